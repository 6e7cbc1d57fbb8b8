"""The report of the real-model study (research/real_smollm2/study_real.py), from its committed ledger alone.

    python research/real_smollm2/report_real.py --ledger research/real_smollm2/ledger --out research/real_smollm2

Writes `summary.json` (per method: seeds, held-out avg@8 before and after, the paired difference
from GRPO at every evaluation with its standard error over seeds), `runs.csv`, `curves.png` and
the table of `README.md` between its two REPORT markers. Whatever has finished is reported: a
method's seeds are counted, and a paired difference uses only the seeds where both runs finished.
Standard errors are over seeds (std / sqrt(n), ddof 1); with n < 2 there is none (null).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from research.common.runs import accuracy_curve, read_run, stats  # noqa: E402
from research.real_smollm2.study_real import METHODS, SETTINGS, TASK  # noqa: E402

BEGIN, END = "<!-- REPORT BEGIN (research/real_smollm2/report_real.py) -->", "<!-- REPORT END -->"


def collect(ledger: Path) -> dict[str, dict[int, dict]]:
    """{method: {seed: run}} of the finished runs kept in the ledger."""
    runs: dict[str, dict[int, dict]] = {m: {} for m in METHODS}
    for path in sorted((Path(ledger) / "runs" / TASK).glob("*-s*")):
        run = read_run(path)
        method, seed = path.name.rsplit("-s", 1)
        if run is not None and method in runs:
            runs[method][int(seed)] = run | {"curve": dict(accuracy_curve(run))}
    return runs


def se(values: list[float]) -> float | None:
    s = stats(values)
    return s["std"] / math.sqrt(s["n"]) if s["n"] > 1 else None


def summarize(runs: dict[str, dict[int, dict]]) -> dict:
    """Per method: seeds, mean accuracy at each evaluation, paired difference from GRPO (points)."""
    out = {}
    for method, by_seed in runs.items():
        seeds = sorted(by_seed)
        steps = sorted({s for r in by_seed.values() for s in r["curve"]})
        row = {"seeds": seeds, "accuracy": {}, "paired_vs_grpo": {}}
        for step in steps:
            acc = [by_seed[s]["curve"][step] for s in seeds if step in by_seed[s]["curve"]]
            row["accuracy"][str(step)] = {"mean": stats(acc)["mean"], "se": se(acc), "n": len(acc)}
            pairs = [
                s
                for s in seeds
                if s in runs["grpo"] and step in runs["grpo"][s]["curve"] and step in by_seed[s]["curve"]
            ]
            if method != "grpo" and pairs:
                diff = [100 * (by_seed[s]["curve"][step] - runs["grpo"][s]["curve"][step]) for s in pairs]
                row["paired_vs_grpo"][str(step)] = {
                    "mean_points": stats(diff)["mean"],
                    "se_points": se(diff),
                    "n": len(diff),
                }
        if seeds:
            row["accuracy_before"] = row["accuracy"][str(min(steps))]["mean"]
            row["accuracy_after"] = row["accuracy"][str(max(steps))]["mean"]
            row["cpu_minutes_per_run"] = stats([r["cpu_seconds"] / 60 for r in by_seed.values()])["mean"]
        out[method] = row
    return out


def table(summary: dict) -> str:
    """The page's table: before, after (the primary metric, step 24) and, secondary, the middle
    evaluation (step 12), each with the paired difference from GRPO."""
    last, mid = str(SETTINGS["steps"]), str(SETTINGS["eval_every"])
    lines = [
        "| method | seeds finished | held-out avg@8 before | after (step 24) "
        "| paired Δ vs GRPO after (points ± s.e.) | step 12 | paired Δ at step 12 | CPU min per run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def diff(row, step):
        d = row["paired_vs_grpo"].get(step)
        return (
            "n/a"
            if d is None
            else f"{d['mean_points']:+.1f}"
            + (f" ± {d['se_points']:.1f}" if d["se_points"] is not None else "")
            + f" (n = {d['n']})"
        )

    def acc(row, step):
        a = row["accuracy"].get(step)
        return "" if a is None else f"{100 * a['mean']:.1f}%"

    for method, row in summary.items():
        if not row["seeds"]:
            lines.append(f"| {method} | 0 | | | | | | |")
            continue
        d_last, d_mid = ("—", "—") if method == "grpo" else (diff(row, last), diff(row, mid))
        lines.append(
            f"| {method} | {len(row['seeds'])} ({', '.join(map(str, row['seeds']))}) "
            f"| {100 * row['accuracy_before']:.1f}% | {acc(row, last)} | {d_last} | {acc(row, mid)} | {d_mid} "
            f"| {row['cpu_minutes_per_run']:.0f} |"
        )
    return "\n".join(lines)


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for method, by_seed in runs.items():
        for k, run in enumerate(by_seed.values()):
            steps = sorted(run["curve"])
            ax.plot(
                steps,
                [100 * run["curve"][s] for s in steps],
                marker="o",
                alpha=0.8,
                color=f"C{METHODS.index(method)}",
                label=method if k == 0 else None,
            )
    ax.set(
        xlabel="RL step", ylabel="held-out avg@8 (%)", title="SmolLM2-135M-Instruct, arith (1 op), one line per seed"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(ledger: Path, out: Path) -> dict:
    runs = collect(ledger)
    summary = {
        "task": TASK,
        "settings": SETTINGS,
        "methods": summarize(runs),
        "command": "python research/real_smollm2/report_real.py "
        "--ledger research/real_smollm2/ledger --out research/real_smollm2",
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    rows = ["method,seed,accuracy_before,accuracy_after,cpu_minutes"] + [
        f"{m},{s},{r['summary']['accuracy_before']},{r['summary']['accuracy_after']},{r['cpu_seconds'] / 60:.1f}"
        for m, by_seed in runs.items()
        for s, r in sorted(by_seed.items())
    ]
    (out / "runs.csv").write_text("\n".join(rows) + "\n")
    if any(runs.values()):
        plot(runs, out / "curves.png")
    page = out / "README.md"
    if page.exists() and BEGIN in page.read_text():
        head, rest = page.read_text().split(BEGIN, 1)
        page.write_text(head + BEGIN + "\n" + table(summary["methods"]) + "\n" + END + rest.split(END, 1)[1])
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ledger", type=Path, default=ROOT / "research" / "real_smollm2" / "ledger")
    p.add_argument("--out", type=Path, default=ROOT / "research" / "real_smollm2")
    args = p.parse_args(argv)
    summary = write(args.ledger, args.out)
    print(table(summary["methods"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
