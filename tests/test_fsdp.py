"""FSDP2 on 2 CPU processes (`accelerate launch --multi_gpu --num_processes 2 train.py --fsdp`) gives
the update of one unsharded process: the GPU path (configs/fsdp2.yaml, accelerate's plugin) runs
the same gather/reshard code on a model accelerate shards, and cannot be launched on this machine
(accelerate's FSDP plugin falls back to DDP without a GPU).

Each run must leave the 1-process run's parameters (within 1e-5) in a final/ folder that
from_pretrained loads: GRPO, OAR-P with --num_iterations 2 (rollout reuse on the sharded model),
and OAR-G stopped after step 1 and resumed from its sharded checkpoint. Each process holds about
half of the parameters and AdamW states an unsharded (DDP) process holds.
"""

import json

import pytest

from tinyrun import TINY, check_ok, final_params, initial_params, launch, max_abs_diff, run_inprocess

RUNS = {"grpo": ["--method", "grpo"], "oar-p/mu2": ["--method", "oar-p", "--num_iterations", "2"], "oar-g/resumed": ["--method", "oar-g"]}


def _args(model, out, setting, *extra):
    return ["--model", str(model), "--dataset", str(model / "data.jsonl"), "--output_dir", str(out),
            "--steps", "2", "--save_every", "1", "--micro_batch_size", "2", *TINY, *RUNS[setting], *extra]


@pytest.mark.slow
@pytest.mark.parametrize("setting", RUNS)
def test_fsdp_two_processes_equal_one(tiny_model, tmp_path, setting):
    from transformers import AutoModelForCausalLM

    one, two = tmp_path / "one", tmp_path / "fsdp"
    run_inprocess(_args(tiny_model, one, setting, "--micro_batch_size", "8"))
    if setting.endswith("resumed"):  # step 1, its sharded checkpoint, then step 2 in a new launch
        check_ok(launch(_args(tiny_model, two, setting, "--fsdp", "--steps", "1")))
        assert (two / "checkpoint-1" / "sharded" / ".metadata").is_file()
        proc = launch(_args(tiny_model, two, setting, "--fsdp", "--resume"))
        check_ok(proc)
        assert "(step 1)" in proc.stdout
    else:
        check_ok(launch(_args(tiny_model, two, setting, "--fsdp")))
    assert max_abs_diff(final_params(one), initial_params(tiny_model)) > 1e-4  # an update to compare
    assert max_abs_diff(final_params(two), final_params(one)) <= 1e-5
    loaded = AutoModelForCausalLM.from_pretrained(two / "final")  # a plain save_pretrained folder
    want = final_params(one)
    assert max(float((p - want[k]).abs().max()) for k, p in loaded.state_dict().items() if k in want) <= 1e-5

    summary = json.loads((two / "summary.json").read_text())
    assert summary["processes"] == 2
    # Sharded along dim 0 with padding to a multiple of 2: a hair over half of the unsharded bytes.
    assert 0.5 <= summary["param_optimizer_bytes"] / summary["param_optimizer_bytes_unsharded"] <= 0.52
    alone = json.loads((one / "summary.json").read_text())
    assert alone["param_optimizer_bytes"] == alone["param_optimizer_bytes_unsharded"] == summary["param_optimizer_bytes_unsharded"]


def test_fsdp_needs_processes(tiny_model, tmp_path):
    with pytest.raises(SystemExit, match="--fsdp shards over processes"):
        run_inprocess(_args(tiny_model, tmp_path / "run", "grpo", "--fsdp"))
