"""FSDP2 (torch.distributed.fsdp.fully_shard) for train.py: shard, gather for generation and
scoring, save and load sharded state, and count what each process holds.

Two ways a model arrives sharded, one code path after it:
  * on GPUs, accelerate's own FSDP2 plugin (`accelerate launch --config_file configs/fsdp2.yaml`)
    shards it in `accelerator.prepare`;
  * on CPU processes (gloo), where accelerate's plugin falls back to DDP (DistributedType.MULTI_CPU) from
    the same launch, train.py calls `shard` itself (`shards_itself`): one FSDP unit per decoder layer plus
    the root (embeddings, final norm, LM head), the same wrapping as the config's transformer-based auto wrap.
`is_sharded` tells either apart from a plain or DDP model.

Why `gathered`: FSDP2 gathers a unit's parameters only around that unit's own forward (hooks on
the module). The sampler, OAR-G and OAR-P call submodules directly (the embedding, the decoder
with a KV cache), where a sharded root fails ("aten.embedding.default got mixed torch.Tensor and
DTensor"). `gathered` all-gathers every unit once, keeps it gathered through any number of forwards
and backwards (no per-call collective, so processes may run different numbers of forwards inside),
and reshards at exit: the full parameters exist once, only for the duration of the block.

Memory (`param_optimizer_bytes`): bytes of the parameters and optimizer states this process holds
(local shards for DTensors), and what an unsharded (DDP) process would hold for the same model.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch


def is_sharded(model) -> bool:
    """True for a model FSDP2 has sharded (by `shard` or by accelerate's FSDP2 plugin)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules transformers names in `_no_split_modules`, which is
    what accelerate's TRANSFORMER_BASED_WRAP wraps by default."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    assert layers, (
        f"{type(model).__name__} names no decoder layer class in _no_split_modules; cannot shard it per layer."
    )
    return layers


def shard(model, mixed_precision: torch.dtype | None = None):
    """fully_shard each decoder layer, then the root; in place (the model's class becomes an FSDP
    class). `mixed_precision`: parameter dtype for compute (reduction stays float32), else none."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _units(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered(model):
    """Inside the block every parameter of a sharded `model` is its full tensor and FSDP2's hooks are
    idle: forwards and backwards inside are plain autograd on the gathered parameters, with no
    collective and no change to FSDP2's bookkeeping, so processes may run different numbers of them
    (OAR scores only some rollouts on each). Resharded at exit. A no-op for an unsharded model.
    Every process must enter it (the gather is collective).

    How the hooks are idled: FSDP2 has no public switch, but its forward hooks return at once for a
    state in PRE_BACKWARD (the path activation-checkpoint recomputation takes, parameters already
    gathered), registering no backward hook; each unit's state is set so and restored at exit.
    Without it, a scoring backward between the update's forward and backward reordered FSDP2's
    prefetch and reduce-scatter on one process only, and two processes deadlocked."""
    if not is_sharded(model):
        yield model
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    units = _units(model)
    for u in units:
        u.unshard()
    states = [u._get_fsdp_state() for u in units]
    saved = [s._training_state for s in states]
    for s in states:
        s._training_state = TrainingState.PRE_BACKWARD
    try:
        yield model
    finally:
        for s, training_state in zip(states, saved):
            s._training_state = training_state
        for u in units:
            u.reshard()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (collective), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor, a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def param_optimizer_bytes(model, optimizer) -> dict[str, int]:
    """Bytes of parameters + optimizer state on this process (`local`: shards as held) and on an
    unsharded process (`unsharded`: full shapes, same dtypes). Gradients are freed after each step
    (zero_grad(set_to_none)), so they are not counted."""
    from torch.distributed.tensor import DTensor

    local = unsharded = 0
    tensors = list(model.parameters())
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        size = t.element_size()
        local += local_tensor(t).numel() * size
        unsharded += (t.numel() if isinstance(t, DTensor) else t.numel()) * size  # DTensor.numel is the global count
    return {"local": local, "unsharded": unsharded}


def _frozen_skipped(model):
    """Options that leave frozen parameters (LoRA's base) out of a checkpoint: they never change and
    are the model source's, loaded again at a resume. A no-op for full fine-tuning (nothing frozen)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


def save_sharded(model, optimizer, path: Path) -> None:
    """Each process writes its shards of the model's trainable parameters and of the optimizer
    (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_frozen_skipped(model))
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))


def load_sharded(model, optimizer, path: Path) -> None:
    """Read the shards `save_sharded` wrote into the sharded model and optimizer, in place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    options = _frozen_skipped(model)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options
    )


def full_state_dict(model) -> dict[str, torch.Tensor] | None:
    """The full state dict on CPU for save_pretrained (filled on process 0, empty elsewhere);
    collective, call it on every process. None for an unsharded model (save_pretrained reads its own)."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # A tied parameter (lm_head = embed_tokens) comes back as two separate tensors; keep its first
    # name only, as save_pretrained does for a model's own state dict (from_pretrained re-ties it).
    first = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    tied = {name for name, p in model.named_parameters(remove_duplicate=False) if first[id(p)] != name}
    return {k: v for k, v in full.items() if k not in tied}


def asked_for(environ=None) -> bool:
    """Whether the launch asked for FSDP: `accelerate launch --config_file configs/fsdp2.yaml` (or --use_fsdp)
    sets ACCELERATE_USE_FSDP for every process, also where accelerate itself then falls back to DDP."""
    import os

    return (environ if environ is not None else os.environ).get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")


def shards_itself(accelerator) -> bool:
    """True when train.py shards the model (`shard`): FSDP was asked for and accelerate's plugin does not."""
    return asked_for() and not accelerate_shards(accelerator)


def accelerate_shards(accelerator) -> bool:
    """True when accelerate's own FSDP plugin prepares the model (GPUs with configs/fsdp2.yaml)."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def mixed_precision(accelerator) -> torch.dtype | None:
    """The compute dtype of accelerate's --mixed_precision, for FSDP2's MixedPrecisionPolicy."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(accelerator.mixed_precision))
