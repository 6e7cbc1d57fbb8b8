"""Calling Hugging Face causal LMs the one way this project does: position ids, caches, a logits forward.

Legend: B rows, L positions, V vocabulary, S cached positions. Sequences are left-padded prompts
followed by right-padded completions, so a row's real tokens need not start at position 0: every
forward pass here passes position ids counted over the attention mask, exactly as `generate` does,
so the log-probs of training equal those of sampling.

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
    window: the attention computed is the one the model defines (tests/test_families.py pins it)."""
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
