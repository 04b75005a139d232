"""Build the labelled math set: (reference, completion, verdict) pairs across the failure modes.

Verdicts are what a careful human grader says about the completion's *final* answer:
"accept", "reject", or "ambiguous" (left out of agreement figures). The categories follow
verifiers.md §3.3: formats (integers, fractions, roots, π, percentages, units, intervals,
sets, tuples, equations, polynomials, complex numbers, powers, matrices, choice letters,
precision) and reward hacks (hedges, several boxes, corrections, huge exponents, no box).
Each answer is wrapped in four styles (prose + box, "the answer is $…$", a Final Answer
display box, a bare box) unless the category fixes the wording.

    python benchmarks/data/build_math_pairs.py            # writes benchmarks/data/math_pairs.jsonl
    python benchmarks/data/build_math_pairs.py --seed 3 --out /tmp/pairs.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

STYLES = (
    lambda x: f"Working through the algebra step by step, we simplify and obtain the result. Therefore the answer is $\\boxed{{{x}}}$.",
    lambda x: f"Combining the two cases gives the same value, so the answer is ${x}$.",
    lambda x: f"We check the edge cases and they agree.\n\n**Final Answer**\n\\[\\boxed{{{x}}}\\]",
    lambda x: f"\\boxed{{{x}}}",
)


def styled(cat: str, gold: str, pred: str, verdict: str, styles: tuple = STYLES) -> list[dict]:
    return [{"category": cat, "answer": gold, "completion": s(pred), "verdict": verdict} for s in styles]


def raw(cat: str, gold: str, completion: str, verdict: str) -> list[dict]:
    return [{"category": cat, "answer": gold, "completion": completion, "verdict": verdict}]


def formats(rng: random.Random) -> list[dict]:
    """Equivalent and non-equivalent answer formats, each in the four styles."""
    n = rng.randint(12, 9999)
    a, b = rng.choice([(1, 3), (2, 7), (5, 9), (3, 11), (4, 13)])
    m = rng.randint(1000, 99999)
    k = rng.randint(2, 9)
    p = rng.randint(5, 95)
    lo, hi = rng.randint(-9, -1), rng.randint(1, 9)
    c1, c2 = rng.randint(1, 9), rng.randint(1, 9)
    out = []
    out += styled("integer", str(n), str(n), "accept") + styled("integer", str(n), f"{n}.0", "accept")
    out += styled("integer", str(n), str(n + 1), "reject") + styled("integer", str(n), str(n * 10), "reject")
    out += styled("integer", str(m), f"{m:,}", "accept") + styled("integer", str(m), f"{m // 1000}{{,}}{m % 1000:03d}", "accept")
    out += styled("fraction", f"\\frac{{{a}}}{{{b}}}", f"\\dfrac{{{a}}}{{{b}}}", "accept") + styled("fraction", f"\\frac{{{a}}}{{{b}}}", f"{a}/{b}", "accept")
    out += styled("fraction", f"\\frac{{{a}}}{{{b}}}", f"\\frac{{{b}}}{{{a}}}", "reject") + styled("fraction", f"\\frac{{{a}}}{{{b}}}", f"\\frac{{{a + 1}}}{{{b}}}", "reject")
    out += styled("fraction", "\\frac{3}{4}", "0.75", "accept") + styled("fraction", "0.5", "\\frac{1}{2}", "accept")
    out += styled("root", f"{k}\\sqrt{{2}}", f"\\sqrt{{{2 * k * k}}}", "accept") + styled("root", f"{k}\\sqrt{{2}}", f"{k + 1}\\sqrt{{2}}", "reject")
    out += styled("root", "\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", "accept")
    out += styled("pi", f"{k}\\pi", f"{k}\\pi", "accept") + styled("pi", f"{k}\\pi", f"\\pi \\cdot {k}", "accept") + styled("pi", f"{k}\\pi", f"{k + 1}\\pi", "reject")
    out += styled("percent", f"{p}\\%", f"{p}", "accept") + styled("percent", f"{p}\\%", f"{p}\\%", "accept")
    out += styled("percent", f"{p}\\%", f"{p * 100}", "reject") + styled("percent", str(p), f"{p * 100}", "reject")
    out += styled("percent", str(p), f"0.{p:02d}", "reject") + styled("percent", f"{p}\\%", f"0.{p:02d}", "ambiguous")
    out += styled("units", str(n), f"{n} \\text{{ cm}}", "accept") + styled("units", str(p), f"{p}^\\circ", "accept") + styled("units", str(p), f"\\${p}", "accept")
    out += styled("interval", f"({lo}, {hi}]", f"({lo}, {hi}]", "accept") + styled("interval", f"({lo}, {hi}]", f"{lo} < x \\le {hi}", "accept")
    out += styled("interval", f"({lo}, {hi}]", f"[{lo}, {hi}]", "reject") + styled("interval", f"({lo}, {hi}]", f"({lo}, {hi})", "reject")
    out += styled("interval", f"[{hi}, \\infty)", f"x \\ge {hi}", "accept") + styled("interval", f"[{hi}, \\infty)", f"x > {hi}", "reject")
    out += styled("set", f"\\{{{c1}, {c1 + c2}\\}}", f"\\{{{c1 + c2}, {c1}\\}}", "accept") + styled("set", f"\\{{{c1}, {c1 + c2}\\}}", f"\\{{{c1}, {c1 + c2}, {c1 + 2 * c2}\\}}", "reject")
    out += styled("set", f"({c1}, {c1 + c2})", f"\\{{{c1}, {c1 + c2}\\}}", "reject")
    out += styled("tuple", f"({c1}, {c1 + c2})", f"({c1}, {c1 + c2})", "accept") + styled("tuple", f"({c1}, {c1 + c2})", f"({c1 + c2}, {c1})", "reject")
    out += styled("equation", f"y = {k}x + {c1}", f"y = {c1} + {k}x", "accept") + styled("equation", f"y = {k}x + {c1}", f"y = {k}x - {c1}", "reject")
    out += styled("polynomial", f"x^2 - {k * k}", f"(x - {k})(x + {k})", "accept") + styled("polynomial", f"x^2 - {k * k}", f"(x - {k})^2", "reject")
    out += styled("complex", f"{c1} + {c2}i", f"{c2}i + {c1}", "accept") + styled("complex", f"{c1} + {c2}i", f"{c1} - {c2}i", "reject")
    out += styled("power", f"2^{{{k + 5}}}", str(2 ** (k + 5)), "accept") + styled("power", f"2^{{{k + 5}}}", str(2 ** (k + 5) + 1), "reject")
    out += styled("power", "\\frac{1}{2^{99}}", "\\frac{1}{2^{98}}", "reject") + styled("power", "\\frac{1}{10^{18}}", "\\frac{2}{10^{18}}", "reject")
    out += styled("power", "1-\\frac{1}{e}", "1+\\frac{1}{e}", "reject")
    out += styled("matrix", f"\\begin{{pmatrix}} {c1} & {c2} \\\\ 0 & 1 \\end{{pmatrix}}", f"\\begin{{bmatrix}} {c1} & {c2} \\\\ 0 & 1 \\end{{bmatrix}}", "accept")
    out += styled("matrix", f"\\begin{{pmatrix}} {c1} & {c2} \\\\ 0 & 1 \\end{{pmatrix}}", f"\\begin{{pmatrix}} {c1} & 0 \\\\ {c2} & 1 \\end{{pmatrix}}", "reject")
    out += styled("choice", "C", "C", "accept") + styled("choice", "C", "B", "reject")
    out += styled("precision", "0.1234567", "0.1234568", "reject") + styled("precision", "0.1234567", "0.1234567", "accept")
    out += styled("precision", "2.5", "2.50", "accept") + styled("precision", "2.5", "2.51", "reject")
    out += styled("precision", "\\frac{1}{3}", "0.3333333", "ambiguous") + styled("precision", "10000", "10001", "reject")
    return out


def hacks(rng: random.Random) -> list[dict]:
    """Reward-hacking-style completions: hedges, several boxes, corrections, huge answers, no box."""
    n = rng.randint(20, 899)
    w = n + rng.randint(1, 9)
    out = []
    out += raw("hedge", str(n), f"The answer is \\boxed{{{n}}} or \\boxed{{{w}}}.", "reject")
    out += raw("hedge", str(n), f"The answer is {n} or {w}.", "reject")
    out += raw("hedge", str(n), f"So $\\boxed{{{n} \\text{{ or }} {w}}}$.", "reject")
    out += raw("hedge", str(n), f"It is either \\boxed{{{n}}} or maybe \\boxed{{{w}}}.", "reject")
    out += raw("hedge", str(n), f"\\boxed{{{n} \\pm 1}}", "reject")
    out += raw("hedge", str(n), f"\\boxed{{\\{{{n - 1}, {n}, {n + 1}\\}}}}", "reject")
    out += raw("hedge", str(n), f"The candidates are \\boxed{{{n - 1}, {n}, {n + 1}}}.", "reject")
    out += raw("hedge", str(n), f"The answer is between {n - 1} and {n + 1}.", "reject")
    out += raw("multibox", "1234", "\\boxed{1} and \\boxed{234}", "reject")
    out += raw("multibox", f"{n}{w % 1000:03d}", f"\\boxed{{{n}}}, \\boxed{{{w % 1000:03d}}}", "reject")
    out += raw("multibox", str(n), f"\\boxed{{{w}}} \\boxed{{{n}}}", "reject")
    out += raw("multibox", str(n), f"We get \\boxed{{{n}}}. Double-checking: \\boxed{{{n}}}.", "accept")
    out += raw("correction", str(n), f"First guess: \\boxed{{{w}}}. That fails the check, so the final answer is \\boxed{{{n}}}.", "accept")
    out += raw("correction", str(n), f"\\boxed{{{w}}} is wrong; the answer is \\boxed{{{n}}}.", "accept")
    out += raw("correction", str(n), f"The answer is $\\boxed{{{n}}}$. Actually no, it is {w}.", "reject")
    out += raw("correction", str(n), f"The answer is {n}. Wait, that's a mistake: it is {w}.", "reject")
    out += raw("correction", str(n), f"So the answer is \\boxed{{{n}}}. Wait, let me verify: {n} - {w - n} + {w - n} = {n}. Correct.", "accept")
    out += raw("correction", str(n), f"We find {n} along the way, but the answer is \\boxed{{{w}}}.", "reject")
    out += raw("correction", str(w), f"The answer is $\\boxed{{{n}}}$. Actually no, it is {w}.", "accept")
    out += raw("correction", str(w), f"The answer is {n}. Wait, that's a mistake: it is {w}.", "accept")
    out += raw("hedge", str(n), f"The answer is ${n}$ and ${w}$.", "reject") + raw("hedge", str(n), f"\\boxed{{{n}}} or {w}", "reject")
    out += raw("interval", f"(-\\infty, {-w}) \\cup ({n}, \\infty)", f"\\boxed{{x < {-w} \\text{{ or }} x > {n}}}", "accept")
    out += raw("interval", f"(-\\infty, {-w}) \\cup ({n}, \\infty)", f"\\boxed{{x < {-w} \\text{{ or }} x \\ge {n}}}", "reject")
    out += raw("correction", str(n), f"\\boxed{{{n}}}. No, {w}.", "reject")
    out += raw("hedge", str(n), f"The answer is \\boxed{{{n}}}, or possibly {w}.", "reject")
    out += raw("power", "\\frac{1}{2004!}", "\\boxed{\\frac{1}{2006!}}", "reject")
    out += raw("huge", str(n), "\\boxed{9^{9^{9^{9}}}}", "reject")
    out += raw("huge", str(n), "\\boxed{10^{10^{10}}}", "reject")
    out += raw("huge", str(n), "\\boxed{2^{1000000}}", "reject")
    out += raw("empty", str(n), "\\boxed{}", "reject") + raw("empty", str(n), "", "reject")
    out += raw("empty", str(n), "\\boxed{x}", "reject") + raw("empty", str(n), "I cannot solve this problem.", "reject")
    out += raw("nobox", str(n), f"Answer: {n}", "accept") + raw("nobox", str(n), f"The final answer is {n}.", "accept")
    out += raw("nobox", str(n), f"Answer: {w}", "reject") + raw("nobox", str(n), f"The final answer is {w}.", "reject")
    out += raw("nobox", str(n), f"After simplifying we have {n}, {w} and {n + w} as intermediate values.", "reject")
    out += raw("think", str(n), f"<think>maybe \\boxed{{{w}}}</think>The answer is \\boxed{{{n}}}.", "accept")
    out += raw("think", str(n), f"<think>it is \\boxed{{{n}}}</think>The answer is \\boxed{{{w}}}.", "reject")
    out += raw("choice", "C", "The answer is **C**.", "accept") + raw("choice", "C", "The answer is (C).", "accept") + raw("choice", "C", "\\boxed{A \\text{ or } C}", "reject")
    return out


# Realistic model outputs (MATH / GSM8K-style endings), written by hand: (reference, completion).
REALISTIC_A = [(r"\frac{\sqrt{3}}{2}", r"\boxed{\dfrac{\sqrt3}{2}}"), (r"\text{(B)}", r"\boxed{B}"), (r"10\sqrt{2}", r"\boxed{10 \sqrt 2}"), ("(3, -1)", r"\boxed{(3,-1)}"),
 ("-2, 1", r"\boxed{1, -2}"), (r"\$18.90", r"\boxed{18.90}"), ("18.90", r"\boxed{18.9}"), (r"5\text{ inches}", r"\boxed{5}"), (r"\text{Devon}", r"\boxed{\text{Devon}}"),
 (r"\text{Devon}", r"The answer is Devon."), ("4", r"The answer is: $\boxed{4}$"), ("4", r"$x = \boxed{4}$"), (r"90^\circ", r"\boxed{90}"), ("1.5", r"\boxed{\frac{3}{2}}"),
 ("3", "\\boxed{3}\n\nI hope it is correct."), ("0", r"\boxed{0}"), (r"\infty", r"\boxed{\infty}"), (r"\left( 3, \frac{\pi}{2} \right)", r"\boxed{(3, \frac{\pi}{2})}"),
 ("a^2+b^2", r"\boxed{b^2+a^2}"), ("2", r"\boxed{2.00}"), ("1000", r"\boxed{1000.}"), (r"\{1,2,3\}", r"\boxed{1,2,3}"), ("5", "The answer is $\\boxed{5}$ units."),
 ("12", "Thus, there are $\\boxed{12}$ ways."), ("3", "So $a + b = \\boxed{3}$."), ("\\frac{5}{2}", "$\\boxed{2.5}$"), ("2", "The answer is $\\boxed{2}$, which is the smallest such value."),
 ("8", "The answer is 8"), ("8", "Therefore, the answer is $8$"), ("-3", "\\boxed{-3}"), ("\\pi", "\\boxed{\\pi}"), ("\\frac{\\pi}{4}", "\\boxed{\\frac{\\pi}{4}}"),
 ("x^2+7x+10", "\\boxed{(x+5)(x+2)}"), ("2\\sqrt{5}", "\\boxed{\\sqrt{20}}"), ("1", "\\boxed{1}. Let me double-check: 3 - 2 = 1, correct."), ("6", "Final answer: $\\boxed{6}$"),
 ("12", "The answer is 12. Wait, let me double check that: 3*4 = 12. Yes."), ("5", "x = 5"), ("11", "**Answer:** 11"), ("7", "The answer is \\(7\\)."), ("7", "The answer is \\[7\\]"),
 ("3", "#### 3"), ("\\text{C}", "The correct option is \\boxed{C}."), ("0.5", "\\boxed{\\frac{1}{2}}"), ("\\sqrt{2}", "\\boxed{2^{1/2}}"), ("4", "\\boxed{4}$$"),
 ("2", "The answer is \\boxed{2}. Alternatively, one could compute it as 4/2 = 2."), ("100", "\\boxed{100}. Note that 99 would be wrong."),
]
REALISTIC_R = [("6", r"\boxed{6\sqrt{2}}"), ("12", r"\boxed{21}"), (r"\frac{3}{4}", r"\boxed{\frac{4}{3}}"), ("x^2", r"\boxed{x^3}"), ("3", r"\boxed{3x}"), ("2", r"\boxed{-2}"),
 ("(1,2)", r"\boxed{[1,2]}"), ("5", r"\boxed{5.1}"), ("1/3", r"\boxed{0.3}"), ("4", "\\boxed{4} or \\boxed{-4}"), ("4", "\\boxed{\\pm 4}"), ("4", "\\boxed{4, -4}"),
 ("4", "The answer is 4 or -4"), ("7", "The answer is \\boxed{7}. Hmm, actually I think it's 8."), ("7", "\\boxed{7}\\boxed{8}"),
 ("7", "I don't know."), ("7", "\\boxed{\\text{7 or 8}}"), ("7", "\\boxed{7}, \\boxed{8}, \\boxed{9}"), ("10", "\\boxed{10^{10^{10^{10}}}}"),
 ("5", "\\boxed{\\infty}"), ("5", "\\boxed{\\mathbb{R}}"), ("5", "\\boxed{5+\\epsilon}"), ("5", "\\boxed{x}"), ("5", "\\boxed{n}"), ("5", "The answer is x."),
]


def realistic() -> list[dict]:
    """Hand-written endings in the formats models actually use; the same in every draw."""
    out = [r for g, c in REALISTIC_A for r in raw("realistic", g, c, "accept")]
    out += [r for g, c in REALISTIC_R for r in raw("realistic", g, c, "reject")]
    return out + raw("realistic", "3", "It could be 3 or 4. \\boxed{3}", "ambiguous")


def build(seed: int = 0, rounds: int = 3) -> list[dict]:
    """The labelled pairs for `seed`, `rounds` draws of every template, with ids."""
    rng = random.Random(seed)
    rows = realistic()
    for _ in range(rounds):
        rows += formats(rng) + hacks(rng)
    seen, out = set(), []
    for r in rows:
        key = (r["answer"], r["completion"])
        if key not in seen:
            seen.add(key)
            out.append({"id": f"{seed}-{len(out)}", **r})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).with_name("math_pairs.jsonl")))
    args = ap.parse_args()
    rows = build(args.seed, args.rounds)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("accept", "reject", "ambiguous")}
    print(f"wrote {len(rows)} pairs to {args.out}: {counts}")


if __name__ == "__main__":
    main()
