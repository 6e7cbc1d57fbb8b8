"""Today's decode loop and OAR-P against the code they replaced, side by side in one process.

    python scripts/bench/bench_before.py --decode --threads 1 --json docs/bench/decode-before-cpu.json
    python scripts/bench/bench_before.py --oar_p --threads 1 --json docs/bench/oar-p-before-cpu.json

The code before is read from git (`--before`, by default c0ec13d, the commit before the changes docs/sampler.md and
docs/long-reasoning.md describe) into modules of its own (`oar_before.*`, importing today's oar.lm, oar.probes and
oar.inverse_cdf, which the changes left as they were for what these modules call) and runs beside today's on the
same inputs: the two interleaved after a warm-up, the order reversed every other repeat, medians. Read the ratios,
measured side by side; the seconds move with the machine's load. Each side's outputs are compared: the decode loops
must give the same tokens and log-probs bit for bit, OAR-P the same scores to float rounding (the largest difference
is reported against the largest score).

--decode: SmolLM2-135M's eager loop in float32 and under accelerate's bf16 autocast (float32 master weights, as
train.py under --mixed_precision bf16), and tiny-arith at the default run's batch; every row runs exactly T
tokens (no EOS), temperature 1.
--oar_p: SmolLM2-135M scoring synthetic rollouts of mixed reasoning lengths in one batch (bench_parts.py's
layout, random ids), exact OAR-P on 16 evenly spaced positions a row and the window mode (W = 32) on 128 (every
position of a shorter row), at training's budget (None), with the clean pass run here.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_parts as bp  # noqa: E402

BEFORE = "c0ec13d"  # the commit before today's sampler and OAR-P changes


def before_modules(commit: str, names: list[str]) -> dict[str, types.ModuleType]:
    """oar/<name>.py of `commit` for each name (in import order), as modules oar_before.<name> whose imports of
    each other point at one another, not at today's files."""
    pkg = sys.modules.setdefault("oar_before", types.ModuleType("oar_before"))
    pkg.__path__ = []
    out = {}
    for name in names:
        src = subprocess.run(
            ["git", "show", f"{commit}:oar/{name}.py"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        for other in names:
            src = src.replace(f"from oar.{other} import", f"from oar_before.{other} import")
        mod = types.ModuleType(f"oar_before.{name}")
        mod.__file__ = f"{commit}:oar/{name}.py"
        sys.modules[mod.__name__] = mod
        exec(compile(src, mod.__file__, "exec"), mod.__dict__)
        out[name] = mod
    return out


def _timed(fns: dict, repeats: int) -> dict:
    """{name: {median_s, times_s, result}}: each callable once to warm up, then `repeats` interleaved runs."""
    results = {name: fn() for name, fn in fns.items()}
    times = bp.interleaved(fns, repeats, warmup={})
    return {
        name: {"median_s": statistics.median(ts), "times_s": ts, "result": results[name]} for name, ts in times.items()
    }


# ------------------------------------------------------------------ the decode loop (docs/sampler.md)


def decode_case(model, ids, attn, *, group_size: int, new_tokens: int, pad: int, repeats: int, before) -> dict:
    """Today's eager loop and the one it replaced on the (P, Lp) prompts, P x group_size rollouts of exactly
    `new_tokens` tokens: seconds, tokens/s and whether the two give the same tokens and log-probs."""
    from oar.lm import eval_mode
    from oar.sampler import decode

    b = ids.shape[0] * group_size
    kw = dict(
        max_new_tokens=new_tokens,
        temperature=1.0,
        top_p=1.0,
        eos_token_ids=set(),
        pad_token_id=pad,
        seeds=list(range(b)),
        group_size=group_size,
    )

    def old():
        with eval_mode(model):
            return before.decode_eager(model, ids, attn, **kw)

    r = _timed({"before": old, "today": lambda: decode(model, ids, attn, **kw)}, repeats)
    (t0, l0), (t1, l1) = r["before"].pop("result"), r["today"].pop("result")
    for x in r.values():
        x["tokens_per_s"] = b * new_tokens / x["median_s"]
    return {
        "rollouts": b,
        "prompt_width": ids.shape[1],
        "new_tokens": new_tokens,
        "repeats": repeats,
        "variants": r,
        "speedup": r["before"]["median_s"] / r["today"]["median_s"],
        "same_tokens": torch.equal(t0, t1),
        "same_logprobs_bit_for_bit": torch.equal(l0, l1),
    }


def under_accelerate_bf16(model):
    """The model as train.py's accelerator prepares it under --mixed_precision bf16 on this device (autocast
    around the forward, float32 master weights)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        return Accelerator(mixed_precision="bf16", cpu=True).prepare(model)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def decode_main(args, say) -> dict:
    from oar.sampler import encode_prompts, format_prompt
    from oar.tasks.arith import arith_problems
    from oar.tasks.tiny_arith_cache import model_source
    from oar.training.models import load_model

    before = before_modules(args.before, ["eager_decode"])["eager_decode"]
    res = {}
    model, tok, _, source = bp.smollm2(Path(args.cache_dir))
    p = args.decode_rollouts // 8
    ids, attn = encode_prompts(
        tok, [format_prompt(tok, q.problem) for q in arith_problems(p, split="train", seed=0)], "cpu"
    )
    kw = dict(group_size=8, new_tokens=args.decode_tokens, pad=tok.pad_token_id, repeats=args.repeats, before=before)
    for name in ("smollm2_float32", "smollm2_bf16_autocast"):
        m = model if name.endswith("float32") else under_accelerate_bf16(copy.deepcopy(model))  # it patches forward
        res[name] = r = decode_case(m, ids, attn, **kw)
        r["model"] = source
        _say_decode(say, f"{source}, {name.split('_', 1)[1]}", r)
    model, tok = load_model(model_source("tiny-arith"))
    ids, attn = encode_prompts(
        tok, [format_prompt(tok, q.problem) for q in arith_problems(32, split="train", seed=0)], "cpu"
    )
    kw |= dict(new_tokens=64, pad=tok.pad_token_id, repeats=max(args.repeats, 5))
    res["tiny_arith"] = r = decode_case(model.eval(), ids, attn, **kw)
    _say_decode(say, "tiny-arith (the default run's 32 prompts x 8, 64 tokens)", r)
    return res


def _say_decode(say, title, r):
    v = r["variants"]
    say(
        f"{title}: {r['rollouts']} rollouts x {r['new_tokens']} tokens after {r['prompt_width']} prompt columns\n"
        f"   before {v['before']['tokens_per_s']:8.1f} tok/s   today {v['today']['tokens_per_s']:8.1f} tok/s   "
        f"{r['speedup']:.2f}x   same tokens {r['same_tokens']}, same log-probs bit for bit "
        f"{r['same_logprobs_bit_for_bit']}"
    )


# ------------------------------------------------------------------ OAR-P (docs/long-reasoning.md)


def mixed_rollouts(lengths: list[int], *, prompt: int, answer: int, seed: int = 0):
    """One synthetic rollout per reasoning length, laid out as the sampler lays them out in one batch: a prompt
    of `prompt` tokens, reasoning, an answer of `answer` tokens and EOS, right-padded to the longest row."""
    rows = [bp.synthetic(1, prompt, r, answer, seed=seed + i) for i, r in enumerate(lengths)]
    width = max(x[0].shape[1] for x in rows)
    out = []
    for k, fill in enumerate((2, 0, False, False)):  # ids (pad 2), attention, reasoning, answer
        out.append(
            torch.stack([torch.nn.functional.pad(x[k][0], (0, width - x[k].shape[1]), value=fill) for x in rows])
        )
    return tuple(out)


def oar_p_main(args, say) -> dict:
    from oar.oar_perturb import perturbation_scores

    mods = before_modules(args.before, ["oar_perturb_exact", "oar_perturb_window", "oar_perturb"])
    old = mods["oar_perturb"].perturbation_scores
    model, tok, _, source = bp.smollm2(Path(args.cache_dir))
    pad = tok.pad_token_id if tok is not None else 2
    lengths = [int(x) for x in args.lengths.split(",")]
    ids, attn, every, ans = mixed_rollouts(lengths, prompt=args.prompt, answer=args.answer)
    res = {"model": source, "reasoning_lengths": lengths, "prompt": args.prompt, "answer": args.answer}
    for mode in args.modes.split(","):
        k = args.positions if mode == "exact" else args.window_positions
        reas = bp.every_kth(every, k) if k else every
        kw = dict(probe="answer_mean", pad_token_id=pad, mode=mode, window=32)
        fns = {
            "before": lambda: old(model, ids, attn, reas, ans, **kw),  # its budget: 8192 (exact), 2,048 (window)
            "today": lambda: perturbation_scores(model, ids, attn, reas, ans, max_chunk_tokens=None, **kw),
        }
        r = _timed(fns, args.repeats)
        a, b = r["before"].pop("result"), r["today"].pop("result")
        res[mode] = {
            "scored_positions": int(reas.sum()),
            "variants": r,
            "speedup": r["before"]["median_s"] / r["today"]["median_s"],
            "max_abs_diff": float((a - b).abs().max()),
            "max_abs_score": float(a.abs().max()),
        }
        x = res[mode]
        say(
            f"{mode}: before {r['before']['median_s']:.1f} s, today {r['today']['median_s']:.1f} s: "
            f"{x['speedup']:.2f}x; scores differ by at most {x['max_abs_diff']:.2e} "
            f"(largest score {x['max_abs_score']:.3g})"
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--decode", action="store_true", help="the eager decode loop, before and today")
    ap.add_argument("--oar_p", action="store_true", help="OAR-P exact and window, before and today")
    ap.add_argument("--before", default=BEFORE, help="the commit whose code is 'before'")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each side, interleaved")
    ap.add_argument("--cache_dir", default="/tmp/oar-bench", help="where SmolLM2's GGUF is converted once")
    ap.add_argument("--decode_rollouts", type=int, default=64, help="--decode: SmolLM2 rollouts (8 per prompt)")
    ap.add_argument("--decode_tokens", type=int, default=256, help="--decode: SmolLM2 new tokens a rollout")
    ap.add_argument("--lengths", default="64,160,320,600,900", help="--oar_p: reasoning lengths, one rollout each")
    ap.add_argument("--modes", default="exact,window", help="--oar_p: the modes to time, comma-separated")
    ap.add_argument("--prompt", type=int, default=128, help="--oar_p: prompt tokens")
    ap.add_argument("--answer", type=int, default=8, help="--oar_p: answer tokens")
    ap.add_argument(
        "--positions", type=int, default=16, help="--oar_p: exact mode's evenly spaced positions a row (0: all)"
    )
    ap.add_argument(
        "--window_positions", type=int, default=128, help="--oar_p: the window mode's positions a row (0: all)"
    )
    args = ap.parse_args()
    if args.threads:
        bp.set_threads(args.threads)
    res = {"machine": bp.machine(), "before": args.before, "args": vars(args)}
    res["commit"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    say = lambda s: print(s, flush=True)
    m = res["machine"]
    say(f"{m['cpu']}, {m['torch_threads']} torch threads, load average {m['load_average_1min']:.1f}")
    if args.decode:
        res["decode"] = decode_main(args, say)
    if args.oar_p:
        res["oar_p"] = oar_p_main(args, say)
    res["load_average_1min_end"] = bp.machine()["load_average_1min"]
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
