"""A training run around train.py's loop: what it builds before the first step, what it does after each
step's update (evaluate, log, checkpoint), and how it ends.

`start(cfg)` runs every cheap check before anything loads (a bad setting, data file, reward or credit
module stops the run in one line and nothing is written), then loads the model, builds the learner
(oar/training/learner.py), tries the credit method on a synthetic step, restores a checkpoint on
--resume, opens the run's log and the sampler, and evaluates the held-out set once before training.
It returns a `Run`: what the loop reads (the learner, the data, the method) and the bookkeeping the
loop should not be made to read (the history a checkpoint keeps, the held-out schedule). Its
`end_step` is step 6 of train.py's loop; `finish` writes the final evaluation, summary.json and final/.

train.py owns the loop and the algorithm; this module owns no maths.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from oar.credit import CreditError, CreditMethod, StepCredit, credit_methods, step_credit
from oar.reward_table import reward_terms, try_on_row, unnamed_rewards
from oar.rollout import Rollout
from oar.sampler import TRAINED_INSTRUCTION, resolve_instruction
from oar.tasks.tiny_arith_cache import model_source
from oar.training import checkpoint as ckpt
from oar.training import lora, rollout_backend, sharding
from oar.training.checks import check_config, check_launch
from oar.training.config import Config, collective_timeout, eval_batch, micro_batch
from oar.training.console import bars_wanted, quiet_libraries
from oar.training.credit_trial import try_credit
from oar.training.data import (
    DataError,
    Problem,
    problems_digest,
    run_problems,
    seen_in_training,
    step_prompts,
    takes_system_turn,
)
from oar.training.evaluation import evaluate
from oar.training.launch import end, gather_ragged, make_accelerator
from oar.training.learner import Learner, build_learner
from oar.training.models import ModelError, load_model, model_digest, resolve_model
from oar.training.resume import check_model, check_resume
from oar.training.runlog import RunLog


@dataclass
class Run:
    """What a run holds between steps (built by `start`)."""

    cfg: Config
    accelerator: Any
    learner: Learner
    tokenizer: Any
    method: CreditMethod
    terms: list  # the reward's weighted terms (oar.reward_table.reward_terms)
    train_set: list[Problem]
    eval_set: list[Problem]
    instruction: str
    sampler: Any  # oar.sampler.sample, or a vLLM engine that follows the policy (rollout_backend.make)
    log: RunLog
    history: dict  # what every checkpoint keeps: step times, skipped steps, the run's facts, evaluations
    start_step: int
    code: str  # the code version every checkpoint records
    micro: int  # rollouts per forward/backward on this process
    local_prompts: int  # this process's prompts per step
    seen: int = 0  # held-out problems that are also training problems
    tied_steps: int = 0  # steps in a row in which every group's rollouts got one reward (no signal)
    said_no_signal: bool = False

    @property
    def own(self) -> bool:
        """The sampler is the policy itself (gathered when sharded), not a vLLM engine with its own weights."""
        return self.cfg.rollout_backend == "own"

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every process's 1-D `x`, concatenated in process order."""
        return gather_ragged(self.accelerator, x)

    def prompts(self, step: int) -> tuple[list[Problem], list[int]]:
        """This process's problems at `step` and one seed per rollout (G per problem; oar/training/data.py)."""
        cfg = self.cfg
        idx, seeds = step_prompts(
            step,
            self.accelerator.process_index,
            self.local_prompts,
            len(self.train_set),
            cfg.prompts_per_step,
            cfg.group_size,
            cfg.seed,
        )
        return [self.train_set[i] for i in idx], seeds

    def sample(self, prompts: list[str], seeds: list[int]) -> Rollout:
        """G rollouts of each prompt text, drawn with `seeds` by the run's sampler: oar.sampler.sample, which
        reads the whole policy (gathered when sharded), or a vLLM engine with the policy's weights."""
        cfg = self.cfg
        bars = self.local_prompts // cfg.rollout_batch_size if cfg.rollout_batch_size else 1  # sampling calls
        with (
            self.learner.gathered(self.own),
            self.log.progress(bars * cfg.max_new_tokens, "rollouts", unit="token") as shown,
        ):
            return self.sampler(
                self.learner.policy,
                self.tokenizer,
                prompts,
                group_size=cfg.group_size,
                seeds=seeds,
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                chunk=cfg.rollout_batch_size,
                on_token=shown.update,
            )

    def credit(self, ro: Rollout, rewards, advantages, scored, seeds: list[int], golds: list[str]) -> StepCredit:
        """The method prepared for this step (oar.credit.step_credit), in the update forward's precision."""
        with self.learner.autocast():  # none under FSDP2, which casts the shards itself
            return step_credit(
                self.cfg.credit(),
                self.learner.policy,
                self.tokenizer,
                ro,
                rewards,
                advantages,
                scored,
                seeds,
                golds,
                self.cfg.probe,
                gather=self.gather,
            )

    def held_out(self) -> tuple[list[dict], dict]:
        """(records, accuracy and pass@k) on the held-out set; avg@k when --eval_samples k > 1."""
        cfg = self.cfg
        with self.learner.gathered(self.own):
            return evaluate(
                self.learner.policy,
                self.tokenizer,
                self.eval_set,
                accelerator=self.accelerator,
                instruction=self.instruction,
                batch_size=eval_batch(cfg, self.accelerator.num_processes),
                max_new_tokens=cfg.max_new_tokens,
                num_samples=cfg.eval_samples,
                temperature=cfg.eval_temperature,
                seed=cfg.seed,
                progress=self.log.bars,
                sampler=self.sampler,
            )

    def end_step(self, step: int, metrics: dict, rollouts: int) -> None:
        """Step 6 of train.py's loop: warn about non-finite scores, evaluate when due, log the step's line
        (the last one waits for the final evaluation, in the checkpoint's history), checkpoint when due.
        `rollouts`: the step's, over every process."""
        cfg, n = self.cfg, step + 1
        if nonfinite := round(metrics["oar/frac_nonfinite_scores"] * rollouts):
            self.log.say(
                f"warning: step {n}: {nonfinite} rollouts had non-finite OAR scores; they got plain GRPO weights"
            )
        self.tied_steps = self.tied_steps + 1 if metrics["reward/frac_zero_std_groups"] == 1.0 else 0
        if self.tied_steps == NO_SIGNAL_STEPS and not self.said_no_signal:  # once a run: the metric keeps the rest
            self.said_no_signal = True
            self.log.say(no_signal(n, metrics["reward/mean"]))
        if self.eval_set and cfg.eval_every and n % cfg.eval_every == 0 and n < cfg.steps:
            metrics |= on_line(self.held_out()[1])
        if n < cfg.steps:
            self.log.step(n, metrics)
        else:  # the last line waits for the final evaluation, which follows the checkpoint: in its history
            self.history["last_metrics"] = metrics
        if (cfg.save_every and n % cfg.save_every == 0) or n == cfg.steps:
            record = {"history": self.history, "config": asdict(cfg), "code": self.code}
            ckpt.save_checkpoint(
                self.accelerator, cfg.output_dir, n, record, cfg.keep_checkpoints, sharded=self.learner.sharded
            )


NO_SIGNAL_STEPS = 3  # steps in a row with every group's rewards tied before the run says it cannot learn


def no_signal(step: int, mean_reward: float) -> str:
    """The line a run says after NO_SIGNAL_STEPS steps in a row in which every group's rollouts got one reward:
    every advantage was 0, so nothing was learned (GRPO learns from the differences within a group)."""
    first = step - NO_SIGNAL_STEPS + 1
    why = (
        "no rollout earned any reward: the task is too hard for the model, or the reward does not match the "
        "answers (the data's answer column against the final answer the model writes, and --reward)"
        if mean_reward == 0
        else "the task is too easy for the model (every rollout earned the same), too hard, or the reward "
        "does not tell its rollouts apart (--reward)"
    )
    return (
        f"warning: steps {first}-{step}: every group's rollouts got one reward (reward/frac_zero_std_groups 1.0, "
        f"mean reward {mean_reward:.3f}), so every advantage was 0 and the policy did not move: {why}."
    )


def pass_at(result: dict) -> dict:
    return {k: v for k, v in result.items() if k.startswith("pass@")}


def on_line(result: dict) -> dict:
    """An evaluation's numbers as the step line logs them: eval/accuracy and eval/pass@k."""
    return {f"eval/{k}": v for k, v in result.items() if k == "accuracy" or k.startswith("pass@")}


def start(cfg: Config) -> Run:
    """Everything before the first step, in the one order that works (module docstring)."""
    from accelerate.utils import set_seed

    trackers = [t for t in cfg.log_with.split(",") if t] or None
    try:
        timeout = collective_timeout()
    except ValueError as err:
        raise SystemExit(f"train.py: error: {err}") from None
    accelerator = make_accelerator(timeout, log_with=trackers, project_dir=cfg.output_dir)
    quiet_libraries(bars_wanted(accelerator.is_main_process))  # bars as ours; warnings once
    n_proc = accelerator.num_processes
    try:  # every cheap check first: nothing is loaded or written when one fails
        kind = getattr(accelerator.distributed_type, "value", "")
        check_config(cfg, n_proc, check_launch(str(accelerator.mixed_precision), kind, n_proc, sharding.asked_for()))
        method = credit_methods(cfg.credit_module)[cfg.method]  # a broken --credit_module has stopped the run
        terms = reward_terms(cfg.reward, cfg.reward_module)  # checked likewise
        resolve_model(cfg.model)
        train_set, eval_set = run_problems(
            cfg.dataset, cfg.eval_dataset, train_size=cfg.train_size, eval_size=cfg.eval_size, seed=cfg.seed
        )
        try_on_row(terms, train_set[0].row, train_set[0].answer, train_set[0].problem)  # TRL-style: its columns
        resume_from = ckpt.resume_point(cfg.output_dir, cfg.resume)
        facts = {  # a resume must find them as its checkpoint did (in the history it records)
            "train_data": problems_digest(train_set),
            "mixed_precision": str(accelerator.mixed_precision),
            "sharded": sharding.asked_for(),
        }
        if cfg.resume:
            check_resume(cfg, ckpt.read_state(resume_from), resume_from, facts)
        instruction = resolve_instruction(cfg.instruction, cfg.dataset, cfg.model)
        source = model_source(cfg.model)  # tiny-arith: its folder, built on first use
        if cfg.lora_r:  # on the model's skeleton (meta device): no weight is read yet
            lora.check_targets(source, cfg.lora_target_modules)
        rollout_backend.check(cfg.rollout_backend, source, top_p=1.0)  # vllm: usable
        set_seed(cfg.seed)
        model, tokenizer = load_model(source, dtype=cfg.dtype)  # the tokenizer checked first
        facts["model_files"] = model_digest(source)  # a resume must find them so
        if cfg.resume:
            check_model(ckpt.read_state(resume_from), resume_from, facts["model_files"])
    except (ValueError, DataError, ModelError) as err:
        raise SystemExit(f"train.py: error: {err}") from None

    # LoRA, checkpointing, KL reference, FSDP2, optimizer, accelerate's prepare (oar/training/learner.py)
    local_prompts = cfg.prompts_per_step // n_proc
    micro = micro_batch(cfg, n_proc)
    learner = build_learner(cfg, accelerator, model, n_micro=local_prompts * cfg.group_size // micro)
    try:  # the method's trial on a synthetic step: a broken one stops here, before any evaluation or file
        with learner.gathered(), learner.autocast():
            try_credit(
                cfg.credit(),
                learner.policy,
                tokenizer,
                train_set[0].problem,
                train_set[0].answer,
                instruction=instruction,
                probe=cfg.probe,
                device=accelerator.device,
                keep_cache=not cfg.gradient_checkpointing,
                gather=lambda x: gather_ragged(accelerator, x),
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
        accelerator, cfg.output_dir, asdict(cfg), resume=cfg.resume, total_steps=cfg.steps, start_step=start_step
    )
    code = ckpt.run_code_version(cfg.credit_module, cfg.reward_module)  # recorded in every checkpoint
    if unnamed := unnamed_rewards(cfg.reward, cfg.reward_module):  # allowed, never silent
        log.say(
            f"--reward_module {cfg.reward_module} defines {', '.join(unnamed)}, which --reward {cfg.reward} does not "
            f"name: they are not in this run's reward (--reward {','.join([cfg.reward, *unnamed])} adds them)"
        )
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
    run = Run(
        cfg,
        accelerator,
        learner,
        tokenizer,
        method,
        terms,
        train_set,
        eval_set,
        instruction,
        sampler,
        log,
        history,
        start_step,
        code,
        micro,
        local_prompts,
    )
    if cfg.resume:  # the engine starts from --model's weights: give it the checkpoint's
        rollout_backend.follow(sampler, learner.policy, learner.peft)
    _before_training(run)
    return run


def _before_training(run: Run) -> None:
    """The held-out set's checks and its evaluation before training (once: a resume keeps it), and a longer
    resume's old last line."""
    cfg, history, log, eval_set = run.cfg, run.history, run.log, run.eval_set
    held_out_set = problems_digest(eval_set) if eval_set else None
    if history.get("eval_before_set", held_out_set) != held_out_set and "eval_before" in history:
        # a resume with another --eval_dataset / --eval_size: "before" was measured on other problems
        for key in ("eval_before", "eval_before_pass"):
            history.pop(key, None)
        log.say("the held-out set is not the one measured before training: no accuracy before it is reported")
    if not eval_set and run.start_step == 0:  # allowed (a smoke test may), never silent
        log.say(
            f"no held-out set: --dataset {cfg.dataset} has none by default, so this run reports no held-out accuracy; "
            f"give --eval_dataset a .jsonl file (or pass a folder that holds train.jsonl and test.jsonl)"
        )
    if any(p.system for p in run.train_set + eval_set) and not takes_system_turn(run.tokenizer):
        log.say(
            f"--model {cfg.model}: its chat template takes no system turn, so each row's system turn opens its "
            f"user turn instead"
        )
    run.seen = seen_in_training(run.train_set, eval_set)
    if run.seen:  # allowed (a smoke test may), never silent
        log.say(
            f"{run.seen} of the {len(eval_set)} held-out problems are also training problems: their accuracy "
            f"is not held out (a .jsonl file has no splits; pass a folder with train.jsonl and "
            f"test.jsonl, or two files)"
        )
    if eval_set and run.start_step == 0:  # "before training" exists only before the first step
        before = run.held_out()[1]
        history |= {
            "eval_before": before["accuracy"],
            "eval_before_pass": pass_at(before),
            "eval_before_set": held_out_set,
        }
        log.say(f"held-out accuracy before training: {before['accuracy']:.3f} on {len(eval_set)} problems")
    if run.start_step < cfg.steps and "last_metrics" in history:  # a longer resume: the old last line first
        log.step_once(run.start_step, history.pop("last_metrics"))  # (missing if a kill cut its final evaluation)


def finish(run: Run) -> dict:
    """The final evaluation, the run's last line, summary.json and final/ (a plain model: LoRA's adapters
    merged into the weights, the adapter alone in final/adapter/); ends the sampler and the processes."""
    cfg, history, learner = run.cfg, run.history, run.learner
    seconds = history["step_seconds"]
    summary = {
        "method": cfg.method,
        "model": cfg.model,
        "steps": cfg.steps,
        "processes": run.accelerator.num_processes,
        "seconds_per_step": float(np.median(seconds)) if seconds else None,
        "skipped_steps": history["bad_steps"],
    }
    final_line = {}
    if run.eval_set:
        records, final = run.held_out()
        summary |= {
            "eval_problems": len(run.eval_set),
            "eval_problems_seen_in_training": run.seen,
            "accuracy_before": history.get("eval_before"),
            "accuracy_after": final["accuracy"],
            "pass_before": history.get("eval_before_pass"),
            "pass_after": pass_at(final),
        }
        run.log.records("eval_final.jsonl", records)
        final_line = on_line(final)  # unrounded, as the evaluations during the run are logged
    run.log.last_step(cfg.steps, history.get("last_metrics"), final_line)
    held = sharding.param_optimizer_bytes(learner.model, learner.optimizer)  # this process's share
    summary |= {"param_optimizer_bytes": held["local"], "param_optimizer_bytes_unsharded": held["unsharded"]}
    state, save_adapter = learner.final_state(main=run.accelerator.is_main_process)  # collective when sharded

    def also(folder):  # the prompt's instruction, which eval.py's 'auto' then uses; LoRA's adapter
        (folder / TRAINED_INSTRUCTION).write_text(json.dumps({"instruction": run.instruction}))
        if save_adapter is not None:
            save_adapter(folder)

    run.log.finish(summary, learner.policy, run.tokenizer, state_dict=state, also=also)
    rollout_backend.close(run.sampler)  # vllm: the engine ends before the process group does
    end(run.accelerator)
    return summary
