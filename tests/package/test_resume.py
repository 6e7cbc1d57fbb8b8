"""Interrupted runs lose nothing: a real train.py killed with SIGKILL (between steps, in the middle
of writing a checkpoint, in the middle of a metrics line) and resumed with --resume ends exactly
where an uninterrupted run ends: the same metrics for every step, the same final parameters
(the checkpoint bookkeeping without a model: tests/package/test_checkpoint_files.py).

The kills are made deterministic by a prelude run in the child before train.py: it wraps one
function so that the process SIGKILLs itself at a chosen point (no test hook in the code itself).
"""

import json
import math
from pathlib import Path

import pytest

from oar.training import checkpoint as ckpt
from tinyrun import (
    ROUNDING,
    TINY,
    TRAIN,
    final_params,
    initial_params,
    max_abs_diff,
    metrics,
    run_inprocess,
    run_script,
)

KILL_DURING_SAVE = """
import os, signal, oar.training.checkpoint as c
_write = c._write_json
def _dying_write(path, obj):  # accelerate's state is in checkpoint-{step}.tmp; trainer_state.json is next
    if path.parent.name == "checkpoint-{step}.tmp":
        os.kill(os.getpid(), signal.SIGKILL)
    _write(path, obj)
c._write_json = _dying_write
"""

KILL_MID_METRICS_LINE = """
import os, signal, oar.training.runlog as r
_step = r.RunLog.step
def _dying_step(self, step, metrics):
    if step == {step}:  # half a line reaches the disk, then the process dies
        with open(self.metrics_path, "a") as f:
            f.write('{{"step": {step}, "reward/me')
        os.kill(os.getpid(), signal.SIGKILL)
    _step(self, step, metrics)
r.RunLog.step = _dying_step
"""


def _args(model: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model",
        str(model),
        "--dataset",
        str(model / "data.jsonl"),
        "--output_dir",
        str(out),
        "--steps",
        "6",
        "--save_every",
        "1",
        "--micro_batch_size",
        "4",
        "--method",
        "oar-g",
        *TINY,
        "--warmup_steps",
        "4",
        *extra,
    ]  # resumes land inside the LR warm-up


def _names(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-"))


def _assert_same_metrics(got: list[dict], want: list[dict]) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), g["step"]
        for key in w:
            assert math.isclose(g[key], w[key], rel_tol=1e-5, abs_tol=ROUNDING.get(key, 1e-6)), (
                g["step"],
                key,
                g[key],
                w[key],
            )


@pytest.mark.slow
def test_killed_run_resumes_exactly(tiny_model, tmp_path):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    run_inprocess(_args(tiny_model, straight))  # the same code and thread count as a child: the same floats
    want = metrics(straight)
    assert len(want) == 6
    # The property is only tested if the policy learns: rewards vary within groups, parameters move.
    assert sum(m["reward/frac_zero_std_groups"] < 1 and m["optim/grad_norm"] > 0 for m in want) >= 3
    assert max_abs_diff(final_params(straight), initial_params(tiny_model)) > 1e-3
    # the logged rate is the one each step trained with: step s of a 4-step warm-up, s / 4 of 1e-3
    assert [m["optim/lr"] for m in want] == pytest.approx([1e-3 * min(1, s / 4) for s in range(1, 7)])

    # 1. killed while writing checkpoint-3: accelerate's state is in checkpoint-3.tmp, not renamed yet.
    died = run_script(TRAIN, _args(tiny_model, broken), prelude=KILL_DURING_SAVE.format(step=3))
    assert died.returncode == -9, died.stderr[-3000:]
    assert _names(broken) == ["checkpoint-1", "checkpoint-2", "checkpoint-3.tmp"]
    assert [m["step"] for m in metrics(broken)] == [1, 2, 3]  # step 3 was logged before the save

    # 2. --resume starts from checkpoint-2 (the .tmp is ignored, then cleaned up); killed again while
    # appending step 5's metrics line, which leaves half a line at the end of metrics.jsonl.
    died = run_script(TRAIN, _args(tiny_model, broken, "--resume"), prelude=KILL_MID_METRICS_LINE.format(step=5))
    assert died.returncode == -9, died.stderr[-3000:]
    assert "resumed from" in died.stdout and "(step 2)" in died.stdout
    assert _names(broken) == ["checkpoint-3", "checkpoint-4"]  # the newest 2 kept, the stale .tmp gone
    assert (broken / "metrics.jsonl").read_text().endswith('"reward/me')

    # 3. --resume again, to the end (in this process: the child runs above are the real kills).
    summary = run_inprocess(_args(tiny_model, broken, "--resume"))
    assert _names(broken) == ["checkpoint-5", "checkpoint-6"]
    _assert_same_metrics(metrics(broken), want)  # each step once, in order, as if never interrupted
    assert max_abs_diff(final_params(broken), final_params(straight)) <= 1e-6
    assert summary["skipped_steps"] == 0


def test_resume_refuses_a_changed_run(tiny_model, tmp_path):
    """Resuming with settings that change what the run computes (here the seed) would silently
    splice two different runs into one metrics.jsonl: it is refused, naming the setting."""
    out = tmp_path / "run"
    run_inprocess(_args(tiny_model, out, "--steps", "1"))
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(SystemExit) as stop:
        run_inprocess(_args(tiny_model, out, "--steps", "2", "--resume", "--seed", "1"))
    assert "--seed 1 (the checkpoint has 0)" in str(stop.value) and "checkpoint-1" in str(stop.value)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing touched


def test_resume_may_change_the_micro_batch(tiny_model, tmp_path):
    """Micro-batching does not change the update, so a resume may change it (e.g. on a smaller
    machine). accelerate restores its accumulation counter from the checkpoint (2 micro-batches
    seen); with 4 per step it would then step the optimizer mid-step and drop the real step."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_inprocess(_args(tiny_model, straight, "--steps", "2"))
    run_inprocess(_args(tiny_model, split, "--steps", "1"))
    run_inprocess(_args(tiny_model, split, "--steps", "2", "--resume", "--micro_batch_size", "2"))
    _assert_same_metrics(metrics(split), metrics(straight))
    assert max_abs_diff(final_params(split), final_params(straight)) <= 1e-5


def test_a_resume_refuses_what_would_not_continue_the_run_and_reports_only_a_true_before(tiny_model, tmp_path, capsys):
    """Against a 2-step run with a held-out set: --steps below the checkpoint's step and training data edited in
    place are refused (the data order is a permutation of the problems); a resume with another held-out set
    reports no accuracy before training (it was measured on other problems), while the same set keeps it; the
    final model records its prompt's instruction, which eval.py's 'auto' then uses. A checkpoint written by other
    code resumes, and says so."""
    from oar.sampler import TRAINED_INSTRUCTION, resolve_instruction

    data = tmp_path / "data.jsonl"
    data.write_text((tiny_model / "data.jsonl").read_text())
    out = tmp_path / "run"
    args = [
        "--model",
        str(tiny_model),
        "--dataset",
        str(data),
        "--eval_dataset",
        str(data),
        "--eval_size",
        "6",
        "--output_dir",
        str(out),
        "--save_every",
        "1",
        *TINY,
    ]
    first = run_inprocess(args + ["--steps", "2"])
    assert first["accuracy_before"] is not None
    with pytest.raises(SystemExit, match="at step 2, past --steps 1"):
        run_inprocess(args + ["--steps", "1", "--resume"])
    state = out / "checkpoint-2" / "trainer_state.json"
    assert json.loads(state.read_text())["code"] == ckpt.code_version()
    state.write_text(json.dumps(json.loads(state.read_text()) | {"code": "0123456789"}))
    capsys.readouterr()
    assert run_inprocess(args + ["--steps", "3", "--resume"])["accuracy_before"] == first["accuracy_before"]
    assert "written by other code (train.py, oar/ and the modules 0123456789" in capsys.readouterr().out
    other = run_inprocess(args + ["--steps", "4", "--resume", "--eval_size", "5"])
    assert other["accuracy_before"] is None and other["pass_before"] is None and other["eval_problems"] == 5
    assert json.loads((out / "final" / TRAINED_INSTRUCTION).read_text()) == {"instruction": ""}
    assert (
        resolve_instruction("auto", str(data), str(out / "final")) == ""
    )  # not the \boxed{} request of a plain folder
    lines = data.read_text().splitlines()
    data.write_text("\n".join(lines[1:] + lines[:1]) + "\n")  # the same problems, in another order
    with pytest.raises(SystemExit, match="other problems than --dataset"):
        run_inprocess(args + ["--steps", "5", "--resume"])


KILL_AFTER_THE_FINAL_EVALUATION = """
import os, signal, oar.training.runlog as r
_records = r.RunLog.records
def _dying_records(self, name, rows):  # after the final checkpoint and evaluation, before the last line
    if name == "eval_final.jsonl":
        os.kill(os.getpid(), signal.SIGKILL)
    _records(self, name, rows)
r.RunLog.records = _dying_records
"""


def test_a_run_killed_after_its_last_checkpoint_logs_its_last_line_on_resume(tiny_model, tmp_path):
    """The last step's line waits for the final evaluation, which follows the final checkpoint (a kill during it
    loses no step). Killed there, the resume has nothing left to train: it evaluates, and logs the last line
    from the checkpoint's record with that evaluation, once, as the uninterrupted run did."""
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    args = lambda out: _args(
        tiny_model,
        out,
        "--steps",
        "2",
        "--eval_dataset",
        str(tiny_model / "data.jsonl"),  # noqa: E731
        "--eval_size",
        "6",
    )
    want = run_inprocess(args(straight))
    assert [m["step"] for m in metrics(straight)] == [1, 2] and "eval/accuracy" in metrics(straight)[1]
    died = run_script(TRAIN, args(broken), prelude=KILL_AFTER_THE_FINAL_EVALUATION)
    assert died.returncode == -9, died.stderr[-3000:]
    assert [m["step"] for m in metrics(broken)] == [1] and "checkpoint-2" in _names(broken)
    got = run_inprocess(args(broken) + ["--resume"])
    _assert_same_metrics(metrics(broken), metrics(straight))
    assert got["accuracy_after"] == want["accuracy_after"]
    run_inprocess(args(broken) + ["--resume"])  # once more, nothing to do: the line is not logged twice
    assert [m["step"] for m in metrics(broken)] == [1, 2]


KILL_AT_STEP_3 = """
import os, signal, oar.training.runlog as r
_step = r.RunLog.step
def _dying_step(self, step, metrics):  # step 3 trained, its line not written: checkpoint-2 is the last
    if step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    _step(self, step, metrics)
r.RunLog.step = _dying_step
"""


@pytest.mark.slow
def test_a_resume_that_moves_the_last_step_logs_every_line_as_a_run_of_its_new_length(tiny_model, tmp_path):
    """--steps may change on a resume. Larger, after a kill during the final evaluation: the old last step's line
    (in the checkpoint's record, never logged) is logged before the run goes on. Lowered to a checkpoint of a
    longer run: that step's line, logged during the run, gains the final evaluation. Either way the lines
    are those of an uninterrupted run of the new length."""
    args = lambda out, steps: _args(
        tiny_model,
        out,
        "--steps",
        str(steps),
        "--eval_dataset",  # noqa: E731
        str(tiny_model / "data.jsonl"),
        "--eval_size",
        "6",
    )
    straight3, longer = tmp_path / "straight3", tmp_path / "longer"
    run_inprocess(args(straight3, 3))
    died = run_script(TRAIN, args(longer, 2), prelude=KILL_AFTER_THE_FINAL_EVALUATION)
    assert died.returncode == -9, died.stderr[-3000:]
    run_inprocess(args(longer, 3) + ["--resume"])
    _assert_same_metrics(metrics(longer), metrics(straight3))

    straight2, shorter = tmp_path / "straight2", tmp_path / "shorter"
    want = run_inprocess(args(straight2, 2))
    died = run_script(TRAIN, args(shorter, 4), prelude=KILL_AT_STEP_3)
    assert died.returncode == -9, died.stderr[-3000:]
    assert "eval/accuracy" not in metrics(shorter)[-1]
    got = run_inprocess(args(shorter, 2) + ["--resume", "--log_with", "tensorboard"])
    _assert_same_metrics(metrics(shorter), metrics(straight2))
    assert got["accuracy_after"] == want["accuracy_after"] == metrics(shorter)[-1]["eval/accuracy"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sent = EventAccumulator(str(shorter / "oar")).Reload().Scalars("eval/accuracy")  # the trackers are sent it too
    assert [(e.step, e.value) for e in sent] == [(2, pytest.approx(got["accuracy_after"]))]


def test_a_resume_under_another_mixed_precision_is_refused(tiny_model, tmp_path, monkeypatch):
    """accelerate's mixed precision is the launch's, not a flag: a checkpoint records it, and a resume launched
    with another is refused before anything is written (its forwards would compute in another dtype)."""
    out = tmp_path / "run"
    run_inprocess(_args(tiny_model, out, "--steps", "1"))
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `accelerate launch --mixed_precision bf16` sets
    with pytest.raises(SystemExit, match="ran under accelerate's mixed precision no, this launch's is bf16"):
        run_inprocess(_args(tiny_model, out, "--steps", "2", "--resume"))
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_a_resume_whose_credit_module_file_changed_says_so(tiny_model, tmp_path, capsys):
    """The code version a checkpoint records covers the run's --credit_module file: edited (or another
    file under the same relative name) between the two halves, the resume says that two versions ran."""
    import shutil

    module = tmp_path / "mine.py"
    shutil.copy(Path(__file__).resolve().parents[1] / "credit_plugin.py", module)
    out = tmp_path / "run"
    args = [
        "--model",
        str(tiny_model),
        "--dataset",
        str(tiny_model / "data.jsonl"),
        "--credit_module",
        str(module),
        "--method",
        "equal-mass",
        "--output_dir",
        str(out),
        "--save_every",
        "1",
        *TINY,
    ]
    run_inprocess(args + ["--steps", "1"])
    capsys.readouterr()
    run_inprocess(args + ["--steps", "2", "--resume"])
    assert "written by other code" not in capsys.readouterr().out  # the same file: one version
    module.write_text(module.read_text() + "\n# edited between the two halves of the run\n")
    run_inprocess(args + ["--steps", "3", "--resume"])
    assert "written by other code" in capsys.readouterr().out


def test_a_run_extended_by_a_resume_keeps_its_last_evaluation(tiny_model, tmp_path):
    """The held-out evaluation at a run's last step is logged on that step's line before its checkpoint, so
    a resume with a larger --steps keeps it (it was only in the summary the resume rewrites), and the run
    then continues as one that evaluated there without stopping: the same lines, the same weights."""
    straight, extended = tmp_path / "straight", tmp_path / "extended"
    args = lambda out: [
        *_args(tiny_model, out, "--eval_dataset", str(tiny_model / "data.jsonl"), "--eval_size", "6"),  # noqa: E731
        "--eval_every",
        "1",
        "--eval_samples",
        "3",
        "--eval_temperature",
        "0.9",
    ]  # after TINY's 0: on every
    # step, avg@3 (k/18: not a float32 number, so a line rounded otherwise than the summary shows)
    summary = run_inprocess(args(straight) + ["--steps", "2"])
    run_inprocess(args(extended) + ["--steps", "1"])
    first = metrics(extended)
    assert [m["step"] for m in first] == [1] and "eval/accuracy" in first[0]
    run_inprocess(args(extended) + ["--steps", "2", "--resume"])
    _assert_same_metrics(metrics(extended), metrics(straight))
    assert max_abs_diff(final_params(extended), final_params(straight)) <= 1e-6
    assert summary["accuracy_after"] == metrics(straight)[-1]["eval/accuracy"]  # the same evaluation, at one precision
    assert (
        metrics(extended)[0]["eval/accuracy"] == metrics(straight)[0]["eval/accuracy"]
    )  # the final one of a shorter run too


def test_a_resume_from_other_model_files_is_refused(tiny_model, tmp_path):
    """A resume reloads --model (the tokenizer, LoRA's frozen base, the KL reference): a folder edited in place
    since the checkpoint (one weight scaled, the file's size unchanged) is refused before anything is written;
    the same files resume."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    out = tmp_path / "run"
    args = lambda steps: _args(model, out, "--steps", str(steps))  # noqa: E731
    run_inprocess(args(1))
    weights = next(model.glob("*.safetensors"))
    tensors = load_file(str(weights))
    name = next(iter(tensors))
    save_file({**tensors, name: tensors[name] * 1.5}, str(weights), metadata={"format": "pt"})
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(
        SystemExit, match=rf"started from other --model files than those there now \({weights.name}: edited"
    ):
        run_inprocess(args(2) + ["--resume"])
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    save_file({**tensors, name: tensors[name]}, str(weights), metadata={"format": "pt"})  # restored: it resumes
    run_inprocess(args(2) + ["--resume"])
    assert [m["step"] for m in metrics(out)] == [1, 2]
