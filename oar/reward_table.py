"""The reward r_i as a table of terms, like the credit methods: `--reward` picks terms and weights,
`--reward_module` adds functions of one's own (docs/rewards.md).

A reward function takes (completion, gold, problem), three strings (the completion's text, the raw
gold answer, the problem statement), and returns a finite number. A run's reward is the weighted sum

    r_i = sum_k c_k f_k(completion_i, gold_i, problem_i)

of the terms `--reward` names, comma-separated `name` or `name:weight` (weight c_k, default 1):

    --reward correct                                # the default: r_i = 1 if the answer is right, else 0
    --reward correct,format:0.1                     # + 0.1 for any final answer, right or wrong
    --reward correct,length:-0.001                  # - 0.001 per character of the completion

BUILTIN (the functions: oar/rewards.py): `correct` (`oar.rewards.reward`: answer correctness, the
paper's reward), `format` (a final-answer marker holding an answer) and `length` (characters). The
default is the paper's reward to the bit: 0.0 + 1.0 * r is r, so `--reward correct` leaves every
number of a run as it was before the table existed. Each term is logged as `reward/<name>`, the
step's mean of its unweighted values; `reward/mean` and the other reward/ metrics stay the total's.

`--reward_module M` names a module (a path to a .py file, or a dotted name on the Python path) whose
`REWARD_FUNCTIONS`, a dict name -> function, join BUILTIN for that run; `--reward` then names them
like the built-ins. A module without that dict offers its TRL-style functions instead, each by its name.
As for credit modules (oar/credit.py says why a table and not a register call), nothing global changes.

TRL's form is taken as TRL calls it: a function with a parameter named `completions` is called once per
step with keyword lists, one entry per rollout, `f(prompts=..., completions=..., **columns)`: the prompts as
the data set gives them (its `prompt` value, else its problem), the completions (strings, or TRL's
[{"role": "assistant", "content": ...}] when the row's prompt is a conversation) and every column of the
rows (`answer`, `solution`, any other; the built-in arith task's are `problem` and `answer`). It returns
one value per rollout, a finite number or None: None means the term cannot score that rollout and adds
nothing to its reward (TRL's sum, which skips None); a rollout no term could score is not scorable, and
gets advantage 0 without entering its group's baseline (oar.grpo.group_advantages' `scorable`).

Checked before anything loads, each failure a RewardError naming the module
or the term: the module imports and defines the dict; every name is new (not a built-in, not a
metric that reward/ already logs) and plain (letters, digits, `_`, `-`); every function takes
(completion, gold, problem) and, called once on EXAMPLE, returns a finite number; `--reward` names
known terms with finite weights, each once. A TRL-style function is tried once after the data loads, on
the first training row's columns (`try_on_row`: its columns are the data set's). During the run a
function that raises or returns a non-finite value stops it with the term and the rollout named: a NaN
reward would silently poison every advantage of its group.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from oar.rewards import correctness_reward, format_reward, length_reward

RewardFunction = Callable[[str, str, str], float]  # (completion, gold, problem) -> a finite number
# TRL's form: (prompts=[...], completions=[...], **columns) -> [a finite number or None per rollout]
BatchRewardFunction = Callable[..., list]

BUILTIN = MappingProxyType({"correct": correctness_reward, "format": format_reward, "length": length_reward})
DEFAULT = "correct"
RESERVED = ("mean", "std", "frac_zero_std_groups")  # reward/<name> metrics that the total already logs
EXAMPLE = ("2 + 3 = 5. The answer is 5.", "5", "Compute 2 + 3.")  # (completion, gold, problem): the trial call
_NAME = re.compile(r"[A-Za-z0-9_-]+")


class RewardError(ValueError):
    """A --reward or --reward_module the run cannot use; the message names it and the fix."""


@dataclass(frozen=True)
class RewardTerm:
    """One term c_k f_k of the reward."""

    name: str  # what --reward names; logged as reward/<name>
    weight: float  # c_k
    fn: RewardFunction | BatchRewardFunction
    builtin: bool

    @property
    def batch(self) -> bool:
        """TRL's form: called once on the step's rollouts with keyword lists (module docstring)."""
        return is_batch(self.fn)


def is_batch(fn) -> bool:
    """Whether `fn` has TRL's form: a parameter named `completions`."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


def reward_functions(module: str = "") -> MappingProxyType:
    """name -> function: BUILTIN, then `module`'s REWARD_FUNCTIONS (loaded and checked once)."""
    return MappingProxyType({**BUILTIN, **module_rewards(module)}) if module else BUILTIN


@functools.cache
def reward_terms(spec: str = DEFAULT, module: str = "") -> tuple[RewardTerm, ...]:
    """The terms of `--reward spec` (with `--reward_module module`), checked; cached, so every call of a
    run (check_config, train.py) sees the same functions."""
    table = reward_functions(module)
    terms, seen = [], set()
    for part in spec.split(","):
        name, colon, weight = part.strip().partition(":")
        name = name.strip()
        if not name:
            raise RewardError(
                f"--reward {spec}: an empty term; write comma-separated name or name:weight, e.g. correct,format:0.1."
            )
        if name not in table:
            where = (
                f"with --reward_module {module}" if module else "or name a module that defines it with --reward_module"
            )
            raise RewardError(f"--reward {spec}: unknown reward {name!r}; choose from {', '.join(table)} ({where}).")
        if name in seen:
            raise RewardError(f"--reward {spec}: {name!r} is named twice; give each reward once, with its weight.")
        try:
            c = float(weight) if colon else 1.0
        except ValueError:
            c = math.nan
        if not math.isfinite(c):
            raise RewardError(
                f"--reward {spec}: the weight of {name!r} must be a finite number, as in {name}:0.5, got "
                f"{weight.strip()!r}."
            )
        seen.add(name)
        terms.append(RewardTerm(name, c, table[name], name in BUILTIN))
    return tuple(terms)


def score(
    terms: tuple[RewardTerm, ...],
    completions: list[str],
    golds: list[str],
    problems: list[str],
    rows: list[dict | None] | None = None,
) -> tuple[list[float], dict]:
    """(r_i for each rollout, {name: [f_k(rollout i)]}): the weighted sums and each term's own values.
    The sum starts at 0.0 and adds the terms in --reward's order (the default's r_i is `reward`'s value);
    a TRL-style term's None adds nothing (`scorable` says which rollouts some term scored). `rows`: each
    rollout's data row (the columns a TRL-style term is passed; None: the problem and its answer)."""
    assert len(completions) == len(golds) == len(problems), (len(completions), len(golds), len(problems))
    rows = rows if rows is not None else [None] * len(completions)
    parts = {
        t.name: _batch_values(t, completions, golds, problems, rows)
        if t.batch
        else [_value(t, i, c, g, p) for i, (c, g, p) in enumerate(zip(completions, golds, problems))]
        for t in terms
    }
    totals = []
    for i in range(len(completions)):
        total = 0.0
        for t in terms:
            if parts[t.name][i] is not None:
                total += t.weight * parts[t.name][i]
        totals.append(total)
    return totals, parts


def scorable(parts: dict[str, list]) -> list[bool]:
    """Per rollout, whether some term scored it (a TRL-style term's None does not); every rollout when no
    term returned None."""
    values = list(parts.values())
    return [any(v[i] is not None for v in values) for i in range(len(values[0]))] if values else []


def trl_arguments(completions: list[str], golds: list[str], problems: list[str], rows: list) -> dict[str, list]:
    """The keyword lists a TRL-style function is called with, one entry per rollout: prompts, completions, and
    every column of the rows (None where a row lacks one); a row of None stands for {problem, answer}."""
    rows = [row if row is not None else {"problem": p, "answer": g} for row, g, p in zip(rows, golds, problems)]
    chat = [_conversational(row) for row in rows]
    prompts = [_prompt(row, p) for row, p in zip(rows, problems)]
    said = [[{"role": "assistant", "content": c}] if talk else c for c, talk in zip(completions, chat)]
    columns = {k: [row.get(k) for row in rows] for k in dict.fromkeys(k for row in rows for k in row) if k != "prompt"}
    return {"prompts": prompts, "completions": said, **columns}


def _conversational(row: dict) -> bool:
    return isinstance(row.get("prompt"), list) or (row.get("prompt") is None and isinstance(row.get("messages"), list))


def _prompt(row: dict, problem: str):
    """A row's prompt as TRL would pass it: its `prompt`, else a `messages` conversation without its assistant
    turn, else the problem statement."""
    if row.get("prompt") is not None:
        return row["prompt"]
    if isinstance(row.get("messages"), list):
        return [t for t in row["messages"] if not (isinstance(t, dict) and t.get("role") == "assistant")]
    return problem


def _batch_values(term: RewardTerm, completions, golds, problems, rows) -> list[float | None]:
    """A TRL-style term's values on the step's rollouts: one call, its list checked entry by entry."""
    kwargs = trl_arguments(completions, golds, problems, rows)
    where = f"--reward {term.name}"
    try:
        values = term.fn(**kwargs)
    except Exception as err:  # the user's function: its error is the user's to fix, and named
        raise RewardError(
            f"{where}: raised on a step's {len(completions)} rollouts ({type(err).__name__}: {err}); it is called "
            f"TRL's way, with the keyword lists {', '.join(kwargs)}."
        ) from None
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        got = (
            f"{len(values)} values" if isinstance(values, (list, tuple)) else f"{type(values).__name__} {values!r:.40}"
        )
        raise RewardError(
            f"{where}: returned {got} for {len(completions)} completions; a TRL-style reward returns a list with "
            f"one finite number (or None) per completion."
        )
    for i, value in enumerate(values):
        if value is not None and (problem_text := _not_finite(value)):
            raise RewardError(
                f"{where}: returned {problem_text} for rollout {i} (problem {problems[i][:60]!r}, completion "
                f"{completions[i][:60]!r}); a reward must be a finite number, or None where it does not apply."
            )
    return [None if v is None else float(v) for v in values]


def try_on_row(terms: tuple[RewardTerm, ...], row: dict | None, gold: str, problem: str) -> None:
    """Call each TRL-style term once, on one rollout of the run's first training row (`EXAMPLE`'s completion),
    before the model loads: a column it needs and the data lacks stops the run in one line."""
    for term in terms:
        if term.batch:
            try:
                _batch_values(term, [EXAMPLE[0]], [gold], [problem], [row])
            except RewardError as err:
                columns = sorted(trl_arguments([EXAMPLE[0]], [gold], [problem], [row]))
                raise RewardError(f"{err} Tried before training on the first training row (arguments: {columns}).")


def _value(term: RewardTerm, i: int, completion: str, gold: str, problem: str) -> float:
    if term.builtin:  # pure and total (oar/rewards.py: nothing raises)
        return term.fn(completion, gold, problem)
    try:
        value = term.fn(completion, gold, problem)
    except Exception as err:  # the user's function: its error is the user's to fix, and named
        raise RewardError(
            f"--reward {term.name}: raised on rollout {i} ({type(err).__name__}: {err}); "
            f"problem {problem[:60]!r}, completion {completion[:60]!r}."
        ) from None
    problem_text = _not_finite(value)
    if problem_text:
        raise RewardError(
            f"--reward {term.name}: returned {problem_text} on rollout {i} (problem {problem[:60]!r}, "
            f"completion {completion[:60]!r}); a reward must be a finite number."
        )
    return float(value)


def _not_finite(value) -> str | None:
    """What makes `value` not a finite real number, or None."""
    if not isinstance(value, numbers.Real):
        return f"{type(value).__name__} {value!r:.40}"
    return None if math.isfinite(value) else repr(float(value))


def unnamed_rewards(spec: str, module: str) -> list[str]:
    """The rewards `module` defines that `--reward spec` leaves out (a run says so: a TRL user's habit is
    to pass the functions and expect them used)."""
    named = {part.partition(":")[0].strip() for part in spec.split(",")}
    return [name for name in module_rewards(module) if name not in named] if module else []


@functools.cache
def module_rewards(module: str) -> MappingProxyType:
    """`module`'s REWARD_FUNCTIONS (a dotted name or a .py path), each checked on EXAMPLE."""
    where = f"--reward_module {module}"
    mod = _import(module, where)
    listed = getattr(mod, "REWARD_FUNCTIONS", None)
    if listed is None:  # a TRL user's file: its own functions of TRL's form, by name
        listed = {
            name: fn
            for name, fn in vars(mod).items()
            if inspect.isfunction(fn) and fn.__module__ == mod.__name__ and not name.startswith("_") and is_batch(fn)
        }
    if not isinstance(listed, dict) or not listed:
        raise RewardError(
            f"{where}: defines no REWARD_FUNCTIONS, a non-empty dict of name -> function(completion, gold, "
            f"problem) -> float, nor a function of TRL's form f(completions, **kwargs) -> list (docs/rewards.md)."
        )
    for name, fn in listed.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RewardError(
                f"{where}: reward name {name!r} must be letters, digits, '_' or '-' (it is written in --reward "
                f"and logged as reward/<name>)."
            )
        if name in BUILTIN or name in RESERVED:
            what = "the built-in reward" if name in BUILTIN else "the metric reward/" + name
            raise RewardError(f"{where}: reward {name!r} clashes with {what} of that name; give it another name.")
        if not callable(fn):
            raise RewardError(f"{where}: reward {name!r} is {fn!r:.60}, not a function.")
        if is_batch(fn):  # TRL's form: tried once the data is loaded, on its columns (try_on_row)
            continue
        try:
            inspect.signature(fn).bind(*EXAMPLE)
        except TypeError:
            raise RewardError(
                f"{where}: reward {name!r}{inspect.signature(fn)} must take (completion, gold, problem), or have "
                f"TRL's form f(completions, **kwargs) -> list."
            ) from None
        except ValueError:  # no signature to read (a builtin): the call below checks it
            pass
        try:
            value = fn(*EXAMPLE)
        except Exception as err:
            raise RewardError(
                f"{where}: reward {name!r} raised on the example (completion, gold, problem) = {EXAMPLE} "
                f"({type(err).__name__}: {err})."
            ) from None
        problem = _not_finite(value)
        if problem:
            raise RewardError(
                f"{where}: reward {name!r} returned {problem} on the example (completion, gold, problem) = "
                f"{EXAMPLE}; a reward must be a finite number."
            )
    return MappingProxyType(dict(listed))


def _import(module: str, where: str):
    """The module a --reward_module names: a .py path (loaded under its own name) or a dotted name."""
    try:
        if module.endswith(".py"):
            path = Path(module).resolve()
            if not path.is_file():
                raise RewardError(
                    f"{where}: no such file; pass a path to a .py file or a dotted module name on the Python path."
                )
            spec = importlib.util.spec_from_file_location(f"oar_reward_module_{path.stem}", path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod  # pickling and dataclasses look their module up here
            try:
                spec.loader.exec_module(mod)
            except BaseException:
                del sys.modules[spec.name]
                raise
            return mod
        return importlib.import_module(module)
    except RewardError:
        raise
    except Exception as err:  # the user's module: any error in it is the user's to fix, and named
        raise RewardError(
            f"{where}: could not import it ({type(err).__name__}: {err}); pass a path to a .py "
            f"file or a dotted module name on the Python path (PYTHONPATH)."
        ) from None
