"""Generation throughput: assay's in-process torch sampler against a colocated vLLM engine, in one run.

Two shapes, the same prompts and sampling for both backends, tokens/s of completion tokens
generated (EOS included), median of `--repeats` timed calls after one untimed call:

* `bundled`: the bundled tiny-arith model (1.06M parameters) at its training shape,
  `--prompts` × `--n` completions of up to 6 tokens, ending on EOS as they do in training;
* `30m`: a randomly initialised Qwen2 of ~31M parameters (hidden 512, 7 layers, 8 heads,
  intermediate 2048, a 4,099-symbol character vocabulary: the usual one plus 4,000 CJK
  characters) with up to 256-token completions. Untrained, it draws EOS about once in
  4,099 tokens, so about 94% of its completions run the full 256 tokens in both backends.

Engine start-up (and its first weight sync) is timed on its own and not counted. Needs
vLLM (`.venv-engine/bin/python benchmarks/generation.py`); figures in docs/engines.md.

    python benchmarks/generation.py [--prompts 16] [--n 8] [--long-prompts 8] [--long-n 4] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from assay.data.tasks import make_task
from assay.models import ALPHABET, build_char_tokenizer, build_tiny_model, load_policy, quiet_hf
from assay.rollout.base import SamplingParams, make_sampler


#: the 30m shape's extra symbols: a large vocabulary makes an untrained model's EOS rare
EXTRA = "".join(chr(0x4E00 + i) for i in range(4000))


def shapes(args) -> list[dict]:
    """`(name, model, tokenizer, prompts, n, params)` of each shape."""
    model, tok = load_policy("tiny-arith")
    task = make_task("arithmetic")
    prompts = [s for _, s in zip(range(args.prompts), task.stream("train", 0))]
    char = build_char_tokenizer(ALPHABET + EXTRA)
    big = build_tiny_model(char, hidden=512, layers=7, heads=8, intermediate=2048, seed=0, max_positions=512).eval()
    long_prompts = [s for _, s in zip(range(args.long_prompts), task.stream("train", 1))]
    return [
        {"name": "bundled", "model": model.eval(), "tok": tok, "prompts": prompts, "n": args.n, "params": SamplingParams(6, 1.0)},
        {"name": "30m", "model": big, "tok": char, "prompts": long_prompts, "n": args.long_n,
         "params": SamplingParams(256, 1.0)},
    ]


def measure(sampler, shape: dict, repeats: int) -> dict:
    """Median tokens/s over `repeats` timed calls (after one untimed), and the tokens per call."""
    gen = torch.Generator().manual_seed(0)
    sampler.generate(shape["prompts"], shape["n"], shape["params"], gen)
    rates, tokens = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        trajs = sampler.generate(shape["prompts"], shape["n"], shape["params"], gen)
        dt = time.perf_counter() - t0
        tokens = sum(len(t.completion_ids) for t in trajs)
        rates.append(tokens / dt)
    return {"tokens_per_s": statistics.median(rates), "all": rates, "tokens_per_call": tokens}


def run(args) -> list[dict]:
    rows = []
    for shape in shapes(args):
        params = sum(p.numel() for p in shape["model"].parameters())
        for backend in ("torch", "vllm"):
            t0 = time.perf_counter()
            sampler = make_sampler(backend, shape["model"], shape["tok"])
            start = time.perf_counter() - t0
            try:
                rows.append({"shape": shape["name"], "parameters": params, "backend": backend, "start_s": start,
                             "sequences": len(shape["prompts"]) * shape["n"], "max_new_tokens": shape["params"].max_new_tokens,
                             **measure(sampler, shape, args.repeats)})
            finally:
                sampler.close()
            print(f"  {shape['name']:>8} {backend:>6}: {rows[-1]['tokens_per_s']:9.0f} tokens/s", flush=True)
    return rows


def render(rows: list[dict]) -> None:
    print(f"\n{'shape':>8} {'params':>8} {'seqs':>5} {'max new':>7} {'backend':>7} {'start s':>8} {'tokens/s (median)':>18}  runs")
    for r in rows:
        runs = ", ".join(f"{x:.0f}" for x in r["all"])
        print(f"{r['shape']:>8} {r['parameters'] / 1e6:7.2f}M {r['sequences']:>5} {r['max_new_tokens']:>7} {r['backend']:>7} "
              f"{r['start_s']:8.1f} {r['tokens_per_s']:18.0f}  {runs}")
    for name in dict.fromkeys(r["shape"] for r in rows):
        t, v = (next(r for r in rows if r["shape"] == name and r["backend"] == b)["tokens_per_s"] for b in ("torch", "vllm"))
        print(f"{name}: vLLM / torch = {v / t:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16, help="bundled shape: prompts (default 16)")
    p.add_argument("--n", type=int, default=8, help="bundled shape: completions per prompt (default 8)")
    p.add_argument("--long-prompts", type=int, default=8, help="30m shape: prompts (default 8)")
    p.add_argument("--long-n", type=int, default=4, help="30m shape: completions per prompt (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per backend and shape (default 3)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the rows to this JSON file")
    args = p.parse_args()
    quiet_hf()
    rows = run(args)
    render(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
