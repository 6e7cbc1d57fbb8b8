"""LoRA through peft (--lora_r, oar/training/lora.py): what a run trains, what it leaves, and the two
silent traps.

  * a LoRA run moves the adapters only: final/ is the initial weights plus s B A of the saved
    adapter, the optimizer holds the adapters' states and nothing else, and a checkpoint holds the
    adapters without the frozen base;
  * final/ is a plain merged model: from_pretrained loads it with no peft name in it (saving the
    inner model's own state dict would write `base_layer` keys, loaded as random projections), its
    logits equal those of the base + final/adapter/ through peft, and eval.py evaluates it;
  * OAR-G and OAR-P through the LoRA model, in training mode with activation checkpointing, equal
    their scores on the merged model (handed the PeftModel wrapper, OAR-G would read a cache that
    checkpointed layers drop: wrong scores, no error);
  * the KL reference, the adapters switched off, is the base model;
  * resume is exact, also with checkpointing switched on at the resume; 2 DDP and 2 FSDP2 processes
    give the update of one, also across a resume;
  * impossible settings stop before anything loads, naming the flag.
"""

import copy
import json
import math

import pytest

import oar.training.run as oar_run
import torch

from conftest import padded_batch, tiny_llama
from oar.grpo import token_logprobs
from oar.oar_grad import gradient_scores
from oar.oar_perturb import perturbation_scores
from oar.training import lora
from oar.lm import forward_logits
from oar.training.models import enable_checkpointing
from tinyrun import (
    ROUNDING,
    TINY,
    assert_same_metrics,
    check_ok,
    final_params,
    initial_params,
    launch,
    max_abs_diff,
    metrics,
    run_inprocess,
)

LORA = ["--lora_r", "4"]


def _args(model, out, *extra):
    return [
        "--model",
        str(model),
        "--dataset",
        str(model / "data.jsonl"),
        "--output_dir",
        str(out),
        "--steps",
        "2",
        "--save_every",
        "1",
        "--micro_batch_size",
        "2",
        *TINY,
        "--method",
        "oar-g",
        "--noise_std",
        "0.1",
        "--kl_beta",
        "0.1",
        *LORA,
        *extra,
    ]


# OAR-G at --noise_std 0.1, not 1e-3: its scores magnify float rounding ~1/noise_std-fold, and on an AMD EPYC
# a resumed or 2-process step 2 then moved grad_norm by 5.6e-5 and 1.6e-4 relative (tests/package/test_distributed.py).


@pytest.fixture(scope="module")
def one_process(tiny_model, tmp_path_factory):
    """The reference LoRA run: 2 steps of OAR-G with the KL penalty, one process."""
    out = tmp_path_factory.mktemp("lora") / "one"
    run_inprocess(_args(tiny_model, out))
    return out


def _adapted(seed=0):
    """A tiny Llama with LoRA adapters whose B is not 0 (a trained adapter), and its base alone."""
    base = tiny_llama(seed=seed)
    peft_model = lora.add_adapters(copy.deepcopy(base), r=4, alpha=8, targets="all-linear")
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return peft_model, base


def _merged(peft_model):
    """The merged plain model, built the way final/ is (lora.final_weights)."""
    plain = tiny_llama()
    state, _ = lora.final_weights(peft_model, None)
    plain.load_state_dict(state)  # strict: every plain name, no peft name
    return plain.eval()


def test_a_lora_run_trains_the_adapters_only_and_leaves_a_plain_merged_model(tiny_model, one_process):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    rows = metrics(one_process)
    assert any(m["reward/frac_zero_std_groups"] < 1 and m["optim/grad_norm"] > 0 for m in rows)  # an update happened
    assert rows[0]["loss/kl_ref"] == 0 < rows[1]["loss/kl_ref"]  # B = 0 at step 1: the policy is its reference
    initial = initial_params(tiny_model)

    # The checkpoint holds the adapters only (the frozen base is --model's) and AdamW states for them only.
    adapters = load_file(str(one_process / "checkpoint-2" / "model.safetensors"))
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)
    assert max(float(v.abs().max()) for k, v in adapters.items() if "lora_B" in k) > 1e-4  # B = 0 at the start
    optim = torch.load(one_process / "checkpoint-2" / "optimizer.bin", weights_only=False)
    shapes = sorted(tuple(s["exp_avg"].shape) for s in optim["state"].values())
    assert shapes == sorted(tuple(v.shape) for v in adapters.values())
    assert len(optim["param_groups"][0]["params"]) == len(adapters)

    # final/: plain names; the initial weights with s B A added to the adapted ones (the base did not move).
    final = final_params(one_process)
    assert not [k for k in final if "lora_" in k or "base_layer" in k]
    peft_names = {
        k.replace(".weight", ".base_layer.weight")
        if k.replace(".weight", ".lora_A.default.weight") in adapters
        else k: v
        for k, v in initial.items()
    }
    want = lora.merged_state_dict({**peft_names, **adapters}, scaling=32 / 4)  # alpha / r
    assert max_abs_diff(final, want) == 0
    assert {k for k in final if not torch.equal(final[k], initial[k])} == {
        k.replace(".base_layer", "") for k in peft_names if ".base_layer" in k
    }

    # It loads as a plain model and computes what the PEFT model computes.
    ids, attn, *_ = padded_batch(vocab_size=20)
    plain = AutoModelForCausalLM.from_pretrained(one_process / "final").eval()
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model), one_process / "final" / "adapter"
    ).eval()
    with torch.no_grad():
        want, got = forward_logits(adapted, ids, attn), forward_logits(plain, ids, attn)
        base_logits = forward_logits(AutoModelForCausalLM.from_pretrained(tiny_model).eval(), ids, attn)
    # W x + s B (A x) against (W + s B A) x: the same sum rounded in another order (logits up to ~12 differed
    # by 2e-5 on an AMD EPYC, where float32's default atol is 1e-5); the base model is ~0.7 away.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert (got - base_logits).abs().max() > 1e-2  # and it is not the base model


def test_eval_loads_the_merged_final(one_process, tiny_model, tmp_path):
    import eval as eval_script
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    summary = eval_script.main(
        eval_script.EvalConfig(
            model=str(one_process / "final"),
            dataset=str(tiny_model / "data.jsonl"),
            output_dir=str(tmp_path / "eval"),
            instruction="",
            max_new_tokens=20,
            eval_size=8,
        )
    )
    assert summary["problems"] == 8 and summary["accuracy"] > 0


@pytest.mark.parametrize("probe", ["answer_mean", "answer_joint"])
def test_oar_scores_through_lora_equal_the_merged_models(probe):
    """What train.py hands OAR (lora.inner), in training mode with activation checkpointing, scores as
    the merged model in eval mode. Handed the PeftModel itself, OAR-G cannot see the checkpointing
    (a property of the transformers class), reads its noise-free prefix from a cache the checkpointed
    layers dropped, and returns other scores without an error."""
    peft_model, _ = _adapted()
    plain = _merged(peft_model)
    ids, attn, reas, ans = padded_batch()
    noise = torch.randn((*ids.shape, 32), generator=torch.Generator().manual_seed(0))
    policy = lora.inner(peft_model)
    enable_checkpointing(policy)
    policy.train()
    for score in (
        lambda m: gradient_scores(m, ids, attn, reas, ans, probe=probe, noise=noise, noise_std=1e-2),
        lambda m: perturbation_scores(m, ids, attn, reas, ans, probe=probe, pad_token_id=0),
    ):
        want = score(plain)
        assert want.abs().max() > 0
        torch.testing.assert_close(score(policy), want, rtol=1e-4, atol=1e-6)  # merged weights round differently
    assert not [n for n, p in peft_model.named_parameters() if p.grad is not None]


def test_the_kl_reference_is_the_base_model():
    peft_model, base = _adapted()
    ids, attn, *_ = padded_batch()
    labels = ids[:, 1:]
    logprobs = lambda m: token_logprobs(forward_logits(m, ids, attn)[:, :-1], labels)
    with torch.no_grad():
        want, adapted = logprobs(base), logprobs(lora.inner(peft_model))
        with lora.adapters_off(lora.inner(peft_model)):
            got = logprobs(lora.inner(peft_model))
        after = logprobs(lora.inner(peft_model))
    torch.testing.assert_close(got, want)
    assert (adapted - want).abs().max() > 1e-3  # the adapters change the policy...
    torch.testing.assert_close(after, adapted)  # ...and are back on after the block, still trainable
    assert {n for n, p in peft_model.named_parameters() if p.requires_grad} == {
        n for n, _ in peft_model.named_parameters() if ".lora_" in n
    }


def test_resume_is_exact_also_with_checkpointing_switched_on(tiny_model, one_process, tmp_path):
    """Step 1, then --resume for step 2 with --gradient_checkpointing (a resumable setting): the
    uninterrupted run's metrics (OAR-G's weight statistics among them) and final weights. With the
    PeftModel handed to OAR-G, step 2's weights would differ."""
    out = tmp_path / "resumed"
    run_inprocess(_args(tiny_model, out, "--steps", "1"))
    run_inprocess(_args(tiny_model, out, "--resume", "--gradient_checkpointing"))
    for got, want in zip(metrics(out), metrics(one_process), strict=True):
        assert got.keys() == want.keys()
        for key in want:
            assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=ROUNDING.get(key, 1e-6)), (
                got["step"],
                key,
                got[key],
                want[key],
            )
    assert max_abs_diff(final_params(out), final_params(one_process)) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_two_processes_equal_one_also_resumed(tiny_model, one_process, tmp_path, sharding):
    """Step 1 on 2 gloo processes (DDP, or FSDP2 with its config), its checkpoint (the adapters and their
    AdamW states, no frozen base), then step 2 in a new launch: the 1-process run's update."""
    out, fsdp = tmp_path / sharding, sharding == "fsdp"
    check_ok(launch(_args(tiny_model, out, "--steps", "1"), fsdp=fsdp))
    if sharding == "fsdp":
        from torch.distributed.checkpoint import FileSystemReader

        saved = FileSystemReader(str(out / "checkpoint-1" / "sharded")).read_metadata().state_dict_metadata
        # torch's DCP keeps the second name of a tied frozen parameter (lm_head = embed_tokens): one matrix
        held = [k[len("model.") :] for k in saved if k.startswith("model.") and k != "model.lm_head.weight"]
    else:
        from safetensors import safe_open

        with safe_open(str(out / "checkpoint-1" / "model.safetensors"), "pt") as f:
            held = list(f.keys())
    assert held and all(".lora_A." in k or ".lora_B." in k for k in held), held
    proc = launch(_args(tiny_model, out, "--resume"), fsdp=fsdp)
    check_ok(proc)
    assert "(step 1)" in proc.stdout
    assert max_abs_diff(final_params(out), final_params(one_process)) <= 1e-5
    assert_same_metrics(metrics(out), metrics(one_process))  # every logged key, loss/kl_ref's token mean too
    adapter = json.loads((out / "final" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 32 and adapter["lora_dropout"] == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--lora_target_modules", "q_proj,qkv_proj"],
            "--lora_target_modules q_proj,qkv_proj: qkv_proj: no such module in LlamaForCausalLM",
        ),
        (["--lora_target_modules", "embed_tokens"], "embed_tokens: not a linear layer"),
        (["--lora_target_modules", "lm_head"], "lm_head: the output head shares its weight with the input embeddings"),
        (["--lora_r", "-4"], "--lora_r -4: the LoRA rank must be > 0"),
        (["--lora_r", "0", "--lora_target_modules", "q_proj"], "--lora_target_modules q_proj without --lora_r"),
    ],
)
def test_impossible_lora_settings_stop_before_anything_loads(tiny_model, tmp_path, flags, message, monkeypatch):

    monkeypatch.setattr(oar_run, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit, match="^train.py: error: ") as stop:
        run_inprocess(_args(tiny_model, tmp_path / "run", *flags))
    assert message in str(stop.value)
    assert "q_proj" in str(stop.value) or "lora_r" in str(stop.value)  # the fix: the names it could use
    assert not (tmp_path / "run").exists()


def test_resume_refuses_changed_lora_settings(tiny_model, one_process, monkeypatch):

    monkeypatch.setattr(oar_run, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as stop:
        run_inprocess(
            _args(
                tiny_model, one_process, "--resume", "--steps", "3", "--lora_r", "8", "--lora_target_modules", "q_proj"
            )
        )
    assert "--lora_r 8 (the checkpoint has 4)" in str(stop.value)
    assert "--lora_target_modules q_proj (the checkpoint has all-linear)" in str(stop.value)
    with pytest.raises(SystemExit, match="--lora_r 0 \\(the checkpoint has 4\\)"):  # nor may it drop LoRA
        run_inprocess(_args(tiny_model, one_process, "--resume", "--steps", "3", "--lora_r", "0"))
