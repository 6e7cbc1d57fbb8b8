"""GRAIL: token weights from each token's saliency for the answer's likelihood (GRAIL, arXiv 2606.04889).

Legend: B rollouts, L sequence positions, H embedding width, V vocabulary, K answer tokens (padded to
the longest answer); M_i the positions of rollout i that are scored (`mask`), n_i = |M_i|.

Score (`grail_scores`), from one forward pass whose only autograd leaf is the input embeddings e:
  J_i = - sum_{k in A_i} log softmax(z_{k-1} / temperature)[x_k]    the answer's negative log-likelihood
  g_t = dJ / de_t,  J = sum_i J_i (rows are independent)             torch.autograd.grad w.r.t. e alone
  s_t = || g_t * e_t ||_2 = sqrt(sum_h (g_th e_th)^2)                 on M_i, 0 elsewhere
The L2 norm of the elementwise product, not the dot product <g_t, e_t> of OAR-G (maths §4): s_t >= 0.
Weights (`grail_weights`), per rollout that is reweighted (`reweighted_rows`), over M_i:
  u_t = log(s_t + 1e-8),  mu = mean_M u,  sigma = sqrt(mean_M (u - mu)^2 + 1e-8)   (population variance)
  w_t = clip(center + spread (u_t - mu) / sigma, w_min, w_max)  on M_i;  w_t = 1 elsewhere
and w = 1 on every row that is not reweighted. The loss takes A_it = A_i w_it (maths §1.2). The
rollout's advantage mass is NOT preserved (GRAIL does not rescale; OAR's gate does, maths §5).
Defaults: spread 0.5, center 1, w_min 0.5, w_max 5, the wrong rollouts (A_i <= 0): the values of
GRAIL's run config and README (its config class leaves spread unset, which it refuses, and w_min 0.1).

Departures from GRAIL's code (declare-lab/grail at 749aa4c, src/train/grail_trainer.py,
`compute_grail_weights`, lines 1254-1543):
  * Alignment: s_t is token t's own embedding's saliency. GRAIL slices the gradient and the
    embeddings with the logits' window [-(T+1), -1), so its score for completion token j is that of
    the token before it (the last prompt token for j = 0).
  * The answer span A_i and the scored positions M_i are the caller's masks. GRAIL re-tokenizes the
    decoded text around the first complete `\\boxed{...}` (marker and braces included), takes its
    statistics over every completion token (the answer span, and the tokens after it, whose gradient is
    exactly 0 and whose u is log 1e-8, included), then sets the answer's content to w_max and the
    marker and the tokens after the answer to center in every row with a box, reweighted or not.
    Here positions outside M_i get 1 and nothing is overwritten.
  * The model's own output head (`probes.logits_at`: its logit scaling and soft-caps) and position
    ids counted over the attention mask (`lm.position_ids`); GRAIL applies `lm_head.weight` by hand
    and passes no position ids. Log-probabilities in float32 (GRAIL: in the logits' dtype).
  * Degenerate rows get weights 1 and are counted (`GrailWeights`): a non-finite score (GRAIL lets
    the NaN reach the loss), and fewer than two scored tokens or all-equal scores (GRAIL: center,
    which is 1 at the default).
  * Only the embeddings as the leaf (GRAIL's `grail_leaf_source` also offers hidden states).
  * Rows without a scored or an answer token are not run and score 0 (GRAIL runs them, then gives
    rows without a box weights 1): pass such rows as not reweighted.
  * When and with which model state is the caller's: GRAIL recomputes the weights in every
    micro-batch of every iteration, with the current parameters, in train mode (dropout off by config).
Fed GRAIL's choices instead (its shift, its span, statistics over the whole completion, its
overwrites), these functions gave GRAIL's own weights to 1.2e-7 on a tiny Llama (GRAIL's methods run
as written beside this repository, not in its tests: its code is not part of oar); without the shift
the weights moved by up to 0.37.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from oar.lm import position_ids
from oar.probes import answer_positions, logits_at


def grail_scores(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor,
    answer_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """GRAIL scores (B, L) float32, >= 0 on `score_mask`, 0 elsewhere. Inputs (B, L), masks bool.

    temperature: the sampling temperature; J reads log softmax(z / temperature), the distribution the
    tokens were drawn from (as GRAIL does). A row whose J is not finite scores NaN on its scored
    positions, so that `grail_weights` counts it and gives it weights 1, never a silent 0."""
    shapes = (input_ids.shape, attention_mask.shape, score_mask.shape, answer_mask.shape)
    assert len(set(shapes)) == 1, shapes
    assert score_mask.dtype == answer_mask.dtype == torch.bool, (score_mask.dtype, answer_mask.dtype)
    assert temperature > 0.0, f"temperature must be > 0, got {temperature}"
    real = attention_mask.bool()
    assert not (score_mask & ~real).any() and not (answer_mask & ~real).any(), (
        "a scored or answer position is padding"
    )
    assert not answer_mask[:, 0].any(), "an answer token in column 0 has no logit that predicts it"
    scores = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    rows = (score_mask.any(1) & answer_mask.any(1)).nonzero().flatten()
    if len(rows) == 0:
        return scores

    # An embedding at or after the last answer token reaches no logit that J reads (causal attention):
    # its gradient is exactly 0, so the columns after it are cut, not computed.
    cols = torch.arange(input_ids.shape[1], device=input_ids.device)
    end = int(torch.where(answer_mask[rows], cols, -1).amax()) + 1
    ids, attn, ans = input_ids[rows, :end], attention_mask[rows, :end], answer_mask[rows, :end]
    pos, valid = answer_positions(ans)  # (b, K): z_{k-1} predicts answer token k
    targets = ids.gather(1, pos + 1)  # (b, K)

    with torch.no_grad():
        e = model.get_input_embeddings()(ids)  # (b, L', H), no graph into the embedding table
    leaf = e.detach().requires_grad_(True)
    with torch.enable_grad():
        logits, _ = logits_at(
            model,
            pos,
            inputs_embeds=leaf,
            attention_mask=attn,
            position_ids=position_ids(attn),
            use_cache=False,
        )  # (b, K, V)
        logp = (
            torch.log_softmax(logits.float() / temperature, dim=-1)
            .gather(-1, targets.unsqueeze(-1))
            .squeeze(-1)
        )
        nll = -torch.where(valid, logp, 0.0).sum(dim=1)  # (b,) J_i; padded answer slots selected away
        # With respect to the leaf alone: no weight-gradient product is formed and no `.grad` is written.
        (grad,) = torch.autograd.grad(nll.sum(), leaf)

    s = (grad.float() * e.float()).norm(dim=-1)  # (b, L')
    s = s.masked_fill(~torch.isfinite(nll.detach())[:, None], float("nan"))
    block = torch.zeros((len(rows), input_ids.shape[1]), dtype=torch.float32, device=input_ids.device)
    block[:, :end] = s
    scores[rows] = torch.where(score_mask[rows], block, 0.0)
    return scores


REWEIGHTED = ("wrong", "correct", "both")


def reweighted_rows(advantages: torch.Tensor, rollouts: str = "wrong") -> torch.Tensor:
    """Which rollouts GRAIL reweights, from the sign of A_i: advantages (B,) -> (B,) bool.

    'wrong': A_i <= 0 (GRAIL's run default; a tied group's A_i = 0 counts, its loss is 0 anyway),
    'correct': A_i > 0, 'both': every rollout (the default of GRAIL's config class)."""
    if rollouts not in REWEIGHTED:
        raise ValueError(f"rollouts must be one of {REWEIGHTED}, got {rollouts!r}")
    assert advantages.dim() == 1, advantages.shape
    if rollouts == "both":
        return torch.ones_like(advantages, dtype=torch.bool)
    return advantages > 0 if rollouts == "correct" else advantages <= 0


class GrailWeights(NamedTuple):
    """The weights, 1 off the reweighted rows' scored positions, and the rows that fell back to 1."""

    weights: torch.Tensor  # (B, L) float32
    nonfinite: int  # reweighted rows with a non-finite log-score (a NaN or inf score): weights 1
    flat: int  # reweighted rows with fewer than two scored tokens or all-equal scores: weights 1


def grail_weights(
    scores: torch.Tensor,
    mask: torch.Tensor,
    reweight: torch.Tensor,
    *,
    spread: float = 0.5,
    center: float = 1.0,
    w_min: float = 0.5,
    w_max: float = 5.0,
    log_eps: float = 1e-8,
    std_eps: float = 1e-8,
) -> GrailWeights:
    """GRAIL's weights from scores (B, L) over `mask` (B, L) bool, on the rows `reweight` (B,) bool.

    spread, center: the target spread and centre of the weights (GRAIL's grail_std, grail_mean);
    log_eps, std_eps: the guards inside the log and the square root (GRAIL's 1e-8 both). Each row is
    its own: no statistic crosses rows, so the weights do not depend on batching or row order."""
    shapes = (scores.shape, mask.shape, reweight.shape)
    assert scores.shape == mask.shape and reweight.shape == scores.shape[:1], shapes
    assert mask.dtype == torch.bool and reweight.dtype == torch.bool, (mask.dtype, reweight.dtype)
    assert spread > 0.0, f"spread must be > 0 (GRAIL refuses a zero grail_std), got {spread}"
    assert w_min <= w_max and log_eps >= 0.0 and std_eps >= 0.0, (w_min, w_max, log_eps, std_eps)
    m = mask & reweight[:, None]
    s = scores.detach().float()
    assert not (s[m] < 0).any(), "GRAIL scores are norms: a negative score is not one"

    u = torch.log(s + log_eps)  # compresses the heavy tail (GRAIL: "attention sink outliers")
    usable = (torch.isfinite(u) | ~m).all(dim=1)  # (B,) a NaN or inf anywhere on M_i: the row keeps 1
    m = m & usable[:, None]
    n = m.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    mu = torch.where(m, u, 0.0).sum(dim=1, keepdim=True) / n
    dev = torch.where(m, u - mu, 0.0)
    var = (dev**2).sum(dim=1, keepdim=True) / n  # population variance, as GRAIL
    # One token, or all equal: exactly 0 variance, nothing to reweight (the where also keeps 0/0 out).
    spread_out = var > 0
    w = (center + spread * dev / torch.sqrt(var + std_eps)).clamp(w_min, w_max)
    weights = torch.where(m & spread_out, w, 1.0)

    scored = reweight & mask.any(dim=1)
    nonfinite = int((scored & ~usable).sum())
    flat = int((scored & usable & ~spread_out.squeeze(1)).sum())
    return GrailWeights(weights, nonfinite, flat)
