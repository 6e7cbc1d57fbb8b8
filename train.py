"""Train a policy on maths problems with GRPO, OAR-G, OAR-P or another token-credit method (arXiv 2601.07408).

    accelerate launch train.py                                # tiny-arith on arith, OAR-G, CPU-friendly
    accelerate launch --num_processes 8 train.py --model Qwen/Qwen2.5-Math-1.5B \
        --dataset openai/gsm8k:main --eval_dataset openai/gsm8k:main --method oar-g
    accelerate launch --config_file configs/fsdp2.yaml --num_processes 8 train.py --model Qwen/Qwen2.5-7B ...  # FSDP2 (docs/gpu.md)

One step, in the order of the paper:
  1. rollout     G samples for each of this process's prompts (a prompt's group stays on one process)
  2. reward      --reward's weighted terms; by default 1 if the extracted final answer matches the gold answer
  3. advantage   group-relative A_i (maths §1.1)
  4. update      per micro-batch: forward -> log-probs; token credit -> weights w_it (oar/credit.py's table: OAR's
                 scores through the bi-level gate, maths §3-5, a comparator, or a --credit_module's); loss with token advantages
                 A_i w_it; backward. GRPO is the same path with w = 1.
  5. step        clip the gradient norm, optimizer step (steps 4-5 run --num_iterations times), LR-schedule step
  6. log / eval / checkpoint

Departures from the paper and the authors' code (each also stated where it lives):
  * OAR-G and OAR-P take their clean probe and clean keys/values from the update's own forward pass
    (no extra clean forward); OAR-G's noise for rollout i comes from rollout i's own seed, so scores
    do not depend on micro-batching.
  * Sampling is our own KV-cache loop with a seeded generator per rollout (oar/sampler.py), so the
    rollouts of a step are identical for any number of processes and after a resume.
  * Rollout reuse, --num_iterations mu (TRL's name and meaning; verl's ppo_epochs): mu passes over
    each batch of rollouts, each pass one optimizer step over the whole batch (every micro-batch of
    every process, accumulated). pi_old is the sampling policy: its log-probs are taken, detached,
    from the first pass's own forward (the parameters have not moved yet, so no extra forward and a
    ratio of exactly 1 on that pass); later passes clip against them. OAR weights (and the KL
    reference's log-probs) are computed once per batch, on the first pass, from the sampling policy,
    and reused by every pass. Rollouts are not shuffled between passes: each pass's gradient is a
    sum over the whole batch, which no order of micro-batches changes (TRL shuffles because it can
    split a batch into several optimizer steps). --steps and the LR schedule count batches of
    rollouts (RL steps), so the LR is the same for the mu updates of a batch and a checkpoint is only
    ever taken between batches; metrics are logged once per RL step, of the first pass, with
    iter<k>/ metrics (k = 2..mu) for the later passes. mu = 1 is the same code path as before (the ratio is
    1 in value, pi_old = pi_theta.detach()).

LoRA (--lora_r > 0, oar/training/lora.py, docs/lora.md): peft adapters on a frozen base; the optimizer holds
only the adapters; the KL reference is the policy with its adapters off; final/ is the merged plain model.

Sharding: a model sharded by FSDP2 (accelerate's plugin on GPUs, or --fsdp on CPU processes) is
gathered whole for sampling, OAR scoring and evaluation, and resharded after (oar/training/sharding.py).

Degenerate numbers, each with a defined outcome (tests/test_failures.py):
  * a group whose rewards are all equal has advantage 0 (oar/grpo.py): it adds nothing to the gradient,
    and OAR does not score it (exact; --score_all scores it, for the oar/ weight diagnostics);
  * a rollout with no extractable answer, or an empty reasoning span, keeps weights 1 (plain GRPO);
  * non-finite OAR scores give their rollout weights 1, counted in oar/frac_nonfinite_scores and warned;
  * no valid completion token in the batch (all truncated under --mask_truncated): the normalizers are
    clamped to 1, so the loss is 0 and the gradient 0; the optimizer still steps (Adam's momentum acts);
  * a non-finite loss or gradient norm (NaN or inf logits): the update is skipped on every process,
    counted (summary.json skipped_steps) and warned; Config.max_bad_steps (3) in a row stop the run with a
    message. The LR schedule advances on a skipped step, so the schedule stays a function of the step.
"""

from __future__ import annotations
# ruff: noqa: E402 (the imports below come after the command line is read)

import sys

if __name__ == "__main__":  # --help and a bad flag answer here, before torch and transformers load
    from oar.training.config import parse_args

    CONFIG = parse_args(sys.argv[1:])

import time
from contextlib import nullcontext
from dataclasses import asdict

import numpy as np
import torch

from oar.training import checkpoint as ckpt
from oar.training import lora, rollout_backend, sharding
from oar.training.config import Config, check_config, check_resume, micro_batch, parse_args
from oar.training.data import DataError, load_problems, prompt_order, rollout_seeds
from oar.training.evaluation import evaluate
from oar.credit import CreditError, credit_methods, step_credit
from oar.training.console import bars_wanted, quiet_libraries
from oar.training.credit_trial import try_credit
from oar.training.launch import end, gather_ragged, lost_process, make_accelerator, release, stop_on_sigterm
from oar.grpo import group_advantages, policy_loss, token_entropy, token_logprobs, truncated_is_weights
from oar.training.models import ModelError, enable_checkpointing, load_model, resolve_model
from oar.lm import forward_logits
from oar.probes import clean_forward, outcome_from_logits
from oar.reward_table import RewardError, reward_terms, score
from oar.training.runlog import RunLog, pass_metrics, sampler_gap_metrics, step_metrics
from oar.sampler import format_prompt, resolve_instruction
from oar.tasks.tiny_arith_cache import model_source


def main(cfg: Config) -> dict:
    from accelerate.utils import set_seed

    accelerator = make_accelerator(cfg.collective_timeout, log_with=[t for t in cfg.log_with.split(",") if t] or None, project_dir=cfg.output_dir)  # trackers write there
    quiet_libraries(bars_wanted(accelerator.is_main_process, cfg.progress))  # their bars where ours are; each warning once
    n_proc, rank = accelerator.num_processes, accelerator.process_index
    local_prompts = cfg.prompts_per_step // n_proc
    try:  # every cheap check first: nothing is loaded or written when one fails
        check_config(cfg, n_proc)
        method = credit_methods(cfg.credit_module)[cfg.method]  # checked: a --credit_module that fails has stopped the run
        terms = reward_terms(cfg.reward, cfg.reward_module)  # checked likewise
        resolve_model(cfg.model)
        train_set = load_problems(cfg.dataset, split="train", limit=cfg.train_size if cfg.dataset == "arith" else None, seed=cfg.seed)
        eval_name = cfg.eval_dataset or ("arith" if cfg.dataset == "arith" else "")
        eval_set = load_problems(eval_name, split="test", limit=cfg.eval_size or None) if eval_name else []
        resume_from = ckpt.latest_checkpoint(cfg.output_dir)
        if cfg.resume and resume_from is None:
            raise ValueError(f"--resume: no complete checkpoint in {cfg.output_dir}; drop --resume to start afresh.")
        if not cfg.resume and resume_from is not None:
            raise ValueError(f"--output_dir {cfg.output_dir} holds checkpoints of an earlier run: pass --resume to "
                             f"continue it, or choose another --output_dir.")
        if cfg.resume:
            check_resume(cfg, ckpt.read_state(resume_from), resume_from)
        instruction = resolve_instruction(cfg.instruction, cfg.dataset, cfg.model)
        if cfg.lora_r:  # on the model's skeleton (meta device): no weight is read yet
            lora.check_targets(model_source(cfg.model), cfg.lora_target_modules)
        rollout_backend.check(cfg.rollout_backend, model_source(cfg.model), top_p=cfg.top_p)  # vllm: installed, and can serve it
        set_seed(cfg.seed)
        model, tokenizer = load_model(model_source(cfg.model), dtype=cfg.dtype)  # the tokenizer is checked before the weights load
    except (ValueError, DataError, ModelError) as err:
        raise SystemExit(f"train.py: error: {err}") from None
    # LoRA: peft freezes the base and adds adapters in place; everything below trains, samples and scores
    # the inner transformers model (lora.inner: OAR-G needs it), the PeftModel only saves the adapter.
    lora_model = lora.add_adapters(model, r=cfg.lora_r, alpha=cfg.lora_alpha, targets=cfg.lora_target_modules) if cfg.lora_r else None
    model = lora.inner(lora_model) if lora_model is not None else model
    if cfg.gradient_checkpointing:
        enable_checkpointing(model)
    # The KL reference: a frozen copy of the initial model, or with LoRA the policy with its adapters off
    ref_model = load_model(model_source(cfg.model), dtype=cfg.dtype)[0].eval().requires_grad_(False) if cfg.kl_beta > 0 and not cfg.lora_r else None
    own_fsdp = cfg.fsdp and not sharding.accelerate_shards(accelerator)  # on CPU processes accelerate's plugin falls back to DDP
    if own_fsdp:  # before the optimizer: it must hold the sharded parameters
        sharding.shard(model, sharding.mixed_precision(accelerator))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    micro = micro_batch(cfg, accelerator.num_processes)
    n_micro = local_prompts * cfg.group_size // micro
    accelerator.gradient_accumulation_steps = n_micro
    if not own_fsdp:  # (with --fsdp accelerate would wrap the sharded model in DDP; its state is saved with DCP)
        model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(schedule)  # stepped once per RL step, on every process
    # LoRA: checkpoints hold the adapters, the frozen base is --model's (--fsdp's do so too, sharding.py);
    # accelerate's FSDP plugin (GPUs) writes the whole model.
    adapters_only = lora_model is not None and not own_fsdp and not sharding.accelerate_shards(accelerator)
    if adapters_only:
        ckpt.skip_frozen(accelerator)
    if ref_model is not None:
        ref_model = ref_model.to(accelerator.device)
    policy = accelerator.unwrap_model(model)
    try:  # the method's trial on a synthetic step: a broken one stops here, before any evaluation or file
        with sharding.gathered(model), accelerator.autocast():
            try_credit(cfg.credit(), policy, tokenizer, train_set[0].problem, train_set[0].answer, instruction=instruction,
                       probe="last" if cfg.probe_warmup else cfg.probe, device=accelerator.device,
                       keep_cache=not cfg.gradient_checkpointing, gather=lambda x: gather_ragged(accelerator, x))
    except CreditError as err:
        raise SystemExit(f"train.py: error: {err}") from None

    start_step, history = 0, {"step_seconds": [], "bad_steps": 0}
    if cfg.resume:
        state = ckpt.load_checkpoint(accelerator, resume_from, sharded=(model, optimizer) if own_fsdp else None,
                                     frozen_skipped=adapters_only)
        start_step, history = state["step"], state["history"]
        accelerator.step = 0  # accumulation counter: restored by load_state, but a step always ends a cycle
    log = RunLog(accelerator, cfg.output_dir, asdict(cfg), resume=cfg.resume, total_steps=cfg.steps, start_step=start_step,
                 progress=cfg.progress)
    if cfg.resume:
        log.say(f"resumed from {resume_from} (step {start_step})")
    # The rollout sampler: oar.sampler.sample, or a vLLM engine in this process that follows the policy (docs/vllm.md)
    sampler = rollout_backend.make(cfg.rollout_backend, model_source(cfg.model), accelerator=accelerator, folder=cfg.output_dir,
                                   **rollout_backend.engine_settings(cfg))
    if cfg.resume:  # the engine starts from --model's weights: give it the checkpoint's
        rollout_backend.follow(sampler, policy, lora_model)
    # Truncated importance sampling where another engine sampled (oar/grpo.py truncated_is_weights)
    is_cap = cfg.vllm_importance_sampling_cap if cfg.rollout_backend == "vllm" else 0.0
    eval_kw = dict(accelerator=accelerator, instruction=instruction, batch_size=cfg.eval_batch_size, max_new_tokens=cfg.max_new_tokens,
                   num_samples=cfg.eval_samples, temperature=cfg.eval_temperature, seed=cfg.seed, loop=cfg.decode_loop,
                   progress=log.bars, sampler=sampler)  # avg@k when k > 1
    if eval_set and "eval_before" not in history:
        with sharding.gathered(model):
            before = evaluate(policy, tokenizer, eval_set, **eval_kw)[1]
        history["eval_before"], history["eval_before_pass"] = before["accuracy"], {k: v for k, v in before.items() if k.startswith("pass@")}
        log.say(f"held-out accuracy before training: {history['eval_before']:.3f} on {len(eval_set)} problems")

    for step in range(start_step, cfg.steps):
        t0, cpu0 = time.perf_counter(), time.process_time()  # wall, and this process's CPU (steadier on a shared machine)
        # 1. rollout: this process's slice of the step's prompts, G samples each
        slots = [step * cfg.prompts_per_step + rank * local_prompts + k for k in range(local_prompts)]
        idx = prompt_order(step, local_prompts, rank, len(train_set), cfg.prompts_per_step, cfg.seed)
        seeds = rollout_seeds(cfg.seed, step, slots, cfg.group_size)
        prompts = [format_prompt(tokenizer, train_set[i].problem, instruction) for i in idx]
        golds = [train_set[i].answer for i in idx for _ in range(cfg.group_size)]
        chunks = local_prompts // cfg.rollout_batch_size if cfg.rollout_batch_size else 1
        with sharding.gathered(model), log.progress(chunks * cfg.max_new_tokens, "rollouts", unit="token") as shown:
            ro = sampler(policy, tokenizer, prompts, group_size=cfg.group_size, seeds=seeds,  # (a sharded model: whole in this block)
                        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, chunk=cfg.rollout_batch_size,
                        loop=cfg.decode_loop, on_token=shown.update)
        t_rollout = time.perf_counter() - t0

        # 2. reward: --reward's weighted terms (oar/reward_table.py; by default answer correctness alone)
        problems = [train_set[i].problem for i in idx for _ in range(cfg.group_size)]
        totals, reward_parts = score(terms, ro.texts, golds, problems)
        rewards = torch.tensor(totals, device=accelerator.device)

        # 3. group-relative advantage (a prompt's group is on this process: no gather needed)
        advantages = group_advantages(rewards, cfg.group_size, scale=cfg.advantage_scale)  # (B,)

        # 4. update, micro-batch by micro-batch. Only completion columns (from Lp) are scored:
        # logits at Lp-1 .. L-1 predict completion tokens Lp .. L. The normalizer is global (every
        # micro-batch and process), and the loss is scaled by n_micro x n_proc because accelerate
        # divides it by the accumulation steps and DDP averages over processes.
        lp = ro.prompt_width
        completion = ro.loss_tokens(cfg.mask_truncated)
        # Clamped to 1: with no valid token anywhere (all truncated under mask_truncated) the loss is 0, not 0/0.
        n_seq = accelerator.reduce(completion.any(1).sum().float(), "sum").clamp(min=1)
        n_tok = accelerator.reduce(completion.sum().float(), "sum").clamp(min=1)
        # A rollout with advantage 0 (its whole group got one reward) or no valid token has loss 0
        # whatever its token weights: OAR does not score it unless asked to (exact; a third of the
        # default run's rollouts).
        scored = ((advantages != 0) & completion.any(1) | cfg.score_all) & method.scores  # (B,)
        probe = "last" if step < cfg.probe_warmup else cfg.probe
        # Token credit (oar/credit.py): what a method needs of the whole step is computed here, before
        # the micro-batches, so its weights do not depend on micro-batching or on the processes; in the
        # update forward's mixed precision (entropy-mask's entropies are that forward's).
        with accelerator.autocast():
            credit = step_credit(cfg.credit(), policy, tokenizer,
                                 ro, rewards, advantages, scored, seeds, golds, probe, gather=lambda x: gather_ragged(accelerator, x))
        model.train()
        w_all, old_all, ref_all, passes, norms = [], [], [], [], []  # per micro-batch (w, old, ref); per pass
        oar_seconds, n_nonfinite, skipped = 0.0, 0, 0
        gaps = []  # |log pi_sample - log pi_old| on the loss's tokens: the sampler's numbers against the update forward's
        for it in range(cfg.num_iterations):  # mu passes over the same rollouts (docstring: rollout reuse)
            stats, bad_loss = [], 0
            shown = log.progress(n_micro, "credit + update" if it == 0 and method.scores else "update", unit="micro-batch")
            for m in range(n_micro):
                rows = slice(m * micro, (m + 1) * micro)
                mb = ro.select(rows)
                with accelerator.accumulate(model):
                    # OAR's clean pass comes for free from the first pass's forward (the sampling policy)
                    reuse = it == 0 and method.uses_clean and cfg.outcome_source == "rollout"
                    logits, clean_kv = clean_forward(model, mb.input_ids, mb.attention_mask, logits_to_keep=mb.input_ids.shape[1] - lp + 1,
                                                     keep_cache=reuse and not cfg.gradient_checkpointing)
                    labels = mb.input_ids[:, lp:]  # (b, T)
                    logprobs = token_logprobs(logits[:, :-1], labels, temperature=cfg.temperature)  # (b, T): the sampled distribution
                    if it == 0:  # the sampling policy: pi_old, OAR weights and the reference, kept for every pass
                        clean = outcome_from_logits(logits.detach(), mb.input_ids[:, lp - 1:], mb.answer_mask[:, lp - 1:], probe) if reuse else None
                        # OAR calls submodules: gathered when sharded, and in the update forward's mixed precision
                        with sharding.gathered(model) if method.scores else nullcontext(), accelerator.autocast():
                            weights, secs, nonfinite = credit(rows, mb, logits.detach(), clean, clean_kv)  # (b, L)
                        oar_seconds, n_nonfinite = oar_seconds + secs, n_nonfinite + nonfinite
                        w_all.append(weights)
                        old_all.append(logprobs.detach())  # (b, T): ratio 1 in value on this pass
                        gaps.append((logprobs.detach() - mb.sample_logprobs[:, lp:].to(logprobs.device)).abs()[completion[rows, lp:]])
                        ref = None
                        if cfg.kl_beta > 0:
                            with torch.no_grad(), lora.adapters_off(policy) if cfg.lora_r else nullcontext(), \
                                    sharding.gathered(model) if cfg.lora_r else nullcontext():
                                ref_logits = forward_logits(ref_model if ref_model is not None else policy, mb.input_ids, mb.attention_mask, logits_to_keep=labels.shape[1] + 1)
                                ref = token_logprobs(ref_logits[:, :-1], labels, temperature=cfg.temperature)
                        ref_all.append(ref)
                    token_adv = advantages[rows, None] * w_all[m][:, lp:]  # (b, T): A_it = A_i w_it
                    is_weights = truncated_is_weights(old_all[m], mb.sample_logprobs[:, lp:].to(logprobs.device), completion[rows, lp:],
                                                      is_cap) if is_cap else None
                    loss, s = policy_loss(logprobs, old_all[m], token_adv, completion[rows, lp:], clip_low=cfg.clip_low,
                                          clip_high=cfg.clip_high, kl_beta=cfg.kl_beta, ref_logprobs=ref_all[m], aggregation=cfg.aggregation,
                                          num_sequences=n_seq, num_tokens=n_tok, is_weights=is_weights)
                    bad_loss += int(not torch.isfinite(loss))
                    accelerator.backward(loss * n_micro * n_proc)
                    valid = completion[rows, lp:]
                    s["entropy"] = float((token_entropy(logits[:, :-1].detach()) * valid).sum() / valid.sum().clamp(min=1))
                    s["tokens"] = float(valid.sum())  # weights the micro-batch means: the step's are then token means
                    stats.append(s)
                shown.update()
            shown.close()

            # 5. optimizer step, unless the loss or the gradient is not finite (a NaN logit anywhere):
            # the norm is the same on every process after DDP's all-reduce and the loss count is summed,
            # so all of them skip together; the skipped gradient is discarded, the optimizer never sees it.
            grad_norm = sharding.full_tensor(accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))  # sharded: a DTensor
            bad_loss = int(accelerator.reduce(torch.tensor(float(bad_loss), device=accelerator.device), "sum"))
            if torch.isfinite(grad_norm) and bad_loss == 0:
                optimizer.step()
            else:
                skipped += 1
                what = f"non-finite loss in {bad_loss} micro-batches" if bad_loss else "non-finite gradient norm"
                where = f" (pass {it + 1} of {cfg.num_iterations})" if cfg.num_iterations > 1 else ""
                log.say(f"warning: step {step + 1}{where}: {what}, update skipped ({history['bad_steps'] + 1} skipped so far)")
            optimizer.zero_grad(set_to_none=True)
            passes.append(stats)
            norms.append(grad_norm)
        # A step with any skipped update counts once; the LR schedule counts RL steps, not updates.
        history["bad_in_a_row"] = history.get("bad_in_a_row", 0) + 1 if skipped else 0
        history["bad_steps"] += int(skipped > 0)
        if history["bad_in_a_row"] >= cfg.max_bad_steps:
            raise SystemExit(f"train.py: error: {history['bad_in_a_row']} steps in a row had a non-finite loss or gradient "
                             f"(a run stops at {cfg.max_bad_steps}); stopping. Lower --learning_rate, check the model's "
                             f"dtype, or resume from the last checkpoint.")
        schedule.step()
        rollout_backend.follow(sampler, policy, lora_model)  # vllm: the engine takes the new weights (once per RL step)
        history["step_seconds"].append(time.perf_counter() - t0)
        step_cpu = time.process_time() - cpu0

        # 6. log, evaluate, checkpoint
        # The whole step's diagnostics, the same on every process and for any number of them; the timings are
        # each process's own, averaged. Logged in float32, as every run has been (the ledgers compare to the digit).
        metrics = step_metrics(ro, rewards, scored, cfg.group_size, passes[0], torch.cat(w_all), norms[0], schedule, accelerator,
                               nonfinite=n_nonfinite)
        metrics |= pass_metrics(passes[1:], norms[1:], accelerator)  # empty for --num_iterations 1
        metrics |= sampler_gap_metrics(gaps, accelerator)
        # each reward term's mean over every process's rollouts (unweighted), summed then divided once
        parts = torch.tensor([[sum(v), len(v)] for v in reward_parts.values()], dtype=torch.float64, device=accelerator.device)
        parts = accelerator.reduce(parts, "sum") if len(reward_parts) else parts
        metrics |= {f"reward/{name}": float(s / n) for name, (s, n) in zip(reward_parts, parts.tolist())}
        timings = {"time/step_s": history["step_seconds"][-1], "time/step_cpu_s": step_cpu, "time/rollout_s": t_rollout,
                   "oar/seconds_per_rollout": oar_seconds / len(ro)}
        metrics |= dict(zip(timings, accelerator.reduce(torch.tensor(list(timings.values()), device=accelerator.device), "mean").tolist()))
        metrics = {k: float(np.float32(v)) for k, v in metrics.items()}
        if n_nonfinite:
            log.say(f"warning: step {step + 1}: {n_nonfinite} rollouts had non-finite OAR scores; they got plain GRPO weights")
        if eval_set and cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            with sharding.gathered(model):
                mid = evaluate(policy, tokenizer, eval_set, **eval_kw)[1]
            metrics |= {"eval/accuracy": mid["accuracy"]} | {f"eval/{k}": v for k, v in mid.items() if k.startswith("pass@")}
        log.step(step + 1, metrics)
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps:
            ckpt.save_checkpoint(accelerator, cfg.output_dir, step + 1, {"history": history, "config": asdict(cfg)}, cfg.keep_checkpoints,
                                 sharded=(model, optimizer) if own_fsdp else None)

    summary = {"method": cfg.method, "model": cfg.model, "steps": cfg.steps, "processes": n_proc,
               "seconds_per_step": float(np.median(history["step_seconds"])) if history["step_seconds"] else None,
               "skipped_steps": history["bad_steps"]}
    if eval_set:
        with sharding.gathered(model):
            records, final = evaluate(policy, tokenizer, eval_set, **eval_kw)
        summary |= {"eval_problems": len(eval_set), "accuracy_before": history.get("eval_before"), "accuracy_after": final["accuracy"],
                    "pass_before": history.get("eval_before_pass"), "pass_after": {k: v for k, v in final.items() if k.startswith("pass@")}}
        log.records("eval_final.jsonl", records)
    held = sharding.param_optimizer_bytes(model, optimizer)  # this process's parameters + optimizer states
    summary |= {"param_optimizer_bytes": held["local"], "param_optimizer_bytes_unsharded": held["unsharded"]}
    full = sharding.full_state_dict(model)  # collective when sharded
    # final/ is a plain model: LoRA's adapters merged into the weights, the adapter alone in final/adapter/
    state, save_adapter = lora.final_weights(lora_model, full, main=accelerator.is_main_process) if lora_model is not None else (full, None)
    log.finish(summary, policy, tokenizer, state_dict=state, also=save_adapter)
    rollout_backend.close(sampler)  # vllm: the engine ends before the process group does
    end(accelerator)
    return summary


if __name__ == "__main__":
    stop_on_sigterm("train.py")  # the launcher's way to stop this process when another one died
    try:
        main(CONFIG)
    except SystemExit as stop:  # a flag the user spelled another library's way is named as they typed it
        if not isinstance(stop.code, str):
            raise
        from oar.training.config import parser

        raise SystemExit(parser().as_typed(stop.code, sys.argv[1:])) from None
    except KeyboardInterrupt:
        raise SystemExit("train.py: interrupted. Run the same command with --resume to continue from the last checkpoint.") from None
    except RewardError as err:  # a --reward_module function that raised or returned a non-finite value mid-run
        raise SystemExit(f"train.py: error: {err}") from None
    except RuntimeError as err:  # a collective whose peer died or stalled: a message, not a traceback
        if (message := lost_process(err, "train.py", CONFIG.collective_timeout)) is None:
            raise
        raise SystemExit(message) from None
    finally:
        release()  # after an error: the process group ends before the interpreter does
