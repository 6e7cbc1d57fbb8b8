"""Entropy as token credit: the forking-tokens mask (arXiv 2506.01939, TRL's `top_entropy_quantile`).

Legend: B rollouts, L positions (any length axis), N valid tokens of the whole step.

  tau_H = quantile_{1 - lambda}({H_t : t valid, over every rollout of the step on every process})
  w_it  = 1 if H_it >= tau_H and t is valid, else 0

H_it is the entropy of the distribution token t was sampled from (the update forward's, at the
sampling temperature); the quantile interpolates linearly, as torch.quantile (TRL's) does. Only the
~lambda share of "forking" tokens carries the advantage. As in TRL and the paper, the loss keeps its
normalizer (all valid tokens), so the advantage mass is not preserved: it is the masked tokens' share
of GRPO's, about lambda (maths §8.1). Weights are 0 or 1, never negative.

"Batch" here is the WHOLE STEP: every rollout of the optimizer step on every process, gathered before
the micro-batch loop (credit.step_credit). TRL takes the quantile over one micro-batch's tokens
(gathered across processes), so there its mask changes with the micro-batch size; here it does not.

The other entropy method, `entropy` (the paper's comparator as we read it: entropy as the importance
score through OAR's bi-level gate, mass preserved), is the gate of the update forward's entropies,
per rollout over its reasoning tokens (`entropy_gate`).

The two methods' parts in oar/credit.py's protocol, which compute the entropies with a forward of
the policy, are `credit_methods.entropy_gate` and `credit_methods.entropy_mask_prepare`.
"""

from __future__ import annotations

from typing import Callable

import torch


def top_entropy_mask(
    entropies: torch.Tensor,
    valid: torch.Tensor,
    *,
    top: float = 0.2,
    gather: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
) -> torch.Tensor:
    """The forking tokens: entropies (B, L) float, valid (B, L) bool -> (B, L) bool, True where a valid
    token's entropy is at least the (1 - top)-quantile of the valid entropies of every process
    (`gather` concatenates a 1-D tensor over processes; identity on one). No valid token anywhere:
    nothing is masked in (all False)."""
    assert entropies.shape == valid.shape, (entropies.shape, valid.shape)
    assert 0.0 < top <= 1.0, f"top must lie in (0, 1], got {top}"
    values = gather(entropies[valid.bool()].float())  # (N,)
    if values.numel() == 0:
        return torch.zeros_like(valid, dtype=torch.bool)
    tau = linear_quantile(values, 1.0 - top)
    return valid.bool() & (entropies >= tau)


def linear_quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile(values, q) (linear interpolation) without its 16M-element limit. values (N,), N >= 1."""
    ordered = values.double().sort().values
    pos = q * (ordered.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, ordered.numel() - 1)
    return (ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)).to(values.dtype)
