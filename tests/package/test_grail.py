"""oar/grail.py: GRAIL's weights by hand and as properties, its score against finite differences."""

import math

import pytest
import torch
from conftest import padded_batch, tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st

from oar.grail import grail_scores, grail_weights, reweighted_rows
from oar.lm import position_ids

ALL = torch.ones(1, 3, dtype=torch.bool)
YES = torch.tensor([True])


def test_weights_by_hand():
    # scores 1, e, e^2 without the guards: u = 0, 1, 2; mu = 1; sigma = sqrt((1 + 0 + 1) / 3) = 0.8164966;
    # z = -1.2247449, 0, 1.2247449
    s = torch.tensor([[1.0, math.e, math.e**2]])
    # spread 0.5: 1 + 0.5 z = 0.3876276, 1, 1.6123724; clipped to [0.5, 5]: 0.5, 1, 1.6123724
    w = grail_weights(s, ALL, YES, log_eps=0.0, std_eps=0.0)
    torch.testing.assert_close(w.weights, torch.tensor([[0.5, 1.0, 1.6123724]]))
    assert (w.nonfinite, w.flat) == (0, 0)
    # spread 4: 1 + 4 z = -3.8989795, 1, 5.8989795; clipped: 0.5, 1, 5
    w = grail_weights(s, ALL, YES, spread=4.0, log_eps=0.0, std_eps=0.0)
    torch.testing.assert_close(w.weights, torch.tensor([[0.5, 1.0, 5.0]]))
    # centre 2, range [0, 10]: 2 + 0.5 z = 1.3876276, 2, 2.6123724
    w = grail_weights(s, ALL, YES, center=2.0, w_min=0.0, w_max=10.0, log_eps=0.0, std_eps=0.0)
    torch.testing.assert_close(w.weights, torch.tensor([[1.3876276, 2.0, 2.6123724]]))
    # GRAIL's guards (1e-8 in the log and under the root) move these by ~1e-8: within float32 rounding
    torch.testing.assert_close(grail_weights(s, ALL, YES).weights, torch.tensor([[0.5, 1.0, 1.6123724]]))


def test_weights_by_hand_with_a_position_left_out():
    # the mask keeps positions 0 and 2: u = 0, 2 (the 100 at position 1 is not a statistic); mu = 1,
    # sigma = 1, z = -1, 1; 1 + 0.5 z = 0.5, 1.5; position 1 gets 1
    s = torch.tensor([[1.0, 100.0, math.e**2]])
    w = grail_weights(s, torch.tensor([[True, False, True]]), YES, log_eps=0.0, std_eps=0.0)
    torch.testing.assert_close(w.weights, torch.tensor([[0.5, 1.0, 1.5]]))


def test_degenerate_rows_get_ones_and_are_counted():
    nan = float("nan")
    s = torch.tensor(
        [
            [0.3, 0.0, 0.0],  # one scored token: flat
            [0.2, 0.2, 0.2],  # all equal: flat
            [0.1, nan, 0.4],  # a NaN: non-finite
            [0.1, nan, 0.4],  # the same, not reweighted: not counted
            [0.1, 0.2, 0.4],  # no scored token: nothing to count
        ]
    )
    mask = torch.tensor([[True, False, False], [True] * 3, [True] * 3, [True] * 3, [False] * 3])
    w = grail_weights(s, mask, torch.tensor([True, True, True, False, True]))
    assert torch.equal(w.weights, torch.ones(5, 3))
    assert (w.nonfinite, w.flat) == (1, 2)
    # an inf score is as unusable as a NaN; with log_eps = 0 so is a 0 (log 0 = -inf)
    assert grail_weights(torch.tensor([[0.1, math.inf, 0.4]]), ALL, YES).nonfinite == 1
    assert grail_weights(torch.tensor([[0.1, 0.0, 0.4]]), ALL, YES, log_eps=0.0).nonfinite == 1
    assert grail_weights(torch.tensor([[0.1, 0.0, 0.4]]), ALL, YES).nonfinite == 0  # GRAIL's guard: log 1e-8


def test_reweighted_rows_follow_the_sign_of_the_advantage():
    a = torch.tensor([-1.0, 0.0, 0.5])
    assert reweighted_rows(a).tolist() == [True, True, False]  # GRAIL's run default: A <= 0
    assert reweighted_rows(a, "correct").tolist() == [False, False, True]
    assert reweighted_rows(a, "both").tolist() == [True, True, True]
    with pytest.raises(ValueError, match="rollouts must be one of"):
        reweighted_rows(a, "all")  # GRAIL's README and config comment name it; its code refuses it too


@st.composite
def batches(draw):
    b, length = draw(st.integers(1, 5)), draw(st.integers(1, 8))
    score = st.one_of(st.just(0.0), st.floats(1e-6, 1e3))
    s = torch.tensor(draw(st.lists(st.lists(score, min_size=length, max_size=length), min_size=b, max_size=b)))
    mask = torch.tensor(
        draw(st.lists(st.lists(st.booleans(), min_size=length, max_size=length), min_size=b, max_size=b))
    )
    reweight = torch.tensor(draw(st.lists(st.booleans(), min_size=b, max_size=b)))
    return s, mask, reweight


@settings(deadline=None)
@given(batches(), st.floats(0.05, 5.0))
def test_weights_lie_in_the_range_and_are_exactly_one_where_nothing_is_reweighted(batch, spread):
    s, mask, reweight = batch
    w = grail_weights(s, mask, reweight, spread=spread).weights
    assert torch.equal(w[~reweight], torch.ones_like(w[~reweight]))
    assert torch.equal(w[~mask], torch.ones_like(w[~mask]))
    assert ((w >= 0.5) & (w <= 5.0)).all()
    # non-decreasing in the score within a row: log, the z-score and the clip are all monotone
    for i in reweight.nonzero().flatten().tolist():
        order = s[i][mask[i]].argsort(stable=True)
        assert (w[i][mask[i]][order].diff() >= 0).all()


@settings(deadline=None)
@given(batches(), st.randoms(use_true_random=False))
def test_weights_do_not_depend_on_batching_or_row_order(batch, rnd):
    s, mask, reweight = batch
    whole = grail_weights(s, mask, reweight)
    alone = [grail_weights(s[i : i + 1], mask[i : i + 1], reweight[i : i + 1]) for i in range(len(s))]
    assert torch.equal(whole.weights, torch.cat([a.weights for a in alone]))
    assert (whole.nonfinite, whole.flat) == (sum(a.nonfinite for a in alone), sum(a.flat for a in alone))
    perm = torch.tensor(rnd.sample(range(len(s)), len(s)))
    assert torch.equal(grail_weights(s[perm], mask[perm], reweight[perm]).weights, whole.weights[perm])


def _answer_nll(model, embeds, attention_mask, input_ids, answer_mask, temperature):
    """J of one row by a plain full forward: -sum over answer tokens k of log softmax(z_{k-1} / T)[x_k]."""
    logits = model(
        inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids(attention_mask)
    ).logits
    logp = torch.log_softmax(logits[0, :-1] / temperature, dim=-1).gather(-1, input_ids[0, 1:, None]).squeeze(-1)
    return -logp[answer_mask[0, 1:]].sum()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scores_match_finite_differences_of_the_answer_nll(temperature):
    # Central differences, independent of autograd, in float64. Llama's forward still runs its RMSNorm and
    # attention softmax in float32, which puts a noise floor of ~1e-7 under J: at step 1e-3 the differences
    # carry ~1e-4 of the score (measured), hence rtol 1e-3, well below the ~20% between neighbouring
    # tokens' scores that an off-by-one would show. This transformers' float64 forward also turns
    # left-padded rows into NaN (its padding mask), so the check reads row 0, which has no left padding:
    # prompt 0-4, reasoning 5-12, answer 13-14, EOS 15. Exactness is the next test's (autograd by hand).
    model = tiny_llama().double()
    ids, attn, reas, ans = padded_batch()
    completion = attn.bool() & (torch.arange(ids.shape[1]) >= 5)  # every prompt ends at column 4
    scores = grail_scores(model, ids, attn, completion, ans, temperature=temperature)
    assert torch.equal(scores[~completion], torch.zeros_like(scores[~completion]))

    i, a, m = ids[:1], attn[:1], ans[:1]
    with torch.no_grad():
        e = model.get_input_embeddings()(i)
        for t in [5, 12, 13, 14, 15]:  # first and last reasoning token, first and last answer token, EOS
            g = torch.zeros(e.shape[-1], dtype=torch.float64)
            for h in range(e.shape[-1]):
                up, down = e.clone(), e.clone()
                up[0, t, h] += 1e-3
                down[0, t, h] -= 1e-3
                g[h] = (
                    _answer_nll(model, up, a, i, m, temperature) - _answer_nll(model, down, a, i, m, temperature)
                ) / 2e-3
            # the score of token t is its own embedding's (not the token before it's, as in GRAIL's code)
            torch.testing.assert_close(scores[0, t], (g * e[0, t]).norm().float(), rtol=1e-3, atol=1e-6)
    # the last answer token and what follows reach no answer logit: exactly 0
    assert scores[0, 14] == 0 and scores[0, 15] == 0 and (scores[0, 5:14] > 0).all()


def test_scores_match_autograd_by_hand_on_every_row():
    # float32, left padding included: each row alone through a plain full forward (every column, every
    # logit), its J's gradient with respect to its embeddings, then || g_t * e_t || on the scored tokens
    model = tiny_llama()
    ids, attn, reas, ans = padded_batch()
    scores = grail_scores(model, ids, attn, reas | ans, ans, temperature=0.7)
    for r in range(len(ids)):
        i, a, m = ids[r : r + 1], attn[r : r + 1], ans[r : r + 1]
        e = model.get_input_embeddings()(i).detach().requires_grad_(True)
        (g,) = torch.autograd.grad(_answer_nll(model, e, a, i, m, 0.7), e)
        expected = torch.where(reas[r] | ans[r], (g[0] * e[0]).norm(dim=-1), 0.0).detach()
        torch.testing.assert_close(scores[r], expected)


def test_scores_write_no_parameter_grad_and_skip_rows_with_nothing_to_score():
    model = tiny_llama()
    ids, attn, reas, ans = padded_batch()
    before = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = before[n].clone()
    reas[2] = False  # row 2 has nothing to score
    scores = grail_scores(model, ids, attn, reas, ans)
    assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters())
    assert (scores[2] == 0).all() and (scores[:2][reas[:2]] > 0).all()
    empty = torch.zeros_like(reas)
    assert torch.equal(grail_scores(model, ids, attn, empty, ans), torch.zeros(ids.shape))


def test_a_broken_row_scores_nan_and_keeps_grpo_weights():
    model = tiny_llama()
    ids, attn, reas, ans = padded_batch()
    ids = ids.masked_fill(ids == 39, 38)
    ids[0, 6] = 39  # a reasoning token of row 0 alone, whose embedding is NaN
    with torch.no_grad():
        model.get_input_embeddings().weight[39] = float("nan")
    scores = grail_scores(model, ids, attn, reas, ans)
    assert scores[0][reas[0]].isnan().all() and torch.isfinite(scores[1:]).all()
    w = grail_weights(scores, reas, torch.ones(3, dtype=torch.bool))
    assert torch.equal(w.weights[0], torch.ones(ids.shape[1])) and w.nonfinite == 1
    assert (w.weights[1:][reas[1:]] != 1).any()
