"""The one Accelerator both entry points use.

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
