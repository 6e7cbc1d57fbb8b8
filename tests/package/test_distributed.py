"""Several processes give the same update as one, and micro-batching does not change it.

Same global batch (2 prompts x 4 rollouts), same seed: one process with one micro-batch of 8, one
process with 8 micro-batches of 1, and `accelerate launch --multi_gpu --num_processes 2` (CPU, gloo)
must leave the same parameters (within 1e-5) and log the same metrics, every one but the timings
(diagnostics are computed over the whole step, not averaged over processes). Why the gradient norm
matters: Adam's first steps are nearly invariant to the gradient's scale, and the clip normalises it
again, so a loss scaled wrongly by the number of processes or micro-batches can leave the parameters
almost unchanged; the logged norm is the raw gradient's and catches it.
"""

import math
import socket

import pytest

from tinyrun import (
    PORT_FLOOR,
    TINY,
    assert_same_metrics,
    check_ok,
    ephemeral_floor,
    final_params,
    free_port,
    initial_params,
    launch,
    max_abs_diff,
    metrics,
    run_inprocess,
)

SETTINGS = {  # (method, aggregation, extra flags): both aggregations, both OAR scorers, plain GRPO
    "oar-g/seq_mean": ["--method", "oar-g", "--aggregation", "seq_mean"],
    "oar-p/token_mean/mask_truncated": [
        "--method",
        "oar-p",
        "--aggregation",
        "token_mean",
        "--mask_truncated",
        "--max_new_tokens",
        "18",
    ],
    "grpo/token_mean": ["--method", "grpo", "--aggregation", "token_mean"],
    # the batch std of the advantages: over the whole step (every process's rewards), not a process's half
    "grpo/batch_scale": ["--method", "grpo", "--aggregation", "seq_mean", "--advantage_scale", "batch"],
    # the comparators of oar/credit.py: a gate per rollout, a threshold over the whole step, a tree per group
    "entropy/seq_mean": ["--method", "entropy", "--aggregation", "seq_mean"],
    "entropy-mask/token_mean": ["--method", "entropy-mask", "--aggregation", "token_mean"],
    "tempo/seq_mean": ["--method", "tempo", "--aggregation", "seq_mean"],
    # beyond the paper; OAR-G's noise at 0.1, not 1e-3: its scores magnify float rounding ~1/noise_std-fold
    # (_assert_same_run), and at 1e-3 the final parameters differ by 3.5e-5 on some CPUs whatever the split
    "oar-g+tempo/token_mean": ["--method", "oar-g+tempo", "--aggregation", "token_mean", "--noise_std", "0.1"],
    "random-gate/seq_mean": ["--method", "random-gate", "--aggregation", "seq_mean"],  # beyond the paper: a control
    # rollouts sampled a prompt at a time (--rollout_batch_size 1): the same batches on 1 and 2 processes
    "grpo/chunked": ["--method", "grpo", "--aggregation", "seq_mean", "--rollout_batch_size", "1"],
    "oar-p/chunked": ["--method", "oar-p", "--aggregation", "seq_mean", "--rollout_batch_size", "1"],
}
# What does not depend on which rollouts OAR scored: all a comparison of two different sets of scored rollouts
# (--score_all) can hold equal. Runs of the same rollouts compare every logged key (tinyrun.assert_same_metrics).
SAME_FOR_ANY_SPLIT = (
    "optim/grad_norm",
    "optim/lr",
    "reward/mean",
    "reward/frac_zero_std_groups",
    "completion/frac_truncated",
    "oar/frac_no_answer",
)


def _args(model, out, setting, micro_batch_size):
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
        "0",
        "--micro_batch_size",
        str(micro_batch_size),
        *TINY,
        *SETTINGS[setting],
    ]


def _assert_same_run(got, want, model, diagnostics=True):
    """Same parameters (1e-5) and the same metrics: every logged key but the timings (`diagnostics`),
    else only SAME_FOR_ANY_SPLIT's. Step 1 starts from identical parameters. After it they differ by
    float rounding (~1e-7: gradients summed in another order), and OAR-G amplifies that: its score is
    the gradient of a KL sitting at its minimum, perturbed by noise of 1e-3, which magnifies a relative
    error about 1e-7 / 1e-3 = 1e-4-fold: step 2 agrees to 3e-5 on one machine, 1.7e-4 on another."""
    assert max_abs_diff(final_params(got), final_params(want)) <= 1e-5
    if diagnostics:
        assert_same_metrics(metrics(got), metrics(want))
        return
    for g, w in zip(metrics(got), metrics(want), strict=True):
        tol = 1e-5 if g["step"] == 1 else 1e-3
        for key in SAME_FOR_ANY_SPLIT:
            assert math.isclose(g[key], w[key], rel_tol=tol, abs_tol=1e-7), (g["step"], key, g[key], w[key])


def _assert_learns(run, model):
    """Equal updates mean something only if there is an update: rewards vary, parameters move."""
    rows = metrics(run)
    assert any(m["reward/frac_zero_std_groups"] < 1 and m["optim/grad_norm"] > 0 for m in rows)
    assert max_abs_diff(final_params(run), initial_params(model)) > 1e-4


@pytest.mark.parametrize("setting", SETTINGS)
def test_micro_batches_of_1_equal_one_batch_of_8(tiny_model, tmp_path, setting):
    whole, split = tmp_path / "8x1", tmp_path / "1x8"
    run_inprocess(_args(tiny_model, whole, setting, 8))
    run_inprocess(_args(tiny_model, split, setting, 1))
    _assert_learns(whole, tiny_model)
    _assert_same_run(split, whole, tiny_model)


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting, micro_batch_size, switch",
    [
        ("oar-g/seq_mean", 4, True),
        ("oar-p/token_mean/mask_truncated", 1, False),
        ("entropy-mask/token_mean", 2, False),
        ("tempo/seq_mean", 2, False),
        ("random-gate/seq_mean", 2, False),  # its widest-prompt gather
        ("grpo/chunked", 4, False),  # --rollout_batch_size 1 on both
        ("grpo/batch_scale", 4, False),  # a std over both processes
        ("oar-p/chunked", 4, True),
    ],
)
def test_two_processes_equal_one(tiny_model, tmp_path, setting, micro_batch_size, switch):
    """Two steps under 2 processes, or (switch) step 1 under 2 processes and step 2 resumed in one:
    a checkpoint does not depend on the number of processes that wrote or reads it."""
    from safetensors.torch import load_file

    one, two = tmp_path / "one", tmp_path / "two"
    run_inprocess(_args(tiny_model, one, setting, 8) + ["--save_every", "1"])
    proc = launch(
        _args(tiny_model, two, setting, micro_batch_size)
        + ["--save_every", "1"]
        + (["--steps", "1"] if switch else []),
        num_processes=2,
    )
    check_ok(proc)
    assert '"processes": 2' in (two / "summary.json").read_text()  # one process group, not two lone runs
    if switch:
        run_inprocess(_args(tiny_model, two, setting, 8) + ["--save_every", "1", "--resume"])
    _assert_learns(one, tiny_model)
    step1 = [load_file(str(run / "checkpoint-1" / "model.safetensors")) for run in (one, two)]
    assert max_abs_diff(*step1) <= 1e-5  # the 2-process step itself
    _assert_same_run(two, one, tiny_model)


@pytest.mark.parametrize("setting", ["oar-g/seq_mean", "oar-p/token_mean/mask_truncated"])
def test_rollouts_with_zero_advantage_are_skipped_exactly(tiny_model, tmp_path, setting):
    """OAR scores no rollout whose advantage is 0 (its group's rewards are all equal), since its loss
    is 0 whatever its weights; --score_all scores every rollout. The runs must be the same run."""
    skip, every = tmp_path / "skip", tmp_path / "all"
    extra = ["--prompts_per_step", "4"]
    run_inprocess(_args(tiny_model, skip, setting, 8) + extra)
    run_inprocess(_args(tiny_model, every, setting, 8) + extra + ["--score_all"])
    _assert_learns(skip, tiny_model)
    _assert_same_run(skip, every, tiny_model, diagnostics=False)  # they describe other rollouts
    scored = [(s["oar/frac_scored"], a["oar/frac_scored"]) for s, a in zip(metrics(skip), metrics(every))]
    assert all(a == pytest.approx(1 - m["oar/frac_no_answer"]) for (_, a), m in zip(scored, metrics(every)))
    assert all(s <= a for s, a in scored) and any(s < a for s, a in scored)  # rollouts were skipped


def test_launch_port_is_free_and_outside_the_ephemeral_range():
    """The launches' port is drawn below the kernel's ephemeral range (where a concurrent run's gloo connections
    could take it before accelerate binds it), differs between draws, and is free to bind."""
    low = ephemeral_floor()
    if low is None:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range (not Linux)")
    ports = [free_port() for _ in range(20)]
    assert all(PORT_FLOOR <= port < low for port in ports), ports
    assert len(set(ports)) > 1
    with socket.socket() as s:
        s.bind(("", ports[0]))
