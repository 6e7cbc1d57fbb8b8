"""Exact OAR-P, fast: the masked copies of many rollouts share forwards and reuse the clean keys/values
(maths §3). `oar_perturb.perturbation_scores` is the entry point; this module is its `exact` mode.

Legend: B rollouts, L sequence positions, H hidden width, V vocabulary, K answer-predicting
positions of a row, c masked copies in one chunk, S cached positions, N recomputed positions.

It gives the numbers of `oar_perturb.perturbation_scores_naive` (one full forward per masked copy;
to float tolerance, tests pin them) at a fraction of the cost, because masking token j cannot
change anything before j:
  * one clean pass per block of rollouts keeps every layer's keys/values (or none at all: train.py
    hands over the update forward's, `clean` / `clean_kv`); a masked copy recomputes only positions
    j .. end-1 (end: the last answer token) and attends to the clean keys/values of positions < j;
  * only the columns from the first answer-predicting one on go through the output head, not L x V logits;
  * copies from *all* rollouts of a block share forwards: copies whose recomputed length rounds up
    to the same multiple of COPY_LENGTH_STEP (4) form a chunk, so little work is padding and small models
    run a few large batches instead of one small forward per rollout;
  * a copy's cached prefix is left-padded (masked out) so that every copy attends to
    L + COPY_LENGTH_STEP - 1 positions, and a chunk too small for the BLAS kernels of large matrices is filled up with
    duplicate copies (probes.min_rows): a copy's numbers do not depend on which rollouts share its
    batch, so micro-batching stays exact to float rounding (tests/package/test_speed_paths.py);
  * a chunk holds at most `max_chunk_tokens` (cached + recomputed) positions, which bounds memory,
    and so does a block of rollouts whose clean keys/values are held at once (rows x L); None sizes it by
    the device (`lm.positions_that_fit`: 8192 on a CPU, from the free memory on a GPU). Any budget gives the
    same scores to float rounding: a copy's shapes are its own (tests/package/test_oar_scores.py);
  * the host reads the masks once per call and builds each block's tables of copies (row, start, masked
    positions) once: no read of a device tensor per copy or per chunk, so a GPU's queue is not drained.
`span > 1` is an approximate mode: mask `span` consecutive reasoning tokens at once and give each
of them the span's score (span-fold fewer copies; its error is reported by scripts/bench/bench.py).
Rows with no answer token or no reasoning token score 0 everywhere. Scoring runs with every module
in eval mode (dropout off; checkpointed layers would drop the caches), and restores each module's mode.

Every causal LM's own forward computes the logits (as `probes.logits_at` does: its head, logit scaling and
soft-cap included, only at the last columns), and caches keep every position (`lm.full_cache`):
the model's masks, sliding windows included, are built in index space from the cache, and the
left-padded prefix shifts cached keys and queries alike, so a window sees the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from oar.lm import cache_kwargs, eval_mode, full_cache, on_device, position_ids, positions_that_fit, returned_cache
from oar.probes import MIN_ROWS, divergence, min_rows, outcome


@torch.no_grad()
def exact_perturbation_scores(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    reasoning_mask: torch.Tensor,
    answer_mask: torch.Tensor,
    *,
    probe: str,
    pad_token_id: int,
    max_chunk_tokens: int | None = None,
    span: int = 1,
    clean: torch.Tensor | None = None,
    clean_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """OAR-P scores (B, L) float32 of the `reasoning_mask` tokens, 0 elsewhere; the arguments are
    `oar_perturb.perturbation_scores`'s (which checks them). At most `max_chunk_tokens` (cached +
    recomputed) positions per forward; None: as many as the device holds (`lm.positions_that_fit`)."""
    batch = _Batch(input_ids, attention_mask, answer_mask, probe, pad_token_id, clean, clean_kv)
    rows = _rows(reasoning_mask, answer_mask, span)
    budget = max_chunk_tokens
    if (
        budget is None
    ):  # a copy attends to L + COPY_LENGTH_STEP - 1 positions; K + COPY_LENGTH_STEP logit columns at most
        k = max((r.end - r.a0 + 1 for r in rows), default=1)
        keys = input_ids.shape[1] + COPY_LENGTH_STEP - 1
        budget = positions_that_fit(model, input_ids.device, per_copy=keys, logit_columns=k + COPY_LENGTH_STEP)
    scores = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    with eval_mode(model):  # caches are needed, and checkpointed layers drop them in training mode
        for block in _blocks(rows, budget // input_ids.shape[1]):
            _score_block(model, block, batch, scores, budget)
    return scores


@dataclass(frozen=True)
class _Batch:
    """What every part of an exact OAR-P call reads: the rows (B, L), the probe and the clean pass."""

    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    answer_mask: torch.Tensor  # (B, L) bool
    probe: str
    pad_token_id: int  # the token a masked position is replaced by
    clean: torch.Tensor | None  # the caller's clean outcome, or None
    clean_kv: list[tuple[torch.Tensor, torch.Tensor]] | None  # and its keys/values, or None: a clean pass runs here


@dataclass
class _Row:
    b: int  # row of the batch
    a0: int  # first answer token (>= 1: position a0 - 1 predicts it)
    end: int  # last answer token; the row is cut after position end - 1
    groups: list[tuple[int, ...]]  # reasoning positions masked together (one copy each)


def _rows(reasoning_mask: torch.Tensor, answer_mask: torch.Tensor, span: int) -> list[_Row]:
    """The rows to score, read from the (B, L) masks in one pass to the host: each row with an answer token
    and a reasoning token before its last answer token (a token at or after it cannot move the answer)."""
    answers, reasoning = ({}, {})
    for table, mask in ((answers, answer_mask), (reasoning, reasoning_mask)):
        for b, j in mask.nonzero().tolist():  # ascending by row, then position
            table.setdefault(b, []).append(j)
    rows = []
    for b, answer in answers.items():
        a0, end = answer[0], answer[-1]  # inputs 0 .. end-1 predict answer tokens a0 .. end
        js = [j for j in reasoning.get(b, []) if j < end]
        if js:
            rows.append(_Row(b, max(a0, 1), end, [tuple(js[i : i + span]) for i in range(0, len(js), span)]))
    return rows


def _blocks(rows: list[_Row], most: int):
    """Consecutive rows, at most `most` (>= 1) per block: a block's clean keys/values are held at once."""
    for i in range(0, len(rows), max(1, most)):
        yield rows[i : i + max(1, most)]


# a copy's recomputed length is rounded up to a multiple of this (copies of a chunk share a shape)
COPY_LENGTH_STEP = 4


def _score_block(model, block: list[_Row], batch: _Batch, scores: torch.Tensor, budget: int) -> None:
    """Clean pass over the block's rows, then every masked copy of those rows, packed in chunks.

    Every copy's computation has a shape fixed by the copy alone (and the batch width L): it
    recomputes round_up(end - start, COPY_LENGTH_STEP) positions after a cache left-padded to
    L + COPY_LENGTH_STEP - 1 - that many. So a copy's score does not depend on which rollouts share its
    chunk, and micro-batching cannot change it (tests/package/test_distributed.py checks whole updates).
    Writes the block's scores into `scores` (B, L).
    """
    input_ids, attention_mask, answer_mask = batch.input_ids, batch.attention_mask, batch.answer_mask
    probe, pad_token_id, clean, clean_kv = batch.probe, batch.pad_token_id, batch.clean, batch.clean_kv
    dev = input_ids.device
    idx = on_device(dev, [r.b for r in block])
    width = input_ids.shape[1]  # the full width, whatever rows the block holds
    ids, mask = input_ids[idx], attention_mask[idx]  # (n, L)
    pos = position_ids(mask)
    k = max(r.end - r.a0 + 1 for r in block)
    keep = on_device(
        dev, [[min(r.a0 - 1 + i, r.end - 1) for i in range(k)] for r in block]
    )  # (n, K) positions, padded
    targets = input_ids[idx[:, None], keep + 1]  # (n, K): the tokens those positions predict
    real = on_device(dev, [[i <= r.end - r.a0 for i in range(k)] for r in block]).bool()  # real entries of `keep`
    valid = answer_mask[idx[:, None], keep + 1] & real

    if clean_kv is not None:  # the caller's clean forward (e.g. the update's): nothing to recompute
        clean, kv = clean[idx], [(k[idx].detach(), v[idx].detach()) for k, v in clean_kv]
    else:  # keys/values of the block; the head runs on one column only (ragged answers would need L x V logits)
        run = on_device(dev, list(range(len(block))) + [0] * (min_rows(len(block), width) - len(block)))
        out = model(
            input_ids=ids[run],
            attention_mask=mask[run],
            position_ids=pos[run],
            **cache_kwargs(full_cache()),
            use_cache=True,
            logits_to_keep=1,
        )
        kv = [
            (layer.keys[: len(block)], layer.values[: len(block)]) for layer in returned_cache(out).layers
        ]  # (n, heads, L, d)
    keys = width + COPY_LENGTH_STEP - 1  # cached + recomputed positions of every copy

    def outcomes(t: _Copies, i0: int, i1: int, n: int):
        """The probe of the copies i0 .. i1-1 of table `t` (sorted), each recomputing n positions, with
        duplicates of copy i0 up to probes.min_rows rows (they keep the matmuls' kernels fixed) ->
        (block rows (c,), outcomes (c, ...)) of the real copies first."""
        c = min_rows(i1 - i0, n)
        at_ = torch.cat([torch.arange(i0, i1, device=dev), torch.full((c - (i1 - i0),), i0, device=dev)])
        n_of, start, end = t.row[at_], t.start[at_], t.end[at_]  # (c,) each
        s = keys - n
        # Cached prefix of copy m: clean positions 0 .. start_m - 1, left-padded to s (pads masked out).
        src = torch.arange(s, device=dev)[None] - (s - start[:, None])  # (c, S)
        cache_mask = (src >= 0) & mask[n_of[:, None], src.clamp(min=0)].bool()
        # Recomputed part: positions start_m .. end_m - 1, right-filled with pads (causal: they
        # cannot reach a real position); the masked group is replaced by the pad token.
        col = start[:, None] + torch.arange(n, device=dev)[None]  # (c, N)
        inside = col < end[:, None]
        colc = col.clamp(max=width - 1)
        q_ids = torch.where(inside, ids[n_of[:, None], colc], pad_token_id)
        p0, p1 = t.pair_from[i0], t.pair_from[i1]  # the (copy, masked position) pairs of copies i0 .. i1-1
        q_ids[t.pair_copy[p0:p1] - i0, t.pair_col[p0:p1] - t.start[t.pair_copy[p0:p1]]] = pad_token_id
        q_mask = torch.where(inside, mask[n_of[:, None], colc], 1)
        q_pos = pos[n_of[:, None], colc] + (col - colc)  # the fill continues the positions
        # The cache keeps every position (lm.full_cache). Left-padding the prefix shifts cached keys and
        # queries by the same s - start columns, so index-space sliding windows still see the same tokens.
        cache = None
        if s > 0:
            cache = full_cache(
                [
                    (
                        key[n_of[:, None], :, src.clamp(min=0)].transpose(1, 2),
                        value[n_of[:, None], :, src.clamp(min=0)].transpose(1, 2),
                    )
                    for key, value in kv
                ]
            )
        at = (keep[n_of] - start[:, None]).clamp(min=0)  # (c, K) answer-predicting positions in the chunk
        # probes.logits_at's rule (the model's own head, from the first answer column on, at least MIN_ROWS rows
        # of it), with that column known here instead of read back from the device
        cols = max(n - min(t.first[i0:i1]), min(n, -(-MIN_ROWS // c)))
        out = model(
            input_ids=q_ids,
            attention_mask=torch.cat([cache_mask.long(), q_mask.long()], 1),
            position_ids=q_pos,
            **cache_kwargs(cache),
            use_cache=cache is not None,
            logits_to_keep=cols,
        )
        answer_logits = out.logits[torch.arange(c, device=dev)[:, None], at - (n - cols)]  # (c, K, V)
        return n_of[: i1 - i0], outcome(answer_logits, targets[n_of], valid[n_of], probe)[: i1 - i0]

    def packed(copies: list[_Copy]):
        """(table, i0, i1, block rows, outcomes) for each chunk of the copies, longest first."""
        t = _Copies.of(sorted(copies, key=lambda c: c.length, reverse=True), block, dev)
        for i0, i1 in _chunks(t.lengths, max(1, budget // keys)):
            yield (t, i0, i1, *outcomes(t, i0, i1, t.lengths[i0]))

    if clean_kv is None:  # the clean probe: an unmasked copy of each row (from a0 - 1), as exact as the masked ones
        clean = None
        for t, i0, i1, n_of, probes in packed(
            [_Copy(n, (), r.a0 - 1, _rounded(r.end - (r.a0 - 1))) for n, r in enumerate(block)]
        ):
            clean = probes.new_zeros((len(block), *probes.shape[1:])) if clean is None else clean
            clean[n_of] = probes  # (n, V) or (n,)

    # One copy per masked group: recompute from start = min(first masked, a0 - 1) to end - 1.
    starts = [(n, g, min(g[0], r.a0 - 1)) for n, r in enumerate(block) for g in r.groups]
    copies = [_Copy(n, g, start, _rounded(block[n].end - start)) for n, g, start in starts]
    for t, i0, i1, n_of, masked in packed(copies):
        s_m = divergence(clean[n_of], masked, probe).float()  # (c,)
        p0, p1 = t.pair_from[i0], t.pair_from[i1]
        scores[idx[n_of[t.pair_copy[p0:p1] - i0]], t.pair_col[p0:p1]] = s_m[t.pair_copy[p0:p1] - i0]


class _Copy(NamedTuple):
    """One masked copy of a block's row: the positions it masks and the stretch it recomputes."""

    row: int  # the row's index in its block
    group: tuple[int, ...]  # positions replaced by the pad token (empty: the clean copy)
    start: int  # first recomputed position
    length: int  # recomputed positions start .. end - 1, rounded up to a multiple of COPY_LENGTH_STEP


@dataclass(frozen=True)
class _Copies:
    """A list of copies as device tables, made once (one transfer each), read per chunk by slicing."""

    lengths: list[int]  # (C,) on the host: the chunks' shapes
    row: torch.Tensor  # (C,) block row of each copy
    start: torch.Tensor  # (C,)
    end: torch.Tensor  # (C,) the row's cut: its last answer token
    pair_copy: torch.Tensor  # (P,) for each masked position of each copy, in copy order: the copy
    pair_col: torch.Tensor  # (P,) and the position
    pair_from: list[int]  # (C + 1,) on the host: copy i's pairs are pair_from[i] .. pair_from[i + 1] - 1
    first: list[int]  # (C,) on the host: the first answer-predicting column of each copy's recomputed stretch

    @staticmethod
    def of(copies: list[_Copy], block: list[_Row], device) -> "_Copies":
        """The table of `copies`, in their order, of the rows of `block`."""
        pair_from, pair_copy, pair_col = [0], [], []
        for i, c in enumerate(copies):
            pair_copy += [i] * len(c.group)
            pair_col += c.group
            pair_from.append(len(pair_col))
        rows = on_device(device, [[c.row, c.start, block[c.row].end] for c in copies])  # (C, 3)
        pairs = on_device(device, [pair_copy, pair_col])  # (2, P)
        first = [max(0, block[c.row].a0 - 1 - c.start) for c in copies]
        return _Copies([c.length for c in copies], *rows.unbind(1), *pairs, pair_from, first)


def _rounded(n: int) -> int:
    """n rounded up to a multiple of COPY_LENGTH_STEP."""
    return -(-n // COPY_LENGTH_STEP) * COPY_LENGTH_STEP


def _chunks(lengths: list[int], most: int):
    """(i0, i1) ranges of consecutive copies with the same padded length, at most `most` per chunk."""
    i0 = 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or i - i0 == most or lengths[i] != lengths[i0]:
            yield i0, i
            i0 = i
