"""train.py and eval.py on the vLLM rollout backend (docs/vllm.md), run as a user runs them: one process or
two (gloo, an engine each), after a resume, every credit method, LoRA, FSDP2, and a held-out evaluation
split unevenly over processes; each is the same run as its one-process reference, to float rounding.
The engine's own invariants are tests/package/test_vllm.py's, whose tiny model these share. Skipped without
vLLM; CI runs them in a second environment (`pytest -m vllm`, .ci/run).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from tinyrun import (
    EVAL,
    ROUNDING,
    TINY,
    TRAIN,
    build_model,
    check_ok,
    env,
    final_params,
    launch,
    max_abs_diff,
    metrics,
    run_script,
)

from oar import vllm_rollouts
from oar.vllm_rollouts import INSTALL

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_rollouts.installed(), reason=f"vLLM is not installed; install it with {INSTALL}"),
]

VLLM_RUN = ["--rollout_backend", "vllm", "--temperature", "1.5"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # tests/package/test_vllm.py's model: built once a session, the folder reused
    return build_model(tmp_path_factory.getbasetemp() / "oar-tiny-vllm", hidden_size=64, num_heads=2)


def _args(tiny, out, *extra):
    # temperature 1.5 (VLLM_RUN): at 1 this model answers every problem right, every group ties, nothing moves
    return [
        "--model",
        str(tiny),
        "--dataset",
        str(tiny / "data.jsonl"),
        "--output_dir",
        str(out),
        "--save_every",
        "1",
        *TINY,
        *VLLM_RUN,
        *extra,
    ]


# Metrics that are the same whichever process holds which rollouts (the others are per-process statistics
# averaged over processes, such as reward/std): tests/package/test_distributed.py's, and the mean length.
ANY_SPLIT = (
    "optim/grad_norm",
    "optim/lr",
    "reward/mean",
    "reward/frac_zero_std_groups",
    "completion/frac_truncated",
    "oar/frac_no_answer",
    "completion/length",
)


def _assert_same(got, want, tol=1e-5, keys=None):
    """The same rollouts (rewards, lengths, truncation) and the same updates, to float rounding."""
    rounding = {**ROUNDING, "sampler/is_weight_mean": 1e-4}
    for g, w in zip(metrics(got), metrics(want), strict=True):
        for key in keys or w:
            assert math.isclose(g[key], w[key], rel_tol=tol, abs_tol=rounding.get(key, 1e-6)), (
                g["step"],
                key,
                g[key],
                w[key],
            )
    # Parameters to 1e-4 after 3 Adam steps at lr 1e-3: Adam divides by sqrt(v), so a gradient entry near 0 that
    # rounding moves by 1e-7 can move its parameter by a sizeable share of lr (measured 1.6e-5 on 2 processes).
    assert max_abs_diff(final_params(got), final_params(want)) <= 1e-4


def test_train_on_one_or_two_processes_and_after_a_resume(tiny, tmp_path):
    """train.py with the vLLM backend: 3 steps on one process, on two (gloo, an engine each), and 1 +
    resumed 2: the same run. Step 2 and 3 sample with the synced weights of the step before."""
    # GRPO: OAR-G's scores magnify float rounding ~1/noise_std-fold (tests/package/test_distributed.py), which would
    # blur the comparison; every method runs on vLLM's rollouts in the next test.
    one, two, cut = tmp_path / "one", tmp_path / "two", tmp_path / "cut"
    proc = run_script(TRAIN, _args(tiny, one, "--steps", "3", "--method", "grpo"), timeout=600)
    check_ok(proc)
    # what train.py's engine was given (oar/vllm_settings.py): PROMPT_TOKENS + 20 new tokens, capped at the model's 512
    assert (
        "vLLM engine on cpu: float32, 512 tokens a request (the model's own limit), chunked prefill off, no sleep "
        "mode on cpu" in proc.stdout
    )
    rows = metrics(one)
    assert any(r["reward/frac_zero_std_groups"] < 1 and r["optim/grad_norm"] > 0 for r in rows)  # it learns something
    assert all(r["sampler/logprob_diff_max"] < 1e-3 and abs(r["sampler/is_weight_mean"] - 1) < 1e-3 for r in rows)
    check_ok(launch(_args(tiny, two, "--steps", "3", "--method", "grpo"), timeout=600))
    _assert_same(two, one, keys=ANY_SPLIT)
    check_ok(run_script(TRAIN, _args(tiny, cut, "--steps", "1", "--method", "grpo"), timeout=600))
    resumed = run_script(TRAIN, _args(tiny, cut, "--steps", "3", "--method", "grpo", "--resume"), timeout=600)
    check_ok(resumed)
    _assert_same(cut, one)


METHODS = ["grpo", "oar-g", "oar-p", "entropy", "entropy-mask", "tempo", "oar-g+tempo", "random-gate"]


def test_every_credit_method_trains_with_lora_and_fsdp_variants(tiny, tmp_path):
    """Each credit method takes two steps on vLLM's rollouts (an engine per run, held-out evaluation on it
    too), one run after another in one fresh process; LoRA (merged weights to the engine), a 2-process
    FSDP2 run (full gather on each, the same run as one process) and eval.py too.

    Why a fresh process: engines started one after another in a process that had already run others
    (this module's) sampled garbage (held-out accuracy 0 where the same run alone scored 1), which
    closing the earlier engines did not cure; a train.py or eval.py process starts one engine."""
    runs = {
        m: _args(
            tiny,
            tmp_path / m,
            "--steps",
            "2",
            "--method",
            m,
            "--eval_size",
            "4",
            "--eval_dataset",
            str(tiny / "data.jsonl"),
        )
        for m in METHODS
    }
    runs["lora"] = _args(tiny, tmp_path / "lora", "--steps", "2", "--method", "oar-g", "--lora_r", "4")
    code = (
        "import json, sys\nfrom tinyrun import run_inprocess\n"
        "for args in json.loads(sys.argv[1]):\n    run_inprocess(args)\n"
    )
    check_ok(
        subprocess.run(
            [sys.executable, "-c", code, json.dumps(list(runs.values()))],
            check=False,
            cwd=Path(__file__).resolve().parents[1],  # tests/, for tinyrun
            env=env(),
            capture_output=True,
            text=True,
            timeout=1200,
        )
    )
    for method in runs:
        assert (tmp_path / method / "final" / "model.safetensors").is_file()
        assert all(math.isfinite(v) for r in metrics(tmp_path / method) for v in r.values())
    assert (
        json.loads((tmp_path / "grpo" / "summary.json").read_text())["accuracy_before"] > 0
    )  # the engine serves the model
    fsdp = tmp_path / "fsdp"
    check_ok(launch(_args(tiny, fsdp, "--steps", "2", "--method", "grpo"), timeout=600, fsdp=True))
    _assert_same(fsdp, tmp_path / "grpo", keys=ANY_SPLIT)
    evaluation = lambda out, n: [
        "--model",
        str(tmp_path / "grpo" / "final"),
        "--dataset",
        str(tiny / "data.jsonl"),
        "--limit",
        str(n),  # noqa: E731
        "--num_samples",
        "2",
        "--temperature",
        "1.0",
        "--max_new_tokens",
        "20",
        "--output_dir",
        str(out),
        "--rollout_backend",
        "vllm",
        "--top_p",
        "0.9",
    ]  # top-p: evaluation only
    check_ok(run_script(EVAL, evaluation(tmp_path / "eval", 4), timeout=600))
    assert json.loads((tmp_path / "eval" / "eval_summary.json").read_text())["problems"] == 4
    # two processes with unequal shards (problems 0, 2 and 1), an engine each: the same records, problem by problem
    check_ok(launch(evaluation(tmp_path / "eval2", 3), timeout=600, script=EVAL))
    read = lambda out: [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]  # noqa: E731
    assert read(tmp_path / "eval2") == read(tmp_path / "eval")[:3]
