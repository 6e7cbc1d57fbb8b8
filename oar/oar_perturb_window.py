"""OAR-P with a local window: an approximate score whose cost grows linearly in the reasoning length.

Legend: B rollouts, L sequence positions, V vocabulary, W window, K answer-predicting positions of a
row (the longest of a block, shorter answers padded), N = W + 1 + K recomputed positions of one masked
copy, c copies of one row packed in one sequence, U such sequences in one forward, E the row's cut
(positions 0 .. E-1 are ever read; E = the last answer token; a block's rows are padded to its longest).

Exact OAR-P (oar/oar_perturb.py) masks token j and recomputes every position j .. E-1: sum_j (E - j)
~ R^2/2 token-forwards per rollout. The window mode recomputes only
    P_j = {j, ..., j + W}  U  {a0 - 1, ..., E - 1}      (the window and the answer-predicting positions)
and lets them attend, at every layer, to the CLEAN keys/values of every other position < E:
    s_j^W = D(P_clean, P_masked^W(j)),  D = KL(P_clean || .) or phi_clean - phi(.) as in maths §3.1.
Cost: R (W + 1 + K) positions per rollout instead of R^2/2, each attending to at most E + c N keys.
What it leaves out: the change that masking j makes to the keys/values of positions j+W+1 .. a0-2,
i.e. influence that travels through an intermediate token more than W positions later. The answer
positions still attend directly to the masked token at every layer. The mode is exact
  * when W reaches the answer (j + W >= a0 - 2 for every j: then P_j holds every position j .. E-1),
  * for a one-layer model whatever W (keys/values of layer 1 depend on one token each),
and tests/package/test_perturb_window.py pins both against `perturbation_scores_naive`.

How it runs, batched across rows (docs/long-reasoning.md): rows sorted by length form blocks whose clean keys/values
are
held at once, from one clean forward per block (or the caller's clean keys/values). A row's copies are
packed c at a time side by side in one sequence of c N new tokens after the row's clean cache, and U such
sequences, of any rows of the block, make one forward, under a custom 4D attention mask: copy m's slot for
position p attends to clean keys at positions q < p outside P_m, and to its own recomputed slots q <= p.
c is kept small (the copies' own slots at most a quarter of the cached keys, `packing`), since every copy
attends to every key of its sequence, the other copies' included, masked; U fills the forward's budget,
`max_chunk_tokens` (cached + recomputed) positions, chosen from the device when None (`lm.positions_that_fit`).
Slots of the window past the answer start, answer slots past a shorter answer, and the copies that fill a
row's last sequence are fillers (they attend to themselves only and nobody attends to them). The clean
outcome is the probe of a copy that masks nothing, computed in the same forwards (without the caller's).
Logits come from the model's own forward (`logits_to_keep` = the answer slots), so a family's logit scaling
or soft-cap is the model's own. The mask is boolean for `sdpa` and additive float (0 / dtype min) for
`eager`. The host reads the masks once per call and builds each block's tables once: nothing per copy.
Any budget gives the same scores to float rounding (tests/package/test_perturb_window.py).

Limits, checked: attention implementations other than sdpa/eager (flash kernels take no 4D mask)
and sliding-window attention shorter than the row (one 4D mask would override every layer's window)
are refused by `window_supported`; `oar_perturb.perturbation_scores` (the entry point, mode 'window'
or 'auto') then runs exact OAR-P and says so once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oar.lm import cache_kwargs, eval_mode, full_cache, on_device, position_ids, positions_that_fit, returned_cache
from oar.probes import check_probe, divergence, outcome


def window_supported(config, length: int) -> str | None:
    """None when the window mode computes what it claims on this model for rows of `length`
    positions; otherwise the reason it does not (the caller runs exact OAR-P instead)."""
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} takes no custom 4D mask (sdpa and eager do)"
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or []) or (
        window is not None and getattr(config, "use_sliding_window", True) and not hasattr(config, "layer_types")
    )
    if sliding and window is not None and window < length:
        return f"sliding-window attention ({window} positions) shorter than the row ({length})"
    return None


def row_extents(attention_mask: torch.Tensor, answer_mask: torch.Tensor) -> torch.Tensor:
    """(B,) each row's own length for `window_supported`: its first attended column through its last
    answer token (left padding, and whatever follows the answer, are not part of what it computes)."""
    width = attention_mask.shape[1]
    start = attention_mask.bool().float().argmax(1)
    last = torch.where(answer_mask.any(1), width - 1 - answer_mask.flip(1).float().argmax(1), start)
    return last - start + 1


@torch.no_grad()
def window_perturbation_scores(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    reasoning_mask: torch.Tensor,
    answer_mask: torch.Tensor,
    *,
    window: int,
    probe: str = "answer_mean",
    pad_token_id: int,
    max_chunk_tokens: int | None = None,
    clean: torch.Tensor | None = None,
    clean_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Window OAR-P scores (B, L) float32, 0 outside `reasoning_mask`. Inputs are (B, L).

    window: W >= 0, recomputed positions after the masked one. max_chunk_tokens: (cached + recomputed)
    positions per forward (at least one sequence of copies), which bounds the keys/values held and the
    (U, c N, E + c N) mask; None: chosen from the device. clean, clean_kv: as in
    `oar_perturb.perturbation_scores` (the update forward's clean outcome and keys/values, each
    (B, heads, >= E, head_dim)); without clean_kv a clean forward per block of rows runs here.
    """
    check_probe(probe)
    assert input_ids.shape == attention_mask.shape == reasoning_mask.shape == answer_mask.shape
    assert window >= 0 and (max_chunk_tokens is None or max_chunk_tokens >= 1), (window, max_chunk_tokens)
    assert clean_kv is None or clean is not None, "clean_kv needs the clean outcome too"
    extents = row_extents(attention_mask, answer_mask).tolist()
    for b in reasoning_mask.any(1).nonzero().flatten().tolist():
        if (reason := window_supported(model.config, extents[b])) is not None:
            raise ValueError(
                f"window OAR-P cannot run on this model: {reason}. Use perturb_mode exact (or auto, which falls back)."
            )
    scores = torch.zeros(input_ids.shape[0], input_ids.shape[1] + 1, dtype=torch.float32, device=input_ids.device)
    rows = sorted(_rows(reasoning_mask, answer_mask), key=lambda r: r.end, reverse=True)
    if rows:
        k = max(r.end - r.a0 + 1 for r in rows)
        budget = max_chunk_tokens or device_budget(model, input_ids.device, rows[0].end, k, window)
        with eval_mode(model):
            batch = _Batch(input_ids, attention_mask, answer_mask, window, probe, pad_token_id, clean, clean_kv)
            for block in _blocks(rows, budget):
                _score_block(model, block, batch, budget, scores)
    return scores[:, :-1].contiguous()  # the last column took the clean and filler copies' writes


@dataclass(frozen=True)
class _Row:
    """A row to score: its place in the batch, its answer, and the reasoning positions before its cut."""

    b: int  # row of the batch
    a0: int  # first answer token (>= 1: inputs a0-1 .. end-1 predict the answer tokens)
    end: int  # last answer token: the row's cut E
    js: list[int]  # reasoning positions < end, one copy each


def _rows(reasoning_mask: torch.Tensor, answer_mask: torch.Tensor) -> list[_Row]:
    """The rows with an answer and a reasoning token before their last answer token, read from the (B, L)
    masks in one pass to the host (a token at or after the last answer token cannot move the answer)."""
    answers, reasoning = {}, {}
    for table, mask in ((answers, answer_mask), (reasoning, reasoning_mask)):
        for b, j in mask.nonzero().tolist():  # ascending by row, then position
            table.setdefault(b, []).append(j)
    rows = [_Row(b, max(a[0], 1), a[-1], [j for j in reasoning.get(b, []) if j < a[-1]]) for b, a in answers.items()]
    return [r for r in rows if r.js]


def packing(end: int, answer_tokens: int, window: int, budget: int) -> tuple[int, int]:
    """(c, U) for rows cut at `end` with `answer_tokens` answer-predicting positions: c copies of a row share
    one sequence, their N = W + 1 + K slots each at most a quarter of its E cached keys (every copy attends to
    all c N slots, masked or not), and U sequences of E + c N positions fill a forward of `budget` positions
    (at least one)."""
    n = window + 1 + answer_tokens
    c = max(1, end // (4 * n))
    return c, max(1, budget // (end + c * n))


def device_budget(model, device, end: int, answer_tokens: int, window: int) -> int:
    """The (cached + recomputed) positions a forward holds on `device` (`lm.positions_that_fit`), for sequences
    of `packing`'s c copies after E = `end` cached keys: 8192 on a CPU, from the free memory on a GPU."""
    c, _ = packing(end, answer_tokens, window, 1)
    n = window + 1 + answer_tokens
    return positions_that_fit(model, device, per_copy=end + c * n, logit_columns=c * answer_tokens)


def _blocks(rows: list[_Row], budget: int):
    """Consecutive rows (sorted by cut, longest first) of nearly one length, whose clean keys/values take at most
    `budget` positions at the block's longest E (at least one row). A row joins while its E is at least 7/8 of
    the block's: every row of a block attends over the longest E (the rest masked), so rows of mixed lengths in
    one block would pay for the longest one's keys (5x at E = 201 beside 1,037, measured 0.65x before this rule)."""
    i = 0
    while i < len(rows):
        e, j = rows[i].end, i + 1
        while j < len(rows) and j - i < budget // e and 8 * rows[j].end >= 7 * e:
            j += 1
        yield rows[i:j]
        i = j


@dataclass(frozen=True)
class _Batch:
    """What every block of a window OAR-P call reads: the rows (B, L), the window, the probe, the clean pass."""

    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    answer_mask: torch.Tensor  # (B, L) bool
    window: int  # W
    probe: str
    pad: int  # the token a masked position is replaced by
    clean: torch.Tensor | None  # the caller's clean outcome, or None
    clean_kv: list[tuple[torch.Tensor, torch.Tensor]] | None  # and its keys/values, or None: a clean pass runs here


def _score_block(model, block: list[_Row], batch: _Batch, budget: int, scores: torch.Tensor) -> None:
    """Every copy of the block's rows, U sequences of c copies a forward; writes `scores` (B, L + 1)."""
    input_ids, attention_mask, answer_mask, window = (
        batch.input_ids,
        batch.attention_mask,
        batch.answer_mask,
        batch.window,
    )
    probe, pad, clean, clean_kv = batch.probe, batch.pad, batch.clean, batch.clean_kv
    dev = input_ids.device
    e = block[0].end  # the block's cut: its rows' keys/values are padded to it (and masked)
    k = max(r.end - r.a0 + 1 for r in block)
    c, u = packing(e, k, window, budget)
    b_of, a0_of, end_of = on_device(dev, [[r.b, r.a0, r.end] for r in block]).unbind(1)  # (R,) each
    ids, mask = input_ids[b_of, : e + 1], attention_mask[b_of, :e]  # (R, E + 1), (R, E)
    pos = position_ids(attention_mask[b_of])[:, :e]
    answer_at = a0_of[:, None] + torch.arange(k, device=dev)[None]  # (R, K): tokens a0 .. a0+K-1, past E for some
    targets = ids.gather(1, answer_at.clamp(max=e))
    valid = answer_mask[b_of[:, None], answer_at.clamp(max=e)] & (answer_at <= end_of[:, None])

    if clean_kv is not None:  # the update forward's: each row's keys/values and clean outcome
        kv = [(key[b_of, :, :e], value[b_of, :, :e]) for key, value in clean_kv]
        clean_of = clean[b_of]
    else:  # one forward over the block's rows; causal, so a row's positions before its cut ignore what follows
        out = model(
            input_ids=ids[:, :e],
            attention_mask=mask,
            position_ids=pos,
            **cache_kwargs(full_cache()),
            use_cache=True,
            logits_to_keep=1,
        )
        kv = [(layer.keys, layer.values) for layer in returned_cache(out).layers]  # (R, heads, E, d)
        clean_of = None  # the probe of each row's first copy, which masks nothing (CLEAN)

    # The block's copies, c to a sequence, each sequence one row's: a masked position, CLEAN or FILLER.
    seqs, firsts = [], []
    for i, r in enumerate(block):
        js = ([CLEAN] if clean_kv is None else []) + r.js
        firsts.append(len(seqs))
        seqs += [(i, js[s : s + c] + [FILLER] * (c - len(js[s : s + c]))) for s in range(0, len(js), c)]
    table = on_device(dev, [[i, *js] for i, js in seqs])  # (S, 1 + c): the row, then the copies' masked positions
    # where each copy's score goes: (batch row, position), and the spare last column for CLEAN and FILLER
    to = on_device(dev, [[[block[i].b, j] if j >= 0 else [0, scores.shape[1] - 1] for j in js] for i, js in seqs])
    for s0 in range(0, len(seqs), u):
        s1 = min(s0 + u, len(seqs))
        row, js = table[s0:s1, 0], table[s0:s1, 1:]  # (U,), (U, c)
        logits = _forward(model, kv, row, js, ids, mask, pos, a0_of, end_of, window, k, pad)  # (U c, K, V)
        probes = outcome(logits, targets[row].repeat_interleave(c, 0), valid[row].repeat_interleave(c, 0), probe)
        probes = probes.view(s1 - s0, c, *probes.shape[1:])  # (U, c, V) or (U, c)
        if clean_kv is None:  # rows whose first sequence is here: their clean probe, read before their copies'
            new = [(s - s0, i) for i, s in enumerate(firsts) if s0 <= s < s1]
            at, rows = on_device(dev, [x for x, _ in new]), on_device(dev, [i for _, i in new])
            clean_of = probes.new_zeros((len(block), *probes.shape[2:])) if clean_of is None else clean_of
            clean_of[rows] = probes[at, 0]
        reference = clean_of[row][:, None].expand_as(probes)
        scores[to[s0:s1, :, 0], to[s0:s1, :, 1]] = divergence(reference, probes, probe).float()


CLEAN, FILLER = -1, -2  # what a copy masks when it masks nothing: the clean probe, or a filler copy


def _forward(model, kv, row, js, ids, mask, pos, a0_of, end_of, window: int, k: int, pad: int) -> torch.Tensor:
    """Logits (U c, K, V) at the answer slots of U sequences of c copies each: sequence u holds copies of the
    block's row row[u], masking js[u] (U, c) each (CLEAN: nothing; FILLER: a copy nobody reads). Each copy
    recomputes its N = W + 1 + K slots on the row's clean keys/values (kv: per layer (R, heads, E, d))."""
    dev, (nu, c), e = js.device, js.shape, mask.shape[1]
    n = window + 1 + k
    a0, end, j = a0_of[row][:, None, None], end_of[row][:, None, None], js[..., None]  # (U, 1, 1), (U, c, 1)
    # Slot positions of each copy: window j .. j+W (fillers where it reaches the answer slots, and for CLEAN
    # and FILLER copies), then the answer-predicting positions a0-1 .. E-1 (fillers past a shorter answer).
    win = j + torch.arange(window + 1, device=dev)  # (U, c, W+1)
    answer = (a0 - 1 + torch.arange(k, device=dev)).expand(nu, c, k)  # (U, c, K)
    filler = torch.cat([(win >= a0 - 1) | (j < 0), (answer > end - 1) | (j == FILLER)], 2)  # (U, c, N)
    slot = torch.minimum(torch.cat([win, answer], 2), end - 1).clamp(min=0)  # (U, c, N) sequence index
    flat = slot.reshape(nu, c * n)
    # A masked token at or after a0-1 lies in the answer slots already: its window is all filler.
    q_ids = torch.where(filler | (slot == j), pad, ids[row].gather(1, flat).view(nu, c, n))
    row_mask = mask[row].bool()  # (U, E)
    recomputed = torch.zeros(nu, c, e + 1, dtype=torch.bool, device=dev)  # column E: where fillers point
    recomputed.scatter_(2, slot.masked_fill(filler, e), True)
    # Keys from the clean cache: real tokens before the query's position that this copy does not recompute.
    to_cache = (
        row_mask[:, None, None, :] & ~recomputed[:, :, None, :e] & (torch.arange(e, device=dev) < slot[..., None])
    )  # (U, c, N, E)
    # Keys among the copy's own slots: causal by position, never a filler; a filler sees itself alone.
    real_key = ~filler & row_mask.gather(1, flat).view(nu, c, n)
    own = (slot[:, :, None, :] <= slot[:, :, :, None]) & real_key[:, :, None, :]
    own = own | (filler[..., None] & torch.eye(n, dtype=torch.bool, device=dev))  # (U, c, N, N)
    to_new = own[:, :, :, None, :] & torch.eye(c, dtype=torch.bool, device=dev)[None, :, None, :, None]
    allowed = torch.cat([to_cache.reshape(nu, c * n, e), to_new.reshape(nu, c * n, c * n)], 2)
    cache = full_cache([(key[row], value[row]) for key, value in kv])  # the rows' clean keys/values, in full
    keep = (torch.arange(c, device=dev)[:, None] * n + window + 1 + torch.arange(k, device=dev)[None]).flatten()
    logits = model(
        input_ids=q_ids.reshape(nu, c * n),
        attention_mask=_attention_bias(allowed, model, kv[0][0].dtype)[:, None],
        position_ids=pos[row].gather(1, flat),
        **cache_kwargs(cache),
        use_cache=True,
        logits_to_keep=keep,
    ).logits  # (U, c K, V)
    return logits.reshape(nu * c, k, -1)


def _attention_bias(allowed: torch.Tensor, model, dtype) -> torch.Tensor:
    """The 4D mask as each attention implementation takes it: sdpa a boolean (True = attend; no
    dtype to match the queries', which autocast may change), eager an additive float (0 / min)."""
    if model.config._attn_implementation == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )
    return allowed
