"""The rollout benchmark (docs/sampler.md): tokens/s of oar's sampler, its three loops (eager, static, compiled),
beside transformers' `generate` (its default cache; its static cache, compiled) on the same batch.

    python scripts/bench/bench.py --rollouts --json docs/bench/rollouts-cpu.json
    python scripts/bench/bench.py --rollouts --device cuda --peak_gbs 3350 --json docs/bench/rollouts-gpu.json

CPU: tiny-arith at the default run's batch (32 prompts x 8 rollouts, 64 new tokens) and SmolLM2-135M
(8 prompts x 8 rollouts x 256 new tokens); GPU: a Qwen2.5-1.5B-shaped model in bf16 at 32, 128 and 256
rollouts x 1,024 new tokens, with the fraction of the memory-bandwidth bound (bytes of weights and
KV cache read per decode step / step time / the device's peak). Every row runs exactly T new tokens
(no EOS), temperature 1, no top-k or top-p. The loops run interleaved after a warm-up (the compiled
ones compile there; that time is reported apart); medians. The three oar loops must give the same
tokens: the benchmark checks it and says so. `eager_sorted` is the eager loop with every row's token
chosen by sorting the vocabulary (the sampler before oar/inverse_cdf.py's head search): it must give
the eager loop's tokens and log-probs bit for bit, and the benchmark checks that too.

`--vllm`: the vLLM backend beside these (scripts/bench/bench_vllm.py).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from unittest import mock

import torch

from oar import inverse_cdf
from oar.sampler import decode

LOOPS = ("eager", "static", "compiled")
SORTED = "eager_sorted"
HF = ("hf_generate", "hf_generate_static_compiled")
VARIANTS = LOOPS + (SORTED,) + HF  # every variant a row can time


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def rollout_speeds(
    model, ids, attn, *, group_size: int, new_tokens: int, pad: int, repeats: int, variants=VARIANTS
) -> dict:
    """Median seconds and tokens/s of each variant on the (P, Lp) prompts ids/attn, P x group_size rollouts."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    device = ids.device
    b = ids.shape[0] * group_size
    out = {}

    def ours(loop):
        def run():
            with sorting_every_row(loop == SORTED):
                out[loop] = decode(
                    model,
                    ids,
                    attn,
                    max_new_tokens=new_tokens,
                    temperature=1.0,
                    top_p=1.0,
                    eos_token_ids=set(),
                    pad_token_id=pad,
                    seeds=list(range(b)),
                    group_size=group_size,
                    loop=loop.replace("_sorted", ""),
                )

        return run

    def hf(static):
        config = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            num_return_sequences=group_size,
            pad_token_id=pad,
            eos_token_id=None,
        )
        if static:
            config.cache_implementation = "static"
            config.compile_config = CompileConfig()
            config.compile_config._compile_all_devices = True  # transformers compiles only on accelerators unless told
        return lambda: model.generate(input_ids=ids, attention_mask=attn, generation_config=config)

    fns = {
        **{v: ours(v) for v in variants if v in LOOPS + (SORTED,)},
        **({"hf_generate": hf(False)} if "hf_generate" in variants else {}),
        **({"hf_generate_static_compiled": hf(True)} if "hf_generate_static_compiled" in variants else {}),
    }
    first = {}
    with torch.no_grad():
        for name, fn in fns.items():  # warm-up: the compiled variants compile here
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            first[name] = time.perf_counter() - t
        times = {k: [] for k in fns}
        for r in range(repeats):
            for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
                _sync(device)
                t = time.perf_counter()
                fns[name]()
                _sync(device)
                times[name].append(time.perf_counter() - t)
    res = {"rollouts": b, "prompt_width": ids.shape[1], "new_tokens": new_tokens, "repeats": repeats, "variants": {}}
    for name, ts in times.items():
        s = statistics.median(ts)
        res["variants"][name] = {
            "median_s": s,
            "times_s": ts,
            "first_call_s": first[name],
            "tokens_per_s": b * new_tokens / s,
        }
    res["choose_s_per_step"], res["choose_sorted_s_per_step"] = choose_seconds(model, ids, attn, group_size)
    loops = [v for v in LOOPS if v in out]
    res["loops_give_equal_tokens"] = all(torch.equal(out[v][0], out[loops[0]][0]) for v in loops)
    if SORTED in out and "eager" in out:  # the head search must be the sort's choice exactly
        res["head_search_equals_sort"] = all(torch.equal(x, y) for x, y in zip(out["eager"], out[SORTED]))
    res["agreement_with_eager"] = {
        v: agreement(out["eager"], out[v]) for v in loops if v != "eager" and "eager" in out
    }
    return res


def choose_seconds(model, ids, attn, group_size: int, repeats: int = 10) -> tuple[float, float]:
    """Median seconds of one step's token choice alone (`oar.decode_loops.choose`: softmax, the search,
    the log-prob) on the model's own next-token logits after the prompts (one row per rollout), with
    the head search and with every row sorted."""
    from oar.decode_loops import choose

    device = ids.device
    with torch.no_grad():
        z = model(input_ids=ids, attention_mask=attn).logits[:, -1].float().repeat_interleave(group_size, 0)
    u = torch.rand(z.shape[0], generator=torch.Generator().manual_seed(0)).to(device)
    done = torch.zeros(z.shape[0], dtype=torch.bool, device=device)
    res = []
    for sort_all in (False, True):
        times = []
        with sorting_every_row(sort_all):
            for _ in range(repeats + 1):
                _sync(device)
                t = time.perf_counter()
                choose(z, 1.0, 1.0, u, done, 0)
                _sync(device)
                times.append(time.perf_counter() - t)
        res.append(statistics.median(times[1:]))
    return res[0], res[1]


def sorting_every_row(on: bool):
    """While on, the sampler sorts every row, as before oar/inverse_cdf.py's head search (its proof's
    precondition reported false); otherwise nothing changes."""
    return mock.patch.object(inverse_cdf, "cumsum_adds_in_float64", lambda: False) if on else contextlib.nullcontext()


def agreement(a, b) -> dict:
    """How far two loops' (tokens, log-probs) agree: rows with equal tokens, and for each row that
    differs, where its first different token is and the sampled log-probability there (a flip is a
    rounding difference where the draw fell between two tokens that rounding can reorder)."""
    diff = a[0] != b[0]
    rows = diff.any(1).nonzero().flatten().tolist()
    first = [int(diff[r].int().argmax()) for r in rows]
    same = ~diff.any(1)
    return {
        "rows": a[0].shape[0],
        "rows_equal": int(same.sum()),
        "first_difference_at": first,
        "logprob_at_first_difference": [float(a[1][r, j]) for r, j in zip(rows, first)],
        "max_logprob_diff_equal_rows": float((a[1] - b[1])[same].abs().max()) if same.any() else None,
    }


def bandwidth_fraction(model, *, rollouts: int, prompt: int, new_tokens: int, step_s: float, peak_gbs: float) -> float:
    """Of the memory-bandwidth bound: bytes a decode step must read (every weight once, and the KV cache
    of all rows at its mean length prompt + T/2) / the measured seconds per step / the peak bytes/s."""
    c = model.config
    elem = next(model.parameters()).element_size()
    weights = sum(p.numel() for p in model.parameters()) * elem
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * elem
    kv = rollouts * (prompt + new_tokens / 2) * kv_per_token
    return (weights + kv) / step_s / (peak_gbs * 1e9)


def cpu_cases(cache_dir, say) -> dict:
    """The CPU rows: tiny-arith at the default run's batch and shape, SmolLM2-135M at 8 x 8 x 256."""
    from pathlib import Path

    import bench_parts as bp

    from oar.sampler import encode_prompts, format_prompt
    from oar.tasks.arith import arith_problems
    from oar.tasks.tiny_arith_cache import model_source
    from oar.training.models import load_model

    res = {}
    model, tok = load_model(model_source("tiny-arith"))
    model.eval()
    ids, attn = encode_prompts(
        tok, [format_prompt(tok, p.problem) for p in arith_problems(32, split="train", seed=0)], "cpu"
    )
    res["tiny_arith"] = r = rollout_speeds(
        model, ids, attn, group_size=8, new_tokens=64, pad=tok.pad_token_id, repeats=5
    )
    _say_row(say, "tiny-arith (0.8M, the default run's 32 prompts x 8, 64 new tokens)", r)
    model, tok, _, source = bp.smollm2(Path(cache_dir))
    prompts = (
        [format_prompt(tok, p.problem) for p in arith_problems(8, split="train", seed=0)] if tok is not None else None
    )
    ids, attn = (
        encode_prompts(tok, prompts, "cpu")
        if tok is not None
        else (torch.randint(3, 40000, (8, 32)), torch.ones(8, 32, dtype=torch.long))
    )
    res["smollm2"] = r = rollout_speeds(
        model, ids, attn, group_size=8, new_tokens=256, pad=tok.pad_token_id if tok else 2, repeats=2
    )
    r["model"] = source
    _say_row(say, f"{source}, 8 prompts x 8, 256 new tokens", r)
    v, w = res["tiny_arith"]["variants"], res["smollm2"]["variants"]
    res["rollouts_speedup_tiny_cpu"] = v["eager"]["median_s"] / v["compiled"]["median_s"]
    res["rollouts_speedup_tiny_cpu_static"] = v["eager"]["median_s"] / v["static"]["median_s"]
    res["rollouts_vs_generate_smollm2_cpu"] = w["hf_generate"]["median_s"] / w["eager"]["median_s"]
    res["rollouts_vs_generate_smollm2_cpu_compiled"] = w["hf_generate"]["median_s"] / w["compiled"]["median_s"]
    res["rollouts_speedup_smollm2_cpu_vs_sorted"] = (
        w[SORTED]["median_s"] / w["eager"]["median_s"]
    )  # the head search's gain
    return res


def gpu_cases(
    peak_gbs: float, say, batches=(32, 128, 256), new_tokens: int = 1024, prompt: int = 128, variants=VARIANTS
) -> dict:
    """The GPU rows: the Qwen2.5-1.5B shape in bf16 (random weights), synthetic prompts of `prompt` tokens."""
    import bench_growth as bg

    model = bg.qwen15b_random("cuda")
    res = {
        "model": "random Qwen2.5-1.5B-shaped Qwen2 (bf16)",
        "device": torch.cuda.get_device_name(),
        "peak_gbs": peak_gbs,
        "rows": [],
    }
    for b in batches:
        ids = torch.randint(3, 150000, (b // 8, prompt), device="cuda")
        r = rollout_speeds(
            model,
            ids,
            torch.ones_like(ids),
            group_size=8,
            new_tokens=new_tokens,
            pad=151643,
            repeats=3,
            variants=variants,
        )
        for name, x in r["variants"].items():
            x["bandwidth_fraction"] = bandwidth_fraction(
                model,
                rollouts=b,
                prompt=prompt,
                new_tokens=new_tokens,
                step_s=x["median_s"] / new_tokens,
                peak_gbs=peak_gbs,
            )
        res["rows"].append(r)
        _say_row(say, f"{res['model']}, {b} rollouts x {new_tokens}", r)
    return res


def _say_row(say, title, r):
    say(f"\n{title}: tokens/s (median of {r['repeats']}; first call, with any compile, apart)")
    base = r["variants"]["eager"]["median_s"]
    for name, x in r["variants"].items():
        extra = f"   of bandwidth bound {x['bandwidth_fraction']:.2f}" if "bandwidth_fraction" in x else ""
        say(
            f"   {name:30s} {x['tokens_per_s']:10.0f} tok/s   {base / x['median_s']:5.2f}x the eager loop   "
            f"first call {x['first_call_s']:6.1f} s{extra}"
        )
    step = r["variants"]["eager"]["median_s"] / r["new_tokens"]
    say(
        f"   choosing the token alone (softmax, search, log-prob) on the model's logits after the prompts: "
        f"{r['choose_s_per_step'] * 1e3:.1f} ms a step "
        f"({r['choose_s_per_step'] / step:.0%} of the eager loop's step); "
        f"sorting every row {r['choose_sorted_s_per_step'] * 1e3:.1f} ms"
    )
    say(f"   oar's loops give the same tokens: {r['loops_give_equal_tokens']}")
    if "head_search_equals_sort" in r:
        say(
            "   eager and eager_sorted give the same tokens and log-probs, bit for bit: "
            f"{r['head_search_equals_sort']}"
        )
    for loop, a in r.get("agreement_with_eager", {}).items():
        say(
            f"   {loop}: {a['rows_equal']} of {a['rows']} rows equal to the eager loop's; the others first differ at "
            f"{a['first_difference_at']}, where the sampled token's log-prob was "
            f"{[round(x, 1) for x in a['logprob_at_first_difference']]}"
        )
