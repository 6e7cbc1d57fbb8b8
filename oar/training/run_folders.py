"""A training run's folders where a model is expected: a checkpoint-N/ evaluates as the model it saved.

train.py's --output_dir holds config.json (the run's settings, not a model's), checkpoints and, once the run
has finished, final/ (a plain model). `oar.training.models.resolve_model` refuses the run folder itself and
a checkpoint with the folder that works (`run_folder_problem`); eval.py evaluates a checkpoint here: the
run's own --model, loaded as that run loaded it, with the checkpoint's weights (accelerate's
model.safetensors), and with LoRA the adapters put back as the run trained them. A checkpoint whose weights
are shards (train.py's FSDP2 on CPU processes: sharded/; accelerate's on GPUs) is refused with the run's
final/ instead. The prompt's instruction is the run's own (`instruction`), as eval.py's 'auto' takes a
final/'s.
"""

from __future__ import annotations

import json
from pathlib import Path

from oar.sampler import resolve_instruction
from oar.tasks.tiny_arith_cache import model_source
from oar.training.models import ModelError, load_model

WEIGHTS = "model.safetensors"  # accelerate's save_state: the prepared model's state dict


def checkpoint_settings(name: str) -> dict | None:
    """The settings of the run whose checkpoint folder `name` is (its trainer_state.json's config, with its
    "step"), or None for anything else."""
    state = Path(name).expanduser() / "trainer_state.json"
    if not state.is_file():
        return None
    record = json.loads(state.read_text())
    config = record.get("config") if isinstance(record, dict) else None
    return config | {"step": record.get("step")} if isinstance(config, dict) and "model" in config else None


def instruction(name: str, given: str, dataset: str) -> str:
    """The instruction eval.py prompts with: `given`, or for 'auto' the run's own when `name` is a checkpoint
    (what train.py resolved from its settings), else resolve_instruction's."""
    run = checkpoint_settings(name)
    if run is None or given != "auto":
        return resolve_instruction(given, dataset, name)
    return resolve_instruction(run.get("instruction", "auto"), run.get("dataset", dataset), run.get("model", ""))


def load_checkpoint_model(folder: str, *, dtype: str = "float32"):
    """(model, tokenizer) of checkpoint `folder`: its run's --model with the checkpoint's weights. ModelError,
    naming the folder that works, when they cannot be put back."""
    run, path = checkpoint_settings(folder), Path(folder).expanduser()
    final = path.parent / "final"
    elsewhere = f"evaluate the run's final model ({final})" if final.is_dir() else "evaluate the run's final/"
    if (path / "sharded").is_dir() or not (path / WEIGHTS).is_file():
        raise ModelError(f"--model {folder}: this checkpoint's weights are FSDP2 shards, not one model; {elsewhere}.")
    base = run.get("model", "")
    try:
        model, tokenizer = load_model(model_source(base), dtype=dtype)
    except ModelError as err:
        raise ModelError(
            f"--model {folder}: a checkpoint of a run on --model {base}, which cannot be loaded here ({err})"
        ) from None
    if run.get("lora_r"):  # the checkpoint holds the adapters alone (checkpoint.skip_frozen)
        from oar.training import lora
        from oar.training.config import Config

        targets = run.get("lora_target_modules", Config.lora_target_modules)
        model = lora.inner(lora.add_adapters(model, r=run["lora_r"], alpha=Config.lora_alpha, targets=targets))
    put_back(model, path / WEIGHTS, folder, adapters_only=bool(run.get("lora_r")))
    return model, tokenizer


def put_back(model, weights_file: Path, folder: str, *, adapters_only: bool) -> None:
    """Load the checkpoint's state dict into `model`: every key it holds must be the model's, and every weight
    the model has must come from it (but a tied one, saved once, and with LoRA the frozen base)."""
    from safetensors.torch import load_file

    weights = {k.removeprefix("module."): v for k, v in load_file(str(weights_file)).items()}  # DDP's prefix
    missing, unexpected = model.load_state_dict(weights, strict=False)
    shared = {t.data_ptr() for k, t in model.state_dict().items() if k in weights}
    if adapters_only:
        lost = [k for k in missing if "lora_" in k]
    else:
        lost = [k for k in missing if model.state_dict()[k].data_ptr() not in shared]  # not a tied copy
    if unexpected or lost:
        what = f"weights the model lacks ({unexpected[0]} first)" if unexpected else f"no {lost[0]}"
        raise ModelError(
            f"--model {folder}: the checkpoint holds {what}, so it is not a checkpoint of its run's --model "
            f"as loaded here; evaluate the run's final/."
        )
