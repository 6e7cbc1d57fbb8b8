"""Plant one wrong intermediate result in a GSM8K gold solution and carry it to the final answer.

A GSM8K solution writes each computation as `text <<expr=value>>value text`, and ends in `#### N`.
The calculator annotations give the dependency graph: an operand of step i that equals the value
of an earlier step j (numerically, exactly: Fractions) is a USE of step j. A plant:

  1. picks an intermediate step k (not the last one) that the last step depends on, transitively;
  2. changes its value v_k to v_k + d, d drawn from DELTAS (an off-by-a-little slip);
  3. re-evaluates every later annotation with the changed operands substituted (exact arithmetic),
     so every downstream result changes with it; the last step's new value is the new `#### N`;
  4. rewrites the visible text: the shown result after `>>` of every changed step, and every later
     verbatim occurrence of a changed step's old value (e.g. `She makes 9 * 2`) gets the new number,
     in the old one's style (thousands commas, decimals).

Rules that make the tracing reliable (a solution none of whose (k, d) pass is SKIPPED, with a reason):
  * parse: every annotation's expression is plain arithmetic (+ - * / parentheses) that evaluates
    EXACTLY to its stated value, that value is shown right after `>>`, and the last step's value is
    the `####` answer (else `unparsed`, `inexact`, `not_shown`, `last_not_answer`);
  * the old value of every changed step is unambiguous: it is not a number of the problem text, not
    the value of another step, not an operand of that step or of an earlier one, and not shown in the
    text before its own annotation (else the candidate is `ambiguous`);
  * every new value is clean (non-negative, at most 2 decimals, whole where the old one was), differs
    from the old one and from the other new values, and is no number of the original problem or
    solution (so the planted tokens are new text and each carried use is traceable); the final
    answer changes (else the candidate is `not_clean` / `collides` / `answer_unchanged`);
  * the planted solution parses again under the same rules, every annotation exact (checked).
The choice is deterministic: `random.Random(f"{seed}:{key}")` orders the candidate steps and deltas,
and the first candidate that passes is taken.

What it does not rewrite: a changed number written in words or another unit ("half", "50%" for a
step value 0.5), and a constant not in the problem (60 minutes) that happens to equal a changed
step's old value is taken as a use of that step. Both are rare; the annotated arithmetic is always
consistent after a plant.

`render` gives the text a model reads: annotations stripped (they double the token count and are not
what a model writes), `#### N` kept (oar.answers.find_answer reads it), with the character spans of
  planted   the new value where it first appears (the shown result of step k), and
  carried   every other rewritten number of the reasoning: later uses of v_k', the changed downstream
            results and their uses, except
  final     the last step's shown result, the number the `####` answer copies (the `####` answer
            itself is in none: it is the answer span).
For the unplanted gold solution the same positions are marked on the original text (`plant=None`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from fractions import Fraction

DELTAS = (1, 2, 3, 4, 5, -1, -2, -3, -4, -5, 10, -10)  # an off-by-a-little slip, drawn in seeded order
SPANS = ("planted", "carried", "final")  # what `render` marks
_ANNOTATION = re.compile(r"<<([^<>]*)=([^<>=]*)>>")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?![\w])|(?<![\w.])\.\d+(?![\w])")  # 16, 130,000, 1.5, .5
_EXPR_NUMBER = re.compile(r"\d*\.?\d+")
_EXPR_CHARS = re.compile(r"[\d.+\-*/() ]+")


class Skip(ValueError):
    """A solution that cannot be planted reliably; `reason` is a short key that is counted."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Step:
    expr: str  # the annotation's left-hand side, e.g. "16-3-4"
    value: Fraction  # its exact value
    annotation: tuple[int, int]  # span of `<<...>>` in the solution
    shown: tuple[int, int]  # span of the result shown right after `>>`
    operands: tuple[tuple[Fraction, tuple[int, int]], ...]  # each operand and its span in the solution


@dataclass(frozen=True)
class Parsed:
    solution: str
    steps: tuple[Step, ...]
    answer: Fraction
    answer_span: tuple[int, int]  # the `####` answer text
    numbers: tuple[tuple[Fraction, tuple[int, int]], ...]  # visible numbers outside annotations (before ####)


@dataclass(frozen=True)
class Plant:
    step: int  # k, the planted step
    delta: Fraction
    new_values: dict  # changed step -> its new value (k and every step whose result changed)
    edits: tuple[
        tuple[tuple[int, int], str, str], ...
    ]  # (span in the solution, new text, kind) kind: planted/carried/answer/expr


def number(text: str) -> Fraction:
    return Fraction(text.replace(",", ""))


def evaluate(expr: str) -> Fraction:
    """Exact value of plain arithmetic (+ - * / parentheses, decimal literals); Skip('unparsed') otherwise."""
    if not _EXPR_CHARS.fullmatch(expr) or "**" in expr or "//" in expr:
        raise Skip("unparsed")
    code = _EXPR_NUMBER.sub(lambda m: f"F('{m.group()}')", expr)
    try:  # only digits, operators and F(...) reach eval: the character whitelist above
        value = eval(code, {"__builtins__": {}, "F": Fraction})  # noqa: S307
    except (SyntaxError, ZeroDivisionError, TypeError):
        raise Skip("unparsed") from None
    if not isinstance(value, Fraction):
        raise Skip("unparsed")
    return value


def parse(solution: str, slip: int | None = None) -> Parsed:
    """The steps of a GSM8K solution (rules in the module docstring); Skip when they cannot be traced.
    slip: a step whose stated value may differ from its expression (a planted solution's step k)."""
    hashes = solution.rfind("####")
    if hashes < 0:
        raise Skip("unparsed")
    m = re.search(r"\S.*", solution[hashes + 4 :])
    if m is None or not _NUMBER.fullmatch(m.group().strip()):
        raise Skip("unparsed")
    answer_span = (hashes + 4 + m.start(), hashes + 4 + m.start() + len(m.group().strip()))
    body = solution[:hashes]
    steps = []
    for i, a in enumerate(_ANNOTATION.finditer(body)):
        expr, stated = a.group(1), a.group(2).strip()
        if not _NUMBER.fullmatch(stated):
            raise Skip("unparsed")
        value = evaluate(expr) if i != slip else number(stated)
        if value != number(stated):
            raise Skip("inexact")  # rounded or wrong annotations cannot be re-evaluated exactly
        shown = _NUMBER.match(body, a.end())
        if shown is None or number(shown.group()) != value:
            raise Skip("not_shown")
        ops = tuple(
            (Fraction(o.group()), (a.start(1) + o.start(), a.start(1) + o.end())) for o in _EXPR_NUMBER.finditer(expr)
        )
        steps.append(Step(expr, value, a.span(), shown.span(), ops))
    if len(steps) < 2:
        raise Skip("one_step")  # no intermediate result to plant
    if steps[-1].value != number(solution[slice(*answer_span)]):
        raise Skip("last_not_answer")
    inside = [s.annotation for s in steps]
    numbers = tuple(
        (number(n.group()), n.span()) for n in _NUMBER.finditer(body) if not any(a <= n.start() < b for a, b in inside)
    )
    return Parsed(solution, tuple(steps), number(solution[slice(*answer_span)]), answer_span, numbers)


def uses(parsed: Parsed) -> list[set[int]]:
    """uses[i]: the earlier steps j whose value is an operand of step i."""
    return [
        {j for j in range(i) for v, _ in s.operands if v == parsed.steps[j].value} for i, s in enumerate(parsed.steps)
    ]


def candidates(parsed: Parsed) -> list[int]:
    """Intermediate steps the last step depends on (transitively)."""
    deps, last = uses(parsed), len(parsed.steps) - 1
    needed, stack = set(), [last]
    while stack:
        for j in deps[stack.pop()]:
            if j not in needed:
                needed.add(j)
                stack.append(j)
    return sorted(needed)


def fmt(value: Fraction, like: str) -> str:
    """`value` written in the style of `like` (thousands commas, at least as many decimals)."""
    decimals = len(like.split(".")[1]) if "." in like else 0
    while (value * 10**decimals).denominator != 1:
        decimals += 1
    return f"{float(value):,.{decimals}f}" if "," in like else f"{float(value):.{decimals}f}"


def try_plant(parsed: Parsed, problem: str, k: int, delta: int) -> Plant:
    """The plant of step k by +delta, or Skip(reason) when a rule of the module docstring fails."""
    steps = parsed.steps
    new = {k: steps[k].value + delta}
    clean = lambda v: v >= 0 and (v * 100).denominator == 1  # noqa: E731 (a result GSM8K could show)
    exprs = {}  # step -> its rewritten expression text
    for i in range(k + 1, len(steps)):
        s = steps[i]
        changed = [(j, span) for v, span in s.operands for j in new if steps[j].value == v]
        if not changed:
            continue
        text, shift = s.expr, -s.annotation[0] - 2  # operand spans are in the solution; the expr starts after `<<`
        for j, (a, b) in sorted(changed, key=lambda c: -c[1][0]):
            text = text[: a + shift] + fmt(new[j], "") + text[b + shift :]
        exprs[i] = text
        value = evaluate(text)
        if not clean(value):
            raise Skip("not_clean")  # before formatting it: 1/3 has no decimal text
        if value != s.value:
            new[i] = value
    if len(steps) - 1 not in new:
        raise Skip("answer_unchanged")
    problem_numbers = {number(n.group()) for n in _NUMBER.finditer(problem)}
    old_numbers = (
        problem_numbers
        | {v for v, _ in parsed.numbers}
        | {s.value for s in steps}
        | {v for s in steps for v, _ in s.operands}
    )
    if len(set(new.values())) < len(new):
        raise Skip("collides")  # two changed numbers with one text: the carried uses could not be told apart
    for j, value in new.items():
        old = steps[j].value
        if (
            old in problem_numbers
            or any(s.value == old for i, s in enumerate(steps) if i != j)
            or any(v == old for s in steps[: j + 1] for v, _ in s.operands)
            or any(v == old and span[1] <= steps[j].annotation[0] for v, span in parsed.numbers)
        ):
            raise Skip("ambiguous")
        if not clean(value) or (old.denominator == 1 and value.denominator != 1):
            raise Skip("not_clean")  # a count stays a whole number
        if value in old_numbers:
            raise Skip("collides")
    edits = []
    for i, text in exprs.items():  # downstream expressions with the changed operands
        a = steps[i].annotation[0] + 2
        edits.append(((a, a + len(steps[i].expr)), text, "expr"))
    for j, value in new.items():  # the stated results: step k's is the slip itself (its expression stays)
        stated = _ANNOTATION.match(parsed.solution, steps[j].annotation[0]).span(2)
        edits.append((stated, fmt(value, ""), "expr"))
    for j, value in new.items():
        shown = steps[j].shown
        edits.append(
            (
                shown,
                fmt(value, parsed.solution[slice(*shown)]),
                "planted" if j == k else "final" if j == len(steps) - 1 else "carried",
            )
        )
        for v, span in parsed.numbers:
            if v == steps[j].value and span[0] >= steps[j].shown[1]:
                edits.append((span, fmt(value, parsed.solution[slice(*span)]), "carried"))
    edits.append((parsed.answer_span, fmt(new[len(steps) - 1], parsed.solution[slice(*parsed.answer_span)]), "answer"))
    plant = Plant(k, Fraction(delta), new, tuple(sorted(edits)))
    check = parse(apply(parsed.solution, plant.edits), slip=k)  # exact, but for the slip
    assert [s.value for s in check.steps] == [new.get(i, s.value) for i, s in enumerate(steps)], (
        "planted arithmetic drifted"
    )
    return plant


def plant(parsed: Parsed, problem: str, *, seed: int, key: str) -> Plant:
    """The seeded plant of a parsed solution: the first (step, delta) in seeded order that passes."""
    rng = random.Random(f"{seed}:{key}")
    steps = [k for k in candidates(parsed) if k < len(parsed.steps) - 1]
    rng.shuffle(steps)
    reasons = []
    for k in steps:
        for delta in rng.sample(DELTAS, len(DELTAS)):
            try:
                return try_plant(parsed, problem, k, delta)
            except Skip as e:
                reasons.append(e.reason)
    raise Skip(max(set(reasons), key=reasons.count) if reasons else "no_candidate")


def apply(text: str, edits) -> str:
    """`text` with each (span, new text, kind) edit applied (spans of the original, not overlapping)."""
    out, at = [], 0
    for (a, b), new, _ in sorted(edits):
        assert a >= at, "overlapping edits"
        out += [text[at:a], new]
        at = b
    return "".join(out + [text[at:]])


def render(parsed: Parsed, plant_: Plant | None, marks: Plant) -> tuple[str, dict[str, list[tuple[int, int]]]]:
    """(reasoning + `#### N` with annotations stripped, {kind: character spans} for each kind of SPANS).

    plant_: the plant to apply, or None for the unplanted gold text; marks: whose planted/carried
    positions to mark (the same plant, so gold and planted texts mark the same numbers)."""
    body_end = parsed.solution.rfind("####")
    marked = [e for e in marks.edits if e[2] in SPANS]
    kinds = {span: kind for span, _, kind in marked}
    edits = marked if plant_ is None else [e for e in plant_.edits if e[2] in SPANS]
    cuts = sorted([(s.annotation, "", "strip") for s in parsed.steps] + edits, key=lambda e: e[0])
    out, spans, at, length = [], {kind: [] for kind in SPANS}, 0, 0
    for (a, b), new, _ in cuts + [((body_end, body_end), "", "end")]:
        out.append(parsed.solution[at:a])
        length += a - at
        piece = parsed.solution[a:b] if (a, b) in kinds and plant_ is None else new
        if (a, b) in kinds:
            spans[kinds[(a, b)]].append((length, length + len(piece)))
        out.append(piece)
        length += len(piece)
        at = b
    body = "".join(out).rstrip()
    answer = (
        parsed.solution[slice(*parsed.answer_span)]
        if plant_ is None
        else next(e[1] for e in plant_.edits if e[2] == "answer")
    )
    return f"{body}\n#### {answer}", spans
