"""The one script a GPU machine runs (docs/gpu.md, "The GPU check"): what the CPU cannot tell, in phases by
priority, each skipped when it would not fit in the time left, the JSON rewritten after every phase.

    python scripts/bench/gpu_check.py --json gpu-check.json                      # one GPU, <= 7 minutes
    python scripts/bench/gpu_check.py --device cpu --tiny --json /tmp/check.json  # the suite's run (seconds)

  0 ceilings       the device, its memory, its copy bandwidth and bf16 matmul rate
  1 steps          one train.py step (after a first one) of GRPO, OAR-G (answer_joint, answer_mean) and OAR-P
                   (--perturb_mode auto) at Qwen2.5-Math-1.5B's shapes, --gradient_checkpointing off and on:
                   seconds, ratio to GRPO's, peak memory, the share of rollouts scored
  2 oar_p_budgets  OAR-P (exact, window) on one micro-batch at the fixed budget of before (8,192 and 2,048
                   positions a forward), at the device's (what training uses) and larger ones: seconds, peak
                   memory, the scores' largest difference from the fixed budget's
  3 sampler        oar's eager loop against transformers' `generate`: tokens/s, the fraction of the HBM
                   bandwidth bound; and under bf16 autocast with float32 weights, the loop casting its linear
                   weights once (as it does) against once a step (as before): the per-token cast's cost
  4 lora_7b        one train.py step with LoRA on a Qwen2.5-7B-shaped model in bf16: seconds and peak
  5 precision      OAR-G and OAR-P scores under bf16 autocast against float32 on the same rollouts

What is timed is train.py's own code: phases 1 and 4 run `train.main` with its settings parsed from flags, in
this process, with three things replaced (and only these): the weights are random, built on the device from
the model folder's config (Qwen2.5-Math-1.5B's and Qwen2.5-7B's shapes; no hub, no 3 to 15 GB written and
read), and each step's end (`Run.end_step`: evaluation, log line, checkpoint) and the run's (`finish`: final
evaluation, final/) record the step's metrics instead of writing files. The tokenizer is made here: 151,936
words, one in eight decoding to `####`, the others to a digit, so that a random model's completions hold a
final answer (`#### 7`) and OAR has reasoning tokens to score; --score_all scores every rollout (a random
model's rewards tie). Prompts: arith problems behind a filler of about 120 words (GSM8K's length).

Timings are wall seconds after a warm-up (phase 1: a run's second step; the first is reported apart). Peak
memory: torch.cuda.max_memory_allocated on a GPU; on the CPU the process's peak resident set above its start
(VmHWM, reset through /proc/self/clear_refs). Each phase's estimate (ESTIMATE_S, a guess for one H200, and a
small one for --tiny) decides whether it starts; phase 1 also stops between runs when the next would not fit.
A phase that fails records its error and the next one runs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Qwen2.5-Math-1.5B's config.json (the README's 1.5B command), its special tokens those of the tokenizer made here
QWEN_MATH_15B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
QWEN_7B = dict(  # Qwen2.5-7B's (docs/lora.md's memory arithmetic)
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
PAD, EOS, UNK = 0, 1, 2
MARKER_EVERY = 8  # one word in 8 decodes to "####"

# What each phase runs: on a GPU (the README's model shapes, batches cut to fit the budget) and with --tiny
SIZES = {
    "gpu": dict(
        model=QWEN_MATH_15B,
        big=QWEN_7B,
        steps=dict(prompts_per_step=2, group_size=8, micro_batch_size=8, max_new_tokens=256),
        lora=dict(prompts_per_step=1, group_size=8, micro_batch_size=8, max_new_tokens=128, lora_r=16),
        oar_p=dict(batch=8, prompt=128, reasoning=256, answer=8),
        sampler=dict(prompts=8, group_size=8, prompt=128, new_tokens=128, repeats=2),
        precision=dict(batch=4, prompt=64, reasoning=128, answer=4),
        copy_bytes=2**30,
        matmul=8192,
        budgets=(32768, 131072),
    ),
    "tiny": dict(
        model=TINY,
        big=dict(TINY, hidden_size=64, num_attention_heads=8, tie_word_embeddings=False),
        steps=dict(prompts_per_step=2, group_size=4, micro_batch_size=4, max_new_tokens=12),
        lora=dict(prompts_per_step=1, group_size=4, micro_batch_size=4, max_new_tokens=8, lora_r=4),
        oar_p=dict(batch=2, prompt=8, reasoning=12, answer=2),
        sampler=dict(prompts=2, group_size=2, prompt=8, new_tokens=8, repeats=1),
        precision=dict(batch=2, prompt=8, reasoning=12, answer=2),
        copy_bytes=2**22,
        matmul=128,
        budgets=(64, 256),
    ),
}
# Seconds a phase is expected to take (the start decides on it): guesses for one H200, and for --tiny on 2 cores
ESTIMATE_S = {
    "gpu": {"ceilings": 15, "steps": 200, "oar_p_budgets": 60, "sampler": 60, "lora_7b": 80, "precision": 30},
    "tiny": {"ceilings": 1, "steps": 30, "oar_p_budgets": 3, "sampler": 5, "lora_7b": 10, "precision": 3},
}
STEP_RUNS = (  # phase 1: (name, flags); each with --gradient_checkpointing off, then on
    ("grpo", ["--method", "grpo"]),
    ("oar-g/answer_joint", ["--method", "oar-g", "--probe", "answer_joint"]),
    ("oar-g/answer_mean", ["--method", "oar-g", "--probe", "answer_mean"]),
    ("oar-p/auto", ["--method", "oar-p", "--perturb_mode", "auto"]),
)
BEFORE_BUDGETS = {"exact": 8192, "window": 2048}  # OAR-P's fixed budgets before it was sized by the device (c0ec13d)
PEAK_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}  # nominal HBM bandwidth by device name


# -- the model folder: a config and a tokenizer, no weights --------------------------------------------------------


def tokenizer_for(vocab: int):
    """A word-level tokenizer of `vocab` words: 0 <pad>, 1 <eos>, 2 <unk>; word i >= 3 decodes to " ####" when
    i % MARKER_EVERY == 0, else to " <i % 10>" (each word is unique by a suffix the decoder drops)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD, "<eos>": EOS, "<unk>": UNK}
    for i in range(3, vocab):
        words[f"\u2581{'####' if i % MARKER_EVERY == 0 else i % 10}~{i}"] = i
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Sequence([decoders.Replace(Regex("~[0-9]+"), ""), decoders.Replace("\u2581", " ")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def model_folder(folder: Path, shape: dict) -> Path:
    """config.json (a Qwen2 of `shape`) and the tokenizer in `folder`; data.jsonl of arith problems beside them,
    each behind a filler of about 120 words."""
    from transformers import Qwen2Config

    from oar.tasks.arith import arith_problems

    folder.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(**shape, pad_token_id=PAD, bos_token_id=None, eos_token_id=EOS, attn_implementation="sdpa")
    config.save_pretrained(folder)
    tokenizer_for(shape["vocab_size"]).save_pretrained(folder)
    filler = " ".join(["Read the problem carefully, think step by step and write the final answer."] * 9)
    with open(folder / "data.jsonl", "w") as f:
        for p in arith_problems(64, split="train", seed=0):
            f.write(json.dumps({"problem": f"{filler} {p.problem}", "answer": p.answer}) + "\n")
    return folder


def random_weights(device: str):
    """A stand-in for AutoModelForCausalLM.from_pretrained: the folder's config with random weights (seed 0),
    built on `device` in the dtype asked for (every run of a phase starts from the same weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    build = AutoModelForCausalLM.from_config

    def from_pretrained(source, *args, dtype=None, **kwargs):
        config = AutoConfig.from_pretrained(source)
        torch.manual_seed(0)
        with torch.device(device):
            return build(config, dtype=dtype or torch.float32)

    return from_pretrained


# -- memory and time -----------------------------------------------------------------------------------------------


def _rss(field: str) -> int:
    return next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith(field + ":"))


@contextlib.contextmanager
def peak_memory(device: str, out: dict):
    """out['peak_bytes']: the block's peak (the allocator's on a GPU, resident set above the start on a CPU)."""
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _rss("VmRSS")
    try:
        yield
    finally:
        if device == "cuda":
            torch.cuda.synchronize()
            out["peak_bytes"] = torch.cuda.max_memory_allocated()
            out["allocated_before_bytes"] = base
        else:
            out["peak_bytes"] = _rss("VmHWM") - base
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def _sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int = 1) -> tuple[float, object]:
    """(median seconds over `repeats` calls after one warm-up call, the last result)."""
    fn()
    seconds, out = [], None
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds), out


# -- the phases ----------------------------------------------------------------------------------------------------


def ceilings(ctx) -> dict:
    import torch
    import transformers

    dev, size = ctx.device, ctx.size
    res = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if dev == "cuda":
        p = torch.cuda.get_device_properties(0)
        res |= {"name": p.name, "memory_bytes": p.total_memory, "capability": f"{p.major}.{p.minor}"}
    else:
        res |= {"name": platform.processor() or "cpu", "cores": os.cpu_count(), "threads": torch.get_num_threads()}
    n = size["copy_bytes"]
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    s, _ = timed(lambda: b.copy_(a), dev, repeats=5)
    res["copy_gbs"] = 2 * n / s / 1e9  # read + write
    m = size["matmul"]
    x = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    s, _ = timed(lambda: x @ x, dev, repeats=5)
    res["bf16_matmul_tflops"] = 2 * m**3 / s / 1e12
    return res


def _train_run(ctx, folder: Path, flags: list[str], out_dir: Path) -> dict:
    """train.main on `flags` (parsed as train.py parses them), random weights, no files written but config.json
    and metrics.jsonl's start: each step's metrics and the run's peak memory."""
    from accelerate.state import AcceleratorState, GradientState

    import train
    from oar.training import rollout_backend
    from oar.training import run as run_module
    from oar.training.config import parse_args
    from oar.training.launch import end

    steps = []

    def end_step(self, step, metrics, rollouts):  # instead of evaluating, logging and checkpointing
        steps.append(metrics)

    def finish(run):  # instead of the final evaluation and final/
        rollout_backend.close(run.sampler)
        end(run.accelerator)
        return {}

    import transformers

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    args = ["--model", str(folder), "--dataset", str(folder / "data.jsonl"), "--output_dir", str(out_dir)]
    args += ["--steps", "2", "--score_all", "--learning_rate", "1e-7", "--instruction", "", *flags]
    cfg = parse_args(args)
    res = {"flags": flags}
    t0 = time.perf_counter()
    with (
        mock.patch.object(transformers.AutoModelForCausalLM, "from_pretrained", random_weights(ctx.device)),
        mock.patch.object(run_module.Run, "end_step", end_step),
        mock.patch.object(train, "finish", finish),
        peak_memory(ctx.device, res),
    ):
        train.main(cfg)
    res["wall_s"] = time.perf_counter() - t0
    keep = ("time/step_s", "time/rollout_s", "oar/seconds_per_rollout", "oar/frac_scored", "oar/frac_no_answer")
    res["steps"] = [{k: m.get(k) for k in keep} | {"completion/length": m.get("completion/length")} for m in steps]
    last = res["steps"][-1]
    res["step_s"], res["rollout_s"] = last["time/step_s"], last["time/rollout_s"]
    res["update_and_credit_s"] = last["time/step_s"] - last["time/rollout_s"]
    return res


def steps_phase(ctx) -> dict:
    size, res = ctx.size, {"shape": "Qwen2.5-Math-1.5B" if not ctx.tiny else "tiny", "runs": {}}
    folder = model_folder(ctx.work / "model-1.5b", size["model"])
    base = [f"--{k}={v}" for k, v in size["steps"].items()]
    res["settings"] = dict(size["steps"], steps=2, score_all=True)
    slowest = 0.0
    for checkpointing in (False, True):
        for name, flags in STEP_RUNS:
            key = f"{name}{'/checkpointing' if checkpointing else ''}"
            if ctx.left() < slowest * 1.2:
                res["runs"][key] = {"skipped": f"{ctx.left():.0f} s left, a run took {slowest:.0f} s"}
                continue
            t0 = time.perf_counter()
            extra = ["--gradient_checkpointing"] if checkpointing else []
            res["runs"][key] = _train_run(ctx, folder, base + flags + extra, ctx.work / key.replace("/", "-"))
            slowest = max(slowest, time.perf_counter() - t0)
            ctx.write()
        grpo = res["runs"].get(f"grpo{'/checkpointing' if checkpointing else ''}", {})
        for name, _ in STEP_RUNS:
            r = res["runs"].get(f"{name}{'/checkpointing' if checkpointing else ''}", {})
            if "step_s" in r and "step_s" in grpo:
                r["ratio_to_grpo"] = r["step_s"] / grpo["step_s"]
                r["update_and_credit_ratio_to_grpo"] = r["update_and_credit_s"] / grpo["update_and_credit_s"]
    return res


def _model(ctx, shape: dict, dtype):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**shape, pad_token_id=PAD, eos_token_id=EOS, attn_implementation="sdpa")
    with torch.device(ctx.device):
        return Qwen2ForCausalLM(config).to(dtype).eval()


def _rollouts(ctx, batch, prompt, reasoning, answer, vocab):
    import bench_parts as bp

    ids, attn, reas, ans = bp.synthetic(batch, prompt, reasoning, answer, vocab=(3, vocab), eos=EOS)
    return [t.to(ctx.device) for t in (ids, attn, reas, ans)]


def oar_p_budgets(ctx) -> dict:
    """Each OAR-P mode on one micro-batch at the fixed budget it had before it was sized by the device (exact 8,192
    positions a forward, window 2,048: BEFORE_BUDGETS), at the device's (None, what training uses: the values
    `lm.positions_that_fit` chose are recorded) and at the sizes' larger ones; the scores of each against the
    fixed budget's. Today's code throughout: the budget alone changes (not the host reads the code before made)."""
    import torch

    from oar import oar_perturb_exact, oar_perturb_window
    from oar.oar_perturb import perturbation_scores

    size = ctx.size
    extra = ctx.budgets or size["budgets"]
    model = _model(ctx, size["model"], torch.bfloat16)
    ids, attn, reas, ans = _rollouts(ctx, **size["oar_p"], vocab=size["model"]["vocab_size"])
    res = {"rollouts": size["oar_p"], "dtype": "bfloat16", "probe": "answer_mean", "modes": {}}
    for mode, before in BEFORE_BUDGETS.items():
        budgets = [before, None, *sorted(set(extra) - {before})]
        out = res["modes"][mode] = {"before": before, "budgets": {}}
        scores = {}
        for budget in budgets:
            chosen, fit = [], oar_perturb_exact.positions_that_fit

            def spy(*args, **kwargs):
                chosen.append(fit(*args, **kwargs))
                return chosen[-1]

            r = {}
            with (
                mock.patch.object(oar_perturb_exact, "positions_that_fit", spy),
                mock.patch.object(oar_perturb_window, "positions_that_fit", spy),
                peak_memory(ctx.device, r),
                torch.no_grad(),
            ):
                s, scores[budget] = timed(
                    lambda: perturbation_scores(
                        model,
                        ids,
                        attn,
                        reas,
                        ans,
                        probe="answer_mean",
                        pad_token_id=PAD,
                        max_chunk_tokens=budget,
                        mode=mode,
                    ),
                    ctx.device,
                )
            r["seconds"] = s
            if budget is None:
                r["device_chose"] = sorted(set(chosen))
            out["budgets"][str(budget or "device")] = r
            ctx.write()
        ref = scores[before].float()
        top = float(ref[reas].abs().max()) or 1.0
        for budget in budgets:
            diff = float((scores[budget].float() - ref)[reas].abs().max())
            r = out["budgets"][str(budget or "device")]
            r |= {"max_abs_diff_to_before": diff, "max_diff_of_largest_score": diff / top}
            r["seconds_ratio_to_before"] = r["seconds"] / out["budgets"][str(before)]["seconds"]
    return res


def sampler_phase(ctx) -> dict:
    """The eager loop against `generate` in bf16 weights (tokens/s, fraction of the bandwidth bound); then float32
    master weights under bf16 autocast (train.py under --mixed_precision bf16): the eager loop as it runs (the
    linear weights cast once per call, `lm.linear_weights_in`) against the same loop with that cast made at every
    step (linear_weights_in a no-op: the loop of c0ec13d, docs/sampler.md), whose difference is the per-token cast."""
    import torch

    import bench_rollouts as br
    from oar import decode_loops

    size, sz = ctx.size, ctx.size["sampler"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, size["model"]["vocab_size"], (sz["prompts"], sz["prompt"]), generator=g).to(ctx.device)
    speeds = lambda model, variants: br.rollout_speeds(  # noqa: E731
        model,
        ids,
        torch.ones_like(ids),
        group_size=sz["group_size"],
        new_tokens=sz["new_tokens"],
        pad=PAD,
        repeats=sz["repeats"],
        variants=variants,
    )
    peak = next((v for k, v in PEAK_GBS.items() if k in ctx.results.get("ceilings", {}).get("name", "")), None)
    peak = peak or ctx.results.get("ceilings", {}).get("copy_gbs")  # no nominal figure: the measured copy rate
    rollouts = sz["prompts"] * sz["group_size"]
    model = _model(ctx, size["model"], torch.bfloat16)
    r = speeds(model, ("eager", "hf_generate"))
    for x in r["variants"].values():
        x["bandwidth_fraction"] = br.bandwidth_fraction(
            model,
            rollouts=rollouts,
            prompt=sz["prompt"],
            new_tokens=sz["new_tokens"],
            step_s=x["median_s"] / sz["new_tokens"],
            peak_gbs=peak,
        )
    r |= {
        "peak_gbs_used": peak,
        "eager_over_generate_tokens_per_s": r["variants"]["eager"]["tokens_per_s"]
        / r["variants"]["hf_generate"]["tokens_per_s"],
    }
    del model
    gc.collect()
    model = _model(ctx, size["model"], torch.float32)
    with torch.autocast(ctx.device, dtype=torch.bfloat16):
        once = speeds(model, ("eager",))["variants"]["eager"]
        with mock.patch.object(decode_loops, "linear_weights_in", lambda model, dtype: contextlib.nullcontext()):
            every = speeds(model, ("eager",))["variants"]["eager"]
    cast_s = (every["median_s"] - once["median_s"]) / sz["new_tokens"]
    r["autocast_float32_weights"] = {
        "cast_once": once,
        "cast_every_step": every,
        "cast_s_per_token": cast_s,
        "cast_share_of_a_step_cast_every_step": cast_s / (every["median_s"] / sz["new_tokens"]),
        "speedup_of_casting_once": every["median_s"] / once["median_s"],
    }
    return r


def lora_phase(ctx) -> dict:
    size = ctx.size
    folder = model_folder(ctx.work / "model-7b", size["big"])
    flags = [f"--{k}={v}" for k, v in size["lora"].items()] + ["--method", "grpo", "--dtype", "bfloat16"]
    res = _train_run(ctx, folder, flags, ctx.work / "lora-7b")
    res["shape"] = "Qwen2.5-7B" if not ctx.tiny else "tiny"
    return res


def precision_phase(ctx) -> dict:
    import torch

    from oar.gating import bilevel_weights
    from oar.oar_grad import gradient_scores
    from oar.oar_perturb import perturbation_scores

    size = ctx.size
    model = _model(ctx, size["model"], torch.float32)
    ids, attn, reas, ans = _rollouts(ctx, **size["precision"], vocab=size["model"]["vocab_size"])
    ways = {
        "oar-p/answer_mean": lambda: perturbation_scores(
            model, ids, attn, reas, ans, probe="answer_mean", pad_token_id=PAD
        ),
        "oar-g/answer_joint": lambda: gradient_scores(
            model, ids, attn, reas, ans, probe="answer_joint", noise_std=1e-3, seeds=list(range(len(ids)))
        ),
        "oar-g/answer_mean": lambda: gradient_scores(
            model, ids, attn, reas, ans, probe="answer_mean", noise_std=1e-3, seeds=list(range(len(ids)))
        ),
    }
    res = {"rollouts": size["precision"], "against": "float32 weights, no autocast", "methods": {}}
    import warnings

    for name, fn in ways.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # OAR-G's half-precision warning: what this phase measures
            fp32 = fn().float()
            with torch.autocast(ctx.device, dtype=torch.bfloat16):
                bf16 = fn().float()
        w32 = bilevel_weights(fp32, reas, quantile=0.4, boost=2.0)
        w16 = bilevel_weights(bf16, reas, quantile=0.4, boost=2.0)
        res["methods"][name] = {
            "spearman": _spearman(fp32[reas], bf16[reas]),
            "max_err_of_largest_score": float(
                (bf16 - fp32)[reas].abs().max() / fp32[reas].abs().max().clamp(min=1e-30)
            ),
            "weights_mae": float((w16 - w32)[reas].abs().mean()),
        }
    return res


def _spearman(a, b) -> float:
    import torch

    ra, rb = (x.argsort().argsort().double() for x in (a.cpu(), b.cpu()))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / torch.sqrt((ra * ra).sum() * (rb * rb).sum()).clamp(min=1e-30))


PHASES = (
    ("ceilings", ceilings),
    ("steps", steps_phase),
    ("oar_p_budgets", oar_p_budgets),
    ("sampler", sampler_phase),
    ("lora_7b", lora_phase),
    ("precision", precision_phase),
)


class Context:
    def __init__(self, args):
        self.device, self.tiny, self.start = args.device, args.tiny, time.perf_counter()
        self.size = SIZES["tiny" if args.tiny else "gpu"]
        self.estimate = ESTIMATE_S["tiny" if args.tiny else "gpu"]
        self.budget_s, self.json = args.budget_s, args.json
        self.budgets = tuple(int(b) for b in args.oar_p_budgets.split(",") if b)
        self.results = {}
        self.report = {
            "what": "scripts/bench/gpu_check.py: the phases a GPU machine runs (docs/gpu.md)",
            "argv": sys.argv[1:],
            "budget_s": args.budget_s,
            "phases": self.results,
        }
        self.work = Path(tempfile.mkdtemp(prefix="oar-gpu-check-"))

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def write(self):
        self.report["elapsed_s"] = time.perf_counter() - self.start
        if self.json:
            tmp = Path(self.json).with_suffix(".tmp")
            tmp.write_text(json.dumps(self.report, indent=1, default=str) + "\n")
            tmp.replace(self.json)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and batches: the suite's CPU run")
    ap.add_argument("--json", required=True, help="rewritten after every phase")
    ap.add_argument("--budget_s", type=float, default=420.0, help="seconds for every phase together (7 minutes)")
    ap.add_argument("--phases", default=",".join(name for name, _ in PHASES), help="comma-separated, in this order")
    ap.add_argument(
        "--oar_p_budgets", default="", help="phase 2's budgets besides the fixed and the device's ('': the sizes')"
    )
    args = ap.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py: --device cuda but no CUDA device; use --device cpu --tiny.")
    if args.device == "cuda":
        os.environ.setdefault("ACCELERATE_MIXED_PRECISION", "bf16")  # the README's --mixed_precision bf16
    ctx = Context(args)
    wanted = set(args.phases.split(","))
    say = lambda s: print(s, flush=True)  # noqa: E731
    for name, phase in PHASES:
        if name not in wanted:
            continue
        if ctx.left() < ctx.estimate[name]:
            ctx.results[name] = {"skipped": f"{ctx.left():.0f} s left, the phase needs about {ctx.estimate[name]} s"}
            say(f"{name}: skipped ({ctx.results[name]['skipped']})")
            ctx.write()
            continue
        t0 = time.perf_counter()
        try:
            ctx.results[name] = phase(ctx)
        except Exception as err:  # noqa: BLE001 (a phase's failure is its result; the next phase runs)
            ctx.results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
        ctx.results[name]["phase_s"] = time.perf_counter() - t0
        say(
            f"{name}: {ctx.results[name]['phase_s']:.1f} s"
            + (" ERROR " + ctx.results[name]["error"] if "error" in ctx.results[name] else "")
        )
        ctx.write()
    return ctx.report


if __name__ == "__main__":
    main()
