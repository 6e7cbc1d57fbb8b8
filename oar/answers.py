r"""Where the final answer of a completion is: its text and answer span (maths §0; the probes read it), and the
reasoning before it.

`find_answer` gives the final answer of a completion and its character span; the reasoning span
R_i of maths §0 is `text[:marker_start]`. Markers: the last `\boxed{..}` / `\fbox{..}` (nested braces matched,
`\{ \}` skipped; also `\boxed 5`); the text after the last `####` to the end of its line (GSM8K);
the text after the last "the (final) answer is" (any case) to the end of its sentence (a `. ` outside braces) or line.
For the last two, wrapping `$`, `\(..\)`, `**`, a leading `:` and a trailing `.` are trimmed.
Which wins: only the last occurrence of each marker counts (an earlier box is a result the model
went on to revise), and of those the marker that starts LAST wins: the final answer comes last
("\boxed{74} + 4 = 88. The answer is 88." gives 88). But after a box, a phrase or `####` whose
answer holds no digit and no LaTeX command is words, not an answer, and the box stands: "\boxed{5}.
I hope the answer is correct.", a markdown heading "#### Verification". A phrase's answer ends at a
comma that opens a clause ("The answer is 5, because ..." gives 5). A marker that gives no answer (`\boxed{}`, an
unclosed `\boxed{12`, a bare `####`) is ignored, and
there is no "last number" fallback: no marker, no answer. When the winner sits inside an earlier
marker's answer ("The answer is $\boxed{5}$"), the answer is the inner `5` but `marker_start` is
where the OUTER marker starts: "The answer is $" is marker, not reasoning. Scanning is linear.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class AnswerSpan(NamedTuple):
    answer: str  # the extracted final answer, stripped
    start: int  # text[start:end] == answer
    end: int
    marker_start: int  # where the final-answer marker begins; the reasoning span is text[:marker_start]


_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_PHRASE = re.compile(r"\bthe\s+(?:final\s+)?answer\s+is\b", re.IGNORECASE)
_BRACE_OR_ESCAPE = re.compile(r"\\.|[{}]", re.DOTALL)
_SENTENCE_SCAN = re.compile(r"\n|\\.|[{}]|\.(?=\s|$)")  # a newline, an escape (not of a newline), a brace, a `. `
_CLAUSE = re.compile(
    r",\s+(?:because|since|as|which|so|given|where|when|while|therefore|thus|hence|that)\b", re.IGNORECASE
)
_ANSWER_LIKE = re.compile(r"[\d\\]")  # a digit or a LaTeX command: what a maths answer after a box holds
_SPACES = re.compile(r"\s*")
_BARE_TOKEN = re.compile(r"[^\s${}]+")
_DEPTH_STEP = {"{": 1, "}": -1}


def group_end(text: str, open_at: int) -> int | None:
    """Index just past the `}` that closes the `{` at `open_at`, or None if it never closes."""
    depth = 0
    for m in _BRACE_OR_ESCAPE.finditer(text, open_at):  # `\{` is matched whole, so never counted
        depth += _DEPTH_STEP.get(m.group(), 0)
        if depth == 0:
            return m.end()
    return None


def _trim(text: str, start: int, end: int, wrappers: bool) -> tuple[int, int]:
    r"""Shrink [start, end) past spaces and, if `wrappers`, past `$ * \( \[ :` in front and `$ * \) \] .` behind."""
    while start < end:  # index tests, not slices, so that a long run of spaces stays linear
        if text[start].isspace() or (wrappers and text[start] in "$*:"):
            start += 1
        elif text[end - 1].isspace() or (wrappers and text[end - 1] in "$*."):
            end -= 1
        elif wrappers and text.startswith(("\\(", "\\["), start, end):
            start += 2
        elif wrappers and text.endswith(("\\)", "\\]"), start, end):
            end -= 2
        else:
            break
    return start, end


def _last(pattern: re.Pattern, text: str) -> re.Match | None:
    """The last non-overlapping match of `pattern` in `text`, in one linear pass."""
    match = None
    for match in pattern.finditer(text):
        pass
    return match


def _boxed(text: str) -> tuple[int, int, int, int] | None:
    """(marker_start, answer_start, answer_end, region_end) of the last box; None if it never closes."""
    m = _last(_BOX, text)
    if m is None:
        return None
    at = _SPACES.match(text, m.end()).end()
    if text.startswith("{", at):
        end = group_end(text, at)
        return None if end is None else (m.start(), at + 1, end - 1, end)
    bare = _BARE_TOKEN.match(text, at)  # `\boxed 5`, as in some MATH solutions (`\boxed5` is not)
    return (m.start(), at, bare.end(), bare.end()) if bare and at > m.end() else None


def _sentence_end(text: str, after: int) -> int | None:
    """Where the sentence from `after` ends: a `. ` outside braces (`34\\text{ sq. units}.` goes on), or
    the line's end. A brace left open to the line's end hides nothing: the first `. ` after it ends."""
    depth, inside = 0, None  # inside: the first `. ` within the braces still open
    for m in _SENTENCE_SCAN.finditer(text, after):
        token = m.group()
        if token == "\n" or (token == "." and depth == 0):
            return inside if depth > 0 and inside is not None else m.start()
        if token == "." and inside is None:
            inside = m.start()
        depth = max(0, depth + _DEPTH_STEP.get(token, 0))  # a stray `}` does not hide later sentence ends
        inside = None if depth == 0 else inside
    return inside if depth > 0 else None


def _to_line_end(text: str, marker_start: int, after: int, sentence: bool) -> tuple[int, int, int, int]:
    """(marker_start, answer_start, answer_end, region_end): to the end of the line, or sentence."""
    stop = _sentence_end(text, after) if sentence else None
    newline = text.find("\n", after)
    end = stop if stop is not None else (newline if newline >= 0 else len(text))
    return marker_start, after, end, end


def find_answer(text: str) -> AnswerSpan | None:
    """The final answer of `text` and its span (rules in the module docstring), or None."""
    if not isinstance(text, str):
        return None
    candidates = []  # ((marker_start, answer_start, answer_end, region_end), is_line_marker)
    if (box := _boxed(text)) is not None:
        candidates.append((box, False))
    if (hashes := text.rfind("####")) >= 0:
        candidates.append((_to_line_end(text, hashes, hashes + 4, sentence=False), True))
    if (phrase := _last(_PHRASE, text)) is not None:
        region = _to_line_end(text, phrase.start(), phrase.end(), sentence=True)
        clause = _CLAUSE.search(text, region[1], region[2])  # "5, because ..." -> "5"
        candidates.append((region[:2] + (clause.start(), region[3]) if clause else region, True))
    best = None
    for (marker, start, end, _), is_line in candidates:
        start, end = _trim(text, start, end, wrappers=is_line)
        if is_line and _BOX.search(text, start, end):
            continue  # "The answer is $\boxed{}$": the box speaks for the phrase, even when empty
        if is_line and box is not None and marker > box[0] and not _ANSWER_LIKE.search(text, start, end):
            continue  # words after a box ("I hope the answer is correct"): the box stands
        if start < end and (best is None or marker > best.marker_start):
            best = AnswerSpan(text[start:end], start, end, marker)
    if best is None:
        return None
    # The winner inside an earlier marker's answer region belongs to that marker: start there.
    outer = [marker for (marker, start, _, stop), _ in candidates if start <= best.marker_start < stop]
    return best._replace(marker_start=min(outer, default=best.marker_start))


def boxed_answer(text: str) -> str | None:
    """The content of the last closed `\\boxed{..}` / `\\fbox{..}` of `text`, stripped, or None: how a
    reference solution (MATH's) marks its answer, whatever remark follows it ("Is it a coincidence that
    the answer is 24?" after `\\boxed{24}`). Completions are read by `find_answer`, where the last marker wins."""
    box = _boxed(text) if isinstance(text, str) else None
    return (text[box[1] : box[2]].strip() or None) if box is not None else None


def extract_answer(text: str) -> str | None:
    """The final answer text of `text` (see `find_answer`), or None."""
    span = find_answer(text)
    return None if span is None else span.answer
