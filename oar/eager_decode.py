"""The sampler's eager decode loop, and the pieces the fixed-shape loop shares with it.

Legend: P prompts, G rollouts per prompt (contiguous), B = P*G rollouts, Lp padded prompt width, T
completion width, V vocabulary.

`decode_eager` is `oar.sampler.decode`'s default loop: one prefill per prompt, its keys/values
copied to the prompt's G rollouts, then one token per step from a DynamicCache until every row has
ended. Its pieces (`draw_uniforms`: each rollout's seeded stream of uniforms; `prefill`; `choose`:
one step's token and log-prob per row, by inverse-CDF sampling, oar/inverse_cdf.py) are also the
fixed-shape loop's (oar/static_decode.py), which is why they live here, below both: the two loops
give the same rollouts because they make the same choices from the same numbers.
"""

from __future__ import annotations

from typing import Callable

import torch

from oar import inverse_cdf
from oar.lm import cache_kwargs, position_ids


@torch.no_grad()
def decode_eager(
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
    on_token: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Autoregressive sampling with a KV cache (`oar.sampler.decode`'s default loop). (P, Lp) prompts ->
    ((B, T) completion ids, (B, T) float32 log-probs of them), B = P x group_size (a prompt's rollouts
    contiguous), ids padded with `pad_token_id` (log-probs 0) after each row's EOS; T <= max_new_tokens.
    Each prompt is prefilled once and its keys/values copied to its G rollouts."""
    b = prompt_ids.shape[0] * group_size
    assert len(seeds) == b, (len(seeds), b)
    uniforms = draw_uniforms(seeds, max_new_tokens, prompt_ids.device, skip_draws)  # (B, max_new_tokens)
    eos = torch.tensor(sorted(eos_token_ids), device=prompt_ids.device)
    logits, cache, pos = prefill(model, prompt_ids, prompt_mask)
    if group_size > 1:  # the G rollouts of a prompt share its prefill
        cache.batch_repeat_interleave(group_size)
    logits, mask, pos = (x.repeat_interleave(group_size, dim=0) for x in (logits, prompt_mask, pos))
    next_pos = pos[:, -1:] + 1
    done = torch.zeros(b, dtype=torch.bool, device=prompt_ids.device)
    tokens, logprobs = [], []
    for t in range(max_new_tokens):
        token, logp = choose(logits, temperature, top_p, uniforms[:, t], done, pad_token_id)
        tokens.append(token)
        logprobs.append(logp)
        done = done | torch.isin(token, eos)
        if on_token is not None:  # a progress bar's tick
            on_token()
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits = model(
            input_ids=token[:, None], attention_mask=mask, position_ids=next_pos, **cache_kwargs(cache), use_cache=True
        ).logits[:, -1]
        next_pos = next_pos + 1
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)


def draw_uniforms(seeds: list[int], length: int, device, skip: list[int] | None = None) -> torch.Tensor:
    """(B, length): row i holds draws skip[i] .. skip[i] + length - 1 (skip: 0 for every row when None) of its
    own generator seeded with seeds[i], the same numbers as one draw per step. A row that skips j draws
    continues a j-token prefix with the numbers a rollout of that seed would use at the same positions."""
    skip = skip or [0] * len(seeds)
    assert len(skip) == len(seeds) and min(skip, default=0) >= 0, (len(skip), len(seeds))
    return torch.stack(
        [torch.rand(j + length, generator=torch.Generator().manual_seed(int(s)))[j:] for s, j in zip(seeds, skip)]
    ).to(device)


def prefill(model, prompt_ids, prompt_mask):
    """One forward over the (P, Lp) prompts: (last logits (P, V), their DynamicCache, position ids (P, Lp))."""
    from transformers import DynamicCache

    pos = position_ids(prompt_mask)
    cache = DynamicCache()
    logits = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=pos,
        **cache_kwargs(cache),
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    return logits, cache, pos


def choose(logits, temperature: float, top_p: float, u, done, pad_token_id: int):
    """One step's (token, log-prob) per row from its logits (B, V) and uniform u (B,); rows already done
    get `pad_token_id` and log-prob 0. The log-prob is under log_softmax(logits / temperature), before top-p."""
    z = logits.float()
    token = _pick(z, temperature, top_p, u).masked_fill(done, pad_token_id)
    logp = torch.log_softmax(z / (temperature or 1.0), dim=-1).gather(-1, token[:, None]).squeeze(-1)
    return token, logp.masked_fill(done, 0.0)


def _pick(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse-CDF sampling with the row's uniform u (B,) over the vocabulary sorted
    most likely first (oar/inverse_cdf.py; found without the sort where that is provably the same
    token); greedy at temperature 0. Top-p keeps the smallest set of most likely tokens whose mass
    reaches top_p."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    return inverse_cdf.choice(torch.softmax(logits / temperature, dim=-1), top_p, u)
