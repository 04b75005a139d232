"""The learner: turns scored trajectories into tensors, computes logprobs, applies the loss.

All the RL maths is called from `assay.algos` by name; nothing here knows which
estimator or loss is selected.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch

from assay.algos import (ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, aggregate, bind_args, loss_reads, mismatch_correction,
                         requirements)
from assay.algos.losses import masked_mean
from assay.config import AlgoConfig
from assay.errors import AssayError
from assay.batch import Batch, collate, step_tensors  # noqa: F401  (re-exported: the learner's batch)
from assay.models import text_config
from assay.models.lora import AdapterOff
from assay.models.logprobs import token_logprobs


def kl_in_loss(algo: AlgoConfig, ref_model) -> bool:
    """Whether the KL to the reference is a loss term: yes, unless the estimator takes it through the advantages (FRPO)."""
    return ref_model is not None and algo.kl_coef > 0 and "ref_logprobs" not in requirements(algo.advantage)


def policy_step(model, ref_model, batch: Batch, advantages: torch.Tensor, algo: AlgoConfig, temperature: float, norm: int,
                fast: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss of one minibatch and its metrics (backward is the caller's).

    `norm` is the constant of `seq-mean-token-sum-norm` (the generation length limit).
    When the estimator itself takes the reference logprobs (FRPO), KL enters through the
    advantages and is left out of the loss. `fast` selects the shared-prefix forward (`token_logprobs`).
    """
    loss_fn = POLICY_LOSSES.get(algo.loss)
    if takes_forward_process(algo):
        return forward_process_step(model, ref_model, batch, advantages, algo, norm)
    logprobs, entropy = token_logprobs(model, batch, temperature, with_entropy=True, entropy_grad=algo.entropy_coef > 0, fast=fast)
    old, is_weights, out = batch.old_logprobs, batch.is_weights, {}
    if batch.behaviour is not None:  # this forward is the proximal policy: π_old is its logprobs, the weights π_prox/π_behav
        old = logprobs.detach() * batch.mask
        is_weights, out = mismatch_correction(old, batch.behaviour, batch.mask, algo.mismatch, algo.mismatch_cap, algo.mismatch_floor,
                                              algo.mismatch_level)
    clips = {k: v for k, v in (("clip_low", algo.clip_low), ("clip_high", algo.clip_high)) if v is not None}
    loss_mat, metrics = loss_fn(logprobs, old, advantages, batch.mask, **clips, **algo.loss_args)
    if is_weights is not None:  # rollout/trainer mismatch correction: weights the policy term only
        loss_mat = loss_mat * is_weights
    out.update({f"actor/{k}": v for k, v in metrics.items()})
    if kl_in_loss(algo, ref_model):
        with torch.no_grad():
            ref_lp, _ = token_logprobs(ref_model, batch, temperature, fast=fast)
        kl = KL_ESTIMATORS.get(algo.kl_estimator)(logprobs, ref_lp)  # [B, T]
        loss_mat = loss_mat + algo.kl_coef * kl
        out["actor/kl"] = masked_mean(kl.detach(), batch.mask).item()
    if entropy is not None:
        if algo.entropy_coef > 0:
            loss_mat = loss_mat - algo.entropy_coef * entropy
        out["actor/entropy"] = masked_mean(entropy.detach(), batch.mask).item()
    with torch.no_grad():
        out["actor/logprob_diff"] = masked_mean((logprobs - old).abs(), batch.mask).item()
    loss = aggregate(loss_mat, batch.mask, algo.aggregation, norm=norm)
    out["actor/loss"] = loss.item()
    return loss, out


@contextlib.contextmanager
def reference_of(ref_model) -> Iterator[Any]:
    """The reference policy as a module: a LoRA policy's own base with its adapters off (`AdapterOff`), else `ref_model`."""
    if isinstance(ref_model, AdapterOff):
        with ref_model.model() as base:
            yield base
    else:
        yield ref_model


def takes_forward_process(algo: AlgoConfig) -> bool:
    """Whether the policy loss reads the forward process (`takes = "forward_process"`: DiffusionNFT), not step logprobs."""
    return loss_reads(algo.loss) == "forward_process"


def forward_process_step(model, ref_model, batch: Batch, advantages: torch.Tensor, algo: AlgoConfig, norm: int) -> tuple[torch.Tensor, dict[str, float]]:
    """`policy_step` for a loss on the forward process (DiffusionNFT): the policy's velocities at its pictures' noisings
    (`batch.draws`, drawn once a batch with the rollout policy's velocities, `FlowPolicy.draw_noisings`) go to the loss.

    The KL to the reference is the velocity-space one, ‖v − v_ref‖² averaged over the picture at the same noisings: the
    KL between the two policies' SDE steps from x_t up to a factor fixed by the step's time and noise level.
    """
    if not hasattr(model, "forward_process"):
        raise AssayError(f"algo.loss={algo.loss!r} trains on the forward process of a picture generator; this policy has none")
    v, target = model.forward_process(batch)
    draws = batch.draws
    loss_mat, metrics = POLICY_LOSSES.get(algo.loss)(v, draws.old_velocity, target, draws.t, advantages, batch.mask, **algo.loss_args)
    out = {f"actor/{k}": val for k, val in metrics.items()}
    if ref_model is not None and algo.kl_coef > 0:
        with torch.no_grad(), reference_of(ref_model) as ref:
            v_ref = ref.forward_process(batch)[0]
        kl = ((v - v_ref) ** 2).mean(dim=tuple(range(2, v.dim())))  # [B, K]
        loss_mat = loss_mat + algo.kl_coef * kl
        out["actor/kl"] = masked_mean(kl.detach(), batch.mask).item()
    loss = aggregate(loss_mat, batch.mask, algo.aggregation, norm=norm)
    out["actor/loss"] = loss.item()
    return loss, out


def trim(batch: Batch, advantages: torch.Tensor) -> tuple[Batch, torch.Tensor]:
    """Drop columns that are padding in every row: leading prompt pads and trailing completion pads.

    Position ids come from the attention mask and are kept, so the model sees the same
    sequences; only less padding goes through it.
    """
    T = batch.response_len
    P = batch.input_ids.shape[1] - T
    prompt_cols = batch.attention_mask[:, :P].any(0).nonzero()
    start = int(prompt_cols[0]) if prompt_cols.numel() else P
    lengths = batch.lengths
    t = max(1, int(lengths.max())) if lengths.numel() else 1
    if start == 0 and t == T:
        return batch, advantages
    cols = slice(start, P + t)
    is_w = batch.is_weights[:, :t] if batch.is_weights is not None else None
    behaviour = batch.behaviour[:, :t] if batch.behaviour is not None else None
    out = dataclasses.replace(batch, input_ids=batch.input_ids[:, cols], attention_mask=batch.attention_mask[:, cols],
                              position_ids=batch.position_ids[:, cols], mask=batch.mask[:, :t], old_logprobs=batch.old_logprobs[:, :t],
                              is_weights=is_w, behaviour=behaviour)
    return out, advantages[:, :t]


def activation_bytes_per_token(model, checkpointing: bool = False) -> int:
    """Rough memory the backward pass keeps per token: layers × (16·hidden + 8·intermediate) values.

    Fitted to Qwen2/Llama blocks under autograd (norms, q/k/v, attention output, the MLP's
    gate, up, activation and product); within ~5% of the measured peak for the models
    used here. With activation `checkpointing`: each layer's input, plus one layer's
    intermediates while it is recomputed. Used only to size micro-batches (`train.micro_batch_mb`).
    """
    cfg = text_config(model)
    hidden = getattr(cfg, "hidden_size", 0) or 0
    inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
    layers = getattr(cfg, "num_hidden_layers", 1) or 1
    itemsize = next(model.parameters()).element_size()
    if checkpointing:
        return max(1, (layers * hidden + 16 * hidden + 8 * inter) * itemsize)
    return max(1, layers * (16 * hidden + 8 * inter) * itemsize)


def pack_rows(batch: Batch, budget: int) -> list[torch.Tensor]:
    """Split the rows into micro-batches of at most `budget` padded tokens each, shortest first.

    Rows are sorted by completion length, so each micro-batch pads to its own longest row
    (see `trim`); a row longer than the budget gets a micro-batch to itself.
    """
    T = batch.response_len
    prompt_len = batch.attention_mask[:, : batch.input_ids.shape[1] - T].sum(-1).tolist()
    comp_len = batch.lengths.long().tolist()
    order = sorted(range(len(comp_len)), key=lambda i: comp_len[i])
    groups: list[list[int]] = [[]]
    width_p = width_c = 0
    for i in order:
        p, c = max(width_p, prompt_len[i]), max(width_c, comp_len[i], 1)
        if groups[-1] and (len(groups[-1]) + 1) * (p + c) > budget:
            groups.append([])
            p, c = prompt_len[i], max(comp_len[i], 1)
        groups[-1].append(i)
        width_p, width_c = p, c
    return [torch.tensor(g, dtype=torch.long, device=batch.mask.device) for g in groups]


def skips_inert_rows(algo: AlgoConfig, ref_model=None) -> bool:
    """Whether rows with a zero advantage on every token may be left out of the update exactly.

    True when such a row adds nothing to the loss or its gradient: the policy loss declares
    `zero_at_zero_advantage` (all the built-ins: each token's loss is its advantage times a
    function of the ratio), there is no entropy bonus, no KL term in the loss (KL
    through the advantages, FRPO's way, is fine), and the aggregation declares the `unit`
    of its denominator, which is then counted over the whole batch.
    """
    if not getattr(POLICY_LOSSES.get(algo.loss), "zero_at_zero_advantage", False) or algo.entropy_coef > 0:
        return False
    if kl_in_loss(algo, ref_model):
        return False
    return getattr(AGGREGATIONS.get(algo.aggregation), "unit", None) is not None


def accumulate_step(model, ref_model, batch: Batch, advantages: torch.Tensor, algo: AlgoConfig, temperature: float, norm: int,
                    micro_batch_tokens: int = 0, fast: bool = True, skip_inert: bool = False, total: float | None = None,
                    loss_scale: float = 1.0) -> dict[str, float]:
    """Forward and backward over `batch` in micro-batches, accumulating gradients (the optimizer step is the caller's).

    The gradient equals that of one `policy_step` over the whole batch: each micro-batch's
    aggregated loss is scaled by its share of the aggregation's denominator (tokens for
    `token-mean`, sequences for the `seq-mean-*` modes), and every loss, KL and entropy
    term is per token, so nothing else couples rows. Micro-batches hold at most
    `micro_batch_tokens` padded tokens (`pack_rows`) and are trimmed of padding they do not
    need, so peak activation memory follows the budget rather than the batch.
    `micro_batch_tokens=0`, or an aggregation that declares no `unit`, runs the batch whole.

    With `skip_inert`, where `skips_inert_rows` allows it, rows whose advantage is exactly
    zero on every response token (a group whose completions all scored alike, under a
    group-relative estimator) are not run at all: they would add zero loss and zero
    gradient, and the shares keep the whole batch's denominator, so the gradient is the
    same to rounding. `actor/loss` is still the whole batch's loss; the other `actor/*`
    metrics then describe the rows that were run, and `actor/skipped_frac` says what share
    of rows was left out. If every row is inert the gradients are set to zero, so the
    optimizer steps exactly as it would have.

    `total` is the aggregation's denominator (tokens or sequences) over a whole batch of which
    `batch` is a part (a rank's share, `assay.training.dist`); the loss is then this part's share
    of the whole batch's, and the metrics describe this part. None: `batch` is the whole batch.

    `loss_scale` multiplies the loss of every backward (fp16's loss scaling: `MasterWeights.loss_scale`).
    """
    B = batch.mask.shape[0]
    unit = getattr(AGGREGATIONS.get(algo.aggregation), "unit", None)
    rows = torch.arange(B, device=batch.mask.device)
    skipped = 0
    if skip_inert and skips_inert_rows(algo, ref_model):
        live = ((advantages != 0) & batch.mask.bool()).any(-1)  # [B]
        rows, skipped = live.nonzero()[:, 0], int(B - live.sum())
    own = float(batch.mask.sum()) if unit == "token" else float(B)
    if total is not None and unit is None:
        raise AssayError(f"algo.aggregation={algo.aggregation!r} declares no unit, so a part of a batch cannot take its share of the loss")
    if not skipped and total is None and (not micro_batch_tokens or unit is None or B * batch.input_ids.shape[1] <= micro_batch_tokens):
        loss, metrics = policy_step(model, ref_model, batch, advantages, algo, temperature, norm, fast)
        (loss * loss_scale).backward()
        return {**metrics, "actor/skipped_frac": 0.0} if skip_inert else metrics
    total = own if total is None else total
    live_batch = batch.select(rows) if skipped else batch
    chunks = pack_rows(live_batch, micro_batch_tokens) if micro_batch_tokens and rows.numel() else [torch.arange(rows.numel(), device=rows.device)]
    sums: dict[str, float] = {}
    ran = 0.0
    for idx in chunks:
        if not idx.numel():
            continue
        sub, adv = trim(live_batch.select(idx), advantages[rows[idx]])
        share = (float(sub.mask.sum()) if unit == "token" else float(idx.numel())) / max(total, 1.0)
        if share == 0.0:
            continue
        loss, metrics = policy_step(model, ref_model, sub, adv, algo, temperature, norm, fast)
        (loss * (share * loss_scale)).backward()
        ran += share
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v * share
    if ran == 0.0:  # nothing to learn from: zero gradients, so AdamW's moments and weight decay advance as usual
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    # the loss is a sum over shares of the whole batch; the other metrics are means over the rows that ran
    out = {k: v if k == "actor/loss" else v / ran for k, v in sums.items()}
    out.setdefault("actor/loss", 0.0)
    if skip_inert:
        out["actor/skipped_frac"] = skipped / max(B, 1)
    return out


#: parameters of an estimator that the trainer fills itself (not hyperparameters)
ESTIMATOR_DATA = ("rewards", "group", "mask")
#: parameters of a policy loss that the trainer fills itself (the clips come from algo.clip_low/high)
LOSS_DATA = ("logprobs", "old_logprobs", "advantages", "mask", "clip_low", "clip_high")
#: what the trainer fills for a loss on the forward process (`takes = "forward_process"`)
FORWARD_LOSS_DATA = ("velocity", "old_velocity", "target", "t", "advantages", "mask")


def estimator_args(algo: AlgoConfig) -> dict:
    """`algo.advantage_args`, checked against the estimator's signature (one line for a bad one)."""
    return bind_args(ADVANTAGES.get(algo.advantage), algo.advantage_args, ESTIMATOR_DATA, "algo.advantage_args")


def loss_args(algo: AlgoConfig) -> dict:
    """`algo.loss_args`, checked against the loss's signature (one line for a bad one)."""
    data = FORWARD_LOSS_DATA if takes_forward_process(algo) else LOSS_DATA
    return bind_args(POLICY_LOSSES.get(algo.loss), algo.loss_args, data, "algo.loss_args")


def compute_advantages(batch: Batch, algo: AlgoConfig, extras: dict | None = None, args: dict | None = None) -> torch.Tensor:
    """Advantages `[B, T]` from the estimator named in the config, given exactly the extras it declares.

    `extras` holds this step's values of the extras (`assay.training.extras`); an estimator
    whose needs are not all there is refused in one line. `args` are the bound
    hyperparameters (`estimator_args`; bound here when not given).
    """
    extras = extras or {}
    fn = ADVANTAGES.get(algo.advantage)
    needs = requirements(algo.advantage)
    missing = sorted(n for n in needs if n not in extras)
    if missing:
        from assay.training.extras import EXTRAS

        docs = "; ".join(f"{n}: {EXTRAS.get(n).doc}" for n in missing if n in EXTRAS)
        raise AssayError(f"algo.advantage={algo.advantage!r} needs {', '.join(missing)}, which this run does not supply" + (f" ({docs})" if docs else ""))
    dev = batch.mask.device
    kw = {n: extras[n].to(dev) if torch.is_tensor(extras[n]) else extras[n] for n in needs}
    args = estimator_args(algo) if args is None else args
    return fn(batch.rewards, batch.group, batch.mask, **kw, **args).to(dev)
