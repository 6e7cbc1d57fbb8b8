"""The value jump of every reasoning token, from the model's own continuations (scripts/analysis/value_attribution.py).

Legend: K continuations per prefix, n_R a rollout's reasoning tokens (completion positions t).

V_j = P(reward 1 | prompt, completion[:j]) is estimated from K continuations of the prefix, sampled by the
model at the rollout temperature within the rollout's remaining token budget, and each reasoning token t gets

    ΔV_t = V_{t+1} - V_t = V(prefix <= t) - V(prefix < t),

the mean of the K paired differences R_{t+1,k} - R_{t,k} (continuation k uses one seed at every prefix:
common random numbers), with the Monte-Carlo standard error std(ddof 1) / sqrt(K). A prefix is
prefilled once for its K continuations (the sampler's `group_size`). The values are kept in a JSON file
with the settings and the rollouts they belong to (`portable`, `rollout_record`, `same_rollouts`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from oar.rewards import reward
from oar.rollout import Rollout, char_offsets
from oar.sampler import decode, left_pad, stop_token_ids
from oar.training.models import SMOLLM2, smollm2_gguf


def needed_prefixes(positions: list[int]) -> list[int]:
    """Prefix lengths j whose value ΔV at completion positions `positions` needs: every t and t + 1."""
    return sorted({t for t in positions} | {t + 1 for t in positions})


def delta_v(rewards: dict[tuple[int, int], float], positions: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """ΔV_t and its Monte-Carlo standard error (n_R,) from the continuation rewards {(j, k): r} (paired over k)."""
    diff = np.array([[rewards[(t + 1, c)] - rewards[(t, c)] for c in range(k)] for t in positions], dtype=np.float64)
    se = diff.std(axis=1, ddof=1) / math.sqrt(k) if k > 1 else np.full(len(positions), math.nan)
    return diff.mean(axis=1), se


def continuation_rewards(model, tok, prompt: list[int], completion: list[int], gold: str, prefixes: list[int], k: int, seed: int, *,
                         max_new_tokens: int, temperature: float, batch: int = 64) -> dict[tuple[int, int], float]:
    """{(j, c): reward of prefix completion[:j] continued by the model with continuation seed c}, every j in
    `prefixes`, c < k. The continuation of prefix j gets the rollout's remaining budget max_new_tokens - j;
    continuation c draws from seed `seed * 1_000_003 + c` at every prefix (common random numbers)."""
    stop = stop_token_ids(model, tok)
    out = {}
    per_call = max(1, batch // k)  # prefixes a call; a prefix's k continuations share its one prefill (group_size k)
    for start in range(0, len(prefixes), per_call):
        part = prefixes[start:start + per_call]
        ids, mask = left_pad([prompt + completion[:j] for j in part], tok.pad_token_id)
        cont, _ = decode(model, ids, mask, max_new_tokens=max_new_tokens - min(part), temperature=temperature, top_p=1.0,
                         eos_token_ids=stop, pad_token_id=tok.pad_token_id, group_size=k,
                         seeds=[seed * 1_000_003 + c for _ in part for c in range(k)])
        for (j, c), row in zip([(j, c) for j in part for c in range(k)], cont.tolist()):
            row = row[:max_new_tokens - j]  # this prefix's own budget
            end = next((n for n, x in enumerate(row) if x in stop), len(row))
            text = char_offsets(tok, completion[:j] + row[:end])[0]  # what the sampler's text of that rollout would be
            out[(j, c)] = reward(text, gold)
    return out


def rollout_values(model, tok, ro: Rollout, golds: list[str], seeds: list[int], *, k: int, max_new_tokens: int, temperature: float,
                   batch: int, log=print, done: list[dict] = (), save=None) -> list[dict]:
    """Per rollout: its reasoning positions (completion indices), ΔV and its s.e. there, V_0 and the seconds it took.
    Starts after the rollouts already `done` (a run that was stopped); `save(values)` after each rollout."""
    out = list(done)
    lp = ro.prompt_width
    for i in range(len(out), len(ro)):
        t0 = time.process_time()
        prompt = ro.input_ids[i, :lp][ro.attention_mask[i, :lp].bool()].tolist()
        completion = ro.input_ids[i, lp:][ro.completion_mask[i, lp:]].tolist()
        positions = ro.reasoning_mask[i, lp:].nonzero().flatten().tolist()
        rec = {"positions": positions, "dv": [], "se": [], "v0": None}
        if positions:
            prefixes = needed_prefixes(positions)
            r = continuation_rewards(model, tok, prompt, completion, golds[i], prefixes, k, seeds[i], max_new_tokens=max_new_tokens,
                                     temperature=temperature, batch=batch)
            dv, se = delta_v(r, positions, k)
            rec |= {"dv": dv.tolist(), "se": se.tolist(), "v0": float(np.mean([r[(prefixes[0], c)] for c in range(k)]))}
        rec["cpu_s"] = time.process_time() - t0
        log(f"[values] rollout {i + 1}/{len(ro)}: n_R {len(positions)}, {rec['cpu_s']:.0f} CPU s, "
            f"max |ΔV| {max(map(abs, rec['dv']), default=0):.2f}")
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


LOGPROB_TOLERANCE = 1e-2  # another machine's float rounding moves a log-prob by ~1e-5 (docs/vllm.md); another model's, by far more


def rollout_record(ro: Rollout) -> dict:
    """What --values records of the rollouts its values belong to: the texts, each completion's token ids and
    the sampler's log-prob of every one of them (4 decimals)."""
    lp = ro.prompt_width
    ids = [ro.input_ids[i, lp:][ro.completion_mask[i, lp:]].tolist() for i in range(len(ro))]
    logprobs = [[round(x, 4) for x in ro.sample_logprobs[i, lp:][ro.completion_mask[i, lp:]].tolist()] for i in range(len(ro))]
    return {"texts": ro.texts, "ids": ids, "logprobs": logprobs}


def same_rollouts(cached: dict, here: dict) -> bool:
    """Whether cached values belong to these rollouts: the same texts, the same token ids (a text can be
    cut into tokens more than one way, and the values index tokens), and log-probs within LOGPROB_TOLERANCE
    (the same model: two checkpoints can sample the same tokens from the same seeds, not with the same
    probabilities). A file written before ids and log-probs were recorded is matched on its texts."""
    if cached["texts"] != here["texts"]:
        return False
    if "ids" not in cached:
        return True
    return cached["ids"] == here["ids"] and all(
        len(a) == len(b) and all(abs(x - y) <= LOGPROB_TOLERANCE for x, y in zip(a, b)) for a, b in zip(cached["logprobs"], here["logprobs"]))
