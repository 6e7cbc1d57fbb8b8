"""Tests of oar/training/data.py (JSON Lines loading and its errors) and oar/tasks/arith.py;
tiny-arith: test_tiny_arith.py."""

from __future__ import annotations

import ast
import json
import operator
from pathlib import Path

import pytest

from oar.tasks.arith import DEFAULT_ARITH, ArithConfig, arith_problems, arith_solution, split_of
from oar.training.data import DataError, Problem, load_jsonl, load_problems, problems_from_records

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def write(tmp_path: Path, text: str, name: str = "rows.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- load_jsonl -----------------------------------------------------------------------------------


def test_load_jsonl_reads_rows_skips_blank_lines_and_ignores_extra_keys(tmp_path):
    path = write(
        tmp_path,
        '{"id": "a", "problem": "1+1?", "answer": "2", "source": "x"}\n\n  \n{"problem": "2+2?", "answer": "4"}\n',
    )
    assert load_jsonl(path) == [Problem("1+1?", "2"), Problem("2+2?", "4")]


@pytest.mark.parametrize(
    "text, line, words",
    [
        ('{"problem": "p", "answer": "1"}\n{"problem": "q", "answer": \n', 2, ["invalid JSON"]),
        ('{"problem": "p", "answer": "1"}\n["p", "1"]\n', 2, ["expected a JSON object", "list"]),
        ('\n{"problem": "p"}\n', 2, ["missing key 'answer'", "Add 'answer'"]),
        (
            '{"query": "p", "answer": "1"}\n',
            1,
            ["missing key 'problem' (or 'question', 'prompt', 'messages'; keys present: ['answer', 'query'])"],
        ),
        (
            '{"prompt": [{"role": "user", "content": "p"}, {"role": "user", "content": "q"}], "answer": "1"}\n',
            1,
            ["key 'prompt' must be a string or a list of turns", "got the roles ['user', 'user']"],
        ),
        ('{"messages": "p", "answer": "1"}\n', 1, ["key 'messages' must be a list of turns"]),
        (
            '{"messages": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "no idea"}]}\n',
            1,
            ["no 'answer' key, and the assistant turn of 'messages' holds no final answer"],
        ),
        ('{"problem": "p", "solution": "it is 7"}\n', 1, ["key 'solution' holds no final answer"]),
        ('{"problem": "p", "answer": "So #### "}\n', 1, ["key 'answer' is empty"]),
        (
            '{"problem": "p", "answer": "First 3.\\nThen 4."}\n',
            1,
            ["key 'answer' holds a worked solution with no final answer"],
        ),
        ('{"problem": "p", "answer": 42}\n', 1, ["'answer' must be a string", "int"]),
        ('{"problem": ["p"], "answer": "1"}\n', 1, ["'problem' must be a string", "list"]),
        ('{"problem": "  ", "answer": "1"}\n', 1, ["'problem' is empty"]),
    ],
)
def test_load_jsonl_bad_row_names_file_line_and_fix(tmp_path, text, line, words):
    path = write(tmp_path, text)
    with pytest.raises(DataError) as err:
        load_jsonl(path)
    message = str(err.value)
    assert f"rows.jsonl:{line}:" in message
    for word in words:
        assert word in message


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_load_jsonl_empty_file(tmp_path, text):
    with pytest.raises(DataError, match=r"rows\.jsonl: no problems"):
        load_jsonl(write(tmp_path, text))


def test_load_jsonl_missing_file_and_directory(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: does not exist"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="is a directory"):
        load_jsonl(tmp_path)


def test_load_jsonl_not_utf8(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"problem": "\xff", "answer": "1"}\n')
    with pytest.raises(DataError, match=r"rows\.jsonl: not UTF-8"):
        load_jsonl(path)


# --- load_problems --------------------------------------------------------------------------------


def test_load_problems_file_folder_and_limit(tmp_path):
    rows = "".join(json.dumps({"problem": f"p{i}", "answer": str(i)}) + "\n" for i in range(5))
    path = write(tmp_path, rows, "test.jsonl")
    assert load_problems(str(path), limit=2) == [Problem("p0", "0"), Problem("p1", "1")]
    assert len(load_problems(str(tmp_path), split="test")) == 5  # folder -> <folder>/<split>.jsonl
    with pytest.raises(DataError, match=r"train\.jsonl: does not exist"):
        load_problems(str(tmp_path), split="train")


def test_load_problems_arith_and_unknown_names():
    assert load_problems("arith", split="test", limit=7, seed=3) == arith_problems(
        7, split="test", seed=3, config=DEFAULT_ARITH
    )
    assert len(load_problems("arith", split="test")) == 500
    with pytest.raises(DataError, match="split must be 'train' or 'test'"):
        load_problems("arith", split="validation")
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="no-such-dataset.*pass 'arith' or a path"):
            load_problems("no-such-dataset")


def test_data_errors_name_no_path_outside_the_repository(tmp_path, monkeypatch):
    """A user has the repository, not the machine it was written on: no message may point at ../shared."""
    import importlib.util

    import oar.training.data as data

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # as without `datasets`
    with pytest.raises(DataError) as err:
        load_problems("no-such-dataset")
    assert "pip install -r requirements.txt" in str(err.value)
    source = Path(data.__file__).read_text()
    assert "shared/" not in source.split('"""', 2)[2]  # the module's code and messages, past its docstring


def test_problems_from_records_maps_hf_fields_and_gsm8k_answers():
    records = [{"question": "Q1", "answer": "She has 3.\n#### 18"}, {"problem": "Q2", "answer": "7"}]
    assert problems_from_records(records, "hf") == [Problem("Q1", "18"), Problem("Q2", "7")]
    # a worked solution in the answer column gives its final answer, not the whole text as the gold
    worked = [
        {"problem": "Q3", "answer": "We get \\boxed{7}."},
        {"problem": "Q4", "answer": "3 + 4 = 7\nThe answer is 7"},
        {"problem": "Q5", "answer": "\\frac{1}{2}"},
    ]
    assert problems_from_records(worked, "hf") == [
        Problem("Q3", "7"),
        Problem("Q4", "7"),
        Problem("Q5", "\\frac{1}{2}"),
    ]
    with pytest.raises(DataError, match="hf row 0: missing key 'answer'"):
        problems_from_records([{"question": "Q"}], "hf")


def test_a_reference_solutions_gold_is_its_last_box_and_a_break_inside_braces_is_one_answer():
    """MATH solutions box their answer and may remark after it: the box is the gold, not the remark (MATH's
    train/counting_and_probability/841 gave '24?', train/geometry/612 a sentence: both always scored 0). A gold
    with a line break inside a brace group is one answer, not a worked solution (MATH's train_12k row 11403,
    `90\\text{ square\\nunits}`, stopped the whole file)."""
    rows = [
        {"problem": "Q1", "solution": "So there are \\boxed{24} ways. Is it a coincidence that the answer is 24?"},
        {"problem": "Q2", "solution": "The area is $\\boxed{1440}$. Can we build it? The answer is yes! Imagine..."},
        {"problem": "Q3", "solution": "3 + 4 = 7. The answer is 7."},
        {"problem": "Q4", "answer": "90\\text{ square\nunits}"},
    ]
    assert [p.answer for p in problems_from_records(rows, "hf")] == ["24", "1440", "7", "90\\text{ square\nunits}"]


COLUMNS = [  # one row of each column layout: GSM8K's, MATH's (answer and solution), a solution alone, ours
    {"question": "Q1", "answer": "She has 3.\n#### 18"},
    {"problem": "Q2", "solution": "So $x = 2$, and \\boxed{\\frac{1}{2}}.", "answer": "\\frac12"},
    {"problem": "Q3", "solution": "3 + 4 = 7\n#### 7"},
    {"problem": "Q4", "answer": "7", "question": "ignored: problem comes first"},
]
MAPPED = [Problem("Q1", "18"), Problem("Q2", "\\frac12"), Problem("Q3", "7"), Problem("Q4", "7")]


def test_jsonl_and_hub_rows_map_their_columns_the_same_way(tmp_path, monkeypatch):
    """question/problem and answer/solution, in a file and through `datasets.load_dataset` (replaced by
    a local Dataset here: tests never fetch), give the same problems."""
    datasets = pytest.importorskip("datasets")

    path = write(tmp_path, "".join(json.dumps(r) + "\n" for r in COLUMNS))
    assert load_jsonl(path) == MAPPED
    calls = []

    def load_dataset(path, name=None, *, split):
        calls.append((path, name, split))
        columns = ("question", "problem", "answer", "solution")  # a table: a column a row lacks holds None there
        return datasets.Dataset.from_dict({c: [r.get(c) for r in COLUMNS] for c in columns})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    # the names are not on any hub: skip the one request that asks (its own tests are test_model_names.py's)
    monkeypatch.setattr("oar.training.data._check_hub_dataset", lambda name, repo_id: None)
    assert load_problems("org/set:main", split="test") == MAPPED
    assert calls == [("org/set", "main", "test")]
    with pytest.raises(DataError, match=r"rows.jsonl:1: key 'problem' must be a string, got NoneType"):
        load_jsonl(write(tmp_path, '{"problem": null, "answer": "1"}\n'))
    monkeypatch.setattr(
        datasets, "load_dataset", lambda path, name=None, *, split: datasets.Dataset.from_list(COLUMNS[:1])
    )
    assert load_problems("org/gsm", split="train") == MAPPED[:1]
    monkeypatch.setattr(
        datasets,
        "load_dataset",
        lambda path, name=None, *, split: datasets.Dataset.from_list(
            [{"problem": "Q2", "solution": "\\boxed{3}", "answer": "3"}]
        ),
    )
    assert load_problems("org/math", split="test") == [Problem("Q2", "3")]


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"shared data not found at {SHARED_DATA}")
@pytest.mark.parametrize("name, count", [("gsm8k/test.jsonl", 1319), ("math500/test.jsonl", 500)])
def test_shared_benchmarks_load(name, count):
    problems = load_jsonl(SHARED_DATA / name)
    assert len(problems) == count
    assert all(p.problem and p.answer for p in problems)


# --- arith ----------------------------------------------------------------------------------------

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def safe_eval(expression: str) -> int:
    """Value of an expression of integers and + - *, without eval."""

    def walk(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        assert isinstance(node, ast.BinOp) and type(node.op) in _BINOPS, ast.dump(node)
        return _BINOPS[type(node.op)](walk(node.left), walk(node.right))

    return walk(ast.parse(expression, mode="eval").body)


def expression_of(problem: Problem) -> str:
    assert problem.problem.startswith("Compute ") and problem.problem.endswith(".")
    return problem.problem[len("Compute ") : -1]


def test_arith_is_deterministic_and_seeded():
    assert arith_problems(50, seed=1) == arith_problems(50, seed=1)
    assert arith_problems(50, seed=1) != arith_problems(50, seed=2)
    assert arith_problems(20, seed=1) == arith_problems(50, seed=1)[:20]  # a prefix, whatever n


def test_arith_solution_hand_example():
    solution = arith_solution(Problem("Compute ((37 + 48) - 15) * 2.", "140"))
    assert solution == "37 + 48 = 85\n85 - 15 = 70\n70 * 2 = 140\n#### 140"
    with pytest.raises(ValueError, match="only integers"):
        arith_solution("Compute 2 ** 3.")


def test_arith_answers_solutions_and_difficulty_knobs():
    config = ArithConfig(min_ops=2, max_ops=4, start_digits=3, digits=2, mul_digits=1, max_value=500)
    for p in arith_problems(500, split="test", seed=0, config=config):
        solution = arith_solution(p)
        lines = solution.split("\n")
        assert lines[-1] == f"#### {p.answer}"
        assert safe_eval(expression_of(p)) == int(p.answer)
        assert 2 <= len(lines) - 1 <= 4  # one line per operation
        for line in lines[:-1]:
            a, op, b, _, c = line.split()
            assert 0 <= int(c) <= 500  # every intermediate within [0, max_value]
            assert 1 <= int(b) <= (9 if op == "*" else 99)
        assert 1 <= int(lines[0].split()[0]) <= 500  # 3 start digits, capped by max_value
    config = ArithConfig(min_ops=2, max_ops=2, ops=("+",), start_digits=1, digits=1)
    only_add = arith_problems(200, config=config)
    assert all(safe_eval(expression_of(p)) <= 27 for p in only_add)
    assert all("-" not in p.problem and "*" not in p.problem for p in only_add)
    assert {len(arith_solution(p).split("\n")) for p in only_add} == {3}


def test_arith_train_and_test_are_disjoint():
    train = {p.problem for p in arith_problems(4000, split="train", seed=0)}
    test = {p.problem for p in arith_problems(4000, split="test", seed=0)}
    assert len(train) == len(test) == 4000  # distinct within a split
    assert not train & test
    assert all(split_of(expression_of(Problem(t, ""))) == "test" for t in test)


def test_arith_config_and_exhausted_space_errors():
    with pytest.raises(ValueError, match="min_ops <= max_ops"):
        ArithConfig(min_ops=3, max_ops=2)
    with pytest.raises(ValueError, match="subset"):
        ArithConfig(ops=("/",))
    with pytest.raises(ValueError, match="ask for fewer or widen"):
        arith_problems(100, config=ArithConfig(min_ops=1, max_ops=1, start_digits=1, digits=1, ops=("+",)))


def test_seen_in_training_counts_held_out_problems_that_are_training_problems(tmp_path):
    """One file for both sets holds out the training problems themselves (a .jsonl file has no splits):
    train.py says how many and records it; arith's splits and a folder's two files count none."""
    from oar.training.data import run_problems, seen_in_training

    rows = [{"problem": f"Compute {i} + 1.", "answer": str(i + 1)} for i in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[3:]))  # row 3 in both
    one = str(tmp_path / "train.jsonl")
    assert seen_in_training(*run_problems(one, one, train_size=0, eval_size=0, seed=0)) == 4
    assert seen_in_training(*run_problems(str(tmp_path), str(tmp_path), train_size=0, eval_size=0, seed=0)) == 1
    assert seen_in_training(*run_problems("arith", "", train_size=200, eval_size=50, seed=0)) == 0


# --- TRL's data conventions (a newcomer's report: a prompt column and messages rows were refused)


def test_a_trl_prompt_column_is_the_problem_and_the_row_is_kept(tmp_path):
    path = write(
        tmp_path,
        '{"prompt": "Compute 3 + 4.", "answer": "7", "source": "mine"}\n'
        '{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compute 5 * 2."}],'
        ' "solution": "So \\\\boxed{10}."}\n',
    )
    plain, chat = load_jsonl(path)
    assert (plain.problem, plain.answer, plain.system) == ("Compute 3 + 4.", "7", "")
    assert plain.row == {"prompt": "Compute 3 + 4.", "answer": "7", "source": "mine"}  # for TRL-style rewards
    assert (chat.problem, chat.answer, chat.system) == ("Compute 5 * 2.", "10", "Be brief.")


def test_messages_rows_take_the_user_turn_and_the_assistant_turns_answer():
    turns = [
        {"role": "system", "content": "Answer with #### N."},
        {"role": "user", "content": "Compute 6 - 2."},
        {"role": "assistant", "content": "6 - 2 = 4\n#### 4"},
    ]
    (p,) = problems_from_records([{"messages": turns}], "hub")
    assert (p.problem, p.answer, p.system) == ("Compute 6 - 2.", "4", "Answer with #### N.")
    (q,) = problems_from_records([{"messages": turns[1:2], "answer": "4"}], "hub")  # an answer column wins
    assert (q.problem, q.answer, q.system) == ("Compute 6 - 2.", "4", "")


def test_a_system_turn_opens_the_prompt(tiny_model):
    """In the chat template when it takes one; a template that refuses system turns (tiny-arith's) gets it at the
    top of the user turn (train.py says so once); a problem without one is prompted exactly as before."""
    from transformers import AutoTokenizer

    from oar.sampler import format_prompt
    from oar.training.data import problem_prompt, takes_system_turn

    tok = AutoTokenizer.from_pretrained(tiny_model)
    p = Problem("Compute 1 + 1.", "2", system="Be brief.")
    assert problem_prompt(tok, Problem("Compute 1 + 1.", "2"), "Go.") == format_prompt(tok, "Compute 1 + 1.", "Go.")
    if tok.chat_template:
        assert not takes_system_turn(tok)  # tiny-arith's template knows user and assistant turns only
        assert problem_prompt(tok, p) == format_prompt(tok, "Be brief.\n\nCompute 1 + 1.")
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert takes_system_turn(tok)
    assert problem_prompt(tok, p, "Go.") == "<system>Be brief.\n<user>Compute 1 + 1.\nGo.\n<assistant>"
    tok.chat_template = None
    assert problem_prompt(tok, p) == "Be brief.\nCompute 1 + 1.\n"
