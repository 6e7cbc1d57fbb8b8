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
