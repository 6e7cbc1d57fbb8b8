"""The update forward read through the model's own output head in chunks (train.py step 5a): token log-probs
with their graph, entropies, the logits at a few positions, and every logit on demand, without the (b, T, V)
logits and their gradient held whole.

Legend: b rows, L positions, C = T + 1 columns read (from the prompt's last column Lp - 1: column c predicts
completion token c), H hidden width, V vocabulary, K answer positions.

Why: at a large vocabulary the update's logits are the largest tensors of a step: Qwen2.5's 151,936 logits a
token, 8 rollouts x 1,024 tokens, are 1.2 G values, 5 GB in float32, and their gradient as much again. Here
the forward keeps the final hidden states (b, C, H) instead (the model's own forward, its head run on one
column only), and the head runs on chunks of at most HEAD_CHUNK_ELEMENTS logits: each chunk's logits are
made, read (log-probs and entropies) and dropped. The backward makes each chunk's logits again
(activation checkpointing of the head alone, torch.utils.checkpoint) and turns their gradient into the
hidden states' and the head's; so a step holds one chunk of logits at a time, and its peak no longer grows
with b x T x V. Cost: the head's product runs once more per token (forward, again in the backward, and its
two gradient products: 4 instead of 3), except where one chunk holds the whole micro-batch (then it is kept
for the backward, as the full logits were: within the bound, at no extra cost).

Exactness. The head is the model's own output embeddings followed by the logit transform its forward applies
and its config names (`output_head`): Gemma 2/3's final soft-cap (z / c, tanh, x c), Granite's
logits_scaling (z / s), Cohere's logit_scale (z x s); nothing for the other families of
tests/families.py. `reproduces` checks, once per run and on a short input, that it gives model(...).logits
(the same floats, up to the rounding of a product over fewer rows); where it does not (a family whose
forward changes its logits some other way) train.py reads the model's own logits as before (`Forward` with
no head) and says so once. The log-probs, entropies and outcome are then today's functions
(oar.grpo.token_logprobs, token_entropy, oar.probes.outcome) on the same logits, so the loss and its
gradient equal the full-logits path's to float rounding (tests/package/test_head.py, on every family). When one
chunk holds the whole micro-batch (a small vocabulary: tiny-arith), the head's product is the one the
model's own forward computes, over the same (b, C) columns.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

from oar.grpo import token_entropy, token_logprobs
from oar.lm import cache_kwargs, eval_mode, full_cache, position_ids, returned_cache
from oar.probes import MIN_ROWS, answer_positions, outcome

HEAD_CHUNK_ELEMENTS = 2**24  # logits made at once: 64 MB in float32, as oar.grpo.CHUNK_ELEMENTS


class Head:
    """The model's head as a function of its final hidden states: (..., H) -> logits (..., V) (module docstring)."""

    def __init__(self, model):
        self.embeddings = model.get_output_embeddings()
        config = model.config
        self.vocab = int(self.embeddings.weight.shape[0])
        self.softcap = getattr(config, "final_logit_softcapping", None)  # Gemma 2, Gemma 3
        self.divide = getattr(config, "logits_scaling", None)  # Granite
        self.multiply = getattr(config, "logit_scale", None)  # Cohere

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embeddings.weight
        if not torch.is_autocast_enabled(hidden.device.type) and hidden.dtype != weight.dtype:
            # a forward whose outputs were cast up (accelerate's float32 outputs, FSDP2's bf16 shards): back to
            # the dtype the model's own head read them in, exactly (a float32 copy of bf16 values)
            hidden = hidden.to(weight.dtype)
        z = self.embeddings(hidden)
        if self.softcap is not None:  # the same three operations, in the same order, as the models' forward
            z = z / self.softcap
            z = torch.tanh(z)
            z = z * self.softcap
        if self.divide is not None:
            z = z / self.divide
        if self.multiply is not None:
            z = z * self.multiply
        return z


def hidden_forward(model, base, input_ids, attention_mask, *, columns: int, keep_cache: bool = False):
    """The update forward (with its graph) of `model` (the one to call: DDP-wrapped, sharded or plain) whose
    decoder is `base` (the unwrapped model's `base_model`): (B, L) inputs -> (final hidden states of the last
    `columns` columns (B, C, H), kv as probes.clean_forward returns it). The model's head runs on its last
    column only (`logits_to_keep=1`); the hidden states are read where the head reads them, at the decoder's
    output, by a hook that lives for this call."""
    seen = {}
    hook = base.register_forward_hook(lambda module, args, out: seen.__setitem__("hidden", out[0]))
    try:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids(attention_mask),
            **cache_kwargs(full_cache() if keep_cache else None),
            use_cache=keep_cache,
            logits_to_keep=1,
        )
    finally:
        hook.remove()
    cache = returned_cache(out) if keep_cache else None
    kv = [(layer.keys.detach(), layer.values.detach()) for layer in cache.layers] if cache is not None else None
    return seen["hidden"][:, -columns:], kv


def _chunks(b: int, c: int, v: int) -> list[tuple[slice, list[slice]]]:
    """Row blocks, each with its column slices, covering (b, c) positions with at most HEAD_CHUNK_ELEMENTS
    logits a chunk: whole rows while they fit (then one chunk per block), else columns of one row."""
    rows = max(1, min(b, HEAD_CHUNK_ELEMENTS // max(1, c * v)))
    cols = c if c * v <= HEAD_CHUNK_ELEMENTS else max(1, HEAD_CHUNK_ELEMENTS // max(1, v))
    return [(slice(i, i + rows), [slice(j, j + cols) for j in range(0, c, cols)]) for i in range(0, b, rows)]


def head_logprobs(head: Head, hidden: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, autocast=None):
    """(log softmax(head(hidden) / temperature)[labels] (b, T) float32 with the graph, the entropy of
    softmax(head(hidden)) (b, T) float32, detached) from hidden states (b, T + 1, H), whose column t predicts
    labels[:, t]; the last column predicts nothing. In chunks, each chunk's logits made again in the backward
    (module docstring). The last column goes through the head too, with a label read and dropped, so that one
    chunk's product is the model's own over the same columns."""
    b, c, _ = hidden.shape
    assert labels.shape == (b, c - 1), (labels.shape, hidden.shape)
    labels = torch.nn.functional.pad(labels, (0, 1))  # (b, C) column C - 1's label: any, dropped
    entropy = torch.empty(b, c, dtype=torch.float32, device=hidden.device)
    made: set[tuple[int, int]] = set()  # chunks whose entropy is written: not again when the backward remakes them
    chunks = _chunks(b, c, head.vocab)
    # Made again in the backward only when there are several: one chunk of logits kept for the backward is
    # within the bound whatever the micro-batch (and costs no second product: a small vocabulary's case)
    again = torch.is_grad_enabled() and hidden.requires_grad and (len(chunks) > 1 or len(chunks[0][1]) > 1)
    blocks = []
    with autocast() if autocast is not None else nullcontext():
        for r, columns in chunks:
            parts = []
            for cols in columns:

                def piece(h, lab, r=r, cols=cols):
                    z = head(h)  # (r, c', V)
                    if (r.start, cols.start) not in made:
                        made.add((r.start, cols.start))
                        entropy[r, cols] = token_entropy(z.detach())
                    return token_logprobs(z, lab, temperature=temperature)

                h, lab = hidden[r, cols], labels[r, cols]
                if again:  # nothing of the chunk is kept but its inputs: the backward makes its logits again
                    parts.append(checkpoint(piece, h, lab, use_reentrant=False, preserve_rng_state=False))
                else:
                    parts.append(piece(h, lab))
            blocks.append(torch.cat(parts, 1))
    return torch.cat(blocks)[:, :-1], entropy[:, :-1]


@dataclass
class Forward:
    """One micro-batch's update forward from column Lp - 1 (`hidden_forward`): its final hidden states (b, C, H)
    and the model's `head`; or, for a model whose head `reproduces` does not confirm (`head` None), the
    model's own logits (b, C, V) in `states`, read as before. `kv`: OAR's clean keys/values, or None."""

    states: torch.Tensor  # (b, C, H) hidden states with the graph; (b, C, V) logits when head is None
    head: Head | None
    kv: Any = None
    autocast: Callable | None = None  # the context the model's forward computes in (the head's too)

    def logprobs(self, labels: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(log pi of labels (b, T) float32 with the graph, at `temperature`; the policy's entropy (b, T)
        float32 at temperature 1, detached), labels (b, T) the tokens columns 0 .. T - 1 predict."""
        if self.head is None:
            logits = self.states[:, :-1]
            return token_logprobs(logits, labels, temperature=temperature), token_entropy(logits.detach())
        return head_logprobs(self.head, self.states, labels, temperature, self.autocast)

    def at(self, pos: torch.Tensor) -> torch.Tensor:
        """The logits (b, K, V) at columns `pos` (b, K), detached. The head's product runs over at least MIN_ROWS
        positions (the ones asked for, then copies of the first), as probes.logits_at's does: BLAS rounds a
        product over a handful of rows otherwise, and a rollout's numbers must not depend on its batch-mates
        (OAR-G's score, a KL's gradient at its minimum, magnifies that rounding a thousandfold)."""
        rows = torch.arange(pos.shape[0], device=pos.device).unsqueeze(1)
        if self.head is None:
            return self.states.detach()[rows, pos]
        h = self.states.detach()[rows, pos].flatten(0, 1)  # (b K, H)
        n = h.shape[0]
        if 0 < n < MIN_ROWS:
            h = torch.cat([h, h[:1].expand(MIN_ROWS - n, -1)])
        with torch.no_grad(), self.autocast() if self.autocast is not None else nullcontext():
            return self.head(h)[:n].view(*pos.shape, -1)

    def logits(self) -> torch.Tensor:
        """Every column's logits (b, C, V), detached: made whole, on demand (a credit method that reads
        `micro.logits`; no graph, so no gradient of them is ever held)."""
        return self.at(torch.arange(self.states.shape[1], device=self.states.device).expand(self.states.shape[0], -1))

    def outcome(self, input_ids: torch.Tensor, answer_mask: torch.Tensor, probe: str) -> torch.Tensor:
        """OAR's clean outcome (maths §2), as probes.outcome_from_logits computes it from these columns' logits:
        input_ids, answer_mask (b, C) the same columns. Only the answer positions go through the head."""
        pos, valid = answer_positions(answer_mask)
        tokens = input_ids.gather(1, (pos + 1).clamp(max=input_ids.shape[1] - 1))
        return outcome(self.at(pos), tokens, valid, probe)


def reproduces(model, base, head: Head, device, autocast=None) -> bool:
    """Whether `head` on the hidden states `hidden_forward` reads gives `model`'s own logits, on a short
    input (2 rows x 8 tokens of ids 0 .. 7, one left-padded), no graph, eval mode: the same floats up to
    the rounding of a product over other rows (torch.testing's tolerance for their dtype), so a forgotten
    scale or cap (a factor of 2 or 8 in the families' tests) is far outside it. Collective under FSDP2:
    every process calls it."""
    ids = torch.arange(16, device=device).view(2, 8) % max(2, head.vocab)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad(), eval_mode(model), autocast() if autocast is not None else nullcontext():
        want = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False).logits
        hidden, _ = hidden_forward(model, base, ids, mask, columns=ids.shape[1])
        got = head(hidden)
    real = mask.bool()
    if got.shape != want.shape or not torch.isfinite(want[real]).all():
        return False
    try:  # in the head's dtype, with its tolerance (a float32 copy of bf16 logits is compared as bf16)
        torch.testing.assert_close(got[real], want[real].to(got.dtype))
    except AssertionError:
        return False
    return True
