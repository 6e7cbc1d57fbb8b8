"""scripts/bench/bench_continuations.py on tiny-arith: both ways run on the same rows, the rows' tokens
agree, and the figures it prints are the ones it returns."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import bench_continuations as bc  # noqa: E402


def test_both_ways_give_every_rows_tokens_and_a_ratio(tmp_path, capsys):
    result = bc.main(
        [
            "--prefixes",
            "4",
            "--k",
            "3",
            "--batch",
            "6",
            "--max_new_tokens",
            "16",
            "--temperature",
            "1.5",
            "--repeats",
            "1",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    assert result["same_tokens"] and result["prefixes"] == 4
    assert all(len(s) == 1 and s[0] > 0 for s in result["cpu_seconds"].values())
    assert f"{result['ratio_per_row_over_shared']:.2f}x" in capsys.readouterr().out
    assert (tmp_path / "r.json").is_file()


def test_the_two_ways_differ_only_in_the_prefill():
    """The same rows in the same order: 2 prefixes x 3 continuations -> 6 rows either way, and the
    seeds make a prefix's continuations differ (temperature 1.5), so a mixed-up order would show."""
    from oar.sampler import encode_prompts, format_prompt
    from oar.tasks.tiny_arith_cache import model_source
    from oar.training.models import load_model

    model, tok = load_model(model_source("tiny-arith"))
    prompt = encode_prompts(tok, [format_prompt(tok, "Compute 7 * 8.")], "cpu")[0][0].tolist()
    kw = dict(batch=6, max_new_tokens=12, temperature=1.5)
    per_row = bc.continuations(model, tok, prompt, [], [0, 0], 3, shared=False, **kw)
    shared = bc.continuations(model, tok, prompt, [], [0, 0], 3, shared=True, **kw)
    assert per_row == shared and len(shared) == 6 and len({tuple(r) for r in shared[:3]}) > 1
