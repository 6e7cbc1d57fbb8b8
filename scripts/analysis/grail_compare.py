r"""GRAIL's own code beside oar on the same token ids: its weights, and its OAR-G baseline's (docs/differences.md,
"GRAIL and its OAR-G baseline").

GRAIL (declare-lab/grail, arXiv 2606.04889) ships its method and an OAR-G baseline as two methods of its
trainer class, `compute_grail_weights` and `compute_oar_g_weights` (src/train/grail_trainer.py). This script
loads that file by path (nothing is fetched; TRL, which the file imports, comes from --trl or the
environment), makes an object of the class without its __init__, gives it the attributes the two methods
read (scripts/analysis/grail_harness.py), and runs them beside oar's `grail` and `oar-g` credit methods,
computed as train.py computes them, on the same rollouts:

  the model     tiny-arith (shipped, oar/tasks/tiny-arith) fine-tuned for --sft_steps CPU steps to end its
                solutions with `\boxed{N}` instead of `#### N`: GRAIL finds the answer by searching the decoded
                text for `\boxed{`, and tiny-arith, which reads no instructions, writes none (0 of 16 rollouts
                asked with the usual \boxed{} request). One token per character, so decoding and re-encoding
                (GRAIL's way to its span) round-trip exactly: checked on every rollout.
  the rollouts  oar's sampler at temperature 1 (GRAIL's run) on held-out 2-operation problems; rewards from the
                last box; A_i = r_i - the group's mean (GRAIL's scale_rewards false); the model in train mode,
                as in both trainers (tiny-arith has no dropout); every rollout scored, as --score_all.
  GRAIL         its weights at its run config (spread 0.5, centre 1, clip [0.5, 5], the wrong rollouts
                A_i <= 0) against oar's `grail` method, and against oar.grail fed GRAIL's choices (its
                one-column shift, the first box as the span, statistics over the whole completion, its
                overwrites): that replica agrees to float rounding, and without the shift shows what the shift moves.
  OAR-G         GRAIL's baseline (tau 0.4, beta 2, noise 1e-3) against oar's `oar-g` (q = 0.4, kappa = 2,
                nu = 1e-3). GRAIL draws its noise from the global RNG, oar from each rollout's seed, so both run
                at --noise_seeds seeds (GRAIL after torch.manual_seed(k), oar from seed_i + k * 10^6), and each
                method's agreement with itself from seed k to k + 1 is the noise floor. Then with matched noise:
                oar given the draws GRAIL used, at GRAIL's positions (redrawn from the seed; checked that GRAIL
                drew exactly one randn(B, T, H)), so what is left is the two codes' other differences. At noise 0
                answer_mean's gradient is exactly 0 in both codes: no comparison there.
  also          GRAIL's two methods with the model in bfloat16 against float32 (same seeds), and GRAIL's OAR-G
                handed a DDP-wrapped model, as its call site hands it the Trainer's wrapped model.

Per rollout, over oar's reasoning tokens R_i: the Spearman correlation of the two weights with GRAIL's column
j + offset read as token j, offsets -1, 0, +1 (GRAIL scores token j - 1 in column j, so its alignment shows as
+1); the largest |difference| of the weights as each code assigns them to tokens (offset 0: what the loss
multiplies); each method's mean weight per region (reasoning, marker, answer, after the answer, EOS) and its
mass (the mean weight over R_i and over the completion).

    pip install --no-deps --target /tmp/trl trl==1.16.0
    python scripts/analysis/grail_compare.py --grail ~/grail --trl /tmp/trl --json docs/bench/grail-compare.json

No GRAIL code is in this repository; tests/scripts/test_grail_compare.py runs the script against a fake of the class.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never fetch: the model is the shipped tiny-arith folder
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from oar.grail import reweighted_rows  # noqa: E402
from scripts.analysis import grail_harness as h  # noqa: E402
from scripts.analysis.attribution import spearman  # noqa: E402

OFFSETS = (-1, 0, 1)
NOISE_SEED_STRIDE = 10**6  # oar's k-th noise draw: the rollouts' seeds + k * this
REGIONS = ("reasoning", "marker", "answer", "after", "eos")


def regions(ro) -> dict[str, torch.Tensor]:
    """oar's regions of each completion, (B, T) bool: reasoning R_i, the marker (between R_i and the answer), the
    answer A_i, the tokens after it (GRAIL's closing brace, EOS), and the EOS of a rollout with an answer."""
    lp = ro.prompt_width
    valid, r, a = ro.completion_mask[:, lp:], ro.reasoning_mask[:, lp:], ro.answer_mask[:, lp:]
    cols = torch.arange(valid.shape[1])
    first = torch.where(a, cols, valid.shape[1]).amin(1, keepdim=True)
    last = torch.where(a, cols, -1).amax(1, keepdim=True)
    eos = (cols == valid.sum(1, keepdim=True) - 1) & ~ro.truncated[:, None] & (last >= 0)
    return {
        "reasoning": r,
        "marker": valid & ~r & (cols < first),
        "answer": a,
        "after": valid & (cols > last) & (last >= 0),
        "eos": eos,
    }


def compare(g: torch.Tensor, o: torch.Tensor, ro, rows: torch.Tensor) -> dict:
    """GRAIL's weights g against oar's o, both (B, T), on the rollouts `rows` (B,) bool, over oar's R_i: the
    mean per-row Spearman at each offset (GRAIL's column j + offset read as token j) and the best offset; the
    largest |g - o| over R_i and over the completion, each weight on the token its code gives it (offset 0)."""
    lp = ro.prompt_width
    r, valid = ro.reasoning_mask[:, lp:], ro.completion_mask[:, lp:]
    per = {d: [] for d in OFFSETS}
    for i in rows.nonzero().flatten().tolist():
        t = r[i].nonzero().flatten()
        for d in OFFSETS:
            keep = t[(t + d >= 0) & (t + d < g.shape[1])]
            per[d].append(spearman(o[i, keep].double().numpy(), g[i, keep + d].double().numpy()))
    mean = {d: float(np.mean(v)) if v else float("nan") for d, v in per.items()}
    on_r, on_all = rows[:, None] & r, rows[:, None] & valid
    return {
        "rows": int(rows.sum()),
        "spearman": {f"{d:+d}": mean[d] for d in OFFSETS},
        "spearman_min_at_0": float(min(per[0])) if per[0] else float("nan"),
        "best_offset": max(OFFSETS, key=lambda d: -2.0 if np.isnan(mean[d]) else mean[d]),
        "max_abs_diff_reasoning": float((g - o)[on_r].abs().max()) if on_r.any() else 0.0,
        "max_abs_diff_completion": float((g - o)[on_all].abs().max()) if on_all.any() else 0.0,
    }


def mean_compare(cs: list[dict]) -> dict:
    """`compare` over several noise draws: Spearman averaged, differences at their largest, every best offset."""
    return {
        "rows": cs[0]["rows"],
        "spearman": {k: float(np.mean([c["spearman"][k] for c in cs])) for k in cs[0]["spearman"]},
        "best_offset": max(OFFSETS, key=lambda d: np.mean([c["spearman"][f"{d:+d}"] for c in cs])),
        "best_offsets": sorted({c["best_offset"] for c in cs}),
        "max_abs_diff_reasoning": max(c["max_abs_diff_reasoning"] for c in cs),
        "max_abs_diff_completion": max(c["max_abs_diff_completion"] for c in cs),
    }


def profile(w: torch.Tensor, ro, rows: torch.Tensor) -> dict:
    """A method's weights (B, T) on the rollouts `rows`: the mean per region, and the mass as the mean weight over
    R_i and over the completion, per rollout then averaged (1 where a method preserves the mass there)."""
    reg, valid = regions(ro), ro.completion_mask[:, ro.prompt_width :]
    out = {k: float(w[rows[:, None] & m].mean()) if (rows[:, None] & m).any() else None for k, m in reg.items()}
    for name, m in (("mass_reasoning", reg["reasoning"]), ("mass_completion", valid)):
        means = [float(w[i][m[i]].mean()) for i in rows.nonzero().flatten().tolist() if m[i].any()]
        out[name] = float(np.mean(means)) if means else None
    return out


def floor(ws: list[torch.Tensor], ro, rows: torch.Tensor) -> float:
    """A method's own seed-to-seed agreement: the mean Spearman over R_i of draw k against draw k + 1."""
    pairs = [compare(a, b, ro, rows)["spearman"]["+0"] for a, b in zip(ws, ws[1:])]
    return float(np.mean(pairs)) if pairs else float("nan")


LADDER = (  # oar.grail fed GRAIL's choices, then each choice turned back to oar's in turn
    ("GRAIL's choices", {}),
    ("without the shift", {"shift": False}),
    ("and J over oar's answer span", {"shift": False, "box_span": False}),
    ("and statistics over R_i, no overwrites", {"shift": False, "box_span": False, "whole": False}),
)


def grail_part(t, model, tok, bed, group_size: int) -> tuple[dict, torch.Tensor]:
    """(a) GRAIL's weights against oar's grail method, and against oar.grail fed GRAIL's choices, those turned
    back to oar's one at a time (LADDER). Float rounding's yardstick: GRAIL's own float32 against float64."""
    ro, rewards, advantages, seeds, golds = bed
    lp, span = ro.prompt_width, h.grail_span(tok, ro)
    valid, reasoning = ro.completion_mask[:, lp:], ro.reasoning_mask[:, lp:]
    both = span["marker"].any(1) & ro.answer_mask.any(1)  # a box for GRAIL, an answer for oar
    wrong = reweighted_rows(advantages, h.GRAIL_RUN["grail_rollout_symmetry"])
    g = t.compute_grail_weights(model, **h.grail_inputs(ro), advantages=advantages[:, None]).float()
    o = h.oar_method("grail", model, tok, ro, rewards, advantages, seeds, golds, group_size)
    wide = copy.deepcopy(model).double()
    g64 = h.harness(type(t), wide, tok).compute_grail_weights(
        wide, **h.grail_inputs(ro), advantages=advantages[:, None]
    )
    span_check = None
    if hasattr(t, "_get_boxed_span_masks"):  # GRAIL's own split of its span, against the one rebuilt
        _, boundary, content, post = t._get_boxed_span_masks(ro.input_ids[:, lp:], valid.shape[1], "cpu")
        span_check = bool(
            torch.equal(boundary, span["marker"] | span["closing"])
            and torch.equal(content, span["content"])
            and torch.equal(post & valid, span["after"] & valid)
        )
    ladder = []
    for name, turned in LADDER:
        w = h.grail_replica(model, ro, span, advantages, **turned)
        c = compare(w, o, ro, both & wrong)
        ladder.append(
            {
                "step": name,
                "max_abs_diff_to_grail": float((w - g)[valid].abs().max()),
                "spearman_to_oar": c["spearman"]["+0"],
                "max_abs_diff_to_oar_reasoning": c["max_abs_diff_reasoning"],
                "max_abs_diff_to_oar_completion": c["max_abs_diff_completion"],
            }
        )
    other = (both & ~wrong)[:, None] & reasoning  # rollouts neither code reweights
    return {
        "replica_max_abs_diff": ladder[0]["max_abs_diff_to_grail"],
        "grail_float32_vs_float64_max_abs_diff": float((g.double() - g64.double()).abs().max()),
        "span_matches_grail": span_check,
        "ladder": ladder,
        "vs_oar_method": compare(g, o, ro, both & wrong),
        "other_rollouts_equal_on_reasoning": bool((g - o)[other].abs().max() == 0) if other.any() else None,
        "profile": {
            "grail": {"wrong": profile(g, ro, both & wrong), "other": profile(g, ro, both & ~wrong)},
            "oar": {"wrong": profile(o, ro, both & wrong), "other": profile(o, ro, both & ~wrong)},
        },
    }, g


def oar_g_part(t, model, tok, bed, group_size: int, noise_seeds: int) -> tuple[dict, list[torch.Tensor]]:
    """(b) GRAIL's OAR-G against oar's oar-g: seeded draws of each, then oar given GRAIL's draws."""
    ro, rewards, advantages, seeds, golds = bed
    answered = h.grail_span(tok, ro)["marker"].any(1) & ro.answer_mask.any(1)  # a box for GRAIL, an answer for oar
    ws_g, ws_o, ws_m, reproduced = [], [], [], []
    for k in range(noise_seeds):
        w, draws, same_state = h.grail_oar_g(t, model, ro, k)
        ws_g.append(w)
        reproduced.append(same_state)
        ws_m.append(h.oar_g_matched(model, ro, draws))
        shifted = [s + k * NOISE_SEED_STRIDE for s in seeds]
        ws_o.append(h.oar_method("oar-g", model, tok, ro, rewards, advantages, shifted, golds, group_size))
    return {
        "seeds": list(range(noise_seeds)),
        "grail_noise_reproduced": all(reproduced),
        "seeded": mean_compare([compare(a, b, ro, answered) for a, b in zip(ws_g, ws_o)]),
        "matched_noise": mean_compare([compare(a, b, ro, answered) for a, b in zip(ws_g, ws_m)])
        if all(reproduced)
        else None,
        "noise_floor": {"grail": floor(ws_g, ro, answered), "oar": floor(ws_o, ro, answered)},
        "profile": {"grail": profile(ws_g[0], ro, answered), "oar": profile(ws_o[0], ro, answered)},
    }, ws_g


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grail", help="a checkout of declare-lab/grail, or its src/train/grail_trainer.py")
    ap.add_argument("--grail_commit", default=None, help="that file's commit (default: git's, for a checkout)")
    ap.add_argument("--trl", default=None, help="a folder holding TRL: pip install --no-deps --target DIR trl==1.16.0")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group_size", type=int, default=4)
    ap.add_argument("--ops", type=int, default=2, help="operations per arith problem")
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--noise_seeds", type=int, default=5, help="OAR-G noise draws per method (>= 2: the noise floor)")
    ap.add_argument("--sft_steps", type=int, default=300, help="steps teaching tiny-arith to box its answer")
    ap.add_argument("--sft_lr", type=float, default=1e-3)
    ap.add_argument("--sft_batch", type=int, default=16)
    ap.add_argument("--model_dir", default=None, help="keep the boxing model here, and reuse it when built alike")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here (docs/bench/grail-compare.json)")
    args = ap.parse_args(argv)
    if not args.grail:
        raise SystemExit(
            "grail_compare.py: pass --grail PATH, a checkout of declare-lab/grail or its src/train/grail_trainer.py "
            "(nothing is fetched), and --trl DIR holding TRL unless it is installed."
        )
    if args.trl:
        sys.path.insert(0, str(Path(args.trl).expanduser()))
    threads, started = torch.get_num_threads(), time.perf_counter()
    torch.set_num_threads(1)  # the same numbers on any machine's cores
    try:
        cls, file = h.load_grail(args.grail)
        commit = args.grail_commit
        if commit is None and Path(args.grail).is_dir():
            got = subprocess.run(["git", "-C", args.grail, "rev-parse", "HEAD"], capture_output=True, text=True)
            commit = got.stdout.strip() if got.returncode == 0 else None
        model, tok, built = h.boxed_model(args.sft_steps, args.sft_lr, args.sft_batch, args.seed, args.model_dir)
        bed = h.rollouts(model, tok, args.prompts, args.group_size, args.ops, args.max_new_tokens, args.seed)
        model.train()  # both trainers weigh in train mode
        t = h.harness(cls, model, tok)
        grail, g = grail_part(t, model, tok, bed, args.group_size)
        oar_g, ws_g = oar_g_part(t, model, tok, bed, args.group_size, args.noise_seeds)

        # GRAIL's own code in bfloat16 against itself in float32, at the same seeds
        ro, rewards, advantages = bed[:3]
        half = copy.deepcopy(model).to(torch.bfloat16)
        t16, span = h.harness(cls, half, tok), h.grail_span(tok, ro)
        both = span["marker"].any(1) & ro.answer_mask.any(1)
        wrong = both & reweighted_rows(advantages, h.GRAIL_RUN["grail_rollout_symmetry"])
        g16 = t16.compute_grail_weights(half, **h.grail_inputs(ro), advantages=advantages[:, None]).float()
        og16 = [h.grail_oar_g(t16, half, ro, k)[0] for k in range(args.noise_seeds)]
        bf16 = {
            "grail_spearman": compare(g16, g, ro, wrong)["spearman"]["+0"],
            "oar_g_spearman": float(np.mean([compare(a, b, ro, both)["spearman"]["+0"] for a, b in zip(og16, ws_g)])),
            "oar_g_noise_floor_float32": oar_g["noise_floor"]["grail"],
            "oar_g_noise_floor_bfloat16": floor(og16, ro, both),
        }
        ddp = h.ddp_error(t, model, ro)
    finally:
        torch.set_num_threads(threads)
    result = {
        "command": "python scripts/analysis/grail_compare.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "grail": {
            "file": str(file),
            "sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
            "lines": len(file.read_text().splitlines()),
            "commit": commit,
            "class": h.GRAIL_CLASS,
            "settings": h.GRAIL_RUN,
        },
        "versions": {
            "trl": importlib.metadata.version("trl") if "trl" in sys.modules else None,
            "torch": torch.__version__,
            "transformers": importlib.metadata.version("transformers"),
        },
        "model": built,
        "rollouts": {
            "n": len(ro),
            "prompts": args.prompts,
            "group_size": args.group_size,
            "ops": args.ops,
            "with_box": int(span["marker"].any(1).sum()),
            "with_oar_answer": int(ro.answer_mask.any(1).sum()),
            "several_boxes": sum(text.count(h.BOX) > 1 for text in ro.texts),
            "correct": int(rewards.sum()),
            "wrong_with_box": int(wrong.sum()),
            "reasoning_tokens": [int(n) for n in ro.reasoning_mask[both].sum(1)],
            "example": ro.texts[int(both.nonzero()[0])] if both.any() else None,
        },
        "grail_weights": grail,
        "oar_g": oar_g,
        "bfloat16_vs_float32": bf16,
        "oar_g_with_ddp_model": ddp,
        "seconds": round(time.perf_counter() - started, 1),
    }
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def report(r: dict) -> None:
    """The table: the agreement of each comparison, then each method's weights by region."""
    ro, gw, og, bf = r["rollouts"], r["grail_weights"], r["oar_g"], r["bfloat16_vs_float32"]
    print(
        f"GRAIL {str(r['grail']['commit'])[:12]}, TRL {r['versions']['trl']}: {ro['n']} rollouts ({ro['prompts']} x "
        f"{ro['group_size']}), {ro['with_box']} with a box, {ro['correct']} correct, {ro['wrong_with_box']} wrong "
        f"with a box"
    )
    print(
        f"GRAIL's span rebuilt exactly: {gw['span_matches_grail']}; GRAIL's own float32 vs float64: max |dw| "
        f"{gw['grail_float32_vs_float64_max_abs_diff']:.1e}"
    )
    print(f"{'oar.grail fed GRAIL choices':36s} {'|dw| to GRAIL':>14s} {'rho@0 to oar':>13s} {'|dw| to oar R':>14s}")
    for step in gw["ladder"]:
        print(
            f"{step['step']:36s} {step['max_abs_diff_to_grail']:14.2e} {step['spearman_to_oar']:13.3f} "
            f"{step['max_abs_diff_to_oar_reasoning']:14.2e}"
        )
    head = ("rows", "rho@-1", "rho@0", "rho@+1", "best", "max|dw| R", "all")
    print(f"{'comparison (Spearman over R_i)':36s} " + " ".join(f"{k:>9s}" for k in head))
    lines = [("GRAIL vs oar grail", gw["vs_oar_method"]), ("GRAIL OAR-G vs oar-g, seeded", og["seeded"])]
    if og["matched_noise"]:
        lines.append(("GRAIL OAR-G vs oar-g, GRAIL's noise", og["matched_noise"]))
    for name, c in lines:
        rho = [c["spearman"][f"{d:+d}"] for d in OFFSETS]
        print(
            f"{name:36s} {c['rows']:9d} " + " ".join(f"{x:9.3f}" for x in rho) + f" {c['best_offset']:+9d} "
            f"{c['max_abs_diff_reasoning']:9.3f} {c['max_abs_diff_completion']:9.3f}"
        )
    fl = og["noise_floor"]
    print(
        f"OAR-G noise floor (rho@0, seed k vs k + 1): GRAIL {fl['grail']:.3f}, oar {fl['oar']:.3f}; GRAIL's noise "
        f"redrawn exactly: {og['grail_noise_reproduced']}"
    )
    print(
        f"GRAIL's code, bfloat16 vs float32 (rho@0): weights {bf['grail_spearman']:.3f}, "
        f"OAR-G {bf['oar_g_spearman']:.3f} (seed k vs k + 1: float32 {bf['oar_g_noise_floor_float32']:.3f}, "
        f"bfloat16 {bf['oar_g_noise_floor_bfloat16']:.3f})"
    )
    print(f"GRAIL's OAR-G given a DDP-wrapped model: {r['oar_g_with_ddp_model'] or 'ran'}")
    print(f"{'mean weight':36s} " + " ".join(f"{k:>9s}" for k in (*REGIONS, "mass R", "mass all")))
    rows = [
        ("GRAIL, wrong rollouts", gw["profile"]["grail"]["wrong"]),
        ("oar grail, wrong rollouts", gw["profile"]["oar"]["wrong"]),
        ("GRAIL, other rollouts", gw["profile"]["grail"]["other"]),
        ("oar grail, other rollouts", gw["profile"]["oar"]["other"]),
        ("GRAIL OAR-G, seed 0", og["profile"]["grail"]),
        ("oar oar-g, seed 0", og["profile"]["oar"]),
    ]
    for name, p in rows:
        cells = [p[k] for k in (*REGIONS, "mass_reasoning", "mass_completion")]
        print(f"{name:36s} " + " ".join(f"{'-':>9s}" if v is None else f"{v:9.3f}" for v in cells))


if __name__ == "__main__":
    main()
