"""Agreement with the labelled math set: assay's math verifier next to plain math-verify.

Plain math-verify is `verify(parse("$gold$"), parse(completion))` with default arguments,
as most frameworks call it. Ambiguous pairs are left out. Prints totals, false
positives / negatives and a per-category table.

    python benchmarks/math_agreement.py [--pairs benchmarks/data/math_pairs.jsonl] [--show-errors]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from assay.rewards.math import MathReward
from assay.types import Sample, Trajectory


def plain_math_verify(gold: str, completion: str) -> bool:
    from math_verify import parse, verify

    return bool(verify(parse(f"${gold}$"), parse(completion)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default=str(Path(__file__).parent / "data" / "math_pairs.jsonl"))
    ap.add_argument("--show-errors", action="store_true")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.pairs, encoding="utf-8") if line.strip()]
    rows = [r for r in rows if r["verdict"] != "ambiguous"]
    reward = MathReward()
    stats = {"assay": defaultdict(int), "math-verify": defaultdict(int)}
    per_cat: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in rows:
        want = r["verdict"] == "accept"
        res = reward.score(Trajectory(Sample(r["id"], "", r["answer"]), r["completion"], [], [], [], True))
        got = {"assay": res.score == 1.0, "math-verify": plain_math_verify(r["answer"], r["completion"])}
        per_cat[r["category"]]["n"] += 1
        for name, g in got.items():
            s = stats[name]
            s["ok"] += g == want
            s["fp"] += g and not want
            s["fn"] += want and not g
            per_cat[r["category"]][name] += g == want
            if args.show_errors and g != want:
                print(f"  {name} {'FP' if g else 'FN'} [{r['category']}] gold={r['answer']!r} completion={r['completion'][-90:]!r} info={res.info if name == 'assay' else ''}")
    n = len(rows)
    print(f"labelled pairs (ambiguous left out): {n}")
    for name, s in stats.items():
        print(f"{name:12s} agreement {s['ok']}/{n} = {100 * s['ok'] / n:.1f}%   false positives {s['fp']}   false negatives {s['fn']}")
    print(f"{'category':12s} {'n':>4s} {'assay':>6s} {'mv':>6s}")
    for cat, c in sorted(per_cat.items()):
        print(f"{cat:12s} {c['n']:4d} {c['assay']:6d} {c['math-verify']:6d}")


if __name__ == "__main__":
    main()
