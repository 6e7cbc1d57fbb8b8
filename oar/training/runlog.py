"""What a run leaves behind and prints: config.json, metrics.jsonl, a line per step, summary.json,
the final model; and `step_metrics`, the diagnostics of one step. Only the main process writes;
every method is safe to call on all processes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from oar.training import console
from oar.training.checkpoint import fsync_tree, write_json_atomic, write_text_atomic
from oar.gating import weight_stats


# nats a token, mean |log pi_sample - log pi_old|; float rounding gives < 1e-4 in float32, <= 1.3e-5 in bf16 on an H200
# (docs/sampler.md)
SAMPLER_DRIFT = 0.1


class RunLog:
    def __init__(
        self,
        accelerator,
        output_dir: str,
        config: dict,
        *,
        resume: bool,
        total_steps: int,
        start_step: int = 0,
    ):
        self.acc, self.dir = accelerator, Path(output_dir)
        self.main = accelerator.is_main_process
        self.bars = console.bars_wanted(self.main)  # on the main process, stderr a terminal
        self.metrics_path = self.dir / "metrics.jsonl"
        self.bar = None
        self.drift_said = False
        if not self.main:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.dir / "config.json", config)
        if resume and self.metrics_path.exists():  # drop lines logged after the checkpoint we resume from
            lines = [ln for ln in self.metrics_path.read_text().splitlines() if _step_of(ln) <= start_step]
            write_text_atomic(self.metrics_path, "".join(ln + "\n" for ln in lines))  # a kill here loses nothing
        elif not resume:
            self.metrics_path.write_text("")
        if accelerator.log_with:
            accelerator.init_trackers(
                "oar", config={k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))}
            )
        if self.bars:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
        self.say(console.LEGEND)  # once, at the start of the log: what the step line's fields are

    def progress(self, total: int, desc: str, **kw):
        """A bar over `total` units of this step (rollouts, scoring, evaluation), drawn where bars are wanted."""
        return console.bar(total, desc, self.bars, **kw)

    def say(self, message: str) -> None:
        if not self.main:
            return
        if self.bar:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def step(self, step: int, metrics: dict) -> None:
        """Append one line to metrics.jsonl, print a readable line, forward to trackers."""
        if self.acc.log_with:
            self.acc.log(metrics, step=step)
        if not self.main:
            return
        with open(self.metrics_path, "a") as f:  # on disk before the step's checkpoint is (which a resume keeps)
            f.write(json.dumps({"step": step, **metrics}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        line = (
            f"step {step:4d} | reward {metrics['reward/mean']:.3f} | len {metrics['completion/length']:5.1f}"
            f" | H {metrics['policy/entropy']:.2f} | clip {metrics['loss/clip_frac']:.3f}"
            f" | ess {metrics['oar/ess_ratio']:.2f} | |g| {metrics['optim/grad_norm']:.2f} | "
            f"{metrics['time/step_s']:.1f}s"
        )
        if "eval/accuracy" in metrics:
            line += f" | held-out {metrics['eval/accuracy']:.3f}"
        self.say(line)
        drift = metrics.get("sampler/logprob_diff_mean", 0.0)
        if drift > SAMPLER_DRIFT and not self.drift_said:  # once a run: the metric keeps the rest
            self.drift_said = True
            self.say(
                f"warning: step {step}: the sampler's log-probs differ from the trainer's by {drift:.3f} a token on "
                f"average (sampler/logprob_diff_mean; above {SAMPLER_DRIFT}): the rollouts come from another policy "
                f"than the one trained (an engine whose weights did not follow, or half-precision kernels far apart)"
            )
        if self.bar:
            self.bar.update(1)

    def step_once(self, step: int, metrics: dict) -> None:
        """`step(step, metrics)` unless metrics.jsonl holds that step already: the last line, written after the
        final checkpoint and evaluation, by an invocation that was killed before it ended."""
        if (
            self.main
            and self.metrics_path.exists()
            and any(_step_of(line) == step for line in self.metrics_path.read_text().splitlines())
        ):
            return
        self.step(step, metrics)

    def logged(self, step: int) -> dict | None:
        """The metrics metrics.jsonl holds for `step` (without "step"), or None; None off the main process."""
        if self.main and self.metrics_path.exists():
            for line in self.metrics_path.read_text().splitlines():
                if _step_of(line) == step:
                    return {k: v for k, v in json.loads(line).items() if k != "step"}
        return None

    def last_step(self, step: int, waiting: dict | None, evaluation: dict) -> None:
        """The run's last line: the step's metrics, `waiting` in the final checkpoint's record (None from a version
        whose last line did not wait), with the final `evaluation`; logged once. A resume that ends at a
        checkpoint of a longer run (--steps lowered to its step) finds the line logged already, without the
        final evaluation: it is completed in place (and the trackers are sent the evaluation)."""
        old = self.logged(step)
        metrics = (old or waiting) and (old or waiting) | evaluation
        if not metrics:
            return
        if old is None or not self.main:
            self.step_once(step, metrics)
        elif json.loads(json.dumps(metrics)) != old:
            if self.acc.log_with and evaluation:  # the trackers had the step's line, without the final evaluation
                self.acc.log(evaluation, step=step)
            lines = self.metrics_path.read_text().splitlines()
            write_text_atomic(
                self.metrics_path,
                "".join(
                    (json.dumps({"step": step, **metrics}) if _step_of(ln) == step else ln) + "\n" for ln in lines
                ),
            )

    def records(self, name: str, rows: list[dict]) -> None:
        if self.main:
            write_text_atomic(self.dir / name, "".join(json.dumps(r) + "\n" for r in rows))

    def finish(self, summary: dict, model, tokenizer, state_dict: dict | None = None, also=None) -> None:
        """Save the final model (safetensors, loadable with from_pretrained) and summary.json. The
        model goes to final.tmp first: a folder named `final` is always complete. `state_dict`: the
        full weights of a sharded model (oar.training.sharding.full_state_dict), else the model's own.
        `also`: a function given the folder, to write more into it before it is renamed (LoRA's adapter)."""
        self.acc.wait_for_everyone()
        if self.main:
            if self.bar:
                self.bar.close()
            final, tmp = self.dir / "final", self.dir / "final.tmp"  # written whole, then renamed
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
            tokenizer.save_pretrained(tmp)
            if also is not None:
                also(tmp)
            fsync_tree(tmp)  # on disk before it is named final, as a checkpoint is
            shutil.rmtree(final, ignore_errors=True)  # a resumed run that had already finished
            os.replace(tmp, final)
            write_json_atomic(self.dir / "summary.json", summary)
            console.plot_metrics(self.dir, summary.get("accuracy_before"), summary.get("accuracy_after"))
            self.say("summary: " + json.dumps(summary))


def _step_of(line: str) -> float:
    """The step of a metrics line; infinity for a blank or torn one (a run killed mid-write leaves
    half a line at the end), so it is dropped with the lines after the checkpoint."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def step_metrics(
    ro, rewards, scored, group_size, stats, weights, grad_norm, lr, accelerator, *, nonfinite: int = 0
) -> dict:
    """maths §6 diagnostics of one step over every process's rollouts, the numbers one process logs for
    the same rollouts: what a diagnostic needs is gathered (the rewards, for their std and groups) or
    summed over processes (counts, token-weighted sums of the micro-batches' token means) before the
    one division. A mean of per-process values would not do: the std of the whole step is not the
    mean of the halves' stds, and processes hold different numbers of tokens. The weight statistics
    cover the reasoning tokens of the rollouts OAR scored (`scored`, (B,)), on any process; `weights`
    (B, L) are on the rollouts' layout, as the credit methods return them (the float32 sums, and so the
    logged digits, depend on the layout's width). `nonfinite`: this process's rollouts whose OAR scores
    were not finite. `lr`: the learning rate the step's update used."""
    all_sum = _all_sum(accelerator)
    everyone = accelerator.gather(rewards)  # (B x processes,): whole groups, in the order one process holds them
    grouped = everyone.view(-1, group_size)
    has_answer = ro.answer_mask.any(1)
    # Counts (exact in float32 below 2^24), summed, then divided once: a fraction is the same for any split.
    counts = torch.tensor(
        [
            len(ro),
            ro.completion_mask.sum(),
            ro.truncated.sum(),
            (~has_answer).sum(),
            (scored & has_answer).sum(),
            nonfinite,
        ],
        dtype=torch.float32,
    )
    n, length, truncated, no_answer, scored_n, nonfinite_n = all_sum(counts)
    m = {
        "reward/mean": float(everyone.mean()),
        "reward/std": float(everyone.std()) if len(everyone) > 1 else 0.0,
        # one reward in the group: exact equality, as group_advantages decides it (a float std of 0.1 x 8 is not 0)
        "reward/frac_zero_std_groups": float((grouped == grouped[:, :1]).all(1).float().mean()),
        "completion/length": float(length / n),
        "completion/frac_truncated": float(truncated / n),
    }
    means = token_means(stats, ("clip_frac", "approx_kl", "entropy", "kl_ref", "is_weight_mean"), all_sum)
    m |= {
        "loss/clip_frac": means["clip_frac"],
        "loss/approx_kl": means["approx_kl"],
        "policy/entropy": means["entropy"],
        "optim/grad_norm": float(grad_norm),
        "optim/lr": float(lr),
        "oar/frac_no_answer": float(no_answer / n),
        "oar/frac_scored": float(scored_n / n),
        "oar/frac_nonfinite_scores": float(nonfinite_n / n),
    }
    if "kl_ref" in means:
        m["loss/kl_ref"] = means["kl_ref"]
    if "is_weight_mean" in means:  # --rollout_backend vllm: the truncated importance weights' token mean
        m["sampler/is_weight_mean"] = means["is_weight_mean"]
    m |= {
        f"oar/{k}": v
        for k, v in weight_stats(
            weights, ro.reasoning_mask & scored[:, None], all_sum=all_sum, all_max=lambda t: accelerator.gather(t)
        ).items()
    }
    return m


def step_log(ro, valid, rewards, scored, group_size, done, reward_parts, lr, timings: dict, accelerator) -> dict:
    """Everything a step logs, over every process, as every run has logged it (`as_logged`): its maths §6
    diagnostics (`step_metrics`), the later passes' (`pass_metrics`), the sampler's gap to the update forward's
    log-probs (`sampler_gap_metrics`, on the loss tokens `valid` (B, T)), each reward term's mean, and the
    `timings` (each process's own, averaged) with the credit method's seconds per rollout. `done`: the step's
    oar.training.update.Update."""
    lp = ro.prompt_width
    sampled = ro.sample_logprobs[:, lp:]  # (B, T) log pi_sample, the sampler's own numbers
    gaps, start = [], 0
    for kept in done.kept:  # each micro-batch's |log pi_sample - log pi_old| on its loss tokens, at its width T'
        b, t = kept.old_logprobs.shape
        r, start = slice(start, start + b), start + b
        gaps.append((kept.old_logprobs - sampled[r, :t].to(kept.old_logprobs.device)).abs()[valid[r, :t]])
    first = done.passes[0], done.weights(ro.input_ids.shape[1]), done.grad_norms[0]  # the first pass's statistics
    metrics = step_metrics(ro, rewards, scored, group_size, *first, lr, accelerator, nonfinite=done.nonfinite)
    metrics |= pass_metrics(done.passes[1:], done.grad_norms[1:], accelerator)  # none for mu = 1
    metrics |= sampler_gap_metrics(gaps, accelerator)
    metrics |= reward_term_metrics(reward_parts, accelerator)
    timings = timings | {"oar/seconds_per_rollout": done.credit_seconds / len(ro)}
    return as_logged(metrics | mean_over_processes(timings, accelerator))


def reward_term_metrics(reward_parts: dict[str, list[float]], accelerator) -> dict:
    """reward/<term>: each --reward term's mean over every process's rollouts (unweighted) that it scored (a
    TRL-style term's None is left out), summed then divided once; 0 when it scored none."""
    scored = [[x for x in v if x is not None] for v in reward_parts.values()]
    parts = torch.tensor([[sum(v), len(v)] for v in scored], dtype=torch.float64, device=accelerator.device)
    parts = accelerator.reduce(parts, "sum") if len(reward_parts) else parts
    return {f"reward/{name}": float(s / max(n, 1.0)) for name, (s, n) in zip(reward_parts, parts.tolist())}


def mean_over_processes(values: dict[str, float], accelerator) -> dict:
    """Each process's own numbers (its timings), averaged over processes."""
    return dict(
        zip(
            values, accelerator.reduce(torch.tensor(list(values.values()), device=accelerator.device), "mean").tolist()
        )
    )


def as_logged(metrics: dict) -> dict[str, float]:
    """Metrics as every run has logged them: rounded to float32 (the ledgers compare to the digit)."""
    return {k: float(np.float32(v)) for k, v in metrics.items()}


def _all_sum(accelerator):
    """A function summing a tensor over processes, on the device the collectives need (a no-op for one)."""
    if accelerator.num_processes == 1:
        return lambda t: t
    return lambda t: accelerator.reduce(t.to(accelerator.device), "sum").cpu()


def token_means(stats: list[dict], keys, all_sum) -> dict:
    """Token means over every process's micro-batches of the `keys` that `stats` (one dict of token means
    and "tokens" per micro-batch) hold: each mean times its tokens, summed over micro-batches and then
    processes (`all_sum`, in float64), over the step's tokens, clamped to 1 (a batch with no valid token)."""
    keys = [k for k in keys if stats and k in stats[0]]
    sums = torch.tensor(
        [sum(s[k] * s["tokens"] for s in stats) for k in keys] + [sum(s["tokens"] for s in stats)], dtype=torch.float64
    )
    *weighted, tokens = all_sum(sums).tolist()
    return {k: v / max(tokens, 1.0) for k, v in zip(keys, weighted)}


def sampler_gap_metrics(gaps: list, accelerator) -> dict:
    """The largest and mean |log pi_sample - log pi_old| over every process's loss tokens (each entry of
    `gaps` a 1-D tensor of one micro-batch's): how far the sampler's own log-probs are from the update
    forward's (float rounding of a cached decode against a full forward here; an engine's mismatch elsewhere)."""
    d = torch.cat(gaps) if gaps else torch.zeros(0, device=accelerator.device)
    total = accelerator.reduce(torch.stack([d.sum(), torch.tensor(float(d.numel()), device=d.device)]), "sum")
    largest = accelerator.gather(d.max().reshape(1) if d.numel() else torch.zeros(1, device=d.device)).max()
    return {
        "sampler/logprob_diff_max": float(largest),
        "sampler/logprob_diff_mean": float(total[0] / total[1].clamp(min=1)),
    }


def pass_metrics(passes: list[list[dict]], grad_norms: list, accelerator) -> dict:
    """Diagnostics of the later updates on one batch of rollouts (--num_iterations > 1): for pass k
    (1-based, so the first is step_metrics' own), iter<k>/clip_frac and iter<k>/approx_kl against the
    sampling policy, token means over every process's micro-batches as step_metrics takes them, and
    the pass's pre-clip gradient norm."""
    out = {}
    for k, (stats, norm) in enumerate(zip(passes, grad_norms, strict=True), start=2):
        means = token_means(stats, ("clip_frac", "approx_kl"), _all_sum(accelerator))
        out |= {
            f"iter{k}/clip_frac": means["clip_frac"],
            f"iter{k}/approx_kl": means["approx_kl"],
            f"iter{k}/grad_norm": float(norm),
        }
    return out
