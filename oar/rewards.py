r"""Whether an extracted answer is right, and the outcome reward r_i (the answer is found by `oar.answers`).

`answers_match(pred, gold)` stops at the first verdict of:
1. numbers: if both sides are plain numbers (`1,000`, `0.5`, `\frac{1}{2}`, `-3./2`, `4.5e33`,
   `4.5\times10^{33}`, `\frac43`) once `$`, `\%`, `^\circ`, units (`\text{cm}`, `18 eggs`) and
   spaces are dropped, they are compared as exact rationals, and that is final (`10\%` matches `10`,
   not `0.1`); numbers that a space keeps apart (`1, 500`, `5 \text{ or } 6`) are no one number;
2. strings: equal after a light normalisation (no spaces but those between two numbers, which keep
   `5 6` from `56`, so `(1, 2)` and `(1,2)` are left to step 3; no `\left`, `\dfrac` -> `\frac`,
   `\text{x}` -> `x`, ...), so identical answers always match, whatever sympy makes of them;
3. math-verify: equivalence through sympy (`\frac{\sqrt3}{2}`, `2π` for `2\pi`, intervals, tuples,
   sets, `x=5` for `5`, simple expressions), with its own unit stripping off (it takes a trailing
   one-letter variable for a unit: `6` matched `6m`); units at the end are dropped by `_without_units`.
Why math-verify earns its place as a dependency: MATH-style gold answers are LaTeX, and string
normalisation alone (Hendrycks' `is_equiv`) rejects equivalent forms such as `\sqrt{50}` for
`5\sqrt{2}` or `\{2,1\}` for `\{1,2\}`; hand-written graders that fix this grow into long tables of
special cases. math-verify (Hugging Face; the checker of open-r1 and lighteval) parses both sides
to sympy and compares them numerically and symbolically, so the reward measures being right rather
than matching the reference's notation. Steps 1-2 keep it off the hot path: plain numbers never
reach it.

Bounding its time: math-verify's timeouts use `signal.alarm`, which raises outside the main thread
and, in it, cancels any alarm the caller had set. We turn them off and run parse + verify under one
deadline of our own (`_deadline`) that works in any thread and leaves signals alone. The deadline is
on the checking thread's CPU time, not the clock's: a busy machine slows the check down without
using up its budget, so a right answer is not scored 0 because other jobs ran (a wall-clock cap,
MV_WALL_SECONDS, bounds a thread that gets no CPU at all). Like a signal, it cannot stop one C call
holding the GIL (sympy computing `9^{9^{9}}` exactly), so answers over MV_MAX_CHARS and towers, huge
powers or factorials (`_may_explode`) skip step 3. Nothing raises.

The built-in terms of a run's reward (`--reward`; the table and its weights: oar/reward_table.py), each
a function (completion, gold, problem) -> float:
  correctness_reward  `reward`: 1 if the final answer matches the gold answer, else 0 (the paper's reward)
  format_reward       1 if the completion has a final-answer marker with an answer in it, right or wrong
  length_reward       the completion's length in characters (a penalty with a negative weight)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import re
import threading
import time
from fractions import Fraction

from oar.answers import find_answer, group_end

MV_SECONDS = 1.0  # deadline for math-verify's parse + verify of one pair, in the checking thread's CPU seconds
MV_WALL_SECONDS = 30.0  # and in wall-clock seconds, for a thread starved of CPU
DEADLINE_POLL = 0.005  # seconds between the watcher's looks at the thread's CPU time
MV_MAX_CHARS = 1_000  # longer answers skip math-verify (and stay under Python's int-str limit)
MAX_NUMBER_CHARS = 1_000  # longer numbers are compared as strings, never converted
MAX_GROWTH = 10**6  # about the most digits an exact integer may reach before sympy stalls in C
MAX_SYMBOLIC_POWER = 100  # larger powers of an expression with letters are not expanded (see _may_explode)


_SPACES = re.compile(r"\s*")
_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_SCIENTIFIC = re.compile(rf"(?P<m>{_NUM})(?:(?:[eE]|\\times10\^|\\cdot10\^)\{{?(?P<e>[-+]?\d{{1,4}})\}}?)?")
_FRACTION = re.compile(rf"(?P<sign>[-+]?)\\frac\{{(?P<n>{_NUM})\}}\{{(?P<d>{_NUM})\}}|(?P<n2>{_NUM})/(?P<d2>{_NUM})")
_BARE_FRACTION = re.compile(
    r"\\frac(?:(?P<n>\d)|\{(?P<n1>[^{}]*)\})(?:(?P<d>\d)|\{(?P<d1>[^{}]*)\})"
)  # one digit may go unbraced
_APART = re.compile(r"[\d.],?\s+[-+]?[\d.]")  # digits, then spaces (after a comma or not), then digits
_SPACE_APART = re.compile(r"(?<=[\d.])(,?)\s+(?=[-+]?[\d.])")  # the spaces that keep them apart
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_UNIT_COMMAND = r"\\(?:text|textnormal|mbox|mathrm)\s*\{[^{}]*\}"  # `\text{ cm}`, `\mbox {feet}`
_WORDS_AT_END = r"(?:\s+[A-Za-z]{2,}\.?)+\s*$"  # words of two letters or more, to the end
_UNITS = re.compile(_UNIT_COMMAND)
# Plain words after a number ("18 eggs", "$4 per hour"): a unit, dropped as a \text{} one is; not a word that
# changes the value, joins another term or names a symbol ("18 thousand", "3 fourths", "5 or more", "2 pi",
# "5 below zero"), nor one letter (a variable)
_SCALING = {
    "hundred",
    "thousand",
    "million",
    "billion",
    "trillion",
    "dozen",
    "score",
    "gross",
    "half",
    "halves",
    "third",
    "thirds",
    "quarter",
    "quarters",
    "squared",
    "cubed",
    "times",
    "or",
    "and",
    "to",
    "plus",
    "minus",
    "over",
    "by",
    "pi",
    "ln",
    "log",
    "sin",
    "cos",
    "tan",
    "exp",
    "sqrt",
    "mod",
    "below",
    "negative",
    "less",
    "fewer",
    "more",
    "before",
    "ago",
    "bc",
    "bce",
    "under",
    "behind",
    "off",
    "percent",
    "percentage",
    "per-cent",
}
_SCALING |= {w + "s" for w in _SCALING if w.isalpha()}  # "5 hundreds", "3 dozens"
_ORDINAL_FRACTION = re.compile(
    r"(?:fourth|fifth|sixth|seventh|eighth|ninth|tenth|hundredth|thousandth|millionth|billionth)s?"
)
_WORD_UNITS = re.compile(r"(?<=[\d.%$])" + _WORDS_AT_END)
# Units at the end of an answer that math-verify reads (its own unit stripping is off: it also takes a trailing
# one-letter variable for a unit, `6m` -> 6): `\text{ cm}^2`, or plain words after a number or a brace (`\sqrt{13}
# feet`)
_TRAILING_TEXT_UNITS = re.compile(r"(?:\s*" + _UNIT_COMMAND + r"(?:\^\{?[23]\}?)?)+\s*$")
_TRAILING_WORD_UNITS = re.compile(r"(?<=[\d.%$}])" + _WORDS_AT_END)
_TEXT_WRAPPER = re.compile(r"\\(?:text|textnormal|textbf|textit|textrm|mbox|mathrm|mathbf)\s*\{([^{}]*)\}")
_NOISE = re.compile(  # dropped from both sides: spacing, sizing, currency, percent and degree signs
    r"\\left(?![A-Za-z])|\\right(?![A-Za-z])|\\[!,;: ]|\s+|\\?\$|\\?%|\^\{?\\circ\}?|°|\\degree"
)


def _canonical(answer: str) -> str:
    """A light string normalisation: answers with equal canonical forms are equal."""
    answer = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    answer = _BARE_FRACTION.sub(_braced_fraction, answer)  # `\frac43` is `\frac{4}{3}` (MATH golds write both)
    answer = _NOISE.sub("", _TEXT_WRAPPER.sub(r"\1", answer)).replace("\u2212", "-")  # U+2212 minus
    return answer.rstrip(".")


def _without_word_units(answer: str, words_at_end: re.Pattern) -> str:
    """`answer` without the plain words at its end that `words_at_end` finds (`18 eggs`), unless one changes the
    value (`_SCALING`: `18 thousand`, `5 more`) or is an ordinal fraction (`3 fourths`)."""
    words = words_at_end.search(answer) if len(answer) <= MAX_NUMBER_CHARS else None  # (linear only when short)
    said = {w.rstrip(".").lower() for w in words[0].split()} if words else set()
    if words and not (_SCALING & said or any(_ORDINAL_FRACTION.fullmatch(w) for w in said)):
        return answer[: words.start()]
    return answer


def _braced_fraction(m: re.Match) -> str:
    return f"\\frac{{{m['n'] or m['n1']}}}{{{m['d'] or m['d1']}}}"


def _as_number(answer: str) -> Fraction | None:
    r"""The exact value of a plain number, `\text{}` and plain-word units dropped (`18 eggs`, not `18
    thousand`); None if it is not one (two numbers apart, `1, 500` or `5 \text{ or } 6`, are a list,
    not 1500 or 56)."""
    answer = _without_word_units(_UNITS.sub(" ", answer), _WORD_UNITS)
    if _APART.search(answer):
        return None
    answer = _canonical(answer)
    if len(answer) > MAX_NUMBER_CHARS:  # Fraction("7" * 10**5) is slow, and past 4,300 digits raises
        return None
    if _THOUSANDS.fullmatch(answer):
        answer = answer.replace(",", "")  # whole thousands groups only: "1,2" is a pair, not 12
    if m := _SCIENTIFIC.fullmatch(answer):
        return Fraction(m["m"]) * Fraction(10) ** int(m["e"] or 0)
    if m := _FRACTION.fullmatch(answer):
        numerator, denominator = Fraction(m["n"] or m["n2"]), Fraction(m["d"] or m["d2"])
        return None if denominator == 0 else (-1 if m["sign"] == "-" else 1) * numerator / denominator
    return None


_POWER = re.compile(r"\^|\*\*")
_FACTORIAL = re.compile(r"(?<!\\)!(?!=)")  # `\!` is a LaTeX space and `!=` no factorial
_SMALL_FACTORIAL_ARG = re.compile(r"(?:^|[^\d.])\d{1,3}$|[A-Za-z]\s*$")
_DIGITS = re.compile(r"\d+")
_LETTER = re.compile(r"[A-Za-z]")  # a variable or a LaTeX command: the answer may be symbolic


def _may_explode(latex: str) -> bool:
    """Whether sympy might build a huge exact integer from `latex`, in C, where no deadline reaches:
    a factorial of more than a letter or a 3-digit literal, a tower (a power or factorial inside an
    exponent), (widest digit run) x (product of the literals in all exponents) > MAX_GROWTH, a
    bound on the digits of `(9999^{9999})^{99}`, or a power above MAX_SYMBOLIC_POWER in an answer
    with any letter (`(x+1)^{999}` expands to 1,000 terms, with stretches of C that a deadline waits
    out: 5 s once against a 1 s deadline). Conservative: `x^{10}+x^9+...+x^2` is refused too."""
    for m in _FACTORIAL.finditer(latex):
        if not _SMALL_FACTORIAL_ARG.search(latex[max(0, m.start() - 4) : m.start()]):
            return True
    growth = max((len(run) for run in _DIGITS.findall(latex)), default=1)
    for m in _POWER.finditer(latex):
        at = _SPACES.match(latex, m.end()).end()
        digits = _DIGITS.match(latex, at)  # `^123`: count the whole run, to be safe
        end = digits.end() if digits else group_end(latex, at) if latex.startswith("{", at) else at + 1
        if end is None or _POWER.search(latex, at, end) or _FACTORIAL.search(latex, at, end):
            return True
        for run in _DIGITS.findall(latex, at, end):
            growth *= max(int(run), 1) if len(run) <= 6 else MAX_GROWTH + 1
            if growth > MAX_GROWTH or (int(run[:6]) > MAX_SYMBOLIC_POWER and _LETTER.search(latex)):
                return True
    return False


class _Timeout(BaseException):
    """Raised at the deadline; a BaseException, so that `except Exception` in sympy lets it through."""


def _cpu_clock(thread_id: int):
    """A function giving thread `thread_id`'s CPU seconds so far (POSIX), or None where there is none."""
    try:
        clock = time.pthread_getcpuclockid(thread_id)
        time.clock_gettime(clock)
    except (AttributeError, OSError):  # no per-thread CPU clocks here (Windows): the wall clock decides
        return None
    return lambda: time.clock_gettime(clock)


@contextlib.contextmanager
def _deadline(seconds: float, wall_seconds: float | None = None):
    """Raise `_Timeout` in the calling thread once it has used `seconds` of CPU time inside the block, or
    `wall_seconds` (MV_WALL_SECONDS by default) have passed, from a watcher thread (CPython async exception).
    Catch it around the whole `with`: the exit clears one not yet delivered."""
    thread_id, lock, state = threading.get_ident(), threading.Lock(), {"done": False, "fired": False}
    cpu, wall = _cpu_clock(thread_id), time.monotonic
    cpu_start, wall_start, cap = (
        cpu() if cpu else None,
        wall(),
        MV_WALL_SECONDS if wall_seconds is None else wall_seconds,
    )
    stop = threading.Event()

    def watch():
        while not stop.wait(DEADLINE_POLL):
            try:
                used = cpu() - cpu_start if cpu else wall() - wall_start
            except OSError:  # the thread ended between the block's exit and this look: nothing to stop
                return
            if used >= seconds or wall() - wall_start >= cap:
                with lock:
                    if not state["done"]:
                        state["fired"] = True
                        exception = ctypes.py_object(_Timeout)
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), exception)
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        with lock:
            state["done"] = True
            if state["fired"]:  # fired, maybe not yet delivered: NULL clears a pending exception
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)


@functools.cache
def _math_verify():
    """math-verify, imported on first use: it brings sympy (~0.8 s of every process's start, and plain
    numbers never need it). Called before a deadline starts: the import must not count against it."""
    import math_verify

    # We pass timeouts of None on purpose (`_deadline` replaces them); math-verify warns once about it.
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(lambda record: "Timeout is disabled" not in record.getMessage())
    # Its first parse builds the grammar and its first verify loads sympy's simplification: ~0.5-0.9 s
    # together, which the first answer's 1 s deadline must not pay (it did: a right answer scored 0)
    latex = (math_verify.LatexExtractionConfig(boxed_match_priority=0),)
    math_verify.verify(
        math_verify.parse("\\boxed{2x+2}", latex, parsing_timeout=None),
        math_verify.parse("\\boxed{2(x+1)}", latex, parsing_timeout=None),
        timeout_seconds=None,
    )
    return math_verify


@functools.lru_cache(maxsize=4096)  # a gold answer is parsed once per prompt, not once per rollout
def _parse(answer: str) -> tuple:
    math_verify = _math_verify()
    return tuple(math_verify.parse("\\boxed{" + _without_units(answer) + "}", _latex_only(), parsing_timeout=None))


@functools.cache
def _latex_only() -> tuple:
    """math-verify's LaTeX extraction, with its normalisation but its unit stripping off: its unit list holds
    one-letter variables (m, s, t, c, ...) and words that change the value (more, less), so `6` matched `6m`,
    `a +` matched `a + b + c`, and `\\sin^2(t)` missed `\\sin^2 t`. Units are dropped by `_without_units`."""
    from latex2sympy2_extended.math_normalization import NormalizationConfig

    math_verify = _math_verify()
    keep = NormalizationConfig(
        basic_latex=True, units=False, malformed_operators=True, nits=True, boxed="all", equations=False
    )
    return (math_verify.LatexExtractionConfig(boxed_match_priority=0, normalization_config=keep),)


def _without_units(answer: str) -> str:
    """`answer` without the units at its end: `\\text{..}`-marked ones (`\\text{ feet}`, `\\mbox{ inches}^2`) and plain
    words of two letters or more after a number or a brace (`12\\sqrt{13} feet`), but not words that change the
    value (`_SCALING`: `5 more`, `2 pi`) nor one letter, which is a variable (`\\frac{37}{4} m`)."""
    cut = _TRAILING_TEXT_UNITS.sub("", answer) if len(answer) <= MV_MAX_CHARS else answer  # (linear only when short)
    return _without_word_units(cut, _TRAILING_WORD_UNITS).strip() or answer


def _math_verify_equal(pred: str, gold: str) -> bool:
    """math-verify's verdict within MV_SECONDS of CPU time; False on a timeout, an error or a refused input.
    A timeout is said (at the 1st, 10th, 100th, ... of the process): an answer that needs more than that of
    sympy scores 0 right or wrong, and its 0 would otherwise pass for a wrong answer."""
    if max(len(pred), len(gold)) > MV_MAX_CHARS or _may_explode(pred) or _may_explode(gold):
        return False
    math_verify = _math_verify()  # outside the deadline
    try:
        with _deadline(MV_SECONDS):  # verify of an empty parse is False
            return math_verify.verify(list(_parse(gold)), list(_parse(pred)), timeout_seconds=None)
    except _Timeout:
        _TIMEOUTS[0] += 1
        if str(_TIMEOUTS[0]).strip("0") == "1":  # 1, 10, 100, ...
            logging.getLogger(__name__).warning(
                "math-verify ran past its %.0f s CPU deadline %d time(s) in this process (last: %r against gold %r); "
                "those answers scored 0, right or wrong",
                MV_SECONDS,
                _TIMEOUTS[0],
                pred[:80],
                gold[:80],
            )
        return False
    except Exception:  # a checker failure is a wrong answer, never a crashed run
        return False


_TIMEOUTS = [0]  # math-verify deadlines this process ran past


def answers_match(pred: str | None, gold: str) -> bool:
    """Whether the extracted answer `pred` equals the raw reference `gold` (checks: module docstring)."""
    if not isinstance(pred, str) or not isinstance(gold, str):
        return False
    pred, gold = pred.strip(), gold.strip()
    pred_canonical, gold_canonical = _canonical(pred), _canonical(gold)
    if not pred_canonical or not gold_canonical:
        return False
    pred_value, gold_value = _as_number(pred), _as_number(gold)
    if pred_value is not None and gold_value is not None:
        return pred_value == gold_value  # exact and final: 0.333 is not 1/3
    if _APART.search(pred) or _APART.search(gold):  # the spaces that keep numbers apart are kept: `5 6` is not `56`
        pred_canonical, gold_canonical = (_canonical(_SPACE_APART.sub("\\1\u2423", x)) for x in (pred, gold))
    return pred_canonical == gold_canonical or _math_verify_equal(pred, gold)


def reward(completion: str, gold: str, *, format_bonus: float = 0.0) -> float:
    """1.0 if the final answer of `completion` matches `gold`, else 0.0; plus `format_bonus` when a
    final answer was found at all, right or wrong (0 by default: the paper's reward is 0/1)."""
    span = find_answer(completion)
    if span is None:
        return 0.0
    return float(answers_match(span.answer, gold)) + format_bonus


def correctness_reward(completion: str, gold: str, problem: str = "") -> float:
    """`reward(completion, gold)`: 1.0 for a final answer that matches `gold`, else 0.0."""
    return reward(completion, gold)


def format_reward(completion: str, gold: str = "", problem: str = "") -> float:
    """1.0 when `completion` has a final-answer marker that holds an answer, right or wrong (`find_answer`
    finds one: a non-empty `\\boxed{..}`, `####` or "the answer is"), else 0.0."""
    return float(find_answer(completion) is not None)


def length_reward(completion: str, gold: str = "", problem: str = "") -> float:
    """The completion's length in characters; with a negative weight, a length penalty."""
    return float(len(completion))
