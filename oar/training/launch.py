"""The one Accelerator both entry points use, and the way they end.

`accelerate launch --num_processes N` (with or without --multi_gpu) on a machine with no GPU starts
N processes, but accelerate only joins them into a gloo process group when told `cpu=True`;
without it each process silently trains alone. We say so whenever processes were launched and no
CUDA device exists, so the same command works on a laptop, in CI and on a GPU node.
"""

from __future__ import annotations

import os

import torch


def make_accelerator(**kwargs):
    from accelerate import Accelerator

    if kwargs.get("log_with"):  # a name that cannot log is check_config's to report (tracker_problem), not accelerate's
        kwargs["log_with"] = [name for name in kwargs["log_with"] if not tracker_problem(name)] or None
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return Accelerator(cpu=launched and not torch.cuda.is_available(), **kwargs)


def tracker_problem(name: str) -> str | None:
    """Why `--log_with name` cannot log, or None. Accelerate raises a bare ValueError on an unknown name
    and only warns, then trains with no tracker, when the tracker's package is missing: a run that
    was asked to log must not find out hours later that it did not."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    if name == "all":  # accelerate's name for every tracker installed
        return None
    if name not in LOGGER_TYPE_TO_CLASS:
        return (f"--log_with {name}: not a tracker; choose from {', '.join(LOGGER_TYPE_TO_CLASS)} or all (comma-separated; "
                f"tensorboard is installed by requirements.txt).")
    if name not in {getattr(t, "value", t) for t in get_available_trackers()}:  # LoggerType members
        fix = "pip install -r requirements.txt" if name == "tensorboard" else \
            f"pip install {name.replace('_', '-')}, or use tensorboard (installed by requirements.txt)"
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
