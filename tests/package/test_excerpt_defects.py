"""`oar`'s side of each place where the authors' released excerpt departs from the paper
(docs/differences.md, "The authors' released excerpt"), and no NaN turned into a score.

1. OAR-P's answer-span probes read answer-conditioned positions: every masked copy keeps the answer.
2. The last-token probe reads z_{a0-1} in OAR-P and OAR-G alike (the excerpt's OAR-G reads after the answer).
3. Gating a batch equals gating each rollout alone, in any row order (the excerpt's q drifts row to row).
4. OAR-G leaves whatever `.grad` the caller had accumulated exactly as it was (the excerpt's backward() adds to it).
5. A NaN in any probe's inputs gives a NaN score for every probe and both methods: the row is counted
   and keeps GRPO's weights, never a finite 0 that the gate would read as "unimportant".
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oar.gating import bilevel_weights
from oar.oar_grad import gradient_scores
from oar.oar_perturb import perturbation_scores, perturbation_scores_naive
from oar.probes import PROBES, divergence

from conftest import padded_batch, tiny_llama


def _change_answer_token(ids, ans, row, which):
    """A copy of ids with answer token `which` (0 = first) of `row` replaced by another token."""
    out = ids.clone()
    j = int(ans[row].nonzero()[which])
    out[row, j] = 3 if int(ids[row, j]) != 3 else 4
    return out


@pytest.mark.parametrize("probe", ["answer_mean", "answer_joint"])
def test_oar_p_answer_span_probes_are_conditioned_on_the_answer(model, batch, probe):
    # Row 1's answer has 3 tokens: its answer_mean / answer_joint probes read the logits that predict
    # tokens 2 and 3 of the answer, which see answer token 1. Change token 1: the fast scores move, and
    # move exactly as the definition's (one full forward per masked copy, the answer kept) say.
    ids, attn, reas, ans = batch
    changed = _change_answer_token(ids, ans, 1, 0)
    before = perturbation_scores(model, ids, attn, reas, ans, probe=probe, pad_token_id=0)
    after = perturbation_scores(model, changed, attn, reas, ans, probe=probe, pad_token_id=0)
    naive = perturbation_scores_naive(model, changed, attn, reas, ans, probe=probe, pad_token_id=0)
    assert (after[1] - before[1]).abs().max() > 1e-4 * before[1].abs().max()  # the answer conditions the probe
    torch.testing.assert_close(after, naive, rtol=0, atol=1e-4 * naive.abs().max().item())


def test_last_token_probes_of_oar_p_and_oar_g_read_the_position_before_the_first_answer_token(model, batch):
    # z_{a0-1} depends on tokens before a0 only: changing a later answer token changes neither method's
    # scores (a probe read after the last answer token, as the excerpt's OAR-G reads it, would move).
    ids, attn, reas, ans = batch
    changed = _change_answer_token(ids, ans, 1, 1)  # row 1's second of three answer tokens
    noise = torch.randn(*ids.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for score in (
        lambda x: perturbation_scores(model, x, attn, reas, ans, probe="last", pad_token_id=0),
        lambda x: gradient_scores(model, x, attn, reas, ans, probe="last", noise=noise),
    ):
        before, after = score(ids), score(changed)
        assert before[1].abs().sum() > 0
        torch.testing.assert_close(after, before)
    # while answer_mean, whose logits predicting the third token see the second, does move
    moved = gradient_scores(model, changed, attn, reas, ans, probe="answer_mean", noise=noise)
    assert not torch.allclose(
        moved[1], gradient_scores(model, ids, attn, reas, ans, probe="answer_mean", noise=noise)[1]
    )


@st.composite
def batches(draw):
    b, n = draw(st.integers(1, 6)), draw(st.integers(1, 16))
    scores = draw(st.lists(st.floats(0, 1e4, allow_nan=False, width=32), min_size=b * n, max_size=b * n))
    mask = draw(st.lists(st.booleans(), min_size=b * n, max_size=b * n))
    order = draw(st.permutations(list(range(b))))
    return torch.tensor(scores).view(b, n), torch.tensor(mask).view(b, n), order


@settings(max_examples=200, deadline=None)
@given(batches(), st.floats(0.01, 0.99), st.floats(0, 4))
def test_gating_a_batch_equals_gating_each_rollout_alone_in_any_order(data, quantile, boost):
    scores, mask, order = data
    whole = bilevel_weights(scores[order], mask[order], quantile=quantile, boost=boost)
    for k, i in enumerate(order):  # the quantile level q applies to every rollout: no state between rows
        torch.testing.assert_close(
            whole[k], bilevel_weights(scores[i : i + 1], mask[i : i + 1], quantile=quantile, boost=boost)[0]
        )


@pytest.mark.parametrize("probe", PROBES)
def test_oar_g_leaves_an_accumulated_grad_exactly_as_it_was(batch, probe):
    model = tiny_llama()
    ids, attn, reas, ans = batch
    model(
        input_ids=ids, attention_mask=attn
    ).logits.square().mean().backward()  # a micro-batch's gradient, accumulated
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    s = gradient_scores(model, ids, attn, reas, ans, probe=probe, generator=torch.Generator().manual_seed(0))
    assert s[reas].abs().sum() > 0
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n]), n


POISON = 7  # a token that breaks its row's forward in the poisoned model


def _poisoned(model, where: str):
    """NaN from the poison token on ('embeddings'), or NaN logits for the whole row that holds it
    ('logits', as transformers' eager attention gives on some left-padded float64 rows: the case where
    the gradient through the KL is 0, not NaN). Forwards over inputs_embeds reuse the rows of the last
    embedding call (OAR-G embeds once, then runs forwards over those rows)."""
    rows = {}

    def embed(module, args, out):
        rows["poisoned"] = (args[0] == POISON).any(-1)
        return out.masked_fill((args[0] == POISON).unsqueeze(-1), float("nan")) if where == "embeddings" else out

    def head(module, args, out):
        return out.masked_fill(rows["poisoned"][:, None, None], float("nan"))

    model.get_input_embeddings().register_forward_hook(embed)
    if where == "logits":
        model.get_output_embeddings().register_forward_hook(head)
    return model


def _batch_with_a_nan_row():
    ids, attn, reas, ans = padded_batch()
    ids = ids.masked_fill(ids == POISON, 8)  # only row 1 carries the poison, in its prompt
    ids[1, int(attn[1].nonzero()[0])] = POISON
    return ids, attn, reas, ans


SCORERS = {
    "oar-p": lambda m, ids, attn, reas, ans, probe: perturbation_scores(
        m, ids, attn, reas, ans, probe=probe, pad_token_id=0
    ),
    "oar-p-naive": lambda m, ids, attn, reas, ans, probe: perturbation_scores_naive(
        m, ids, attn, reas, ans, probe=probe, pad_token_id=0
    ),
    "oar-p-window": lambda m, ids, attn, reas, ans, probe: perturbation_scores(
        m, ids, attn, reas, ans, probe=probe, pad_token_id=0, mode="window", window=2
    ),
    "oar-g": lambda m, ids, attn, reas, ans, probe: gradient_scores(
        m,
        ids,
        attn,
        reas,
        ans,
        probe=probe,
        noise=torch.randn(*ids.shape, m.config.hidden_size, generator=torch.Generator().manual_seed(0)),
    ),
}


# NaN from the embeddings reaches the cached keys/values, so every path sees it; NaN put into the head's
# output alone is seen by the paths whose head runs over whole rows (the fast OAR-P paths recompute a
# row's answer logits from its cache, where a head-only NaN never was).
CASES = [
    ("oar-p", "embeddings"),
    ("oar-p-window", "embeddings"),
    ("oar-p-naive", "embeddings"),
    ("oar-p-naive", "logits"),
    ("oar-g", "embeddings"),
    ("oar-g", "logits"),
]


@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("method, where", CASES)
def test_nan_logits_on_one_row_give_that_row_nan_scores_and_grpo_weights(method, where, probe):
    ids, attn, reas, ans = _batch_with_a_nan_row()
    clean_model, model = tiny_llama(), _poisoned(tiny_llama(), where)
    got = SCORERS[method](model, ids, attn, reas, ans, probe)
    want = SCORERS[method](clean_model, ids, attn, reas, ans, probe)  # the same weights without the hook
    assert got[1][reas[1]].isnan().all()  # every reasoning token of the broken row: counted, not 0
    for r in (0, 2):  # the other rows are untouched
        torch.testing.assert_close(got[r], want[r])
    w = bilevel_weights(got, reas)
    assert (w[1] == 1).all() and torch.isfinite(w).all()  # GRPO's weights for the broken row


def test_one_masked_copy_that_overflows_scores_nan_not_zero():
    # Position j's masked copy came out NaN (e.g. a half-precision overflow): its score is NaN, so the row
    # is counted and keeps GRPO's weights, where a 0 would have been suppressed as the least important token.
    g = torch.Generator().manual_seed(0)
    for probe in PROBES:
        if probe == "answer_joint":
            clean, masked = torch.randn(1, generator=g), torch.randn(4, generator=g)
        else:
            clean, masked = (
                torch.log_softmax(torch.randn(1, 9, generator=g), -1),
                torch.log_softmax(torch.randn(4, 9, generator=g), -1),
            )
        masked[2] = float("nan")
        s = divergence(clean.expand_as(masked), masked, probe)
        assert s[2].isnan() and torch.isfinite(s[[0, 1, 3]]).all()
    scores = torch.tensor([[0.0, 0.3, float("nan"), 0.9]])
    assert (bilevel_weights(scores, torch.ones_like(scores, dtype=torch.bool)) == 1).all()


def test_a_ruled_out_token_is_not_a_broken_outcome():
    # -inf log-probs are legitimate (a token the clean model rules out): 0 log 0 = 0, the KL stays finite
    clean = torch.log_softmax(torch.tensor([[0.0, 1.0, float("-inf")]]), -1)
    perturbed = torch.log_softmax(torch.tensor([[1.0, 0.0, float("-inf")]]), -1)
    kl = divergence(clean, perturbed, "last")
    assert torch.isfinite(kl).all() and kl.item() > 0
