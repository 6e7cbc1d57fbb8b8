"""research/real_smollm2/report_real.py: paired differences from a hand-made ledger, worked by hand."""

import json
import math

import pytest


def _run(ledger, method, seed, before, mid, after, cpu=600.0):
    d = ledger / "runs" / "arith1" / f"{method}-s{seed}"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"method": method, "seed": seed}))
    (d / "summary.json").write_text(json.dumps({"steps": 24, "accuracy_before": before, "accuracy_after": after}))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 12, "eval/accuracy": mid}) + "\n")
    (d / "study_time.json").write_text(json.dumps({"seconds": 900.0, "cpu_seconds": cpu, "invocations": 1}))


def test_paired_differences_and_their_standard_errors_by_hand(tmp_path):
    from research.real_smollm2 import report_real

    ledger = tmp_path / "ledger"
    for seed, (g, o) in enumerate([(0.50, 0.55), (0.60, 0.60), (0.40, 0.50)]):
        _run(ledger, "grpo", seed, 0.155, 0.3, g)
        _run(ledger, "oar-g", seed, 0.155, 0.3, o)
    _run(ledger, "oar-p", 0, 0.155, 0.2, 0.45)  # one seed: no standard error
    out = tmp_path / "out"
    (out).mkdir()
    (out / "README.md").write_text(f"head\n{report_real.BEGIN}\nold\n{report_real.END}\ntail\n")
    s = report_real.write(ledger, out)["methods"]
    # oar-g - grpo after, in points: +5, 0, +10 -> mean 5, sd 5, s.e. 5 / sqrt(3)
    d = s["oar-g"]["paired_vs_grpo"]["24"]
    assert d["n"] == 3 and d["mean_points"] == pytest.approx(5.0) and d["se_points"] == pytest.approx(5 / math.sqrt(3))
    assert s["oar-g"]["paired_vs_grpo"]["0"]["mean_points"] == pytest.approx(0.0)
    assert s["oar-p"]["seeds"] == [0] and s["oar-p"]["paired_vs_grpo"]["24"] == {
        "mean_points": pytest.approx(-5.0),
        "se_points": None,
        "n": 1,
    }
    assert s["grpo"]["accuracy"]["24"]["mean"] == pytest.approx(0.5) and s["grpo"][
        "cpu_minutes_per_run"
    ] == pytest.approx(10.0)
    page = (out / "README.md").read_text()
    assert page.startswith("head\n") and page.endswith("tail\n") and "old" not in page and "+5.0 ± 2.9 (n = 3)" in page
    assert "| 30.0% | +0.0 ± 0.0 (n = 3) |" in page and "| 20.0% | -10.0 (n = 1) |" in page  # step 12, secondary
    assert (out / "curves.png").exists() and (out / "runs.csv").read_text().count("\n") == 8


def test_the_committed_task_is_what_study_real_makes_and_a_changed_file_stops_it(tmp_path):
    import shutil
    from pathlib import Path

    from research.real_smollm2 import study_real

    repo = Path(__file__).resolve().parents[2]
    study_real.write_data(repo)  # raises SystemExit if the committed splits differ from oar/tasks/arith.py's
    lines = {s: (repo / study_real.DATA / f"{s}.jsonl").read_text().splitlines() for s in study_real.SPLITS}
    assert {s: len(v) for s, v in lines.items()} == study_real.SPLITS
    assert not set(lines["train"]) & set(lines["test"])
    copy = tmp_path / study_real.DATA
    shutil.copytree(repo / study_real.DATA, copy)
    (copy / "test.jsonl").write_text("\n".join(lines["test"][:-1]) + "\n")
    with pytest.raises(SystemExit, match="not the task's test split"):
        study_real.write_data(tmp_path)


def test_the_ledger_records_the_model_file_and_refuses_another(tmp_path):
    from research.real_smollm2 import study_real

    model, other, ledger = tmp_path / "m.gguf", tmp_path / "o.gguf", tmp_path / "ledger"
    model.write_bytes(b"weights")
    other.write_bytes(b"other weights")
    assert study_real.check_model(ledger, model) == "recorded" and study_real.check_model(ledger, model) == "matches"
    with pytest.raises(SystemExit, match="not the GGUF the ledger's runs started from"):
        study_real.check_model(ledger, other)
