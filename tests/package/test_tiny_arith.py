"""Tests of oar/tasks/tiny_arith.py and oar/tasks/tiny_arith_cache.py: the built-in policy, its build and its cache."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
import torch

from oar.tasks.arith import ArithConfig, arith_problems, arith_solution
from oar.training.data import Problem


def test_tiny_arith_builds_saves_and_loads_like_a_hub_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oar.tasks.tiny_arith import TinyArithRecipe
    from oar.tasks.tiny_arith_cache import build_tiny_arith, ensure_tiny_arith

    recipe = TinyArithRecipe(
        hidden_size=32, num_layers=1, num_heads=2, steps=3, batch_size=4, warmup_steps=1, eval_problems=4
    )
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
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Compute (3 + 4) * 2."}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "Q: Compute (3 + 4) * 2.\nA:\n"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Compute 1 + 2."}, {"role": "assistant", "content": "1 + 2 = 3\n#### 3"}],
        tokenize=False,
    )
    assert chat == "Q: Compute 1 + 2.\nA:\n1 + 2 = 3\n#### 3<eos>"
    enc = tok(["Q: 1\n", "Q: 12 + 3\n"], return_tensors="pt", padding=True)
    assert enc.input_ids[0, 0].item() == tok.pad_token_id  # left padding, as generation needs
    out_ids = model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert out_ids.shape[0] == 2


@pytest.mark.slow  # an end-to-end run of 10-35 s
def test_tiny_arith_overwrite_replaces_atomically(tmp_path):
    from oar.tasks.tiny_arith import TinyArithRecipe
    from oar.tasks.tiny_arith_cache import build_tiny_arith

    recipe = TinyArithRecipe(
        hidden_size=16, num_layers=1, num_heads=2, steps=1, batch_size=2, warmup_steps=1, eval_problems=2
    )
    out = tmp_path / "tiny"
    build_tiny_arith(out, seed=0, recipe=recipe)
    info = build_tiny_arith(out, seed=1, recipe=replace(recipe, eval_problems=3), overwrite=True)
    saved = json.loads((out / "build_info.json").read_text())
    assert (saved["seed"], saved["heldout_problems"]) == (info["seed"], 3) == (1, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tiny.lock", "tiny"]


def test_sft_target_is_lazy_on_a_fixed_share_of_the_longer_problems():
    from oar.tasks.tiny_arith import TinyArithRecipe, sft_target

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
    lazy_at = lambda rate: {
        p.problem
        for p in problems
        if sft_target(Problem(p.problem, "0"), replace(recipe, lazy_rate=rate))
        != arith_solution(Problem(p.problem, "0"))
    }
    assert len(lazy_at(0.75)) == lazy[3] and lazy_at(0.5) < lazy_at(0.75)
    with pytest.raises(ValueError, match="lazy_ops"):
        TinyArithRecipe(lazy_ops=1)


@pytest.mark.slow  # an end-to-end run of 10-35 s
def test_tiny_arith_is_deterministic_for_a_seed(tmp_path):
    from safetensors.torch import load_file

    from oar.tasks.tiny_arith import TinyArithRecipe
    from oar.tasks.tiny_arith_cache import build_tiny_arith

    recipe = TinyArithRecipe(
        hidden_size=16, num_layers=1, num_heads=2, steps=3, batch_size=4, warmup_steps=1, eval_problems=2
    )
    for name, seed in [("a", 0), ("b", 0), ("c", 1)]:
        build_tiny_arith(tmp_path / name, seed=seed, recipe=recipe)
    a, b, c = (load_file(tmp_path / name / "model.safetensors") for name in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_publish_keeps_a_build_that_won_the_race(tmp_path):
    from oar.tasks.tiny_arith_cache import _publish

    out, ours = tmp_path / "model", tmp_path / "ours"
    for folder, text in [(out, "theirs"), (ours, "ours")]:
        folder.mkdir()
        (folder / "build_info.json").write_text(text)
    _publish(ours, out, overwrite=False)  # another process finished first: no error, theirs kept
    assert (out / "build_info.json").read_text() == "theirs"


def test_concurrent_builds_of_one_folder_build_it_once(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from oar.tasks.tiny_arith import TinyArithRecipe
    from oar.tasks.tiny_arith_cache import build_tiny_arith, is_complete

    recipe = TinyArithRecipe(
        hidden_size=16, num_layers=1, num_heads=2, steps=2, batch_size=2, warmup_steps=1, eval_problems=2
    )

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
    from oar.tasks.tiny_arith import BUILDER_VERSION
    from oar.tasks.tiny_arith_cache import default_model_dir

    monkeypatch.setenv("OAR_CACHE", str(tmp_path))
    assert default_model_dir() == tmp_path / BUILDER_VERSION


def test_the_shipped_weights_load_and_score_as_recorded(monkeypatch, tmp_path):
    """`--model tiny-arith` is the shipped build (no build, whatever the cache holds), its weights hash
    as recorded, and its greedy held-out accuracy is the recorded one: the same start on every machine."""
    from oar.tasks.arith import arith_problems
    from oar.tasks.tiny_arith import TinyArithRecipe, greedy_accuracy, max_new_tokens_for
    from oar.tasks.tiny_arith_cache import SHIPPED, model_source, weights_sha256
    from oar.training.models import load_model

    monkeypatch.setenv("OAR_CACHE", str(tmp_path / "empty"))  # a build would land here: none must
    assert model_source("tiny-arith") == str(SHIPPED) and not (tmp_path / "empty").exists()
    info = json.loads((SHIPPED / "build_info.json").read_text())
    assert weights_sha256(SHIPPED) == info["weights_sha256"]
    recipe = TinyArithRecipe()
    assert info["recipe"] == json.loads(json.dumps(asdict(recipe))) | {"num_threads": info["recipe"]["num_threads"]}
    model, tok = load_model(model_source("tiny-arith"))
    held_out = arith_problems(info["heldout_problems"], split="test", seed=info["seed"], config=recipe.eval_arith)
    acc = greedy_accuracy(model, tok, held_out, max_new_tokens=max_new_tokens_for(recipe.eval_arith))
    assert acc == info["heldout_accuracy"] == 0.452


def test_shipped_weights_that_do_not_hash_as_recorded_stop_with_a_message(monkeypatch, tmp_path):
    import shutil

    from oar.tasks import tiny_arith_cache

    copy = tmp_path / "tiny-arith"
    shutil.copytree(tiny_arith_cache.SHIPPED, copy)
    info = json.loads((copy / "build_info.json").read_text())
    (copy / "build_info.json").write_text(json.dumps(info | {"weights_sha256": "0" * 64}))
    monkeypatch.setattr(tiny_arith_cache, "SHIPPED", copy)
    with pytest.raises(RuntimeError, match="do not hash as build_info.json records"):
        tiny_arith_cache.model_source("tiny-arith")
