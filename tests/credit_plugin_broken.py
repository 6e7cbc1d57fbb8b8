"""Credit methods that break the protocol, for tests/package/test_credit_trial.py: each must stop train.py in
its trial on a synthetic step, before any evaluation or file, with one line naming the method."""

import torch

from oar.credit import CreditMethod


def wrong_shape(step, state, micro):
    return torch.ones(
        micro.rollouts.input_ids.shape[0], micro.rollouts.input_ids.shape[1] - 1
    )  # (b, L - 1): one column short


def nan_weights(step, state, micro):
    return torch.full(micro.rollouts.input_ids.shape, float("nan"))


def raises(step, state, micro):
    return torch.ones(micro.rollouts.input_ids.shape) / 0 if micro.rows.start is None else {}["no such key"]


def unseeded(step, state, micro):
    return 0.5 + torch.rand(micro.rollouts.input_ids.shape)  # the global generator: other weights on every call


def prepare_raises(step):
    raise RuntimeError("prepare cannot read the step")


CREDIT_METHODS = [
    CreditMethod("wrong-shape", wrong_shape),
    CreditMethod("nan-weights", nan_weights),
    CreditMethod("raises", raises),
    CreditMethod("unseeded", unseeded),
    CreditMethod(
        "prepare-raises", lambda step, state, micro: torch.ones(micro.rollouts.input_ids.shape), prepare=prepare_raises
    ),
]


def fails_on_a_real_step(step, state, micro):
    """Passes the trial (one group of G rollouts) and raises on a training step's larger micro-batch."""
    if len(micro.rollouts) > step.settings.group_size:
        raise IndexError("a real micro-batch holds more than one group")
    return torch.ones(micro.rollouts.input_ids.shape)


def nan_on_a_real_step(step, state, micro):
    """Passes the trial and returns NaN weights on a training step's micro-batch."""
    fill = float("nan") if len(micro.rollouts) > step.settings.group_size else 1.0
    return torch.full(micro.rollouts.input_ids.shape, fill)


CREDIT_METHODS += [
    CreditMethod("fails-on-a-real-step", fails_on_a_real_step),
    CreditMethod("nan-on-a-real-step", nan_on_a_real_step),
]
