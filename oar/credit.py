"""Token credit: the protocol from what a step has to token weights w_it, and the table of methods.

Legend: B this process's rollouts (P prompts x G, a prompt's group contiguous and on one process),
b a micro-batch's rollouts, L positions (prompt width Lp + completion), T = L - Lp completion
positions, V vocabulary.

The loss takes token advantages A_it = A_i w_it (maths §1.2) and never branches on the method: a
method is only a way to fill w. `train.py --method NAME` picks one from the table, METHODS (their
functions are oar/credit_methods.py's, which call the maths on plain tensors):

  grpo          w = 1                                                      (the reference)
  oar-g, oar-p  OAR's scores through the bi-level gate (maths §3-5; oar_grad.py, oar_perturb.py)
  entropy       the update forward's token entropy through the same gate
  entropy-mask  1 on the top-lambda entropy tokens of the whole step, else 0 (oar/entropy_credit.py)
  tempo         prefix-tree credit from the group's own rewards, may be < 0 (oar/tempo.py)
  oar-g+tempo   BEYOND THE PAPER: OAR-G's weights plus TEMPO's TD term at branch tokens,
                A_it = A_i w^OAR_it + (V(child) - V(node)) / d, i.e. w = w^OAR + (w^TEMPO - 1): OAR keeps
                its gate on the written computation, the forks it under-weights get their group's
                credit. Mass: OAR's (preserved) plus one token's worth; sign: can flip, as TEMPO's.
  random-gate   BEYOND THE PAPER, a control: uniform random scores (from each rollout's seed) through
                the same gate: what the gate does to learning when its scores carry no information.
  grail         a comparator (GRAIL, arXiv 2606.04889): each reasoning token's saliency for the answer's
                likelihood, log and z-scored per rollout, clipped to [0.5, 5], on wrong rollouts only
                (oar/grail.py; no gate, no mass preservation)

The protocol (docs/credit-methods.md has a worked example). A method is a `CreditMethod`, a name and
two functions, which train.py calls in its steps 4 and 5:
  prepare(step) -> state            once per step, before the update, with everything the step has
                                    (`Step`): what a method needs of the WHOLE step is computed here
                                    (TEMPO's trees; entropy-mask's threshold over every process's
                                    tokens, through `step.gather`). Default: nothing.
  weigh(step, state, micro) -> w    once per micro-batch of the update's first pass (`MicroBatch`: its
                                    rows and that pass's forward, whose logits OAR reuses as its clean
                                    pass): weights (b, L') over the rollouts' layout at the micro-batch's
                                    own width (`micro.rollouts.input_ids.shape`: the step's prompt columns,
                                    the right padding all its rows share cut; a (B, L) state of prepare's
                                    is cut to it), of which the loss reads the completion columns; or
                                    (w, n) with n the rollouts whose scores were not finite (w = 1).
So a method's weights can be, and every built-in's are, a function of the step, never of the
micro-batching or of the number of processes (tests/package/test_credit.py, tests/package/test_distributed.py).
`step_credit` runs a method's prepare and checks, for every method, what the loss relies on: finite
float weights of the micro-batch's shape, constants of the loss.

A method of one's own needs no edit here. `--credit_module M` names a module (a path to a .py file,
or a dotted name on the Python path) that lists its methods in `CREDIT_METHODS`; they join the
built-ins for that run: `--credit_module examples/position_decay.py --method position-decay`.
A list the module defines rather than a `register()` call it makes on import: nothing global changes,
so a run's table is a function of its config (saved in config.json; a resume must name the same
module), two runs in one process never see each other's methods, and a module imported twice cannot
register twice. A module that does not import, a method that breaks the protocol, or a name that
clashes with a built-in stops the run in train.py's first checks, before anything loads.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

import torch

from oar import credit_methods as builtin
from oar.credit_settings import CreditSettings
from oar.rollout import Rollout

__all__ = [
    "METHODS",
    "CreditError",
    "CreditMethod",
    "CreditSettings",
    "MicroBatch",
    "Step",
    "StepCredit",
    "credit_methods",
    "module_methods",
    "protocol_problem",
    "step_credit",
]


# -- the protocol ----------------------------------------------------------------------------------


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
    """One micro-batch of the update: rollouts `step.rollouts.select(rows).trimmed()` (b rows at their own width
    L' = Lp + T': the step's prompt columns, then completion columns up to the micro-batch's longest row) and
    the update forward's outputs. `logits` (b, T' + 1, V), detached, from column Lp - 1 (logits[:, t] predicts
    completion token t), are made on first read: train.py's forward keeps hidden states, not logits (oar/head.py),
    so a method that does not read them costs no (b, T', V) tensor."""

    rows: slice  # into the step's B rows
    rollouts: Rollout  # b rows, L' columns
    source: Any  # the logits (b, T' + 1, V) as a tensor, or a function of no argument that makes them
    clean: Any = None  # OAR's clean outcome from that forward (probes.clean_forward), when uses_clean, else None
    clean_kv: Any = None  # and its keys/values

    @functools.cached_property
    def logits(self) -> torch.Tensor:
        """(b, T' + 1, V) the update forward's logits, detached (made once, on first read)."""
        return (self.source() if callable(self.source) else self.source).detach()


def _nothing(step: Step) -> None:
    return None


@dataclass(frozen=True)
class CreditMethod:
    """A token-credit method: `weigh(step, prepare(step), micro)` -> weights (b, L) (the module docstring)."""

    name: str  # what --method selects
    weigh: Callable[[Step, Any, MicroBatch], Any]
    prepare: Callable[[Step], Any] = _nothing
    # False: w = 1 whatever the step (GRPO): no rollout counts as scored and a sharded model is not gathered
    scores: bool = True
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


# -- the table -------------------------------------------------------------------------------------

METHODS = MappingProxyType(
    {
        m.name: m
        for m in (
            CreditMethod("grpo", builtin.ones, scores=False),
            CreditMethod("oar-g", builtin.oar_scorer("gradient"), uses_clean=True),
            CreditMethod("oar-p", builtin.oar_scorer("perturbation"), uses_clean=True),
            CreditMethod("entropy", builtin.entropy_gate),
            CreditMethod("entropy-mask", builtin.precomputed, prepare=builtin.entropy_mask_prepare),
            CreditMethod("tempo", builtin.precomputed, prepare=builtin.tempo_prepare),
            CreditMethod("oar-g+tempo", builtin.oar_g_plus_tempo, prepare=builtin.tempo_prepare, uses_clean=True),
            CreditMethod("random-gate", builtin.random_gate, prepare=builtin.random_gate_prepare),
            CreditMethod("grail", builtin.grail),
        )
    }
)
assert not any(map(protocol_problem, METHODS.values()))


def credit_methods(module: str = "") -> MappingProxyType:
    """The table a run chooses from: name -> CreditMethod, the built-ins then `module`'s (`module_methods`:
    CreditError if unusable)."""
    if not module:
        return METHODS
    return MappingProxyType({**METHODS, **{m.name: m for m in module_methods(module, tuple(METHODS))}})


@functools.cache
def module_methods(module: str, builtins: tuple[str, ...] = ()) -> tuple[CreditMethod, ...]:
    """The methods `module` (a dotted name or a .py path) lists in CREDIT_METHODS, checked, none named
    as one of `builtins`; cached, so every call of a run (its checks, train.py, step_credit) sees the same
    objects. A module that does not import, lists no methods, breaks the protocol, clashes with a built-in
    name or lists a name twice raises a CreditError that names it (docs/credit-methods.md)."""
    where = f"--credit_module {module}"
    try:
        if module.endswith(".py"):
            path = Path(module).resolve()
            if not path.is_file():
                raise CreditError(
                    f"{where}: no such file; pass a path to a .py file or a dotted module name on the Python path."
                )
            spec = importlib.util.spec_from_file_location(f"oar_credit_module_{path.stem}", path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod  # dataclasses and pickling look their module up here
            try:
                spec.loader.exec_module(mod)
            except BaseException:
                del sys.modules[spec.name]
                raise
        else:
            mod = importlib.import_module(module)
    except CreditError:
        raise
    except Exception as err:  # the user's module: any error in it is the user's to fix, and named
        raise CreditError(
            f"{where}: could not import it ({type(err).__name__}: {err}); pass a path to a .py "
            f"file or a dotted module name on the Python path (PYTHONPATH)."
        ) from None
    listed = getattr(mod, "CREDIT_METHODS", None)
    if not isinstance(listed, (list, tuple)) or not listed:
        raise CreditError(
            f"{where}: defines no CREDIT_METHODS, a non-empty list of oar.credit.CreditMethod "
            "(docs/credit-methods.md)."
        )
    names = set()
    for k, m in enumerate(listed):
        problem = protocol_problem(m)
        if problem:
            raise CreditError(f"{where}: CREDIT_METHODS[{k}]: {problem} (the protocol: docs/credit-methods.md).")
        if m.name in builtins:
            raise CreditError(
                f"{where}: method {m.name!r} clashes with the built-in method of that name; give it another name."
            )
        if m.name in names:
            raise CreditError(f"{where}: method {m.name!r} is listed twice in CREDIT_METHODS.")
        names.add(m.name)
    return tuple(listed)


# -- one step's credit -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCredit:
    """A method prepared for one step (`step_credit`); `weigh` gives each micro-batch's checked weights."""

    method: CreditMethod
    step: Step
    state: Any  # what prepare returned
    seconds_per_rollout: float  # prepare's time, shared out over the step's rollouts

    def weigh(self, rows: slice, mb: Rollout, logits, clean=None, clean_kv=None):
        """(weights (b, L'), 0 outside the completion; seconds; rollouts with non-finite scores) for the
        micro-batch `mb = ro.select(rows)` (or its `trimmed()` columns, L' of them), whose `logits` (b, T' + 1, V)
        are the update forward's from column Lp - 1: a tensor, or a function that makes them when the method reads
        them. Seconds: the micro-batch's weigh plus its rollouts' share of prepare."""
        method, start = self.method, time.perf_counter()
        micro = MicroBatch(rows, mb, logits, clean, clean_kv)
        out = user_call(method, self.step.settings, f"in weigh on rows {rows.start}:{rows.stop}", method.weigh)(
            self.step, self.state, micro
        )
        weights, nonfinite = out if isinstance(out, tuple) else (out, 0)
        # what the loss relies on, checked for every method: one finite float weight per position
        shape = tuple(mb.input_ids.shape)
        if not (isinstance(weights, torch.Tensor) and weights.is_floating_point() and weights.shape == shape):
            got = (
                f"{weights.dtype} of shape {tuple(weights.shape)}"
                if isinstance(weights, torch.Tensor)
                else f"a {type(weights).__name__}"
            )
            raise CreditError(
                f"credit method {method.name!r}: weigh returned {got}; it must return float weights of "
                f"the micro-batch's shape {shape} (b, L': micro.rollouts.input_ids.shape)."
            )
        if not torch.isfinite(weights).all():
            raise CreditError(
                f"credit method {method.name!r}: weigh returned non-finite weights for rows {rows}; give a "
                f"rollout whose scores are not finite weights 1 and count it (the (w, n) return)."
            )
        # maths §5: the completion keeps its weights, padding (and the prompt) gets 0; weights are constants of
        # the loss (a method that read the model with a graph, e.g. a plugin without no_grad, must add no gradient)
        weights = weights.detach() * mb.completion_mask
        if not method.scores and not torch.equal(weights, mb.completion_mask.to(weights.dtype)):
            raise CreditError(
                f"credit method {method.name!r}: scores=False promises weights 1 (nothing is scored, gathered "
                f"or logged for it), but weigh returned others; declare scores=True."
            )
        return weights, time.perf_counter() - start + self.seconds_per_rollout * len(mb), int(nonfinite)

    __call__ = weigh  # step_credit(...)(rows, mb, logits, ...) as before


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
) -> StepCredit:
    """Credit for one step: runs `settings.method`'s prepare on the whole step and returns it ready to weigh
    micro-batches (`StepCredit.weigh`). rewards, advantages, scored (B,): this process's; `scored` marks the
    rollouts whose weights matter (advantage != 0 and a valid token): the others get 1 from the scoring
    methods (their loss is 0 whatever w). `gather(x)`: all processes' 1-D `x` concatenated (identity on one)."""
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
    state = user_call(method, settings, f"in prepare on a step of {len(ro)} rollouts", method.prepare)(step)
    return StepCredit(method, step, state, (time.perf_counter() - start) / max(1, len(ro)))


class MethodRaised(CreditError):
    """A --credit_module method raised; the message names it, the error, the file and line, and the call."""


def user_call(method: CreditMethod, settings: CreditSettings, call: str, fn: Callable) -> Callable:
    """`fn` (a method's prepare or weigh) as it is for a built-in (an exception is a bug, with its traceback),
    and for a method of --credit_module's with its exceptions turned into one MethodRaised line: a method
    that passed the trial on a synthetic step can still fail on a real one."""
    if method.name in METHODS:
        return fn

    def called(*args):
        try:
            return fn(*args)
        except CreditError:
            raise
        except Exception as err:
            where = traceback.extract_tb(err.__traceback__)[-1]
            raise MethodRaised(
                f"credit method {method.name!r} (--credit_module {settings.credit_module}) raised "
                f"{type(err).__name__}: {err} at {where.filename}:{where.lineno}, {call}."
            ) from None

    return called
