"""GRPO: group-relative advantages, the clipped policy loss, and lean per-token log-probs.

Legend: B rollouts (P prompts x G rollouts, a prompt's G rollouts contiguous), T completion length,
V vocabulary. Masks are bool (B, T).

maths §1, with the conventions TRL and verl share so results compare:
  A_i      = (r_i - mean_g r) / (std_g r + 1e-4)              std unbiased (ddof = 1)
  rho_it   = exp(logpi_theta - logpi_old)
  l_it     = -min(rho A_it, clip(rho, 1 - eps_low, 1 + eps_high) A_it) + beta_KL k3_it
  k3_it    = exp(ref - logpi) - (ref - logpi) - 1
Advantages enter the loss per token, shape (B, T): GRPO broadcasts A_i over the completion, OAR
multiplies by its weights. There is one loss; OAR with unit weights *is* GRPO.

Off-policy correction (`truncated_is_weights`, applied when a separate engine samples, docs/vllm.md):
  omega_it = min(pi_old(x_it) / pi_sample(x_it), C)             detached
  l_it     = -omega_it min(rho A_it, clip(rho, 1 - eps_low, 1 + eps_high) A_it) + beta_KL k3_it
pi_old is the trainer's own log-prob at sampling time, pi_sample the engine's. Without weights the
loss is the one above, the same floats.

Deviations: a group whose rewards are all equal gets advantages of exactly 0 (not the ~1e-17 that
float rounding of `r - mean` can leave), so tied groups never move the policy.
"""

from __future__ import annotations

import math

import torch

ADVANTAGE_EPS = 1e-4


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale: str = "group",
    batch_rewards: torch.Tensor | None = None,
    scorable: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group-relative advantages A_i (maths §1.1). `rewards` (B,) -> (B,).

    scale="group": divide by each group's unbiased std + 1e-4 (GRPO, the default);
    scale="batch": divide by the unbiased std of the whole step's rewards + 1e-4 (group mean, batch std:
                   TRL's scale_rewards="batch"): `batch_rewards`, every process's (train.py gathers
                   them), else `rewards`;
    scale="none":  centre only (Dr. GRPO). Rollouts of one prompt are contiguous: rewards.view(P, G).

    `scorable` (B,) bool: the rollouts a reward could score (None: all). One that is not (a TRL-style reward's
    None from every term) gets A_i = 0 and has no part in its group's mean and std, nor in the batch std
    (`batch_rewards` are then the scorable ones'); a group with fewer than 2 scorable rollouts has A = 0.
    """
    assert rewards.dim() == 1 and rewards.numel() % group_size == 0, (rewards.shape, group_size)
    assert group_size >= 2, "a group needs at least 2 rollouts to have a baseline"
    if scorable is not None and not bool(scorable.all()):
        return _scorable_advantages(rewards, group_size, scale, batch_rewards, scorable)
    r = rewards.float().view(-1, group_size)  # (P, G)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        adv = centred / (r.std(dim=1, keepdim=True) + ADVANTAGE_EPS)
    elif scale == "batch":
        adv = centred / ((r if batch_rewards is None else batch_rewards.float()).std() + ADVANTAGE_EPS)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    tied = (r == r[:, :1]).all(dim=1, keepdim=True)  # every reward equal to the first
    return adv.masked_fill(tied, 0.0).view(-1)


def _scorable_advantages(rewards, group_size: int, scale: str, batch_rewards, scorable) -> torch.Tensor:
    """group_advantages over each group's scorable rollouts only (n_g of them): mean and unbiased std over those,
    0 for the others. E.g. rewards (1, 0, x, 0) with the third not scorable, scale group: mean 1/3, std
    sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = 0.5774, A = (1.1545, -0.5773, 0, -0.5773) (the 1e-4 in the divisor)."""
    m = scorable.view(-1, group_size)  # (P, G) bool
    r = torch.where(m, rewards.float().view(-1, group_size), 0.0)
    n = m.sum(dim=1, keepdim=True)  # (P, 1) scorable rollouts of each group
    mean = r.sum(dim=1, keepdim=True) / n.clamp(min=1)
    centred = torch.where(m, r - mean, 0.0)
    if scale == "group":
        std = (centred.square().sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        adv = centred / (std + ADVANTAGE_EPS)
    elif scale == "batch":
        pool = rewards.float()[scorable] if batch_rewards is None else batch_rewards.float()
        adv = centred / ((pool.std() if pool.numel() > 1 else pool.new_zeros(())) + ADVANTAGE_EPS)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    first = r.gather(1, m.float().argmax(dim=1, keepdim=True))  # each group's first scorable reward
    tied = (n < 2) | ((r == first) | ~m).all(dim=1, keepdim=True)  # no two scorable rewards differ
    return torch.where(m & ~tied, adv, 0.0).view(-1)


CHUNK_ELEMENTS = 2**24  # logits handled at once by the chunked helpers: 64 MB of float32


def _chunks(shape: torch.Size, chunk_rows: int):
    """Index pairs (row slice, position slice) covering (B, T, V) logits, each at most `chunk_rows`
    rows and CHUNK_ELEMENTS values: the temporaries stay small whatever B, T and V are."""
    b, t, v = shape
    rows = max(1, min(chunk_rows, CHUNK_ELEMENTS // max(1, t * v)))
    cols = max(1, t if rows > 1 else min(t, CHUNK_ELEMENTS // max(1, v)))  # >= 1: an empty T has no chunk
    for i in range(0, b, rows):
        for j in range(0, t, cols):
            yield slice(i, i + rows), slice(j, j + cols)


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int = 4, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature)[labels] for every position. logits (B, T, V), labels (B, T) -> (B, T) float32.

    `temperature` is the sampler's: the loss then scores the distribution the rollouts came from
    (as TRL and verl do), without a divided copy of the logits.

    Computed as logit[label] - logsumexp(logits), in chunks of at most `chunk_rows` rows and
    CHUNK_ELEMENTS logits, in float32 whatever the logits' dtype (bfloat16 logits lose no more than
    their own rounding). No (B, T, V) tensor besides the caller's logits exists in the forward, and
    the backward saves only the logits (already alive) and the (B, T) logsumexp: it recomputes each
    chunk's softmax and writes the gradient, softmax(z) * -g plus g at the label, straight into the
    one (B, T, V) gradient. (Plain autograd would keep a float32 copy of bfloat16 logits for the
    backward: twice their size.)
    """
    assert logits.shape[:-1] == labels.shape, (logits.shape, labels.shape)
    assert temperature > 0, temperature
    return _TokenLogprobs.apply(logits, labels, chunk_rows, float(temperature))


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, chunk_rows, temperature):
        lse = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)  # (B, T)
        picked = torch.empty_like(lse)
        for r, c in _chunks(logits.shape, chunk_rows):
            z = logits[r, c].float() / temperature
            lse[r, c] = torch.logsumexp(z, dim=-1)
            picked[r, c] = z.gather(-1, labels[r, c].unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk_rows, ctx.temperature = chunk_rows, temperature
        return picked - lse

    @staticmethod
    def backward(ctx, grad_out):
        logits, labels, lse = ctx.saved_tensors
        t = ctx.temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for r, c in _chunks(logits.shape, ctx.chunk_rows):
            g = grad_out[r, c].float().unsqueeze(-1) / t  # (b, t, 1); the chain rule's 1/T for z = logits / T
            chunk = torch.exp(logits[r, c].float() / t - lse[r, c].unsqueeze(-1)).mul_(-g)  # d/dz of -lse
            chunk.scatter_add_(-1, labels[r, c].unsqueeze(-1), g)  # d/dz of z[label]
            grad[r, c] = chunk
        return grad, None, None, None


@torch.no_grad()
def token_entropy(logits: torch.Tensor, chunk_rows: int = 4) -> torch.Tensor:
    """Entropy of each position's next-token distribution: logits (B, T, V) -> (B, T) float32,
    in the chunks token_logprobs uses."""
    out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    for r, c in _chunks(logits.shape, chunk_rows):
        logp = torch.log_softmax(logits[r, c].float(), dim=-1)
        out[r, c] = -(logp.exp() * logp.clamp(min=torch.finfo(torch.float32).min)).sum(
            -1
        )  # 0 log 0 = 0 (a -inf logit)
    return out


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    aggregation: str = "seq_mean",
    num_sequences: float | None = None,
    num_tokens: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate loss with token-level advantages (maths §1.3, §1.4). All inputs (B, T).

    The normalizer is named, so the loss is exact under accumulation and across processes:
      seq_mean:   sum_i [sum_t l_it m_it / sum_t m_it] / num_sequences
                  (num_sequences: rows with >= 1 valid token, of the whole global batch if given)
      token_mean: sum_it l_it m_it / num_tokens   (num_tokens: valid tokens of the global batch)
    With the defaults (None) the normalizer is this batch's own count. Rows with no valid token
    contribute 0 and are not counted, so padding rows never change the loss.

    `is_weights` (B, T), optional: per-token importance weights w_it (`truncated_is_weights`) that
    multiply the clipped surrogate term, l_it = -w_it min(...) + beta_KL k3_it, as TRL applies its
    vLLM correction (the KL penalty is not reweighted). None leaves the loss exactly as without.

    Returns (loss, stats) where stats are detached floats over valid tokens: clip_frac (tokens
    whose clipped term was the active one), approx_kl (k3 of old vs new), ratio_mean, kl_ref
    when a reference is given, and is_weight_mean when importance weights are.
    """
    assert logprobs.shape == old_logprobs.shape == advantages.shape == completion_mask.shape, (
        logprobs.shape,
        old_logprobs.shape,
        advantages.shape,
        completion_mask.shape,
    )
    valid = completion_mask.bool()
    mask = valid.to(logprobs.dtype)
    # Padding may hold anything (even inf): select, never multiply, so it cannot leak a NaN.
    log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        assert is_weights.shape == per_token.shape, (is_weights.shape, per_token.shape)
        per_token = per_token * is_weights.detach()
    if kl_beta != 0.0:
        assert ref_logprobs is not None, "kl_beta > 0 needs ref_logprobs"
        per_token = per_token + kl_beta * _k3(torch.where(valid, ref_logprobs - logprobs, 0.0))

    per_token = torch.where(valid, per_token, 0.0)
    lengths = mask.sum(dim=1)
    if aggregation == "seq_mean":
        per_seq = (per_token * mask).sum(dim=1) / lengths.clamp(min=1.0)
        denom = num_sequences if num_sequences is not None else (lengths > 0).sum().clamp(min=1)
        loss = per_seq.sum() / denom
    elif aggregation == "token_mean":
        denom = num_tokens if num_tokens is not None else lengths.sum().clamp(min=1.0)
        loss = (per_token * mask).sum() / denom
    else:
        raise ValueError(f"aggregation must be 'seq_mean' or 'token_mean', got {aggregation!r}")

    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        stats = {
            "clip_frac": float(((clipped < unclipped).to(mask.dtype) * mask).sum() / n),
            "approx_kl": float((_k3(-log_ratio) * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
        }
        if ref_logprobs is not None:
            stats["kl_ref"] = float((_k3(torch.where(valid, ref_logprobs - logprobs, 0.0))).sum() / n)
        if is_weights is not None:
            stats["is_weight_mean"] = float((is_weights * mask).sum() / n)
    return loss, stats


def truncated_is_weights(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, completion_mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025; TRL's vllm_importance_sampling_correction), all (B, T):
    omega_it = min(exp(logpi_trainer - logpi_sampler), cap) on valid tokens, 1 elsewhere, detached (maths §1.3).

    Why: a separate engine's numerics make its log-probs differ from the trainer's for the same
    weights, so its rollouts are slightly off-policy; the weight reweights each token towards the
    trainer's distribution, and the cap bounds the variance a rare large ratio would add. Computed
    as exp(min(log ratio, log cap)): no overflow, and padding (whose log-probs may hold anything)
    never leaks an inf into the product."""
    assert trainer_logprobs.shape == sampler_logprobs.shape == completion_mask.shape, (
        trainer_logprobs.shape,
        sampler_logprobs.shape,
        completion_mask.shape,
    )
    assert cap > 0, cap
    log_ratio = (trainer_logprobs.detach() - sampler_logprobs.detach()).float().clamp(max=math.log(cap))
    return torch.where(completion_mask.bool(), torch.exp(log_ratio), 1.0)


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(p || q): exp(x) - x - 1 with x = log(q / p), >= 0; unbiased for tokens
    drawn from p: the KL reference term's (p = pi_theta, q = pi_ref, while pi_theta samples, mu = 1). For
    loss/approx_kl (x = log pi_old / pi_theta, tokens from pi_old) it is a diagnostic, not unbiased."""
    return torch.exp(log_ratio) - log_ratio - 1.0
