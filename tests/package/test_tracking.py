"""--log_with: a real run logged to tensorboard (requirements.txt installs it) and read back from its event
file, and a tracker that cannot log (unknown, or its package missing) stopped before anything loads."""

import json

import pytest

import oar.training.run as oar_run
from tinyrun import TINY, run_inprocess


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
        "0",
        "--method",
        "grpo",
        *TINY,
        *extra,
    ]


def test_a_run_logged_to_tensorboard_reads_back(tiny_model, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is in requirements.txt: pip install -r requirements.txt")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    run_inprocess(_args(tiny_model, out, "--log_with", "tensorboard"))
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "oar")).Reload()  # accelerate's run name is "oar" (RunLog)
    for name in ("reward/mean", "reward/correct", "loss/clip_frac", "optim/grad_norm"):
        scalars = events.Scalars(name)
        assert [s.step for s in scalars] == [1, 2], name
        # tensorboard keeps float32
        assert [s.value for s in scalars] == pytest.approx([row[name] for row in logged], rel=1e-6, abs=1e-7), name


@pytest.mark.parametrize(
    "name, needle",
    [
        ("nosuch", "--log_with nosuch: not a tracker; choose from "),
        ("wandb", "--log_with wandb: its package is not installed; pip install wandb, or use tensorboard"),
    ],
)
def test_a_tracker_that_cannot_log_stops_the_run_before_anything_loads(
    tiny_model, tmp_path, monkeypatch, name, needle
):
    import accelerate.tracking

    monkeypatch.setattr(
        accelerate.tracking, "get_available_trackers", lambda: ["tensorboard"]
    )  # wandb absent, wherever this runs
    monkeypatch.setattr(oar_run, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        run_inprocess(_args(tiny_model, out, "--log_with", f"tensorboard,{name}"))
    message = stop.value.code
    assert isinstance(message, str) and message.startswith(f"train.py: error: {needle}") and "\n" not in message, (
        message
    )
    assert not out.exists()
