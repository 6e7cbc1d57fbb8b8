"""The ΔV values of one rollout, two ways, side by side in one run (scripts/analysis/delta_v.py):
every (prefix, continuation) pair sampled, a prefix's K continuations sharing its prefill (what 535cfe5
ran), against sampling only the pairs that deviate from the rollout at their prefix and copying the rest
(`delta_v.continuation_rewards`). Prints the CPU seconds of each, their ratio, how many pairs were
sampled, and whether the rewards are the same.

    python scripts/bench/bench_delta_v.py                                          # tiny-arith: seconds
    OMP_NUM_THREADS=1 python scripts/bench/bench_delta_v.py --model smollm2 --threads 1 \\
        --data research/signal-or-gate/data/arith-1op2d/test.jsonl --split test \\
        --instruction "$(PYTHONPATH=research/signal-or-gate python -c 'import study; print(study.INSTRUCTION)')"

The rollout is the first of --problems problems' rollouts (value_attribution's seeds and temperature)
that has reasoning tokens; its reasoning positions are the prefixes, as value_attribution takes them.
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

from oar.sampler import decode, format_prompt, left_pad, resolve_instruction, sample, stop_token_ids  # noqa: E402
from oar.tasks.tiny_arith_cache import model_source  # noqa: E402
from oar.training.data import load_problems  # noqa: E402
from oar.training.models import load_model  # noqa: E402
from scripts.analysis import delta_v as dvm  # noqa: E402


def every_pair(model, tok, prompt, completion, gold, prefixes, k, seed, *, max_new_tokens, temperature, batch) -> dict:
    """{(j, c): reward} with every pair sampled, a prefix's K continuations in one group (one shared prefill)."""
    stop, out = stop_token_ids(model, tok), {}
    per_call = max(1, batch // k)
    for start in range(0, len(prefixes), per_call):
        part = prefixes[start : start + per_call]
        ids, mask = left_pad([prompt + completion[:j] for j in part], tok.pad_token_id)
        cont, _ = decode(
            model,
            ids,
            mask,
            max_new_tokens=max_new_tokens - min(part),
            temperature=temperature,
            top_p=1.0,
            eos_token_ids=stop,
            pad_token_id=tok.pad_token_id,
            group_size=k,
            seeds=[dvm.continuation_seed(seed, c) for _ in part for c in range(k)],
            skip_draws=[j for j in part for _ in range(k)],
        )
        for (j, c), row in zip([(j, c) for j in part for c in range(k)], cont.tolist()):
            row = row[: max_new_tokens - j]
            end = next((n for n, x in enumerate(row) if x in stop), len(row))
            out[(j, c)] = dvm.reward(dvm.char_offsets(tok, completion[:j] + row[:end])[0], gold)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-arith")
    p.add_argument("--data", default="arith")
    p.add_argument("--split", default="test")
    p.add_argument("--instruction", default="auto")
    p.add_argument("--problems", type=int, default=4)
    p.add_argument("--group_size", type=int, default=4)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(model_source(args.model))
    model.eval()
    problems = load_problems(args.data, split=args.split, limit=args.problems)[: args.problems]
    instruction = resolve_instruction(args.instruction, args.data, args.model)
    seeds = [n for n in range(len(problems) * args.group_size)]  # value_attribution's at --seed 0
    ro = sample(
        model,
        tok,
        [format_prompt(tok, q.problem, instruction) for q in problems],
        group_size=args.group_size,
        seeds=seeds,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
    )
    lp = ro.prompt_width
    i = next((i for i in range(len(ro)) if ro.reasoning_mask[i].any()), None)
    if i is None:
        raise SystemExit(
            "bench_delta_v.py: no rollout has reasoning tokens; take more --problems or a longer --max_new_tokens"
        )
    prompt = ro.input_ids[i, :lp][ro.attention_mask[i, :lp].bool()].tolist()
    completion = ro.input_ids[i, lp:][ro.completion_mask[i, lp:]].tolist()
    prefixes = dvm.needed_prefixes(ro.reasoning_mask[i, lp:].nonzero().flatten().tolist())
    gold = problems[i // args.group_size].answer
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, batch=args.batch)
    t = time.process_time()
    every = every_pair(model, tok, prompt, completion, gold, prefixes, args.k, seeds[i], **kw)
    every_s = time.process_time() - t
    t = time.process_time()
    skipping = dvm.continuation_rewards(model, tok, prompt, completion, gold, prefixes, args.k, seeds[i], **kw)
    skipping_s = time.process_time() - t
    sampled = len(
        dvm.deviations(
            model,
            prompt,
            completion,
            prefixes,
            args.k,
            seeds[i],
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
        )
    )
    res = {
        "model": args.model,
        "rollout": i,
        "prefixes": len(prefixes),
        "k": args.k,
        "pairs": len(prefixes) * args.k,
        "pairs_sampled": sampled,
        "every_pair_cpu_s": every_s,
        "skipping_cpu_s": skipping_s,
        "ratio": every_s / skipping_s,
        "same_rewards": every == skipping,
        "torch_threads": torch.get_num_threads(),
    }
    print(
        f"rollout {i}: {len(prefixes)} prefixes x K = {args.k}: {res['pairs']} pairs, {sampled} sampled when "
        f"skipping; CPU s every pair {every_s:.1f}, skipping {skipping_s:.1f}: {res['ratio']:.2f}x; "
        f"the same rewards: {res['same_rewards']}"
    )
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
