"""What OAR does to the token that fixes tiny-arith's planted flaw.

    python scripts/analysis/decision_token.py                 # the cached tiny-arith build
    python scripts/analysis/decision_token.py --model runs/default/final --problems 64

tiny-arith stops one line early on 3-operation problems (oar/tasks/tiny_arith.py); a rollout that
finishes the work instead is the one RL should reinforce, and the token where it decides to go on
is the first token of its third line. This samples rollouts of 3-operation train problems with
train.py's sampling settings, keeps those that finish the work and are rewarded (the ones GRPO
reinforces), and prints the OAR-G and OAR-P gate weight (train.py's gate settings) of that
decision token (the reasoning tokens' mean weight is 1 by mass preservation) and where its score
ranks among the rollout's reasoning tokens. Relies on tiny-arith's one-token-per-character tokenizer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from oar.tasks.arith import ArithConfig, arith_problems  # noqa: E402
from oar.training.config import Config  # noqa: E402
from oar.gating import bilevel_weights  # noqa: E402
from oar.training.models import load_model  # noqa: E402
from oar.tasks.tiny_arith_cache import model_source  # noqa: E402
from oar.oar_grad import gradient_scores  # noqa: E402
from oar.oar_perturb import perturbation_scores  # noqa: E402
from oar.rewards import reward  # noqa: E402
from oar.sampler import format_prompt, sample  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-arith")
    p.add_argument("--problems", type=int, default=256, help="3-operation train problems, G rollouts each")
    p.add_argument("--seed", type=int, default=3)
    args = p.parse_args()
    model, tok = load_model(model_source(args.model))
    model.eval()
    problems = arith_problems(args.problems, seed=args.seed, config=ArithConfig(min_ops=3, max_ops=3))
    cfg, g = Config(), Config().group_size  # train.py's defaults
    ro = sample(
        model,
        tok,
        [format_prompt(tok, q.problem) for q in problems],
        group_size=g,
        seeds=list(range(g * len(problems))),
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
    )
    golds = [q.answer for q in problems for _ in range(g)]
    finished = [i for i, t in enumerate(ro.texts) if "####" in t and t.split("####")[0].count("\n") >= 3]
    worked = [i for i in finished if reward(ro.texts[i], golds[i]) == 1.0]
    print(
        f"{len(finished)} of {len(ro)} rollouts of 3-operation problems finish the work; "
        f"{len(worked)} of them are right"
    )
    if not worked:
        return
    rows = torch.tensor(worked)
    batch = ro.input_ids[rows], ro.attention_mask[rows], ro.reasoning_mask[rows], ro.answer_mask[rows]
    # The decision token: the first character of line 3 (one token per character, from column Lp).
    where = [ro.prompt_width + t.index("\n", t.index("\n") + 1) + 1 for t in (ro.texts[i] for i in worked)]
    torch.manual_seed(0)
    for name, scores in (
        ("oar-g", gradient_scores(model, *batch, probe=cfg.probe, noise_std=cfg.noise_std)),
        ("oar-p", perturbation_scores(model, *batch, probe=cfg.probe, pad_token_id=tok.pad_token_id)),
    ):
        weights = bilevel_weights(
            scores, batch[2], quantile=cfg.gate_quantile, boost=cfg.gate_boost, floor=cfg.gate_floor
        )
        w = [weights[k, j].item() for k, j in enumerate(where)]
        rank = [(scores[k][batch[2][k]] < scores[k, j]).float().mean().item() for k, j in enumerate(where)]
        print(
            f"{name}: decision-token weight mean {statistics.mean(w):.2f} (median {statistics.median(w):.2f}), "
            f"below 1 in {sum(x < 1 for x in w) / len(w):.0%} of rollouts; its score beats "
            f"{statistics.mean(rank):.0%} of the rollout's reasoning tokens on average"
        )


if __name__ == "__main__":
    main()
