"""The signal-or-gate study's report, from its ledger alone: the pre-registered metrics and decision rule, in code.

    python research/signal-or-gate/report.py                  # research/signal-or-gate/ledger -> summary.json, curves.png, the page's table

Written with the pre-registration (README.md), before any result: what it computes is what the page
fixed. Per run (ledger/runs/<task>/<arm>-s<seed>/): the mean of `reward/mean` over all steps (the
primary metric), held-out avg@2 and pass@2 at steps 0, 6, 12, 16, the steps to 50% training reward
(first step whose mean of `reward/mean` over it and the two before reaches 0.5; steps + 1 if never),
`policy/entropy` at the last step, and CPU seconds (study_time.json). Per comparison (the page's list):
the paired difference over the seeds where both arms finished, mean ± standard error (ddof 1), the
paired t statistic and its two-sided p-value (df = n - 1). The decision rule is then applied: test 1
(oar-g-q25 - random-gate-q25) and test 2 (oar-g-q25 - oar-g-q40), each at alpha 0.05, on balanced
seeds only, and none on fewer than three.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

HERE = Path(__file__).resolve().parent
ARMS = ("grpo", "oar-g-q25", "random-gate-q25", "oar-g-q40", "inverted-q25")
COMPARISONS = (("oar-g-q25", "random-gate-q25"), ("oar-g-q25", "oar-g-q40"), ("oar-g-q25", "grpo"), ("random-gate-q25", "grpo"),
               ("oar-g-q40", "grpo"), ("inverted-q25", "grpo"), ("inverted-q25", "random-gate-q25"))
ALPHA, MIN_SEEDS = 0.05, 3
BEGIN, END = "<!-- REPORT BEGIN (research/signal-or-gate/report.py) -->", "<!-- REPORT END -->"


def t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom: I_x(df/2, 1/2) / 2 at x = df / (df + t^2)."""
    if t < 0:
        return 1.0 - t_sf(-t, df)
    return betainc(df / 2, 0.5, df / (df + t * t)) / 2


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b): the continued fraction (Numerical Recipes'
    betacf) where it converges fast, x < (a + 1) / (a + b + 2), else through I_x(a, b) = 1 - I_{1-x}(b, a)."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x >= (a + 1) / (a + b + 2):
        return 1.0 - front * _betacf(b, a, 1.0 - x) / b
    return front * _betacf(a, b, x) / a


def _betacf(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)), -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return f


def paired(diffs: list[float]) -> dict:
    """Mean, standard error (ddof 1), t and two-sided p of paired differences; None where n < 2 (or a zero spread)."""
    n = len(diffs)
    mean = sum(diffs) / n if n else math.nan
    if n < 2:
        return {"n": n, "mean": mean, "se": None, "t": None, "p": None}
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n)
    if se == 0:
        return {"n": n, "mean": mean, "se": 0.0, "t": None, "p": None}
    t = mean / se
    return {"n": n, "mean": mean, "se": se, "t": t, "p": 2 * t_sf(abs(t), n - 1)}


def run_metrics(path: Path) -> dict | None:
    """One finished run's pre-registered numbers, or None when it has not finished."""
    if not (path / "summary.json").is_file():
        return None
    summary = json.loads((path / "summary.json").read_text())
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    reward = [r["reward/mean"] for r in rows]
    smooth = [sum(reward[max(0, i - 2): i + 1]) / len(reward[max(0, i - 2): i + 1]) for i in range(len(reward))]
    reached = next((i + 1 for i, v in enumerate(smooth) if v >= 0.5), summary["steps"] + 1)
    held = {0: (summary["accuracy_before"], (summary.get("pass_before") or {}).get("pass@2"))}
    held |= {r["step"]: (r["eval/accuracy"], r.get("eval/pass@2")) for r in rows if "eval/accuracy" in r}
    held[summary["steps"]] = (summary["accuracy_after"], (summary.get("pass_after") or {}).get("pass@2"))
    timing = json.loads((path / "study_time.json").read_text()) if (path / "study_time.json").is_file() else {}
    return {"mean_reward": sum(reward) / len(reward), "reward": reward, "steps_to_50": reached, "final_entropy": rows[-1]["policy/entropy"],
            "heldout": {str(s): {"avg": a, "pass@2": p} for s, (a, p) in sorted(held.items())},
            "cpu_seconds": timing.get("cpu_seconds") if not timing.get("unmeasured") else None}


def collect(ledger: Path, task: str) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {a: {} for a in ARMS}
    for path in sorted((Path(ledger) / "runs" / task).glob("*-s*")):
        arm, seed = path.name.rsplit("-s", 1)
        got = run_metrics(path) if arm in runs else None
        if got is not None:
            runs[arm][int(seed)] = got
    return runs


def compare(runs: dict, a: str, b: str) -> dict:
    """a - b over the seeds where both finished: the primary metric (points) and held-out avg@2 at the last step (points)."""
    seeds = sorted(set(runs[a]) & set(runs[b]))
    out = {"seeds": seeds, "mean_reward": paired([100 * (runs[a][s]["mean_reward"] - runs[b][s]["mean_reward"]) for s in seeds])}
    last = [s for s in seeds if runs[a][s]["heldout"] and runs[b][s]["heldout"]]
    end = lambda r: r["heldout"][max(r["heldout"], key=int)]["avg"]  # noqa: E731
    out["heldout_last"] = paired([100 * (end(runs[a][s]) - end(runs[b][s])) for s in last])
    return out


def decide(comparisons: dict) -> dict:
    """The page's decision rule on tests 1 and 2 (None: not enough balanced seeds to test)."""
    def verdict(key):
        c = comparisons[key]["mean_reward"]
        if c["n"] < MIN_SEEDS or c["p"] is None:
            return None
        return "positive" if c["p"] < ALPHA and c["mean"] > 0 else "negative" if c["p"] < ALPHA else "not significant"

    signal, gate = verdict("oar-g-q25 - random-gate-q25"), verdict("oar-g-q25 - oar-g-q40")
    held = comparisons["oar-g-q25 - oar-g-q40"]["heldout_last"]
    inverted = comparisons["inverted-q25 - random-gate-q25"]["mean_reward"]
    return {"scores_carry_information": signal,
            "inverted_at_or_below_random": None if inverted["n"] < MIN_SEEDS else inverted["mean"] <= 0,
            "change_default_gate_to_q25_b1": None if gate is None else gate == "positive" and held["n"] > 0 and held["mean"] >= 0}


def table(runs: dict, comparisons: dict) -> str:
    lines = ["| arm | seeds | mean training reward | held-out avg@2 at steps 0 / 6 / 12 / 16 | steps to 50% | final entropy | CPU min |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for arm, by_seed in runs.items():
        if not by_seed:
            lines.append(f"| {arm} | 0 | | | | | |")
            continue
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        steps = sorted({s for r in by_seed.values() for s in r["heldout"]}, key=int)
        held = " / ".join(f"{100 * mean([r['heldout'][s]['avg'] for r in by_seed.values() if s in r['heldout']]):.1f}%" for s in steps)
        cpu = [r["cpu_seconds"] for r in by_seed.values() if r["cpu_seconds"]]
        lines.append(f"| {arm} | {len(by_seed)} ({', '.join(map(str, sorted(by_seed)))}) | {100 * mean([r['mean_reward'] for r in by_seed.values()]):.1f}% | "
                     f"{held} | {mean([r['steps_to_50'] for r in by_seed.values()]):.1f} | {mean([r['final_entropy'] for r in by_seed.values()]):.3f} | "
                     f"{mean(cpu) / 60 if cpu else math.nan:.0f} |")
    lines += ["", "| paired difference (points) | seeds | mean training reward ± s.e. (t, p) | held-out avg@2 at the last step ± s.e. |",
              "| --- | --- | --- | --- |"]
    for key, c in comparisons.items():
        r, h = c["mean_reward"], c["heldout_last"]
        fmt = lambda x, tp=True: "n/a" if not x["n"] else f"{x['mean']:+.1f}" + (f" ± {x['se']:.1f}" if x["se"] is not None else "") + (  # noqa: E731
            f" (t = {x['t']:.2f}, p = {x['p']:.3f})" if tp and x["t"] is not None else "")
        lines.append(f"| {key} | {len(c['seeds'])} | {fmt(r)} | {fmt(h, False)} |")
    return "\n".join(lines)


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=120)
    for k, (arm, by_seed) in enumerate(runs.items()):
        if not by_seed:
            continue
        color = f"C{k}"
        rewards = np.array([r["reward"] for r in by_seed.values()]) * 100
        steps = np.arange(1, rewards.shape[1] + 1)
        left.plot(steps, rewards.mean(0), color=color, label=f"{arm} (n={len(by_seed)})")
        left.fill_between(steps, rewards.min(0), rewards.max(0), color=color, alpha=0.12, lw=0)
        marks = sorted({int(s) for r in by_seed.values() for s in r["heldout"]})
        held = np.array([[r["heldout"][str(s)]["avg"] for s in marks] for r in by_seed.values()]) * 100
        right.plot(marks, held.mean(0), color=color, marker="o")
        right.fill_between(marks, held.min(0), held.max(0), color=color, alpha=0.12, lw=0)
    left.set(xlabel="step", ylabel="training reward (%)", title="training reward: mean over seeds, band = min..max")
    right.set(xlabel="step", ylabel="held-out avg@2 (%)", title="held-out (200 problems)")
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write(ledger: Path, out: Path, task: str) -> dict:
    runs = collect(ledger, task)
    comparisons = {f"{a} - {b}": compare(runs, a, b) for a, b in COMPARISONS}
    acceptance = Path(ledger) / "acceptance.json"
    summary = {"task": task, "acceptance": json.loads(acceptance.read_text()) if acceptance.is_file() else None,
               "runs": {a: {str(s): {k: v for k, v in r.items() if k != "reward"} for s, r in b.items()} for a, b in runs.items()},
               "comparisons": comparisons, "decision": decide(comparisons)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if any(runs.values()):
        plot(runs, out / "curves.png")
    page = out / "README.md"
    if page.is_file() and BEGIN in page.read_text():
        head, rest = page.read_text().split(BEGIN, 1)
        page.write_text(head + BEGIN + "\n" + table(runs, comparisons) + "\n" + END + rest.split(END, 1)[1])
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ledger", type=Path, default=HERE / "ledger")
    p.add_argument("--out", type=Path, default=HERE)
    p.add_argument("--task", default="arith-1op2d")
    args = p.parse_args(argv)
    summary = write(args.ledger, args.out, args.task)
    print(table(collect(args.ledger, args.task), summary["comparisons"]))
    print(json.dumps(summary["decision"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
