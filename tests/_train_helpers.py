"""What end-to-end training tests share: a reward that varies, and checks that learning happened.

The tiny random model of `conftest.tiny_model_dir` never earns a reward under the
arithmetic verifier, so a run scored by it has advantage 0 everywhere and its weights never
move: such a test checks nothing. `LEARNING_SIGNAL` gives those runs a deterministic 0/1
reward with p = 0.5, so every step has groups with different rewards and a real gradient.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from assay.algos import AGGREGATIONS, POLICY_LOSSES
from assay.report.metrics import read_metrics

LEARNING_SIGNAL = "reward={name: random, args: {p: 0.5}}"


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(Path(folder) / "model.safetensors")


def update_of(run_dir: Path, start_dir: Path) -> dict[str, torch.Tensor]:
    """What training changed: final weights minus the starting weights, per tensor."""
    start = weights(start_dir)
    return {k: v - start[k] for k, v in weights(Path(run_dir) / "final").items()}


def assert_learned(run_dir: Path, start_dir: Path) -> dict[str, torch.Tensor]:
    """The weights moved and every step had a non-zero gradient; returns the update."""
    delta = update_of(run_dir, start_dir)
    assert max(float(d.abs().max()) for d in delta.values()) > 1e-6, "the weights never moved"
    rows = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "actor/grad_norm" in r]
    assert rows and all(r["actor/grad_norm"] > 0 for r in rows), [r["actor/grad_norm"] for r in rows]
    return delta


def assert_same_update(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-3) -> None:
    """Two weight updates agree, each tensor within rtol of its own size (not of the weights)."""
    for k in a:
        scale = float(b[k].abs().max())
        assert float((a[k] - b[k]).abs().max()) <= rtol * max(scale, 1e-8), (k, float((a[k] - b[k]).abs().max()), scale)
    assert max(float(d.abs().max()) for d in a.values()) > 1e-6


def plain_logprobs(model, batch, temperature: float) -> torch.Tensor:
    """log π `[B, T]` of the batch's completion tokens through the model's own forward."""
    T = batch.response_len
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    logp = torch.log_softmax(logits[:, -T - 1 : -1].float() / temperature, dim=-1)
    return logp.gather(-1, batch.input_ids[:, -T:, None])[..., 0]


def direct_first_loss(model, batch, advantages, cfg) -> float:
    """The first update's loss computed directly: the loss function on the model's own logprobs, aggregated.

    On the first update the policy is the reference, so a KL term adds 0; the entropy
    bonus is not part of it (tests that use it check it separately).
    """
    lp = plain_logprobs(model, batch, cfg.rollout.temperature)
    clips = {k: v for k, v in (("clip_low", cfg.algo.clip_low), ("clip_high", cfg.algo.clip_high)) if v is not None}
    loss_mat, _ = POLICY_LOSSES.get(cfg.algo.loss)(lp, batch.old_logprobs, advantages, batch.mask, **clips, **cfg.algo.loss_args)
    return float(AGGREGATIONS.get(cfg.algo.aggregation)(loss_mat, batch.mask, norm=cfg.rollout.max_new_tokens))
