"""oar/inverse_cdf.py: the CPU head search picks exactly the token that sorting the vocabulary picks,
on every row, including the rows it must hand back to the sort (ties, a total near a float32
rounding midpoint, a threshold beyond the head, NaN)."""

import torch

from oar import inverse_cdf
from oar.inverse_cdf import HEAD, choice, cumsum_adds_in_float64, head_choice, sorted_choice


def reference(probs, top_p, u):
    """The sampler's rule before the head search, verbatim: sort, (top-p), cumsum, search."""
    probs, order = probs.sort(dim=-1, descending=True)
    if top_p < 1.0:
        probs = probs * ((probs.cumsum(-1) - probs) < top_p)
    cdf = probs.cumsum(-1)
    choice = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).clamp(max=cdf.shape[-1] - 1)
    return order.gather(-1, choice).squeeze(-1)


def _case(seed, rows, vocab, scale, temperature=1.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale
    return torch.softmax(logits / temperature, -1), torch.rand(rows, generator=g)


def test_this_torch_adds_cumsum_in_float64():
    # The head search's proof needs it; where a torch does otherwise, choice() sorts every row (still exact).
    assert cumsum_adds_in_float64()


def test_head_search_equals_the_sort_and_is_mostly_taken():
    taken = 0
    for seed, (vocab, scale, temperature) in enumerate(
        [
            (49152, 3.0, 1.0),
            (49152, 3.0, 0.5),
            (49152, 1.0, 1.0),
            (4096, 6.0, 0.7),
            (1000, 0.2, 1.0),
            (151936, 4.0, 1.0),
        ]
    ):
        probs, u = _case(seed, 32, vocab, scale, temperature)
        assert torch.equal(choice(probs, 1.0, u), reference(probs, 1.0, u)), (vocab, scale, temperature)
        assert torch.equal(sorted_choice(probs, 1.0, u), reference(probs, 1.0, u))
        taken += int(head_choice(probs, u)[1].sum())
    assert taken > 32  # the peaked cases are answered from the head, not all handed back


def test_every_uniform_over_a_peaked_row():
    probs, _ = _case(7, 1, 16384, 8.0)
    u = torch.linspace(0, 1 - 2**-24, 1001)
    probs = probs.expand(len(u), -1).contiguous()
    token, sure = head_choice(probs, u)
    assert sure.float().mean() > 0.9
    assert torch.equal(token[sure], reference(probs, 1.0, u)[sure])
    assert torch.equal(choice(probs, 1.0, u), reference(probs, 1.0, u))


def test_ties_are_sorted_not_guessed():
    # Logits on a coarse grid: many tokens share a probability, so the head's order of equal values may
    # differ from the sort's; those rows must go to the sort.
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(256, 8192, generator=g) * 4).round() + torch.linspace(0, 1, 256)[:, None].round()
    probs, u = torch.softmax(logits, -1), torch.rand(256, generator=g)
    token, sure = head_choice(probs, u)
    vals = probs.sort(-1, descending=True).values
    pos = (
        torch.searchsorted(vals.cumsum(-1), (u * vals.cumsum(-1)[:, -1])[:, None], right=True)
        .squeeze(1)
        .clamp(max=HEAD - 1)
    )
    tied = (probs == vals.gather(1, pos[:, None])).sum(1) > 1
    assert tied.any() and not (sure & tied).any()
    assert torch.equal(choice(probs, 1.0, u), reference(probs, 1.0, u))


def test_a_total_near_a_float32_midpoint_is_sorted():
    # Sums to 1 + 2**-24 exactly, the midpoint between 1 and the next float32: another order of
    # addition could round it either way, so the head may not trust its total.
    row = torch.zeros(1, 4 * HEAD + 8)
    row[0, 0], row[0, 1] = 0.5, 0.5 + 2.0**-24
    u = torch.tensor([0.25])
    assert not head_choice(row, u)[1].item()
    assert torch.equal(choice(row, 1.0, u), reference(row, 1.0, u))
    row[0, 1] = 0.5 + 2.0**-22  # far from a midpoint: trusted
    assert head_choice(row, u)[1].item()


def test_a_total_that_another_order_rounds_otherwise_is_sorted():
    # torch's float64 sum rounds to 1 + 2**-23, the sort's in-order sum lands on the midpoint and
    # rounds to 1: the two totals put the threshold on different tokens, so the slack must catch it.
    row = torch.zeros(1, 4 * HEAD + 8)
    row[0, 0], row[0, 1], row[0, -64:] = 0.5, 0.5 + 2.0**-24, 2.0**-54
    u = torch.tensor([0.5])
    assert not head_choice(row, u)[1].item()
    assert torch.equal(choice(row, 1.0, u), reference(row, 1.0, u))


def test_the_end_of_the_float32_range_and_other_dtypes_take_the_sort():
    row = torch.zeros(1, 4 * HEAD + 8, dtype=torch.float64)
    row[0, 0], row[0, 1], row[0, 2:18] = 2.0**128 - 2.0**104, 2.0**103 - 2.0**79, 2.0**74 + 2.0**51
    row, u = row.float(), torch.tensor([0.5])  # the sort's running total overflows to inf
    assert not head_choice(row, u)[1].item()
    assert torch.equal(choice(row, 1.0, u), reference(row, 1.0, u))
    for dtype, values in [
        (torch.bfloat16, [0.5, 0.498046875, 2.0**-10]),
        (torch.float16, [0.5, 0.5 - 2.0**-12, 2.0**-13]),
        (torch.float64, [0.5 + 2.0**-32, 0.25, 0.25 - 2.0**-32 + 2.0**-30]),
    ]:
        row = torch.zeros(1, 4 * HEAD + 8, dtype=dtype)
        row[0, :3] = torch.tensor(values, dtype=dtype)
        assert torch.equal(choice(row, 1.0, u), reference(row, 1.0, u)), dtype


def test_a_tie_across_the_heads_end_and_thresholds_on_cumulative_sums():
    g = torch.Generator().manual_seed(0)
    vocab = 4 * HEAD + 8
    tied = torch.zeros(16, vocab)  # 63 distinct values, then 137 equal ones; the threshold at the 64th
    for b in range(16):
        perm = torch.randperm(vocab, generator=g)
        tied[b, perm[:63]], tied[b, perm[63:200]] = torch.linspace(0.02, 0.01, 63), 0.001
    cdf = tied.sort(-1, descending=True).values.cumsum(-1)
    u = (cdf[:, 62] + cdf[:, 63]) / 2 / cdf[:, -1]
    assert not head_choice(tied, u)[1].any()
    assert torch.equal(choice(tied, 1.0, u), reference(tied, 1.0, u))
    dyadic = torch.zeros(44, vocab)  # sums to exactly 1: each threshold is exactly a cumulative sum
    dyadic[:, :43], dyadic[:, 43] = torch.arange(1, 44) * 2.0**-10, 78 * 2.0**-10
    u = dyadic[0].sort(descending=True).values.cumsum(0)[:44]
    assert head_choice(dyadic, u)[1].any()
    assert torch.equal(choice(dyadic, 1.0, u), reference(dyadic, 1.0, u))
    probs, _ = _case(9, 64, 4 * vocab, 3.0)  # thresholds on, just above and just below a cumulative sum
    cdf = probs.sort(-1, descending=True).values.cumsum(-1)
    at = cdf.gather(1, torch.randint(0, HEAD, (64, 1), generator=g)).squeeze(1) / cdf[:, -1]
    for u in (at, torch.nextafter(at, torch.ones(())), torch.nextafter(at, torch.zeros(()))):
        assert torch.equal(choice(probs, 1.0, u), reference(probs, 1.0, u))


def test_nan_ruled_out_tokens_and_top_p_take_the_sort():
    probs, u = _case(11, 8, 8192, 3.0)
    probs[2, 5] = float("nan")
    probs[3] = torch.where(probs[3] < probs[3].median(), torch.zeros(()), probs[3])  # half the vocabulary ruled out
    u[4] = 1 - 2**-24  # the threshold in the tail
    token, sure = head_choice(probs, u)
    assert not sure[2] and not sure[4]
    assert torch.equal(choice(probs, 1.0, u), reference(probs, 1.0, u))
    assert torch.equal(choice(probs, 0.9, u), reference(probs, 0.9, u))


def test_the_sort_is_used_where_the_proof_does_not_hold(monkeypatch):
    probs, u = _case(5, 4, 8192, 3.0)
    calls = []
    monkeypatch.setattr(inverse_cdf, "head_choice", lambda *a, **k: calls.append(1) or head_choice(*a, **k))
    choice(probs, 0.95, u)  # top-p < 1
    choice(probs[:, : 4 * HEAD], 1.0, u)  # a small vocabulary
    monkeypatch.setattr(inverse_cdf, "cumsum_adds_in_float64", lambda: False)
    choice(probs, 1.0, u)
    assert calls == []


def test_the_sampler_draws_the_sorted_rules_rollouts(monkeypatch):
    # The eager and fixed-shape loops through a model with a 2,048-token vocabulary and peaked
    # distributions: tokens and log-probs bit for bit those of sorting every row, the head search used.
    from conftest import tiny_llama

    from oar.sampler import decode

    model = tiny_llama(vocab_size=2048, seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(25)
    ids, attn = (
        torch.randint(3, 2048, (3, 6), generator=torch.Generator().manual_seed(0)),
        torch.ones(3, 6, dtype=torch.long),
    )
    attn[1, :3] = 0
    sure = []
    monkeypatch.setattr(inverse_cdf, "head_choice", lambda *a: sure.append(head_choice(*a)[1]) or head_choice(*a))
    kw = dict(
        max_new_tokens=24,
        temperature=0.7,
        top_p=1.0,
        eos_token_ids={2},
        pad_token_id=0,
        seeds=list(range(12)),
        group_size=4,
    )
    runs = {loop: decode(model, ids, attn, loop=loop, **kw) for loop in ("eager", "static")}
    assert torch.cat(sure).float().mean() > 0.5
    monkeypatch.setattr(inverse_cdf, "cumsum_adds_in_float64", lambda: False)
    for loop, (tokens, logprobs) in runs.items():
        want = decode(model, ids, attn, loop=loop, **kw)
        assert torch.equal(tokens, want[0]) and torch.equal(logprobs, want[1]), loop
