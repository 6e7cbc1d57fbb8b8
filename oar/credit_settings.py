"""The settings a token-credit method reads, declared once: `oar.training.config.Config` extends this
class, so each of these is a command-line flag of train.py with this default and this docstring as
its help, and a run's `CreditSettings` is derived from its Config (`Config.credit()`), never copied.

This module imports nothing (no torch): train.py's `--help` and its flag errors answer from it and
from oar/training/config.py before torch loads.

Knobs that no run turned (only tuning studies did) are constants here, not flags (each was a flag
before; a checkpoint that ran with another value is refused on resume: oar/training/config.py's
REMOVED, oar/training/resume.py). They stay readable as class attributes, so `step.settings.gate_floor`
reads as it did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

GATE_FLOOR = 0.1  # a suppressed token's smallest weight before the mass rescale (maths §5; 1.0: boost only)
PRESERVE_MASS = True  # the gate rescales a rollout's reasoning weights to sum to its length (maths §5 step 5)
# entropy-mask's lambda (maths §8.1): the share of the step's tokens, the highest-entropy ones, carrying the advantage
ENTROPY_TOP = 0.2
PERTURB_SPAN = 1  # OAR-P: tokens masked together (1 = the definition, exact)
PERTURB_WINDOW = 32  # OAR-P window mode: positions recomputed after the masked token (plus the answer's)
# OAR-P auto mode: reasoning-to-answer positions from which the window is used (docs/long-reasoning.md)
PERTURB_AUTO_LENGTH = 512
# OAR-P: (cached + recomputed) positions per forward of masked copies, a memory bound, not a number changer;
# None: chosen from the device (oar.lm.positions_that_fit: 8,192 on a CPU, from the free memory on a GPU)
PERTURB_CHUNK_TOKENS = None


@dataclass(frozen=True)
class CreditSettings:
    """What token credit reads of a run (oar/credit.py): the method and its gate, OAR's scorers, and
    the few sampling and loss settings a method needs to recompute what the step saw."""

    TITLE: ClassVar[str] = "token credit (OAR and others)"  # its group in train.py --help

    method: str = "oar-g"
    """Token credit: grpo | oar-g | oar-p | entropy | entropy-mask | tempo | oar-g+tempo | random-gate | grail
    (oar-g+tempo and random-gate beyond the paper, grail a comparator; oar/credit.py), or a method of
    --credit_module."""
    credit_module: str = ""
    """A module (a .py file, or a dotted name on the Python path) whose CREDIT_METHODS list adds methods
    to --method's choices (docs/credit-methods.md)."""
    gate_quantile: float = 0.4
    """q of the bi-level gate: scores below the q-quantile are suppressed (authors' code: 0.25)."""
    gate_boost: float = 2.0
    """kappa of the bi-level gate: boost of scores above the quantile (authors' code: 1.0; maths §5)."""
    probe: str = "answer_mean"
    """Outcome probe: last | answer_mean | answer_joint (maths §2)."""
    noise_std: float = 1e-3
    """OAR-G: std of the Gaussian noise added to the reasoning positions' embeddings."""
    perturb_mode: str = "auto"
    """OAR-P: exact | window | auto (exact where a rollout's reasoning-to-answer stretch is shorter than
    512 positions, window above; docs/long-reasoning.md)."""
    score_all: bool = False
    """Also score rollouts with advantage 0 (their group's rewards are all equal): their loss is 0
    whatever the weights, so this only adds oar/ diagnostics (and time)."""

    # Read by the methods, shown in --help with the sampling, GRPO and memory settings
    temperature: float = 1.0
    """Sampling temperature of rollouts; the loss and entropy credit score logits / temperature."""
    micro_batch_size: int = 64
    """Rollouts per forward/backward on a process (capped at its rollouts); gradient accumulation
    covers the rest. Changes memory, not the update."""
    group_size: int = 8
    """G: rollouts per prompt (>= 2: a group is its own baseline)."""
    mask_truncated: bool = False
    """Give completions cut at --max_new_tokens (no EOS) no loss."""

    gate_floor: ClassVar[float] = GATE_FLOOR
    preserve_mass: ClassVar[bool] = PRESERVE_MASS
    perturb_window: ClassVar[int] = PERTURB_WINDOW
    entropy_top: ClassVar[float] = ENTROPY_TOP
    perturb_span: ClassVar[int] = PERTURB_SPAN
    perturb_auto_length: ClassVar[int] = PERTURB_AUTO_LENGTH
    perturb_chunk_tokens: ClassVar[int | None] = PERTURB_CHUNK_TOKENS
