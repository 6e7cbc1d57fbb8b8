"""research/proxy-ceiling: the masking curve, the mask-direction gradient, the metrics, the decision rule, and
measure.py end to end (a few rollouts of the shipped tiny-arith model in seconds: scores, resume, report)."""

import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import padded_batch, tiny_llama

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "research" / "proxy-ceiling"
sys.path.insert(0, str(STUDY))

import measure  # noqa: E402
import scores  # noqa: E402
import tables  # noqa: E402
from oar.oar_grad import gradient_scores  # noqa: E402
from oar.oar_perturb import perturbation_scores  # noqa: E402
from oar.probes import PROBES, outcome_from_logits  # noqa: E402


def one_row(b: int = 1):
    """Row b of the hand-made batch cut to its own tokens (no padding), as measure.row cuts a rollout."""
    ids, attn, reas, ans = padded_batch()
    keep = attn[b].bool()
    return ids[b : b + 1, keep], reas[b : b + 1, keep], ans[b : b + 1, keep]


@pytest.mark.parametrize("probe", PROBES)
def test_the_curve_at_alpha_one_is_exact_oar_p(probe):
    """alpha = 1 puts the pad token's embedding at t: exact OAR-P's masked copy. Tolerance: the curve's divergence
    is float64 from float32 logits, OAR-P's float32, and their forwards batch the copies differently."""
    model = tiny_llama()
    ids, reas, ans = one_row()
    _, kv = scores.clean_pass(model, ids)
    curve = scores.masking_curve(model, ids, reas, ans, pad_token_id=0, alphas=[0.3, 1.0], kv=kv)
    exact = perturbation_scores(model, ids, torch.ones_like(ids), reas, ans, probe=probe, pad_token_id=0)
    torch.testing.assert_close(curve[probe][1].float(), exact[0], rtol=1e-4, atol=1e-6)
    assert not torch.allclose(curve[probe][0].float(), exact[0])  # alpha = 0.3 is another perturbation
    assert (curve[probe][:, ~reas[0]] == 0).all()


def test_the_kl_curve_is_second_order_at_small_alpha():
    """J_t(alpha) = alpha^2 / 2 d^T F d + O(alpha^3) for a KL probe: doubling a small alpha quadruples it."""
    model = tiny_llama()
    ids, reas, ans = one_row()
    _, kv = scores.clean_pass(model, ids)
    curve = scores.masking_curve(model, ids, reas, ans, pad_token_id=0, alphas=[1e-3, 2e-3], kv=kv)["answer_mean"]
    ratio = curve[1, reas[0]] / curve[0, reas[0]]
    torch.testing.assert_close(ratio, torch.full_like(ratio, 4.0), rtol=1e-2, atol=0)


@pytest.mark.parametrize("probe", PROBES)
def test_the_mask_direction_gradient_along_the_input_is_oar_g(probe):
    """The same gradient as OAR-G's: projected on e_t it gives oar_grad.gradient_scores of the same noise."""
    model = tiny_llama()
    ids, reas, ans = one_row()
    attn = torch.ones_like(ids)
    logits, kv = scores.clean_pass(model, ids)
    clean = outcome_from_logits(logits, ids, ans, probe)
    noise = torch.randn(1, ids.shape[1], 32, generator=torch.Generator().manual_seed(0))
    oar_g = gradient_scores(model, ids, attn, reas, ans, probe=probe, noise=noise, noise_std=1e-2)
    mine = scores.mask_grad_scores(
        model, ids, reas, ans, probe=probe, noise=1e-2 * noise, pad_token_id=0, clean=clean, kv=kv, along="input"
    )
    torch.testing.assert_close(mine, oar_g, rtol=1e-4, atol=1e-9)  # float rounding of a grad of a tiny KL
    along_mask = scores.mask_grad_scores(
        model, ids, reas, ans, probe=probe, noise=1e-2 * noise, pad_token_id=0, clean=clean, kv=kv
    )
    assert (along_mask[:, ~reas[0]] == 0).all() and (along_mask[reas] > 0).all()


def test_a_method_against_itself_and_its_reverse():
    x = np.array([0.3, 0.1, 0.1, 0.9, 0.5, 0.2, 0.7])  # a tie too
    assert tables.spearman(x, x) == pytest.approx(1.0)
    assert tables.top_overlap(x, x) == pytest.approx(1.0)
    assert tables.spearman(x, -x) == pytest.approx(-1.0)
    assert math.isnan(tables.spearman(x, np.ones(7)))  # a constant method has no rank
    # k = ceil(0.2 * 5) = 1: the top token of [5, 4, 3, 2, 1] is the last of [1, 2, 3, 4, 5]'s: overlap 0
    assert tables.top_overlap([5, 4, 3, 2, 1], [1, 2, 3, 4, 5]) == 0.0
    # a two-way tie at the top of a: each token is in its top 1 with probability 1/2, one of them is b's top
    assert tables.top_overlap([2, 2, 1, 0, 0], [3, 0, 0, 0, 0]) == pytest.approx(0.5)


def ledger(rhos: dict, problems: list[int], cost: dict | None = None, retest: dict | None = None) -> dict:
    """A synthetic ledger: per rollout r, method m has Spearman rhos[m][r] with every probe's OAR-P."""
    names = list(rhos) + [f"oar-p/{p}" for p in PROBES]
    rows = []
    for r, problem in enumerate(problems):
        metrics = {
            m: {
                "rho": {p: rhos[m][r] if m in rhos else 1.0 for p in PROBES},
                "top20": 0.5,
                "retest": (retest or {}).get(m, 0.9),
                "auc": None,
            }
            for m in names
        }
        cpu = {m: (cost or {}).get(m, 1.0) for m in names}
        rows.append({"rollout": r, "problem": problem, "n_reasoning": 10, "metrics": metrics, "cpu_s": cpu})
    return {"settings": {"name": "smollm2", "rollouts": len(problems)}, "rollouts": rows}


def test_the_standard_error_is_over_problems():
    """Problem 0's rollouts 0.2 and 0.4 are one unit (mean 0.3), problem 1's 0.6 another: mean 0.45, s.e.
    std(0.3, 0.6; ddof 1) / sqrt 2 = 0.2121 / 1.4142 = 0.15."""
    data = ledger({tables.BASE + "/K1": [0.2, 0.4, 0.6]}, [0, 0, 1])
    mean, se, n, k = tables.summarize(data)[tables.BASE + "/K1"]["spearman"]
    assert (mean, n, k) == (pytest.approx(0.45), 3, 2)
    assert se == pytest.approx(0.15)


def test_the_decision_rule():
    """A cheap candidate 0.2 above today's OAR-G on every rollout, with a small spread, ships; the same gain at 2x the
    cost, or a gain of 0.1, does not; nothing ships when none passes."""
    problems = [r // 2 for r in range(20)]
    base = [0.3 + 0.01 * (r % 3) for r in range(20)]
    rhos = {f"oar-g/{p}/0.001/K1": base for p in PROBES}
    rhos |= {"cheap": [b + 0.2 + 0.001 * (r % 2) for r, b in enumerate(base)], "dear": [b + 0.3 for b in base]}
    rhos |= {"small": [b + 0.1 for b in base]}
    data = ledger(rhos, problems, cost={"dear": 2.0})
    dec = tables.decide(data, tables.summarize(data))
    assert dec["ships"]["candidate"] == "cheap"
    assert {r["candidate"] for r in dec["pairs"] if r["ships"]} == {"cheap"}
    assert not any(r["candidate"] == "dear" for r in dec["pairs"])  # over 1.5x: not a candidate
    rhos.pop("cheap")
    data = ledger(rhos, problems, cost={"dear": 2.0})
    assert tables.decide(data, tables.summarize(data))["ships"] is None
    rhos["cheap"] = [b + 0.2 for b in base]  # the same gain on every rollout: s.e. 0, z infinite
    data = ledger(rhos, problems, cost={"dear": 2.0})
    assert tables.decide(data, tables.summarize(data))["ships"]["candidate"] == "cheap"
    noisy = ledger(rhos, problems, cost={"dear": 2.0}, retest={"cheap": 0.75})  # below today's 0.9 - 0.1
    dec = tables.decide(noisy, tables.summarize(noisy))
    assert dec["ships"] is None and not next(r for r in dec["pairs"] if r["candidate"] == "cheap")["checks"]["retest"]


SMALL = {"answer_mean": {1e-3: 2}, "answer_joint": {0.0: 1}}


def test_measure_scores_resumes_and_reports(tmp_path, capsys):
    """Three rollouts of the fork testbed (the shipped tiny-arith model, planted tokens), two OAR-G draws: J-1 is
    exact OAR-P on every rollout; a second run resumes (the rollouts already measured are not recomputed); other
    settings are refused; the report writes the ledger, the tables and summary.json."""
    spec = replace(measure.SETS["fork"], rollouts=3, draws=SMALL)
    cache = tmp_path / "cache"
    first = measure.run_set(spec, cache, limit=2, log=lambda *a, **k: None)
    assert len(first["rollouts"]) == 2
    second = measure.run_set(spec, cache, log=lambda *a, **k: None)
    assert second["rollouts"][:2] == first["rollouts"]  # restored, not measured again (the times would differ)
    assert len(second["rollouts"]) == 3
    for rec in second["rollouts"]:
        s = rec["scores"]
        for p in PROBES:
            np.testing.assert_allclose(s[f"J-1/{p}"], s[f"oar-p/{p}"], rtol=1e-4, atol=1e-6)
        assert len(s["oar-g/answer_mean/0.001"]) == 2 and len(s["oar-g/answer_mean/0.001"][0]) == len(rec["positions"])
        assert rec["cpu_s"]["oar-g/answer_mean/0.001"][0][0] == 1  # the first batch is one pass: the cost unit
        assert len(rec["planted"]) == len(rec["positions"])
        assert set(rec["values"]) >= {"dv", "se", "plus", "minus"}
    with pytest.raises(SystemExit, match="other settings"):
        measure.run_set(replace(spec, draws={"answer_mean": {1e-3: 3}}), cache)
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text(f"page\n{tables.BEGIN}\nold\n{tables.END}\nafter\n")
    result = tables.report(cache, tmp_path / "ledger", out)
    fork = result["sets"]["fork"]
    assert fork["oar-p/answer_mean"]["spearman"][0] == pytest.approx(1.0)
    assert fork["J-1/answer_mean"]["spearman"][0] == pytest.approx(1.0, abs=1e-3)
    assert fork[tables.BASE + "/K1"]["cost"] == pytest.approx(1.0)
    assert fork[tables.BASE + "/K1"]["spearman"][2] == 3  # three rollouts scored
    assert result["decision"] is None  # no smollm2 ledger
    page = (out / "README.md").read_text()
    assert "old" not in page and page.endswith("after\n") and "| method (vs exact OAR-P, answer_mean) | fork |" in page
    assert (tmp_path / "ledger" / "fork.json.gz").is_file() and (out / "tables.md").is_file()
