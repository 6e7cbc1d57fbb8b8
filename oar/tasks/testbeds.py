"""The three tiny-arith testbeds whose pivotal tokens are known (oar/tasks/teacher.py says what each plants).

    fork    v4, the default built-in policy: the teacher answers one line early on 75% of the
            3-operation problems; the fork token decides whether a rollout goes on computing.
    slip    no early answers; 30% of the facts are shaky (the teacher slips on their last digit
            half the time); the slipped digit decides the answer.
    filler  slip's teacher, with every worked line prefixed by `hmm, `: the same pivotal tokens
            among 5 per line that cannot change the answer.

Each is a TinyArithRecipe with the default size and steps (built in ~5 min on 2 threads, within the
6-minute budget), and the completion budget its solutions need (`max_new_tokens`, filler's lines
are longer). Testbeds are built into folders named by the caller (research/testbeds_v5/study_v5.py builds them
under its root); the built-in `tiny-arith` name stays v4.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from oar.tasks.tiny_arith import TinyArithRecipe


@dataclass(frozen=True)
class Testbed:
    name: str
    recipe: TinyArithRecipe
    max_new_tokens: int
    """train.py --max_new_tokens for this testbed (64 is train.py's default)."""
    fork_line: int | None
    """0-based line whose first character is the fork (None: no fork planted)."""


_SLIP = replace(TinyArithRecipe(), lazy_rate=0.0, slip_rate=0.3)
TESTBEDS = {
    "fork": Testbed("fork", TinyArithRecipe(), 64, fork_line=2),
    "slip": Testbed("slip", _SLIP, 64, fork_line=None),
    "filler": Testbed("filler", replace(_SLIP, filler="hmm, "), 96, fork_line=None),
}
