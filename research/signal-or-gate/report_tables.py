"""The signal-or-gate page's report block, rendered from report.py's runs and comparisons
(research/signal-or-gate/report.py computes them; this file only lays them out): the arms, the gate's shape, the
paired differences, each comparison seed by seed and each run's own numbers and time.
"""

from __future__ import annotations

from dataclasses import asdict

from oar.training.config import REMOVED, Config
from research.common import paired_t
from study import SETTINGS  # what every run is planned with

# The gate's shape per arm (the page: "reported, not decided on"): means over the steps of train.py's diagnostics
SHAPE = {
    "oar/ess_ratio": "ESS",
    "oar/weight_max": "weight max",
    "oar/frac_boosted": "boosted",
    "oar/frac_suppressed": "suppressed",
}
# FREE_SETTINGS that change a run's arithmetic, not what it trains: the run table names a run that ran another value
# than planned
ROUNDING = ("micro_batch_size", "gradient_checkpointing", "decode_loop")


def table(runs: dict, comparisons: dict) -> str:
    """The page's block: the arms, the gate's shape, the paired differences, each seed's differences, each run."""
    return "\n\n".join(
        (
            arm_table(runs),
            shape_table(runs),
            difference_table(comparisons),
            seed_table(runs, comparisons),
            run_table(runs),
        )
        + ((versions,) if (versions := code_versions(runs)) else ())
    )


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def _pts(x: float, sign: str = "+") -> str:
    """Points to one decimal, rounded first: 100 * (0.45 - 0.5275) is -7.7499..., shown -7.8."""
    return f"{round(x, 9):{sign}.1f}"


def _count(k: int) -> str:
    return f"{k} run{'s' * (k != 1)}"


def arm_table(runs: dict) -> str:
    """Each arm's mean over its own seeds of the pre-registered metrics, and its CPU."""
    lines = [
        "| arm | seeds | mean training reward | held-out avg@2 at steps 0 / 6 / 12 / 16 | steps to 50% "
        "| final entropy | CPU min in the steps | CPU min, whole run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, by_seed in runs.items():
        if not by_seed:
            lines.append(f"| {arm} | 0 | | | | | | |")
            continue
        steps = sorted({s for r in by_seed.values() for s in r["heldout"]}, key=int)
        held = " / ".join(
            f"{100 * _mean([r['heldout'][s]['avg'] for r in by_seed.values() if s in r['heldout']]):.1f}%"
            for s in steps
        )
        steps_cpu = [r["step_cpu_seconds"] for r in by_seed.values() if r["step_cpu_seconds"] is not None]
        in_steps = f"{_mean(steps_cpu) / 60:.0f} ({_count(len(steps_cpu))})" if steps_cpu else "not logged"
        cpu = [r["cpu_seconds"] for r in by_seed.values() if r["cpu_seconds"]]
        timed = f"{_mean(cpu) / 60:.0f} ({_count(len(cpu))})" if cpu else "not measured"
        if resumed := sum(r["resumed"] for r in by_seed.values() if r["cpu_seconds"]):
            timed += f", {resumed} resumed (with its redone steps and reloads)"
        if 0 < len(cpu) < len(by_seed) or not cpu:
            timed += f"; {_count(len(by_seed) - len(cpu))} killed mid-way, time lost"
        lines.append(
            f"| {arm} | {len(by_seed)} ({', '.join(map(str, sorted(by_seed)))}) "
            f"| {100 * _mean([r['mean_reward'] for r in by_seed.values()]):.1f}% | {held} "
            f"| {_mean([r['steps_to_50'] for r in by_seed.values()]):.1f} "
            f"| {_mean([r['final_entropy'] for r in by_seed.values()]):.3f} | {in_steps} | {timed} |"
        )
    return "\n".join(
        lines
        + [
            "",
            "Each row is its arm's mean over its own seeds (listed); the paired differences below compare the seeds "
            "both arms finished. CPU in the steps: the sum of each logged step's `time/step_cpu_s` (training only, "
            "each step once); whole run: study_time.json, which also counts evaluations, model loads and, after a "
            "resume, the steps redone. Neither records the machine.",
        ]
    )


def shape_table(runs: dict) -> str:
    """OAR's diagnostics per arm, means over seeds and steps."""
    lines = [
        "The gate's shape, means over steps (reported, not decided on):",
        "",
        "| arm | " + " | ".join(SHAPE.values()) + " |",
        "| --- |" + " --- |" * len(SHAPE),
    ]
    for arm, by_seed in runs.items():
        shapes = [r["shape"] for r in by_seed.values() if r["shape"]]
        if shapes:
            cells = [[x[k] for x in shapes if k in x] for k in SHAPE]
            lines.append(f"| {arm} | " + " | ".join(f"{_mean(c):.3f}" if c else "n/a" for c in cells) + " |")
    return "\n".join(lines)


def difference_table(comparisons: dict) -> str:
    """The pre-registered paired differences: mean ± s.e., and from MIN_SEEDS seeds the t-test and interval."""
    lines = [
        "| paired difference (points) | seeds | mean training reward ± s.e. (t, p; 95% interval) "
        "| held-out avg@2 at the last step ± s.e. [95% interval] "
        "| held-out pass@2 at the last step ± s.e. [95% interval] |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key, c in comparisons.items():
        last = c["heldout"][max(c["heldout"], key=int)]["pass@2"] if c["heldout"] else paired_t.paired([])
        ci = lambda x: f"{_pts(x['ci'][0])} to {_pts(x['ci'][1])}"  # noqa: E731
        fmt = lambda x, tp=True: (  # noqa: E731
            "n/a"
            if not x["n"]
            else _pts(x["mean"])
            + (f" ± {_pts(x['se'], '')}" if x["se"] is not None else "")
            + (
                (f" (t = {x['t']:.2f}, p = {x['p']:.3f}; {ci(x)})" if tp else f" [{ci(x)}]")
                if x["t"] is not None
                else ""
            )
        )
        lines.append(
            f"| {key} | {len(c['seeds'])} | {fmt(c['mean_reward'])} | {fmt(c['heldout_last'], False)} "
            f"| {fmt(last, False)} |"
        )
    return "\n".join(lines)


def seed_table(runs: dict, comparisons: dict) -> str:
    """Each comparison seed by seed: the differences the table above summarizes (blank where an arm lacks the seed)."""
    seeds = sorted({s for by_seed in runs.values() for s in by_seed})
    lines = [
        "Seed by seed (points: mean training reward / held-out avg@2 at the last step):",
        "",
        "| paired difference | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "| --- |" + " --- |" * len(seeds),
    ]
    for a, b in (key.split(" - ") for key in comparisons):
        cells = []
        for s in seeds:
            if s not in runs[a] or s not in runs[b]:
                cells.append("")
                continue
            x, y = runs[a][s], runs[b][s]
            last = str(max(set(x["heldout"]) & set(y["heldout"]), key=int))
            cells.append(
                f"{_pts(100 * (x['mean_reward'] - y['mean_reward']))} / "
                f"{_pts(100 * (x['heldout'][last]['avg'] - y['heldout'][last]['avg']))}"
            )
        lines.append(f"| {a} - {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_table(runs: dict) -> str:
    """One row a run, in the plan's order (seed by seed, the arms in order): its own numbers and what it cost."""
    lines = [
        'Each run (whole run: study_time.json\'s wall and CPU minutes over its invocations; "at least" where an '
        "invocation was killed before it could record its time; in parentheses, a setting that changes only the run's "
        "rounding, where it ran another value than planned):",
        "",
        "| run | mean training reward | training reward a step, min - max | held-out avg@2, step 0 -> last "
        "| steps to 50% | CPU min in the steps | whole run: wall min, CPU min |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    planned = {k: REMOVED[k] for k in ROUNDING if k in REMOVED} | asdict(Config()) | SETTINGS
    for seed in sorted({s for by_seed in runs.values() for s in by_seed}):
        for arm, by_seed in runs.items():
            if (r := by_seed.get(seed)) is None:
                continue
            other = [
                f"{k} {(r['config'] or {}).get(k)}"
                for k in ROUNDING
                if (r["config"] or {}).get(k, planned[k]) != planned[k]  # a former flag: its fixed value
            ]
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
            lines.append(
                f"| {name} | {100 * r['mean_reward']:.1f}% "
                f"| {100 * min(r['reward']):.0f}-{100 * max(r['reward']):.0f}% "
                f"| {100 * held[0]:.1f}% -> {100 * held[-1]:.1f}% | {reached} | {steps_cpu} | {whole} |"
            )
    return "\n".join(lines)


def code_versions(runs: dict) -> str:
    """Which code made which runs, when more than one version did ('' when one did)."""
    versions = sorted({v for by_seed in runs.values() for r in by_seed.values() for v in r["code"]})
    if len(versions) < 2:
        return ""
    made = {
        v: [f"{arm}-s{s}" for arm, by_seed in runs.items() for s, r in sorted(by_seed.items()) if v in r["code"]]
        for v in versions
    }
    return (
        f"The runs were made by {len(versions)} versions of train.py and oar/ (study_time.json): "
        + "; ".join(f"{v}: {', '.join(names)}" for v, names in made.items())
        + "."
    )
