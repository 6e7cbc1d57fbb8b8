"""Evaluate a model on maths problems: greedy pass@1 by default, avg@k and unbiased pass@k with samples.

    accelerate launch eval.py                                     # tiny-arith on 500 held-out arith problems
    accelerate launch --num_processes 8 eval.py --model runs/oar-g/final \
        --dataset HuggingFaceH4/MATH-500 --num_samples 16 --temperature 0.6 --max_new_tokens 2048

Writes `<output_dir>/eval.jsonl` (one line per problem: problem, gold, completion, extracted answer,
correct) and `<output_dir>/eval_summary.json`, and prints a one-line summary. Scoring is
`oar.rewards`, the same as training's reward.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from oar.training.checkpoint import write_json_atomic
from oar.training.data import DataError, load_problems
from oar.training.evaluation import evaluate
from oar.training.launch import end, make_accelerator, release
from oar.training.models import ModelError, load_model, resolve_model
from oar.sampler import DECODE_LOOPS, resolve_instruction
from oar.tasks.tiny_arith_cache import model_source



@dataclass
class EvalConfig:
    """Every setting of an evaluation; saved beside the results."""

    model: str = field(default="tiny-arith", metadata={"help": "Hub id, local folder (e.g. a run's final/), .gguf file, 'tiny-arith' or 'smollm2'."})
    dataset: str = field(default="arith", metadata={"help": "'arith' (its held-out split), a .jsonl file, or a `datasets` name."})
    output_dir: str = field(default="runs/eval", metadata={"help": "Where eval.jsonl and eval_summary.json go."})
    split: str = field(default="test", metadata={"help": "Split for arith / folders / hub datasets."})
    limit: int = field(default=500, metadata={"help": "Evaluate the first N problems (0: all)."})
    num_samples: int = field(default=1, metadata={"help": "k samples per problem: avg@k and pass@j for j = 1, 2, 4, ... <= k."})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy; k > 1 needs > 0."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass."})
    max_new_tokens: int = field(default=64, metadata={"help": "Completion budget."})
    batch_size: int = field(default=256, metadata={"help": "Sequences per generation batch (prompts x samples)."})
    instruction: str = field(default="auto", metadata={"help": "Appended to each problem; 'auto': none for arith or tiny-arith, a \\boxed{} request otherwise."})
    dtype: str = field(default="float32", metadata={"help": "Weights dtype."})
    seed: int = field(default=0, metadata={"help": "Sampling seed (k > 1)."})
    decode_loop: str = field(default="eager", metadata={"help": "The sampler's loop: eager, static or compiled (docs/sampler.md)."})


def main(cfg: EvalConfig) -> dict:

    accelerator = make_accelerator()
    try:  # cheap checks before the model is loaded
        if cfg.num_samples < 1 or cfg.limit < 0 or cfg.batch_size < 1:
            raise ValueError("--num_samples and --batch_size must be >= 1, --limit >= 0.")
        if cfg.num_samples > 1 and cfg.temperature <= 0:
            raise ValueError(f"--num_samples {cfg.num_samples} with --temperature {cfg.temperature}: greedy samples are all "
                             f"the same; pass --temperature > 0 (e.g. 0.6).")
        if cfg.max_new_tokens < 1 or cfg.temperature < 0 or not 0 < cfg.top_p <= 1:
            raise ValueError(f"--max_new_tokens {cfg.max_new_tokens} must be >= 1, --temperature {cfg.temperature} >= 0 "
                             f"and --top_p {cfg.top_p} in (0, 1].")
        if cfg.decode_loop not in DECODE_LOOPS:
            raise ValueError(f"--decode_loop {cfg.decode_loop}: one of {', '.join(DECODE_LOOPS)}.")
        if not isinstance(getattr(torch, cfg.dtype, None), torch.dtype):
            raise ValueError(f"--dtype {cfg.dtype}: a torch dtype name such as float32 or bfloat16.")
        if Path(cfg.output_dir).exists() and not Path(cfg.output_dir).is_dir():
            raise ValueError(f"--output_dir {cfg.output_dir} is a file; pass a directory (it is created if missing).")
        resolve_model(cfg.model)
        problems = load_problems(cfg.dataset, split=cfg.split, limit=cfg.limit or None)
        instruction = resolve_instruction(cfg.instruction, cfg.dataset, cfg.model)
        model, tokenizer = load_model(model_source(cfg.model), dtype=cfg.dtype)  # the tokenizer is checked before the weights load
    except (ValueError, DataError, ModelError) as err:
        raise SystemExit(f"eval.py: error: {err}") from None
    model = model.to(accelerator.device).eval()
    records, summary = evaluate(model, tokenizer, problems, accelerator=accelerator, instruction=instruction,
                                batch_size=cfg.batch_size, max_new_tokens=cfg.max_new_tokens, num_samples=cfg.num_samples,
                                temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed, loop=cfg.decode_loop)
    summary = {"model": cfg.model, "dataset": cfg.dataset, **summary}
    if accelerator.is_main_process:
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "eval.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        tmp.replace(out / "eval.jsonl")
        write_json_atomic(out / "eval_summary.json", {"config": asdict(cfg), **summary})
        passes = " ".join(f"{k} {v:.3f}" for k, v in summary.items() if k.startswith("pass@"))
        print(f"{cfg.model} on {cfg.dataset}: accuracy {summary['accuracy']:.3f} over {summary['problems']} problems"
              f" (k={cfg.num_samples}) | {passes} | no answer {summary['frac_no_answer']:.3f}"
              f" | truncated {summary['frac_truncated']:.3f} -> {out / 'eval.jsonl'}", flush=True)
    end(accelerator)
    return summary


if __name__ == "__main__":
    from transformers import HfArgumentParser

    (config,) = HfArgumentParser(EvalConfig).parse_args_into_dataclasses(args=sys.argv[1:])
    try:
        main(config)
    finally:
        release()  # after an error: the process group ends before the interpreter does
