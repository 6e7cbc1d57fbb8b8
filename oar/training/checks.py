"""The checks that refuse impossible settings before anything loads, each named with its fix.

`check_config` is train.py's: every problem of a Config at once, one line each (ValueError). The
model, backend and evaluation checks are shared with eval.py, whose settings are those parts of a
Config. What a resumed run may change is oar.training.resume.check_resume's. Like config.py, this
module imports no torch at import time: a bad flag answers before torch loads.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from oar.training.config import BackendSettings, Config, EvalSettings, ModelSettings, micro_batch


def check_model_settings(cfg: ModelSettings) -> list[str]:
    """Impossible loading and sampling settings, shared by train.py and eval.py."""
    import torch

    problems = []
    need = lambda ok, msg: ok or problems.append(msg)
    dtype = getattr(torch, cfg.dtype, None)
    need(
        isinstance(dtype, torch.dtype) and dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64),
        f"--dtype {cfg.dtype}: the weights' floating-point dtype, one of float32, bfloat16, float16, float64.",
    )
    need(cfg.max_new_tokens >= 1, f"--max_new_tokens {cfg.max_new_tokens}: must be >= 1.")
    return problems


def check_backend_settings(cfg: BackendSettings) -> list[str]:
    """Impossible rollout-backend settings, shared by train.py and eval.py (what vLLM cannot serve is
    oar.training.rollout_backend.check's, once the model is known)."""
    problems = []
    need = lambda ok, msg: ok or problems.append(msg)
    need(cfg.rollout_backend in ("own", "vllm"), f"--rollout_backend {cfg.rollout_backend}: own or vllm.")
    need(
        0 < cfg.vllm_gpu_memory_utilization <= 1,
        f"--vllm_gpu_memory_utilization {cfg.vllm_gpu_memory_utilization}: must lie in (0, 1].",
    )
    for name in ("temperature", "eval_temperature"):  # those of the entry point's settings
        t = getattr(cfg, name, None)
        need(
            cfg.rollout_backend != "vllm" or t is None or not 0 < t < 0.01,
            f"--{name} {t} with --rollout_backend vllm: vLLM samples any temperature in (0, 0.01) at 0.01, without a "
            "word (and reports log-probs at 0.01); use a temperature of 0 (greedy) or >= 0.01, or --rollout_backend "
            "own.",
        )
    return problems


def check_eval_settings(cfg: EvalSettings) -> list[str]:
    """Impossible evaluation settings, shared by train.py and eval.py."""
    problems = []
    need = lambda ok, msg: ok or problems.append(msg)
    need(cfg.eval_size >= 0, f"--eval_size {cfg.eval_size}: must be >= 0 (0: every problem).")
    need(
        not math.isfinite(cfg.eval_temperature)  # said once, below
        or cfg.eval_samples >= 1
        and cfg.eval_temperature >= 0
        and (cfg.eval_samples == 1 or cfg.eval_temperature > 0),
        f"--eval_samples {cfg.eval_samples} / --eval_temperature {cfg.eval_temperature}: k >= 1, temperature >= 0, "
        f"and k > 1 needs --eval_temperature > 0 (greedy samples are all the same).",
    )
    need(math.isfinite(cfg.eval_temperature), f"--eval_temperature {cfg.eval_temperature}: must be a finite number.")
    return problems


def check_half_weights(dtype: str, lora_r: int) -> list[str]:
    """float16 weights trained in full: AdamW steps them in float16 with no loss scaling and no float32 copy,
    and its first update overflows (on tiny-arith every weight tensor is NaN or inf after one step, and the
    run would save that model as done). bfloat16 has float32's range; LoRA's adapters are float32 (peft)."""
    import torch

    if getattr(torch, dtype, None) is not torch.float16 or lora_r:
        return []
    return [
        f"--dtype {dtype} for full fine-tuning: AdamW would step float16 weights without loss scaling, and one "
        f"update leaves them NaN or inf; use --dtype bfloat16 (the same memory) or float32 (the default), or "
        f"train LoRA adapters on the float16 model (--lora_r 16)."
    ]


def check_output_dir(output_dir: str) -> list[str]:
    """Whether --output_dir can be a folder: not a file, and not under one (the first part of it that exists
    must be a folder this process can write in)."""
    path = Path(output_dir)
    if path.exists():
        return (
            []
            if path.is_dir()
            else [f"--output_dir {output_dir} is a file; pass a directory (it is created if missing)."]
        )
    above = next((p for p in path.absolute().parents if p.exists()), None)
    if above is not None and not above.is_dir():
        return [f"--output_dir {output_dir}: {above} is a file, so no folder can be made under it; pass another path."]
    if above is not None and not os.access(above, os.W_OK | os.X_OK):
        return [
            f"--output_dir {output_dir}: {above} is not writable by this user, so the folder cannot be made there; "
            "pass another path."
        ]
    return []


def check_launch(mixed_precision: str, distributed_type: str, num_processes: int = 1, fsdp: bool = False) -> list[str]:
    """What `accelerate launch` (its flags or config file) set that train.py cannot train under; `fsdp`: the
    launch asked for FSDP2 (sharding.asked_for), which train.py applies itself where accelerate does not."""
    problems = []
    if fsdp and distributed_type != "FSDP" and num_processes < 2:
        problems.append(
            "FSDP2's config on one CPU process: train.py shards over processes there; start 2 or more "
            "(accelerate launch --config_file configs/fsdp2.yaml --num_processes N --mixed_precision no ...)."
        )
    if mixed_precision == "fp16":
        problems.append(
            "accelerate's fp16 mixed precision: its loss scaling skips the steps whose gradients overflow, which "
            "train.py counts as failed steps (and a skipped step leaves its scaler unable to unscale the next); "
            "launch with --mixed_precision bf16 (or no)."
        )
    if distributed_type == "DEEPSPEED":
        problems.append(
            "DeepSpeed: train.py scales the loss for accelerate's own gradient accumulation, which DeepSpeed "
            "replaces; "
            "launch multi-GPU DDP, or FSDP2 with --config_file configs/fsdp2.yaml."
        )
    return problems


def check_config(cfg: Config, num_processes: int, launch: list[str] = ()) -> None:
    """Every impossible setting, named with its fix, before anything expensive happens (ValueError,
    one line per problem); `launch`: check_launch's problems with the accelerator, listed with them."""
    from oar.credit import CreditError, credit_methods
    from oar.reward_table import RewardError, reward_terms
    from oar.training.launch import tracker_problem
    from oar.oar_perturb import MODES as PERTURB_MODES
    from oar.probes import PROBES
    from oar.training import lora

    problems = list(launch)
    need = lambda ok, msg: ok or problems.append(msg)
    try:  # a user's module is imported here, so that one that fails stops the run before anything loads
        methods = credit_methods(cfg.credit_module)
        where = (
            f"with --credit_module {cfg.credit_module}"
            if cfg.credit_module
            else "or name a module that defines it with --credit_module"
        )
        need(cfg.method in methods, f"--method {cfg.method}: choose one of {', '.join(methods)} ({where}).")
    except CreditError as err:
        problems.append(str(err))
    try:  # likewise a --reward_module: imported, and each of its functions called once on an example
        reward_terms(cfg.reward, cfg.reward_module)
    except RewardError as err:
        problems.append(str(err))
    problems += [problem for name in cfg.log_with.split(",") if name and (problem := tracker_problem(name))]
    need(cfg.probe in PROBES, f"--probe {cfg.probe}: choose one of {', '.join(PROBES)}.")
    need(cfg.group_size >= 2, f"--group_size {cfg.group_size}: GRPO needs >= 2 rollouts per prompt for a baseline.")
    need(
        cfg.prompts_per_step % num_processes == 0,
        f"--prompts_per_step {cfg.prompts_per_step} does not divide over {num_processes} processes; use a multiple "
        f"of {num_processes}.",
    )
    local = cfg.prompts_per_step // num_processes * cfg.group_size
    need(
        cfg.micro_batch_size >= 1 and local % micro_batch(cfg, num_processes) == 0,
        f"--micro_batch_size {cfg.micro_batch_size} must divide the {local} rollouts each process holds "
        f"(prompts_per_step / processes x group_size), or be at least that many (one micro-batch).",
    )
    need(
        cfg.rollout_batch_size >= 0
        and (cfg.rollout_batch_size == 0 or (cfg.prompts_per_step // num_processes) % cfg.rollout_batch_size == 0),
        f"--rollout_batch_size {cfg.rollout_batch_size} must divide each process's "
        f"{cfg.prompts_per_step // num_processes} prompts "
        f"(prompts_per_step / processes), or be 0 (all at once).",
    )
    need(0.0 < cfg.gate_quantile < 1.0, f"--gate_quantile {cfg.gate_quantile}: must lie strictly between 0 and 1.")
    need(cfg.gate_boost >= 0, f"--gate_boost {cfg.gate_boost}: must be >= 0.")
    need(cfg.noise_std >= 0, f"--noise_std {cfg.noise_std}: must be >= 0.")
    need(
        cfg.noise_std != 0 or cfg.method != "oar-g" or cfg.probe == "answer_joint",
        f"--noise_std 0 with --probe {cfg.probe}: OAR-G's distribution probes need the noise (at the clean point "
        f"the KL's gradient is 0 and the scores would be float rounding); use --noise_std > 0, or --probe "
        f"answer_joint.",
    )
    for name in (
        "temperature",
        "learning_rate",
        "noise_std",
        "gate_boost",
        "kl_beta",
        "clip_low",
        "clip_high",
    ):
        need(math.isfinite(getattr(cfg, name)), f"--{name} {getattr(cfg, name)}: must be a finite number.")
    need(cfg.temperature > 0, f"--temperature {cfg.temperature}: rollouts need sampling (> 0).")
    need(cfg.aggregation in ("seq_mean", "token_mean"), f"--aggregation {cfg.aggregation}: seq_mean or token_mean.")
    need(
        cfg.advantage_scale in ("group", "batch", "none"),
        f"--advantage_scale {cfg.advantage_scale}: group, batch or none.",
    )
    need(cfg.steps >= 1, f"--steps {cfg.steps}: must be >= 1.")
    need(
        cfg.seed >= 0, f"--seed {cfg.seed}: must be >= 0 (it seeds numpy's data order, which takes no negative seed)."
    )
    need(cfg.prompts_per_step >= 1, f"--prompts_per_step {cfg.prompts_per_step}: must be >= 1.")
    need(
        cfg.perturb_mode in PERTURB_MODES,
        f"--perturb_mode {cfg.perturb_mode}: choose one of {', '.join(PERTURB_MODES)}.",
    )
    need(
        cfg.num_iterations >= 1,
        f"--num_iterations {cfg.num_iterations}: must be >= 1 (1 = one update per batch of rollouts).",
    )
    need(cfg.learning_rate > 0, f"--learning_rate {cfg.learning_rate}: must be > 0.")
    need(0 <= cfg.clip_low < 1, f"--clip_low {cfg.clip_low}: must lie in [0, 1).")
    # --epsilon sets both: a negative one is named once, by the clip_low check above
    need(cfg.clip_high >= 0 or cfg.clip_high == cfg.clip_low, f"--clip_high {cfg.clip_high}: must be >= 0.")
    need(cfg.kl_beta >= 0, f"--kl_beta {cfg.kl_beta}: must be >= 0 (0 turns the penalty off).")
    for name in ("warmup_steps", "eval_every", "save_every"):
        need(getattr(cfg, name) >= 0, f"--{name} {getattr(cfg, name)}: must be >= 0.")
    problems += check_model_settings(cfg) + check_eval_settings(cfg) + check_backend_settings(cfg)
    problems += check_half_weights(cfg.dtype, cfg.lora_r)
    problems += check_output_dir(cfg.output_dir)
    problems += lora.check_settings(cfg.lora_r, cfg.lora_target_modules, default_targets=Config.lora_target_modules)
    if problems:
        raise ValueError("\n".join(one_per_flag(problems)))


FINITE = "must be a finite number."


def one_per_flag(problems: list[str]) -> list[str]:
    """A flag whose value is not a finite number is named once, for that: NaN also fails every range check
    (--learning_rate nan is neither finite nor > 0), which would only repeat it."""
    nonfinite = {p.split()[0] for p in problems if p.endswith(FINITE)}
    return [p for p in problems if p.endswith(FINITE) or p.split()[0] not in nonfinite]
