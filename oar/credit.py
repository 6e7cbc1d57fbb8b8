"""Token credit: one protocol from what a step has to token weights w_it, and the table of methods.

Legend: B this process's rollouts (P prompts x G, a prompt's group contiguous and on one process),
b a micro-batch's rollouts, L positions (prompt width Lp + completion), T = L - Lp completion
positions, V vocabulary.

The loss takes token advantages A_it = A_i w_it (maths §1.2) and never branches on the method:
a method is only a way to fill w. `train.py --method NAME` picks one from the table, METHODS:

  grpo          w = 1                                                      (the reference)
  oar-g, oar-p  OAR's scores through the bi-level gate (maths §3-5; oar_grad.py, oar_perturb.py)
  entropy       the update forward's token entropy through the same gate     (credit_adapters.entropy_gate)
  entropy-mask  1 on the top-rho entropy tokens of the whole step, else 0    (oar/entropy_credit.py)
  tempo         prefix-tree credit from the group's own rewards, may be < 0 (oar/tempo.py)
  oar-g+tempo   BEYOND THE PAPER: OAR-G's weights plus TEMPO's TD term at branch tokens,
                A_it = A_i w^OAR_it + (V(child) - V(node)) / d, i.e. w = w^OAR + (w^TEMPO - 1): OAR keeps
                its gate on the written computation, the forks it under-weights get their group's
                credit. Mass: OAR's (preserved) plus one token's worth; sign: can flip, as TEMPO's.
  random-gate   BEYOND THE PAPER, a control: uniform random scores (from each rollout's seed) through
                the same gate: what the gate does to learning when its scores carry no information
                (oar/credit_adapters.py).

The protocol (docs/credit-methods.md has a worked example; oar/credit_protocol.py): a method is a
`CreditMethod`, a name and two functions, `prepare(step) -> state` once per step (with the whole
`Step`) and `weigh(step, state, micro) -> w` once per micro-batch (`MicroBatch`), which return
weights (b, L). The built-ins' functions are oar/credit_adapters.py's: each takes a `Step` and calls
the maths (oar_grad, oar_perturb, gating, entropy_credit, tempo), which take plain tensors.
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

import time
from types import MappingProxyType
from typing import Callable

import torch

from oar.credit_adapters import (
    entropy_gate,
    entropy_mask_prepare,
    oar_g_plus_tempo,
    oar_scorer,
    ones,
    precomputed,
    random_gate,
    random_gate_prepare,
    tempo_prepare,
)
from oar.credit_modules import module_methods
from oar.credit_protocol import CreditError, CreditMethod, CreditSettings, MicroBatch, Step, protocol_problem
from oar.rollout import Rollout

COMPARED = ("grpo", "oar-g", "oar-p", "entropy", "entropy-mask", "tempo")  # the paper's methods and the comparators


def credit_methods(module: str = "") -> MappingProxyType:
    """The table a run chooses from: name -> CreditMethod, the built-ins then `module`'s, loaded and
    checked by oar/credit_modules.py (CreditError if unusable)."""
    if not module:
        return METHODS
    return MappingProxyType({**METHODS, **{m.name: m for m in module_methods(module, tuple(METHODS))}})


def step_credit(
    settings: CreditSettings,
    model,
    tokenizer,
    ro: Rollout,
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    scored: torch.Tensor,
    seeds: list[int],
    golds: list[str],
    probe: str,
    *,
    gather: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
):
    """Credit for one step: runs the method's prepare and returns `weigh(rows, mb, logits, clean=None,
    clean_kv=None) -> (weights (b, L), 0 outside the completion; seconds; non-finite rows)` for the micro-batch `mb =
    ro.select(rows)`,
    whose `logits` (b, T + 1, V) are the update forward's from column Lp - 1 (as train.py keeps them).
    Seconds: the micro-batch's weigh plus its rollouts' share of prepare.

    rewards, advantages, scored (B,): this process's; `scored` marks the rollouts whose weights
    matter (advantage != 0 and a valid token): the others get 1 from the scoring methods (their loss
    is 0 whatever w). `gather(x)`: all processes' 1-D `x` concatenated (identity on one process)."""
    assert rewards.shape == advantages.shape == scored.shape == (len(ro),), (
        rewards.shape,
        advantages.shape,
        scored.shape,
    )
    table = credit_methods(settings.credit_module)
    if settings.method not in table:
        raise CreditError(f"method {settings.method!r}: choose one of {', '.join(table)}.")
    method = table[settings.method]
    step = Step(settings, model, tokenizer, ro, rewards, advantages, scored, list(seeds), list(golds), probe, gather)
    start = time.perf_counter()
    state = method.prepare(step)
    per_rollout = (time.perf_counter() - start) / max(1, len(ro))

    def weigh(rows, mb, logits, clean=None, clean_kv=None):
        start = time.perf_counter()
        out = method.weigh(step, state, MicroBatch(rows, mb, logits, clean, clean_kv))
        weights, nonfinite = out if isinstance(out, tuple) else (out, 0)
        # what the loss relies on, checked for every method: one finite float weight per position
        if not (
            isinstance(weights, torch.Tensor) and weights.is_floating_point() and weights.shape == mb.input_ids.shape
        ):
            got = (
                f"{weights.dtype} of shape {tuple(weights.shape)}"
                if isinstance(weights, torch.Tensor)
                else f"a {type(weights).__name__}"
            )
            raise CreditError(
                f"credit method {method.name!r}: weigh returned {got}; it must return float weights of "
                f"the micro-batch's shape {tuple(mb.input_ids.shape)} (b, L)."
            )
        if not torch.isfinite(weights).all():
            raise CreditError(
                f"credit method {method.name!r}: weigh returned non-finite weights for rows {rows}; give a "
                f"rollout whose scores are not finite weights 1 and count it (the (w, n) return)."
            )
        # maths §5: the completion keeps its weights, padding (and the prompt) gets 0; weights are constants of the
        # loss (a method that read the model with a graph, e.g. a plugin without no_grad, must not add a gradient)
        weights = weights.detach() * mb.completion_mask
        if not method.scores and not torch.equal(weights, mb.completion_mask.to(weights.dtype)):
            raise CreditError(
                f"credit method {method.name!r}: scores=False promises weights 1 (nothing is scored, gathered "
                f"or logged for it), but weigh returned others; declare scores=True."
            )
        return weights, time.perf_counter() - start + per_rollout * len(mb), int(nonfinite)

    return weigh


# -- the built-ins (their functions: oar/credit_adapters.py) --------------------------------------

METHODS = MappingProxyType(
    {
        m.name: m
        for m in (  # the order of the study's tables
            CreditMethod("grpo", ones, scores=False),
            CreditMethod("oar-g", oar_scorer("gradient"), uses_clean=True),
            CreditMethod("oar-p", oar_scorer("perturbation"), uses_clean=True),
            CreditMethod("entropy", entropy_gate),
            CreditMethod("entropy-mask", precomputed, prepare=entropy_mask_prepare),
            CreditMethod("tempo", precomputed, prepare=tempo_prepare),
            CreditMethod("oar-g+tempo", oar_g_plus_tempo, prepare=tempo_prepare, uses_clean=True),
            CreditMethod("random-gate", random_gate, prepare=random_gate_prepare),
        )
    }
)


assert not any(map(protocol_problem, METHODS.values())) and set(COMPARED) <= set(METHODS)
