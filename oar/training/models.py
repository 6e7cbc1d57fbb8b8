"""Loading Hugging Face causal LMs: a model name (hub id, local folder, .gguf file) to (model, tokenizer).

Calling them (position ids, caches, a logits forward) is oar/lm.py's job.
"""

from __future__ import annotations

from pathlib import Path

import torch


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
