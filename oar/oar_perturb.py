"""OAR-P: token importance by counterfactual perturbation (SPEC §3).

Legend: B rollouts, L sequence positions, V vocabulary, c masked copies in one chunk.

For each reasoning position j of rollout i, replace token j by the pad token (attention unchanged),
recompute the outcome probe, and score
    s_j = KL(P_clean || P_masked(j))        for `last` / `answer_mean`
    s_j = phi_clean - phi_masked(j)         for `answer_joint`.

`perturbation_scores_naive` is that definition verbatim: one forward over the whole sequence per
masked copy, as the authors' released code runs it. `perturbation_scores` gives the same numbers
(to float tolerance; a test pins them) at a fraction of the cost, because masking token j cannot
change anything before j:
  * the keys/values of positions < j are the clean pass's: each chunk of masked copies starts from
    the clean KV cache cropped at its first masked position, so the prompt is never recomputed;
  * nothing after the last answer token matters: the sequence is cut there;
  * only answer positions need logits (`logits_to_keep`), not L x V of them;
  * copies run in chunks of at most `max_chunk_tokens` recomputed tokens, which bounds memory.
`span > 1` is an approximate mode: mask `span` consecutive reasoning tokens at once and give each
of them the span's score (span-fold fewer copies; its error is reported by scripts/bench.py).
Rows with no answer token or no reasoning token score 0 everywhere.
"""

from __future__ import annotations

import torch

from oar.models import forward_logits, position_ids
from oar.probes import answer_positions, check_probe, divergence, outcome, outcome_from_logits


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
    max_chunk_tokens: int = 8192,
    span: int = 1,
) -> torch.Tensor:
    """OAR-P scores (B, L) float32, 0 outside `reasoning_mask`. Inputs are (B, L); exact for span=1."""
    check_probe(probe)
    assert input_ids.shape == attention_mask.shape == reasoning_mask.shape == answer_mask.shape
    assert span >= 1
    scores = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    for b in range(input_ids.shape[0]):
        answer = answer_mask[b].nonzero().flatten()
        reasoning = reasoning_mask[b].nonzero().flatten()
        if answer.numel() == 0:
            continue
        a0, end = int(answer[0]), int(answer[-1])  # inputs 0 .. end-1 predict answer tokens a0 .. end
        reasoning = reasoning[reasoning < end]  # a token at or after `end` cannot move the answer
        if reasoning.numel() == 0:
            continue
        keep = end - a0 + 1  # logits at a0-1 .. end-1
        ids, mask = input_ids[b : b + 1, :end], attention_mask[b : b + 1, :end]
        pos = position_ids(mask)
        targets = input_ids[b : b + 1, a0 : end + 1]
        valid = answer_mask[b : b + 1, a0 : end + 1]

        clean_out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=keep)
        clean = outcome(clean_out.logits, targets, valid, probe)
        clean_kv = _kv_tensors(clean_out.past_key_values)

        groups = reasoning.split(span)  # each group of positions is masked together
        g = 0
        while g < len(groups):
            start = int(groups[g][0])
            c = max(1, max_chunk_tokens // (end - start))
            chunk = groups[g : g + c]
            seg = ids[:, start:].repeat(len(chunk), 1)  # (c, end - start)
            for m, group in enumerate(chunk):
                seg[m, group - start] = pad_token_id
            cache = _cropped_cache(clean_kv, start, len(chunk))
            logits = model(
                input_ids=seg,
                attention_mask=mask.expand(len(chunk), -1),
                position_ids=pos[:, start:].expand(len(chunk), -1),
                past_key_values=cache,
                use_cache=cache is not None,
                logits_to_keep=keep,
            ).logits
            s = divergence(clean, outcome(logits, targets.expand(len(chunk), -1), valid.expand(len(chunk), -1), probe), probe)
            for m, group in enumerate(chunk):
                scores[b, group] = s[m].float()
            g += len(chunk)
    return scores


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
    """The definition, for tests and benchmarks: a full-length forward (all L x V logits) per
    masked copy, `chunk_size` copies per batch. Same shapes and result as `perturbation_scores`."""
    check_probe(probe)
    scores = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    for b in range(input_ids.shape[0]):
        if not answer_mask[b].any():
            continue
        row = slice(b, b + 1)
        clean = outcome_from_logits(forward_logits(model, input_ids[row], attention_mask[row]), input_ids[row], answer_mask[row], probe)
        for js in reasoning_mask[b].nonzero().flatten().split(chunk_size):
            n = len(js)
            ids = input_ids[row].repeat(n, 1)
            ids[torch.arange(n), js] = pad_token_id
            logits = forward_logits(model, ids, attention_mask[row].expand(n, -1))
            masked = outcome_from_logits(logits, ids, answer_mask[row].expand(n, -1), probe)
            scores[b, js] = divergence(clean, masked, probe).float()
    return scores


def _kv_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each (1, heads, positions, head_dim), from a transformers cache."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def _cropped_cache(kv: list[tuple[torch.Tensor, torch.Tensor]], length: int, copies: int):
    """A fresh DynamicCache holding the first `length` positions of `kv`, repeated `copies` times."""
    if length == 0:
        return None
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k[:, :, :length].expand(copies, -1, -1, -1), v[:, :, :length].expand(copies, -1, -1, -1), i)
    return cache
