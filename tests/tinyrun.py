"""Helpers for the tests that run train.py end to end: a tiny model that earns some reward, and
ways to run train.py (subprocess, `accelerate launch`, or in this process).

Why a trained model: a random model never writes a correct answer, so every reward is 0, every
advantage is 0, the gradient is 0 and the parameters never move; any "same update" test would
then pass trivially. A few seconds of supervised training on 1-operation, 1-digit arith problems
(the same problems the RL run then sees) gives rewards of about 0.5 with mixed groups.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "train.py"
EVAL = ROOT / "eval.py"
TIME_KEYS = ("time/", "oar/seconds_per_rollout")  # wall-clock metrics: never equal between runs

# Flags every end-to-end test run shares: tiny batches, no evaluation, one thread per process.
# Metrics that are float rounding by definition: |log pi_sample - log pi_old| (a cached decode against the update
# forward, ~1e-6 in float32) moves with the micro-batching and the process count; compared to this absolute tolerance.
ROUNDING = {"sampler/logprob_diff_max": 1e-4, "sampler/logprob_diff_mean": 1e-4}
# Metrics that count (tokens, rollouts, groups) or follow from 0/1 rewards: equal to the bit for the same
# rollouts, however the step is split. The others are sums of float32 numbers taken in another order.
DISCRETE = (
    "reward/mean",
    "reward/std",
    "reward/frac_zero_std_groups",
    "completion/length",
    "completion/frac_truncated",
    "optim/lr",
    "oar/frac_no_answer",
    "oar/frac_scored",
    "oar/frac_nonfinite_scores",
)

TINY = [
    "--instruction",
    "",
    "--prompts_per_step",
    "2",
    "--group_size",
    "4",
    "--max_new_tokens",
    "20",
    "--learning_rate",
    "1e-3",
    "--warmup_steps",
    "1",
    "--eval_every",
    "0",
]


def build_model(out: Path, hidden_size: int = 32, num_heads: int = 4) -> Path:
    """Save a briefly trained tiny-arith-style model, its tokenizer and `data.jsonl` into `out`
    (once per session: a finished folder is reused). Returns `out`. (vLLM's CPU kernels need heads of
    32 or more: tests/package/test_vllm.py builds one with hidden_size 64 and 2 heads.)"""
    if (out / "data.jsonl").is_file():
        return out
    from oar.training.data import Problem
    from oar.tasks.tiny_arith import TinyArithRecipe, make_model, make_tokenizer, train

    problems = [
        Problem(f"Compute {a} {op} {b}.", str(a + b if op == "+" else a * b))
        for a in range(2, 7)
        for b in range(2, 5)
        for op in "+*"
    ]  # 30, in arith's format
    recipe = TinyArithRecipe(
        hidden_size=hidden_size, num_layers=2, num_heads=num_heads, steps=200, batch_size=32, lr=1e-2, warmup_steps=5
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the build's floats depend on the thread count; keep it fixed
    try:
        torch.manual_seed(0)
        tok = make_tokenizer()
        model = make_model(tok, recipe)
        train(model, tok, problems * (recipe.steps * recipe.batch_size // len(problems) + 1), recipe)
    finally:
        torch.set_num_threads(threads)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(tmp / "data.jsonl", "w") as f:
        f.writelines(json.dumps({"problem": p.problem, "answer": p.answer}) + "\n" for p in problems)
    tmp.rename(out)
    return out


def env() -> dict:
    """Environment of a child run: one torch thread (2 shared cores; oversubscription makes a
    tiny step 20x slower), no network, the repository and tests/ (this module) importable."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    }


# Every process a test starts carries MARK=<this pytest process>:<n> in its environment, and so do the ranks
# a launcher starts from it: torchrun puts each rank in a process session of its own, where killing the
# launcher's group does not reach. conftest.py fails a test that leaves one alive.
MARK, SESSION = "OAR_TEST_RUN", str(os.getpid())
_COUNT = itertools.count()


def spawn(cmd: list[str]) -> tuple[subprocess.Popen, str]:
    """Start `cmd` in a process session of its own, marked; (process, its mark). `finish` waits for it."""
    token = f"{SESSION}:{next(_COUNT)}"
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**env(), MARK: token},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return proc, token


def finish(proc: subprocess.Popen, token: str, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a `spawn`ed command; on a timeout (TimeoutExpired, as subprocess.run) or a failure, kill
    everything it started."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_all(proc, token)
        proc.communicate()
        raise
    if proc.returncode != 0:  # a launcher that failed may leave ranks behind
        kill_all(proc, token)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_all(proc: subprocess.Popen, token: str) -> None:
    """SIGKILL `proc`'s process group and every process that carries `token` (ranks in sessions of their own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in marked(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def marked(prefix: str) -> dict[int, str]:
    """{pid: command line} of the live processes whose MARK starts with `prefix` (a whole mark, or SESSION + ':')."""
    want, found = f"{MARK}={prefix}".encode(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            if any(var.startswith(want) for var in environ.split(b"\0")):
                found[int(entry)] = (
                    Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
        except OSError:  # gone, or not ours to read
            continue
    return found


def run_script(script: Path, args: list[str], *, prelude: str = "", timeout: int = 120) -> subprocess.CompletedProcess:
    """`python script args` in a child process. `prelude` is Python run first in the child (the
    tests use it to make the run kill itself at a chosen point)."""
    if prelude:
        code = (
            f"import runpy, sys\n{prelude}\nsys.argv = [{str(script)!r}] + sys.argv[1:]\n"
            f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
        )
        cmd = [sys.executable, "-c", code, *args]
    else:
        cmd = [sys.executable, str(script), *args]
    return finish(*spawn(cmd), timeout=timeout)


PORT_FLOOR = 10000  # the launches' ports are drawn from PORT_FLOOR up to the kernel's ephemeral range


def ephemeral_floor() -> int | None:
    """The first port of the kernel's ephemeral range (bind(0) and outgoing connections), None where unknown."""
    ports = Path("/proc/sys/net/ipv4/ip_local_port_range")
    return int(ports.read_text().split()[0]) if ports.is_file() else None


def free_port() -> int:
    """A port below the kernel's ephemeral range that nothing holds now. (A port from bind(0) comes from that
    range, which the gloo connections of a concurrent run draw from too: one of them could take it between
    this check and accelerate's bind of it.)"""
    low = ephemeral_floor() or 32768
    draw = random.Random(f"{os.getpid()} {time.time_ns()}")
    for _ in range(200):
        port = draw.randrange(PORT_FLOOR, low) if low > PORT_FLOOR + 1000 else 0
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:  # held, or in TIME_WAIT
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in {PORT_FLOOR}..{low - 1} after 200 draws")


def launch_command(args: list[str], num_processes: int = 2, script: Path = TRAIN, fsdp: bool = False) -> list[str]:
    """`accelerate launch --multi_gpu --num_processes N script args` (train.py by default) on the CPU
    (gloo), on a free port so that concurrent runs on the machine do not collide. `fsdp`: launched with
    configs/fsdp2.yaml instead, as a GPU user shards (float32 here: the config's bf16 is overridden), which on
    CPU processes accelerate runs as DDP and train.py shards itself."""
    how = ["--config_file", str(ROOT / "configs" / "fsdp2.yaml")] if fsdp else ["--multi_gpu"]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *how,
        "--num_processes",
        str(num_processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        str(script),
        *args,
    ]


def launch(
    args: list[str], num_processes: int = 2, timeout: int = 180, script: Path = TRAIN, fsdp: bool = False
) -> subprocess.CompletedProcess:
    """`launch_command` run to its end (`finish`)."""
    return finish(*spawn(launch_command(args, num_processes, script, fsdp)), timeout=timeout)


@functools.cache
def train_module():
    """train.py loaded by its path, once per process: the one way tests (and scripts/bench/bench_parts.py) run
    the training loop in-process, and the module whose globals a test may patch (`load_model`, `policy_loss`)
    to see what the loop calls. train.py is an entry point, not a library: settings come from
    oar.training.config, and nothing else imports it."""
    spec = importlib.util.spec_from_file_location("train_entry_point", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_inprocess(args: list[str]) -> dict:
    """train.py's main on parsed `args` in this process (cheap: no interpreter start, no imports)."""
    from accelerate.state import AcceleratorState, GradientState

    from oar.training.config import parse_args

    AcceleratorState._reset_state(reset_partial_state=True)  # a fresh Accelerator for each run
    GradientState._reset_state()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_module().main(parse_args(args))
    finally:
        torch.set_num_threads(threads)


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock entries."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in rows]


def assert_same_metrics(got: list[dict], want: list[dict], later_rel: float = 1e-3) -> None:
    """Every logged key of two runs' metrics (`metrics`: timings dropped) the same, step by step. Step 1
    starts from the same parameters: DISCRETE keys equal to the bit, the rest within 1e-5 relative (sums
    of float32 numbers in another order, other kernels for other batch shapes), ROUNDING's within their
    absolute tolerance. Later steps start from parameters that differ by float rounding (~1e-7), which
    OAR-G's scores magnify ~1/noise_std-fold (tests/package/test_distributed.py): `later_rel` relative."""
    assert [g["step"] for g in got] == [w["step"] for w in want]
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys(), (g["step"], sorted(g.keys() ^ w.keys()))
        first = g["step"] == 1
        for key in w:
            if key in ROUNDING:
                assert abs(g[key] - w[key]) <= ROUNDING[key], (g["step"], key, g[key], w[key])
            elif first and key in DISCRETE:
                assert g[key] == w[key], (g["step"], key, g[key], w[key])
            else:
                tol = 1e-5 if first else later_rel
                assert math.isclose(g[key], w[key], rel_tol=tol, abs_tol=1e-7), (g["step"], key, g[key], w[key])


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "final" / "model.safetensors"))


def initial_params(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )


def tiny_step(model_dir: Path):
    """One step's rollouts of the tiny model at `model_dir` on two problems, 4 each (seeds 0-7, 20 new tokens):
    (model, tokenizer, rollouts, golds (8,), rewards (8,), advantages (8,)), as train.py's steps 1-3 make them."""
    from oar.grpo import group_advantages
    from oar.rewards import reward
    from oar.sampler import format_prompt, sample
    from oar.training.models import load_model

    model, tok = load_model(str(model_dir))
    problems = [("Compute 3 + 4.", "7"), ("Compute 5 * 2.", "10")]
    ro = sample(
        model, tok, [format_prompt(tok, q) for q, _ in problems], group_size=4, seeds=list(range(8)), max_new_tokens=20
    )
    golds = [a for _, a in problems for _ in range(4)]
    rewards = torch.tensor([reward(t, g) for t, g in zip(ro.texts, golds)])
    return model, tok, ro, golds, rewards, group_advantages(rewards, 4)
