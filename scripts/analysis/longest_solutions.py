"""Write the N problems with the longest gold solutions (that end in a \\boxed{} answer) to a small jsonl,
so that scripts/analysis/fidelity.py can run on a machine that cannot read ../shared (the GPU machine).

    python scripts/analysis/longest_solutions.py --data ../shared/data/math/train.jsonl --n 40 \\
        --out /tmp/longest40.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--data", default="../shared/data/math/train.jsonl", help="jsonl with problem, solution, answer fields"
    )
    ap.add_argument("--n", type=int, default=40, help="how many problems to keep")
    ap.add_argument("--out", required=True, help="where to write them")
    args = ap.parse_args()
    path = Path(args.data)
    if not path.is_file():
        raise SystemExit(
            f"--data {args.data}: no such file. Pass the MATH train.jsonl (../shared/data/math/train.jsonl)."
        )
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "\\boxed{" in r.get("solution", "")]
    rows.sort(key=lambda r: len(r["solution"]), reverse=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows[: args.n]))
    print(
        f"wrote {min(args.n, len(rows))} problems to {args.out} (solutions {len(rows[args.n - 1]['solution'])}.."
        f"{len(rows[0]['solution'])} characters)"
    )


if __name__ == "__main__":
    main()
