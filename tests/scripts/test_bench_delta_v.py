"""scripts/bench/bench_delta_v.py: both ways of making one rollout's ΔV values give the same rewards, and the
skipping one samples fewer pairs (tiny-arith, seconds)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import bench_delta_v  # noqa: E402


def test_the_benchmark_compares_the_same_rewards_made_two_ways(tmp_path):
    res = bench_delta_v.main(
        [
            "--problems",
            "2",
            "--group_size",
            "2",
            "--k",
            "4",
            "--max_new_tokens",
            "48",
            "--temperature",
            "1.0",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    assert res["same_rewards"] and 0 < res["pairs_sampled"] < res["pairs"] == res["prefixes"] * 4
    assert (tmp_path / "r.json").is_file() and res["ratio"] > 0
