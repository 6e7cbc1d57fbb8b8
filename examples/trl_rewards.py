"""Reward functions written for TRL's GRPOTrainer, in TRL's form: f(completions, **kwargs) -> list[float | None],
one call per step, every data set column passed as a keyword list. `--reward_module` takes such a file unchanged
(it has no REWARD_FUNCTIONS dict: each public function with a `completions` parameter is a reward, by its name):

    python train.py --dataset my_prompts.jsonl --reward_module examples/trl_rewards.py \\
        --reward accuracy_reward,format_reward:0.1

A completion is a string, or [{"role": "assistant", "content": ...}] when the row's prompt is a conversation
(TRL's conversational format); `answer` is the data set's column as given.
"""

import re


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def accuracy_reward(completions, answer, **kwargs):
    """1.0 when the number after the completion's last '####' (or in its last \\boxed{}) is the gold answer,
    0.0 otherwise; None when the gold answer is not a number (as TRL's own accuracy_reward skips a gold it
    cannot parse): this term then does not score the rollout."""
    rewards = []
    for completion, gold in zip(completions, answer):
        gold = gold.rsplit("####", 1)[-1].strip().replace(",", "")  # a GSM8K answer: what follows '####'
        if not re.fullmatch(r"-?\d+(\.\d+)?", gold):
            rewards.append(None)
            continue
        found = re.findall(r"####\s*(-?[\d,.]+)|\\boxed\{(-?[\d,.]+)\}", _text(completion))
        given = next(g for g in found[-1] if g).replace(",", "").rstrip(".") if found else None
        rewards.append(1.0 if given == gold else 0.0)
    return rewards


def format_reward(completions, **kwargs):
    """TRL's documented example, adapted to a final-answer line: 1.0 when the completion ends with one."""
    pattern = r"(?s).*(####\s*\S+|\\boxed\{[^}]*\})\s*$"
    return [1.0 if re.match(pattern, _text(c)) else 0.0 for c in completions]
