"""The training-step measurements behind scripts/bench/bench.py (its parts 2 and 4): per-step seconds
and CPU seconds of train.py for each method, and of TRL's GRPOTrainer, in interleaved rounds."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from bench_parts import med  # noqa: E402


def train_steps(
    settings: dict, methods, *, steps: int, repeats: int, trl_python: str | None = None, trl_model: str | None = None
) -> dict:
    """Per-step seconds of train.main for each method (and of TRL's GRPOTrainer when trl_python is
    given), runs interleaved in rounds, the first step of every run dropped (warm-up). "oar-g+all" is oar-g
    with --score_all. Learning rate 1e-12: every method samples the same rollouts at every step, the update
    still computed. `cpu_ratio_vs_grpo`: the median over rounds of a method's CPU seconds over GRPO's on the
    same steps in the same round (nearly the same busy neighbours): the steadier figure on a shared machine.
    `same_rollouts`: whether every method's steps had GRPO's rewards and completion lengths, round by
    round (the check that the ratios compare the same work)."""
    from oar.training.config import Config
    from tests.tinyrun import train_module  # train.py's main, loaded by its path (train.py is not a library)

    samples = {m: [] for m in methods}
    cpu = {m: [] for m in methods}
    extra = {
        m: {"completion_length": [], "oar_s_per_rollout": [], "frac_no_answer": [], "frac_scored": []} for m in methods
    }
    seen = {m: [] for m in methods}  # per run: each step's (reward/mean, completion/length)
    runs = list(methods) + (["trl"] if trl_python else [])
    if trl_python:
        samples["trl"], extra["trl"] = [], {"completion_length": []}
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        for r in range(repeats):
            for m in runs if r % 2 == 0 else runs[::-1]:
                out = Path(tmp) / f"{m}-{r}"
                if m == "trl":
                    same = [
                        f"--{k}={getattr(Config(**settings), k)}"
                        for k in ("prompts_per_step", "group_size", "max_new_tokens", "micro_batch_size")
                    ]
                    cmd = [
                        trl_python,
                        str(HERE / "bench_trl.py"),
                        "--model",
                        trl_model,
                        "--steps",
                        str(steps),
                        *same,
                        "--json",
                        str(out) + ".json",
                    ]
                    subprocess.run(cmd, check=True, capture_output=True, text=True)
                    got = json.loads(Path(str(out) + ".json").read_text())
                    samples["trl"] += got["step_seconds"][1:]
                    extra["trl"]["completion_length"] += got["completion_length"][1:]
                    extra["trl"]["version"] = got["trl_version"]
                    continue
                method, _, variant = m.partition("+")
                cfg = Config(
                    **settings,
                    method=method,
                    score_all=variant == "all",
                    steps=steps,
                    output_dir=str(out),
                    learning_rate=1e-12,
                    eval_size=1,
                    eval_every=0,
                    save_every=0,
                )
                with contextlib.redirect_stdout(io.StringIO()):
                    train_module().main(cfg)
                lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
                seen[m].append([(ln["reward/mean"], ln["completion/length"]) for ln in lines])
                lines = lines[1:]
                samples[m] += [ln["time/step_s"] for ln in lines]
                cpu[m] += [ln["time/step_cpu_s"] for ln in lines]
                extra[m]["completion_length"] += [ln["completion/length"] for ln in lines]
                extra[m]["oar_s_per_rollout"] += [ln["oar/seconds_per_rollout"] for ln in lines]
                extra[m]["frac_no_answer"] += [ln["oar/frac_no_answer"] for ln in lines]
                extra[m]["frac_scored"] += [ln["oar/frac_scored"] for ln in lines]
    differ = sorted({m for m in methods for mine, grpo in zip(seen[m], seen["grpo"]) if mine != grpo})
    res = {
        "settings": settings,
        "steps_per_run": steps,
        "repeats": repeats,
        "step_s": samples,
        "same_rollouts": not differ,
        "rollouts_differ": differ,
        "median_step_s": {m: med(s) for m, s in samples.items()},
    }
    res["details"] = {m: {k: (med(v) if isinstance(v, list) else v) for k, v in d.items()} for m, d in extra.items()}
    base = res["median_step_s"]["grpo"]
    res["ratio_vs_grpo"] = {m: res["median_step_s"][m] / base for m in samples if m != "grpo"}
    res["step_cpu_s"] = cpu
    n = steps - 1  # a run's timed steps: cpu[m] holds the rounds one after another
    res["cpu_ratio_vs_grpo_by_round"] = {
        m: [sum(cpu[m][i : i + n]) / sum(cpu["grpo"][i : i + n]) for i in range(0, len(cpu["grpo"]), n)]
        for m in methods
        if m != "grpo"
    }
    res["cpu_ratio_vs_grpo"] = {m: med(r) for m, r in res["cpu_ratio_vs_grpo_by_round"].items()}
    return res
