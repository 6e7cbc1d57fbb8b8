"""The testbeds' flawed teachers and the known tokens they plant (oar/tasks/teacher.py, oar/tasks/testbeds.py)."""

from dataclasses import replace

import pytest

from oar.tasks.arith import ArithConfig, arith_problems, arith_solution
from oar.training.data import Problem
from oar.tasks.teacher import fork_spans, filler_spans, pad_lines, slip_lines, slip_spans, slipped


def test_slip_by_hand():
    assert (slipped(45, "k"), slipped(49, "k"), slipped(40, "k")) in [(44, 48, 41), (46, 48, 41)]
    lines = ["28 * 3 = 84", "84 + 9 = 93", "#### 93"]
    assert slip_lines(lines, "p", 0.0) == lines
    # rate 1: every fact is shaky, each occurrence slips with probability 1/2 (a hash of problem and line)
    out = slip_lines(lines, "Compute (28 * 3) + 9.", 1.0)
    first = int(out[0].rsplit("= ", 1)[1])
    assert out[1].startswith(f"{first} + 9 = ")  # the written value is carried forward
    assert out[2] == f"#### {out[1].rsplit('= ', 1)[1]}"  # and the answer follows it
    assert pad_lines(lines, "hmm, ") == ["hmm, 28 * 3 = 84", "hmm, 84 + 9 = 93", "#### 93"]


def test_known_spans_by_hand():
    text = "28 * 3 = 85\n85 + 9 = 94\n#### 94"
    assert slip_spans(text) == [(10, 11)]  # 84 written 85: the last digit; line 2 is right given 85
    assert slip_spans("45 - 5 = 4\n#### 4") == [(10, 11)]  # 40 written 4: the newline that ended the number
    assert slip_spans("hmm, 3 + 4 = 7\n") == []
    assert fork_spans("37 + 8 = 45\n45 - 5 = 40\n#### 40") == [(24, 25)]  # '#': the premature answer
    assert fork_spans("37 + 8 = 45\n45 - 5 = 40\n40 * 2 = 80\n#### 80") == [(24, 25)]  # '4': goes on
    assert fork_spans("37 + 8 = 45\n#### 45") == []
    assert filler_spans("hmm, 1 + 2 = 3\nhmm, 3 * 2 = 6\n#### 6", "hmm, ") == [(0, 5), (15, 20)]


def test_testbed_teachers_plant_their_flaws_at_their_rates():
    from oar.tasks.testbeds import TESTBEDS
    from oar.tasks.tiny_arith import TinyArithRecipe, sft_target

    problems = arith_problems(3000, seed=0, config=ArithConfig(min_ops=1, max_ops=3))
    fork, slip, filler = (TESTBEDS[k].recipe for k in ("fork", "slip", "filler"))
    assert fork == TinyArithRecipe()  # v4 is the fork testbed, unchanged
    slips = lines = 0
    for p in problems:
        s, f = sft_target(p, slip), sft_target(p, filler)
        assert f == "\n".join(pad_lines(s.split("\n"), "hmm, "))  # filler = slip's teacher, padded
        assert [text[a:b] for text in [f] for a, b in filler_spans(f, "hmm, ")] == ["hmm, "] * s.count("=")
        slips, lines = slips + len(slip_spans(s)), lines + s.count("=")
        if not slip_spans(s):
            assert s == arith_solution(p)  # no early answers in slip
    assert abs(slips / lines - 0.15) < 0.03  # 30% of facts shaky x 1/2 of their occurrences
    with pytest.raises(ValueError, match="filler"):
        replace(TinyArithRecipe(), filler="7 ")
    assert sft_target(Problem("Compute (37 + 8) - 5.", "40"), fork) == arith_solution("Compute (37 + 8) - 5.")
