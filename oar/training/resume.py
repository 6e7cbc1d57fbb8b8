"""What a resumed run may change: the settings, facts and former flags a checkpoint is checked against.

`check_resume` refuses a resume that would splice two different runs into one: a setting outside
RESUMABLE changed, other training problems or another accelerate mixed precision (the run's facts),
or a former flag (config.py's REMOVED) that ran at another value than this version fixes; once the model is
loaded, `check_model` refuses other --model files than the run started from.
`from_record` rebuilds the Config a run's config.json records, written by this version or an earlier
one. Like config.py, this module imports no torch: a refused resume answers before torch loads.
"""

from __future__ import annotations

from dataclasses import asdict

from oar.training.config import REMOVED, Config

# Settings a resumed run may change: they change neither the data, the rollouts nor the updates
# (micro-batching and processes give the same update, tests/package/test_distributed.py). Any other setting
# must match the checkpoint's, or a resume would splice two different runs into one.
RESUMABLE = {
    "steps",
    "output_dir",
    "resume",
    "eval_dataset",
    "eval_every",
    "eval_size",
    "eval_batch_size",
    "save_every",
    "keep_checkpoints",
    "log_with",
    "max_bad_steps",
    "micro_batch_size",
    "gradient_checkpointing",
    "perturb_chunk_tokens",
    "score_all",
    "decode_loop",
    "progress",
    "collective_timeout",
    "vllm_gpu_memory_utilization",
    "fsdp",  # no longer a setting but how the run is launched: the "sharded" fact below
}


def check_resume(cfg: Config, state: dict, where, facts: dict | None = None) -> None:
    """A resume continues the checkpoint's run: every setting outside RESUMABLE must be the same. A
    setting the checkpoint lacks (written before the setting existed) ran at its default, e.g. lora_r 0;
    one it has that is no longer a flag (REMOVED) must have run at the value this version fixes. --steps
    may not end before the checkpoint's step, and the run's `facts` (recorded in its history) must be the
    checkpoint's: the training problems ("train_data", data.problems_digest; an edited file at the same
    path would reorder the data silently), accelerate's "mixed_precision" (every forward's floats) and
    whether the launch shards the model ("sharded": FSDP2's checkpoints are shards)."""
    if cfg.steps < state.get("step", 0):
        raise ValueError(
            f"--resume: {where} is at step {state['step']}, past --steps {cfg.steps}: pass --steps >= "
            f"{state['step']} to continue it (its final model is already the later one)."
        )
    recorded, facts = state.get("history", {}), facts or {}
    if (
        None not in (recorded.get("train_data"), facts.get("train_data"))
        and recorded["train_data"] != facts["train_data"]
    ):
        raise ValueError(
            f"--resume: {where} trained on other problems than --dataset {cfg.dataset} now holds (an edited file, "
            f"another hub revision): its data order would not continue. Restore the data, or start a new run."
        )
    ran, now = recorded.get("mixed_precision"), facts.get("mixed_precision")
    if None not in (ran, now) and ran != now:
        raise ValueError(
            f"--resume: {where} ran under accelerate's mixed precision {ran}, this launch's is {now}: every "
            f"forward would compute otherwise. Launch with --mixed_precision {ran} to continue it."
        )
    was_sharded = recorded.get(
        "sharded", True if state.get("config", {}).get("fsdp") else None
    )  # before it was a fact
    if None not in (was_sharded, facts.get("sharded")) and was_sharded != facts["sharded"]:
        how = "sharded by FSDP2" if was_sharded else "not sharded"
        fix = "with --config_file configs/fsdp2.yaml" if was_sharded else "without FSDP2's config"
        raise ValueError(
            f"--resume: {where} was {how}, and its checkpoints are written so: launch {fix} to continue it."
        )
    saved = {**asdict(Config()), **state.get("config", {})}
    changed = [
        f"--{k} {v} (the checkpoint has {saved[k]})"
        for k, v in asdict(cfg).items()
        if k not in RESUMABLE and k in saved and saved[k] != v
    ]
    if changed:
        raise ValueError(
            f"--resume: {where} belongs to a run with other settings: {'; '.join(changed)}. Pass the "
            f"checkpoint's values to continue it, or choose another --output_dir to start a new run."
        )
    fixed = refixed(saved)
    if fixed:
        raise ValueError(
            f"--resume: {where} ran with {fixed}, a setting this version no longer takes "
            f"(docs/flags.md); continue it with the version that wrote it, or start a new run."
        )


def check_model(state: dict, where, digest: dict) -> None:
    """A resume reloads --model (the tokenizer, LoRA's frozen base, the KL reference, the instruction 'auto'
    reads): its files must be those the checkpoint's run started from (`models.model_digest`, in its history;
    a checkpoint from before it was recorded is not checked)."""
    ran = state.get("history", {}).get("model_files")
    if ran is not None and ran != digest:
        changed = ", ".join(sorted(k for k in ran.keys() | digest.keys() if ran.get(k) != digest.get(k)))
        raise ValueError(
            f"--resume: {where} started from other --model files than those there now ({changed}: "
            f"edited, added, removed or another hub revision): the run would go on from another model. "
            f"Restore them, or start a new run."
        )


def refixed(saved: dict) -> str:
    """The settings a recorded config ran at another value than the one this version fixes (REMOVED),
    as one readable line ('' when none)."""
    return "; ".join(
        f"{k} {saved[k]!r} (now fixed at {v!r})"
        for k, v in REMOVED.items()
        if k not in RESUMABLE and v is not None and k in saved and saved[k] != v
    )


# Flags removed without a fixed value because they never changed an update: the vLLM engine's own sizes (f6e6ae1)
RETIRED = {"vllm_kv_cache_gib", "vllm_max_model_length", "vllm_enforce_eager"}


def from_record(saved: dict, **changes) -> Config:
    """The Config a run's config.json records, written by this version or an earlier one, with
    `changes` applied: a setting it lacks takes today's default, a setting that is no longer a flag
    (REMOVED) is dropped if it ran at the value this version fixes (or changes no update) and refused
    otherwise; a RETIRED one is dropped."""
    fixed = refixed(saved)
    if fixed:
        raise ValueError(f"the recorded run ran with {fixed}: this version cannot rerun it.")
    return Config(**{k: v for k, v in {**saved, **changes}.items() if k not in REMOVED and k not in RETIRED})
