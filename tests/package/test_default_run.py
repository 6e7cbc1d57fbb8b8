"""The default run's first three steps, against a recorded reference (tests/data/default_run_3_steps.json).

`accelerate launch train.py` with no flags trains tiny-arith (the weights shipped in
oar/tasks/tiny-arith/) with OAR-G on arith. Its first three steps are re-run here with every setting
that moves their numbers at its default: `python train.py --steps 3 --eval_size 1` on one torch
thread, as `accelerate launch` without a config runs it (OMP_NUM_THREADS=1). `--eval_size 1` only
shortens the held-out evaluations before and after training; they sample with their own seeded
generators, so they change no training number. Every logged metric but the wall-clock ones must be
equal to the recorded float, and the final weights must hash equal: on a CPU the run is
deterministic (two runs of the same commit agree bit for bit), so a refactor that changes any number
of the default run, however little, fails here. The thread count is pinned: on two threads (measured
at the recording commit) the weights and every metric are the same except sampler/logprob_diff_*,
the rounding gap between the cached decode and the update forward, which moves in its 7th digit.

Another CPU kind moves the floats (docs/default-run.md: the RL curve moves by rounding between CPUs):
torch picks its kernels by the CPU's capability (AVX2, AVX512, ...). So the file keeps one recording per
CPU kind, named by the CPU and the capability torch uses, and the test compares with this machine's
(or, for a kind never recorded, with the first recording, whose capability was not written down).

Record this machine's kind (a new kind: after checking that the first recording's own commit gives the
same numbers here as HEAD; a change of the numbers: only when intended, and say why in the commit):
    python tests/package/test_default_run.py --record
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, when run as a script (--record)
from tinyrun import ROOT, TIME_KEYS, TRAIN, check_ok, env  # noqa: E402

RECORD = ROOT / "tests" / "data" / "default_run_3_steps.json"
ARGS = ["--steps", "3", "--eval_size", "1"]


def weights_sha256(path: Path) -> str:
    """sha256 over the tensors of a safetensors file: each name, dtype, shape and raw bytes, in name
    order. The tensors, not the file: a header written in another order by another version of the
    serializer is the same weights."""
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for name, t in sorted(load_file(str(path)).items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_default(out: Path) -> dict:
    """Run the default command into `out`; returns {"metrics": [...], "weights_sha256": ...}."""
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *ARGS, "--output_dir", str(out)],
        check=False,
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    check_ok(proc)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "metrics": [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in rows],
        "weights_sha256": weights_sha256(out / "final" / "model.safetensors"),
    }


@pytest.mark.slow  # ~25 s alone on one thread of this project's CPU, up to 45 s on shared cores
def test_the_default_run_logs_the_recorded_numbers(tmp_path):
    want = recording(json.loads(RECORD.read_text())["recordings"])
    got = run_default(tmp_path / "run")
    where = (
        f"recorded at {want['recorded_at_commit']} on {want['machine']} "
        f"({want['cpu_capability'] or 'capability not recorded'}, torch {want['torch']}); "
        f"this is {cpu_name()} ({cpu_capability()}, torch {torch.__version__}). "
        "On the same CPU kind and torch a difference is a change of the run; "
        "on another, compare with the recording's commit on this machine first"
    )
    assert len(got["metrics"]) == len(want["metrics"]) == 3
    for step, (g, w) in enumerate(zip(got["metrics"], want["metrics"]), start=1):
        # every recorded metric is still logged under its name; metrics added since (reward/<term>) are new keys
        assert w.keys() <= g.keys(), f"step {step}: recorded metrics no longer logged: {sorted(w.keys() - g.keys())}"
        moved = {k: (w[k], g[k]) for k in w if g[k] != w[k]}  # exact: the run is deterministic on a CPU
        assert not moved, f"step {step}: (recorded, now) {moved}; {where}"
    assert got["weights_sha256"] == want["weights_sha256"], (
        f"the final weights differ from the recorded run's; {where}"
    )


def cpu_capability() -> str:
    """The instruction set torch's CPU kernels were chosen for on this machine (AVX2, AVX512, ...)."""
    return torch.backends.cpu.get_cpu_capability()


def recording(recordings: list[dict]) -> dict:
    """This machine's kind's recording: the same CPU name and capability, else the first (kind not recorded)."""
    here = [r for r in recordings if (r["machine"], r["cpu_capability"]) == (cpu_name(), cpu_capability())]
    return (here or recordings)[0]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def record() -> None:
    import tempfile

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], check=True, cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "oar", "train.py"], check=True, cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        result = run_default(Path(tmp) / "run")
    kind = {"machine": cpu_name(), "cpu_capability": cpu_capability()}
    this = {
        "recorded_at_commit": commit + (" (with uncommitted changes to oar/ or train.py)" if dirty else ""),
        **kind,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        **result,
    }
    others = (
        [r for r in json.loads(RECORD.read_text())["recordings"] if {k: r[k] for k in kind} != kind]
        if RECORD.is_file()
        else []
    )
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(
        json.dumps(
            {
                "what": "the first 3 steps of `accelerate launch train.py` (OAR-G, tiny-arith, arith): "
                "every logged metric but time/* and oar/seconds_per_rollout, "
                "and the sha256 of final/model.safetensors's tensors, "
                "one recording per CPU kind (tests/package/test_default_run.py)",
                "command": "OMP_NUM_THREADS=1 python train.py " + " ".join(ARGS),
                "recordings": others + [this],
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {RECORD}: {len(others) + 1} recording(s)")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        raise SystemExit("usage: python tests/package/test_default_run.py --record   (or run it with pytest)")
    record()
