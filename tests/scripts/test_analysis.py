"""The evidence study's own maths and pictures: attribution metrics on hand-made inputs (the arithmetic
in the comments), the pivotal-token labelling of an arith solution, and the heatmap page on a tiny
random model. Fast: no training, no built tiny-arith."""

import math

import numpy as np
import pytest
import torch

from oar.tasks.arith import arith_solution
from oar.training.data import Problem
from scripts.analysis.attribution import (
    average_ranks,
    make_rollouts,
    pivotal_char_spans,
    pivotal_mask,
    precision_at_k,
    roc_auc,
    spearman,
    token_labels,
    top_overlap,
)

SOLUTION = "37 + 48 = 85\n85 - 15 = 70\n70 * 2 = 140\n#### 140"


# ----------------------------------------------------------------------------------------- metrics


def test_average_ranks_share_ties():
    # sorted: 1 (rank 1), 2 2 (ranks 2, 3 -> 2.5 each), 5 (rank 4)
    assert average_ranks([5, 2, 1, 2]).tolist() == [4.0, 2.5, 1.0, 2.5]


def test_precision_at_k():
    # k = 2 pivotal tokens (0 and 3); the top 2 scores are tokens 0 and 2: one hit -> 1/2
    assert precision_at_k([0.9, 0.1, 0.8, 0.2], [1, 0, 0, 1]) == 0.5
    assert precision_at_k([0.9, 0.1, 0.3, 0.8], [1, 0, 0, 1]) == 1.0
    # all scores tied: the single slot goes to a random token, 1 of 4 is pivotal -> 1/4
    assert precision_at_k([1, 1, 1, 1], [1, 0, 0, 0]) == 0.25
    # k = 2: token 0 (score 3, not pivotal) is in; one slot left among the tied tokens 1, 2
    # (one of the two pivotal) -> expected hits 0 + 1 * 1/2 = 0.5, precision 0.5 / 2 = 0.25
    assert precision_at_k([3, 2, 2, 1], [0, 1, 0, 1]) == 0.25
    assert math.isnan(precision_at_k([1, 2], [0, 0])) and math.isnan(precision_at_k([1, 2], [1, 1]))


def test_roc_auc():
    # positives score 0.9, 0.2; negatives 0.1, 0.8. Pairs won: 0.9>0.1, 0.9>0.8, 0.2>0.1; lost 0.2<0.8 -> 3/4
    assert roc_auc([0.9, 0.1, 0.8, 0.2], [1, 0, 0, 1]) == 0.75
    assert roc_auc([1, 1, 1], [1, 0, 0]) == 0.5  # every pair tied: 1/2 each
    # positive 2 vs negatives 2 (tie, 1/2) and 1 (win) -> 1.5 / 2
    assert roc_auc([2, 2, 1], [1, 0, 0]) == 0.75
    assert roc_auc([3, 2, 1], [0, 1, 1]) == 0.0
    assert math.isnan(roc_auc([1, 2], [1, 1]))


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 45]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks (1, 2, 3) vs (1, 3, 2): d = (0, -1, 1), 1 - 6 * 2 / (3 * 8) = 0.5
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert spearman([1, 2, 3], [7, 7, 7]) == 0.0


def test_spearman_gives_ties_their_average_rank():
    # a's ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4), centred: 4.5 / sqrt(4.5 * 5) = 3 / sqrt(10)
    # (scipy.stats.spearmanr's value; scipy is not a dependency, so the case is worked by hand)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(3 / math.sqrt(10))
    assert spearman([5, 5, 1, 1], [2, 2, 0, 0]) == pytest.approx(1.0)


def test_top_overlap():
    # n = 10 -> m = ceil(2.0) = 2. top(a) = {9, 8}; in b token 8 drops to the bottom -> top(b) = {9, 7}: 1/2
    a = np.arange(10.0)
    b = a.copy()
    b[8] = -1
    assert top_overlap(a, a) == 1.0
    assert top_overlap(a, b) == 0.5
    assert top_overlap(a, -a) == 0.0
    assert top_overlap([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == 0.0  # m = ceil(0.6) = 1: {2} vs {0}


# ---------------------------------------------------------------------------------- pivotal labels


def test_pivotal_spans_of_an_arith_solution():
    assert arith_solution(Problem("Compute ((37 + 48) - 15) * 2.", "140")) == SOLUTION
    spans = pivotal_char_spans(SOLUTION)
    # each line's result, then the final answer; the operands, including the copied "85" and "70"
    # that open lines 2 and 3, are not pivotal
    assert [SOLUTION[a:b] for a, b in spans] == ["85", "70", "140", "140"]
    assert spans[0] == (10, 12) and spans[1] == (23, 25)
    assert pivotal_char_spans("1 + 2 = -3\n") == [(8, 10)]  # no answer marker: the result only, its sign included


def test_token_labels_for_multi_character_tokens():
    # tokens "37 + 48", " =", " 8", "5\n": a token is pivotal when it overlaps a result's characters
    offsets = [(0, 7), (7, 9), (9, 11), (11, 13), (13, 13)]  # the last is a special token (empty)
    assert token_labels(offsets, [(10, 12)]) == [False, False, True, True, False]


def test_pivotal_mask_on_a_rollout_labels_its_own_text():
    from oar.sampler import encode_prompts
    from oar.rollout import build_rollout
    from oar.tasks.tiny_arith import make_tokenizer

    tok = make_tokenizer()  # 1 character = 1 token
    wrong = SOLUTION.replace("= 70", "= 71")  # a wrong intermediate is still that rollout's pivotal token
    prompt_ids, prompt_mask = encode_prompts(tok, ["Q: x\nA:\n", "Q: longer prompt\nA:\n"], "cpu")
    rows = [tok(s, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for s in (SOLUTION, wrong)]
    completion = torch.full((2, max(map(len, rows))), tok.pad_token_id)
    for i, r in enumerate(rows):
        completion[i, : len(r)] = torch.tensor(r)
    ro = build_rollout(tok, prompt_ids, prompt_mask, completion, {tok.eos_token_id})
    mask = pivotal_mask(tok, ro.input_ids, ro.completion_mask, ro.prompt_width)
    for i, text in enumerate((SOLUTION, wrong)):
        labelled = [c - ro.prompt_width for c in mask[i].nonzero().flatten().tolist()]
        expected = [k for a, b in pivotal_char_spans(text) for k in range(a, b)]
        assert labelled == expected
        assert "".join(text[k] for k in labelled) == ("85" + "70" if i == 0 else "85" + "71") + "140" + "140"
    # the answer's digits are labelled but lie outside the reasoning span, where no score exists
    assert mask.sum(1).tolist() == [10, 10] and (mask & ro.reasoning_mask).sum(1).tolist() == [7, 7]


# ---------------------------------------------------------------------------------------- heatmap


def test_heatmap_page_on_a_tiny_random_model(tmp_path):
    from oar.tasks.tiny_arith import TinyArithRecipe, make_model, make_tokenizer
    from scripts.analysis.heatmap import heatmap_data, render_html, render_png

    torch.manual_seed(0)
    tok = make_tokenizer()
    model = make_model(tok, TinyArithRecipe(hidden_size=32, num_layers=1, num_heads=2)).eval()
    problem = Problem("Compute ((37 + 48) - 15) * 2.", "140")
    ro = make_rollouts(model, tok, [problem], source="gold", seed=0, max_new_tokens=64)
    gating = {"quantile": 0.4, "boost": 2.0, "floor": 0.1, "preserve_mass": True}
    data = heatmap_data(model, tok, ro, probe="answer_mean", gating=gating)
    n_reasoning = int(ro.reasoning_mask.sum())
    assert sum(t["reasoning"] for t in data["tokens"]) == n_reasoning == len(SOLUTION.split("####")[0])
    for p in data["panels"].values():  # mass preservation: the reasoning weights sum to n_R
        assert sum(w for w, t in zip(p["weights"], data["tokens"]) if t["reasoning"]) == pytest.approx(
            n_reasoning, rel=1e-5
        )

    page = render_html(data, "a <title> & more")
    assert page.count('title="w=') == 2 * n_reasoning  # one hover per reasoning token per panel
    assert page.count("outside reasoning: w=1") == 2 * (len(data["tokens"]) - n_reasoning)
    assert "OAR-G" in page and "OAR-P" in page and "a &lt;title&gt; &amp; more" in page
    assert page.count('class="tok pivotal"') == 2 * 7  # 85, 70, 140 in the reasoning, both panels
    png = render_png(data, "tiny", tmp_path / "h.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------------- report


def _fake_run(root, name, seed, method, before, after, step_s):
    """A finished run folder as train.py and study.py leave it, 4 steps, an evaluation at step 2."""
    import json

    d = root / f"{name}-s{seed}"
    d.mkdir(parents=True)
    config = {
        "method": method,
        "model": "tiny-arith",
        "dataset": "arith",
        "steps": 4,
        "prompts_per_step": 2,
        "group_size": 2,
        "max_new_tokens": 8,
        "learning_rate": 1e-3,
        "temperature": 1.0,
        "eval_every": 2,
        "eval_size": 500,
        "gate_quantile": 0.4,
        "gate_boost": 2.0,
        "gate_floor": 0.1,
        "probe": "answer_mean",
    }
    (d / "config.json").write_text(json.dumps(config))
    (d / "summary.json").write_text(
        json.dumps(
            {
                "method": method,
                "steps": 4,
                "seconds_per_step": step_s,
                "accuracy_before": before,
                "accuracy_after": after,
            }
        )
    )
    rows = [
        {
            "step": s,
            "time/step_s": step_s,
            "oar/seconds_per_rollout": 0.0,
            "reward/mean": 0.5,
            "policy/entropy": 1.0,
            "oar/ess_ratio": 1.0,
            **({"eval/accuracy": (before + after) / 2} if s == 2 else {}),
        }
        for s in range(1, 5)
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "study_time.json").write_text(json.dumps({"seconds": 10.0, "cpu_seconds": 9.0, "code": ["abc"]}))
