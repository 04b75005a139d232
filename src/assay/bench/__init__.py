"""Benchmarks: `assay bench train` times a GRPO step in assay and in TRL against the machine's compute-bound limit.

- `config.py`: `BenchConfig`, the step shape and how many steps to time.
- `flops.py`: FLOPs of a step from parameters and tokens, the fp32 matmul rate, a token counter.
- `train.py`: runs each framework in its own subprocess and reports (`run_bench`, `render`).
- `workers.py`: the subprocess side, one framework per process.
"""
