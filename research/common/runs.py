"""A finished study run's files, read back: its settings, summary, per-step metrics and timing.

Shared by the studies' reports (research/testbeds_v5/report_v5.py, research/real_smollm2/report_real.py). A run
folder holds config.json, summary.json, metrics.jsonl and study_time.json (research/common/study_run.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def read_run(path: Path) -> dict | None:
    """A finished run's files, or None when it has no summary.json yet."""
    if not (path / "summary.json").exists():
        return None
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    config = json.loads((path / "config.json").read_text())
    timing = json.loads((path / "study_time.json").read_text()) if (path / "study_time.json").exists() else {}
    whole = fully_timed(timing, config)
    return {
        "dir": path,
        "config": config,
        "summary": json.loads((path / "summary.json").read_text()),
        "rows": rows,
        "wall_seconds": timing["seconds"] if whole else math.nan,
        "cpu_seconds": timing.get("cpu_seconds", math.nan) if whole else math.nan,
        "code": timing.get("code", []),
    }


def fully_timed(timing: dict, config: dict) -> bool:
    """Whether study_time.json holds every invocation of the run: not when one was killed before it
    could write its time (research/common/study_run.py counts those as `unmeasured`; older files show it as a
    resumed run with a single recorded invocation)."""
    return (
        bool(timing)
        and not timing.get("unmeasured")
        and not timing.get("open")
        and not (config.get("resume") and timing.get("invocations", 0) < 2)
    )


def accuracy_curve(run: dict) -> list[tuple[int, float]]:
    """(step, held-out accuracy): before training, every --eval_every, after the last step."""
    s = run["summary"]
    curve = [(0, s["accuracy_before"])] + [
        (r["step"], r["eval/accuracy"]) for r in run["rows"] if "eval/accuracy" in r
    ]
    return curve + [(s["steps"], s["accuracy_after"])]


def stats(values) -> dict:
    v = np.array([x for x in values if x is not None and not math.isnan(x)], dtype=np.float64)
    return {
        "mean": float(v.mean()) if len(v) else math.nan,
        "std": float(v.std(ddof=1)) if len(v) > 1 else math.nan,
        "n": len(v),
    }
