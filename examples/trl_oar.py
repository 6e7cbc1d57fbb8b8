"""A TRL user's GRPO script, trained with OAR-G by changing one line: its trl import (docs/trl.md).

    pip install -r requirements.txt -r requirements-trl.txt
    python examples/trl_oar.py                        # tiny-arith on arith, 30 steps: 17 s on one CPU thread
    accelerate launch --num_processes 2 examples/trl_oar.py --model Qwen/Qwen2.5-0.5B-Instruct

Everything below is TRL's GRPO recipe (a dataset of prompts and answers, a reward function, GRPOConfig,
GRPOTrainer, train) but one line, marked: `from trl import GRPOConfig, GRPOTrainer` became the import from
oar.integrations.trl, whose GRPOTrainer here is OARGRPOTrainer, OAR-G by default. Its two keywords of its own
are optional: GRPOTrainer(..., credit="oar-p") picks another method of oar's table (grpo, oar-g, oar-p,
entropy, entropy-mask, tempo, ...), settings=OARSettings(gate_quantile=0.25, probe="answer_joint") OAR's
settings. TRL's log gains oar/ess_ratio, oar/weight_max, oar/frac_boosted, oar/frac_suppressed,
oar/frac_scored and oar/frac_nonfinite_scores (docs/maths.md §6), printed at the end.
"""

import argparse

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

# from trl import GRPOConfig, GRPOTrainer  # TRL's GRPO: the line as it was
from oar.integrations.trl import GRPOConfig, OARGRPOTrainer as GRPOTrainer  # OAR-G: the one changed line
from oar.rewards import correctness_reward
from oar.tasks.arith import arith_problems
from oar.tasks.tiny_arith_cache import model_source


def correct(completions, answer, **_):
    """TRL's reward-function signature: 1 for a completion whose final answer equals the gold one, else 0."""
    return [correctness_reward(c[0]["content"], a) for c, a in zip(completions, answer)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-arith", help="tiny-arith (ships with oar), a hub id or a folder")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--output_dir", default="runs/trl-oar")
    args = p.parse_args()

    source = model_source(args.model)  # tiny-arith: its folder; any other name as it is
    tokenizer = AutoTokenizer.from_pretrained(source, padding_side="left")
    problems = arith_problems(2_000, seed=0)  # the built-in task; answers end in `#### N`
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": q.problem}], "answer": q.answer} for q in problems]
    )
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=32,  # 4 prompts x 8 rollouts a step
        num_generations=8,
        max_completion_length=48,
        learning_rate=2e-4,
        logging_steps=5,
        report_to="none",
        bf16=False,  # a CPU run in float32 (OAR-G's default noise is below bf16's rounding: docs/model-families.md)
        gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(source),
        reward_funcs=correct,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
    )
    trainer.train()
    for log in trainer.state.log_history:
        if "reward" in log:
            print(
                f"step {log['step']:3d}  reward {log['reward']:.3f}  ess {log['oar/ess_ratio']:.2f}  "
                f"boosted {log['oar/frac_boosted']:.2f}  scored {log['oar/frac_scored']:.2f}"
            )


if __name__ == "__main__":
    main()
