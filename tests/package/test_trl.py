"""oar.integrations.trl: OAR's credit inside TRL's GRPOTrainer (docs/trl.md). Needs trl (requirements-trl.txt);
CI runs these with `pytest -m trl`. Every run trains tiny-arith (oar/tasks/tiny-arith, shipped: no download) for
two or three steps of 2 prompts x 4 rollouts on the CPU.

What is pinned, each against something the integration does not compute itself:
  * credit='grpo' is TRL's own run, bit for bit (A_i x 1 = A_i, the same loss);
  * OAR-G's and OAR-P's token weights on TRL's rollouts are oar's maths (oar_grad.gradient_scores,
    oar_perturb.perturbation_scores, gating.bilevel_weights) on TRL's own output tensors, with the model as it
    sampled them; each rollout keeps its advantage mass; the logged oar/ diagnostics are gating.weight_stats'
    of those weights and reach tensorboard;
  * two gloo processes give the weights and parameters of one, with groups that span processes and a process
    that holds no group (tempo, entropy-mask, OAR-G, random-gate);
  * LoRA: the weights are the adapted policy's; a resume from a TRL checkpoint continues the run exactly;
  * what OAR cannot honour stops the build (or the first batch that shows it) in one line.
Run as a script under `accelerate launch` (the two-process test does), it runs the cases and saves what they did.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.trl
trl = pytest.importorskip("trl", reason="trl is not installed: pip install -r requirements-trl.txt")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from oar.credit import CreditError  # noqa: E402
from oar.gating import bilevel_weights, weight_stats  # noqa: E402
from oar.integrations.trl import (  # noqa: E402
    OARGRPOTrainer,
    OARSettings,
    credit_rows,
    refusal,
    rollout_of,
    scored_runs,
)
from oar.credit import METHODS  # noqa: E402
from oar.oar_grad import gradient_scores  # noqa: E402
from oar.oar_perturb import perturbation_scores  # noqa: E402
from oar.rewards import correctness_reward  # noqa: E402
from oar.rollout import build_rollout  # noqa: E402
from oar.tasks.arith import arith_problems, arith_solution  # noqa: E402
from oar.tasks.tiny_arith_cache import model_source  # noqa: E402

SOURCE = model_source("tiny-arith")
G = 4
PROBLEMS = arith_problems(16, seed=0)


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as the suite's xdist workers have (conftest.py): on 2 shared cores a tiny model's step is
    many times slower with a thread per core beside other work. `pytest -m trl` runs without xdist."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _dataset(conversational: bool = True) -> Dataset:
    tok = AutoTokenizer.from_pretrained(SOURCE)
    prompt = (
        (lambda p: [{"role": "user", "content": p}])
        if conversational
        else (
            lambda p: tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
        )
    )
    return Dataset.from_list([{"prompt": prompt(p.problem), "answer": p.answer} for p in PROBLEMS])


def correct(completions, answer, **_):
    return [correctness_reward(c if isinstance(c, str) else c[0]["content"], a) for c, a in zip(completions, answer)]


def _config(out, **kw) -> trl.GRPOConfig:
    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=8,
        num_generations=G,
        max_completion_length=32,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    return trl.GRPOConfig(**(settings | kw))


def _trainer(cls, out, *, model=None, dataset=None, trainer_kw=None, **config):
    return cls(
        model=model or AutoModelForCausalLM.from_pretrained(SOURCE),
        reward_funcs=correct,
        args=_config(out, **config),
        train_dataset=_dataset() if dataset is None else dataset,
        processing_class=AutoTokenizer.from_pretrained(SOURCE),
        **(trainer_kw or {}),
    )


def _params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Spy(OARGRPOTrainer):
    """Keeps each generation batch's output, its credit record, and oar's own weights for it (`expect`, computed
    from the output tensors with the model as it sampled them: nothing has updated it since)."""

    expect = None  # (trainer, out) -> dict, set per test

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.seen = getattr(self, "seen", [])
            self.seen.append(
                {
                    "out": out,
                    "credit": self.last_credit,
                    "expected": self.expect(out) if self.expect is not None else None,
                }
            )
        return out


def oar_weights(trainer, out, method: str, model=None) -> dict:
    """oar's maths on TRL's output: build_rollout of its padded tensors, then the method's scores through the
    gate, with train.py's definition of what is scored (A_i != 0, a loss token) and maths §0's seeds."""
    tok, model = trainer.processing_class, model or trainer.accelerator.unwrap_model(trainer.model)
    ro = build_rollout(tok, out["prompt_ids"], out["prompt_mask"], out["completion_ids"], trainer.eos_token_ids)
    advantages = trainer.last_credit.advantages
    scored = (advantages != 0) & out["completion_mask"].bool().any(1)
    reasoning = ro.reasoning_mask & scored[:, None]
    generation = len(getattr(trainer, "seen", []))  # the generation batches before this one
    seeds = [(0 * 1_000_003 + generation) * 10_007 * G + i for i in range(len(ro))]
    was = model.training
    model.eval()
    if method == "oar-g":
        scores = gradient_scores(
            model,
            ro.input_ids,
            ro.attention_mask,
            reasoning,
            ro.answer_mask,
            probe="answer_mean",
            noise_std=trainer.oar_settings.noise_std,
            seeds=seeds,
        )
    else:
        scores = perturbation_scores(
            model,
            ro.input_ids,
            ro.attention_mask,
            reasoning,
            ro.answer_mask,
            probe="answer_mean",
            pad_token_id=tok.pad_token_id,
        )
    model.train(was)
    w = bilevel_weights(scores, reasoning, quantile=0.4, boost=2.0, floor=0.1, preserve_mass=True)
    lp = out["prompt_ids"].shape[1]
    return {
        "weights": w[:, lp:] * out["completion_mask"],
        "scored": scored,
        "seeds": seeds,
        "stats": weight_stats(w, reasoning),
        "answered": ro.answer_mask.any(1),
    }


# -- 1. credit='grpo' is TRL's own run -------------------------------------------------------------


def test_grpo_credit_is_trls_own_run_to_the_bit(tmp_path):
    """Two steps of trl.GRPOTrainer and of OARGRPOTrainer(credit='grpo'), same seed: the same parameters bit for
    bit, and the same logged loss and gradient norms. The integration's path ran (A_it = A_i w_it with w = 1,
    weights 1 on every completion token) and the run moved the model."""
    start = _params(AutoModelForCausalLM.from_pretrained(SOURCE))
    theirs = _trainer(trl.GRPOTrainer, tmp_path / "trl")
    theirs.train()
    ours = _trainer(OARGRPOTrainer, tmp_path / "oar", trainer_kw={"credit": "grpo"})
    ours.train()
    a, b = _params(theirs.model), _params(ours.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], start[k]) for k in a)  # it trained
    keys = ("loss", "grad_norm", "reward", "entropy")
    assert [[h[k] for k in keys] for h in theirs.state.log_history[:2]] == [
        [h[k] for k in keys] for h in ours.state.log_history[:2]
    ]
    rec = ours.last_credit
    assert rec.weights.shape[0] == 8 and set(rec.weights.unique().tolist()) <= {0.0, 1.0}
    assert [
        ours.state.log_history[1][f"oar/{k}"]
        for k in ("weight_mean", "weight_max", "frac_boosted", "frac_suppressed", "ess_ratio")
    ] == [1, 1, 0, 0, 1]


# -- 2. OAR-G and OAR-P weights are oar's maths on TRL's rollouts -----------------------------------


@pytest.mark.parametrize("method", ["oar-g", "oar-p"])
def test_weights_on_trls_rollouts_are_oars_maths(tmp_path, method):
    """Each generation batch's token advantages / A_i equal oar's weights computed from TRL's output tensors with
    the model that sampled them (step 2's after step 1's update); each scored rollout's advantage mass over its
    loss tokens is A_i T_i (preserve_mass); the logged oar/ diagnostics are weight_stats' of oar's weights and reach
    tensorboard (OAR-G's run). Tolerance: oar's functions recompute the clean pass the trainer takes from its
    own forward, rounding ~1e-7, which OAR-G's scores magnify by ~1/noise_std (maths §4)."""
    logged = method == "oar-g"
    trainer = _trainer(
        Spy,
        tmp_path / "run",
        trainer_kw={"credit": method},
        max_steps=2,
        **({"report_to": ["tensorboard"]} if logged else {}),
    )
    trainer.expect = lambda out: oar_weights(trainer, out, method)
    trainer.train()
    assert len(trainer.seen) == 2
    scored_any = False
    for step, seen in enumerate(trainer.seen, start=1):
        out, rec, want = seen["out"], seen["credit"], seen["expected"]
        a, mask = rec.advantages, out["completion_mask"].bool()
        assert rec.seeds == want["seeds"]
        assert torch.equal(want["scored"], (a != 0) & mask.any(1))
        got = out["advantages"]  # (n, T) A_it
        assert got.shape == mask.shape and torch.equal(got[a == 0], torch.zeros_like(got[a == 0]))
        rows = a != 0
        scored_any |= bool(rows.any())
        torch.testing.assert_close(got[rows] / a[rows, None], want["weights"][rows], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(rec.weights[rows], want["weights"][rows], rtol=1e-4, atol=1e-4)
        # mass: sum_t A_it over the loss tokens is A_i T_i
        torch.testing.assert_close((got * mask)[rows].sum(1), a[rows] * mask[rows].sum(1), rtol=1e-5, atol=1e-5)
        # and the weights are not GRPO's ones: OAR reshaped something
        assert not rows.any() or not torch.allclose(rec.weights[rows], mask[rows].float())
        log = trainer.state.log_history[step - 1]
        for key in ("weight_mean", "weight_max", "frac_boosted", "frac_suppressed", "ess_ratio"):
            assert log[f"oar/{key}"] == pytest.approx(want["stats"][key], rel=1e-4, abs=1e-6), key
        assert log["oar/frac_scored"] == pytest.approx(float((want["scored"] & want["answered"]).float().mean()))
        assert log["oar/frac_nonfinite_scores"] == 0.0
    assert scored_any  # the test compared weights that OAR computed
    if logged:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        (folder,) = (tmp_path / "run" / "runs").iterdir()  # transformers' TensorBoardCallback: output_dir/runs/<run>
        events = EventAccumulator(str(folder)).Reload()
        for key in (
            "ess_ratio",
            "weight_max",
            "frac_boosted",
            "frac_suppressed",
            "frac_scored",
            "frac_nonfinite_scores",
        ):
            values = [s.value for s in events.Scalars(f"train/oar/{key}")]
            assert values == pytest.approx([h[f"oar/{key}"] for h in trainer.state.log_history[:2]], rel=1e-6), key


@pytest.mark.parametrize("method", list(METHODS))
def test_every_built_in_trains_in_trl_and_keeps_what_it_promises(tmp_path, method):
    """Each method of oar's table, two steps in TRL: finite weights, 0 off the loss tokens, and on the scored
    rollouts what maths §8 says it keeps: the advantage mass (sum_t w = T_i: grpo, the gated ones), one token's
    worth more (tempo, oar-g+tempo: T_i + 1), or a 0/1 mask (entropy-mask); weights >= 0 where the sign is kept."""
    trainer = _trainer(Spy, tmp_path, trainer_kw={"credit": method})
    trainer.train()
    scored_any = False
    for seen in trainer.seen:
        w, a, mask = seen["credit"].weights, seen["credit"].advantages, seen["out"]["completion_mask"].bool()
        assert torch.isfinite(w).all() and torch.equal(w[~mask], torch.zeros_like(w[~mask]))
        rows = a != 0
        if not rows.any():  # step 1: every group tied
            continue
        scored_any = True
        total, tokens = w[rows].sum(1), mask[rows].sum(1).float()
        if method in ("tempo", "oar-g+tempo"):
            torch.testing.assert_close(total, tokens + 1)
        elif method == "entropy-mask":
            assert set(w[rows].unique().tolist()) <= {0.0, 1.0} and (w[rows] == 0).any()
        else:
            torch.testing.assert_close(total, tokens)
            assert (w >= 0).all()
    assert scored_any


def test_weights_once_a_generation_batch_reused_by_every_pass(tmp_path):
    """steps_per_generation 2 and num_iterations 2: a generation batch serves 4 micro-steps, its weights computed
    once, before them, with seeds of the batch's index; under mask_truncated_completions a truncated rollout (no
    loss token in TRL's mask) is not scored: w = 1, not OAR's."""
    trainer = _trainer(Spy, tmp_path, trainer_kw={"credit": "oar-g"}, per_device_train_batch_size=4,
                       gradient_accumulation_steps=2, num_iterations=2, max_steps=4, mask_truncated_completions=True,
                       max_completion_length=24)  # fmt: skip
    calls = []
    trainer.expect = lambda out: calls.append(trainer._step) or oar_weights(trainer, out, "oar-g")
    trainer.train()
    assert calls == [0, 4]  # micro-steps 0 and 4 of 8
    for k, seen in enumerate(trainer.seen):
        rec, mask = seen["credit"], seen["out"]["completion_mask"].bool()
        assert rec.seeds == [(0 * 1_000_003 + k) * 10_007 * G + i for i in range(8)]
        cut = ~mask.any(1)  # truncated, masked by TRL
        assert not seen["expected"]["scored"][cut].any()
        assert set(rec.weights[cut].unique().tolist()) <= {0.0, 1.0}
    assert any((~s["out"]["completion_mask"].bool().any(1)).any() for s in trainer.seen)  # some were cut


# -- 3. LoRA and resuming --------------------------------------------------------------------------


def test_lora_weights_are_the_adapted_policys(tmp_path):
    """With a LoRA adapter (peft), step 3's weights are oar's maths on the adapted policy, which step 2 moved
    away from the base model's (the same maths with the adapter off gives other weights; step 1's groups were
    all tied, no gradient); the base stays frozen. OAR-G's noise at 0.1, not 1e-3: the scores magnify float
    rounding ~1/noise_std-fold (maths §4), and after two updates the gate's quantile then moved weights by 3e-3
    between the trainer's clean pass and oar_grad's own (the scores themselves agreed to 1e-4 of their size)."""
    from peft import LoraConfig

    trainer = _trainer(
        Spy,
        tmp_path / "run",
        trainer_kw={
            "credit": "oar-g",
            "settings": OARSettings(noise_std=0.1),
            "peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
        },
        learning_rate=5e-2,
        max_steps=3,
    )
    base = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_" not in k}
    lora = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_B" in k}

    def expect(out):
        peft_model = trainer.accelerator.unwrap_model(trainer.model)
        with peft_model.disable_adapter():
            off = oar_weights(trainer, out, "oar-g")
        return {**oar_weights(trainer, out, "oar-g"), "off": off["weights"]}

    trainer.expect = expect
    trainer.train()
    rec, want = trainer.seen[2]["credit"], trainer.seen[2]["expected"]
    rows = rec.advantages != 0
    assert rows.any()
    torch.testing.assert_close(rec.weights[rows], want["weights"][rows], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(want["off"][rows], want["weights"][rows], rtol=1e-3, atol=1e-3)
    state = trainer.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in base.items())
    assert any(not torch.equal(state[k], v) for k, v in lora.items())


def test_a_resume_from_a_trl_checkpoint_continues_the_run(tmp_path):
    """Three OAR-G steps straight, and the same run resumed from its TRL checkpoint after step 1: the same final
    parameters bit for bit (TRL restores its data order and random state; OAR-G's noise seeds follow the
    restored step, not the resumed process's own count). A resume with another credit is refused in one line."""
    straight = _trainer(
        Spy, tmp_path / "a", trainer_kw={"credit": "oar-g"}, max_steps=3, save_strategy="steps", save_steps=1
    )
    straight.train()
    resumed = _trainer(Spy, tmp_path / "b", trainer_kw={"credit": "oar-g"}, max_steps=3, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    assert [s["credit"].seeds for s in resumed.seen] == [s["credit"].seeds for s in straight.seen[1:]]
    assert any((s["credit"].advantages != 0).any() for s in straight.seen[1:])  # OAR scored after the checkpoint
    a, b = _params(straight.model), _params(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = _trainer(Spy, tmp_path / "c", trainer_kw={"credit": "oar-p"}, max_steps=3)
    with pytest.raises(CreditError, match="resume from .*checkpoint-1: it trained with") as err:
        other.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    assert "\n" not in str(err.value)


# -- 4. what OAR cannot honour, refused in one line -------------------------------------------------


@pytest.mark.parametrize(
    "trainer_kw, config, needle",
    [
        ({"credit": "nosuch"}, {}, "credit 'nosuch': choose one of grpo, oar-g"),
        ({"credit_module": "no/such/module.py", "credit": "mine"}, {}, "no/such/module.py"),
        ({"settings": None}, {"top_entropy_quantile": 0.2}, "top_entropy_quantile=0.2 with credit 'oar-g'"),
        ({"credit": "tempo"}, {"loss_type": "sapo"}, "loss_type='sapo'"),
        ({"credit": "oar-g+tempo"}, {"off_policy_mask_threshold": 0.5}, "off_policy_mask_threshold=0.5"),
        (
            {"credit": "tempo"},
            {"multi_objective_aggregation": "normalize_then_sum"},
            "multi_objective_aggregation",
        ),
    ],
    ids=["unknown", "module", "trl-entropy-mask", "sapo", "off-policy-mask", "normalize-then-sum"],
)
def test_what_oar_cannot_honour_stops_the_build(tmp_path, trainer_kw, config, needle):
    with pytest.raises(CreditError) as err:
        _trainer(OARGRPOTrainer, tmp_path, trainer_kw=trainer_kw, **config)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_what_the_build_refuses_and_what_it_allows(tmp_path, monkeypatch):
    """The refusals no test here can build (tools need a chat template that renders tool calls, which tiny-arith's
    does not; a vision processor; FSDP / ZeRO-3; another TRL release), read off `refusal`; bad OAR settings; and
    what credit='grpo' allows (TRL's own run, whatever TRL does), built."""
    args = _config(tmp_path)
    assert "tools / environment_factory" in refusal(METHODS["grpo"], args, tools=True, vision=False, sharded=False)
    assert "read token ids only" in refusal(METHODS["oar-p"], args, tools=False, vision=True, sharded=False)
    assert "FSDP or DeepSpeed ZeRO-3" in refusal(METHODS["oar-g"], args, tools=False, vision=False, sharded=True)
    assert refusal(METHODS["grpo"], args, tools=False, vision=True, sharded=True) is None
    assert refusal(METHODS["tempo"], args, tools=False, vision=False, sharded=False) is None
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    assert "requirements-trl.txt" in refusal(METHODS["grpo"], args, tools=False, vision=False, sharded=False)
    monkeypatch.undo()
    with pytest.raises(CreditError, match="gate_quantile=1.5 must lie in"):
        OARSettings(gate_quantile=1.5)
    with pytest.raises(CreditError, match="probe='mean'"):
        OARSettings(probe="mean")
    _trainer(OARGRPOTrainer, tmp_path, trainer_kw={"credit": "grpo"}, top_entropy_quantile=0.2, loss_type="sapo")


NEGATIVE = """
import torch
from oar.credit import CreditMethod

def weigh(step, state, micro):
    return torch.where(micro.rollouts.reasoning_mask, -1.0, 1.0)

CREDIT_METHODS = [CreditMethod("negative", weigh)]
"""


def test_a_sign_flip_under_a_sign_reading_loss_stops_the_batch_that_shows_it(tmp_path):
    """A credit module's method whose weights are < 0 trains under loss_type='grpo', and stops in one line under
    'sapo' (which picks each token's temperature by the sign TRL takes for the rollout's) once a scored batch shows
    it."""
    module = tmp_path / "negative.py"
    module.write_text(NEGATIVE)
    _trainer(
        OARGRPOTrainer, tmp_path / "grpo", trainer_kw={"credit": "negative", "credit_module": str(module)}
    ).train()
    trainer = _trainer(
        OARGRPOTrainer,
        tmp_path / "sapo",
        trainer_kw={"credit": "negative", "credit_module": str(module)},
        loss_type="sapo",
    )
    with pytest.raises(CreditError, match="made a weight < 0 and loss_type='sapo'") as err:
        trainer.train()
    assert "\n" not in str(err.value)


# -- 5. the layout and the partition, by hand -------------------------------------------------------


def test_credit_rows_are_whole_groups_from_their_first_rollout():
    """TRL's rows [p n, (p + 1) n) of each process p; the credit's, whole groups from the one holding their first."""
    assert [credit_rows(p, 6, 4) for p in (0, 1)] == [slice(0, 8), slice(8, 12)]  # group 1: rows 4..7 on both
    assert [credit_rows(p, 2, 4) for p in (0, 1)] == [
        slice(0, 4),
        slice(4, 4),
    ]  # one group: process 1 has none
    assert [credit_rows(p, 8, 4) for p in (0, 1, 2)] == [
        slice(0, 8),
        slice(8, 16),
        slice(16, 24),
    ]  # TRL's own
    assert [credit_rows(p, 3, 2) for p in (0, 1)] == [slice(0, 4), slice(4, 6)]  # (3 rows a process, G = 2)


def test_only_runs_of_scored_rollouts_are_weighed():
    """The credit's micro-batches: runs of scored rows cut at the micro-batch size; no forward for the rest."""
    flags = lambda s: torch.tensor([c == "T" for c in s])  # noqa: E731
    assert scored_runs(flags("FTTTFFT"), 2) == [slice(1, 3), slice(3, 4), slice(6, 7)]
    assert scored_runs(flags("TTTT"), 8) == [slice(0, 4)]
    assert scored_runs(flags("FFFF"), 8) == [] and scored_runs(flags(""), 8) == []


def test_rollout_of_is_trls_completion_exactly():
    """TRL's token lists in oar's layout: a completion that ended with EOS keeps it; one cut short without EOS
    (shorter than the widest) ends at its own last token, truncated, where build_rollout alone would read its
    padding on; spans as maths §0 finds them; a completion that goes on after an EOS is refused."""
    tok = AutoTokenizer.from_pretrained(SOURCE)
    eos = tok.eos_token_id
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    sampled = [(enc("Q: 1+2\nA:\n"), enc("1 + 2 = 3\n#### 3") + [eos]), (enc("Q: 4\nA:\n"), enc("4 -"))]
    ro = rollout_of(tok, sampled, [eos], "cpu")
    lp = ro.prompt_width
    assert lp == len(sampled[0][0]) and ro.input_ids.shape[1] == lp + len(sampled[0][1])
    assert ro.completion_mask.sum(1).tolist() == [len(sampled[0][1]), len(sampled[1][1])]
    assert ro.truncated.tolist() == [False, True]
    assert ro.attention_mask[1].tolist() == [0] * (lp - len(sampled[1][0])) + [1] * (len(sampled[1][0]) + 3) + [0] * 14
    assert ro.texts == ["1 + 2 = 3\n#### 3", "4 -"]
    completion = ro.input_ids[0, lp:].tolist()
    assert [completion[t] for t in ro.answer_mask[0, lp:].nonzero().flatten().tolist()] == enc("3")[-1:]
    assert ro.reasoning_mask[0, lp:].sum() == len(enc("1 + 2 = 3\n"))
    assert not ro.reasoning_mask[1].any() and not ro.answer_mask[1].any()
    with pytest.raises(CreditError, match="goes on after an EOS"):
        rollout_of(tok, [(enc("Q"), enc("1") + [eos] + enc("2"))], [eos], "cpu")


def test_import_oar_needs_no_trl():
    code = (
        "import sys, oar, oar.integrations, oar.credit, oar.rollout; assert 'trl' not in sys.modules, 'trl imported'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2]
    )
    assert done.returncode == 0, done.stderr[-2000:]


# -- 6. two processes give the run of one -----------------------------------------------------------

CASES = {  # name: (prompts a generation batch, methods); G = 4 rows a group
    "span": (3, ["tempo", "entropy-mask", "oar-g", "random-gate"]),  # 12 rows, 6 a process: group 1 on both
    "empty": (1, ["tempo", "entropy-mask"]),  # 4 rows, 2 a process: process 1 computes no group
}


@functools.cache
def _by_prompt() -> dict:
    return {row["prompt"]: p for row, p in zip(_dataset(conversational=False), PROBLEMS)}


def canned(prompts: list, trainer) -> dict:
    """rollout_func: the same completions whatever the process count, by the row's place in its group: right
    with the solution's lines, right after other words, wrong, no answer (rewards 1, 1, 0, 0: every group scored)."""
    tok, first = trainer.processing_class, trainer.accelerator.process_index * len(prompts)
    rows = []
    for i, prompt in enumerate(prompts):
        problem = _by_prompt()[prompt]
        solution = arith_solution(problem)
        text = [
            solution,
            f"so it is {problem.answer}\n#### {problem.answer}",
            f"{solution}1",
            "I do not know",
        ][(first + i) % G]
        rows.append(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    return {
        "prompt_ids": [tok(p, add_special_tokens=False)["input_ids"] for p in prompts],
        "completion_ids": rows,
        "logprobs": [[0.0] * len(r) for r in rows],
    }


class Recorder(OARGRPOTrainer):
    """Every process's weights of each generation batch, gathered (padded to one width)."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        w = self.accelerator.pad_across_processes(self.last_credit.weights, dim=1)
        self.gathered = getattr(self, "gathered", []) + [self.accelerator.gather(w).cpu()]
        return out


def run_case(case: str, method: str, out: Path, processes: int) -> dict:
    prompts, _ = CASES[case]
    rows = prompts * G // processes
    # SGD: Adam's first steps move a parameter by ~lr whatever the size of its gradient, so float rounding of a
    # near-zero gradient (a sum in another order on two processes) would move it by up to 2 lr; SGD by lr x rounding
    # OAR-G's noise at 0.1, not 1e-3: a process's batch is another width than the whole batch, and at 1e-3 the
    # scores magnify that float rounding ~1/noise_std-fold (maths §4), which the gate's quantile turns into weights
    # 8e-3 apart for the same rows in a batch of 8 or 12 on one process (oar's own property, not the processes')
    trainer = _trainer(
        Recorder,
        out,
        dataset=_dataset(conversational=False),
        trainer_kw={"credit": method, "rollout_func": canned, "settings": OARSettings(noise_std=0.1)},
        per_device_train_batch_size=rows,
        max_steps=2,
        optim="sgd",
        learning_rate=0.1,
    )
    trainer.train()
    logs = [
        {k: v for k, v in h.items() if k.startswith(("oar/", "loss", "grad_norm")) and k != "oar/seconds_per_rollout"}
        for h in trainer.state.log_history[:2]
    ]
    return {
        "weights": trainer.gathered,
        "params": _params(trainer.accelerator.unwrap_model(trainer.model)),
        "logs": logs,
    }


def _same(got: dict, want: dict, label: str) -> None:
    """The same run within float rounding: the weights to 1e-3 (OAR-G's scores of the same rows in a batch of
    another width differ by rounding x 1/noise_std, 7e-5 of a weight of 0.4 seen), parameters to 1e-5."""
    for a, b in zip(got["weights"], want["weights"], strict=True):
        width = max(a.shape[1], b.shape[1])
        pad = lambda w: torch.nn.functional.pad(w, (0, width - w.shape[1]))  # noqa: E731
        torch.testing.assert_close(pad(a), pad(b), rtol=1e-3, atol=1e-4, msg=lambda m: f"{label}: {m}")
    for k in want["params"]:
        torch.testing.assert_close(
            got["params"][k], want["params"][k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{label} {k}: {m}"
        )
    for a, b in zip(got["logs"], want["logs"], strict=True):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6), label


@pytest.mark.slow
def test_two_gloo_processes_give_the_run_of_one(tmp_path):
    """The same rollouts (rollout_func) on 1 process and on 2 (accelerate launch, gloo): the same token weights
    each generation batch, the same parameters after two steps and the same oar/ diagnostics, for the methods
    that read more than a rollout: TEMPO's trees over a group that spans both processes, entropy-mask's
    threshold over the whole batch, random-gate's width; OAR-G's noise seeds; and a process with no group."""
    from tinyrun import finish, launch_command, spawn

    cmd = launch_command(["--out", str(tmp_path / "two")], num_processes=2, script=Path(__file__))
    done = finish(*spawn(cmd), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    two = torch.load(tmp_path / "two" / "results.pt")
    for case, (_, methods) in CASES.items():
        for method in methods:
            one = run_case(case, method, tmp_path / "one" / case / method, processes=1)
            _same(two[case][method], one, f"{case}/{method}")
            # the weights were not GRPO's: the method reshaped reasoning tokens
            assert any(log["oar/ess_ratio"] < 1 - 1e-6 or log["oar/weight_max"] != 1 for log in one["logs"]), (
                case + method
            )


def main() -> None:
    """Under `accelerate launch`: every case on this launch's processes; the main process saves results.pt."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    out = Path(p.parse_args().out)
    results = {}
    for case, (_, methods) in CASES.items():
        for method in methods:
            results.setdefault(case, {})[method] = run_case(
                case, method, out / case / method, processes=int(os.environ["WORLD_SIZE"])
            )
    if int(os.environ["RANK"]) == 0:
        torch.save(results, out / "results.pt")
    # as train.py ends (oar.training.launch): a gloo process that exits with its group alive can abort in C++
    # teardown after its work is done ("terminate called without an active exception", exit -6), and even with
    # the group destroyed, so the process ends without the interpreter's teardown
    from oar.training.launch import finished, release

    torch.distributed.barrier()
    release()
    finished()


if __name__ == "__main__":
    main()
