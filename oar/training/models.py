"""Calling Hugging Face causal LMs the one way this project does, and loading them.

Legend: B rows, L positions, V vocabulary. Sequences are left-padded prompts followed by
right-padded completions, so a row's real tokens need not start at position 0: every forward pass
here passes position ids counted over the attention mask, exactly as `generate` does, so the
log-probs of training equal those of sampling.
"""

from __future__ import annotations

from pathlib import Path

import torch


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) 0/1 mask -> (B, L) positions counted over real tokens (padding gets 0)."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def forward_logits(model, input_ids=None, attention_mask=None, *, inputs_embeds=None, logits_to_keep: int = 0) -> torch.Tensor:
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


class ModelError(ValueError):
    """A model name that cannot be loaded; the message says which input and what to do."""


def resolve_model(name: str) -> tuple[str, dict]:
    """Where `name` points: ('tiny-arith' | hub id | local folder | .gguf file) -> (path or id,
    extra from_pretrained kwargs). Checks local paths before anything expensive happens; building
    tiny-arith is left to `load_model`."""
    if name == "tiny-arith":  # the built-in policy: the entry points build it (oar.tasks.tiny_arith_cache.model_source)
        return name, {}
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise ModelError(f"--model {name}: no such .gguf file. Pass an existing GGUF file, a model folder, or a hub id.")
        return str(path.parent), {"gguf_file": path.name}
    looks_local = name.startswith((".", "/", "~")) or path.exists() or name.count("/") > 1
    if looks_local and not (path / "config.json").is_file():
        raise ModelError(f"--model {name}: not a model folder (no config.json there). Pass a folder written by "
                         f"save_pretrained, a .gguf file, a hub id such as Qwen/Qwen2.5-Math-1.5B, or tiny-arith.")
    return str(path) if path.exists() else name, {}


def load_model(name: str, *, dtype: str = "float32"):
    """(model, tokenizer) for a model name as `resolve_model` accepts it (the built-in 'tiny-arith'
    is resolved to its folder by the entry points: `oar.tasks.tiny_arith_cache.model_source`). The
    tokenizer pads on the left (generation needs it) and has a pad token (its EOS when it had none)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, kwargs = resolve_model(name)
    tokenizer = _loaded(name, "tokenizer", lambda: _tokenizer_class(source, AutoTokenizer).from_pretrained(source, **kwargs))
    if tokenizer.eos_token_id is None:
        raise ModelError(f"--model {name}: its tokenizer has no EOS token, so completions cannot end. "
                         f"Set tokenizer.eos_token and save the tokenizer again.")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # pads are masked out; sharing EOS is harmless
    tokenizer.padding_side = "left"
    model = _loaded(name, "model", lambda: AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype), **kwargs))
    if "gguf_file" in kwargs:
        # transformers dequantizes GGUF weights on load: what remains is a plain float model, which
        # save_pretrained refuses while the GGUF quantizer is still attached.
        model.hf_quantizer = None
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
    return model, tokenizer


def _tokenizer_class(source: str, auto):
    """The class to load a folder's tokenizer with: the generic one it was saved as (a tokenizer.json of
    its own, e.g. oar.tasks.tiny_arith's), else `auto`. Why: transformers 5's AutoTokenizer picks the model
    family's class from config.json before the saved class, and for a Qwen2 folder its Qwen2Tokenizer
    re-splits a custom tokenizer.json into other tokens (spaces dropped), silently."""
    import json

    import transformers

    config = Path(source) / "tokenizer_config.json"
    saved = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    return getattr(transformers, saved) if saved in ("TokenizersBackend", "PreTrainedTokenizerFast") else auto


def _loaded(name: str, what: str, load):
    """`load()`, with the errors of a folder or hub id that holds no usable model (missing or corrupt
    files, an unknown architecture, a hub id that is not there or not reachable) named as one ModelError."""
    from safetensors import SafetensorError  # a truncated or corrupt weights file

    try:
        return load()
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ModelError(f"--model {name}: could not load its {what} ({type(err).__name__}: {first[:300]}). Pass a folder "
                         f"written by save_pretrained, a .gguf file, a hub id that is cached or reachable, or tiny-arith.") from None
