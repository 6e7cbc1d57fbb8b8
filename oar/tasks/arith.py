"""The built-in offline task `arith`: multi-step integer arithmetic with worked solutions.

A problem is a left-nested chain of operations, e.g. `Compute ((37 + 8) - 5) * 2.`, whose gold
answer is the integer result as a string ("80"). Its worked solution states every intermediate
result on its own line and ends with the final-answer marker the rewards use:

    37 + 8 = 45
    45 - 5 = 40
    40 * 2 = 80
    #### 80

Why this task: it needs no download, a model of ~1M parameters learns it partly in minutes on a
CPU, every answer is checkable exactly, and the reasoning span (the lines before `####`) really
moves the answer, which is what OAR's token weights are meant to find.

Conventions (choices of ours, not the paper's):
- Every intermediate result stays in [0, `max_value`], so answers are never negative.
- Train and test are disjoint by construction: an expression belongs to the test split iff
  crc32(expression) % 100 < TEST_PERCENT, whatever `n` and `seed` are asked for.
- Within one call the problems are distinct; the seed fixes the draw (Python's `random`, which is
  stable across platforms and versions for `randint`/`choice` on a str seed).
"""

from __future__ import annotations

import ast
import random
import zlib
from dataclasses import dataclass

from oar.tasks.problem import Problem

OPS = ("+", "-", "*")
TEST_PERCENT = 20  # share of all expressions that can only ever be in the test split
_PREFIX, _SUFFIX = "Compute ", "."


@dataclass(frozen=True)
class ArithConfig:
    """Difficulty knobs of `arith`. Checked on construction so a bad setting fails early."""

    min_ops: int = 2
    """Fewest operations in one problem (the solution has this many lines before `####`)."""
    max_ops: int = 3
    """Most operations in one problem; the count is drawn uniformly in [min_ops, max_ops]."""
    start_digits: int = 2
    """The first number is drawn in [1, 10**start_digits - 1]."""
    digits: int = 1
    """Operands of `+` and `-` are drawn in [1, 10**digits - 1]."""
    mul_digits: int = 1
    """Multipliers of `*` are drawn in [2, 10**mul_digits - 1]: one digit keeps products learnable."""
    ops: tuple[str, ...] = OPS
    """Allowed operations, a non-empty subset of ('+', '-', '*')."""
    max_value: int = 99
    """Every intermediate result stays in [0, max_value]; bounds the answer length."""

    def __post_init__(self):
        if not 1 <= self.min_ops <= self.max_ops:
            raise ValueError(
                f"ArithConfig: need 1 <= min_ops <= max_ops, got min_ops={self.min_ops}, max_ops={self.max_ops}."
            )
        if min(self.start_digits, self.digits, self.mul_digits) < 1:
            raise ValueError(
                f"ArithConfig: start_digits, digits and mul_digits must be >= 1, got "
                f"{self.start_digits}, {self.digits}, {self.mul_digits}."
            )
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"ArithConfig: ops must be a non-empty subset of {OPS}, got {self.ops!r}.")
        if self.max_value < 1:
            raise ValueError(f"ArithConfig: max_value must be >= 1, got {self.max_value}.")


DEFAULT_ARITH = ArithConfig()
"""The default RL and evaluation difficulty, e.g. `Compute ((37 + 8) - 5) * 2.`: 2-3 operations,
a 2-digit start, 1-digit operands, every result in [0, 99]. Sized so that tiny-arith, after its
few CPU minutes of supervised training, solves about a quarter of it (see oar/tasks/tiny_arith.py)."""


def split_of(expression: str) -> str:
    """'test' or 'train': a stable hash of the expression text decides, so splits never overlap."""
    return "test" if zlib.crc32(expression.encode()) % 100 < TEST_PERCENT else "train"


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _random_expression(rng: random.Random, config: ArithConfig) -> tuple[str, int] | None:
    """One left-nested expression and its value, or None when the draw hit a dead end.

    Each step picks an operation that can keep the running value in [0, max_value], then an
    operand in the range that does; a dead end (no such operation) is rare and simply redrawn.
    """
    hi = 10**config.digits - 1
    mul_hi = 10**config.mul_digits - 1
    value = rng.randint(1, min(10**config.start_digits - 1, config.max_value))
    text = str(value)
    for step in range(rng.randint(config.min_ops, config.max_ops)):
        ranges = {  # op -> inclusive operand range that keeps the result in [0, max_value]
            "+": (1, min(hi, config.max_value - value)),
            "-": (1, min(hi, value)),
            "*": (2, min(mul_hi, config.max_value // value) if value else mul_hi),
        }
        feasible = [op for op in config.ops if ranges[op][0] <= ranges[op][1]]
        if not feasible:
            return None
        op = rng.choice(feasible)
        operand = rng.randint(*ranges[op])
        # Parenthesise the running expression from the second step on, so the text reads in the
        # order the solution computes it, without relying on operator precedence.
        text = f"({text}) {op} {operand}" if step else f"{text} {op} {operand}"
        value = _apply(value, op, operand)
    return text, value


def arith_problems(
    n: int, *, split: str = "train", seed: int = 0, config: ArithConfig = DEFAULT_ARITH
) -> list[Problem]:
    """`n` distinct problems of `split` ('train' or 'test'), deterministic in (n, split, seed, config).

    Draws expressions and keeps those whose hash puts them in `split` (see `split_of`). Raises
    ValueError when the configuration has fewer than `n` distinct problems in that split.
    """
    if split not in ("train", "test"):
        raise ValueError(f"arith: split must be 'train' or 'test', got {split!r}.")
    rng = random.Random(f"arith:{split}:{seed}")
    seen: set[str] = set()
    problems: list[Problem] = []
    attempts, max_attempts = 0, 50 * n + 10_000
    while len(problems) < n:
        attempts += 1
        if attempts > max_attempts:
            raise ValueError(
                f"arith: found only {len(problems)} distinct {split} problems of {n} "
                f"asked for with {config}; ask for fewer or widen the config "
                f"(more digits, ops or max_ops)."
            )
        drawn = _random_expression(rng, config)
        if drawn is None or drawn[0] in seen or split_of(drawn[0]) != split:
            continue
        seen.add(drawn[0])
        problems.append(Problem(problem=f"{_PREFIX}{drawn[0]}{_SUFFIX}", answer=str(drawn[1])))
    return problems


def unseen_problems(
    n: int, exclude: set[str], *, pool: int, seed: int, config: ArithConfig = DEFAULT_ARITH
) -> list[Problem]:
    """Up to `n` train-split problems none of whose texts is in `exclude`: the first of a `pool`-sized
    draw with `seed` that are not excluded (a validation slice for choosing settings without
    touching the test split). Fewer than `n` when the pool runs out."""
    return [p for p in arith_problems(pool, split="train", seed=seed, config=config) if p.problem not in exclude][:n]


def arith_solution(problem: Problem | str) -> str:
    """The worked solution of an arith problem: one `a op b = c` line per operation, then `#### N`.

    Parses the expression with `ast` (never `eval`) and walks it in evaluation order, so it works
    for any tree of + - * over integers, not only the chains `arith_problems` generates.
    """
    text = problem.problem if isinstance(problem, Problem) else problem
    if not (text.startswith(_PREFIX) and text.endswith(_SUFFIX)):
        raise ValueError(
            f"arith_solution: {text!r} is not an arith problem (expected '{_PREFIX}<expression>{_SUFFIX}')."
        )
    expression = text[len(_PREFIX) : -len(_SUFFIX)]
    lines: list[str] = []
    symbols = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in symbols:
            a, b = walk(node.left), walk(node.right)
            op = symbols[type(node.op)]
            lines.append(f"{a} {op} {b} = {_apply(a, op, b)}")
            return _apply(a, op, b)
        raise ValueError(
            f"arith_solution: {text!r} contains {ast.dump(node)[:40]}; only integers and + - * are allowed."
        )

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as err:
        raise ValueError(f"arith_solution: cannot parse {expression!r}: {err.msg}.") from None
    answer = walk(tree.body)
    return "\n".join(lines + [f"#### {answer}"])
