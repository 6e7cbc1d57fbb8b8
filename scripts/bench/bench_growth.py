"""The measurements for scripts/bench/bench.py --growth (docs/long-reasoning.md): how each scorer's cost grows
with the reasoning length R, and the sampler's decode speed beside transformers' `generate`.

Growth (one synthetic rollout per R: prompt P + reasoning R + answer A tokens, answer_mean probe):
  exact OAR-P   every position up to `exact_all_up_to`; beyond, the clean pass plus k positions in
                blocks of 4 spread evenly, x n_R / k (a copy costs its recomputed length, so evenly
                spread blocks average it), as the sweep of bench_parts.oar_p_sweep does
  window W      the clean pass plus k' evenly spaced positions x n_R / k' beyond `window_all_up_to`, k'
                the multiple of training's copies per forward (`oar_perturb_window.packing`: U sequences
                of c copies) at or above k: a copy attends to all E + c N keys of its sequence, and a
                forward of fewer copies than training packs would time other kernels
  OAR-G         the whole gradient_scores call
  GRPO update   forward + token log-probs + backward over the completion (what every method pays)
Timings are single runs after one warm-up at the first length (CUDA synchronized around each).
"""

from __future__ import annotations

import time

import torch

from oar.grpo import token_logprobs
from oar.oar_grad import gradient_scores
from oar.oar_perturb import perturbation_scores
from oar.oar_perturb_window import device_budget, packing, window_perturbation_scores
from oar.probes import clean_forward, outcome_from_logits

QWEN15B_SHAPE = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)


def qwen15b_random(device: str, dtype=torch.bfloat16):
    """A Qwen2.5-1.5B-shaped Qwen2 model with random weights (timings need no training), built on `device`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        **QWEN15B_SHAPE, pad_token_id=151643, bos_token_id=151643, eos_token_id=151645, attn_implementation="sdpa"
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def growth(
    model,
    pad: int,
    synthetic,
    every_kth,
    *,
    lengths,
    prompt: int,
    answer: int,
    windows,
    k: int,
    exact_all_up_to: int,
    window_all_up_to: int,
    chunk_tokens: int | None,
    window_chunk_tokens: int | None,
) -> list[dict]:
    """Seconds per rollout of each scorer and of the GRPO update at each reasoning length R."""
    device = next(model.parameters()).device
    kw = dict(probe="answer_mean", pad_token_id=pad)
    rows = []
    for i, n_r in enumerate(lengths):
        ids, attn, reas, ans = (t.to(device) for t in synthetic(1, prompt, n_r, answer, seed=n_r))
        row, times = {"reasoning": n_r}, {}

        def clean():
            with torch.no_grad():
                logits, kv = clean_forward(model, ids, attn, keep_cache=True)
            return outcome_from_logits(logits, ids, ans, "answer_mean"), kv

        def sampled(name, positions, score):
            """clean pass + the sampled positions' copies, scaled to all n_R positions."""
            c_s = _time(lambda: times.__setitem__("c", clean()), device)
            p_s = _time(lambda: score(positions, *times["c"]), device)
            row[f"{name}_positions_timed"] = int(positions.sum())
            return c_s + p_s * n_r / int(positions.sum())

        exact = lambda m, c=None, kv=None: perturbation_scores(
            model, ids, attn, m, ans, max_chunk_tokens=chunk_tokens, clean=c, clean_kv=kv, **kw
        )
        blocks = torch.zeros_like(reas)
        for s0 in torch.linspace(prompt, prompt + n_r - 4, max(k // 4, 1)).round().long().tolist():
            blocks[0, s0 : s0 + 4] = True
        fns = {"exact": (lambda: exact(reas)) if n_r <= exact_all_up_to else None}
        for w in windows:
            win = lambda m, c=None, kv=None, w=w: window_perturbation_scores(
                model, ids, attn, m, ans, window=w, max_chunk_tokens=window_chunk_tokens, clean=c, clean_kv=kv, **kw
            )
            end = ids.shape[1] - 2  # the last answer token (then EOS)
            budget = window_chunk_tokens or device_budget(model, device, end, answer, w)
            c, u = packing(end, answer, w, budget)
            per = c * u  # copies a forward, as training packs them
            whole = min(-(-k // per) * per, n_r)  # whole forwards (or every position)
            fns[f"window{w}"] = (
                (lambda win=win: win(reas))
                if n_r <= window_all_up_to
                else (win, every_kth(reas.cpu(), whole).to(device))
            )
        fns["oar_g"] = lambda: gradient_scores(
            model, ids, attn, reas, ans, probe="answer_mean", generator=torch.Generator(device=device).manual_seed(0)
        )

        def update():
            model.zero_grad(set_to_none=True)
            logits, _ = clean_forward(model, ids, attn, logits_to_keep=n_r + answer + 2)
            token_logprobs(logits[:, :-1], ids[:, -(n_r + answer + 1) :]).sum().backward()
            model.zero_grad(set_to_none=True)

        fns["grpo_update"] = update
        if i == 0:  # warm-up (kernels, allocator) on 4 positions per scorer
            few = every_kth(reas.cpu(), 4).to(device)
            exact(few)
            for w in windows:
                window_perturbation_scores(
                    model, ids, attn, few, ans, window=w, max_chunk_tokens=window_chunk_tokens, **kw
                )
            fns["oar_g"](), update()
        row["exact_s"] = _time(fns["exact"], device) if fns["exact"] else sampled("exact", blocks, exact)
        row["exact_positions_timed"] = row.get("exact_positions_timed", n_r)
        for name, f in fns.items():
            if name == "exact":
                continue
            row[f"{name}_s"] = _time(f, device) if callable(f) else sampled(name, f[1], f[0])
            if name.startswith("window"):
                row.setdefault(f"{name}_positions_timed", n_r)
        rows.append(row)
        print(
            "   " + "  ".join(f"{key} {v:.2f}" if isinstance(v, float) else f"{key} {v}" for key, v in row.items()),
            flush=True,
        )
    return rows


def per_doubling(rows: list[dict], key: str, lo: int = 512, hi: int = 2048) -> float | None:
    """(t(hi) / t(lo)) ** (1 / doublings): the time ratio per doubling of R between lo and hi."""
    by = {r["reasoning"]: r[key] for r in rows}
    if lo not in by or hi not in by:
        return None
    import math

    return (by[hi] / by[lo]) ** (1.0 / math.log2(hi / lo))


def decode_speed(
    model, tokenizer_pad: int, *, prompts: int, group_size: int, prompt_len: int, new_tokens: int, synthetic
) -> dict:
    """Decode tokens/s of oar.sampler.generate and of transformers' generate on the same batch
    (P prompts x G samples, exactly `new_tokens` each: no EOS can stop either), temperature 1, no top-k/p."""
    from oar.sampler import generate

    device = next(model.parameters()).device
    ids, attn, _, _ = synthetic(prompts, prompt_len, 1, 1, seed=1)
    ids, attn = ids[:, :prompt_len].to(device), attn[:, :prompt_len].to(device)
    b = prompts * group_size
    ours = lambda: generate(
        model,
        ids,
        attn,
        max_new_tokens=new_tokens,
        temperature=1.0,
        top_p=1.0,
        eos_token_ids=[-1],
        pad_token_id=tokenizer_pad,
        seeds=list(range(b)),
        group_size=group_size,
    )
    hf = lambda: model.generate(
        input_ids=ids,
        attention_mask=attn,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        num_return_sequences=group_size,
        pad_token_id=tokenizer_pad,
        eos_token_id=None,
    )
    with torch.no_grad():
        out_hf = hf()
        assert out_hf.shape == (b, prompt_len + new_tokens), out_hf.shape
        ours(), hf()  # warm-up of both
        t_ours, t_hf = _time(ours, device), _time(hf, device)
    return {
        "rollouts": b,
        "prompt": prompt_len,
        "new_tokens": new_tokens,
        "sampler_s": t_ours,
        "hf_generate_s": t_hf,
        "sampler_tokens_per_s": b * new_tokens / t_ours,
        "hf_generate_tokens_per_s": b * new_tokens / t_hf,
    }


def report(res: dict, windows: str, fast_window: int, fidelity_json: str, out: str, say) -> None:
    """Print the growth table, per-doubling ratios and decode speed; fill the headline keys (the
    fidelity ones from a scripts/analysis/fidelity.py JSON); write `out`."""
    import json
    from pathlib import Path

    rows = res["growth"]
    cols = ["exact"] + [f"window{w}" for w in windows.split(",") if w] + ["oar_g", "grpo_update"]
    say("\n   R     " + "".join(f"{c:>13s}" for c in cols) + "   (seconds per rollout)")
    for r in rows:
        say(f"   {r['reasoning']:5d} " + "".join(f"{r[c + '_s']:13.2f}" for c in cols))
    say(
        "   per doubling 512->2048: "
        + "  ".join(f"{c} {per_doubling(rows, c + '_s') or float('nan'):.2f}x" for c in cols)
    )
    fast = f"window{fast_window}"
    at = {r["reasoning"]: r for r in rows}
    res["oar_p_fast_mode"] = fast
    res["oar_p_fast_speedup_at_1024"] = (
        at[1024]["exact_s"] / at[1024][fast + "_s"] if 1024 in at and fast + "_s" in at[1024] else None
    )
    res["oar_p_fast_growth_per_doubling"] = per_doubling(rows, fast + "_s") if fast in cols else None
    res["oar_p_exact_growth_per_doubling"] = per_doubling(rows, "exact_s")
    res["oar_g_growth_per_doubling"] = per_doubling(rows, "oar_g_s")
    res["grpo_update_growth_per_doubling"] = per_doubling(rows, "grpo_update_s")
    res["oar_p_fast_weight_mae"] = res["oar_p_fast_spearman"] = None
    if fidelity_json:
        fid = json.loads(Path(fidelity_json).read_text())
        if fast in fid["summary"]:
            res["oar_p_fast_weight_mae"], res["oar_p_fast_spearman"] = (
                fid["summary"][fast]["weight_mae"],
                fid["summary"][fast]["spearman"],
            )
            res["oar_p_fast_fidelity_source"] = (
                f"{fidelity_json}: {fid['rollouts']} MATH solutions, n_R {fid['reasoning_tokens_range']}, "
                f"{fid['device']} (not R = 1,024 unless that range says so)"
            )
    if "decode" in res:
        d = res["decode"]
        say(
            f"\ndecode, {d['rollouts']} rollouts x {d['new_tokens']} new tokens after a {d['prompt']}-token prompt: "
            f"oar.sampler {d['sampler_tokens_per_s']:.0f} tokens/s, "
            f"transformers generate {d['hf_generate_tokens_per_s']:.0f} tokens/s "
            f"({d['sampler_s']:.1f} s vs {d['hf_generate_s']:.1f} s)"
        )
    keys = (
        "oar_p_fast_mode",
        "oar_p_fast_speedup_at_1024",
        "oar_p_fast_weight_mae",
        "oar_p_fast_spearman",
        "oar_p_fast_growth_per_doubling",
        "oar_p_exact_growth_per_doubling",
        "oar_g_growth_per_doubling",
        "grpo_update_growth_per_doubling",
    )
    say(f"\nheadline: {json.dumps({k: res[k] for k in keys})}")
    if "oar_p_fast_fidelity_source" in res:
        say(f"fidelity from {res['oar_p_fast_fidelity_source']}")
    if out:
        Path(out).write_text(json.dumps(res, indent=1))
