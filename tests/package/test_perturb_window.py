"""Window OAR-P (oar/oar_perturb_window.py) against the definition it approximates.

* exact once the window reaches the answer: equal to `perturbation_scores_naive` on tiny random
  Llama (eager attention) and Qwen2 (sdpa) models, every probe, ragged left-padded rows, any chunk;
* exact for a one-layer model whatever the window: a layer's keys/values depend on one token each,
  so the only path from the masked token to the answer is the answer positions' own attention;
* a short window on a deeper model is an approximation: it differs from exact, and the difference
  shrinks to zero as the window grows (monotone in the last step: W = answer distance is exact);
* the clean keys/values of the update's forward give the same scores as a clean pass of its own;
* property (hypothesis): a copy whose window reaches the answer is exact, whatever the row;
* perturbation_scores(mode="auto"), the entry point: exact below the switch length, window above
  it; a sliding window shorter than the row is refused by the window mode and sends auto to exact.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oar.oar_perturb import perturbation_scores, perturbation_scores_naive
from oar.oar_perturb_window import window_perturbation_scores, window_supported
from oar.probes import PROBES, clean_forward, outcome_from_logits

from conftest import tiny_llama
from test_speed_paths import ragged_batch


def tiny_qwen2(layers: int = 2, seed: int = 0, **extra):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        attn_implementation="sdpa",
        **extra,
    )
    return Qwen2ForCausalLM(config).float().eval()


def _tol(ref):
    return dict(rtol=0, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("chunk", [1, 50, 10_000])
def test_window_reaching_the_answer_equals_naive(family, probe, chunk):
    model = tiny_llama(seed=3) if family == "llama" else tiny_qwen2(seed=3)
    ids, attn, reas, ans = ragged_batch()
    naive = perturbation_scores_naive(model, ids, attn, reas, ans, probe=probe, pad_token_id=0, chunk_size=5)
    win = window_perturbation_scores(
        model, ids, attn, reas, ans, window=ids.shape[1], probe=probe, pad_token_id=0, max_chunk_tokens=chunk
    )
    assert naive[reas].abs().max() > 0
    torch.testing.assert_close(win, naive, **_tol(naive))
    assert (win[~reas] == 0).all() and (win[4] == 0).all()  # row 4 has no answer


@pytest.mark.parametrize("window", [0, 2])
def test_one_layer_model_is_exact_for_any_window(window):
    model = tiny_llama(layers=1, seed=5)
    ids, attn, reas, ans = ragged_batch(seed=2)
    naive = perturbation_scores_naive(model, ids, attn, reas, ans, pad_token_id=0)
    win = window_perturbation_scores(model, ids, attn, reas, ans, window=window, pad_token_id=0)
    torch.testing.assert_close(win, naive, **_tol(naive))


def test_short_window_is_approximate_and_converges():
    model = tiny_llama(layers=3, seed=7)
    ids, attn, reas, ans = ragged_batch(seed=4)
    naive = perturbation_scores_naive(model, ids, attn, reas, ans, pad_token_id=0)
    err = [
        (window_perturbation_scores(model, ids, attn, reas, ans, window=w, pad_token_id=0) - naive).abs().max().item()
        for w in (0, 4, 12)
    ]
    assert err[0] > 1e-3 * naive.abs().max()  # a real approximation at W = 0 (three layers carry influence)
    # 12 >= every reasoning-to-answer distance here: exact up to float32 rounding, which for KLs of ~4e-3
    # computed from logits of ~1 is a few 1e-7 absolute (4.2e-7 measured on an AMD EPYC, above 1e-4 relative)
    assert err[2] <= max(1e-4 * naive.abs().max().item(), 1e-6)
    assert err[1] <= err[0]


def test_update_forward_keys_values_give_the_same_scores():
    model = tiny_qwen2(layers=2, seed=1)
    ids, attn, reas, ans = ragged_batch(seed=5)
    own = window_perturbation_scores(model, ids, attn, reas, ans, window=3, pad_token_id=0)
    logits, kv = clean_forward(model, ids, attn, keep_cache=True)
    clean = outcome_from_logits(logits, ids, ans, "answer_mean")
    reused = window_perturbation_scores(
        model, ids, attn, reas, ans, window=3, pad_token_id=0, clean=clean, clean_kv=kv
    )
    torch.testing.assert_close(reused, own, **_tol(own))


def test_auto_uses_exact_below_the_switch_and_window_above(capsys):
    model = tiny_llama(layers=3, seed=7)
    ids, attn, reas, ans = ragged_batch(seed=4)
    naive = perturbation_scores_naive(model, ids, attn, reas, ans, pad_token_id=0)
    win = window_perturbation_scores(model, ids, attn, reas, ans, window=0, pad_token_id=0)
    # maths §6: window where a_end - min R >= the switch length. Spans of ragged_batch(4), by its layouts:
    span = [11, 7, 6, 13, None, 9]  # (row 4 has no answer: exact)
    for switch in (11, 12):  # row 0 exactly at the switch, then just below it
        auto = perturbation_scores(
            model, ids, attn, reas, ans, mode="auto", window=0, auto_length=switch, pad_token_id=0
        )
        for b in range(ids.shape[0]):
            use_window = span[b] is not None and span[b] >= switch
            torch.testing.assert_close(auto[b], win[b] if use_window else naive[b], **_tol(naive))
        assert not torch.allclose(win[0], naive[0], **_tol(naive))  # W = 0 differs from exact: the test can tell
    assert "window mode (W=0)" in capsys.readouterr().out


def test_sliding_window_shorter_than_the_row_is_refused_and_auto_falls_back(monkeypatch, capsys):
    model = tiny_qwen2(layers=2, seed=2, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    ids, attn, reas, ans = ragged_batch(seed=6)
    assert "sliding-window" in window_supported(model.config, ids.shape[1])
    assert window_supported(model.config, 4) is None  # a window as long as the row changes nothing
    with pytest.raises(ValueError, match="sliding-window"):
        window_perturbation_scores(model, ids, attn, reas, ans, window=2, pad_token_id=0)
    # The fallback is the exact path (whose sliding-window support is oar_perturb's business): every row's
    # numbers are exact's, bit for bit, though every row is past the switch length.
    exact = perturbation_scores(model, ids, attn, reas, ans, mode="exact", pad_token_id=0)
    for mode in ("auto", "window"):
        fallback = perturbation_scores(model, ids, attn, reas, ans, mode=mode, window=2, auto_length=1, pad_token_id=0)
        assert torch.equal(fallback, exact) and exact.abs().sum() > 0, mode
    assert "window mode unavailable" in capsys.readouterr().out


def test_training_runs_the_window_mode_and_names_bad_settings(tiny_model, tmp_path, monkeypatch, capsys):
    """train.py --perturb_mode window scores through window_perturbation_scores (W = PERTURB_WINDOW, 32),
    and an impossible mode is named before anything loads."""
    import oar.oar_perturb as oar_perturb  # the entry point training calls, which calls the window file
    from oar.training.checks import check_config
    from oar.training.config import parse_args
    from tinyrun import TINY, metrics, run_inprocess

    seen = []
    real = oar_perturb.window_perturbation_scores
    monkeypatch.setattr(
        oar_perturb, "window_perturbation_scores", lambda *a, **k: seen.append(k["window"]) or real(*a, **k)
    )
    out = tmp_path / "run"
    run_inprocess(
        [
            "--model",
            str(tiny_model),
            "--dataset",
            str(tiny_model / "data.jsonl"),
            "--output_dir",
            str(out),
            "--micro_batch_size",
            "8",
            *TINY,
            "--method",
            "oar-p",
            "--steps",
            "1",
            "--score_all",
            "--perturb_mode",
            "window",
        ]
    )
    assert seen and set(seen) == {32}
    assert metrics(out)[0]["oar/frac_nonfinite_scores"] == 0
    with pytest.raises(ValueError, match="--perturb_mode fast: choose one of exact, window, auto"):
        check_config(parse_args(["--micro_batch_size", "8", *TINY, "--perturb_mode", "fast"]), 1)


_MODEL = {}


@settings(max_examples=12, deadline=None)
@given(
    st.integers(0, 3),
    st.integers(1, 9),
    st.integers(1, 3),
    st.integers(0, 2),
    st.integers(0, 6),
    st.integers(0, 10_000),
)
def test_copies_whose_window_reaches_the_answer_are_exact(pad, reasoning, answer, marker, window, seed):
    """Property: a masked token j with j + W >= a0 - 2 (its window covers every position up to the
    answer) gets exact OAR-P's score whatever the rest of the row, and every score is finite and >= 0
    (KL). One row: left pad, prompt 3, reasoning, marker, answer, one tail token."""
    model = _MODEL.setdefault("m", tiny_llama(layers=3, seed=11))
    g = torch.Generator().manual_seed(seed)
    n = pad + 3 + reasoning + marker + answer + 1
    ids = torch.randint(3, 40, (1, n), generator=g)
    attn = torch.ones_like(ids)
    attn[:, :pad] = 0
    reas = torch.zeros(ids.shape, dtype=torch.bool)
    reas[0, pad + 3 : pad + 3 + reasoning] = True
    ans = torch.zeros_like(reas)
    a0 = pad + 3 + reasoning + marker
    ans[0, a0 : a0 + answer] = True
    naive = perturbation_scores_naive(model, ids, attn, reas, ans, pad_token_id=0)
    win = window_perturbation_scores(model, ids, attn, reas, ans, window=window, pad_token_id=0)
    covered = reas & (torch.arange(n)[None] + window >= a0 - 2)
    torch.testing.assert_close(
        win[covered], naive[covered], rtol=0, atol=1e-4 * naive.abs().max().item() + 2e-6
    )  # + float32 cancellation in a KL near 0
    assert torch.isfinite(win).all() and (win >= -1e-6).all()


def test_a_rows_mode_on_a_sliding_window_model_does_not_depend_on_its_batch_mates(capsys):
    """Mistral-style sliding window (40): a row of 26 positions fits it and takes the window mode alone
    or beside a row of 56 positions, which does not fit and is scored exactly. The mode used to be
    decided by the batch's width, so the long batch-mate sent the short row to exact."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        sliding_window=40,
        pad_token_id=0,
        attn_implementation="eager",
    )
    model = MistralForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(1)

    def row(n_reas, width):  # 3 prompt tokens, the reasoning, 2 answer tokens, EOS, right padding
        ids = torch.randint(3, 40, (width,), generator=g)
        n = 3 + n_reas + 2
        att = (torch.arange(width) <= n).long()
        ids[n], ids[n + 1 :] = 2, 0
        reas, ans = torch.zeros(width, dtype=torch.bool), torch.zeros(width, dtype=torch.bool)
        reas[3 : 3 + n_reas], ans[3 + n_reas : n] = True, True
        return ids, att, reas, ans

    short, long = row(20, 27), row(50, 60)
    kw = dict(probe="answer_mean", pad_token_id=0, mode="auto", window=2, auto_length=5)
    alone = perturbation_scores(model, *[x[None] for x in short], **kw)[0]
    widen = lambda x: torch.cat([x, torch.zeros(60 - x.shape[0], dtype=x.dtype)])
    both = perturbation_scores(model, *[torch.stack([widen(a), b]) for a, b in zip(short, long)], **kw)
    window_only = window_perturbation_scores(model, *[x[None] for x in short], window=2, pad_token_id=0)[0]
    torch.testing.assert_close(alone, window_only)  # the short row takes the window mode ...
    torch.testing.assert_close(both[0, :27], alone, rtol=1e-5, atol=1e-9)  # ... beside the long one too
    exact_long = perturbation_scores(model, *[x[None] for x in long], mode="exact", pad_token_id=0)[0]
    torch.testing.assert_close(both[1], exact_long, rtol=1e-5, atol=1e-9)  # the long row falls back to exact
    assert "window mode unavailable" in capsys.readouterr().out


def test_span_above_one_is_the_exact_modes_alone():
    """`span` > 1 masks that many tokens at once in the exact mode; a window row masks one, so the window and auto
    modes refuse it rather than ignore it."""
    model = tiny_llama(layers=2, seed=3)
    ids, attn, reas, ans = ragged_batch(seed=1)
    perturbation_scores(model, ids, attn, reas, ans, span=2, pad_token_id=0)  # the exact mode's approximation
    for mode in ("window", "auto"):
        with pytest.raises(AssertionError, match="span=2 needs mode='exact'"):
            perturbation_scores(model, ids, attn, reas, ans, span=2, mode=mode, pad_token_id=0)


def _window_definition(model, ids, attn, reas, ans, window: int, probe: str) -> torch.Tensor:
    """maths §3.2 one copy at a time, nothing packed or padded: the copy that masks j recomputes
    P_j = {j .. j+W} u {a0-1 .. E-1} (within the row's cut E) in a forward of its own after the row's clean cache,
    position p of P_j attending to the clean keys of the real positions q < p outside P_j and to its own q <= p;
    the clean outcome is read off the clean forward's logits."""
    from oar.lm import cache_kwargs, full_cache, position_ids, returned_cache
    from oar.probes import divergence, outcome

    scores = torch.zeros(ids.shape, dtype=torch.float32)
    pos = position_ids(attn)
    for b in range(ids.shape[0]):
        answer = ans[b].nonzero().flatten().tolist()
        if not answer:
            continue
        a0, end = max(answer[0], 1), answer[-1]
        row = dict(
            input_ids=ids[b : b + 1, :end], attention_mask=attn[b : b + 1, :end], position_ids=pos[b : b + 1, :end]
        )
        out = model(**row, use_cache=True)
        kv = [(layer.keys, layer.values) for layer in returned_cache(out).layers]
        targets, valid = ids[b, a0 : end + 1][None], ans[b, a0 : end + 1][None]
        clean = outcome(out.logits[:, a0 - 1 : end], targets, valid, probe)
        for j in [j for j in reas[b].nonzero().flatten().tolist() if j < end]:
            p = torch.tensor(sorted(set(range(j, min(j + window, end - 1) + 1)) | set(range(a0 - 1, end))))
            keys = torch.arange(end)
            to_cache = attn[b, :end].bool()[None] & (keys[None] < p[:, None]) & ~torch.isin(keys, p)[None]
            allowed = torch.cat([to_cache, p[None, :] <= p[:, None]], 1)
            if model.config._attn_implementation == "eager":
                allowed = torch.zeros(allowed.shape, dtype=model.dtype).masked_fill(
                    ~allowed, torch.finfo(model.dtype).min
                )
            logits = model(
                input_ids=torch.where(p == j, 0, ids[b, p])[None],
                attention_mask=allowed[None, None],
                position_ids=pos[b, p][None],
                **cache_kwargs(full_cache(kv)),
                use_cache=True,
            ).logits
            masked = outcome(logits[:, -(end - a0 + 1) :], targets, valid, probe)  # the answer slots come last
            scores[b, j] = divergence(clean, masked, probe).float()
    return scores


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("probe", PROBES)
def test_the_packed_copies_give_the_definitions_scores_whatever_the_budget(family, probe):
    # the batched window mode (U sequences of c copies a forward, rows padded to their block's longest, K
    # padded to its longest answer) against maths §3.2 one copy at a time, for windows that stop short of the
    # answer (where the mode is an approximation, so only the definition can pin it), the forwards in float64
    from test_oar_scores import _long_batch

    model = tiny_llama(layers=3, seed=3) if family == "llama" else tiny_qwen2(layers=3, seed=3)
    model = model.double()
    model.set_attn_implementation("sdpa")  # eager attention in float64 turns left-padded rows into NaN here
    with torch.no_grad():  # logits of ~10, not ~0.1: KLs far above the float32 rounding of the probes' log-probs
        model.lm_head.weight.mul_(100)
    ids, attn, reas, ans = _long_batch(lengths=(12, 50, 70, 20))
    for window in (0, 3):
        want = _window_definition(model, ids, attn, reas, ans, window, probe)
        assert want[reas].abs().max() > 0
        for budget in (None, 1, 200):
            got = window_perturbation_scores(
                model, ids, attn, reas, ans, window=window, probe=probe, pad_token_id=0, max_chunk_tokens=budget
            )
            # the probes compute in float32 (probes.outcome): their rounding, ~1e-6 of the largest score, is the floor
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
