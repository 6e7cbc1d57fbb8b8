"""Bi-level gating: token importance scores -> token weights w_it, rollout mass preserved (maths §5).

Legend: B rollouts, L positions (any length axis: the full sequence or the completion only).

Per rollout, over its reasoning positions R (n_R = |R|) only:
  1. u_t = log(1 + |s_t|)                 compresses heavy-tailed scores
  2. n_t = (u_t - min u) / (max u - min u) in [0, 1]; max u == min u -> all weights 1
  3. tau = quantile_q({n_t})              linear interpolation, q = `quantile`
  4. w_t = max(n_t / tau, floor)          if n_t <  tau   (suppress low-impact tokens)
     w_t = 1 + boost (n_t - tau)/(1 - tau) if n_t >= tau   (boost pivotal ones)
  5. w_t <- w_t n_R / sum_R w             (preserve_mass): sum_R w = n_R, so the rollout's total
                                          advantage mass sum_t A_i w_it is GRPO's A_i T_i
Positions outside R get weight 1 (the answer span, the marker, EOS); oar.credit.step_credit zeroes padding's.
Weights are >= 0, so A_it has the sign of A_i.

Choices where the paper is silent: the score's sign is dropped in step 1 (an answer_joint OAR-P
score can be negative: masking a token may make the answer *more* likely, which is as much
influence as making it less likely); the divisions in step 4 are guarded (tau = 0 sends every token
to the boost branch since n_t >= 0; tau = 1 makes (n_t - tau)/(1 - tau) = 0) without moving a token
between branches; a row with any non-finite reasoning score gets all-ones weights (plain GRPO), and
the caller counts such rows. `floor = 1` gives boost-only gating, `boost = 0` suppress-only, before
step 5: the mass rescale then moves every weight by one factor (a suppressed token can end below the floor).

The gate with a run's settings (`credit_methods.gate`) and its control, BEYOND THE PAPER, uniform
random scores through it (`credit_methods.random_gate`), are the credit layer's (oar/credit.py).
"""

from __future__ import annotations

import torch


def bilevel_weights(
    scores: torch.Tensor,
    reasoning_mask: torch.Tensor,
    *,
    quantile: float = 0.4,
    boost: float = 2.0,
    floor: float = 0.1,
    preserve_mass: bool = True,
) -> torch.Tensor:
    """Token weights from importance scores. scores (B, L) float, reasoning_mask (B, L) bool -> (B, L) float32."""
    assert scores.shape == reasoning_mask.shape, (scores.shape, reasoning_mask.shape)
    assert 0.0 < quantile < 1.0, f"quantile must lie in (0, 1), got {quantile}"
    assert boost >= 0.0 and floor >= 0.0, (boost, floor)
    mask = reasoning_mask.bool()
    s = scores.detach().float()
    usable = (torch.isfinite(s) | ~mask).all(dim=1, keepdim=True)  # (B, 1)
    mask = mask & usable

    u = torch.log1p(s.abs()).masked_fill(~mask, 0.0)
    u_min = u.masked_fill(~mask, float("inf")).amin(dim=1, keepdim=True)
    u_max = u.masked_fill(~mask, float("-inf")).amax(dim=1, keepdim=True)
    spread = u_max - u_min  # (B, 1); -inf for rows without reasoning tokens
    reshape = spread > 0  # rows with something to reshape
    n = ((u - u_min) / spread.where(reshape, torch.ones_like(spread))).clamp(0.0, 1.0)

    tau = _masked_quantile(n, mask, quantile)  # (B, 1)
    suppressed = n < tau
    w_low = (n / tau.clamp(min=torch.finfo(n.dtype).tiny)).clamp(min=floor)
    w_high = 1.0 + boost * (n - tau) / (1.0 - tau).clamp(min=torch.finfo(n.dtype).eps)
    w = torch.where(suppressed, w_low, w_high)

    active = mask & reshape
    if preserve_mass:
        n_r = active.sum(dim=1, keepdim=True).float()
        total = (w * active).sum(dim=1, keepdim=True)
        w = w * n_r / total.clamp(min=torch.finfo(w.dtype).tiny)
    return torch.where(active, w, torch.ones_like(w))


def _masked_quantile(values: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """Per-row q-quantile of values[mask] with linear interpolation (numpy's default). -> (B, 1).

    Rows with no masked value return 0 (their weights are all ones anyway).
    """
    count = mask.sum(dim=1, keepdim=True)  # (B, 1)
    ordered = values.masked_fill(~mask, float("inf")).sort(dim=1).values
    pos = q * (count - 1).clamp(min=0).to(values.dtype)
    lo = pos.floor().long()
    hi = (lo + 1).clamp(max=(count - 1).clamp(min=0))
    v_lo = ordered.gather(1, lo)
    v_hi = ordered.gather(1, hi)
    tau = v_lo + (v_hi - v_lo) * (pos - lo.to(values.dtype))
    return torch.where(count > 0, tau, torch.zeros_like(tau))


def weight_stats(
    weights: torch.Tensor, reasoning_mask: torch.Tensor, *, all_sum=None, all_max=None
) -> dict[str, float]:
    """maths §6 diagnostics over reasoning tokens: mean/max weight, boosted/suppressed fractions and
    the ESS ratio (sum w)^2 / (n_R sum w^2), averaged over rollouts that have reasoning tokens.

    all_sum, all_max: optional functions that sum / take the maximum of a 1-D tensor over processes,
    so that N processes report the statistics of the whole step, not a mean of per-process ones (a
    process whose rollouts were all unscored has no tokens to describe). With no token anywhere the
    statistics are those of GRPO's weights: mean and max 1, nothing boosted or suppressed, ESS 1."""
    mask = reasoning_mask.bool()
    w = weights.float() * mask
    n_r = mask.sum(dim=1).float()
    rows = n_r > 0
    ess = w.sum(1) ** 2 / (n_r * (w**2).sum(1)).clamp(min=1e-12)
    sums = torch.stack(
        [
            w.sum(),
            ((weights > 1.0) & mask).sum().float(),
            ((weights < 1.0) & mask).sum().float(),
            n_r.sum(),
            ess[rows].sum(),
            rows.sum().float(),
        ]
    )
    most = w.masked_fill(~mask, float("-inf")).max().view(1) if w.numel() else torch.full((1,), float("-inf"))
    if all_sum is not None:
        sums, most = all_sum(sums), all_max(most)
    w_sum, boosted, suppressed, n, ess_sum, n_rows = sums.tolist()
    if n == 0:
        return {"weight_mean": 1.0, "weight_max": 1.0, "frac_boosted": 0.0, "frac_suppressed": 0.0, "ess_ratio": 1.0}
    return {
        "weight_mean": w_sum / n,
        "weight_max": float(most.max()),
        "frac_boosted": boosted / n,
        "frac_suppressed": suppressed / n,
        "ess_ratio": ess_sum / n_rows,
    }
