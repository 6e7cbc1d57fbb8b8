"""Checkpoints that survive being killed: written under a temporary name, renamed when complete.

A checkpoint is `output_dir/checkpoint-<step>/` holding accelerate's state (model, optimizer, RNG,
registered objects) and `trainer_state.json` (the step it resumes at). It is written to
`checkpoint-<step>.tmp/` and renamed only once every process has finished writing, so a directory
named `checkpoint-<step>` is always complete (its files and folders are fsynced first, so also after a
power loss); a run killed mid-save leaves a `.tmp` that the next save removes. The newest `keep`
checkpoints are kept; an older one is renamed to `.old` before it is deleted, so a kill during the
deletion never leaves a half-deleted folder under a checkpoint's name. A folder counts as a
checkpoint only when it holds trainer_state.json (written last).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
from pathlib import Path

_NAME = re.compile(r"^checkpoint-(\d+)$")
ROOT = Path(__file__).resolve().parents[2]  # the repository: train.py and oar/


def files_version(paths) -> str:
    """A hash of files' names (relative to the repository, else their own) and contents, in order; a
    missing file adds nothing."""
    digest = hashlib.sha1()
    for path in map(Path, paths):
        if path.is_file():
            name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
            digest.update(name.encode() + path.read_bytes())
    return digest.hexdigest()[:10]


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, read in blocks (weights of many GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def code_version(extra: tuple[Path, ...] = ()) -> str:
    """A hash of the code a run executes (train.py, oar/**/*.py, then `extra` files), committed or not: a
    checkpoint records it, so a resume by other code says so, and the studies' ledgers compare runs by it."""
    return files_version([ROOT / "train.py", *sorted((ROOT / "oar").rglob("*.py")), *extra])


def run_code_version(*modules: str, base: Path | None = None) -> str:
    """`code_version` with a run's --credit_module / --reward_module files: a .py path (a relative one
    taken from `base`, by default the working directory, as train.py loads them) or an importable module's
    own file. Not the files those import: a helper edited beside them goes unseen."""
    return code_version(tuple(f for m in modules if m and (f := _module_file(m, Path(base or "."))) is not None))


def _module_file(module: str, base: Path) -> Path | None:
    """The file a --credit_module / --reward_module value names: its path, or a dotted module's source
    file (None when it cannot be found here, or is not Python source)."""
    if module.endswith(".py"):
        return (base / module).resolve()
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and str(spec.origin).endswith(".py") else None


def checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _NAME.match(p.name)) and (p / "trainer_state.json").is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = checkpoints(output_dir)
    return found[-1] if found else None


def resume_point(output_dir: str | Path, resume: bool) -> Path | None:
    """The checkpoint a run resumes from (None for a fresh run); ValueError naming the fix when
    `--resume` finds none, or when a fresh run would write over an earlier run's checkpoints."""
    found = latest_checkpoint(output_dir)
    if resume and found is None:
        raise ValueError(f"--resume: no complete checkpoint in {output_dir}; drop --resume to start afresh.")
    if not resume and found is not None:
        raise ValueError(
            f"--output_dir {output_dir} holds checkpoints of an earlier run: pass --resume to "
            f"continue it, or choose another --output_dir."
        )
    return found


def _not_the_tied_head_note(record: logging.LogRecord) -> bool:
    """False for accelerate's note that save_state left out a tensor sharing another's memory ("Removed shared
    tensor {'lm_head.weight'} while saving ... check by verifying ..."): a head tied to the embedding, as in
    tiny-arith and SmolLM2. What reads a checkpoint (--resume, eval.py given checkpoint-N/) builds the run's
    model, whose tie gives the left-out name its values again (tests/package/test_resume.py)."""
    return "Removed shared tensor" not in record.getMessage()  # after accelerate's "[RANK 0] " prefix


@contextlib.contextmanager
def _tied_head_unannounced():
    logger = logging.getLogger("accelerate.utils.other")  # where accelerate's clean_state_dict_for_safetensors logs
    logger.addFilter(_not_the_tied_head_note)
    try:
        yield
    finally:
        logger.removeFilter(_not_the_tied_head_note)


def save_checkpoint(accelerator, output_dir: str | Path, step: int, state: dict, keep: int, sharded=None) -> Path:
    """Save accelerate's state plus `state` (JSON) as checkpoint-<step>, atomically; keep the last `keep`.
    `sharded`: (model, optimizer) that train.py sharded itself (--fsdp), which accelerate does not
    hold: each process writes its shards to `sharded/` (oar.training.sharding.save_sharded)."""
    root = Path(output_dir)
    final = root / f"checkpoint-{step}"
    tmp = root / f"checkpoint-{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    with _tied_head_unannounced():
        accelerator.save_state(str(tmp))
    if sharded is not None:
        from oar.training.sharding import save_sharded

        save_sharded(*sharded, tmp / "sharded")
    if accelerator.is_main_process:
        _write_json(tmp / "trainer_state.json", {**state, "step": step})
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():  # the same step saved before a crash: the new one replaces it
            shutil.rmtree(final)
        fsync_tree(tmp)  # on disk before the name says complete, even if the machine dies
        os.replace(tmp, final)
        _fsync(root)
        for old in checkpoints(root)[:-keep]:
            doomed = old.with_name(old.name + ".old")
            shutil.rmtree(doomed, ignore_errors=True)
            os.replace(old, doomed)  # atomic: out of the list at once, deleted below
        for stale in [*root.glob("checkpoint-*.tmp"), *root.glob("checkpoint-*.old")]:
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def read_state(path: str | Path) -> dict:
    """A checkpoint's trainer_state.json (cheap: read before anything is loaded)."""
    return json.loads((Path(path) / "trainer_state.json").read_text())


def skip_frozen(accelerator) -> None:
    """From now on accelerate's checkpoints hold the prepared models' trainable parameters only:
    frozen ones (LoRA's base weights) never change and are the model source's, loaded again at a
    resume (a checkpoint of a 7B model's adapters is megabytes, not its 15 GB of weights). At a
    load, every trainable parameter must be in the checkpoint. Call once, for a model with frozen
    parameters, and load with `load_checkpoint(..., frozen_skipped=True)`."""
    from safetensors import safe_open

    def trainable(model) -> set[str]:
        return {n for n, p in model.named_parameters() if p.requires_grad}

    def drop_frozen(models, weights, output_dir):
        for model, state in zip(models, weights, strict=True):
            keep = trainable(model)
            for key in [k for k in state if k not in keep]:
                del state[key]

    def check_complete(models, input_dir):
        for i, model in enumerate(models):
            with safe_open(str(Path(input_dir) / (f"model_{i}.safetensors" if i else "model.safetensors")), "pt") as f:
                missing = trainable(model) - set(f.keys())
            if missing:
                raise RuntimeError(
                    f"{input_dir} lacks {len(missing)} trainable parameters of the model "
                    f"(e.g. {sorted(missing)[0]}): it was written by a run with other trainable parameters."
                )

    accelerator.register_save_state_pre_hook(drop_frozen)
    accelerator.register_load_state_pre_hook(check_complete)


def load_checkpoint(accelerator, path: str | Path, sharded=None, frozen_skipped: bool = False) -> dict:
    """Restore accelerate's state from `path` (and `sharded`'s, see save_checkpoint); returns its
    trainer_state.json. `frozen_skipped`: the checkpoint holds the trainable parameters only (skip_frozen)."""
    accelerator.load_state(str(path), **({"strict": False} if frozen_skipped else {}))
    if sharded is not None:
        from oar.training.sharding import load_sharded

        load_sharded(*sharded, Path(path) / "sharded")
    return read_state(path)


def write_json_atomic(path: str | Path, obj) -> None:
    """Write JSON under a temporary name, then rename: a reader never sees half a file."""
    _write_json(Path(path), obj)


def _write_json(path: Path, obj) -> None:  # the checkpoint's writer (tests replace it to die mid-save)
    write_text_atomic(path, json.dumps(obj, indent=2))


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` under a temporary name, fsync it, then rename: a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # per process: two writers of one file never share it
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_tree(folder: Path) -> None:
    """Flush a folder's files and folders to disk, deepest first, then the folder itself: before a rename says
    it is complete (a checkpoint, the final model)."""
    for path in [*sorted(folder.rglob("*"), key=lambda x: len(x.parts), reverse=True), folder]:
        _fsync(path)


def _fsync(path: Path) -> None:
    """Flush a file's or a directory's (its entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
