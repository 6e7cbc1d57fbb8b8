"""Where the built-in policy tiny-arith comes from: the weights shipped in `oar/tasks/tiny-arith/`, or a build.

The repository ships one build (SHIPPED: 3.2 MB of safetensors, made by scripts/build_tiny_arith.py
at seed 0 with the default recipe but one torch thread, `num_threads` 1 where the default is 2, as its
build_info.json records with its weights' hash), so `--model tiny-arith`
starts from the same weights and held-out accuracy on every machine: a build depends on the CPU
(float rounding over 1,300 steps; docs/default-run.md). A build from scratch goes into a cache folder,
once: a lock so that concurrent processes (e.g. `accelerate launch`) build it once, and an atomic
publish so a killed build never leaves a folder that looks complete. The model, its tokenizer and
its training are in oar/tasks/tiny_arith.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

from oar.tasks.tiny_arith import BUILDER_VERSION, TinyArithRecipe, train_tiny_arith

SHIPPED = Path(__file__).resolve().parent / "tiny-arith"  # the build that ships with the repository


def build_tiny_arith(
    out_dir: str | Path,
    *,
    seed: int = 0,
    recipe: TinyArithRecipe = TinyArithRecipe(),
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Train tiny-arith and save it to `out_dir` atomically; returns what build_info.json holds.

    `log` receives progress lines (e.g. `print`); the default is silent. One build per folder at a
    time: a second caller (another process of `accelerate launch`, or this script while a run
    builds the cache) waits on a lock file, then finds the folder built (FileExistsError unless
    `overwrite`). The model is written to a temporary folder beside `out_dir` and renamed into
    place, so a killed build never leaves a folder that looks complete.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out_dir.parent / f".{out_dir.name}.lock"):
        if out_dir.exists() and not overwrite:
            raise FileExistsError(
                f"{out_dir} already exists; remove it or pass overwrite=True "
                f"(--overwrite on the command line) to rebuild it."
            )
        model, tok, info = train_tiny_arith(seed, recipe, log)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; the published folder reads like any other
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            _name_tokenizer_class(tmp / "tokenizer_config.json")
            info["weights_sha256"] = weights_sha256(tmp)  # what the shipped build is checked against
            (tmp / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")  # last: marks done
            _publish(tmp, out_dir, overwrite)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # a no-op once renamed
    return info


def _name_tokenizer_class(config_path: Path) -> None:
    """Record the class as PreTrainedTokenizerFast: transformers 5 saves 'TokenizersBackend', which
    transformers 4 cannot load, while both load 'PreTrainedTokenizerFast'."""
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def _publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Rename the finished `tmp` to `out_dir`; keep an existing build unless `overwrite`."""
    if overwrite and out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old / out_dir.name)  # move aside first: a dir cannot replace a full dir
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if not is_complete(out_dir):
            raise  # not the benign race: something else is in the way
        # Another process published first; its build is as good as ours (same seed and recipe).


def is_complete(model_dir: Path) -> bool:
    """Whether `model_dir` holds a finished build (build_info.json is written last, then renamed)."""
    return (Path(model_dir) / "build_info.json").is_file()


def default_model_dir() -> Path:
    """Where the built model is cached: `$OAR_CACHE` or `~/.cache/oar`, then BUILDER_VERSION."""
    root = os.environ.get("OAR_CACHE") or Path.home() / ".cache" / "oar"
    return Path(root).expanduser() / BUILDER_VERSION


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive advisory lock so concurrent processes build once, not once each."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone still prevents a corrupt folder
        yield
        return
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_tiny_arith(model_dir: str | Path | None = None) -> Path:
    """The folder of the built tiny-arith model (default `default_model_dir()`), built if absent.

    Safe to call from several processes at once (e.g. `accelerate launch`): one builds, the others
    wait on its lock (see build_tiny_arith) and then use the finished folder.
    """
    path = Path(model_dir) if model_dir is not None else default_model_dir()
    if is_complete(path):
        return path
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    say(f"oar: tiny-arith is not built at {path}; building it (a few minutes on a CPU, once)...")
    try:
        info = build_tiny_arith(path, log=say)
    except FileExistsError:
        if not is_complete(path):
            raise FileExistsError(
                f"{path} exists but holds no finished tiny-arith build (no "
                f"build_info.json); remove the folder and it will be rebuilt."
            ) from None
        return path  # another process built it while we waited for the lock
    say(f"oar: built tiny-arith in {info['build_seconds']:.0f} s, held-out accuracy {info['heldout_accuracy']:.1%}")
    return path


def weights_sha256(model_dir: str | Path) -> str:
    """A hash of the tensors (names, dtypes, shapes, bytes) of a saved model, not of the file's header."""
    from safetensors.numpy import load_file

    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors = load_file(path)
        for name in sorted(tensors):
            t = tensors[name]
            digest.update(f"{name}:{t.dtype}:{t.shape};".encode())
            digest.update(t.tobytes())
    return digest.hexdigest()


def shipped_model() -> Path | None:
    """The shipped build when it is there and of this BUILDER_VERSION (else None: a build is needed).
    Its weights must hash as recorded: a changed or truncated file (e.g. a Git LFS pointer) stops here."""
    info_path = SHIPPED / "build_info.json"
    if not info_path.is_file():
        return None
    info = json.loads(info_path.read_text())
    if info.get("builder") != BUILDER_VERSION:
        return None
    if weights_sha256(SHIPPED) != info.get("weights_sha256"):
        raise RuntimeError(
            f"{SHIPPED}: the shipped tiny-arith weights do not hash as build_info.json records; "
            f"restore them (git checkout -- {SHIPPED}) or build a model with scripts/build_tiny_arith.py "
            f"and pass its folder as --model."
        )
    return SHIPPED


def model_source(name: str) -> str:
    """A `--model` value as `oar.training.models.load_model` takes it: for 'tiny-arith' the shipped
    build (or, without one, the cached build, built on first use: minutes), any other name unchanged.
    The entry points resolve the built-in name here, so the core (oar/training/models.py) does not
    depend on the toy task."""
    if name != "tiny-arith":
        return name
    return str(shipped_model() or ensure_tiny_arith())
