"""The study's pictures (matplotlib, Agg: no display needed). Plain rows in, one PNG out, its path returned.

Rows are the dicts of the report's CSVs: curves are drawn as the mean over seeds with a ±1 std band
(seeds aligned by step; a step some seed lacks is averaged over the seeds that have it).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

COLORS = {"grpo": "#555555", "oar-g": "#1f77b4", "oar-p": "#d62728", "random": "#bbbbbb", "entropy": "#2ca02c", "entropy-mask": "#98df8a",
          "tempo": "#9467bd", "oar-g+tempo": "#ff7f0e", "random-gate": "#e377c2"}


def _by_method(rows: list[dict], key: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """method -> (steps (S,), values (seeds, S)) with NaN where a seed has no value at a step."""
    out = {}
    for m in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == m]
        steps = np.array(sorted({r["step"] for r in mine}))
        seeds = sorted({r["seed"] for r in mine})
        values = np.full((len(seeds), len(steps)), np.nan)
        for r in mine:
            values[seeds.index(r["seed"]), np.searchsorted(steps, r["step"])] = r[key]
        out[m] = (steps, values)
    return out


def _band(ax, steps, values, label, color, smooth: int = 1):
    if smooth > 1:  # moving average along steps (per seed), for noisy per-step diagnostics
        kernel = np.ones(smooth) / smooth
        values = np.array([np.convolve(np.nan_to_num(v, nan=np.nanmean(v)), kernel, mode="valid") for v in values])
        steps = steps[smooth - 1:]
    mean = np.nanmean(values, axis=0)
    ax.plot(steps, mean, color=color, label=f"{label} (n={values.shape[0]})", lw=1.8)
    if values.shape[0] > 1:
        std = np.nanstd(values, axis=0, ddof=1)
        ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.18, lw=0)


def accuracy_curves(rows: list[dict], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=130)
    for m, (steps, values) in _by_method(rows, "accuracy").items():
        _band(ax, steps, 100 * values, m.upper(), COLORS.get(m))
    ax.set(xlabel="training step", ylabel="held-out accuracy (%, greedy)", title="Held-out accuracy, mean ± std over seeds")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def training_curves(rows: list[dict], path: Path) -> Path:
    panels = [("entropy", "policy entropy (nats/token)"), ("ess_ratio", "ESS ratio of OAR weights"), ("reward_mean", "train reward")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), dpi=130)
    n_steps = max(r["step"] for r in rows)
    smooth = max(1, n_steps // 20)
    for ax, (key, title) in zip(axes, panels):
        for m, (steps, values) in _by_method(rows, key).items():
            _band(ax, steps, values, m.upper(), COLORS.get(m), smooth=min(smooth, len(steps)))
        ax.set(xlabel="training step", title=title + (f" (moving avg {smooth})" if smooth > 1 else ""))
        ax.grid(alpha=0.3)
    axes[0].legend()
    return _save(fig, path)


def ablation_bars(rows: list[dict], grpo: dict | None, path: Path) -> Path:
    """Horizontal bars (mean over seeds, ±std whisker) with each seed as a dot, grouped by what varies;
    GRPO's mean ± std as a grey band for reference."""
    keys = list(dict.fromkeys((r["group"], r["label"]) for r in rows))
    fig, ax = plt.subplots(figsize=(7.5, 0.38 * len(keys) + 1.4), dpi=130)
    groups = list(dict.fromkeys(g for g, _ in keys))
    for y, (g, label) in enumerate(keys):
        acc = 100 * np.array([r["accuracy_after"] for r in rows if (r["group"], r["label"]) == (g, label)])
        color = plt.cm.tab10(groups.index(g) % 10)
        ax.barh(y, acc.mean(), color=color, alpha=0.55, xerr=acc.std(ddof=1) if len(acc) > 1 else None, capsize=3)
        ax.plot(acc, np.full(len(acc), y), "o", color="black", ms=3.5)
    if grpo:
        ax.axvline(100 * grpo["mean"], color="#555555", ls="--", lw=1, label=f"GRPO mean ± std (n={len(grpo['seeds'])})")
        if len(grpo["seeds"]) > 1:
            ax.axvspan(100 * (grpo["mean"] - grpo["std"]), 100 * (grpo["mean"] + grpo["std"]), color="#555555", alpha=0.12)
        ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(range(len(keys)), [f"{g}: {label}" for g, label in keys], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="held-out accuracy after training (%)", title="OAR-G ablations (bars: mean; dots: seeds)")
    values = 100 * np.array([r["accuracy_after"] for r in rows])
    ax.set_xlim(max(0, values.min() - 10), min(100, values.max() + 5))
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def attribution_bars(rows: list[dict], path: Path) -> Path:
    """Per source (a row of panels): precision@k and ROC-AUC per probe and scorer, then OAR-G vs OAR-P
    agreement (Spearman, top-20% overlap) per probe; whiskers are standard errors over rollouts."""
    sources = list(dict.fromkeys(r["source"] for r in rows))
    fig, axes = plt.subplots(len(sources), 3, figsize=(14, 3.4 * len(sources)), dpi=130, squeeze=False)
    for row, source in zip(axes, sources):
        mine = [r for r in rows if r["source"] == source and "precision_at_k" in r]
        agree = [r for r in rows if r["source"] == source and "spearman" in r]
        probes = list(dict.fromkeys(r["probe"] for r in mine))
        scorers = list(dict.fromkeys(r["scorer"] for r in mine))
        panels = [("precision_at_k", "precision@k", mine[0]["pivotal_frac"], mine, scorers, "scorer"),
                  ("roc_auc", "ROC-AUC", 0.5, mine, scorers, "scorer")]
        for ax, (key, title, chance, data, bars, by) in zip(row, panels):
            _grouped(ax, probes, {sc.upper(): [next(r for r in data if r["probe"] == p and r[by] == sc) for p in probes] for sc in bars},
                     key, {sc.upper(): COLORS.get(sc) for sc in bars})
            ax.axhline(chance, color="black", ls=":", lw=1, label="chance")
            ax.set(ylim=(0, 1), title=f"{title}: {source} rollouts")
        row[0].legend(fontsize=8)
        ax = row[2]
        by_probe = [next(r for r in agree if r["probe"] == p) for p in probes]
        for j, (key, label, color) in enumerate([("spearman", "Spearman", "#9467bd"), ("top20_overlap", "top-20% overlap", "#8c564b")]):
            ax.bar(np.arange(len(probes)) + (j - 0.5) * 0.4, [r[key] for r in by_probe], 0.4, yerr=[r[key + "_se"] for r in by_probe],
                   capsize=2, label=label, color=color)
        ax.axhline(0.2, color="black", ls=":", lw=1, label="overlap by chance")
        ax.set_xticks(range(len(probes)), probes)
        ax.set(ylim=(min(0, *(r["spearman"] for r in by_probe)) - 0.05, 1), title=f"OAR-G vs OAR-P agreement: {source} rollouts")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def testbed_accuracy(testbeds: dict, path: Path) -> Path:
    """Issue 14's study: held-out accuracy over training, one panel per testbed (summary.json's
    testbeds: method -> curve {step: {mean, std}}), mean ± 1 std over seeds."""
    fig, axes = plt.subplots(1, len(testbeds), figsize=(5 * len(testbeds), 3.8), dpi=120, squeeze=False)
    for ax, (tb, methods) in zip(axes[0], testbeds.items()):
        for m, v in methods.items():
            steps = [int(s) for s in v["curve"]]
            mean = np.array([c["mean"] for c in v["curve"].values()]) * 100
            std = np.nan_to_num(np.array([c["std"] for c in v["curve"].values()], dtype=float) * 100)
            ax.plot(steps, mean, color=COLORS.get(m), label=f"{m} (n={len(v['seeds'])})", lw=1.6)
            ax.fill_between(steps, mean - std, mean + std, color=COLORS.get(m), alpha=0.12, lw=0)
        ax.set(title=f"testbed {tb}", xlabel="step", ylabel="held-out accuracy (%, greedy)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def known_token_weights(attribution: dict, path: Path) -> Path:
    """Issue 14's attribution: each method's mean weight on each kind of known token, one panel per
    testbed (the fork split by what the rollout did there: stopped / went on); 1 is GRPO's."""
    kinds = ("fork_stop", "fork_go", "slip", "filler", "other")
    fig, axes = plt.subplots(1, len(attribution), figsize=(5 * len(attribution), 3.8), dpi=120, squeeze=False)
    for ax, (tb, a) in zip(axes[0], attribution.items()):
        methods = [r["method"] for r in a["table"]]
        x = np.arange(len(methods))
        vals = {kind: np.array([r.get(f"w_{kind}", np.nan) for r in a["table"]], dtype=float) for kind in kinds}
        present = [kind for kind in kinds if not np.isnan(vals[kind]).all()]  # a kind the testbed lacks gets no bar, not a 0
        width = 0.8 / len(present)
        for k, kind in enumerate(present):
            ax.bar(x + (k - (len(present) - 1) / 2) * width, vals[kind], width=width, label=kind.replace("_", " "),
                   color=f"C{kinds.index(kind)}")  # a kind keeps its colour across panels
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(x, methods, rotation=30, fontsize=8)
        ax.set(title=f"{tb}: mean weight on known tokens", ylabel="mean w")
        ax.legend(fontsize=7)
    return _save(fig, path)


def _grouped(ax, groups: list[str], bars: dict[str, list[dict]], key: str, colors: dict) -> None:
    """Bars of rows[key] ± rows[key + '_se'], one cluster per group, one bar per entry of `bars`."""
    width = 0.8 / len(bars)
    for j, (label, rows) in enumerate(bars.items()):
        ax.bar(np.arange(len(groups)) + (j - (len(bars) - 1) / 2) * width, [r[key] for r in rows], width,
               yerr=[r[key + "_se"] for r in rows], capsize=2, label=label, color=colors.get(label))
    ax.set_xticks(range(len(groups)), groups)
    ax.grid(axis="y", alpha=0.3)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
