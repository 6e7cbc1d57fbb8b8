"""One torch thread against two, side by side: train.py and eval.py, on tiny-arith and SmolLM2, with the
machine otherwise as it is ("idle": nothing of this script's beside the run) and beside another job (a
process that keeps one core busy, at the same nice level), the two thread counts alternating run by run.

    nice -n 10 python scripts/bench/bench_threads.py --out docs/bench/threads-cpu.json
    python scripts/bench/bench_threads.py --model <folder> --data <file.jsonl> --toy --out /tmp/t.json  # a test

Why: a plain `python train.py` lets torch take a thread per core, `accelerate launch` sets OMP_NUM_THREADS=1;
on shared cores the first was measured 3-12x slower. The runs differ only in OMP_NUM_THREADS;
each is a whole process (imports, model load, the work), timed by its wall clock and its CPU seconds
(resource.getrusage of the children), with the step's own `time/step_s` for train.py. The load average
before each run is recorded: on a machine shared with other jobs it says what else ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_DATA = ROOT / "research" / "real_smollm2" / "data"
SMOLLM2_INSTRUCTION = "End your reply with the answer in \\boxed{}, like this: The answer is \\boxed{17}."


def cases(model: str, data: str, smollm2: bool, toy: bool) -> dict[str, list[str]]:
    """name -> the command (script and flags). tiny-arith's train.py run is the README's 30-second command;
    SmolLM2's is one GRPO step of docs/real-model.md's command at a quarter of its prompts."""
    tiny_train = ["train.py", "--model", model, "--steps", "1" if toy else "3", "--eval_size", "4" if toy else "50"]
    tiny_train += ["--dataset", data, "--prompts_per_step", "2", "--group_size", "4"] if toy else []
    tiny_eval = ["eval.py", "--model", model, "--eval_size", "4" if toy else "200"]
    tiny_eval += ["--dataset", data] if toy else []
    out = {"tiny-arith train.py": tiny_train, "tiny-arith eval.py": tiny_eval}
    if smollm2:
        common = ["--model", "smollm2", "--instruction", SMOLLM2_INSTRUCTION, "--max_new_tokens", "64"]
        out["smollm2 train.py"] = ["train.py", *common, "--method", "grpo", "--steps", "1", "--prompts_per_step", "2"]
        out["smollm2 train.py"] += ["--group_size", "8", "--micro_batch_size", "16", "--temperature", "0.5"]
        out["smollm2 train.py"] += ["--learning_rate", "1e-5", "--dataset", str(SMOLLM2_DATA / "train.jsonl")]
        out["smollm2 train.py"] += ["--eval_dataset", str(SMOLLM2_DATA / "test.jsonl"), "--eval_size", "8"]
        out["smollm2 eval.py"] = ["eval.py", *common, "--dataset", str(SMOLLM2_DATA / "test.jsonl")]
        out["smollm2 eval.py"] += ["--eval_size", "16"]
    return out


def busy() -> subprocess.Popen:
    """Another job: one process that keeps a core busy (at this process's nice level, inherited)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def timed(command: list[str], threads: int, folder: Path) -> dict:
    """One run of `command` with OMP_NUM_THREADS=threads in a fresh output folder: wall and CPU seconds,
    the load average before it, and train.py's median time/step_s."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = folder / f"run-{time.monotonic_ns()}"
    cmd = [sys.executable, str(ROOT / command[0]), *command[1:], "--output_dir", str(out)]
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"bench_threads: {' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    row = {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)}
    row["load_before"] = load
    metrics = out / "metrics.jsonl"
    if metrics.is_file():
        steps = [json.loads(line)["time/step_s"] for line in metrics.read_text().splitlines() if line.strip()]
        row["step_s"] = statistics.median(steps)
    return row


def measure(commands: dict[str, list[str]], conditions: list[str], repeats: int, threads=(1, 2)) -> dict:
    """For each condition and case, `repeats` rounds; a round runs every thread count once, in an order
    that alternates round by round (1, 2 then 2, 1), so a slow spell of the machine falls on both."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
        for condition in conditions:
            other = busy() if condition == "beside another job" else None
            try:
                for name, command in commands.items():
                    runs = {t: [] for t in threads}
                    for r in range(repeats):
                        for t in threads if r % 2 == 0 else threads[::-1]:
                            runs[t].append(timed(command, t, Path(tmp)))
                            print(f"{condition} | {name} | {t} thread(s): {runs[t][-1]}", file=sys.stderr, flush=True)
                    results.setdefault(condition, {})[name] = summarise(runs)
            finally:
                if other is not None:
                    other.kill()
                    other.wait()
    return results


def summarise(runs: dict[int, list[dict]]) -> dict:
    """Each thread count's runs and medians, and the ratio of medians 2 threads / 1 thread (> 1: two are slower)."""
    out = {f"{t} thread": {"runs": rows} | medians(rows) for t, rows in runs.items()}
    one, two = out["1 thread"], out["2 thread"]
    out["two_over_one"] = {
        k: two[f"median_{k}"] / one[f"median_{k}"] for k in ("wall_s", "cpu_s", "step_s") if f"median_{k}" in two
    }
    return out


def medians(rows: list[dict]) -> dict:
    return {
        f"median_{k}": statistics.median(r[k] for r in rows) for k in ("wall_s", "cpu_s", "step_s") if k in rows[0]
    }


def machine() -> dict:
    cpu = ""
    info = Path("/proc/cpuinfo")
    if info.is_file():
        cpu = next((ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if "model name" in ln), "")
    import torch

    return {
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu": cpu,
        "nice": os.nice(0),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-arith", help="the small model (tiny-arith, or a folder for --toy)")
    ap.add_argument("--data", default="arith", help="its data (arith, or a .jsonl file for --toy)")
    ap.add_argument("--no_smollm2", action="store_true", help="leave SmolLM2 out")
    ap.add_argument("--toy", action="store_true", help="the smallest runs (a test of this script)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--conditions", default="idle,beside another job")
    ap.add_argument("--cases", default="", help="comma-separated case names to run (default: all)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    commands = cases(args.model, args.data, not args.no_smollm2, args.toy)
    if args.cases:
        commands = {name: commands[name] for name in args.cases.split(",")}
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    results = measure(commands, conditions, args.repeats)
    record = {
        "what": __doc__.split("\n\n")[0],
        "command": "python scripts/bench/bench_threads.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine(),
        "cases": {name: " ".join(c) for name, c in commands.items()},
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
