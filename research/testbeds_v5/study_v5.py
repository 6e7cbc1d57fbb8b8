"""The testbeds study: where does token-level credit help? Six credit methods x three testbeds x seeds.

    nohup nice -n 19 python research/testbeds_v5/study_v5.py --root /work/study-v5 > /work/study-v5/study.log 2>&1 &
    python research/testbeds_v5/study_v5.py --root /work/study-v5 --dry_run          # the plan, nothing run
    python research/testbeds_v5/study_v5.py --root /work/study-v5 --only fork &
    python research/testbeds_v5/study_v5.py --root /work/study-v5 --only slip filler
                                                                         # two processes, two cores, disjoint testbeds
    python research/testbeds_v5/study_v5.py --root /tmp/s --scale tiny                # the whole pipeline at toy size
    python research/testbeds_v5/report_v5.py --root /work/study-v5 --out research/testbeds_v5   # whatever has finished

Testbeds (oar/tasks/testbeds.py): fork (tiny-arith v4), slip, filler; each built once under <root>/models/
(seed 0, its recipe; a folder built from another recipe stops the study). Methods: oar/credit.py's
COMPARED (grpo, oar-g, oar-p, entropy, entropy-mask, tempo); beyond the paper, only when named: oar-g+tempo
(a candidate) and random-gate (a control: the gate with uninformative scores).

Settings, fixed before any run (research/testbeds_v5/README.md repeats them): train.py's defaults (32
prompts x 8 rollouts per step, lr 5e-5, OAR q = 0.4, beta = 2, floor 0.1, probe answer_mean,
entropy-mask rho = 0.2) with 60 steps, so every run has the same budget of 15,360 rollouts; held-out:
500 arith test-split problems, greedy, at steps 0, 20, 40, 60; the testbed's completion budget
(64 tokens, filler 96); a checkpoint every 20 steps. Nothing is chosen on the held-out split.

Order: seed 0 of every (testbed, method), then seed 1, ...: an interrupted study has the most
informative runs. A testbed's model is built (minutes) and its attribution made (minutes) just
before its first run.
Resumable: a run with summary.json is skipped, one with a checkpoint resumes from it (train.py
--resume), one with neither restarts (research/common/study_run.py's run_one, with its timing file).
Across machines: every testbed's starting model, build record, attribution and finished run is also
kept in --ledger (default research/testbeds_v5/ledger, committed; research/common/study_ledger.py); on a new
machine the kept models are copied in instead of rebuilt and the finished runs restored.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from oar.training.checkpoint import write_json_atomic  # noqa: E402
from oar.credit import METHODS  # noqa: E402

COMPARED = ("grpo", "oar-g", "oar-p", "entropy", "entropy-mask", "tempo")  # the paper's methods and the comparators
from oar.tasks.testbeds import TESTBEDS  # noqa: E402
from research.common import study_ledger  # noqa: E402
from research.common.study_run import run_dir, run_one  # noqa: E402

SETTINGS = {"steps": 60, "eval_every": 20, "eval_size": 500, "save_every": 20}
TINY = {
    "steps": 2,
    "prompts_per_step": 2,
    "group_size": 4,
    "micro_batch_size": 8,
    "eval_size": 16,
    "eval_every": 1,
    "save_every": 1,
}
COST = {
    "grpo": 1.0,
    "oar-g": 1.2,
    "oar-p": 2.6,
    "entropy": 1.05,
    "entropy-mask": 1.2,
    "tempo": 1.05,
    "oar-g+tempo": 1.25,
    "random-gate": 1.05,
}  # guesses until timed


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument(
        "--root", type=Path, default=Path("/work/study-v5"), help="runs, models and attribution (outside the repo)"
    )
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--testbeds", nargs="+", default=list(TESTBEDS), choices=list(TESTBEDS))
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(COMPARED),
        choices=list(METHODS),
        help="default: the six of the fixed plan; oar-g+tempo and random-gate (beyond the paper) only when named",
    )
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        choices=list(TESTBEDS),
        metavar="TESTBED",
        help="run only these testbeds' runs (the plan, ledger and report still cover --testbeds): "
        "one process per testbed uses more cores, and no two processes touch one run",
    )
    p.add_argument("--scale", default="default", choices=["default", "tiny"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument(
        "--attr_prompts",
        type=int,
        default=None,
        help="problems (x8 rollouts) per testbed for attribution (default 48; tiny 4)",
    )
    p.add_argument(
        "--ledger",
        default=None,
        help="where finished work is kept across machines (default research/testbeds_v5/ledger; tiny scale: none); "
        "'none' for none",
    )
    p.add_argument("--dry_run", action="store_true")
    args = p.parse_args(argv)
    default_ledger = None if args.scale == "tiny" else ROOT / "research" / "testbeds_v5" / "ledger"
    args.ledger = default_ledger if args.ledger is None else (None if args.ledger == "none" else Path(args.ledger))
    args.attr_prompts = args.attr_prompts or (4 if args.scale == "tiny" else 48)
    return args


def model_dir(root: Path, testbed: str) -> Path:
    return root / "models" / testbed


def ensure_testbed(root: Path, name: str, scale: str, threads: int) -> Path:
    """The testbed's starting model, built once (seed 0) with `threads` torch threads (its recipe says
    2; under contention 2 threads spin on each other: 6x less work per CPU second measured on this
    shared machine, so the study builds with its own thread count; on one machine 1 and 2 threads
    built the same weights, bitwise); a build from another recipe stops the study."""
    from dataclasses import replace

    from oar.tasks.tiny_arith_cache import build_tiny_arith, is_complete

    recipe = replace(TESTBEDS[name].recipe, num_threads=threads)
    if scale == "tiny":  # seconds, not minutes: the pipeline only
        recipe = replace(recipe, hidden_size=32, num_layers=1, num_heads=2, steps=20, batch_size=16, eval_problems=16)
    out = model_dir(root, name)
    if not is_complete(out):
        print(f"[study] building testbed {name} into {out} ...", flush=True)
        info = build_tiny_arith(out, seed=0, recipe=recipe, log=lambda s: print(s, flush=True))
        print(
            f"[study] built {name}: held-out accuracy {info['heldout_accuracy']:.1%}, {info['build_seconds']:.0f} s "
            f"({info['build_cpu_seconds']:.0f} s CPU)",
            flush=True,
        )
    built = json.loads((out / "build_info.json").read_text())
    same = lambda r: {k: v for k, v in r.items() if k != "num_threads"}  # noqa: E731 - threads did not change the weights here
    if same(built["recipe"]) != same(json.loads(json.dumps(asdict(recipe)))):
        raise SystemExit(
            f"study_v5.py: error: {out} was built from another recipe than testbed {name}'s; "
            f"delete the folder to rebuild it, or use another --root."
        )
    return out


def plan(args) -> list[dict]:
    base = TINY if args.scale == "tiny" else SETTINGS
    runs = []
    for seed in args.seeds:
        for tb in args.testbeds:
            for m in args.methods:
                settings = base | {
                    "model": str(model_dir(args.root, tb)),
                    "method": m,
                    "max_new_tokens": TESTBEDS[tb].max_new_tokens,
                }
                runs.append({"name": f"{tb}/{m}", "testbed": tb, "method": m, "seed": seed, "settings": settings})
    return runs


def attribution(args) -> None:
    """research/testbeds_v5/attribution_v5.py on every testbed's starting model, every method of oar/credit.py (the
    trained ones and those beyond the plan: it costs no training); one file per testbed, kept."""
    import torch

    from oar.training.models import load_model
    from research.testbeds_v5 import attribution_v5

    torch.set_num_threads(args.threads)
    for tb in args.testbeds:
        out = args.root / "attribution" / f"{tb}.json"
        if out.exists():
            continue
        ensure_testbed(args.root, tb, args.scale, args.threads)
        start = time.time()
        model, tok = load_model(str(model_dir(args.root, tb)))
        try:
            result = attribution_v5.run(model, tok, TESTBEDS[tb], prompts=args.attr_prompts)
        except Exception as err:  # noqa: BLE001 - the training runs matter more; the report says it is missing
            print(f"[study] attribution {tb} FAILED ({type(err).__name__}: {err}); the runs go on", flush=True)
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out, result | {"seconds": time.time() - start})
        print(f"[study] attribution {tb}: {out} in {time.time() - start:.0f} s", flush=True)


def estimate(args, runs) -> str:
    """Hours left, from the finished runs' wall-clock per (testbed, method), else a method's guessed cost."""
    done = {}
    for r in runs:
        t = run_dir(args, r) / "study_time.json"
        if (run_dir(args, r) / "summary.json").exists() and t.exists():
            done.setdefault((r["testbed"], r["method"]), []).append(json.loads(t.read_text())["seconds"])
    if not done:
        return "no run timed yet"
    per = {k: sum(v) / len(v) for k, v in done.items()}
    unit = sum(per[k] / COST[k[1]] for k in per) / len(per)  # seconds of a GRPO run
    left = [r for r in runs if not (run_dir(args, r) / "summary.json").exists()]
    total = sum(per.get((r["testbed"], r["method"]), unit * COST[r["method"]]) for r in left)
    return f"{len(left)} of {len(runs)} runs left, about {total / 3600:.1f} h at the pace so far"


def _claim(root: Path, testbed: str):
    """An exclusive lock on one testbed's runs for this process's lifetime (None: another process has it),
    so that two processes of one study never train, restore or record the same run."""
    import fcntl

    handle = open(root / f".lock-{testbed}", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill ends the running train.py too; it resumes
    runs = plan(args)
    if args.dry_run:
        print(f"[study] {len(runs)} runs under {args.root}")
        for r in runs:
            print(f"  {r['name']} seed {r['seed']}: {r['settings']}")
        return 0
    args.root.mkdir(parents=True, exist_ok=True)
    # plan.json is always the fixed plan (report_v5.py counts against it), whichever part of it, or
    # which methods beyond it, this worker runs
    fixed = parse_args(["--root", str(args.root), "--scale", args.scale])
    write_json_atomic(
        args.root / "plan.json",
        {
            "scale": args.scale,
            "settings": TINY if args.scale == "tiny" else SETTINGS,
            "testbeds": {tb: asdict(TESTBEDS[tb]) for tb in fixed.testbeds},
            "runs": plan(fixed),
            "command": " ".join(sys.argv),
        },
    )
    ok, synced, locks = True, set(), {}
    print(f"[study] {len(runs)} runs under {args.root}; ledger {args.ledger}; {estimate(args, runs)}", flush=True)
    for r in runs:  # a testbed is built, and its attribution made, when its first run comes
        tb = r["testbed"]
        if args.only is not None and tb not in args.only:
            continue
        if tb not in locks:
            locks[tb] = _claim(args.root, tb)
            if locks[tb] is None:
                print(
                    f"[study] testbed {tb}: another process of this study runs it; its runs are skipped here",
                    flush=True,
                )
        if locks[tb] is None:
            continue
        if args.ledger is not None and tb not in synced:
            if study_ledger.restore_model(args.ledger, tb, model_dir(args.root, tb)):
                print(
                    f"[study] testbed {tb}: the ledger's starting model copied to {model_dir(args.root, tb)}",
                    flush=True,
                )
            model = ensure_testbed(args.root, tb, args.scale, args.threads)
            build = study_ledger.check_build(args.ledger, tb, model)
            restored = study_ledger.restore(args.ledger, args.root, tb, model)
            print(
                f"[study] testbed {tb}: build {build} in {args.ledger}; {restored} finished run(s) restored from it",
                flush=True,
            )
            synced.add(tb)
        attribution(SimpleNamespace(**vars(args) | {"testbeds": [tb]}))
        status = run_one(SimpleNamespace(root=args.root, threads=args.threads), r)
        ok &= status != "failed"
        if args.ledger is not None and status not in ("failed", "busy"):
            study_ledger.record_attribution(args.ledger, args.root, tb)
            study_ledger.record_run(args.ledger, args.root, tb, run_dir(args, r).name)
        if status != "done":
            print(f"[study] estimate: {estimate(args, runs)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
