"""Where each credit method puts the advantage, on a testbed whose pivotal tokens are known.

Legend: B rollouts (P prompts x G), L positions.

The starting model of a testbed samples G rollouts for each of P train-split problems (3 operations:
the fork sits on the third line), exactly as train.py's step 1-3 would (seeded sampler, rewards,
group advantages). Every method of oar/credit.py then weighs the SAME rollouts through the same
code path train.py uses (credit.step_credit; the update forward's logits for the entropy methods).
Rollouts with advantage 0 carry no update and are left out. Metrics are over each rollout's scope,
its reasoning tokens plus its fork token (a rollout that answers one line early forks on the first
`#` of its `####` marker, which is not reasoning: OAR's gate leaves it at 1 by maths §5), then
averaged over rollouts; the standard errors are clustered by prompt (a group's rollouts share a
prompt and are often the same text, so they are not independent draws):

  pivotal        the digits of each computed result (scripts/analysis/attribution.py), the fork and the slips
  planted        the fork and the slips only: the tokens the testbed's teacher decided
  precision@k, ROC-AUC   of |w| (the share of |A_i| the token gets) against the pivotal tokens
                 (ties shared, scripts/analysis/attribution.py); all-ones GRPO gets the base rate and 0.5
  roc_auc_planted        the same against the planted tokens, on rollouts that have one
  w_fork, w_slip, w_filler, w_other   the mean weight (signed) on the fork tokens, the slip tokens,
                 the filler tokens and the remaining reasoning tokens (oar/tasks/teacher.py finds them on
                 each rollout's own text); w_fork_stop / w_fork_go split the fork by what the
                 rollout did there (answered early: `#`; went on: a digit)

Nothing is trained and nothing held out is touched.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from oar.tasks.arith import ArithConfig, arith_problems
from oar.credit import METHODS, step_credit
from oar.grpo import group_advantages
from oar.lm import forward_logits
from oar.rewards import reward
from oar.sampler import format_prompt, sample
from oar.rollout import char_offsets
from oar.tasks.teacher import filler_spans, fork_spans, slip_spans
from scripts.analysis.attribution import pivotal_char_spans, precision_at_k, roc_auc, token_labels

KINDS = ("pivotal", "fork", "slip", "filler")
METRICS = (
    "precision_at_k",
    "roc_auc",
    "roc_auc_planted",
    "w_fork",
    "w_fork_stop",
    "w_fork_go",
    "w_slip",
    "w_filler",
    "w_other",
    "frac_negative",
)


def clustered_mean(values: list[float], clusters: list[int], key: str) -> dict:
    """Mean of the non-NaN `values`, its standard error clustered by `clusters` (the usual sandwich
    estimator of a mean, with the G/(G-1) small-sample factor), and n; {} when nothing is left."""
    v, c = np.array(values, dtype=np.float64), np.array(clusters)
    keep = ~np.isnan(v)
    v, c = v[keep], c[keep]
    if not len(v):
        return {f"{key}_n": 0}
    out = {key: float(v.mean()), f"{key}_n": len(v)}
    groups = np.unique(c)
    if len(groups) > 1:
        sums = np.array([(v[c == g] - v.mean()).sum() for g in groups])
        out[f"{key}_se"] = float(math.sqrt((sums**2).sum() * len(groups) / (len(groups) - 1)) / len(v))
    return out


def labels(tokenizer, ro, testbed) -> dict[str, torch.Tensor]:
    """Known tokens (B, L) bool of each kind, found on each completion's own text."""
    out = {k: torch.zeros(ro.completion_mask.shape, dtype=torch.bool) for k in KINDS}
    for i in range(len(ro)):
        cols = ro.completion_mask[i].nonzero().flatten().tolist()
        text, offsets = char_offsets(tokenizer, ro.input_ids[i, cols].tolist())
        spans = {
            "fork": fork_spans(text, testbed.fork_line) if testbed.fork_line is not None else [],
            "slip": slip_spans(text),
            "filler": filler_spans(text, testbed.recipe.filler),
        }
        spans["pivotal"] = pivotal_char_spans(text) + spans["fork"] + spans["slip"]
        for kind, sp in spans.items():
            for col, hit in zip(cols, token_labels(offsets, sp)):
                out[kind][i, col] = hit
    return out


def method_weights(
    method: str,
    model,
    tokenizer,
    ro,
    rewards,
    advantages,
    seeds,
    golds,
    *,
    group_size: int,
    micro_batch_size: int = 64,
) -> torch.Tensor:
    """Weights (B, L) of `method` on these rollouts, through train.py's interface (defaults of Config)."""
    from oar.training.config import Config

    cfg = Config(method=method, group_size=group_size, micro_batch_size=micro_batch_size)
    settings = cfg.credit()
    scored = (advantages != 0) & ro.completion_mask.any(1)
    weigh = step_credit(settings, model, tokenizer, ro, rewards, advantages, scored, seeds, golds, cfg.probe)
    out = []
    for start in range(0, len(ro), micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        mb = ro.select(rows)
        with torch.no_grad():
            logits = forward_logits(
                model, mb.input_ids, mb.attention_mask, logits_to_keep=mb.input_ids.shape[1] - ro.prompt_width + 1
            )
        out.append(weigh(rows, mb, logits)[0].cpu())
    return torch.cat(out)


def run(
    model,
    tokenizer,
    testbed,
    *,
    prompts: int = 48,
    group_size: int = 8,
    seed: int = 0,
    methods=METHODS,
    arith: ArithConfig = ArithConfig(min_ops=3, max_ops=3),
) -> dict:
    """The attribution table of one testbed's starting model: one row per method."""
    problems = arith_problems(prompts, split="train", seed=20_000 + seed, config=arith)
    seeds = [seed * 1_000_003 + i for i in range(prompts * group_size)]
    model.eval()
    ro = sample(
        model,
        tokenizer,
        [format_prompt(tokenizer, p.problem) for p in problems],
        group_size=group_size,
        seeds=seeds,
        max_new_tokens=testbed.max_new_tokens,
    )
    golds = [p.answer for p in problems for _ in range(group_size)]
    rewards = torch.tensor([reward(t, g) for t, g in zip(ro.texts, golds)])
    advantages = group_advantages(rewards, group_size)
    known = labels(tokenizer, ro, testbed)
    reasoning = ro.reasoning_mask.cpu()
    used = [i for i in range(len(ro)) if advantages[i] != 0 and reasoning[i].any()]
    rows = []
    for method in methods:
        w = method_weights(method, model, tokenizer, ro, rewards, advantages, seeds, golds, group_size=group_size)
        per = {k: [] for k in METRICS}
        for i in used:
            scope = reasoning[i] | known["fork"][i]
            score = w[i][scope].abs().numpy()
            per["precision_at_k"].append(precision_at_k(score, known["pivotal"][i][scope].numpy()))
            per["roc_auc"].append(roc_auc(score, known["pivotal"][i][scope].numpy()))
            per["roc_auc_planted"].append(roc_auc(score, (known["fork"][i] | known["slip"][i])[scope].numpy()))
            other = reasoning[i] & ~known["pivotal"][i] & ~known["filler"][i]
            for kind, mask in [
                ("fork", known["fork"][i]),
                ("fork_stop", known["fork"][i] & ~reasoning[i]),
                ("fork_go", known["fork"][i] & reasoning[i]),
                ("slip", known["slip"][i] & scope),
                ("filler", known["filler"][i] & scope),
                ("other", other),
            ]:
                per[f"w_{kind}"].append(float(w[i][mask].mean()) if mask.any() else math.nan)
            per["frac_negative"].append(float((w[i][scope] < 0).float().mean()))
        row = {"method": method, "rollouts": len(used)}
        for key, values in per.items():
            row |= {key: math.nan, f"{key}_se": math.nan} | clustered_mean(
                values, [i // group_size for i in used], key
            )
        rows.append(row)
    return {
        "testbed": testbed.name,
        "prompts": prompts,
        "group_size": group_size,
        "seed": seed,
        "sample_accuracy": float(rewards.mean()),
        "pivotal_frac": float(np.mean([known["pivotal"][i][reasoning[i]].float().mean() for i in used]))
        if used
        else math.nan,
        "rollouts_with_fork": int(known["fork"].any(1).sum()),
        "rollouts_with_slip": int(known["slip"].any(1).sum()),
        "table": rows,
    }
