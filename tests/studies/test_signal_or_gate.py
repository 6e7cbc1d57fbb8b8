"""The signal-or-gate study: its inverted-score control (research/signal-or-gate/inverted.py), which is
OAR-G with the ranking turned over and nothing else, and its driver (study.py: the acceptance band, the
order of the runs). The report's tests: tests/studies/test_signal_or_gate_report.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tinyrun import tiny_step

ROOT = Path(__file__).resolve().parents[2]
MODULE = str(ROOT / "research" / "signal-or-gate" / "inverted.py")


def _module():
    from oar.credit import module_methods

    return module_methods(MODULE)[0]


def test_invert_by_hand():
    """u = log(1 + s) = 0, 1, 2 on the reasoning tokens becomes 2, 1, 0: s' = e^2 - 1, e - 1, 0; other columns kept."""
    import sys

    inverted = sys.modules[_module().weigh.__module__]
    s = torch.tensor([[5.0, 0.0, math.e - 1, math.e**2 - 1, 7.0]])
    r = torch.tensor([[False, True, True, True, False]])
    got = inverted.invert(s, r)
    torch.testing.assert_close(got, torch.tensor([[5.0, math.e**2 - 1, math.e - 1, 0.0, 7.0]]))
    s_nan = s.clone()
    s_nan[0, 2] = float("nan")
    assert torch.equal(
        inverted.invert(s_nan, r).isnan(), s_nan.isnan()
    )  # a non-finite row passes through to the gate's all-ones


def test_inverted_is_oar_g_turned_over(tiny_model):
    """On a real step of the tiny model: with the inversion off the module's weights are the built-in
    oar-g's (the same noise, probe and gate); with it on they are the gate of 1 - n, so the token OAR-G
    boosts most is suppressed most, and the rollout's mass is kept."""
    import sys

    from oar.credit import CreditSettings, MicroBatch, Step, step_credit
    from oar.gating import bilevel_weights

    method = _module()
    inverted = sys.modules[method.weigh.__module__]
    model, tok, ro, golds, rewards, adv = tiny_step(tiny_model)
    scored = (adv != 0) & ro.completion_mask.any(1)
    seeds = [21, 22, 23, 24, 25, 26, 27, 28]
    logits = torch.zeros(8, ro.input_ids.shape[1] - ro.prompt_width + 1, 1)  # unread by both methods
    q, beta = 0.25, 1.0  # the study's gate

    def weights(name, module=""):
        s = CreditSettings(method=name, credit_module=module, group_size=4, gate_quantile=q, gate_boost=beta)
        return step_credit(s, model, tok, ro, rewards, adv, scored, seeds, golds, "answer_mean")(
            slice(0, 8), ro, logits
        )[0]

    oar_g, inv = weights("oar-g"), weights("oar-g-inverted", MODULE)
    settings = CreditSettings(
        method="oar-g-inverted", credit_module=MODULE, group_size=4, gate_quantile=q, gate_boost=beta
    )
    step = Step(settings, model, tok, ro, rewards, adv, scored, seeds, golds, "answer_mean", lambda x: x)
    plain, _ = inverted.weigh(step, None, MicroBatch(slice(0, 8), ro, logits), inverted=False)
    completion = ro.completion_mask.float()  # step_credit's weights are 0 outside the completion (maths §5)
    torch.testing.assert_close(plain * completion, oar_g)  # the scores are OAR-G's own

    reasoning = ro.reasoning_mask & scored[:, None]
    scores, _ = inverted.oar_g_scores(step, MicroBatch(slice(0, 8), ro, logits))
    u = torch.log1p(scores.double().abs())
    lo = u.masked_fill(~reasoning, math.inf).amin(1, keepdim=True)
    hi = u.masked_fill(~reasoning, -math.inf).amax(1, keepdim=True)
    n = ((u - lo) / (hi - lo)).where(reasoning, 0.0)
    gate_of_flipped = bilevel_weights(
        torch.expm1(1 - n).where(reasoning, 0.0).float(), reasoning, quantile=q, boost=beta
    )
    torch.testing.assert_close(
        inv, gate_of_flipped * completion, atol=1e-5, rtol=1e-5
    )  # the gate normalises log(1 + s) = 1 - n to 1 - n
    rows = [i for i in range(8) if reasoning[i].sum() >= 3]
    assert rows, "no scored rollout with 3 reasoning tokens: the check below would not run"
    for i in rows:
        top, low = (
            scores[i].masked_fill(~reasoning[i], -1).argmax(),
            scores[i].masked_fill(~reasoning[i], math.inf).argmin(),
        )
        assert oar_g[i, top] > oar_g[i, low] and inv[i, top] < inv[i, low]  # the order is turned over
        torch.testing.assert_close(inv[i][reasoning[i]].sum(), reasoning[i].sum().float())  # mass preserved
    assert torch.equal(inv[~reasoning], completion[~reasoning])


def _study():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "signal_or_gate_study", ROOT / "research" / "signal-or-gate" / "study.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _finished_run(path: Path, before: float, after: float, single: list[float], completions: list[str]) -> Path:
    """A run folder as train.py leaves it, with the files the acceptance check reads."""
    import json

    path.mkdir(parents=True)
    (path / "summary.json").write_text(
        json.dumps({"steps": len(single), "accuracy_before": before, "accuracy_after": after})
    )
    (path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s + 1, "reward/frac_zero_std_groups": v}) + "\n" for s, v in enumerate(single))
    )
    (path / "eval_final.jsonl").write_text(json.dumps({"index": 0, "completion": completions}) + "\n")
    return path


def test_acceptance_band_by_hand(tmp_path):
    """Second half of 4 steps = steps 3, 4: mean(0.4, 0.5) = 0.45 < 0.5; reasoning spans (words before the
    marker) 21, 25 and one without an answer (not counted): median 23 >= 20; 10% and 50% inside the bands."""
    study = _study()
    words = lambda n: " ".join(["x"] * n)
    good = _finished_run(
        tmp_path / "good",
        0.10,
        0.50,
        [0.9, 0.9, 0.4, 0.5],
        [words(21) + " The answer is \\boxed{3}.", words(25) + " \\boxed{4}", words(2) + " no answer"],
    )
    got = study.acceptance(good, lambda t: len(t.split()))
    assert got["measured"] == {
        "start": 0.10,
        "end": 0.50,
        "single_reward_groups_second_half": 0.45,
        "median_reasoning_tokens": 23,
        "completions_with_answer": 2,
    }
    assert got["accepted"]
    saturated = _finished_run(tmp_path / "saturated", 0.10, 0.92, [0.1, 0.2, 0.6, 0.8], [words(8) + " \\boxed{3}"])
    bad = study.acceptance(saturated, lambda t: len(t.split()))
    assert bad["criteria"] == {"start": True, "end": False, "single_reward_groups": False, "reasoning_span": False}
    assert not bad["accepted"]


def test_study_runs_other_arms_only_when_the_band_is_met(tmp_path, monkeypatch):
    """The driver runs grpo seed 0 first; another arm only when that run's logs meet the band,
    else it stops (exit 2)."""
    study = _study()
    ran = []
    monkeypatch.setattr(study, "run_one", lambda args, r: ran.append(r["method"]) or "done")
    monkeypatch.setattr(study, "write_data", lambda: None)
    monkeypatch.setattr(study, "gguf_token_counter", lambda model: lambda t: len(t.split()))
    argv = [
        "--root",
        str(tmp_path / "root"),
        "--ledger",
        "none",
        "--model",
        str(tmp_path / "m.gguf"),
        "--seeds",
        "0",
        "1",
        "--arms",
        "grpo",
        "oar-g-q25",
    ]
    run = tmp_path / "root" / study.TASK / "grpo-s0"
    assert study.main(argv) == 2 and ran == ["grpo"]  # grpo-s0 did not finish (run_one is mocked): nothing else runs
    _finished_run(run, 0.10, 0.92, [0.1, 0.2, 0.6, 0.8], ["x " * 30 + "\\boxed{3}"])  # saturated
    ran.clear()
    assert study.main(argv) == 2 and ran == ["grpo"]
    import shutil

    shutil.rmtree(run)
    _finished_run(run, 0.10, 0.50, [0.9, 0.9, 0.4, 0.5], ["x " * 30 + "\\boxed{3}"])  # in the band
    ran.clear()
    assert study.main(argv) == 0 and ran == ["grpo", "oar-g-q25", "grpo", "oar-g-q25"]  # seed by seed


def test_study_goes_past_a_busy_run_and_keeps_it_out_of_the_ledger(tmp_path, monkeypatch):
    """A run another study process holds ('busy') is passed over, not recorded in the ledger (it has not
    finished), and does not stop the study."""
    study = _study()
    recorded = []
    monkeypatch.setattr(study, "run_one", lambda args, r: "busy" if r["method"] == "oar-g-q25" else "ok")
    monkeypatch.setattr(study, "write_data", lambda: None)
    monkeypatch.setattr(study, "check_model", lambda ledger, model: "matches")
    monkeypatch.setattr(study, "gguf_token_counter", lambda model: lambda t: len(t.split()))
    monkeypatch.setattr(study.study_ledger, "restore", lambda *a: 0)
    monkeypatch.setattr(study.study_ledger, "record_run", lambda ledger, root, task, name: recorded.append(name))
    _finished_run(
        tmp_path / "root" / study.TASK / "grpo-s0", 0.10, 0.50, [0.9, 0.9, 0.4, 0.5], ["x " * 30 + "\\boxed{3}"]
    )
    argv = [
        "--root",
        str(tmp_path / "root"),
        "--ledger",
        str(tmp_path / "ledger"),
        "--model",
        str(tmp_path / "m.gguf"),
        "--seeds",
        "0",
        "--arms",
        "grpo",
        "oar-g-q25",
        "random-gate-q25",
    ]
    assert study.main(argv) == 0 and recorded == ["grpo-s0", "random-gate-q25-s0"]


def test_train_py_runs_the_inverted_arm(tiny_model, tmp_path):
    """The arm as the study runs it: train.py --credit_module research/signal-or-gate/inverted.py --method
    oar-g-inverted at the authors' gate; its reasoning tokens are reshaped (weights other than 1)."""
    import json

    from tinyrun import TINY, run_inprocess

    run = tmp_path / "run"
    run_inprocess(
        [
            "--model",
            str(tiny_model),
            "--dataset",
            str(tiny_model / "data.jsonl"),
            "--credit_module",
            MODULE,
            "--method",
            "oar-g-inverted",
            "--gate_quantile",
            "0.25",
            "--gate_boost",
            "1",
            "--steps",
            "2",
            "--save_every",
            "0",
            "--output_dir",
            str(run),
            *TINY,
        ]
    )
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and any(r["oar/frac_scored"] > 0 and r["oar/weight_max"] > 1 for r in rows)


def test_the_committed_splits_are_the_tasks_and_are_never_rewritten(tmp_path):
    """write_data: the committed splits are what oar/tasks/arith.py makes (else the study stops), a start
    leaves them untouched (another study process's train.py may be reading them), and a fresh repository
    gets them whole."""
    study = _study()
    committed = [ROOT / study.DATA / f"{split}.jsonl" for split in study.SPLITS]
    stamps = [p.stat().st_mtime_ns for p in committed]
    study.write_data(ROOT)
    assert [p.stat().st_mtime_ns for p in committed] == stamps
    study.write_data(tmp_path)
    assert [(tmp_path / study.DATA / p.name).read_text() for p in committed] == [p.read_text() for p in committed]
    (tmp_path / study.DATA / "test.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit, match="not the task's test split"):
        study.write_data(tmp_path)
