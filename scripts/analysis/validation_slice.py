"""Write a validation slice of arith's TRAIN split that no default run trains on, for choosing settings.

    python scripts/analysis/validation_slice.py --out runs/val.jsonl
    python train.py --eval_dataset runs/val.jsonl --eval_every 20 --save_every 0 --output_dir runs/val-default

Held-out (test split) problems are for reporting only; settings are chosen on this slice. It is
drawn with another seed from the train split at the default difficulty and excludes the first
`--train_size` problems of every seed (train.py's Config.train_size, 10,000) in `--train_seeds` (what
train.py draws with those seeds).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from oar.tasks.arith import DEFAULT_ARITH, arith_problems, unseen_problems  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--size", type=int, default=500)
    p.add_argument("--seed", type=int, default=20_000)
    p.add_argument("--train_size", type=int, default=10_000, help="arith problems train.py draws (Config.train_size)")
    p.add_argument(
        "--train_seeds", type=int, nargs="+", default=[0], help="train.py seeds whose problems are excluded"
    )
    args = p.parse_args()
    seen = {
        q.problem
        for s in args.train_seeds
        for q in arith_problems(args.train_size, split="train", seed=s, config=DEFAULT_ARITH)
    }
    chosen = unseen_problems(args.size, seen, pool=6 * args.size, seed=args.seed, config=DEFAULT_ARITH)
    if len(chosen) < args.size:
        raise SystemExit(f"validation_slice.py: only {len(chosen)} unseen problems; lower --size or --train_size.")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps({"problem": q.problem, "answer": q.answer}) + "\n" for q in chosen))
    print(f"{len(chosen)} train-split problems, none among {len(seen)} a run trains on -> {args.out}")


if __name__ == "__main__":
    main()
