"""Rollouts: batched sampling with a KV cache, one seeded stream per rollout (maths §0).

Legend: P prompts, G rollouts per prompt (contiguous: rows i*G .. i*G+G-1 share prompt i),
B = P*G rollouts, Lp padded prompt width, T completion width, V vocabulary. The layout of a step's
rollouts and the masks OAR reads are oar/rollout.py's (`Rollout`); the decode loops, eager (the default)
and fixed-shape (for a GPU to replay), are oar/decode_loops.py's.

Why a sampling loop of our own rather than `generate`: each rollout draws its randomness from its
own seeded generator (one uniform per token, inverse-CDF sampling), so a rollout is the same
whatever batch or process it lands in — one process and eight give the same rollouts, and a resumed
run replays the interrupted one. A call draws each rollout's uniforms as one row of a (B, T) table up
front (`torch.rand(T, generator=g)` is the same stream as T single draws: tests/package/test_sampler.py), so
the loop reads them on the device with no per-token work on the host. What is invariant: the
uniforms, exactly; the tokens, as far as the logits are: the batch a rollout is sampled in changes
the kernels' rounding, which can flip a token where two are nearly equally likely. `chunk` fixes the
batches: prompts are sampled `chunk` at a time, so a process that holds whole chunks of the step's
prompts samples them in the same shapes as one process holding all (train.py --rollout_batch_size).

The sampler also returns the log-probability of each sampled token under the distribution it sampled
from before top-p (log_softmax(logits / temperature), the trainer's `token_logprobs` definition):
train.py logs how far the update forward's log-probs are from them (sampler/logprob_diff_*), the
check that users of a separate inference engine watch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from oar.decode_loops import decode_eager, decode_static
from oar.lm import eval_mode
from oar.rollout import Rollout, build_rollout, concat_rollouts


DECODE_LOOPS = (
    "eager",
    "static",
    "compiled",
)  # decode(loop=...): the same rollouts in fixed shapes, for a GPU to replay
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def resolve_instruction(instruction: str, dataset: str, model: str = "") -> str:
    """The text appended to each problem: `instruction` as given, or for 'auto' the one a model folder
    records it was trained with (TRAINED_INSTRUCTION, which train.py writes into final/), else nothing on
    the built-in arith task or for the tiny-arith model, by name or folder (it knows only its own `#### N`
    format, whatever the data file), and the usual \\boxed{} request elsewhere."""
    if instruction != "auto":
        return instruction
    saved = Path(model) / TRAINED_INSTRUCTION if model else None
    if saved is not None and saved.is_file():  # eval.py on a trained model prompts as its training did
        return json.loads(saved.read_text())["instruction"]
    built = Path(model) / "build_info.json" if model else None  # a tiny-arith folder (shipped or built) records it
    tiny = model == "tiny-arith" or (
        built is not None
        and built.is_file()
        and str(json.loads(built.read_text()).get("builder", "")).startswith("tiny-arith")
    )
    return "" if dataset == "arith" or tiny else BOXED_INSTRUCTION


TRAINED_INSTRUCTION = (
    "oar_instruction.json"  # in a trained model's folder: {"instruction": the text its training used}
)


def format_prompt(tokenizer, problem: str, instruction: str = "") -> str:
    """The prompt text: the tokenizer's chat template when it has one, the plain problem otherwise."""
    content = f"{problem}\n{instruction}".strip() if instruction else problem
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
    return content + "\n"


def encode_prompts(tokenizer, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and attention mask, (N, Lp). A chat-templated prompt already holds its
    special tokens, so none are added a second time."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    ids, mask = left_pad(
        [tokenizer(p, add_special_tokens=not templated)["input_ids"] for p in prompts], tokenizer.pad_token_id
    )
    return ids.to(device), mask.to(device)


def left_pad(seqs: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists as left-padded ids and attention mask, (N, max length), on the CPU."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


@torch.no_grad()
def sample(
    model,
    tokenizer,
    prompts: list[str],
    *,
    group_size: int,
    seeds: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    chunk: int = 0,
    loop: str = "eager",
    on_token: Callable[[], None] | None = None,
) -> Rollout:
    """G rollouts for each of P prompt texts. `seeds` has one seed per rollout (B = P*G); with
    temperature 0 decoding is greedy and the seeds are unused. `chunk` > 0: sample `chunk` prompts
    at a time (their own padding, their own batch), the chunks' rollouts concatenated in order. `loop`:
    "eager" (the default), or the same steps in fixed shapes, "static" or "compiled" (`decode`).
    `on_token()`: called after each decode step of each chunk (a progress bar's tick; up to
    max_new_tokens per chunk, fewer when every row has ended)."""
    assert len(seeds) == len(prompts) * group_size, (len(seeds), len(prompts), group_size)
    if 0 < chunk < len(prompts):
        assert len(prompts) % chunk == 0, f"chunk {chunk} must divide the {len(prompts)} prompts"
        parts = [
            sample(
                model,
                tokenizer,
                prompts[k : k + chunk],
                group_size=group_size,
                seeds=seeds[k * group_size : (k + chunk) * group_size],
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                loop=loop,
                on_token=on_token,
            )
            for k in range(0, len(prompts), chunk)
        ]
        return concat_rollouts(parts, tokenizer.pad_token_id)
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, device)  # (P, Lp)
    stop = stop_token_ids(model, tokenizer)
    completion, logprobs = decode(
        model,
        prompt_ids,
        prompt_mask,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        eos_token_ids=stop,
        pad_token_id=tokenizer.pad_token_id,
        seeds=seeds,
        group_size=group_size,
        loop=loop,
        on_token=on_token,
    )
    prompt_ids = prompt_ids.repeat_interleave(group_size, dim=0)  # (B, Lp), groups contiguous
    prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0)
    return build_rollout(tokenizer, prompt_ids, prompt_mask, completion, stop, logprobs)


def generate(model, prompt_ids, prompt_mask, **kwargs) -> torch.Tensor:
    """`decode`'s completion ids alone (B, T)."""
    return decode(model, prompt_ids, prompt_mask, **kwargs)[0]


@torch.no_grad()
def decode(
    model,
    prompt_ids,
    prompt_mask,
    *,
    max_new_tokens,
    temperature,
    top_p,
    eos_token_ids,
    pad_token_id,
    seeds,
    group_size: int = 1,
    skip_draws: list[int] | None = None,
    loop: str = "eager",
    on_token: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Autoregressive sampling with a KV cache. (P, Lp) prompts -> ((B, T) completion ids, (B, T) float32
    log-probs of them), B = P x group_size (a prompt's rollouts contiguous), ids padded with
    `pad_token_id` (log-probs 0) after each row's EOS; T <= max_new_tokens. Each prompt is prefilled
    once and its keys/values copied to its G rollouts. `loop`: "eager", or the same steps in fixed shapes,
    "static" or "compiled" (oar/decode_loops.py). `skip_draws`: per row, how many draws of its seed's stream
    to pass over first (`decode_loops.draw_uniforms`), so that continuations
    of a rollout's prefixes of different lengths share their random numbers position by position
    (scripts/analysis/delta_v.py); None: none. Runs with every module in eval mode (each gets its own mode
    back after): a model the update left in training mode would sample with dropout, and its
    checkpointed layers drop the KV cache (transformers < 5.24), so each token would see itself alone."""
    assert loop in DECODE_LOOPS, loop
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        eos_token_ids=eos_token_ids,
        pad_token_id=pad_token_id,
        seeds=seeds,
        group_size=group_size,
        skip_draws=skip_draws,
        on_token=on_token,
    )
    with eval_mode(model):
        if loop == "eager":
            return decode_eager(model, prompt_ids, prompt_mask, **kwargs)
        return decode_static(model, prompt_ids, prompt_mask, compiled=loop == "compiled", **kwargs)


def stop_token_ids(model, tokenizer) -> set[int]:
    """Tokens that end a completion: the tokenizer's EOS and the model's generation-config EOS ids
    (chat models often stop on an end-of-turn token that is not the tokenizer's EOS)."""
    ids = {tokenizer.eos_token_id}
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(config_eos) if isinstance(config_eos, (list, tuple)) else {config_eos}
    return {int(i) for i in ids if i is not None}
