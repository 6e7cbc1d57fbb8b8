"""The page of research/testbeds_v5/report_v5.py: its summary.json rendered as research/testbeds_v5/README.md
(tables of the runs, the paired differences, the planted flaws and the attribution; what the numbers mean)."""

from __future__ import annotations

import math

import numpy as np


def _minutes(seconds: list) -> str:
    """Mean minutes over the runs whose time is whole (research/common/runs.py's fully_timed), saying how many."""
    timed = [x for x in seconds if x is not None and not math.isnan(x)]
    mean = f"{np.mean(timed) / 60:.1f} min" if timed else "n/a"
    return mean if len(timed) == len(seconds) else f"{mean} ({len(timed)} of {len(seconds)} runs timed whole)"


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def _f(x, digits=2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown(summary: dict, images) -> str:
    s = summary["settings"]
    lines = [
        "# Where token-level credit helps: the plan's six credit methods (and any beyond it) on three testbeds "
        f"({summary['status']})",
        "",
        f"Generated {summary['generated']} by `{summary['report_command']}` from the runs of `{summary['command']}`.",
        "",
        "**Settings, fixed before the first run** (research/testbeds_v5/study_v5.py): "
        f"{s['steps']} steps × {s.get('prompts_per_step', 32)} prompts × {s.get('group_size', 8)} rollouts = the same "
        f"{s['steps'] * s.get('prompts_per_step', 32) * s.get('group_size', 8):,} rollouts per run for every method; "
        "train.py's defaults otherwise (lr 5e-5, OAR q = 0.4, β = 2, floor 0.1, probe answer_mean, "
        "entropy-mask ρ = 0.2, tempo's TD term with coefficient 1); held-out: "
        f"{s.get('eval_size', 500)} problems of arith's test split, greedy, every {s['eval_every']} steps and at the "
        "end; completion budget 64 tokens (filler: 96); seeds 0-4; each testbed's starting model built once (seed 0). "
        "Nothing was chosen on the held-out split.",
        "",
    ]
    versions: dict[str, list[str]] = {}  # the code's hash -> the runs it made (a resumed run may have two)
    for tb, methods in summary["testbeds"].items():
        for m, v in methods.items():
            for seed, code in zip(v["seeds"], v["code_by_seed"]):
                versions.setdefault("+".join(code) or "unknown", []).append(f"{tb}/{m}-s{seed}")
    if len(versions) > 1:
        lines += [
            "Code (research/common/study_run.py's hash of train.py and oar/*.py; the tree moved during the study, "
            "runs.csv has each run's): "
            + "; ".join(
                f"`{c}` {len(r)} run{'s' * (len(r) > 1)}" + ("" if len(r) > 10 else f" ({', '.join(r)})")
                for c, r in sorted(versions.items(), key=lambda kv: -len(kv[1]))
            )
            + ".",
            "",
        ]
    if summary.get("beyond_plan"):
        lines += [
            f"Beyond the plan: {', '.join(f'`{m}`' for m in summary['beyond_plan'])} (not in the paper; named after "
            "the plan was fixed, same settings and seeds, run with `study_v5.py --methods`), in the tables below and "
            "not in the run count.",
            "",
        ]
    if summary["builds"]:
        lines += [
            "Starting models (built by the study, seed 0, oar/tasks/testbeds.py's recipes): "
            + "; ".join(
                f"`{tb}` {_pct(b['heldout_accuracy'])}% held-out (greedy, build's own 500 problems), "
                f"{b['build_seconds'] / 60:.0f} min "
                f"({b['build_cpu_seconds'] / 60:.0f} min CPU) on {b['torch_threads']} torch thread(s)"
                for tb, b in summary["builds"].items()
            )
            + ".",
            "",
        ]
    for tb, methods in summary["testbeds"].items():
        lines += [
            f"## Testbed `{tb}`",
            "",
            "| method | seeds | before | after (mean ± std) | per seed | paired Δ vs GRPO (± s.e.) "
            "| train reward (last 5 steps) | policy entropy (last 10 steps, nats/token) | training time "
            "| CPU time/run |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m, v in methods.items():
            d = v["paired_diff_vs_grpo"]
            delta = (
                "—" if m == "grpo" else (f"{100 * d['mean']:+.1f} ± {_pct(d['se'])} (n={d['n']})" if d["n"] else "n/a")
            )
            lines.append(
                f"| {m} | {', '.join(map(str, v['seeds']))} | {_pct(np.mean(v['accuracy_before']))} "
                f"| {_pct(v['mean'])} ± {_pct(v['std'])} | "
                f"{', '.join(_pct(a) for a in v['accuracy_after'])} | {delta} | {_pct(v['final_train_reward'])} | "
                f"{_f(v['final_policy_entropy']['mean'], 4)} ± {_f(v['final_policy_entropy']['std'], 4)} | "
                f"{np.mean(v['train_seconds']) / 60:.1f} min | {_minutes(v['cpu_seconds'])} |"
            )
        steps = sorted({int(st) for v in methods.values() for st in v["paired_curve_vs_grpo"]})
        windows = sorted(
            {w for v in methods.values() for w in v["paired_train_reward_vs_grpo"]}, key=lambda w: int(w.split("-")[0])
        )
        lines += [
            "",
            "Paired Δ vs GRPO (points; ± s.e. over the seeds both have, n): held-out accuracy at each evaluation, and "
            "the sampled train reward averaged over the steps between evaluations (the same problems for both at a "
            "seed):",
            "",
            "| method | "
            + " | ".join([f"held-out, step {st}" for st in steps] + [f"train reward, steps {w}" for w in windows])
            + " |",
            "|---|" + "---|" * (len(steps) + len(windows)),
        ]
        for m, v in methods.items():
            if m != "grpo":
                cells = [v["paired_curve_vs_grpo"].get(str(st)) for st in steps] + [
                    v["paired_train_reward_vs_grpo"].get(w) for w in windows
                ]
                lines.append(
                    f"| {m} | "
                    + " | ".join(
                        "n/a" if c is None or not c["n"] else f"{100 * c['mean']:+.1f} ± {_pct(c['se'])} ({c['n']})"
                        for c in cells
                    )
                    + " |"
                )
        lines += [
            "",
            "The planted flaws in the final models' held-out completions (greedy; %, mean ± std over the seeds whose "
            "completions were kept, n): 3-operation problems answered one line early (the fork), completions with a "
            "written result that is not `a op b` (a slip, the model's own errors included):",
            "",
            "| method | answered early (3-op) | with a slip |",
            "|---|---|---|",
        ]
        for m, v in methods.items():
            f = v["flaws"]
            lines.append(
                f"| {m} | "
                + " | ".join(
                    "n/a" if not f[k]["n"] else f"{_pct(f[k]['mean'])} ± {_pct(f[k]['std'])} ({f[k]['n']})"
                    for k in ("early_answers_3op", "with_slip")
                )
                + " |"
            )
        lines.append("")
    if summary["attribution"]:
        lines += [
            "## Where each method puts the advantage (starting models, known tokens)",
            "",
            "Each testbed's starting model samples 8 rollouts for each of 48 train-split 3-operation problems; every "
            "method weighs the same rollouts through train.py's credit interface. Over the scope of each rollout with "
            "advantage ≠ 0 (its reasoning tokens and its fork token: a rollout that answers early forks on the first "
            "`#` of its `####` marker, which OAR's gate leaves at 1): precision@k and ROC-AUC of |w| against the "
            "pivotal tokens (result digits, the fork, the slips), ROC-AUC against the planted tokens alone (the fork "
            "and the slips), and the mean weight w (signed: TEMPO's can be negative) on the fork (all; where the "
            "rollout stopped; where it went on), slip and filler tokens and on the other reasoning tokens. ± is a "
            "standard error clustered by prompt. GRPO's all-ones weights give the base rate and 0.5.",
            "",
            "| testbed | method | rollouts | precision@k | ROC-AUC | ROC-AUC planted | w fork | w fork stop / go "
            "| w slip | w filler | w other | share w < 0 |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for tb, a in summary["attribution"].items():
            for r in a["table"]:
                cell = lambda k: f"{_f(r[k])} ± {_f(r[k + '_se'])}" if r.get(k + "_n", 0) > 1 else _f(r.get(k))  # noqa: E731
                split = f"{_f(r.get('w_fork_stop'))} / {_f(r.get('w_fork_go'))}"
                lines.append(
                    f"| {tb} | {r['method']} | {r['rollouts']} | {cell('precision_at_k')} | {cell('roc_auc')} "
                    f"| {cell('roc_auc_planted')} | {cell('w_fork')} | {split} | {cell('w_slip')} "
                    f"| {cell('w_filler')} | {cell('w_other')} | {_f(r['frac_negative'], 3)} |"
                )
        lines += [
            "",
            "Rollouts with a fork / slip token, and the starting model's sample accuracy: "
            + "; ".join(
                f"{tb}: {a['rollouts_with_fork']} / {a['rollouts_with_slip']} of {a['prompts'] * a['group_size']}, "
                f"{_pct(a['sample_accuracy'])}%"
                for tb, a in summary["attribution"].items()
            )
            + ". Of the rollouts scored, the fork stopped / went on in: "
            + "; ".join(
                f"{tb} {a['table'][0].get('w_fork_stop_n', 'n/a')} / {a['table'][0].get('w_fork_go_n', 'n/a')}"
                for tb, a in summary["attribution"].items()
                if a["rollouts_with_fork"]
            )
            + ".",
            "",
        ]
    lines += [f"![{p.stem}]({p.name})" for p in images] + [""]
    return "\n".join(lines)
