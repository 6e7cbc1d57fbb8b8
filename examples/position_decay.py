"""position-decay: a token-credit method defined outside oar/, in oar/credit.py's protocol (docs/credit-methods.md).

    accelerate launch train.py --credit_module examples/position_decay.py --method position-decay

Legend: b a micro-batch's rollouts, L positions. Over rollout i's reasoning tokens R_i, in order
k = 0 .. n_R - 1, the weights decay geometrically and are rescaled to keep the rollout's mass:

    w_ik = n_R d^k / sum_j d^j          (sum_R w = n_R: the advantage mass A_i T_i is GRPO's)

Tokens outside R_i (marker, answer, EOS) keep 1, as under OAR's gate; weights are > 0, so every token
keeps the sign of A_i. A hypothesis to test, not a finding: the first steps of a solution decide it.
Each rollout's weights are a function of that rollout alone, so they do not depend on micro-batching
or on the number of processes, and the method needs nothing of the whole step (no prepare).
"""

import torch

from oar.credit import CreditMethod, MicroBatch, Step

DECAY = 0.9  # d, per reasoning token: the 10th token weighs 0.9^9 ~ 0.39 of the first


def weigh(step: Step, state: None, micro: MicroBatch) -> torch.Tensor:
    """Weights (b, L) of one micro-batch; only rollouts whose weights matter (`step.scored`) are reshaped."""
    reasoning = micro.rollouts.reasoning_mask & step.scored[micro.rows, None]  # (b, L)
    k = reasoning.cumsum(1) - 1  # (b, L): each reasoning token's place in its rollout's span
    decay = torch.where(reasoning, DECAY ** k.float(), 0.0)
    w = (
        decay * reasoning.sum(1, keepdim=True) / decay.sum(1, keepdim=True).clamp(min=1e-30)
    )  # a row without R: 0 / tiny
    return torch.where(reasoning, w, 1.0)


CREDIT_METHODS = [CreditMethod("position-decay", weigh)]
