"""The built-in credit methods' functions, in oar/credit.py's protocol: each takes a `Step` (and a
`MicroBatch`) and calls the maths, which take plain tensors; oar/credit.py lists them in METHODS.

Legend: B this process's rollouts, b a micro-batch's rollouts, L positions (prompt width Lp +
completion), T = L - Lp completion positions, V vocabulary, H hidden width.

  ones                               grpo: w = 1
  oar_scorer, oar_weights            oar-g / oar-p: oar_grad.gradient_scores or
                                     oar_perturb.perturbation_scores through the gate
  entropy_gate                       entropy: the update forward's token entropy through the gate
  entropy_mask_prepare, precomputed  entropy-mask: entropy_credit.top_entropy_mask over the whole step
  tempo_prepare, precomputed         tempo: tempo.tempo_weights over the whole step
  oar_g_plus_tempo                   oar-g+tempo: OAR-G's weights plus TEMPO's TD share
  random_gate_prepare, random_gate   random-gate: uniform scores from each rollout's seed, gated
  grail                              grail: grail.grail_scores through grail.grail_weights (a comparator)
`gate` is gating.bilevel_weights with the run's settings. This module reads the protocol's types
only to annotate (the protocol's module, oar/credit.py, imports this one to build its table).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from oar.entropy_credit import top_entropy_mask
from oar.gating import bilevel_weights
from oar.grail import grail_scores, grail_weights, reweighted_rows
from oar.grpo import token_entropy
from oar.lm import forward_logits
from oar.oar_grad import gradient_scores
from oar.oar_perturb import perturbation_scores
from oar.rollout import Rollout
from oar.tempo import tempo_weights

if TYPE_CHECKING:
    from oar.credit import CreditSettings, MicroBatch, Step


def gate(s: CreditSettings, scores: torch.Tensor, reasoning: torch.Tensor) -> torch.Tensor:
    """The bi-level gate with the run's settings: scores (b, L) over `reasoning` (b, L) -> weights (b, L)."""
    return bilevel_weights(
        scores,
        reasoning,
        quantile=s.gate_quantile,
        boost=s.gate_boost,
        floor=s.gate_floor,
        preserve_mass=s.preserve_mass,
    )


def ones(step: Step, state, micro: MicroBatch) -> torch.Tensor:
    """GRPO: w = 1 (b, L)."""
    return torch.ones(micro.rollouts.input_ids.shape, device=micro.rollouts.input_ids.device)


def precomputed(step: Step, state: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
    """The micro-batch's rows of weights (B, L) that prepare computed for the whole step, at its width L' <= L
    (the columns cut are padding of all its rows)."""
    return state[micro.rows, : micro.rollouts.input_ids.shape[1]]


# -- OAR-G and OAR-P -------------------------------------------------------------------------------


def oar_scorer(scorer: str) -> Callable[[Step, Any, MicroBatch], tuple[torch.Tensor, int]]:
    """OAR-G ('gradient') or OAR-P ('perturbation') as a weigh function."""

    def weigh(step: Step, state, micro: MicroBatch) -> tuple[torch.Tensor, int]:
        return oar_weights(step, micro, scorer)

    return weigh


def oar_g_plus_tempo(step: Step, td: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, int]:
    """OAR-G's weights plus TEMPO's TD share (w^TEMPO - 1: 0 off the branch tokens), prepared by tempo_prepare."""
    w, nonfinite = oar_weights(step, micro, "gradient")
    return w + (td[micro.rows, : w.shape[1]] - 1.0).to(w.device), nonfinite


def oar_weights(step: Step, micro: MicroBatch, scorer: str) -> tuple[torch.Tensor, int]:
    """OAR-G (scorer 'gradient') or OAR-P ('perturbation') for one micro-batch: weights (b, L), and how many
    rollouts had a non-finite score (they get all-ones weights, as gating.bilevel_weights defines).
    Only the step's scored rollouts are scored; the others get all-ones weights. The clean outcome and
    keys/values come from the update's forward (`micro.clean`, `micro.clean_kv`; probes.clean_forward)."""
    s, mb, scored = step.settings, micro.rollouts, step.scored[micro.rows]
    reasoning = mb.reasoning_mask & scored[:, None]  # (b, L) a row without reasoning tokens costs nothing and weighs 1
    if not reasoning.any():
        return torch.ones(mb.input_ids.shape, device=mb.input_ids.device), 0
    ids, attn, reas, ans = mb.input_ids, mb.attention_mask, reasoning, mb.answer_mask
    clean, clean_kv = micro.clean, micro.clean_kv
    if scorer == "gradient":
        scores = gradient_scores(
            step.model,
            ids,
            attn,
            reas,
            ans,
            probe=step.probe,
            noise_std=s.noise_std,
            seeds=step.seeds[micro.rows],
            clean=clean,
            clean_kv=clean_kv,
        )
    else:
        scores = perturbation_scores(
            step.model,
            ids,
            attn,
            reas,
            ans,
            probe=step.probe,
            pad_token_id=step.tokenizer.pad_token_id,
            mode=s.perturb_mode,
            window=s.perturb_window,
            auto_length=s.perturb_auto_length,
            span=s.perturb_span,
            max_chunk_tokens=s.perturb_chunk_tokens,
            clean=clean,
            clean_kv=clean_kv,
        )
    width = min(scores.shape[1], mb.input_ids.shape[1])  # reasoning positions lie before both ends
    full = torch.zeros(mb.input_ids.shape, device=scores.device)
    full[:, :width] = scores[:, :width]
    weights = gate(s, full, reasoning)
    nonfinite = int((~torch.isfinite(full) & reasoning).any(1).sum())
    return weights, nonfinite


# -- entropy and entropy-mask ----------------------------------------------------------------------


@torch.no_grad()
def step_entropies(model, ro: Rollout, micro_batch_size: int, temperature: float = 1.0) -> torch.Tensor:
    """Entropy (B, L) of the policy's next-token distribution at every completion position (0 on the
    prompt), from a no-grad forward in micro-batches: before the update, the policy is the one that
    the update's forward sees (one update per batch), so these are the update forward's entropies."""
    lp = ro.prompt_width
    out = torch.zeros(ro.input_ids.shape, device=ro.input_ids.device)
    for start in range(0, len(ro), micro_batch_size):
        mb = ro.select(slice(start, start + micro_batch_size))
        logits = forward_logits(model, mb.input_ids, mb.attention_mask, logits_to_keep=mb.input_ids.shape[1] - lp + 1)
        out[start : start + len(mb), lp:] = token_entropy(logits[:, :-1] / temperature)
    return out


def entropy_mask_prepare(step: Step) -> torch.Tensor:
    """entropy-mask's weights (B, L) for the whole step: one threshold over the step's tokens on every
    process (the loss's tokens), so every entropy first."""
    s = step.settings
    ent = step_entropies(step.model, step.rollouts, s.micro_batch_size, s.temperature)  # (B, L)
    return top_entropy_mask(
        ent, step.rollouts.loss_tokens(s.mask_truncated), top=s.entropy_top, gather=step.gather
    ).float()


def entropy_gate(step: Step, state, micro: MicroBatch) -> torch.Tensor:
    """entropy's weights (b, L): the gate of the update forward's entropies (of the distribution token t
    was drawn from, at the sampling temperature) over the scored rollouts' reasoning tokens."""
    mb, lp = micro.rollouts, step.rollouts.prompt_width
    ent = token_entropy(micro.logits[:, :-1].detach() / step.settings.temperature)  # (b, T)
    full = torch.zeros(mb.input_ids.shape, device=ent.device)
    full[:, lp:] = ent
    return gate(step.settings, full, mb.reasoning_mask & step.scored[micro.rows, None])


# -- tempo -----------------------------------------------------------------------------------------


def tempo_prepare(step: Step) -> torch.Tensor:
    """TEMPO's weights (B, L) for the step's rollouts, 1 on the prompt columns."""
    ro, lp = step.rollouts, step.rollouts.prompt_width
    full = tempo_weights(
        ro.input_ids[:, lp:], ro.completion_mask[:, lp:], step.rewards, group_size=step.settings.group_size
    )
    return torch.cat([torch.ones_like(ro.input_ids[:, :lp], dtype=full.dtype), full], dim=1)


# -- random-gate (BEYOND THE PAPER: the gate's control) --------------------------------------------


def random_gate_prepare(step: Step) -> int:
    """The step's widest prompt over every process: random_gate reads each rollout's stream at the
    columns the step would have on one process, so the draws do not depend on the process count."""
    return int(
        step.gather(torch.tensor([float(step.rollouts.prompt_width)], device=step.rollouts.input_ids.device)).max()
    )


def random_gate(step: Step, width: int, micro: MicroBatch) -> torch.Tensor:
    """The gate of uniform scores (b, L): rollout i's are a stream from its own seed, read at each token's
    column in the one-process layout (the step's widest prompt `width`, then the completion): the same draws
    whatever the micro-batching or the process count. Not whatever the step's other prompts: a wider one
    moves the columns, as it does in a one-process run."""
    mb, lp = micro.rollouts, step.rollouts.prompt_width
    T = mb.input_ids.shape[1] - lp
    full = torch.zeros(mb.input_ids.shape, device=mb.input_ids.device)
    full[:, lp:] = torch.stack(
        [
            torch.rand(width + T, generator=torch.Generator().manual_seed(seed + 104_729))[width:]
            for seed in step.seeds[micro.rows]
        ]
    ).to(full.device)
    return gate(step.settings, full, mb.reasoning_mask & step.scored[micro.rows, None])


# -- grail (a comparator, arXiv 2606.04889) --------------------------------------------------------


def grail(step: Step, state, micro: MicroBatch) -> tuple[torch.Tensor, int]:
    """GRAIL's weights (b, L) on the scored rollouts' reasoning tokens: each token's saliency for the answer's
    likelihood, per rollout log and z-scored, mapped and clipped to [0.5, 5] (oar/grail.py), on the wrong
    rollouts only (A_i <= 0, GRAIL's run default); 1 elsewhere. Its own forward and backward to the embeddings,
    from the sampling policy; no noise, no gate, no mass preservation (docs/differences.md)."""
    mb, scored = micro.rollouts, step.scored[micro.rows]
    rows = reweighted_rows(step.advantages[micro.rows]) & scored & mb.answer_mask.any(1)  # (b,)
    mask = mb.reasoning_mask & rows[:, None]  # (b, L)
    if not mask.any():
        return torch.ones(mb.input_ids.shape, device=mb.input_ids.device), 0
    scores = grail_scores(
        step.model, mb.input_ids, mb.attention_mask, mask, mb.answer_mask, temperature=step.settings.temperature
    )
    out = grail_weights(scores, mask, rows)
    return out.weights, out.nonfinite
