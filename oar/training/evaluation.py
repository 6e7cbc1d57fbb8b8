"""Held-out evaluation shared by `eval.py` and `train.py`: sample, extract, check, gather.

Problems are sharded across processes (problem i on process i mod n), each problem's k samples on
one process, and the per-problem records are gathered and put back in order. Scoring uses the same
`rewards` functions as training, so "correct" means the same thing in both.

  avg@k     mean over problems of the fraction of its k samples that are correct (pass@1 at k=1: greedy at temperature
  0)
  pass@j    unbiased estimator 1 - C(n - c, j) / C(n, j) per problem (Chen et al., 2021), j <= k
"""

from __future__ import annotations

from math import comb
from pathlib import Path

import torch

from oar.answers import extract_answer
from oar.training.console import bar
from oar.rewards import reward
from oar.sampler import sample
from oar.training.data import problem_prompt


def evaluate(
    model,
    tokenizer,
    problems,
    *,
    accelerator=None,
    instruction: str = "",
    batch_size: int = 64,
    max_new_tokens: int = 256,
    num_samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    loop: str = "eager",
    progress: bool = False,
    sampler=sample,
) -> tuple[list[dict], dict]:
    """Returns (records in problem order, summary). `batch_size` counts sequences (prompts x samples);
    `loop` is the sampler's (oar.sampler.decode); `progress`: draw a bar with an ETA over the main
    process's problems (oar/training/console.py decides where bars are wanted); `sampler` draws the samples
    (oar.sampler.sample, or a vLLM engine: oar/training/rollout_backend.py)."""
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    mine = list(range(rank, len(problems), world))
    per_batch = max(1, batch_size // num_samples)
    was_training = model.training
    model.eval()
    records = []
    shown = bar(len(mine), "held-out", progress and rank == 0, unit="problem")
    for start in range(0, len(mine), per_batch):
        idx = mine[start : start + per_batch]
        prompts = [problem_prompt(tokenizer, problems[i], instruction) for i in idx]  # a system turn first
        seeds = [seed * 1_000_003 + i * num_samples + s for i in idx for s in range(num_samples)]
        out = sampler(
            model,
            tokenizer,
            prompts,
            group_size=num_samples,
            seeds=seeds,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            loop=loop,
        )
        for j, i in enumerate(idx):
            texts = out.texts[j * num_samples : (j + 1) * num_samples]
            correct = [reward(t, problems[i].answer) == 1.0 for t in texts]
            extracted = [extract_answer(t) for t in texts]
            one = num_samples == 1
            records.append(
                {
                    "index": i,
                    "problem": problems[i].problem,
                    "gold": problems[i].answer,
                    "completion": texts[0] if one else texts,
                    "extracted": extracted[0] if one else extracted,
                    "correct": correct[0] if one else correct,
                    "truncated": bool(out.truncated[j * num_samples])
                    if one
                    else out.truncated[j * num_samples : (j + 1) * num_samples].tolist(),
                }
            )
        shown.update(len(idx))
    shown.close()
    model.train(was_training)
    if accelerator is not None and world > 1:
        from accelerate.utils import gather_object

        records = gather_object(records)
    records.sort(key=lambda r: r["index"])
    return records, summarize(records, num_samples)


def summarize(records: list[dict], num_samples: int) -> dict:
    """avg@k, unbiased pass@j for j = 1, 2, 4, ... <= k and for j = k, and the no-answer and truncation rates."""
    as_list = lambda v: v if isinstance(v, list) else [v]
    correct = torch.tensor([sum(as_list(r["correct"])) for r in records], dtype=torch.float64)
    n = num_samples
    summary = {
        "problems": len(records),
        "num_samples": n,
        "accuracy": float(correct.mean() / n) if records else 0.0,
        "frac_no_answer": _mean([e is None for r in records for e in as_list(r["extracted"])]),
        "frac_truncated": _mean([t for r in records for t in as_list(r["truncated"])]),
    }
    for j in sorted({2**i for i in range(n.bit_length())} | {n}):
        summary[f"pass@{j}"] = _mean([1.0 - comb(n - int(c), j) / comb(n, j) for c in correct.tolist()])
    return summary


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0


def result_files(folder: Path) -> tuple[Path, Path]:
    """Where eval.py writes an evaluation in `folder`: eval.jsonl and eval_summary.json, or when an earlier
    evaluation holds those names, the first free eval-<k>.jsonl and eval_summary-<k>.json (k = 2, 3, ...),
    so no result is written over."""
    k, suffix = 1, ""
    while (folder / f"eval{suffix}.jsonl").exists() or (folder / f"eval_summary{suffix}.json").exists():
        k += 1
        suffix = f"-{k}"
    return folder / f"eval{suffix}.jsonl", folder / f"eval_summary{suffix}.json"
