"""scripts/bench/bench_update.py at a small size: the four ways of the update each run in a process of their own,
give today's loss and gradients to float rounding, and trimming the micro-batches to their own widths never
makes one wider than the step."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import bench_update  # noqa: E402


@pytest.mark.slow  # four processes, each importing torch and transformers
def test_the_four_ways_agree_and_each_is_measured(tmp_path):
    out = tmp_path / "u.json"
    res = bench_update.main(
        ["--rows", "4", "--micro", "2", "--max_len", "24", "--vocab", "512", "--repeats", "1", "--json", str(out)]
    )
    assert set(res["variants"]) == {"today", "trim", "head", "both"}
    assert max(res["micro_batch_widths"]) <= res["step_width"]
    for name, v in res["variants"].items():
        assert v["vs_today"]["loss_abs_diff"] <= 1e-5 * max(1.0, abs(res["variants"]["today"]["loss"])), name
        assert v["vs_today"]["grad_max_abs_diff_rel"] <= 1e-5, name
        assert v["peak_extra_bytes"] >= 0 and v["wall_s_median"] > 0, name  # tiny tensors may fit the heap as it is
    assert out.exists()
