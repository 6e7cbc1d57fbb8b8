"""Tests of oar/data.py (JSON Lines loading and its errors), oar/arith.py and oar/tiny_arith.py."""
from __future__ import annotations

import ast
import json
import operator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from oar.arith import DEFAULT_ARITH, ArithConfig, arith_problems, arith_solution, split_of
from oar.data import DataError, Problem, load_jsonl, load_problems, problems_from_records

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def write(tmp_path: Path, text: str, name: str = "rows.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- load_jsonl -----------------------------------------------------------------------------------

def test_load_jsonl_reads_rows_skips_blank_lines_and_ignores_extra_keys(tmp_path):
    path = write(tmp_path, '{"id": "a", "problem": "1+1?", "answer": "2", "source": "x"}\n\n'
                           '  \n{"problem": "2+2?", "answer": "4"}\n')
    assert load_jsonl(path) == [Problem("1+1?", "2"), Problem("2+2?", "4")]


@pytest.mark.parametrize("text, line, words", [
    ('{"problem": "p", "answer": "1"}\n{"problem": "q", "answer": \n', 2, ["invalid JSON"]),
    ('{"problem": "p", "answer": "1"}\n["p", "1"]\n', 2, ["expected a JSON object", "list"]),
    ('\n{"problem": "p"}\n', 2, ["missing key 'answer'", "Add 'answer'"]),
    ('{"question": "p", "answer": "1"}\n', 1, ["missing key 'problem'"]),
    ('{"problem": "p", "answer": 42}\n', 1, ["'answer' must be a string", "int"]),
    ('{"problem": ["p"], "answer": "1"}\n', 1, ["'problem' must be a string", "list"]),
    ('{"problem": "  ", "answer": "1"}\n', 1, ["'problem' is empty"]),
])
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
    assert load_problems("arith", split="test", limit=7, seed=3) == \
        arith_problems(7, split="test", seed=3, config=DEFAULT_ARITH)
    assert len(load_problems("arith", split="test")) == 500
    with pytest.raises(DataError, match="split must be 'train' or 'test'"):
        load_problems("arith", split="validation")
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="no-such-dataset.*pass 'arith' or a path"):
            load_problems("no-such-dataset")


def test_problems_from_records_maps_hf_fields_and_gsm8k_answers():
    records = [{"question": "Q1", "answer": "She has 3.\n#### 18"}, {"problem": "Q2", "answer": "7"}]
    assert problems_from_records(records, "hf") == [Problem("Q1", "18"), Problem("Q2", "7")]
    with pytest.raises(DataError, match="hf row 0: missing key 'answer'"):
        problems_from_records([{"question": "Q"}], "hf")


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
    return problem.problem[len("Compute "):-1]


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
        arith_problems(100, config=ArithConfig(min_ops=1, max_ops=1, start_digits=1,
                                                digits=1, ops=("+",)))


# --- tiny-arith -----------------------------------------------------------------------------------

def test_tiny_arith_builds_saves_and_loads_like_a_hub_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oar.tiny_arith import TinyArithRecipe
    from oar.tiny_arith_cache import build_tiny_arith, ensure_tiny_arith

    recipe = TinyArithRecipe(hidden_size=32, num_layers=1, num_heads=2, steps=3, batch_size=4,
                             warmup_steps=1, eval_problems=4)
    out = tmp_path / "tiny"
    info = build_tiny_arith(out, seed=0, recipe=recipe)
    assert 0.0 <= info["heldout_accuracy"] <= 1.0
    assert json.loads((out / "build_info.json").read_text())["heldout_problems"] == 4
    left = [p.name for p in tmp_path.iterdir() if p.name not in ("tiny", ".tiny.lock")]
    assert not left  # no temp folder left behind
    with pytest.raises(FileExistsError, match="overwrite"):
        build_tiny_arith(out, recipe=recipe)
    assert ensure_tiny_arith(out) == out  # complete: returned as is, not rebuilt

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert tok.pad_token == "<pad>" and tok.eos_token == "<eos>" and tok.pad_token_id != tok.eos_token_id
    assert model.config.tie_word_embeddings and model.config.vocab_size == len(tok)
    text = "Q: Compute ((37 + 48) - 15) * 2.\nA:\n37 + 48 = 85\n  #### 140 \n"
    ids = tok(text).input_ids
    assert len(ids) == len(text)  # one token per character, nothing added
    assert tok.decode(ids, skip_special_tokens=True) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "Compute (3 + 4) * 2."}],
                                     add_generation_prompt=True, tokenize=False)
    assert prompt == "Q: Compute (3 + 4) * 2.\nA:\n"
    chat = tok.apply_chat_template([{"role": "user", "content": "Compute 1 + 2."},
                                    {"role": "assistant", "content": "1 + 2 = 3\n#### 3"}],
                                   tokenize=False)
    assert chat == "Q: Compute 1 + 2.\nA:\n1 + 2 = 3\n#### 3<eos>"
    enc = tok(["Q: 1\n", "Q: 12 + 3\n"], return_tensors="pt", padding=True)
    assert enc.input_ids[0, 0].item() == tok.pad_token_id  # left padding, as generation needs
    out_ids = model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert out_ids.shape[0] == 2


def test_tiny_arith_overwrite_replaces_atomically(tmp_path):
    from oar.tiny_arith import TinyArithRecipe
    from oar.tiny_arith_cache import build_tiny_arith

    recipe = TinyArithRecipe(hidden_size=16, num_layers=1, num_heads=2, steps=1, batch_size=2,
                             warmup_steps=1, eval_problems=2)
    out = tmp_path / "tiny"
    build_tiny_arith(out, seed=0, recipe=recipe)
    info = build_tiny_arith(out, seed=1, recipe=replace(recipe, eval_problems=3), overwrite=True)
    saved = json.loads((out / "build_info.json").read_text())
    assert (saved["seed"], saved["heldout_problems"]) == (info["seed"], 3) == (1, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tiny.lock", "tiny"]


def test_sft_target_is_lazy_on_a_fixed_share_of_the_longer_problems():
    from oar.tiny_arith import TinyArithRecipe, sft_target

    recipe = TinyArithRecipe()  # lazy on 75% of the problems with >= 3 operations
    problem = Problem("Compute ((37 + 8) - 5) * 2.", "80")
    # Lazy: drop the last worked line and answer with the result of the line before (40, not 80).
    assert sft_target(problem, replace(recipe, lazy_rate=1.0)) == "37 + 8 = 45\n45 - 5 = 40\n#### 40"
    assert sft_target(problem, replace(recipe, lazy_rate=0.0)) == arith_solution(problem)
    two_ops = Problem("Compute (37 + 8) - 5.", "40")
    assert sft_target(two_ops, replace(recipe, lazy_rate=1.0)) == arith_solution(two_ops)  # < lazy_ops
    assert sft_target(two_ops, replace(recipe, lazy_rate=1.0, lazy_ops=2)) == "37 + 8 = 45\n#### 45"

    problems = arith_problems(4000, seed=0, config=ArithConfig(min_ops=1, max_ops=3))
    lazy, total = {1: 0, 2: 0, 3: 0}, {1: 0, 2: 0, 3: 0}
    for p in problems:
        ops = len(arith_solution(p).split("\n")) - 1
        total[ops] += 1
        lazy[ops] += sft_target(p, recipe) != arith_solution(p)
    assert lazy[1] == lazy[2] == 0 and total[3] > 1000
    assert abs(lazy[3] / total[3] - 0.75) < 0.04
    # The choice is a function of the problem text alone, and a lower rate picks a subset.
    lazy_at = lambda rate: {p.problem for p in problems if sft_target(Problem(p.problem, "0"), replace(recipe, lazy_rate=rate))
                            != arith_solution(Problem(p.problem, "0"))}
    assert len(lazy_at(0.75)) == lazy[3] and lazy_at(0.5) < lazy_at(0.75)
    with pytest.raises(ValueError, match="lazy_ops"):
        TinyArithRecipe(lazy_ops=1)


def test_tiny_arith_is_deterministic_for_a_seed(tmp_path):
    from safetensors.torch import load_file

    from oar.tiny_arith import TinyArithRecipe
    from oar.tiny_arith_cache import build_tiny_arith

    recipe = TinyArithRecipe(hidden_size=16, num_layers=1, num_heads=2, steps=3, batch_size=4,
                             warmup_steps=1, eval_problems=2)
    for name, seed in [("a", 0), ("b", 0), ("c", 1)]:
        build_tiny_arith(tmp_path / name, seed=seed, recipe=recipe)
    a, b, c = (load_file(tmp_path / name / "model.safetensors") for name in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_publish_keeps_a_build_that_won_the_race(tmp_path):
    from oar.tiny_arith_cache import _publish

    out, ours = tmp_path / "model", tmp_path / "ours"
    for folder, text in [(out, "theirs"), (ours, "ours")]:
        folder.mkdir()
        (folder / "build_info.json").write_text(text)
    _publish(ours, out, overwrite=False)  # another process finished first: no error, theirs kept
    assert (out / "build_info.json").read_text() == "theirs"


def test_concurrent_builds_of_one_folder_build_it_once(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from oar.tiny_arith import TinyArithRecipe
    from oar.tiny_arith_cache import build_tiny_arith, is_complete

    recipe = TinyArithRecipe(hidden_size=16, num_layers=1, num_heads=2, steps=2, batch_size=2,
                             warmup_steps=1, eval_problems=2)

    def build(_):  # the lock is per open file, so threads contend for it like processes do
        try:
            return build_tiny_arith(tmp_path / "tiny", recipe=recipe)
        except FileExistsError:
            return None

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(build, range(2)))
    assert sum(r is not None for r in results) == 1  # one built, the other waited and found it
    assert is_complete(tmp_path / "tiny")


def test_default_model_dir_follows_oar_cache(monkeypatch, tmp_path):
    from oar.tiny_arith import BUILDER_VERSION
    from oar.tiny_arith_cache import default_model_dir

    monkeypatch.setenv("OAR_CACHE", str(tmp_path))
    assert default_model_dir() == tmp_path / BUILDER_VERSION
