"""The ΔV values' continuations (scripts/analysis/value_attribution.py), two ways, side by side in one run:
K continuations of each prefix sampled with one prefill shared by the K (the sampler's group_size: what
the script did from 94f9638 until d55d613, which samples only the pairs that deviate from the rollout,
each with its own prefill) against one prefill per continuation row, on the same prefixes and seeds,
in repeats (per row first, then shared, each time; the minimum of each is reported). Prints the CPU
seconds of each, their ratio, and whether every row's tokens are the same.

    python scripts/bench/bench_continuations.py                                   # tiny-arith: seconds
    OMP_NUM_THREADS=1 python scripts/bench/bench_continuations.py --model smollm2 --threads 1   # minutes
    OMP_NUM_THREADS=1 python scripts/bench/bench_continuations.py --model smollm2 --threads 1 \\
        --instruction "$(PYTHONPATH=research/signal-or-gate python -c 'import study; print(study.INSTRUCTION)')"

The completion continued is the model's own greedy answer to one arith problem; its first --prefixes
prefixes are continued K times each, --batch rows a call, as the script batches them. What sharing
saves is the prefill, so it grows with the prompt: the signal-or-gate study's one-shot instruction
makes a longer prompt than the default's.
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

from oar.sampler import decode, encode_prompts, format_prompt, left_pad, resolve_instruction, sample, stop_token_ids  # noqa: E402
from oar.tasks.tiny_arith_cache import model_source  # noqa: E402
from oar.training.models import load_model  # noqa: E402


def continuations(
    model, tok, prompt, completion, prefixes, k, *, shared: bool, batch: int, **sampling
) -> list[list[int]]:
    """Every (prefix, continuation) row's tokens, prefix-major; continuation c draws from seed c at every prefix."""
    rows = []
    per_call = max(1, batch // k)
    for start in range(0, len(prefixes), per_call):
        part = prefixes[start : start + per_call]
        texts = [prompt + completion[:j] for j in part for _ in ([0] if shared else range(k))]
        ids, mask = left_pad(texts, tok.pad_token_id)
        out, _ = decode(
            model,
            ids,
            mask,
            max_new_tokens=sampling["max_new_tokens"] - min(part),
            temperature=sampling["temperature"],
            top_p=1.0,
            eos_token_ids=stop_token_ids(model, tok),
            pad_token_id=tok.pad_token_id,
            seeds=[c for _ in part for c in range(k)],
            group_size=k if shared else 1,
        )
        rows += out.tolist()
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="tiny-arith")
    p.add_argument("--problem", default="Compute 20 + 3.")
    p.add_argument(
        "--instruction",
        default="auto",
        help="appended to the problem, as train.py's --instruction ('auto': its default)",
    )
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--batch", type=int, default=64, help="continuation rows a call (the script's --batch)")
    p.add_argument("--max_new_tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(model_source(args.model))
    model.eval()
    text = format_prompt(tok, args.problem, resolve_instruction(args.instruction, "arith", args.model))
    greedy = sample(model, tok, [text], group_size=1, seeds=[0], max_new_tokens=args.max_new_tokens, temperature=0.0)
    prompt = encode_prompts(tok, [text], "cpu")[0][0].tolist()
    completion = tok(greedy.texts[0], add_special_tokens=False)["input_ids"]
    prefixes = list(range(min(args.prefixes, len(completion) + 1)))
    seconds, tokens = {"per_row": [], "shared": []}, {}
    for _ in range(args.repeats):
        for way in ("per_row", "shared"):
            start = time.process_time()
            tokens[way] = continuations(
                model,
                tok,
                prompt,
                completion,
                prefixes,
                args.k,
                shared=way == "shared",
                batch=args.batch,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
            )
            seconds[way].append(time.process_time() - start)
    best = {way: min(s) for way, s in seconds.items()}
    result = {
        "model": args.model,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(completion),
        "threads": torch.get_num_threads(),
        "prefixes": len(prefixes),
        "k": args.k,
        "batch": args.batch,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "cpu_seconds": seconds,
        "ratio_per_row_over_shared": best["per_row"] / best["shared"],
        "same_tokens": tokens["per_row"] == tokens["shared"],
    }
    print(
        f"{args.model}, {len(prefixes)} prefixes x {args.k} continuations, {args.batch} rows a call, "
        f"{torch.get_num_threads()} thread(s): one prefill a row {best['per_row']:.1f} CPU s, "
        f"one a prefix {best['shared']:.1f} CPU s (best of {args.repeats}), "
        f"{result['ratio_per_row_over_shared']:.2f}x; every row's tokens the same: {result['same_tokens']}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
