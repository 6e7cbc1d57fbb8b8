"""The flawed teachers of tiny-arith's testbeds, and where their flaws sit in any rollout's text.

tiny-arith imitates a teacher (oar/tasks/tiny_arith.sft_target). Each testbed plants one kind of flaw whose
pivotal tokens are known exactly, so a credit method's weights can be checked against the truth:

  fork    (v4, `lazy_rate`): on a share of the 3-operation problems the teacher stops one line early
          and answers with that line's result. The pivotal token is the FORK: the first character of
          the third line, where a rollout either writes `####` (premature, almost always wrong) or
          goes on computing. Teacher-forced perturbation credits the computation written after it,
          not this decision (scripts/analysis/decision_token.py).
  slip    (`slip_rate`): a share of the facts (`a op b`, as written) are shaky: each time one is
          worked, the teacher writes its result's last digit off by one with probability 1/2, and
          carries the written value forward, so the final answer is wrong. The model learns a near
          coin-flip on those digits: greedy decoding gets some wrong, sampling gets each right about
          half the time, and reward alone says which. The pivotal token is the SLIP: the first
          character of a written result that differs from `a op b` computed from the line's operands.
  filler  (`filler`): every worked line starts with a fixed phrase (`hmm, 37 + 8 = 45`) that cannot
          change the answer: uniform credit spreads over it, and a good method should not.

All positions are character spans [start, end) of a completion's text; with tiny-arith's tokenizer
(one token per character) a span is a token. The labels are computed on the rollout's OWN text, so
the model's own arithmetic errors count as slips too (they decide its answer the same way).
The choice of which problem or line carries a flaw is a hash of the problem text (and the line), so
a problem always gets the same target and a lower rate picks a subset.
"""

from __future__ import annotations

import re
import zlib

_LINE = re.compile(r"(-?\d+) ([-+*]) (-?\d+) = (-?\d+)")  # a worked line: `a op b = c`


def _chosen(key: str, rate: float) -> bool:
    """Whether the item named `key` carries a flaw at `rate`: a stable hash, so lower rates pick subsets."""
    return zlib.crc32(key.encode()) % 10_000 < rate * 10_000


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def slipped(value: int, key: str) -> int:
    """`value` with its last digit off by one (down from a 9, up from a 0, else a hash picks the side):
    exactly one digit changes and the number keeps its length."""
    last = abs(value) % 10
    if last == 9 or (last != 0 and zlib.crc32(b"side:" + key.encode()) % 2):
        return value - 1 if value >= 0 else value + 1
    return value + 1 if value >= 0 else value - 1


def slip_lines(lines: list[str], problem: str, rate: float) -> list[str]:
    """A worked solution's lines (`a op b = c` ..., `#### N`) with slips: a line whose fact `a op b`
    is shaky (a share `rate` of the facts, by a hash of the fact) has its result `slipped` on half of
    its occurrences (a hash of the problem and the line number); every later line uses the value as
    written, and the final answer is the last written result. `rate` 0: unchanged."""
    if rate <= 0:
        return list(lines)
    out, gold_prev, written_prev = [], None, None
    for k, line in enumerate(lines):
        m = _LINE.fullmatch(line)
        if m is None:  # the `#### N` line: the answer follows what was written
            out.append(f"#### {written_prev}" if line.startswith("####") and written_prev is not None else line)
            continue
        a, op, b, gold = int(m[1]), m[2], int(m[3]), int(m[4])
        if a == gold_prev:  # the chain's running value: carry the written (maybe slipped) one
            a = written_prev
        c = _apply(a, op, b)
        if _chosen(f"shaky:{a} {op} {b}", rate) and _chosen(f"slip:{problem}:{k}", 0.5):
            c = slipped(c, f"{problem}:{k}")
        out.append(f"{a} {op} {b} = {c}")
        gold_prev, written_prev = gold, c
    return out


def pad_lines(lines: list[str], filler: str) -> list[str]:
    """Every worked line prefixed with `filler` (the `#### N` line is left alone)."""
    return [line if line.startswith("####") or not filler else filler + line for line in lines]


# ------------------------------------------------------------------ known tokens in a rollout's text


def fork_spans(text: str, line: int = 2) -> list[tuple[int, int]]:
    """The fork: the first character of line `line` (0-based; tiny-arith's lazy flaw acts at the
    third line of a 3-operation problem), when the text has that line and it is not empty."""
    starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]
    if len(starts) <= line or starts[line] >= len(text) or text[starts[line]] == "\n":
        return []
    return [(starts[line], starts[line] + 1)]


def slip_spans(text: str) -> list[tuple[int, int]]:
    """Each worked line whose written result differs from `a op b`: the first differing character
    (the character after the number when the written one is a prefix of the true one)."""
    spans = []
    for m in _LINE.finditer(text):
        true, written = str(_apply(int(m[1]), m[2], int(m[3]))), m[4]
        if true != written:
            i = next((j for j, (x, y) in enumerate(zip(true, written)) if x != y), min(len(true), len(written)))
            spans.append((m.start(4) + i, m.start(4) + i + 1))
    return [(s, e) for s, e in spans if e <= len(text)]


def filler_spans(text: str, filler: str) -> list[tuple[int, int]]:
    """Every copy of `filler` at the start of a line."""
    if not filler:
        return []
    starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]
    return [(s, s + len(filler)) for s in starts if text.startswith(filler, s)]
