"""The inverted-score control of the signal-or-gate study: OAR-G's scores, inverted, through the same gate.

    train.py --credit_module research/signal-or-gate/inverted.py --method oar-g-inverted ...

Legend: b rollouts of a micro-batch, L positions.

OAR-G (oar/credit_methods.py, docs/maths.md) scores each reasoning token, s_t = |<g_t, e_t>|, and the bi-level gate
(oar/gating.py, docs/maths.md) turns the scores of rollout i into weights through u_t = log(1 + |s_t|) and
n_t = (u_t - min u) / (max u - min u). Negating s literally would change nothing: the gate takes |s|
first. What the control must do is hand the gate the opposite ranking with the same spread, so this
method inverts the scores in the gate's own log space, per rollout over its reasoning tokens:

    u'_t = max u + min u - u_t,   s'_t = exp(u'_t) - 1     so that   n'_t = 1 - n_t

(the token OAR-G ranks first gets OAR-G's last place, and the gaps between tokens are kept). Every
other step is OAR-G's: the same noise (each rollout's own seed, oar_grad.seeded_noise), the same clean
outcome from the update forward, the same probe, the same gate settings (--gate_quantile, --gate_boost,
and the fixed floor and mass preservation, oar.credit_settings.GATE_FLOOR and PRESERVE_MASS). If OAR's
scores carry information about which tokens matter, this arm should learn worse than `random-gate`
(which gates scores that carry none); if only the reshaping matters, the three gated arms should tie.
tests/studies/test_signal_or_gate.py checks that with the inversion switched off the weights are the
built-in oar-g's, and with it on they are the gate of 1 - n.

Scope: the rollout's own answer is the outcome (the study's, and train.py's only one).
Preserves what the gate preserves (the mass, the sign of A_i).
"""

from __future__ import annotations

import torch

from oar.credit import CreditMethod, MicroBatch, Step
from oar.credit_methods import gate
from oar.oar_grad import gradient_scores


def oar_g_scores(step: Step, micro: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """OAR-G's scores (b, L) for the micro-batch's scored rollouts, and the reasoning mask (b, L) they cover,
    drawn exactly as oar/credit_methods.py's oar_weights draws them (each rollout's noise from its own seed,
    oar_grad.seeded_noise; the update forward's clean outcome)."""
    s, mb, rows = step.settings, micro.rollouts, micro.rows
    reasoning = mb.reasoning_mask & step.scored[rows][:, None]  # (b, L)
    if not reasoning.any():
        return torch.zeros(mb.input_ids.shape, device=mb.input_ids.device), reasoning
    scores = gradient_scores(
        step.model,
        mb.input_ids,
        mb.attention_mask,
        reasoning,
        mb.answer_mask,
        probe=step.probe,
        noise_std=s.noise_std,
        seeds=step.seeds[rows],
        clean=micro.clean,
        clean_kv=micro.clean_kv,
    )
    width = min(scores.shape[1], mb.input_ids.shape[1])
    full = torch.zeros(mb.input_ids.shape, device=scores.device)
    full[:, :width] = scores[:, :width]
    return full, reasoning


def invert(scores: torch.Tensor, reasoning: torch.Tensor) -> torch.Tensor:
    """Scores (b, L) whose gate-normalised values are 1 - n over each row's `reasoning` (b, L) tokens:
    u' = max u + min u - u in the gate's log space u = log(1 + |s|). Rows with a non-finite
    reasoning score are returned as they are (the gate gives them all-ones weights)."""
    u = torch.log1p(scores.abs().double())
    finite = (torch.isfinite(u) | ~reasoning).all(1, keepdim=True)
    lo = u.masked_fill(~reasoning, float("inf")).amin(1, keepdim=True)
    hi = u.masked_fill(~reasoning, float("-inf")).amax(1, keepdim=True)
    flipped = torch.expm1(hi + lo - u).float()
    return torch.where(reasoning & finite, flipped, scores)


def weigh(step: Step, state, micro: MicroBatch, inverted: bool = True) -> tuple[torch.Tensor, int]:
    """Weights (b, L): the gate of OAR-G's inverted scores (`inverted=False`: OAR-G's own, the test's check)."""
    scores, reasoning = oar_g_scores(step, micro)
    nonfinite = int((~torch.isfinite(scores) & reasoning).any(1).sum())
    if not reasoning.any():
        return torch.ones(scores.shape, device=scores.device), 0
    return gate(step.settings, invert(scores, reasoning) if inverted else scores, reasoning), nonfinite


CREDIT_METHODS = [CreditMethod("oar-g-inverted", weigh, uses_clean=True)]
