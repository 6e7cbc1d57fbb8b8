"""`oar.answers` and `oar.rewards` give the right verdicts: hand-checked cases and every real gold answer
(tests/package/test_reward_safety.py: that they are safe and bounded on any input)."""

import json
from pathlib import Path

import pytest

from oar.answers import extract_answer, find_answer
from oar.rewards import answers_match, reward

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"

MATCH_CASES = [
    # GSM8K-style numbers: separators, currency, units and signs are not part of the value
    ("18", "18", True),
    ("1,000", "1000", True),
    ("1000", "1,000", True),
    ("1,234,567", "1234567", True),
    ("$18", "18", True),
    (r"\$18.90", "18.9", True),
    ("18.00", "18", True),
    ("18.", "18", True),
    ("0018", "18", True),
    ("-5", "-5", True),
    ("\u22125", "-5", True),  # unicode minus
    ("5", "-5", False),
    ("17", "18", False),
    ("1,2", "12", False),  # a comma that is not a thousands separator keeps its meaning
    ("12", "1,2", False),
    ("1, 500", "1500", False),  # nor does a comma and a space: a list, not 1500
    ("1500", "1, 500", False),
    ("5 6", "56", False),  # nor a space alone: the string check keeps it too (it had matched there)
    ("12 3", "123", False),
    ("1 500", "1500", False),  # as "1 500" against "1,500"
    ("5  6", "5 6", True),  # identical up to spacing
    # math-verify's own unit stripping (off) took a trailing one-letter variable for a unit, both ways:
    (r"\frac{37}{4}", r"\frac{37}{4} m", False),  # Minerva 104: wrong, had matched
    (r"\frac{37m}{4}", r"\frac{37}{4} m", True),  # right, had not
    ("6", "6m", False),  # OlympiadBench 117
    ("4", "4t", False),  # MATH train_12k 11372, "Simplify 3t+4-6t+7t-4"
    ("a +", "a + b + c", False),  # MATH train 4490
    ("c+b+a", "a + b + c", True),
    (r"\sin^2(t)", r"\sin^2 t", True),  # MATH train 7489
    ("5 more", "5", False),  # a word that changes the value is no unit
    (r"12\sqrt{13} feet", r"12\sqrt{13}", True),  # units in words or \text{} at the end still drop
    (r"12\sqrt{13}", r"12\sqrt{13} \text{ feet}", True),
    ("864", r"864 \mbox{ inches}^2", True),
    ("125", r"125\textnormal{ miles}", True),
    (r"8\sqrt{3}", r"8\sqrt{3} \text { square inches}", True),  # a space after \text (MATH train_12k 9254)
    (r"\lambda_{\text{red}}/\sqrt{2}", r"\lambda_{\text {red}} / \sqrt{2}", True),  # Minerva 139
    (r"5 \text{ or } 6", "56", False),  # a dropped unit does not join the numbers either side
    (r"5 \text{cm}", "5", True),
    (r"1.3333333", r"\frac43", False),  # `\frac43` is `\frac{4}{3}`, compared exactly as that is
    (r"\frac43", r"\frac{4}{3}", True),
    (r"\frac9{19}", "9/19", True),
    (r"\frac{270}7", "270/7", True),
    (r"10\%", "10", True),
    ("10%", r"10\%", True),
    ("0.1", r"10\%", False),  # `%` is dropped like a unit, not read as /100
    (r"90^\circ", "90", True),
    (r"90^{\circ}", "90", True),
    ("90°", r"90^\circ", True),
    (r"5\text{ cm}", "5", True),
    (r"5 \mbox{ dollars}", "5", True),
    (
        "18 eggs",
        "18",
        True,
    ),  # plain words after a number are a unit too (math-verify scored "18 dollars" 0, "18 apples" 1)
    ("18 dollars", "18", True),
    ("$4.50 per hour.", "4.5", True),
    ("18 thousand", "18", False),  # a word that scales the number is not a unit
    ("2 dozen", "24", False),  # nor read as its value
    ("5 or more", "5", False),  # nor one that joins another term
    ("3 i", "3", False),  # one letter is a variable, not a unit
    ("18 eggs and 2 hens", "18", False),
    ("5 hundreds", "5", False),  # plural scale words, fractions, symbols and signs change the value
    ("3 fourths", "3", False),
    ("2 pi", "2", False),
    ("5 degrees below zero", "5", False),
    ("100 BC", "100", False),
    ("18 months", "18", True),  # (a unit ending like an ordinal fraction)
    (r"32,\!348", r"\$32,\!348", True),
    ("1{,}000", "1000", True),
    ("3.5", "3.50", True),
    ("3.5", "3.05", False),
    (".5", "0.5", True),
    # fractions, decimals and powers of ten, compared exactly
    ("0.5", r"\frac{1}{2}", True),
    (r"\frac{1}{2}", "0.5", True),
    ("1/2", r"\frac{1}{2}", True),
    (r"\dfrac{14}{3}", r"\frac{14}{3}", True),
    (r"\frac{28}{6}", r"\frac{14}{3}", True),
    (r"-\frac{1}{3}", "-1./3", True),
    ("0.333", r"\frac{1}{3}", False),  # exact rationals: no rounding
    (r"\frac{1}{0}", r"\frac{1}{0}", True),  # not a number, but identical strings always match
    (r"\frac12", r"\frac{1}{2}", True),
    (r"\tfrac{3}{2}", "1.5", True),
    ("4.5e33", r"4.5 \times 10^{33}", True),
    ("4.5e33", "4.6e33", False),
    ("1e-5", "0.00001", True),
    # MATH-style LaTeX (math-verify)
    (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}", True),
    (r"\sqrt{50}", r"5\sqrt{2}", True),
    (r"5\sqrt{2}", r"5\sqrt{3}", False),
    (r"2\pi", "2π", True),
    (r"\pi", r"2\pi", False),
    ("(1,2)", "(2,1)", False),
    ("(1, 2)", "(1,2)", True),
    ("[0, 1)", "[0, 1]", False),
    (r"(-\infty,3]", r"(-\infty, 3]", True),
    (r"(-\infty, 3)", r"(-\infty, 3]", False),
    (r"(3, \frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)", True),
    (r"(3, \pi)", r"\left( 3, \frac{\pi}{2} \right)", False),
    ("Evelyn", r"\text{Evelyn}", True),
    ("Bob", r"\text{Evelyn}", False),
    (r"\{1,2\}", r"\{2,1\}", True),
    ("x=5", "5", True),
    ("6-5i", "6 - 5i", True),
    ("6+5i", "6 - 5i", False),
    ("(x+1)^2", "x^2+2x+1", True),
    ("x^2+1", "x^2+2x+1", False),
    ("p-q", "p - q", True),
    ("q-p", "p - q", False),
    ("3, 5, 7", "3, 5, 7", True),
    ("52_8", "52_8", True),
    (r"\frac{d !}{2 k(d-k) !}", r"\frac{d !}{2 k(d-k) !}", True),  # refused by math-verify, same string
    ("2^{1009}", "2^{1009}", True),
    (r"11\sqrt{2}", r"11\sqrt2", True),
    # no answer is never right
    (None, "5", False),
    ("", "5", False),
    ("   ", "5", False),
    ("$", "5", False),
]


@pytest.mark.parametrize("pred, gold, expected", MATCH_CASES)
def test_answers_match(pred, gold, expected):
    assert answers_match(pred, gold) is expected


# (text, answer, marker_start); the span is checked against the text in the test.
FIND_CASES = [
    (r"so $\boxed{42}$", "42", 4),
    (r"\fbox{ 7 }", "7", 0),
    (r"thus \boxed{\frac{1}{2}}.", r"\frac{1}{2}", 5),
    (r"\boxed{\left(\frac{1}{2}, \{3\}\right)}", r"\left(\frac{1}{2}, \{3\}\right)", 0),  # `\{` is no brace
    (r"so \boxed 5$ ok", "5", 3),
    ("18 - 3 = 15\n#### 15", "15", 12),
    ("#### $1,000.\nbye", "1,000", 0),
    ("#### 1\n#### 2", "2", 7),  # the last `####`
    ("The answer is 3.5.", "3.5", 0),
    (r"The answer is 34\text{ sq. units}. Done", r"34\text{ sq. units}", 0),  # a `. ` inside braces goes on
    ("The answer is {5. Then more", "{5", 0),  # ... but a brace never closed hides nothing
    ("The answer is {5. Then\nmore", "{5", 0),
    ("The answer is 5\\\nThen we check. Done", "5\\", 0),  # a backslash does not escape the line's end
    ("So the final answer is: **42**. Done", "42", 3),
    (r"THE ANSWER IS \(\frac{1}{2}\).", r"\frac{1}{2}", 0),
    # several markers: the one that starts last wins ...
    (r"\boxed{1} and \boxed{2}", "2", 14),
    (r"\boxed{5}. Checking again, the answer is 7.", "7", 27),
    ("\\boxed{74} + 4 = 88\nThe answer is 88", "88", 20),  # SmolLM2 boxes an operand, then answers
    # ... but words after a box are not an answer: no digit, no LaTeX command
    ("So \\boxed{5}.\n\nI hope the answer is correct.", "5", 3),
    ("\\boxed{5}\n\n#### Verification\nChecks out.", "5", 0),  # a markdown heading
    ("The answer is 7.\n#### 8", "8", 17),
    ("#### 8\nthen \\boxed{9}", "9", 12),
    # a phrase's answer ends where a clause begins; a list stays whole
    ("The answer is 5, because 2 + 3 = 5.", "5", 0),
    ("The final answer is 12, which is even.", "12", 0),
    ("The answer is 3, 4, and 5.", "3, 4, and 5", 0),
    # a box inside a phrase: the box's content, the phrase's start
    (r"The answer is $\boxed{5}$.", "5", 0),
    (r"#### \boxed{6}", "6", 0),
    ("The answer is below.\n\\boxed{5}", "5", 21),  # not inside the phrase's sentence
    # an empty or broken last marker is ignored, it does not fall back to an earlier box
    (r"The answer is 4. \boxed{}", "4", 0),
    (r"\boxed{3} then \boxed{12", None, None),
    (r"The answer is $\boxed{}$", None, None),
]


@pytest.mark.parametrize("text, answer, marker_start", FIND_CASES)
def test_find_answer(text, answer, marker_start):
    span = find_answer(text)
    if answer is None:
        assert span is None
        return
    assert span.answer == answer and text[span.start : span.end] == answer
    assert span.marker_start == marker_start
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    "text",
    ["", "The result is 42.", "42", r"\boxed{}", r"\boxed{ }", r"\boxed{12", "#### ", "####\n5", "the answer is ."],
)
def test_find_answer_none(text):
    assert find_answer(text) is None and extract_answer(text) is None


def test_reward():
    assert reward(r"so \boxed{18}", "18") == 1.0
    assert reward(r"so \boxed{17}", "18") == 0.0
    assert reward("the result is 18", "18") == 0.0  # no marker, no credit
    assert reward(r"The answer is 34\text{ sq. units}.", "34") == 1.0  # the unit's `. ` does not cut it
    assert reward(r"\boxed{17}", "18", format_bonus=0.1) == 0.1
    assert reward(r"\boxed{18}", "18", format_bonus=0.1) == 1.1
    assert reward("18", "18", format_bonus=0.1) == 0.0


def _gold_answers():
    if not DATA.is_dir():
        pytest.skip(f"../shared/data not found: {DATA} (the benchmark files live beside the repository)")
    for path in sorted(DATA.glob("*/test.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            yield path.parent.name, json.loads(line)["answer"]


def test_every_gold_answer_matches_itself():
    """Boxed (and, for GSM8K, `####`) gold answers must be extracted and matched back to themselves."""
    failures, rows = [], 0
    for dataset, gold in _gold_answers():
        rows += 1
        forms = [f"\\boxed{{{gold}}}"] + ([f"#### {gold}"] if dataset == "gsm8k" else [])
        failures += [(dataset, text) for text in forms if not answers_match(extract_answer(text), gold)]
    assert rows > 2_000 and not failures, failures[:10]
