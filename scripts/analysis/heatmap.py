"""Token heatmap: what OAR-G and OAR-P boost and suppress on one rollout, side by side.

    python scripts/analysis/heatmap.py --run runs/study/oar-g-s0          # its final/ model, probe and gating
    python scripts/analysis/heatmap.py --model tiny-arith --rollout gold    # the starting model on a worked solution
    python scripts/analysis/heatmap.py --run runs/study/oar-p-s1 --index 7 --seed 3 --out /tmp/hm

Writes <out>.html (hover a token for its weight and score) and <out>.png: by default <run>/heatmap with
--run (beside the run's metrics.png), runs/heatmap/heatmap with --model.
Both methods score the SAME rollout; weights are gating.bilevel_weights of each score with the run's
probe and gating settings (train.py's defaults with --model). Colours: blue = suppressed (w < 1),
white = 1, red = boosted (w > 1); tokens outside the reasoning span (marker, answer, EOS) are framed
grey and keep weight 1; pivotal tokens (computed results, scripts/analysis/attribution.py) are underlined, so
a reader can see whether OAR finds them. Problems come from arith's train split, never the held-out one.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import TwoSlopeNorm, to_hex  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from oar.gating import bilevel_weights, weight_stats  # noqa: E402
from oar.rollout import char_offsets  # noqa: E402
from scripts.analysis.attribution import make_rollouts, pivotal_mask, scores_of, spearman  # noqa: E402

CMAP = plt.get_cmap("RdBu_r")
PANELS = (("oar-g", "OAR-G (gradient × input)"), ("oar-p", "OAR-P (perturbation)"))


def choose_rollout(
    model, tokenizer, problem, *, rollout: str, seed: int, max_new_tokens: int, temperature: float, tries: int = 20
):
    """One rollout of `problem` with an answer and reasoning to weigh: sampled (first seed from `seed`
    that gives one), greedy, or the gold solution teacher-forced."""
    for k in range(tries if rollout == "sample" else 1):
        ro = make_rollouts(
            model,
            tokenizer,
            [problem],
            source="gold" if rollout == "gold" else "sample",
            seed=seed + k,
            max_new_tokens=max_new_tokens,
            temperature=temperature if rollout == "sample" else 0.0,
        )
        if ro.answer_mask.any() and ro.reasoning_mask.any():
            return ro
    raise SystemExit(
        f"heatmap.py: error: no {rollout} rollout of {problem.problem!r} with a final answer in {tries} tries; "
        f"try --rollout gold, another --index, or a better-trained model."
    )


def heatmap_data(model, tokenizer, ro, *, probe: str, gating: dict, seed: int = 0, noise_std: float = 1e-3) -> dict:
    """Tokens of rollout 0's completion with each method's score and weight (plain lists, JSON-able)."""
    cols = ro.completion_mask[0].nonzero().flatten().tolist()
    ids = ro.input_ids[0, cols].tolist()
    text, offsets = char_offsets(tokenizer, ids)
    pivotal = pivotal_mask(tokenizer, ro.input_ids.cpu(), ro.completion_mask.cpu(), ro.prompt_width)[0]
    reasoning = ro.reasoning_mask[0].cpu()
    tokens = [
        {
            "text": text[s:e] or tokenizer.convert_ids_to_tokens(i),
            "reasoning": bool(reasoning[c]),
            "pivotal": bool(pivotal[c]),
        }
        for c, i, (s, e) in zip(cols, ids, offsets)
    ]
    panels = {}
    for name, _ in PANELS:
        scores = scores_of(name, model, tokenizer, ro, probe, seed=seed, noise_std=noise_std)  # (1, L)
        weights = bilevel_weights(scores, ro.reasoning_mask.cpu(), **gating)
        panels[name] = {
            "scores": scores[0, cols].tolist(),
            "weights": weights[0, cols].tolist(),
            "stats": weight_stats(weights, ro.reasoning_mask.cpu()),
        }
    r = [k for k, t in enumerate(tokens) if t["reasoning"]]
    agree = spearman([panels["oar-g"]["scores"][k] for k in r], [panels["oar-p"]["scores"][k] for k in r])
    return {
        "completion": text,
        "tokens": tokens,
        "panels": panels,
        "spearman": agree,
        "probe": probe,
        "gating": gating,
    }


def _vmax(data: dict) -> float:
    return max(2.0, *(max(p["weights"]) for p in data["panels"].values()))


def _color(w: float, norm) -> str:
    return to_hex(CMAP(norm(w)))


def _shown(text: str) -> str:
    return text.replace("\n", "↵\n")


def render_html(data: dict, title: str) -> str:
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=_vmax(data))
    panels = []
    for name, label in PANELS:
        p, spans = data["panels"][name], []
        for t, s, w in zip(data["tokens"], p["scores"], p["weights"]):
            cls = "tok" + ("" if t["reasoning"] else " other") + (" pivotal" if t["pivotal"] else "")
            tip = f"w={w:.3f} score={s:.3g}" if t["reasoning"] else "outside reasoning: w=1"
            style = f' style="background:{_color(w, norm)}"' if t["reasoning"] else ""
            spans.append(
                f'<span class="{cls}"{style} title="{html.escape(tip)}">{html.escape(_shown(t["text"]))}</span>'
            )
        st = p["stats"]
        panels.append(
            f'<div class="panel"><h3>{label}</h3><p class="stats">boosted {st["frac_boosted"]:.0%}, suppressed '
            f"{st['frac_suppressed']:.0%}, max w {st['weight_max']:.2f}, ESS {st['ess_ratio']:.2f}</p>"
            f'<div class="text">{"".join(spans)}</div></div>'
        )
    # The bar is laid out like the norm: 0 .. 1 on the left half, 1 .. vmax on the right half.
    gradient = ", ".join(f"{to_hex(CMAP(p))} {100 * p:.0f}%" for p in np.linspace(0, 1, 11))
    g = data["gating"]
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>OAR token heatmap</title><style>
body {{ font-family: sans-serif; margin: 24px; color: #222; max-width: 1200px; }}
.panels {{ display: flex; gap: 28px; flex-wrap: wrap; }} .panel {{ flex: 1; min-width: 340px; }}
.text {{ font-family: monospace; font-size: 18px; line-height: 2; white-space: pre-wrap; \
border: 1px solid #ddd; padding: 12px; border-radius: 6px; }}
.tok {{ padding: 3px 0; }} .tok.other {{ outline: 1px dashed #999; background: #f2f2f2; color: #777; }}
.tok.pivotal {{ text-decoration: underline; text-decoration-thickness: 2px; text-underline-offset: 5px; }}
.stats {{ color: #555; font-size: 14px; }} \
.bar {{ height: 14px; width: 360px; background: linear-gradient(to right, {gradient}); border: 1px solid #aaa; }}
.ticks {{ display: flex; justify-content: space-between; width: 360px; font-size: 12px; color: #555; }}
</style></head><body>
<h2>{html.escape(title)}</h2>
<p>probe <code>{data["probe"]}</code>, q = {g["quantile"]}, β = {g["boost"]}, floor {g["floor"]}, \
mass preservation {"on" if g["preserve_mass"] else "off"};
Spearman(OAR-G, OAR-P scores) over the reasoning tokens = {data["spearman"]:.2f}. \
Hover a token for its weight and score.</p>
<div class="panels">{"".join(panels)}</div>
<h4>Legend</h4><div class="bar"></div><div class="ticks">\
<span>0 (suppressed)</span><span>1</span><span>{norm.vmax:.1f} (boosted)</span></div>
<p class="stats">Underlined: pivotal tokens (the digits of a computed result). \
Dashed frame: outside the reasoning span (weight 1). ↵: newline.</p>
</body></html>
"""


def _layout(tokens: list[dict], width: int = 48) -> list[tuple[int, int, str]]:
    """(column, line, shown text) per token: newlines break lines, long lines wrap at `width`."""
    x = y = 0
    out = []
    for t in tokens:
        shown = t["text"].replace("\n", "↵")
        if x + len(shown) > width:
            x, y = 0, y + 1
        out.append((x, y, shown))
        x += len(shown)
        if "\n" in t["text"]:
            x, y = 0, y + 1
    return out


def render_png(data: dict, title: str, path: Path) -> Path:
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=_vmax(data))
    cells = _layout(data["tokens"])
    cols, rows = max(x + len(s) for x, _, s in cells), max(y for _, y, _ in cells) + 1
    fig = plt.figure(figsize=(14, 0.42 * rows + 4.2), dpi=130)
    grid = fig.add_gridspec(3, 2, height_ratios=[0.42 * rows + 0.6, 2.0, 0.18], hspace=0.55)
    font = min(15.0, 6.4 / max(cols, 20) * 72 / 0.62)  # monospace glyph ~0.6 em wide: fill a ~6.4 in panel
    for k, (name, label) in enumerate(PANELS):
        ax = fig.add_subplot(grid[0, k])
        p = data["panels"][name]
        for (x, y, shown), t, w in zip(cells, data["tokens"], p["weights"]):
            face = _color(w, norm) if t["reasoning"] else "#f2f2f2"
            ax.add_patch(
                Rectangle(
                    (x, y),
                    len(shown),
                    1,
                    facecolor=face,
                    edgecolor="#999" if not t["reasoning"] else "none",
                    ls="--" if not t["reasoning"] else "-",
                    lw=0.6,
                )
            )
            dark = t["reasoning"] and abs(norm(w) - 0.5) > 0.38
            ax.text(
                x + len(shown) / 2,
                y + 0.55,
                shown,
                ha="center",
                va="center",
                family="monospace",
                fontsize=font,
                color="white" if dark else ("#777" if not t["reasoning"] else "black"),
            )
            if t["pivotal"]:
                ax.plot([x + 0.1, x + len(shown) - 0.1], [y + 0.92, y + 0.92], color="black", lw=1.4)
        st = p["stats"]
        ax.set_title(
            f"{label}\nboosted {st['frac_boosted']:.0%}, suppressed {st['frac_suppressed']:.0%}, "
            f"max w {st['weight_max']:.2f}",
            fontsize=10,
        )
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.axis("off")
    ax = fig.add_subplot(grid[1, :])  # the two weight profiles along the reasoning tokens
    r = [k for k, t in enumerate(data["tokens"]) if t["reasoning"]]
    for k in r:
        if data["tokens"][k]["pivotal"]:
            ax.axvspan(r.index(k) - 0.5, r.index(k) + 0.5, color="#ffd92f", alpha=0.35, lw=0)
    for name, label in PANELS:
        ax.step(
            range(len(r)),
            [data["panels"][name]["weights"][k] for k in r],
            where="mid",
            label=label.split(" ")[0],
            color="#1f77b4" if name == "oar-g" else "#d62728",
        )
    ax.axhline(1.0, color="black", lw=0.6, ls=":")
    ax.set_xticks(
        range(len(r)), [data["tokens"][k]["text"].replace("\n", "↵") for k in r], family="monospace", fontsize=7
    )
    ax.set(
        ylabel="weight",
        title=f"weights along the reasoning (yellow: pivotal); Spearman of scores = {data['spearman']:.2f}",
    )
    ax.legend(fontsize=8, loc="upper left")
    cax = fig.add_subplot(grid[2, :])
    fig.colorbar(
        plt.cm.ScalarMappable(norm=norm, cmap=CMAP),
        cax=cax,
        orientation="horizontal",
        label="token weight: < 1 suppressed (blue), 1 neutral, > 1 boosted (red)",
    )
    fig.suptitle(title, fontsize=11)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def main(argv=None) -> None:
    from oar.tasks.arith import arith_problems
    from oar.training.models import load_model
    from oar.tasks.tiny_arith_cache import model_source
    from oar.rewards import reward
    from dataclasses import asdict

    from oar.training.config import Config
    from oar.training.console import bars_wanted, quiet_libraries

    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--run", help="a train.py output_dir with final/ (its config.json sets probe and gating)")
    src.add_argument("--model", default="tiny-arith", help="a model name as train.py --model takes it")
    p.add_argument("--index", type=int, default=0, help="which arith train problem (of a fixed draw)")
    p.add_argument("--rollout", default="sample", choices=["sample", "greedy", "gold"])
    p.add_argument(
        "--seed", type=int, default=0, help="sampling seed (the first that gives an answer is kept) and OAR-G noise"
    )
    p.add_argument("--probe", default=None, help="override the run's probe")
    p.add_argument(
        "--out", default=None, help="output path without extension (default: <run>/heatmap, or runs/heatmap/heatmap)"
    )
    a = p.parse_args(argv)
    cfg = asdict(Config())
    if a.run:
        if not (Path(a.run) / "final" / "config.json").is_file():
            raise SystemExit(
                f"heatmap.py: error: --run {a.run}: no final/ model there (a run writes it when it finishes); "
                f"pass a finished output_dir, or --model."
            )
        cfg |= json.loads((Path(a.run) / "config.json").read_text()) if (Path(a.run) / "config.json").exists() else {}
    quiet_libraries(bars_wanted(True))  # transformers' loading bar only on a terminal, as train.py's
    torch.manual_seed(a.seed)
    model, tok = load_model(str(Path(a.run) / "final") if a.run else model_source(a.model))
    model.eval()
    problem = arith_problems(a.index + 1, split="train", seed=20_000)[a.index]
    ro = choose_rollout(
        model,
        tok,
        problem,
        rollout=a.rollout,
        seed=a.seed,
        max_new_tokens=cfg["max_new_tokens"],
        temperature=cfg["temperature"],
    )
    gating = {
        "quantile": cfg["gate_quantile"],
        "boost": cfg["gate_boost"],
        "floor": cfg.get("gate_floor", Config.gate_floor),
        "preserve_mass": cfg.get("preserve_mass", Config.preserve_mass),
    }
    data = heatmap_data(
        model, tok, ro, probe=a.probe or cfg["probe"], gating=gating, seed=a.seed, noise_std=cfg["noise_std"]
    )
    ok = "correct" if reward(ro.texts[0], problem.answer) else f"wrong (gold {problem.answer})"
    title = f"{a.run or a.model}: {problem.problem} — {a.rollout} rollout, {ok}"
    out = Path(a.out or (Path(a.run) / "heatmap" if a.run else "runs/heatmap/heatmap"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".html").write_text(render_html(data, title))
    render_png(data, title, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.html')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
