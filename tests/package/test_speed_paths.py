"""The fast paths of docs/speed.md pinned to the slow definitions they replace (scripts/bench/bench.py times them).

* OAR-P: copies of *different* rollouts packed into one chunk (prefixes of different lengths,
  left-padded in the cache) give the naive definition's scores, for every probe and chunk size,
  also on a model in training mode with gradient checkpointing (modes come back unchanged).
* OAR-G: the split forward (noise-free prefix without a graph, answer positions only through the
  head) equals a plain full-sequence backward, noise included; so does the unsplit path taken
  under gradient checkpointing.
* token_logprobs' hand-written backward equals autograd through log_softmax, for non-contiguous
  bfloat16 input, a chunk size that does not divide B, and an arbitrary upstream gradient.
"""

import pytest
import torch

from oar.grpo import token_logprobs
from oar.lm import forward_logits
from oar.oar_grad import gradient_scores
from oar.oar_perturb import perturbation_scores, perturbation_scores_naive
from oar.probes import PROBES, clean_forward, divergence, outcome_from_logits

from conftest import tiny_llama


def _enable_checkpointing(model):
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()


def ragged_batch(seed: int = 1, vocab_size: int = 40):
    """Six rows with different left pads, reasoning and answer lengths and tails; one row has no
    answer, one has its reasoning right up to the answer (no marker in between)."""
    g = torch.Generator().manual_seed(seed)
    # (left pad, prompt, reasoning, marker, answer, tail)
    layouts = [
        (0, 4, 9, 1, 2, 1),
        (3, 2, 4, 1, 3, 2),
        (1, 5, 6, 0, 1, 1),
        (2, 3, 11, 1, 2, 0),
        (0, 2, 3, 1, 0, 4),
        (4, 1, 7, 2, 1, 1),
    ]
    width = max(sum(x) for x in layouts)
    ids = torch.zeros(len(layouts), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    reas = torch.zeros(ids.shape, dtype=torch.bool)
    ans = torch.zeros_like(reas)
    for i, (lp, p, r, mk, a, tail) in enumerate(layouts):
        n = lp + p + r + mk + a + tail
        ids[i, lp:n] = torch.randint(3, vocab_size, (n - lp,), generator=g)
        attn[i, lp:n] = 1
        reas[i, lp + p : lp + p + r] = True
        ans[i, lp + p + r + mk : lp + p + r + mk + a] = True
    return ids, attn, reas, ans


@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("max_chunk_tokens", [1, 40, 130, 100_000])
def test_oar_p_packed_across_rollouts_equals_naive(probe, max_chunk_tokens):
    model = tiny_llama(seed=3)
    ids, attn, reas, ans = ragged_batch()
    fast = perturbation_scores(
        model, ids, attn, reas, ans, probe=probe, pad_token_id=0, max_chunk_tokens=max_chunk_tokens
    )
    naive = perturbation_scores_naive(model, ids, attn, reas, ans, probe=probe, pad_token_id=0, chunk_size=5)
    assert naive[reas].abs().max() > 0
    torch.testing.assert_close(fast, naive, rtol=0, atol=1e-4 * naive.abs().max().item())
    assert (fast[4] == 0).all()  # no answer: no scores


def test_oar_p_in_training_mode_with_checkpointing_matches_eval_and_keeps_modes():
    model = tiny_llama(seed=3)
    ids, attn, reas, ans = ragged_batch()
    expected = perturbation_scores(model, ids, attn, reas, ans, pad_token_id=0)
    _enable_checkpointing(model)
    model.train()
    model.model.layers[1].eval()  # a mix of modes must come back as it was
    modes = [m.training for m in model.modules()]
    got = perturbation_scores(model, ids, attn, reas, ans, pad_token_id=0, max_chunk_tokens=50)
    torch.testing.assert_close(got, expected)
    assert [m.training for m in model.modules()] == modes


def _oar_g_reference(model, ids, attn, reas, ans, noise, noise_std, probe):
    """maths §4 the plain way: full-sequence forward on e + delta, all logits, autograd.grad."""
    e = model.get_input_embeddings()(ids).detach()
    with torch.no_grad():
        clean = outcome_from_logits(forward_logits(model, ids, attn), ids, ans, probe)
    noised = (e + noise_std * noise * reas.unsqueeze(-1)).requires_grad_(True)
    masked = outcome_from_logits(forward_logits(model, attention_mask=attn, inputs_embeds=noised), ids, ans, probe)
    has = ans.any(1)
    (grad,) = torch.autograd.grad(divergence(clean, masked, probe)[has].sum(), noised)
    return (grad * e).sum(-1).abs() * reas * has.unsqueeze(1)


@pytest.mark.parametrize("probe", PROBES)
def test_oar_g_split_forward_equals_full_backward(probe):
    model = tiny_llama(seed=3)
    ids, attn, reas, ans = ragged_batch()
    noise = torch.randn(*ids.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    ref = _oar_g_reference(model, ids, attn, reas, ans, noise, 1e-2, probe)
    fast = gradient_scores(model, ids, attn, reas, ans, probe=probe, noise_std=1e-2, noise=noise)
    assert ref.abs().max() > 0
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-6 * ref.abs().max().item())
    _enable_checkpointing(model)
    model.train()  # checkpointed layers drop caches: the unsplit path, same numbers, no .grad left
    unsplit = gradient_scores(model, ids, attn, reas, ans, probe=probe, noise_std=1e-2, noise=noise)
    torch.testing.assert_close(unsplit, ref, rtol=1e-4, atol=1e-6 * ref.abs().max().item())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_backward_equals_autograd_on_views(dtype):
    g = torch.Generator().manual_seed(1)
    full = (4 * torch.randn(5, 9, 60, generator=g)).to(dtype).requires_grad_(True)
    logits = full[:, :-1]  # the non-contiguous view train.py passes
    labels = torch.randint(0, 60, (5, 8), generator=g)
    upstream = torch.randn(5, 8, generator=g)
    ours = token_logprobs(logits, labels, chunk_rows=2)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(ours, ref)
    (g1,) = torch.autograd.grad((ours * upstream).sum(), full)
    (g2,) = torch.autograd.grad((ref * upstream).sum(), full)
    assert g1.dtype == dtype
    torch.testing.assert_close(g1, g2)


@pytest.mark.parametrize("probe", PROBES)
def test_scores_do_not_depend_on_the_batch_or_on_reusing_the_update_forward(probe):
    # A rollout's scores are the same scored in a batch, alone (micro-batches of 1), or from the
    # clean outcome and keys/values of the update's own forward (what train.py passes).
    model = tiny_llama(seed=3)
    ids, attn, reas, ans = ragged_batch()
    noise = torch.randn(*ids.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    logits, kv = clean_forward(model, ids, attn, keep_cache=True)
    clean = outcome_from_logits(logits, ids, ans, probe)
    oar_g = lambda r, **kw: gradient_scores(model, ids[r], attn[r], reas[r], ans[r], probe=probe, noise=noise[r], **kw)
    oar_p = lambda r, **kw: perturbation_scores(
        model, ids[r], attn[r], reas[r], ans[r], probe=probe, pad_token_id=0, **kw
    )
    for scorer in (oar_g, oar_p):
        whole = scorer(slice(None))
        alone = torch.cat([scorer(slice(i, i + 1)) for i in range(len(ids))])
        reused = scorer(slice(None), clean=clean, clean_kv=kv)
        top = whole.abs().max().item()
        torch.testing.assert_close(alone, whole, rtol=0, atol=1e-6 * top)
        # The update's logits come from a matmul over every position, the scorers' from one over the
        # answer positions: last-bit differences (~1e-7 relative) in the clean probe P_0. OAR-G's
        # gradient is that of a KL at its minimum, proportional to P(e + delta) - P_0 with
        # |delta| = noise_std = 1e-3, so it magnifies them about 1e-7 / 1e-3 = 1e-4-fold (1.9e-5 of
        # the largest score was seen on one machine, against 1e-5 allowed before).
        torch.testing.assert_close(reused, whole, rtol=0, atol=1e-4 * top)
