"""A credit method is tried on a synthetic step right after the model loads (oar/training/credit_trial.py):
a broken one stops train.py in seconds with one line naming it, before the held-out evaluation runs
and before any file is written; the built-ins pass, and the trial leaves the run's random state alone."""

from pathlib import Path

import pytest

import oar.training.run as oar_run
import torch

from tinyrun import TINY, TRAIN, run_inprocess, run_script

BROKEN = Path(__file__).resolve().parents[1] / "credit_plugin_broken.py"

CASES = {  # method -> words its one line must hold
    "wrong-shape": "weigh returned torch.float32 of shape (4, ",
    "nan-weights": "returned non-finite weights",
    "raises": "raised KeyError: 'no such key' at ",
    "unseeded": "two calls on the same step gave different weights",
    "prepare-raises": "raised RuntimeError: prepare cannot read the step at ",
}


def _args(model, out, method):
    return [
        "--model",
        str(model),
        "--dataset",
        str(model / "data.jsonl"),
        "--eval_dataset",
        str(model / "data.jsonl"),
        "--output_dir",
        str(out),
        "--micro_batch_size",
        "8",
        *TINY,
        "--credit_module",
        str(BROKEN),
        "--method",
        method,
    ]


@pytest.mark.parametrize("method", CASES)
def test_a_broken_method_stops_before_evaluation_and_writes_nothing(tiny_model, tmp_path, monkeypatch, method):
    evaluated = []
    monkeypatch.setattr(oar_run, "evaluate", lambda *a, **k: evaluated.append(1))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        run_inprocess(_args(tiny_model, out, method))
    message = stop.value.code
    assert isinstance(message, str) and message.startswith(f"train.py: error: credit method {method!r}"), message
    assert CASES[method] in message and len(message.splitlines()) == 1, message
    if method in ("raises", "prepare-raises"):
        assert f"{BROKEN}:" in message  # where it raised
    assert not evaluated and not out.exists()  # no evaluation ran, no config.json, no metrics.jsonl


def test_the_command_line_sees_one_line_and_no_traceback(tiny_model, tmp_path):
    out = tmp_path / "out"
    proc = run_script(TRAIN, _args(tiny_model, out, "nan-weights"))
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Warning" not in ln]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith("train.py: error: credit method 'nan-weights'"), proc.stderr[-3000:]
    assert not out.exists()


def test_every_built_in_passes_and_the_random_state_is_left_alone(tiny_model):
    from oar.credit import METHODS, CreditSettings
    from oar.training.credit_trial import try_credit
    from oar.training.models import load_model

    model, tok = load_model(str(tiny_model))
    state = torch.get_rng_state()
    for name in METHODS:
        for keep_cache in (True, False):
            try_credit(
                CreditSettings(method=name, group_size=4, noise_std=0.1),
                model,
                tok,
                "Compute 2 + 3.",
                "5",
                instruction="",
                probe="answer_mean",
                device="cpu",
                keep_cache=keep_cache,
            )
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize(
    "method, words",
    [
        ("fails-on-a-real-step", "raised IndexError: a real micro-batch holds more than one group at "),
        ("nan-on-a-real-step", "returned non-finite weights for rows slice(0, 8"),
    ],
)
def test_a_method_that_passes_the_trial_and_fails_on_a_real_step_is_one_line(tiny_model, tmp_path, method, words):
    """Issue 54: such a method printed a 17-20 line traceback from inside train.py's loop."""
    proc = run_script(TRAIN, _args(tiny_model, tmp_path / "out", method) + ["--steps", "1"])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Warning" not in ln]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith(f"train.py: error: credit method {method!r}") and words in lines[-1], lines[-3:]
    if method == "fails-on-a-real-step":
        assert f"{BROKEN}:" in lines[-1] and lines[-1].endswith("in weigh on rows 0:8."), lines[-1]
