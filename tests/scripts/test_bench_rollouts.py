"""scripts/bench/bench_rollouts.py (the rollout benchmark, docs/sampler.md): what it times is the same batch for every
variant, and its bandwidth arithmetic is right on a model whose sizes are known."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import bench_rollouts as br  # noqa: E402

from conftest import tiny_llama  # noqa: E402


def test_every_variant_runs_the_same_batch_to_the_full_length():
    model = tiny_llama(vocab_size=1024, seed=3)  # past 4 x HEAD tokens: the eager loop's head search runs
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # peaked distributions, as a trained model's
    ids, attn = torch.randint(3, 40, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    attn[0, :2] = 0
    variants = ("eager", "static", "eager_sorted", "hf_generate")
    r = br.rollout_speeds(model, ids, attn, group_size=3, new_tokens=7, pad=0, repeats=1, variants=variants)
    assert set(r["variants"]) == set(variants) and r["rollouts"] == 6
    assert r["loops_give_equal_tokens"] is True and r["agreement_with_eager"]["static"]["rows_equal"] == 6
    assert r["head_search_equals_sort"] is True
    assert r["choose_s_per_step"] > 0 and r["choose_sorted_s_per_step"] > 0
    for x in r["variants"].values():
        assert x["tokens_per_s"] == 6 * 7 / x["median_s"] and len(x["times_s"]) == 1


def test_the_bandwidth_bound_counts_every_weight_and_the_mean_kv_cache():
    model = tiny_llama(hidden=32, layers=2)  # 4 heads of 8, 2 KV heads, float32
    params = sum(p.numel() for p in model.parameters())
    kv_per_token = 2 * 2 * 2 * 8 * 4  # keys and values, layers, KV heads, head dim, bytes
    want = (params * 4 + 10 * (20 + 30 / 2) * kv_per_token) / 0.001 / 1e9
    got = br.bandwidth_fraction(model, rollouts=10, prompt=20, new_tokens=30, step_s=0.001, peak_gbs=1.0)
    assert abs(got - want) < 1e-12 * want


def test_agreement_finds_the_rows_and_first_positions_that_differ():
    tokens = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 2, 3]])
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -9.0, -3.0], [-0.5, -0.5, -0.5]])
    other = tokens.clone()
    other[1, 1:] = 8
    a = br.agreement((tokens, logp), (other, logp + 1e-3))
    assert a["rows"] == 3 and a["rows_equal"] == 2 and a["first_difference_at"] == [1]
    assert a["logprob_at_first_difference"] == [-9.0] and abs(a["max_logprob_diff_equal_rows"] - 1e-3) < 1e-6


def test_the_choice_alone_is_timed_on_the_models_logits_both_ways():
    ids = torch.randint(3, 40, (2, 5))
    head, every_row_sorted = br.choose_seconds(
        tiny_llama(vocab_size=1024), ids, torch.ones_like(ids), group_size=2, repeats=2
    )
    assert 0 < head < 1 and 0 < every_row_sorted < 1
