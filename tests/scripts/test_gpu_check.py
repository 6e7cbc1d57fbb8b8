"""scripts/bench/gpu_check.py, the one script a GPU machine runs (docs/gpu.md), on the CPU with tiny shapes: every
phase runs through the same code a GPU run takes and writes what the GPU run would, so a typo cannot waste a lease;
and a phase that would not fit is skipped, with the JSON still written."""

import json
import subprocess
import sys

import pytest
from tinyrun import ROOT, env

SCRIPT = ROOT / "scripts" / "bench" / "gpu_check.py"


def run(tmp_path, *flags):
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--json", str(out), *flags],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["phases"]


@pytest.mark.slow  # ~15 s on 2 cores (more on a loaded machine): 9 tiny train.py runs
def test_every_phase_runs_on_the_cpu_and_writes_its_numbers(tmp_path):
    phases = run(tmp_path)
    assert list(phases) == ["ceilings", "steps", "oar_p_budgets", "sampler", "lora_7b", "precision"]
    errors = {name: p["traceback"] for name, p in phases.items() if "error" in p}
    assert not errors, errors
    assert not [name for name, p in phases.items() if "skipped" in p]
    assert phases["ceilings"]["copy_gbs"] > 0 and phases["ceilings"]["bf16_matmul_tflops"] > 0
    runs = phases["steps"]["runs"]
    assert len(runs) == 8 and all(len(r["steps"]) == 2 for r in runs.values())
    for name in ("oar-g/answer_joint", "oar-g/answer_mean", "oar-p/auto"):
        for key in (name, f"{name}/checkpointing"):
            assert runs[key]["ratio_to_grpo"] > 0 and runs[key]["peak_bytes"] >= 0
            assert runs[key]["steps"][-1]["oar/frac_scored"] > 0  # OAR had reasoning tokens to score
    modes = phases["oar_p_budgets"]["modes"]
    assert set(modes) == {"exact", "window"}
    for mode in modes.values():
        budgets = mode["budgets"]
        assert str(mode["before"]) in budgets and budgets["device"]["device_chose"] == [8192]  # a CPU's budget
        assert len(budgets) == 4 and all(b["seconds"] > 0 for b in budgets.values())
        assert all(b["max_diff_of_largest_score"] <= 1e-2 for b in budgets.values())  # a schedule, not maths
    sampler = phases["sampler"]
    assert sampler["variants"]["eager"]["tokens_per_s"] > 0 and sampler["variants"]["hf_generate"]["tokens_per_s"] > 0
    cast = sampler["autocast_float32_weights"]  # its sign is noise at these sizes on a CPU: only that it ran
    assert cast["cast_once"]["tokens_per_s"] > 0 and cast["cast_every_step"]["tokens_per_s"] > 0
    assert len(phases["lora_7b"]["steps"]) == 2
    assert set(phases["precision"]["methods"]) == {"oar-p/answer_mean", "oar-g/answer_joint", "oar-g/answer_mean"}


def test_a_phase_that_would_not_fit_is_skipped_and_said(tmp_path):
    phases = run(tmp_path, "--budget_s", "0", "--phases", "ceilings,steps")
    assert list(phases) == ["ceilings", "steps"]
    assert all("skipped" in p and "s left" in p["skipped"] for p in phases.values())
