"""research/common/study_ledger.py: finished runs move to a new machine only with the weights they started from."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file


def _model(path, value: float):
    path.mkdir(parents=True)
    save_file({"w": torch.full((3, 2), value), "b": torch.zeros(2)}, str(path / "model.safetensors"))
    (path / "build_info.json").write_text(json.dumps({"seed": 0, "heldout_accuracy": 0.5}))
    return path


def _finished_run(root, model, name="grpo-s0"):
    run = root / "slip" / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": str(model), "output_dir": str(run), "method": "grpo"}))
    (run / "summary.json").write_text(json.dumps({"accuracy_after": 0.7}))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "study_time.json").write_text(json.dumps({"seconds": 5.0, "model": str(model)}))
    (run / "checkpoint-1").mkdir()  # not kept: the ledger holds a few kB per run
    return run


def _recorded(tmp_path):
    """A ledger with slip's model and one finished run, made on 'machine a'."""
    from research.common import study_ledger

    ledger, a = tmp_path / "ledger", tmp_path / "a"
    model_a = _model(a / "models" / "slip", 1.0)
    assert study_ledger.check_build(ledger, "slip", model_a) == "recorded"
    _finished_run(a, model_a)
    assert study_ledger.record_run(ledger, a, "slip", "grpo-s0")
    return ledger, a, model_a


def test_a_run_recorded_on_one_machine_is_restored_on_another_with_its_paths(tmp_path):
    from research.common import study_ledger

    ledger, a, model_a = _recorded(tmp_path)
    kept = ledger / "runs" / "slip" / "grpo-s0"
    assert sorted(p.name for p in kept.iterdir()) == sorted([*study_ledger.RUN_FILES, "ledger.json"])
    assert not study_ledger.record_run(ledger, a, "slip", "grpo-s0")  # kept entries are never rewritten
    other = (
        tmp_path / "other"
    )  # ... and another run of the same name (another machine's, a rerun) is refused, not ignored
    _finished_run(other, model_a)
    (other / "slip" / "grpo-s0" / "summary.json").write_text(json.dumps({"accuracy_after": 0.1}))
    with pytest.raises(ValueError, match="two different runs of one name"):
        study_ledger.record_run(ledger, other, "slip", "grpo-s0")

    b = tmp_path / "b"
    model_b = b / "models" / "slip"  # a new machine: the kept model is copied in, not rebuilt
    assert study_ledger.restore_model(ledger, "slip", model_b) and not study_ledger.restore_model(
        ledger, "slip", model_b
    )
    assert study_ledger.weights_sha256(model_b) == study_ledger.weights_sha256(model_a)
    assert study_ledger.check_build(ledger, "slip", model_b) == "matches"
    (b / "slip" / "grpo-s0").mkdir(parents=True)  # an unfinished attempt: replaced by the finished one ...
    from research.common.study_run import claimed

    with claimed(b / "slip" / "grpo-s0") as lock:  # ... but not while another study process is running it
        assert lock is not None and study_ledger.restore(ledger, b, "slip", model_b) == 0
        assert not (b / "slip" / "grpo-s0" / "config.json").exists()
    assert study_ledger.restore(ledger, b, "slip", model_b) == 1
    run = b / "slip" / "grpo-s0"
    config = json.loads((run / "config.json").read_text())
    assert config["model"] == str(model_b) and config["output_dir"] == str(run)
    assert json.loads((run / "study_time.json").read_text())["model"] == str(model_b)
    assert sorted(p.name for p in run.iterdir()) == sorted(study_ledger.RUN_FILES)
    assert study_ledger.restore(ledger, b, "slip", model_b) == 0  # already there
    left = [p for p in b.glob("slip/.*") if not p.name.endswith(".lock")]  # the runs' lock files stay (empty, reused)
    assert not left and not list(ledger.glob("runs/slip/.*"))  # no temporary folder left


def test_a_rebuild_with_other_weights_stops_the_study(tmp_path):
    from research.common import study_ledger

    ledger = tmp_path / "ledger"
    study_ledger.check_build(ledger, "slip", _model(tmp_path / "a", 1.0))
    with pytest.raises(SystemExit, match="not the model the ledger's runs started from"):
        study_ledger.check_build(ledger, "slip", _model(tmp_path / "b", 1.5))


def test_runs_without_their_build_record_or_incomplete_are_refused(tmp_path):
    from research.common import study_ledger

    ledger, a, model_a = _recorded(tmp_path)
    (ledger / "runs" / "slip" / "grpo-s0" / "metrics.jsonl").unlink()
    with pytest.raises(SystemExit, match=r"incomplete \(no metrics.jsonl\)"):
        study_ledger.restore(ledger, tmp_path / "b", "slip", model_a)
    (ledger / "builds" / "slip.json").unlink()  # the runs' starting model is now unknown
    with pytest.raises(SystemExit, match="holds runs but"):
        study_ledger.check_build(ledger, "slip", model_a)


def test_a_run_from_other_weights_is_refused(tmp_path):
    from research.common import study_ledger

    ledger, a, model_a = _recorded(tmp_path)
    (ledger / "runs" / "slip" / "grpo-s0" / "ledger.json").write_text(json.dumps({"weights_sha256": "other"}))
    with pytest.raises(SystemExit, match="from other weights than the build"):
        study_ledger.restore(ledger, tmp_path / "b", "slip", model_a)


def test_an_unfinished_run_is_not_recorded(tmp_path):
    from research.common import study_ledger

    (tmp_path / "slip" / "grpo-s0").mkdir(parents=True)
    with pytest.raises(ValueError, match="not a finished run"):
        study_ledger.record_run(tmp_path / "ledger", tmp_path, "slip", "grpo-s0")


@pytest.mark.slow  # an end-to-end run of 10-35 s
def test_one_testbed_is_claimed_by_one_process(tmp_path):
    import subprocess
    import sys

    from research.testbeds_v5.study_v5 import _claim

    held = _claim(tmp_path, "fork")
    assert held is not None and _claim(tmp_path, "slip") is not None
    other = (
        "import sys; sys.path.insert(0, '.'); from pathlib import Path; "
        "from research.testbeds_v5.study_v5 import _claim; "
        f"print(_claim(Path({str(tmp_path)!r}), 'fork') is None, _claim(Path({str(tmp_path)!r}), 'filler') is None)"
    )
    repo = Path(__file__).resolve().parents[2]
    assert subprocess.run(
        [sys.executable, "-c", other], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.split() == ["True", "False"]


def test_held_out_completions_are_added_to_a_kept_run_once_and_gzipped(tmp_path):
    """An entry kept before completions were gets them from its own run's folder, byte-identical
    after gunzip and the same bytes from any machine; the entry's other files are not touched."""
    import gzip

    from research.common import study_ledger

    ledger, a, _ = _recorded(tmp_path)  # recorded without eval_final.jsonl
    kept = ledger / "runs" / "slip" / "grpo-s0"
    before = {p.name: p.read_bytes() for p in kept.iterdir()}
    lines = "".join(
        json.dumps({"index": i, "completion": f"{i} + 1 = {i + 1}\n#### {i + 1}", "correct": True}) + "\n"
        for i in range(50)
    )
    (a / "slip" / "grpo-s0" / "eval_final.jsonl").write_text(lines)
    assert not study_ledger.record_run(ledger, a, "slip", "grpo-s0")  # not new, but completed
    packed = kept / "eval_final.jsonl.gz"
    assert gzip.decompress(packed.read_bytes()).decode() == lines
    assert {p.name: p.read_bytes() for p in kept.iterdir() if p.name != packed.name} == before
    assert packed.read_bytes() == gzip.compress(
        lines.encode(), mtime=0
    )  # no file name or time in the header: any machine's bytes
    assert not study_ledger.record_completions(ledger, a, "slip", "grpo-s0")  # once
    assert not study_ledger.record_completions(ledger, a, "slip", "oar-g-s0")  # no such entry: nothing made
    # another machine's run of the same name (another summary) does not lend the entry its completions
    packed.unlink()
    (a / "slip" / "grpo-s0" / "summary.json").write_text(json.dumps({"accuracy_after": 0.9}))
    assert not study_ledger.record_completions(ledger, a, "slip", "grpo-s0") and not packed.exists()


def test_a_run_another_study_process_holds_is_left_to_it(tmp_path):
    """record_run takes the run's lock: while another study process holds it (it found the run finished and
    is recording it), this one records nothing; once it is free, the run is recorded."""
    from research.common import study_ledger
    from research.common.study_run import claimed

    ledger, _, model_a = _recorded(tmp_path)
    late = tmp_path / "late"
    _finished_run(late, model_a, name="grpo-s1")
    with claimed(late / "slip" / "grpo-s1") as lock:
        assert lock is not None and not study_ledger.record_run(ledger, late, "slip", "grpo-s1")
        assert not (ledger / "runs" / "slip" / "grpo-s1").exists()
    assert study_ledger.record_run(ledger, late, "slip", "grpo-s1")


def test_a_run_finished_here_between_the_first_look_and_the_lock_is_not_replaced(tmp_path, monkeypatch):
    """restore looks at summary.json again once it holds the run's lock: another study process that finishes
    the run here in between (and releases the lock) leaves its result, which restore must not overwrite with
    the ledger's run of the same name."""
    from contextlib import contextmanager

    from research.common import study_ledger

    ledger, _, model_a = _recorded(tmp_path)
    b = tmp_path / "b"
    (b / "slip" / "grpo-s0").mkdir(parents=True)  # being run here by another study process
    mine = json.dumps({"accuracy_after": 0.3})
    real = study_ledger.claimed

    @contextmanager
    def finished_meanwhile(out):  # the other process writes summary.json and ends just before the lock is taken
        (out / "summary.json").write_text(mine)
        with real(out) as lock:
            yield lock

    monkeypatch.setattr(study_ledger, "claimed", finished_meanwhile)
    assert study_ledger.restore(ledger, b, "slip", model_a) == 0
    assert (b / "slip" / "grpo-s0" / "summary.json").read_text() == mine


def test_a_copy_that_fails_leaves_no_temporary_folder(tmp_path, monkeypatch):
    from research.common import study_ledger

    def broken(src, dst, **kwargs):
        Path(dst).mkdir()
        (Path(dst) / "half").write_text("x")
        raise OSError("disk full")

    monkeypatch.setattr(study_ledger.shutil, "copytree", broken)
    with pytest.raises(OSError, match="disk full"):
        study_ledger._copy_folder(_model(tmp_path / "src", 1.0), tmp_path / "dst")
    assert not (tmp_path / "dst").exists() and [p.name for p in tmp_path.iterdir()] == ["src"]
