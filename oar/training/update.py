"""One RL step's update (train.py step 5): --num_iterations passes over the step's rollouts, each pass
every micro-batch's loss and backward, then one optimizer step.

Legend: B this process's rollouts, b a micro-batch's, L positions (prompt width Lp + completion),
T = L - Lp completion positions, V vocabulary.

Per micro-batch, in the order of the maths (docs/maths.md §1):
  a. forward       the update forward's logits at columns Lp-1 .. L-1 (they predict completion tokens
                   Lp .. L) and, when the method reuses it, OAR's clean pass (its keys/values and outcome)
  b. log-probs     log pi_theta (b, T), at the sampler's temperature (the distribution sampled from)
  c. first pass    what every pass reuses, from the sampling policy (the parameters have not moved):
                   token weights w (b, L) from the step's credit, pi_old = log pi_theta detached (ratio 1
                   in value on this pass), the KL reference's log-probs, the sampler's gap to pi_old
  d. loss          policy_loss with token advantages A_it = A_i w_it, normalised by the whole global
                   batch's sequences or tokens (every micro-batch of every process, clamped to 1: with
                   no valid token the loss is 0, not 0/0)
  e. backward      the loss times n_micro x n_proc: accelerate divides it by the accumulation steps and
                   DDP averages over processes, so the gradient is that of the global loss
Then the optimizer step, unless the loss or the gradient norm is not finite (`optimizer_step`).

Credit weights: a method returns weights over the rollouts' layout (b, L) (the --credit_module protocol,
oar/credit_protocol.py, which user methods implement); the loss reads their completion columns, cut in
one place (where the token advantages are formed); the step's log keeps the layout (oar/training/runlog.py).

Rollout reuse, --num_iterations mu (TRL's name and meaning; verl's ppo_epochs): mu passes over each
batch of rollouts, each pass one optimizer step over the whole batch (every micro-batch of
every process, accumulated). pi_old is the sampling policy: its log-probs are taken, detached,
from the first pass's own forward (the parameters have not moved yet, so no extra forward and a
ratio of exactly 1 on that pass); later passes clip against them. OAR weights (and the KL
reference's log-probs) are computed once per batch, on the first pass, from the sampling policy,
and reused by every pass. Rollouts are not shuffled between passes: each pass's gradient is a
sum over the whole batch, which no order of micro-batches changes (TRL shuffles because it can
split a batch into several optimizer steps). --steps and the LR schedule count batches of
rollouts (RL steps), so the LR is the same for the mu updates of a batch and a checkpoint is only
ever taken between batches; metrics are logged once per RL step, of the first pass, with
iter<k>/ metrics (k = 2..mu) for the later passes. mu = 1 is the same code path as before (the
ratio is 1 in value, pi_old = pi_theta.detach()).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oar.credit import CreditMethod
from oar.grpo import policy_loss, token_entropy, token_logprobs, truncated_is_weights
from oar.probes import clean_forward, outcome_from_logits
from oar.rollout import Rollout
from oar.training import sharding
from oar.training.learner import Learner


@dataclass
class Kept:
    """What the first pass keeps of one micro-batch for every pass, from the sampling policy."""

    weights: torch.Tensor  # (b, L): w_it, the credit method's token weights on the rollouts' layout
    old_logprobs: torch.Tensor  # (b, T) log pi_old, detached
    ref_logprobs: torch.Tensor | None  # (b, T) log pi_ref (kl_beta > 0), else None


@dataclass
class Update:
    """What one step's update leaves for its log."""

    passes: list[list[dict]] = field(default_factory=list)  # per pass, each micro-batch's loss statistics
    grad_norms: list[torch.Tensor] = field(default_factory=list)  # per pass, before clipping
    kept: list[Kept] = field(default_factory=list)  # per micro-batch
    gaps: list[torch.Tensor] = field(default_factory=list)  # per micro-batch: |log pi_sample - log pi_old|
    credit_seconds: float = 0.0  # the credit method's time, all micro-batches
    nonfinite: int = 0  # rollouts whose scores were not finite (they got weights 1)
    skipped: int = 0  # passes whose optimizer step was skipped

    @property
    def weights(self) -> torch.Tensor:
        """(B, L) the step's token weights."""
        return torch.cat([k.weights for k in self.kept])


def update(
    cfg,
    learner: Learner,
    accelerator,
    ro: Rollout,
    advantages: torch.Tensor,
    credit,
    method: CreditMethod,
    *,
    micro: int,
    probe: str,
    log,
    step: int,
    bad_steps: int,
) -> Update:
    """The step's --num_iterations passes (module docstring). `advantages` (B,) A_i; `credit`: step_credit's
    weigh for this step; `log`: the RunLog (bars, warnings); `step`, `bad_steps`: for the warnings."""
    lp, n_micro, n_proc = ro.prompt_width, len(ro) // micro, accelerator.num_processes
    completion = ro.loss_tokens(cfg.mask_truncated)[:, lp:]  # (B, T) the tokens the loss counts
    sampled = ro.sample_logprobs[:, lp:]  # (B, T) log pi_sample, the sampler's own numbers
    n_seq = accelerator.reduce(completion.any(1).sum().float(), "sum").clamp(min=1)
    n_tok = accelerator.reduce(completion.sum().float(), "sum").clamp(min=1)
    is_cap = cfg.vllm_importance_sampling_cap if cfg.rollout_backend == "vllm" else 0.0  # another sampler
    out = Update()
    learner.model.train()
    for it in range(cfg.num_iterations):  # mu passes over the same rollouts (rollout reuse, above)
        stats, bad_loss = [], 0
        label = "credit + update" if it == 0 and method.scores else "update"
        shown = log.progress(n_micro, label, unit="micro-batch")
        for m in range(n_micro):
            rows = slice(m * micro, (m + 1) * micro)
            mb, valid = ro.select(rows), completion[rows]
            with accelerator.accumulate(learner.model):
                # a. OAR's clean pass comes for free from the first pass's forward (the sampling policy)
                reuse = it == 0 and method.uses_clean and cfg.outcome_source == "rollout"
                logits, clean_kv = clean_forward(
                    learner.model,
                    mb.input_ids,
                    mb.attention_mask,
                    logits_to_keep=mb.input_ids.shape[1] - lp + 1,
                    keep_cache=reuse and not cfg.gradient_checkpointing,
                )
                labels = mb.input_ids[:, lp:]  # (b, T)
                logprobs = token_logprobs(logits[:, :-1], labels, temperature=cfg.temperature)  # b. (b, T)
                if it == 0:  # c.
                    clean = None
                    if reuse:
                        clean = outcome_from_logits(
                            logits.detach(), mb.input_ids[:, lp - 1 :], mb.answer_mask[:, lp - 1 :], probe
                        )
                    # the method calls submodules: gathered when sharded; in the update's precision
                    with learner.gathered(method.scores), learner.autocast():
                        weights, secs, nonfinite = credit(rows, mb, logits.detach(), clean, clean_kv)
                    out.credit_seconds, out.nonfinite = out.credit_seconds + secs, out.nonfinite + nonfinite
                    out.gaps.append((logprobs.detach() - sampled[rows].to(logprobs.device)).abs()[valid])
                    ref = None
                    if cfg.kl_beta > 0:
                        ref = learner.reference_logprobs(mb.input_ids, mb.attention_mask, labels, cfg.temperature)
                    out.kept.append(Kept(weights, logprobs.detach(), ref))
                kept = out.kept[m]
                token_adv = advantages[rows, None] * kept.weights[:, lp:]  # (b, T): A_it = A_i w_it
                is_weights = None
                if is_cap:  # truncated importance sampling (oar/grpo.py truncated_is_weights)
                    sample_logprobs = sampled[rows].to(logprobs.device)
                    is_weights = truncated_is_weights(kept.old_logprobs, sample_logprobs, valid, is_cap)
                loss, s = policy_loss(
                    logprobs,
                    kept.old_logprobs,
                    token_adv,
                    valid,  # d.
                    clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high,
                    kl_beta=cfg.kl_beta,
                    ref_logprobs=kept.ref_logprobs,
                    aggregation=cfg.aggregation,
                    num_sequences=n_seq,
                    num_tokens=n_tok,
                    is_weights=is_weights,
                )
                bad_loss += int(not torch.isfinite(loss))
                accelerator.backward(loss * n_micro * n_proc)  # e.
                entropy = token_entropy(logits[:, :-1].detach())  # (b, T)
                # selected, not multiplied: a padded column's non-finite entropy stays out
                s["entropy"] = float(torch.where(valid, entropy, 0.0).sum() / valid.sum().clamp(min=1))
                s["tokens"] = float(valid.sum())  # weights the micro-batch means: the step's are token means
                stats.append(s)
            shown.update()
        shown.close()
        grad_norm, what = optimizer_step(learner, accelerator, cfg.max_grad_norm, bad_loss)
        if what:
            out.skipped += 1
            where = f" (pass {it + 1} of {cfg.num_iterations})" if cfg.num_iterations > 1 else ""
            log.say(f"warning: step {step + 1}{where}: {what}, update skipped ({bad_steps + 1} skipped so far)")
        out.passes.append(stats)
        out.grad_norms.append(grad_norm)
    return out


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
    else:
        what = f"non-finite loss in {bad_loss} micro-batches" if bad_loss else "non-finite gradient norm"
    learner.optimizer.zero_grad(set_to_none=True)
    return grad_norm, what


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
