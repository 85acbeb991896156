"""Compare two scenario runs' tokens (issue 16: data-parallel vs one engine, same seeds).

    python3 benchmarks/scripts/compare_scenario_tokens.py RUN_A/outputs RUN_B/outputs [--context 3]

Prints JSON: scenarios compared, how many are identical, the fraction of identical generated
tokens, and where the first differing token of each differing scenario lies (generated frame).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--context", type=int, default=3)
    args = ap.parse_args()
    names = sorted(p.name for p in args.a.glob("*.npy"))
    missing = [n for n in names if not (args.b / n).is_file()]
    identical, equal_tokens, total_tokens, first_frames = 0, 0, 0, []
    for name in names:
        if name in missing:
            continue
        a, b = np.load(args.a / name)[args.context:], np.load(args.b / name)[args.context:]
        same = a == b
        equal_tokens += int(same.sum())
        total_tokens += same.size
        if same.all():
            identical += 1
        else:
            first_frames.append(int(np.argwhere(~same)[0][0]))
    print(json.dumps({
        "scenarios": len(names) - len(missing), "missing_in_b": len(missing), "identical": identical,
        "generated_token_agreement": round(equal_tokens / max(total_tokens, 1), 5),
        "first_difference_generated_frame": {str(f): first_frames.count(f) for f in sorted(set(first_frames))},
    }))


if __name__ == "__main__":
    main()
