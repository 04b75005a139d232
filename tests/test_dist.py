"""Training past one process (`assay.training.dist`): two gloo processes on this CPU, as `torchrun` starts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def torchrun(*args: str, nproc: int = 2, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc-per-node N ARGS` on loopback, one thread per process."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum-norm"])
def test_two_ranks_give_one_process_gradient(aggregation):
    """Each rank trains on its share of the groups with the whole batch's denominator; FSDP2 sums the shards'
    gradients: the single process's gradient, to floating-point rounding."""
    p = torchrun(str(HERE / "_dist_grad.py"), aggregation)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
    assert out["max_grad"] > 1e-5  # a real gradient
    assert out["max_diff"] <= 1e-5 * out["max_grad"] * 10, out  # 1e-5 of the largest entry (rounding of a different summation order)
    assert out["loss_sum"] == pytest.approx(out["loss_single"], abs=1e-6)
