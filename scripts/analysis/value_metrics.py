"""The metrics that compare a credit method's weights with ΔV (scripts/analysis/value_attribution.py defines
them in its docstring): per rollout `metrics`, the table's cells over rollouts clustered by problem (the
pooled ΔV² share by a jackknife over problems), and the significance counts of the sign test over all tokens."""

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


def target(v: dict) -> np.ndarray:
    """ΔV_t² - se_t², the unbiased estimate of ΔV_t² (with 0/1 rewards and a +1s, b -1s among the K paired
    differences it is ((a - b)² - (a + b)) / (K (K - 1))), rounded at 1e-12: equal (a, b) classes computed in
    float differ by 1e-18 and would be ranked apart at random."""
    dv, se = np.asarray(v["dv"], float), np.asarray(v["se"], float)
    return np.round(dv**2 - se**2, 12)


def metrics(w, v: dict, correct: bool) -> dict:
    """One rollout's numbers for weights `w` against its values `v` (delta_v.rollout_values's record) over its
    reasoning tokens: the ΔV² share's parts (share_num: the target summed over the method's top k, ties shared;
    share_base: what a method with no information puts there, k / n_R of the mass; mass: the target's sum),
    spearman (with the target) and spearman_abs (with |ΔV|), undefined where either side is constant,
    recall@k, and on a wrong rollout the sign agreement (sign_num / sign_den: the agreeing and the whole
    credit mass, for the pooled share) and the balance."""
    w, dv = np.asarray(w, float), np.asarray(v["dv"], float)
    t = target(v)
    n = len(dv)
    k = max(1, math.ceil(TOP * n))
    informative, varies = np.ptp(t) > 0, np.ptp(w) > 0
    top, best = top_membership(w, k), top_membership(t, k) if informative else None  # the method's top k, the target's
    out = {
        "share_num": float((top * t).sum()),
        "share_base": float(k / n * t.sum()),
        "mass": float(t.sum()),
        "spearman": spearman(w, t) if informative and varies else math.nan,
        "spearman_abs": spearman(w, np.abs(dv)) if np.ptp(np.abs(dv)) > 0 and varies else math.nan,
        "recall": float((top * best).sum() / k) if informative else math.nan,
        "recall_ceiling": float((best**2).sum() / k) if informative else math.nan,
        "sign_agree": math.nan,
        "sign_num": 0.0,
        "sign_den": 0.0,
        "balance": math.nan,
    }
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


def pooled_share(records: list[dict], name: str, minus_base: bool = False) -> tuple[float, float, int]:
    """(share, its standard error, problems): the method's top-k ΔV² over all ΔV² of every rollout, pooled (a
    ratio of sums, each an unbiased sum of targets: no rank of a noisy number is taken), less the share with
    no information when `minus_base`; the s.e. by a jackknife over problems (a problem's rollouts, one unit)."""
    by: dict = {}
    for r in records:
        m = r["methods"][name]
        num, base, mass = by.get(r["problem"], (0.0, 0.0, 0.0))
        by[r["problem"]] = (num + m["share_num"], base + m["share_base"], mass + m["mass"])
    parts = np.array(list(by.values())) if by else np.zeros((0, 3))
    # no share where the ΔV² mass is not positive (every target 0, or noise below 0): a ratio with it is no fraction
    share = lambda x: (x[:, 0] - minus_base * x[:, 1]).sum() / x[:, 2].sum() if x[:, 2].sum() > 0 else math.nan  # noqa: E731
    whole = share(parts)
    if len(parts) < 2 or math.isnan(whole):
        return whole, math.nan, len(parts)
    leave_one = np.array([share(np.delete(parts, p, 0)) for p in range(len(parts))])
    return (
        float(whole),
        float(math.sqrt((len(parts) - 1) / len(parts) * ((leave_one - leave_one.mean()) ** 2).sum())),
        len(parts),
    )


def table(records: list[dict], names: list[str]) -> str:
    lines = [
        "| method | ΔV² share in its top 20% (pooled) | minus no information | Spearman with ΔV² - se² "
        "| Spearman with |ΔV| | recall@k of top ΔV² - se² (k = 20% of n_R) | sign agreement, wrong rollouts (pooled) "
        "| ΔV-weighted sign balance, wrong rollouts |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    problems = [r["problem"] for r in records]
    cell = lambda xs: "{:.3f} ± {:.3f} (n = {} / {})".format(*clustered_mean_se(xs, problems))  # noqa: E731
    share = lambda name, minus: "{:.3f} ± {:.3f} ({} problems)".format(*pooled_share(records, name, minus))  # noqa: E731
    for name in names:
        m = [r["methods"][name] for r in records]
        num, den = sum(x["sign_num"] for x in m), sum(x["sign_den"] for x in m)
        pooled = f" ({num / den:.3f})" if den > 0 else ""
        lines.append(
            f"| {name} | {share(name, False)} | {share(name, True)} | {cell([x['spearman'] for x in m])} "
            f"| {cell([x['spearman_abs'] for x in m])} | {cell([x['recall'] for x in m])} "
            f"| {cell([x['sign_agree'] for x in m])}{pooled} | {cell([x['balance'] for x in m])} |"
        )
    first = [r["methods"][names[0]] for r in records]  # share_base, mass and the ceiling are the values', any method's
    mass = sum(x["mass"] for x in first)
    base = sum(x["share_base"] for x in first) / mass if mass > 0 else math.nan
    ceiling = clustered_mean_se([x["recall_ceiling"] for x in first], problems)[0]
    return "\n".join(lines) + (
        f"\n\nn = rollouts / problems where the cell is defined; ± its standard error over problems (the shares: a "
        f"jackknife over problems). No information (a constant or random method) puts {base:.3f} of the ΔV² in its "
        f"top 20% (k / n_R of each rollout's); recall@k is at most {ceiling:.3f} here (the target's own, its ties "
        f"shared), a constant method's k / n_R. Spearman is undefined where a method's weights are constant on the "
        f"rollout."
    )


def null_flag_chance(n: int) -> float:
    """P(sign test p < ALPHA) for n non-zero differences when the token does not move V (each is +1 or -1 at 1/2)."""
    return sum(math.comb(n, a) for a in range(n + 1) if sign_test(a, n - a) < ALPHA) / 2**n


def benjamini_hochberg(p_values) -> int:
    """How many of the p-values Benjamini-Hochberg rejects at q = FDR."""
    p = np.sort(np.asarray(p_values, float))
    ok = p <= FDR * np.arange(1, len(p) + 1) / max(len(p), 1)
    return int(np.nonzero(ok)[0].max() + 1) if ok.any() else 0


def significance(values: list[dict]) -> dict:
    """The tokens the sign test flags, those expected by chance if no token moved V, those surviving BH."""
    counts = [(a, b) for v in values for a, b in zip(v["plus"], v["minus"])]
    p = [sign_test(a, b) for a, b in counts]
    return {
        "tokens": len(p),
        "significant": int(sum(x < ALPHA for x in p)),
        "expected_by_chance": float(sum(null_flag_chance(a + b) for a, b in counts)),
        "bh_significant": benjamini_hochberg(p),
    }
