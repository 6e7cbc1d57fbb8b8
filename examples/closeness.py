"""closeness: a reward defined outside oar/, in oar/reward_table.py's protocol (docs/rewards.md).

    accelerate launch train.py --reward_module examples/closeness.py --reward correct,closeness:0.5

Partial credit for a numeric final answer near the gold one: 1 / (1 + |answer - gold|), so an exact
answer earns 1, one off earns 0.5, and no answer, or one that is not a plain number, earns 0. Summed
with `correct` it makes the reward denser than 0/1: in a group where every answer is wrong, the
nearer ones still get a positive advantage. A hypothesis to test, not a finding: it also rewards
guessing near the answer, which `correct` alone never does.
"""

import math

from oar.answers import extract_answer


def closeness(completion: str, gold: str, problem: str) -> float:
    """1 / (1 + |a - g|) for the completion's final answer a and the gold answer g, both plain numbers; else 0."""
    answer = extract_answer(completion)
    try:
        a, g = float(answer.replace(",", "")), float(gold.replace(",", ""))
    except (AttributeError, ValueError):  # no final answer (None), or not a plain number
        return 0.0
    distance = abs(a - g)
    return (
        1.0 / (1.0 + distance) if math.isfinite(distance) else 0.0
    )  # "nan", "inf", 1e400: no credit, never a NaN reward


REWARD_FUNCTIONS = {"closeness": closeness}
