"""eval.py end to end: ordered per-problem records, a summary that follows from them, and the same
records from `accelerate launch --multi_gpu --num_processes 2` as from one process."""

import json

import pytest

from oar.answers import extract_answer
from oar.rewards import reward
from tinyrun import EVAL, check_ok, launch, run_script


def _args(model, out, *extra):
    return [
        "--model",
        str(model),
        "--dataset",
        str(model / "data.jsonl"),
        "--output_dir",
        str(out),
        "--instruction",
        "",
        "--max_new_tokens",
        "20",
        *extra,
    ]


def _read(out):
    records = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    return records, json.loads((out / "eval_summary.json").read_text())


def test_greedy_records_are_in_order_and_the_summary_follows_from_them(tiny_model, tmp_path):
    # Every third gold answer is made wrong, so the records hold both outcomes whatever the tiny model
    # scores (its build rounds differently across CPUs: on one AMD EPYC it gets all 30 right).
    problems = [json.loads(line) for line in (tiny_model / "data.jsonl").read_text().splitlines()]
    problems = [{**p, "answer": str(int(p["answer"]) + 1)} if i % 3 == 0 else p for i, p in enumerate(problems)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in problems))
    out = tmp_path / "eval"
    args = _args(tiny_model, out, "--limit", "0", "--batch_size", "7")  # 5 batches, the last short
    proc = run_script(EVAL, [str(data) if a == str(tiny_model / "data.jsonl") else a for a in args])
    check_ok(proc)
    records, summary = _read(out)
    assert [r["index"] for r in records] == list(range(len(problems)))
    for r, p in zip(records, problems):
        assert (r["problem"], r["gold"]) == (p["problem"], p["answer"])
        assert r["correct"] == (reward(r["completion"], r["gold"]) == 1.0)
        assert r["extracted"] == extract_answer(r["completion"])
    correct = sum(r["correct"] for r in records)
    assert 0 < correct < len(records)  # the model is partly right: the checks above compare something
    assert summary["problems"] == len(problems) and summary["accuracy"] == pytest.approx(correct / len(problems))
    assert summary["pass@1"] == pytest.approx(summary["accuracy"])
    assert summary["instruction"] == ""  # what the prompts asked for is recorded ('auto' on tiny-arith: nothing)
    assert f"{summary['accuracy']:.3f}" in proc.stdout  # the one-line summary


def test_samples_give_avg_and_unbiased_pass_at_k(tiny_model, tmp_path):
    out = tmp_path / "eval"
    check_ok(run_script(EVAL, _args(tiny_model, out, "--limit", "12", "--num_samples", "4", "--temperature", "1.0")))
    records, summary = _read(out)
    assert all(len(r["completion"]) == 4 and len(r["correct"]) == 4 for r in records)
    c = [sum(r["correct"]) for r in records]
    assert summary["accuracy"] == pytest.approx(sum(c) / (4 * len(c)))  # avg@4
    assert summary["pass@1"] == pytest.approx(summary["accuracy"])
    # unbiased pass@2 with n = 4: 1 - C(4 - c, 2) / C(4, 2); pass@4: any of the 4 correct
    comb2 = {0: 6, 1: 3, 2: 1, 3: 0, 4: 0}
    assert summary["pass@2"] == pytest.approx(sum(1 - comb2[k] / 6 for k in c) / len(c))
    assert summary["pass@4"] == pytest.approx(sum(k > 0 for k in c) / len(c))
    assert summary["pass@1"] <= summary["pass@2"] <= summary["pass@4"]


@pytest.mark.slow
def test_two_processes_give_the_records_of_one(tiny_model, tmp_path):
    """An odd number of problems (one process gets one more) and sampled completions: each
    problem's samples are seeded by its index, so sharding must not change a single character."""
    extra = ["--limit", "29", "--num_samples", "2", "--temperature", "1.0", "--batch_size", "6"]
    one, two = tmp_path / "one", tmp_path / "two"
    check_ok(run_script(EVAL, _args(tiny_model, one, *extra)))
    check_ok(launch(_args(tiny_model, two, *extra), num_processes=2, script=EVAL))
    (records_one, summary_one), (records_two, summary_two) = _read(one), _read(two)
    assert len(records_two) == 29
    assert records_two == records_one
    summary_one["config"].pop("output_dir"), summary_two["config"].pop("output_dir")
    assert summary_two == summary_one


def test_train_py_sampled_held_out_accuracy_is_eval_py_avg_at_k(tiny_model, tmp_path):
    """train.py --eval_samples k --eval_temperature t evaluates as eval.py does with the run's seed: avg@k
    over the same per-problem streams (the real-model study's primary metric), before and after training."""
    from tinyrun import TINY, run_inprocess

    ev = tmp_path / "eval"
    check_ok(
        run_script(
            EVAL, _args(tiny_model, ev, "--limit", "8", "--num_samples", "4", "--temperature", "0.7", "--seed", "3")
        )
    )
    _, want = _read(ev)
    run = tmp_path / "run"
    summary = run_inprocess(
        [
            "--model",
            str(tiny_model),
            "--dataset",
            str(tiny_model / "data.jsonl"),
            "--eval_dataset",
            str(tiny_model / "data.jsonl"),
            "--eval_size",
            "8",
            "--eval_samples",
            "4",
            "--eval_temperature",
            "0.7",
            "--seed",
            "3",
            "--steps",
            "2",
            "--save_every",
            "0",
            "--output_dir",
            str(run),
            *TINY,
            "--eval_every",
            "1",
        ]
    )
    assert summary["accuracy_before"] == pytest.approx(want["accuracy"])
    assert summary["eval_problems_seen_in_training"] == 8  # one file for both: said, and recorded
    assert summary["pass_before"] == pytest.approx(
        {k: v for k, v in want.items() if k.startswith("pass@")}
    )  # pass@1, 2, 4 too
    assert set(summary["pass_after"]) == {"pass@1", "pass@2", "pass@4"}
    mid = json.loads(
        (run / "metrics.jsonl").read_text().splitlines()[0]
    )  # the evaluation at step 1 logs pass@j beside avg@k
    assert mid["step"] == 1 and {"eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/pass@4"} <= set(mid)
    assert 0 < want["accuracy"] < 1  # sampled, partly right: the equality compares something
    final = [json.loads(line) for line in (run / "eval_final.jsonl").read_text().splitlines()]
    assert all(len(r["correct"]) == 4 for r in final)


def test_pass_at_k_is_reported_at_k_itself_as_well_as_at_powers_of_two():
    """--eval_samples 6 gives pass@1, 2, 4 and pass@6 (any of the six right), unbiased each."""
    from math import comb

    from oar.training.evaluation import summarize

    correct = [[True] + [False] * 5, [False] * 6, [True, True, False, True, False, False]]
    records = [{"correct": c, "extracted": ["1"] * 6, "truncated": [False] * 6} for c in correct]
    summary = summarize(records, 6)
    assert [k for k in summary if k.startswith("pass@")] == ["pass@1", "pass@2", "pass@4", "pass@6"]
    assert summary["pass@6"] == pytest.approx(2 / 3)
    assert summary["pass@4"] == pytest.approx(((1 - comb(5, 4) / comb(6, 4)) + 0 + (1 - comb(3, 4) / comb(6, 4))) / 3)


# -- a run's folders: a checkpoint could not be evaluated, the run folder gave a tokenizer error, and a
# second evaluation into the same folder wrote over the first ----------------------------------------------------


def _evaluate(model, out, data):
    import eval as evaluation
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    args = ["--model", str(model), "--dataset", str(data), "--output_dir", str(out), "--max_new_tokens", "20"]
    return evaluation.main(evaluation.parser().parse(args))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_checkpoint_evaluates_as_the_model_it_saved(tiny_model, tmp_path, lora):
    """checkpoint-2 of a 2-step run holds the weights final/ holds: the same completions, problem by problem;
    the second evaluation into the folder is written beside the first (eval-2.jsonl), not over it."""
    from tinyrun import TINY, run_inprocess

    run, out, data = tmp_path / "run", tmp_path / "eval", tiny_model / "data.jsonl"
    extra = ["--lora_r", "4"] if lora else []
    train = ["--model", str(tiny_model), "--dataset", str(data), "--output_dir", str(run), "--steps", "2"]
    run_inprocess([*train, "--save_every", "1", "--micro_batch_size", "8", *TINY, *extra])
    _evaluate(run / "checkpoint-2", out, data)
    _evaluate(run / "final", out, data)
    first = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    second = [json.loads(line) for line in (out / "eval-2.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in first] == [r["completion"] for r in second]
    assert json.loads((out / "eval_summary.json").read_text())["model"] == str(run / "checkpoint-2")
    assert json.loads((out / "eval_summary-2.json").read_text())["model"] == str(run / "final")
    initial = tmp_path / "initial"
    _evaluate(tiny_model, initial, data)  # the checkpoint's weights, not --model's, were evaluated
    before = [json.loads(line) for line in (initial / "eval.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in before] != [r["completion"] for r in first]


def test_a_run_folder_is_refused_with_the_model_it_holds(tiny_model, tmp_path):
    from tinyrun import TINY, run_inprocess

    run, data = tmp_path / "run", tiny_model / "data.jsonl"
    train = ["--model", str(tiny_model), "--dataset", str(data), "--output_dir", str(run), "--steps", "1"]
    run_inprocess([*train, "--micro_batch_size", "8", *TINY])
    with pytest.raises(SystemExit) as stop:
        _evaluate(run, tmp_path / "eval", data)
    message = stop.value.code
    assert message.startswith(f"eval.py: error: --model {run}: a training run's folder"), message
    assert f"pass {run / 'final'} or {run / 'checkpoint-1'}" in message and "\n" not in message
    assert "tokenizer" not in message and not (tmp_path / "eval").exists()
