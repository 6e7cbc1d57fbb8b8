"""The value jump of every reasoning token, from the model's own continuations (scripts/analysis/value_attribution.py).

Legend: K continuations per prefix, n_R a rollout's reasoning tokens (completion positions t).

V_j = P(reward 1 | prompt, completion[:j]) is estimated from K continuations of the prefix, sampled by the
model at the rollout temperature within the rollout's remaining token budget, and each reasoning token t gets

    ΔV_t = V_{t+1} - V_t = V(prefix <= t) - V(prefix < t),

the mean of the K paired differences d_{t,c} = R_{t+1,c} - R_{t,c}, with the Monte-Carlo standard error
std(ddof 1) / sqrt(K). Common random numbers make the pairs share their noise: continuation c of every
prefix draws its token at completion position p with the same uniform u_c[p] of one seeded stream (the
sampler's `skip_draws`), so the continuations of prefixes t and t + 1 differ only where the one from t
resampled position t to another token than the rollout's (with probability 1 - p(c_t)); where it drew
c_t they are the same text and d_{t,c} = 0 (to float rounding of the two batches). ΔV stays unbiased
(each V_j is a mean over K independent streams) and its noise concentrates where the token mattered.
The continuation streams' seeds are disjoint from every rollout seed (`continuation_seed`), so no
continuation replays a rollout. With 0/1 rewards d is -1, 0 or 1, and under "token t does not move V"
its non-zero values are +1 or -1 with probability 1/2 each: `sign_test` is exact.

The same coupling makes most continuations free: where continuation c of prefix j draws the rollout's
own token j, it is continuation c of prefix j + 1, so only the continuations that draw another token
there (`deviations`, found from one teacher-forced forward of the rollout) are sampled, and the rest are
copied (on SmolLM2's rollouts of the study's task about one in ten (j, c) deviates). The values are kept
in a JSON file with the settings and the rollouts they belong to (`portable`, `rollout_record`,
`same_rollouts`; VALUES_FORMAT says how they were made).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch

from oar.decode_loops import choose, draw_uniforms
from oar.lm import forward_logits
from oar.rewards import reward
from oar.rollout import Rollout, char_offsets
from oar.sampler import decode, left_pad, stop_token_ids
from oar.training.models import SMOLLM2, smollm2_gguf


VALUES_FORMAT = (
    2  # 1: continuation c of every prefix drew from the start of its stream (pairs barely coupled); 2: this
)
CONTINUATION_OFFSET = (
    500_000  # continuation seeds are = this + c (mod 1_000_003); rollout seeds (= n < this) never are
)


def continuation_seed(rollout_seed: int, c: int) -> int:
    """The seed of continuation c's stream for a rollout: disjoint from every seed `seed * 1_000_003 + n`
    (n < CONTINUATION_OFFSET) the rollouts are sampled with, and from other rollouts' continuations."""
    assert 0 <= c < 1_000_003 - CONTINUATION_OFFSET
    return rollout_seed * 1_000_003 + CONTINUATION_OFFSET + c


def needed_prefixes(positions: list[int]) -> list[int]:
    """Prefix lengths j whose value ΔV at completion positions `positions` needs: every t and t + 1."""
    return sorted({t for t in positions} | {t + 1 for t in positions})


def paired_differences(rewards: dict[tuple[int, int], float], positions: list[int], k: int) -> np.ndarray:
    """d_{t,c} = R_{t+1,c} - R_{t,c} (n_R, K) from the continuation rewards {(j, c): r}."""
    return np.array(
        [[rewards[(t + 1, c)] - rewards[(t, c)] for c in range(k)] for t in positions], dtype=np.float64
    ).reshape(-1, k)


def delta_v(rewards: dict[tuple[int, int], float], positions: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """ΔV_t and its Monte-Carlo standard error (n_R,) from the continuation rewards {(j, c): r} (paired over c)."""
    diff = paired_differences(rewards, positions, k)
    se = diff.std(axis=1, ddof=1) / math.sqrt(k) if k > 1 else np.full(len(positions), math.nan)
    return diff.mean(axis=1), se


def sign_test(plus: int, minus: int) -> float:
    """Two-sided exact sign test of `plus` +1s against `minus` -1s (zeros dropped): the p-value of 'the
    token does not move V', under which each non-zero difference is +1 or -1 with probability 1/2."""
    n = plus + minus
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(plus, minus) + 1)) / 2**n
    return min(1.0, 2 * tail)


def continuation_rewards(
    model,
    tok,
    prompt: list[int],
    completion: list[int],
    gold: str,
    prefixes: list[int],
    k: int,
    seed: int,
    *,
    max_new_tokens: int,
    temperature: float,
    batch: int = 64,
) -> dict[tuple[int, int], float]:
    """{(j, c): reward of prefix completion[:j] continued by the model with continuation seed c}, every j in
    `prefixes`, c < k. The continuation of prefix j gets the rollout's remaining budget max_new_tokens - j;
    continuation c draws from the stream of `continuation_seed(seed, c)`, position p with its draw p at every
    prefix (common random numbers: the prefix of length j skips j draws). So where continuation c of prefix
    j draws the rollout's own token j, it is continuation c of prefix j + 1, text and reward: only the others
    (`deviations`) are sampled, and the rest are copied from the prefix after, longest prefix first."""
    sampled = sample_rewards(
        model,
        tok,
        prompt,
        completion,
        gold,
        sorted(
            deviations(
                model, prompt, completion, prefixes, k, seed, temperature=temperature, max_new_tokens=max_new_tokens
            )
        ),
        seed,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        batch=batch,
    )
    out = {}
    for j in sorted(prefixes, reverse=True):
        for c in range(k):
            out[(j, c)] = sampled[(j, c)] if (j, c) in sampled else out[(j + 1, c)]
    return out


@torch.no_grad()
def deviations(
    model,
    prompt: list[int],
    completion: list[int],
    prefixes: list[int],
    k: int,
    seed: int,
    *,
    temperature: float,
    max_new_tokens: int,
) -> set[tuple[int, int]]:
    """The (j, c) whose continuation must be sampled: continuation c of prefix j draws at position j another
    token than the rollout's (chosen as the sampler chooses, `decode_loops.choose`, from the rollout's own
    teacher-forced distribution there and the stream's draw j), or prefix j + 1 is not one of `prefixes`."""
    needed = set(prefixes)
    ids = torch.tensor([prompt + completion], device=next(model.parameters()).device)
    z = forward_logits(model, ids, torch.ones_like(ids), logits_to_keep=len(completion) + 1)[
        0, :-1
    ]  # (T, V): z[t] predicts token t
    u = draw_uniforms(
        [continuation_seed(seed, c) for c in range(k)], max_new_tokens, ids.device
    )  # (K, max_new_tokens)
    out = set()
    for j in prefixes:
        if j + 1 not in needed or j >= len(completion):
            out |= {(j, c) for c in range(k)}
            continue
        token, _ = choose(
            z[j].expand(k, -1), temperature, 1.0, u[:, j], torch.zeros(k, dtype=torch.bool, device=ids.device), 0
        )
        out |= {(j, c) for c in range(k) if int(token[c]) != completion[j]}
    return out


def sample_rewards(
    model,
    tok,
    prompt: list[int],
    completion: list[int],
    gold: str,
    pairs: list[tuple[int, int]],
    seed: int,
    *,
    max_new_tokens: int,
    temperature: float,
    batch: int = 64,
) -> dict[tuple[int, int], float]:
    """{(j, c): reward} of continuation c of prefix completion[:j], sampled for each pair, `batch` rows a call
    (pairs in order of j: rows of similar length together)."""
    stop = stop_token_ids(model, tok)
    out = {}
    for start in range(0, len(pairs), batch):
        part = pairs[start : start + batch]
        ids, mask = left_pad([prompt + completion[:j] for j, _ in part], tok.pad_token_id)
        cont, _ = decode(
            model,
            ids,
            mask,
            max_new_tokens=max_new_tokens - min(j for j, _ in part),
            temperature=temperature,
            top_p=1.0,
            eos_token_ids=stop,
            pad_token_id=tok.pad_token_id,
            seeds=[continuation_seed(seed, c) for _, c in part],
            skip_draws=[j for j, _ in part],
        )
        for (j, c), row in zip(part, cont.tolist()):
            row = row[: max_new_tokens - j]  # this prefix's own budget
            end = next((n for n, x in enumerate(row) if x in stop), len(row))
            text = char_offsets(tok, completion[:j] + row[:end])[0]  # what the sampler's text of that rollout would be
            out[(j, c)] = reward(text, gold)
    return out


def rollout_values(
    model,
    tok,
    ro: Rollout,
    golds: list[str],
    seeds: list[int],
    *,
    k: int,
    max_new_tokens: int,
    temperature: float,
    batch: int,
    log=print,
    done: list[dict] = (),
    save=None,
) -> list[dict]:
    """Per rollout: its reasoning positions (completion indices); ΔV, its s.e., and the counts of +1 and -1
    paired differences there; v_first, V before its first reasoning token; the CPU seconds it took.
    Starts after the rollouts already `done` (a run that was stopped); `save(values)` after each rollout."""
    cont = {continuation_seed(s, c) for s in seeds for c in range(k)}
    assert not cont & set(seeds), "a continuation stream would replay a rollout"
    out = list(done)
    lp = ro.prompt_width
    for i in range(len(out), len(ro)):
        t0 = time.process_time()
        prompt = ro.input_ids[i, :lp][ro.attention_mask[i, :lp].bool()].tolist()
        completion = ro.input_ids[i, lp:][ro.completion_mask[i, lp:]].tolist()
        positions = ro.reasoning_mask[i, lp:].nonzero().flatten().tolist()
        rec = {"positions": positions, "dv": [], "se": [], "plus": [], "minus": [], "v_first": None}
        if positions:
            prefixes = needed_prefixes(positions)
            r = continuation_rewards(
                model,
                tok,
                prompt,
                completion,
                golds[i],
                prefixes,
                k,
                seeds[i],
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                batch=batch,
            )
            assert set(r.values()) <= {0.0, 1.0}, "the sign test and the counts assume 0/1 rewards"
            dv, se = delta_v(r, positions, k)
            d = paired_differences(r, positions, k)
            rec |= {
                "dv": dv.tolist(),
                "se": se.tolist(),
                "plus": (d > 0).sum(1).tolist(),
                "minus": (d < 0).sum(1).tolist(),
                "v_first": float(np.mean([r[(prefixes[0], c)] for c in range(k)])),
            }
        rec["cpu_s"] = time.process_time() - t0
        log(
            f"[values] rollout {i + 1}/{len(ro)}: n_R {len(positions)}, {rec['cpu_s']:.0f} CPU s, "
            f"max |ΔV| {max(map(abs, rec['dv']), default=0):.2f}"
        )
        out.append(rec)
        if save is not None:
            save(out)
    return out


def portable(settings: dict) -> dict:
    """The settings the values depend on, as --values records them: the model by its file or folder name,
    not where it lies (a site-packages or a clone differs between machines; `smollm2` is its GGUF's name),
    so values made on one machine resume on another. A name does not tell two checkpoints apart (every
    run's is `final`): `same_rollouts` checks the rollouts themselves."""
    model = settings["model"]
    return settings | {"model": smollm2_gguf().name if model == SMOLLM2 else Path(model).name}


VALUE_CODE = (
    "oar/answers.py",
    "oar/rewards.py",
    "oar/rollout.py",
    "oar/sampler.py",
    "oar/decode_loops.py",
    "oar/inverse_cdf.py",
    "oar/lm.py",
    "scripts/analysis/delta_v.py",
)  # what decides a value: the continuations and their rewards


def values_code() -> str:
    """A hash of VALUE_CODE's files: a values file records every version that added to it, so values made
    by two versions of the answer rule or the sampler say so (value_attribution.py warns on resume)."""
    from oar.training.checkpoint import ROOT, files_version

    return files_version(ROOT / name for name in VALUE_CODE)


LOGPROB_TOLERANCE = (
    1e-2  # another machine's float rounding moves a log-prob by ~1e-5 (docs/vllm.md); another model's, by far more
)


def rollout_record(ro: Rollout, golds: list[str]) -> dict:
    """What --values records of the rollouts its values belong to: the texts, each completion's token ids,
    the sampler's log-prob of every one of them (4 decimals), and the gold answers the rewards checked."""
    lp = ro.prompt_width
    ids = [ro.input_ids[i, lp:][ro.completion_mask[i, lp:]].tolist() for i in range(len(ro))]
    logprobs = [
        [round(x, 4) for x in ro.sample_logprobs[i, lp:][ro.completion_mask[i, lp:]].tolist()] for i in range(len(ro))
    ]
    return {"texts": ro.texts, "ids": ids, "logprobs": logprobs, "golds": list(golds)}


def same_rollouts(cached: dict, here: dict) -> bool:
    """Whether cached values belong to these rollouts: the same texts, the same token ids (a text can be
    cut into tokens more than one way, and the values index tokens), and log-probs within LOGPROB_TOLERANCE
    (the same model: two checkpoints can sample the same tokens from the same seeds, not with the same
    probabilities), and the same gold answers (an edited data set changes the rewards)."""
    if any(cached.get(key) != here[key] for key in ("texts", "ids", "golds")):
        return False
    return all(
        len(a) == len(b) and all(abs(x - y) <= LOGPROB_TOLERANCE for x, y in zip(a, b))
        for a, b in zip(cached["logprobs"], here["logprobs"])
    )
