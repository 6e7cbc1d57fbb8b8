"""Rollouts: batched sampling with a KV cache, and the masks OAR needs (SPEC §2).

Legend: P prompts, G rollouts per prompt (contiguous: rows i*G .. i*G+G-1 share prompt i),
B = P*G rollouts, Lp padded prompt width, T completion width, L = Lp + T, V vocabulary.

Layout of every sequence: [left padding | prompt | completion | right padding], so the completion
starts at column Lp in every row. The completion is the generated tokens up to and including the
EOS that ends it (EOS is inside `completion_mask`: stopping earns credit); a rollout that hits
`max_new_tokens` without EOS is `truncated`. The completion text is split with
`answers.find_answer` into reasoning (before the final-answer marker) and answer (the extracted
answer's characters) and mapped back to tokens:
  reasoning_mask  tokens that end before the marker starts
  answer_mask     tokens that overlap the answer's character span
Both are empty for a rollout with no final answer (it gets plain GRPO weights).

Why a sampling loop of our own rather than `generate`: each rollout draws its randomness from its
own seeded generator (one uniform per token, inverse-CDF sampling), so a rollout is the same
whatever batch or process it lands in — one process and eight give the same rollouts, and a resumed
run replays the interrupted one. A call draws each rollout's uniforms as one row of a (B, T) table up
front (`torch.rand(T, generator=g)` is the same stream as T single draws: tests/test_sampler.py), so
the loop reads them on the device with no per-token work on the host. What is invariant: the
uniforms, exactly; the tokens, as far as the logits are: the batch a rollout shares changes the
kernels' rounding, which can flip a token where two are nearly equally likely (docs/sampler.md).

The sampler also returns the log-probability of each sampled token under the distribution it sampled
from before top-p (log_softmax(logits / temperature), the trainer's `token_logprobs` definition):
train.py logs how far the update forward's log-probs are from them (sampler/logprob_diff_*), the
check that users of a separate inference engine watch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oar.training.models import position_ids
from oar.answers import find_answer


@dataclass
class Rollout:
    input_ids: torch.Tensor  # (B, L) long
    attention_mask: torch.Tensor  # (B, L) long
    completion_mask: torch.Tensor  # (B, L) bool: generated tokens through EOS
    reasoning_mask: torch.Tensor  # (B, L) bool
    answer_mask: torch.Tensor  # (B, L) bool
    truncated: torch.Tensor  # (B,) bool: no EOS within max_new_tokens
    texts: list[str]  # completion texts, special tokens removed
    prompt_width: int  # Lp: completions start at this column
    sample_logprobs: torch.Tensor | None = None  # (B, L) float32: the sampler's log-prob of each completion token, 0 elsewhere

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def loss_tokens(self, mask_truncated: bool) -> torch.Tensor:
        """(B, L) bool: the tokens the loss counts, the completion's, less truncated rollouts' under --mask_truncated."""
        return self.completion_mask & ~self.truncated[:, None] if mask_truncated else self.completion_mask

    def select(self, rows: slice) -> "Rollout":
        """The rollouts `rows` (a micro-batch), same layout."""
        return Rollout(
            self.input_ids[rows], self.attention_mask[rows], self.completion_mask[rows],
            self.reasoning_mask[rows], self.answer_mask[rows], self.truncated[rows], self.texts[rows],
            self.prompt_width, None if self.sample_logprobs is None else self.sample_logprobs[rows],
        )


BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def resolve_instruction(instruction: str, dataset: str, model: str = "") -> str:
    """The text appended to each problem: `instruction` as given, or for 'auto' nothing on the built-in
    arith task or for the tiny-arith model (it knows only its own `#### N` format, whatever the data
    file), and the usual \\boxed{} request elsewhere."""
    if instruction != "auto":
        return instruction
    return "" if dataset == "arith" or model == "tiny-arith" else BOXED_INSTRUCTION


def format_prompt(tokenizer, problem: str, instruction: str = "") -> str:
    """The prompt text: the tokenizer's chat template when it has one, the plain problem otherwise."""
    content = f"{problem}\n{instruction}".strip() if instruction else problem
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    return content + "\n"


def encode_prompts(tokenizer, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and attention mask, (N, Lp). A chat-templated prompt already holds its
    special tokens, so none are added a second time."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    encoded = [tokenizer(p, add_special_tokens=not templated)["input_ids"] for p in prompts]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, width - len(e):] = torch.tensor(e, dtype=torch.long)
        mask[i, width - len(e):] = 1
    return ids.to(device), mask.to(device)


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
) -> Rollout:
    """G rollouts for each of P prompt texts. `seeds` has one seed per rollout (B = P*G); with
    temperature 0 decoding is greedy and the seeds are unused."""
    assert len(seeds) == len(prompts) * group_size, (len(seeds), len(prompts), group_size)
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, device)  # (P, Lp)
    stop = stop_token_ids(model, tokenizer)
    completion, logprobs = decode(model, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                  eos_token_ids=stop, pad_token_id=tokenizer.pad_token_id, seeds=seeds, group_size=group_size)
    prompt_ids = prompt_ids.repeat_interleave(group_size, dim=0)  # (B, Lp), groups contiguous
    prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0)
    return build_rollout(tokenizer, prompt_ids, prompt_mask, completion, stop, logprobs)


def generate(model, prompt_ids, prompt_mask, **kwargs) -> torch.Tensor:
    """`decode`'s completion ids alone (B, T)."""
    return decode(model, prompt_ids, prompt_mask, **kwargs)[0]


@torch.no_grad()
def decode(model, prompt_ids, prompt_mask, *, max_new_tokens, temperature, top_p, eos_token_ids, pad_token_id, seeds,
           group_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Autoregressive sampling with a KV cache. (P, Lp) prompts -> ((B, T) completion ids, (B, T) float32
    log-probs of them), B = P x group_size (a prompt's rollouts contiguous), ids padded with
    `pad_token_id` (log-probs 0) after each row's EOS; T <= max_new_tokens. Each prompt is prefilled
    once and its keys/values copied to its G rollouts."""
    from transformers import DynamicCache

    b = prompt_ids.shape[0] * group_size
    assert len(seeds) == b, (len(seeds), b)
    # Row i's uniforms: the first max_new_tokens draws of its own generator, the same numbers as one draw per step.
    uniforms = torch.stack([torch.rand(max_new_tokens, generator=torch.Generator().manual_seed(int(s))) for s in seeds])
    uniforms = uniforms.to(prompt_ids.device)  # (B, max_new_tokens)
    eos = torch.tensor(sorted(eos_token_ids), device=prompt_ids.device)
    mask = prompt_mask
    pos = position_ids(mask)
    cache = DynamicCache()
    logits = model(input_ids=prompt_ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]
    if group_size > 1:  # the G rollouts of a prompt share its prefill
        cache.batch_repeat_interleave(group_size)
        logits, mask, pos = (x.repeat_interleave(group_size, dim=0) for x in (logits, mask, pos))
    next_pos = pos[:, -1:] + 1
    done = torch.zeros(b, dtype=torch.bool, device=prompt_ids.device)
    tokens, logprobs = [], []
    for t in range(max_new_tokens):
        z = logits.float()
        token = _pick(z, temperature, top_p, uniforms[:, t]).masked_fill(done, pad_token_id)
        logp = torch.log_softmax(z / (temperature or 1.0), dim=-1).gather(-1, token[:, None]).squeeze(-1)
        tokens.append(token)
        logprobs.append(logp.masked_fill(done, 0.0))
        done = done | torch.isin(token, eos)
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos, past_key_values=cache,
                       use_cache=True).logits[:, -1]
        next_pos = next_pos + 1
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)


def _pick(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse-CDF sampling with the row's uniform u (B,); greedy at temperature 0.
    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    probs, order = probs.sort(dim=-1, descending=True)
    if top_p < 1.0:
        probs = probs * ((probs.cumsum(-1) - probs) < top_p)  # the most likely token is always kept
    cdf = probs.cumsum(-1)
    choice = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).clamp(max=cdf.shape[-1] - 1)
    return order.gather(-1, choice).squeeze(-1)


def build_rollout(tokenizer, prompt_ids, prompt_mask, completion, eos_token_ids, logprobs=None) -> Rollout:
    """Assemble the (B, L) layout and the masks from prompts (B, Lp) and completions (B, T), with the
    sampler's log-probs (B, T) of the completion tokens when given."""
    b, width = prompt_ids.shape
    eos = torch.tensor(sorted(eos_token_ids), device=completion.device)
    is_eos = torch.isin(completion, eos)
    first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full_like(is_eos[:, 0], completion.shape[1], dtype=torch.long))
    cols = torch.arange(completion.shape[1], device=completion.device)
    gen_mask = cols[None] <= first_eos[:, None]  # through EOS (or everything, when truncated)
    truncated = ~is_eos.any(1)

    reasoning = torch.zeros_like(gen_mask)
    answer = torch.zeros_like(gen_mask)
    texts = []
    for i in range(b):
        content = completion[i, : int(first_eos[i])].tolist()  # tokens before EOS
        text, offsets = char_offsets(tokenizer, content)
        texts.append(text)
        span = find_answer(text)
        if span is None:
            continue
        for t, (start, end) in enumerate(offsets):
            reasoning[i, t] = end <= span.marker_start and end > start
            answer[i, t] = start < span.end and end > span.start

    pad = lambda m: torch.cat([torch.zeros_like(prompt_mask, dtype=torch.bool), m], dim=1)
    return Rollout(
        input_ids=torch.cat([prompt_ids, completion.masked_fill(~gen_mask, tokenizer.pad_token_id)], dim=1),
        attention_mask=torch.cat([prompt_mask, gen_mask.long()], dim=1),
        completion_mask=pad(gen_mask),
        reasoning_mask=pad(reasoning),
        answer_mask=pad(answer),
        truncated=truncated,
        texts=texts,
        prompt_width=width,
        sample_logprobs=None if logprobs is None else torch.cat([torch.zeros_like(prompt_mask, dtype=torch.float32),
                                                                 logprobs.float().masked_fill(~gen_mask, 0.0)], dim=1),
    )


def char_offsets(tokenizer, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """Decoded text and each token's (start, end) character span in it, in linear time.

    Fast tokenizers stream-decode (`tokenizers.decoders.DecodeStream`): a token that only starts a
    character split over byte-level tokens gets an empty span and the token completing it gets the
    character. Otherwise tokens are decoded one by one; where neither reproduces the full decode
    (rare decoders), the spans come from decoding growing prefixes, which is quadratic."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    pieces = _streamed_pieces(tokenizer, ids)
    if pieces is None or "".join(pieces) != text:
        pieces = [tokenizer.decode([t], skip_special_tokens=True) for t in ids]
    if "".join(pieces) == text:
        ends = torch.tensor([len(p) for p in pieces], dtype=torch.long).cumsum(0).tolist() if pieces else []
    else:
        ends = [len(tokenizer.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]
    starts = [0] + ends[:-1]
    return text, list(zip(starts, ends))


def _streamed_pieces(tokenizer, ids: list[int]) -> list[str] | None:
    """The text each token adds when decoding left to right ('' while a character is incomplete),
    or None for tokenizers without a `tokenizers` backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=True)
    try:
        return [stream.step(backend, t) or "" for t in ids]
    except Exception:  # a decoder the stream does not support: fall back
        return None


def stop_token_ids(model, tokenizer) -> set[int]:
    """Tokens that end a completion: the tokenizer's EOS and the model's generation-config EOS ids
    (chat models often stop on an end-of-turn token that is not the tokenizer's EOS)."""
    ids = {tokenizer.eos_token_id}
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(config_eos) if isinstance(config_eos, (list, tuple)) else {config_eos}
    return {int(i) for i in ids if i is not None}


def with_reference_answer(rollout: Rollout, tokenizer, golds: list[str], template: str):
    """`outcome_source=reference` (the authors' code): keep each rollout's prompt and reasoning where
    they are, replace what follows by `template` filled with the gold answer, and mark the gold
    answer's tokens. Returns (input_ids, attention_mask, reasoning_mask, answer_mask), each (B, L');
    reasoning positions are the rollout's own, so scores on them map back one to one."""
    rows = []
    for i, gold in enumerate(golds):
        text = template.format(answer=gold)
        start = template.index("{answer}")  # the gold answer's characters are text[start : start + len(gold)]
        prefix = tokenizer(text[:start], add_special_tokens=False)["input_ids"]
        answer = tokenizer(gold, add_special_tokens=False)["input_ids"]
        suffix = tokenizer(text[start + len(gold):], add_special_tokens=False)["input_ids"]
        reasoning = rollout.reasoning_mask[i].nonzero().flatten()
        cut = int(reasoning[-1]) + 1 if reasoning.numel() else rollout.prompt_width
        rows.append((rollout.input_ids[i, :cut].tolist(), rollout.attention_mask[i, :cut].tolist(), prefix, answer, suffix))
    width = max(len(ids) + len(p) + len(a) + len(s) for ids, _, p, a, s in rows)
    device = rollout.input_ids.device
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    answer_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    reasoning_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    keep = min(width, rollout.reasoning_mask.shape[1])
    reasoning_mask[:, :keep] = rollout.reasoning_mask[:, :keep].cpu()
    for i, (ids, att, p, a, s) in enumerate(rows):
        seq = ids + p + a + s
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = torch.tensor(att + [1] * (len(p) + len(a) + len(s)))
        answer_mask[i, len(ids) + len(p) : len(ids) + len(p) + len(a)] = True
    return input_ids.to(device), attention.to(device), reasoning_mask.to(device), answer_mask.to(device)
