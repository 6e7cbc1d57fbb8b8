"""FSDP2 on 2 CPU processes (`accelerate launch --config_file configs/fsdp2.yaml --num_processes 2 train.py`) gives
the update of one unsharded process: the GPU path (configs/fsdp2.yaml, accelerate's plugin) runs
the same gather/reshard code on a model accelerate shards, and cannot be launched on this machine
(accelerate's FSDP plugin falls back to DDP without a GPU).

Each run must leave the 1-process run's parameters (within 1e-5) in a final/ folder that
from_pretrained loads: GRPO, OAR-P with --num_iterations 2 (rollout reuse on the sharded model),
OAR-G stopped after step 1 and resumed from its sharded checkpoint, and entropy-mask (a forward of
the sharded model before the update, and a threshold gathered over both processes). Each process holds about
half of the parameters and AdamW states an unsharded (DDP) process holds.
"""

import json

import pytest
import torch

from tinyrun import TINY, check_ok, final_params, initial_params, launch, max_abs_diff, run_inprocess

RUNS = {
    "grpo": ["--method", "grpo"],
    "oar-p/mu2": ["--method", "oar-p", "--num_iterations", "2"],
    "oar-g/resumed": ["--method", "oar-g"],
    "entropy-mask": ["--method", "entropy-mask"],
}  # its own no-grad forward of the sharded model, and a gather


def _args(model, out, setting, *extra):
    return [
        "--model",
        str(model),
        "--dataset",
        str(model / "data.jsonl"),
        "--output_dir",
        str(out),
        "--steps",
        "2",
        "--save_every",
        "1",
        "--micro_batch_size",
        "2",
        *TINY,
        *RUNS[setting],
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("setting", RUNS)
def test_fsdp_two_processes_equal_one(tiny_model, tmp_path, setting):
    from transformers import AutoModelForCausalLM

    one, two = tmp_path / "one", tmp_path / "fsdp"
    run_inprocess(_args(tiny_model, one, setting, "--micro_batch_size", "8"))
    if setting.endswith("resumed"):  # step 1, its sharded checkpoint, then step 2 in a new launch
        check_ok(launch(_args(tiny_model, two, setting, "--steps", "1"), fsdp=True))
        assert (two / "checkpoint-1" / "sharded" / ".metadata").is_file()
        proc = launch(_args(tiny_model, two, setting, "--resume"), fsdp=True)
        check_ok(proc)
        assert "(step 1)" in proc.stdout
    else:
        check_ok(launch(_args(tiny_model, two, setting), fsdp=True))
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
    assert (
        alone["param_optimizer_bytes"]
        == alone["param_optimizer_bytes_unsharded"]
        == summary["param_optimizer_bytes_unsharded"]
    )


def test_fsdp_needs_processes(tiny_model, tmp_path, monkeypatch):
    """FSDP2's config on one CPU process (accelerate sets ACCELERATE_USE_FSDP) is refused: there is nothing to
    shard over."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(SystemExit, match="FSDP2's config on one CPU process"):
        run_inprocess(_args(tiny_model, tmp_path / "run", "grpo"))
    # (a former --fsdp says how to launch instead: tests/package/test_flags.py)


def test_gpu_config_is_fsdp2_per_decoder_layer_in_bf16(monkeypatch):
    """configs/fsdp2.yaml, read as `accelerate launch --config_file` reads it, gives accelerate's
    FSDP2 plugin one unit per decoder layer, bf16 and sharded checkpoints (the plugin itself only
    runs on GPUs; tests above run the same sharding on CPU)."""
    import functools

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env
    from conftest import tiny_llama

    from tinyrun import ROOT

    args = launch_command_parser().parse_args(["--config_file", str(ROOT / "configs" / "fsdp2.yaml"), "train.py"])
    env = prepare_multi_gpu_env(_validate_launch_command(args)[0])
    for key, value in env.items():
        if "FSDP" in key or key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    model = tiny_llama()
    plugin.set_auto_wrap_policy(model)
    plugin.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert isinstance(plugin.auto_wrap_policy, functools.partial)
    assert {c.__name__ for c in plugin.auto_wrap_policy.keywords["transformer_layer_cls"]} == set(
        model._no_split_modules
    )
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16


@pytest.mark.slow
def test_the_kl_reference_under_fsdp_in_bf16_is_the_policy_at_the_start(tiny_model, tmp_path):
    """FSDP2 --mixed_precision bf16 --kl_beta: the reference computes as the sharded policy does (bf16
    parameters, FSDP2's policy), so before any update pi_ref = pi_theta and step 1's k3 is exactly 0; a
    float32 reference (or one under autocast) beside the bf16 shards made it non-zero."""
    from tinyrun import finish, launch_command, spawn

    out = tmp_path / "run"
    cmd = launch_command(_args(tiny_model, out, "grpo", "--steps", "1", "--kl_beta", "0.1"), fsdp=True)
    cmd[cmd.index("--mixed_precision") + 1] = "bf16"
    check_ok(finish(*spawn(cmd), timeout=180))
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert step["loss/kl_ref"] == 0.0


RECORD_AUTOCAST = """
import json, torch, oar.credit_methods as c
_scores = c.gradient_scores
def _recording(*args, **kwargs):  # whether the credit's forward autocasts, as the update forward does not
    with open({path!r}, "a") as f:
        f.write(json.dumps(torch.is_autocast_enabled("cpu")) + "\\n")
    return _scores(*args, **kwargs)
c.gradient_scores = _recording
"""


@pytest.mark.slow
def test_the_credit_under_fsdp_in_bf16_computes_without_autocast_as_the_update_forward(tiny_model, tmp_path):
    """OAR-G's noised forward is compared with the clean outcome of the update forward, which FSDP2 computes in
    its shards' mixed precision with no autocast around it: the credit computes the same way (learner.autocast),
    not under accelerate's autocast, which an unsharded bf16 launch turns on (and its update forward too)."""
    from tinyrun import TRAIN, finish, launch_command, spawn

    record = tmp_path / "autocast.jsonl"
    script = tmp_path / "recording_train.py"  # train.py run after the prelude, in each launched process
    script.write_text(
        RECORD_AUTOCAST.format(path=str(record)) + f"import runpy, sys\nsys.argv[0] = {str(TRAIN)!r}\n"
        f"runpy.run_path({str(TRAIN)!r}, run_name='__main__')\n"
    )
    for sharded in (True, False):
        record.unlink(missing_ok=True)
        cmd = launch_command(
            _args(tiny_model, tmp_path / f"run{int(sharded)}", "oar-g/resumed", "--steps", "1"),
            script=script,
            fsdp=sharded,
        )
        cmd[cmd.index("--mixed_precision") + 1] = "bf16"
        check_ok(finish(*spawn(cmd), timeout=180))
        seen = {json.loads(line) for line in record.read_text().splitlines()}
        assert seen == ({False} if sharded else {True}), (sharded, seen)  # the trial step and the update's scoring
