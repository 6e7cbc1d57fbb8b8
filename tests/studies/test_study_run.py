"""research/common/study_run.py: one run of a study brought to completion, whichever study runs it: a finished
run is kept only as planned and with its exit code said, a run is held by one study process at a time (also
after its study was killed outright), and a run's code version covers its --credit_module file."""

import pytest


def test_a_run_finished_before_a_setting_existed_is_still_finished(tmp_path):
    """A setting added to Config after a run finished (absent from its config.json, here --credit_module)
    ran as its default, since new settings default to the old behaviour: the run is skipped, not refused;
    a setting that differs still stops the study."""
    import json
    from dataclasses import asdict
    from types import SimpleNamespace

    from research.common.study_run import run_one
    from oar.training.config import Config

    run = {"name": "grpo", "seed": 0, "settings": {"model": "some/model", "method": "grpo"}}
    out = tmp_path / "grpo-s0"
    out.mkdir()
    saved = {k: v for k, v in (asdict(Config()) | run["settings"] | {"seed": 0}).items() if k != "credit_module"}
    (out / "config.json").write_text(json.dumps(saved))
    (out / "summary.json").write_text("{}")
    assert run_one(SimpleNamespace(root=tmp_path), run) == "done"
    (out / "config.json").write_text(json.dumps(saved | {"method": "oar-g"}))
    with pytest.raises(SystemExit, match="finished run with other settings"):
        run_one(SimpleNamespace(root=tmp_path), run)
    (out / "config.json").write_text(
        json.dumps(saved | {"eval_size": 50})
    )  # evaluated otherwise: not the plan's measure
    with pytest.raises(SystemExit, match="finished run with other settings.*eval_size"):
        run_one(SimpleNamespace(root=tmp_path), run)
    (out / "config.json").write_text(
        json.dumps(saved | {"eval_batch_size": 8, "micro_batch_size": 2})
    )  # the same numbers
    assert run_one(SimpleNamespace(root=tmp_path), run) == "done"


def test_a_train_py_that_fails_after_its_summary_is_kept_with_a_line(tmp_path, monkeypatch, capsys):
    """train.py writes summary.json and the final model, then tears down (the vLLM engine, the process
    group): a failure there is reported as failed, and at the next start the run is finished, with a note
    naming the exit code, not taken silently."""
    import json
    import sys
    from dataclasses import asdict
    from types import SimpleNamespace

    import research.common.study_run as sr
    from oar.training.config import Config

    run = {"name": "grpo", "seed": 0, "settings": {"model": "some/model", "method": "grpo"}}
    out = tmp_path / "grpo-s0"
    config = json.dumps(asdict(Config()) | run["settings"] | {"seed": 0})
    script = (
        f"import pathlib; d = pathlib.Path({str(out)!r}); (d / 'config.json').write_text({config!r}); "
        "(d / 'summary.json').write_text('{}'); raise SystemExit(3)"
    )
    monkeypatch.setattr(sr, "command", lambda *a: [sys.executable, "-c", script])
    args = SimpleNamespace(root=tmp_path, threads=1)
    assert sr.run_one(args, run) == "failed"
    assert json.loads((out / "study_time.json").read_text())["exit"] == 3
    capsys.readouterr()
    assert sr.run_one(args, run) == "done"
    assert "finished (summary.json), but train.py then exited 3" in capsys.readouterr().out


def test_a_run_held_by_another_study_process_is_busy_and_free_when_its_holder_dies(tmp_path):
    """Two study processes over one --root run different runs: a run another process holds is 'busy'
    (its folder untouched), and free again once that process ends, even by a kill."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from research.common.study_run import claimed, run_one

    run = {"name": "grpo", "seed": 0, "settings": {"model": "some/model", "method": "grpo"}}
    out = tmp_path / "grpo-s0"
    out.mkdir()
    (out / "partial").write_text("a checkpoint-less folder run_one would delete")
    with claimed(out) as lock:
        assert lock is not None and run_one(SimpleNamespace(root=tmp_path), run) == "busy"
    assert (out / "partial").exists()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
            str(tmp_path / ".grpo-s0.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with claimed(out) as lock:
            assert lock is None
    finally:
        holder.kill()
        holder.wait()
    with claimed(out) as lock:
        assert lock is not None


def test_a_study_killed_outright_leaves_its_run_held_until_its_train_py_ends(tmp_path):
    """The study hands its lock to the train.py it starts: killed by SIGKILL (its handler cannot stop the
    child), it leaves the run held while that train.py still trains, so a second study does not resume
    or delete the folder under it; once the child ends too, the run is free."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from research.common.study_run import ROOT, claimed

    out, marker = tmp_path / "grpo-s0", tmp_path / "child.pid"
    study = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import pathlib, sys, types
sys.path.insert(0, {str(ROOT)!r})
import research.common.study_run as sr
sr.command = lambda *a: [sys.executable, "-c", \
"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(60)"]
sr.run_one(types.SimpleNamespace(root=pathlib.Path(sys.argv[1]), threads=1), \
{{"name": "grpo", "seed": 0, "settings": {{"model": "m"}}}})
""",
            str(tmp_path),
        ]
    )
    try:
        deadline = time.time() + 60
        while not (marker.exists() and marker.read_text()) and time.time() < deadline:
            time.sleep(0.1)
        child = int(marker.read_text())
        study.send_signal(signal.SIGKILL)
        study.wait()
        with claimed(out) as lock:
            assert lock is None  # the study is gone, its train.py is not: the run is still held
    finally:
        if marker.exists() and marker.read_text():
            os.kill(int(marker.read_text()), signal.SIGKILL)
    deadline = time.time() + 10
    while time.time() < deadline:
        with claimed(out) as lock:
            if lock is not None:
                break
        time.sleep(0.1)
    assert lock is not None, f"the run stayed held after its train.py ({child}) ended"


def test_a_runs_code_version_covers_its_credit_module_file():
    """An arm that trains through a --credit_module file (the signal-or-gate study's inverted control) is
    versioned with that file: an edit to it between seeds shows in the report; a dotted module name adds nothing."""
    from research.common.study_run import code_version

    assert code_version("research/signal-or-gate/inverted.py") != code_version() == code_version("some.module")


def test_each_invocation_records_the_machine_once(tmp_path, monkeypatch):
    """study_time.json names the machines a run's invocations ran on (processor, vector instructions,
    library versions): two invocations on one machine name it once, a second machine is added."""
    import json
    import sys
    from types import SimpleNamespace

    import research.common.study_run as sr

    run = {"name": "grpo", "seed": 0, "settings": {"model": "some/model", "method": "grpo"}}
    monkeypatch.setattr(sr, "command", lambda *a: [sys.executable, "-c", "raise SystemExit(1)"])
    monkeypatch.setattr(
        sr, "latest_checkpoint", lambda out: out / "checkpoint-4"
    )  # each invocation resumes the folder
    args = SimpleNamespace(root=tmp_path, threads=1)
    for _ in range(2):
        assert sr.run_one(args, run) == "failed"
    timing = json.loads((tmp_path / "grpo-s0" / "study_time.json").read_text())
    assert timing["invocations"] == 2 and timing["machines"] == [sr.machine()]
    assert {"cpu", "simd", "cores", "python", "torch"} <= set(timing["machines"][0])
    monkeypatch.setattr(sr, "machine", lambda: {"cpu": "another"})
    assert sr.run_one(args, run) == "failed"
    assert [m["cpu"] for m in json.loads((tmp_path / "grpo-s0" / "study_time.json").read_text())["machines"]][1:] == [
        "another"
    ]
