"""The evidence study of issue 6: does OAR beat GRPO on arith? One script, resumable, in stages.

    python scripts/studies/study.py --stage main          # GRPO, OAR-G, OAR-P x seeds 0 1 2, same rollout budget
    python scripts/studies/study.py --stage ablations     # OAR-G gating and probe variants, seed 0 (--ablation_seeds 0 1: two)
    python scripts/studies/study.py --stage attribution   # OAR-P / OAR-G scores vs the known pivotal tokens
    python scripts/studies/study.py --stage report        # docs/results/: summary.json, CSVs, PNGs, README.md
    nohup python scripts/studies/study.py --stage all > study.log 2>&1 &     # all four, in the background
    python scripts/studies/study.py --stage all --scale tiny                 # the whole pipeline at toy size
    python scripts/studies/study.py --stage all --dry_run                    # the plan and commands, nothing run

Scale is one flag. `--scale default` is train.py's Config defaults (steps, prompts_per_step,
group_size, learning rate...), so retuning train.py retunes the study; `--scale tiny` shrinks the
steps, the batch and the evaluation to check the pipeline in minutes, under runs/study-tiny (never
mixed with real runs). `--set key=value` overrides a train.py setting for every run.

Runs: each is runs/study/<name>-s<seed>/, train.py's output_dir, run as a child process (a crash
ends that run only; the rest go on and the exit status is 1). A run with summary.json is done and
skipped; one with a checkpoint is resumed with --resume; one with neither is deleted and restarted.
Runs go seed by seed, so every method is timed early; after each run the remaining time is estimated.
Ablation variants are OAR-G runs that differ from the main oar-g run in one setting (a variant equal
to it IS that run); they are compared on final accuracy only, so they skip evaluations in between.

Held-out data: arith's test split (train.py's default eval set, disjoint from train by hash) is only
evaluated. No setting is chosen on it: every run uses train.py's defaults or an ablation fixed below.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from oar.training.checkpoint import write_json_atomic  # noqa: E402
from scripts.studies.study_run import code_version, command, effective, model_ident, run_dir, run_one  # noqa: E402
from train import METHODS, RESUMABLE, Config  # noqa: E402

SCALES = {
    "default": {},  # train.py's defaults
    "tiny": {"steps": 4, "prompts_per_step": 4, "group_size": 4, "micro_batch_size": 8, "eval_size": 40, "save_every": 2},
}
# OAR-G variants, fixed before any run. name -> (what varies, its value, train.py settings). A variant
# whose settings are train.py's defaults IS the main oar-g run and shares its folders.
ABLATIONS = {
    "q0.25": ("gate quantile q", "0.25", {"gate_quantile": 0.25}),
    "q0.4": ("gate quantile q", "0.4", {"gate_quantile": 0.4}),
    "q0.7": ("gate quantile q", "0.7", {"gate_quantile": 0.7}),
    "boost1": ("boost beta", "1", {"gate_boost": 1.0}),
    "boost2": ("boost beta", "2", {"gate_boost": 2.0}),
    "boost4": ("boost beta", "4", {"gate_boost": 4.0}),
    "both": ("gating branches", "suppress + boost", {"gate_boost": 2.0, "gate_floor": 0.1}),
    "suppress-only": ("gating branches", "suppress only (beta=0)", {"gate_boost": 0.0}),
    "boost-only": ("gating branches", "boost only (floor=1)", {"gate_floor": 1.0}),
    "mass-on": ("mass preservation", "on", {"preserve_mass": True}),
    "mass-off": ("mass preservation", "off", {"preserve_mass": False}),
    "probe-last": ("probe", "last", {"probe": "last"}),
    "probe-answer_mean": ("probe", "answer_mean", {"probe": "answer_mean"}),
    "probe-answer_joint": ("probe", "answer_joint", {"probe": "answer_joint"}),
    "authors": ("defaults", "authors' code (q=0.25, beta=1)", {"gate_quantile": 0.25, "gate_boost": 1.0}),
    "paper": ("defaults", "paper (q=0.4, beta=2)", {"gate_quantile": 0.4, "gate_boost": 2.0}),
}
PRIOR_COST = {"grpo": 1.0, "oar-g": 1.4, "oar-p": 4.2}  # paper's overheads: used until a method is timed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--stage", required=True, choices=["main", "ablations", "attribution", "report", "all"])
    p.add_argument("--scale", default="default", choices=sorted(SCALES))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="train.py settings for every run")
    p.add_argument("--model", default="tiny-arith", help="policy every run starts from (train.py --model)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds of the main comparison")
    p.add_argument("--ablation_seeds", nargs="+", type=int, default=[0], help="seeds of each ablation (1 fits the time budget; 0 1 for 2)")
    p.add_argument("--eval_points", type=int, default=6, help="held-out evaluations during training (eval_every = steps // this)")
    p.add_argument("--attr_problems", type=int, default=None, help="rollouts for the attribution stage (default 300; tiny 24)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per run (2 shared cores: 2)")
    p.add_argument("--root", default=None, help="runs folder (default runs/study, tiny: runs/study-tiny)")
    p.add_argument("--out", default=None, help="report folder (default docs/results, tiny: runs/study-tiny/results)")
    p.add_argument("--dry_run", action="store_true", help="print the plan and the commands; run nothing")
    args = p.parse_args(argv)
    tiny = args.scale == "tiny"
    args.root = Path(args.root or ("runs/study-tiny" if tiny else "runs/study"))
    args.out = Path(args.out or ("runs/study-tiny/results" if tiny else "docs/results"))
    args.attr_problems = args.attr_problems or (24 if tiny else 300)
    args.base = base_settings(args)
    return args


def base_settings(args) -> dict:
    """Settings shared by every run: the scale, --set, the model; eval_every from the final steps."""
    types = {f.name: type(getattr(Config(), f.name)) for f in fields(Config)}
    settings = {"model": args.model, **SCALES[args.scale]}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in types or not _:
            raise SystemExit(f"study.py: error: --set {item}: expected KEY=VALUE with KEY a train.py setting (python train.py --help).")
        settings[key] = value.lower() in ("1", "true", "yes") if types[key] is bool else types[key](value)
    if args.scale == "default" and settings.get("eval_size", Config.eval_size) < 500:
        print("[study] warning: fewer than 500 held-out problems per evaluation; the study asks for >= 500.", flush=True)
    steps = settings.get("steps", Config.steps)
    settings.setdefault("eval_every", max(1, steps // max(1, args.eval_points)))
    return settings


def plan(stage: str, args) -> list[dict]:
    """The runs of a stage, seed by seed: {name, seed, group, label, settings}. Variants with the same
    effective settings share one run (e.g. q=0.4 and the paper's defaults are the main oar-g run)."""
    if stage == "main":
        return [{"name": m, "seed": s, "group": "method", "label": m, "settings": args.base | {"method": m}}
                for s in args.seeds for m in METHODS if m in PRIOR_COST]  # the v3/v4 study: GRPO, OAR-G, OAR-P (issue 14: study_v5.py)
    reference = args.base | {"method": "oar-g"}
    names = {_trained(reference): ("oar-g", reference)}  # what is trained -> (run name, settings)
    runs = []
    for seed in args.ablation_seeds:
        for key, (group, label, over) in ABLATIONS.items():
            # Only the final accuracy of a variant is compared: no evaluation during training.
            name, settings = names.setdefault(_trained(reference | over), (f"abl-{key}", reference | over | {"eval_every": 0}))
            runs.append({"name": name, "seed": seed, "group": group, "label": label, "settings": settings})
    return runs


def _trained(settings: dict) -> str:
    """The settings that change what is trained (not evaluation, logging or batching), as a key."""
    return json.dumps({k: v for k, v in effective(settings).items() if k not in RESUMABLE - {"steps"}}, sort_keys=True)


def estimate(args, runs: list[dict]) -> str:
    """Minutes left for `runs`, from the wall-clock of finished runs of the same method in args.root
    (unmeasured methods: the paper's relative overheads applied to the measured ones)."""
    seconds: dict[str, list[float]] = {}
    for d in args.root.glob("*-s*"):
        if (d / "summary.json").exists() and (d / "study_time.json").exists():
            method = json.loads((d / "config.json").read_text())["method"]
            seconds.setdefault(method, []).append(json.loads((d / "study_time.json").read_text())["seconds"])
    if not seconds:
        return "no run timed yet"
    per = {m: sum(v) / len(v) for m, v in seconds.items()}
    unit = sum(per[m] / PRIOR_COST[m] for m in per) / len(per)  # seconds of one GRPO run
    left = [r for r in runs if not (run_dir(args, r) / "summary.json").exists()]
    total = sum(per.get(r["settings"]["method"], unit * PRIOR_COST[r["settings"]["method"]]) for r in {run_dir(args, r): r for r in left}.values())
    timed = ", ".join(f"{m} {per[m] / 60:.1f} min/run" for m in sorted(per))
    when = f"{total / 3600:.1f} h" if total > 5400 else f"{total / 60:.0f} min"
    return f"{len({run_dir(args, r) for r in left})} runs left, about {when} ({timed})"


def stage_runs(stage: str, args) -> bool:
    runs = plan(stage, args)
    unique = list({run_dir(args, r): r for r in runs}.values())
    if args.dry_run:
        print(f"[study] {stage}: {len(unique)} runs")
        for r in unique:
            print("  " + " ".join(command(r["settings"], run_dir(args, r), r["seed"], False)[1:]))
        return True
    args.root.mkdir(parents=True, exist_ok=True)
    if args.model == "tiny-arith":  # build it here once (minutes), so no run's wall-clock includes the build
        from oar.tasks.tiny_arith_cache import ensure_tiny_arith

        ensure_tiny_arith()
    write_json_atomic(args.root / f"plan-{stage}.json", {"scale": args.scale, "base": args.base, "runs": runs})
    print(f"[study] {stage}: {len(unique)} runs under {args.root}; {estimate(args, unique)}", flush=True)
    ok = True
    for r in unique:
        status = run_one(args, r)
        ok &= status != "failed"
        if status != "done":
            everything = plan("main", args) + plan("ablations", args)
            print(f"[study] estimate: this stage {estimate(args, unique)}; main+ablations {estimate(args, everything)}", flush=True)
    return ok


def stage_attribution(args) -> bool:
    out = args.root / "attribution.json"
    if out.exists():
        print(f"[study] attribution: {out} exists (delete it to recompute)")
        return True
    if args.dry_run:
        print(f"[study] attribution: {args.attr_problems} sampled rollouts + gold solutions of {args.model}, 3 probes")
        return True
    import torch

    from oar.training.models import load_model
    from oar.tasks.tiny_arith_cache import model_source
    from scripts.analysis import attribution

    torch.set_num_threads(args.threads)
    start = time.time()
    model, tokenizer = load_model(model_source(args.model))
    max_new = args.base.get("max_new_tokens", Config.max_new_tokens)
    result = attribution.run(model, tokenizer, n=args.attr_problems, seed=0, max_new_tokens=max_new)
    result |= {"model": args.model, "model_build": model_ident(args.model), "code": code_version(), "seconds": time.time() - start}
    args.root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, result)
    print(f"[study] attribution: {out} in {result['seconds']:.0f} s", flush=True)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    # `kill <pid>` of a background study: exit through Python, so subprocess.run kills the running
    # train.py too (no orphan writing into a run folder); the run then resumes from its checkpoint.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    stages = ["attribution", "main", "ablations", "report"] if args.stage == "all" else [args.stage]
    ok = True
    for stage in stages:
        if stage == "report":
            if not args.dry_run:
                from scripts.analysis import heatmap
                from scripts.studies import report

                if (args.root / "oar-g-s0" / "final").is_dir():  # the picture of what OAR reweights, from a trained run
                    heatmap.main(["--run", str(args.root / "oar-g-s0"), "--out", str(args.out / "heatmap")])
                report.write(args.root, args.out, scale=args.scale, command=' '.join(sys.argv[1:]))
        elif stage == "attribution":
            ok &= stage_attribution(args)
        else:
            ok &= stage_runs(stage, args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
