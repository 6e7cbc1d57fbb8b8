"""LoRA through peft for train.py: check the settings, add the adapters, switch them off for the KL
reference, and turn the trained model into a plain merged model plus its adapter (docs/lora.md).

Legend: d_out x d_in a targeted linear layer's weight W, r the rank; A (r, d_in), B (d_out, r).

The adapted layer computes W x + s B A x with s = alpha / r (peft's scaling, no rsLoRA), B = 0 at
the start, so step 0 is the base model's. No dropout: it would make OAR's scores, the log-probs of
the update and the KL reference random draws (the update and pi_old would see different masks).

One model, two views of it:
  * `add_adapters` returns peft's PeftModel (it saves the adapter); train.py trains, samples and
    scores with `inner(...)`, the transformers model with the LoRA layers injected in place (the
    same parameters). OAR, the sampler and the update must get this inner model: OAR-G asks the
    model whether activation checkpointing is on (a property of the transformers class, which the
    PeftModel wrapper does not have), and with the wrapper it would read the noise-free prefix from
    a cache that checkpointed layers drop in training mode: wrong scores, no error
    (tests/package/test_lora.py pins it).
  * the KL reference is the same model with its adapters off (`adapters_off`): no second copy.

What `final/` holds: `merged_state_dict` folds s B A into W and drops peft's names; saving the inner
model's own state dict instead would write `...q_proj.base_layer.weight` keys, which
`from_pretrained` does not recognise, and it would load randomly initialised projections with only
a warning. The adapter alone goes to `final/adapter/` (PeftModel.from_pretrained(base, it)).
Checkpoints hold the adapters and their AdamW states, not the frozen base (checkpoint.skip_frozen,
sharding.save_sharded): a resume reads the base from --model again.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

ALL_LINEAR = "all-linear"  # peft's name for every linear layer except the output head
ADAPTER = "default"  # peft's adapter name; the only one train.py makes


def parse_targets(text: str) -> str | list[str]:
    """'all-linear' -> itself; 'q_proj,v_proj' -> ['q_proj', 'v_proj'] (peft matches each as a
    module-name suffix: 'q_proj' is every '....q_proj')."""
    text = text.strip()
    return ALL_LINEAR if text == ALL_LINEAR else [t.strip() for t in text.split(",") if t.strip()]


def check_settings(r: int, targets: str, *, default_targets: str) -> list[str]:
    """Impossible LoRA settings, each named with its fix (train.py's check_config adds them to its list)."""
    if r == 0:  # full fine-tuning: a LoRA flag without a rank would be silently ignored
        if targets == default_targets:
            return []
        return [
            f"--lora_target_modules {targets} without --lora_r: pass --lora_r > 0 (e.g. 16) to train LoRA adapters, "
            "or drop it for full fine-tuning."
        ]
    problems = []
    if r < 0:
        problems.append(f"--lora_r {r}: the LoRA rank must be > 0 (e.g. 16), or 0 for full fine-tuning.")
    if not parse_targets(targets):
        problems.append(f"--lora_target_modules {targets!r}: name modules, e.g. q_proj,v_proj, or pass {ALL_LINEAR}.")
    return problems


def linear_names(model) -> dict[str, bool]:
    """{module name: is a linear layer} of every named submodule of `model`."""
    linear = (torch.nn.Linear,)
    try:  # GPT-2 style models use transformers' Conv1D as their linear layers; peft adapts them too
        from transformers.pytorch_utils import Conv1D

        linear += (Conv1D,)
    except ImportError:
        pass
    return {name: isinstance(m, linear) for name, m in model.named_modules() if name}


def check_targets(model: str, targets: str) -> None:
    """Refuse target modules that `model` (a name as resolve_model takes it) does not have, before any
    weight loads: the model's skeleton is built from its config on the meta device (no memory, no
    weights read) and its module names are matched as peft matches them (a name or a dotted suffix).
    Raises ValueError naming the bad targets and listing the linear layers the model has."""
    wanted = parse_targets(targets)
    if wanted == ALL_LINEAR:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    from oar.training.models import ModelError, resolve_model

    source, kwargs = resolve_model(model)  # a folder, a hub id, or a .gguf file's folder and name
    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
    except (OSError, ValueError, KeyError) as err:  # no config there, an unknown architecture, a hub id not reachable
        raise ModelError(
            f"--model {model}: could not read its config to check --lora_target_modules ({type(err).__name__}: "
            f"{str(err).strip()[:300]}). Pass a folder written by save_pretrained, a .gguf file or a reachable hub id."
        ) from None
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = linear_names(skeleton)
    head = skeleton.get_output_embeddings()
    tied = (
        {n for n, m in skeleton.named_modules() if m is head}
        if getattr(config, "tie_word_embeddings", False)
        else set()
    )
    matches = lambda t: [n for n in names if n == t or n.endswith("." + t)]
    missing = [t for t in wanted if not matches(t)]
    not_linear = [t for t in wanted if matches(t) and not any(names[n] for n in matches(t))]
    # A head tied to the input embeddings is one matrix under two names. Merged, final/ would hold two
    # different matrices under a config that says they are one (tie_word_embeddings): transformers 5.23
    # loads them untied (measured), a loader that ties them (vLLM, ...) drops the head's update.
    tied_head = [t for t in wanted if set(matches(t)) & tied]
    kinds = sorted({n.rsplit(".", 1)[-1] for n, lin in names.items() if lin and n not in tied})
    if missing or not_linear or tied_head:
        what = "; ".join(
            [f"{', '.join(missing)}: no such module in {type(skeleton).__name__}"] * bool(missing)
            + [f"{', '.join(not_linear)}: not a linear layer (LoRA here adapts linear layers only)"] * bool(not_linear)
            + [
                f"{', '.join(tied_head)}: the output head shares its weight with the input embeddings "
                f"(tie_word_embeddings)"
            ]
            * bool(tied_head)
        )
        raise ValueError(
            f"--lora_target_modules {targets}: {what}. Its linear layers: {', '.join(kinds)}; "
            f"or pass {ALL_LINEAR} (every one but the output head)."
        )


def add_adapters(model, *, r: int, alpha: float, targets: str):
    """peft's PeftModel around `model`: LoRA of rank r on `targets`, no dropout, no bias, every base
    parameter frozen (requires_grad False), B = 0. `model` is adapted in place: `inner(result)` is it."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=parse_targets(targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config, adapter_name=ADAPTER)


def inner(model):
    """The transformers model inside a PeftModel (LoRA layers injected in place, the same
    parameters); any other model as it is. What train.py samples, trains and scores with."""
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


@contextmanager
def adapters_off(model):
    """Inside the block `model` (a PeftModel or its inner model) computes the base model: every
    LoRA layer skips its adapter. No parameter is touched; the adapters are back on at exit (the
    trainable ones still trainable)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in inner(model).modules() if isinstance(m, BaseTunerLayer)]
    assert layers, "adapters_off: the model has no LoRA layers"
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)


def merged_state_dict(
    state_dict: dict[str, torch.Tensor], scaling: float, *, fan_in_fan_out: bool = False, adapter: str = ADAPTER
) -> dict[str, torch.Tensor]:
    """The inner model's state dict (peft's names) -> the plain model's: for every adapted layer
    `p`, p.weight = W + scaling * B @ A (computed in float32, stored in W's dtype; transposed for
    fan_in_fan_out layers such as GPT-2's Conv1D), p.bias as it was; the LoRA tensors dropped.
    Every other entry is passed through. Pure: the input is not modified."""
    out = {}
    for key, value in state_dict.items():
        if f".lora_A.{adapter}." in key or f".lora_B.{adapter}." in key:
            continue
        if ".base_layer." not in key:
            out[key] = value
            continue
        layer, leaf = key.split(".base_layer.")
        if leaf == "weight":
            a, b = (
                state_dict[f"{layer}.lora_A.{adapter}.weight"],
                state_dict[f"{layer}.lora_B.{adapter}.weight"],
            )  # (r, d_in), (d_out, r)
            delta = scaling * (b.float() @ a.float())  # (d_out, d_in)
            value = (value.float() + (delta.T if fan_in_fan_out else delta)).to(value.dtype)
        out[f"{layer}.{leaf}"] = value
    assert not any(".base_layer." in k or ".lora_" in k for k in out), "merged_state_dict: peft names left"
    return out


def final_weights(peft_model, full_state: dict[str, torch.Tensor] | None, *, main: bool = True):
    """What `final/` gets from a LoRA run: (merged state dict for save_pretrained, a function that
    writes the adapter into a folder). `full_state`: the inner model's full state dict
    (oar.training.sharding.full_state_dict of a sharded model: filled on process 0, empty elsewhere),
    or None to read the model's own. Only the main process (`main`) writes, so only it merges, on the
    CPU: a merged copy of every adapted weight must not sit beside the model in accelerator memory."""
    config = peft_model.peft_config[ADAPTER]
    state = inner(peft_model).state_dict() if full_state is None else full_state
    state = {k: v.detach().cpu() for k, v in state.items()} if main else {}
    merged = merged_state_dict(state, config.lora_alpha / config.r, fan_in_fan_out=config.fan_in_fan_out)

    def save_adapter(folder: Path) -> None:  # peft names its keys from the PeftModel: base_model.model.<inner name>
        peft_model.save_pretrained(
            str(Path(folder) / "adapter"), state_dict={f"base_model.model.{k}": v for k, v in state.items()}
        )

    return merged, save_adapter
