"""The signal-or-gate study's report (research/signal-or-gate/report.py): the pre-registered metrics, the
paired tests and the decision rule, on synthetic ledgers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _study():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "signal_or_gate_study", ROOT / "research" / "signal-or-gate" / "study.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _report():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "signal_or_gate_report", ROOT / "research" / "signal-or-gate" / "report.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_report_t_test_by_hand():
    """Student's t tail against closed forms: df 1 is Cauchy, P(T > 1) = 1/4; df 2 has P(T > t) =
    (1 - t / sqrt(t^2 + 2)) / 2. Paired differences 1, 2, 3: mean 2, s.e. 1/sqrt(3), t = 2 sqrt(3),
    two-sided p = 1 - 2 sqrt(3) / sqrt(14) = 0.0742; and the pre-registered critical value
    2.776 at df 4 gives p = 0.05."""
    from research.common.paired_t import t_quantile, t_sf

    report = _report()
    assert t_sf(1.0, 1) == pytest.approx(0.25, abs=1e-9)
    assert t_sf(0.0, 3) == pytest.approx(0.5)
    t = 2 * math.sqrt(3)
    assert t_sf(t, 2) == pytest.approx((1 - t / math.sqrt(t * t + 2)) / 2, rel=1e-9)
    got = report.paired([1.0, 2.0, 3.0])
    assert (
        got["mean"] == 2.0
        and got["se"] == pytest.approx(1 / math.sqrt(3))
        and got["p"] == pytest.approx(1 - t / math.sqrt(14), rel=1e-9)
    )
    assert 2 * t_sf(2.776, 4) == pytest.approx(0.05, abs=2e-4)
    # the interval the rule asks for: mean ± t_{0.975, df} s.e.; t_{0.975, 2} = 4.303 (tables),
    # df 1: tan(0.475 pi) = 12.706
    assert t_quantile(0.025, 4) == pytest.approx(2.7764451, abs=1e-6)
    assert t_quantile(0.025, 1) == pytest.approx(math.tan(0.475 * math.pi), rel=1e-9)
    assert got["ci"] == pytest.approx([2 - 4.3026527 / math.sqrt(3), 2 + 4.3026527 / math.sqrt(3)], abs=1e-6)


def test_report_equal_differences_up_to_rounding_have_no_spread():
    """Held-out accuracies are multiples of 1/400: three seeds each 1 point apart give 100 * (a - b) of
    0.9999999999999999, 0.9999999999999996, 1.0000000000000009. An exact se == 0 test missed it and gave
    se 4e-16, t = 2.5e15, p = 0; they are one difference, with no t-test. So are equal gaps of a training
    reward logged in float32 (1/768 each, 0.13 points: they differ by ~2e-7 points)."""
    import numpy as np

    report = _report()
    diffs = [100 * ((y + 4) / 400 - y / 400) for y in (7, 33, 97)]
    assert len(set(diffs)) > 1  # the float rounding that made the spread
    got = report.paired(diffs)
    assert got["zero_spread"] and got["se"] == 0.0 and got["t"] is None and got["p"] is None and "ci" not in got
    rewards = [float(np.float32(k / 768)) for k in (101, 333, 517, 702)]
    gaps = [100 * (float(np.float32((k + 1) / 768)) - r) for k, r in zip((101, 333, 517, 702), rewards)]
    assert len(set(gaps)) > 1 and report.paired(gaps)["zero_spread"]
    # the smallest real spread, two seeds' gaps one rollout of 768 apart, is tested
    assert report.paired([100 / 768, 200 / 768, 100 / 768])["p"] is not None


def _synthetic_ledger(
    root: Path, base: dict, wobble: dict = {}, seeds=range(3), heldout: dict = {}, config: dict = {}
) -> Path:
    """A ledger of finished 4-step runs of the study's settings: arm a's seed s has training reward base[a] +
    wobble[a][s] at every step, held-out avg@2 heldout.get(a, reward) at the end; config.json as study.py would
    write it (plus `config`)."""
    import json

    from research.common.study_run import effective

    study = _study()
    arms = study.ARMS
    for arm, r in base.items():
        for seed in seeds:
            d = root / "runs" / "arith-mix" / f"{arm}-s{seed}"
            d.mkdir(parents=True)
            reward = r + wobble.get(arm, [0] * 5)[seed]
            end = heldout.get(arm, reward)
            (d / "summary.json").write_text(
                json.dumps(
                    {
                        "steps": 4,
                        "accuracy_before": 0.08,
                        "accuracy_after": end,
                        "pass_before": {"pass@2": 0.1},
                        "pass_after": {"pass@2": end + 0.1},
                    }
                )
            )
            rows = [
                {"step": s, "reward/mean": reward, "policy/entropy": 1.0, "time/step_cpu_s": 30.0} for s in range(1, 5)
            ]
            rows[1] |= {"eval/accuracy": reward / 2, "eval/pass@2": reward}
            (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
            (d / "study_time.json").write_text(json.dumps({"cpu_seconds": 600.0, "code": ["abc" if seed else "def"]}))
            settings = effective(
                study.SETTINGS | {"steps": 4, "seed": seed, "output_dir": str(d), **arms[arm]}
            ) | config.get(f"{arm}-s{seed}", {})
            (d / "config.json").write_text(json.dumps(settings))
    return root


def test_report_applies_the_decision_rule(tmp_path):
    """A synthetic ledger of three seeds: OAR-G at q = 0.25 ahead of random-gate by 11-13 points of training
    reward on every seed (significant), inverted behind it; OAR-G q = 0.25 vs q = 0.4 within noise."""
    report = _report()
    base = {"grpo": 0.30, "oar-g-q25": 0.40, "random-gate-q25": 0.29, "oar-g-q40": 0.40, "inverted-q25": 0.25}
    ledger = _synthetic_ledger(
        tmp_path / "ledger", base, {"oar-g-q25": [0.0, 0.02, 0.01], "oar-g-q40": [0.02, -0.01, 0.0]}
    )
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "README.md").write_text(f"x\n{report.BEGIN}\nold\n{report.END}\ny\n")
    summary = report.write(ledger, tmp_path / "out", "arith-mix")
    signal = summary["comparisons"]["oar-g-q25 - random-gate-q25"]["mean_reward"]
    assert signal["n"] == 3 and signal["mean"] == pytest.approx(12.0) and signal["p"] < 0.05
    assert summary["decision"] == {
        "seeds": {
            k: [0, 1, 2]
            for k in ("scores_carry_information", "change_default_gate_to_q25_b1", "inverted_at_or_below_random")
        },
        "scores_carry_information": "positive",
        "change_default_gate_to_q25_b1": False,
        "inverted_at_or_below_random": {"mean_training_reward": True, "heldout_last_step": True},
    }
    assert summary["runs"]["grpo"]["0"]["heldout"] == {
        "0": {"avg": 0.08, "pass@2": 0.1},
        "2": {"avg": 0.15, "pass@2": 0.3},
        "4": {"avg": 0.3, "pass@2": pytest.approx(0.4)},
    }
    # the secondary paired differences, at every evaluated step: avg@2 and pass@2 (points)
    held = summary["comparisons"]["oar-g-q25 - random-gate-q25"]["heldout"]
    assert (
        set(held) == {"0", "2", "4"}
        and held["0"]["avg"]["mean"] == 0.0
        and held["4"]["pass@2"]["mean"] == pytest.approx(12.0)
    )
    page = (tmp_path / "out" / "README.md").read_text()
    assert (
        "old" not in page
        and "| oar-g-q25 - random-gate-q25 | 3 | +12.0" in page
        and (tmp_path / "out" / "curves.png").is_file()
    )
    assert "2 versions of train.py and oar/" in page and "def: grpo-s0, " in page  # seed 0's runs made by other code


def test_report_gate_rule_reads_the_held_out_direction_and_needs_three_balanced_seeds(tmp_path):
    """q = 0.25 significantly ahead of q = 0.4 in training reward changes the default only if it is not behind at
    the end held out (q25 - q40 >= 0); an arm with two seeds is compared on its two only, and not tested."""
    report = _report()
    base = {"oar-g-q25": 0.45, "random-gate-q25": 0.29, "oar-g-q40": 0.40}
    wobble = {"oar-g-q25": [0.0, 0.02, 0.01]}
    behind = report.write(
        _synthetic_ledger(tmp_path / "a", base, wobble, heldout={"oar-g-q25": 0.30, "oar-g-q40": 0.35}),
        tmp_path / "oa",
        "arith-mix",
    )
    assert behind["comparisons"]["oar-g-q25 - oar-g-q40"]["heldout_last"]["mean"] == pytest.approx(-5.0)
    assert behind["decision"]["change_default_gate_to_q25_b1"] is False
    ahead = report.write(
        _synthetic_ledger(tmp_path / "b", base, wobble, heldout={"oar-g-q25": 0.35, "oar-g-q40": 0.35}),
        tmp_path / "ob",
        "arith-mix",
    )
    assert ahead["decision"]["change_default_gate_to_q25_b1"] is True
    ledger = _synthetic_ledger(tmp_path / "c", base, wobble)
    import shutil

    shutil.rmtree(ledger / "runs" / "arith-mix" / "random-gate-q25-s2")
    few = report.write(ledger, tmp_path / "oc", "arith-mix")
    assert few["comparisons"]["oar-g-q25 - random-gate-q25"]["seeds"] == [0, 1]
    assert few["decision"]["scores_carry_information"] is None
    # each test says on which seeds it ran: test 2 on all three, test 1 on the two random-gate finished
    assert few["decision"]["seeds"] == {
        "scores_carry_information": [0, 1],
        "change_default_gate_to_q25_b1": [0, 1, 2],
        "inverted_at_or_below_random": [],
    }


def test_report_refuses_runs_that_are_not_one_study(tmp_path):
    """A run with another learning rate, or one whose log lacks a step, stops the report with its name."""
    report = _report()
    base = {"oar-g-q25": 0.40, "random-gate-q25": 0.29}
    ledger = _synthetic_ledger(tmp_path / "a", base, config={"random-gate-q25-s1": {"learning_rate": 1e-4}})
    with pytest.raises(SystemExit, match="random-gate-q25-s1: settings differ .*learning_rate"):
        report.write(ledger, tmp_path / "oa", "arith-mix")
    ledger = _synthetic_ledger(tmp_path / "b", base)
    metrics = ledger / "runs" / "arith-mix" / "oar-g-q25-s2" / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[1:]))
    with pytest.raises(SystemExit, match="oar-g-q25-s2: metrics.jsonl has steps"):
        report.write(ledger, tmp_path / "ob", "arith-mix")


def test_report_steps_to_half_need_a_full_window(tmp_path):
    """Steps to 50%: the first step whose mean with the two before reaches 0.5, so step 3 at the earliest: a
    lucky step 1 (0.9, then 0.1, 0.2, 0.6: means 0.4 at step 3, 0.3 at step 4) is not 'reached'; 4 steps run -> 5."""
    import json

    report = _report()
    ledger = _synthetic_ledger(tmp_path / "l", {"grpo": 0.3})
    metrics = ledger / "runs" / "arith-mix" / "grpo-s0" / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    for row, r in zip(rows, [0.9, 0.1, 0.2, 0.6]):
        row["reward/mean"] = r
    metrics.write_text("".join(json.dumps(x) + "\n" for x in rows))
    assert report.run_metrics(metrics.parent)["steps_to_50"] == 5
    assert report.paired([2.0, 2.0, 2.0])["zero_spread"]
    # a mean of exactly 0.5 as logged (float32 k/48: 21, 23, 28 of 48 sum to 0.49999999) reaches it
    import numpy as np

    for row, k in zip(rows, [21, 23, 28, 10]):
        row["reward/mean"] = float(np.float32(k / 48))
    metrics.write_text("".join(json.dumps(x) + "\n" for x in rows))
    assert report.run_metrics(metrics.parent)["steps_to_50"] == 3


def test_report_tests_nothing_below_three_seeds_checks_each_arms_own_settings_and_shows_the_gates_shape(tmp_path):
    """Two seeds give a difference and its s.e. but no t or p, on the page or in summary.json; a run whose gate is
    not its arm's (a folder named oar-g-q25 that ran q = 0.4), or whose config.json lacks a setting the others
    changed from its default, stops the report; the gate's diagnostics are averaged per arm."""
    import json

    report = _report()
    base = {"oar-g-q25": 0.40, "random-gate-q25": 0.29}
    ledger = _synthetic_ledger(tmp_path / "a", base, {"oar-g-q25": [0.0, 0.02]}, seeds=range(2))
    for arm, ess in (("oar-g-q25", 0.8), ("random-gate-q25", 0.6)):
        for seed in range(2):
            metrics = ledger / "runs" / "arith-mix" / f"{arm}-s{seed}" / "metrics.jsonl"
            rows = [json.loads(x) | {"oar/ess_ratio": ess + 0.1 * seed} for x in metrics.read_text().splitlines()]
            metrics.write_text("".join(json.dumps(x) + "\n" for x in rows))
    for arm, seed, lost in (
        ("random-gate-q25", 1, {"unmeasured": 1}),
        ("oar-g-q25", 1, {"open": True}),  # killed outright; open
        ("oar-g-q25", 0, {"invocations": 2}),  # stopped and resumed: every invocation timed
        ("random-gate-q25", 0, {"code": []}),
    ):  # its train.py finished after its study process died
        timing = ledger / "runs" / "arith-mix" / f"{arm}-s{seed}" / "study_time.json"
        timing.write_text(json.dumps(json.loads(timing.read_text()) | lost))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "README.md").write_text(f"{report.BEGIN}\n{report.END}\n")
    two = report.write(ledger, tmp_path / "out", "arith-mix")["comparisons"]["oar-g-q25 - random-gate-q25"][
        "mean_reward"
    ]
    assert two["n"] == 2 and two["se"] == pytest.approx(1.0) and two["t"] is None and two["p"] is None
    page = (tmp_path / "out" / "README.md").read_text()
    assert "| oar-g-q25 - random-gate-q25 | 2 | +12.0 ± 1.0 |" in page and "t = " not in page
    assert "| oar-g-q25 | 0.850 |" in page and "| random-gate-q25 | 0.650 |" in page  # ESS, mean over seeds and steps
    # CPU minutes: in the steps (4 x 30 s) for every run;
    # of the whole run for fully timed runs only, a resumed one said
    assert (
        "| 2 (2 runs) | 10 (1 run), 1 resumed (with its redone steps and reloads); 1 run killed mid-way, time lost |"
        in page
    )
    assert "| 2 (2 runs) | 10 (1 run); 1 run killed mid-way, time lost |" in page
    assert "unrecorded: random-gate-q25-s0" in page  # code unknown is listed, not taken for the others'
    wrong = _synthetic_ledger(tmp_path / "b", base, config={"oar-g-q25-s1": {"gate_quantile": 0.4, "gate_boost": 2.0}})
    with pytest.raises(SystemExit, match="oar-g-q25-s1: not the arm's settings.*gate_quantile"):
        report.write(wrong, tmp_path / "ob", "arith-mix")
    lacking = _synthetic_ledger(
        tmp_path / "c", base, config={f"{a}-s{s}": {"top_p": 0.9} for a in base for s in (0, 1)}
    )
    config = lacking / "runs" / "arith-mix" / "random-gate-q25-s2" / "config.json"
    config.write_text(
        json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "top_p"})
    )  # ran at the default 1.0
    with pytest.raises(SystemExit, match="settings differ .*top_p"):
        report.write(lacking, tmp_path / "oc", "arith-mix")


def test_the_committed_page_and_summary_are_the_reports_of_the_committed_ledger():
    """A run added to the ledger without report.py rerun (or a hand edit of its block) leaves the page stale."""
    import json

    report, here = _report(), ROOT / "research" / "signal-or-gate"
    runs = report.collect(here / "ledger", "arith-1op2d")
    comparisons = report.compare_all(runs)
    page = (here / "README.md").read_text()
    assert f"{report.BEGIN}\n{report.table(runs, comparisons)}\n{report.END}" in page
    assert json.loads((here / "summary.json").read_text())["comparisons"] == json.loads(json.dumps(comparisons))


def test_the_pages_attribution_table_is_the_committed_one():
    """The ΔV table is copied into the page by hand from the ledger's table.json: it must be that table."""
    import json

    here = ROOT / "research" / "signal-or-gate"
    made = here / "ledger" / "delta-v" / "table.json"
    if not made.is_file():
        pytest.skip("no ΔV table in the ledger yet (it is committed once the 100 rollouts' values are made)")
    assert json.loads(made.read_text())["table"] in (here / "README.md").read_text()


def test_report_shows_each_seeds_differences_and_each_runs_cost(tmp_path):
    """The page's seed-by-seed table holds each seed's two differences (blank where an arm lacks the seed), and
    its run table each run's numbers and time: whole when every invocation was timed, "at least" when one was
    killed before it could record its time, "not recorded" without study_time.json's seconds; a run made with
    a setting that changes only its rounding (gradient checkpointing) is compared like the others, and named."""
    import json
    import shutil

    report = _report()
    ledger = _synthetic_ledger(
        tmp_path / "l",
        {"grpo": 0.30, "oar-g-q25": 0.40},
        {"oar-g-q25": [0.0, 0.02, 0.01]},
        heldout={"grpo": 0.5, "oar-g-q25": 0.45},
    )
    shutil.rmtree(ledger / "runs" / "arith-mix" / "oar-g-q25-s2")
    runs = ledger / "runs" / "arith-mix"
    (runs / "grpo-s0" / "study_time.json").write_text(
        json.dumps({"seconds": 5400.0, "cpu_seconds": 3000.0, "invocations": 2, "code": ["a"]})
    )
    (runs / "grpo-s1" / "study_time.json").write_text(
        json.dumps({"seconds": 600.0, "cpu_seconds": 300.0, "invocations": 1, "unmeasured": 1, "code": ["a"]})
    )
    config = runs / "oar-g-q25-s0" / "config.json"  # a run made with gradient checkpointing: its rounding only, named
    config.write_text(json.dumps(json.loads(config.read_text()) | {"gradient_checkpointing": True}))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "README.md").write_text(f"{report.BEGIN}\n{report.END}\n")
    report.write(ledger, tmp_path / "out", "arith-mix")
    page = (tmp_path / "out" / "README.md").read_text()
    assert "| oar-g-q25-s0 (gradient_checkpointing True) | 40.0% |" in page and "| oar-g-q25-s1 | 42.0% |" in page
    assert "| paired difference | seed 0 | seed 1 | seed 2 |" in page
    assert "| oar-g-q25 - grpo | +10.0 / -5.0 | +12.0 / -5.0 |  |" in page
    assert "| oar-g-q25 - random-gate-q25 |  |  |  |" in page
    # a run's reward range, held-out first -> last, steps to 50% (never: steps + 1),
    # CPU of its 4 steps of 30 s, its time
    assert "| grpo-s0 | 30.0% | 30-30% | 8.0% -> 50.0% | not reached (5) | 2 | 90, 50 (2 invocations) |" in page
    assert "| grpo-s1 | 30.0% | 30-30% | 8.0% -> 50.0% | not reached (5) | 2 | at least 10, 5 |" in page
    assert "| oar-g-q25-s1 | 42.0% | 42-42% | 8.0% -> 45.0% | not reached (5) | 2 | not recorded |" in page
    assert (
        page.index("| grpo-s0 |") < page.index("| oar-g-q25-s0 (") < page.index("| grpo-s1 |")
    )  # seed by seed, arms in order
