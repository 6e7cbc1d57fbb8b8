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

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return Accelerator(cpu=launched and not torch.cuda.is_available(), **kwargs)


def end(accelerator) -> None:
    """Wait for every process, finish the trackers and destroy the process group. A gloo process that
    exits with its group alive can abort in C++ teardown ("terminate called without an active
    exception", exit -6) after its work is done: 2 of 12 two-process eval runs did, before this."""
    accelerator.wait_for_everyone()
    accelerator.end_training()
