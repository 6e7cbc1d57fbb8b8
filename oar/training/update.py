"""The pieces of train.py's step 5 (the update) that are bookkeeping, not the algorithm: what the first pass
keeps for the later ones, the loss's global normalizers, the guarded optimizer step, and what the update
leaves for the step's log.

Legend: B this process's rollouts, b a micro-batch's, L positions (prompt width Lp + completion),
T = L - Lp completion positions; a micro-batch has its own width L' = Lp + T' <= L (Rollout.trimmed).

Rollout reuse, --num_iterations mu (TRL's name and meaning; verl's ppo_epochs): mu passes over each
batch of rollouts, each pass one optimizer step over the whole batch (every micro-batch of every
process, accumulated). pi_old is the sampling policy: its log-probs are taken, detached, from the first
pass's own forward (the parameters have not moved yet, so no extra forward and a ratio of exactly 1 on
that pass); later passes clip against them. OAR weights (and the KL reference's log-probs) are computed
once per batch, on the first pass, from the sampling policy, and reused by every pass (`Kept`). Rollouts
are not shuffled between passes: each pass's gradient is a sum over the whole batch, which no order of
micro-batches changes (TRL shuffles because it can split a batch into several optimizer steps). --steps
and the LR schedule count batches of rollouts (RL steps), so the LR is the same for the mu updates of a
batch and a checkpoint is only ever taken between batches; metrics are logged once per RL step, of the
first pass, with iter<k>/ metrics (k = 2..mu) for the later passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oar.training import sharding
from oar.training.learner import Learner


@dataclass
class Kept:
    """What the first pass keeps of one micro-batch for every pass, from the sampling policy."""

    weights: torch.Tensor  # (b, L'): w_it, the credit method's token weights on the micro-batch's layout
    old_logprobs: torch.Tensor  # (b, T') log pi_old, detached
    ref_logprobs: torch.Tensor | None  # (b, T') log pi_ref (kl_beta > 0), else None


@dataclass
class Update:
    """What one step's update leaves for its log."""

    passes: list[list[dict]] = field(default_factory=list)  # per pass, each micro-batch's loss statistics
    grad_norms: list[torch.Tensor] = field(default_factory=list)  # per pass, before clipping
    kept: list[Kept] = field(default_factory=list)  # per micro-batch
    credit_seconds: float = 0.0  # the credit method's time, all micro-batches
    nonfinite: int = 0  # rollouts whose scores were not finite (they got weights 1)
    skipped: int = 0  # passes whose optimizer step was skipped

    def weights(self, width: int) -> torch.Tensor:
        """(B, L) the step's token weights at the step's `width` L: each micro-batch's padded with 0 (the weight
        of padding) past its own width."""
        return torch.cat([torch.nn.functional.pad(k.weights, (0, width - k.weights.shape[1])) for k in self.kept])

    def keep(self, kept: Kept, seconds: float, nonfinite: int) -> None:
        """The first pass's micro-batch: what every pass reuses, and the credit method's time and count."""
        self.kept.append(kept)
        self.credit_seconds += seconds
        self.nonfinite += nonfinite

    def finish_pass(self, stats: list[dict], grad_norm, why: str, log, step: int, it: int, passes: int, bad: int):
        """Record pass `it` (0-based) of `passes`; `why` its step was skipped ("" when it was not), said in the
        log with the run's `bad` steps so far (train.py's history) and this step's number."""
        if why:
            self.skipped += 1
            where = f" (pass {it + 1} of {passes})" if passes > 1 else ""
            log.say(f"warning: step {step + 1}{where}: {why}, update skipped ({bad + 1} skipped so far)")
        self.passes.append(stats)
        self.grad_norms.append(grad_norm)


def loss_normalizers(valid: torch.Tensor, accelerator) -> dict[str, torch.Tensor]:
    """policy_loss's normalizers for the global batch, from this process's loss tokens `valid` (B, T): the
    sequences with a counted token and the counted tokens over every process, each clamped to 1 (with no valid
    token the loss is 0, not 0/0), so the loss is the same for any micro-batching and process count."""
    n_seq = accelerator.reduce(valid.any(1).sum().float(), "sum").clamp(min=1)
    n_tok = accelerator.reduce(valid.sum().float(), "sum").clamp(min=1)
    return {"num_sequences": n_seq, "num_tokens": n_tok}


def token_stats(entropy: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """A micro-batch's mean policy entropy over its loss tokens and their count (which weights the micro-batch
    means into the step's token means: runlog.token_means). entropy (b, T') at temperature 1, as the update
    forward gives it (oar.head.Forward.logprobs), valid (b, T')."""
    # selected, not multiplied: a padded column's non-finite entropy stays out
    mean = torch.where(valid, entropy, 0.0).sum() / valid.sum().clamp(min=1)
    return {"entropy": float(mean), "tokens": float(valid.sum())}


def optimizer_step(learner: Learner, accelerator, max_grad_norm: float, bad_loss: int):
    """Clip and step, unless the loss (in `bad_loss` micro-batches here) or the gradient is not finite (a
    NaN logit anywhere): the norm is the same on every process after DDP's all-reduce and the loss count
    is summed, so all of them skip together; the skipped gradient is discarded, the optimizer never sees
    it. Returns (the pre-clip gradient norm, why the step was skipped: "" when it was not)."""
    # accelerate's optimizer steps (and zeroes) only at the end of an accumulation cycle: a counter out of
    # phase with the micro-batches would skip or split this step without a word, so it is checked here
    assert accelerator.sync_gradients, (
        "the optimizer step is not at the end of an accumulation cycle (micro-batches != the accelerator's "
        "gradient_accumulation_steps): it would be skipped or split"
    )
    params = learner.model.parameters()
    grad_norm = sharding.full_tensor(accelerator.clip_grad_norm_(params, max_grad_norm))  # sharded: a DTensor
    bad_loss = int(accelerator.reduce(torch.tensor(float(bad_loss), device=accelerator.device), "sum"))
    what = ""
    if torch.isfinite(grad_norm) and bad_loss == 0:
        learner.optimizer.step()
        if broken := nonfinite_weights(learner.model, accelerator):  # before anything can save them
            raise SystemExit(broken_weights_message(broken, learner))
    else:
        what = f"non-finite loss in {bad_loss} micro-batches" if bad_loss else "non-finite gradient norm"
    learner.optimizer.zero_grad(set_to_none=True)
    return grad_norm, what


def nonfinite_weights(model, accelerator) -> list[str]:
    """The trained parameters holding a NaN or an inf after an optimizer step, on any process (each checks its
    own shards; the count is summed so that every process stops together); [] when all are finite. One
    isfinite pass over the trained weights and one synchronisation: a few milliseconds on a GPU, ~0.1 s for
    SmolLM2's 135M float32 weights on one CPU thread, against seconds to minutes for the step itself."""
    named = [(n, sharding.local_tensor(p)) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        return []
    finite = torch.stack([torch.isfinite(p).all() for _, p in named])  # (n,) bool, one sync below
    bad = accelerator.reduce((~finite).sum().float(), "sum")
    if not bool(bad):
        return []
    return [n for (n, _), ok in zip(named, finite.tolist()) if not ok] or ["(on another process)"]


def broken_weights_message(broken: list[str], learner: Learner) -> str:
    """train.py's one line for an optimizer step that left weights non-finite, with the cause where it is known."""
    step = learner.schedule.last_epoch + 1  # the LR schedule counts RL steps (it is stepped after each)
    total = sum(1 for p in learner.model.parameters() if p.requires_grad)
    dtypes = {p.dtype for p in learner.model.parameters() if p.requires_grad}
    cause = (
        "float16 weights: AdamW runs without loss scaling or a float32 copy here, and its update overflows; "
        "use --dtype bfloat16 or float32"
        if torch.float16 in dtypes
        else "lower --learning_rate, or keep float32 weights (--dtype float32)"
    )
    return (
        f"train.py: error: step {step}: the optimizer step left {len(broken)} of {total} trained weight tensors "
        f"non-finite (NaN or inf; {broken[0]} first), so the run stops before anything of this step is saved "
        f"(a checkpoint written before it is intact: --resume continues from it). Cause: {cause}."
    )


def count_bad_steps(history: dict, skipped: int, max_bad_steps: int) -> str | None:
    """Count a step with any skipped update once (the LR schedule counts RL steps, not updates); the
    message to stop with when `max_bad_steps` steps in a row had one, else None."""
    history["bad_in_a_row"] = history.get("bad_in_a_row", 0) + 1 if skipped else 0
    history["bad_steps"] += int(skipped > 0)
    if history["bad_in_a_row"] < max_bad_steps:
        return None
    return (
        f"train.py: error: {history['bad_in_a_row']} steps in a row had a non-finite loss or gradient "
        f"(a run stops at {max_bad_steps}); stopping. Lower --learning_rate, check the model's "
        f"dtype, or resume from the last checkpoint."
    )
