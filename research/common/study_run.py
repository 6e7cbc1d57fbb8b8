"""One run of a study: train.py as a child process, resumable, timed, checked against what it was asked to train.

`run_one` brings a run folder to completion: a folder with summary.json is done (and must hold the
settings and starting model asked for), one with a checkpoint resumes with --resume, one with neither
starts again. Each invocation adds its wall-clock and CPU seconds, the code's hash and the machine it ran on
(`machine`) to the folder's study_time.json, and records its starting model and exit code there (the last
invocation's) (one killed before it could adds to its count of unmeasured invocations). A run is held by one
study process at a time (`claimed`), so a second process over the same --root takes the next free run instead.
Used by research/signal-or-gate/study.py, research/testbeds_v5/study_v5.py and research/real_smollm2/study_real.py;
the first evidence study's script is retired (its results: research/arith_v4/).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from oar.training.checkpoint import run_code_version  # noqa: E402
from oar.training.checkpoint import latest_checkpoint, write_json_atomic  # noqa: E402
from oar.training.config import Config  # noqa: E402
from oar.training.resume import RESUMABLE  # noqa: E402

# Settings that change neither what a study trains nor what it measures: what a resume may change
# (train.py's RESUMABLE) but the step count and the held-out evaluation's (a resume may change those, but a
# finished run evaluated on 50 problems is not one of a plan of 200). The report compares runs by the others.
UNMEASURED = RESUMABLE - {"steps", "eval_dataset", "eval_size", "eval_every", "score_all"}


def effective(settings: dict) -> dict:
    return asdict(Config()) | settings


def run_dir(args, run) -> Path:
    return args.root / f"{run['name']}-s{run['seed']}"


def command(settings: dict, out: Path, seed: int, resume: bool) -> list[str]:
    cmd = [sys.executable, str(ROOT / "train.py")]
    for key, value in (settings | {"seed": seed, "output_dir": str(out)}).items():
        cmd += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return cmd + (["--resume", "true"] if resume else [])


def run_one(args, run) -> str:
    """Bring one run to completion: 'done' (skipped), 'ok', 'failed', or 'busy' (another study process over
    the same --root holds it: `claimed`)."""
    out = run_dir(args, run)
    with claimed(out) as lock:
        if lock is None:
            print(f"[study] busy   {out.name}: another study process is running it; the next run", flush=True)
            return "busy"
        return _run_claimed(args, run, out, lock)


@contextmanager
def claimed(out: Path):
    """Yields the lock's file descriptor when this process holds run folder `out`, else None: an
    exclusive advisory lock on a file beside it, which the system releases when every process holding it
    has ended, however it ended (a kill, a lost machine). The study passes it to its train.py, so a study
    killed outright (SIGKILL) leaves the run held until that train.py ends too. So two study processes
    over one --root (one per free core) run different runs side by side, never one twice, and a run
    whose holders died is free at once."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        yield handle.fileno()


def _run_claimed(args, run, out: Path, lock: int) -> str:
    if (out / "summary.json").exists():
        saved = json.loads((out / "config.json").read_text())
        ignore = UNMEASURED | {"resume"}
        # a setting newer than the run (absent from its config.json) ran as its default:
        # new settings default to the old behaviour
        saved = asdict(Config()) | saved
        wrong = {
            k: (v, saved.get(k))
            for k, v in effective(run["settings"] | {"seed": run["seed"]}).items()
            if k not in ignore and saved.get(k) != v
        }
        timing = _timing(out)
        built = timing.get("model")
        if None not in (built, model_ident(run["settings"]["model"])) and built != model_ident(
            run["settings"]["model"]
        ):
            wrong["model build"] = (model_ident(run["settings"]["model"]), built)
        if wrong:
            raise SystemExit(
                f"study.py: error: {out} is a finished run with other settings {wrong} (wanted, found); "
                f"use another --root, or delete the folder to rerun it."
            )
        if (exit_code := timing.get("exit")) not in (
            0,
            None,
        ):  # summary.json and the model were written, then it failed
            print(
                f"[study] note   {out.name}: finished (summary.json), but train.py then exited {exit_code}; "
                f"its results are kept, see {out / 'train.log'}",
                flush=True,
            )
        return "done"
    resume = latest_checkpoint(out) is not None
    if out.exists() and not resume:
        shutil.rmtree(out)  # interrupted before its first checkpoint: nothing worth keeping
    out.mkdir(parents=True, exist_ok=True)
    cmd = command(run["settings"], out, run["seed"], resume)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    print(f"[study] {'resume' if resume else 'start '} {out.name}: {' '.join(cmd[1:])}", flush=True)
    # An invocation is marked open while it runs: one killed outright (SIGKILL, the machine gone) never
    # writes its time, and the next one counts it as unmeasured, so the report does not show a partial time as whole.
    before = _timing(out)
    unmeasured = before.get("unmeasured", 0) + int(bool(before.get("open")))
    write_json_atomic(out / "study_time.json", before | {"open": True, "unmeasured": unmeasured})
    version = code_version(run["settings"].get("credit_module", ""))  # what train.py will run: taken before it starts
    start, cpu, code = time.time(), _child_cpu(), None
    try:
        with open(out / "train.log", "a") as log:  # the child holds the run's lock too (`claimed`)
            code = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=(lock,)
            ).returncode
    finally:  # also when the study is stopped: a resumed run's time adds up over its invocations
        write_json_atomic(
            out / "study_time.json",
            {
                "seconds": before.get("seconds", 0.0) + time.time() - start,
                "cpu_seconds": before.get("cpu_seconds", 0.0) + _child_cpu() - cpu,
                "invocations": before.get("invocations", 0) + 1,
                "unmeasured": unmeasured,
                "model": model_ident(run["settings"]["model"]),
                "code": sorted(set(before.get("code", [])) | {version}),
                "exit": code,  # None: the study was stopped
                "machines": (seen := before.get("machines", [])) + [here for here in [machine()] if here not in seen],
            },
        )
    if code != 0:
        tail = (out / "train.log").read_text().splitlines()[-15:]
        print(
            f"[study] FAILED {out.name} (exit {code}); last lines of {out / 'train.log'}:\n  " + "\n  ".join(tail),
            flush=True,
        )
        return "failed"
    print(f"[study] done   {out.name} in {(time.time() - start) / 60:.1f} min", flush=True)
    return "ok"


def _timing(out: Path) -> dict:
    """The run folder's study_time.json ({} before its first invocation)."""
    return json.loads((out / "study_time.json").read_text()) if (out / "study_time.json").exists() else {}


def code_version(credit_module: str = "") -> str:
    """The code a run executes (oar.training.checkpoint.code_version: train.py, oar/**/*.py), with its
    --credit_module file if it names one: the report warns when the runs it compares were made by
    different code (the tree may change during a study)."""
    return run_code_version(credit_module, base=ROOT)  # a relative path is train.py's, which runs in ROOT


def machine() -> dict:
    """Where an invocation ran: the processor, its widest vector instructions, the cores, and the versions of
    the libraries that do the arithmetic. One seed can sample differently on two machines or builds (the
    signal-or-gate study found a pre-training evaluation of 32 against 33 of 400), so runs made on two
    machines pair by prompts and seeds, not by arithmetic; this says which runs those are."""
    import platform
    from importlib import metadata

    cpu, flags = platform.processor() or platform.machine(), set()
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    simd = next((name for name in ("avx512f", "avx2", "neon", "asimd") if name in flags), None)
    versions = {}
    for name in ("torch", "transformers", "accelerate", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {"cpu": cpu, "simd": simd, "cores": os.cpu_count(), "python": platform.python_version(), **versions}


def _child_cpu() -> float:
    """CPU seconds of finished children: on cores shared with other jobs, steadier than wall-clock."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def model_ident(model: str) -> str | None:
    """What a run started from: the name, or for tiny-arith its builder version and a hash of the
    recipe it was built with (a recipe change without a version bump must not pass as the same
    model); None while tiny-arith is not built (nothing to compare)."""
    if model != "tiny-arith":
        return model
    from oar.tasks.tiny_arith import BUILDER_VERSION
    from oar.tasks.tiny_arith_cache import default_model_dir, shipped_model

    info = (shipped_model() or default_model_dir()) / "build_info.json"
    if not info.exists():
        return None
    built = json.loads(info.read_text())
    digest = hashlib.sha1(json.dumps([built["recipe"], built["seed"]], sort_keys=True).encode()).hexdigest()[:10]
    return f"{BUILDER_VERSION}:{digest}"
