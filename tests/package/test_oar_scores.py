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


def _long_batch(seed=0, lengths=(12, 30, 55, 70, 20), vocab=40):
    """Rows of mixed reasoning lengths (left pads 0-2, answers of 1-3 tokens), long enough that the window mode
    packs several copies to a sequence and the exact mode's copies fill several chunks."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths) + 12
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attn, reas, ans = (
        torch.zeros_like(ids),
        torch.zeros(ids.shape, dtype=torch.bool),
        torch.zeros(ids.shape, dtype=torch.bool),
    )
    for i, r in enumerate(lengths):
        lp, a = i % 3, 1 + i % 3
        n = lp + 3 + r + 1 + a + 1  # left pad, prompt 3, reasoning, marker, answer, EOS
        ids[i, lp:n] = torch.randint(3, vocab, (n - lp,), generator=g)
        attn[i, lp:n] = 1
        reas[i, lp + 3 : lp + 3 + r] = True
        ans[i, lp + 4 + r : lp + 4 + r + a] = True
    return ids, attn, reas, ans


@pytest.mark.parametrize("mode", ["exact", "window", "auto"])
def test_oar_p_budget_from_the_device_gives_todays_scores(monkeypatch, mode):
    # max_chunk_tokens=None is chosen from the device: on a CPU 8192, the budget before it was sized by the device,
    # so the same numbers bit for bit; on a GPU from its free memory (faked here), forwards many times larger,
    # which, like a budget of one copy a forward, change the scores by float rounding only (a copy's shapes are its
    # own)
    import oar.lm as lm

    model = tiny_llama(layers=3, seed=3)
    ids, attn, reas, ans = _long_batch()
    kw = dict(probe="answer_mean", pad_token_id=0, mode=mode, window=4, auto_length=40)
    want = perturbation_scores(model, ids, attn, reas, ans, max_chunk_tokens=8192, **kw)
    assert want[reas].abs().min() > 0
    assert torch.equal(perturbation_scores(model, ids, attn, reas, ans, **kw), want)
    forwards = []
    model.register_forward_pre_hook(lambda m, a, k: forwards.append(k["input_ids"].shape), with_kwargs=True)
    perturbation_scores(model, ids, attn, reas, ans, max_chunk_tokens=8192, **kw)
    at_8192 = len(forwards)
    monkeypatch.setattr(lm, "_free_bytes", lambda device: 8 << 30)  # an accelerator with 8 GiB free
    assert lm.positions_that_fit(model, "cpu", per_copy=100, logit_columns=4) > 100 * lm.CPU_FORWARD_POSITIONS
    # float32 rounding of KLs of 1e-7 to 7e-5 from logits of ~1: a few 1e-7 absolute (as test_perturb_window's)
    tol = dict(rtol=0, atol=max(1e-4 * want.abs().max().item(), 1e-6))
    for budget in (None, 1):  # at 1, one copy (exact) or one sequence of copies (window) a forward
        forwards.clear()
        got = perturbation_scores(model, ids, attn, reas, ans, max_chunk_tokens=budget, **kw)
        torch.testing.assert_close(got, want, **tol)
        assert len(forwards) <= at_8192 if budget is None else len(forwards) > 4 * at_8192, (budget, at_8192)


def test_the_device_budget_never_falls_below_a_cpus():
    import oar.lm as lm

    model = tiny_llama()
    assert lm.positions_that_fit(model, "cpu", per_copy=1000, logit_columns=64) == lm.CPU_FORWARD_POSITIONS
    assert lm._free_bytes("cpu") is None


@pytest.mark.parametrize("mode", ["exact", "window"])
def test_oar_p_reads_nothing_back_from_the_device_per_copy(monkeypatch, mode):
    # On a GPU a read of a tensor's value waits for the queue: the scorers read the masks once per call and
    # build their tables of copies on the host, so rows four times longer (four times the copies) read the
    # same number of values back. Counted at oar/'s own reads (int(), bool(), .item(), .tolist(), .nonzero()).
    import sys

    reads = []
    for name in ("__bool__", "__int__", "__index__", "__float__", "item", "tolist", "nonzero"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, **k):
            if "/oar/" in sys._getframe(1).f_code.co_filename:
                reads.append(sys._getframe(1).f_lineno)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    model = tiny_llama(layers=2, seed=3)
    counts = []
    for lengths in ((10, 6), (40, 24)):
        ids, attn, reas, ans = _long_batch(lengths=lengths)
        reads.clear()
        perturbation_scores(model, ids, attn, reas, ans, pad_token_id=0, mode=mode, window=3, max_chunk_tokens=64)
        counts.append(len(reads))
    assert counts[0] == counts[1], counts
