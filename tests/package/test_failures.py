"""Nothing silent: bad input stops with one message before anything is loaded or written (non-finite
numbers: test_degenerate_numbers.py; hostile completion text: test_hostile_text.py). Here: what
train.py, eval.py and the sampler do with bad data, models and settings end to end.
"""

import shutil
from pathlib import Path

import pytest

from oar.training.checks import check_config
from oar.training.config import Config, micro_batch, parse_args
from tinyrun import EVAL, TINY, TRAIN, run_inprocess, run_script


def _args(model, out, *extra):
    return [
        "--model",
        str(model),
        "--dataset",
        str(model / "data.jsonl"),
        "--output_dir",
        str(out),
        "--micro_batch_size",
        "8",
        *TINY,
        *extra,
    ]


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
    data.write_text('{"problem": "Compute 1 + 1.", "answer": "2"}\n{"query": "Compute 2 + 2.", "answer": "4"}\n')
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
    _stops(
        base + ["--num_samples", "4"], "--eval_temperature > 0", script="eval.py"
    )  # as_typed renames it in eval.py's __main__
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
    ("--temperature", "0"): "--temperature 0.0",
    ("--dtype", "manual_seed"): "--dtype manual_seed",
    ("--learning_rate", "-1"): "--learning_rate",
    ("--clip_low", "1"): "--clip_low 1.0",
    ("--kl_beta", "-0.1"): "--kl_beta -0.1",
    ("--save_every", "-1"): "--save_every",
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


@pytest.mark.parametrize("value", ["0", "soon"])
def test_an_impossible_collective_timeout_is_named(tiny_model, tmp_path, monkeypatch, value):
    """OAR_COLLECTIVE_TIMEOUT (seconds, for train.py and eval.py) below 1 or not a number stops the run in one
    line, before anything is written."""
    monkeypatch.setenv("OAR_COLLECTIVE_TIMEOUT", value)
    _stops(_args(tiny_model, tmp_path / "out"), f"OAR_COLLECTIVE_TIMEOUT={value}: must be a number of seconds >= 1")


def test_every_impossible_setting_is_named_at_once(tiny_model, tmp_path):
    message = _stops(
        _args(tiny_model, tmp_path / "out", "--group_size", "1", "--gate_quantile", "2", "--noise_std", "-1"),
        "--group_size 1",
        "--gate_quantile 2.0",
        "--noise_std -1.0",
    )
    assert len(message.splitlines()) == 3  # one line each (G = 1 leaves 2 rollouts: one micro-batch, not an error)


def test_an_accelerate_launch_train_py_cannot_train_under_is_named(tiny_model, tmp_path, monkeypatch):
    """fp16 mixed precision (its loss scaling skips overflowing steps, which train.py counts as failed) and DeepSpeed
    (it replaces the accumulation train.py scales the loss for) are refused before anything loads;
    bf16 and DDP pass."""
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


# -- no silent wrong model (a newcomer's report: a float16 run saved NaN weights as done) -----------------------------


def test_float16_full_fine_tuning_is_refused_before_anything_loads(tiny_model, tmp_path):
    """--dtype float16 without LoRA: AdamW steps float16 weights with no loss scaling, and one update leaves every
    weight NaN or inf; refused in one line with the dtypes that work (LoRA on a float16 base trains float32
    adapters, and is allowed)."""
    message = _stops(_args(tiny_model, tmp_path / "out", "--dtype", "float16"), "--dtype float16 for full", "bfloat16")
    assert len(message.splitlines()) == 1
    check_config(parse_args(["--dtype", "float16", "--lora_r", "4"]), num_processes=1)  # adapters: float32


def test_a_step_that_leaves_weights_non_finite_stops_before_anything_is_saved(tiny_model, tmp_path, monkeypatch):
    """The newcomer's run, with the refusal above taken away: --dtype float16, full fine-tuning, a checkpoint
    due at every step. Before, step 1 left every weight tensor NaN/inf and the run saved final/ with
    skipped_steps 0 (held-out 0.4 -> 0.0, no word why). Now the step's own check stops it, naming the cause,
    and no checkpoint, final/ or summary.json holds the broken weights."""
    import oar.training.checks as checks

    monkeypatch.setattr(checks, "check_half_weights", lambda dtype, lora_r: [])
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        run_inprocess(_args(tiny_model, out, "--dtype", "float16", "--steps", "2", "--save_every", "1"))
    message = stop.value.code
    assert message.startswith("train.py: error: step 1: the optimizer step left "), message
    assert "float16 weights: AdamW runs without loss scaling" in message and "\n" not in message, message
    assert not list(out.glob("checkpoint-*")) and not (out / "final").exists() and not (out / "summary.json").exists()


def test_eval_refuses_a_model_with_non_finite_weights(tiny_model, tmp_path):
    """eval.py on the NaN model that run saved reported accuracy 0 and nothing else; now it says the weights are
    broken, before evaluating (train.py refuses to start from one the same way)."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan-model"
    shutil.copytree(tiny_model, broken)
    weights = load_file(str(broken / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name][0] = float("nan")
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    base = ["--model", str(broken), "--dataset", str(broken / "data.jsonl"), "--output_dir", str(tmp_path / "out")]
    message = _stops(base, f"--model {broken}: 1 of its", "hold NaN or inf", script="eval.py")
    assert len(message.splitlines()) == 1
    _stops(_args(broken, tmp_path / "out"), "hold NaN or inf")


# -- one line each --------------------------------------------------------------------------


def test_an_output_dir_under_a_file_is_named_before_anything_loads(tiny_model, tmp_path):
    """Before: NotADirectoryError from pathlib's mkdir, a traceback, after the model had loaded."""
    (tmp_path / "afile").write_text("not a folder")
    message = _stops(_args(tiny_model, tmp_path / "afile" / "run"), f"{tmp_path / 'afile'} is a file, so no folder")
    assert len(message.splitlines()) == 1
    base = ["--model", str(tiny_model), "--dataset", str(tiny_model / "data.jsonl")]
    _stops([*base, "--output_dir", str(tmp_path / "afile" / "eval")], "is a file, so no folder", script="eval.py")


@pytest.mark.parametrize("flag", ["--learning_rate", "--temperature", "--kl_beta", "--clip_low", "--gate_boost"])
def test_a_value_that_is_not_a_number_is_named_once(flag):
    """--learning_rate nan printed two lines (not finite; not > 0): NaN fails every range check as well."""
    with pytest.raises(ValueError) as err:
        check_config(parse_args([flag, "nan"]), num_processes=1)
    assert str(err.value) == f"{flag} nan: must be a finite number."


def test_a_checkpoint_passed_to_train_py_as_a_model_is_named_with_what_works(tiny_model, tmp_path):
    run = tmp_path / "run"
    run_inprocess(_args(tiny_model, run, "--steps", "1"))
    message = _stops(_args(run / "checkpoint-1", tmp_path / "out"), "a checkpoint of a training run")
    assert f"python eval.py --model {run / 'checkpoint-1'}" in message and f"--resume --output_dir {run}" in message
    assert len(message.splitlines()) == 1
