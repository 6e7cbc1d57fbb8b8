"""What a run shows a person (oar/training/console.py): bars only where wanted, the step line's legend
once, each library warning once, metrics.png at the end; the heatmap script writes into the run."""

import json
import logging
import shutil

import pytest

from oar.training import console
from tinyrun import ROOT, TINY, run_inprocess


def _run_args(model, out, *extra):
    return [
        "--model",
        str(model),
        "--dataset",
        str(model / "data.jsonl"),
        "--eval_dataset",
        str(model / "data.jsonl"),
        "--eval_size",
        "4",
        "--output_dir",
        str(out),
        "--micro_batch_size",
        "4",
        "--steps",
        "2",
        *TINY,
        *extra,
    ]


def test_a_run_leaves_a_plot_explains_its_step_line_and_draws_no_bar_into_a_pipe(tiny_model, tmp_path, capsys):
    out = tmp_path / "run"
    run_inprocess(_run_args(tiny_model, out))
    printed = capsys.readouterr()
    assert printed.out.count(console.LEGEND) == 1 and printed.out.index(console.LEGEND) < printed.out.index(
        "step    1"
    )
    for field in ("reward", "len", "H", "clip", "ess", "|g|", "held-out"):  # every field of the step line is explained
        assert f"{field} = " in console.LEGEND
    assert "it/s" not in printed.err and "rollouts" not in printed.err  # stderr is not a terminal: no bars
    png = out / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width = matplotlib.image.imread(png).shape[:2]
    assert width > 3 * height  # four panels side by side


def test_the_plot_reads_metrics_jsonl(tmp_path):
    rows = [
        {
            "step": s,
            "reward/mean": 0.1 * s,
            "policy/entropy": 1.0 / s,
            "oar/frac_boosted": 0.3,
            "oar/frac_suppressed": 0.4,
            **({"eval/accuracy": 0.5} if s == 2 else {}),
        }
        for s in range(1, 5)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import matplotlib.pyplot as plt

    seen = []
    real = plt.Axes.plot
    plt.Axes.plot = lambda self, *a, **k: seen.append((a, k.get("label"))) or real(self, *a, **k)
    try:
        path = console.plot_metrics(tmp_path, before=0.2, after=0.7)
    finally:
        plt.Axes.plot = real
    assert path == tmp_path / "metrics.png" and path.stat().st_size > 1000
    series = {label: (list(x), list(y)) for (x, y), label in seen}
    assert series["mean reward"] == ([1, 2, 3, 4], pytest.approx([0.1, 0.2, 0.3, 0.4]))
    assert series["accuracy"] == ([0, 2, 4], [0.2, 0.5, 0.7])  # before training, along, after
    assert series["boosted"][1] == [0.3] * 4 and series["suppressed"][1] == [0.4] * 4


def test_a_library_warning_is_shown_once(caplog):
    logger = logging.getLogger("accelerate.accelerator")
    console.quiet_libraries(bars=False)
    for _ in range(3):  # as accelerate says "Removed shared tensor ..." at every save of a model with tied embeddings
        logger.warning("test_console: the same warning at every save")
    logger.warning("test_console: another one")
    said = [r.getMessage() for r in caplog.records]
    assert (
        said.count("test_console: the same warning at every save") == 1
        and said.count("test_console: another one") == 1
    )


@pytest.mark.parametrize("bars", [False, True])
def test_a_gguf_loads_with_its_bar_only_where_bars_are_wanted(bars):
    """transformers' GGUF de-quantization draws its own tqdm bar, ignoring its progress-bar setting: while a
    GGUF loads (oar/training/models.py), that bar follows the setting quiet_libraries made."""
    pytest.importorskip("gguf")
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from oar.training.models import _gguf_bar_as_configured

    console.quiet_libraries(bars=bars)
    try:
        bar = gguf_utils.tqdm
        with _gguf_bar_as_configured({"gguf_file": "m.gguf"}):
            assert gguf_utils.tqdm(range(2)).disable is not bars
        assert gguf_utils.tqdm is bar  # restored
    finally:
        hf_logging.enable_progress_bar()


def test_the_heatmap_script_writes_into_the_run_folder(tiny_model, tmp_path):
    from dataclasses import asdict

    from oar.training.config import Config
    from scripts.analysis import heatmap

    run = tmp_path / "run"
    shutil.copytree(tiny_model, run / "final")
    (run / "config.json").write_text(json.dumps(asdict(Config())))
    in_repo = lambda: sorted((p, p.stat().st_mtime) for p in ROOT.rglob("heatmap.*") if ".git" not in p.parts)
    before = in_repo()
    heatmap.main(["--run", str(run), "--rollout", "gold"])
    assert (run / "heatmap.html").is_file() and (run / "heatmap.png").is_file()
    assert in_repo() == before  # nothing written into the repository (docs/results/ was the default)


@pytest.mark.parametrize("loop", ["eager", "static"])
def test_the_rollout_bar_ticks_once_per_decode_step(loop):
    from oar.sampler import sample
    from oar.tasks.tiny_arith import TinyArithRecipe, make_model, make_tokenizer

    import torch

    torch.manual_seed(0)
    tok = make_tokenizer()
    model = make_model(tok, TinyArithRecipe(hidden_size=32, num_layers=1, num_heads=2)).eval()
    ticks = []
    ro = sample(
        model,
        tok,
        ["Compute 2 + 3.\n", "Compute 4 * 5.\n"],
        group_size=2,
        seeds=[1, 2, 3, 4],
        max_new_tokens=6,
        chunk=1,
        loop=loop,
        on_token=lambda: ticks.append(1),
    )
    quiet = sample(
        model,
        tok,
        ["Compute 2 + 3.\n", "Compute 4 * 5.\n"],
        group_size=2,
        seeds=[1, 2, 3, 4],
        max_new_tokens=6,
        chunk=1,
        loop=loop,
    )
    assert torch.equal(ro.input_ids, quiet.input_ids)  # the bar only counts
    assert 2 <= len(ticks) <= 2 * 6  # one per decode step of each of the 2 chunks, at most max_new_tokens each


def test_a_sampler_far_from_the_trainer_is_said_once(tmp_path, capsys):
    """sampler/logprob_diff_mean above SAMPLER_DRIFT means the rollouts came from another policy than the one
    trained (an engine whose weights did not follow): the run says so once; rounding-sized gaps say nothing."""
    from oar.training import runlog

    class Acc:
        is_main_process, log_with = True, None

    log = runlog.RunLog(Acc(), str(tmp_path), {}, resume=False, total_steps=3)
    line = {
        k: 0.0
        for k in (
            "reward/mean",
            "completion/length",
            "policy/entropy",
            "loss/clip_frac",
            "oar/ess_ratio",
            "optim/grad_norm",
            "time/step_s",
        )
    }
    capsys.readouterr()
    for step, drift in enumerate((3e-5, 0.4, 0.9), start=1):
        log.step(step, line | {"sampler/logprob_diff_mean": drift})
    said = capsys.readouterr().out
    assert (
        said.count("warning:") == 1 and "warning: step 2: the sampler's log-probs differ" in said and "0.400" in said
    )
