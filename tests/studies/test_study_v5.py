"""research/testbeds_v5/study_v5.py's plan and research/testbeds_v5/attribution_v5.py on the session's briefly
trained tiny model."""

import itertools
import math

import numpy as np
import pytest

import torch

from oar.tasks.arith import ArithConfig
from oar.credit import METHODS
from oar.tasks.testbeds import TESTBEDS


def test_plan_puts_seed_0_of_everything_first_with_one_budget(tmp_path):
    from research.testbeds_v5.study_v5 import parse_args, plan

    runs = plan(parse_args(["--root", str(tmp_path)]))
    assert len(runs) == 6 * 3 * 5 and {r["seed"] for r in runs[:18]} == {0}
    assert (
        len(
            {
                (r["settings"]["steps"], r["settings"].get("prompts_per_step"), r["settings"].get("group_size"))
                for r in runs
            }
        )
        == 1
    )
    assert {r["settings"]["max_new_tokens"] for r in runs if r["testbed"] == "filler"} == {96}


def test_attribution_v5_weighs_the_same_rollouts_with_every_method(tiny_model, monkeypatch):
    from oar.training.models import load_model
    from research.testbeds_v5 import attribution_v5

    model, tok = load_model(str(tiny_model))
    torch.manual_seed(0)
    # The methods are exercised only on rollouts whose group has mixed rewards (advantage != 0). Whether the session's
    # tiny model gets some of a group right depends on what it learned, which varies with the CPU's rounding (one
    # machine's model sampled 0 of 24 right; another training of it gets whole groups right or wrong, no group mixed,
    # on these 8 problems). So the rewards alternate 1, 0, 1, 0 in sampling order: every group of 4 is mixed on any
    # machine. The texts, outcomes and weights stay the model's own; only which rollouts count and their signs are set.
    monkeypatch.setattr(attribution_v5, "reward", lambda text, gold, it=itertools.cycle([1.0, 0.0]): next(it))
    out = attribution_v5.run(
        model,
        tok,
        TESTBEDS["slip"],
        prompts=8,
        group_size=4,
        arith=ArithConfig(min_ops=1, max_ops=1, start_digits=1, ops=("+", "*")),
    )
    table = {r["method"]: r for r in out["table"]}
    assert list(table) == list(METHODS) and out["sample_accuracy"] == 0.5  # the alternating rewards were used
    used = table["grpo"]["rollouts"]
    assert used > 0 and all(r["rollouts"] == used for r in table.values())
    assert table["grpo"]["roc_auc"] == 0.5 and table["grpo"]["w_other"] == 1.0  # all ones: chance, weight 1
    assert table["entropy-mask"]["w_other"] <= 1.0 and table["grpo"]["frac_negative"] == 0
    assert all(math.isnan(r["w_fork"]) and r["w_fork_n"] == 0 for r in table.values())  # slip plants no fork
    for r in table.values():  # standard errors clustered by prompt: at most 8 clusters behind each
        assert r["w_other_n"] == used and (r["w_other_se"] >= 0 or math.isnan(r["w_other_se"]))


def test_clustered_standard_error_by_hand():
    from research.testbeds_v5.attribution_v5 import clustered_mean

    # mean 2.5; cluster sums of deviations -2 and +2: sqrt((4 + 4) * 2 / 1) / 4 = 1
    assert clustered_mean([1.0, 2.0, 3.0, 4.0], [0, 0, 1, 1], "x") == {"x": 2.5, "x_n": 4, "x_se": 1.0}
    # the same values as independent clusters:
    # the usual s.e. times sqrt((G-1)/G * G/(G-1)) = std/sqrt(n) * sqrt(3/4 * 4/3)
    independent = clustered_mean([1.0, 2.0, 3.0, 4.0], [0, 1, 2, 3], "x")["x_se"]
    assert math.isclose(independent, float(np.std([1, 2, 3, 4], ddof=1) / 2))
    assert clustered_mean([math.nan, 1.0], [0, 1], "x") == {"x": 1.0, "x_n": 1}  # one value: no s.e.
    assert clustered_mean([math.nan], [0], "x") == {"x_n": 0}


def test_report_v5_pairs_seeds_and_labels_a_partial_study(tmp_path):
    import json

    from research.testbeds_v5 import report_v5

    runs = [
        {"name": f"fork/{m}", "testbed": "fork", "method": m, "seed": s, "settings": {}}
        for s in (0, 1, 2)
        for m in ("grpo", "tempo")
    ]
    (tmp_path / "plan.json").write_text(
        json.dumps({"runs": runs, "settings": {"steps": 2, "eval_every": 1}, "command": "x"})
    )
    after = {
        ("grpo", 0): 0.40,
        ("grpo", 1): 0.50,
        ("tempo", 0): 0.45,
        ("tempo", 1): 0.52,
        ("grpo", 2): 0.3,
    }  # tempo seed 2 unfinished
    for (m, s), acc in after.items():
        d = tmp_path / "fork" / f"{m}-s{s}"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"method": m}))
        (d / "summary.json").write_text(json.dumps({"steps": 2, "accuracy_before": 0.2, "accuracy_after": acc}))
        evals = {1: {"eval/accuracy": acc / 2}, 2: {}}  # an evaluation at step 1
        reward = {1: acc, 2: acc + 0.1}  # the sampled train reward of each step
        (d / "metrics.jsonl").write_text(
            "".join(
                json.dumps(
                    {"step": k, "reward/mean": reward[k], "time/step_s": 1.0, "policy/entropy": acc * k} | evals[k]
                )
                + "\n"
                for k in (1, 2)
            )
        )
        (d / "study_time.json").write_text(json.dumps({"seconds": 10.0, "cpu_seconds": 8.0}))
    evals = [
        ("Compute ((1 + 2) + 3) + 4.", "1 + 2 = 3\n3 + 3 = 6\n#### 6"),  # 3 operations, answered one line early
        ("Compute ((1 + 2) + 3) + 4.", "1 + 2 = 3\n3 + 3 = 6\n6 + 4 = 10\n#### 10"),  # 3 operations, went on
        ("Compute 2 * 3.", "2 * 3 = 7\n#### 7"),  # a slip
        ("Compute (5 - 1) - 1.", "5 - 1 = 4\n4 - 1 = 3\n#### 3"),
    ]
    (tmp_path / "fork" / "grpo-s0" / "eval_final.jsonl").write_text(
        "".join(json.dumps({"problem": q, "completion": c}) + "\n" for q, c in evals)
    )
    summary = report_v5.write(tmp_path, tmp_path / "out")
    assert summary["status"] == "PARTIAL: 5 of 6 runs finished"
    flaws = summary["testbeds"]["fork"]["grpo"]["flaws"]  # seed 0 kept its completions, seeds 1-2 did not
    assert (
        flaws["early_answers_3op"]["mean"] == 0.5
        and flaws["with_slip"]["mean"] == 0.25
        and flaws["with_slip"]["n"] == 1
    )
    assert summary["testbeds"]["fork"]["tempo"]["flaws"]["with_slip"]["n"] == 0
    tempo = summary["testbeds"]["fork"]["tempo"]
    # paired over seeds 0 and 1 only (tempo has no seed 2): +0.05, +0.02 -> mean 0.035, se 0.015
    assert tempo["paired_diff_vs_grpo"]["n"] == 2
    assert (
        abs(tempo["paired_diff_vs_grpo"]["mean"] - 0.035) < 1e-9
        and abs(tempo["paired_diff_vs_grpo"]["se"] - 0.015) < 1e-9
    )
    assert summary["testbeds"]["fork"]["grpo"]["seeds"] == [0, 1, 2]
    # the same pairing at every evaluation: step 2 is the final; at step 1 +0.025, +0.01 -> 0.0175 ± 0.0075
    curve = tempo["paired_curve_vs_grpo"]
    assert curve["2"] == tempo["paired_diff_vs_grpo"] and curve["1"]["n"] == 2
    assert abs(curve["1"]["mean"] - 0.0175) < 1e-9 and abs(curve["1"]["se"] - 0.0075) < 1e-9
    # the train reward between evaluations, paired the same way:
    # steps 1-1 and 2-2 differ as the finals, +0.05 and +0.02
    assert (
        abs(tempo["final_policy_entropy"]["mean"] - (0.45 * 1.5 + 0.52 * 1.5) / 2) < 1e-9
    )  # mean over the last steps, then seeds
    reward = tempo["paired_train_reward_vs_grpo"]
    assert set(reward) == {"1-1", "2-2"} and all(
        abs(reward[w]["mean"] - 0.035) < 1e-9 and reward[w]["n"] == 2 for w in reward
    )
    assert "PARTIAL" in (tmp_path / "out" / "README.md").read_text() and (tmp_path / "out" / "accuracy.png").exists()
    strict = json.loads(
        (tmp_path / "out" / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON")
    )
    assert strict["testbeds"]["fork"]["tempo"]["std"] is not None


def test_report_v5_from_the_ledger_alone(tmp_path):
    import json

    from research.testbeds_v5 import report_v5

    for m, acc in (("grpo", 0.40), ("tempo", 0.45), ("oar-g+tempo", 0.47)):  # the last is beyond the plan
        d = tmp_path / "runs" / "fork" / f"{m}-s0"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"method": m}))
        (d / "summary.json").write_text(json.dumps({"steps": 60, "accuracy_before": 0.2, "accuracy_after": acc}))
        (d / "metrics.jsonl").write_text(json.dumps({"step": 60, "reward/mean": 0.5, "time/step_s": 1.0}) + "\n")
        code = ["bbb"] if m == "oar-g+tempo" else ["aaa"]  # made by a later version of the code
        (d / "study_time.json").write_text(json.dumps({"seconds": 10.0, "cpu_seconds": 8.0, "code": code}))
    (tmp_path / "builds").mkdir()
    build = {
        "heldout_accuracy": 0.2,
        "heldout_problems": 500,
        "build_seconds": 600.0,
        "build_cpu_seconds": 500.0,
        "torch_threads": 1,
    }
    (tmp_path / "builds" / "fork.json").write_text(json.dumps(build | {"recipe": {}, "weights_sha256": "ab"}))
    summary = report_v5.write(tmp_path, tmp_path / "out", ledger=True)
    assert summary["status"] == "PARTIAL: 2 of 90 runs finished"  # the study's whole plan, from study_v5.py
    assert abs(summary["testbeds"]["fork"]["tempo"]["paired_diff_vs_grpo"]["mean"] - 0.05) < 1e-9
    # a run beyond the plan is reported, paired with GRPO, labelled, and not counted in the plan's runs
    assert summary["beyond_plan"] == ["oar-g+tempo"]
    assert abs(summary["testbeds"]["fork"]["oar-g+tempo"]["paired_diff_vs_grpo"]["mean"] - 0.07) < 1e-9
    assert "Beyond the plan: `oar-g+tempo`" in (tmp_path / "out" / "README.md").read_text()
    assert summary["builds"]["fork"] == build | {"weights_sha256": "ab"}
    assert "--ledger" in (tmp_path / "out" / "README.md").read_text()
    assert (
        "`aaa` 2 runs (fork/grpo-s0, fork/tempo-s0); `bbb` 1 run (fork/oar-g+tempo-s0)"
        in (tmp_path / "out" / "README.md").read_text()
    )
    assert (tmp_path / "out" / "runs.csv").read_text().splitlines()[0].endswith(",code")


@pytest.mark.slow  # an end-to-end run of 10-35 s
def test_study_v5_runs_skips_and_resumes_at_toy_scale(tmp_path, capsys):
    """The whole pipeline at --scale tiny (one testbed, GRPO, seed 0): build, attribution, one run; run
    again: skipped; with its summary gone (stopped after its last checkpoint): resumed, not restarted."""
    import json

    from research.testbeds_v5.study_v5 import main

    argv = ["--root", str(tmp_path), "--scale", "tiny", "--testbeds", "fork", "--methods", "grpo", "--seeds", "0"]
    run = tmp_path / "fork" / "grpo-s0"
    assert main(argv) == 0 and (run / "summary.json").exists() and (tmp_path / "attribution" / "fork.json").exists()
    timing = lambda: json.loads((run / "study_time.json").read_text())  # noqa: E731
    assert (
        len(json.loads((tmp_path / "plan.json").read_text())["runs"]) == 90
    )  # the fixed plan, whatever part a worker runs
    assert timing()["invocations"] == 1 and timing()["cpu_seconds"] > 0
    assert main(argv) == 0 and timing()["invocations"] == 1  # finished: skipped
    assert "open" not in timing() and timing()["unmeasured"] == 0
    # stopped after its last checkpoint by SIGKILL: summary gone, the invocation still marked open
    (run / "summary.json").unlink()
    (run / "study_time.json").write_text(json.dumps(timing() | {"open": True}))
    assert main(argv) == 0 and (run / "summary.json").exists() and timing()["invocations"] == 2
    assert "resume grpo-s0" in capsys.readouterr().out
    assert timing()["unmeasured"] == 1  # the killed invocation's time is lost, and the run says so
    from research.common.runs import read_run

    assert math.isnan(read_run(run)["cpu_seconds"]) and math.isnan(read_run(run)["wall_seconds"])


def test_a_run_is_fully_timed_only_when_every_invocation_recorded_its_time():
    from research.common.runs import fully_timed

    whole = {"seconds": 10.0, "cpu_seconds": 8.0, "invocations": 1, "unmeasured": 0}
    assert fully_timed(whole, {"resume": False}) and fully_timed(whole | {"invocations": 2}, {"resume": True})
    assert not fully_timed(whole | {"unmeasured": 1, "invocations": 2}, {"resume": True})
    assert not fully_timed(whole | {"open": True}, {"resume": False})  # an invocation still running, or killed
    # written before invocations were marked open: a resumed run with one recorded invocation lost one
    assert not fully_timed({"seconds": 170.6, "cpu_seconds": 108.7, "invocations": 1}, {"resume": True})
    assert not fully_timed({}, {})
