"""oar/training/learner.py: the KL reference train.py's update reads, on one process.

Without LoRA the reference is a frozen copy of the initial model; with LoRA it is the policy with its
adapters off. Either way it must not move when the policy does (the k3 penalty would otherwise
measure nothing), and with LoRA the adapters must be back on after it.
"""

from __future__ import annotations

import pytest
import torch


def _learner(tiny_model, tmp_path, **settings):
    from accelerate.state import AcceleratorState, GradientState

    from oar.training.config import Config
    from oar.training.launch import make_accelerator
    from oar.training.learner import build_learner
    from oar.training.models import load_model

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    cfg = Config(model=str(tiny_model), output_dir=str(tmp_path), **({"kl_beta": 0.1} | settings))
    model, tokenizer = load_model(cfg.model, dtype=cfg.dtype)
    return build_learner(cfg, make_accelerator(), model, n_micro=1), tokenizer


@pytest.mark.parametrize("lora_r, precision", [(0, "no"), (4, "no"), (0, "bf16"), (4, "bf16")])
def test_the_reference_stays_the_initial_model_when_the_policy_moves(
    tiny_model, tmp_path, monkeypatch, lora_r, precision
):
    """Under --mixed_precision bf16 too: the reference computes in the policy's precision, so at the start
    it is the policy to the bit (the frozen copy in float32 beside an autocast policy was not)."""
    from oar.grpo import token_logprobs
    from oar.lm import forward_logits

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", precision)
    learner, tok = _learner(tiny_model, tmp_path, lora_r=lora_r)
    assert (learner.reference is None) == bool(lora_r) and (learner.peft is not None) == bool(lora_r)
    if learner.reference is not None:
        assert not any(p.requires_grad for p in learner.reference.parameters())
    enc = tok(["Compute 3 + 4. #### 7", "Compute 12 - 5. ####"], return_tensors="pt", padding=True)
    ids, attn = enc["input_ids"], enc["attention_mask"]
    labels = ids[:, 4:]  # (b, T): any completion width

    def policy_logprobs():
        with torch.no_grad():
            return token_logprobs(
                forward_logits(learner.policy, ids, attn, logits_to_keep=labels.shape[1] + 1)[:, :-1], labels
            )

    before = learner.reference_logprobs(ids, attn, labels, 1.0)
    assert before.shape == labels.shape
    assert torch.equal(before, policy_logprobs())  # at the start the reference is the policy
    with torch.no_grad():  # move every trainable parameter (LoRA: the adapters only)
        for p in learner.policy.parameters():
            if p.requires_grad:
                p.add_(0.05)
    moved = policy_logprobs()
    assert (moved - before).abs().max() > 1e-3  # the policy moved ...
    assert torch.equal(learner.reference_logprobs(ids, attn, labels, 1.0), before)  # ... its reference did not
    assert torch.equal(policy_logprobs(), moved)  # and LoRA's adapters are on again


def test_under_accelerates_fsdp_plugin_the_reference_is_sharded_as_the_policy(tiny_model, tmp_path, monkeypatch):
    """GPUs with configs/fsdp2.yaml (accelerate's plugin shards the policy in prepare, with no autocast around
    its forward): the frozen reference is sharded with the same mixed precision and runs without autocast,
    as under --fsdp (test_fsdp.py measures that path's k3 at exactly 0). Unsharded under autocast it differed
    from the bf16 policy by 2e-3 in log-prob at step 0, and held a whole fp32 copy on every GPU. The plugin
    cannot run on a CPU: the wiring is checked with the sharding recorded instead."""
    from contextlib import nullcontext

    from oar.training import sharding

    sharded = []
    monkeypatch.setattr(sharding, "accelerate_shards", lambda accelerator: True)
    monkeypatch.setattr(
        sharding, "shard", lambda model, mixed_precision=None: sharded.append((model, mixed_precision))
    )
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    learner, _ = _learner(tiny_model, tmp_path)
    assert [(m is learner.reference, p) for m, p in sharded] == [(True, torch.bfloat16)]  # the policy: prepare's
    assert learner.autocast is nullcontext and not learner.own_fsdp


def test_full_fine_tuning_of_half_precision_weights_warns(tiny_model, tmp_path):
    """--dtype bfloat16 without LoRA (and without accelerate's FSDP2 plugin, which keeps float32 masters): AdamW
    steps bfloat16 weights, whose rounding swallows small updates (at lr 1e-6, 58x less moved than in float32 in a
    review's check); the run says so. LoRA (float32 adapters) does not warn."""
    import warnings

    with pytest.warns(UserWarning, match="--dtype bfloat16 without LoRA trains bfloat16 weights"):
        _learner(tiny_model, tmp_path / "full", dtype="bfloat16", kl_beta=0.0)
    with pytest.warns(UserWarning, match="--dtype half without LoRA"):  # torch's other name for float16
        _learner(tiny_model, tmp_path / "half", dtype="half", kl_beta=0.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="--dtype")
        _learner(tiny_model, tmp_path / "lora", dtype="bfloat16", kl_beta=0.0, lora_r=4)
        _learner(tiny_model, tmp_path / "fp32", kl_beta=0.0)


def test_an_optimizer_step_out_of_phase_with_accumulation_is_refused(tiny_model, tmp_path):
    """update.optimizer_step belongs at the end of an accumulation cycle (n_micro micro-batches, which build_learner
    gives accelerate): in the middle of one, accelerate's optimizer would not step and not zero, without a word.
    Refused there; at the cycle's end the step moves the weights."""
    from accelerate.state import AcceleratorState, GradientState

    from oar.training.config import Config
    from oar.training.launch import make_accelerator
    from oar.training.learner import build_learner
    from oar.training.models import load_model
    from oar.training.update import optimizer_step

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    cfg = Config(model=str(tiny_model), output_dir=str(tmp_path))
    model, tok = load_model(cfg.model, dtype=cfg.dtype)
    accelerator = make_accelerator()
    learner = build_learner(cfg, accelerator, model, n_micro=2)
    ids = tok(["Compute 3 + 4. #### 7"], return_tensors="pt")["input_ids"]

    def micro_batch():
        with accelerator.accumulate(learner.policy):
            accelerator.backward(learner.policy(input_ids=ids).logits.float().pow(2).mean())

    micro_batch()
    with pytest.raises(AssertionError, match="not at the end of an accumulation cycle"):
        optimizer_step(learner, accelerator, 1.0, 0)
    micro_batch()
    before = [p.detach().clone() for p in learner.model.parameters()]
    _, why = optimizer_step(learner, accelerator, 1.0, 0)
    assert why == "" and any(not torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))
