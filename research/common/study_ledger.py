"""A study's finished work kept in the repository, so that it resumes on another machine.

A study's root (models, checkpoints, logs) lives on one machine and is lost with it; this ledger keeps
what resuming and the report need: each testbed's starting model (3 MB: tiny-arith v4's recipe and seed
give bitwise one model on one machine whatever the thread count or torch version, but another machine
built another one, 23.4% against 45.2% held-out, so a rebuild cannot be trusted to match), its build
record with a hash of its weights, its attribution, and each finished run's config.json, summary.json,
metrics.jsonl and study_time.json (a few kB). On a new machine the study copies the kept models into
its root instead of building them; a testbed built anew is checked against the recorded hash, and the
ledger's runs are restored only when it matches, otherwise the study stops: a report mixing two
starting models would be silently wrong.

    ledger/models/<testbed>/                  the starting model, as built
    ledger/builds/<testbed>.json              build_info.json + weights_sha256
    ledger/attribution/<testbed>.json
    ledger/runs/<testbed>/<method>-s<seed>/   the run's four small files + ledger.json (the weights' hash)
                                              + eval_final.jsonl.gz (its held-out completions, ~20 kB)

Every entry is written under a temporary name and renamed, so a killed study never leaves half of one.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
from pathlib import Path

from oar.tasks.tiny_arith_cache import weights_sha256  # noqa: F401 - the hash of a build, used by the studies
from oar.training.checkpoint import write_text_atomic
from research.common.study_run import claimed

RUN_FILES = ("config.json", "summary.json", "metrics.jsonl", "study_time.json")


def run_entry(ledger: Path, testbed: str, run_name: str) -> Path:
    """Where the ledger keeps the run `run_name` (`<method>-s<seed>`) of `testbed`."""
    return Path(ledger) / "runs" / testbed / run_name


def check_build(ledger: Path, testbed: str, model_dir: Path) -> str:
    """Record the testbed's build in the ledger ('recorded'), or check that the model at `model_dir`
    is the recorded one ('matches'; a stop otherwise); the ledger keeps a copy of the model either way."""
    path, kept = Path(ledger) / "builds" / f"{testbed}.json", Path(ledger) / "models" / testbed
    built = json.loads((Path(model_dir) / "build_info.json").read_text()) | {
        "weights_sha256": weights_sha256(model_dir)
    }
    status = "matches" if path.exists() else "recorded"
    if status == "recorded":
        if any((Path(ledger) / "runs" / testbed).glob("*")):
            raise SystemExit(
                f"study: error: {Path(ledger) / 'runs' / testbed} holds runs but {path} is missing: "
                f"which model they started from is unknown; restore the file or use another --ledger."
            )
        _write(path, built)
    recorded = json.loads(path.read_text())
    if recorded["weights_sha256"] != built["weights_sha256"]:
        raise SystemExit(
            f"study: error: testbed {testbed} at {model_dir} is not the model the ledger's runs started from "
            f"(weights hash {built['weights_sha256'][:12]} here, {recorded['weights_sha256'][:12]} in {path}; "
            f"held-out accuracy {built.get('heldout_accuracy')} vs {recorded.get('heldout_accuracy')}). "
            f"A rebuild on another "
            f"machine can differ; use another --ledger to start a new study."
        )
    if not kept.exists():
        _copy_folder(Path(model_dir), kept)
    return status


def restore_model(ledger: Path, testbed: str, model_dir: Path) -> bool:
    """Copy the kept starting model to `model_dir` when it is not there; whether it was copied."""
    kept = Path(ledger) / "models" / testbed
    if Path(model_dir).exists() or not (kept / "build_info.json").is_file():
        return False
    _copy_folder(kept, Path(model_dir))
    return True


def restore(ledger: Path, root: Path, testbed: str, model_dir: Path) -> int:
    """Copy the ledger's attribution and finished runs of `testbed` into `root` where `root` lacks them
    (after check_build): only complete entries recorded from the build's weights; each restored run's
    records are given the paths of `model_dir` and its new folder. The number of runs restored."""
    ledger, root = Path(ledger), Path(root)
    _copy_if_absent(ledger / "attribution" / f"{testbed}.json", root / "attribution" / f"{testbed}.json")
    weights = _build_weights(ledger, testbed)
    restored = 0
    for kept in sorted(p for p in (ledger / "runs" / testbed).glob("*") if not p.name.startswith(".")):
        out = root / testbed / kept.name
        if (out / "summary.json").exists():
            continue
        missing = [n for n in (*RUN_FILES, "ledger.json") if not (kept / n).is_file()]
        if missing or json.loads((kept / "ledger.json").read_text())["weights_sha256"] != weights:
            raise SystemExit(
                f"study: error: {kept} is "
                f"{'incomplete (no ' + ', '.join(missing) + ')' if missing else 'from other weights than the build'}; "
                f"delete it and the run is made again."
            )
        with claimed(out) as lock:
            if lock is None:  # another study process (or its train.py) is running it here: not replaced under it
                print(
                    f"[study] {out.name} is running in another study process: not restored from the ledger", flush=True
                )
                continue
            if (out / "summary.json").exists():  # looked at again under the lock: a run that another process
                continue  # finished between the first look and the lock is its result, not the ledger's to replace
            with _staged(out) as tmp:  # replaces an unfinished attempt here: the ledger holds the finished one
                shutil.copytree(kept, tmp, ignore=shutil.ignore_patterns(".*"))  # not a write cut short
                (tmp / "ledger.json").unlink()
                _repoint(tmp, out, model_dir)
        restored += 1
    return restored


def record_run(ledger: Path, root: Path, testbed: str, run_name: str) -> bool:
    """Keep a finished run (`root/<testbed>/<run_name>`) in the ledger, with the hash of the weights
    it started from (the build's), and its held-out completions; whether it was new to the ledger (a
    kept run is never rewritten; one kept without its completions gets them). A kept run of the same name
    whose summary.json differs is another run (another machine's, a rerun): refused, since the report
    would read the kept one while the study went on from this one. Recorded under the run's lock
    (`claimed`): a second study process that found the run finished while this one records it leaves it
    to this one (False), so the two never write one entry at once."""
    src, dst = Path(root) / testbed / run_name, run_entry(ledger, testbed, run_name)
    if not (src / "summary.json").exists():
        raise ValueError(f"{src} is not a finished run (no summary.json)")
    with claimed(src) as lock:
        return lock is not None and _record_claimed(ledger, root, testbed, run_name, src, dst)


def _record_claimed(ledger: Path, root: Path, testbed: str, run_name: str, src: Path, dst: Path) -> bool:
    new = not dst.exists()
    if (
        not new
        and (dst / "summary.json").is_file()
        and (dst / "summary.json").read_bytes() != (src / "summary.json").read_bytes()
    ):
        raise ValueError(
            f"{src} and the ledger's {dst} are two different runs of one name (their summary.json differ): "
            f"keep one. To keep the ledger's, delete {src} (the study restores it); to keep this one, "
            f"delete {dst}."
        )
    if new:
        with _staged(dst) as tmp:
            tmp.mkdir()
            for name in RUN_FILES:
                shutil.copy2(src / name, tmp / name)
            _write(tmp / "ledger.json", {"weights_sha256": _build_weights(ledger, testbed)})
    record_completions(ledger, root, testbed, run_name)
    return new


def record_completions(ledger: Path, root: Path, testbed: str, run_name: str) -> bool:
    """Add a kept run's final held-out completions (eval_final.jsonl, gzipped) to its ledger entry
    when the entry lacks them and the run folder has them and is the entry's run (the same
    summary.json: another machine's run of the same name is not); whether it added them. The
    report reads each run's flaw rates from them."""
    src, entry = Path(root) / testbed / run_name, run_entry(ledger, testbed, run_name)
    dst = entry / "eval_final.jsonl.gz"
    if not (src / "eval_final.jsonl").is_file() or dst.exists() or not (entry / "summary.json").is_file():
        return False
    if (src / "summary.json").read_bytes() != (entry / "summary.json").read_bytes():
        return False
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    tmp.write_bytes(
        gzip.compress((src / "eval_final.jsonl").read_bytes(), mtime=0)
    )  # no name, no time: the same bytes anywhere
    tmp.rename(dst)
    return True


def record_attribution(ledger: Path, root: Path, testbed: str) -> None:
    _copy_if_absent(Path(root) / "attribution" / f"{testbed}.json", Path(ledger) / "attribution" / f"{testbed}.json")


def _build_weights(ledger: Path, testbed: str) -> str:
    return json.loads((Path(ledger) / "builds" / f"{testbed}.json").read_text())["weights_sha256"]


def _copy_if_absent(src: Path, dst: Path) -> None:
    if src.exists() and not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        shutil.copy2(src, tmp)
        tmp.replace(dst)  # a copy cut short is never taken for the file (it is not repaired once there)


def _repoint(run: Path, final: Path, model_dir: Path) -> None:
    """A restored run's records name the model and output folders of the machine that made it; they
    are given `model_dir` and the run's `final` folder."""
    config = json.loads((run / "config.json").read_text())
    config |= {"model": str(model_dir), "output_dir": str(final)}
    (run / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    timing = run / "study_time.json"
    t = json.loads(timing.read_text())
    if isinstance(t.get("model"), str) and Path(t["model"]).name == Path(model_dir).name:
        timing.write_text(json.dumps(t | {"model": str(model_dir)}) + "\n")


@contextlib.contextmanager
def _staged(dst: Path):
    """A temporary path beside `dst` to fill; renamed to `dst` (replacing it) once the block ends
    without error, so `dst` is never seen half written."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield tmp
    except BaseException:  # a copy that failed leaves nothing behind (one killed outright does: *.tmp, never read)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)


def _copy_folder(src: Path, dst: Path) -> None:
    with _staged(dst) as tmp:
        shutil.copytree(src, tmp)


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")
