"""The benchmark of docs/speed.md: what OAR costs next to GRPO, measured side by side in one run.

    python scripts/bench/bench.py --json bench.json                 # full (tens of minutes on 2 CPU cores)
    python scripts/bench/bench.py --quick --json quick.json         # smaller sizes, same comparisons, no TRL
    python scripts/bench/bench.py --trl_python /tmp/trl-venv/bin/python --json bench.json   # + TRL's GRPOTrainer
    python scripts/bench/bench.py --growth --json growth.json       # cost growth with R, decode tokens/s
    python scripts/bench/bench.py --growth --device cuda --model qwen1.5b-random --json growth-gpu.json
    python scripts/bench/bench.py --rollouts --json rollouts.json   # the sampler's loops vs generate (docs/sampler.md)
    python scripts/bench/bench.py --rollouts --vllm --json v.json   # the vLLM backend beside them (docs/vllm.md)

1. OAR-P: the fast exact path vs the naive definition (one full forward per masked copy) on
   SmolLM2-135M-Instruct, and how both grow with the reasoning length. The naive cost is timed on
   k evenly spaced masked positions and scaled by n_R / k: every naive copy costs exactly one
   full-length forward, so this is its cost, not an estimate that favours the fast path.
2. Training step (rollout + reward + scores + update) of train.py: OAR-G and OAR-P over GRPO on the
   default tiny-arith setting and on a small SmolLM2 setting.
3. Log-probs: peak memory of token_logprobs vs a full float32 log_softmax, each in a fresh process.
4. TRL: GRPO steps/s of train.py over TRL's GRPOTrainer (scripts/bench/bench_trl.py), same setting.
5. GPU: not measured here (null) when no GPU is present.
Timings are medians over repeats after a warm-up, with A and B interleaved.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_parts as bp  # noqa: E402
import bench_steps  # noqa: E402
from oar.tasks.tiny_arith_cache import ensure_tiny_arith  # noqa: E402

# SmolLM2-135M rarely writes an extractable answer to arith problems (0 of 8 with the \boxed{} request in
# 64 tokens); this wording gets about a quarter. Rollouts without an answer cost OAR nothing (weights 1),
# so the table prints their fraction next to the SmolLM2 ratios.
SMOLLM2_INSTRUCTION = "Solve it. Your reply must end with the sentence: The answer is <number>."
FULL = dict(
    batch=2,
    prompt=128,
    reasoning=128,
    answer=4,
    k=16,
    repeats=3,
    sweep=(32, 64, 128, 256, 512),
    sweep_k=16,
    sweep_fast_all=256,
    ta=dict(),
    ta_steps=4,
    ta_repeats=3,
    sm=dict(prompts_per_step=2, group_size=4, max_new_tokens=64, micro_batch_size=8),
    sm_steps=2,
    sm_repeats=2,
    mem_fwd=(64, 256, 49152),
    mem_bwd=(16, 256, 49152),
)
QUICK = dict(
    batch=2,
    prompt=32,
    reasoning=32,
    answer=4,
    k=8,
    repeats=2,
    sweep=(16, 32, 64),
    sweep_k=4,
    sweep_fast_all=64,
    ta=dict(prompts_per_step=8, max_new_tokens=48),
    ta_steps=3,
    ta_repeats=8,  # 8 rounds of 2 timed steps: a median of 8 CPU ratios
    sm=dict(prompts_per_step=1, group_size=4, max_new_tokens=32, micro_batch_size=4),
    sm_steps=2,
    sm_repeats=1,
    mem_fwd=None,
    mem_bwd=(8, 256, 49152),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--quick", action="store_true", help="smaller sizes, same comparisons, no TRL (< 4 min on 2 cores)"
    )
    ap.add_argument(
        "--trl_python", help="a python with trl installed (e.g. /tmp/trl-venv/bin/python); TRL is skipped without it"
    )
    ap.add_argument(
        "--cache_dir", default="/tmp/oar-bench", help="where SmolLM2's GGUF is converted once to safetensors"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads for everything (0: torch's default). On a shared, "
        "oversubscribed machine 1 avoids OpenMP barrier stalls that slow small ops 10x",
    )
    ap.add_argument(
        "--skip", default="", help="comma-separated parts to leave out: oar_p, sweep, steps, smollm2_steps, logprob"
    )
    ap.add_argument(
        "--growth",
        action="store_true",
        help="only the cost growth with R of exact OAR-P, the window modes, OAR-G and a GRPO update, plus decode "
        "tokens/s (scripts/bench/bench_growth.py; docs/long-reasoning.md)",
    )
    ap.add_argument(
        "--rollouts",
        action="store_true",
        help="only the rollout tokens/s of the sampler's loops beside transformers' generate "
        "(scripts/bench/bench_rollouts.py; docs/sampler.md)",
    )
    ap.add_argument(
        "--vllm",
        action="store_true",
        help="--rollouts: only the vLLM backend beside the own sampler and generate, "
        "SmolLM2 64 x 8 x 128 on the CPU (needs requirements-vllm.txt)",
    )
    ap.add_argument(
        "--vllm_prompts", type=int, default=64, help="--rollouts --vllm: prompts (x 8 rollouts x 128 tokens)"
    )
    ap.add_argument(
        "--vllm_repeats",
        type=int,
        default=1,
        help="--rollouts --vllm: timed runs of each backend, in alternating "
        "order (forward, reversed, ...), the median reported: on a shared machine, load falls on every backend alike",
    )
    ap.add_argument(
        "--peak_gbs",
        type=float,
        default=3350.0,
        help="--rollouts --device cuda: the GPU's peak memory bandwidth, GB/s (H100 SXM 3350, H200 4800)",
    )
    ap.add_argument(
        "--gpu_batches", default="32,128,256", help="--rollouts --device cuda: rollouts a batch, comma-separated"
    )
    ap.add_argument("--gpu_new_tokens", type=int, default=1024, help="--rollouts --device cuda: new tokens a rollout")
    ap.add_argument(
        "--gpu_variants",
        default="",
        help="--rollouts --device cuda: comma-separated loops to time ('': every one, bench_rollouts.VARIANTS)",
    )
    ap.add_argument("--device", default="cpu", help="--growth, --rollouts: cpu or cuda")
    ap.add_argument(
        "--model",
        default="smollm2",
        help="--growth: smollm2 (the GGUF, float32) or qwen1.5b-random (Qwen2.5-1.5B shape, bf16)",
    )
    ap.add_argument("--lengths", default="256,512,1024,2048", help="--growth: reasoning lengths R")
    ap.add_argument("--windows", default="16,32,64", help="--growth: window sizes W to time")
    ap.add_argument(
        "--fast_window",
        type=int,
        default=32,
        help="--growth: the window of the default long-R mode (the oar_p_fast_* keys)",
    )
    ap.add_argument("--sample_k", type=int, default=16, help="--growth: positions timed per sampled scorer")
    ap.add_argument(
        "--exact_all_up_to", type=int, default=256, help="--growth: exact OAR-P on every position up to this R"
    )
    ap.add_argument(
        "--window_all_up_to", type=int, default=0, help="--growth: window modes on every position up to this R"
    )
    ap.add_argument(
        "--decode",
        default="4,8,128,512",
        help="--growth: decode batch 'prompts,group,prompt_len,new_tokens' ('' skips)",
    )
    ap.add_argument(
        "--fidelity_json",
        default="",
        help="--growth: scripts/analysis/fidelity.py output whose window<fast_window> row gives "
        "oar_p_fast_weight_mae and oar_p_fast_spearman",
    )
    ap.add_argument(
        "--from_json",
        default="",
        help="--growth: no timing; report a saved --growth JSON again (with --fidelity_json)",
    )
    args = ap.parse_args()
    if args.growth:
        return growth_main(args)
    if args.rollouts:
        return rollouts_main(args)
    size, skip = (QUICK if args.quick else FULL), set(filter(None, args.skip.split(",")))
    if args.threads:
        bp.set_threads(args.threads)
    t_start = time.time()
    res = {
        "mode": "quick" if args.quick else "full",
        "machine": bp.machine(),
        "sizes": {k: v for k, v in size.items()},
    }
    say = lambda s: print(s, flush=True)
    say(
        f"machine: {res['machine']['cpu']}, {res['machine']['cores']} cores, torch {res['machine']['torch']}, "
        f"{res['machine']['torch_threads']} torch threads, load average {res['machine']['load_average_1min']:.1f} "
        "(shared machine: ratios are what to read)"
    )

    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    model, tok, folder, source = bp.smollm2(cache)
    pad = tok.pad_token_id if tok is not None else 2
    res["oar_p_model"] = source

    # 1. OAR-P
    if "oar_p" not in skip:
        h = bp.oar_p_headline(
            model,
            pad,
            batch=size["batch"],
            prompt=size["prompt"],
            reasoning=size["reasoning"],
            answer=size["answer"],
            k=size["k"],
            repeats=size["repeats"],
        )
        res["oar_p"] = h
        say(
            f"\n1. OAR-P importance, {source}\n   {h['batch']} rollouts of prompt {h['prompt']} + "
            f"reasoning {h['reasoning']} + answer {h['answer']} tokens, answer_mean probe, "
            f"{h['repeats']} interleaved repeats (median)"
        )
        say(
            f"   naive definition (one full forward per copy; {h['naive_positions_timed_per_row']} positions/row "
            f"timed, x n_R/k)  {h['naive_s_scaled']:8.1f} s"
        )
        say(
            f"   fast exact (default)            {h['fast_s']:8.1f} s   {h['speedup']:5.1f}x faster   "
            f"max err {h['max_err_rel']:.1e} of the largest score   (target >= 4x, <= 1e-4)"
        )
        say(
            f"   span 4 (approximate, not default) {h['span4_s']:6.1f} s   "
            f"{h['span4_speedup_vs_naive']:5.1f}x faster   "
            f"err {h['span4_max_err_rel']:.2f} of the largest exact score"
        )
    if "sweep" not in skip:
        rows = bp.oar_p_sweep(
            model,
            pad,
            prompt=size["prompt"],
            lengths=size["sweep"],
            answer=size["answer"],
            k=size["sweep_k"],
            fast_all_up_to=size["sweep_fast_all"],
        )
        res["oar_p_sweep"] = rows
        say(
            f"   growth with the reasoning length (1 rollout, prompt {size['prompt']} + answer {size['answer']}, "
            f"timed once; naive on {size['sweep_k']} evenly spaced positions x n_R/k, fast on all positions up to "
            f"n_R={size['sweep_fast_all']}, beyond on {size['sweep_k']} in blocks of 4 x n_R/k plus one clean pass):"
            "\n   n_R    naive s    fast s   speedup   fast positions timed   max error (of the largest score)"
        )
        for r in rows:
            say(
                f"   {r['reasoning']:4d} {r['naive_s']:10.1f} {r['fast_s']:9.1f} {r['speedup']:8.1f}x   "
                f"{r['fast_positions_timed']:20d}   {r['max_err_rel']:.1e}"
            )
    del model

    # 2. (+4.) training steps
    methods = ("grpo", "oar-g", "oar-p", "oar-g+all", "oar-p+all")  # +all: --score_all, every rollout scored
    if "steps" not in skip:
        trl = args.trl_python if not args.quick else None
        trl_model = str(ensure_tiny_arith()) if trl else None
        st = bench_steps.train_steps(
            size["ta"],
            methods,
            steps=size["ta_steps"],
            repeats=size["ta_repeats"],
            trl_python=trl,
            trl_model=trl_model,
        )
        res["steps_tiny_arith"] = st
        _print_steps(say, "tiny-arith (train.py defaults" + (f", {size['ta']})" if size["ta"] else ")"), st)
        if trl:
            t = st["details"]["trl"]
            say(
                f"\n4. TRL {t.get('version')} GRPOTrainer vs train.py --method grpo, "
                "same model/prompts/G/max_new_tokens/micro-batches, "
                f"one update per batch, no KL, CPU:\n   TRL {st['median_step_s']['trl']:.2f} s/step (mean completion "
                f"{t['completion_length']:.1f} tokens), ours {st['median_step_s']['grpo']:.2f} s/step "
                f"({st['details']['grpo']['completion_length']:.1f} tokens)"
                f"   throughput ratio {st['median_step_s']['trl'] / st['median_step_s']['grpo']:.2f}x (target >= 1.2x)"
            )
    if "smollm2_steps" not in skip and folder is not None:
        sm = dict(size["sm"], model=str(folder), instruction=SMOLLM2_INSTRUCTION)
        st = bench_steps.train_steps(sm, methods, steps=size["sm_steps"], repeats=size["sm_repeats"])
        res["steps_smollm2"] = st
        _print_steps(
            say,
            f"SmolLM2-135M ({', '.join(f'{k}={v}' for k, v in size['sm'].items())}, arith, "
            "'The answer is' instruction)",
            st,
        )

    # 3. log-prob memory
    if "logprob" not in skip:
        mem = {"equality": bp.logprob_equality()}
        if size["mem_fwd"]:
            mem["forward"] = bp.logprob_memory(*size["mem_fwd"], backward=False)
        mem["forward_backward"] = bp.logprob_memory(*size["mem_bwd"], backward=True)
        res["logprob_memory"] = mem
        say(
            "\n3. Log-probs: peak RSS above the logits, fresh process per variant; "
            "full = log_softmax(logits, dtype=float32)"
        )
        for name, m in (("forward", mem.get("forward")), ("forward_backward", mem["forward_backward"])):
            for dtype in ("float32", "bfloat16") if m else ():
                for key in (f"{dtype}_forward_extra", f"{dtype}_forward_backward_extra"):
                    if key in m and (name == "forward_backward" or "backward" not in key):
                        x = m[key]
                        say(
                            f"   B={m['B']} T={m['T']} V={m['V']} {dtype:8s} {key.split('_', 1)[1]:24s} "
                            f"ours {x['ours_mb']:7.0f} MB   full {x['full_mb']:7.0f} MB   "
                            f"ratio {x['ratio'] or float('nan'):.3f} "
                            f"(target <= 0.5; logits {m[f'{dtype}_logits_mb']:.0f} MB)"
                        )
        say(f"   equal values/gradients (max |diff|): {json.dumps(mem['equality'])}")

    say("\n5. GPU: none on this machine (gpu fields null)")
    res.update(_headline(res))
    res["total_s"] = time.time() - t_start
    say(f"\nheadline: {json.dumps({k: res[k] for k in _headline(res)})}\ntotal {res['total_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


def growth_main(args) -> None:
    """The growth table and decode speed alone (docs/long-reasoning.md), on the CPU or a GPU
    (or re-reported from --from_json)."""
    import torch

    import bench_growth as bg

    say = lambda s: print(s, flush=True)
    if args.from_json:  # no timing: the saved run's table again, with the fidelity file given now
        res = json.loads(Path(args.from_json).read_text())
        return bg.report(res, res["args"]["windows"], args.fast_window, args.fidelity_json, args.json, say)
    if args.threads:
        bp.set_threads(args.threads)
    device = torch.device(args.device)
    res = {"mode": "growth", "machine": bp.machine(), "device": str(device), "args": vars(args)}
    if device.type == "cuda":
        res["machine"].update(device="cuda", gpu=torch.cuda.get_device_name())
    if args.model == "qwen1.5b-random":
        model, pad, source = bg.qwen15b_random(args.device), 151643, "random Qwen2.5-1.5B-shaped Qwen2 (bf16)"
    elif args.model == "smollm2":
        model, tok, _, source = bp.smollm2(Path(args.cache_dir))
        model, pad = model.to(device), (tok.pad_token_id if tok is not None else 2)
    else:
        raise SystemExit(f"--model {args.model}: choose smollm2 or qwen1.5b-random")
    res["model"] = source
    lengths, windows = [int(x) for x in args.lengths.split(",")], [int(x) for x in args.windows.split(",") if x]
    say(
        f"machine: {res['machine']['cpu']} / {res['machine'].get('gpu')}, device {device}, "
        f"torch threads {res['machine']['torch_threads']}, "
        f"load average {res['machine']['load_average_1min']:.1f} (shared machine: read ratios)\nmodel: {source}"
    )
    say(
        f"growth with R (1 rollout, prompt 128 + R + answer 8; sampled scorers on {args.sample_k} positions, "
        "window modes on whole forwards of training's size, x n_R/k + clean pass):"
    )
    res["growth"] = bg.growth(
        model,
        pad,
        bp.synthetic,
        bp.every_kth,
        lengths=lengths,
        prompt=128,
        answer=8,
        windows=windows,
        k=args.sample_k,
        exact_all_up_to=args.exact_all_up_to,
        window_all_up_to=args.window_all_up_to,
        chunk_tokens=None,  # as training sizes both modes' forwards: by the device (lm.positions_that_fit)
        window_chunk_tokens=None,
    )
    if args.decode:
        p, g, lp, t = (int(x) for x in args.decode.split(","))
        res["decode"] = bg.decode_speed(
            model, pad, prompts=p, group_size=g, prompt_len=lp, new_tokens=t, synthetic=bp.synthetic
        )
    bg.report(res, args.windows, args.fast_window, args.fidelity_json, args.json, say)


def rollouts_main(args) -> None:
    """The sampler's loops beside transformers' generate (docs/sampler.md), on the CPU rows or the GPU rows."""
    import torch

    import bench_rollouts as br
    import bench_vllm

    if args.threads:
        bp.set_threads(args.threads)
    say = lambda s: print(s, flush=True)
    res = {"mode": "rollouts", "machine": bp.machine()}
    say(
        f"machine: {res['machine']['cpu']}, torch threads {res['machine']['torch_threads']}, load average "
        f"{res['machine']['load_average_1min']:.1f} (shared machine: read ratios)"
    )
    if args.vllm:
        res["vllm_cpu"] = v = bench_vllm.vllm_cpu_case(
            args.cache_dir, say, prompts=args.vllm_prompts, repeats=args.vllm_repeats
        )
        res.update({f"rollouts_{k}_smollm2_cpu": v[k] for k in ("vllm_vs_own", "vllm_vs_generate", "own_vs_generate")})
    elif args.device == "cuda":
        res["machine"].update(device="cuda", gpu=torch.cuda.get_device_name())
        res["gpu"] = br.gpu_cases(
            args.peak_gbs,
            say,
            batches=tuple(int(b) for b in args.gpu_batches.split(",")),
            new_tokens=args.gpu_new_tokens,
            variants=tuple(args.gpu_variants.split(",")) if args.gpu_variants else br.VARIANTS,
        )
    else:
        res["cpu"] = cpu = br.cpu_cases(args.cache_dir, say)
        res.update({k: v for k, v in cpu.items() if k.startswith("rollouts_")})
        say("\nheadline: " + json.dumps({k: round(v, 3) for k, v in res.items() if k.startswith("rollouts_")}))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


def _print_steps(say, title, st):
    say(
        f"\n2. Training step (rollout + reward + scores + update), {title}\n   {st['repeats']} interleaved runs x "
        f"{st['steps_per_run'] - 1} timed steps (first dropped), median s/step:"
    )
    say("   " + "   ".join(f"{m} {s:.2f}" for m, s in st["median_step_s"].items() if m != "trl"))
    r, d = st["ratio_vs_grpo"], st["details"]
    c = st["cpu_ratio_vs_grpo"]
    say(
        "   CPU seconds over GRPO's on the same steps, median over the rounds (steadier): "
        + "   ".join(f"{m} {x:.2f}" for m, x in c.items())
    )
    say(
        f"   wall: OAR-G/GRPO {r['oar-g']:.2f} (target <= 1.15)   OAR-P/GRPO {r['oar-p']:.2f} (target <= 3)   "
        f"rollouts scored {d['oar-g']['frac_scored']:.2f} (not scored: advantage 0 or no answer); "
        f"without an answer {d['oar-g']['frac_no_answer']:.2f}"
    )
    if "oar-g+all" in r:
        say(
            f"   every rollout scored (--score_all): OAR-G/GRPO {r['oar-g+all']:.2f}   "
            f"OAR-P/GRPO {r['oar-p+all']:.2f}   rollouts scored {d['oar-g+all']['frac_scored']:.2f}"
        )
    say(
        "   OAR s/rollout of the step: "
        + ", ".join(f"{m} {d[m]['oar_s_per_rollout']:.4f}" for m in d if m.startswith("oar"))
    )
    if not st["same_rollouts"]:
        say(
            f"   WARNING: {', '.join(st['rollouts_differ'])} sampled other rollouts than grpo: "
            "these ratios compare different work"
        )


def _headline(res) -> dict:
    get = lambda *path: _dig(res, path)
    mem = res.get("logprob_memory", {})
    ratios = [
        x["ratio"]
        for part in ("forward", "forward_backward")
        for k, x in mem.get(part, {}).items()
        if isinstance(x, dict) and x.get("ratio")
    ]
    st = res.get("steps_tiny_arith", {})
    return {
        "oar_p_speedup_vs_naive": get("oar_p", "speedup"),
        "oar_p_max_err_vs_naive": get("oar_p", "max_err_rel"),
        "step_ratio_oar_g": get("steps_tiny_arith", "ratio_vs_grpo", "oar-g"),
        "step_ratio_oar_p": get("steps_tiny_arith", "ratio_vs_grpo", "oar-p"),
        "step_ratio_oar_g_score_all": get("steps_tiny_arith", "ratio_vs_grpo", "oar-g+all"),
        "step_ratio_oar_p_score_all": get("steps_tiny_arith", "ratio_vs_grpo", "oar-p+all"),
        "step_ratio_oar_g_smollm2": get("steps_smollm2", "ratio_vs_grpo", "oar-g"),
        "step_ratio_oar_p_smollm2": get("steps_smollm2", "ratio_vs_grpo", "oar-p"),
        "step_ratio_oar_g_smollm2_score_all": get("steps_smollm2", "ratio_vs_grpo", "oar-g+all"),
        **{
            f"step_cpu_ratio_{m.replace('-', '_').replace('+all', '_score_all')}": get(
                "steps_tiny_arith", "cpu_ratio_vs_grpo", m
            )
            for m in ("oar-g", "oar-p", "oar-g+all", "oar-p+all")
        },
        "step_ratio_oar_p_smollm2_score_all": get("steps_smollm2", "ratio_vs_grpo", "oar-p+all"),
        "logprob_peak_mem_ratio": max(ratios) if ratios else None,
        "trl_throughput_ratio": st["median_step_s"]["trl"] / st["median_step_s"]["grpo"]
        if "trl" in st.get("median_step_s", {})
        else None,
        "gpu_oar_p_speedup_vs_naive": None,
        "gpu_step_ratio_oar_g": None,
        "gpu_step_ratio_oar_p": None,
    }


def _dig(d, path):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


if __name__ == "__main__":
    main()
