"""scripts/bench/fsdp_memory.py on 2 gloo CPU processes: the real shards hold what the count says, and
the DDP and FSDP2 steps it compares are the same step (their losses agree)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

import fsdp_memory  # noqa: E402


@pytest.mark.slow
def test_two_cpu_ranks_shard_as_counted_and_run_the_same_step(tmp_path):
    report = fsdp_memory.main(["--device", "cpu", "--size", "tiny", "--world", "2", "--out", str(tmp_path / "m.json")])
    ddp, fsdp = (next(m for m in report["measured"] if m["mode"] == mode) for mode in ("ddp", "fsdp2"))
    assert ddp["world"] == fsdp["world"] == 2 and fsdp["param_optimizer_bytes"] < ddp["param_optimizer_bytes"]
    assert abs(fsdp["loss"] - ddp["loss"]) <= 2e-2 * ddp["loss"] and ddp["loss"] > 1.0
    assert json.loads((tmp_path / "m.json").read_text())["per_rank"][1]["world"] == 2
