"""Planted GSM8K errors (research/real_smollm2/plant_gsm8k.py): hand-checked plants on inline solutions, no model."""

import json
from fractions import Fraction
from pathlib import Path

import pytest

from oar.answers import find_answer
from research.real_smollm2.plant_gsm8k import Skip, fmt, parse, plant, render, try_plant, uses

JANET = (
    "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
    "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer’s market.\n#### 18"
)
JANET_PROBLEM = (
    "Janet’s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
    "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck egg."
)
JOSH = (
    "The cost of the house and repairs came out to 80,000+50,000=$<<80000+50000=130000>>130,000\n"
    "He increased the value of the house by 80,000*1.5=<<80000*1.5=120000>>120,000\n"
    "So the new value of the house is 120,000+80,000=$<<120000+80000=200000>>200,000\n"
    "So he made a profit of 200,000-130,000=$<<200000-130000=70000>>70,000\n#### 70000"
)
JOSH_PROBLEM = (
    "He buys a house for $80,000 and then puts in $50,000 in repairs. This increased the value of the house by 150%."
)


def test_parse_reads_the_steps_and_their_dependencies():
    p = parse(JANET)
    assert [s.value for s in p.steps] == [9, 18] and p.answer == 18
    assert JANET[slice(*p.steps[0].shown)] == "9" and JANET[slice(*p.answer_span)] == "18"
    assert uses(p) == [set(), {0}]  # the 9 of `9*2` is step 0's result


def test_plant_carries_the_slip_to_the_answer():
    p = parse(JANET)
    pl = try_plant(p, JANET_PROBLEM, 0, 1)  # 16-3-4 "=" 10: then 10*2 = 20, the answer 20
    assert pl.new_values == {0: 10, 1: 20}
    text, spans = render(p, pl, pl)
    assert text == (
        "Janet sells 16 - 3 - 4 = 10 duck eggs a day.\n"
        "She makes 10 * 2 = $20 every day at the farmer’s market.\n"
        "#### 20"
    )
    assert [text[a:b] for a, b in spans["planted"]] == ["10"]
    assert sorted(spans["carried"]) == spans["carried"]
    assert [text[a:b] for a, b in spans["carried"]] == ["10"]  # `10 * 2`
    assert [text[a:b] for a, b in spans["final"]] == ["20"]  # the shown result the answer copies (not the #### answer)
    assert find_answer(text).answer == "20"
    gold, gold_spans = render(p, None, pl)  # the same numbers, marked on the untouched text
    assert gold == JANET.replace("<<16-3-4=9>>", "").replace("<<9*2=18>>", "").replace(".\n####", ".\n####")
    assert [gold[a:b] for a, b in gold_spans["planted"]] == ["9"]
    assert [gold[a:b] for a, b in gold_spans["carried"] + gold_spans["final"]] == ["9", "18"]


def test_plant_keeps_the_number_style_and_recomputes_downstream():
    p = parse(JOSH)
    pl = try_plant(
        p, JOSH_PROBLEM, 0, 10
    )  # cost 130,010: profit 200,000 - 130,010 = 69,990; step 1 and 2 do not use it
    assert pl.new_values == {0: 130010, 3: 69990}
    text, spans = render(p, pl, pl)
    assert text.splitlines()[0] == "The cost of the house and repairs came out to 80,000+50,000=$130,010"
    assert text.splitlines()[3] == "So he made a profit of 200,000-130,010=$69,990"
    assert text.endswith("\n#### 69990")  # the answer line keeps its own (plain) style
    assert [text[a:b] for a, b in spans["carried"] + spans["final"]] == ["130,010", "69,990"]


def test_ambiguous_chains_are_skipped():
    # The intermediate 8 is also a number of the problem: a later 8 could be either, so no plant.
    solution = "She has 5+3=<<5+3=8>>8 apples.\nShe gives 8*2=<<8*2=16>>16.\n#### 16"
    with pytest.raises(Skip) as e:
        plant(parse(solution), "She has 5 apples and 8 pears; she buys 3 more apples.", seed=0, key="x")
    assert e.value.reason == "ambiguous"


@pytest.mark.parametrize(
    "solution, reason",
    [
        ("Half is 10/3=<<10/3=3.33>>3.33\nso 3.33*3=<<3.33*3=10>>10\n#### 10", "inexact"),  # rounded annotations
        ("He has 2+2=<<2+2=4>>4\n#### 4", "one_step"),
        ("He has 2+2=<<2+2=4>>4\nthen 4*3=<<4*3=12>>12\n#### 13", "last_not_answer"),
        ("He has 2+2=<<2+2=4>>four\nthen 4*3=<<4*3=12>>12\n#### 12", "not_shown"),
    ],
)
def test_untraceable_solutions_say_why(solution, reason):
    with pytest.raises(Skip) as e:
        parse(solution)
    assert e.value.reason == reason


def test_a_count_stays_whole_and_the_answer_must_change():
    solution = "Each gets 12/4=<<12/4=3>>3\nIn all 3*0=<<3*0=0>>0\n#### 0"
    with pytest.raises(Skip) as e:
        try_plant(parse(solution), "12 cakes for 4 kids", 0, 1)
    assert e.value.reason == "answer_unchanged"  # 4*0 is still 0
    solution = "Each gets 12/4=<<12/4=3>>3\nHalf of it is 3/2=<<3/2=1.5>>1.5\n#### 1.5"
    assert try_plant(parse(solution), "12 cakes for 4 kids", 0, 2).new_values == {0: 5, 1: Fraction(5, 2)}
    with pytest.raises(Skip) as e:
        try_plant(parse("Each gets 12/4=<<12/4=3>>3\nthen 3*3=<<3*3=9>>9\nso 9-6=<<9-6=3>>3\n#### 3"), "", 0, 1)
    assert e.value.reason == "ambiguous"  # the last result 3 equals step 0's


def test_plants_are_deterministic_from_the_seed():
    p = parse(JOSH)
    assert plant(p, JOSH_PROBLEM, seed=0, key="test-2") == plant(p, JOSH_PROBLEM, seed=0, key="test-2")
    assert len({plant(p, JOSH_PROBLEM, seed=s, key="test-2").delta for s in range(10)}) > 1


def test_fmt_follows_the_old_style():
    assert fmt(Fraction(130010), "130,000") == "130,010"
    assert (
        fmt(Fraction(5, 2), "") == "2.5"
        and fmt(Fraction(3), "7.50") == "3.00"
        and fmt(Fraction(1200), "1000") == "1200"
    )


DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "train.jsonl"


def test_every_plant_of_real_solutions_is_consistent():
    if not DATA.is_file():
        pytest.skip(f"../shared/data not found: {DATA} (GSM8K lives beside the repository)")
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:300]]
    planted = 0
    for r in rows:
        try:
            p = parse(r["solution"])
            pl = plant(p, r["problem"], seed=0, key=r["id"])  # try_plant re-parses the planted solution
        except Skip:
            continue
        planted += 1
        text, spans = render(p, pl, pl)
        gold, _ = render(p, None, pl)
        assert "<<" not in text and find_answer(text).answer != find_answer(gold).answer
        assert len(spans["planted"]) == 1 and len(spans["final"]) == 1
    assert planted > 150  # about two thirds of GSM8K train plants
