"""The token-credit protocol: what a method is given (`Step`, `MicroBatch`) and what it is (`CreditMethod`).

Legend: B this process's rollouts (P prompts x G, a prompt's group contiguous and on one process),
b a micro-batch's rollouts, L positions (prompt width Lp + completion), T = L - Lp completion
positions, V vocabulary.

A method is a `CreditMethod`: a name and two functions, called in train.py's steps 4 (prepare) and
5 (weigh, in oar/training/update.py's micro-batch loop):
  prepare(step) -> state            once per step, before the micro-batch loop, with everything the
                                    step has (`Step`): what a method needs of the WHOLE step is
                                    computed here (TEMPO's trees; entropy-mask's threshold over every
                                    process's tokens, through `step.gather`). Default: nothing.
  weigh(step, state, micro) -> w    once per micro-batch (`MicroBatch`: its rows and the update
                                    forward's logits): weights (b, L) over the sequence layout, of
                                    which the loss reads the completion columns; or (w, n) with n the
                                    rollouts whose scores were not finite (they should get w = 1).
So a method's weights can be, and every built-in's are, a function of the step, never of the
micro-batching or of the number of processes (tests/test_credit.py, tests/test_distributed.py).

Users import these names from `oar.credit` (the table of methods, which uses them); they live in a
module of their own so that the built-ins (oar/credit_adapters.py) and the table that lists them
(oar/credit.py) both depend on the protocol, and not on each other.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from oar.credit_settings import CreditSettings
from oar.rollout import Rollout


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
    probe: str  # this step's outcome probe (maths §2)
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
    scores: bool = (
        True  # False: w = 1 whatever the step (GRPO): no rollout counts as scored, a sharded model is not gathered
    )
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
