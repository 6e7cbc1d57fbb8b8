"""Inverse-CDF sampling over the vocabulary, the sampler's one rule for turning a uniform into a token.

The definition (`sorted_choice`): order the vocabulary by probability, most likely first; the token is
the first whose cumulative probability exceeds u x the total. It needs the whole vocabulary sorted,
which on a CPU is most of a small model's decode step (64 x 49,152 probabilities: ~220 ms against
~6 ms for the 65 largest).

`head_choice` gives exactly the same token without the sort, on a CPU, for the rows where it can prove
so, and hands the others back to `sorted_choice`. The proof rests on how torch's CPU `cumsum` adds a
row: one element after another in a float64 accumulator, each partial sum rounded to float32
(`cumsum_adds_in_float64` checks this once per process; where it does not hold, every row is sorted).
Then, with the k+1 largest probabilities from `topk` (the same values, in the same order, as the
sort's first k+1):
  * the first k cumulative sums are the sort's first k, bit for bit, so a threshold below the k-th
    lands on the same position;
  * the total (the sort's last cumulative sum) is the float32 rounding of a float64 sum whose order
    can move it by at most V x 2**-52 of itself; a float64 sum in any order, further than that from
    a float32 rounding midpoint, rounds to the same float32;
  * the position names the same token when its probability is held by no other token (a tie could
    be ordered otherwise by the sort).
A row that fails any of the three (its threshold beyond the head, its total too near a midpoint or
the float32 range's end, a tie at its position, a NaN anywhere) is sorted as before. Top-p < 1, a
GPU (whose sort is fast and whose scan adds in another order), probabilities in another dtype than
float32 (a bfloat16 or float16 cumsum adds in float32) and a step being compiled use the sort throughout.
"""

from __future__ import annotations

import functools

import torch

HEAD = 64  # the most likely tokens `head_choice` searches before it falls back to the sort


def choice(probs: torch.Tensor, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` (B, V) for its uniform u (B,): `sorted_choice`'s token, found
    without the sort where `head_choice` can prove it is the same."""
    fast = (
        probs.device.type == "cpu"
        and probs.dtype == torch.float32
        and top_p >= 1.0
        and probs.shape[-1] > 4 * HEAD
        and not torch.compiler.is_compiling()
        and cumsum_adds_in_float64()
    )
    if not fast:
        return sorted_choice(probs, top_p, u)
    token, sure = head_choice(probs, u)
    if not bool(sure.all()):
        rows = (~sure).nonzero().squeeze(1)
        token[rows] = sorted_choice(probs[rows], top_p, u[rows])
    return token


def sorted_choice(probs: torch.Tensor, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """The definition: inverse-CDF sampling over the vocabulary sorted most likely first. Top-p keeps
    the smallest set of most likely tokens whose mass reaches top_p (the most likely always)."""
    probs, order = probs.sort(dim=-1, descending=True)
    if top_p < 1.0:
        probs = probs * ((probs.cumsum(-1) - probs) < top_p)
    cdf = probs.cumsum(-1)
    position = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).clamp(max=cdf.shape[-1] - 1)
    return order.gather(-1, position).squeeze(-1)


def head_choice(probs: torch.Tensor, u: torch.Tensor, k: int = HEAD) -> tuple[torch.Tensor, torch.Tensor]:
    """(token (B,), sure (B,)): `sorted_choice`'s token at top-p 1 wherever `sure`, found among the k
    most likely tokens; rows not sure must be sorted. Float32 probabilities on a CPU (module docstring)."""
    vals, idx = probs.topk(k + 1, dim=-1)  # descending, as the sort's first k + 1
    exact = probs.sum(-1, dtype=torch.float64)  # the total in float64, in another order than the sort's
    total = exact.float()
    above, below = (torch.nextafter(total, torch.full_like(total, end)) for end in (float("inf"), 0.0))
    midpoints = [(total.double() + x.double()) / 2 for x in (below, above)]
    # twice the two orders' combined rounding bound, V x 2**-52 x sum |p|; probabilities are >= 0, so sum |p| is the
    # total
    # (a NaN makes every comparison below False: the row is sorted)
    slack = probs.shape[-1] * 2.0**-51 * exact
    total_sure = (
        (exact - midpoints[0] > slack) & (midpoints[1] - exact > slack) & above.isfinite()
    )  # the largest float32 rounds to inf above
    cdf = vals[:, :k].cumsum(-1)
    position = torch.searchsorted(cdf, (u * total).unsqueeze(-1), right=True).squeeze(-1)
    inside = position < k
    at = position.clamp(max=k - 1)[:, None]
    v = vals.gather(1, at)
    alone = (v != vals.gather(1, at + 1)) & ((at == 0) | (v != vals.gather(1, (at - 1).clamp(min=0))))
    return idx.gather(1, at).squeeze(1), inside & alone.squeeze(1) & total_sure


@functools.cache
def cumsum_adds_in_float64() -> bool:
    """Whether this torch's CPU cumsum adds a float32 row in order in a float64 accumulator: a prefix's
    cumsum equals the whole row's first entries, and 1 + 64 x 2**-25 is reached (a float32 accumulator
    stays at 1)."""
    row = torch.cat([torch.ones(1), torch.full((64,), 2.0**-25)])
    if float(row.cumsum(0)[-1]) != 1.0 + 2.0**-19:
        return False
    x = torch.rand(4, 5000, generator=torch.Generator().manual_seed(0)) ** 8
    return torch.equal(x.cumsum(-1)[:, :100], x[:, :100].cumsum(-1)) and torch.equal(
        x.cumsum(-1)[:, -1], x.double().cumsum(-1)[:, -1].float()
    )
