"""Calling Hugging Face causal LMs the one way this project does: position ids, caches, a logits forward.

Legend: B rows, L positions, V vocabulary, S cached positions. Sequences are left-padded prompts
followed by right-padded completions, so a row's real tokens need not start at position 0: every
forward pass here passes position ids counted over the attention mask, exactly as `generate` does,
so the log-probs of training equal those of sampling.

For a decode loop: a cache filled in place (`in_place_cache`), what autocast a forward runs under
(`autocast_seen`), and the linear weights cast once for it (`linear_weights_in`), each giving the numbers
of the plain way.

The bottom of the package: it uses torch and transformers only, and the maths (probes, OAR-G,
OAR-P, entropies), the sampler and the training loop all call models through it. Loading a model is
oar/training/models.py's job.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) 0/1 mask -> (B, L) positions counted over real tokens (padding gets 0)."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def forward_logits(
    model, input_ids=None, attention_mask=None, *, inputs_embeds=None, logits_to_keep: int = 0
) -> torch.Tensor:
    """Logits (B, L, V) of a causal LM (the last `logits_to_keep` positions when > 0), no cache."""
    out = model(
        input_ids=input_ids,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        use_cache=False,
        logits_to_keep=logits_to_keep,
    )
    return out.logits


def full_cache(kv=None):
    """A transformers cache that keeps every position of every layer, optionally holding `kv` (each
    layer's (keys, values), (B, heads, S, head_dim)).

    Why not the model's own `DynamicCache(config=...)`: for sliding-window layers (Mistral with a
    window, Gemma 2, Gemma 3) it keeps only the last window of positions, and OAR reads every clean
    position back. The model builds its attention masks from the cache's length and offsets in index
    space (transformers' masking_utils), so with a cache that keeps everything it still applies its own
    window: the attention computed is the one the model defines (tests/package/test_families.py pins it)."""
    from transformers import DynamicCache

    cache = DynamicCache()  # no config: every layer a full DynamicLayer
    for layer, (k, v) in enumerate(kv or []):
        cache.update(k, v, layer)
    return cache


@functools.cache
def cache_argument() -> str:
    """The name under which a forward takes its KV cache and its output returns it. transformers 5.24
    renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40); 4.57-5.23 know only the
    old one, and would silently drop a `cache=` keyword into **kwargs: the installed release decides."""
    from packaging.version import Version
    from transformers import __version__

    return "cache" if Version(__version__).release >= (5, 24) else "past_key_values"


def cache_kwargs(cache) -> dict:
    """`{name: cache}` for a forward's keyword arguments: `model(ids, **cache_kwargs(cache), use_cache=True)`."""
    return {cache_argument(): cache}


def returned_cache(out):
    """The KV cache a forward returned (None when it kept none), under either release's name."""
    return getattr(out, cache_argument(), None)


@contextmanager
def eval_mode(model):
    """Run with every module in eval mode (dropout off; checkpointed layers would drop the caches the
    scorers read), then give each module its own mode back."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def in_place_cache(cache, width: int, repeats: int = 1):
    """The prefill's DynamicCache, with every layer's keys/values (each row repeated `repeats` times: a prompt's G
    rollouts) moved into buffers `width` columns wide that the later steps fill in place.

    A DynamicCache grows by `torch.cat` (a copy of the whole cache, every layer, every step); here a step writes
    its one column and the forward reads the written columns as views: the same tensors, so the same numbers
    (tests/package/test_sampler.py pins it, bit for bit, on every family of tests/families.py). A layer of another kind
    than a plain DynamicLayer (a model's own sliding or linear-attention layer) keeps growing as it did; so does
    a layer once a step brings another dtype than its buffer's or more columns than `width`."""
    layer_type = _in_place_layer()
    if not all(type(layer).__name__ == "DynamicLayer" and layer.is_initialized for layer in cache.layers):
        if repeats > 1:
            cache.batch_repeat_interleave(repeats)
        return cache
    cache.layers = [layer_type(layer.keys, layer.values, width, repeats) for layer in cache.layers]
    return cache


@functools.cache
def _in_place_layer():
    """The class of `in_place_cache`'s layers (transformers is imported only when a cache is made)."""
    from transformers.cache_utils import DynamicLayer

    class InPlaceLayer(DynamicLayer):
        """A DynamicLayer whose keys and values are the first `length` columns of preallocated buffers."""

        def __init__(self, keys, values, width: int, repeats: int):
            super().__init__()
            self.device, self.is_initialized, self.length = keys.device, True, keys.shape[-2]
            self.buffers = []
            for x in (keys, values):  # (B, heads, width, head_dim), each in its own dtype (autocast: float32 keys)
                buf = x.new_empty(x.shape[0] * repeats, *x.shape[1:-2], max(width, x.shape[-2]), x.shape[-1])
                buf[..., : self.length, :] = x.repeat_interleave(repeats, 0)
                self.buffers.append(buf)
            self._views()

        def _views(self):
            self.keys, self.values = (buf[..., : self.length, :] for buf in self.buffers)

        def update(self, key_states, value_states, *args, **kwargs):
            end = self.length + key_states.shape[-2]
            dtypes = (key_states.dtype, value_states.dtype)
            if self.buffers and end <= self.buffers[0].shape[-2] and dtypes == tuple(b.dtype for b in self.buffers):
                for buf, x in zip(self.buffers, (key_states, value_states)):
                    buf[..., self.length : end, :] = x
                self.length = end
                self._views()
            else:  # what a DynamicLayer does, from here on (never met in the sampler's loops)
                self.buffers = []
                self.keys = torch.cat([self.keys, key_states], dim=-2)
                self.values = torch.cat([self.values, value_states], dim=-2)
            return self.keys, self.values

    return InPlaceLayer


@contextmanager
def autocast_seen(model):
    """A dict that gets {"dtype": d} when the model's forward, inside, runs under autocast to d: read at its
    input embeddings, since accelerate's mixed precision enables autocast within the wrapped forward only."""
    seen: dict = {}
    device = model.device.type

    def note(module, args):
        if torch.is_autocast_enabled(device):
            seen["dtype"] = torch.get_autocast_dtype(device)

    try:
        handle = model.get_input_embeddings().register_forward_pre_hook(note)
    except (AttributeError, NotImplementedError):  # no embedding module to watch: nothing seen, as without autocast
        handle = None
    try:
        yield seen
    finally:
        if handle is not None:
            handle.remove()


@contextmanager
def linear_weights_in(model, dtype: torch.dtype | None):
    """Inside, every nn.Linear's float32 weight and bias is a copy in `dtype`; the originals are put back after.

    Under autocast to `dtype` (accelerate's mixed precision with float32 master weights), a linear layer casts
    its float32 weight to `dtype` on every call, and the cast is cached only within one forward: a decode loop
    re-casts the whole policy at every step. Autocast leaves a tensor already in its dtype as it is, so with the
    copies each forward computes the same numbers (the cast is the same rounding, made once) and the loop casts
    once per call of this. Nothing is swapped for `dtype` None or float32, and nothing in a model whose parameters
    something else swaps in and out (FSDP2's DTensors, accelerate's offloading hooks), nor a weight that is not a
    plain float32 Parameter (a quantized one); an embedding keeps its own (autocast does not cast embeddings)."""
    swapped = []
    if dtype not in (None, torch.float32) and not _parameters_managed(model):
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                for name in ("weight", "bias"):
                    p = module._parameters.get(name)
                    if type(p) is torch.nn.Parameter and p.dtype == torch.float32 and p.device.type != "meta":
                        swapped.append((module, name, p))
        copies = {}  # a weight tied between two linear layers is copied once
        for module, name, p in swapped:
            if id(p) not in copies:
                copies[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
            module._parameters[name] = copies[id(p)]
    try:
        yield
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p


def _parameters_managed(model) -> bool:
    """Whether something other than the modules themselves swaps the model's parameters (FSDP2, offloading)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed: no DTensor to meet
        DTensor = ()
    return any(isinstance(p, DTensor) for p in model.parameters()) or any(
        hasattr(m, "_hf_hook") for m in model.modules()
    )


CPU_FORWARD_POSITIONS = 8192  # positions (cached + recomputed) of masked copies in one scoring forward on a CPU
DEVICE_MEMORY_SHARE = 0.5  # of an accelerator's free memory, what one scoring forward may plan to take


def positions_that_fit(model, device, *, per_copy: int, logit_columns: int) -> int:
    """How many (cached + recomputed) positions of masked copies one no-grad scoring forward holds on `device`.

    On a CPU, CPU_FORWARD_POSITIONS (8192: OAR-P's budget before it was sized by the device; larger forwards
    run no faster there, and the memory is the host's). On a CUDA device, as many whole copies of `per_copy`
    positions and `logit_columns` vocabulary-wide logit columns each as DEVICE_MEMORY_SHARE of its free memory
    holds (the caching allocator's unused reserve counted free), by the model's sizes: a position holds its
    keys/values in every layer twice (the gathered prefix and the cache's own) and one layer's activations, a
    logit column the logits and two float32 copies; never fewer than on a CPU. An estimate from the config,
    not a measurement: it has not run on a GPU (docs/long-reasoning.md)."""
    free = _free_bytes(device)
    if free is None:
        return CPU_FORWARD_POSITIONS
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    inner = getattr(c, "intermediate_size", None) or 4 * c.hidden_size
    elem = next(model.parameters()).element_size()
    position = (
        4 * c.num_hidden_layers * kv_heads * head_dim + 4 * c.hidden_size + 3 * inner + 2 * heads * head_dim
    ) * elem
    column = c.vocab_size * (elem + 8)
    copies = int(DEVICE_MEMORY_SHARE * free) // (per_copy * position + logit_columns * column)
    return max(CPU_FORWARD_POSITIONS, copies * per_copy)


def _free_bytes(device) -> int | None:
    """Free memory of a CUDA device, with what its caching allocator holds unused; None for any other device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def on_device(device, values) -> torch.Tensor:
    """A host list (of lists) of ints as a long tensor on `device`: on a GPU pinned and copied without waiting,
    so a scorer's index tables do not drain the queue (a plain copy from pageable memory synchronises)."""
    t = torch.tensor(values, dtype=torch.long)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t.to(device)
