"""scripts/analysis/fidelity.py's pieces: the answer split of a gold solution and the four fidelity numbers."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.analysis.fidelity import compare, split_boxed  # noqa: E402


def test_split_boxed_takes_the_last_box_and_nested_braces():
    assert split_boxed("So $x=\\boxed{1}$, then $y=\\boxed{\\frac{1}{2}}$.") == (
        "So $x=\\boxed{1}$, then $y=",
        "\\frac{1}{2}",
    )
    assert split_boxed("no answer here") is None
    assert split_boxed("open \\boxed{1 + {2}") is None  # never closed


def test_compare_identical_reversed_and_rescaled_scores():
    reas = torch.tensor([[False, True, True, True, True, True, False]])
    exact = torch.tensor([[0.0, 0.1, 0.5, 0.2, 0.9, 0.05, 0.0]])
    same = compare(exact.clone(), exact, reas)
    assert same == pytest.approx({"spearman": 1.0, "top20": 1.0, "weight_mae": 0.0, "branch_flip": 0.0})
    # Ranks 2 4 3 5 1 become 4 2 3 1 5 (6 - r): Spearman -1; the top token (k = round(0.2 * 5) = 1) is
    # now the lowest; 4 of the 5 tokens change gate branch (only the median one, rank 3, keeps its own).
    rev = compare(torch.tensor([[0.0, 0.5, 0.1, 0.2, 0.05, 0.9, 0.0]]), exact, reas)
    assert rev["spearman"] == pytest.approx(-1.0) and rev["top20"] == 0.0 and rev["branch_flip"] == pytest.approx(0.8)
    # Scores 10x larger: same ranks, but log(1 + |s|) is not scale-free, so the gated weights move.
    big = compare(exact * 10, exact, reas)
    assert big["spearman"] == pytest.approx(1.0) and big["top20"] == 1.0 and big["weight_mae"] > 0.01
