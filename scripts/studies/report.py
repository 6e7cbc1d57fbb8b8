"""The study's report: runs/study -> docs/results (summary.json, CSVs, PNGs, README.md). Called by
`scripts/studies/study.py --stage report`; reads what the other stages left and runs nothing.

Inputs: plan-main.json / plan-ablations.json (which run is which variant), each run's config.json,
summary.json, metrics.jsonl and study_time.json, and attribution.json. Only finished runs (with
summary.json) count; the README lists the ones missing instead of dropping them silently.

Statistics: mean and sample std (ddof=1) across seeds. OAR vs GRPO is compared seed by seed (one
seed = the same data order and the same first-step rollouts for every method): the paired
difference's mean and standard error; with 3 seeds only a gap beyond ~2 standard errors is called a
difference. One evaluation on n problems also carries binomial noise sqrt(p(1-p)/n), ~2 points at
n = 500, p = 0.5. Wall-clock: training seconds are the sum of the logged step times (evaluation
excluded, so methods compare on the work they differ in); wall seconds include evaluation.
"""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path

import numpy as np

from scripts.studies import plots

TRAIN_KEYS = {"reward_mean": "reward/mean", "entropy": "policy/entropy", "ess_ratio": "oar/ess_ratio",
              "completion_length": "completion/length", "frac_boosted": "oar/frac_boosted", "frac_suppressed": "oar/frac_suppressed"}


def read_run(path: Path) -> dict | None:
    """A finished run's files, or None when it has no summary.json yet."""
    if not (path / "summary.json").exists():
        return None
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    config = json.loads((path / "config.json").read_text())
    timing = json.loads((path / "study_time.json").read_text()) if (path / "study_time.json").exists() else {}
    whole = fully_timed(timing, config)
    return {"dir": path, "config": config, "summary": json.loads((path / "summary.json").read_text()), "rows": rows,
            "wall_seconds": timing["seconds"] if whole else math.nan,
            "cpu_seconds": timing.get("cpu_seconds", math.nan) if whole else math.nan,
            "code": timing.get("code", [])}


def fully_timed(timing: dict, config: dict) -> bool:
    """Whether study_time.json holds every invocation of the run: not when one was killed before it
    could write its time (scripts/studies/study_run.py counts those as `unmeasured`; older files show it as a
    resumed run with a single recorded invocation)."""
    return bool(timing) and not timing.get("unmeasured") and not timing.get("open") and \
        not (config.get("resume") and timing.get("invocations", 0) < 2)


def accuracy_curve(run: dict) -> list[tuple[int, float]]:
    """(step, held-out accuracy): before training, every --eval_every, after the last step."""
    s = run["summary"]
    curve = [(0, s["accuracy_before"])] + [(r["step"], r["eval/accuracy"]) for r in run["rows"] if "eval/accuracy" in r]
    return curve + [(s["steps"], s["accuracy_after"])]


def stats(values) -> dict:
    v = np.array([x for x in values if x is not None and not math.isnan(x)], dtype=np.float64)
    return {"mean": float(v.mean()) if len(v) else math.nan, "std": float(v.std(ddof=1)) if len(v) > 1 else math.nan, "n": len(v)}


def load_plan(root: Path, stage: str) -> list[dict]:
    path = root / f"plan-{stage}.json"
    return json.loads(path.read_text())["runs"] if path.exists() else []


def write(root, out, *, scale: str = "default", command: str = "--stage report") -> dict:
    root, out = Path(root), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs, missing = {}, []
    for r in load_plan(root, "main") + load_plan(root, "ablations"):
        d = root / f"{r['name']}-s{r['seed']}"
        if d not in runs:
            runs[d] = read_run(d)
            if runs[d] is None:
                missing.append(d.name)

    # -- main comparison
    methods: dict[str, dict] = {}
    for r in load_plan(root, "main"):
        run = runs[root / f"{r['name']}-s{r['seed']}"]
        if run is not None:
            methods.setdefault(r["name"], {})[r["seed"]] = run
    table, curve_rows, train_rows = {}, [], []
    grpo = methods.get("grpo", {})
    for m, by_seed in methods.items():
        seeds = sorted(by_seed)
        after = [by_seed[s]["summary"]["accuracy_after"] for s in seeds]
        train_s = [sum(r["time/step_s"] for r in by_seed[s]["rows"]) for s in seeds]
        paired = [by_seed[s]["summary"]["accuracy_after"] - grpo[s]["summary"]["accuracy_after"] for s in seeds if s in grpo]
        p = stats(paired)
        table[m] = {"seeds": seeds, "accuracy_after": after, **{k: v for k, v in stats(after).items() if k != "n"},
                    "accuracy_before": [by_seed[s]["summary"]["accuracy_before"] for s in seeds],
                    "train_seconds": train_s, "seconds_per_step": stats([by_seed[s]["summary"]["seconds_per_step"] for s in seeds])["mean"],
                    "wall_seconds": [by_seed[s]["wall_seconds"] for s in seeds], "cpu_seconds": [by_seed[s]["cpu_seconds"] for s in seeds],
                    "oar_seconds_per_rollout": stats([np.mean([r["oar/seconds_per_rollout"] for r in by_seed[s]["rows"]]) for s in seeds])["mean"],
                    "paired_diff_vs_grpo": {"mean": p["mean"], "se": p["std"] / math.sqrt(p["n"]) if p["n"] > 1 else math.nan, "n": p["n"]}}
        for s in seeds:
            curve_rows += [{"method": m, "seed": s, "step": st, "accuracy": a} for st, a in accuracy_curve(by_seed[s])]
            train_rows += [{"method": m, "seed": s, "step": r["step"], **{k: r.get(v, math.nan) for k, v in TRAIN_KEYS.items()}} for r in by_seed[s]["rows"]]
    if "grpo" in table:
        for m in table:
            table[m]["overhead_vs_grpo"] = stats(table[m]["train_seconds"])["mean"] / stats(table["grpo"]["train_seconds"])["mean"]

    # -- ablations (every variant, including those that are the main oar-g run)
    abl_rows = []
    for r in load_plan(root, "ablations"):
        run = runs[root / f"{r['name']}-s{r['seed']}"]
        if run is not None:
            abl_rows.append({"group": r["group"], "label": r["label"], "run": r["name"], "seed": r["seed"],
                             "accuracy_after": run["summary"]["accuracy_after"]})

    attribution = json.loads((root / "attribution.json").read_text()) if (root / "attribution.json").exists() else None
    attr_rows = [{"source": src, **row} for src, v in (attribution or {}).get("sources", {}).items() for row in v["table"]]

    any_run = next((r for r in runs.values() if r is not None), None)
    setup = {}
    if any_run:
        c = any_run["config"]
        setup = {k: c[k] for k in ("model", "dataset", "steps", "prompts_per_step", "group_size", "max_new_tokens", "learning_rate",
                                   "temperature", "eval_every", "eval_size", "gate_quantile", "gate_boost", "gate_floor", "probe")}
        setup["rollouts_per_run"] = c["steps"] * c["prompts_per_step"] * c["group_size"]
    summary = {"generated": time.strftime("%Y-%m-%d %H:%M"), "scale": scale, "root": str(root), "command": f"python scripts/studies/study.py {command}", "setup": setup,
               "held_out": {"data": "arith test split (disjoint from train by expression hash)", "problems": setup.get("eval_size"),
                            "decoding": "greedy", "use": "evaluation only; no setting was chosen on it"},
               "methods": table, "ablations": abl_rows, "attribution": attribution, "missing_runs": missing,
               "code_versions": sorted({c for r in runs.values() if r for c in r["code"]})}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _csv(out / "main_runs.csv", [{"method": m, "seed": s, "accuracy_before": b, "accuracy_after": a, "train_seconds": round(t, 1),
                                  "wall_seconds": round(w, 1), "cpu_seconds": round(c, 1)} for m, v in table.items()
                                 for s, b, a, t, w, c in zip(v["seeds"], v["accuracy_before"], v["accuracy_after"], v["train_seconds"],
                                                             v["wall_seconds"], v["cpu_seconds"])])
    _csv(out / "curves_accuracy.csv", curve_rows)
    _csv(out / "curves_training.csv", train_rows)
    _csv(out / "ablations.csv", abl_rows)
    _csv(out / "attribution.csv", attr_rows)

    images = {}
    if curve_rows:
        images["accuracy"] = plots.accuracy_curves(curve_rows, out / "accuracy.png")
        images["training"] = plots.training_curves(train_rows, out / "training_curves.png")
    if abl_rows:
        images["ablations"] = plots.ablation_bars(abl_rows, table.get("grpo"), out / "ablations.png")
    if attr_rows:
        images["attribution"] = plots.attribution_bars(attr_rows, out / "attribution.png")
    (out / "README.md").write_text(markdown(summary, abl_rows, attr_rows, images, out))
    # The same section with links from the repository root, to paste into the main README.
    section = markdown(summary, abl_rows, attr_rows, images, out, at=f"{out.as_posix()}/")
    (out / "main_readme_section.md").write_text("\n".join("#" + ln if ln.startswith("#") else ln for ln in section.splitlines()) + "\n")
    print(f"[study] report: {out}/ (summary.json, README.md, {len(images)} plots); missing runs: {len(missing)}", flush=True)
    return summary


def _csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)), restval="")
            w.writeheader()
            w.writerows(rows)


def _pct(x, digits=1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}"


def verdict(name: str, v: dict) -> str:
    d = v["paired_diff_vs_grpo"]
    if d["n"] < 2 or math.isnan(d["se"]):
        return f"{name} vs GRPO: too few paired seeds ({d['n']}) to say anything."
    gap = f"{name} − GRPO = {100 * d['mean']:+.1f} ± {100 * d['se']:.1f} points (paired over {d['n']} seeds, mean ± standard error)"
    if d["mean"] - 2 * d["se"] > 0:
        return gap + ": better than GRPO beyond two standard errors."
    if d["mean"] + 2 * d["se"] < 0:
        return gap + ": worse than GRPO beyond two standard errors."
    return gap + ": not distinguishable from GRPO at this number of seeds."


def markdown(summary: dict, abl_rows, attr_rows, images: dict, out: Path, at: str = "") -> str:
    """The results page; `at` prefixes every link (empty: links relative to `out` itself)."""
    s, methods = summary["setup"], summary["methods"]
    lines = ["# Evidence study: does OAR beat GRPO on arith?", "",
             f"Generated {summary['generated']} by `{summary['command']}` (scale `{summary['scale']}`) from the runs in "
             f"`{summary['root']}/`, made by the stages of `scripts/studies/study.py` (every run's command and seed: "
             f"`{summary['root']}/plan-*.json`, and `config.json` in each run folder).", ""]
    if s:
        lines += [f"Setup: `{s['model']}` on `{s['dataset']}`, {s['steps']} steps × {s['prompts_per_step']} prompts × "
                  f"{s['group_size']} rollouts = {s['rollouts_per_run']} rollouts per run for every method, learning rate "
                  f"{s['learning_rate']}, temperature {s['temperature']}, up to {s['max_new_tokens']} new tokens. OAR: "
                  f"q = {s['gate_quantile']}, β = {s['gate_boost']}, floor {s['gate_floor']}, probe `{s['probe']}`.", "",
                  f"Held-out: {summary['held_out']['problems']} problems of the arith test split, greedy decoding, evaluated "
                  f"every {s['eval_every']} steps. It is used for evaluation only: no setting was chosen on it "
                  "(every run uses train.py's defaults or an ablation fixed in advance in scripts/studies/study.py).", ""]
    if methods:
        lines += ["## Main comparison", "",
                  "| method | seeds | accuracy before | accuracy after (mean ± std) | per seed | paired Δ vs GRPO | s/step | training time | overhead vs GRPO | CPU time/run |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for m, v in methods.items():
            d = v["paired_diff_vs_grpo"]
            delta = "—" if m == "grpo" else f"{100 * d['mean']:+.1f} ± {_pct(d['se'])}"
            lines.append(f"| {m} | {', '.join(map(str, v['seeds']))} | {_pct(np.mean(v['accuracy_before']))} | {_pct(v['mean'])} ± {_pct(v['std'])} | "
                         f"{', '.join(_pct(a) for a in v['accuracy_after'])} | {delta} | {v['seconds_per_step']:.2f} | "
                         f"{np.mean(v['train_seconds']) / 60:.1f} min | {v.get('overhead_vs_grpo', math.nan):.2f}× | {np.mean(v['cpu_seconds']) / 60:.1f} min |")
        lines += ["", "Accuracies in %. Training time: the logged step times (evaluation excluded); CPU time: the whole run, "
                  "evaluations included (steadier than wall-clock on shared cores). " + " ".join(verdict(m, v) for m, v in methods.items() if m != "grpo"), ""]
        lines += [f"![held-out accuracy]({at}{images['accuracy'].name})", "", f"![entropy, ESS, reward]({at}{images['training'].name})", ""]
    if abl_rows:
        seeds = sorted({r["seed"] for r in abl_rows})
        lines += [f"## Ablations (OAR-G, seeds {', '.join(map(str, seeds))})", "", "| varies | setting | run | accuracy after (per seed) | mean |", "|---|---|---|---|---|"]
        groups: dict = {}
        for r in abl_rows:
            groups.setdefault((r["group"], r["label"], r["run"]), []).append(r["accuracy_after"])
        for (g, label, run), acc in groups.items():
            lines.append(f"| {g} | {label} | `{run}` | {', '.join(_pct(a) for a in acc)} | {_pct(float(np.mean(acc)))} |")
        lines += ["", "Rows whose run is `oar-g` are the main OAR-G runs (same settings). "
                  "Suppress-only with mass preservation still raises the unsuppressed tokens (the rescale).", "",
                  f"![ablations]({at}{images['ablations'].name})", ""]
    if attr_rows:
        lines += ["## Attribution quality (starting model, known pivotal tokens)", "",
                  "Pivotal = the digits of each computed result (after ` = `), labelled on each rollout's own text; metrics over "
                  "reasoning tokens, averaged over rollouts. Sources: `sample` = the model's own rollouts (temperature 1), "
                  "`gold` = the worked solutions teacher-forced.", "",
                  "| source | probe | scorer | rollouts | pivotal share | precision@k | ROC-AUC | Spearman (G vs P) | top-20% overlap |",
                  "|---|---|---|---|---|---|---|---|---|"]
        f = lambda r, k: "" if k not in r or r[k] is None or math.isnan(r[k]) else f"{r[k]:.3f} ± {r[k + '_se']:.3f}"
        for r in attr_rows:
            share = f"{r['pivotal_frac']:.2f}" if "pivotal_frac" in r else ""
            lines.append(f"| {r['source']} | {r['probe']} | {r['scorer']} | {r['rollouts']} | {share} | "
                         f"{f(r, 'precision_at_k')} | {f(r, 'roc_auc')} | {f(r, 'spearman')} | {f(r, 'top20_overlap')} |")
        lines += ["", f"![attribution]({at}{images['attribution'].name})", ""]
    if (out / "heatmap.png").exists():
        lines += ["## What OAR boosts and suppresses", "", f"`python scripts/analysis/heatmap.py --run {summary['root']}/oar-g-s0` "
                  f"(hover the tokens in [heatmap.html]({at}heatmap.html) for their weights).", "", f"![token heatmap]({at}heatmap.png)", ""]
    if len(summary["code_versions"]) > 1:
        lines += [f"**Warning:** these runs were made by {len(summary['code_versions'])} different versions of train.py / "
                  f"oar/*.py ({', '.join(summary['code_versions'])}; see each run's study_time.json): rerun the odd ones "
                  "(delete their folders) before trusting a comparison.", ""]
    if summary["missing_runs"]:
        lines += [f"Not finished yet (left out above): {', '.join(summary['missing_runs'])}.", ""]
    return "\n".join(lines)
