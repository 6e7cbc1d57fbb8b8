"""A credit method's trial: one call shaped like a training step, on a tiny synthetic batch, right after
the model loads and before anything is evaluated or written.

Why: a method of one's own (`--credit_module`) that returns the wrong shape, non-finite weights,
raises, or draws unseeded randomness would otherwise surface only at step 1's update, after the
before-training evaluation (minutes on a real model), as a traceback, with config.json and an empty
metrics.jsonl already written. The trial makes the calls train.py's steps 4-5 make for one micro-batch
(the update forward, the clean outcome when the method reuses it, `step_credit`'s prepare and weigh)
on G made-up completions of one training problem (half with the gold answer, half with a wrong one,
one without any), twice, and checks what the loss relies on: weights of the micro-batch's shape
(step_credit's check), finite (idem), and the same on the second call (a method's weights must be a
function of the step, or a resume and a second process would see other ones).

Legend: G rollouts (one prompt's group), L = Lp + T positions, V vocabulary.
"""

from __future__ import annotations

import traceback
from typing import Callable

import torch

from oar.credit import METHODS, CreditError, CreditSettings, MethodRaised, credit_methods, step_credit
from oar.grpo import group_advantages
from oar.probes import clean_forward, outcome_from_logits
from oar.rewards import reward
from oar.rollout import build_rollout
from oar.sampler import encode_prompts, format_prompt


def synthetic_step(tokenizer, problem: str, gold: str, group_size: int, instruction: str, device):
    """One prompt and `group_size` made-up completions: '<problem> #### <gold>' (even rows), a wrong
    answer (odd rows), and, in the last row of a group of 3 or more, no answer at all; each ends in EOS.
    Returns the Rollout (G rows) and the golds."""
    wrong = f"{gold}1"
    texts = [f"{problem} #### {gold if i % 2 == 0 else wrong}" for i in range(group_size)]
    if group_size >= 3:
        texts[-1] = problem  # no final answer: weights 1 by the protocol's convention
    eos = tokenizer.eos_token_id
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts]
    width = max(map(len, ids))
    completion = torch.full((group_size, width), tokenizer.pad_token_id, dtype=torch.long)
    for i, row in enumerate(ids):
        completion[i, : len(row)] = torch.tensor(row)
    prompt_ids, prompt_mask = encode_prompts(
        tokenizer, [format_prompt(tokenizer, problem, instruction)] * group_size, "cpu"
    )
    ro = build_rollout(tokenizer, prompt_ids, prompt_mask, completion, {eos})
    for name in ("input_ids", "attention_mask", "completion_mask", "reasoning_mask", "answer_mask", "truncated"):
        setattr(ro, name, getattr(ro, name).to(device))
    return ro, [gold] * group_size


def try_credit(
    settings: CreditSettings,
    model,
    tokenizer,
    problem: str,
    gold: str,
    *,
    instruction: str,
    probe: str,
    device,
    keep_cache: bool = True,
    gather: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
) -> None:
    """Run `settings.method` twice on a synthetic step (module docstring); CreditError naming the
    method and what it did wrong, else None. A method from --credit_module that raises is reported in
    one line with the file and line it raised at; a built-in's exception propagates (a bug, with its
    traceback). `keep_cache`: hand the method the clean keys/values, as train.py does without
    gradient checkpointing."""
    method = credit_methods(settings.credit_module)[settings.method]
    ro, golds = synthetic_step(tokenizer, problem, gold, settings.group_size, instruction, device)
    rewards = torch.tensor([reward(t, g) for t, g in zip(ro.texts, golds)], device=device)
    advantages = group_advantages(rewards, settings.group_size)  # (G,)
    scored = ro.completion_mask.any(1)  # (G,) every rollout, as --score_all: the method is exercised on each
    seeds = list(range(len(ro)))
    lp = ro.prompt_width
    reuse = method.uses_clean

    def once() -> torch.Tensor:
        with torch.no_grad():  # the update forward's logits, detached as train.py hands them over
            logits, kv = clean_forward(
                model,
                ro.input_ids,
                ro.attention_mask,
                logits_to_keep=ro.input_ids.shape[1] - lp + 1,
                keep_cache=reuse and keep_cache,
            )
        clean = (
            outcome_from_logits(logits, ro.input_ids[:, lp - 1 :], ro.answer_mask[:, lp - 1 :], probe)
            if reuse
            else None
        )
        weigh = step_credit(
            settings, model, tokenizer, ro, rewards, advantages, scored, seeds, golds, probe, gather=gather
        )
        return weigh(slice(0, len(ro)), ro, logits, clean, kv)[0]  # shape and finiteness checked there

    # The global random state is left as it was: the run's numbers are those it would have without the trial.
    try:
        with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []):
            first, second = once(), once()
    except MethodRaised as err:  # prepare or weigh raised (oar.credit.user_call names where)
        raise CreditError(f"{str(err).removesuffix('.')}, on a synthetic step tried before training.") from None
    except CreditError:
        raise
    except Exception as err:
        if settings.method in METHODS:
            raise
        where = traceback.extract_tb(err.__traceback__)[-1]
        raise CreditError(
            f"credit method {settings.method!r} (--credit_module {settings.credit_module}) raised "
            f"{type(err).__name__}: {err} at {where.filename}:{where.lineno}, on a synthetic step of "
            f"{len(ro)} rollouts tried before training."
        ) from None
    # Two calls on one step must agree; a tolerance, not equality, because GPU kernels may add in another order.
    if not torch.allclose(first, second, rtol=1e-4, atol=1e-5):
        raise CreditError(
            f"credit method {settings.method!r}: two calls on the same step gave different weights "
            f"(largest difference {float((first - second).abs().max()):.3g}); draw randomness from "
            f"step.seeds (each rollout's own seed), so a resume and every process see the same weights."
        )
