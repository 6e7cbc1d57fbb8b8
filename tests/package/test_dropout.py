"""Training computes without noise: disable_dropout turns off every dropout rate and train-mode MoE jitter of
every family (pi_old, the update and the scores are then one function), and leaves what a model computes in
eval mode as it was."""

import pytest
import torch

from families import FAMILIES, family, long_batch
from oar.lm import forward_logits
from oar.training.models import disable_dropout


@pytest.mark.parametrize("name", [*FAMILIES, "falcon", "dbrx", "mixtral"])
def test_training_turns_every_familys_dropout_off(name):
    """With every dropout rate (and MoE router jitter, Mixtral's) of its config at 0.5, a family's model in train
    mode gives its eval-mode logits after disable_dropout (train.py's learner calls it): pi_old, the update and the
    scores are one function."""
    model_cls, config = family(name)
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key or "jitter" in key) and isinstance(value, float):
            setattr(config, key, 0.5)
    torch.manual_seed(0)
    model = model_cls(config).float()
    ids, attn = long_batch()[:2]
    want = forward_logits(model.eval(), ids, attn)
    noisy = forward_logits(model.train(), ids, attn)
    disable_dropout(model)
    got = forward_logits(model.train(), ids, attn)
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(
        noisy, want, atol=1e-5
    )  # it had dropout to turn off


def test_disable_dropout_keeps_what_a_model_computes_in_eval_mode():
    """Phi-MoE's router reads `router_jitter_noise` as a fixed threshold in eval mode too (Mixtral's is train-mode
    noise): disable_dropout leaves it, so the model computes what it was pretrained to. (Phi-MoE's train-mode
    routing samples experts, which no setting turns off: its update forward is not deterministic.)"""
    model_cls, config = family("phimoe")
    torch.manual_seed(0)
    model = model_cls(config).float().eval()
    ids, attn = long_batch()[:2]
    want = forward_logits(model, ids, attn)
    disable_dropout(model)
    assert torch.equal(forward_logits(model.eval(), ids, attn), want) and model.config.router_jitter_noise == 0.5
