"""`StaticDecoder` attending over the cache slots written so far against the whole buffer (unwritten slots masked).

    python benchmarks/decode_span.py [--prompts 16 --group 8 --tokens 32 128 240 --threads 2 --repeats 4]

The bundled model decodes `--prompts × --group` rows (128) for each completion length in `--tokens`,
every row to its end (no stop token), once with `StaticDecoder.step` as it is (each step attends over
`written + 1` slots) and once with each step over the whole buffer, as a recorded CUDA-graph step
does (`forward_token` without a span). Time: the median `generate` of `--repeats` (the first of each
kind dropped as warm-up). The longer the completion, the more of the buffer an early step skips.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from assay.models import load_policy
from assay.rollout.base import SamplingParams
from assay.rollout.decoder import StaticDecoder
from assay.rollout.torch_sampler import TorchSampler
from assay.types import Sample


def _whole_buffer_step(self, tok, pos):
    logits = self.forward_token(tok, pos)
    self.slot += 1
    self.filled += 1
    return logits


def timed(sampler: TorchSampler, samples: list[Sample], group: int, tokens: int, repeats: int) -> float:
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        sampler.generate(samples, group, SamplingParams(tokens, 1.0), torch.Generator().manual_seed(r))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 128, 240])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_policy("tiny-arith", "cpu")
    samples = [Sample(id=str(i), prompt=f"{i}+{i + 7}=", answer="") for i in range(args.prompts)]
    sampler = TorchSampler(model, tok)
    sampler.stop = torch.tensor([-1])  # no stop token: every row decodes all its tokens
    written = StaticDecoder.step
    print(f"{args.prompts * args.group} rows, bundled model, {args.threads} threads: median generate")
    for tokens in args.tokens:
        StaticDecoder.step = _whole_buffer_step
        whole = timed(sampler, samples, args.group, tokens, args.repeats)
        StaticDecoder.step = written
        grown = timed(sampler, samples, args.group, tokens, args.repeats)
        print(f"{tokens:4d} tokens: whole buffer {whole * 1e3:6.0f} ms, written slots {grown * 1e3:6.0f} ms, {whole / grown:.2f}x")


if __name__ == "__main__":
    main()
