"""Sampler: the (B, L) layout and the masks on hand-made completions; sampling determinism."""

from pathlib import Path

import pytest
import torch

from oar.sampler import encode_prompts, format_prompt, sample
from oar.rollout import build_rollout
from oar.tasks.tiny_arith import make_tokenizer

from conftest import tiny_llama


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()  # one token per character: masks can be checked character by character


def _rollout(tok, prompts, completions, budget):
    ids, mask = encode_prompts(tok, prompts, "cpu")
    rows = []
    for c in completions:
        t = tok(c, add_special_tokens=False)["input_ids"]
        if not c.endswith("…"):  # "…" marks a completion cut by the budget: no EOS
            t = t + [tok.eos_token_id]
        else:
            t = tok(c[:-1], add_special_tokens=False)["input_ids"]
        rows.append(t + [tok.pad_token_id] * (budget - len(t)))
    return build_rollout(tok, ids, mask, torch.tensor(rows), {tok.eos_token_id})


def test_masks_on_a_hand_made_completion(tok):
    prompts = ["Q: Compute 1 + 2.\nA:\n", "Q: 7\nA:\n"]
    completions = ["1 + 2 = 3\n#### 3", "12 * 3 = 36\n#### 36"]
    ro = _rollout(tok, prompts, completions, budget=24)
    lp = ro.prompt_width
    assert lp == len(prompts[0]) and (ro.attention_mask[1, : lp - len(prompts[1])] == 0).all()  # left padding
    for i, c in enumerate(completions):
        comp = ro.completion_mask[i].nonzero().flatten()
        # Completion = its characters + EOS, starting at Lp; nothing after EOS.
        assert comp.tolist() == list(range(lp, lp + len(c) + 1))
        assert ro.input_ids[i, lp + len(c)] == tok.eos_token_id
        assert (ro.attention_mask[i, lp + len(c) + 1 :] == 0).all()
        marker = c.index("####")
        reasoning = ro.reasoning_mask[i].nonzero().flatten() - lp
        assert reasoning.tolist() == list(range(marker))  # every character before the marker
        answer = ro.answer_mask[i].nonzero().flatten() - lp
        assert "".join(c[k] for k in answer.tolist()) == c.split("#### ")[1]
    assert ro.texts == completions and not ro.truncated.any()


def test_truncated_and_answerless_rollouts(tok):
    ro = _rollout(tok, ["Q: 1\nA:\n"] * 2, ["1 + 1 = 2\n#### 2…", "no marker here"], budget=16)
    assert ro.truncated.tolist() == [True, False]
    # A truncated rollout keeps all its tokens in the completion (it has no EOS to include).
    assert int(ro.completion_mask[0].sum()) == 16
    # No final answer: no reasoning/answer span, so OAR leaves it with GRPO's weights.
    assert not ro.reasoning_mask[1].any() and not ro.answer_mask[1].any()


def test_format_prompt_uses_chat_template_when_present(tok):
    assert format_prompt(tok, "Compute 1 + 2.") == "Q: Compute 1 + 2.\nA:\n"
    plain = make_tokenizer()
    plain.chat_template = None
    assert format_prompt(plain, "Compute 1 + 2.", "Think.") == "Compute 1 + 2.\nThink.\n"


def test_greedy_sampling_matches_hf_generate(tok):
    model = tiny_llama(vocab_size=len(tok), seed=1)
    model.generation_config.eos_token_id = tok.eos_token_id
    prompts = ["Q: Compute 12 + 7.\nA:\n", "Q: 3\nA:\n"]
    ro = sample(model, tok, prompts, group_size=1, seeds=[0, 1], max_new_tokens=12, temperature=0.0)
    ids, mask = encode_prompts(tok, prompts, "cpu")
    ref = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    for i in range(2):
        got = ro.input_ids[i, ro.completion_mask[i]].tolist()
        want = ref[i, ids.shape[1] :].tolist()
        assert got == want[: len(got)]


@pytest.mark.parametrize("loop", ["eager", "static"])
def test_a_model_left_in_training_mode_samples_in_eval_mode_and_gets_its_mode_back(tok, loop):
    """The update leaves the policy in training mode; the next step's rollouts must not see it: every
    forward of the sampler runs in eval mode (checkpointed layers would drop the KV cache, transformers
    < 5.24, and dropout would noise the tokens), and the model is in training mode again afterwards."""
    model = tiny_llama(vocab_size=len(tok), seed=3)
    prompts, seeds = ["Q: Compute 12 + 7.\nA:\n", "Q: 3\nA:\n"], [5, 6]
    want = sample(model.eval(), tok, prompts, group_size=1, seeds=seeds, max_new_tokens=8, loop=loop).texts
    from oar.training.models import enable_checkpointing

    enable_checkpointing(model)
    model.train()
    modes = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: modes.append(mod.training)) for m in model.modules()]
    got = sample(model, tok, prompts, group_size=1, seeds=seeds, max_new_tokens=8, loop=loop).texts
    for h in hooks:
        h.remove()
    assert modes and not any(modes)
    assert all(m.training for m in model.modules())
    assert got == want


def test_a_rollout_does_not_depend_on_its_batch(tok):
    model = tiny_llama(vocab_size=len(tok), seed=2)
    a, b = "Q: Compute 1 + 2 + 3.\nA:\n", "Q: 9\nA:\n"
    both = sample(model, tok, [a, b], group_size=2, seeds=[10, 11, 12, 13], max_new_tokens=10)
    alone = sample(model, tok, [b], group_size=2, seeds=[12, 13], max_new_tokens=10)
    assert both.texts[2:] == alone.texts
    again = sample(model, tok, [a, b], group_size=2, seeds=[10, 11, 12, 13], max_new_tokens=10)
    assert again.texts == both.texts
    assert len(set(both.texts[:2] + both.texts[2:])) > 1  # the seeds do make rollouts differ


def test_auto_instruction_asks_for_boxed_answers_except_from_arith_or_tiny_arith():
    from oar.sampler import BOXED_INSTRUCTION, resolve_instruction

    assert resolve_instruction("auto", "arith") == ""
    assert resolve_instruction("auto", "data/test.jsonl", "tiny-arith") == ""  # it knows only '#### N'
    assert resolve_instruction("auto", "data/test.jsonl", "Qwen/Qwen2.5-Math-1.5B") == BOXED_INSTRUCTION
    assert resolve_instruction("Answer briefly.", "arith", "tiny-arith") == "Answer briefly."
    from oar.tasks.tiny_arith_cache import shipped_model

    if (folder := shipped_model()) is not None:  # by its folder too: it records its builder
        assert resolve_instruction("auto", "data/test.jsonl", str(folder)) == ""
    assert (
        resolve_instruction("auto", "data/test.jsonl", str(Path(__file__).parent)) == BOXED_INSTRUCTION
    )  # any other folder


@pytest.mark.parametrize("length", [1, 15, 16, 17, 64, 257, 1024])
def test_a_table_of_uniforms_is_the_stream_of_single_draws(length):
    """The sampler draws a rollout's uniforms as one tensor up front; every published rollout was made
    with one draw per token, so the two must be the same numbers (they are: CPU generators, any length)."""
    for seed in (0, 7, 2**40 + 3):
        g = torch.Generator().manual_seed(seed)
        single = torch.stack([torch.rand((), generator=g) for _ in range(length)])
        assert torch.equal(torch.rand(length, generator=torch.Generator().manual_seed(seed)), single)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_sampler_returns_the_log_probs_of_its_tokens(tok, temperature):
    from oar.grpo import token_logprobs
    from oar.lm import forward_logits

    model = tiny_llama(vocab_size=len(tok), seed=3)
    ro = sample(
        model,
        tok,
        ["Q: Compute 1 + 2.\nA:\n", "Q: 9\nA:\n"],
        group_size=2,
        seeds=[1, 2, 3, 4],
        max_new_tokens=9,
        temperature=temperature,
    )
    lp, done = ro.prompt_width, ro.completion_mask
    logits = forward_logits(model, ro.input_ids, ro.attention_mask, logits_to_keep=ro.input_ids.shape[1] - lp + 1)
    full = token_logprobs(logits[:, :-1], ro.input_ids[:, lp:], temperature=temperature or 1.0)  # a full forward's
    assert done[:, lp:].any() and (ro.sample_logprobs[~done] == 0).all()
    torch.testing.assert_close(ro.sample_logprobs[:, lp:][done[:, lp:]], full[done[:, lp:]], rtol=0, atol=1e-5)
    assert torch.equal(ro.select(slice(1, 3)).sample_logprobs, ro.sample_logprobs[1:3])


def test_train_py_logs_how_far_the_sampler_is_from_the_update_forward(tiny_model, tmp_path):
    import json

    from tinyrun import TINY, run_inprocess

    out = tmp_path / "run"
    run_inprocess(
        [
            "--model",
            str(tiny_model),
            "--dataset",
            str(tiny_model / "data.jsonl"),
            "--output_dir",
            str(out),
            "--steps",
            "1",
            "--save_every",
            "0",
            "--method",
            "grpo",
            *TINY,
        ]
    )
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    # float32 on a CPU: a cached decode and a full forward agree to rounding
    assert 0 <= row["sampler/logprob_diff_mean"] <= row["sampler/logprob_diff_max"] < 1e-4


def test_chunks_are_sampled_as_separate_batches_and_laid_out_as_one(tok):
    """`chunk`: prompts sampled k at a time, each chunk its own batch and padding, concatenated in one layout.
    A process holding whole chunks of a step's prompts therefore samples exactly what one process does."""
    model = tiny_llama(vocab_size=len(tok), seed=4)
    prompts = ["Q: Compute 1 + 2.\nA:\n", "Q: 9\nA:\n", "Q: Compute 12 * 3 - 5.\nA:\n", "Q: 4 + 4\nA:\n"]
    seeds = list(range(100, 108))
    kw = dict(group_size=2, max_new_tokens=8, temperature=1.0)
    whole = sample(model, tok, prompts, seeds=seeds, chunk=2, **kw)
    halves = [
        sample(model, tok, prompts[k : k + 2], seeds=seeds[2 * k : 2 * k + 4], **kw) for k in (0, 2)
    ]  # two processes' calls
    assert whole.texts == halves[0].texts + halves[1].texts
    for i, part, j in [
        (0, halves[0], 0),
        (5, halves[1], 1),
    ]:  # a row keeps its tokens, masks and log-probs under the new padding
        for name in ("input_ids", "completion_mask", "reasoning_mask", "answer_mask", "sample_logprobs"):
            got, want = getattr(whole, name)[i], getattr(part, name)[j]
            got = got[whole.prompt_width - part.prompt_width :][: want.shape[0]]
            assert torch.equal(got, want), name
    assert torch.equal(whole.attention_mask.sum(1), torch.cat([h.attention_mask.sum(1) for h in halves]))
    assert whole.input_ids.shape[1] == max(h.prompt_width for h in halves) + max(
        h.input_ids.shape[1] - h.prompt_width for h in halves
    )
    with pytest.raises(AssertionError, match="must divide"):
        sample(model, tok, prompts, seeds=seeds, chunk=3, **kw)


@pytest.mark.slow  # an end-to-end run of 10-35 s
@pytest.mark.parametrize("loop", ["eager", "static"])
def test_a_published_v5_ledger_run_reproduces_to_the_digit(tmp_path, loop):
    # fork/grpo-s0 of the 90-run study, from its recorded config and its starting model (the shipped
    # tiny-arith weights are the same blob): every logged number of its first 3 steps but the timings.
    import json
    from pathlib import Path

    from oar.training.resume import from_record
    from tinyrun import train_module

    run = Path(__file__).resolve().parents[2] / "research" / "testbeds_v5" / "ledger" / "runs" / "fork" / "grpo-s0"
    cfg = json.loads((run / "config.json").read_text())
    train_module().main(
        from_record(
            cfg,
            model="tiny-arith",
            steps=3,
            output_dir=str(tmp_path),
            eval_size=1,
            eval_every=0,
            save_every=0,
            decode_loop=loop,
        )
    )
    got = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[:3]]
    timing = {"oar/seconds_per_rollout"}
    got = [{k: g[k] for k in w if not k.startswith("time/") and k not in timing} for g, w in zip(got, want)]
    want = [{k: v for k, v in w.items() if not k.startswith("time/") and k not in timing} for w in want]
    # The rollouts (tokens, rewards, lengths) must be the recorded ones exactly. The update's float
    # reductions are not: the ledger was recorded on another CPU, and a sum over the vocabulary or the
    # parameters rounds differently with another kernel (measured here: policy/entropy and
    # optim/grad_norm 1e-7 relative apart at step 1 on one AMD EPYC, equal on another); 1e-6 relative
    # is that rounding, not a change of the algorithm.
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in w:
            if k != "optim/lr":
                assert g[k] == pytest.approx(w[k], rel=1e-6, abs=1e-9), k
    # the ledger's optim/lr is the next step's rate (logged after the schedule stepped, until 3ab1f25)
    assert [g["optim/lr"] for g in got[1:]] == pytest.approx([w["optim/lr"] for w in want[:-1]], rel=1e-6)
