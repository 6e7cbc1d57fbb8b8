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
    to the same multiple of GRAIN (4) form a chunk, so little work is padding and small models run
    a few large batches instead of one small forward per rollout;
  * a copy's cached prefix is left-padded (masked out) so that every copy attends to L + GRAIN - 1
    positions, and a chunk too small for the BLAS kernels of large matrices is filled up with
    duplicate copies (probes.min_rows): a copy's numbers do not depend on which rollouts share its
    batch, so micro-batching stays exact to float rounding (tests/test_speed_paths.py);
  * a chunk holds at most `max_chunk_tokens` (cached + recomputed) positions, which bounds memory,
    and so does a block of rollouts whose clean keys/values are held at once (rows x L).
`span > 1` is an approximate mode: mask `span` consecutive reasoning tokens at once and give each
of them the span's score (span-fold fewer copies; its error is reported by scripts/bench/bench.py).
Rows with no answer token or no reasoning token score 0 everywhere. Scoring runs with every module
in eval mode (dropout off; checkpointed layers would drop the caches), and restores each module's mode.

Every causal LM's own forward computes the logits (`probes.logits_at`: its head, logit scaling and
soft-cap included, only at the last columns), and caches keep every position (`lm.full_cache`):
the model's masks, sliding windows included, are built in index space from the cache, and the
left-padded prefix shifts cached keys and queries alike, so a window sees the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from oar.lm import cache_kwargs, eval_mode, full_cache, position_ids, returned_cache
from oar.probes import divergence, logits_at, min_rows, outcome


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
    max_chunk_tokens: int,
    span: int = 1,
    clean: torch.Tensor | None = None,
    clean_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """OAR-P scores (B, L) float32 of the `reasoning_mask` tokens, 0 elsewhere; the arguments are
    `oar_perturb.perturbation_scores`'s (which checks them). At most `max_chunk_tokens` (cached +
    recomputed) positions per forward."""
    batch = _Batch(input_ids, attention_mask, answer_mask, probe, pad_token_id, clean, clean_kv)
    return _scores(model, batch, reasoning_mask, span, max_chunk_tokens)


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


def _scores(model, batch: _Batch, reasoning_mask: torch.Tensor, span: int, budget: int) -> torch.Tensor:
    """OAR-P's exact mode (exact for span 1) over the rows' `reasoning_mask` tokens (B, L) -> scores (B, L) float32.
    budget: at most this many (cached + recomputed) positions per forward."""
    input_ids, answer_mask = batch.input_ids, batch.answer_mask
    scores = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    rows = []
    for b in range(input_ids.shape[0]):
        answer = answer_mask[b].nonzero().flatten()
        reasoning = reasoning_mask[b].nonzero().flatten()
        if answer.numel() == 0:
            continue
        a0, end = int(answer[0]), int(answer[-1])  # inputs 0 .. end-1 predict answer tokens a0 .. end
        reasoning = reasoning[reasoning < end]  # a token at or after `end` cannot move the answer
        if reasoning.numel():
            rows.append(_Row(b, max(a0, 1), end, reasoning.split(span)))
    with eval_mode(model):  # caches are needed, and checkpointed layers drop them in training mode
        for block in _blocks(rows, budget // input_ids.shape[1]):
            _score_block(model, block, batch, scores, budget)
    return scores


@dataclass
class _Row:
    b: int  # row of the batch
    a0: int  # first answer token (>= 1: position a0 - 1 predicts it)
    end: int  # last answer token; the row is cut after position end - 1
    groups: tuple[torch.Tensor, ...]  # reasoning positions masked together (one copy each)


def _blocks(rows: list[_Row], most: int):
    """Consecutive rows, at most `most` (>= 1) per block: a block's clean keys/values are held at once."""
    for i in range(0, len(rows), max(1, most)):
        yield rows[i : i + max(1, most)]


GRAIN = 4  # recomputed lengths are rounded up to a multiple of this (copies of one chunk share a shape)


def _score_block(model, block: list[_Row], batch: _Batch, scores: torch.Tensor, budget: int) -> None:
    """Clean pass over the block's rows, then every masked copy of those rows, packed in chunks.

    Every copy's computation has a shape fixed by the copy alone (and the batch width L): it
    recomputes round_up(end - start, GRAIN) positions after a cache left-padded to
    L + GRAIN - 1 - that many. So a copy's score does not depend on which rollouts share its
    chunk, and micro-batching cannot change it (tests/test_distributed.py checks whole updates).
    Writes the block's scores into `scores` (B, L).
    """
    input_ids, attention_mask, answer_mask = batch.input_ids, batch.attention_mask, batch.answer_mask
    probe, pad_token_id, clean, clean_kv = batch.probe, batch.pad_token_id, batch.clean, batch.clean_kv
    idx = torch.tensor([r.b for r in block], device=input_ids.device)
    width = input_ids.shape[1]  # the full width, whatever rows the block holds
    ids, mask = input_ids[idx], attention_mask[idx]  # (n, L)
    pos = position_ids(mask)
    k = max(r.end - r.a0 + 1 for r in block)
    keep = torch.stack([_arange_padded(r.a0 - 1, r.end, k, input_ids.device) for r in block])  # (n, K) positions
    targets = input_ids[idx[:, None], keep + 1]  # (n, K): the tokens those positions predict
    count = torch.tensor([r.end - r.a0 + 1 for r in block], device=idx.device)[:, None]  # real entries of `keep`
    valid = answer_mask[idx[:, None], keep + 1] & (torch.arange(k, device=idx.device)[None] < count)

    if clean_kv is not None:  # the caller's clean forward (e.g. the update's): nothing to recompute
        clean, kv = clean[idx], [(k[idx].detach(), v[idx].detach()) for k, v in clean_kv]
    else:  # keys/values of the block; the head runs on one column only (ragged answers would need L x V logits)
        run = torch.cat(
            [torch.arange(len(block)), torch.zeros(min_rows(len(block), width) - len(block), dtype=torch.long)]
        )
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
    keys = width + GRAIN - 1  # cached + recomputed positions of every copy

    def outcomes(chunk):
        """The probe of each copy (a _Copy) of a chunk, duplicates included."""
        n = chunk[0].length
        n_of = torch.tensor([c.row for c in chunk], device=idx.device)  # (c,) block row of each copy
        start = torch.tensor([c.start for c in chunk], device=idx.device)  # (c,)
        s = keys - n
        # Cached prefix of copy m: clean positions 0 .. start_m - 1, left-padded to s (pads masked out).
        src = torch.arange(s, device=idx.device)[None] - (s - start[:, None])  # (c, S)
        cache_mask = (src >= 0) & mask[n_of[:, None], src.clamp(min=0)].bool()
        # Recomputed part: positions start_m .. end_m - 1, right-filled with pads (causal: they
        # cannot reach a real position); the masked group is replaced by the pad token.
        col = start[:, None] + torch.arange(n, device=idx.device)[None]  # (c, N)
        real = col < torch.tensor([block[c.row].end for c in chunk], device=idx.device)[:, None]
        colc = col.clamp(max=width - 1)
        q_ids = torch.where(real, ids[n_of[:, None], colc], pad_token_id)
        for m, c in enumerate(chunk):
            q_ids[m, c.group - int(start[m])] = pad_token_id
        q_mask = torch.where(real, mask[n_of[:, None], colc], 1)
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
        answer_logits, _ = logits_at(
            model,
            at,
            input_ids=q_ids,
            attention_mask=torch.cat([cache_mask.long(), q_mask.long()], 1),
            position_ids=q_pos,
            **cache_kwargs(cache),
            use_cache=cache is not None,
        )  # (c, K, V)
        return n_of, outcome(answer_logits, targets[n_of], valid[n_of], probe)

    def packed(copies):
        """(chunk of real copies, their block rows, their outcomes) for copies packed in chunks."""
        copies = sorted(copies, key=lambda c: c.length, reverse=True)
        for chunk in _chunks(copies, max(1, budget // keys)):
            n_real = len(chunk)
            chunk = chunk + [chunk[0]] * (
                min_rows(n_real, chunk[0].length) - n_real
            )  # duplicates keep the matmuls' kernels fixed
            n_of, probes = outcomes(chunk)
            yield chunk[:n_real], n_of[:n_real], probes[:n_real]

    if clean_kv is None:  # the clean probe: an unmasked copy of each row (from a0 - 1), as exact as the masked ones
        none = torch.zeros(0, dtype=torch.long, device=idx.device)
        rows_clean = {}
        for chunk, _, probes in packed(
            [_Copy(n, none, r.a0 - 1, _rounded(r.end - (r.a0 - 1))) for n, r in enumerate(block)]
        ):
            rows_clean.update({c.row: probes[m] for m, c in enumerate(chunk)})
        clean = torch.stack([rows_clean[n] for n in range(len(block))])  # (n, V) or (n,)

    # One copy per masked group: recompute from start = min(first masked, a0 - 1) to end - 1.
    starts = [(n, g, min(int(g[0]), r.a0 - 1)) for n, r in enumerate(block) for g in r.groups]
    copies = [_Copy(n, g, start, _rounded(block[n].end - start)) for n, g, start in starts]
    for chunk, n_of, masked in packed(copies):
        s_m = divergence(clean[n_of], masked, probe).float()
        for m, c in enumerate(chunk):
            scores[block[c.row].b, c.group] = s_m[m]


class _Copy(NamedTuple):
    """One masked copy of a block's row: the positions it masks and the stretch it recomputes."""

    row: int  # the row's index in its block
    group: torch.Tensor  # positions replaced by the pad token (empty: the clean copy)
    start: int  # first recomputed position
    length: int  # recomputed positions start .. end - 1, rounded up to a multiple of GRAIN


def _rounded(n: int) -> int:
    """n rounded up to a multiple of GRAIN."""
    return -(-n // GRAIN) * GRAIN


def _chunks(copies: list[_Copy], most: int):
    """Consecutive copies with the same padded length, at most `most` per chunk."""
    chunk = []
    for c in copies:
        if chunk and (len(chunk) == most or c.length != chunk[0].length):
            yield chunk
            chunk = []
        chunk.append(c)
    if chunk:
        yield chunk


def _arange_padded(lo: int, hi: int, k: int, device) -> torch.Tensor:
    """lo, lo+1, ..., hi-1, then repeats of hi-1 up to length k (padding the answer positions)."""
    return torch.arange(lo, lo + k, device=device).clamp(max=hi - 1)
