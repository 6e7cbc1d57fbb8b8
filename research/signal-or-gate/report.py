"""The signal-or-gate study's report, from its ledger alone: the pre-registered metrics and decision rule, in code.

    python research/signal-or-gate/report.py                  # research/signal-or-gate/ledger -> summary.json, curves.png, the page's table

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

from oar.training.config import Config  # noqa: E402
from research.common import paired_t  # noqa: E402
from research.common.runs import fully_timed  # noqa: E402
from research.common.study_run import UNMEASURED  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from study import ARMS as ARM_RUNS  # noqa: E402  (what each arm's runs must have set)
from study import SETTINGS  # noqa: E402  (what every run is planned with)
ARMS = ("grpo", "oar-g-q25", "random-gate-q25", "oar-g-q40", "inverted-q25")
COMPARISONS = (("oar-g-q25", "random-gate-q25"), ("oar-g-q25", "oar-g-q40"), ("oar-g-q25", "grpo"), ("random-gate-q25", "grpo"),
               ("oar-g-q40", "grpo"), ("inverted-q25", "grpo"), ("inverted-q25", "random-gate-q25"))
ALPHA, MIN_SEEDS = 0.05, 3
# What an arm sets (study.py's ARMS), and what may differ between runs of one study without changing what is
# trained or measured: where the run and its model lie, and study_run's UNMEASURED settings
ARM_SETTINGS = {"method", "gate_quantile", "gate_boost", "credit_module", "seed"}
FREE_SETTINGS = UNMEASURED | {"model"}
# The gate's shape per arm (the page: "reported, not decided on"): means over the steps of train.py's diagnostics
SHAPE = {"oar/ess_ratio": "ESS", "oar/weight_max": "weight max", "oar/frac_boosted": "boosted", "oar/frac_suppressed": "suppressed"}
# FREE_SETTINGS that change a run's arithmetic, not what it trains: the run table names a run that ran another value than planned
ROUNDING = ("micro_batch_size", "gradient_checkpointing", "decode_loop")
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
    # the first step whose mean with the two before it reaches 0.5: a full window of three steps, so step 3 at the earliest
    # (less 1e-6: rewards are logged in float32, and a true mean of 0.5, e.g. 21, 23, 28 of 48, sums a hair below it)
    reached = next((i + 1 for i in range(2, len(reward)) if sum(reward[i - 2: i + 1]) / 3 >= 0.5 - 1e-6), summary["steps"] + 1)
    held = {0: (summary["accuracy_before"], (summary.get("pass_before") or {}).get("pass@2"))}
    held |= {r["step"]: (r["eval/accuracy"], r.get("eval/pass@2")) for r in rows if "eval/accuracy" in r}
    held[summary["steps"]] = (summary["accuracy_after"], (summary.get("pass_after") or {}).get("pass@2"))
    timing = json.loads((path / "study_time.json").read_text()) if (path / "study_time.json").is_file() else {}
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else None
    build = json.loads((path / "ledger.json").read_text()).get("weights_sha256") if (path / "ledger.json").is_file() else None
    return {"mean_reward": sum(reward) / len(reward), "reward": reward, "steps_to_50": reached, "final_entropy": rows[-1]["policy/entropy"],
            "heldout": {str(s): {"avg": a, "pass@2": p} for s, (a, p) in sorted(held.items())},
            "cpu_seconds": timing.get("cpu_seconds") if fully_timed(timing, config or {}) else None,
            # what study_time.json measured, whole or not (`timed`: every invocation recorded): the table of runs
            "wall_seconds_timed": timing.get("seconds"), "cpu_seconds_timed": timing.get("cpu_seconds"),
            "invocations": timing.get("invocations"), "timed": fully_timed(timing, config or {}),
            "resumed": timing.get("invocations", 1) > 1 or bool(timing.get("unmeasured")),
            # the CPU of the training steps alone, each counted once (a resume drops the lines after its checkpoint
            # and logs them again): comparable between runs that stopped and ran straight, unlike cpu_seconds
            "step_cpu_seconds": sum(r["time/step_cpu_s"] for r in rows) if all("time/step_cpu_s" in r for r in rows) else None,
            "steps": summary["steps"], "steps_logged": [r["step"] for r in rows], "config": config, "build": build,
            # a run whose study process was killed while its train.py finished alone records no code version:
            # unknown, not the same as the others'
            "code": timing.get("code") or ["unrecorded"],
            "shape": {k: sum(r[k] for r in rows if k in r) / n for k in SHAPE if (n := sum(k in r for r in rows))}}


def check_runs(runs: dict, build: str | None) -> list[str]:
    """What would make the runs' comparison silently wrong, one line each: a run without its config.json,
    settings that differ between runs beyond their arm's own and FREE_SETTINGS (a setting a config.json lacks
    ran as its default), an arm's own settings other than study.py's for that arm, steps other than 1..N
    (N the same for all), a model build other than the ledger's (builds/<task>.json). Empty: all agree."""
    defaults = asdict(Config())
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
            own = {k: (v, config.get(k)) for k, v in (defaults | ARM_RUNS[arm]).items() if k in ARM_SETTINGS - {"seed"} and config.get(k) != v}
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
    out = {"seeds": seeds, "mean_reward": paired([100 * (runs[a][s]["mean_reward"] - runs[b][s]["mean_reward"]) for s in seeds])}
    steps = sorted(set.intersection(*[set(runs[x][s]["heldout"]) for s in seeds for x in (a, b)]) if seeds else set(), key=int)
    out["heldout"] = {step: {m: paired([100 * (runs[a][s]["heldout"][step][m] - runs[b][s]["heldout"][step][m]) for s in seeds
                                        if runs[a][s]["heldout"][step][m] is not None and runs[b][s]["heldout"][step][m] is not None])
                             for m in ("avg", "pass@2")} for step in steps}
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
    return {"seeds": {"scores_carry_information": comparisons["oar-g-q25 - random-gate-q25"]["seeds"],  # each test's own pairs
                      "change_default_gate_to_q25_b1": comparisons["oar-g-q25 - oar-g-q40"]["seeds"],
                      "inverted_at_or_below_random": comparisons["inverted-q25 - random-gate-q25"]["seeds"]},
            "scores_carry_information": signal,
            # "ends at or below": read both ways (amendment 2), on the primary metric and on held-out avg@2 at the last step
            "inverted_at_or_below_random": None if not enough else {
                "mean_training_reward": inverted["mean_reward"]["mean"] <= 0, "heldout_last_step": inverted["heldout_last"]["mean"] <= 0},
            "change_default_gate_to_q25_b1": None if gate is None else gate == "positive" and held["n"] > 0 and held["mean"] >= 0}


def table(runs: dict, comparisons: dict) -> str:
    """The page's block: the arms, the gate's shape, the paired differences, each seed's differences, each run."""
    return "\n\n".join((arm_table(runs), shape_table(runs), difference_table(comparisons), seed_table(runs),
                        run_table(runs)) + ((versions,) if (versions := code_versions(runs)) else ()))


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def _pts(x: float, sign: str = "+") -> str:
    """Points to one decimal, rounded first: 100 * (0.45 - 0.5275) is -7.7499..., shown -7.8."""
    return f"{round(x, 9):{sign}.1f}"


def _count(k: int) -> str:
    return f"{k} run{'s' * (k != 1)}"


def arm_table(runs: dict) -> str:
    """Each arm's mean over its own seeds of the pre-registered metrics, and its CPU."""
    lines = ["| arm | seeds | mean training reward | held-out avg@2 at steps 0 / 6 / 12 / 16 | steps to 50% | final entropy "
             "| CPU min in the steps | CPU min, whole run |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm, by_seed in runs.items():
        if not by_seed:
            lines.append(f"| {arm} | 0 | | | | | | |")
            continue
        steps = sorted({s for r in by_seed.values() for s in r["heldout"]}, key=int)
        held = " / ".join(f"{100 * _mean([r['heldout'][s]['avg'] for r in by_seed.values() if s in r['heldout']]):.1f}%" for s in steps)
        steps_cpu = [r["step_cpu_seconds"] for r in by_seed.values() if r["step_cpu_seconds"] is not None]
        in_steps = f"{_mean(steps_cpu) / 60:.0f} ({_count(len(steps_cpu))})" if steps_cpu else "not logged"
        cpu = [r["cpu_seconds"] for r in by_seed.values() if r["cpu_seconds"]]
        timed = f"{_mean(cpu) / 60:.0f} ({_count(len(cpu))})" if cpu else "not measured"
        if resumed := sum(r["resumed"] for r in by_seed.values() if r["cpu_seconds"]):
            timed += f", {resumed} resumed (with its redone steps and reloads)"
        if 0 < len(cpu) < len(by_seed) or not cpu:
            timed += f"; {_count(len(by_seed) - len(cpu))} killed mid-way, time lost"
        lines.append(f"| {arm} | {len(by_seed)} ({', '.join(map(str, sorted(by_seed)))}) | {100 * _mean([r['mean_reward'] for r in by_seed.values()]):.1f}% | "
                     f"{held} | {_mean([r['steps_to_50'] for r in by_seed.values()]):.1f} | {_mean([r['final_entropy'] for r in by_seed.values()]):.3f} | "
                     f"{in_steps} | {timed} |")
    return "\n".join(lines + ["", "Each row is its arm's mean over its own seeds (listed); the paired differences below compare the seeds "
                              "both arms finished. CPU in the steps: the sum of each logged step's `time/step_cpu_s` (training only, each "
                              "step once); whole run: study_time.json, which also counts evaluations, model loads and, after a resume, the "
                              "steps redone. Neither records the machine."])


def shape_table(runs: dict) -> str:
    """OAR's diagnostics per arm, means over seeds and steps."""
    lines = ["The gate's shape, means over steps (reported, not decided on):", "",
             "| arm | " + " | ".join(SHAPE.values()) + " |", "| --- |" + " --- |" * len(SHAPE)]
    for arm, by_seed in runs.items():
        shapes = [r["shape"] for r in by_seed.values() if r["shape"]]
        if shapes:
            cells = [[x[k] for x in shapes if k in x] for k in SHAPE]
            lines.append(f"| {arm} | " + " | ".join(f"{_mean(c):.3f}" if c else "n/a" for c in cells) + " |")
    return "\n".join(lines)


def difference_table(comparisons: dict) -> str:
    """The pre-registered paired differences: mean ± s.e., and from MIN_SEEDS seeds the t-test and interval."""
    lines = ["| paired difference (points) | seeds | mean training reward ± s.e. (t, p; 95% interval) | held-out avg@2 at the last "
             "step ± s.e. [95% interval] | held-out pass@2 at the last step ± s.e. [95% interval] |", "| --- | --- | --- | --- | --- |"]
    for key, c in comparisons.items():
        last = c["heldout"][max(c["heldout"], key=int)]["pass@2"] if c["heldout"] else paired([])
        ci = lambda x: f"{_pts(x['ci'][0])} to {_pts(x['ci'][1])}"  # noqa: E731
        fmt = lambda x, tp=True: "n/a" if not x["n"] else _pts(x["mean"]) + (f" ± {_pts(x['se'], '')}" if x["se"] is not None else "") + (  # noqa: E731
            (f" (t = {x['t']:.2f}, p = {x['p']:.3f}; {ci(x)})" if tp else f" [{ci(x)}]") if x["t"] is not None else "")
        lines.append(f"| {key} | {len(c['seeds'])} | {fmt(c['mean_reward'])} | {fmt(c['heldout_last'], False)} | {fmt(last, False)} |")
    return "\n".join(lines)


def seed_table(runs: dict) -> str:
    """Each comparison seed by seed: the differences the table above summarizes (blank where an arm lacks the seed)."""
    seeds = sorted({s for by_seed in runs.values() for s in by_seed})
    lines = ["Seed by seed (points: mean training reward / held-out avg@2 at the last step):", "",
             "| paired difference | " + " | ".join(f"seed {s}" for s in seeds) + " |", "| --- |" + " --- |" * len(seeds)]
    for a, b in COMPARISONS:
        cells = []
        for s in seeds:
            if s not in runs[a] or s not in runs[b]:
                cells.append("")
                continue
            x, y = runs[a][s], runs[b][s]
            last = str(max(set(x["heldout"]) & set(y["heldout"]), key=int))
            cells.append(f"{_pts(100 * (x['mean_reward'] - y['mean_reward']))} / {_pts(100 * (x['heldout'][last]['avg'] - y['heldout'][last]['avg']))}")
        lines.append(f"| {a} - {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_table(runs: dict) -> str:
    """One row a run, in the plan's order (seed by seed, the arms in order): its own numbers and what it cost."""
    lines = ["Each run (whole run: study_time.json's wall and CPU minutes over its invocations; \"at least\" where an invocation "
             "was killed before it could record its time; in parentheses, a setting that changes only the run's rounding, where it "
             "ran another value than planned):", "",
             "| run | mean training reward | training reward a step, min - max | held-out avg@2, step 0 -> last | steps to 50% "
             "| CPU min in the steps | whole run: wall min, CPU min |", "| --- | --- | --- | --- | --- | --- | --- |"]
    planned = asdict(Config()) | SETTINGS
    for seed in sorted({s for by_seed in runs.values() for s in by_seed}):
        for arm, by_seed in runs.items():
            if (r := by_seed.get(seed)) is None:
                continue
            other = [f"{k} {(r['config'] or {}).get(k)}" for k in ROUNDING if (r["config"] or {}).get(k, planned[k]) != planned[k]]
            name = f"{arm}-s{seed}" + (f" ({', '.join(other)})" if other else "")
            held = [r["heldout"][s]["avg"] for s in sorted(r["heldout"], key=int)]
            steps_cpu = "not logged" if r["step_cpu_seconds"] is None else f"{r['step_cpu_seconds'] / 60:.0f}"
            reached = r["steps_to_50"] if r["steps_to_50"] <= r["steps"] else f"not reached ({r['steps_to_50']})"
            if r["wall_seconds_timed"] is None:
                whole = "not recorded"
            else:
                whole = f"{r['wall_seconds_timed'] / 60:.0f}, {r['cpu_seconds_timed'] / 60:.0f}"
                whole = whole if r["timed"] else f"at least {whole}"
                whole += f" ({r['invocations']} invocations)" if (r["invocations"] or 1) > 1 else ""
            lines.append(f"| {name} | {100 * r['mean_reward']:.1f}% | {100 * min(r['reward']):.0f}-{100 * max(r['reward']):.0f}% | "
                         f"{100 * held[0]:.1f}% -> {100 * held[-1]:.1f}% | {reached} | {steps_cpu} | {whole} |")
    return "\n".join(lines)


def code_versions(runs: dict) -> str:
    """Which code made which runs, when more than one version did ('' when one did)."""
    versions = sorted({v for by_seed in runs.values() for r in by_seed.values() for v in r["code"]})
    if len(versions) < 2:
        return ""
    made = {v: [f"{arm}-s{s}" for arm, by_seed in runs.items() for s, r in sorted(by_seed.items()) if v in r["code"]] for v in versions}
    return (f"The runs were made by {len(versions)} versions of train.py and oar/ (study_time.json): "
            + "; ".join(f"{v}: {', '.join(names)}" for v, names in made.items()) + ".")


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
    summary = {"task": task, "acceptance": json.loads(acceptance.read_text()) if acceptance.is_file() else None,
               "runs": {a: {str(s): {k: v for k, v in r.items() if k not in ("reward", "config", "steps_logged")} for s, r in b.items()}
                        for a, b in runs.items()},
               "comparisons": comparisons, "decision": decide(comparisons)}
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
