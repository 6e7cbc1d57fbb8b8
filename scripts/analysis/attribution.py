"""Attribution quality where the truth is known: do OAR-P and OAR-G scores find the tokens that decide
an arith answer, and does OAR-G agree with OAR-P? (the paper's "causal-token recall"; results:
research/arith_v4/).

Legend: B rollouts, L positions (prompt + completion, the sampler's layout), n reasoning tokens of one rollout.

Ground truth. In an arith solution

    37 + 48 = 85
    85 - 15 = 70
    #### 70

the pivotal tokens are the digits of each computed result (the number right after ` = ` on a line,
a leading `-` included) and of the final answer. The operands are not pivotal, including a result
copied to the start of the next line (`85` on line 2): it only repeats a decision already made.
Labels are computed on the rollout's OWN text (a wrong result is still the token that decided that
rollout's answer), as character spans mapped to tokens with the sampler's offsets, so any
tokenizer works (a token is pivotal when it overlaps a pivotal span). OAR scores exist on reasoning
tokens only (the answer span is where the probe is read), so every metric below is over the
reasoning tokens of a rollout: the final answer's digits are labelled but never ranked.

Metrics, per rollout, then averaged over the rollouts that have both pivotal and other reasoning tokens:
  precision@k   k = number of pivotal reasoning tokens; share of the k best-scored tokens that are
                pivotal. Ties at the k-th score are shared out in expectation (random tie-breaking),
                so a constant score gets the base rate, not an artefact of position order.
  ROC-AUC       probability that a pivotal token outscores a non-pivotal one, ties 1/2 (Mann-Whitney
                U over average ranks).
  Spearman      Pearson correlation of the average ranks of two scores (0 when either is constant).
  top-20%       |top_m(a) & top_m(b)| / m with m = ceil(0.2 n), ties broken by position.
The random baseline draws uniform scores from a seeded generator (expected precision@k = the
pivotal fraction, AUC = 0.5). The study uses arith TRAIN-split problems here: nothing held out is
touched, and nothing is tuned on these numbers either.
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch

from oar.tasks.arith import ArithConfig, arith_problems, arith_solution
from oar.oar_grad import gradient_scores
from oar.oar_perturb import perturbation_scores
from oar.probes import PROBES
from oar.answers import find_answer
from oar.rewards import reward
from oar.sampler import encode_prompts, format_prompt, sample, stop_token_ids
from oar.rollout import build_rollout, char_offsets

SCORERS = ("oar-p", "oar-g", "random")
_RESULT = re.compile(r"= (-?\d+)")  # the number a line computes: right after " = "


# ------------------------------------------------------------------------------------ ground truth


def pivotal_char_spans(text: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of the computed results in the reasoning and of the final answer."""
    span = find_answer(text)
    reasoning = text if span is None else text[: span.marker_start]
    spans = [m.span(1) for m in _RESULT.finditer(reasoning)]
    return spans + ([] if span is None else [(span.start, span.end)])


def token_labels(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Whether each token (its character span; special tokens have empty ones) overlaps a pivotal span."""
    return [e > s and any(s < b and e > a for a, b in spans) for s, e in offsets]


def pivotal_mask(tokenizer, input_ids: torch.Tensor, completion_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """Pivotal tokens (B, L) bool of rollouts in the sampler's layout, labelled on each completion's text."""
    out = torch.zeros(completion_mask.shape, dtype=torch.bool)
    for i in range(input_ids.shape[0]):
        cols = completion_mask[i].nonzero().flatten().tolist()  # completion positions, EOS included
        text, offsets = char_offsets(tokenizer, input_ids[i, cols].tolist())
        for col, pivotal in zip(cols, token_labels(offsets, pivotal_char_spans(text))):
            out[i, col] = pivotal
    assert not out[:, :prompt_width].any()
    return out


# ------------------------------------------------------------------------------------------ metrics


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n of `x`, ties given the mean of the ranks they span."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    ranks = np.empty(len(x))
    start = 0
    for end in range(1, len(x) + 1):
        if end == len(x) or sorted_x[end] != sorted_x[start]:
            ranks[order[start:end]] = (start + 1 + end) / 2  # mean of ranks start+1 .. end
            start = end
    return ranks


def precision_at_k(scores, labels) -> float:
    """Share of the k = sum(labels) best-scored tokens that are pivotal; ties at the cut in expectation.
    NaN when k is 0 or every token is pivotal (nothing to find)."""
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    k = int(y.sum())
    if k == 0 or k == len(y):
        return math.nan
    cut = np.sort(s)[::-1][k - 1]
    above, tied = s > cut, s == cut
    hits = y[above].sum() + (k - above.sum()) * y[tied].mean()  # the tied slots go to a random tied token
    return float(hits / k)


def roc_auc(scores, labels) -> float:
    """P(score of a pivotal token > that of a non-pivotal one), ties 1/2. NaN without both classes."""
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    u = average_ranks(s)[y].sum() - n_pos * (n_pos + 1) / 2  # Mann-Whitney U of the positives
    return float(u / (n_pos * n_neg))


def spearman(a, b) -> float:
    """Spearman rank correlation; 0 when either input is constant, NaN below 2 tokens."""
    if len(a) < 2:
        return math.nan
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = math.sqrt(float((ra**2).sum() * (rb**2).sum()))
    return float((ra * rb).sum() / denom) if denom > 0 else 0.0


def top_overlap(a, b, frac: float = 0.2) -> float:
    """|top_m(a) & top_m(b)| / m, m = ceil(frac * n); ties broken by position (stable sort)."""
    n = len(a)
    if n == 0:
        return math.nan
    m = max(1, math.ceil(frac * n))
    top = lambda x: set(np.argsort(-np.asarray(x, dtype=np.float64), kind="stable")[:m].tolist())
    return len(top(a) & top(b)) / m


# --------------------------------------------------------------------------------- rollouts, scores


def make_rollouts(
    model, tokenizer, problems, *, source: str, seed: int, max_new_tokens: int, temperature: float = 1.0
):
    """Rollouts of `problems` in the sampler's layout: sampled by the model ('sample', one per problem,
    seeded) or the gold worked solutions teacher-forced ('gold')."""
    prompts = [format_prompt(tokenizer, p.problem) for p in problems]
    if source == "sample":
        seeds = [seed * 1_000_003 + i for i in range(len(problems))]
        return sample(
            model,
            tokenizer,
            prompts,
            group_size=1,
            seeds=seeds,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
        )
    assert source == "gold", source
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, device)
    solutions = [
        tokenizer(arith_solution(p), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for p in problems
    ]
    completion = torch.full((len(problems), max(map(len, solutions))), tokenizer.pad_token_id, dtype=torch.long)
    for i, ids in enumerate(solutions):
        completion[i, : len(ids)] = torch.tensor(ids)
    return build_rollout(tokenizer, prompt_ids, prompt_mask, completion.to(device), stop_token_ids(model, tokenizer))


def scores_of(
    scorer: str, model, tokenizer, ro, probe: str, *, seed: int, noise_std: float = 1e-3, batch: int = 64
) -> torch.Tensor:
    """Importance scores (B, L) of one scorer, `batch` rollouts at a time (bounds OAR-G's backward)."""
    if scorer == "random":
        return torch.rand(ro.input_ids.shape, generator=torch.Generator().manual_seed(seed)) * ro.reasoning_mask
    out = []
    for start in range(0, len(ro), batch):
        mb = ro.select(slice(start, start + batch))
        args = (model, mb.input_ids, mb.attention_mask, mb.reasoning_mask, mb.answer_mask)
        if scorer == "oar-p":
            out.append(perturbation_scores(*args, probe=probe, pad_token_id=tokenizer.pad_token_id))
        else:
            g = torch.Generator().manual_seed(seed + start)
            out.append(gradient_scores(*args, probe=probe, noise_std=noise_std, generator=g))
    return torch.cat(out).cpu()


def attribution_table(model, tokenizer, ro, *, probes=PROBES, seed: int = 0) -> list[dict]:
    """One row per (probe, scorer) with mean precision@k and ROC-AUC (and their standard errors), and
    per probe the OAR-G vs OAR-P agreement row (Spearman, top-20% overlap)."""
    pivotal = pivotal_mask(tokenizer, ro.input_ids.cpu(), ro.completion_mask.cpu(), ro.prompt_width)
    reasoning = ro.reasoning_mask.cpu()
    rows_used = [i for i in range(len(ro)) if 0 < int((pivotal[i] & reasoning[i]).sum()) < int(reasoning[i].sum())]
    base = (
        float(np.mean([(pivotal[i] & reasoning[i]).sum() / reasoning[i].sum() for i in rows_used]))
        if rows_used
        else math.nan
    )
    table = []
    for probe in probes:
        per = {name: scores_of(name, model, tokenizer, ro, probe, seed=seed) for name in SCORERS}
        for name, s in per.items():
            prec = [precision_at_k(s[i][reasoning[i]].numpy(), pivotal[i][reasoning[i]].numpy()) for i in rows_used]
            auc = [roc_auc(s[i][reasoning[i]].numpy(), pivotal[i][reasoning[i]].numpy()) for i in rows_used]
            table.append(
                {
                    "probe": probe,
                    "scorer": name,
                    "rollouts": len(rows_used),
                    "pivotal_frac": base,
                    **_mean_se("precision_at_k", prec),
                    **_mean_se("roc_auc", auc),
                }
            )
        pairs = [(per["oar-g"][i][reasoning[i]].numpy(), per["oar-p"][i][reasoning[i]].numpy()) for i in rows_used]
        table.append(
            {
                "probe": probe,
                "scorer": "oar-g vs oar-p",
                "rollouts": len(rows_used),
                **_mean_se("spearman", [spearman(g, p) for g, p in pairs]),
                **_mean_se("top20_overlap", [top_overlap(g, p) for g, p in pairs]),
            }
        )
    return table


def _mean_se(name: str, values) -> dict:
    v = np.array([x for x in values if not math.isnan(x)], dtype=np.float64)
    se = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan
    return {name: float(v.mean()) if len(v) else math.nan, f"{name}_se": se}


@torch.no_grad()
def run(model, tokenizer, *, n: int, seed: int, max_new_tokens: int, arith: ArithConfig | None = None) -> dict:
    """The whole attribution study on `n` arith train problems: sampled rollouts and gold solutions."""
    kwargs = {"config": arith} if arith is not None else {}
    problems = arith_problems(n, split="train", seed=10_000 + seed, **kwargs)  # not the training draw (seed 0..)
    model.eval()
    result = {"problems": n, "split": "train", "seed": seed, "sources": {}}
    for source in ("sample", "gold"):
        ro = make_rollouts(model, tokenizer, problems, source=source, seed=seed, max_new_tokens=max_new_tokens)
        with torch.enable_grad():  # OAR-G needs autograd for its input gradient
            table = attribution_table(model, tokenizer, ro, seed=seed)
        correct = float(np.mean([reward(t, p.answer) for t, p in zip(ro.texts, problems)]))
        result["sources"][source] = {
            "rollouts": len(ro),
            "accuracy": correct,
            "with_answer": float(ro.answer_mask.any(1).float().mean()),
            "table": table,
        }
    return result
