"""The metrics that compare a credit method's weights with ΔV (scripts/analysis/value_attribution.py defines
them in its docstring): per rollout `metrics`, the table's cells over rollouts clustered by problem, and
the significance counts of the sign test over all tokens."""

from __future__ import annotations

import math

import numpy as np

from scripts.analysis.attribution import spearman
from scripts.analysis.delta_v import sign_test

TOP = 0.2  # recall@k: k = ceil(TOP * n_R)
ALPHA = 0.05  # a token's ΔV is significant when its sign test gives p < ALPHA
FDR = 0.1  # Benjamini-Hochberg's q for the count of tokens that survive a correction for testing them all


def top_membership(x, k: int) -> np.ndarray:
    """P(token is among the k largest of x) under random tie-breaking: 1 above the cut, a share at it."""
    x = np.asarray(x, float)
    cut = np.sort(x)[::-1][k - 1]
    above, tied = x > cut, x == cut
    return above + tied * (k - above.sum()) / tied.sum()


def metrics(w, v: dict, correct: bool) -> dict:
    """spearman, recall@k and (on a wrong rollout) sign agreement of weights `w` with one rollout's values `v`
    (delta_v.rollout_values's record) over its reasoning tokens; sign_num / sign_den: the agreeing and the
    whole credit mass, for the pooled share."""
    w, dv, se = (np.asarray(x, float) for x in (w, v["dv"], v["se"]))
    target = dv ** 2 - se ** 2
    n = len(dv)
    k = max(1, math.ceil(TOP * n))
    informative = np.ptp(target) > 0
    out = {"spearman": spearman(w, target) if informative else math.nan,
           "recall": float((top_membership(w, k) * top_membership(target, k)).sum() / k) if informative else math.nan,
           "sign_agree": math.nan, "sign_num": 0.0, "sign_den": 0.0, "balance": math.nan}
    if not correct and np.abs(w * dv).sum() > 0:
        out["balance"] = float((-w * dv).sum() / np.abs(w * dv).sum())
    sig = np.array([sign_test(a, b) < ALPHA for a, b in zip(v["plus"], v["minus"])], dtype=bool)
    if not correct and sig.any():
        agree = np.abs(w[sig]) * (np.sign(-w[sig]) == np.sign(dv[sig]))
        out |= {"sign_num": float(agree.sum()), "sign_den": float(np.abs(w[sig]).sum())}
        if out["sign_den"] > 0:
            out["sign_agree"] = out["sign_num"] / out["sign_den"]
    return out


def clustered_mean_se(values, clusters) -> tuple[float, float, int, int]:
    """(mean of the clusters' means, its standard error, values, clusters) over the defined values: the values
    of one cluster (a problem's rollouts) are one unit, each problem weighs the same."""
    by = {}
    for x, c in zip(values, clusters):
        if not math.isnan(x):
            by.setdefault(c, []).append(x)
    means = np.array([np.mean(v) for v in by.values()])
    n = sum(len(v) for v in by.values())
    if not n:
        return math.nan, math.nan, 0, 0
    mean = float(means.mean())
    se = float(means.std(ddof=1) / math.sqrt(len(means))) if len(means) > 1 else math.nan
    return mean, se, n, len(means)


def table(records: list[dict], names: list[str]) -> str:
    lines = ["| method | Spearman with ΔV² | minus control: random's, paired | recall@k of top ΔV² (k = 20% of n_R) "
             "| sign agreement, wrong rollouts (pooled) | ΔV-weighted sign balance, wrong rollouts |", "| --- | --- | --- | --- | --- | --- |"]
    problems = [r["problem"] for r in records]
    cell = lambda xs: "{:.3f} ± {:.3f} (n = {} / {})".format(*clustered_mean_se(xs, problems))
    for name in names:
        m = [r["methods"][name] for r in records]
        versus_random = [x["spearman"] - r["methods"]["control: random"]["spearman"] for x, r in zip(m, records)]
        num, den = sum(x["sign_num"] for x in m), sum(x["sign_den"] for x in m)
        pooled = f" ({num / den:.3f})" if den > 0 else ""
        lines.append(f"| {name} | {cell([x['spearman'] for x in m])} | {cell(versus_random)} | {cell([x['recall'] for x in m])} "
                     f"| {cell([x['sign_agree'] for x in m])}{pooled} | {cell([x['balance'] for x in m])} |")
    return "\n".join(lines) + "\n\nn = rollouts / problems where the cell is defined; ± its standard error over problems."


def null_flag_chance(n: int) -> float:
    """P(sign test p < ALPHA) for n non-zero differences when the token does not move V (each is +1 or -1 at 1/2)."""
    return sum(math.comb(n, a) for a in range(n + 1) if sign_test(a, n - a) < ALPHA) / 2 ** n


def benjamini_hochberg(p_values) -> int:
    """How many of the p-values Benjamini-Hochberg rejects at q = FDR."""
    p = np.sort(np.asarray(p_values, float))
    ok = p <= FDR * np.arange(1, len(p) + 1) / max(len(p), 1)
    return int(np.nonzero(ok)[0].max() + 1) if ok.any() else 0


def significance(values: list[dict]) -> dict:
    """The tokens the sign test flags, those expected by chance if no token moved V, those surviving BH."""
    counts = [(a, b) for v in values for a, b in zip(v["plus"], v["minus"])]
    p = [sign_test(a, b) for a, b in counts]
    return {"tokens": len(p), "significant": int(sum(x < ALPHA for x in p)),
            "expected_by_chance": float(sum(null_flag_chance(a + b) for a, b in counts)), "bh_significant": benjamini_hochberg(p)}
