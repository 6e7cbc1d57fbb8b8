"""What the vLLM engine is given on each platform: the rules, as one pure function (docs/vllm.md).

`engine_args(platform, ...)` turns the trainer's settings into `vllm.LLM`'s: dtype, length, chunked
prefill, sleep mode, compilation, KV cache. It reads nothing from the process (the platform is an
argument: oar.vllm_rollouts.platform() reads vLLM's, tests pass a CPU or a CUDA one), so every rule is
tested on a CPU, the GPU's included, though no GPU has run them. `overrides(environ)` reads the two
environment variables a user may set instead of a flag (train.py's flags are a fixed budget):

  OAR_VLLM_DTYPE=<float32|bfloat16|float16>  the engine's dtype, in place of the derived one
  OAR_VLLM_PROMPT_TOKENS=<tokens>            the prompt width the engine is started for (PROMPT_TOKENS)

Why a prompt width at all: vLLM fixes a request's most tokens (max_model_len) when the engine starts,
before any prompt is seen; left to the model's own limit (131,072 tokens for some Qwen2.5 configs) the
engine must be able to hold one such request in its KV cache, which a 7B model's share of a GPU cannot.
train.py asks for PROMPT_TOKENS + --max_new_tokens, capped at the model's limit; a longer prompt stops
the run with a message naming OAR_VLLM_PROMPT_TOKENS (oar/vllm_rollouts.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ENGINE_DTYPES = ("float32", "bfloat16", "float16")  # what vLLM computes in (it has no float64 kernels)
# The prompt tokens an engine is started for. The longest prompts measured (SmolLM2's tokenizer, its chat template,
# the \boxed{} instruction; shared/data's files): GSM8K 271, MATH-500 961, OlympiadBench 1,349, MATH's 12k 2,087.
# 4096 holds each with room for a longer instruction; its cost on a GPU is the KV cache of one full request
# (Qwen2.5-7B in bfloat16: 56 KiB a token, 0.29 GB at 4096 + 1024 tokens).
PROMPT_TOKENS = 4096


@dataclass(frozen=True)
class Platform:
    """What the engine's settings depend on: vLLM's current platform (oar.vllm_rollouts.platform())."""

    name: str  # vLLM's device type: cpu, cuda, rocm, xpu, ...
    cpu: bool
    sleep_mode: bool  # vLLM can give the engine's device memory back and map it again (CUDA, ROCm, XPU)


def engine_args(
    p: Platform,
    *,
    dtype: str,
    engine_dtype: str | None = None,
    max_model_length: int = 0,
    model_limit: int = 0,
    kv_cache_gib: float = 0.0,
    gpu_memory_utilization: float = 0.3,
    enforce_eager: bool | None = None,
    training: bool = True,
    environ: Mapping[str, str] = os.environ,
) -> dict:
    """The settings `vllm.LLM` is given on platform `p`, decided here and nowhere else:

    dtype           `engine_dtype` if given; on a CPU the trainer's weights' `dtype` (float64 as float32), so
                    its log-probs are the trainer's to 1e-4; elsewhere bfloat16 (float16 for float16 weights),
                    not the float32 master weights: those would take 4 bytes a parameter of the engine's
                    memory share (a 7B model's 30 GB, against 0.3 x 80 GB)
    max_model_len   `max_model_length` (prompt + completion tokens a request may hold) capped at the model's
                    own `model_limit` (vLLM refuses more); 0: the model's own
    chunked prefill off on a CPU (vLLM 0.32's CPU build crashes a seeded request whose prefill is split
                    across scheduler steps); elsewhere vLLM's default (on)
    sleep mode      for a `training` engine where the platform has it: it sleeps through each update
    enforce_eager   `enforce_eager` if given; else eager on a CPU (compiling there takes minutes and was not
                    measured), CUDA graphs elsewhere
    KV cache        `kv_cache_gib` if given; else 1 GiB on a CPU unless `environ` has VLLM_CPU_KVCACHE_SPACE
                    (vLLM reads it), and on a GPU what `gpu_memory_utilization` leaves after the weights"""
    chosen = engine_dtype or (
        ("float32" if dtype == "float64" else dtype) if p.cpu else ("float16" if dtype == "float16" else "bfloat16")
    )
    assert chosen in ENGINE_DTYPES, chosen
    length = min(max_model_length, model_limit) if max_model_length and model_limit else max_model_length
    gib = kv_cache_gib or (1.0 if p.cpu and not environ.get("VLLM_CPU_KVCACHE_SPACE") else 0.0)
    return {
        "dtype": chosen,
        "max_model_len": length or None,
        "enable_sleep_mode": training and p.sleep_mode,
        "enforce_eager": p.cpu if enforce_eager is None else enforce_eager,
        "gpu_memory_utilization": gpu_memory_utilization,
        "kv_cache_memory_bytes": int(gib * 2**30) or None,
        **({"enable_chunked_prefill": False} if p.cpu else {}),
    }


def overrides(environ: Mapping[str, str] = os.environ) -> dict:
    """The engine's settings a user set in the environment (module docstring), checked: a bad value raises a
    ValueError naming the variable and what it takes. Returns engine_dtype (None: derived) and prompt_tokens."""
    dtype = environ.get("OAR_VLLM_DTYPE") or None
    if dtype is not None and dtype not in ENGINE_DTYPES:
        raise ValueError(f"OAR_VLLM_DTYPE={dtype}: the vLLM engine's dtype, one of {', '.join(ENGINE_DTYPES)}.")
    text = environ.get("OAR_VLLM_PROMPT_TOKENS") or str(PROMPT_TOKENS)
    if not (text.isdigit() and int(text) >= 1):
        raise ValueError(
            f"OAR_VLLM_PROMPT_TOKENS={text}: the prompt tokens the vLLM engine is started for, a whole number >= 1."
        )
    return {"engine_dtype": dtype, "prompt_tokens": int(text)}
