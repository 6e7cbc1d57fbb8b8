"""Nothing silent: non-finite numbers never reach the optimizer, and every degenerate number has the outcome
train.py's docstring gives it (NaN logits, a non-finite loss, no answer, all truncated, tied groups,
non-finite OAR scores), end to end through train.py. Function-level cases live beside their functions
(tied groups: test_grpo; empty reasoning, one token, NaN scores: test_gating; 1 MB and pathological
answers: test_rewards); bad input: test_failures.py.
"""

import shutil
from pathlib import Path

import pytest
import torch

from oar.training.config import Config
from test_failures import _args
from tinyrun import final_params, metrics, run_inprocess, train_module


def _nan_model(tiny_model: Path, where: Path) -> Path:
    """A copy of the model whose final norm is NaN: every logit is NaN, in sampling and in training."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model, where)
    weights = load_file(str(where / "model.safetensors"))
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    save_file(weights, str(where / "model.safetensors"), metadata={"format": "pt"})
    return where


def test_nan_logits_skip_steps_then_stop_with_a_message(tiny_model, tmp_path, capsys, monkeypatch):
    import oar.training.models as models

    model, out = _nan_model(tiny_model, tmp_path / "nan-model"), tmp_path / "run"
    monkeypatch.setattr(Config, "max_bad_steps", 2)  # a constant (3), no longer a flag
    # a model with NaN weights is refused at load (test_failures.py); here the NaN logits must reach the loop
    monkeypatch.setattr(models, "nonfinite_parameters", lambda model: [])
    with pytest.raises(SystemExit) as stop:
        run_inprocess(_args(model, out, "--method", "oar-g", "--steps", "5", "--save_every", "1"))
    message = str(stop.value)
    assert message.startswith("train.py: error: 2 steps in a row") and "(a run stops at 2)" in message
    printed = capsys.readouterr().out
    assert "step 1: non-finite loss in 1 micro-batches, update skipped (1 skipped so far)" in printed
    assert "(2 skipped so far)" in printed
    # No NaN reached the optimizer: it never stepped (no Adam state), the weights are the loaded ones.
    state = torch.load(out / "checkpoint-1" / "optimizer.bin", weights_only=True)
    assert state["state"] == {}
    from safetensors.torch import load_file

    saved, loaded = (
        load_file(str(out / "checkpoint-1" / "model.safetensors")),
        load_file(str(model / "model.safetensors")),
    )
    assert all(torch.equal(saved[k], loaded[k]) or torch.allclose(saved[k], loaded[k], equal_nan=True) for k in loaded)


def test_a_nonfinite_loss_is_skipped_even_when_the_gradient_is_finite(tiny_model, tmp_path, monkeypatch, capsys):
    """A NaN that enters the loss as a constant leaves every gradient finite: only the loss shows it."""
    calls = []

    def loss_with_a_nan_at_step_2(*args, **kwargs):
        loss, stats = policy_loss(*args, **kwargs)
        calls.append(1)
        return (loss + float("nan"), stats) if len(calls) == 2 else (loss, stats)

    train = train_module()  # train.py's step 5: the micro-batch loop that calls the loss

    policy_loss = train.policy_loss
    monkeypatch.setattr(train, "policy_loss", loss_with_a_nan_at_step_2)
    summary = run_inprocess(_args(tiny_model, tmp_path / "run", "--method", "grpo", "--steps", "3"))
    assert summary["skipped_steps"] == 1
    assert "step 2: non-finite loss in 1 micro-batches, update skipped (1 skipped so far)" in capsys.readouterr().out
    assert all(torch.isfinite(p).all() for p in final_params(tmp_path / "run").values())
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2, 3]


@pytest.mark.parametrize("method", ["oar-g", "oar-p"])
def test_no_answer_all_truncated_tied_groups_are_defined(tiny_model, tmp_path, method):
    """2 new tokens: every rollout truncated (and masked out), none has an answer or a reasoning
    span, every group ties at reward 0. Defined: weights 1, advantages 0, loss 0 (not 0/0), a zero
    gradient, no skipped step."""
    out = tmp_path / "run"
    summary = run_inprocess(
        _args(
            tiny_model,
            out,
            "--method",
            method,
            "--steps",
            "2",
            "--max_new_tokens",
            "2",
            "--mask_truncated",
            "--aggregation",
            "token_mean",
        )
    )
    assert summary["skipped_steps"] == 0
    for m in metrics(out):
        assert m["completion/frac_truncated"] == 1 and m["oar/frac_no_answer"] == 1
        assert m["reward/frac_zero_std_groups"] == 1 and m["optim/grad_norm"] == 0
        assert m["oar/weight_max"] == 1 and m["oar/frac_nonfinite_scores"] == 0


def test_groups_with_one_reward_that_is_not_a_binary_fraction_count_as_tied(tiny_model, tmp_path):
    """A reward of 0.1 for every rollout: each group's advantages are exactly 0 (group_advantages compares the
    rewards), and reward/frac_zero_std_groups says 1, as it must, though one group of eight 0.1s has a float32 std
    of 8e-9 (torch's row-wise std of two such groups happens to give 0: one group shows it)."""
    module = tmp_path / "tenth.py"
    module.write_text("REWARD_FUNCTIONS = {'tenth': lambda completion, gold, problem: 0.1}\n")
    out = tmp_path / "run"
    run_inprocess(
        _args(
            tiny_model,
            out,
            "--method",
            "grpo",
            "--steps",
            "1",
            "--prompts_per_step",
            "1",
            "--group_size",
            "8",
            "--reward_module",
            str(module),
            "--reward",
            "tenth",
        )
    )
    (m,) = metrics(out)
    assert (
        m["reward/mean"] == pytest.approx(0.1) and m["reward/frac_zero_std_groups"] == 1 and m["optim/grad_norm"] == 0
    )


def test_nonfinite_oar_scores_are_counted(tiny_model, tmp_path, monkeypatch, capsys):
    """Scores that are not finite give plain GRPO weights (gating's rule); the run says so."""
    # train.py's step 5 asks oar/credit.py's oar-g, which calls this module's gradient_scores
    from oar import credit_methods

    gradient_scores = credit_methods.gradient_scores
    monkeypatch.setattr(credit_methods, "gradient_scores", lambda *a, **k: gradient_scores(*a, **k) * float("inf"))
    out = tmp_path / "run"
    summary = run_inprocess(_args(tiny_model, out, "--method", "oar-g", "--steps", "1"))
    assert summary["skipped_steps"] == 0
    (m,) = metrics(out)
    assert m["oar/frac_nonfinite_scores"] > 0 and m["oar/ess_ratio"] == 1  # all weights 1
    assert "had non-finite OAR scores; they got plain GRPO weights" in capsys.readouterr().out
