"""Bi-level gating (maths §5): a hand-computed case and the invariants as hypothesis properties."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from oar.gating import bilevel_weights, weight_stats


def test_bilevel_weights_by_hand():
    # Scores s = e^u - 1 with u = [0, 1, 2, 3, 4], so n = [0, .25, .5, .75, 1].
    # q = 0.4: position 0.4 * 4 = 1.6 -> tau = .25 + .6 * (.5 - .25) = 0.4.
    # suppress: n=0 -> max(0 / .4, .1) = .1;  n=.25 -> .625
    # boost (beta 2): n=.5 -> 1 + 2 * .1 / .6 = 1.3333; n=.75 -> 1 + 2 * .35 / .6 = 2.1667; n=1 -> 3
    # sum = 7.225; mass preserved: w * 5 / 7.225. Two positions outside the span keep weight 1.
    s = torch.tensor([[9.0, math.e**0 - 1, math.e - 1, math.e**2 - 1, math.e**3 - 1, math.e**4 - 1, -5.0]])
    mask = torch.tensor([[False, True, True, True, True, True, False]])
    raw = torch.tensor([0.1, 0.625, 1 + 2 * 0.1 / 0.6, 1 + 2 * 0.35 / 0.6, 3.0])
    w = bilevel_weights(s, mask, preserve_mass=False)
    torch.testing.assert_close(w[0, 1:6], raw)
    w = bilevel_weights(s, mask)
    torch.testing.assert_close(w[0, 1:6], raw * 5 / 7.225)
    assert w[0, 0] == 1 and w[0, 6] == 1


def test_degenerate_rows():
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, False], [True, True, True]])
    s = torch.tensor([[1.0, 2.0, 0.0], [1.0, 2.0, 3.0], [5.0, 0.0, 0.0], [1.0, float("nan"), 2.0]])
    w = bilevel_weights(s, mask)
    # Row 0 reshapes; row 1 has no reasoning, row 2 one token (max u = min u), row 3 a NaN: all ones.
    assert not torch.equal(w[0, :2], torch.ones(2))
    assert torch.equal(w[1:], torch.ones(3, 3))


def test_a_row_with_an_infinite_score_gets_ones():
    """+-inf, like NaN, is a broken score, not a very large one: its row keeps GRPO's weights (a NaN
    reaches every min/max, an inf only some: the check must look at every score)."""
    mask = torch.ones(3, 4, dtype=torch.bool)
    w = bilevel_weights(
        torch.tensor([[1.0, float("inf"), 2.0, 0.5], [1.0, float("-inf"), 2.0, 0.5], [1.0, 3.0, 2.0, 0.5]]), mask
    )
    assert torch.equal(w[:2], torch.ones(2, 4)) and not torch.equal(w[2], torch.ones(4))


def test_guards_do_not_move_tokens_between_branches():
    # Scores [0, 0, 0, 1]: n = [0, 0, 0, 1]; q = 0.4 -> tau = 0, so every token takes the boost
    # branch: n=0 -> 1 + 2 * 0 = 1, n=1 -> 3 (no division by tau = 0).
    w = bilevel_weights(torch.tensor([[0.0, 0, 0, 1]]), torch.ones(1, 4, dtype=torch.bool), preserve_mass=False)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1, 1, 3]]))
    # Scores [0, 1, 1, 1]: tau = 1, n=1 tokens boost by (1 - 1) / 0 := 0 -> weight 1; n=0 -> floor.
    w = bilevel_weights(torch.tensor([[0.0, 1, 1, 1]]), torch.ones(1, 4, dtype=torch.bool), preserve_mass=False)
    torch.testing.assert_close(w, torch.tensor([[0.1, 1, 1, 1]]))


def test_variants_are_settings_not_flags():
    s = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    m = torch.ones(1, 5, dtype=torch.bool)
    boost_only = bilevel_weights(s, m, floor=1.0, preserve_mass=False)
    assert (boost_only >= 1).all()
    suppress_only = bilevel_weights(s, m, boost=0.0, preserve_mass=False)
    assert (suppress_only <= 1).all()
    with pytest.raises(AssertionError, match="quantile"):
        bilevel_weights(s, m, quantile=1.0)


def test_weight_stats():
    w = torch.tensor([[0.5, 1.5, 1.0, 7.0]])
    m = torch.tensor([[True, True, True, False]])
    st_ = weight_stats(w, m)
    # Over the 3 reasoning tokens: mean 1, max 1.5, one boosted, one suppressed;
    # ESS = 3^2 / (3 * (0.25 + 2.25 + 1)) = 9 / 10.5.
    assert st_["weight_mean"] == pytest.approx(1.0) and st_["weight_max"] == 1.5
    assert st_["frac_boosted"] == pytest.approx(1 / 3) and st_["frac_suppressed"] == pytest.approx(1 / 3)
    assert st_["ess_ratio"] == pytest.approx(9 / 10.5)
    # No token to describe (a step where OAR scored no rollout): GRPO's weights, not zeros
    none = weight_stats(w, torch.zeros_like(m))
    assert none == {
        "weight_mean": 1.0,
        "weight_max": 1.0,
        "frac_boosted": 0.0,
        "frac_suppressed": 0.0,
        "ess_ratio": 1.0,
    }


# ---------------------------------------------------------------- properties
@st.composite
def scored_rows(draw, min_len=1, max_len=24, signed=False):
    n = draw(st.integers(min_len, max_len))
    scores = draw(st.lists(st.floats(-1e6 if signed else 0, 1e6, allow_nan=False, width=32), min_size=n, max_size=n))
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return torch.tensor([scores]), torch.tensor([mask])


gate_params = st.fixed_dictionaries(
    {
        "quantile": st.floats(0.01, 0.99),
        "boost": st.floats(0, 8),
        "floor": st.floats(0, 1),
    }
)


@settings(max_examples=300, deadline=None)
@given(scored_rows(signed=True), gate_params)
def test_weights_finite_nonnegative_one_outside_and_mass_preserved(row, params):
    s, m = row
    w = bilevel_weights(s, m, **params)
    assert torch.isfinite(w).all() and (w >= 0).all()
    assert (w[~m] == 1).all()
    # sum over R equals n_R, so a rollout's advantage mass sum_t A_i w_t equals GRPO's A_i * T_i.
    torch.testing.assert_close(w[m].sum(), torch.tensor(float(m.sum())), rtol=1e-5, atol=1e-4)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20), st.floats(0, 1e4, width=32), gate_params)
def test_equal_scores_give_all_ones(n, value, params):
    w = bilevel_weights(torch.full((1, n), value), torch.ones(1, n, dtype=torch.bool), **params)
    assert torch.equal(w, torch.ones(1, n))


@settings(max_examples=300, deadline=None)
@given(scored_rows(min_len=2, signed=True), gate_params)
def test_weights_are_monotone_in_the_score_before_rescaling(row, params):
    """Monotone in |s| (maths §5 step 1, u = log(1 + |s|)): a signed score's sign is dropped."""
    s, m = row
    w = bilevel_weights(s, m, preserve_mass=False, **params)
    order = s[m].abs().argsort()
    assert (w[m][order].diff() >= -1e-6).all()


@settings(max_examples=200, deadline=None)
@given(scored_rows(), gate_params, st.randoms(use_true_random=False))
def test_permuting_positions_permutes_weights(row, params, rng):
    s, m = row
    perm = list(range(s.shape[1]))
    rng.shuffle(perm)
    w = bilevel_weights(s, m, **params)
    wp = bilevel_weights(s[:, perm], m[:, perm], **params)
    torch.testing.assert_close(wp, w[:, perm])


@settings(max_examples=200, deadline=None)
@given(scored_rows(), gate_params, st.integers(0, 5), st.floats(-1e9, 1e9, width=32))
def test_padding_never_changes_a_weight(row, params, n_pad, junk):
    s, m = row
    assume(n_pad > 0 or not m.all())
    w = bilevel_weights(s, m, **params)
    # Junk (even NaN/inf) outside the span, and extra padded positions, leave the weights alone.
    s2 = torch.where(m, s, torch.tensor(junk))
    s2 = torch.cat([s2, torch.full((1, n_pad), float("nan"))], 1)
    m2 = torch.cat([m, torch.zeros(1, n_pad, dtype=torch.bool)], 1)
    w2 = bilevel_weights(s2, m2, **params)
    torch.testing.assert_close(w2[:, : s.shape[1]], w)


@settings(max_examples=100, deadline=None)
@given(scored_rows(max_len=12), gate_params, st.floats(0.01, 3), st.sampled_from([-1.0, 1.0]))
def test_token_advantages_keep_the_sign_and_mass_of_grpo(row, params, size, sign):
    s, m = row
    adv = sign * size
    params = {**params, "floor": max(params["floor"], 0.01)}  # floor 0 may zero a token, never flip it
    w = bilevel_weights(s, m, **params)
    token_adv = adv * w
    assert (torch.sign(token_adv) == math.copysign(1, adv)).all()
    # Completion = every position here: total mass A_i * T_i.
    torch.testing.assert_close(
        token_adv.sum(), torch.tensor(adv * s.shape[1], dtype=torch.float32), rtol=1e-5, atol=1e-4
    )


def test_rows_are_independent():
    g = torch.Generator().manual_seed(0)
    s = torch.rand(4, 9, generator=g)
    m = torch.rand(4, 9, generator=g) < 0.7
    w = bilevel_weights(s, m)
    for i in range(4):
        torch.testing.assert_close(bilevel_weights(s[i : i + 1], m[i : i + 1]), w[i : i + 1])
