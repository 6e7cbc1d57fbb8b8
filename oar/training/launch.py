"""The one Accelerator both entry points use, and the way they end.

`accelerate launch --num_processes N` (with or without --multi_gpu) on a machine with no GPU starts
N processes, but accelerate only joins them into a gloo process group when told `cpu=True`;
without it each process silently trains alone. We say so whenever processes were launched and no
CUDA device exists, so the same command works on a laptop, in CI and on a GPU node.

When a process dies or stalls, the others must not wait for ever. A process that dies is seen by the
launcher (torchrun's agent, under `accelerate launch`), which sends every other process SIGTERM at
once and SIGKILL 30 s later; `stop_on_sigterm` turns that into a one-line exit. A process that stalls
(alive, not answering) is seen by nobody: the others block in their next collective until the process
group's timeout (OAR_COLLECTIVE_TIMEOUT, `config.collective_timeout`), then `lost_process` names what
happened, and the launcher then ends the stalled one. Either way the run stops with a message saying how to resume
(tests/package/test_lost_process.py), and without the interpreter's teardown (`exit_at_once`), which can
deadlock once a peer is lost. On GPUs NCCL's watchdog ends a process whose collective timed out
itself, with its own message.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from datetime import timedelta

import torch

from oar.training.config import collective_timeout


def make_accelerator(timeout: float | None = None, **kwargs):
    """The Accelerator; `timeout` (seconds; the run's collective_timeout()): how long a collective waits for
    the other processes before it raises (None: torch's default, 30 minutes for gloo, 10 for NCCL)."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    if kwargs.get(
        "log_with"
    ):  # a name that cannot log is check_config's to report (tracker_problem), not accelerate's
        kwargs["log_with"] = [name for name in kwargs["log_with"] if not tracker_problem(name)] or None
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=timeout))] if timeout else []
    return Accelerator(cpu=launched and not torch.cuda.is_available(), kwargs_handlers=handlers, **kwargs)


RESUME_HINT = "Run the same command with --resume to continue from the last checkpoint."  # train.py's


class Stopped(SystemExit):
    """SIGTERM arrived (`stop_on_sigterm`); its code is the message."""


def stop_on_sigterm(script: str, hint: str = RESUME_HINT) -> None:
    """Exit with a message on SIGTERM instead of dying silently: the launcher sends it to every process
    once one has failed (the failure is then reported above this line), a scheduler when it cancels a job.
    The handler raises `Stopped`, so the code unwinds as from an error (no checkpoint is half-written:
    they are written to a temporary name and renamed); the entry point then ends with `exit_at_once`.
    `hint`: what to do next (train.py's resumes; eval.py's starts again)."""

    def stop(signum, frame):
        raise Stopped(
            f"{script}: stopped by SIGTERM: the launcher stops every process once one of them has died "
            f"or failed, or the job was cancelled. {hint}"
        )

    signal.signal(signal.SIGTERM, stop)


def lost_process(err: BaseException, script: str, timeout: float, hint: str = RESUME_HINT) -> str | None:
    """The one-line message for an error raised by a collective operation whose peer process is gone
    (gloo: 'Connection closed by peer' at once when it died, 'Timed out waiting ...' when it stalled
    past the timeout; NCCL: a DistBackendError), or by the process group's start when a peer never
    joined it (a DistStoreError after the same timeout); None for any other error."""
    if not torch.distributed.is_available():
        return None
    text = str(err).strip()
    gloo = any(
        s in text
        for s in ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer", "Timed out waiting")
    )
    if not (isinstance(err, torch.distributed.DistError) or (torch.distributed.is_initialized() and gloo)):
        return None
    what = re.sub(
        r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else type(err).__name__
    )  # without gloo's source path
    what = what if len(what) <= 200 else what[:200].rsplit(" ", 1)[0] + " ..."  # cut between words, and said
    return (
        f"{script}: error: another process of this run died or stalled (a collective operation failed: {what}; "
        f"OAR_COLLECTIVE_TIMEOUT is {timeout:g} s). This process stops too. {hint}"
    )


def exit_at_once(message: str) -> None:
    """Write `message` and end this process now, without the interpreter's teardown: for a process whose
    peer died or stalled. Tearing down then can hang for ever: the main thread frees DDP's reducer and
    with it the gloo process group, whose destructor joins a worker thread that is still freeing the
    failed collective's tensors and waits for the interpreter lock the main thread holds (seen with
    py-spy: 2 of 5 stalled-peer runs of test_lost_process hung there). Checkpoints and summaries are
    renamed into place whole and metrics.jsonl is closed after every step's line, so they are kept; a
    tracker's last buffered events may be lost (docs/resuming.md)."""
    sys.stdout.flush()
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


THREADS = 1  # torch's threads per process when OMP_NUM_THREADS is unset (docs/speed.md, "Threads")


def default_threads() -> str | None:
    """With OMP_NUM_THREADS unset, run torch on THREADS threads, as `accelerate launch` does (it sets
    OMP_NUM_THREADS=1 unless told otherwise), and return the line that says so; None when the variable is set
    (torch reads it itself). Why one: torch's default is a thread per core, and on 2 cores that other jobs
    used two threads ran 1.4-10x slower than one (docs/bench/threads-cpu.json), on 2 idle cores at most 1.3x
    faster (docs/bench/threads-cpu-quiet.json): one is never the slow case by a multiple (docs/speed.md)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    torch.set_num_threads(THREADS)
    return (
        f"torch threads: {THREADS}, as accelerate launch sets them (OMP_NUM_THREADS is unset; two ran up to 1.3x "
        f"faster on idle cores, up to 10x slower on busy ones: docs/speed.md#threads); OMP_NUM_THREADS=2 sets two"
    )


def run_entry(main, cfg, script: str, parser, hint: str = RESUME_HINT, errors: tuple = ()) -> None:
    """Run an entry point's `main(cfg)` so that every way it ends says something: SIGTERM (`stop_on_sigterm`)
    and a lost peer (`lost_process`) end in one line and at once, Ctrl-C says what to do next (`hint`), a
    flag the user spelled another library's way is named as typed (`parser()`'s `as_typed`), the script's own
    user-facing `errors` become `script: error: ...`, and the process group ends before the interpreter.
    Torch's thread count is set first (`default_threads`), said by the first process."""
    if (threads := default_threads()) and os.environ.get("RANK", "0") == "0":
        print(threads, flush=True)
    stop_on_sigterm(script, hint)
    try:
        main(cfg)
    except Stopped as stop:  # the launcher's, once another process died: a teardown could hang (exit_at_once)
        exit_at_once(stop.code)
    except SystemExit as stop:
        if not isinstance(stop.code, str):
            raise
        raise SystemExit(parser().as_typed(stop.code, sys.argv[1:])) from None
    except KeyboardInterrupt:
        raise SystemExit(f"{script}: interrupted. {hint}") from None
    except errors as err:
        raise SystemExit(f"{script}: error: {err}") from None
    except RuntimeError as err:  # a collective (or the group's start) whose peer died or stalled
        if (message := lost_process(err, script, collective_timeout(), hint)) is None:
            raise
        exit_at_once(message)
    finally:
        release()  # after an error too: the process group ends before the interpreter does
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a launched process whose work is all written: no teardown
        finished()


def finished() -> None:
    """End a launched process that has finished its work (its files renamed into place, its trackers closed,
    its process group destroyed) without the interpreter's teardown, exit status 0. Under gloo the C++
    teardown can still abort the process after that ("terminate called without an active exception",
    exit -6, which the launcher reports as the run's failure): seen in 2 of 8 two-process FSDP2 runs of the
    test suite on a loaded machine, after `end` had already waited for every process."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def tracker_problem(name: str) -> str | None:
    """Why `--log_with name` cannot log, or None. Accelerate raises a bare ValueError on an unknown name
    and only warns, then trains with no tracker, when the tracker's package is missing: a run that
    was asked to log must not find out hours later that it did not."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    if name == "all":  # accelerate's name for every tracker installed
        return None
    if name not in LOGGER_TYPE_TO_CLASS:
        return (
            f"--log_with {name}: not a tracker; choose from {', '.join(LOGGER_TYPE_TO_CLASS)} or all "
            "(comma-separated; "
            f"tensorboard is installed by requirements.txt)."
        )
    if name not in {getattr(t, "value", t) for t in get_available_trackers()}:  # LoggerType members
        fix = (
            "pip install -r requirements.txt"
            if name == "tensorboard"
            else f"pip install {name.replace('_', '-')}, or use tensorboard (installed by requirements.txt)"
        )
        return f"--log_with {name}: its package is not installed; {fix}."
    return None


def end(accelerator) -> None:
    """A run's end, on every process: wait for the others, finish the trackers, destroy the process
    group. A gloo process that exits with its group alive can abort in C++ teardown ("terminate
    called without an active exception", exit -6) after its work is done: 3 of 22 two-process eval
    runs did without this, 0 of 44 with it."""
    accelerator.wait_for_everyone()
    accelerator.end_training()


def release() -> None:
    """Destroy the process group if one is still alive, without waiting for the other processes:
    for an exit on an error, which one process may meet alone (see `end`)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def gather_ragged(accelerator, values: torch.Tensor) -> torch.Tensor:
    """Every process's 1-D `values` concatenated in process order; the lengths may differ."""
    if accelerator.num_processes == 1:
        return values
    counts = accelerator.gather(torch.tensor([values.numel()], device=values.device))
    padded = accelerator.gather(accelerator.pad_across_processes(values, dim=0)).view(accelerator.num_processes, -1)
    return torch.cat([padded[k, : int(n)] for k, n in enumerate(counts.tolist())])
