"""The paired t-test of a study's seeds, without scipy: Student's t tail and quantile, and a list of paired
differences' mean, standard error, t, two-sided p and interval.

Used by research/signal-or-gate/report.py (its tests: tests/studies/test_signal_or_gate_report.py, against closed
forms and tables). The tail is the regularized incomplete beta function's continued fraction (Numerical
Recipes' betacf); the quantile inverts it by bisection.
"""

from __future__ import annotations

import math


def t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom: I_x(df/2, 1/2) / 2 at x = df / (df + t^2)."""
    if t < 0:
        return 1.0 - t_sf(-t, df)
    return betainc(df / 2, 0.5, df / (df + t * t)) / 2


def t_quantile(q: float, df: int) -> float:
    """The t with P(T > t) = q (0 < q < 1/2), by bisection on t_sf: the half-width of a two-sided 1 - 2q
    interval in standard errors (2.776 at q = 0.025, df = 4)."""
    lo, hi = 0.0, 1.0
    while t_sf(hi, df) > q:
        lo, hi = hi, 2 * hi
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_sf(mid, df) > q else (lo, mid)
    return (lo + hi) / 2


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b): the continued fraction (Numerical Recipes'
    betacf) where it converges fast, x < (a + 1) / (a + b + 2), else through I_x(a, b) = 1 - I_{1-x}(b, a)."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x >= (a + 1) / (a + b + 2):
        return 1.0 - front * _betacf(b, a, 1.0 - x) / b
    return front * _betacf(a, b, x) / a


def _betacf(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 300):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return f


def paired(diffs: list[float], test_from: int = 3, alpha: float = 0.05, same_within: float = 1e-4) -> dict:
    """Mean, standard error (ddof 1), t, two-sided p and the 1 - `alpha` interval (`ci`, mean ± t_{df} s.e.) of
    paired differences; no s.e. where n < 2, and no t, p or interval where n < `test_from` (a study that
    tests nothing on fewer than three seeds) or every difference is the same, within `same_within` (in the
    differences' unit)."""
    n = len(diffs)
    mean = sum(diffs) / n if n else math.nan
    if n < 2:
        return {"n": n, "mean": mean, "se": None, "t": None, "p": None}
    # Every seed the same difference: no t (the verdict says so). Equal up to float rounding counts, or an s.e.
    # of rounding makes t huge and p 0: a training reward logged in float32 moves an equal gap of 1/768 by
    # ~2e-7 points (s.e. 6e-8, t = 2e6), held-out multiples of 1/400 by ~1e-15. The default 1e-4 points is far
    # below the smallest real spread between two seeds' gaps (1/768 of a reward: 0.13 points).
    if max(diffs) - min(diffs) <= same_within:
        return {"n": n, "mean": mean, "se": 0.0, "t": None, "p": None, "zero_spread": True}
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n)
    if n < test_from:
        return {"n": n, "mean": mean, "se": se, "t": None, "p": None}
    t, half = mean / se, t_quantile(alpha / 2, n - 1) * se
    return {"n": n, "mean": mean, "se": se, "t": t, "p": 2 * t_sf(abs(t), n - 1), "ci": [mean - half, mean + half]}
