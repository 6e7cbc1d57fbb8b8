"""Evaluate a model on maths problems: greedy pass@1 by default, avg@k and unbiased pass@k with samples.

    accelerate launch eval.py                                     # tiny-arith on 500 held-out arith problems
    accelerate launch --num_processes 8 eval.py --model runs/oar-g/final \
        --dataset HuggingFaceH4/MATH-500 --eval_samples 16 --eval_temperature 0.6 --max_new_tokens 2048

Writes `<output_dir>/eval.jsonl` (one line per problem: problem, gold, completion, extracted answer,
correct) and `<output_dir>/eval_summary.json`, and prints a one-line summary; into a folder that holds
them already, `eval-2.jsonl` and `eval_summary-2.json` (then -3, ...): an earlier evaluation is kept.
`--model` also takes a training run's checkpoint-N/ folder (oar/training/run_folders.py). Scoring is
`oar.rewards`, the same as training's reward. The evaluation flags are train.py's (--eval_size,
--eval_samples, --eval_temperature), with eval.py's own --eval_top_p, --eval_batch_size and --decode_loop;
the old names (--limit, --num_samples, --temperature, --top_p, --batch_size) still work.
"""

from __future__ import annotations
# ruff: noqa: E402 (the imports below come after the command line is read)

import sys
from dataclasses import asdict, dataclass
from typing import ClassVar

from oar.training.checks import check_backend_settings, check_eval_settings, check_model_settings, check_output_dir
from oar.training.config import BackendSettings, EvalSettings, ModelSettings
from oar.training.flags import Alias, FlagParser


@dataclass(frozen=True)
class EvalConfig(ModelSettings, EvalSettings, BackendSettings):
    """Every setting of an evaluation; saved beside the results. The model and evaluation settings are
    train.py's (oar/training/config.py), with the same names, defaults and checks."""

    TITLE: ClassVar[str] = "what to evaluate"

    dataset: str = "arith"
    """'arith' (its held-out split), a .jsonl file, a folder with test.jsonl, or a `datasets` name."""
    split: str = "test"
    """Split for arith / folders / hub datasets."""
    output_dir: str = "runs/eval"
    """Where eval.jsonl and eval_summary.json go."""
    eval_top_p: float = 1.0
    """Nucleus sampling mass of the samples (train.py's evaluations sample with 1.0)."""
    eval_batch_size: int = 256
    """Sequences per generation batch (prompts x samples)."""
    decode_loop: str = "eager"
    """The sampler's loop: eager | static (fixed shapes, the same samples) | compiled (static through
    torch.compile: CUDA graphs on a GPU); docs/sampler.md."""


TITLES = ("what to evaluate", "run", "evaluation", "vLLM rollouts")
SHOWN_IN = {
    "model": "what to evaluate",
    "seed": "evaluation",
    "max_new_tokens": "evaluation",
    "eval_top_p": "evaluation",
    "eval_batch_size": "evaluation",
    "decode_loop": "evaluation",
}
ALIASES = (  # eval.py's names before they became train.py's
    Alias("limit", "eval_size", origin="its old name"),
    Alias("num_samples", "eval_samples", origin="its old name"),
    Alias("temperature", "eval_temperature", origin="its old name"),
    Alias("top_p", "eval_top_p", origin="its old name"),
    Alias("batch_size", "eval_batch_size", origin="its old name"),
    Alias("max_completion_length", "max_new_tokens"),
    Alias("model_name_or_path", "model"),
    Alias("torch_dtype", "dtype"),
)
GONE = {"collective_timeout": "set OAR_COLLECTIVE_TIMEOUT=<seconds> (default 3600; docs/resuming.md)"}


def parser() -> FlagParser:
    return FlagParser(
        EvalConfig,
        prog="eval.py",
        description=__doc__.split("\n\n")[0],
        titles=TITLES,
        shown_in=SHOWN_IN,
        aliases=ALIASES,
        gone=GONE,
    )


def check(cfg: EvalConfig) -> list[str]:
    """Every impossible setting of an evaluation: train.py's checks of the same settings, and eval.py's own."""
    from oar.sampler import DECODE_LOOPS

    own = [] if 0 < cfg.eval_top_p <= 1 else [f"--eval_top_p {cfg.eval_top_p}: must lie in (0, 1]."]
    if cfg.eval_batch_size < 1:
        own.append(f"--eval_batch_size {cfg.eval_batch_size}: must be >= 1.")
    if cfg.decode_loop not in DECODE_LOOPS:
        own.append(f"--decode_loop {cfg.decode_loop}: one of {', '.join(DECODE_LOOPS)}.")
    return (
        check_model_settings(cfg)
        + check_eval_settings(cfg)
        + check_backend_settings(cfg)
        + own
        + check_output_dir(cfg.output_dir)
    )


if __name__ == "__main__":  # --help and a bad flag answer here, before torch and transformers load
    CONFIG = parser().parse(sys.argv[1:])

import json
from pathlib import Path

from oar.training.checkpoint import write_json_atomic
from oar.training.console import bars_wanted, quiet_libraries
from oar.training import rollout_backend
from oar.training.data import DataError, load_problems
from oar.training.evaluation import evaluate, result_files
from oar.training.config import collective_timeout
from oar.training.launch import end, make_accelerator, run_entry
from oar.training.models import ModelError, load_model, resolve_model
from oar.training.run_folders import checkpoint_settings, load_checkpoint_model
from oar.training.run_folders import instruction as run_instruction
from oar.tasks.tiny_arith_cache import model_source


AGAIN = "Run the same command again: an evaluation keeps nothing partial, it starts over."  # a lost process's hint


def main(cfg: EvalConfig) -> dict:
    if impossible := check(cfg):
        raise SystemExit("eval.py: error: " + "\n".join(impossible))
    accelerator = make_accelerator(collective_timeout())
    quiet_libraries(bars_wanted(accelerator.is_main_process))  # their bars where ours are; each warning once
    try:  # cheap checks before the model is loaded
        run = checkpoint_settings(cfg.model)  # a run's checkpoint-N/: its --model with the checkpoint's weights
        resolve_model(run["model"] if run else cfg.model)
        problems = load_problems(cfg.dataset, split=cfg.split, limit=cfg.eval_size or None)
        instruction = run_instruction(cfg.model, cfg.instruction, cfg.dataset)
        if run and cfg.rollout_backend != "own":
            raise ModelError(
                f"--model {cfg.model}: a checkpoint evaluates with --rollout_backend own (vLLM loads "
                f"a model folder: the run's final/)."
            )
        rollout_backend.check(
            cfg.rollout_backend, model_source(cfg.model), top_p=cfg.eval_top_p, training=False
        )  # vllm: can serve it
        model, tokenizer = (
            load_checkpoint_model(cfg.model, dtype=cfg.dtype)
            if run
            else load_model(model_source(cfg.model), dtype=cfg.dtype)
        )  # the tokenizer is checked before the weights load
    except (ValueError, DataError, ModelError) as err:
        raise SystemExit(f"eval.py: error: {err}") from None
    model = model.to(accelerator.device).eval()
    sampler = rollout_backend.make(
        cfg.rollout_backend,
        model_source(cfg.model),
        accelerator=accelerator,
        folder=cfg.output_dir,
        training=False,
        **rollout_backend.engine_settings(cfg),
    )
    records, summary = evaluate(
        model,
        tokenizer,
        problems,
        accelerator=accelerator,
        instruction=instruction,
        batch_size=cfg.eval_batch_size,
        max_new_tokens=cfg.max_new_tokens,
        num_samples=cfg.eval_samples,
        temperature=cfg.eval_temperature,
        top_p=cfg.eval_top_p,
        seed=cfg.seed,
        loop=cfg.decode_loop,
        progress=bars_wanted(accelerator.is_main_process),
        sampler=sampler,
    )
    summary = {"model": cfg.model, "dataset": cfg.dataset, "instruction": instruction, **summary}
    if accelerator.is_main_process:
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        records_file, summary_file = result_files(out)  # an earlier evaluation's files are kept
        tmp = records_file.with_name(records_file.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        tmp.replace(records_file)
        write_json_atomic(summary_file, {"config": asdict(cfg), **summary})
        passes = " ".join(f"{k} {v:.3f}" for k, v in summary.items() if k.startswith("pass@"))
        print(
            f"{cfg.model} on {cfg.dataset}: accuracy {summary['accuracy']:.3f} over {summary['problems']} problems"
            f" (k={cfg.eval_samples}) | {passes} | no answer {summary['frac_no_answer']:.3f}"
            f" | truncated {summary['frac_truncated']:.3f} -> {records_file}",
            flush=True,
        )
    rollout_backend.close(sampler)  # vllm: the engine ends before the process group does
    end(accelerator)
    return summary


if __name__ == "__main__":  # each way it ends says something; the process group ends first (launch.run_entry)
    run_entry(main, CONFIG, "eval.py", parser, AGAIN)
