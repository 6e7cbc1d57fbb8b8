"""The scores measure.py needs that oar does not compute: the masking curve J_t(alpha), OAR-G's gradient projected on
the masking direction, and the uncertainty controls, each on one rollout (research/proxy-ceiling/README.md).

Legend: L the row's positions (one rollout, no padding: a row is cut to its own tokens), H the embedding width,
V the vocabulary, K the answer tokens, A the alphas of one call.

  J_t(alpha)  each reasoning token's embedding alone moved a fraction alpha of the way to the pad token's,
              e_t(alpha) = (1 - alpha) e_t + alpha e_pad, every other embedding clean, and the probe's divergence
              from the clean outcome computed exactly: J_t(alpha) = D(outcome(e), outcome(e with e_t(alpha))).
              At alpha = 1 the row holds the pad token's embedding at t, which is exact OAR-P's masked copy (maths
              §3.1): J_t(1) = s_t of `oar.oar_perturb.perturbation_scores`. For the KL probes J_t(alpha) =
              alpha^2 / 2 d_t^T F_t d_t + O(alpha^3) (d_t = e_pad - e_t, F_t the Fisher block of token t): small
              alpha ranks tokens by the second-order term of each token's OWN effect, with no cross terms, which
              any gradient- or Fisher-based local proxy estimates at best; for answer_joint its first-order term
              alpha <grad phi, d_t>. The divergence is taken in float64 from the float32 logits, because at
              alpha = 0.01 the KL (about 1e-6) is near float32's rounding of a sum over the vocabulary. A copy
              recomputes positions t .. end - 1 on the clean keys/values of positions < t (as exact OAR-P does), the
              A alphas of one token in one batch, and all three probes are read from the same answer logits.
  mask-grad   OAR-G's pass (maths §4: the gradient g of J at the noised embeddings), scored along the direction
              masking would move the token, s_t = |<g_t, e_pad - e_t>|, instead of |<g_t, e_t>|: the first-order
              Taylor term of D along OAR-P's own perturbation. For answer_joint at sigma = 0 it is exactly
              J_t(alpha)'s first-order term / alpha; for the KL probes the gradient at the clean point is 0 and the
              noise's curvature term H delta is what is projected. One forward and one backward, as OAR-G.
  controls    surprisal -log p(x_t) and entropy H(p(. | x_<t)) of the sampling distribution (logits / temperature)
              from the clean forward: in training the update forward's logits give them for free.
"""

from __future__ import annotations

import torch

from oar.lm import cache_kwargs, full_cache, position_ids
from oar.probes import PROBES, answer_positions, divergence, logits_at, outcome


def outcome64(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, probe: str) -> torch.Tensor:
    """`oar.probes.outcome` in float64: logits (B, K, V), targets (B, K), valid (B, K) -> log P (B, V) or phi (B,)."""
    z = logits.double()
    if probe == "last":
        return torch.log_softmax(z[:, 0], dim=-1)
    count = valid.sum(dim=1).clamp(min=1).to(z.dtype)
    if probe == "answer_mean":
        return torch.log_softmax(torch.where(valid.unsqueeze(-1), z, 0.0).sum(dim=1) / count.unsqueeze(-1), dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return torch.where(valid, logp, 0.0).sum(dim=1) / count


def clean_pass(model, ids: torch.Tensor):
    """One forward over a row (1, L) with every position's keys/values kept: (logits (1, L, V), kv per layer)."""
    from oar.lm import returned_cache

    attn = torch.ones_like(ids)
    out = model(
        input_ids=ids,
        attention_mask=attn,
        position_ids=position_ids(attn),
        **cache_kwargs(full_cache()),
        use_cache=True,
    )
    kv = [(layer.keys.detach(), layer.values.detach()) for layer in returned_cache(out).layers]
    return out.logits.detach(), kv


@torch.no_grad()
def masking_curve(
    model, ids: torch.Tensor, reasoning: torch.Tensor, answer: torch.Tensor, *, pad_token_id: int, alphas, kv
) -> dict[str, torch.Tensor]:
    """{probe: J (A, L) float64}: J_t(alpha) for every alpha (rows) at the reasoning positions t of the row (1, L);
    0 elsewhere. kv: the clean keys/values of the row (`clean_pass`)."""
    assert ids.shape[0] == 1 and ids.shape == reasoning.shape == answer.shape
    alphas = torch.tensor(list(alphas), dtype=torch.float32)
    n_a, width = len(alphas), ids.shape[1]
    cols = answer[0].nonzero().flatten()
    a0, end = int(cols[0]), int(cols[-1])  # inputs a0 - 1 .. end - 1 predict the answer tokens
    pos, valid = answer_positions(answer)  # (1, K)
    targets = ids.gather(1, pos + 1)
    emb = model.get_input_embeddings()
    e = emb(ids)  # (1, L, H)
    e_pad = emb(torch.tensor([pad_token_id]))[0]  # (H,)
    clean_logits = logits_at_rows(model, ids, pos)
    clean = {p: outcome64(clean_logits, targets, valid, p) for p in PROBES}
    out = {p: torch.zeros(n_a, width, dtype=torch.float64) for p in PROBES}
    for t in reasoning[0].nonzero().flatten().tolist():
        if t >= end:  # a token at or after the last answer token cannot move it (maths §3.1)
            continue
        start = min(t, a0 - 1)
        x = e[:, start:end].expand(n_a, -1, -1).clone()  # (A, end - start, H)
        x[:, t - start] = (1 - alphas)[:, None] * e[0, t] + alphas[:, None] * e_pad
        prefix = [(k[:, :, :start].expand(n_a, -1, -1, -1), v[:, :, :start].expand(n_a, -1, -1, -1)) for k, v in kv]
        attn = torch.ones(n_a, end, dtype=torch.long)
        logits, _ = logits_at(
            model,
            (pos - start).expand(n_a, -1),
            inputs_embeds=x,
            attention_mask=attn,
            position_ids=position_ids(attn)[:, start:],
            **cache_kwargs(full_cache(prefix)),
            use_cache=True,
        )
        for p in PROBES:
            out[p][:, t] = divergence(
                clean[p].expand(n_a, *clean[p].shape[1:]), outcome64(logits, targets.expand(n_a, -1), valid, p), p
            )
    return out


def logits_at_rows(model, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The model's logits (1, K, V) at positions pos (1, K) of one clean forward over the row."""
    attn = torch.ones_like(ids)
    logits, _ = logits_at(model, pos, input_ids=ids, attention_mask=attn, position_ids=position_ids(attn))
    return logits


def mask_grad_scores(
    model,
    ids: torch.Tensor,
    reasoning: torch.Tensor,
    answer: torch.Tensor,
    *,
    probe: str,
    noise: torch.Tensor,
    pad_token_id: int,
    clean: torch.Tensor,
    kv,
    along: str = "mask",
) -> torch.Tensor:
    """|<g_t, e_pad - e_t>| (along 'mask'; |<g_t, e_t>| along 'input') (R, L) float32 on the reasoning positions
    before the last answer token, 0 elsewhere, for R noise draws at once: g the gradient of OAR-G's objective (maths
    §4, steps 1-4) at the embeddings noised by `noise` (R, L, H), already scaled (sigma delta), on those positions.
    Along 'input' this is `oar.oar_grad.gradient_scores` of the same noise. As there, `clean` is the clean outcome
    (`oar.probes.outcome` of the row) and the columns before the first noised or answer-predicting one come from the
    clean keys/values `kv` of the row (1, L) (`clean_pass`)."""
    assert ids.shape[0] == 1 and ids.shape == reasoning.shape == answer.shape and noise.shape[1] == ids.shape[1]
    n_r = noise.shape[0]
    cols = torch.arange(ids.shape[1])
    a_cols = answer[0].nonzero().flatten()
    a0, end = int(a_cols[0]), int(a_cols[-1])
    noisy = reasoning[0] & (cols < end)  # (L,)
    first = min(int(noisy.nonzero().min()), a0 - 1)
    pos, valid = answer_positions(answer)  # (1, K)
    targets = ids.gather(1, pos + 1)
    emb = model.get_input_embeddings()
    with torch.no_grad():
        e = emb(ids[:, : end + 1])  # (1, end + 1, H)
        e_pad = emb(torch.tensor([pad_token_id]))[0]
    x = (e[:, first:].float() + noise[:, first : end + 1].float() * noisy[first : end + 1, None]).to(e.dtype)
    leaf = x.requires_grad_(True)  # (R, end + 1 - first, H)
    attn = torch.ones(n_r, end + 1, dtype=torch.long)
    prefix = [(k[:, :, :first].expand(n_r, -1, -1, -1), v[:, :, :first].expand(n_r, -1, -1, -1)) for k, v in kv]
    with torch.enable_grad():
        logits, _ = logits_at(
            model,
            (pos - first).expand(n_r, -1),
            inputs_embeds=leaf,
            attention_mask=attn,
            position_ids=position_ids(attn)[:, first:],
            **cache_kwargs(full_cache(prefix)),
            use_cache=True,
        )
        objective = divergence(
            clean.detach().expand(n_r, *clean.shape[1:]), outcome(logits, targets.expand(n_r, -1), valid, probe), probe
        )
        (g,) = torch.autograd.grad(objective.sum(), leaf)
    direction = {"mask": e_pad - e[:, first:], "input": e[:, first:]}[along]  # (1, end + 1 - first, H)
    s = torch.zeros(n_r, ids.shape[1], dtype=torch.float32)
    s[:, first : end + 1] = (g.float() * direction.float()).sum(-1).abs() * noisy[first : end + 1]
    return s


def uncertainty(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(surprisal, entropy), each (1, L) float32, of token t under the sampling distribution softmax(z_{t-1} / T) from
    the clean logits (1, L, V); position 0 (nothing predicts it) gets 0."""
    logp = torch.log_softmax(logits[0, :-1].float() / (temperature or 1.0), dim=-1)  # (L - 1, V): row t - 1 -> token t
    surprisal = torch.zeros(ids.shape)
    entropy = torch.zeros(ids.shape)
    surprisal[0, 1:] = -logp.gather(-1, ids[0, 1:, None])[:, 0]
    entropy[0, 1:] = -(logp.exp() * logp.clamp(min=torch.finfo(torch.float32).min)).sum(-1)
    return surprisal, entropy
