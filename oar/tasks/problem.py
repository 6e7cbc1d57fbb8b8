"""A maths problem: its statement and its raw gold answer string (the one record every loader makes).

The tasks' own record (oar/tasks/arith.py makes them), which the loaders of oar/training/data.py
return too: it lives with the tasks so that a task never imports the training machinery."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One problem: its statement and its raw gold answer; from a data set's row, also the system turn of a
    conversational row and the row itself (the columns a TRL-style reward function is passed)."""

    problem: str
    answer: str
    system: str = ""  # a conversational row's system turn ('' when it has none)
    row: dict[str, Any] | None = field(default=None, compare=False, repr=False)  # the row as read (None: built)
