"""A token-credit method defined outside oar/, for tests/package/test_credit_methods.py:
`--credit_module tests/credit_plugin.py`.

equal-mass: under token_mean aggregation each valid token carries A_i, so a rollout's pull grows with
its length T_i. Weights w_it = T̄ / T_i on its completion tokens, T̄ the mean length of the step's
rollouts over EVERY process, give each rollout the mass A_i T̄ whatever its length (the step's total
mass sum_i |A_i| T̄ stays on GRPO's scale). It needs the whole step (T̄, through `step.gather`), so it
exercises prepare: taken over one process's rollouts only, T̄ would change with the process count.
"""

import torch

from oar.credit import CreditMethod, MicroBatch, Step


def mean_length(step: Step) -> float:
    """T̄: the mean valid-token count of the step's rollouts, on every process."""
    lengths = step.rollouts.loss_tokens(step.settings.mask_truncated).sum(1).float()  # (B,)
    return float(step.gather(lengths).mean())


def weigh(step: Step, mean: float, micro: MicroBatch) -> torch.Tensor:
    valid = micro.rollouts.loss_tokens(step.settings.mask_truncated)  # (b, L)
    w = mean / valid.sum(1, keepdim=True).clamp(min=1).float()  # (b, 1)
    return torch.where(valid, w, 1.0)


CREDIT_METHODS = [CreditMethod("equal-mass", weigh, prepare=mean_length)]
