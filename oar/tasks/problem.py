"""A maths problem: its statement and its raw gold answer string (the one record every loader makes).

The tasks' own record (oar/tasks/arith.py makes them), which the loaders of oar/training/data.py
return too: it lives with the tasks so that a task never imports the training machinery."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One problem: its statement and its raw gold answer."""

    problem: str
    answer: str
