"""OAR-P and OAR-G on a tiny random Llama: the fast paths against the definitions (maths §3, §4)."""

import copy
import warnings

import pytest
import torch

from oar.lm import forward_logits
from oar.oar_grad import gradient_scores
from oar.oar_perturb import perturbation_scores, perturbation_scores_naive
from oar.probes import PROBES, answer_positions, divergence, outcome_from_logits

from conftest import tiny_llama


@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("max_chunk_tokens", [1, 25, 8192])
def test_oar_p_equals_the_naive_definition(model, batch, probe, max_chunk_tokens):
    ids, attn, reas, ans = batch
    fast = perturbation_scores(
        model, ids, attn, reas, ans, probe=probe, pad_token_id=0, max_chunk_tokens=max_chunk_tokens
    )
    naive = perturbation_scores_naive(model, ids, attn, reas, ans, probe=probe, pad_token_id=0, chunk_size=3)
    assert naive[reas].abs().max() > 0  # the comparison is not between two zeros
    torch.testing.assert_close(fast, naive, rtol=0, atol=1e-4 * naive.abs().max().item())
    assert (fast[~reas] == 0).all()


def test_oar_p_naive_is_one_forward_per_masked_copy(model, batch):
    # The definition spelt out for one position: mask token j, run the full sequence, KL of the probes.
    ids, attn, reas, ans = batch
    b, j = 1, int(reas[1].nonzero()[2])
    clean = outcome_from_logits(
        forward_logits(model, ids[b : b + 1], attn[b : b + 1]), ids[b : b + 1], ans[b : b + 1], "answer_mean"
    )
    masked_ids = ids[b : b + 1].clone()
    masked_ids[0, j] = 0
    masked = outcome_from_logits(
        forward_logits(model, masked_ids, attn[b : b + 1]), masked_ids, ans[b : b + 1], "answer_mean"
    )
    expected = divergence(clean, masked, "answer_mean")
    got = perturbation_scores_naive(model, ids, attn, reas, ans, probe="answer_mean", pad_token_id=0)[b, j]
    torch.testing.assert_close(got, expected[0])


def test_oar_p_span_mode_shares_a_score_per_span(model, batch):
    ids, attn, reas, ans = batch
    s = perturbation_scores(model, ids, attn, reas, ans, pad_token_id=0, span=2)
    first = reas[0].nonzero().flatten()
    assert s[0, first[0]] == s[0, first[1]] and s[0, first[2]] == s[0, first[3]]


def test_rows_without_answer_score_zero(model, batch):
    ids, attn, reas, ans = batch
    ans = ans.clone()
    ans[1] = False
    for scores in (
        perturbation_scores(model, ids, attn, reas, ans, pad_token_id=0),
        gradient_scores(model, ids, attn, reas, ans),
    ):
        assert (scores[1] == 0).all() and scores[0].abs().sum() > 0


def test_rows_without_reasoning_tokens_score_zero(model, batch):
    """A row with an answer and no reasoning token (the whole completion is the answer) scores 0 in every
    scorer; the naive definition ran a forward of zero copies on it and raised."""
    ids, attn, reas, ans = batch
    reas = reas.clone()
    reas[1] = False
    for scores in (
        perturbation_scores(model, ids, attn, reas, ans, pad_token_id=0),
        perturbation_scores_naive(model, ids, attn, reas, ans, pad_token_id=0),
        gradient_scores(model, ids, attn, reas, ans),
    ):
        assert (scores[1] == 0).all() and scores[0].abs().sum() > 0


def _autograd_reference_joint(model, ids, attn, reas, ans):
    """OAR-G with noise 0 and answer_joint, the plain way: J = phi_0 - phi(e), backward() into a
    leaf embedding tensor on a copy of the model, s = |<dJ/de, e>|."""
    ref_model = copy.deepcopy(model)
    e = ref_model.get_input_embeddings()(ids).detach().requires_grad_(True)
    phi = outcome_from_logits(
        forward_logits(ref_model, attention_mask=attn, inputs_embeds=e), ids, ans, "answer_joint"
    )
    (phi.detach() - phi).sum().backward()
    return (e.grad * e.detach()).sum(-1).abs() * reas


def test_oar_g_equals_autograd_reference_for_answer_joint(model, batch):
    ids, attn, reas, ans = batch
    ours = gradient_scores(model, ids, attn, reas, ans, probe="answer_joint", noise_std=0.0)
    ref = _autograd_reference_joint(model, ids, attn, reas, ans)
    assert ref.abs().max() > 0
    torch.testing.assert_close(ours, ref)


def test_oar_g_leaves_no_gradient_and_keeps_flags(batch):
    model = tiny_llama()
    model.model.layers[0].requires_grad_(False)  # a mix of frozen and trainable parameters
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    ids, attn, reas, ans = batch
    for probe in PROBES:
        s = gradient_scores(model, ids, attn, reas, ans, probe=probe, generator=torch.Generator().manual_seed(0))
        assert torch.isfinite(s).all() and s[reas].abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags


def test_oar_g_noise_is_what_makes_kl_gradients_nonzero(model, batch):
    # At delta = 0 the KL is at its minimum: the gradient is 0 up to float rounding (maths §4, "why
    # the noise"); with sigma = 1e-3 it is orders of magnitude larger.
    ids, attn, reas, ans = batch
    g = lambda seed: gradient_scores(model, ids, attn, reas, ans, generator=torch.Generator().manual_seed(seed))
    with pytest.warns(UserWarning, match="noise_std 0"):  # so a run or a caller never takes it for scores
        silent = gradient_scores(model, ids, attn, reas, ans, probe="answer_mean", noise_std=0.0)
    assert silent.max() < 1e-3 * g(1).max()
    assert torch.equal(g(1), g(1)) and not torch.equal(g(1), g(2))
    assert (g(1)[~reas] == 0).all()


def test_oar_g_explicit_noise_and_clean_reuse(model, batch):
    # Passing the noise draws and a precomputed clean outcome gives the same scores as drawing them here.
    ids, attn, reas, ans = batch
    h = model.config.hidden_size
    noise = torch.randn(*ids.shape, h, generator=torch.Generator().manual_seed(3))
    clean = outcome_from_logits(forward_logits(model, ids, attn), ids, ans, "answer_mean")
    a = gradient_scores(model, ids, attn, reas, ans, noise=noise)
    b = gradient_scores(model, ids, attn, reas, ans, noise=noise, clean=clean)
    torch.testing.assert_close(a, b)
    # Each rollout's scores depend only on its own noise: batching does not matter.
    one = gradient_scores(model, ids[1:2], attn[1:2], reas[1:2], ans[1:2], noise=noise[1:2])
    torch.testing.assert_close(one[0], a[1])


def test_scores_are_padding_invariant(model, batch):
    # Two extra left-pads shift a row but must not change its scores (position ids follow the mask).
    ids, attn, reas, ans = batch
    pad2 = lambda x, v: torch.cat([torch.full((x.shape[0], 2), v, dtype=x.dtype), x], 1)
    shifted = (pad2(ids, 0), pad2(attn, 0), pad2(reas, False), pad2(ans, False))
    for fn in (
        lambda *b: perturbation_scores(model, *b, pad_token_id=0),
        lambda *b: gradient_scores(model, *b, probe="answer_joint", noise_std=0.0),
    ):
        torch.testing.assert_close(fn(*shifted)[:, 2:], fn(ids, attn, reas, ans), rtol=1e-4, atol=1e-6)


def test_oar_g_warns_where_half_precision_drowns_its_perturbation(model, batch):
    # bfloat16 rounds the logits more than a 1e-3 perturbation moves the KL (docs/model-families.md):
    # a distribution probe then gives rounding noise, said once; answer_joint needs no noise.
    ids, attn, reas, ans = batch
    half = model.to(torch.bfloat16)
    with pytest.warns(UserWarning, match="half precision"):
        gradient_scores(half, ids, attn, reas, ans, probe="answer_mean", generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # ours (transformers' FutureWarnings are pyproject.toml's)
        gradient_scores(half, ids, attn, reas, ans, probe="answer_joint", generator=torch.Generator().manual_seed(0))
        gradient_scores(
            model.float(), ids, attn, reas, ans, probe="answer_mean", generator=torch.Generator().manual_seed(0)
        )


def test_answer_positions_pad_a_short_answer_with_its_own_last_position():
    """Padded slots repeat the row's last position (not column 0): OAR-G runs the output head from the
    earliest position any row needs, so a short answer beside a long one must not widen it to the row start."""
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0, 4:7], mask[1, 6] = True, True  # row 2: no answer
    pos, valid = answer_positions(mask)
    assert pos.tolist() == [[3, 4, 5], [5, 5, 5], [0, 0, 0]]
    assert valid.tolist() == [[True] * 3, [True, False, False], [False] * 3]
