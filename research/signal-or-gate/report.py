"""The signal-or-gate study's report, from its ledger alone: the pre-registered metrics and decision rule, in code.

    python research/signal-or-gate/report.py   # research/signal-or-gate/ledger -> summary.json, curves.png,
                                               # the page's table

Written with the pre-registration (README.md), before any result: what it computes is what the page
fixed. Per run (ledger/runs/<task>/<arm>-s<seed>/): the mean of `reward/mean` over all steps (the
primary metric), held-out avg@2 and pass@2 at steps 0, 6, 12, 16, the steps to 50% training reward
(first step whose mean of `reward/mean` over it and the two before reaches 0.5; steps + 1 if never),
`policy/entropy` at the last step, and CPU seconds: the whole run's (study_time.json) and the training
steps' own (their logged `time/step_cpu_s`, which a resume does not count twice). Per comparison (the
page's list): the paired difference over the seeds where both arms finished, mean ± standard error
(ddof 1), the paired t statistic, its two-sided p-value (df = n - 1) and 95% interval, for the primary
metric and for held-out avg@2 and pass@2 at each evaluated step. The decision rule is then applied:
test 1 (oar-g-q25 - random-gate-q25) and test 2 (oar-g-q25 - oar-g-q40), each at alpha 0.05, on
balanced pairs (each test on the seeds both its arms finished, recorded), and none on fewer than three.
The page's block also shows each comparison seed by seed and each run's own numbers and time (descriptive,
no metric of their own).

Before any number, every run is checked (`check_runs`): all runs ran the same settings but for their
arm's own (method, gate, credit module) and seed, steps 1..N each, from the model build the ledger
records; a run that fails stops the report. Runs made by different code (study_time.json's hashes of
train.py and oar/) are listed under the table: the study's code moved between its runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dataclasses import asdict  # noqa: E402

from oar.training.config import REMOVED, Config  # noqa: E402
from research.common import paired_t  # noqa: E402
from research.common.runs import fully_timed  # noqa: E402
from research.common.study_run import UNMEASURED  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from study import ARMS as ARM_RUNS  # noqa: E402  (what each arm's runs must have set)
from report_tables import SHAPE, table  # noqa: E402  (the page's block)

ARMS = ("grpo", "oar-g-q25", "random-gate-q25", "oar-g-q40", "inverted-q25")
COMPARISONS = (
    ("oar-g-q25", "random-gate-q25"),
    ("oar-g-q25", "oar-g-q40"),
    ("oar-g-q25", "grpo"),
    ("random-gate-q25", "grpo"),
    ("oar-g-q40", "grpo"),
    ("inverted-q25", "grpo"),
    ("inverted-q25", "random-gate-q25"),
)
ALPHA, MIN_SEEDS = 0.05, 3
# What an arm sets (study.py's ARMS), and what may differ between runs of one study without changing what is
# trained or measured: where the run and its model lie, and study_run's UNMEASURED settings
ARM_SETTINGS = {"method", "gate_quantile", "gate_boost", "credit_module", "seed"}
FREE_SETTINGS = UNMEASURED | {"model"}
BEGIN, END = "<!-- REPORT BEGIN (research/signal-or-gate/report.py) -->", "<!-- REPORT END -->"


def paired(diffs: list[float]) -> dict:
    """The page's paired test of differences (research/common/paired_t.py): two-sided at ALPHA, with its
    interval; no t, p or interval on fewer than MIN_SEEDS seeds."""
    return paired_t.paired(diffs, test_from=MIN_SEEDS, alpha=ALPHA)


def run_metrics(path: Path) -> dict | None:
    """One finished run's pre-registered numbers, or None when it has not finished."""
    if not (path / "summary.json").is_file():
        return None
    summary = json.loads((path / "summary.json").read_text())
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    reward = [r["reward/mean"] for r in rows]
    # the first step whose mean with the two before it reaches 0.5: a full window of three steps, so step 3 at the
    # earliest (less 1e-6: rewards are logged in float32, and a true mean of 0.5, e.g. 21, 23, 28 of 48, sums a hair
    # below it)
    reached = next(
        (i + 1 for i in range(2, len(reward)) if sum(reward[i - 2 : i + 1]) / 3 >= 0.5 - 1e-6), summary["steps"] + 1
    )
    held = {0: (summary["accuracy_before"], (summary.get("pass_before") or {}).get("pass@2"))}
    held |= {r["step"]: (r["eval/accuracy"], r.get("eval/pass@2")) for r in rows if "eval/accuracy" in r}
    held[summary["steps"]] = (summary["accuracy_after"], (summary.get("pass_after") or {}).get("pass@2"))
    timing = json.loads((path / "study_time.json").read_text()) if (path / "study_time.json").is_file() else {}
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else None
    build = (
        json.loads((path / "ledger.json").read_text()).get("weights_sha256")
        if (path / "ledger.json").is_file()
        else None
    )
    timed = fully_timed(timing, config or {})  # every invocation recorded its time
    return {
        "mean_reward": sum(reward) / len(reward),
        "reward": reward,
        "steps_to_50": reached,
        "final_entropy": rows[-1]["policy/entropy"],
        "heldout": {str(s): {"avg": a, "pass@2": p} for s, (a, p) in sorted(held.items())},
        "cpu_seconds": timing.get("cpu_seconds") if timed else None,
        # what study_time.json measured, whole or not (`timed`: every invocation recorded): the table of runs
        "wall_seconds_timed": timing.get("seconds"),
        "cpu_seconds_timed": timing.get("cpu_seconds"),
        "invocations": timing.get("invocations"),
        "timed": timed,
        "resumed": timing.get("invocations", 1) > 1 or bool(timing.get("unmeasured")),
        # the CPU of the training steps alone, each counted once (a resume drops the lines after its checkpoint
        # and logs them again): comparable between runs that stopped and ran straight, unlike cpu_seconds
        "step_cpu_seconds": sum(r["time/step_cpu_s"] for r in rows)
        if all("time/step_cpu_s" in r for r in rows)
        else None,
        "steps": summary["steps"],
        "steps_logged": [r["step"] for r in rows],
        "config": config,
        "build": build,
        # a run whose study process was killed while its train.py finished alone records no code version:
        # unknown, not the same as the others'
        "code": timing.get("code") or ["unrecorded"],
        "shape": {k: sum(r[k] for r in rows if k in r) / n for k in SHAPE if (n := sum(k in r for r in rows))},
    }


def check_runs(runs: dict, build: str | None) -> list[str]:
    """What would make the runs' comparison silently wrong, one line each: a run without its config.json,
    settings that differ between runs beyond their arm's own and FREE_SETTINGS (a setting a config.json lacks
    ran as its default), an arm's own settings other than study.py's for that arm, steps other than 1..N
    (N the same for all), a model build other than the ledger's (builds/<task>.json). Empty: all agree."""
    # a former flag a config.json lacks ran at the value this version fixes (config.REMOVED)
    defaults = {k: v for k, v in REMOVED.items() if v is not None} | asdict(Config())
    problems, first = [], None
    for arm, by_seed in runs.items():
        for seed, r in sorted(by_seed.items()):
            name = f"{arm}-s{seed}"
            if r["config"] is None:
                problems.append(f"{name}: no config.json")
                continue
            config = defaults | r["config"]
            if config.get("seed") != seed:
                problems.append(f"{name}: config.json says seed {config.get('seed')}")
            own = {
                k: (v, config.get(k))
                for k, v in (defaults | ARM_RUNS[arm]).items()
                if k in ARM_SETTINGS - {"seed"} and config.get(k) != v
            }
            if own:
                problems.append(f"{name}: not the arm's settings (study.py's, this run's): {own}")
            if r["steps_logged"] != list(range(1, r["steps"] + 1)):
                problems.append(f"{name}: metrics.jsonl has steps {r['steps_logged']}, not 1..{r['steps']}")
            if build is not None and r["build"] not in (None, build):
                problems.append(f"{name}: started from model build {r['build'][:12]}, the ledger's is {build[:12]}")
            shared = {k: v for k, v in config.items() if k not in ARM_SETTINGS | FREE_SETTINGS}
            if first is None:
                first = (name, shared, r["steps"])
                continue
            differ = {k: (first[1].get(k), v) for k, v in shared.items() if first[1].get(k) != v}
            if r["steps"] != first[2]:
                differ["steps run"] = (first[2], r["steps"])
            if differ:
                problems.append(f"{name}: settings differ from {first[0]}'s: {differ}")
    return problems


def collect(ledger: Path, task: str) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {a: {} for a in ARMS}
    for path in sorted((Path(ledger) / "runs" / task).glob("*-s*")):
        arm, seed = path.name.rsplit("-s", 1)
        got = run_metrics(path) if arm in runs else None
        if got is not None:
            runs[arm][int(seed)] = got
    return runs


def compare(runs: dict, a: str, b: str) -> dict:
    """a - b over the seeds where both finished, in points: the primary metric, and held-out avg@2 and pass@2
    at every step both evaluated (`heldout`, by step; `heldout_last`: avg@2 at the last step)."""
    seeds = sorted(set(runs[a]) & set(runs[b]))
    out = {
        "seeds": seeds,
        "mean_reward": paired([100 * (runs[a][s]["mean_reward"] - runs[b][s]["mean_reward"]) for s in seeds]),
    }
    steps = sorted(
        set.intersection(*[set(runs[x][s]["heldout"]) for s in seeds for x in (a, b)]) if seeds else set(), key=int
    )
    out["heldout"] = {
        step: {
            m: paired(
                [
                    100 * (runs[a][s]["heldout"][step][m] - runs[b][s]["heldout"][step][m])
                    for s in seeds
                    if runs[a][s]["heldout"][step][m] is not None and runs[b][s]["heldout"][step][m] is not None
                ]
            )
            for m in ("avg", "pass@2")
        }
        for step in steps
    }
    out["heldout_last"] = out["heldout"][steps[-1]]["avg"] if steps else paired([])
    return out


def compare_all(runs: dict) -> dict:
    """Every pre-registered comparison, by its name ("a - b")."""
    return {f"{a} - {b}": compare(runs, a, b) for a, b in COMPARISONS}


def decide(comparisons: dict) -> dict:
    """The page's decision rule on tests 1 and 2 (None: not enough balanced seeds to test)."""

    def verdict(key):
        c = comparisons[key]["mean_reward"]
        if c["n"] < MIN_SEEDS:
            return None
        if c.get("zero_spread"):
            return "no spread over seeds (no t-test)"
        return "positive" if c["p"] < ALPHA and c["mean"] > 0 else "negative" if c["p"] < ALPHA else "not significant"

    signal, gate = verdict("oar-g-q25 - random-gate-q25"), verdict("oar-g-q25 - oar-g-q40")
    held = comparisons["oar-g-q25 - oar-g-q40"]["heldout_last"]  # q25 - q40: "q25 is not behind q40" is a mean >= 0
    inverted = comparisons["inverted-q25 - random-gate-q25"]
    enough = inverted["mean_reward"]["n"] >= MIN_SEEDS
    return {
        "seeds": {
            "scores_carry_information": comparisons["oar-g-q25 - random-gate-q25"]["seeds"],  # each test's own pairs
            "change_default_gate_to_q25_b1": comparisons["oar-g-q25 - oar-g-q40"]["seeds"],
            "inverted_at_or_below_random": comparisons["inverted-q25 - random-gate-q25"]["seeds"],
        },
        "scores_carry_information": signal,
        # "ends at or below": read both ways (amendment 2), on the primary metric
        # and on held-out avg@2 at the last step
        "inverted_at_or_below_random": None
        if not enough
        else {
            "mean_training_reward": inverted["mean_reward"]["mean"] <= 0,
            "heldout_last_step": inverted["heldout_last"]["mean"] <= 0,
        },
        "change_default_gate_to_q25_b1": None
        if gate is None
        else gate == "positive" and held["n"] > 0 and held["mean"] >= 0,
    }


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


def write(ledger: Path, out: Path, task: str, echo: bool = False) -> dict:
    """summary.json, curves.png and the page's block in `out`, from the ledger; the block printed too with `echo`."""
    runs = collect(ledger, task)
    build = Path(ledger) / "builds" / f"{task}.json"
    problems = check_runs(runs, json.loads(build.read_text())["weights_sha256"] if build.is_file() else None)
    if problems:
        raise SystemExit("report.py: error: these runs cannot be compared as one study:\n  " + "\n  ".join(problems))
    comparisons = compare_all(runs)
    acceptance = Path(ledger) / "acceptance.json"
    summary = {
        "task": task,
        "acceptance": json.loads(acceptance.read_text()) if acceptance.is_file() else None,
        "runs": {
            a: {
                str(s): {k: v for k, v in r.items() if k not in ("reward", "config", "steps_logged")}
                for s, r in b.items()
            }
            for a, b in runs.items()
        },
        "comparisons": comparisons,
        "decision": decide(comparisons),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if any(runs.values()):
        plot(runs, out / "curves.png")
    page, block = out / "README.md", table(runs, comparisons)
    if page.is_file() and BEGIN in page.read_text():
        head, rest = page.read_text().split(BEGIN, 1)
        page.write_text(head + BEGIN + "\n" + block + "\n" + END + rest.split(END, 1)[1])
    if echo:
        print(block)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ledger", type=Path, default=HERE / "ledger")
    p.add_argument("--out", type=Path, default=HERE)
    p.add_argument("--task", default="arith-1op2d")
    args = p.parse_args(argv)
    print(json.dumps(write(args.ledger, args.out, args.task, echo=True)["decision"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
