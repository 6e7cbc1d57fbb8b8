"""The sampler's two decode loops, eager and fixed-shape: the same rollouts from the same numbers (maths §0).

Legend: P prompts, G rollouts per prompt (contiguous), B = P*G rollouts, Lp padded prompt width, T
completion width, V vocabulary.

Both loops prefill each prompt once, copy its keys/values to its G rollouts, and then take one token
per step with the same pieces: `draw_uniforms` (each rollout's seeded stream of uniforms, drawn as a
(B, T) table up front), `prefill` and `choose` (one step's token and log-prob per row, by inverse-CDF
sampling: oar/inverse_cdf.py). They differ only in where the state lives:

* `decode_eager` (`oar.sampler.decode`'s default): the cache holds exactly the columns written so far, as
  a DynamicCache would, until every row has ended. Its keys/values and its attention mask are preallocated
  (`lm.in_place_cache`: each step writes its column, the forward reads the written ones as views), which
  gives the numbers of growing them by `torch.cat`, bit for bit, without a copy of the whole cache a step.
* `decode_static` (for a GPU to replay; docs/sampler.md): the keys and values go into a preallocated
  `StaticCache` of width Lp + T rounded up (`cache_width`: at most 1/8 more, so that calls with nearby
  prompt widths share compiled shapes), the attention mask is one (B, width) tensor made up front, and
  the step counter, the positions, the done flags and the output tokens and log-probs are tensors updated
  in place. One decode step (forward, choice, bookkeeping) is then a function of fixed shapes with no
  host work in it: the host asks whether every row is done every `check_interval` steps. Finished rows
  keep being fed (their token is the pad, their log-prob 0) and are never compacted, so a row's numbers
  do not depend on when its batch-mates stop; the output is cut where the eager loop stops, so both give
  the same shapes. `compiled=True` wraps the step in `torch.compile(mode="reduce-overhead")`: on CUDA,
  torch captures it as a CUDA graph and replays it; on a CPU, the same call runs inductor's compiled
  step, which the CPU suite tests. Attention runs over the whole width (the unwritten columns are
  masked), so the logits agree with the eager loop's up to float rounding, not bit for bit: the tokens
  are the same unless two tokens are tied to within rounding (tests/package/test_static_decode.py: 16 families
  in float64).

The fixed-shape loop hands over to the eager one, said once per process, for a model whose cache is not
all full-attention layers (a sliding window, chunked or linear attention), under transformers 4.x (whose
static cache gave other tokens than the eager loop on every family tried: 4.57.6; 5.24 gives the same),
and under autocast (accelerate's mixed precision) with a transformers before 5.24, whose static cache
holds the values in the keys' dtype (an H200 run stopped at its first step).

What neither loop does per token (docs/sampler.md), each giving the same numbers as doing it: wait for the device
(whether every row is done is read every `check_interval` steps, every step on a CPU, where the read costs
nothing, and the output is cut where a check after every step would have stopped; transformers' own sdpa mask
still reads the padding mask once a forward, outside the compiled step), or cast the policy again under autocast
(accelerate's mixed precision with float32 master weights casts every linear weight at every forward: the steps
run with copies already in the autocast dtype, `lm.linear_weights_in`; not the compiled step, whose CUDA graph
would record the copies' new addresses at every call).
"""

from __future__ import annotations

import sys
from typing import Callable

import torch

from oar import inverse_cdf
from oar.lm import autocast_seen, cache_kwargs, in_place_cache, linear_weights_in, position_ids

CHECK_EVERY = 16  # steps between the host's checks that every row is done, on an accelerator
_SAID: set[str] = set()


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
    check_every: int | None = None,
    on_token: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Autoregressive sampling with a KV cache (`oar.sampler.decode`'s default loop). (P, Lp) prompts ->
    ((B, T) completion ids, (B, T) float32 log-probs of them), B = P x group_size (a prompt's rollouts
    contiguous), ids padded with `pad_token_id` (log-probs 0) after each row's EOS; T <= max_new_tokens.
    Each prompt is prefilled once and its keys/values copied to its G rollouts. `check_every`: steps between
    the checks that every row is done (None: `check_interval`); any value gives the same output."""
    device, T = prompt_ids.device, max_new_tokens
    b, lp = prompt_ids.shape[0] * group_size, prompt_ids.shape[1]
    assert len(seeds) == b, (len(seeds), b)
    every = check_every or check_interval(device)
    uniforms = draw_uniforms(seeds, T, device, skip_draws)  # (B, T)
    eos = torch.tensor(sorted(eos_token_ids), device=device)
    with autocast_seen(model) as seen:  # accelerate's mixed precision wraps the forward itself in autocast
        logits, cache, pos = prefill(model, prompt_ids, prompt_mask)
    cache = in_place_cache(cache, lp + T, repeats=group_size)  # the G rollouts of a prompt share its prefill
    logits, pos = (x.repeat_interleave(group_size, dim=0) for x in (logits, pos))
    mask = torch.ones(b, lp + T, dtype=prompt_mask.dtype, device=device)  # step t reads columns 0 .. Lp + t
    mask[:, :lp] = prompt_mask.repeat_interleave(group_size, dim=0)
    next_pos = pos[:, -1:] + 1
    done = torch.zeros(b, dtype=torch.bool, device=device)
    tokens, logprobs = [], []
    with linear_weights_in(model, seen.get("dtype")):  # cast once for the steps, not once a step
        for t in range(T):
            token, logp = choose(logits, temperature, top_p, uniforms[:, t], done, pad_token_id)
            tokens.append(token)
            logprobs.append(logp)
            done = done | torch.isin(token, eos)
            if on_token is not None:  # a progress bar's tick
                on_token()
            if t == T - 1 or ((t + 1) % every == 0 and bool(done.all())):
                break
            logits = model(
                input_ids=token[:, None],
                attention_mask=mask[:, : lp + t + 1],
                position_ids=next_pos,
                **cache_kwargs(cache),
                use_cache=True,
            ).logits[:, -1]
            next_pos = next_pos + 1
    return _cut(torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), eos)


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


def cache_width(columns: int) -> int:
    """`columns` rounded up to a multiple of 2**(bits - 4), at least 8: eight widths per doubling, at
    most 1/8 of the attention wasted on unwritten columns."""
    step = 1 << max(3, columns.bit_length() - 4)
    return -(-columns // step) * step


def static_cache_or_reason(model, width: int):
    """(a StaticCache of `width` columns, None) when every layer of the model's cache is a plain
    full-attention layer, else (None, why not)."""
    from packaging.version import Version
    from transformers import StaticCache, __version__
    from transformers.cache_utils import StaticLayer

    if (
        Version(__version__).major < 5
    ):  # 4.57.6 samples other tokens than the eager loop (tests/package/test_static_decode.py)
        return None, f"transformers {__version__}'s static cache does not give the eager loop's tokens; 5.x does"
    try:
        cache = StaticCache(config=model.config, max_cache_len=width)
    except Exception as err:  # a config transformers cannot make a static cache for
        return None, f"no static cache for this model ({type(err).__name__}: {err})"
    kinds = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer})
    return (cache, None) if not kinds else (None, f"its cache has {', '.join(kinds)} layers")


def keeps_each_dtype(layer_type, keys: torch.dtype, values: torch.dtype) -> bool:
    """Whether a cache layer of `layer_type` stores keys and values of these dtypes each in its own:
    transformers before 5.24 allocates the values in the keys' dtype, and a step's values of another
    dtype then cannot be copied in (a CUDA run under bf16 autocast: float32 keys, bfloat16 values)."""
    if keys == values:
        return True
    probe = layer_type(max_cache_len=1)
    probe.lazy_initialization(torch.zeros(1, 1, 1, 1, dtype=keys), torch.zeros(1, 1, 1, 1, dtype=values))
    return probe.values.dtype == values


@torch.no_grad()
def decode_static(
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
    compiled: bool = False,
    check_every: int | None = None,
    on_token: Callable[[], None] | None = None,
):
    """`oar.sampler.decode` in fixed shapes (same arguments and outputs); `compiled`: the step through
    torch.compile (a CUDA graph on a GPU). `check_every` as in `decode_eager`."""
    device, T = prompt_ids.device, max_new_tokens
    b = prompt_ids.shape[0] * group_size
    assert len(seeds) == b, (len(seeds), b)
    width = cache_width(prompt_ids.shape[1] + T)

    def eager_instead(why):
        if why not in _SAID:
            _SAID.add(why)
            print(
                f"oar.sampler: the fixed-shape decode loop cannot run here ({why}); the eager loop samples instead",
                file=sys.stderr,
            )
        return decode_eager(
            model,
            prompt_ids,
            prompt_mask,
            max_new_tokens=T,
            temperature=temperature,
            top_p=top_p,
            eos_token_ids=eos_token_ids,
            pad_token_id=pad_token_id,
            seeds=seeds,
            group_size=group_size,
            skip_draws=skip_draws,
            check_every=check_every,
            on_token=on_token,
        )

    every = check_every or check_interval(device)
    cache, why = static_cache_or_reason(model, width)
    if cache is None:
        return eager_instead(why)
    with autocast_seen(model) as seen:  # accelerate's mixed precision wraps the forward itself in autocast
        logits, prompt_cache, pos = prefill(model, prompt_ids, prompt_mask)  # P rows, as the eager loop
    if not keeps_each_dtype(type(cache.layers[0]), model.dtype, seen.get("dtype", model.dtype)):
        return eager_instead(
            f"under autocast to {seen['dtype']} a step's values are {seen['dtype']} and its keys may stay "
            f"{model.dtype} (RoPE), and this transformers' static cache keeps both in the keys' dtype (5.24 keeps "
            "each its own)"
        )
    for src, dst in zip(prompt_cache.layers, cache.layers):  # each prompt's keys/values to its G rows
        dst.update(src.keys.repeat_interleave(group_size, 0), src.values.repeat_interleave(group_size, 0))
    del prompt_cache

    uniforms = draw_uniforms(seeds, T, device, skip_draws)
    eos = torch.tensor(sorted(eos_token_ids), device=device)
    ones = torch.ones(prompt_mask.shape[0], width - prompt_mask.shape[1], dtype=prompt_mask.dtype, device=device)
    mask = torch.cat([prompt_mask, ones], 1).repeat_interleave(
        group_size, 0
    )  # (B, width): causality hides the unwritten columns
    next_pos = pos[:, -1:].repeat_interleave(group_size, 0) + 1
    tokens = torch.full((b, T), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((b, T), dtype=torch.float32, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    t = torch.zeros(1, dtype=torch.long, device=device)

    def record(z):
        token, logp = choose(z, temperature, top_p, uniforms.index_select(1, t).squeeze(1), done, pad_token_id)
        tokens.index_copy_(1, t, token[:, None])
        logprobs.index_copy_(1, t, logp[:, None])
        done.logical_or_(torch.isin(token, eos))
        t.add_(1)

    kv = cache_kwargs(cache)  # once, outside the step torch.compile traces

    def step():  # no inputs, no outputs: a CUDA graph's replay overwrites its outputs, so the state is all it touches
        last = tokens.index_select(1, t - 1)  # (B, 1): the token the previous step chose
        z = model(input_ids=last, attention_mask=mask, position_ids=next_pos, **kv, use_cache=True).logits[:, -1]
        next_pos.add_(1)
        record(z)

    run = step
    if compiled:  # the state the step mutates keeps its address, so a CUDA graph may capture it (as the cache's)
        for x in (uniforms, mask, next_pos, tokens, logprobs, done, t):
            torch._dynamo.mark_static_address(x)
        run = torch.compile(step, mode="reduce-overhead", dynamic=False)
    record(logits.repeat_interleave(group_size, 0))
    tick = on_token or (lambda: None)  # a progress bar's tick, outside the compiled step
    tick()
    # the compiled step's CUDA graph would record new addresses for the copies at every call: it casts as before
    with linear_weights_in(model, None if compiled else seen.get("dtype")):
        for i in range(1, T):
            if i % every == 0 and bool(done.all()):
                break
            run()
            tick()
    return _cut(tokens, logprobs, eos)


def check_interval(device) -> int:
    """Steps between the host's checks that every row is done: 1 on a CPU, where reading a flag costs nothing and
    each step run past the end costs a forward; CHECK_EVERY on an accelerator, where a read waits for the queue."""
    return 1 if torch.device(device).type == "cpu" else CHECK_EVERY


def _cut(tokens, logprobs, eos):
    """(B, n) tokens and log-probs cut where a check after every step stops: after the step at which the last row
    ended (n if one never did). A finished row's tokens after its EOS are pads, so its first EOS is its end."""
    ended = torch.isin(tokens, eos)
    length = torch.where(ended.any(1), ended.int().argmax(1) + 1, tokens.shape[1])
    width = int(length.max())
    return (tokens, logprobs) if width == tokens.shape[1] else (tokens[:, :width].clone(), logprobs[:, :width].clone())
