"""OAR-P with a local window: an approximate score whose cost grows linearly in the reasoning length.

Legend: B rollouts, L sequence positions, V vocabulary, W window, K answer-predicting positions of a
row, N = W + 1 + K recomputed positions of one masked copy, c copies packed in one forward, E the
row's cut (positions 0 .. E-1 are ever read; E = the last answer token).

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
and tests/test_perturb_window.py pins both against `perturbation_scores_naive`.

How it runs: one clean forward per row (or the caller's clean keys/values), then the row's copies are
packed side by side in one sequence of c N new tokens after that clean cache, with a custom 4D
attention mask: copy m's slot for position p attends to clean keys at positions q < p outside P_m,
and to its own recomputed slots q <= p. Slots of the window past the answer start are fillers (they
attend to themselves only and nobody attends to them). Logits come from the model's own forward
(`logits_to_keep` = the answer slots), so a family's logit scaling or soft-cap is the model's own.
The mask is boolean for `sdpa` and additive float (0 / dtype min) for `eager`.

Limits, checked: attention implementations other than sdpa/eager (flash kernels take no 4D mask)
and sliding-window attention shorter than the row (one 4D mask would override every layer's window)
are refused by `window_supported`; `oar_perturb.perturbation_scores` (the entry point, mode 'window'
or 'auto') then runs exact OAR-P and says so once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oar.lm import cache_kwargs, eval_mode, full_cache, position_ids, returned_cache
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
    max_chunk_tokens: int = 2048,
    clean: torch.Tensor | None = None,
    clean_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Window OAR-P scores (B, L) float32, 0 outside `reasoning_mask`. Inputs are (B, L).

    window: W >= 0, recomputed positions after the masked one. max_chunk_tokens: packed recomputed
    positions per forward (at least one copy), which bounds the (c N, E + c N) mask. clean, clean_kv:
    as in `oar_perturb.perturbation_scores` (the update forward's clean outcome and keys/values,
    each (B, heads, >= E, head_dim)); without clean_kv a clean forward per row runs here.
    """
    check_probe(probe)
    assert input_ids.shape == attention_mask.shape == reasoning_mask.shape == answer_mask.shape
    assert window >= 0 and max_chunk_tokens >= 1, (window, max_chunk_tokens)
    assert clean_kv is None or clean is not None, "clean_kv needs the clean outcome too"
    extents = row_extents(attention_mask, answer_mask)
    for b in reasoning_mask.any(1).nonzero().flatten().tolist():
        if (reason := window_supported(model.config, int(extents[b]))) is not None:
            raise ValueError(
                f"window OAR-P cannot run on this model: {reason}. Use perturb_mode exact (or auto, which falls back)."
            )
    scores = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    pos_all = position_ids(attention_mask)
    with eval_mode(model):
        for b in range(input_ids.shape[0]):
            answer = answer_mask[b].nonzero().flatten()
            if answer.numel() == 0:
                continue
            a0, end = max(int(answer[0]), 1), int(answer[-1])  # inputs a0-1 .. end-1 predict the answer tokens
            js = reasoning_mask[b].nonzero().flatten()
            js = js[js < end]  # a token at or after `end` cannot move the answer
            if js.numel():
                kv = (
                    None if clean_kv is None else [(k[b : b + 1, :, :end], v[b : b + 1, :, :end]) for k, v in clean_kv]
                )
                c_out = None if clean_kv is None else clean[b : b + 1]
                row = _CutRow(
                    input_ids[b, :end],
                    attention_mask[b, :end],
                    pos_all[b, :end],
                    input_ids[b, a0 : end + 1],
                    answer_mask[b, a0 : end + 1],
                    a0,
                    c_out,
                    kv,
                )
                scores[b, js] = _score_row(model, row, js, window, probe, pad_token_id, max_chunk_tokens)
    return scores


@dataclass(frozen=True)
class _CutRow:
    """One row cut to E positions (0 .. E-1, E = its last answer token), and its clean pass if given."""

    ids: torch.Tensor  # (E,)
    mask: torch.Tensor  # (E,) attention mask
    pos: torch.Tensor  # (E,) position ids
    targets: torch.Tensor  # (K,) the answer tokens a0 .. E
    valid: torch.Tensor  # (K,) bool: which of them are answer tokens
    a0: int  # first answer token (>= 1)
    clean: torch.Tensor | None  # (1, V) or (1,): the clean outcome, with kv; None: a clean pass runs here
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None  # per layer (1, heads, E, d)


def copies_per_forward(window: int, answer_tokens: int, budget: int) -> int:
    """Masked copies packed into one forward: each recomputes W + 1 window slots and the K answer-predicting
    ones, and a forward holds at most `budget` recomputed positions (at least one copy)."""
    return max(1, budget // (window + 1 + answer_tokens))


def _score_row(model, row: _CutRow, js: torch.Tensor, window: int, probe: str, pad: int, budget: int) -> torch.Tensor:
    """Scores (n_js,) of masking each of the row's positions `js` in turn, W = `window`, at most
    `budget` recomputed positions per forward; `pad` replaces the masked token."""
    ids, mask, pos, targets, valid, a0, clean, kv = (
        row.ids,
        row.mask,
        row.pos,
        row.targets,
        row.valid,
        row.a0,
        row.clean,
        row.kv,
    )
    dev, end, k = ids.device, ids.shape[0], targets.shape[0]
    answer_slots = torch.arange(a0 - 1, end, device=dev)  # (K,)
    if kv is None:  # the clean pass: keys/values of positions 0 .. E-1 and the clean outcome
        out = model(
            input_ids=ids[None],
            attention_mask=mask[None],
            position_ids=pos[None],
            use_cache=True,
            logits_to_keep=answer_slots,
        )
        clean = outcome(out.logits, targets[None], valid[None], probe)
        kv = [(layer.keys, layer.values) for layer in returned_cache(out).layers]  # (1, heads, E, d)
    n = window + 1 + k
    per = copies_per_forward(window, k, budget)
    result = []
    for part in js.split(per):
        c = part.shape[0]
        # Slot positions of each copy: window j .. j+W (fillers where it reaches the answer slots or
        # the cut), then the answer-predicting positions a0-1 .. E-1.
        win = part[:, None] + torch.arange(window + 1, device=dev)[None]  # (c, W+1)
        filler = torch.cat([win >= a0 - 1, torch.zeros(c, k, dtype=torch.bool, device=dev)], 1)  # (c, N)
        # A masked token at or after a0-1 lies in the answer slots already: its window is all filler.
        slot_pos = torch.cat([win, answer_slots[None].expand(c, k)], 1).clamp(max=end - 1)  # (c, N) sequence index
        q_ids = torch.where(filler, pad, ids[slot_pos])
        q_ids[slot_pos == part[:, None]] = pad  # the masked token (in the window, or among the answer slots)
        recomputed = torch.zeros(c, end + 1, dtype=torch.bool, device=dev)  # column E: where fillers point
        recomputed.scatter_(1, slot_pos.masked_fill(filler, end), True)
        recomputed = recomputed[:, :end]  # (c, E)
        # Keys from the clean cache: real tokens before the query's position that this copy does not recompute.
        to_cache = (
            mask.bool()[None, None]
            & ~recomputed[:, None]
            & (torch.arange(end, device=dev)[None, None] < slot_pos[:, :, None])
        )  # (c, N, E)
        # Keys among the copy's own slots: causal by position, never a filler; a filler sees itself.
        own = (slot_pos[:, None, :] <= slot_pos[:, :, None]) & ~filler[:, None, :] & mask.bool()[slot_pos][:, None, :]
        own = own | (filler[:, :, None] & torch.eye(n, dtype=torch.bool, device=dev)[None])  # (c, N, N)
        to_new = torch.zeros(c, n, c, n, dtype=torch.bool, device=dev)
        to_new[torch.arange(c), :, torch.arange(c)] = own
        allowed = torch.cat([to_cache.reshape(c * n, end), to_new.reshape(c * n, c * n)], 1)
        bias = _attention_bias(allowed, model, kv[0][0].dtype)
        cache = full_cache(kv)  # the clean keys/values of positions 0 .. E-1, every layer in full
        keep = (torch.arange(c, device=dev)[:, None] * n + window + 1 + torch.arange(k, device=dev)[None]).flatten()
        logits = model(
            input_ids=q_ids.reshape(1, -1),
            attention_mask=bias[None, None],
            position_ids=pos[slot_pos].reshape(1, -1),
            **cache_kwargs(cache),
            use_cache=True,
            logits_to_keep=keep,
        ).logits  # (1, c K, V)
        masked = outcome(logits.view(c, k, -1), targets[None].expand(c, k), valid[None].expand(c, k), probe)
        result.append(divergence(clean.expand(c, *clean.shape[1:]), masked, probe).float())
    return torch.cat(result)


def _attention_bias(allowed: torch.Tensor, model, dtype) -> torch.Tensor:
    """The 4D mask as each attention implementation takes it: sdpa a boolean (True = attend; no
    dtype to match the queries', which autocast may change), eager an additive float (0 / min)."""
    if model.config._attn_implementation == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )
    return allowed
