"""The proxy-ceiling study's metrics, tables and pre-registered decision, from measure.py's ledger alone.

Legend: N rollouts of a set (the scored ones: reasoning tokens, an answer), n_R a rollout's reasoning tokens, D a
cell's OAR-G draws, K draws averaged, B = D // K disjoint blocks of K draws.

Per rollout, on its reasoning tokens, every score by its magnitude |s| (the gate reads log(1 + |s|), maths §5):
  spearman   rank correlation with exact OAR-P of the same probe (midranks; undefined where either is constant)
  top20      |top k of the method & top k of OAR-P| / k, k = ceil(0.2 n_R), ties shared out in expectation
             (value_metrics.top_membership)
  retest     Spearman between two independent K-draw means of OAR-G (blocks 2b and 2b + 1, averaged over b):
             1 by construction for a method without noise
  share      the ΔV² share in the method's top 20% (value_metrics.metrics / pooled_share: the signal-or-gate
             table's lead metric; pooled over rollouts, a jackknife s.e. over problems), where the rollout has values
  auc        ROC-AUC of the planted tokens (fork, slip) among the reasoning tokens (testbeds; rollouts with one)
An OAR-G cell with K draws is the mean over draws of |<g, e>| (each draw's score, then averaged); its metrics are
averaged over the B blocks (each a K-draw method: B estimates of the same expectation). Cells: mean over rollouts
± s.e. with the rollouts clustered by problem (the G rollouts of a problem are one unit, value_metrics.
clustered_mean_se); a paired difference is taken rollout by rollout, then clustered the same way. Cost: the sum
over the set's rollouts of the method's CPU seconds over that of one OAR-G pass (answer_mean, sigma 1e-3, draw 0,
measured beside it on every rollout); K draws cost the cell's batch of K rows (measure.py's batch_sizes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from oar.probes import PROBES
from scripts.analysis.attribution import average_ranks, roc_auc
from scripts.analysis.value_metrics import TOP, clustered_mean_se, metrics, pooled_share, top_membership

KS = (1, 4, 16)
SET_ORDER = ("tiny-arith", "fork", "slip", "filler", "smollm2")
BASE = "oar-g/answer_mean/0.001"


# ----------------------------------------------------------------------------------------------- per rollout


def spearman(a, b) -> float:
    """Rank correlation with midranks; NaN where either side is constant or has fewer than 2 tokens."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return math.nan
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / math.sqrt((ra**2).sum() * (rb**2).sum()))


def top_overlap(a, b) -> float:
    """The expected share of the k largest of b among the k largest of a, k = ceil(TOP n), ties shared."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    k = max(1, math.ceil(TOP * len(a)))
    return float((top_membership(a, k) * top_membership(b, k)).sum() / k)


def blocks(draws: list[list[float]], k: int) -> list[np.ndarray]:
    """The means of the disjoint blocks of k draws (B = D // k of them), each |score| first."""
    d = np.abs(np.asarray(draws, float))
    return [d[b * k : (b + 1) * k].mean(0) for b in range(len(d) // k)]


def methods_of(rec: dict) -> dict[str, list[np.ndarray]]:
    """{method: its versions (one, or the B blocks of an OAR-G cell at each K)} of one rollout, as |score|."""
    out = {}
    for name, s in rec["scores"].items():
        if drawn(name):
            for k in KS:
                if len(s) >= k:
                    out[f"{name}/K{k}"] = blocks(s, k)
        else:
            out[name] = [np.abs(np.asarray(s, float))]
    return out


def drawn(name: str) -> bool:
    """Whether a method's scores are noise draws (OAR-G's cells, mask-grad): a list of draws, K-draw versions."""
    return name.startswith(("oar-g/", "mask-grad/"))


def noiseless(name: str) -> bool:
    """A method whose scores are the same every time: no noise, or noise of sigma 0."""
    return not drawn(name) or float(name.split("/")[2]) == 0.0


def reference(name: str) -> str:
    """The exact OAR-P a method is compared with: its probe's, answer_mean's for a method without one."""
    probe = next((p for p in PROBES if f"/{p}" in name), "answer_mean")
    return f"oar-p/{probe}"


def rollout_metrics(rec: dict) -> dict[str, dict]:
    """{method: {rho: {probe: Spearman with that probe's exact OAR-P}, top20, retest, auc, share parts}} of one
    scored rollout of the cache (top20 against the method's own reference OAR-P)."""
    versions = methods_of(rec)
    v = rec.get("values")
    has_values = (
        v is not None and v.get("positions") == rec["positions"] and len(v.get("dv", [])) == len(rec["positions"])
    )
    planted = np.asarray(rec.get("planted", []), bool)
    out = {}
    for name, vs in versions.items():
        m = {
            "rho": {p: _mean_defined([spearman(x, versions[f"oar-p/{p}"][0]) for x in vs]) for p in PROBES},
            "top20": float(np.mean([top_overlap(x, versions[reference(name)][0]) for x in vs])),
            "retest": math.nan,
            "auc": _mean_defined([roc_auc(x, planted) for x in vs])
            if planted.any() and not planted.all()
            else math.nan,
        }
        if noiseless(name):
            m["retest"] = 1.0  # the same scores every time
        elif len(vs) >= 2:
            m["retest"] = _mean_defined([spearman(vs[2 * b], vs[2 * b + 1]) for b in range(len(vs) // 2)])
        if has_values:
            parts = [metrics(x.tolist(), v, rec["correct"]) for x in vs]
            m |= {key: float(np.mean([p[key] for p in parts])) for key in ("share_num", "share_base", "mass")}
        out[name] = m
    return out


def _mean_defined(xs) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return float(np.mean(xs)) if xs else math.nan


def cpu_of(rec: dict, name: str) -> float:
    """CPU seconds of method `name` on one rollout of the cache. An OAR-G cell at K draws: its batch of K rows, or K
    times the per-row time of its largest batch where it has no batch of K."""
    if not drawn(name):
        return rec["cpu_s"][name]
    cell, k = name.rsplit("/K", 1)
    batches = {size: t for size, t in rec["cpu_s"][cell]}
    return batches[int(k)] if int(k) in batches else int(k) * batches[max(batches)] / max(batches)


def ledger_of(cache: dict) -> dict:
    """The set's ledger: its settings, and every rollout's identity, metrics and costs (no scores)."""
    rows = []
    reweighted = grail_rows(cache)
    for rec in cache["rollouts"]:
        row = {k: rec[k] for k in ("rollout", "problem", "seed", "correct")} | {"n_reasoning": len(rec["positions"])}
        if rec.get("scores"):
            m = rollout_metrics(rec)
            row["metrics"] = _rounded(m)
            v = rec.get("values")
            if v is not None and v.get("positions") == rec["positions"] and v.get("dv"):
                # training's own draw alone, to set beside the signal-or-gate table's OAR-G (same rollouts, same noise)
                row["training_draw"] = _rounded(metrics(rec["scores"][BASE][0], v, rec["correct"]))
                row["value_jump"] = _rounded(
                    {
                        name: metrics(w, v, rec["correct"])
                        for name, w in value_jump_weights(rec, reweighted[rec["rollout"]]).items()
                    }
                )
            row["cpu_s"] = {name: round(cpu_of(rec, name), 6) for name in m} | {
                "clean forward": round(rec["cpu_s"]["clean forward"], 6)
            }
        rows.append(row)
    return {"settings": cache["settings"], "rollouts": rows}


VALUE_JUMP = ("oar-g", "oar-p", "grail", "grail (every rollout)", "entropy", "surprisal")


def value_jump_weights(rec: dict, grail_reweighted: bool) -> dict[str, list[float]]:
    """The weights each method of the signal-or-gate value-jump table gives one rollout's reasoning tokens, as that
    table weighs them: OAR-G (training's draw) and OAR-P (answer_mean) through the gate at q = 0.4, beta = 2 (floor
    0.1, mass preserved); entropy and surprisal raw (its controls); GRAIL through its own weights
    (`oar.grail.grail_weights`, its run's defaults: spread 0.5, clip [0.5, 5]) on the rollouts GRAIL reweights, the
    wrong ones (A_i <= 0), and again on every rollout (as the attribution scores every rollout of the others)."""
    import torch

    from oar.gating import bilevel_weights
    from oar.grail import grail_weights

    s = rec["scores"]
    n = len(rec["positions"])
    every = torch.ones(1, n, dtype=torch.bool)
    gate = lambda x: bilevel_weights(torch.tensor([x]), every, quantile=0.4, boost=2.0)[0].tolist()  # noqa: E731
    grail = lambda rows: grail_weights(torch.tensor([s["grail"]]), every, torch.tensor([rows])).weights[0].tolist()  # noqa: E731
    return {
        "oar-g": gate(s[BASE][0]),
        "oar-p": gate(s["oar-p/answer_mean"]),
        "grail": grail(grail_reweighted),
        "grail (every rollout)": grail(True),
        "entropy": s["entropy"],
        "surprisal": s["surprisal"],
    }


def grail_rows(cache: dict) -> dict[int, bool]:
    """{rollout: whether GRAIL reweights it}: A_i <= 0 (`oar.grail.reweighted_rows`, 'wrong'), A_i from the rewards
    of the rollout's problem (a set's rollouts of one problem are its group)."""
    import torch

    from oar.grail import reweighted_rows
    from oar.grpo import group_advantages

    by: dict[int, list[dict]] = {}
    for r in cache["rollouts"]:
        by.setdefault(r["problem"], []).append(r)
    out = {}
    for group in by.values():
        rewards = torch.tensor([float(r["correct"]) for r in group])
        if len(group) < 2:
            out |= {r["rollout"]: True for r in group}
            continue
        flags = reweighted_rows(group_advantages(rewards, len(group)), "wrong").tolist()
        out |= {r["rollout"]: f for r, f in zip(group, flags)}
    return out


def value_jump_table(data: dict) -> str:
    """The signal-or-gate value-jump table's columns (value_metrics.table) for VALUE_JUMP, on the rollouts with
    values at their positions."""
    from scripts.analysis.value_metrics import table

    recs = [
        {
            "problem": r["problem"],
            "methods": {k: {x: _num(y) for x, y in m.items()} for k, m in r["value_jump"].items()},
        }
        for r in scored(data)
        if "value_jump" in r
    ]
    return table(recs, list(VALUE_JUMP)) if recs else ""


def _rounded(x):
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return None if isinstance(x, float) and math.isnan(x) else round(x, 6) if isinstance(x, float) else x


def _num(x) -> float:
    return math.nan if x is None else float(x)


# ----------------------------------------------------------------------------------------------- over rollouts


def scored(ledger: dict) -> list[dict]:
    return [r for r in ledger["rollouts"] if r.get("metrics")]


def summarize(ledger: dict) -> dict:
    """{method: {metric: [mean, se, n, problems]}, share, share_none, cost} over a set's scored rollouts."""
    recs = scored(ledger)
    problems = [r["problem"] for r in recs]
    base_cost = sum(r["cpu_s"][f"{BASE}/K1"] for r in recs)
    out = {}
    for name in recs[0]["metrics"] if recs else ():
        ms = [r["metrics"][name] for r in recs]
        probe = reference(name).split("/")[1]
        row = {"spearman": list(clustered_mean_se([_num(m["rho"][probe]) for m in ms], problems))}
        for key in ("top20", "retest", "auc"):
            row[key] = list(clustered_mean_se([_num(m[key]) for m in ms], problems))
        shares = [{"problem": r["problem"], "methods": {name: m}} for r, m in zip(recs, ms) if "share_num" in m]
        row["share"] = list(pooled_share(shares, name)) if shares else [math.nan, math.nan, 0]
        row["share_none"] = _no_information(shares, name)
        row["cost"] = sum(r["cpu_s"][name] for r in recs) / base_cost if base_cost > 0 else math.nan
        out[name] = row
    return out


def _no_information(shares: list[dict], name: str) -> float:
    mass = sum(s["methods"][name]["mass"] for s in shares)
    return sum(s["methods"][name]["share_base"] for s in shares) / mass if mass > 0 else math.nan


def against(ledger: dict, name: str, probe: str) -> list[float]:
    """Per scored rollout: Spearman of method `name` with exact OAR-P of `probe`."""
    return [_num(r["metrics"][name]["rho"][probe]) for r in scored(ledger)]


def paired_share(ledger: dict, a: str, b: str) -> list:
    """[share(a) - share(b), its jackknife s.e. over problems, problems] of the pooled ΔV² share."""
    rows = []
    for r in scored(ledger):
        ma, mb = r["metrics"][a], r["metrics"][b]
        if "share_num" in ma:
            d = {"share_num": ma["share_num"] - mb["share_num"], "share_base": 0.0, "mass": ma["mass"]}
            rows.append({"problem": r["problem"], "methods": {"d": d}})
    return list(pooled_share(rows, "d")) if rows else [math.nan, math.nan, 0]


# ----------------------------------------------------------------------------------------------- tables


def cell(x: list, digits: int = 3) -> str:
    mean, se = x[0], x[1]
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "—"
    return f"{mean:.{digits}f} ± {se:.{digits}f}" if se == se else f"{mean:.{digits}f}"


def label(name: str) -> str:
    """A method's row label: 'OAR-G, sigma 1e-3, K = 4' rather than the ledger's key."""
    parts = name.split("/")
    kind = parts[0]
    if kind == "oar-g":
        sigma = float(parts[2])
        return f"OAR-G σ = {sigma:g}, K = {parts[3][1:]}" if sigma > 0 else f"OAR-G σ = 0, K = {parts[3][1:]}"
    if kind == "mask-grad":
        return f"mask-grad σ = {float(parts[2]):g}, K = {parts[3][1:]}"
    if kind.startswith("J-"):
        return f"J(α = {kind[2:]})"
    if kind.startswith("window-"):
        return f"OAR-P window W = {kind[7:]}"
    if kind == "oar-p":
        return "OAR-P exact (reference)"
    return {"grail": "GRAIL", "entropy": "entropy", "surprisal": "surprisal"}.get(kind, name)


def order(names: list[str], probe: str) -> list[str]:
    """The rows of a probe's table, in reading order: OAR-P, its windows, the curve, OAR-G, the others."""
    kinds = ("oar-p", "window-", "J-", "oar-g", "mask-grad")

    def rank(n):
        kind = next(k for k in kinds if n.startswith(k))
        nums = [float(x) for x in n.replace("K", "").replace("window-", "").replace("J-", "").split("/") if _is_num(x)]
        return kinds.index(kind), nums

    out = sorted([n for n in names if f"/{probe}" in n], key=rank)
    if probe == "answer_mean":
        out += [n for n in ("grail", "entropy", "surprisal") if n in names]
    return out


def _is_num(x: str) -> bool:
    try:
        float(x)
    except ValueError:
        return False
    return True


def set_table(name: str, summary: dict, probe: str) -> str:
    has_share = any(not math.isnan(r["share"][0]) for r in summary.values())
    has_auc = any(not math.isnan(r["auc"][0]) for r in summary.values())
    head = ["method", "cost (× one OAR-G pass)", "test-retest", "Spearman with exact OAR-P", "top-20% overlap"]
    head += ["ΔV² share in top 20%"] * has_share + ["planted-token AUC"] * has_auc
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for m in order(list(summary), probe):
        r = summary[m]
        cols = [label(m), f"{r['cost']:.2f}", cell(r["retest"]), cell(r["spearman"]), cell(r["top20"])]
        cols += [cell(r["share"])] * has_share + [cell(r["auc"])] * has_auc
        lines.append("| " + " | ".join(cols) + " |")
    n = next(iter(summary.values()))["spearman"]
    note = f"\n\n{name}, probe {probe}: {n[2]} rollouts of {n[3]} problems; ± s.e. over problems."
    if has_share:
        none = next(iter(summary.values()))["share_none"]
        note += f" No information puts {none:.3f} of the ΔV² in its top 20%."
    return "\n".join(lines) + note


def headline(summaries: dict) -> str:
    """Spearman with exact OAR-P (answer_mean), the rows a user chooses between, one column a set."""
    rows = [
        "J-0.01/answer_mean",
        "J-0.1/answer_mean",
        "J-0.3/answer_mean",
        "J-1/answer_mean",
        "window-8/answer_mean",
        "window-16/answer_mean",
        f"{BASE}/K1",
        f"{BASE}/K4",
        f"{BASE}/K16",
        "oar-g/answer_mean/0.1/K1",
        "oar-g/answer_mean/0.1/K16",
        "oar-g/answer_joint/0.001/K1",
        "oar-g/last/0.001/K1",
        "mask-grad/answer_mean/0.001/K1",
        "mask-grad/last/0.001/K1",
        "mask-grad/answer_joint/0/K1",
        "grail",
        "entropy",
        "surprisal",
    ]
    sets = [s for s in SET_ORDER if s in summaries]
    lines = ["| method (vs exact OAR-P, answer_mean) | " + " | ".join(sets) + " |", "|" + " --- |" * (len(sets) + 1)]
    for m in rows:
        cells = []
        for s in sets:
            r = summaries[s].get(m)
            cells.append("—" if r is None else f"{cell(r['spearman'])} ({r['cost']:.1f}×)")
        lines.append(
            f"| {label(m)}{'' if '/' not in m or 'answer_mean' in m else ', ' + m.split('/')[1]} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- the decision

RULE = {
    "cost_at_most": 1.5,  # x one OAR-G pass, measured on smollm2
    "gain_at_least": 0.15,  # in mean Spearman with exact OAR-P over today's OAR-G of the target probe
    "z_at_least": 3.0,  # gain / its clustered s.e.: about p < 0.0013 one-sided, for the ~60 (candidate, probe) pairs
    "retest_slack": 0.1,  # test-retest at least today's OAR-G's less this
    "share_se": 2.0,  # ΔV² share not below today's OAR-G's by more than this many s.e. (paired, jackknife)
}


def decide(data: dict, summary: dict) -> dict:
    """The pre-registered rule (README, "Pre-registration") on smollm2's ledger: which cheap variant, if any, ships."""
    problems = [r["problem"] for r in scored(data)]
    candidates = [m for m, r in summary.items() if r["cost"] <= RULE["cost_at_most"] and not m.startswith("oar-p/")]
    rows, passed = [], []
    for probe in PROBES:
        base = f"oar-g/{probe}/0.001/K1"
        rho_base = against(data, base, probe)
        for c in candidates:
            if c == base:
                continue
            d = [a - b for a, b in zip(against(data, c, probe), rho_base)]
            gain, se, n, k = clustered_mean_se(d, problems)
            share = paired_share(data, c, base)
            retest = summary[c]["retest"][0]
            checks = {
                "gain": gain >= RULE["gain_at_least"],
                "z": gain >= RULE["z_at_least"] * se,  # False where se is NaN (one problem)
                "retest": retest >= summary[base]["retest"][0] - RULE["retest_slack"],
                "share": not (share[0] < -RULE["share_se"] * share[1]),
            }
            row = {
                "candidate": c,
                "target": probe,
                "gain": gain,
                "se": se,
                "rollouts": n,
                "problems": k,
                "cost": summary[c]["cost"],
                "retest": retest,
                "share_minus_base": share[:2],
                "checks": checks,
                "ships": all(checks.values()),
            }
            rows.append(row)
            passed += [row] * row["ships"]
    best = max(passed, key=lambda r: (r["gain"], -r["cost"])) if passed else None
    return {"rule": RULE, "candidates": len(candidates), "pairs": rows, "ships": best}


def _probe_of(name: str) -> str:
    return name.split("/")[1] if "/" in name else "-"


def decision_text(dec: dict) -> str:
    rows = sorted(dec["pairs"], key=lambda r: -r["gain"])[:8]
    lines = [
        "| candidate | target OAR-P probe | gain in Spearman ± s.e. | z | cost | test-retest "
        "| ΔV² share − today's ± s.e. | passes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        z = r["gain"] / r["se"] if r["se"] else math.nan
        lines.append(
            f"| {label(r['candidate'])} ({_probe_of(r['candidate'])}) | {r['target']} "
            f"| {r['gain']:+.3f} ± {r['se']:.3f} | {z:.1f} | {r['cost']:.2f} | {r['retest']:.3f} "
            f"| {r['share_minus_base'][0]:+.3f} ± {r['share_minus_base'][1]:.3f} "
            f"| {', '.join(k for k, ok in r['checks'].items() if not ok) or 'all'} |"
        )
    verdict = (
        f"**Ships: {label(dec['ships']['candidate'])} for probe {dec['ships']['target']}.**"
        if dec["ships"]
        else f"**No variant ships**: none of the {dec['candidates']} candidates at <= {RULE['cost_at_most']}x one "
        f"OAR-G pass passes the rule for any probe."
    )
    return (
        f"The eight largest gains of {len(dec['pairs'])} (candidate, probe) pairs; 'passes' names the checks "
        f"that fail.\n\n" + "\n".join(lines) + "\n\n" + verdict
    )


# ----------------------------------------------------------------------------------------------- report


BEGIN, END = "<!-- TABLES BEGIN (research/proxy-ceiling/measure.py --report) -->", "<!-- TABLES END -->"


SIGNAL_TABLE = Path(__file__).resolve().parents[1] / "signal-or-gate" / "ledger" / "delta-v" / "table.json"


def reproduces_signal_table(data: dict) -> dict:
    """On the smollm2 rollouts: do OAR-G's training draw, OAR-P and the controls, weighed as the signal-or-gate table
    weighs them, give that table's per-rollout numbers? {row: {rollouts, share: max |diff| of the ΔV² share's
    numerator, every: max |diff| over every column}}."""
    table = {r["rollout"]: r["methods"] for r in json.loads(SIGNAL_TABLE.read_text())["records"]}
    theirs = {"oar-g": "oar-g", "oar-p": "oar-p", "entropy": "control: entropy", "surprisal": "control: surprisal"}
    share, every = {k: [] for k in theirs}, {k: [] for k in theirs}
    for r in scored(data):
        if "value_jump" not in r or r["rollout"] not in table:
            continue
        for mine, name in theirs.items():
            a, b = r["value_jump"][mine], table[r["rollout"]][name]
            both = [k for k in b if not (math.isnan(_num(a[k])) and math.isnan(b[k]))]
            share[mine].append(abs(_num(a["share_num"]) - b["share_num"]))
            every[mine].append(max(abs(_num(a[k]) - b[k]) for k in both))
    return {
        k: {
            "rollouts": len(share[k]),
            "share": max(share[k], default=math.nan),
            "every": max(every[k], default=math.nan),
        }
        for k in theirs
    }


def report(cache: Path, ledger: Path, out: Path) -> dict:
    """Each set's ledger from its cache (where there is one), then summary.json, tables.md (every set, every probe)
    and the page's block, from the ledgers alone."""
    from measure import read_gz, write_gz

    ledger.mkdir(parents=True, exist_ok=True)
    for s in SET_ORDER:
        raw = read_gz(cache / f"{s}.json.gz")
        if raw is not None:
            write_gz(ledger / f"{s}.json.gz", ledger_of(raw))
    datas = {s: read_gz(ledger / f"{s}.json.gz") for s in SET_ORDER}
    datas = {s: d for s, d in datas.items() if d is not None and scored(d)}
    summaries = {s: summarize(d) for s, d in datas.items()}
    complete = {s: len(d["rollouts"]) == _planned(d) for s, d in datas.items()}
    dec = decide(datas["smollm2"], summaries["smollm2"]) if complete.get("smollm2") else None
    full = []
    for s, summary in summaries.items():
        full.append(f"## {s}\n\n{_set_line(datas[s], complete[s])}")
        full += [f"### {s}, probe {p}\n\n{set_table(s, summary, p)}" for p in PROBES]
    (out / "tables.md").write_text(
        "# The proxy-ceiling tables, every set and probe\n\nWritten by `research/proxy-ceiling/measure.py --report` "
        "from the ledger; the page (README.md) says how to read them.\n\n" + "\n\n".join(full) + "\n"
    )
    block = [headline(summaries)]
    block.append(
        "Each cell: mean Spearman with exact OAR-P (answer_mean) over the set's rollouts ± s.e. over problems, and "
        "in parentheses the cost as a multiple of one OAR-G pass on that model. "
        + "; ".join(_set_line(d, complete[s]) for s, d in datas.items())
        + ". Every probe, the other columns and the ΔV² share: [tables.md](tables.md)."
    )
    check = reproduces_signal_table(datas["smollm2"]) if "smollm2" in datas else None
    if check:
        smol = scored(datas["smollm2"])
        moved = ", ".join(str(r["rollout"]) for r in smol if "value_jump" not in r)
        block.append(
            f"**The value-jump table, GRAIL's rows beside the ones it shares with signal-or-gate's**, on the "
            f"{check['oar-g']['rollouts']} rollouts whose reasoning positions today's answer rule finds where the "
            f"values were made (signal-or-gate's table has {len(smol)}: rollouts {moved or 'none'} moved since, and "
            "`value_attribution.py` on today's code refuses the file). OAR-G (training's draw), OAR-P, entropy and "
            "surprisal are weighed as that table weighs them; OAR-P, entropy and surprisal reproduce its per-rollout "
            f"numbers, every column, to {max(check[k]['every'] for k in ('oar-p', 'entropy', 'surprisal')):.1e} (the "
            f"ledger's rounding), OAR-G its ΔV² share to {check['oar-g']['share']:.1e} and its other columns to "
            f"{check['oar-g']['every']:.1e}: at σ = 1e-3 its scores move with the float rounding of the clean outcome "
            "(here a cached forward of the rollout alone, there the update forward of its padded group), by up to "
            "tens of percent on the smallest scores, which reorders a few near-equal weights. GRAIL is weighed by "
            "its own weights, on the rollouts it reweights (A_i <= 0) and on every rollout.\n\n"
            + value_jump_table(datas["smollm2"])
        )
    block.append(
        "**The pre-registered decision.** " + (decision_text(dec) if dec else "Not applied: smollm2 is not complete.")
    )
    page = out / "README.md"
    if page.is_file():
        text = page.read_text()
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            page.write_text(head + BEGIN + "\n" + "\n\n".join(block) + "\n" + END + rest.split(END, 1)[1])
    result = {"sets": summaries, "complete": complete, "signal_or_gate_check": check, "decision": dec}
    (out / "summary.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    print("\n\n".join(block))
    return result


def _planned(data: dict) -> int:
    return data["settings"]["rollouts"]


def _set_line(data: dict, complete: bool) -> str:
    recs = scored(data)
    n_r = [r["n_reasoning"] for r in recs]
    ref = [r["metrics"]["oar-p/answer_mean"] for r in recs]
    valued = [m for m in ref if "mass" in m]
    return (
        f"{data['settings']['name']}: {len(recs)} scored rollouts of {len(data['rollouts'])}"
        f"{'' if complete else ' (incomplete)'} from {len({r['problem'] for r in recs})} problems, n_R "
        f"{min(n_r)}-{max(n_r)} (median {int(np.median(n_r))}), {sum(r['correct'] for r in recs)} correct; ΔV on "
        f"{len(valued)}, with a non-zero ΔV² mass on {sum(m['mass'] != 0 for m in valued)}"
    )
