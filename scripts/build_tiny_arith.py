"""Build the tiny-arith policy and print its held-out accuracy and build time.

    python scripts/build_tiny_arith.py                       # into the cache (default_model_dir)
    python scripts/build_tiny_arith.py --out_dir /tmp/ta --seed 1 --overwrite
    python scripts/build_tiny_arith.py --out_dir oar/tasks/tiny-arith --overwrite   # replace the shipped build

`--model tiny-arith` uses the build that ships in oar/tasks/tiny-arith/ (oar/tasks/tiny_arith_cache.py);
a build made here is this machine's (float rounding over 1,300 steps differs between CPUs): pass its
folder as --model to train from it.

Training and the model code live in oar/tasks/tiny_arith.py; this is only the command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without install

from oar.tasks.tiny_arith import BUILDER_VERSION  # noqa: E402
from oar.tasks.tiny_arith_cache import build_tiny_arith, default_model_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out_dir", type=Path, default=None, help=f"output folder (default: the cache, {default_model_dir()})"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing build")
    args = parser.parse_args()
    out_dir = args.out_dir or default_model_dir()
    print(f"building {BUILDER_VERSION} into {out_dir} (seed {args.seed})...", flush=True)
    try:
        info = build_tiny_arith(
            out_dir, seed=args.seed, overwrite=args.overwrite, log=lambda line: print(line, flush=True)
        )
    except FileExistsError as err:
        parser.error(str(err))
    print(
        f"held-out accuracy {info['heldout_accuracy']:.1%} on {info['heldout_problems']} test "
        f"problems; {info['parameters']:,} parameters, vocab {info['vocab_size']}; "
        f"train {info['train_seconds']:.0f} s, build {info['build_seconds']:.0f} s; "
        f"final train loss {info['final_train_loss']:.3f}"
    )


if __name__ == "__main__":
    main()
