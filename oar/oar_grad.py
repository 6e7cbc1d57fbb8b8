"""OAR-G: token importance from one gradient x input pass on noised embeddings (maths §4).

Legend: B rollouts, L sequence positions, H embedding width, V vocabulary.

  1. P_0 (or phi_0): the clean outcome, detached. Pass `clean` to reuse a forward the training
     step already ran (its logits at the answer positions); otherwise one no-grad forward here.
  2. e = embed(x), detached;  e~ = e + delta,  delta ~ N(0, sigma^2 I) on reasoning positions only,
     in training each rollout's drawn from its own seed (`seeded_noise`: batching-independent).
  3. J = KL(P_0 || P(e~))   (phi_0 - phi(e~) for answer_joint), summed over rollouts: rollouts are
     independent, so d(sum J)/d e~_i = dJ_i/d e~_i.
  4. g = dJ/de~ by `torch.autograd.grad` with respect to e~ alone: autograd then skips every
     weight-gradient product, writes nothing to any `.grad`, and no `requires_grad` flag is touched.
  5. s_t = |<g_t, e_t>| on reasoning positions, 0 elsewhere.
Why the noise: at delta = 0 the KL sits at its minimum (0) and its gradient is exactly 0; the noise
makes the first-order signal non-zero. answer_joint needs none (noise_std = 0 is allowed).

Cost (all exact, pinned by tests against a plain full-sequence backward):
  * columns before the first noised or answer-predicting position cannot depend on the noise: the
    graph starts there, attending to their keys/values, taken from `clean_kv` (train.py hands over
    the update forward's) or from one forward without a graph (not possible with gradient
    checkpointing in training mode, which drops caches: then the whole row is in the graph);
  * columns after the last answer token are cut, and only the K answer-predicting positions of a
    row (from its first on) go through the model's own head, not every position x V;
  * rows are scored in groups of the same columns (first .. last answer token rounded up to a
    multiple of COLUMN_STEP), so short rows do not pay for the longest one's; a row's shapes never
    depend on the other rows, and groups too small for the BLAS kernels of large matrices are
    filled up with duplicate rows (probes.min_rows): micro-batching stays exact to float rounding.

Deviations: the noise is drawn in float32 (or taken as given), added to the embeddings in float32,
and the sum is cast to the model's dtype. Rows without an answer token score 0. A row whose
objective is not finite (NaN logits, an overflow) scores NaN on its reasoning tokens, so that it is
counted and keeps GRPO's weights (gating.bilevel_weights), never a silent 0.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from oar.lm import cache_kwargs, full_cache, position_ids, returned_cache
from oar.probes import answer_positions, check_probe, divergence, logits_at, min_rows, outcome


def gradient_scores(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    reasoning_mask: torch.Tensor,
    answer_mask: torch.Tensor,
    *,
    probe: str = "answer_mean",
    noise_std: float = 1e-3,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    seeds: list[int] | None = None,
    clean: torch.Tensor | None = None,
    clean_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """OAR-G scores (B, L) float32, 0 outside `reasoning_mask`. Inputs (B, L).

    The noise delta / noise_std: standard-normal draws (B, L, H), from `seeds` when given (one seed per
    rollout: `seeded_noise`, training's way, so a rollout's noise does not depend on how rollouts are
    batched), else `noise` as given, else the generator's; scaled by noise_std.
    clean: optional precomputed clean outcome, as `probes.outcome` returns it for these rows.
    clean_kv: optional keys/values of a clean forward over these rows (per layer, each
    (B, heads, >= L', head_dim), as `probes.clean_forward` returns them): the noise-free columns are
    read from it instead of being computed again.
    """
    check_probe(probe)
    assert noise_std >= 0.0, f"noise_std must be >= 0, got {noise_std}"
    if noise_std == 0.0 and probe != "answer_joint":  # maths §4, "why the noise"
        warnings.warn(
            f"OAR-G with probe {probe!r} and noise_std 0: at the clean point the KL is at its minimum, so its "
            f"gradient is 0 and the scores are float rounding. Use noise_std > 0 or probe 'answer_joint'.",
            stacklevel=2,
        )
    low = next(model.parameters()).dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled(
        input_ids.device.type
    )
    if low and probe != "answer_joint" and noise_std < 0.1:
        # Measured on SmolLM2-135M (docs/model-families.md): at noise 1e-3 the KL moves less than
        # bfloat16 rounds the logits, and the scores' rank correlation with float32's is about 0.
        warnings.warn(
            f"OAR-G in half precision with probe {probe!r} and noise_std {noise_std}: the perturbation is below "
            f"the rounding of the logits, so the scores are mostly rounding noise. Use --probe answer_joint, "
            f"--noise_std 0.1, float32 weights without mixed precision, or --method oar-p.",
            stacklevel=2,
        )
    assert input_ids.shape == attention_mask.shape == reasoning_mask.shape == answer_mask.shape
    scores = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    hidden = model.get_input_embeddings().embedding_dim
    assert seeds is None or noise is None, "give seeds or noise, not both"
    if seeds is not None:
        noise = seeded_noise(seeds, reasoning_mask, hidden).to(input_ids.device)
    if noise is None:
        noise = torch.randn(
            (*input_ids.shape, hidden),
            generator=generator,
            device=input_ids.device if generator is None else generator.device,
        )
    assert noise.shape == (*input_ids.shape, hidden), (noise.shape, input_ids.shape, hidden)
    # Each row's columns: from the first that the noise or the probe touches through its last answer
    # token, rounded up to a multiple of COLUMN_STEP; rows with the same columns are scored together. A row's
    # shapes, hence its numbers, never depend on the other rows (micro-batching is exact).
    cols = torch.arange(input_ids.shape[1], device=input_ids.device)
    last = torch.where(answer_mask, cols, -1).amax(1)  # (B,) last answer token, -1 without one
    noisy = reasoning_mask & (cols[None] < last[:, None])  # a token at or after it cannot move the probe
    a0 = torch.where(answer_mask, cols, input_ids.shape[1]).amin(1)  # (B,) first answer token
    first = torch.minimum(torch.where(noisy, cols, input_ids.shape[1]).amin(1), (a0 - 1).clamp(min=0))
    if model.training and _checkpointing(model):
        first = torch.zeros_like(first)  # checkpointed layers drop caches in training mode: all columns in the graph
    end = torch.minimum(
        first + (last + COLUMN_STEP - first) // COLUMN_STEP * COLUMN_STEP, torch.tensor(input_ids.shape[1])
    )  # > last
    groups: dict[tuple[int, int], list[int]] = {}
    for b in noisy.any(1).nonzero().flatten().tolist():  # rows without an answer or noise score 0
        groups.setdefault((int(first[b]), int(end[b])), []).append(b)
    for (lo, hi), rows in groups.items():
        run = torch.tensor(rows + rows[:1] * (min_rows(len(rows), hi - lo) - len(rows)), device=input_ids.device)
        group = _Group(
            input_ids[run, :hi],
            attention_mask[run, :hi],
            noisy[run, :hi],
            answer_mask[run, :hi],
            noise[run, :hi],
            lo,
            None if clean is None else clean[run],
            None if clean_kv is None else [(k[run, :, :lo], v[run, :, :lo]) for k, v in clean_kv],
        )
        scores[run[: len(rows)], lo:hi] = _scores(model, group, probe, noise_std)[: len(rows)]
    return scores


NOISE_SEED_OFFSET = 7919  # rollout i's noise generator is seeded with seeds[i] + this (its sampler uses seeds[i])


def seeded_noise(seeds: list[int], reasoning_mask: torch.Tensor, hidden: int) -> torch.Tensor:
    """Standard-normal noise (B, L, H) float32 on the CPU: rollout i's reasoning positions get, in order,
    the draws of its own generator seeded with seeds[i] + NOISE_SEED_OFFSET; every other position 0.
    So a rollout's noise is a function of its seed and its reasoning tokens alone, whatever batch,
    micro-batch or process scores it (and the noise a row gets never depends on its padding)."""
    assert len(seeds) == reasoning_mask.shape[0], (len(seeds), reasoning_mask.shape)
    noise = torch.zeros(*reasoning_mask.shape, hidden)
    for i in reasoning_mask.any(1).nonzero().flatten().tolist():
        gen = torch.Generator().manual_seed(seeds[i] + NOISE_SEED_OFFSET)
        noise[i, reasoning_mask[i].cpu()] = torch.randn(int(reasoning_mask[i].sum()), hidden, generator=gen)
    return noise


# a row's graph columns are rounded up to a multiple of this, so rows of similar length share a forward
COLUMN_STEP = 8


@dataclass(frozen=True)
class _Group:
    """Rows scored together (B'), cut a little after their last answer token (L' columns), whose graph
    starts at column `first`: the columns before it hold no noise and predict no answer."""

    input_ids: torch.Tensor  # (B', L')
    attention_mask: torch.Tensor  # (B', L')
    noisy: torch.Tensor  # (B', L') bool: the reasoning tokens that get noise and scores
    answer_mask: torch.Tensor  # (B', L') bool
    noise: torch.Tensor  # (B', L', H) standard-normal draws
    first: int
    clean: torch.Tensor | None  # the rows' clean outcome, or None: computed here
    clean_kv: (
        list[tuple[torch.Tensor, torch.Tensor]] | None
    )  # keys/values of columns < first, or None: one forward here


def _scores(model, group: _Group, probe: str, noise_std: float) -> torch.Tensor:
    """Scores (B', L' - first) of the group's columns first .. L'-1. Columns before `first` come from
    `clean_kv` or one forward without a graph."""
    input_ids, attention_mask, noisy, answer_mask = (
        group.input_ids,
        group.attention_mask,
        group.noisy,
        group.answer_mask,
    )
    noise, first, clean, clean_kv = group.noise, group.first, group.clean, group.clean_kv
    end = input_ids.shape[1]
    pos, valid = answer_positions(answer_mask)  # (B, K) positions of the logits that predict answers
    targets = input_ids.gather(1, (pos + 1).clamp(max=end - 1))
    pos_ids = position_ids(attention_mask)
    at = (pos - first).clamp(min=0)  # (B, K) in the graph's columns

    with torch.no_grad():
        e = model.get_input_embeddings()(input_ids)  # (B, L', H)
        prefix = None
        if first > 0 and clean_kv is not None:  # the noise-free columns, as the caller's clean forward left them
            prefix = [(k[:, :, :first].detach(), v[:, :, :first].detach()) for k, v in clean_kv]
        elif first > 0:  # the noise-free columns: once, without a graph
            out = model(
                inputs_embeds=e[:, :first],
                attention_mask=attention_mask[:, :first],
                position_ids=pos_ids[:, :first],
                **cache_kwargs(full_cache()),
                use_cache=True,
                logits_to_keep=1,
            )
            prefix = [(layer.keys, layer.values) for layer in returned_cache(out).layers]

    def probe_of(embeds: torch.Tensor) -> torch.Tensor:  # embeds (B, L' - first, H) -> outcome
        logits, _ = logits_at(
            model,
            at,
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            position_ids=pos_ids[:, first:],
            **cache_kwargs(None if prefix is None else full_cache(prefix)),
            use_cache=prefix is not None,
        )
        return outcome(
            logits, targets, valid, probe
        )  # the model's own head (logit scaling, soft-caps) at the K positions

    if clean is None:
        with torch.no_grad():
            clean = probe_of(e[:, first:])
    e = e[:, first:]
    delta = noise_std * noise[:, first:].to(e.device, torch.float32) * noisy[:, first:].unsqueeze(-1)
    noised = (e.float() + delta).to(e.dtype).requires_grad_(True)

    with torch.enable_grad():
        objective = divergence(clean.detach(), probe_of(noised), probe)  # (B,)
        (grad,) = torch.autograd.grad(objective.sum(), noised)

    scores = (grad.float() * e.float()).sum(dim=-1).abs() * noisy[:, first:]  # (B', L' - first)
    # A non-finite objective (NaN logits, an overflow) has a zero or NaN gradient: either way the row's
    # scores must say so (NaN on its reasoning tokens), or the gate would take them for unimportant.
    broken = ~torch.isfinite(objective.detach())[:, None] & noisy[:, first:]
    return scores.masked_fill(broken, float("nan"))


def _checkpointing(model) -> bool:
    """Whether activation (gradient) checkpointing is on; transformers 5 renamed the property."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False
