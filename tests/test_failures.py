"""Nothing silent: non-finite numbers never reach the optimizer, bad input stops with one message
before anything is loaded or written (hostile completion text: test_hostile_text.py).

Function-level cases live beside their functions (tied groups: test_grpo; empty reasoning, one
token, NaN scores: test_gating; 1 MB and pathological answers: test_rewards). Here: what train.py,
eval.py and the sampler do with them end to end.
"""

import shutil
from pathlib import Path

import pytest
import torch

from oar.training.checks import check_config
from oar.training.config import Config, micro_batch, parse_args
from tinyrun import EVAL, TINY, TRAIN, final_params, metrics, run_inprocess, run_script


def _args(model, out, *extra):
    return ["--model", str(model), "--dataset", str(model / "data.jsonl"), "--output_dir", str(out),
            "--micro_batch_size", "8", *TINY, *extra]


# -- numbers stay numbers -------------------------------------------------------------------------

def _nan_model(tiny_model: Path, where: Path) -> Path:
    """A copy of the model whose final norm is NaN: every logit is NaN, in sampling and in training."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model, where)
    weights = load_file(str(where / "model.safetensors"))
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    save_file(weights, str(where / "model.safetensors"), metadata={"format": "pt"})
    return where


def test_nan_logits_skip_steps_then_stop_with_a_message(tiny_model, tmp_path, capsys, monkeypatch):
    model, out = _nan_model(tiny_model, tmp_path / "nan-model"), tmp_path / "run"
    monkeypatch.setattr(Config, "max_bad_steps", 2)  # a constant (3), no longer a flag
    with pytest.raises(SystemExit) as stop:
        run_inprocess(_args(model, out, "--method", "oar-g", "--steps", "5", "--save_every", "1"))
    message = str(stop.value)
    assert message.startswith("train.py: error: 2 steps in a row") and "(a run stops at 2)" in message
    printed = capsys.readouterr().out
    assert "step 1: non-finite loss in 1 micro-batches, update skipped (1 skipped so far)" in printed
    assert "(2 skipped so far)" in printed
    # No NaN reached the optimizer: it never stepped (no Adam state), the weights are the loaded ones.
    state = torch.load(out / "checkpoint-1" / "optimizer.bin", weights_only=True)
    assert state["state"] == {}
    from safetensors.torch import load_file

    saved, loaded = load_file(str(out / "checkpoint-1" / "model.safetensors")), load_file(str(model / "model.safetensors"))
    assert all(torch.equal(saved[k], loaded[k]) or torch.allclose(saved[k], loaded[k], equal_nan=True) for k in loaded)


def test_a_nonfinite_loss_is_skipped_even_when_the_gradient_is_finite(tiny_model, tmp_path, monkeypatch, capsys):
    """A NaN that enters the loss as a constant leaves every gradient finite: only the loss shows it."""
    calls = []

    def loss_with_a_nan_at_step_2(*args, **kwargs):
        loss, stats = policy_loss(*args, **kwargs)
        calls.append(1)
        return (loss + float("nan"), stats) if len(calls) == 2 else (loss, stats)

    from oar.training import update  # train.py's step 5: the micro-batch loop that calls the loss

    policy_loss = update.policy_loss
    monkeypatch.setattr(update, "policy_loss", loss_with_a_nan_at_step_2)
    summary = run_inprocess(_args(tiny_model, tmp_path / "run", "--method", "grpo", "--steps", "3"))
    assert summary["skipped_steps"] == 1
    assert "step 2: non-finite loss in 1 micro-batches, update skipped (1 skipped so far)" in capsys.readouterr().out
    assert all(torch.isfinite(p).all() for p in final_params(tmp_path / "run").values())
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2, 3]


@pytest.mark.parametrize("method", ["oar-g", "oar-p"])
def test_no_answer_all_truncated_tied_groups_are_defined(tiny_model, tmp_path, method):
    """2 new tokens: every rollout truncated (and masked out), none has an answer or a reasoning
    span, every group ties at reward 0. Defined: weights 1, advantages 0, loss 0 (not 0/0), a zero
    gradient, no skipped step."""
    out = tmp_path / "run"
    summary = run_inprocess(_args(tiny_model, out, "--method", method, "--steps", "2", "--max_new_tokens", "2",
                                  "--mask_truncated", "--aggregation", "token_mean"))
    assert summary["skipped_steps"] == 0
    for m in metrics(out):
        assert m["completion/frac_truncated"] == 1 and m["oar/frac_no_answer"] == 1
        assert m["reward/frac_zero_std_groups"] == 1 and m["optim/grad_norm"] == 0
        assert m["oar/weight_max"] == 1 and m["oar/frac_nonfinite_scores"] == 0


def test_groups_with_one_reward_that_is_not_a_binary_fraction_count_as_tied(tiny_model, tmp_path):
    """A reward of 0.1 for every rollout: each group's advantages are exactly 0 (group_advantages compares the
    rewards), and reward/frac_zero_std_groups says 1, as it must, though one group of eight 0.1s has a float32 std of 8e-9
    (torch's row-wise std of two such groups happens to give 0: one group shows it)."""
    module = tmp_path / "tenth.py"
    module.write_text("REWARD_FUNCTIONS = {'tenth': lambda completion, gold, problem: 0.1}\n")
    out = tmp_path / "run"
    run_inprocess(_args(tiny_model, out, "--method", "grpo", "--steps", "1", "--prompts_per_step", "1", "--group_size", "8",
                        "--reward_module", str(module), "--reward", "tenth"))
    (m,) = metrics(out)
    assert m["reward/mean"] == pytest.approx(0.1) and m["reward/frac_zero_std_groups"] == 1 and m["optim/grad_norm"] == 0


def test_nonfinite_oar_scores_are_counted(tiny_model, tmp_path, monkeypatch, capsys):
    """Scores that are not finite give plain GRPO weights (gating's rule); the run says so."""
    from oar import credit_adapters  # train.py's step 4 asks oar/credit.py, whose oar-g calls this module's gradient_scores

    gradient_scores = credit_adapters.gradient_scores
    monkeypatch.setattr(credit_adapters, "gradient_scores", lambda *a, **k: gradient_scores(*a, **k) * float("inf"))
    out = tmp_path / "run"
    summary = run_inprocess(_args(tiny_model, out, "--method", "oar-g", "--steps", "1"))
    assert summary["skipped_steps"] == 0
    (m,) = metrics(out)
    assert m["oar/frac_nonfinite_scores"] > 0 and m["oar/ess_ratio"] == 1  # all weights 1
    assert "had non-finite OAR scores; they got plain GRPO weights" in capsys.readouterr().out


# -- bad input is named ---------------------------------------------------------------------------

def _assert_named(proc, *needles):
    """One message, non-zero exit, no traceback, nothing expensive started."""
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Loading weights" not in proc.stderr  # stopped before the model's weights were read
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr[-3000:])


@pytest.mark.slow
def test_train_names_a_malformed_jsonl_line(tiny_model, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "Compute 1 + 1.", "answer": "2"}\n{"problem": "Compute 2 + 2.", "answer": 4\n')
    out = tmp_path / "out"
    proc = run_script(TRAIN, ["--model", str(tiny_model), "--dataset", str(data), "--output_dir", str(out)])
    _assert_named(proc, "train.py: error:", f"{data}:2: invalid JSON")
    assert not out.exists()


@pytest.mark.slow
def test_eval_names_a_missing_field(tiny_model, tmp_path):
    data = tmp_path / "test.jsonl"
    data.write_text('{"problem": "Compute 1 + 1.", "answer": "2"}\n{"prompt": "Compute 2 + 2.", "answer": "4"}\n')
    out = tmp_path / "out"
    proc = run_script(EVAL, ["--model", str(tiny_model), "--dataset", str(data), "--output_dir", str(out)])
    _assert_named(proc, "eval.py: error:", f"{data}:2: missing key 'problem'")
    assert not out.exists()


def _stops(args, *needles, script="train.py"):
    """main() on `args` ends in SystemExit with a message (what the user sees, without a traceback)."""
    import eval as evaluation

    out = Path(args[args.index("--output_dir") + 1])
    with pytest.raises(SystemExit) as stop:
        if script == "train.py":
            run_inprocess(args)
        else:
            evaluation.main(evaluation.parser().parse(args))
    message = stop.value.code
    assert isinstance(message, str) and message.startswith(f"{script}: error:"), message
    for needle in needles:
        assert needle in message, (needle, message)
    assert not out.exists()  # nothing written
    return message


BAD_DATA = {  # file content -> what the message must name
    "empty": ("", "no problems (the file is empty"),
    "blank lines only": ("\n\n  \n", "no problems"),
    "wrong type": ('{"problem": "Compute 1 + 1.", "answer": 2}\n', ":1: key 'answer' must be a string"),
    "not an object": ('["Compute 1 + 1.", "2"]\n', ":1: expected a JSON object"),
    "not UTF-8": (b'{"problem": "\xff", "answer": "2"}\n', "not UTF-8"),
}


@pytest.mark.parametrize("case", BAD_DATA)
@pytest.mark.parametrize("which", ["--dataset", "--eval_dataset"])
def test_bad_data_is_named_before_the_model_loads(tiny_model, tmp_path, case, which):
    content, needle = BAD_DATA[case]
    data = tmp_path / "bad.jsonl"
    data.write_bytes(content if isinstance(content, bytes) else content.encode())
    args = _args(tiny_model, tmp_path / "out") + [which, str(data)]
    _stops(args, str(data), needle)


def test_eval_names_bad_data_and_settings(tiny_model, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text("{not json}\n")
    base = ["--model", str(tiny_model), "--output_dir", str(tmp_path / "out")]
    _stops(base + ["--dataset", str(data)], f"{data}:1: invalid JSON", script="eval.py")
    _stops(base + ["--num_samples", "4"], "--eval_temperature > 0", script="eval.py")  # as_typed renames it in eval.py's __main__
    _stops(base + ["--top_p", "0"], "--eval_top_p 0.0", script="eval.py")
    _stops(base + ["--model", str(tmp_path / "nowhere")], "not a model folder", script="eval.py")


def test_train_names_a_tokenizer_without_eos(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    model = tmp_path / "no-eos"
    shutil.copytree(tiny_model, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.eos_token = None
    tok.save_pretrained(model)
    _stops(_args(model, tmp_path / "out"), f"--model {model}: its tokenizer has no EOS token")


def test_missing_and_broken_models_are_named(tiny_model, tmp_path):
    out = tmp_path / "out"
    _stops(_args(tmp_path / "nowhere", out), f"--model {tmp_path / 'nowhere'}: not a model folder")
    _stops(_args(tiny_model, out) + ["--model", str(tmp_path / "m.gguf")], "no such .gguf file")
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)  # a truncated download
    _stops(_args(broken, out), f"--model {broken}: could not load its model")


def test_a_tokenizer_without_pad_pads_with_eos(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from oar.training.models import load_model

    model = tmp_path / "no-pad"
    shutil.copytree(tiny_model, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.pad_token = None
    tok.save_pretrained(model)
    _, loaded = load_model(str(model))
    assert loaded.pad_token_id == loaded.eos_token_id and loaded.padding_side == "left"


IMPOSSIBLE = {  # setting -> a word the message must contain
    ("--group_size", "1"): "--group_size 1",
    ("--prompts_per_step", "3"): "--prompts_per_step 3 does not divide over 2 processes",
    ("--micro_batch_size", "3"): "--micro_batch_size 3 must divide",
    ("--micro_batch_size", "0"): "--micro_batch_size 0",
    ("--gate_quantile", "0"): "--gate_quantile 0.0",
    ("--gate_quantile", "1"): "--gate_quantile 1.0",
    ("--gate_quantile", "1.5"): "--gate_quantile 1.5",
    ("--noise_std", "-0.1"): "--noise_std -0.1",
    ("--gate_boost", "-1"): "--gate_boost",
    ("--method", "ppo"): "--method ppo: choose one of grpo, oar-g, oar-p",
    ("--probe", "first"): "--probe first: choose one of",
    ("--aggregation", "sum"): "--aggregation sum",
    ("--advantage_scale", "std"): "--advantage_scale std",
    ("--outcome_source", "gold"): "--outcome_source gold",
    ("--temperature", "0"): "--temperature 0.0",
    ("--top_p", "1.5"): "--top_p 1.5",
    ("--dtype", "manual_seed"): "--dtype manual_seed",
    ("--learning_rate", "-1"): "--learning_rate",
    ("--clip_low", "1"): "--clip_low 1.0",
    ("--kl_beta", "-0.1"): "--kl_beta -0.1",
    ("--save_every", "-1"): "--save_every",
    ("--keep_checkpoints", "0"): "--keep_checkpoints",
    ("--collective_timeout", "0"): "--collective_timeout 0: must be >= 1",
    ("--steps", "0"): "--steps",
    ("--seed", "-1"): "--seed -1: must be >= 0",
    ("--rollout_batch_size", "3"): "--rollout_batch_size 3 must divide each process's 2 prompts",
    ("--eval_samples", "4"): "--eval_samples 4 / --eval_temperature 0.0",  # k > 1 greedy samples: all the same
    ("--eval_samples", "0", "--eval_temperature", "0.7"): "--eval_samples 0",
}


@pytest.mark.parametrize("setting", IMPOSSIBLE, ids=lambda s: "=".join(s))
def test_impossible_settings_are_named(setting):
    cfg = parse_args(["--prompts_per_step", "4", "--group_size", "4", "--micro_batch_size", "8", *setting])
    with pytest.raises(ValueError) as err:
        check_config(cfg, num_processes=2)
    assert IMPOSSIBLE[setting] in str(err.value)


def test_every_impossible_setting_is_named_at_once(tiny_model, tmp_path):
    message = _stops(_args(tiny_model, tmp_path / "out", "--group_size", "1", "--gate_quantile", "2", "--noise_std", "-1"),
                     "--group_size 1", "--gate_quantile 2.0", "--noise_std -1.0")
    assert len(message.splitlines()) == 3  # one line each (G = 1 leaves 2 rollouts: one micro-batch, not an error)


def test_an_accelerate_launch_train_py_cannot_train_under_is_named(tiny_model, tmp_path, monkeypatch):
    """fp16 mixed precision (its loss scaling skips overflowing steps, which train.py counts as failed) and DeepSpeed
    (it replaces the accumulation train.py scales the loss for) are refused before anything loads; bf16 and DDP pass."""
    from oar.training.checks import check_launch

    assert check_launch("bf16", "MULTI_GPU") == check_launch("no", "FSDP") == []
    assert "fp16" in check_launch("fp16", "NO")[0] and "DeepSpeed" in check_launch("no", "DEEPSPEED")[0]
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # what `accelerate launch --mixed_precision fp16` sets
    with pytest.raises(SystemExit, match="fp16 mixed precision.*bf16"):
        run_inprocess(_args(tiny_model, tmp_path / "fp16"))
    assert not (tmp_path / "fp16").exists()


def test_a_micro_batch_larger_than_a_process_rollouts_is_one_micro_batch():
    # the default 64 on 8 processes x 4 prompts x 8 rollouts: one micro-batch of 32 each, not an error
    cfg = parse_args(["--prompts_per_step", "32", "--group_size", "8"])
    check_config(cfg, num_processes=8)
    assert micro_batch(cfg, 8) == 32 and micro_batch(cfg, 2) == 64 and micro_batch(cfg, 1) == 64


def test_output_dir_that_is_a_file_is_named(tiny_model, tmp_path):
    (tmp_path / "taken").write_text("not a directory")
    with pytest.raises(SystemExit) as stop:
        run_inprocess(_args(tiny_model, tmp_path / "taken"))
    assert "is a file" in str(stop.value)


def test_the_default_config_is_possible():
    check_config(Config(), num_processes=1)


def test_resume_without_a_checkpoint_and_a_rerun_over_one_are_named(tiny_model, tmp_path):
    out = tmp_path / "out"
    _stops(_args(tiny_model, out, "--resume"), "--resume: no complete checkpoint")
    run_inprocess(_args(tiny_model, out, "--steps", "1"))
    with pytest.raises(SystemExit) as stop:
        run_inprocess(_args(tiny_model, out, "--steps", "1"))
    assert "holds checkpoints of an earlier run: pass --resume" in str(stop.value)
