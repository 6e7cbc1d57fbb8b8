"""A two-process run that loses a process stops within a bounded time, says so, leaves no process
behind, and `--resume` continues it to the numbers of an uninterrupted run (docs/resuming.md).

Rank 1 is killed (SIGKILL) or stopped (SIGSTOP: alive, never answering, as a hung process is) in the
middle of step 2, once step 1 is logged and checkpointed. A killed rank is seen by the launcher, which
stops rank 0 at once (SIGTERM; oar/training/launch.py's stop_on_sigterm) unless gloo's closed socket
stops it first. A stopped rank is seen by nobody: rank 0 waits in its next collective until
OAR_COLLECTIVE_TIMEOUT, exits with a message, and the launcher then kills the stopped rank (SIGTERM,
which a stopped process does not act on, then SIGKILL 30 s later). Nothing in the code knows about
the test: the signals are real. eval.py, which has nothing to resume, stops the same way, whether a process never
joins or is lost mid-evaluation (the eval.py tests); there the stopped rank is let run again once the launcher's
SIGTERM waits in it (`continue_once_told_to_stop`), which ends it at once instead of 30 s later: train.py's test
keeps the launcher's SIGKILL of a rank that never runs again, the same launcher path for both scripts.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tinyrun import (
    EVAL,
    TINY,
    assert_same_metrics,
    check_ok,
    finish,
    kill_all,
    launch,
    launch_command,
    marked,
    metrics,
    run_inprocess,
    spawn,
)

# OAR_COLLECTIVE_TIMEOUT here: a tiny step is ~1 s, so no healthy wait comes near it, even on a loaded machine
TIMEOUT = 20
MARGIN = 30  # seconds of slack on a loaded 2-core machine, for a process to notice and exit
GRACE = 30  # torchrun's wait between its SIGTERM and its SIGKILL of a process that did not exit


def _args(model, out):
    return [
        "--model",
        str(model),
        "--dataset",
        str(model / "data.jsonl"),
        "--output_dir",
        str(out),
        "--steps",
        "3",
        "--save_every",
        "1",
        "--micro_batch_size",
        "4",
        "--method",
        "oar-p",
        *TINY,
    ]


@pytest.fixture(scope="module", autouse=True)
def short_timeout():
    """This module's runs (in this process and launched) wait TIMEOUT seconds at a collective, not an hour."""
    before = os.environ.get("OAR_COLLECTIVE_TIMEOUT")
    os.environ["OAR_COLLECTIVE_TIMEOUT"] = str(TIMEOUT)
    yield
    if before is None:
        del os.environ["OAR_COLLECTIVE_TIMEOUT"]
    else:
        os.environ["OAR_COLLECTIVE_TIMEOUT"] = before


@pytest.fixture(scope="module")
def uninterrupted(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_inprocess(_args(tiny_model, out))
    return metrics(out)


def _ranks(token: str, script: str = "train.py") -> dict[int, int]:
    """{local rank: pid} of the run's `script` processes."""
    ranks = {}
    for pid, cmd in marked(token).items():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = [v.split(b"=", 1)[1] for v in environ if v.startswith(b"LOCAL_RANK=")]
        if script in cmd and rank:
            ranks[int(rank[0])] = pid
    return ranks


def continue_once_told_to_stop(pid: int, timeout: float) -> None:
    """Wait until a SIGTERM is pending in stopped process `pid` (the launcher's, after another rank exited), then
    let it run again (SIGCONT): it acts on the SIGTERM as a hung process that wakes up would, and exits."""
    sigterm = 1 << (signal.SIGTERM - 1)

    def pending() -> bool:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:  # gone already
            return True
        masks = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
        return any(m & sigterm for m in masks)

    _wait(pending, timeout, f"the launcher's SIGTERM to reach process {pid}")
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(0.05)
    raise AssertionError(f"waited {timeout} s for {what}")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stalled"])
def test_a_lost_process_stops_the_run_with_a_message_and_resume_continues_it(tiny_model, tmp_path, uninterrupted, sig):
    out = tmp_path / "run"
    proc, token = spawn(launch_command(_args(tiny_model, out), num_processes=2))
    try:
        logged = lambda: (out / "metrics.jsonl").is_file() and '"step": 1' in (out / "metrics.jsonl").read_text()
        _wait(
            lambda: logged() and (out / "checkpoint-1").is_dir() and len(_ranks(token)) == 2,
            240,
            "step 1 logged and checkpointed",
        )
        ranks = _ranks(token)
        os.kill(ranks[1], sig)  # during step 2
        lost = time.monotonic()
        _wait(
            lambda: (
                not Path(f"/proc/{ranks[0]}").exists() or Path(f"/proc/{ranks[0]}/stat").read_text().split()[2] == "Z"
            ),
            TIMEOUT + MARGIN,
            "rank 0 to exit",
        )
        survivor_s = time.monotonic() - lost
        done = finish(proc, token, timeout=GRACE + MARGIN)
        left = marked(token)  # before any clean-up of ours: the launcher and both ranks must be gone
    finally:
        kill_all(proc, token)
    assert not left, left
    assert done.returncode != 0
    # Within the collective timeout plus a margin, either way: after a SIGKILL torchrun SIGTERMs rank 0 at once, but
    # a rank inside a gloo collective runs its handler only when the call returns (the peer's closed socket, or the
    # timeout): CI measured 30.2 s on a killed peer, so a tighter bound for that case would be a bet on the load.
    assert survivor_s <= TIMEOUT + MARGIN, survivor_s
    # rank 0 exited non-zero (the launcher's report lists every rank's exit code: 1, or -15 when the launcher's
    # SIGTERM reached it while the interpreter was shutting down, its message written) with the one-line message
    code = re.search(rf"exitcode\s*:\s*(-?\d+) \(pid: {ranks[0]}\)", done.stderr)
    assert code and int(code.group(1)) != 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("train.py: ")]
    assert said and all("--resume" in line for line in said), done.stderr[-3000:]
    if sig == signal.SIGSTOP:  # only the timeout could end it
        assert any("died or stalled" in line and f"OAR_COLLECTIVE_TIMEOUT is {TIMEOUT} s" in line for line in said), (
            said
        )
    # a message, not a traceback: the only one is the launcher's own (ChildFailedError, its report)
    assert done.stderr.count("Traceback (most recent call last)") <= 1 and not re.search(
        r"\[rank\d\]:\s*Traceback", done.stderr
    ), done.stderr[-3000:]
    # The resumed run continues from the last complete checkpoint to the uninterrupted run's numbers.
    check_ok(launch(_args(tiny_model, out) + ["--resume"], num_processes=2))
    assert_same_metrics(metrics(out), uninterrupted)


def test_a_timed_out_run_leaves_nothing_behind_even_in_another_session():
    """What torchrun does to its ranks, by hand: the child starts a grandchild in a session of its own and
    hangs. The launch helper's timeout must kill both (the grandchild through the mark it inherited)."""
    code = (
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
        "start_new_session=True); time.sleep(120)"
    )
    proc, token = spawn([sys.executable, "-c", code])
    _wait(lambda: len(marked(token)) == 2, 60, "the child and its grandchild")
    with pytest.raises(subprocess.TimeoutExpired):
        finish(proc, token, timeout=1)
    _wait(lambda: not marked(token), 10, "both to be killed")


@pytest.mark.slow
def test_eval_py_with_a_process_that_never_joins_stops_at_its_collective_timeout(tiny_model, tmp_path):
    """eval.py has train.py's OAR_COLLECTIVE_TIMEOUT and its way to stop: rank 1 is stopped as soon as it exists
    (long before it joins the process group), so rank 0 waits in the group's start until the timeout, then
    says so in one line, and the launcher's SIGTERM ends the stopped rank once it runs again (gloo's default wait
    would be 30 minutes)."""
    args = [
        "--model",
        str(tiny_model),
        "--dataset",
        str(tiny_model / "data.jsonl"),
        "--output_dir",
        str(tmp_path / "eval"),
        "--instruction",
        "",
        "--max_new_tokens",
        "20",
    ]
    proc, token = spawn(launch_command(args, num_processes=2, script=EVAL))
    try:
        ranks = _wait(lambda: r if len(r := _ranks(token, "eval.py")) == 2 else None, 120, "both ranks")
        os.kill(ranks[1], signal.SIGSTOP)
        stalled = time.monotonic()
        _wait(
            lambda: (
                not Path(f"/proc/{ranks[0]}").exists() or Path(f"/proc/{ranks[0]}/stat").read_text().split()[2] == "Z"
            ),
            TIMEOUT + MARGIN + 30,
            "rank 0 to exit",
        )  # + 30: rank 0 imports torch and loads the model before it waits
        survivor_s = time.monotonic() - stalled
        continue_once_told_to_stop(ranks[1], MARGIN)
        done = finish(proc, token, timeout=MARGIN)
        left = marked(token)
    finally:
        kill_all(proc, token)
    assert not left, left
    assert done.returncode != 0 and TIMEOUT <= survivor_s <= TIMEOUT + MARGIN + 30, (done.returncode, survivor_s)
    said = [line for line in done.stderr.splitlines() if line.startswith("eval.py: ")]
    assert len(said) == 1 and "died or stalled" in said[0] and f"OAR_COLLECTIVE_TIMEOUT is {TIMEOUT} s" in said[0], (
        done.stderr[-3000:]
    )
    assert "starts over" in said[0] and "--resume" not in said[0]  # an evaluation has nothing to resume
    assert not re.search(r"\[rank\d\]:\s*Traceback", done.stderr), done.stderr[-3000:]


# Run before eval.py in each launched process: its evaluation, as it starts, leaves a file named by the rank
MARK_EVALUATING = """
import os, runpy, sys
from pathlib import Path
import oar.training.evaluation as evaluation

real = evaluation.evaluate


def evaluate(*args, **kwargs):
    Path({folder!r}, "evaluating-" + os.environ["LOCAL_RANK"]).touch()
    return real(*args, **kwargs)


evaluation.evaluate = evaluate  # eval.py imports it by name after this
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stalled"])
def test_eval_py_that_loses_a_process_mid_evaluation_stops_with_a_message(tiny_model, tmp_path, sig):
    """eval.py's rank 1 is killed or stopped during the evaluation: half a second after rank 0 started it (a
    prelude run before eval.py leaves a file as evaluate starts: the model loaded, the process group joined), into
    seconds of sampling. Rank 0 evaluates its share, then waits in the evaluation's gather of the records, which
    fails at once on a killed peer's closed socket (or the launcher's SIGTERM) and after OAR_COLLECTIVE_TIMEOUT on
    a stopped one; either way eval.py ends in train.py's one line, nothing is written and no process is left."""
    args = [
        "--model",
        str(tiny_model),
        "--dataset",
        str(tiny_model / "data.jsonl"),
        "--output_dir",
        str(tmp_path / "eval"),
        "--instruction",
        "",
        "--max_new_tokens",
        "64",
        "--eval_samples",
        "64",
        "--eval_temperature",
        "1.5",
        "--eval_batch_size",
        "64",  # 15 sampling calls of 64 rows a rank: seconds of evaluation on either side of the signal
    ]
    script = tmp_path / "marking_eval.py"  # eval.py run after the prelude, in each launched process
    script.write_text(MARK_EVALUATING.format(folder=str(tmp_path), script=str(EVAL)))
    proc, token = spawn(launch_command(args, num_processes=2, script=script))
    try:
        ranks = _wait(
            lambda: r if len(r := _ranks(token, "eval.py")) == 2 and (tmp_path / "evaluating-0").exists() else None,
            180,
            "rank 0 to start evaluating",
        )
        time.sleep(0.5)  # into the evaluation
        os.kill(ranks[1], sig)
        lost = time.monotonic()
        _wait(
            lambda: (
                not Path(f"/proc/{ranks[0]}").exists() or Path(f"/proc/{ranks[0]}/stat").read_text().split()[2] == "Z"
            ),
            TIMEOUT + MARGIN + 60,
            "rank 0 to exit",
        )  # + 60: rank 0 first evaluates its own share
        survivor_s = time.monotonic() - lost
        if sig == signal.SIGSTOP:
            continue_once_told_to_stop(ranks[1], MARGIN)
        done = finish(proc, token, timeout=MARGIN)
        left = marked(token)
    finally:
        kill_all(proc, token)
    assert not left, left
    assert done.returncode != 0 and survivor_s <= TIMEOUT + MARGIN + 60, (done.returncode, survivor_s)
    if sig == signal.SIGSTOP:  # only the timeout could end it
        assert survivor_s >= TIMEOUT, survivor_s
    said = [line for line in done.stderr.splitlines() if line.startswith("eval.py: ")]
    assert said and all("starts over" in line and "--resume" not in line for line in said), done.stderr[-3000:]
    if sig == signal.SIGSTOP:
        assert any("died or stalled" in line and f"OAR_COLLECTIVE_TIMEOUT is {TIMEOUT} s" in line for line in said), (
            said
        )
    assert not (tmp_path / "eval" / "eval.jsonl").exists()  # nothing partial
    assert not re.search(r"\[rank\d\]:\s*Traceback", done.stderr), done.stderr[-3000:]


def test_a_long_collective_error_is_cut_between_words_and_says_so(monkeypatch):
    """The message quotes the collective's first line, at most about 200 characters: cut at a space, with '...'."""
    import torch

    from oar.training.launch import lost_process

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    words = "[../gloo/transport/pair.cc:534] Connection closed by peer " + " ".join(f"word{i}" for i in range(80))
    message = lost_process(RuntimeError(words), "train.py", 600)
    quoted = message.split("failed: ", 1)[1].split("; OAR_COLLECTIVE_TIMEOUT", 1)[0]
    assert quoted.startswith("Connection closed by peer word0") and quoted.endswith(" ...") and len(quoted) <= 204
    assert words.split("] ", 1)[1].startswith(quoted[:-4] + " ")  # whole words only


def test_each_way_an_entry_point_ends_says_something(monkeypatch):
    """launch.run_entry (train.py's and eval.py's __main__): Ctrl-C says what to do next, the script's own
    errors and a flag typed another library's way end in one line, an exit code passes through, any other
    error keeps its traceback, and the process group is released whichever way it ended."""
    import signal
    from types import SimpleNamespace

    from oar.training import launch

    released = []
    monkeypatch.setattr(launch, "release", lambda: released.append(1))
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # stop_on_sigterm's handler stays out of pytest
    cfg = SimpleNamespace()
    parser = lambda: SimpleNamespace(as_typed=lambda message, argv: f"typed: {message}")  # noqa: E731

    def ending(exc):
        def main(_):
            raise exc

        try:
            launch.run_entry(main, cfg, "eval.py", parser, "Start again.", errors=(KeyError,))
        except BaseException as out:  # noqa: BLE001 (what the script would end with)
            return out

    assert ending(KeyboardInterrupt()).code == "eval.py: interrupted. Start again."
    assert ending(KeyError("no such reward")).code == "eval.py: error: 'no such reward'"
    assert ending(SystemExit("bad flag")).code == "typed: bad flag"
    assert ending(SystemExit(3)).code == 3
    assert isinstance(ending(ValueError("a bug")), ValueError)
    assert isinstance(ending(RuntimeError("not a collective")), RuntimeError)  # lost_process: None
    assert len(released) == 6
