"""The report of research/testbeds_v5/study_v5.py: whatever runs have finished -> research/testbeds_v5/ (rerunnable).

    python research/testbeds_v5/report_v5.py --root /work/study-v5 --out research/testbeds_v5
    python research/testbeds_v5/report_v5.py --ledger research/testbeds_v5/ledger --out research/testbeds_v5
                                                             # from the repository alone

Writes summary.json (per testbed and method: seeds, final accuracies, mean ± std, the paired
difference vs GRPO with its standard error, the held-out curve, times), runs.csv, curves.csv,
attribution.csv, accuracy.png and attribution.png (research/common/plots.py) and README.md
(research/testbeds_v5/report_v5_page.py). Only finished runs (summary.json) count; the page says how many of the
planned runs that is, and labels itself PARTIAL until all are.

Statistics: mean and sample std (ddof = 1) over seeds; a method vs GRPO is compared seed by seed
(same data order and same first rollouts): mean paired difference and its standard error
std / sqrt(n), n the seeds both have. Training seconds are the logged step times (evaluation
excluded); wall and CPU seconds are the whole run's (research/common/study_run.py's study_time.json), null
for a run with an invocation that was killed before it could record its time.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from oar.credit import METHODS  # noqa: E402
from research.testbeds_v5.study_v5 import COMPARED  # noqa: E402
from oar.tasks.teacher import fork_spans, slip_spans  # noqa: E402
from research.common.runs import accuracy_curve, read_run, stats  # noqa: E402
from research.common.study_ledger import run_entry  # noqa: E402

BEYOND = [m for m in METHODS if m not in COMPARED]  # methods named after the plan was fixed (oar-g+tempo, random-gate)
OPERATOR = re.compile(r" [-+*] ")  # between operands in arith's problem text ("Compute (75 - 1) - 3.")


def flaw_rates(run_dir: Path) -> dict | None:
    """The planted flaws in a run's final held-out completions (greedy; eval_final.jsonl, or the
    ledger's .gz): the share of 3-operation problems answered one line early (the fork: `#` opens
    line 3) and the share of completions with a slip (a written result that is not `a op b`; the
    model's own arithmetic errors count too). None when the run kept no completions."""
    for name, opener in (
        ("eval_final.jsonl", open),
        ("eval_final.jsonl.gz", gzip.open),
        ("eval.jsonl", open),
    ):  # the last: eval.py's
        if (run_dir / name).is_file():
            with opener(run_dir / name, "rt") as f:
                rows = [json.loads(line) for line in f if line.strip()]
            three = [r["completion"] for r in rows if len(OPERATOR.findall(r["problem"])) == 3]
            early = [any(text[a] == "#" for a, _ in fork_spans(text)) for text in three]
            return {
                "early_answers_3op": float(np.mean(early)) if early else math.nan,
                "with_slip": float(np.mean([bool(slip_spans(r["completion"])) for r in rows])),
                "completions": len(rows),
            }
    return None


def collect(root: Path, ledger: bool = False) -> dict:
    """The finished runs, attribution and builds under a study's --root, or in its ledger
    (research/common/study_ledger.py: the plan is then study_v5.py's default one)."""
    if ledger:
        from research.testbeds_v5.study_v5 import SETTINGS, parse_args, plan as default_plan

        plan = {
            "runs": default_plan(parse_args(["--root", "<root>"])),
            "settings": SETTINGS,
            "command": f"research/testbeds_v5/study_v5.py --ledger {root}",
        }
    else:
        plan = json.loads((root / "plan.json").read_text())
    runs, table = plan["runs"], {}
    where = lambda tb, name: run_entry(root, tb, name) if ledger else root / tb / name  # noqa: E731
    finished = 0
    for r in runs:
        run = read_run(where(r["testbed"], f"{r['method']}-s{r['seed']}"))
        if run is not None:
            finished += 1
            table.setdefault(r["testbed"], {}).setdefault(r["method"], {})[r["seed"]] = run
    # Finished runs of methods beyond the plan (study_v5.py --methods oar-g+tempo): reported beside
    # the plan's with the same statistics, and counted apart.
    beyond = set()
    for tb in sorted({r["testbed"] for r in runs}):
        for d in sorted(where(tb, "").glob("*-s*")):
            method, _, seed = d.name.rpartition("-s")
            if method in BEYOND and seed.isdigit() and (run := read_run(d)) is not None:
                table.setdefault(tb, {}).setdefault(method, {})[int(seed)] = run
                beyond.add(method)
    out = {}
    for tb, methods in table.items():
        grpo = methods.get("grpo", {})
        out[tb] = {}
        for m, by_seed in methods.items():
            seeds = sorted(by_seed)
            after = [by_seed[s]["summary"]["accuracy_after"] for s in seeds]
            flaws = [flaw_rates(by_seed[s]["dir"]) for s in seeds]
            curves: dict[int, list[float]] = {}
            diffs: dict[int, list[float]] = {}  # step -> this method's accuracy minus GRPO's, seed by seed
            rewards: dict[
                str, list[float]
            ] = {}  # "a-b" -> this method's mean train reward over steps a..b minus GRPO's
            for s in seeds:
                mine, base = dict(accuracy_curve(by_seed[s])), dict(accuracy_curve(grpo[s])) if s in grpo else {}
                for step, acc in mine.items():
                    curves.setdefault(step, []).append(acc)
                    if step in base:
                        diffs.setdefault(step, []).append(acc - base[step])
                if s in grpo:  # the same seed draws the same problems at every step, whatever the method
                    base_rewards = _reward_windows(grpo[s], sorted(mine))
                    for window, mean in _reward_windows(by_seed[s], sorted(mine)).items():
                        rewards.setdefault(window, []).append(mean - base_rewards[window])
            out[tb][m] = {
                "seeds": seeds,
                "accuracy_after": after,
                "accuracy_before": [by_seed[s]["summary"]["accuracy_before"] for s in seeds],
                **{k: v for k, v in stats(after).items() if k != "n"},
                "paired_diff_vs_grpo": _paired(
                    [
                        by_seed[s]["summary"]["accuracy_after"] - grpo[s]["summary"]["accuracy_after"]
                        for s in seeds
                        if s in grpo
                    ]
                ),
                "paired_curve_vs_grpo": {str(st): _paired(v) for st, v in sorted(diffs.items()) if st > 0},
                "paired_train_reward_vs_grpo": {w: _paired(v) for w, v in rewards.items()},
                "curve": {
                    str(st): {
                        "mean": float(np.mean(v)),
                        "std": float(np.std(v, ddof=1)) if len(v) > 1 else math.nan,
                        "n": len(v),
                    }
                    for st, v in sorted(curves.items())
                },
                "final_train_reward": stats([_last_mean(by_seed[s]["rows"], "reward/mean", 5) for s in seeds])["mean"],
                "final_policy_entropy": stats([_last_mean(by_seed[s]["rows"], "policy/entropy", 10) for s in seeds]),
                "train_seconds": [sum(x["time/step_s"] for x in by_seed[s]["rows"]) for s in seeds],
                "wall_seconds": [by_seed[s]["wall_seconds"] for s in seeds],
                "cpu_seconds": [by_seed[s]["cpu_seconds"] for s in seeds],
                "code": sorted({c for s in seeds for c in by_seed[s]["code"]}),
                "code_by_seed": [by_seed[s]["code"] for s in seeds],
                "flaws": {
                    k: stats([f[k] for f in flaws if f is not None]) for k in ("early_answers_3op", "with_slip")
                },
            }
    attribution = {p.stem: json.loads(p.read_text()) for p in sorted((root / "attribution").glob("*.json"))}
    build_files = (
        sorted((root / "builds").glob("*.json")) if ledger else sorted((root / "models").glob("*/build_info.json"))
    )
    builds = {
        (p.stem if ledger else p.parent.name): {k: v for k, v in json.loads(p.read_text()).items() if k != "recipe"}
        for p in build_files
    }
    return {
        "plan": plan,
        "finished": finished,
        "planned": len(runs),
        "testbeds": out,
        "attribution": attribution,
        "builds": builds,
        "beyond_plan": sorted(beyond),
    }


def _reward_windows(run: dict, evals: list[int]) -> dict[str, float]:
    """Mean sampled train reward over the steps between evaluations ("1-20", "21-40", ...)."""
    by_step = {r["step"]: r["reward/mean"] for r in run["rows"]}  # a resumed run may repeat a step: the last counts
    bounds = [e for e in evals if e > 0]
    return {
        f"{a + 1}-{b}": float(np.mean([by_step[t] for t in range(a + 1, b + 1) if t in by_step]))
        for a, b in zip([0] + bounds, bounds)
        if any(t in by_step for t in range(a + 1, b + 1))
    }


def _last_mean(rows: list[dict], key: str, n: int) -> float:
    """Mean of `key` over the last `n` logged steps that have it (NaN when none has)."""
    values = [r[key] for r in rows if key in r][-n:]
    return float(np.mean(values)) if values else math.nan


def _paired(diffs: list[float]) -> dict:
    """Mean of paired differences (method - GRPO, same seed), its standard error, and n."""
    st = stats(diffs)
    return {"mean": st["mean"], "se": st["std"] / math.sqrt(st["n"]) if st["n"] > 1 else math.nan, "n": st["n"]}


def _nan_to_null(x):
    """JSON has no NaN (Python writes it, strict parsers reject it): a statistic with too few seeds is null."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_nan_to_null(v) for v in x]
    return x


def write(root, out, ledger: bool = False) -> dict:
    """The report of the study under `root` (a --root, or with `ledger` its ledger) into `out`."""
    root, out = Path(root), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = collect(root, ledger)
    partial = data["finished"] < data["planned"]
    summary = {
        "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "report_command": f"python research/testbeds_v5/report_v5.py "
        f"--{'ledger' if ledger else 'root'} {root} --out {out}",
        "status": f"{'PARTIAL: ' if partial else ''}{data['finished']} of {data['planned']} runs finished",
        "command": data["plan"].get("command"),
        "settings": data["plan"]["settings"],
        "builds": data["builds"],
        "testbeds": data["testbeds"],
        "attribution": data["attribution"],
        "beyond_plan": data["beyond_plan"],
    }
    (out / "summary.json").write_text(json.dumps(_nan_to_null(summary), indent=2, allow_nan=False) + "\n")
    run_rows, curve_rows, attr_rows = [], [], []
    for tb, methods in data["testbeds"].items():
        for m, v in methods.items():
            for s, b, a, t, w, c, code in zip(
                v["seeds"],
                v["accuracy_before"],
                v["accuracy_after"],
                v["train_seconds"],
                v["wall_seconds"],
                v["cpu_seconds"],
                v["code_by_seed"],
            ):
                run_rows.append(
                    {
                        "testbed": tb,
                        "method": m,
                        "seed": s,
                        "accuracy_before": b,
                        "accuracy_after": a,
                        "train_seconds": round(t, 1),
                        "wall_seconds": round(w, 1),
                        "cpu_seconds": round(c, 1),
                        "code": "+".join(code),
                    }
                )
            curve_rows += [{"testbed": tb, "method": m, "step": int(st), **c} for st, c in v["curve"].items()]
    for tb, a in data["attribution"].items():
        attr_rows += [{"testbed": tb, **r} for r in a["table"]]
    for name, rows in [("runs.csv", run_rows), ("curves.csv", curve_rows), ("attribution.csv", attr_rows)]:
        with open(out / name, "w", newline="") as f:
            if rows:
                w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
                w.writeheader()
                w.writerows(rows)
    from research.common import plots
    from research.testbeds_v5 import report_v5_page

    images = []
    if curve_rows:
        images.append(plots.testbed_accuracy(data["testbeds"], out / "accuracy.png"))
    if attr_rows:
        images.append(plots.known_token_weights(data["attribution"], out / "attribution.png"))
    (out / "README.md").write_text(report_v5_page.markdown(summary, images))
    print(f"[report] {out}/: {summary['status']}; {len(images)} plots", flush=True)
    return summary


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--root", type=Path, default=Path("/work/study-v5"), help="a study's root (its runs, models and attribution)"
    )
    where.add_argument(
        "--ledger", type=Path, default=None, help="a study's ledger instead: the report from the repository alone"
    )
    p.add_argument("--out", type=Path, default=Path("research/testbeds_v5"))
    a = p.parse_args()
    write(a.ledger or a.root, a.out, ledger=a.ledger is not None)
