"""The v5 study's pictures (matplotlib, Agg: no display needed): summary.json's parts in, one PNG out,
its path returned. (The first evidence study's plots went with its retired report; its figures stay
in research/arith_v4/.)
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

COLORS = {
    "grpo": "#555555",
    "oar-g": "#1f77b4",
    "oar-p": "#d62728",
    "random": "#bbbbbb",
    "entropy": "#2ca02c",
    "entropy-mask": "#98df8a",
    "tempo": "#9467bd",
    "oar-g+tempo": "#ff7f0e",
    "random-gate": "#e377c2",
}


def testbed_accuracy(testbeds: dict, path: Path) -> Path:
    """The v5 study: held-out accuracy over training, one panel per testbed (summary.json's
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
    """The v5 study's attribution: each method's mean weight on each kind of known token, one panel per
    testbed (the fork split by what the rollout did there: stopped / went on); 1 is GRPO's."""
    kinds = ("fork_stop", "fork_go", "slip", "filler", "other")
    fig, axes = plt.subplots(1, len(attribution), figsize=(5 * len(attribution), 3.8), dpi=120, squeeze=False)
    for ax, (tb, a) in zip(axes[0], attribution.items()):
        methods = [r["method"] for r in a["table"]]
        x = np.arange(len(methods))
        vals = {kind: np.array([r.get(f"w_{kind}", np.nan) for r in a["table"]], dtype=float) for kind in kinds}
        present = [
            kind for kind in kinds if not np.isnan(vals[kind]).all()
        ]  # a kind the testbed lacks gets no bar, not a 0
        width = 0.8 / len(present)
        for k, kind in enumerate(present):
            ax.bar(
                x + (k - (len(present) - 1) / 2) * width,
                vals[kind],
                width=width,
                label=kind.replace("_", " "),
                color=f"C{kinds.index(kind)}",
            )  # a kind keeps its colour across panels
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(x, methods, rotation=30, fontsize=8)
        ax.set(title=f"{tb}: mean weight on known tokens", ylabel="mean w")
        ax.legend(fontsize=7)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
