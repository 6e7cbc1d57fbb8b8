"""TRL's side of scripts/bench/bench.py's throughput comparison: GRPOTrainer on the setting train.py runs.

    /tmp/trl-venv/bin/python scripts/bench/bench_trl.py --model DIR --steps 4 --json OUT.json

Run with a Python that has `trl` (a benchmark-only virtual environment: trl is not a dependency of
this project). It takes the same model folder, the same arith problems in the same order
(oar.training.data.prompt_order with the same seed), the same chat-templated prompt text, G, completion budget,
sampling (temperature 1, top-p 1, no top-k), micro-batch and accumulation (one generation of P x G
completions per optimizer step), one update per batch (num_iterations=1), no KL (beta=0), the
per-sequence mean loss (loss_type='grpo', what train.py's seq_mean is), group-scaled advantages and
the same reward function (oar.rewards.reward). Writes the wall-clock seconds of every optimizer step
(generation, reward, loss, backward and optimizer step: TRL generates inside the step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="model folder (save_pretrained layout)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts_per_step", type=int, default=32)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--micro_batch_size", type=int, default=64)
    p.add_argument("--learning_rate", type=float, default=1e-12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True)
    args = p.parse_args()

    import torch
    import trl

    if "OMP_NUM_THREADS" in os.environ:  # the same threads as our side (bench.py --threads)
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from oar.training.data import load_problems
    from oar.rewards import reward
    from oar.sampler import format_prompt
    from oar.training.data import prompt_order

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    problems = load_problems("arith", split="train", limit=10_000, seed=args.seed)
    order = [
        i
        for step in range(args.steps)
        for i in prompt_order(step, args.prompts_per_step, 0, len(problems), args.prompts_per_step, args.seed)
    ]
    data = Dataset.from_list(
        [{"prompt": format_prompt(tok, problems[i].problem, ""), "answer": problems[i].answer} for i in order]
    )

    def correctness(prompts, completions, answer, **_):
        return [reward(c, a) for c, a in zip(completions, answer)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self.t0 = [], None

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.seconds.append(time.perf_counter() - self.t0)

    rollouts = args.prompts_per_step * args.group_size
    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as out:
        cfg = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.micro_batch_size,
            gradient_accumulation_steps=rollouts // args.micro_batch_size,
            num_generations=args.group_size,
            max_completion_length=args.max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            num_iterations=1,
            beta=0.0,
            loss_type="grpo",
            scale_rewards="group",
            epsilon=0.2,
            learning_rate=args.learning_rate,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_grad_norm=1.0,
            max_steps=args.steps,
            shuffle_dataset=False,
            seed=args.seed,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=False,
            fp16=False,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        model = AutoModelForCausalLM.from_pretrained(args.model)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=correctness,
            args=cfg,
            train_dataset=data,
            processing_class=tok,
            callbacks=[timer],
        )
        trainer.train()
        lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    Path(args.json).write_text(
        json.dumps({"step_seconds": timer.seconds, "trl_version": trl.__version__, "completion_length": lengths})
    )


if __name__ == "__main__":
    main()
