"""Which sampler train.py and eval.py draw rollouts with (--rollout_backend), what the vLLM engine is
given, and how it follows the policy's weights.

  own   oar.sampler.sample, the project's seeded loop (the default; unchanged)
  vllm  oar.vllm_rollouts.VLLMRollouts, an in-process engine per process (docs/vllm.md)

Both are called as `sample` is. `engine_settings(cfg)` is what a run asks of the engine (the trainer's
dtype, a request's most tokens, the GPU share; the platform's rules are oar/vllm_settings.py's).
`rest(sampler)` after a step's rollouts lets the engine sleep through the update where it has sleep
mode (a GPU). `follow(sampler, policy, peft_model)` after every RL step sends the vLLM engine the
policy's weights in the engine's dtype: every process gathers the full tensors of a model sharded by
FSDP2 (its own engine needs all of them), one at a time as the engine loads them, each cast before it
is gathered; LoRA's adapters are merged into the base weights (the engine serves a plain model), and
the engine resets its prefix cache. For the own sampler all three do nothing.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from oar import vllm_rollouts, vllm_settings
from oar.sampler import sample
from oar.training import lora, sharding
from oar.training.models import load_model, resolve_model

BACKENDS = ("own", "vllm")


def check(backend: str, model: str, *, top_p: float, training: bool = True) -> None:
    """Before anything loads: the backend exists and (vllm) can serve `model` with these settings, for
    training or (`training` False, eval.py) for evaluation alone, and the engine's environment variables
    (oar/vllm_settings.py overrides) are valid."""
    if backend not in BACKENDS:
        raise ValueError(f"--rollout_backend {backend}: one of {', '.join(BACKENDS)}.")
    if backend == "vllm":
        vllm_settings.overrides()
        source, kwargs = resolve_model(model)
        vllm_rollouts.check(source, top_p=top_p, gguf_file=kwargs.get("gguf_file"), training=training)


def engine_settings(cfg) -> dict:
    """VLLMRollouts' settings from a run's config (train.py's or eval.py's) and the environment: the
    trainer's weights' dtype (the engine's own is derived from it on the platform, unless OAR_VLLM_DTYPE
    names one), a request's most tokens (the prompt width the engine is started for, PROMPT_TOKENS or
    OAR_VLLM_PROMPT_TOKENS, + --max_new_tokens; capped at the model's limit) and the GPU memory share.
    The rest are the platform's (oar/vllm_settings.py engine_args). Nothing for the own sampler."""
    if cfg.rollout_backend != "vllm":
        return {}
    env = vllm_settings.overrides()
    return {
        "dtype": cfg.dtype,
        "engine_dtype": env["engine_dtype"],
        "max_model_length": env["prompt_tokens"] + cfg.max_new_tokens,
        "gpu_memory_utilization": cfg.vllm_gpu_memory_utilization,
    }


def make(backend: str, model: str, *, accelerator, folder: str | Path, **settings):
    """The sampler for `backend`: `sample` itself, or a vLLM engine on `model` (a folder or hub id; a
    .gguf is converted once into `folder`/vllm-model by the main process), whose one-line summary of what
    it was given the main process prints. `settings`: VLLMRollouts'."""
    if backend == "own":
        return sample
    source, kwargs = resolve_model(model)
    if "gguf_file" in kwargs:
        target = Path(folder) / "vllm-model"
        if accelerator.is_main_process:
            convert_gguf(model, target)
        accelerator.wait_for_everyone()
        source = str(target)
    engine = vllm_rollouts.VLLMRollouts(source, distributed=accelerator.num_processes > 1, **settings)
    if accelerator.is_main_process:
        print(engine.summary, flush=True)
    return engine


def convert_gguf(model_name: str, folder: Path) -> str:
    """A .gguf model as a plain folder vLLM reads: loaded through the project's loader (dequantized,
    oar/training/models.py load_model) and saved with save_pretrained into `folder`. A folder made from
    the same file (its path, size and modification time, kept in SOURCE) is reused; one made from another
    .gguf (a new run in an old --output_dir) is made again, not served as the wrong weights."""
    source = gguf_identity(model_name)
    marker = folder / SOURCE
    if not ((folder / "config.json").is_file() and marker.is_file() and json.loads(marker.read_text()) == source):
        model, tokenizer = load_model(model_name)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE).write_text(json.dumps(source))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    return str(folder)


SOURCE = "oar_source.json"  # in a converted folder: which .gguf it was made from


def gguf_identity(model_name: str) -> dict:
    """The .gguf file a --model names (its resolved path), with its size and modification time."""
    folder, kwargs = resolve_model(model_name)
    path = (Path(folder) / kwargs["gguf_file"]).resolve()
    stat = path.stat()
    return {"path": str(path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def policy_weights(policy, peft_model=None, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under the plain model's names, one tensor at a time (collective when sharded:
    every process must draw them all, in order): FSDP2's gathered as they are drawn, so no process holds
    the whole model twice (its engine keeps its own copy); LoRA's merged (W + s B A) one layer at a time.
    `dtype` (the engine's): each tensor is cast before it is gathered, so FSDP2 all-gathers bfloat16 for a
    bfloat16 engine, not the float32 master weights (half the bytes; the engine would round them anyway);
    a LoRA layer is merged from its own tensors (in float32) and rounded once, after. Detached; no copy
    where none is needed."""

    def cast(t: torch.Tensor) -> torch.Tensor:  # a DTensor stays sharded: its local shard is cast
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    params = policy.named_parameters()
    if peft_model is None:
        for name, p in params:
            yield name, sharding.full_tensor(cast(p.detach()))
        return
    config = peft_model.peft_config[lora.ADAPTER]
    scaling = config.lora_alpha / config.r
    for key, layer in itertools.groupby(params, key=lambda item: _adapted_layer(item[0])):  # a layer's are consecutive
        layer = list(layer)
        if [name for name, _ in layer] == [key]:  # not adapted: the parameter alone
            yield key, sharding.full_tensor(cast(layer[0][1].detach()))
            continue
        full = {name: sharding.full_tensor(p.detach()) for name, p in layer}
        for name, t in lora.merged_state_dict(full, scaling, fan_in_fan_out=config.fan_in_fan_out).items():
            yield name, cast(t)


def _adapted_layer(name: str) -> str:
    """The layer a LoRA-wrapped parameter belongs to (its base weight and adapters share it); any other
    parameter: its own name."""
    for part in (".base_layer.", ".lora_"):
        if part in name:
            return name.split(part)[0]
    return name


def rest(sampler) -> None:
    """After a step's rollouts (every process): the vLLM engine sleeps through the update where it has sleep
    mode, its GPU memory given back to the trainer until `follow` wakes it; otherwise nothing."""
    if isinstance(sampler, vllm_rollouts.VLLMRollouts):
        sampler.rest()


def follow(sampler, policy, peft_model=None) -> None:
    """The vLLM engine takes the policy's current weights in its own dtype (every process calls it), waking
    first if it sleeps; the own sampler reads the model itself, so nothing to do."""
    if isinstance(sampler, vllm_rollouts.VLLMRollouts):
        sampler.load_weights(policy_weights(policy, peft_model, dtype=sampler.dtype))


def close(sampler) -> None:
    """Shut the vLLM engine down (every process, before the run's process group ends); nothing for own."""
    if isinstance(sampler, vllm_rollouts.VLLMRollouts):
        sampler.close()
