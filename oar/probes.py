"""Outcome probes: the model's own final-answer distribution, read off one forward pass (maths §2).

Legend: B rollouts, L sequence positions, K answer tokens (padded to the longest answer), V vocab.
z_p are the logits at position p; they predict token p + 1, so answer token k is read at k - 1.

  last         P = softmax(z_{a0 - 1})                    the distribution of the first answer token
  answer_mean  P = softmax(mean_{k in answer} z_{k - 1})       logits averaged over the span, then softmax
  answer_joint phi = mean_{k in answer} log p(x_k | x_<k)      a scalar: how likely the whole answer is

`outcome` returns log P (B, V) for the two distribution probes and phi (B,) for answer_joint;
`divergence` turns a clean and a perturbed outcome into an importance score: KL(P_clean || P_pert)
for distributions, phi_clean - phi_pert for answer_joint (maths §3, §4). Rows whose answer mask is
empty give a meaningless outcome; the scorers zero their scores.
"""

from __future__ import annotations

import torch

from oar.lm import cache_kwargs, full_cache, position_ids, returned_cache

PROBES = ("last", "answer_mean", "answer_joint")


def check_probe(probe: str) -> None:
    if probe not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, got {probe!r}")


def answer_positions(answer_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the logits that predict each answer token. answer_mask (B, L) bool ->
    (positions (B, K) long, valid (B, K) bool), ascending, K = the longest answer (>= 1). A shorter
    answer's padded slots repeat its last position, so the columns a row needs never depend on its
    batch-mates (a head run from the earliest position reads no column left of any answer)."""
    mask = answer_mask.bool()
    k = max(int(mask.sum(dim=1).max()) if mask.numel() else 0, 1)
    # Stable sort puts each row's answer positions first, in order.
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :k]
    valid = mask.gather(1, order)
    pos = (order - 1).clamp(min=0)
    last = pos.gather(1, (valid.sum(dim=1, keepdim=True) - 1).clamp(min=0))  # (B, 1)
    return torch.where(valid, pos, last), valid


def outcome(answer_logits: torch.Tensor, answer_tokens: torch.Tensor, valid: torch.Tensor, probe: str) -> torch.Tensor:
    """The probe from the logits at answer positions. answer_logits (B, K, V), answer_tokens (B, K)
    (the tokens those logits predict), valid (B, K) -> log P (B, V) float32, or phi (B,) float32."""
    check_probe(probe)
    z = answer_logits.float()
    if probe == "last":
        return torch.log_softmax(z[:, 0], dim=-1)
    count = valid.sum(dim=1).clamp(min=1).to(z.dtype)  # (B,)
    # Padded slots (a shorter answer than the longest) read some other position's logits: they are
    # selected away with `where`, not multiplied by 0, so that a NaN there (e.g. a left-padded column)
    # cannot reach the outcome, while a NaN at a real answer position does.
    if probe == "answer_mean":
        mean_z = torch.where(valid.unsqueeze(-1), z, 0.0).sum(dim=1) / count.unsqueeze(-1)
        return torch.log_softmax(mean_z, dim=-1)
    token_logp = z.gather(-1, answer_tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return torch.where(valid, token_logp, 0.0).sum(dim=1) / count


def clean_forward(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, logits_to_keep: int = 0, keep_cache: bool = False
):
    """One forward (the update's, with its graph) that can also hand OAR its clean pass. (B, L) inputs
    -> (logits (B, L', V), kv): kv is each layer's (keys, values), detached, (B, heads, L, head_dim),
    when `keep_cache` and the model kept a cache (checkpointed layers drop it in training mode), else
    None. OAR-G reads its noise-free prefix from kv and OAR-P its clean keys/values, instead of
    running the clean sequence again; the logits give the clean probe (`outcome_from_logits`)."""
    # A cache of every position (lm.full_cache): a sliding-window model's own cache keeps only its window.
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        **cache_kwargs(full_cache() if keep_cache else None),
        use_cache=keep_cache,
        logits_to_keep=logits_to_keep,
    )
    cache = returned_cache(out) if keep_cache else None
    kv = [(layer.keys.detach(), layer.values.detach()) for layer in cache.layers] if cache is not None else None
    return out.logits, kv


MIN_ROWS = 32  # BLAS kernels round differently for a handful of rows than for many


def min_rows(n: int, positions: int) -> int:
    """How many rows (n or more, the extra ones duplicates) to run through a forward over
    `positions` positions each, so that its matmuls see at least MIN_ROWS rows: then a rollout's
    numbers are the same whatever batch it is scored in (micro-batching stays exact)."""
    return max(n, -(-MIN_ROWS // max(positions, 1)))


def logits_at(model, at: torch.Tensor, **inputs):
    """The model's own logits (its output head with whatever logit scaling or soft-cap its forward
    applies: Granite's logits_scaling, Cohere's logit_scale, Gemma 2/3's final soft-cap...) at columns
    `at` (B, K) of one forward over `inputs` (the keyword arguments of `model(...)`, whose columns
    are those of input_ids or inputs_embeds) -> (logits (B, K, V), the model's output).

    Exact by construction: no hand-built head. Only the last columns, from the first one asked for,
    go through the head (`logits_to_keep`), and at least MIN_ROWS rows of them when the forward has
    that many: BLAS libraries use other kernels, with other rounding, for a few rows, and a rollout's
    numbers must not depend on how many share its batch."""
    ref = inputs.get("input_ids")
    width = (ref if ref is not None else inputs["inputs_embeds"]).shape[1]
    assert at.dim() == 2 and at.shape[0] == (ref if ref is not None else inputs["inputs_embeds"]).shape[0], at.shape
    keep = max(width - int(at.min()), min(width, -(-MIN_ROWS // at.shape[0])))
    out = model(**inputs, logits_to_keep=keep)
    rows = torch.arange(at.shape[0], device=at.device).unsqueeze(1)
    return out.logits[rows, at - (width - keep)], out


def outcome_from_logits(
    logits: torch.Tensor, input_ids: torch.Tensor, answer_mask: torch.Tensor, probe: str
) -> torch.Tensor:
    """`outcome` for full-sequence logits (B, L, V), input_ids (B, L), answer_mask (B, L)."""
    pos, valid = answer_positions(answer_mask)
    rows = torch.arange(logits.shape[0], device=logits.device).unsqueeze(1)
    return outcome(logits[rows, pos], input_ids.gather(1, (pos + 1).clamp(max=input_ids.shape[1] - 1)), valid, probe)


def divergence(clean: torch.Tensor, perturbed: torch.Tensor, probe: str) -> torch.Tensor:
    """Importance of a perturbation: KL(P_clean || P_pert) = sum_v P_clean (log P_clean - log P_pert)
    for distribution probes ((..., V) log-probs -> (...)), phi_clean - phi_pert for answer_joint.

    A NaN (or +inf) anywhere in either outcome makes the score NaN: a broken forward must be counted
    (oar/frac_nonfinite_scores) and give its rollout GRPO's weights, never a finite 0 that the gate
    would read as "this token does not matter". -inf log-probs are legitimate (a ruled-out token)."""
    check_probe(probe)
    if probe == "answer_joint":
        return clean - perturbed  # NaN and inf propagate
    p = clean.exp()
    # 0 log 0 = 0: a token the clean model rules out (logit -inf) contributes nothing.
    kl = torch.where(p > 0, p * (clean - perturbed), torch.zeros_like(p)).sum(dim=-1)
    broken = (clean.isnan() | perturbed.isnan() | clean.isposinf() | perturbed.isposinf()).any(dim=-1)
    return torch.where(broken, torch.full_like(kl, float("nan")), kl)
