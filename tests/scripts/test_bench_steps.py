"""scripts/bench/bench_steps.py's training-step timing: every method runs the same steps in interleaved
rounds, and the CPU ratio is the median over rounds of the paired per-round ratios."""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import bench_steps as bp  # noqa: E402


def test_cpu_ratios_pair_each_round_with_grpos_and_take_the_median(tiny_model):
    settings = dict(model=str(tiny_model), prompts_per_step=2, group_size=2, max_new_tokens=8, micro_batch_size=4)
    st = bp.train_steps(settings, ["grpo", "oar-g"], steps=2, repeats=3)
    cpu, rounds = st["step_cpu_s"], st["cpu_ratio_vs_grpo_by_round"]["oar-g"]
    assert len(cpu["grpo"]) == len(cpu["oar-g"]) == 3  # 3 rounds x 1 timed step (the first of each run dropped)
    want = [a / b for a, b in zip(cpu["oar-g"], cpu["grpo"])]
    assert rounds == want and st["cpu_ratio_vs_grpo"]["oar-g"] == statistics.median(want)
    assert (
        st["details"]["oar-g"]["completion_length"] == st["details"]["grpo"]["completion_length"]
    )  # the same rollouts
    assert st["same_rollouts"] and st["rollouts_differ"] == []


def test_a_method_that_samples_other_rollouts_is_named(tiny_model, monkeypatch):
    """The ratios mean something only over the same work: a method whose steps got other rewards or
    lengths (here: cut at 2 new tokens instead of 8) is named in rollouts_differ."""
    from oar.training.config import Config

    settings = dict(model=str(tiny_model), prompts_per_step=2, group_size=2, max_new_tokens=8, micro_batch_size=4)
    real = Config.__init__

    def shorter(self, **kw):
        real(self, **{**kw, "max_new_tokens": 2 if kw.get("method") == "oar-g" else kw["max_new_tokens"]})

    monkeypatch.setattr(Config, "__init__", shorter)
    st = bp.train_steps(settings, ["grpo", "oar-g"], steps=2, repeats=1)
    assert not st["same_rollouts"] and st["rollouts_differ"] == ["oar-g"]


def test_the_trl_side_runs_bench_trl_py_with_the_same_settings(tiny_model, tmp_path):
    """--trl_python's command: scripts/bench/bench_trl.py (it moved once and the command kept the old
    path), the step settings of our runs, its JSON read back. The stand-in python records what it ran."""
    import json
    import stat

    fake = tmp_path / "python"
    fake.write_text(
        "#!" + sys.executable + "\n"
        "import json, pathlib, sys\n"
        "script, args = pathlib.Path(sys.argv[1]), sys.argv[2:]\n"
        "assert script.is_file(), script\n"
        "out = args[args.index('--json') + 1]\n"
        f"pathlib.Path({str(tmp_path / 'ran.json')!r}).write_text(json.dumps([script.name] + args))\n"
        "json.dump({'step_seconds': [9.0, 2.0], 'completion_length': [8, 7], 'trl_version': 'x'}, open(out, 'w'))\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    settings = dict(model=str(tiny_model), prompts_per_step=2, group_size=2, max_new_tokens=8, micro_batch_size=4)
    st = bp.train_steps(settings, ["grpo"], steps=2, repeats=1, trl_python=str(fake), trl_model="m")
    ran = json.loads((tmp_path / "ran.json").read_text())
    assert ran[0] == "bench_trl.py" and "--prompts_per_step=2" in ran and "--max_new_tokens=8" in ran
    assert st["step_s"]["trl"] == [2.0] and st["details"]["trl"]["completion_length"] == 7
