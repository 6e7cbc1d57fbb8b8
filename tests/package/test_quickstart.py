"""The 30-second first command (a newcomer's report: the quick start offered only the 15-minute default run): three
steps of the default run with 50 held-out problems show every part of a run. Run as the README's quick start writes
it, from a plain `python train.py` with OMP_NUM_THREADS unset, as a user's shell has it, its --output_dir moved
under tmp_path. 15 s measured on this project's 2 shared cores (load average 2-2.8), about 3 s a step."""

import json
import re
import subprocess
import sys

import pytest

from test_docs import quick_start
from tinyrun import ROOT, TRAIN, check_ok, env


def first_command() -> list[str]:
    """The flags of the README's first `python train.py` command (after its `pip install ... &&`)."""
    (line,) = [line for line in quick_start() if "python train.py" in line]
    flags = line.split("python train.py", 1)[1].split()
    assert flags[:4] == ["--steps", "3", "--eval_size", "50"], line
    return flags


@pytest.mark.slow
def test_the_first_command_shows_every_part_of_a_run(tmp_path):
    out = tmp_path / "run"
    flags = first_command()
    flags[flags.index("--output_dir") + 1] = str(out)
    shell = {k: v for k, v in env().items() if k != "OMP_NUM_THREADS"}  # unset: the entry point picks one thread
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *flags],
        cwd=ROOT,
        env=shell,
        capture_output=True,
        text=True,
        timeout=600,
    )
    check_ok(proc)
    said = proc.stdout
    assert said.startswith("torch threads: 1") and "held-out accuracy before training" in said, said[:2000]
    assert len(re.findall(r"^step +\d+ \|", said, re.MULTILINE)) == 3 and "summary: " in said
    # no library's alarm about the checkpoint's tied head (accelerate's "Removed shared tensor"): resumes re-tie it
    assert "Removed shared tensor" not in said + proc.stderr, (said + proc.stderr)[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_problems"] == 50 and summary["accuracy_before"] == pytest.approx(0.4, abs=0.2)
    assert summary["skipped_steps"] == 0 and summary["accuracy_after"] is not None
    for name in ("config.json", "metrics.jsonl", "metrics.png", "eval_final.jsonl", "final/model.safetensors"):
        assert (out / name).is_file(), name
    assert (out / "checkpoint-3" / "trainer_state.json").is_file()
