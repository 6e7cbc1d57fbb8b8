"""Train a policy on maths problems with GRPO, OAR-G, OAR-P or another token-credit method (arXiv 2601.07408).

    accelerate launch train.py                                # tiny-arith on arith, OAR-G, CPU-friendly
    accelerate launch --num_processes 8 train.py --model Qwen/Qwen2.5-Math-1.5B \\
        --dataset openai/gsm8k:main --eval_dataset openai/gsm8k:main --method oar-g
    accelerate launch --config_file configs/fsdp2.yaml --num_processes 8 train.py \\
        --model Qwen/Qwen2.5-7B ...                           # FSDP2 (docs/gpu.md)

One step, in the order of the paper (the numbers of main's loop; docs/maths.md gives each equation):
  1. sample     G rollouts for each of this process's prompts (a prompt's group stays on one process)
  2. reward     --reward's weighted terms; by default 1 if the extracted final answer matches the gold
  3. advantage  group-relative A_i (maths §1.1)
  4. credit     the method's view of the whole step (oar/credit.py): its `prepare`
  5. update     --num_iterations passes over the rollouts by micro-batch, each pass one optimizer step:
                forward -> log-probs; on the first pass, from that same forward, the token weights w_it
                (OAR's scores through the gate, maths §3-5: the forward is OAR's clean pass), pi_old and
                the KL reference; the loss with token advantages A_i w_it; backward. GRPO is w = 1.
  6. log        diagnostics (maths §6), the held-out evaluation and the checkpoint when due

Departures from the paper and the authors' code (docs/differences.md has them all):
  * OAR-G and OAR-P take their clean probe and clean keys/values from the update's own forward pass
    (no extra clean forward); OAR-G's noise for rollout i comes from rollout i's own seed, so scores
    do not depend on micro-batching.
  * Sampling is our own KV-cache loop with a seeded generator per rollout (oar/sampler.py), so the
    rollouts of a step are identical for any number of processes and after a resume.
  * Rollout reuse, --num_iterations mu (TRL's name; verl's ppo_epochs): mu optimizer steps on each batch
    of rollouts, clipped against the sampling policy; scores, weights and --steps are per batch.

Degenerate numbers, each with a defined outcome (tests/package/test_degenerate_numbers.py): a group whose rewards
are all equal has advantage 0 and is not scored (its loss is 0 whatever w; --score_all scores it); a
rollout with no extractable answer, or an empty reasoning span, keeps weights 1; non-finite OAR scores give
their rollout weights 1 (counted, warned); no valid completion token in the batch: the normalizers are
clamped to 1, so the loss is 0; a non-finite loss or gradient norm skips the optimizer step on every process
(counted in summary.json's skipped_steps, warned), and 3 such steps in a row stop the run.

Where the rest lives: setup, resume and the run's end in oar/training/run.py (`start`, `Run.end_step`,
`finish`); which model does what (LoRA, FSDP2, the KL reference) in oar/training/learner.py.
"""

from __future__ import annotations
# ruff: noqa: E402 (the imports below come after the command line is read)

import sys

if __name__ == "__main__":  # --help and a bad flag answer here, before torch and transformers load
    from oar.training.config import parse_args

    CONFIG = parse_args(sys.argv[1:])

import time

import torch

from oar.credit import CreditError
from oar.grpo import group_advantages, policy_loss, truncated_is_weights
from oar.reward_table import RewardError, score, scorable
from oar.training import rollout_backend
from oar.training.config import Config, parser
from oar.training.data import problem_prompt
from oar.training.launch import run_entry
from oar.training.run import finish, start
from oar.training.runlog import step_log
from oar.training.update import Kept, Update, count_bad_steps, loss_normalizers, optimizer_step, token_stats


def main(cfg: Config) -> dict:
    run = start(cfg)  # checks, data, model, learner, sampler, log; a resume's state; evaluation before training
    acc, learner, method, G = run.accelerator, run.learner, run.method, cfg.group_size
    policy, tokenizer = learner.policy, run.tokenizer  # the unwrapped model: sampling, scoring, evaluation
    for step in range(run.start_step, cfg.steps):
        t0, cpu0 = time.perf_counter(), time.process_time()  # wall, and this process's CPU (steadier)

        # 1. sample: this process's slice of the step's prompts, G rollouts each (a group on one process), one
        # seed per rollout; with oar.sampler.sample (the policy, gathered when sharded) or a vLLM engine
        problems, seeds = run.prompts(step)
        prompts = [problem_prompt(tokenizer, p, run.instruction) for p in problems]  # a row's system turn first
        ro = run.sample(prompts, seeds)  # (B, L) rollouts: [left pad | prompt | completion | right pad]
        rollout_backend.rest(run.sampler)  # vllm: the engine sleeps through the update where it can (a GPU)
        t_rollout = time.perf_counter() - t0

        # 2. reward: --reward's weighted terms (oar/reward_table.py; by default answer correctness alone)
        golds, texts = [p.answer for p in problems for _ in range(G)], [p.problem for p in problems for _ in range(G)]
        rows = [p.row for p in problems for _ in range(G)]  # the data's columns, which TRL-style rewards are passed
        totals, reward_parts = score(run.terms, ro.texts, golds, texts, rows)
        rewards = torch.tensor(totals, device=acc.device)
        can_score = torch.tensor(scorable(reward_parts), device=acc.device)  # False: every term returned None

        # 3. group-relative advantage (a group is on this process; --advantage_scale batch divides by the std of
        # every process's rewards, so the advantages do not depend on the number of processes); a rollout that no
        # reward term could score gets 0 and stays out of the baseline
        everyone = run.gather(rewards[can_score]) if cfg.advantage_scale == "batch" else None
        advantages = group_advantages(rewards, G, cfg.advantage_scale, everyone, can_score)  # (B,) A_i

        # 4. credit: what the method needs of the whole step, before the update (oar/credit.py), so that its
        # weights depend neither on micro-batching nor on the processes. A rollout with advantage 0 or no valid
        # token has loss 0 whatever its weights: OAR does not score it (a third of the default run's rollouts).
        has_tokens = ro.loss_tokens(cfg.mask_truncated).any(1)
        scored = ((advantages != 0) & has_tokens | cfg.score_all) if method.scores else torch.zeros_like(has_tokens)
        credit = run.credit(ro, rewards, advantages, scored, seeds, golds)  # prepare, in the update's precision

        # 5. update: --num_iterations passes, each every micro-batch's loss and backward, then one optimizer step
        lp, B, micro = ro.prompt_width, len(ro), run.micro
        valid = ro.loss_tokens(cfg.mask_truncated)[:, lp:]  # (B, T) the tokens the loss counts
        normalizers = loss_normalizers(valid, acc)  # the global batch's sequences and tokens (maths §1.4)
        scale = B // micro * acc.num_processes  # accelerate divides by the accumulation steps, DDP averages
        is_cap = cfg.vllm_importance_sampling_cap if cfg.rollout_backend == "vllm" else 0.0  # another sampler
        keep_cache = method.uses_clean and not cfg.gradient_checkpointing  # OAR's clean keys/values
        done = Update()
        learner.model.train()
        for it in range(cfg.num_iterations):
            stats, bad_loss = [], 0
            label = "credit + update" if it == 0 and method.scores else "update"
            shown = run.log.progress(B // micro, label, unit="micro-batch")
            for m, rows in enumerate(slice(k, k + micro) for k in range(0, B, micro)):
                mb = ro.select(rows).trimmed()  # (b, L') at its own width: the right padding all its rows share cut
                t = mb.input_ids.shape[1] - lp  # its completion columns T' <= T
                with acc.accumulate(learner.model):
                    # 5a. forward: the log-probs of the sampled tokens (b, T'), at the sampling temperature, from the
                    # final hidden states through the model's head in chunks (oar/head.py: no (b, T', V) logits kept)
                    ids, labels = mb.input_ids, mb.input_ids[:, lp:]  # (b, L'), (b, T')
                    fwd = learner.forward(ids, mb.attention_mask, columns=t + 1, keep_cache=it == 0 and keep_cache)
                    logprobs, entropy = fwd.logprobs(labels, cfg.temperature)  # (b, T') each, from column Lp - 1
                    if it == 0:  # 5b. what every pass reuses, from the sampling policy (the parameters have not moved)
                        clean = None  # OAR's clean outcome (maths §2): this forward is OAR's clean pass
                        if method.uses_clean:
                            clean = fwd.outcome(ids[:, lp - 1 :], mb.answer_mask[:, lp - 1 :], cfg.probe)
                        with learner.gathered(method.scores), learner.autocast():  # OAR's scores through the gate
                            # the logits (b, T' + 1, V) are made, detached, only if the method reads them
                            weights, secs, nonfinite = credit.weigh(rows, mb, fwd.logits, clean, fwd.kv)
                        ref = None  # the KL reference's log-probs
                        if cfg.kl_beta > 0:
                            ref = learner.reference_logprobs(ids, mb.attention_mask, labels, cfg.temperature)
                        done.keep(Kept(weights, logprobs.detach(), ref), secs, nonfinite)
                    kept = done.kept[m]
                    # 5c. the loss with token advantages A_it = A_i w_it, normalised by the whole step (maths §1.3)
                    token_adv = advantages[rows, None] * kept.weights[:, lp:]  # (b, T')
                    is_weights = None
                    if is_cap:  # truncated importance sampling (oar/grpo.py truncated_is_weights)
                        sampled = ro.sample_logprobs[rows, lp : lp + t].to(logprobs.device)
                        is_weights = truncated_is_weights(kept.old_logprobs, sampled, valid[rows, :t], is_cap)
                    loss, s = policy_loss(
                        logprobs,
                        kept.old_logprobs,
                        token_adv,
                        valid[rows, :t],
                        ref_logprobs=kept.ref_logprobs,
                        is_weights=is_weights,
                        **cfg.loss(),
                        **normalizers,
                    )
                    bad_loss += int(not torch.isfinite(loss))
                    acc.backward(loss * scale)  # 5d. the gradient of the global loss
                    stats.append(s | token_stats(entropy, valid[rows, :t]))
                shown.update()
            shown.close()
            # 5e. clip and step, unless the loss or the gradient norm is not finite (then on no process)
            grad_norm, why = optimizer_step(learner, acc, cfg.max_grad_norm, bad_loss)
            done.finish_pass(stats, grad_norm, why, run.log, step, it, cfg.num_iterations, run.history["bad_steps"])
        if (stop := count_bad_steps(run.history, done.skipped, cfg.max_bad_steps)) is not None:
            raise SystemExit(stop)
        lr = learner.schedule.get_last_lr()[0]  # the rate this step trained with (logged)
        learner.schedule.step()  # the LR schedule counts RL steps, and advances on a skipped one
        rollout_backend.follow(run.sampler, policy, learner.peft)  # vllm: the engine takes the new weights
        run.history["step_seconds"].append(time.perf_counter() - t0)

        # 6. log, evaluate, checkpoint: the step's diagnostics are the same on every process and for any number
        # of them (oar/training/runlog.py); the timings are each process's own, averaged
        timings = {
            "time/step_s": run.history["step_seconds"][-1],
            "time/step_cpu_s": time.process_time() - cpu0,
            "time/rollout_s": t_rollout,
        }
        metrics = step_log(ro, valid, rewards, scored, G, done, reward_parts, lr, timings, acc)
        run.end_step(step, metrics, rollouts=B * acc.num_processes)
    return finish(run)  # the final evaluation, summary.json, final/


if __name__ == "__main__":  # each way it ends says something; the process group ends first (launch.run_entry)
    run_entry(main, CONFIG, "train.py", parser, errors=(RewardError, CreditError))  # a user module's error: a line
