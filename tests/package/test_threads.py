"""Torch's thread count when OMP_NUM_THREADS is unset (a newcomer's report: a plain `python train.py` took a thread per
core and ran 3-12x slower on shared cores than `accelerate launch`, which sets one), and the benchmark that measures
1 against 2 threads (scripts/bench/bench_threads.py, docs/bench/threads-cpu.json)."""

import json
import sys
from pathlib import Path

import pytest
import torch

from tinyrun import EVAL, ROOT, check_ok, finish, spawn

sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import bench_threads as bt  # noqa: E402


def test_unset_omp_num_threads_means_one_thread_and_says_so(monkeypatch):
    from oar.training.launch import THREADS, default_threads

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        said = default_threads()
        assert (
            torch.get_num_threads() == THREADS == 1
            and said.startswith("torch threads: 1")
            and "OMP_NUM_THREADS=2" in said
        )
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice: left to torch, nothing said
        assert default_threads() is None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_a_plain_python_eval_py_runs_on_one_thread(tiny_model, tmp_path):
    """The entry point itself, with OMP_NUM_THREADS unset as a user's shell has it."""
    prelude = (
        "import os; os.environ.pop('OMP_NUM_THREADS')\n"  # tinyrun's env sets it: a user's shell does not
        "import atexit, torch; atexit.register(lambda: print('threads at exit', torch.get_num_threads()))\n"
        f"import runpy, sys; sys.argv = [{str(EVAL)!r}] + sys.argv[1:]\n"
        f"runpy.run_path({str(EVAL)!r}, run_name='__main__')"
    )
    code = prelude
    args = ["--model", str(tiny_model), "--dataset", str(tiny_model / "data.jsonl"), "--eval_size", "2"]
    proc, token = spawn([sys.executable, "-c", code, *args, "--output_dir", str(tmp_path / "out")])
    done = finish(proc, token, timeout=300)
    check_ok(done)
    assert "torch threads: 1, as accelerate launch sets them" in done.stdout and "threads at exit 1" in done.stdout


def test_the_benchmark_alternates_the_thread_counts_and_runs_the_other_job_only_beside(monkeypatch, tmp_path):
    order, others = [], []
    real_busy = bt.busy

    def busy():
        others.append(real_busy())
        return others[-1]

    monkeypatch.setattr(bt, "busy", busy)
    monkeypatch.setattr(
        bt,
        "timed",
        lambda command, t, folder: (
            order.append((command[0], t, bool(others) and others[-1].poll() is None))
            or {"wall_s": float(t), "cpu_s": 1.0, "load_before": 0.0}
        ),
    )
    record = bt.main(["--toy", "--no_smollm2", "--repeats", "2", "--out", str(tmp_path / "t.json")])
    assert [t for _, t, _ in order] == [1, 2, 2, 1] * 4  # each case, each condition: rounds alternate the order
    assert [beside for *_, beside in order] == [False] * 8 + [True] * 8  # the busy job runs only "beside another job"
    assert len(others) == 1 and others[0].poll() is not None  # and is ended after it
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["results"] == record["results"]
    cell = saved["results"]["beside another job"]["tiny-arith eval.py"]
    assert cell["two_over_one"]["wall_s"] == 2.0 and len(cell["1 thread"]["runs"]) == 2


@pytest.mark.slow  # two real runs of eval.py
def test_the_benchmark_at_toy_scale(tiny_model, tmp_path):
    out = tmp_path / "threads.json"
    args = ["--toy", "--no_smollm2", "--model", str(tiny_model), "--data", str(tiny_model / "data.jsonl")]
    bt.main([*args, "--cases", "tiny-arith eval.py", "--conditions", "idle", "--repeats", "1", "--out", str(out)])
    cell = json.loads(out.read_text())["results"]["idle"]["tiny-arith eval.py"]
    assert cell["1 thread"]["median_wall_s"] > 0 and cell["2 thread"]["median_cpu_s"] > 0
    assert Path(json.loads(out.read_text())["command"].split()[1]).name == "bench_threads.py"
