"""A maths problem: its statement and its raw gold answer string (the one record every loader makes).

Its own module so that the loaders (oar/training/data.py) and the built-in task that makes problems
(oar/tasks/arith.py) both depend on it, and not on each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One problem: its statement and its raw gold answer."""

    problem: str
    answer: str
