"""What a run shows a person: progress bars with an ETA, the step line's legend, library warnings once,
and `metrics.png` at the end.

Bars (tqdm, on stderr) are drawn on the main process only, and only when stderr is a terminal; tests and
`> log 2>&1` runs see none.
The libraries' own bars (transformers' "Loading weights", "Writing model shards") follow the same
rule. A library log message that repeats (accelerate's "Removed shared tensor" at every save) is
shown once per run.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

# The step line (RunLog.step), explained once at the start of a run's log and in docs/flags.md.
LEGEND = (
    "step line: reward = mean reward of the step's rollouts | len = mean completion tokens | "
    "H = policy entropy per token (nats) | clip = share of tokens whose ratio was clipped | "
    "ess = effective sample size of OAR's weights, (sum w)^2 / (n sum w^2), 1 = all equal | "
    "|g| = gradient norm before clipping | s = seconds for the step | held-out = evaluation accuracy"
)


class _Null:
    """A bar that draws nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def bars_wanted(main: bool) -> bool:
    """Draw bars: on the main process, when stderr is a terminal."""
    return main and sys.stderr.isatty()


def bar(total: int, desc: str, enabled: bool, **kw):
    """A tqdm bar with an ETA over `total` units, or one that draws nothing. Use as a context manager."""
    if not enabled:
        return _Null()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, **kw)


class _Once(logging.Filter):
    """Lets each distinct message of a logger through once."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


_ONCE = _Once()
LIBRARIES = ("transformers", "accelerate", "peft", "torch", "datasets", "huggingface_hub")


def quiet_libraries(bars: bool) -> None:
    """Each library log message once per process; the libraries' progress bars only where ours are drawn."""
    names = [n for n in logging.root.manager.loggerDict if n.split(".")[0] in LIBRARIES] + list(LIBRARIES)
    for name in names:
        logger = logging.getLogger(name)
        if _ONCE not in logger.filters:
            logger.addFilter(_ONCE)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.enable_progress_bar() if bars else hf_logging.disable_progress_bar()
    except ImportError:
        pass


# -- metrics.png ---------------------------------------------------------------------------------

PANELS = (  # (title, [(metric, label)]): what a reader checks first
    ("reward", [("reward/mean", "mean reward")]),
    ("held-out accuracy", [("eval/accuracy", "accuracy")]),
    ("policy entropy (nats / token)", [("policy/entropy", "H")]),
    ("OAR gate", [("oar/frac_boosted", "boosted"), ("oar/frac_suppressed", "suppressed")]),
)


def plot_metrics(run_dir: str | Path, before: float | None = None, after: float | None = None) -> Path:
    """`run_dir/metrics.png` from its metrics.jsonl: reward, held-out accuracy (with the evaluations
    before and after training, at steps 0 and the last, when given), entropy and the share of tokens
    the gate boosted and suppressed, against the step. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2), constrained_layout=True)
    for ax, (title, series) in zip(axes, PANELS):
        for key, label in series:
            points = [(r["step"], r[key]) for r in rows if key in r]
            if key == "eval/accuracy":
                last = rows[-1]["step"] if rows else 0
                points = (
                    ([(0, before)] if before is not None else [])
                    + points
                    + ([(last, after)] if after is not None else [])
                )
            if points:
                ax.plot(*zip(*points), marker="o" if len(points) < 20 else None, label=label)
        if len(series) > 1:
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(run_dir.name, fontsize=10)
    out = run_dir / "metrics.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
