"""scripts/bench/bench_lora.py on the tests' tiny model: both settings run in alternating order, step 1
is checked to sample the same rollouts in both, and each run's LoRA/full ratios come with their median."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import bench_lora  # noqa: E402


@pytest.mark.slow
def test_two_runs_alternate_and_pair_the_same_first_step(tiny_model, tmp_path):
    res = bench_lora.main(
        [
            "--model",
            str(tiny_model),
            "--runs",
            "2",
            "--lora_r",
            "4",
            "--work",
            str(tmp_path / "w"),
            "--out",
            str(tmp_path / "lora.json"),
        ]
    )
    assert [r["order"] for r in res["runs"]] == ["lora,full", "full,lora"]
    for r in res["runs"]:
        assert (
            r["lora"]["step1"] == r["full"]["step1"]
            and r["lora"]["optimizer_state_bytes"] < r["full"]["optimizer_state_bytes"]
        )
    assert set(res["lora_over_full_median"]) == {"step_s", "rollout_s", "update_s"}
