"""Token credit: one protocol from what a step has to token weights w_it, and the table of methods.

Legend: B this process's rollouts (P prompts x G, a prompt's group contiguous and on one process),
b a micro-batch's rollouts, L positions (prompt width Lp + completion), T = L - Lp completion
positions, V vocabulary.

The loss takes token advantages A_it = A_i w_it (SPEC §1, STYLE 4) and never branches on the method:
a method is only a way to fill w. `train.py --method NAME` picks one from the table, METHODS:

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
                the same gate: what the gate does to learning when its scores carry no information
                (oar/gating.py).

The protocol (docs/credit-methods.md has a worked example). A method is a `CreditMethod`: a name and
two functions, called in train.py's step 4:
  prepare(step) -> state            once per step, before the micro-batch loop, with everything the
                                    step has (`Step`): what a method needs of the WHOLE step is
                                    computed here (TEMPO's trees; entropy-mask's threshold over every
                                    process's tokens, through `step.gather`). Default: nothing.
  weigh(step, state, micro) -> w    once per micro-batch (`MicroBatch`: its rows and the update
                                    forward's logits): weights (b, L) over the sequence layout, of
                                    which train.py reads the completion columns; or (w, n) with n the
                                    rollouts whose scores were not finite (they should get w = 1).
So a method's weights can be, and every built-in's are, a function of the step, never of the
micro-batching or of the number of processes (tests/test_credit.py, tests/test_distributed.py).
step_credit checks what the loss relies on for every method: finite float weights of the micro-batch's shape.

A method of one's own needs no edit here. `--credit_module M` names a module (a path to a .py file,
or a dotted name on the Python path) that lists its methods in `CREDIT_METHODS`; they join the
built-ins for that run: `--credit_module examples/position_decay.py --method position-decay`.
Why a list the module defines rather than a `register()` call it makes on import: nothing global
changes, so a run's table is a function of its config (saved in config.json; a resume must name the
same module), two runs in one process never see each other's methods, and a module imported twice
cannot register twice. A module that does not import, a method that breaks the protocol, or a name
that clashes with a built-in stops the run in train.py's first checks, before anything loads
(oar/credit_modules.py loads and checks such modules).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable

import torch

from oar.entropy_credit import entropy_gate, entropy_mask_prepare, step_entropies  # noqa: F401 (step_entropies: re-exported)
from oar.gating import gate, random_gate, random_gate_prepare
from oar.oar_grad import gradient_scores
from oar.oar_perturb_window import perturbation_scores_auto
from oar.sampler import Rollout, with_reference_answer
from oar.tempo import tempo_prepare

COMPARED = ("grpo", "oar-g", "oar-p", "entropy", "entropy-mask", "tempo")  # the paper's methods and the comparators


@dataclass(frozen=True)
class CreditSettings:
    """The settings credit reads; field names are train.py's Config fields (train.py copies them)."""

    method: str = "grpo"
    credit_module: str = ""
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
        table = credit_methods(self.credit_module)
        assert self.method in table, f"method {self.method!r}: choose one of {', '.join(table)}"
        assert 0.0 < self.entropy_top <= 1.0, f"entropy_top {self.entropy_top}: must lie in (0, 1]"


@dataclass(frozen=True)
class Step:
    """What a method may read of the whole step: this process's share, and `gather` for the others'."""

    settings: CreditSettings
    model: Any  # the policy (unwrapped), in the update forward's mixed precision
    tokenizer: Any
    rollouts: Rollout  # B rows, the sampler's layout: completions start at column rollouts.prompt_width
    rewards: torch.Tensor  # (B,)
    advantages: torch.Tensor  # (B,) A_i
    scored: torch.Tensor  # (B,) bool: the rollouts whose weights matter (A_i != 0 and a valid token)
    seeds: list[int]  # (B,) each rollout's own seed: draw randomness from it to stay batching-independent
    golds: list[str]  # (B,) gold answers
    probe: str  # this step's outcome probe (SPEC §2)
    gather: Callable[[torch.Tensor], torch.Tensor]  # every process's 1-D tensor concatenated (identity on one)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of the update: rollouts `step.rollouts.select(rows)` and the update forward's outputs."""

    rows: slice  # into the step's B rows
    rollouts: Rollout  # b rows
    logits: torch.Tensor  # (b, T + 1, V), detached, from column Lp - 1: logits[:, t] predicts completion token t
    clean: Any = None  # OAR's clean outcome from that forward (probes.clean_forward), when uses_clean, else None
    clean_kv: Any = None  # and its keys/values


def _nothing(step: Step) -> None:
    return None


@dataclass(frozen=True)
class CreditMethod:
    """A token-credit method: `weigh(step, prepare(step), micro)` -> weights (b, L) (the module docstring)."""

    name: str  # what --method selects
    weigh: Callable[[Step, Any, MicroBatch], Any]
    prepare: Callable[[Step], Any] = _nothing
    scores: bool = True  # False: w = 1 whatever the step (GRPO): no rollout counts as scored, a sharded model is not gathered
    uses_clean: bool = False  # weigh reads micro.clean / clean_kv (OAR's): train.py keeps them from the update forward


class CreditError(ValueError):
    """A credit module or method the run cannot use; the message names it and the fix."""


def protocol_problem(m) -> str | None:
    """What makes `m` not a CreditMethod a run can call, or None."""
    if not isinstance(m, CreditMethod):
        return f"{m!r} is not an oar.credit.CreditMethod"
    if not isinstance(m.name, str) or not m.name or m.name != m.name.strip():
        return f"name {m.name!r} must be a non-empty string without surrounding spaces"
    for what, fn, args in (("weigh", m.weigh, ("step", "state", "micro")), ("prepare", m.prepare, ("step",))):
        if not callable(fn):
            return f"method {m.name!r}: {what} is {fn!r}, not a function"
        try:
            inspect.signature(fn).bind(*args)
        except TypeError:
            return f"method {m.name!r}: {what}{inspect.signature(fn)} must take ({', '.join(args)})"
        except ValueError:  # no signature to read (a builtin): it is called and checked then
            pass
    if not isinstance(m.scores, bool) or not isinstance(m.uses_clean, bool):
        return f"method {m.name!r}: scores and uses_clean must be True or False"
    return None


def credit_methods(module: str = "") -> MappingProxyType:
    """The table a run chooses from: name -> CreditMethod, the built-ins then `module`'s, loaded and
    checked by oar/credit_modules.py (CreditError if unusable)."""
    if not module:
        return METHODS
    from oar.credit_modules import module_methods  # it reads this module's table: imported on use

    return MappingProxyType({**METHODS, **{m.name: m for m in module_methods(module)}})


def step_credit(settings: CreditSettings, model, tokenizer, ro: Rollout, rewards: torch.Tensor, advantages: torch.Tensor,
                scored: torch.Tensor, seeds: list[int], golds: list[str], probe: str, *,
                gather: Callable[[torch.Tensor], torch.Tensor] = lambda x: x):
    """Credit for one step: runs the method's prepare and returns `weigh(rows, mb, logits, clean=None,
    clean_kv=None) -> (weights (b, L), seconds, non-finite rows)` for the micro-batch `mb = ro.select(rows)`,
    whose `logits` (b, T + 1, V) are the update forward's from column Lp - 1 (as train.py keeps them).
    Seconds: the micro-batch's weigh plus its rollouts' share of prepare.

    rewards, advantages, scored (B,): this process's; `scored` marks the rollouts whose weights
    matter (advantage != 0 and a valid token): the others get 1 from the scoring methods (their loss
    is 0 whatever w). `gather(x)`: all processes' 1-D `x` concatenated (identity on one process)."""
    assert rewards.shape == advantages.shape == scored.shape == (len(ro),), (rewards.shape, advantages.shape, scored.shape)
    method = credit_methods(settings.credit_module)[settings.method]
    step = Step(settings, model, tokenizer, ro, rewards, advantages, scored, list(seeds), list(golds), probe, gather)
    start = time.perf_counter()
    state = method.prepare(step)
    per_rollout = (time.perf_counter() - start) / max(1, len(ro))

    def weigh(rows, mb, logits, clean=None, clean_kv=None):
        start = time.perf_counter()
        out = method.weigh(step, state, MicroBatch(rows, mb, logits, clean, clean_kv))
        weights, nonfinite = out if isinstance(out, tuple) else (out, 0)
        # what the loss relies on, checked for every method: one finite float weight per position
        if not (isinstance(weights, torch.Tensor) and weights.is_floating_point() and weights.shape == mb.input_ids.shape):
            got = f"{weights.dtype} of shape {tuple(weights.shape)}" if isinstance(weights, torch.Tensor) else f"a {type(weights).__name__}"
            raise CreditError(f"credit method {method.name!r}: weigh returned {got}; it must return float weights of "
                              f"the micro-batch's shape {tuple(mb.input_ids.shape)} (b, L).")
        if not torch.isfinite(weights).all():
            raise CreditError(f"credit method {method.name!r}: weigh returned non-finite weights for rows {rows}; give a "
                              f"rollout whose scores are not finite weights 1 and count it (the (w, n) return).")
        return weights, time.perf_counter() - start + per_rollout * len(mb), int(nonfinite)
    return weigh


# -- the built-ins -------------------------------------------------------------------------------

def ones(step: Step, state, micro: MicroBatch) -> torch.Tensor:
    """GRPO: w = 1 (b, L)."""
    return torch.ones(micro.rollouts.input_ids.shape, device=micro.rollouts.input_ids.device)


def precomputed(step: Step, state: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
    """The micro-batch's rows of weights (B, L) that prepare computed for the whole step."""
    return state[micro.rows]


def oar_scorer(scorer: str) -> Callable[[Step, Any, MicroBatch], tuple[torch.Tensor, int]]:
    """OAR-G ('gradient') or OAR-P ('perturbation') as a weigh function."""
    def weigh(step: Step, state, micro: MicroBatch):
        rows = micro.rows
        return oar_weights(step.settings, step.model, step.tokenizer, micro.rollouts, step.scored[rows], step.probe,
                           micro.clean, step.seeds[rows], step.golds[rows], micro.clean_kv, scorer=scorer)
    return weigh


def oar_g_plus_tempo(step: Step, td: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, int]:
    """OAR-G's weights plus TEMPO's TD share (w^TEMPO - 1: 0 off the branch tokens), prepared by tempo_prepare."""
    w, nonfinite = oar_scorer("gradient")(step, None, micro)
    return w + (td[micro.rows] - 1.0).to(w.device), nonfinite


METHODS = MappingProxyType({m.name: m for m in (  # the order of the study's tables
    CreditMethod("grpo", ones, scores=False),
    CreditMethod("oar-g", oar_scorer("gradient"), uses_clean=True),
    CreditMethod("oar-p", oar_scorer("perturbation"), uses_clean=True),
    CreditMethod("entropy", entropy_gate),
    CreditMethod("entropy-mask", precomputed, prepare=entropy_mask_prepare),
    CreditMethod("tempo", precomputed, prepare=tempo_prepare),
    CreditMethod("oar-g+tempo", oar_g_plus_tempo, prepare=tempo_prepare, uses_clean=True),
    CreditMethod("random-gate", random_gate, prepare=random_gate_prepare),
)})


def oar_weights(s: CreditSettings, model, tokenizer, mb: Rollout, scored, probe, clean, seeds, golds, clean_kv=None, *,
                scorer: str = "gradient") -> tuple[torch.Tensor, int]:
    """OAR-G (scorer 'gradient') or OAR-P ('perturbation') for one micro-batch: weights (b, L), and how many
    rollouts had a non-finite score (they get all-ones weights, as gating.bilevel_weights defines).
    Only the rollouts marked in `scored` (b,) are scored; the others get all-ones weights. `clean`,
    `clean_kv`: the clean outcome and keys/values from the update's forward (probes.clean_forward), or None."""
    reasoning = mb.reasoning_mask & scored[:, None]  # (b, L) a row without reasoning tokens costs nothing and weighs 1
    if not reasoning.any():
        return torch.ones(mb.input_ids.shape, device=mb.input_ids.device), 0
    ids, attn, reas, ans = mb.input_ids, mb.attention_mask, reasoning, mb.answer_mask
    if s.outcome_source == "reference":  # score against the gold answer appended after the reasoning
        ids, attn, reas, ans = with_reference_answer(mb, tokenizer, golds, s.reference_template)
        reas = reas & scored[:, None]
        clean = clean_kv = None
    if scorer == "gradient":
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
    return weights, nonfinite


assert not any(map(protocol_problem, METHODS.values())) and set(COMPARED) <= set(METHODS)
