"""OAR-P: token importance by counterfactual perturbation (maths §3).

For each reasoning position j of rollout i, replace token j by the pad token (attention unchanged),
recompute the outcome probe, and score
    s_j = KL(P_clean || P_masked(j))        for `last` / `answer_mean`
    s_j = phi_clean - phi_masked(j)         for `answer_joint`.

`perturbation_scores_naive` is that definition verbatim: one forward over the whole sequence per
masked copy, with the rollout's answer in every copy (the authors' released code runs it that way
for the last-token probe only: its copies omit the answer, so its answer-span probes read positions
no answer conditions; docs/differences.md). `perturbation_scores` is the one entry point, training's
included, and gives the same numbers (to float tolerance; tests pin them) at a fraction of the cost:
its exact mode (oar/oar_perturb_exact.py) recomputes a masked copy only from the masked token on,
on the clean pass's keys/values, and packs the copies of many rollouts into shared forwards; its
window mode (oar/oar_perturb_window.py) is an approximation linear in the reasoning length.
Rows with no answer token or no reasoning token score 0 everywhere.
tests/package/test_families.py pins fast == naive on 15 families, sliding windows shorter than the sequence.
"""

from __future__ import annotations

import torch

from oar.lm import forward_logits
from oar.oar_perturb_exact import exact_perturbation_scores
from oar.oar_perturb_window import row_extents, window_perturbation_scores, window_supported
from oar.probes import check_probe, divergence, outcome_from_logits


MODES = ("exact", "window", "auto")  # perturbation_scores(mode=...)


@torch.no_grad()
def perturbation_scores(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    reasoning_mask: torch.Tensor,
    answer_mask: torch.Tensor,
    *,
    probe: str = "answer_mean",
    pad_token_id: int,
    max_chunk_tokens: int | None = None,
    span: int = 1,
    clean: torch.Tensor | None = None,
    clean_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    mode: str = "exact",
    window: int = 32,
    auto_length: int = 512,
) -> torch.Tensor:
    """OAR-P scores (B, L) float32, 0 outside `reasoning_mask`. Inputs are (B, L); the one entry point
    of OAR-P, training's included (oar/credit_methods.py), whatever the mode:

      exact   oar/oar_perturb_exact.py's computation (exact for span=1; `span` > 1 masks that many tokens at
              once, an approximation: span-fold fewer copies; this mode only)
      window  oar/oar_perturb_window.py's approximation, W = `window` recomputed positions after the
              masked one (linear in the reasoning length)
      auto    exact for a row whose scored stretch (first reasoning token to last answer token) is
              shorter than `auto_length` positions, window for longer rows. Rows are scored
              independently, so splitting a batch by mode gives each row the number its mode defines.
    The window mode falls back to exact, saying so once, on models where it is not supported
    (`oar_perturb_window.window_supported`).

    max_chunk_tokens: (cached + recomputed) positions of masked copies per forward, a memory bound that changes
    the scores by float rounding only; None (the default): chosen from the device (`lm.positions_that_fit`:
    8192 on a CPU, from the free memory on a GPU).

    clean, clean_kv: optionally the clean outcome (as `probes.outcome` returns it) and the keys/values
    (per layer, each (B, heads, >= L', head_dim)) of a clean forward over these rows, as
    `probes.clean_forward` gives them from the update's own forward: then no clean pass runs here
    (without clean_kv, `clean` is not used: the clean pass gives both).
    """
    assert mode in MODES, f"perturb mode must be one of {MODES}, got {mode!r}"
    assert clean_kv is None or clean is not None, "clean_kv needs the clean outcome too"
    check_probe(probe)
    assert input_ids.shape == attention_mask.shape == reasoning_mask.shape == answer_mask.shape
    assert span >= 1 and (max_chunk_tokens is None or max_chunk_tokens >= 1), (span, max_chunk_tokens)
    # span > 1 is the exact mode's approximation; a window row masks one token, and would ignore it silently
    assert span == 1 or mode == "exact", f"span={span} needs mode='exact' (the window mode masks one token at a time)"
    exact = lambda reasoning: exact_perturbation_scores(
        model,
        input_ids,
        attention_mask,
        reasoning,
        answer_mask,
        probe=probe,
        pad_token_id=pad_token_id,
        max_chunk_tokens=max_chunk_tokens,
        span=span,
        clean=clean,
        clean_kv=clean_kv,
    )
    if mode == "exact":
        return exact(reasoning_mask)
    first = torch.where(reasoning_mask.any(1), reasoning_mask.float().argmax(1), input_ids.shape[1])  # (B,)
    last = torch.where(answer_mask.any(1), input_ids.shape[1] - 1 - answer_mask.flip(1).float().argmax(1), -1)  # (B,)
    long = (last - first >= auto_length) if mode == "auto" else torch.ones_like(first, dtype=torch.bool)  # (B,)
    # Whether the window mode computes what it claims for each row, by the row's own extent (a sliding
    # window can cover one row and not a longer batch-mate: a row's mode must not depend on its batch)
    reasons = [window_supported(model.config, int(e)) for e in row_extents(attention_mask, answer_mask).tolist()]
    unfit = torch.tensor([r is not None for r in reasons], device=input_ids.device)
    if (long & unfit & reasoning_mask.any(1)).any():
        reason = next(r for r, u, g in zip(reasons, unfit.tolist(), long.tolist()) if u and g)
        _say_once(f"OAR-P window mode unavailable ({reason}): exact OAR-P scores such rollouts instead")
    long = long & ~unfit
    if not (reasoning_mask & long[:, None]).any():
        return exact(reasoning_mask)
    scores = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    for use_window, rows in ((True, long), (False, ~long)):
        if not (reasoning_mask & rows[:, None]).any():
            continue
        if use_window and mode == "auto":
            _say_once(
                f"OAR-P: rows with >= {auto_length} positions from reasoning to answer use the window mode "
                f"(W={window})"
            )
        reas = reasoning_mask & rows[:, None]
        if use_window:
            scores += window_perturbation_scores(
                model,
                input_ids,
                attention_mask,
                reas,
                answer_mask,
                window=window,
                probe=probe,
                pad_token_id=pad_token_id,
                max_chunk_tokens=max_chunk_tokens,
                clean=clean,
                clean_kv=clean_kv,
            )
        else:
            scores += exact(reas)
    return scores


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    """Log a mode decision once per process (a run makes it on every micro-batch)."""
    if message not in _SAID:
        _SAID.add(message)
        print(f"[oar] {message}", flush=True)


@torch.no_grad()
def perturbation_scores_naive(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    reasoning_mask: torch.Tensor,
    answer_mask: torch.Tensor,
    *,
    probe: str = "answer_mean",
    pad_token_id: int,
    chunk_size: int = 16,
) -> torch.Tensor:
    """The definition, for tests and benchmarks: a full-length forward per masked copy, `chunk_size`
    copies per batch, with the vocabulary's logits only where the probe reads them (from the position
    before the first answer token: a benchmark's naive side does no work the definition does not need).
    Same shapes and result as `perturbation_scores`."""
    check_probe(probe)
    scores = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    for b in range(input_ids.shape[0]):
        if not answer_mask[b].any():
            continue
        row = slice(b, b + 1)
        keep = input_ids.shape[1] - int(answer_mask[b].nonzero().min()) + 1  # positions first answer - 1 .. L - 1

        def outcome_of(ids, n):  # the probe of n copies of row b whose ids are `ids`
            logits = forward_logits(model, ids, attention_mask[row].expand(n, -1), logits_to_keep=keep)
            return outcome_from_logits(logits, ids[:, -keep:], answer_mask[row, -keep:].expand(n, -1), probe)

        clean = outcome_of(input_ids[row], 1)
        for js in reasoning_mask[b].nonzero().flatten().split(chunk_size):
            if not (n := len(js)):  # a row without reasoning tokens: its clean forward only
                continue
            ids = input_ids[row].repeat(n, 1)
            ids[torch.arange(n), js] = pad_token_id
            scores[b, js] = divergence(clean, outcome_of(ids, n), probe).float()
    return scores
