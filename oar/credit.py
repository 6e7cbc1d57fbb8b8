"""Token credit: one interface from what a step has to token weights w_it, and the table of methods.

Legend: B this process's rollouts (P prompts x G, a prompt's group contiguous and on one process),
b a micro-batch's rollouts, L positions (prompt width Lp + completion), T = L - Lp completion
positions, V vocabulary.

The loss takes token advantages A_it = A_i w_it (SPEC §1, STYLE 4) and never branches on the method:
a method is only a way to fill w. `train.py --method NAME` picks one from METHODS:

  grpo          w = 1                                                      (the reference)
  oar-g, oar-p  OAR's scores through the bi-level gate (SPEC §3-5; oar_grad.py, oar_perturb.py)
  entropy       the update forward's token entropy through the same gate     (oar/entropy_credit.py)
  entropy-mask  1 on the top-rho entropy tokens of the whole step, else 0    (oar/entropy_credit.py)
  tempo         prefix-tree credit from the group's own rewards, may be < 0 (oar/tempo.py)
  oar-g+tempo   BEYOND THE PAPER: OAR-G's weights plus TEMPO's TD term at branch tokens,
                A_it = A_i w^OAR_it + (V(child) - V(node)) / d, i.e. w = w^OAR + (w^TEMPO - 1): OAR keeps
                its gate on the written computation, the forks it under-weights get their group's
                credit. Mass: OAR's (preserved) plus one token's worth; sign: can flip, as TEMPO's.
  random-gate   BEYOND THE PAPER, a control: uniform random scores (from each rollout's seed) through
                the same gate: what the gate does to learning when its scores carry no information.

Two calls per step, both in train.py's step 4: `step_credit(...)` before the micro-batch loop, with
everything the step has (what a method needs of the whole step is computed there: TEMPO's trees,
entropy-mask's threshold over every process's tokens), returns a function that the loop calls once
per micro-batch with the update forward's logits. Weights are (b, L) over the sequence layout;
train.py reads the completion columns. So every method's weights are a function of the step, never
of the micro-batching or of the number of processes (tests/test_credit.py, tests/test_distributed.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from oar.entropy_credit import top_entropy_mask
from oar.gating import bilevel_weights
from oar.grpo import token_entropy
from oar.training.models import forward_logits
from oar.oar_grad import gradient_scores
from oar.oar_perturb_window import perturbation_scores_auto
from oar.sampler import Rollout, with_reference_answer
from oar.tempo import tempo_weights

COMPARED = ("grpo", "oar-g", "oar-p", "entropy", "entropy-mask", "tempo")  # the paper's methods and the comparators
METHODS = COMPARED + ("oar-g+tempo", "random-gate")  # plus ours, beyond the paper: a candidate and a control


@dataclass(frozen=True)
class CreditSettings:
    """The settings credit reads; field names are train.py's Config fields (train.py copies them)."""

    method: str = "grpo"
    gate_quantile: float = 0.4
    gate_boost: float = 2.0
    gate_floor: float = 0.1
    preserve_mass: bool = True
    noise_std: float = 1e-3
    perturb_span: int = 1
    perturb_mode: str = "auto"
    perturb_window: int = 32
    perturb_auto_length: int = 512
    perturb_chunk_tokens: int = 8192
    outcome_source: str = "rollout"
    reference_template: str = "#### {answer}"
    temperature: float = 1.0
    micro_batch_size: int = 64
    group_size: int = 8
    entropy_top: float = 0.2
    mask_truncated: bool = False

    def __post_init__(self):
        assert self.method in METHODS, f"method {self.method!r}: choose one of {', '.join(METHODS)}"
        assert 0.0 < self.entropy_top <= 1.0, f"entropy_top {self.entropy_top}: must lie in (0, 1]"


MicroCredit = Callable[..., tuple[torch.Tensor, float, int]]


def gate(s: CreditSettings, scores: torch.Tensor, reasoning: torch.Tensor) -> torch.Tensor:
    """The bi-level gate (SPEC §5) with the run's settings: scores (b, L) over `reasoning` (b, L) -> weights."""
    return bilevel_weights(scores, reasoning, quantile=s.gate_quantile, boost=s.gate_boost,
                           floor=s.gate_floor, preserve_mass=s.preserve_mass)


def step_credit(settings: CreditSettings, model, tokenizer, ro: Rollout, rewards: torch.Tensor, advantages: torch.Tensor,
                scored: torch.Tensor, seeds: list[int], golds: list[str], probe: str, *,
                gather: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> MicroCredit:
    """Credit for one step: returns `weigh(rows, mb, logits, clean=None, clean_kv=None) -> (weights (b, L),
    seconds, non-finite rows)` for the micro-batch `mb = ro.select(rows)`, whose `logits` (b, T + 1, V)
    are the update forward's from column Lp - 1 (as train.py keeps them).

    rewards, advantages, scored (B,): this process's; `scored` marks the rollouts whose weights
    matter (advantage != 0 and a valid token): the others get 1 from the scoring methods (their loss
    is 0 whatever w). `gather(x)`: all processes' 1-D `x` concatenated (identity on one process);
    entropy-mask takes its threshold over the whole step with it, random-gate the step's widest prompt."""
    s, lp = settings, ro.prompt_width
    assert rewards.shape == advantages.shape == scored.shape == (len(ro),), (rewards.shape, advantages.shape, scored.shape)
    ones = lambda mb: torch.ones(mb.input_ids.shape, device=mb.input_ids.device)  # noqa: E731
    if s.method == "grpo":
        return lambda rows, mb, logits, clean=None, clean_kv=None: (ones(mb), 0.0, 0)
    if s.method in ("oar-g", "oar-p"):
        return lambda rows, mb, logits, clean=None, clean_kv=None: oar_weights(
            s, model, tokenizer, mb, scored[rows], probe, clean, seeds[rows], golds[rows], clean_kv)
    if s.method == "entropy":
        def weigh(rows, mb, logits, clean=None, clean_kv=None):
            start = time.perf_counter()
            ent = token_entropy(logits[:, :-1].detach() / s.temperature)  # (b, T): entropy of the distribution token t was drawn from
            full = torch.zeros(mb.input_ids.shape, device=ent.device)
            full[:, lp:] = ent
            return gate(s, full, mb.reasoning_mask & scored[rows, None]), time.perf_counter() - start, 0
        return weigh
    if s.method == "random-gate":
        # Rollout i's scores are a stream from its own seed, read at each token's column in the layout the
        # step would have on one process (the widest prompt of every process, then the completion): the
        # same draws whatever the other prompts on this process, the micro-batching or the process count.
        width = int(gather(torch.tensor([float(lp)], device=ro.input_ids.device)).max())

        def weigh(rows, mb, logits, clean=None, clean_kv=None):
            T = mb.input_ids.shape[1] - lp
            full = torch.zeros(mb.input_ids.shape, device=mb.input_ids.device)
            full[:, lp:] = torch.stack([torch.rand(width + T, generator=torch.Generator().manual_seed(seed + 104_729))[width:]
                                        for seed in seeds[rows]]).to(full.device)
            return gate(s, full, mb.reasoning_mask & scored[rows, None]), 0.0, 0
        return weigh
    if s.method == "oar-g+tempo":
        start = time.perf_counter()
        td = tempo_weights(ro.input_ids[:, lp:], ro.completion_mask[:, lp:], rewards, group_size=s.group_size) - 1.0  # (B, T): 0 off branches
        td = torch.cat([torch.zeros_like(ro.input_ids[:, :lp], dtype=td.dtype), td], dim=1)  # (B, L)
        tree_seconds = (time.perf_counter() - start) / max(1, len(ro))
        oar_g = replace(s, method="oar-g")

        def weigh(rows, mb, logits, clean=None, clean_kv=None):
            w, secs, nonfinite = oar_weights(oar_g, model, tokenizer, mb, scored[rows], probe, clean, seeds[rows], golds[rows], clean_kv)
            return w + td[rows].to(w.device), secs + tree_seconds * len(mb), nonfinite
        return weigh
    start = time.perf_counter()
    if s.method == "tempo":
        full = tempo_weights(ro.input_ids[:, lp:], ro.completion_mask[:, lp:], rewards, group_size=s.group_size)
        full = torch.cat([torch.ones_like(ro.input_ids[:, :lp], dtype=full.dtype), full], dim=1)  # (B, L)
    else:  # entropy-mask: one threshold over the step's tokens on every process, so entropies first
        ent = step_entropies(model, ro, s.micro_batch_size, s.temperature)  # (B, L)
        full = top_entropy_mask(ent, ro.loss_tokens(s.mask_truncated), top=s.entropy_top, gather=gather).float()  # the loss's tokens
    per_rollout = (time.perf_counter() - start) / max(1, len(ro))
    return lambda rows, mb, logits, clean=None, clean_kv=None: (full[rows], per_rollout * len(mb), 0)


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
        out[start:start + len(mb), lp:] = token_entropy(logits[:, :-1] / temperature)
    return out


def oar_weights(s: CreditSettings, model, tokenizer, mb: Rollout, scored, probe, clean, seeds, golds, clean_kv=None):
    """OAR-G / OAR-P for one micro-batch: weights (b, L), the seconds the scoring took, and how many
    rollouts had a non-finite score (they get all-ones weights, as gating.bilevel_weights defines).
    Only the rollouts marked in `scored` (b,) are scored; the others get all-ones weights. `clean`,
    `clean_kv`: the clean outcome and keys/values from the update's forward (probes.clean_forward), or None."""
    reasoning = mb.reasoning_mask & scored[:, None]  # (b, L) a row without reasoning tokens costs nothing and weighs 1
    if not reasoning.any():
        return torch.ones(mb.input_ids.shape, device=mb.input_ids.device), 0.0, 0
    start = time.perf_counter()
    ids, attn, reas, ans = mb.input_ids, mb.attention_mask, reasoning, mb.answer_mask
    if s.outcome_source == "reference":  # score against the gold answer appended after the reasoning
        ids, attn, reas, ans = with_reference_answer(mb, tokenizer, golds, s.reference_template)
        reas = reas & scored[:, None]
        clean = clean_kv = None
    if s.method == "oar-g":
        h = model.config.hidden_size
        noise = torch.zeros(*ids.shape, h)
        for i in reas.any(1).nonzero().flatten().tolist():  # rollout i's noise comes from its own seed: batching-independent
            noise[i, reas[i].cpu()] = torch.randn(int(reas[i].sum()), h, generator=torch.Generator().manual_seed(seeds[i] + 7919))
        scores = gradient_scores(model, ids, attn, reas, ans, probe=probe, noise_std=s.noise_std,
                                 noise=noise.to(ids.device), clean=clean, clean_kv=clean_kv)
    else:
        scores = perturbation_scores_auto(model, ids, attn, reas, ans, probe=probe, pad_token_id=tokenizer.pad_token_id,
                                          max_chunk_tokens=s.perturb_chunk_tokens, span=s.perturb_span, clean=clean, clean_kv=clean_kv,
                                          mode=s.perturb_mode, window=s.perturb_window, auto_length=s.perturb_auto_length)
    width = min(scores.shape[1], mb.input_ids.shape[1])  # reasoning positions lie before both ends
    full = torch.zeros(mb.input_ids.shape, device=scores.device)
    full[:, :width] = scores[:, :width]
    weights = gate(s, full, reasoning)
    nonfinite = int((~torch.isfinite(full) & reasoning).any(1).sum())
    return weights, time.perf_counter() - start, nonfinite
