"""scripts/bench/graph_replays.py: every call of the compiled loop is timed and checked against the
eager loop's tokens, and the profiled calls count launches (none on a CPU, where there are no graphs)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

import graph_replays as gr  # noqa: E402


def test_each_call_is_checked_and_two_are_profiled(monkeypatch, tmp_path):
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kwargs: fn
    )  # the CPU compile takes ~25 s; the script's logic is the subject
    out = gr.main(["--device", "cpu", "--calls", "5", "--new_tokens", "6", "--json", str(tmp_path / "r.json")])
    assert [r["call"] for r in out["calls"]] == list(range(5)) and all(
        isinstance(r["same_tokens"], bool) for r in out["calls"]
    )
    profiled = [r for r in out["calls"] if "graph_launches" in r]
    assert [r["call"] for r in profiled] == [3] and profiled[0]["graph_launches"] == 0
    assert (tmp_path / "r.json").exists() and out["eager_s_median"] > 0 and out["rollouts"] == 32
