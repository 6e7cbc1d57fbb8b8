"""scripts/bench/bench_growth.py: a sampled window mode is timed on whole forwards of the size training
packs (oar_perturb_window.packing's U sequences of c copies), never on fewer copies per forward than training;
bench_parts.oar_p_sweep checks what it times against the naive definition."""

import sys
from pathlib import Path

from conftest import tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import bench_growth as bg  # noqa: E402
import bench_parts as bp  # noqa: E402


def test_a_sampled_window_mode_is_timed_on_whole_forwards_of_trainings_size():
    model = tiny_llama(vocab_size=40)
    forwards = []
    hook = lambda _, args, kwargs: forwards.append(
        tuple(ids.shape) if (ids := kwargs.get("input_ids")) is not None else None
    )
    model.register_forward_pre_hook(hook, with_kwargs=True)
    synthetic = lambda *a, seed: bp.synthetic(*a, seed=seed, vocab=(3, 40))
    # a row cut at E = 47 (8 + 32 + 8 - 1), 13 slots a copy, one copy a sequence of 47 + 13 positions: 3 a forward
    window, answer, chunk = 4, 8, 180
    rows = bg.growth(
        model,
        0,
        synthetic,
        bp.every_kth,
        lengths=[32],
        prompt=8,
        answer=answer,
        windows=[window],
        k=4,
        exact_all_up_to=0,
        window_all_up_to=0,
        chunk_tokens=4096,
        window_chunk_tokens=chunk,
    )
    from oar.oar_perturb_window import packing

    assert packing(47, answer, window, chunk) == (1, 3)
    assert rows[0]["window4_positions_timed"] == 6  # k = 4 rounded up to two forwards of 3 copies
    assert forwards.count((3, window + 1 + answer)) >= 2  # the timed forwards are full ones
    assert rows[0]["exact_positions_timed"] == 4 and rows[0]["window4_s"] > 0


def test_the_oar_p_sweep_checks_the_fast_scores_against_the_naive_ones():
    model = tiny_llama(vocab_size=40_000)  # bench_parts.synthetic's ids
    rows = bp.oar_p_sweep(model, 0, prompt=8, lengths=[8, 24], answer=4, k=8, fast_all_up_to=8)
    assert [r["fast_positions_timed"] for r in rows] == [8, 8] and [r["naive_positions_timed"] for r in rows] == [8, 8]
    assert all(r["max_err_rel"] < 1e-4 and r["speedup"] > 0 for r in rows), rows
