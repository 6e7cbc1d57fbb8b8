"""A step's rollouts: the (B, L) layout, the masks OAR needs (maths §0), and the sampler's log-probs.

Legend: P prompts, G rollouts per prompt (contiguous: rows i*G .. i*G+G-1 share prompt i),
B = P*G rollouts, Lp padded prompt width, T completion width, L = Lp + T.

Layout of every sequence: [left padding | prompt | completion | right padding], so the completion
starts at column Lp in every row. The completion is the generated tokens up to and including the
EOS that ends it (EOS is inside `completion_mask`: stopping earns credit); a rollout that hits
`max_new_tokens` without EOS is `truncated`. The completion text is split with
`answers.find_answer` into reasoning (before the final-answer marker) and answer (the extracted
answer's characters) and mapped back to tokens:
  reasoning_mask  tokens that end before the marker starts
  answer_mask     tokens that overlap the answer's character span
(a byte-level token that holds only the first bytes of a character, perhaps after a space, counts as
holding that character: `held_spans`).
Both are empty for a rollout with no final answer (it gets plain GRPO weights).
Sampling itself is oar/sampler.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    sample_logprobs: torch.Tensor | None = (
        None  # (B, L) float32: the sampler's log-prob of each completion token, 0 elsewhere
    )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def loss_tokens(self, mask_truncated: bool) -> torch.Tensor:
        """(B, L) bool: the tokens the loss counts: the completion's, less truncated rollouts' under
        --mask_truncated."""
        return self.completion_mask & ~self.truncated[:, None] if mask_truncated else self.completion_mask

    def select(self, rows: slice) -> "Rollout":
        """The rollouts `rows` (a micro-batch), same layout."""
        return Rollout(
            self.input_ids[rows],
            self.attention_mask[rows],
            self.completion_mask[rows],
            self.reasoning_mask[rows],
            self.answer_mask[rows],
            self.truncated[rows],
            self.texts[rows],
            self.prompt_width,
            None if self.sample_logprobs is None else self.sample_logprobs[rows],
        )

    def trimmed(self) -> "Rollout":
        """The same rollouts without the right-padding columns that every row has (a micro-batch at its own
        width L' <= L: up to its longest row's last token, and at least one completion column), same
        prompt width. Only the right: the prompt's columns stay the step's, so column Lp is every row's first
        completion token in the step and in each micro-batch alike."""
        real = self.attention_mask.bool().any(0).nonzero()
        width = max(self.prompt_width + 1, int(real.max()) + 1 if len(real) else 0)
        if width >= self.input_ids.shape[1]:
            return self
        cut = lambda t: t[:, :width]  # noqa: E731
        return Rollout(
            cut(self.input_ids),
            cut(self.attention_mask),
            cut(self.completion_mask),
            cut(self.reasoning_mask),
            cut(self.answer_mask),
            self.truncated,
            self.texts,
            self.prompt_width,
            None if self.sample_logprobs is None else cut(self.sample_logprobs),
        )


def build_rollout(tokenizer, prompt_ids, prompt_mask, completion, eos_token_ids, logprobs=None) -> Rollout:
    """Assemble the (B, L) layout and the masks from prompts (B, Lp) and completions (B, T), with the
    sampler's log-probs (B, T) of the completion tokens when given."""
    b, width = prompt_ids.shape
    eos = torch.tensor(sorted(eos_token_ids), device=completion.device)
    is_eos = torch.isin(completion, eos)
    first_eos = torch.where(
        is_eos.any(1), is_eos.float().argmax(1), torch.full_like(is_eos[:, 0], completion.shape[1], dtype=torch.long)
    )
    cols = torch.arange(completion.shape[1], device=completion.device)
    gen_mask = cols[None] <= first_eos[:, None]  # through EOS (or everything, when truncated)
    truncated = ~is_eos.any(1)

    reasoning = torch.zeros_like(gen_mask)
    answer = torch.zeros_like(gen_mask)
    texts = []
    special = set(getattr(tokenizer, "all_special_ids", []))  # and added tokens flagged special (skipped in decoding)
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    for i in range(b):
        content = completion[i, : int(first_eos[i])].tolist()  # tokens before EOS
        text, offsets = char_offsets(tokenizer, content)
        texts.append(text)
        span = find_answer(text)
        if span is None:
            continue
        for t, (start, end) in enumerate(held_spans(offsets, [c in special for c in content])):
            reasoning[i, t] = end <= span.marker_start and end > start
            answer[i, t] = start < span.end and end > span.start and end > start  # a special token holds none

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
        sample_logprobs=None
        if logprobs is None
        else torch.cat(
            [torch.zeros_like(prompt_mask, dtype=torch.float32), logprobs.float().masked_fill(~gen_mask, 0.0)], dim=1
        ),
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


def held_spans(offsets: list[tuple[int, int]], special: list[bool]) -> list[tuple[int, int]]:
    """Each token's character span (`char_offsets`), with a token that decodes to nothing alone (the
    first bytes of a character, perhaps after a space: "Ġæ" of " 日") given the span of the next token
    that decodes to something, the piece that completes its character: "√3" and " 日本" start at their
    first byte token. Special tokens keep their empty spans."""
    out, following = list(offsets), None  # the span of the nearest later token with text
    for t in range(len(out) - 1, -1, -1):
        start, end = out[t]
        if start < end:
            following = out[t]
        elif not special[t]:
            out[t] = (start, following[1]) if following is not None else (start, start + 1)
    return out


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


def concat_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """One Rollout of the rows of `parts` in order (e.g. the chunks a step was sampled in): every part is
    left-padded to the widest prompt and right-padded to the longest completion, so the completion
    starts at one column Lp for all. Padding is masked out: each row's tokens and masks are its part's."""
    if len(parts) == 1:
        return parts[0]
    lp = max(r.prompt_width for r in parts)
    t = max(r.input_ids.shape[1] - r.prompt_width for r in parts)

    def cat(get, value):  # each part's (b, L_r) padded to (b, lp + t): left by lp - Lp_r, right by its shortfall
        return torch.cat(
            [
                torch.nn.functional.pad(
                    get(r), (lp - r.prompt_width, t - (get(r).shape[1] - r.prompt_width)), value=value
                )
                for r in parts
            ]
        )

    logprobs = None if any(r.sample_logprobs is None for r in parts) else cat(lambda r: r.sample_logprobs, 0.0)
    return Rollout(
        cat(lambda r: r.input_ids, pad_token_id),
        cat(lambda r: r.attention_mask, 0),
        cat(lambda r: r.completion_mask, False),
        cat(lambda r: r.reasoning_mask, False),
        cat(lambda r: r.answer_mask, False),
        torch.cat([r.truncated for r in parts]),
        [s for r in parts for s in r.texts],
        lp,
        logprobs,
    )
