"""The policy as train.py trains it, and the plumbing that decides which model does what.

A run holds up to five views of one policy: the model accelerate prepared (DDP-wrapped) or FSDP2
sharded, which the optimizer steps and `accumulate` synchronises; the unwrapped transformers model,
which samples, scores and is evaluated; with LoRA (--lora_r), peft's PeftModel around it, which
saves the adapter; the KL reference, a frozen copy of the initial model or, with LoRA, the policy
with its adapters off; and the optimizer with its LR schedule. `build_learner` assembles them in
the one order that works (adapters before checkpointing and sharding, sharding before the optimizer,
the optimizer before `prepare`), and `Learner` answers the questions the loop would otherwise branch
on: `gathered()` (whole parameters for calls a shard cannot serve, oar/training/sharding.py),
`forward` (the update forward: through the head in chunks, or the model's logits, oar/head.py),
`reference_logprobs` (which model and which context), `sharded` (what a checkpoint writes itself),
`final_state` (what final/ gets).

Legend: b a micro-batch's rollouts, L positions, T completion positions.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from oar.head import Forward, Head, hidden_forward, reproduces
from oar.probes import clean_forward
from oar.tasks.tiny_arith_cache import model_source
from oar.training import checkpoint as ckpt
from oar.training import lora, sharding
from oar.training.models import disable_dropout, enable_checkpointing, load_model


@dataclass
class Learner:
    model: Any  # what the optimizer steps and accelerate accumulates: DDP-wrapped, FSDP2-sharded or plain
    optimizer: torch.optim.Optimizer  # AdamW over the trainable parameters (LoRA: the adapters only)
    schedule: Any  # the LR schedule, stepped once per RL step
    policy: Any  # the unwrapped transformers model: sampling, scoring, evaluation, save_pretrained
    peft: Any = None  # LoRA's PeftModel around `policy`, else None
    reference: Any = None  # the KL reference's frozen copy (kl_beta > 0 without LoRA), else None
    own_fsdp: bool = False  # sharded by train.py (CPU processes launched with FSDP2's config), not accelerate's plugin
    adapters_only: bool = False  # checkpoints leave out the frozen base (LoRA, not sharded)
    autocast: Any = nullcontext  # the context the policy's forward computes in: accelerate's autocast, or
    # none when sharded, by train.py or accelerate's plugin (FSDP2's MixedPrecisionPolicy casts the shards, and
    # accelerate wraps no autocast around an FSDP2 forward; the reference is sharded the same way)
    chunked_head: bool = False  # the update reads the final hidden states through the head in chunks (oar/head.py)

    def forward(self, input_ids, attention_mask, *, columns: int, keep_cache: bool = False, model=None) -> Forward:
        """The update forward of (b, L) inputs, read from their last `columns` columns (oar.head.Forward): the
        final hidden states and the head when `chunked_head`, else the model's own logits; with OAR's clean
        keys/values when `keep_cache`. `model`: another one to run (the KL reference), else the trained one."""
        model, unwrapped = (self.model, self.policy) if model is None else (model, model)
        if not self.chunked_head:
            logits, kv = clean_forward(model, input_ids, attention_mask, logits_to_keep=columns, keep_cache=keep_cache)
            return Forward(logits, None, kv)
        hidden, kv = hidden_forward(
            model, unwrapped.base_model, input_ids, attention_mask, columns=columns, keep_cache=keep_cache
        )
        return Forward(hidden, Head(unwrapped), kv, self.autocast)

    def gathered(self, when: bool = True):
        """Whole parameters inside the block when the model is sharded (collective: every process
        enters); nothing to do otherwise, or when `when` is False."""
        return sharding.gathered(self.model) if when else nullcontext()

    def reference_logprobs(self, input_ids, attention_mask, labels, temperature: float) -> torch.Tensor:
        """log pi_ref of `labels` (b, T), the completion of (b, L) inputs: the frozen copy, or with LoRA
        the policy with its adapters off (gathered when sharded: peft's switch reaches into submodules), in
        the policy's precision: under bf16 the frozen copy would otherwise compute in float32 while the
        policy autocasts, and pi_ref != pi_theta at step 0."""
        with (
            torch.no_grad(),
            lora.adapters_off(self.policy) if self.peft is not None else nullcontext(),
            self.gathered(self.peft is not None),
            self.autocast(),
        ):
            model = self.reference if self.reference is not None else self.policy
            fwd = self.forward(input_ids, attention_mask, columns=labels.shape[1] + 1, model=model)
            return fwd.logprobs(labels, temperature)[0]

    @property
    def sharded(self):
        """(model, optimizer) when train.py sharded them (a checkpoint writes their shards), else None."""
        return (self.model, self.optimizer) if self.own_fsdp else None

    def final_state(self, main: bool):
        """(state dict for save_pretrained, a function writing more into final/ or None): the full weights
        of a sharded model (collective), LoRA's merged into them, the adapter alone in final/adapter/."""
        full = sharding.full_state_dict(self.model)
        return lora.final_weights(self.peft, full, main=main) if self.peft is not None else (full, None)


HALF_WEIGHTS = (
    "--dtype {dtype} without LoRA trains {dtype} weights with a plain AdamW: an update below "
    "about 1/256 of its weight is rounded away (at --learning_rate {lr:g}, most of them). Keep "
    "float32 weights (the default --dtype) and launch with --mixed_precision bf16 to compute in "
    "bfloat16, or shard with configs/fsdp2.yaml (accelerate's FSDP2 keeps float32 masters)."
)


def build_learner(cfg, accelerator, model, *, n_micro: int) -> Learner:
    """Everything train.py trains from the loaded `model`, in the order that works (module docstring).
    `n_micro`: micro-batches per optimizer step on each process (accelerate's accumulation steps)."""
    disable_dropout(model)  # one function of the weights: sampling, scoring, pi_old, the update (models.py)
    # LoRA: peft freezes the base and adds adapters in place; everything below trains, samples and scores
    # the inner transformers model (lora.inner: OAR-G needs it), the PeftModel only saves the adapter.
    peft = None
    if cfg.lora_r:
        peft = lora.add_adapters(model, r=cfg.lora_r, alpha=cfg.lora_alpha, targets=cfg.lora_target_modules)
        model = lora.inner(peft)
    if cfg.gradient_checkpointing:
        enable_checkpointing(model)
    # The KL reference: a frozen copy of the initial model, or with LoRA the policy with its adapters off
    reference = None
    if cfg.kl_beta > 0 and not cfg.lora_r:
        reference = load_model(model_source(cfg.model), dtype=cfg.dtype)[0].eval().requires_grad_(False)
        reference = reference.to(accelerator.device)
    # On CPU processes accelerate's FSDP plugin falls back to DDP: train.py shards the model here
    plugin_fsdp = sharding.accelerate_shards(accelerator)  # GPUs with configs/fsdp2.yaml: prepare shards it
    upcast = plugin_fsdp and sharding.mixed_precision(accelerator) is not None  # the plugin: float32 masters
    if not cfg.lora_r and getattr(torch, cfg.dtype) in (torch.bfloat16, torch.float16) and not upcast:
        warnings.warn(HALF_WEIGHTS.format(dtype=cfg.dtype, lr=cfg.learning_rate), stacklevel=2)
    own_fsdp = sharding.shards_itself(accelerator)
    if own_fsdp:  # before the optimizer: it must hold the sharded parameters
        sharding.shard(model, sharding.mixed_precision(accelerator))
    if reference is not None and (own_fsdp or plugin_fsdp):  # computes as the sharded policy does (bf16
        sharding.shard(reference, sharding.mixed_precision(accelerator))  # shards, no autocast); a shard each
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)  # no decay (GRPO)
    warmup = lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps))  # noqa: E731
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    accelerator.gradient_accumulation_steps = n_micro
    if not own_fsdp:  # (else accelerate would wrap the sharded model in DDP; its state is DCP's)
        model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(schedule)  # stepped once per RL step, on every process
    # LoRA: checkpoints hold the adapters, the frozen base is --model's (train.py's shards too, sharding.py);
    # accelerate's FSDP plugin (GPUs) writes the whole model.
    adapters_only = peft is not None and not own_fsdp and not plugin_fsdp
    if adapters_only:
        ckpt.skip_frozen(accelerator)
    policy = accelerator.unwrap_model(model)
    autocast = nullcontext if own_fsdp or plugin_fsdp else accelerator.autocast  # FSDP2 casts, not autocast
    chunked = chunked_head(model, policy, accelerator.device, autocast, sharded=own_fsdp or plugin_fsdp)
    return Learner(model, optimizer, schedule, policy, peft, reference, own_fsdp, adapters_only, autocast, chunked)


FULL_LOGITS = (
    "the update reads the model's full logits (b, T, V) and their gradient, not its hidden states through the "
    "head in chunks (oar/head.py): {why}"
)


def chunked_head(model, policy, device, autocast, *, sharded: bool) -> bool:
    """Whether the update can read the final hidden states through the head in chunks (oar/head.py): not under
    FSDP2, where the head's parameters belong to a unit whose hooks (accelerate's plugin gives the head and the
    embeddings a unit of their own) would run once per chunk, and chunks differ between processes; and only
    where the head reproduces the model's logits (oar.head.reproduces). Said once when not."""
    if sharded:
        warnings.warn(FULL_LOGITS.format(why="the model is sharded (FSDP2; docs/gpu.md)"), stacklevel=2)
        return False
    if policy.base_model is policy or policy.get_output_embeddings() is None:
        warnings.warn(
            FULL_LOGITS.format(why=f"{type(policy).__name__} has no separate decoder and head"), stacklevel=2
        )
        return False
    if not reproduces(model, policy.base_model, Head(policy), device, autocast):
        warnings.warn(
            FULL_LOGITS.format(
                why=f"{type(policy).__name__}'s forward changes its logits in a way oar.head.Head does not reproduce"
            ),
            stacklevel=2,
        )
        return False
    return True
