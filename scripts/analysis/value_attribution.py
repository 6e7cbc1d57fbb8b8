"""Which tokens does a credit method rank highest, against each token's true effect on success (ΔV)?

    python scripts/analysis/value_attribution.py --model M.gguf --data problems.jsonl --method oar-g
    python scripts/analysis/value_attribution.py --model M --credit_module my_credit.py --method my-method \\
        --values runs/va/values.json
    python scripts/analysis/value_attribution.py ... --values runs/va/values.json --cached_only
                                                        # the table so far, while a run goes on

Legend: P problems, G rollouts per problem, N = P x G rollouts, T completion tokens, n_R a rollout's
reasoning tokens (before the final-answer marker), K continuations per prefix, L positions.

The truth (the paper's "oracle causal tokens"): on the model's own rollouts (on-policy, sampled with the
project's sampler and per-rollout seeds), the value of a completion prefix c_<j is the chance that the
model, writing the rest itself at the rollout temperature within the same token budget, ends with a
correct answer: V_j = P(reward 1 | prompt, c_<j). It is estimated from K continuations per prefix,
and each reasoning token t gets

    ΔV_t = V_{t+1} - V_t = V(prefix <= t) - V(prefix < t).

Continuation c of every prefix of a rollout draws position p with the same random number (common random
numbers: the continuations of prefixes t and t + 1 are the same text unless the first resampled token t),
so ΔV_t is the mean of K paired differences, exact 0s where the token's choice did not matter, and its
Monte-Carlo standard error is their standard deviation / sqrt(K) (ddof 1). Prefixes are batched
(prefixes of similar length together, `--batch` continuation rows a call); each (prefix, continuation)
row is prefilled on its own (since d55d613: the shared prefill of commit 94f9638 is gone). The values
are computed and cached by scripts/analysis/delta_v.py. A table is made by code whose answer rule finds
the reasoning positions the values were made at: other code refuses the values file.

A method is scored through train.py's credit interface (oar.credit.step_credit): any built-in
(`--method oar-g`, `oar-p`, `entropy`, `tempo`, `random-gate`, ...) or one of a `--credit_module`'s,
with the group's rewards and advantages, EVERY rollout marked scored (attribution, not training: a
group whose rewards are equal still gets its weights), the update forward's logits and the rollouts'
seeds. Its weights w_t (gated: monotone in the score for OAR's methods) are compared with ΔV on each
rollout's reasoning tokens:

  target      ΔV_t^2 - se_t^2, an unbiased estimate of ΔV_t^2 (value_metrics.target). Unbiased in value,
              not in rank: a token whose continuations changed outcome both ways (a +1s, b -1s, a = b)
              has a target below 0, below every token that changed nothing, so ranking it penalizes a
              method that weights such forks; ranking |ΔV_t| instead rewards it (|ΔV_t|'s noise is
              largest where V is near 1/2, whatever the token did). Hence the share, linear in the target:
  share       the ΔV^2 share in the method's top 20%: sum over every rollout and its method's top k =
              ceil(0.2 n_R) tokens (ties shared) of the target, over the target's sum over all tokens:
              numerator and denominator are sums of unbiased estimates, so no noise variance favours a
              method. With no information (a constant or a random method) it is k / n_R of each
              rollout's mass, pooled; the table gives the share and the share less that. s.e.: a
              jackknife over problems
  spearman    rank correlation of w_t with the target, and (spearman_abs) with |ΔV_t| as the issue asked,
              each biased as said above (undefined, not 0, on a rollout whose target, or whose weights,
              are constant: every continuation of every prefix ended alike, or the method gave w = 1)
  recall@k    of the k tokens with the largest target, the share among the method's k largest w_t (ties
              at either cut shared out in expectation: a constant method scores k / n_R; undefined where
              the target is constant). Its ceiling is far below 1 when fewer than k tokens have a
              positive target: the table says the target's own recall
  sign agree  on wrong rollouts (reward 0), the tokens whose ΔV_t is significant (an exact sign test of
              its paired differences, p < 0.05; `delta_v.sign_test`): the share of the method's credit
              mass |w_t| on tokens where the sign of the credit a wrong rollout gets (A_i w_t with
              A_i < 0, so -w_t) is the sign of ΔV_t. For w >= 0 this is the mass on the tokens that
              lowered the chance of success; GRPO's (w = 1) is their share. Also pooled over all
              wrong rollouts' significant tokens (one mass, in the JSON and the printout). At K = 8 the
              test cannot flag a token with fewer than 6 non-zero differences, so few tokens qualify,
              and any method with w > 0 agrees fully on a rollout with one flagged token: compare it
              with `control: uniform` (GRPO). A wrong rollout of a group with no right one has A_i = 0
              in training; the sign is read as if it were below its group's mean.
  balance     on wrong rollouts, every reasoning token, no test: sum_t (-w_t ΔV_t) / sum_t |w_t ΔV_t|, in
              [-1, 1]: +1 when all the method's ΔV-weighted credit sits on tokens that lowered V. ΔV's
              noise (mean 0) dilutes it, not biases its sign; GRPO's is the rollouts' own balance.

Controls, always in the table as `control: uniform` (GRPO's w = 1), `control: random` (uniform scores from
each rollout's seed), `control: surprisal` (-log p of the token at the sampling temperature),
`control: entropy` (of the distribution it was drawn from; raw, where the credit method `entropy` is the
same score through the gate), read from the same forward, and `control: position` (the completion index t:
a method that only leans later or earlier; per rollout only its order counts, and the pooled sign
agreement weights rollouts by it).
Each cell: the mean over rollouts where the metric is defined, ± its standard error with the rollouts
clustered by problem (the G rollouts of a problem, which the group methods see together, are one unit:
the s.e. is over the problems' means); n rollouts (problems). The significance line
says how many tokens the sign test flags, how many it would flag by chance if no token moved V (the
sum over tokens of P(p < 0.05) given their number of non-zero differences), and how many survive
Benjamini-Hochberg at q = 0.1 over all of them. The expensive part (the values) is kept in `--values`
(JSON, written after every rollout, with the rollouts' texts, token ids, log-probs and gold answers) and
reused when the settings (VALUES_FORMAT among them) and the rollouts match (`same_rollouts`; a file of
others is refused, not overwritten): a stopped run resumes at its next rollout, and scoring another method
costs only its weights. The file also keeps every version of the code that made its values
(`delta_v.values_code`: the answer rule, the rewards and the sampler), and a resume by another version
says so: values made by two versions are reported as such (`values_code` in the output).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from oar.credit import CreditSettings, credit_methods, step_credit
from oar.grpo import group_advantages, token_entropy
from oar.lm import forward_logits
from oar.rewards import reward
from oar.rollout import Rollout
from oar.sampler import (
    format_prompt,
    resolve_instruction,
    sample,
)
from oar.training.checkpoint import write_json_atomic
from oar.training.data import load_problems
from oar.training.models import load_model
from scripts.analysis.delta_v import (
    VALUE_CODE,
    VALUES_FORMAT,
    portable,
    rollout_record,
    rollout_values,
    same_rollouts,
    values_code,
)
from scripts.analysis.value_metrics import (  # noqa: F401 (re-exported: tests/scripts/test_value_attribution.py uses them)
    ALPHA,
    FDR,
    benjamini_hochberg,
    clustered_mean_se,
    metrics,
    null_flag_chance,
    pooled_share,
    significance,
    table,
    top_membership,
)

CONTROLS = (
    "control: uniform",
    "control: random",
    "control: surprisal",
    "control: entropy",
    "control: position",
)  # apart from the
# methods (`entropy` is one); uniform is GRPO's w = 1


# ------------------------------------------------------------------------------------------ methods


def method_weights(
    name: str,
    module: str,
    model,
    tok,
    ro: Rollout,
    rewards,
    golds,
    seeds,
    *,
    group_size: int,
    temperature: float,
    probe: str,
    gate: dict,
) -> torch.Tensor:
    """Weights (N, L) of credit method `name` through train.py's interface, group by group (every rollout scored)."""
    settings = CreditSettings(
        method=name,
        credit_module=module,
        group_size=group_size,
        micro_batch_size=group_size,
        temperature=temperature,
        **gate,
    )
    adv = group_advantages(rewards, group_size)
    weigh = step_credit(
        settings, model, tok, ro, rewards, adv, torch.ones(len(ro), dtype=torch.bool), seeds, golds, probe
    )
    out = []
    for g in range(0, len(ro), group_size):
        rows = slice(g, g + group_size)
        mb = ro.select(rows)
        with torch.no_grad():
            logits = forward_logits(
                model, mb.input_ids, mb.attention_mask, logits_to_keep=mb.input_ids.shape[1] - ro.prompt_width + 1
            )
        with torch.enable_grad():  # OAR-G's input gradient
            out.append(weigh(rows, mb, logits)[0].detach().cpu())
    return torch.cat(out)


def control_scores(model, ro: Rollout, seeds: list[int], temperature: float) -> dict[str, torch.Tensor]:
    """The controls' scores (N, L): uniform (GRPO's w = 1), uniform random (from each rollout's seed), the token's
    surprisal and entropy, its position in the completion
    (a rollout's order of positions is its reasoning tokens' order)."""
    n, width = ro.input_ids.shape
    lp = ro.prompt_width
    surprisal, entropy = torch.zeros(n, width), torch.zeros(n, width)
    for i in range(n):
        with torch.no_grad():
            z = forward_logits(
                model, ro.input_ids[i : i + 1], ro.attention_mask[i : i + 1], logits_to_keep=width - lp + 1
            )[0, :-1].float()
        z = z / (temperature or 1.0)  # (T, V): z[t] predicted completion token t
        surprisal[i, lp:] = -torch.log_softmax(z, -1).gather(-1, ro.input_ids[i, lp:, None])[:, 0]
        entropy[i, lp:] = token_entropy(z[None])[0]
    rand = torch.stack([torch.rand(width, generator=torch.Generator().manual_seed(s + 31337)) for s in seeds])
    position = torch.zeros(n, width)
    position[:, lp:] = torch.arange(width - lp, dtype=torch.float32)
    return dict(zip(CONTROLS, (torch.ones(n, width), rand, surprisal, entropy, position)))


# --------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--model", required=True, help="as train.py's --model: a folder, a .gguf file or a hub id")
    p.add_argument(
        "--data", default="arith", help="problems: 'arith', a .jsonl file (problem, answer) or a `datasets` name"
    )
    p.add_argument("--split", default="train")
    p.add_argument("--instruction", default="auto", help="as train.py's")
    p.add_argument(
        "--method", nargs="+", default=["oar-g"], help="credit methods to score (built-ins or --credit_module's)"
    )
    p.add_argument("--credit_module", default="")
    p.add_argument("--problems", type=int, default=25, help="P problems (the first of --data)")
    p.add_argument("--group_size", type=int, default=4, help="G rollouts per problem (the methods see the group)")
    p.add_argument("--k", type=int, default=8, help="continuations per prefix")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe", default="answer_mean")
    p.add_argument("--gate_quantile", type=float, default=0.4)
    p.add_argument("--gate_boost", type=float, default=2.0)
    p.add_argument("--batch", type=int, default=64, help="continuation rows per sampling call")
    p.add_argument(
        "--values",
        type=Path,
        default=None,
        help="JSON cache of the rollouts' values (written; reused when its settings match)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the table and per-rollout metrics here (JSON)")
    p.add_argument(
        "--cached_only",
        action="store_true",
        help="score the methods on the rollouts whose values --values "
        "already holds and compute no more: an interim table while a long run is still going",
    )
    args = p.parse_args(argv)
    if args.cached_only and args.values is None:
        p.error("--cached_only scores the values of --values FILE: give the file")
    table_ = credit_methods(args.credit_module)
    unknown = [m for m in args.method if m not in table_]
    if unknown:
        p.error(
            f"--method {' '.join(unknown)}: not a credit method; choose from {', '.join(table_)} "
            "(or add --credit_module FILE)"
        )
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    model, tok = load_model(args.model)
    model.eval()
    problems = load_problems(args.data, split=args.split, limit=args.problems)[: args.problems]
    instruction = resolve_instruction(args.instruction, args.data, args.model)
    key = portable(
        {
            k: getattr(args, k)
            for k in (
                "model",
                "data",
                "split",
                "instruction",
                "problems",
                "group_size",
                "k",
                "max_new_tokens",
                "temperature",
                "seed",
            )
        }
        | {"values_format": VALUES_FORMAT}
    )
    G = args.group_size
    seeds = [args.seed * 1_000_003 + n for n in range(len(problems) * G)]
    prompts = [format_prompt(tok, p.problem, instruction) for p in problems]
    ro = sample(
        model,
        tok,
        prompts,
        group_size=G,
        seeds=seeds,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
    )
    golds = [p.answer for p in problems for _ in range(G)]
    rewards = torch.tensor([reward(t, g) for t, g in zip(ro.texts, golds)])
    cached = json.loads(args.values.read_text()) if args.values is not None and args.values.is_file() else None
    record = rollout_record(ro, golds)
    if cached is not None and not (portable(cached["settings"]) == key and same_rollouts(cached, record)):
        raise SystemExit(
            f"value_attribution.py: error: {args.values} holds the values of other settings or other rollouts "
            f"(another model?); give another --values file, or delete it to start again."
        )
    done = cached["values"] if cached is not None else []
    # every version of the code that made values in the file ("unrecorded": values from before versions were kept),
    # and what it records once this run adds its own
    made_by = sorted(cached.get("code", ["unrecorded"])) if done else []
    code = sorted(set(made_by) | {values_code()})
    if made_by and made_by != [values_code()]:
        print(
            f"[values] warning: {args.values}'s values were made by "
            f"{'code of no recorded version' if 'unrecorded' in made_by else 'other code'} ({', '.join(made_by)}): "
            f"the answer rule or the sampler may differ from this code's ({', '.join(VALUE_CODE)})",
            flush=True,
        )
    lp = ro.prompt_width
    # the values' reasoning positions are the code's that made them: a table by code with another answer rule would
    # score the methods (this code's masks) on positions that are not their reasoning, without a word; checked before
    # any new value is computed (hours), which this code would add at its own positions
    moved = [i for i, v in enumerate(done) if v["positions"] != ro.reasoning_mask[i, lp:].nonzero().flatten().tolist()]
    if moved:
        raise SystemExit(
            f"value_attribution.py: error: the reasoning positions of {len(moved)} of the {len(done)} rollouts "
            f"in {args.values} (rollouts {', '.join(map(str, moved[:8]))}{', ...' if len(moved) > 8 else ''}) "
            f"are not this code's: it finds their answers elsewhere. Make the table with the code that made "
            f"the values ({', '.join(made_by)}: the commit the values file was made at), or start a new values file."
        )
    if args.values is not None:
        args.values.parent.mkdir(parents=True, exist_ok=True)
    if done:
        print(f"[values] reused {args.values} ({len(done)} of {len(ro)} rollouts)", flush=True)
    if args.cached_only and not done:
        raise SystemExit(f"value_attribution.py: error: --cached_only: {args.values} holds no values yet")
    values = (
        done
        if args.cached_only
        else rollout_values(
            model,
            tok,
            ro,
            golds,
            seeds,
            k=args.k,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            batch=args.batch,
            done=done,
            save=None
            if args.values is None
            else lambda vs: write_json_atomic(args.values, {"settings": key, "code": code, **record, "values": vs}),
        )
    )
    total = len(ro)
    if (
        len(values) < total
    ):  # --cached_only before the values are complete: only the groups that have values are scored
        keep = math.ceil(len(values) / G) * G
        ro, rewards, golds, seeds = ro.select(slice(0, keep)), rewards[:keep], golds[:keep], seeds[:keep]
    scores = control_scores(model, ro, seeds, args.temperature)
    gate = {"gate_quantile": args.gate_quantile, "gate_boost": args.gate_boost}
    for name in args.method:
        scores[name] = method_weights(
            name,
            args.credit_module,
            model,
            tok,
            ro,
            rewards,
            golds,
            seeds,
            group_size=G,
            temperature=args.temperature,
            probe=args.probe,
            gate=gate,
        )
    records = []
    for i, v in enumerate(values):
        if not v["positions"]:
            continue
        cols = [lp + t for t in v["positions"]]
        records.append(
            {
                "rollout": i,
                "problem": i // G,
                "correct": bool(rewards[i] == 1),
                "n_reasoning": len(cols),
                "v_first": v["v_first"],
                "methods": {m: metrics(s[i, cols].tolist(), v, bool(rewards[i] == 1)) for m, s in scores.items()},
            }
        )
    names = [*CONTROLS, *args.method]
    moving = [
        v for v in values if any(v["plus"]) or any(v["minus"])
    ]  # rollouts where some continuation ended otherwise
    sig = significance(values)
    # the Monte-Carlo s.e. over the tokens with a non-zero paired difference: the others have s.e. 0, though a
    # |ΔV| up to about 3 / K (the rule of three: no change in K draws) goes unseen there
    nonzero = [x for v in values for x, a, b in zip(v["se"], v["plus"], v["minus"]) if a + b]
    result = {
        "settings": key | {"methods": args.method, "credit_module": args.credit_module, "probe": args.probe, **gate},
        "rollouts": total,
        "rollouts_with_values": len(values),
        "scored_rollouts": len(records),
        "correct": int(rewards[: len(values)].sum()),
        "reasoning_tokens": sum(r["n_reasoning"] for r in records),
        "rollouts_with_any_nonzero_difference": len(moving),
        "mc_se_mean_where_nonzero": float(np.mean(nonzero)) if nonzero else math.nan,
        "significance": sig,
        "values_cpu_s": sum(v["cpu_s"] for v in values),
        "values_code": code if len(values) > len(done) else made_by or None,
        "table": table(records, names),
        "records": records,
    }
    print(
        f"{len(records)} rollouts with reasoning tokens of the {len(values)} with values "
        f"({result['correct']} correct), of {total}; "
        f"{result['reasoning_tokens']} reasoning tokens; values {result['values_cpu_s']:.0f} CPU s. K = {args.k}: "
        f"{len(moving)} rollouts where some continuation ended otherwise (mean Monte-Carlo s.e. of ΔV over the "
        f"{len(nonzero)} tokens with a non-zero paired difference {result['mc_se_mean_where_nonzero']:.3f}; "
        f"where all {args.k} were 0, |ΔV| up to about {3 / args.k:.2f} goes unseen, the rule of three); "
        f"{sig['significant']} of {sig['tokens']} tokens significant (sign test, p < {ALPHA}), "
        f"{sig['expected_by_chance']:.1f} expected by chance if no token moved V, {sig['bh_significant']} after "
        f"Benjamini-Hochberg at q = {FDR}"
    )
    print(result["table"])
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
