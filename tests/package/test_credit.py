"""Token credit methods (oar/credit.py, oar/tempo.py, oar/entropy_credit.py): hand-computed cases,
properties, and the interface's invariance to micro-batching (train.py end to end: test_distributed.py)."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oar.entropy_credit import linear_quantile, top_entropy_mask
from oar.grpo import group_advantages
from oar.tempo import tempo_weights
from tinyrun import tiny_step


def test_tempo_by_hand():
    # One group of 4, three tokens each. Prefix tree: a, b, c start with 1, d with 7; then a, b
    # continue with 2 and c with 5; then a ends with 3 and b with 4. Rewards 1 0 1 0, mean 0.5.
    ids = torch.tensor([[1, 2, 3], [1, 2, 4], [1, 5, 6], [7, 8, 9]])
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    w = tempo_weights(ids, torch.ones(4, 3, dtype=torch.bool), rewards, group_size=4)
    # t=0: V(root) = 1/2; child {a,b,c}: 2/3 (delta +1/6), child {d}: 0 (delta -1/2).
    #   a: 1 + (1/6)/(1 - 1/2) = 4/3; b: 1 + (1/6)/(0 - 1/2) = 2/3; c: 4/3; d: 1 + (-1/2)/(-1/2) = 2.
    # t=1: node {a,b,c} = 2/3; {a,b}: 1/2 (delta -1/6), {c}: 1 (delta +1/3).
    #   a: 1 - (1/6)/(1/2) = 2/3; b: 1 + (1/6)/(1/2) = 4/3; c: 1 + (1/3)/(1/2) = 5/3; d: no branch, 1.
    # t=2: node {a,b} = 1/2; a -> 1 (delta +1/2): 2; b -> 0 (delta -1/2): 2; c, d: no branch, 1.
    want = torch.tensor([[4 / 3, 2 / 3, 2.0], [2 / 3, 4 / 3, 2.0], [4 / 3, 5 / 3, 1.0], [2.0, 1.0, 1.0]])
    torch.testing.assert_close(w, want)
    assert torch.allclose(w.sum(1), torch.full((4,), 4.0))  # T_i + 1: the TD terms telescope to r_i - mean


def test_tempo_can_flip_the_sign_of_a_rewarded_token():
    # 7 of 8 rollouts right (mean 7/8). Rollout 0 (right) shares its first token only with rollout 1
    # (wrong): that branch is worth 1/2 against the root's 7/8, delta -3/8, so w = 1 + (-3/8)/(1/8) = -2:
    # TEMPO pushes that token down although rollout 0 was rewarded. The loss takes it as is.
    ids = torch.tensor([[1, 2], [1, 3]] + [[4, 5]] * 6)
    rewards = torch.tensor([1.0, 0.0] + [1.0] * 6)
    w = tempo_weights(ids, torch.ones(8, 2, dtype=torch.bool), rewards, group_size=8)
    assert w[0, 0].item() == pytest.approx(-2.0)
    adv = group_advantages(rewards, 8)
    assert (adv[0] * w[0, 0]) < 0 < adv[0]


def test_tempo_padding_tied_groups_and_ended_rollouts():
    ids = torch.tensor([[1, 2, 0], [1, 3, 4], [5, 6, 7], [5, 6, 7], [1, 2, 0], [1, 2, 4]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    w = tempo_weights(ids, mask, torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0]), group_size=2)
    # group 1: the rollouts branch on their tokens at t=1 (2 vs 3); each child is worth its own
    # reward against the root's 1/2: delta = +-1/2 over r_i - mean = +-1/2, w = 2; rollout 0's
    # padding at t=2 keeps 1, and rollout 1's t=2 is no branch (it is alone below t=1).
    assert w[0].tolist() == [1.0, 2.0, 1.0] and w[1].tolist() == [1.0, 2.0, 1.0]
    assert w[2:4].eq(1).all()  # group 2: identical rollouts, equal rewards: no branch, A = 0
    # group 3: rollout 4 stops after t=1 without a token of its own where rollout 5 goes on: a branch
    # at t=2 whose only child is rollout 5 (V 0 against the node's 1/2: w = 1 + (-1/2)/(-1/2) = 2);
    # rollout 4's TD term has no token to sit on (tempo.py's docstring), so it keeps 1.
    assert w[4].tolist() == [1.0, 1.0, 1.0] and w[5].tolist() == [1.0, 1.0, 2.0]


def test_tempo_warns_when_a_rollout_at_its_group_mean_loses_a_td_term():
    # rewards 0, 0.5, 1 (a format bonus): rollout 1 sits at the mean 0.5, A_1 = 0, yet both its tokens
    # branch: into a child worth 0.25 (TD -0.25 against the root's 0.5), then into its own leaf (TD
    # +0.25 against that child): TEMPO's terms have no weight to ride on.
    ids, mask = torch.tensor([[1, 2], [1, 3], [4, 5]]), torch.ones(3, 2, dtype=torch.bool)
    with pytest.warns(UserWarning, match="get no TD term"):
        w = tempo_weights(ids, mask, torch.tensor([0.0, 0.5, 1.0]), group_size=3)
    assert w[1].tolist() == [1.0, 1.0]
    with warnings.catch_warnings():  # 0/1 rewards: a rollout at the mean means a tied group, nothing lost
        warnings.simplefilter("error")
        tempo_weights(ids, mask, torch.tensor([0.0, 0.0, 1.0]), group_size=3)


def test_tempo_reads_a_rollout_at_its_group_mean_through_float32_rounding():
    """Rewards as train.py holds them, float32 (--reward correct,format:0.4): rollout 4's 0.4 is the mean of the
    group only up to ~1e-8, where 1 / (r_i - mean) made weights of 5e7 (and A_i w_it the size of the group's
    largest advantage). It is at the mean: weights 1, and the TD term it cannot carry is said."""
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.4, 0.4, 1.0, 1.4], dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3], [2, 2, 3], [3, 2, 3], [4, 2, 3], [5, 6, 3], [5, 7, 3], [5, 8, 3], [5, 9, 3]])
    with pytest.warns(UserWarning, match="get no TD term"):
        w = tempo_weights(ids, torch.ones(8, 3, dtype=torch.bool), rewards, group_size=8)
    assert w[4].tolist() == [1.0, 1.0, 1.0] and float(w.abs().max()) < 10


@st.composite
def groups(draw):
    g, t, n_groups = draw(st.integers(2, 6)), draw(st.integers(1, 6)), draw(st.integers(1, 3))
    ids = torch.tensor(
        draw(
            st.lists(st.lists(st.integers(0, 2), min_size=t, max_size=t), min_size=g * n_groups, max_size=g * n_groups)
        )
    )
    lengths = draw(st.lists(st.integers(1, t), min_size=g * n_groups, max_size=g * n_groups))
    mask = torch.arange(t)[None] < torch.tensor(lengths)[:, None]
    eos = torch.arange(t)[None] == torch.tensor(lengths)[:, None] - 1
    ids = ids.masked_fill(
        eos & (torch.tensor(lengths)[:, None] < t), 3
    )  # the sampler's layout: ends in EOS unless truncated
    # A reward is a function of the completion (as with a gold answer per group): identical
    # completions get the same reward; which function is drawn.
    table = draw(st.dictionaries(st.tuples(st.integers(0, 2), st.integers(1, t)), st.sampled_from([0.0, 1.0])))
    key = lambda i: (int(ids[i, : lengths[i]].sum()) % 3, lengths[i])  # noqa: E731
    rewards = torch.tensor(
        [table.get(key(i), float(sum(ids[i, : lengths[i]].tolist()) % 2)) for i in range(len(lengths))]
    )
    return ids.masked_fill(~mask, -1), mask, rewards, g


@settings(max_examples=60, deadline=None)
@given(groups())
def test_tempo_properties(case):
    ids, mask, rewards, g = case
    w = tempo_weights(ids, mask, rewards, group_size=g)
    mean = rewards.view(-1, g).mean(1).repeat_interleave(g)
    moved = rewards != mean
    # mass: along a rollout with A_i != 0 the weights sum to T_i + 1; A_i = 0 rollouts keep weight 1
    torch.testing.assert_close((w * mask).sum(1)[moved], mask.sum(1).float()[moved] + 1)
    assert w[~moved].eq(1).all() and w[~mask].eq(1).all()
    # A_i w_it = A_i + delta_it / d for every advantage scale: the weight does not depend on d
    for scale in ("group", "none"):
        adv = group_advantages(rewards, g, scale=scale)
        tok = adv[:, None] * w * mask  # the valid tokens
        assert torch.allclose(tok.sum(1)[moved], (adv * (mask.sum(1) + 1))[moved], atol=1e-4)
    # groups are independent and rows within a group may be reordered
    perm = torch.cat([torch.randperm(g) + k for k in range(0, len(rewards), g)])
    torch.testing.assert_close(tempo_weights(ids[perm], mask[perm], rewards[perm], group_size=g), w[perm])


def test_top_entropy_mask_by_hand():
    ent = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.0]])
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)  # 7.0 is padding: never counted
    # valid values sorted: 0.0 0.1 0.2 0.3 0.5 0.7 0.9 (n = 7); top 0.2 -> the 0.8-quantile at
    # position 0.8 * 6 = 4.8: 0.5 + 0.8 (0.7 - 0.5) = 0.66, so 0.7 and 0.9 carry the advantage.
    m = top_entropy_mask(ent, valid, top=0.2)
    assert m.tolist() == [[False, True, False, False], [False, True, False, False]]
    assert top_entropy_mask(ent, valid, top=1.0).equal(valid)  # rho = 1: every valid token
    assert not top_entropy_mask(ent, torch.zeros_like(valid)).any()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 5, allow_nan=False), min_size=1, max_size=60), st.floats(0.05, 1.0), st.integers(1, 5))
def test_top_entropy_mask_properties(values, top, split):
    x = torch.tensor(values)
    torch.testing.assert_close(linear_quantile(x, 1 - top), torch.quantile(x, 1 - top))
    ent, valid = x.view(1, -1), torch.ones(1, len(values), dtype=torch.bool)
    m = top_entropy_mask(ent, valid, top=top)
    assert m.sum() >= max(1, int(top * len(values)) - 1)  # at least the top share (ties go in)
    assert ent[m].min() >= ent[~m].max() if (~m).any() else True
    # the threshold is the whole step's: "processes" holding any split of the tokens agree
    cut = min(split, len(values))
    parts = [ent[:, :cut], ent[:, cut:]]

    def gather_on(rank):  # what all_gather gives process `rank`: every process's valid tokens, in rank order
        def gather(mine):
            assert mine.equal(parts[rank].flatten())  # each process offers its own tokens only
            return torch.cat([p.flatten() for p in parts])

        return gather

    got = torch.cat(
        [
            top_entropy_mask(p, torch.ones_like(p, dtype=torch.bool), top=top, gather=gather_on(k))
            for k, p in enumerate(parts)
        ],
        1,
    )
    assert got.equal(m)


def test_step_credit_gives_each_method_the_same_weights_for_any_micro_batching(tiny_model):
    """The interface on a real step of the tiny model: weights per micro-batch of 1 equal those of one
    batch of 8, GRPO is all ones, entropy is the gate of the update forward's entropies."""
    from oar.credit import METHODS, CreditSettings, step_credit
    from oar.gating import bilevel_weights
    from oar.grpo import token_entropy
    from oar.lm import forward_logits
    from oar.rollout import Rollout

    model, tok, ro, golds, rewards, adv = tiny_step(tiny_model)
    scored = (adv != 0) & ro.completion_mask.any(1)
    lp = ro.prompt_width
    with torch.no_grad():
        logits = forward_logits(model, ro.input_ids, ro.attention_mask, logits_to_keep=ro.input_ids.shape[1] - lp + 1)
    for method in METHODS:
        got = {}
        for mbs in (1, 8):
            weigh = step_credit(
                CreditSettings(method=method, group_size=4, micro_batch_size=mbs),
                model,
                tok,
                ro,
                rewards,
                adv,
                scored,
                list(range(8)),
                golds,
                "answer_mean",
            )
            got[mbs] = torch.cat(
                [
                    weigh(slice(i, i + mbs), ro.select(slice(i, i + mbs)), logits[i : i + mbs])[0]
                    for i in range(0, 8, mbs)
                ]
            )
        # OAR-G's score is the gradient of a KL at its minimum: it magnifies float rounding about
        # 1 / noise_std = 1e3-fold (2.5e-4 seen with several BLAS threads, 1e-4 allowed before).
        torch.testing.assert_close(got[1], got[8], atol=1e-3, rtol=1e-3)
        assert got[8].shape == ro.input_ids.shape
    grpo = step_credit(
        CreditSettings(method="grpo"), model, tok, ro, rewards, adv, scored, list(range(8)), golds, "answer_mean"
    )
    completion = ro.completion_mask.float()  # maths §5: weights are 0 outside the completion (padding, the prompt)
    assert torch.equal(grpo(slice(0, 8), ro, logits)[0], completion)
    ent = step_credit(
        CreditSettings(method="entropy", group_size=4),
        model,
        tok,
        ro,
        rewards,
        adv,
        scored,
        list(range(8)),
        golds,
        "answer_mean",
    )
    full = torch.zeros(ro.input_ids.shape)
    full[:, lp:] = token_entropy(logits[:, :-1])
    torch.testing.assert_close(
        ent(slice(0, 8), ro, logits)[0], bilevel_weights(full, ro.reasoning_mask & scored[:, None]) * completion
    )
    assert rewards.min() < rewards.max()  # the groups had something to credit
    # oar-g+tempo (beyond the paper) is OAR-G's weights plus TEMPO's TD share on the branch tokens
    both = {
        m: step_credit(
            CreditSettings(method=m, group_size=4),
            model,
            tok,
            ro,
            rewards,
            adv,
            scored,
            list(range(8)),
            golds,
            "answer_mean",
        )(slice(0, 8), ro, logits)[0]
        for m in ("oar-g", "tempo", "oar-g+tempo")
    }
    torch.testing.assert_close(both["oar-g+tempo"], (both["oar-g"] + both["tempo"] - 1) * completion)
    assert (both["tempo"] != 1).any()  # some token branched
    # random-gate (a control) is the gate of uniform scores drawn from each rollout's own seed
    seeds = [11, 12, 13, 14, 15, 16, 17, 18]
    rand = step_credit(
        CreditSettings(method="random-gate", group_size=4),
        model,
        tok,
        ro,
        rewards,
        adv,
        scored,
        seeds,
        golds,
        "answer_mean",
    )(slice(0, 8), ro, logits)[0]
    uniform = torch.stack(
        [torch.rand(ro.input_ids.shape[1], generator=torch.Generator().manual_seed(s + 104_729)) for s in seeds]
    )
    torch.testing.assert_close(rand, bilevel_weights(uniform, ro.reasoning_mask & scored[:, None]) * completion)
    moved = (rand != completion).any(1)
    assert moved.any() and torch.equal(
        rand[~(ro.reasoning_mask & scored[:, None])], completion[~(ro.reasoning_mask & scored[:, None])]
    )
    # only scored reasoning tokens move
    # ... and they are the same draws when a wider prompt sits on another process, which widens this
    # process's layout only on the one-process run: 3 more padding columns here, the gather says why there
    pad = lambda x: torch.cat([torch.zeros(len(ro), 3, dtype=x.dtype), x], dim=1)  # noqa: E731
    wide = Rollout(
        pad(ro.input_ids),
        pad(ro.attention_mask),
        pad(ro.completion_mask),
        pad(ro.reasoning_mask),
        pad(ro.answer_mask),
        ro.truncated,
        ro.texts,
        lp + 3,
    )
    one = step_credit(
        CreditSettings(method="random-gate", group_size=4),
        model,
        tok,
        wide,
        rewards,
        adv,
        scored,
        seeds,
        golds,
        "answer_mean",
    )(slice(0, 8), wide, logits)[0]
    two = step_credit(
        CreditSettings(method="random-gate", group_size=4),
        model,
        tok,
        ro,
        rewards,
        adv,
        scored,
        seeds,
        golds,
        "answer_mean",
        gather=lambda x: torch.cat([x, x + 3]),
    )(slice(0, 8), ro, logits)[0]
    assert not torch.equal(two, rand)  # the draws moved with the step's widest prompt
    torch.testing.assert_close(one[:, lp + 3 :], two[:, lp:])  # the same draws; the gate's sums may round apart
    # under --mask_truncated a truncated rollout carries no loss, so it does not set entropy-mask's threshold
    # either (as TRL's completion mask): truncate the rollout with the most top-entropy tokens
    from dataclasses import replace

    from oar.credit_methods import step_entropies

    ent = step_entropies(model, ro, 8)
    cut = replace(ro, truncated=torch.arange(8) == top_entropy_mask(ent, ro.completion_mask).sum(1).argmax())
    w = step_credit(
        CreditSettings(method="entropy-mask", group_size=4, mask_truncated=True),
        model,
        tok,
        cut,
        rewards,
        adv,
        scored,
        seeds,
        golds,
        "answer_mean",
    )(slice(0, 8), cut, logits)[0]
    assert (
        w.equal(top_entropy_mask(ent, cut.completion_mask & ~cut.truncated[:, None]).float())
        and not w[cut.truncated].any()
    )


def test_step_entropies_are_those_of_the_distributions_the_tokens_were_drawn_from(tiny_model):
    """Against the definition, one prefix at a time: the entropy at completion position t is that of
    the model's next-token distribution after the tokens before t (no slicing shared with the code)."""
    from oar.credit_methods import step_entropies
    from oar.grpo import token_entropy
    from oar.training.models import load_model
    from oar.sampler import format_prompt, sample

    model, tok = load_model(str(tiny_model))
    ro = sample(
        model,
        tok,
        [format_prompt(tok, "Compute 3 + 4."), format_prompt(tok, "Compute 12 - 5.")],
        group_size=2,
        seeds=[0, 1, 2, 3],
        max_new_tokens=10,
        temperature=0.7,
    )
    got = step_entropies(model, ro, micro_batch_size=3, temperature=0.7)
    assert got[:, : ro.prompt_width].eq(0).all()
    for i in range(len(ro)):
        for t in ro.completion_mask[i].nonzero().flatten().tolist():
            with torch.no_grad():
                last = model(
                    input_ids=ro.input_ids[i : i + 1, :t], attention_mask=ro.attention_mask[i : i + 1, :t]
                ).logits[0, -1]
            torch.testing.assert_close(got[i, t], token_entropy(last[None, None] / 0.7)[0, 0], atol=1e-5, rtol=1e-5)


def test_a_micro_batchs_seconds_include_its_rollouts_share_of_prepare(tiny_model, monkeypatch):
    """oar/seconds_per_rollout counts a method's prepare (TEMPO's tree, the random draws) too, spread
    over the rollouts: a micro-batch of 2 of 8 carries a quarter of it."""
    import dataclasses
    import time

    import oar.credit as credit

    model, tok, ro, golds, rewards, adv = tiny_step(tiny_model)
    tempo = credit.METHODS["tempo"]
    slow = dataclasses.replace(tempo, prepare=lambda step: (time.sleep(1.0), tempo.prepare(step))[1])
    monkeypatch.setattr(credit, "credit_methods", lambda module: {"tempo": slow})
    scored = (adv != 0) & ro.completion_mask.any(1)
    logits = torch.zeros(2, ro.input_ids.shape[1] - ro.prompt_width + 1, 8)
    weigh = credit.step_credit(
        credit.CreditSettings(method="tempo", group_size=4),
        model,
        tok,
        ro,
        rewards,
        adv,
        scored,
        list(range(8)),
        golds,
        "answer_mean",
    )
    _, seconds, _ = weigh(slice(0, 2), ro.select(slice(0, 2)), logits)
    assert 0.25 <= seconds < 1.0  # 2/8 of at least 1 s, and not all of it


def test_grail_is_grail_s_weights_on_the_wrong_rollouts_reasoning(tiny_model):
    """--method grail: oar.grail's scores and weights of each scored wrong rollout's reasoning tokens (A_i <= 0),
    1 on every other token and row (the right rollouts among them), 0 outside the completion; no gradient is
    left in the model's parameters."""
    from oar.credit import CreditSettings, step_credit
    from oar.grail import grail_scores, grail_weights
    from oar.lm import forward_logits
    from oar.rewards import reward
    from oar.rollout import concat_rollouts
    from oar.training.credit_trial import synthetic_step
    from oar.training.models import load_model

    model, tok = load_model(str(tiny_model))
    # two groups of made-up completions: right answers, wrong ones, one without an answer (credit_trial's)
    steps = [synthetic_step(tok, q, a, 4, "", "cpu") for q, a in (("Compute 3 + 4.", "7"), ("Compute 5 * 2.", "10"))]
    ro, golds = concat_rollouts([r for r, _ in steps], tok.pad_token_id), steps[0][1] + steps[1][1]
    rewards = torch.tensor([reward(t, g) for t, g in zip(ro.texts, golds)])
    adv = group_advantages(rewards, 4)
    scored = (adv != 0) & ro.completion_mask.any(1)
    lp = ro.prompt_width
    with torch.no_grad():
        logits = forward_logits(model, ro.input_ids, ro.attention_mask, logits_to_keep=ro.input_ids.shape[1] - lp + 1)
    credit = step_credit(
        CreditSettings(method="grail", group_size=4),
        model,
        tok,
        ro,
        rewards,
        adv,
        scored,
        list(range(8)),
        golds,
        "last",
    )
    got, _, nonfinite = credit.weigh(slice(0, 8), ro, logits)
    rows = (adv <= 0) & scored & ro.answer_mask.any(1)
    assert rows.any() and (~rows & scored).any()  # wrong rollouts to reweight, right ones to leave
    mask = ro.reasoning_mask & rows[:, None]
    want = grail_weights(grail_scores(model, ro.input_ids, ro.attention_mask, mask, ro.answer_mask), mask, rows)
    assert nonfinite == want.nonfinite == 0
    torch.testing.assert_close(got, want.weights * ro.completion_mask)
    assert torch.equal(got[~rows], ro.completion_mask[~rows].float())  # right and unscored rollouts: GRPO's
    assert (got[mask] != 1).any()  # the gate moved something
    assert all(p.grad is None for p in model.parameters())
