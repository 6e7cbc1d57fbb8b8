"""OAR's token credit inside TRL's GRPOTrainer: `OARGRPOTrainer`, the same trainer with token weights (docs/trl.md).

    from oar.integrations.trl import GRPOConfig, OARGRPOTrainer as GRPOTrainer  # a TRL script's one changed line

Legend: N processes, n this process's rows of a generation batch (per_device_train_batch_size x
steps_per_generation), B = N n the generation batch, G rollouts per prompt (num_generations), Lp prompt
width, T completion width, L = Lp + T.

Where OAR goes into TRL (trl 1.16): `_generate_and_score_completions` samples a generation batch, gathers
every process's rewards, forms A_i (B,) and keeps this process's rows; `_compute_loss` reads `advantages`
per token and accepts (n, T) ("to support subclasses that provide advantages with shape (B, T)"). This
subclass lets TRL do all of that, then, once per generation batch and before any update on it (so with
the policy that sampled it, as train.py's step 4), hands the loss A_it = A_i w_it (maths §1.2), w from
oar's credit table (oar.credit.METHODS, plus `credit_module`'s) computed by oar's own code:

  1. layout     every process's prompt and completion ids (gathered) -> oar.rollout.build_rollout's (b, L)
                layout, the reasoning and answer spans found in the completion's text (maths §0)
  2. partition  TRL slices the batch by rows, so a group may lie on two processes: each group's credit is
                computed by the process holding its first rollout (`credit_rows`). Every process's oar
                Step is then whole groups, as oar's protocol promises (TEMPO's trees), and what a method
                takes over the whole step it takes through step.gather with each rollout once
                (entropy-mask's threshold, random-gate's width)
  3. credit     oar.credit.step_credit: the method's prepare once, its weigh per micro-batch with a clean
                forward's logits, outcome and keys/values (oar.probes.clean_forward, as oar's update
                forward gives them), the model in eval mode (no dropout: one function of the weights, as
                in oar's loop, which turns dropout off) under TRL's autocast (the update's precision). Only
                runs of scored rollouts (A_i != 0 and a loss token) are weighed (`scored_runs`); the others
                get w = 1 and no forward: their weights enter neither the loss nor the diagnostics
  4. hand back  the processes' weights summed into (B, T) (each row from one process), this process's
                rows taken, A_it = A_i w_it; oar's diagnostics (maths §6) into TRL's metrics as oar/*

Departures from train.py, each because TRL owns that part:
  * the clean pass is one more no-grad forward of each scored rollout: TRL's update forward runs after the
    batch is shuffled and split, through a fused LM head that never forms the logits OAR's probe reads;
  * rollout seeds (OAR-G's noise, random-gate's draws): maths §0's formula, the generation batch's index
    for the step and the row in the generation batch for the slot: the same for any number of processes
    and after a resume, but not train.py's numbers (TRL samples other rollouts);
  * TRL's evaluation loss keeps A_i (a diagnostic; scoring it would cost what training does).
What TRL would do that OAR cannot honour stops the build in one line (`refusal`).
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import trl
from accelerate.utils import gather_object
from trl import GRPOConfig  # noqa: F401 (re-exported: a script's one changed line can be its trl import)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from oar.credit import METHODS, CreditError, CreditMethod, CreditSettings, credit_methods, step_credit
from oar.gating import weight_stats
from oar.probes import clean_forward, outcome_from_logits
from oar.rollout import Rollout, build_rollout

logger = logging.getLogger(__name__)

TESTED_TRL = "1.16."  # the release whose private methods this subclass overrides (requirements-trl.txt)
CREDIT_FILE = "oar_credit.json"  # in each checkpoint: the credit it trained with, which a resume must match
TEMPO_PREPARE = METHODS["tempo"].prepare  # tempo and oar-g+tempo: reads the rewards, weights may be < 0
SIGN_READING_LOSSES = ("sapo", "vespo")  # choose a rollout's temperature / gamma by its advantage's sign


@dataclass(frozen=True)
class OARSettings:
    """OAR's settings for a TRL run: train.py's flags of the same names and defaults (oar.credit.CreditSettings).
    The rest of what oar's credit reads comes from TRL's config: temperature, num_generations,
    mask_truncated_completions; the gate's floor and mass preservation and OAR-P's window are oar's constants."""

    gate_quantile: float = CreditSettings.gate_quantile
    """q of the bi-level gate: scores below the q-quantile are suppressed (maths §5)."""
    gate_boost: float = CreditSettings.gate_boost
    """kappa of the bi-level gate: boost of scores above the quantile."""
    probe: str = CreditSettings.probe
    """Outcome probe: last | answer_mean | answer_joint (maths §2)."""
    noise_std: float = CreditSettings.noise_std
    """OAR-G: std of the Gaussian noise on the reasoning positions' embeddings (maths §4)."""
    perturb_mode: str = CreditSettings.perturb_mode
    """OAR-P: exact | window | auto (maths §3.3)."""

    def __post_init__(self):
        for ok, problem in (
            (0 < self.gate_quantile < 1, f"gate_quantile={self.gate_quantile} must lie in (0, 1)"),
            (self.gate_boost >= 0, f"gate_boost={self.gate_boost} must be >= 0"),
            (self.noise_std >= 0, f"noise_std={self.noise_std} must be >= 0"),
            (
                self.probe in ("last", "answer_mean", "answer_joint"),
                f"probe={self.probe!r}: choose last, answer_mean or answer_joint",
            ),
            (
                self.perturb_mode in ("exact", "window", "auto"),
                f"perturb_mode={self.perturb_mode!r}: choose exact, window or auto",
            ),
        ):
            if not ok:
                raise CreditError(f"OARSettings: {problem}.")


@dataclass
class CreditRecord:
    """The last generation batch's credit on this process, for a look (and the tests)."""

    weights: torch.Tensor  # (n, T) w_it on TRL's completion columns, 0 on padding
    advantages: torch.Tensor  # (n,) TRL's A_i
    seeds: list[int]  # (n,) the rollouts' seeds


def credit_rows(process: int, n: int, group_size: int) -> slice:
    """The rows of the generation batch whose credit `process` computes: the whole groups whose first rollout
    is among its TRL rows [process n, (process + 1) n). n = 6, G = 4: process 0 rows 0..7, process 1 8..11;
    n = 2, G = 4: process 0 rows 0..3, process 1 none."""
    first = -(-process * n // group_size) * group_size
    return slice(first, -(-(process + 1) * n // group_size) * group_size)


def scored_runs(scored: torch.Tensor, size: int) -> list[slice]:
    """The micro-batches the credit weighs: each run of consecutive scored rows (b,), cut every `size` rows. The
    other rows get w = 1 without a forward: their weights enter neither the loss (A_i = 0 or no loss token) nor
    the diagnostics, and oar's loop, which has their forward for free from its update, gives them 1 too.
    [F T T T F F T], size 2: rows 1-2, 3, 6."""
    runs, start = [], None
    for i, s in enumerate(scored.tolist() + [False]):
        if s and start is None:
            start = i
        elif not s and start is not None:
            runs += [slice(a, min(a + size, i)) for a in range(start, i, size)]
            start = None
    return runs


def rollout_seed(seed: int, generation: int, row: int, group_size: int) -> int:
    """maths §0's rollout seed, with the generation batch's index as the step and its row as p G + g."""
    return (seed * 1_000_003 + generation) * 10_007 * group_size + row


def refusal(method: CreditMethod, args, *, tools: bool, vision: bool, sharded: bool) -> str | None:
    """Why OAR cannot honour this TRL run, in one line with the fix, or None. `args`: the GRPOConfig."""
    if not trl.__version__.startswith(TESTED_TRL):
        return (
            f"trl {trl.__version__}: OARGRPOTrainer overrides TRL {TESTED_TRL}x's internals; "
            "pip install -r requirements-trl.txt"
        )
    if tools:  # multi-turn completions: end-of-turn tokens inside, tool output the model did not write
        return (
            "tools / environment_factory: OAR's layout is one completion the model wrote, ended by its first EOS; "
            "train multi-turn runs with trl.GRPOTrainer"
        )
    if not method.scores:  # w = 1: TRL's own loss, whatever TRL does
        return None
    if vision:
        return (
            f"credit {method.name!r}: OAR's forwards read token ids only, not images; use credit='grpo' for a "
            "vision-language model"
        )
    if sharded:
        return (
            f"credit {method.name!r} with FSDP or DeepSpeed ZeRO-3: OAR's forwards run on each process's whole model, "
            f"which sharding splits (train.py gathers it for them); use DDP or ZeRO-1/2"
        )
    if args.top_entropy_quantile < 1.0:
        return (
            f"top_entropy_quantile={args.top_entropy_quantile} with credit {method.name!r}: TRL's entropy mask would "
            f"multiply OAR's weights (two credit methods); set it to 1.0, or use credit='entropy-mask'"
        )
    if method.prepare is TEMPO_PREPARE and args.multi_objective_aggregation != "sum_then_normalize":
        return (
            f"credit {method.name!r} with multi_objective_aggregation={args.multi_objective_aggregation!r}: TEMPO's "
            f"values are mean rewards, which that aggregation does not form; use 'sum_then_normalize'"
        )
    if method.prepare is TEMPO_PREPARE and sign_reading(args):
        return (
            f"credit {method.name!r} with {sign_reading(args)}: TEMPO's weights can flip a token's sign, and that "
            "loss "
            "reads each token's sign where TRL reads the rollout's; use loss_type='grpo' and no "
            "off_policy_mask_threshold"
        )
    return None


def sign_reading(args) -> str:
    """The setting by which TRL's loss reads the advantage's sign (then token weights must not flip it), or ''."""
    if args.loss_type in SIGN_READING_LOSSES:
        return f"loss_type={args.loss_type!r}"
    return (
        f"off_policy_mask_threshold={args.off_policy_mask_threshold}"
        if args.off_policy_mask_threshold is not None
        else ""
    )


def reward_sums(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each rollout's reward as TRL's sum_then_normalize forms it: per_function (B, F), weights (F,) -> (B,),
    NaN where every function returned None (TRL gives that rollout A_i = 0)."""
    total = (per_function * weights.to(per_function.device)[None]).nansum(1)
    return total.masked_fill(per_function.isnan().all(1), float("nan"))


def rollout_of(tokenizer, sampled: list[tuple[list[int], list[int]]], eos_token_ids: list[int], device) -> Rollout:
    """oar's layout (b, L) of TRL's rollouts, (prompt ids, completion ids) as TRL sampled them: TRL cut each
    completion at its first EOS (kept) or at max_completion_length. b = 0 gives an empty layout."""
    pad, eos = tokenizer.pad_token_id, set(eos_token_ids)
    if not sampled:
        empty = torch.zeros((0, 0), dtype=torch.long, device=device)
        flag = empty.bool()
        return Rollout(empty, empty, flag, flag, flag, torch.zeros(0, dtype=torch.bool, device=device), [], 0)
    for prompt, completion in sampled:
        if eos & set(completion[:-1]):  # (a rollout_func's) oar's layout ends a completion at its first EOS
            raise CreditError(
                f"a completion goes on after an EOS token ({completion[:12]}...): OAR reads a completion "
                f"as ending at its first EOS; cut completions there"
            )
    lp, t = max(len(p) for p, _ in sampled), max(1, max(len(c) for _, c in sampled))
    prompt_ids = torch.full((len(sampled), lp), pad, dtype=torch.long)
    prompt_mask = torch.zeros((len(sampled), lp), dtype=torch.long)
    completion = torch.full((len(sampled), t), min(eos), dtype=torch.long)  # a filler EOS, replaced below
    for i, (p, c) in enumerate(sampled):
        prompt_ids[i, lp - len(p) :], prompt_mask[i, lp - len(p) :] = torch.tensor(p, dtype=torch.long), 1
        completion[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    ro = build_rollout(tokenizer, prompt_ids.to(device), prompt_mask.to(device), completion.to(device), eos_token_ids)
    # The completion is TRL's tokens exactly: the filler ended a row without EOS (build_rollout would read on),
    # one column too late; cut it, so the layout's masks are TRL's.
    lengths = torch.tensor([len(c) for _, c in sampled], device=device)
    real = torch.cat(
        [
            torch.zeros_like(prompt_mask, dtype=torch.bool).to(device),
            torch.arange(t, device=device)[None] < lengths[:, None],
        ],
        dim=1,
    )  # (b, L)
    attention = torch.cat([prompt_mask.to(device), real[:, lp:].long()], dim=1)
    truncated = torch.tensor([not c or c[-1] not in eos | {pad} for _, c in sampled], device=device)  # TRL's
    return replace(
        ro,
        input_ids=ro.input_ids.masked_fill(attention == 0, pad),
        attention_mask=attention,
        completion_mask=real,
        reasoning_mask=ro.reasoning_mask & real,
        answer_mask=ro.answer_mask & real,
        truncated=truncated,
    )


@contextmanager
def eval_mode(model):
    """The model in eval mode (no dropout, no checkpointing), its mode restored after."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


class OARGRPOTrainer(trl.GRPOTrainer):
    """trl.GRPOTrainer with token credit: the loss takes A_it = A_i w_it (module docstring). The arguments are
    GRPOTrainer's, plus `credit`, a method of oar's table ('oar-g' by default, 'grpo' is TRL's own run), and
    `credit_module`, a module whose CREDIT_METHODS join the table (docs/credit-methods.md); `settings` are
    OAR's (OARSettings: the gate, the probe, OAR-G's noise, OAR-P's mode)."""

    def __init__(
        self,
        *args,
        credit: str = "oar-g",
        credit_module: str = "",
        settings: OARSettings | None = None,
        **kwargs,
    ):
        table = credit_methods(credit_module)  # a module that does not load stops here, in one line
        if credit not in table:
            raise CreditError(f"credit {credit!r}: choose one of {', '.join(table)}")
        self.oar_method, self.oar_module = table[credit], credit_module
        self.oar_settings = settings if settings is not None else OARSettings()
        self.last_credit: CreditRecord | None = None
        super().__init__(*args, **kwargs)
        deepspeed = self.accelerator.state.deepspeed_plugin
        problem = refusal(
            self.oar_method,
            self.args,
            tools=bool(self.tools) or self.environment_factories is not None,
            vision=self._is_vlm,
            sharded=self.is_fsdp_enabled or (deepspeed is not None and deepspeed.zero_stage == 3),
        )
        if problem:
            raise CreditError(f"OARGRPOTrainer: {problem}.")

    # -- what TRL sampled and scored, kept for the credit ------------------------------------------

    def _generate(self, prompts: list):
        out = super()._generate(prompts)
        self._oar_sampled = out[0], out[1], out[2]  # this process's prompt ids, completion ids, tool mask
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self._oar_rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._oar_rewards  # (B, reward functions): every process's rows

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:  # evaluation: TRL's loss with A_i (module docstring)
            return out
        weights = self._token_weights(out)  # (n, T)
        out["advantages"] = out["advantages"][:, None] * weights  # A_it = A_i w_it
        return out

    # -- the credit --------------------------------------------------------------------------------

    def _token_weights(self, out: dict) -> torch.Tensor:
        """w (n, T) for this process's rows of the generation batch TRL just scored (module docstring, 1-4)."""
        acc, method, group = self.accelerator, self.oar_method, self.num_generations
        prompts, completions, tool_mask = self._oar_sampled
        if tool_mask is not None:
            raise CreditError(
                "OARGRPOTrainer: rollout_func returned an env_mask: OAR's layout is one completion "
                "the model wrote; train multi-turn runs with trl.GRPOTrainer."
            )
        start = time.perf_counter()
        # 1. every process's rollouts, rewards, A_i and loss tokens (TRL's: none for a masked truncated one)
        everyone = gather_object(list(zip(prompts, completions)))  # B (prompt ids, completion ids)
        n, width = len(prompts), out["completion_ids"].shape[1]
        advantages = acc.gather(out["advantages"])  # (B,)
        has_tokens = acc.gather(out["completion_mask"].any(1).long()).bool()  # (B,)
        rewards = reward_sums(self._oar_rewards, self.reward_weights)  # (B,)
        ga = self.args.gradient_accumulation_steps  # the generation batch's index, restored on a resume:
        generation = (self.state.global_step * ga + self._step % ga) // (
            self.args.steps_per_generation * self.num_iterations
        )
        seeds = [rollout_seed(self.args.seed, generation, i, group) for i in range(len(everyone))]
        # 2. this process's credit rows: whole groups; 3. their weights (b, L) in oar's layout
        own = credit_rows(acc.process_index, n, group)
        if method.prepare is TEMPO_PREPARE and rewards[own].isnan().any():
            raise CreditError(
                f"credit {method.name!r}: every reward function returned None for some rollouts; "
                f"TEMPO's values need each rollout's reward."
            )
        ro = rollout_of(self._tokenizer, everyone[own], self.eos_token_ids, acc.device)
        scored = (advantages[own] != 0) & has_tokens[own] & method.scores  # (b,) train.py's step 4
        mine, nonfinite = self._weigh(ro, rewards[own], advantages[own], scored, seeds[own])
        # 4. (B, T) from every process (each row from one), this process's rows of it
        full = torch.zeros(len(everyone), max(width, max(len(c) for _, c in everyone)), device=acc.device)
        full[own, : mine.shape[1] - ro.prompt_width] = mine[:, ro.prompt_width :]
        if acc.num_processes > 1:
            full = acc.reduce(full, "sum")
        local = slice(acc.process_index * n, (acc.process_index + 1) * n)
        weights = full[local, :width]  # (n, T)
        flipped = (weights < 0) & out["completion_mask"].bool() & (out["advantages"] != 0)[:, None]
        if sign_reading(self.args) and flipped.any():
            raise CreditError(
                f"credit {method.name!r} made a weight < 0 and {sign_reading(self.args)} reads each token's "
                f"sign where TRL reads the rollout's; use loss_type='grpo' and no off_policy_mask_threshold."
            )
        self._log_credit(ro, mine, scored, nonfinite, len(everyone), time.perf_counter() - start)
        self.last_credit = CreditRecord(weights, out["advantages"], seeds[local])
        return weights

    def _weigh(self, ro: Rollout, rewards, advantages, scored, seeds) -> tuple[torch.Tensor, int]:
        """The method's weights (b, L) on the layout `ro` (this process's credit rows), and how many rollouts had
        non-finite scores: train.py's steps 4 and 5c, with a clean forward of our own for the update's."""
        acc, method, s = self.accelerator, self.oar_method, self.oar_settings
        settings = CreditSettings(
            method=method.name,
            credit_module=self.oar_module,
            **{f.name: getattr(s, f.name) for f in fields(s)},
            temperature=self.temperature,
            micro_batch_size=self.args.per_device_train_batch_size,
            group_size=self.num_generations,
            mask_truncated=self.mask_truncated_completions,
        )
        model, lp = acc.unwrap_model(self.model), ro.prompt_width
        if len(ro) == 0 and method.prepare is TEMPO_PREPARE:
            # TEMPO's prepare reads no other process, and oar.tempo.tempo_weights gives (0,), not (0, T), for no row
            return ro.input_ids.float(), 0
        weights, nonfinite = ro.completion_mask.float(), 0  # w = 1 where weigh is not called
        golds = [""] * len(ro)  # no built-in reads them; TRL has no gold-answer column to take them from
        with eval_mode(model), acc.autocast():
            weigh = step_credit(
                settings,
                model,
                self._tokenizer,
                ro,
                rewards,
                advantages,
                scored,
                seeds,
                golds,
                s.probe,
                gather=self._gather,
            )
            for rows in scored_runs(scored, max(1, self.args.per_device_train_batch_size)):
                mb, clean = ro.select(rows), None
                # what oar's update forward hands a method (oar/training/update.py, step c), from our own forward
                with torch.no_grad():
                    keep = mb.input_ids.shape[1] - lp + 1  # logits from column Lp - 1
                    logits, kv = clean_forward(
                        model, mb.input_ids, mb.attention_mask, logits_to_keep=keep, keep_cache=method.uses_clean
                    )
                if method.uses_clean:
                    ids, answer = mb.input_ids[:, lp - 1 :], mb.answer_mask[:, lp - 1 :]
                    clean = outcome_from_logits(logits, ids, answer, s.probe)
                w, _, bad = weigh(rows, mb, logits, clean, kv)
                weights[rows], nonfinite = w.float(), nonfinite + bad
        return weights, nonfinite

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every process's 1-D `x` concatenated in process order (the lengths may differ): oar's step.gather."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return x
        counts = acc.gather(torch.tensor([x.numel()], device=acc.device)).tolist()
        if max(counts) == 0:
            return x
        padded = acc.gather(acc.pad_across_processes(x.to(acc.device), dim=0)).view(acc.num_processes, -1)
        return torch.cat([padded[k, :c] for k, c in enumerate(counts)]).to(x.device)

    def _log_credit(
        self,
        ro: Rollout,
        weights: torch.Tensor,
        scored: torch.Tensor,
        nonfinite: int,
        rollouts: int,
        seconds: float,
    ) -> None:
        """maths §6's oar/ diagnostics of the generation batch, every process's rows counted once, into TRL's
        metrics (averaged over the logging window, sent to report_to's trackers)."""
        acc = self.accelerator
        all_sum = (lambda t: t) if acc.num_processes == 1 else (lambda t: acc.reduce(t.to(acc.device), "sum"))
        stats = weight_stats(
            weights,
            ro.reasoning_mask & scored[:, None],
            all_sum=all_sum,
            all_max=lambda t: acc.gather(t.to(acc.device)),
        )
        has_answer = ro.answer_mask.any(1)
        counts = torch.tensor(
            [(~has_answer).sum(), (scored & has_answer).sum(), nonfinite, seconds], dtype=torch.float64
        )
        no_answer, scored_n, nonfinite_n, seconds = all_sum(counts).tolist()
        logged = {
            **stats,
            "frac_no_answer": no_answer / rollouts,
            "frac_scored": scored_n / rollouts,
            "frac_nonfinite_scores": nonfinite_n / rollouts,
            "seconds_per_rollout": seconds / rollouts,
        }
        for key, value in logged.items():
            self._metrics["train"][f"oar/{key}"].append(float(value))
        if nonfinite_n:
            logger.warning(f"{int(nonfinite_n)} rollouts had non-finite OAR scores; they got plain GRPO weights")

    # -- checkpoints: the credit they trained with -------------------------------------------------

    def _credit_record(self) -> dict:
        return {
            "credit": self.oar_method.name,
            "credit_module": self.oar_module,
            "settings": asdict(self.oar_settings),
        }

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            (folder / CREDIT_FILE).write_text(json.dumps(self._credit_record(), indent=1))

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is not None:
            saved, now = Path(checkpoint) / CREDIT_FILE, self._credit_record()
            if not saved.exists():
                logger.warning(
                    f"{checkpoint} has no {CREDIT_FILE} (a trl.GRPOTrainer checkpoint?): its steps ran "
                    f"without this trainer's credit {now['credit']!r}"
                )
            elif (old := json.loads(saved.read_text())) != now:
                raise CreditError(
                    f"resume from {checkpoint}: it trained with {old}, this trainer has {now}; resume "
                    f"with the same credit, credit_module and settings, or start a new output_dir."
                )
        super()._load_optimizer_and_scheduler(checkpoint)
