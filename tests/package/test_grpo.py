"""GRPO maths: hand-computed cases (arithmetic in the comments) and hypothesis properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oar.gating import bilevel_weights
from oar.grpo import group_advantages, policy_loss, token_entropy, token_logprobs


# ---------------------------------------------------------------- group advantages, by hand
def test_group_advantages_by_hand():
    # Group [1, 0, 0, 0]: mean 0.25; unbiased var = (0.75^2 + 3 * 0.25^2) / 3 = 0.25, std 0.5.
    # A = 0.75 / 0.5001 and -0.25 / 0.5001. Group [1, 1, 1, 1] is tied: A = 0.
    adv = group_advantages(torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1]), group_size=4)
    expected = torch.tensor([0.75 / 0.5001] + [-0.25 / 0.5001] * 3 + [0.0] * 4)
    torch.testing.assert_close(adv, expected)


def test_group_advantages_batch_and_none_scales():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    # Centred per group: [0.5, -0.5] and the tied [0, 0]. Batch std of [1, 0, 1, 1]:
    # mean 0.75, squares 3 * 0.0625 + 0.5625 = 0.75, / 3 = 0.25 -> std 0.5.
    torch.testing.assert_close(
        group_advantages(r, 2, scale="batch"), torch.tensor([0.5 / 0.5001, -0.5 / 0.5001, 0, 0])
    )
    torch.testing.assert_close(group_advantages(r, 2, scale="none"), torch.tensor([0.5, -0.5, 0, 0]))
    # one process's half of a step: the batch std is the whole step's (train.py gathers it), not the half's 0.707
    torch.testing.assert_close(
        group_advantages(r[:2], 2, scale="batch", batch_rewards=r), torch.tensor([0.5 / 0.5001, -0.5 / 0.5001])
    )
    with pytest.raises(ValueError, match="scale"):
        group_advantages(r, 2, scale="rank")


groups = st.integers(1, 4).flatmap(
    lambda p: st.integers(2, 6).flatmap(
        lambda g: st.tuples(st.just(g), st.lists(st.floats(-10, 10, width=32), min_size=p * g, max_size=p * g))
    )
)


@settings(max_examples=200, deadline=None)
@given(groups, st.sampled_from(["group", "batch", "none"]))
def test_advantages_have_zero_mean_per_group_and_zero_for_ties(case, scale):
    g, values = case
    r = torch.tensor(values)
    adv = group_advantages(r, g, scale=scale).view(-1, g)
    assert torch.isfinite(adv).all()
    # Zero mean up to float32 rounding of values up to 10 / (std + 1e-4).
    assert adv.mean(dim=1).abs().max() <= 1e-3 * (1 + adv.abs().max())
    tied = (r.view(-1, g) == r.view(-1, g)[:, :1]).all(dim=1)
    assert (adv[tied] == 0).all()


@pytest.mark.parametrize("value, g", [(0.1, 7), (0.3, 6), (1 / 3, 5)])
def test_a_tied_group_of_any_reward_has_advantage_exactly_zero(value, g):
    """Centring 7 x 0.1 in float32 leaves ~1e-8, and dividing by std + 1e-4 magnifies it to ~1e-4: a
    tied group has no signal and must get exactly 0, not rounding (hypothesis rarely draws such ties)."""
    r = torch.cat([torch.full((g,), value), torch.tensor([0.0] * (g - 1) + [1.0])])
    for scale in ("group", "batch", "none"):
        adv = group_advantages(r, g, scale=scale)
        assert torch.equal(adv[:g], torch.zeros(g)) and adv[g:].abs().sum() > 0, (scale, adv)


def test_the_loss_statistics_ignore_padding():
    """ratio_mean, approx_kl, clip_frac and kl_ref are over the valid tokens: what padding holds moves none."""
    old, adv, mask = torch.tensor([[-0.5, -0.5, 0.0]]), torch.ones(1, 3), torch.tensor([[True, True, False]])
    stats = [
        policy_loss(
            torch.tensor([[0.0, 0.0, pad]]), old, adv, mask, kl_beta=0.1, ref_logprobs=torch.tensor([[0.0, -1.0, pad]])
        )[1]
        for pad in (5.0, -5.0)
    ]
    assert stats[0] == stats[1]
    assert math.isclose(stats[0]["ratio_mean"], math.exp(0.5), rel_tol=1e-6) and stats[0]["clip_frac"] == 1.0
    assert math.isclose(stats[0]["approx_kl"], math.exp(-0.5) + 0.5 - 1, rel_tol=1e-5)
    assert math.isclose(stats[0]["kl_ref"], (math.exp(-1) + 1 - 1) / 2, rel_tol=1e-5)


@settings(max_examples=200, deadline=None)
@given(groups, st.floats(0.5, 20), st.floats(-100, 100))
def test_group_scaled_advantages_are_affine_invariant(case, a, b):
    g, values = case
    r = torch.tensor(values, dtype=torch.float64)
    # Invariance is exact up to the 1e-4 in the denominator: relative error <= 1e-4 / std * |1/a - 1|,
    # so compare only groups whose std makes that < 1e-3.
    spread = r.view(-1, g).std(dim=1) >= 0.5
    before = group_advantages(r, g).view(-1, g)[spread]
    after = group_advantages(a * r + b, g).view(-1, g)[spread]
    torch.testing.assert_close(after, before, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------- policy loss, by hand
def test_clipping_on_each_side_by_hand():
    # ratio  = [1.5, 0.5, 0.5, 1.5], A = [+1, +1, -1, -1], eps = 0.2
    # token 0: min(1.5, 1.2)   = 1.2  -> loss -1.2 (clipped above, active)
    # token 1: min(0.5, 0.8)   = 0.5  -> loss -0.5 (unclipped: pessimistic side)
    # token 2: min(-0.5, -0.8) = -0.8 -> loss  0.8 (clipped below, active)
    # token 3: min(-1.5, -1.2) = -1.5 -> loss  1.5 (unclipped)
    # seq_mean = (-1.2 - 0.5 + 0.8 + 1.5) / 4 = 0.15; clip fraction 2 / 4.
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.5]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, stats = policy_loss(ratio.log(), torch.zeros(1, 4), adv, torch.ones(1, 4, dtype=torch.bool))
    torch.testing.assert_close(loss, torch.tensor(0.15))
    assert stats["clip_frac"] == pytest.approx(0.5)


def test_asymmetric_clip_high():
    # clip_high = 0.28 (DAPO): ratio 1.5, A = 1 -> min(1.5, 1.28) = 1.28 -> loss -1.28.
    loss, _ = policy_loss(
        torch.tensor([[math.log(1.5)]]),
        torch.zeros(1, 1),
        torch.ones(1, 1),
        torch.ones(1, 1, dtype=torch.bool),
        clip_high=0.28,
    )
    torch.testing.assert_close(loss, torch.tensor(-1.28))


def test_aggregations_by_hand():
    # ratio 1, so l = -A. Row 0 has tokens [1, 3] valid (+ a padded one), row 1 has [5].
    # seq_mean = ((1 + 3) / 2 + 5) / 2 = 3.5;  token_mean = (1 + 3 + 5) / 3 = 3.
    adv = -torch.tensor([[1.0, 3.0, 99.0], [5.0, 99.0, 99.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    zeros = torch.zeros(2, 3)
    assert policy_loss(zeros, zeros, adv, mask)[0].item() == pytest.approx(3.5)
    assert policy_loss(zeros, zeros, adv, mask, aggregation="token_mean")[0].item() == pytest.approx(3.0)
    # Global normalizers: the same rows counted in a batch of 4 sequences / 6 tokens.
    assert policy_loss(zeros, zeros, adv, mask, num_sequences=4)[0].item() == pytest.approx(7.0 / 4)
    assert policy_loss(zeros, zeros, adv, mask, aggregation="token_mean", num_tokens=6)[0].item() == pytest.approx(1.5)


def test_k3_kl_by_hand():
    # pi = 1 (logp 0), ref = 0.5: x = log 0.5; k3 = 0.5 - log 0.5 - 1 = 0.193147; A = 0, beta = 0.1.
    k3 = 0.5 - math.log(0.5) - 1
    loss, stats = policy_loss(
        torch.zeros(1, 2),
        torch.zeros(1, 2),
        torch.zeros(1, 2),
        torch.ones(1, 2, dtype=torch.bool),
        kl_beta=0.1,
        ref_logprobs=torch.full((1, 2), math.log(0.5)),
    )
    torch.testing.assert_close(loss, torch.tensor(0.1 * k3))
    assert stats["kl_ref"] == pytest.approx(k3, rel=1e-5)


def test_unknown_aggregation_is_named():
    z = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(z, z, z, z.bool(), aggregation="sum")


# ---------------------------------------------------------------- policy loss, properties
def _random_loss_inputs(seed, b=4, t=6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, generator=g, requires_grad=True)
    old = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.8
    mask[:, 0] = True
    adv = torch.randn(b, generator=g)
    return logits, old, mask, adv


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["seq_mean", "token_mean"]))
def test_oar_with_unit_weights_is_grpo_exactly(seed, aggregation):
    lp, old, mask, adv = _random_loss_inputs(seed)
    grpo_adv = adv[:, None].expand_as(lp)
    # Equal scores make bilevel_weights all ones: the OAR path must give the same loss and gradient.
    weights = bilevel_weights(torch.full(lp.shape, 0.3), mask)
    losses, grads = [], []
    for a in (grpo_adv, adv[:, None] * weights):
        loss, _ = policy_loss(lp, old, a, mask, aggregation=aggregation)
        (g,) = torch.autograd.grad(loss, lp)
        losses.append(loss), grads.append(g)
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["seq_mean", "token_mean"]), st.integers(1, 3), st.integers(0, 2))
def test_padding_never_changes_the_loss(seed, aggregation, extra_cols, extra_rows):
    lp, old, mask, adv = _random_loss_inputs(seed)
    a = adv[:, None].expand_as(lp)
    base, _ = policy_loss(lp, old, a, mask, aggregation=aggregation)
    # Garbage in padded columns and in all-padding rows must not matter.
    g = torch.Generator().manual_seed(seed + 1)
    pad = lambda x, fill: torch.cat(
        [torch.cat([x, fill(x.shape[0], extra_cols)], 1), fill(extra_rows, x.shape[1] + extra_cols)], 0
    )
    junk = lambda r, c: 100 * torch.randn(r, c, generator=g)
    padded_mask = pad(mask, lambda r, c: torch.zeros(r, c, dtype=torch.bool))
    loss, _ = policy_loss(pad(lp, junk), pad(old, junk), pad(a, junk), padded_mask, aggregation=aggregation)
    torch.testing.assert_close(loss, base)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["seq_mean", "token_mean"]), st.integers(1, 4))
def test_global_normalizer_makes_micro_batches_sum_to_the_full_loss(seed, aggregation, n_micro):
    lp, old, mask, adv = _random_loss_inputs(seed, b=4)
    a = adv[:, None].expand_as(lp)
    full, _ = policy_loss(lp, old, a, mask, aggregation=aggregation)
    norm = {"num_sequences": mask.any(1).sum()} if aggregation == "seq_mean" else {"num_tokens": mask.sum()}
    parts = [
        policy_loss(*(x.chunk(n_micro)[i] for x in (lp, old, a, mask)), aggregation=aggregation, **norm)[0]
        for i in range(len(lp.chunk(n_micro)))
    ]
    torch.testing.assert_close(sum(parts), full)


# ---------------------------------------------------------------- log-probs
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_equal_log_softmax(dtype, temperature):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(5, 7, 50, generator=g)).to(dtype).requires_grad_(True)
    labels = torch.randint(0, 50, (5, 7), generator=g)
    weights = torch.randn(5, 7, generator=g)  # an upstream gradient that is not all ones
    ours = token_logprobs(logits, labels, chunk_rows=2, temperature=temperature)
    ref = torch.log_softmax(logits.float() / temperature, -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(ours, ref)
    (g1,) = torch.autograd.grad((ours * weights).sum(), logits)
    (g2,) = torch.autograd.grad((ref * weights).sum(), logits)
    torch.testing.assert_close(g1, g2)


def test_token_entropy_uniform_and_peaked():
    # Uniform over 8 tokens: entropy log 8. A huge single logit: entropy ~ 0.
    logits = torch.zeros(1, 2, 8)
    logits[0, 1, 3] = 100.0
    ent = token_entropy(logits)
    torch.testing.assert_close(ent, torch.tensor([[math.log(8), 0.0]]), atol=1e-5, rtol=0)
    logits[0, 0, 4:] = -math.inf  # ruled-out tokens (0 log 0 = 0): uniform over the other 4
    torch.testing.assert_close(token_entropy(logits), torch.tensor([[math.log(4), 0.0]]), atol=1e-5, rtol=0)


def test_an_empty_completion_has_empty_logprobs_and_entropies():
    assert token_logprobs(torch.zeros(3, 0, 5), torch.zeros(3, 0, dtype=torch.long)).shape == (3, 0)
    assert token_entropy(torch.zeros(3, 0, 5)).shape == (3, 0)


def test_a_rollout_no_reward_could_score_has_advantage_zero_and_no_part_in_the_baseline():
    """Hand-computed (oar.grpo._scorable_advantages' docstring): rewards (1, 0, x, 0), the third not scorable (a
    TRL-style reward's None from every term): the others' mean 1/3, std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = 1/sqrt(3),
    so A = (2/3, -1/3, 0, -1/3) * sqrt(3) / (1 + 1e-4 sqrt(3)), whatever x is; the same as the group of three."""
    from oar.grpo import group_advantages

    scorable = torch.tensor([True, True, False, True])
    for x in (0.0, 5.0, -3.0):
        got = group_advantages(torch.tensor([1.0, 0.0, x, 0.0]), 4, scorable=scorable)
        three = group_advantages(torch.tensor([1.0, 0.0, 0.0]), 3)
        torch.testing.assert_close(got, torch.tensor([three[0], three[1], 0.0, three[2]]))
    k = 3**0.5 / (1 + 1e-4 * 3**0.5)
    torch.testing.assert_close(got, torch.tensor([2 / 3 * k, -1 / 3 * k, 0.0, -1 / 3 * k]))
    # a group with one scorable rollout has no baseline: 0; all scorable is the unmasked function to the bit
    lone = torch.tensor([True, False, False, False, True, True, True, True])
    rewards = torch.tensor([1.0, 0, 5, 1, 2, 0, 1, 3])
    assert group_advantages(rewards, 4, scorable=lone)[:4].eq(0).all()
    assert torch.equal(group_advantages(rewards, 4, scorable=lone)[4:], group_advantages(rewards[4:], 4))
    every = torch.ones(8, dtype=torch.bool)
    for scale in ("group", "batch", "none"):
        assert torch.equal(group_advantages(rewards, 4, scale, scorable=every), group_advantages(rewards, 4, scale))
