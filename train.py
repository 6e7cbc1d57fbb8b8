"""Train a policy on maths problems with GRPO, OAR-G, OAR-P or another token-credit method (arXiv 2601.07408).

    accelerate launch train.py                                # tiny-arith on arith, OAR-G, CPU-friendly
    accelerate launch --num_processes 8 train.py --model Qwen/Qwen2.5-Math-1.5B \
        --dataset openai/gsm8k:main --eval_dataset openai/gsm8k:main --method oar-g
    accelerate launch --config_file configs/fsdp2.yaml --num_processes 8 train.py \
        --model Qwen/Qwen2.5-7B ...                           # FSDP2 (docs/gpu.md)

One step, in the order of the paper (the numbers of main's loop):
  1. sample      G rollouts for each of this process's prompts (a prompt's group stays on one process)
  2. reward      --reward's weighted terms; by default 1 if the extracted final answer matches the gold
  3. advantage   group-relative A_i (maths §1.1)
  4. credit      the method's view of the whole step (oar/credit.py's table: OAR's scores through the
                 bi-level gate, maths §3-5, a comparator, or a --credit_module's); w_it per micro-batch
  5. update      per micro-batch: forward -> log-probs, weights, loss with token advantages A_i w_it,
                 backward; then clip the gradient norm and step (oar/training/update.py). --num_iterations
                 passes; GRPO is the same path with w = 1. Then the LR-schedule step.
  6. log / eval / checkpoint

Departures from the paper and the authors' code (each also stated where it lives):
  * OAR-G and OAR-P take their clean probe and clean keys/values from the update's own forward pass
    (no extra clean forward); OAR-G's noise for rollout i comes from rollout i's own seed, so scores
    do not depend on micro-batching.
  * Sampling is our own KV-cache loop with a seeded generator per rollout (oar/sampler.py), so the
    rollouts of a step are identical for any number of processes and after a resume.
  * Rollout reuse, --num_iterations mu (TRL's name; verl's ppo_epochs): mu optimizer steps on each batch
    of rollouts, clipped against the sampling policy; scores, weights and --steps are per batch
    (oar/training/update.py says how).

LoRA (--lora_r > 0, oar/training/lora.py, docs/lora.md): peft adapters on a frozen base; the optimizer
holds only the adapters; the KL reference is the policy with its adapters off; final/ is the merged
plain model. Sharding: a model sharded by FSDP2 (accelerate's plugin on GPUs, or --fsdp on CPU
processes) is gathered whole for sampling, OAR scoring and evaluation, and resharded after
(oar/training/sharding.py). Which model does what is oar/training/learner.py's.

Degenerate numbers, each with a defined outcome (tests/test_degenerate_numbers.py):
  * a group whose rewards are all equal has advantage 0 (oar/grpo.py): it adds nothing to the gradient,
    and OAR does not score it (exact; --score_all scores it, for the oar/ weight diagnostics);
  * a rollout with no extractable answer, or an empty reasoning span, keeps weights 1 (plain GRPO);
  * non-finite OAR scores give their rollout weights 1, counted in oar/frac_nonfinite_scores and warned;
  * no valid completion token in the batch (all truncated under --mask_truncated): the normalizers are
    clamped to 1, so the loss is 0 and the gradient 0; the optimizer still steps (Adam's momentum acts);
  * a non-finite loss or gradient norm (NaN or inf logits): the update is skipped on every process,
    counted (summary.json skipped_steps) and warned; Config.max_bad_steps (3) in a row stop the run
    with a message. The LR schedule advances on a skipped step, so the schedule stays a function of the step.
"""

from __future__ import annotations
# ruff: noqa: E402 (the imports below come after the command line is read)

import sys

if __name__ == "__main__":  # --help and a bad flag answer here, before torch and transformers load
    from oar.training.config import parse_args

    CONFIG = parse_args(sys.argv[1:])

import json
import time
from dataclasses import asdict

import numpy as np
import torch

from oar.credit import CreditError, credit_methods, step_credit
from oar.grpo import group_advantages
from oar.reward_table import RewardError, reward_terms, score
from oar.sampler import TRAINED_INSTRUCTION, format_prompt, resolve_instruction
from oar.tasks.tiny_arith_cache import model_source
from oar.training import checkpoint as ckpt
from oar.training import lora, rollout_backend, sharding
from oar.training.checks import check_config, check_launch
from oar.training.config import Config, micro_batch, parse_args, parser
from oar.training.console import bars_wanted, quiet_libraries
from oar.training.credit_trial import try_credit
from oar.training.data import DataError, problems_digest, run_problems, seen_in_training, step_prompts
from oar.training.evaluation import evaluate
from oar.training.launch import end, gather_ragged, make_accelerator, run_entry
from oar.training.learner import build_learner
from oar.training.models import ModelError, load_model, model_digest, resolve_model
from oar.training.resume import check_model, check_resume
from oar.training.runlog import (
    RunLog,
    as_logged,
    mean_over_processes,
    pass_metrics,
    reward_term_metrics,
    sampler_gap_metrics,
    step_metrics,
)
from oar.training.update import count_bad_steps, update


def main(cfg: Config) -> dict:
    from accelerate.utils import set_seed

    trackers = [t for t in cfg.log_with.split(",") if t] or None
    accelerator = make_accelerator(cfg.collective_timeout, log_with=trackers, project_dir=cfg.output_dir)
    quiet_libraries(bars_wanted(accelerator.is_main_process, cfg.progress))  # bars as ours; warnings once
    n_proc, rank = accelerator.num_processes, accelerator.process_index
    local_prompts = cfg.prompts_per_step // n_proc
    try:  # every cheap check first: nothing is loaded or written when one fails
        kind = getattr(accelerator.distributed_type, "value", "")
        check_config(cfg, n_proc, check_launch(str(accelerator.mixed_precision), kind))
        method = credit_methods(cfg.credit_module)[cfg.method]  # a broken --credit_module has stopped the run
        terms = reward_terms(cfg.reward, cfg.reward_module)  # checked likewise
        resolve_model(cfg.model)
        train_set, eval_set = run_problems(
            cfg.dataset, cfg.eval_dataset, train_size=cfg.train_size, eval_size=cfg.eval_size, seed=cfg.seed
        )
        resume_from = ckpt.resume_point(cfg.output_dir, cfg.resume)
        facts = {
            "train_data": problems_digest(train_set),  # a resume must find them as its checkpoint did
            "mixed_precision": str(accelerator.mixed_precision),
        }  # (in the history it records)
        if cfg.resume:
            check_resume(cfg, ckpt.read_state(resume_from), resume_from, facts)
        instruction = resolve_instruction(cfg.instruction, cfg.dataset, cfg.model)
        source = model_source(cfg.model)  # tiny-arith: its folder, built on first use
        if cfg.lora_r:  # on the model's skeleton (meta device): no weight is read yet
            lora.check_targets(source, cfg.lora_target_modules)
        rollout_backend.check(cfg.rollout_backend, source, top_p=cfg.top_p)  # vllm: usable
        set_seed(cfg.seed)
        model, tokenizer = load_model(source, dtype=cfg.dtype)  # the tokenizer checked first
        facts["model_files"] = model_digest(source)  # a resume must find them so
        if cfg.resume:
            check_model(ckpt.read_state(resume_from), resume_from, facts["model_files"])
    except (ValueError, DataError, ModelError) as err:
        raise SystemExit(f"train.py: error: {err}") from None
    # LoRA, checkpointing, KL reference, FSDP2, optimizer, accelerate's prepare (oar/training/learner.py)
    micro = micro_batch(cfg, n_proc)
    learner = build_learner(cfg, accelerator, model, n_micro=local_prompts * cfg.group_size // micro)
    policy, gather = learner.policy, (lambda x: gather_ragged(accelerator, x))
    try:  # the method's trial on a synthetic step: a broken one stops here, before any evaluation or file
        with learner.gathered(), learner.autocast():
            try_credit(
                cfg.credit(),
                policy,
                tokenizer,
                train_set[0].problem,
                train_set[0].answer,
                instruction=instruction,
                probe="last" if cfg.probe_warmup else cfg.probe,
                device=accelerator.device,
                keep_cache=not cfg.gradient_checkpointing,
                gather=gather,
            )
    except CreditError as err:
        raise SystemExit(f"train.py: error: {err}") from None

    start_step, history = 0, {"step_seconds": [], "bad_steps": 0, **facts}
    if cfg.resume:
        state = ckpt.load_checkpoint(
            accelerator, resume_from, sharded=learner.sharded, frozen_skipped=learner.adapters_only
        )
        start_step, history = state["step"], facts | state["history"]  # an old checkpoint gains the facts
        accelerator.step = 0  # accumulation counter: restored by load_state, but a step always ends a cycle
    log = RunLog(
        accelerator,
        cfg.output_dir,
        asdict(cfg),
        resume=cfg.resume,
        total_steps=cfg.steps,
        start_step=start_step,
        progress=cfg.progress,
    )
    code = ckpt.run_code_version(cfg.credit_module, cfg.reward_module)  # recorded in every checkpoint
    if cfg.resume:
        log.say(f"resumed from {resume_from} (step {start_step})")
        if state.get("code", code) != code:  # allowed (a fix may be why it resumes), but said: two versions
            log.say(
                f"the checkpoint was written by other code (train.py, oar/ and the modules "
                f"{state['code']}, now {code}): the steps after it run this version"
            )
    # The sampler: oar.sampler.sample, or a vLLM engine in this process that follows the policy (docs/vllm.md)
    sampler = rollout_backend.make(
        cfg.rollout_backend,
        source,
        accelerator=accelerator,
        folder=cfg.output_dir,
        **rollout_backend.engine_settings(cfg),
    )
    own = cfg.rollout_backend == "own"  # the sampler is the policy (gathered when sharded), not a vLLM engine
    if cfg.resume:  # the engine starts from --model's weights: give it the checkpoint's
        rollout_backend.follow(sampler, policy, learner.peft)

    def held_out():  # (records, accuracy and pass@k) on the held-out set; avg@k when --eval_samples k > 1
        with learner.gathered(own):
            return evaluate(
                policy,
                tokenizer,
                eval_set,
                accelerator=accelerator,
                instruction=instruction,
                batch_size=cfg.eval_batch_size,
                max_new_tokens=cfg.max_new_tokens,
                num_samples=cfg.eval_samples,
                temperature=cfg.eval_temperature,
                seed=cfg.seed,
                loop=cfg.decode_loop,
                progress=log.bars,
                sampler=sampler,
            )

    pass_at = lambda result: {k: v for k, v in result.items() if k.startswith("pass@")}  # noqa: E731
    on_line = lambda r: {f"eval/{k}": v for k, v in r.items() if k == "accuracy" or k.startswith("pass@")}  # noqa: E731
    held_out_set = problems_digest(eval_set) if eval_set else None
    if history.get("eval_before_set", held_out_set) != held_out_set and "eval_before" in history:
        # a resume with another --eval_dataset / --eval_size: "before" was measured on other problems
        for key in ("eval_before", "eval_before_pass"):
            history.pop(key, None)
        log.say("the held-out set is not the one measured before training: no accuracy before it is reported")
    if seen := seen_in_training(train_set, eval_set):  # allowed (a smoke test may), never silent
        log.say(
            f"{seen} of the {len(eval_set)} held-out problems are also training problems: their accuracy "
            f"is not held out (a .jsonl file has no splits; pass a folder with train.jsonl and "
            f"test.jsonl, or two files)"
        )
    if eval_set and start_step == 0:  # "before training" exists only before the first step
        before = held_out()[1]
        history |= {
            "eval_before": before["accuracy"],
            "eval_before_pass": pass_at(before),
            "eval_before_set": held_out_set,
        }
        log.say(f"held-out accuracy before training: {before['accuracy']:.3f} on {len(eval_set)} problems")

    if start_step < cfg.steps and "last_metrics" in history:  # a longer resume: the old last line first
        log.step_once(start_step, history.pop("last_metrics"))  # (missing if a kill cut its final evaluation)
    for step in range(start_step, cfg.steps):
        t0, cpu0 = time.perf_counter(), time.process_time()  # wall, and this process's CPU (steadier)
        # 1. sample: this process's slice of the step's prompts, G rollouts each (a group on one process)
        idx, seeds = step_prompts(
            step, rank, local_prompts, len(train_set), cfg.prompts_per_step, cfg.group_size, cfg.seed
        )
        prompts = [format_prompt(tokenizer, train_set[i].problem, instruction) for i in idx]
        golds = [train_set[i].answer for i in idx for _ in range(cfg.group_size)]
        chunks = local_prompts // cfg.rollout_batch_size if cfg.rollout_batch_size else 1
        with (
            learner.gathered(own),  # the own sampler reads the whole policy; a vLLM engine its own weights
            log.progress(chunks * cfg.max_new_tokens, "rollouts", unit="token") as shown,
        ):
            ro = sampler(
                policy,
                tokenizer,
                prompts,
                group_size=cfg.group_size,
                seeds=seeds,
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                chunk=cfg.rollout_batch_size,
                loop=cfg.decode_loop,
                on_token=shown.update,
            )
        t_rollout = time.perf_counter() - t0

        # 2. reward: --reward's weighted terms (oar/reward_table.py; by default answer correctness alone)
        problems = [train_set[i].problem for i in idx for _ in range(cfg.group_size)]
        totals, reward_parts = score(terms, ro.texts, golds, problems)
        rewards = torch.tensor(totals, device=accelerator.device)

        # 3. group-relative advantage (a prompt's group is on this process; --advantage_scale batch divides by
        # the std of every process's rewards, so the advantages do not depend on the number of processes)
        everyone = accelerator.gather(rewards) if cfg.advantage_scale == "batch" else None
        advantages = group_advantages(rewards, cfg.group_size, cfg.advantage_scale, batch_rewards=everyone)

        # 4. token credit (oar/credit.py): what the method needs of the whole step, before the micro-batches,
        # so its weights depend neither on micro-batching nor on the processes; in the update's precision.
        # A rollout with advantage 0 (its group got one reward) or no valid token has loss 0 whatever its
        # weights: OAR does not score it unless asked to (exact; a third of the default run's rollouts).
        has_tokens = ro.loss_tokens(cfg.mask_truncated).any(1)
        scored = ((advantages != 0) & has_tokens | cfg.score_all) & method.scores  # (B,)
        probe = "last" if step < cfg.probe_warmup else cfg.probe
        with learner.autocast():  # the update forward's context (none under FSDP2)
            credit = step_credit(
                cfg.credit(), policy, tokenizer, ro, rewards, advantages, scored, seeds, golds, probe, gather=gather
            )

        # 5. update: --num_iterations passes by micro-batch, each one optimizer step (oar/training/update.py)
        done = update(
            cfg,
            learner,
            accelerator,
            ro,
            advantages,
            credit,
            method,
            micro=micro,
            probe=probe,
            log=log,
            step=step,
            bad_steps=history["bad_steps"],
        )
        if (stop := count_bad_steps(history, done.skipped, cfg.max_bad_steps)) is not None:
            raise SystemExit(stop)
        lr = learner.schedule.get_last_lr()[0]  # the rate this step trained with (logged)
        learner.schedule.step()  # the LR schedule counts RL steps, and advances on a skipped one
        rollout_backend.follow(sampler, policy, learner.peft)  # vllm: the engine takes the new weights
        history["step_seconds"].append(time.perf_counter() - t0)
        step_cpu = time.process_time() - cpu0

        # 6. log, evaluate, checkpoint. The step's diagnostics are the same on every process and for any
        # number of them (oar/training/runlog.py); the timings are each process's own, averaged.
        metrics = step_metrics(
            ro,
            rewards,
            scored,
            cfg.group_size,
            done.passes[0],
            done.weights,
            done.grad_norms[0],
            lr,
            accelerator,
            nonfinite=done.nonfinite,
        )
        metrics |= pass_metrics(done.passes[1:], done.grad_norms[1:], accelerator)  # none for mu = 1
        metrics |= sampler_gap_metrics(done.gaps, accelerator)
        metrics |= reward_term_metrics(reward_parts, accelerator)
        timings = {
            "time/step_s": history["step_seconds"][-1],
            "time/step_cpu_s": step_cpu,
            "time/rollout_s": t_rollout,
            "oar/seconds_per_rollout": done.credit_seconds / len(ro),
        }
        metrics = as_logged(metrics | mean_over_processes(timings, accelerator))
        if nonfinite := round(metrics["oar/frac_nonfinite_scores"] * len(ro) * n_proc):  # every process's
            log.say(
                f"warning: step {step + 1}: {nonfinite} rollouts had non-finite OAR scores; "
                f"they got plain GRPO weights"
            )
        if eval_set and cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            metrics |= on_line(held_out()[1])
        if step + 1 < cfg.steps:
            log.step(step + 1, metrics)
        else:  # the last line waits for the final evaluation, which follows the checkpoint: in its history
            history["last_metrics"] = metrics
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps:
            record = {"history": history, "config": asdict(cfg), "code": code}
            ckpt.save_checkpoint(
                accelerator, cfg.output_dir, step + 1, record, cfg.keep_checkpoints, sharded=learner.sharded
            )

    seconds = history["step_seconds"]
    summary = {
        "method": cfg.method,
        "model": cfg.model,
        "steps": cfg.steps,
        "processes": n_proc,
        "seconds_per_step": float(np.median(seconds)) if seconds else None,
        "skipped_steps": history["bad_steps"],
    }
    final_line = {}
    if eval_set:
        records, final = held_out()
        summary |= {
            "eval_problems": len(eval_set),
            "eval_problems_seen_in_training": seen,
            "accuracy_before": history.get("eval_before"),
            "accuracy_after": final["accuracy"],
            "pass_before": history.get("eval_before_pass"),
            "pass_after": pass_at(final),
        }
        log.records("eval_final.jsonl", records)
        final_line = on_line(final)  # unrounded, as the evaluations during the run are logged
    log.last_step(cfg.steps, history.get("last_metrics"), final_line)
    held = sharding.param_optimizer_bytes(learner.model, learner.optimizer)  # this process's share
    summary |= {"param_optimizer_bytes": held["local"], "param_optimizer_bytes_unsharded": held["unsharded"]}
    # final/ is a plain model: LoRA's adapters merged into the weights, the adapter alone in final/adapter/
    state, save_adapter = learner.final_state(main=accelerator.is_main_process)  # collective when sharded

    def also(folder):  # the prompt's instruction, which eval.py's 'auto' then uses; LoRA's adapter
        (folder / TRAINED_INSTRUCTION).write_text(json.dumps({"instruction": instruction}))
        if save_adapter is not None:
            save_adapter(folder)

    log.finish(summary, policy, tokenizer, state_dict=state, also=also)
    rollout_backend.close(sampler)  # vllm: the engine ends before the process group does
    end(accelerator)
    return summary


if __name__ == "__main__":  # each way it ends says something; the process group ends first (launch.run_entry)
    run_entry(main, CONFIG, "train.py", parser, errors=(RewardError,))  # a --reward_module's error: a line
