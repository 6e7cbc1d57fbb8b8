"""scripts/bench/bench_parts.py's training-step timing: every method runs the same steps in interleaved
rounds, and the CPU ratio is the median over rounds of the paired per-round ratios."""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

import bench_parts as bp  # noqa: E402


def test_cpu_ratios_pair_each_round_with_grpos_and_take_the_median(tiny_model):
    settings = dict(model=str(tiny_model), prompts_per_step=2, group_size=2, max_new_tokens=8, micro_batch_size=4)
    st = bp.train_steps(settings, ["grpo", "oar-g"], steps=2, repeats=3)
    cpu, rounds = st["step_cpu_s"], st["cpu_ratio_vs_grpo_by_round"]["oar-g"]
    assert len(cpu["grpo"]) == len(cpu["oar-g"]) == 3  # 3 rounds x 1 timed step (the first of each run dropped)
    want = [a / b for a, b in zip(cpu["oar-g"], cpu["grpo"])]
    assert rounds == want and st["cpu_ratio_vs_grpo"]["oar-g"] == statistics.median(want)
    assert st["details"]["oar-g"]["completion_length"] == st["details"]["grpo"]["completion_length"]  # the same rollouts
