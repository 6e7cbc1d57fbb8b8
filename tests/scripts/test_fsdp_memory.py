"""scripts/bench/fsdp_memory.py on 2 gloo CPU processes: the real shards hold what the count says (the
script asserts it), a rank holds about half of DDP's parameters and AdamW states, and it writes its report."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import fsdp_memory  # noqa: E402


@pytest.mark.slow
def test_two_cpu_ranks_shard_as_counted(tmp_path):
    report = fsdp_memory.main(["--device", "cpu", "--size", "tiny", "--world", "2", "--out", str(tmp_path / "m.json")])
    ddp, fsdp = (next(m for m in report["measured"] if m["mode"] == mode) for mode in ("ddp", "fsdp2"))
    assert ddp["world"] == fsdp["world"] == 2
    assert 0.5 <= fsdp["param_optimizer_bytes"] / ddp["param_optimizer_bytes"] <= 0.52  # half the rows, padded
    assert json.loads((tmp_path / "m.json").read_text())["per_rank"][1]["world"] == 2
