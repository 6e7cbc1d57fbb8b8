"""The reward as a table of terms (oar/reward_table.py, --reward, --reward_module): hand-computed weighted
sums, the default equal to `oar.rewards.reward` to the bit, a reward of one's own trained through
train.py and logged per name, and modules or specs that cannot serve stopped before the model loads."""

import json
import math
from pathlib import Path

import pytest

import oar.training.run as oar_run
from tinyrun import ROOT, TINY, TRAIN, run_inprocess, run_script

from oar.reward_table import BUILTIN, EXAMPLE, RewardError, reward_terms, score
from oar.rewards import format_reward, length_reward, reward

EXAMPLE_MODULE = ROOT / "examples" / "closeness.py"  # docs/rewards.md's worked example
TEXTS = ["3 + 4 = 7\n#### 7", "3 + 4 = 8\n#### 8", "no marker at all", r"so \boxed{}", "The answer is 7."]
GOLDS = ["7"] * len(TEXTS)
PROBLEMS = ["Compute 3 + 4."] * len(TEXTS)


def _args(model, out, *extra):
    return [
        "--model",
        str(model),
        "--dataset",
        str(model / "data.jsonl"),
        "--output_dir",
        str(out),
        "--steps",
        "2",
        "--save_every",
        "0",
        "--method",
        "grpo",
        *TINY,
        *extra,
    ]


def test_the_weighted_sum_by_hand():
    totals, parts = score(reward_terms("correct,format:0.1,length:-0.01"), TEXTS, GOLDS, PROBLEMS)
    assert parts == {
        "correct": [1.0, 0.0, 0.0, 0.0, 1.0],
        "format": [1.0, 1.0, 0.0, 0.0, 1.0],
        "length": [16.0, 16.0, 16.0, 11.0, 16.0],
    }
    # r = correct + 0.1 format - 0.01 length: 1 + 0.1 - 0.16 = 0.94; 0 + 0.1 - 0.16 = -0.06; -0.16; -0.11; 0.94
    assert totals == pytest.approx([0.94, -0.06, -0.16, -0.11, 0.94])
    # correct + 0.1 format is `reward`'s own format bonus, to the bit
    assert score(reward_terms("correct,format:0.1"), TEXTS, GOLDS, PROBLEMS)[0] == [
        reward(t, g, format_bonus=0.1) for t, g in zip(TEXTS, GOLDS)
    ]
    assert [format_reward(t) for t in TEXTS] == [1.0, 1.0, 0.0, 0.0, 1.0] and length_reward("abc") == 3.0


def test_the_default_is_the_papers_reward_to_the_bit():
    texts = TEXTS + [r"\boxed{\frac{14}{2}}", "#### 7.0", "#### 1e400", "#### nan"]
    totals, parts = score(reward_terms(), texts, ["7"] * len(texts), [""] * len(texts))
    want = [reward(t, "7") for t in texts]
    assert [t.name for t in reward_terms()] == ["correct"] and totals == want and parts == {"correct": want}
    assert all(type(t) is float for t in totals)


@pytest.mark.parametrize(
    "spec, needle",
    [
        (
            "right",
            "unknown reward 'right'; choose from correct, format, length "
            "(or name a module that defines it with --reward_module)",
        ),
        ("correct,correct:2", "'correct' is named twice"),
        ("correct:x", "the weight of 'correct' must be a finite number, as in correct:0.5, got 'x'"),
        ("correct:nan", "must be a finite number"),
        ("correct,", "an empty term"),
    ],
)
def test_a_bad_spec_names_itself(spec, needle):
    with pytest.raises(RewardError) as err:
        reward_terms(spec)
    assert str(err.value).startswith(f"--reward {spec}: ") and needle in str(err.value)


BROKEN = {  # module text (None: no such file) -> what the message must say besides the module's path
    "missing": (None, "no such file"),
    "unimportable": (
        "import no_such_package_anywhere\n",
        "could not import it (ModuleNotFoundError: No module named 'no_such_package_anywhere')",
    ),
    "no table": ("def mine(c, g, p):\n    return 1.0\n", "defines no REWARD_FUNCTIONS"),
    "a list": ("REWARD_FUNCTIONS = [lambda c, g, p: 1.0]\n", "defines no REWARD_FUNCTIONS, a non-empty dict"),
    "clash": (
        "REWARD_FUNCTIONS = {'correct': lambda c, g, p: 1.0}\n",
        "reward 'correct' clashes with the built-in reward",
    ),
    "reserved": (
        "REWARD_FUNCTIONS = {'mean': lambda c, g, p: 1.0}\n",
        "reward 'mean' clashes with the metric reward/mean",
    ),
    "bad name": ("REWARD_FUNCTIONS = {'a:b': lambda c, g, p: 1.0}\n", "reward name 'a:b' must be letters, digits"),
    "not a function": ("REWARD_FUNCTIONS = {'mine': 1.0}\n", "reward 'mine' is 1.0, not a function"),
    "bad signature": (
        "REWARD_FUNCTIONS = {'mine': lambda completion: 1.0}\n",
        "reward 'mine'(completion) must take (completion, gold, problem)",
    ),
    "raises": ("REWARD_FUNCTIONS = {'mine': lambda c, g, p: 1 / 0}\n", "reward 'mine' raised on the example"),
    "nan": (
        "REWARD_FUNCTIONS = {'mine': lambda c, g, p: float('nan')}\n",
        "reward 'mine' returned nan on the example",
    ),
    "a string": (
        "REWARD_FUNCTIONS = {'mine': lambda c, g, p: '1'}\n",
        "reward 'mine' returned str '1' on the example",
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_module_that_cannot_serve_stops_the_run_before_the_model_loads(tiny_model, tmp_path, monkeypatch, case):

    text, needle = BROKEN[case]
    module = tmp_path / f"{case.replace(' ', '_')}.py"
    if text is not None:
        module.write_text(text)
    monkeypatch.setattr(oar_run, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        run_inprocess(_args(tiny_model, out, "--reward_module", str(module), "--reward", "correct,mine:0.5"))
    message = stop.value.code
    assert isinstance(message, str) and message.startswith(f"train.py: error: --reward_module {module}: "), message
    assert needle in message and "\n" not in message, message
    assert not out.exists()


def test_a_reward_of_ones_own_trains_and_is_logged_per_name(tiny_model, tmp_path):
    """docs/rewards.md's command on the tiny model: correct + 0.5 closeness, each term logged, the total as before."""
    out = tmp_path / "run"
    summary = run_inprocess(
        _args(tiny_model, out, "--reward_module", str(EXAMPLE_MODULE), "--reward", "correct,closeness:0.5")
    )
    assert summary["skipped_steps"] == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # the mean of a weighted sum is the weighted sum of the means
        assert row["reward/mean"] == pytest.approx(row["reward/correct"] + 0.5 * row["reward/closeness"])
        assert row["reward/closeness"] >= row["reward/correct"]  # an exact answer earns 1 from both
    assert any(
        0 < r["reward/closeness"] and r["reward/closeness"] != r["reward/correct"] for r in rows
    )  # partial credit reached the loss
    assert any(r["loss/clip_frac"] >= 0 and r["reward/std"] > 0 for r in rows)
    assert json.loads((out / "config.json").read_text())["reward"] == "correct,closeness:0.5"


def test_the_example_reward_by_hand():
    from oar.reward_table import module_rewards

    closeness = module_rewards(str(EXAMPLE_MODULE))["closeness"]
    assert [
        closeness(t, "7", "") for t in ["#### 7", "#### 8", "#### 5", "no answer", "#### x", "#### nan", "#### 1e400"]
    ] == [1.0, 0.5, 1 / 3, 0.0, 0.0, 0.0, 0.0]
    assert closeness(*EXAMPLE) == 1.0


def test_the_default_run_logs_the_total_and_its_one_term(tiny_model, tmp_path):
    run_inprocess(_args(tiny_model, tmp_path / "run"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["reward/correct"] == pytest.approx(r["reward/mean"]) for r in rows)


def test_a_reward_that_fails_mid_run_stops_it_with_one_line(tiny_model, tmp_path):
    """A function that passes the trial call but raises on a rollout: the term and the rollout named, no traceback."""
    module = tmp_path / "picky.py"
    module.write_text(
        "def picky(completion, gold, problem):\n"
        "    if completion != '2 + 3 = 5. The answer is 5.':  # the trial call's completion\n"
        "        raise KeyError(problem)\n    return 1.0\n"
        "REWARD_FUNCTIONS = {'picky': picky}\n"
    )
    proc = run_script(TRAIN, _args(tiny_model, tmp_path / "out", "--reward_module", str(module), "--reward", "picky"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: --reward picky: raised on rollout 0 (KeyError: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_builtins_are_total_on_hostile_text():
    for text in ["", "\x00", r"\boxed{" * 50, "#### " + "9" * 5000, "The answer is ."]:
        for name, fn in BUILTIN.items():
            assert math.isfinite(fn(text, "7", "p")), (name, text)


def test_docs_name_the_example():
    page = (ROOT / "docs" / "rewards.md").read_text()
    assert "examples/closeness.py" in page and "--reward correct,closeness:0.5" in page
    assert Path(ROOT / "README.md").read_text().count("docs/rewards.md") >= 1


# -- TRL's form: f(completions, **columns) -> list[float | None] -------------------------------------

TRL_EXAMPLE = ROOT / "examples" / "trl_rewards.py"  # a TRL user's reward file, taken unchanged


def test_a_trl_style_function_is_called_trls_way_and_none_adds_nothing(tmp_path):
    from oar.reward_table import scorable

    module = tmp_path / "trl_style.py"
    module.write_text(
        "SEEN = []\n"
        "def only_sevens(completions, answer, source, **kwargs):\n"
        "    SEEN.append({'completions': completions, 'answer': answer, 'source': source, **kwargs})\n"
        "    return [None if a != '7' else float('#### 7' in c) for c, a in zip(completions, answer)]\n"
    )
    terms = reward_terms("correct,only_sevens:2", str(module))
    rows = [{"prompt": "Compute 3 + 4.", "answer": "7", "source": "x"}, {"question": "Q", "answer": "8"}]
    totals, parts = score(terms, ["#### 7", "#### 8"], ["7", "8"], ["Compute 3 + 4.", "Q"], rows)
    assert parts == {"correct": [1.0, 1.0], "only_sevens": [1.0, None]}
    assert totals == [3.0, 1.0] and scorable(parts) == [True, True]  # None adds nothing; correct scored both
    seen = terms[1].fn.__globals__["SEEN"][-1]
    assert seen["prompts"] == ["Compute 3 + 4.", "Q"] and seen["question"] == [None, "Q"]  # TRL: every column
    assert seen["source"] == ["x", None] and "prompt" not in seen  # the prompt column is passed as prompts
    _, alone = score(terms[1:], ["#### 7", "#### 8"], ["7", "8"], ["p", "Q"], rows)
    assert scorable(alone) == [True, False]  # no term scored the second: advantage 0 (test_grpo.py)


def test_a_conversational_row_gives_trls_completions_and_prompts():
    from oar.reward_table import trl_arguments

    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compute 3 + 4."}]
    kwargs = trl_arguments(["#### 7"], ["7"], ["Compute 3 + 4."], [{"prompt": prompt, "answer": "7"}])
    assert kwargs == {
        "prompts": [prompt],
        "completions": [[{"role": "assistant", "content": "#### 7"}]],
        "answer": ["7"],
    }


def _prompt_rows(tiny_model, path, conversational=False):
    rows = [json.loads(line) for line in (tiny_model / "data.jsonl").read_text().splitlines()]
    if conversational:  # messages rows with a system turn, the answer in its own column
        rows = [
            {
                "messages": [
                    {"role": "system", "content": "Reply with #### N."},
                    {"role": "user", "content": r["problem"]},
                ]
            }
            | {"answer": r["answer"]}
            for r in rows
        ]
    else:  # TRL's standard prompt-only format, the gold answer as a column
        rows = [{"prompt": r["problem"], "answer": r["answer"]} for r in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("conversational", [False, True], ids=["prompt column", "messages rows"])
def test_a_trl_reward_file_and_a_prompt_column_data_set_train_unchanged(tiny_model, tmp_path, conversational):
    data = _prompt_rows(tiny_model, tmp_path / "trl.jsonl", conversational)
    out = tmp_path / "run"
    args = _args(tiny_model, out, "--reward_module", str(TRL_EXAMPLE), "--reward", "accuracy_reward,format_reward:0.1")
    args[args.index("--dataset") + 1] = str(data)
    summary = run_inprocess(args)
    assert summary["skipped_steps"] == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["reward/mean"] == pytest.approx(row["reward/accuracy_reward"] + 0.1 * row["reward/format_reward"])
    assert any(r["reward/std"] > 0 for r in rows)  # the reward reached the loss
    # the prompt column is the tiny model's own prompt; a system turn above it (tiny-arith's template takes
    # none: it opens the user turn) is text the model never saw, and it answers less often
    assert conversational or any(r["reward/accuracy_reward"] > 0 for r in rows)


def test_a_trl_function_that_needs_a_column_the_data_lacks_stops_before_the_model_loads(
    tiny_model, tmp_path, monkeypatch
):
    module = tmp_path / "needs.py"
    module.write_text("def graded(completions, ground_truth, **kwargs):\n    return [0.0 for _ in completions]\n")
    monkeypatch.setattr(oar_run, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as stop:
        run_inprocess(_args(tiny_model, tmp_path / "out", "--reward_module", str(module), "--reward", "graded"))
    message = stop.value.code
    assert message.startswith("train.py: error: --reward graded: raised on a step's 1 rollouts (TypeError: "), message
    assert "ground_truth" in message and "first training row" in message and "\n" not in message, message
    assert not (tmp_path / "out").exists()


def test_functions_the_reward_does_not_name_are_said(tiny_model, tmp_path, capsys):
    """A TRL user passes the file and expects its functions used; --reward names the terms, so the run says which
    it leaves out."""
    run_inprocess(_args(tiny_model, tmp_path / "out", "--reward_module", str(TRL_EXAMPLE), "--steps", "1"))
    said = capsys.readouterr().out
    assert "defines accuracy_reward, format_reward, which --reward correct does not name" in said, said[-2000:]
    assert "--reward correct,accuracy_reward,format_reward adds them" in said
