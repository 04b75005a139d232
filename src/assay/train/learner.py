"""The learner: turns scored trajectories into tensors, computes logprobs, applies the loss.

All the RL maths is called from `assay.algos` by name; nothing here knows which
estimator or loss is selected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from assay.algos import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES, aggregate, requirements
from assay.algos.losses import masked_mean
from assay.config import AlgoConfig
from assay.errors import AssayError
from assay.types import RewardResult, Trajectory


@dataclass
class Batch:
    """Scored rollouts as tensors: prompts left-padded to P, completions right-padded to T."""

    input_ids: torch.Tensor  # [B, P+T]
    attention_mask: torch.Tensor  # [B, P+T]
    position_ids: torch.Tensor  # [B, P+T]
    mask: torch.Tensor  # [B, T] 1 on completion tokens
    old_logprobs: torch.Tensor  # [B, T] the sampler's logprobs
    rewards: torch.Tensor  # [B] NaN where unscored
    group: torch.Tensor  # [B]
    components: torch.Tensor  # [B, K] named reward components (sorted names), NaN where absent

    @property
    def response_len(self) -> int:
        return self.mask.shape[1]

    def select(self, idx: torch.Tensor) -> "Batch":
        return Batch(*(getattr(self, f)[idx] for f in self.__dataclass_fields__))


def collate(trajs: list[Trajectory], results: list[RewardResult], pad_id: int, device: torch.device) -> Batch:
    """Pack trajectories and their rewards into one `Batch`."""
    B = len(trajs)
    P = max(len(t.prompt_ids) for t in trajs)
    T = max(1, max(len(t.completion_ids) for t in trajs))
    ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + T), dtype=torch.long)
    mask = torch.zeros((B, T))
    old = torch.zeros((B, T))
    for i, t in enumerate(trajs):
        p, c = len(t.prompt_ids), len(t.completion_ids)
        ids[i, P - p : P] = torch.tensor(t.prompt_ids, dtype=torch.long)
        attn[i, P - p : P] = 1
        if c:
            ids[i, P : P + c] = torch.tensor(t.completion_ids, dtype=torch.long)
            attn[i, P : P + c] = 1
            mask[i, :c] = 1
            old[i, :c] = torch.tensor(t.logprobs)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    rewards = torch.tensor([float("nan") if r.score is None else float(r.score) for r in results])
    group = torch.tensor([t.group for t in trajs], dtype=torch.long)
    names = sorted({k for r in results for k in r.components})
    comps = torch.tensor([[float(r.components.get(k, float("nan"))) for k in names] for r in results]).reshape(B, len(names))
    return Batch(ids.to(device), attn.to(device), pos.to(device), mask.to(device), old.to(device), rewards, group, comps)


def token_logprobs(model, batch: Batch, temperature: float = 1.0, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob `[B, T]` of each completion token under `model` (and its entropy `[B, T]`).

    Only the T positions that predict completion tokens go through the LM head.
    """
    T = batch.response_len
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, logits_to_keep=T + 1)
    logits = out.logits[:, :-1].float() / temperature  # [B, T, V]
    logp = torch.log_softmax(logits, dim=-1)
    targets = batch.input_ids[:, -T:]  # [B, T]
    lp = logp.gather(-1, targets[..., None])[..., 0]
    ent = None
    if with_entropy:
        ent = -(logp.exp() * logp).sum(-1)  # [B, T]
    return lp, ent


def policy_step(model, ref_model, batch: Batch, advantages: torch.Tensor, algo: AlgoConfig, temperature: float, norm: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss of one minibatch and its metrics (backward is the caller's).

    `norm` is the constant of `seq-mean-token-sum-norm` (the generation length limit).
    When the estimator itself takes the reference logprobs (FRPO), KL enters through the
    advantages and is left out of the loss.
    """
    need_entropy = True
    logprobs, entropy = token_logprobs(model, batch, temperature, with_entropy=need_entropy)
    loss_fn = POLICY_LOSSES.get(algo.loss)
    clips = {k: v for k, v in (("clip_low", algo.clip_low), ("clip_high", algo.clip_high)) if v is not None}
    loss_mat, metrics = loss_fn(logprobs, batch.old_logprobs, advantages, batch.mask, **clips, **algo.loss_args)
    out = {f"actor/{k}": v for k, v in metrics.items()}
    if ref_model is not None and algo.kl_coef > 0 and "ref_logprobs" not in requirements(algo.advantage):
        with torch.no_grad():
            ref_lp, _ = token_logprobs(ref_model, batch, temperature)
        kl = KL_ESTIMATORS.get(algo.kl_estimator)(logprobs, ref_lp)  # [B, T]
        loss_mat = loss_mat + algo.kl_coef * kl
        out["actor/kl"] = masked_mean(kl.detach(), batch.mask).item()
    if entropy is not None:
        if algo.entropy_coef > 0:
            loss_mat = loss_mat - algo.entropy_coef * entropy
        out["actor/entropy"] = masked_mean(entropy.detach(), batch.mask).item()
    with torch.no_grad():
        out["actor/logprob_diff"] = masked_mean((logprobs - batch.old_logprobs).abs(), batch.mask).item()
    loss = aggregate(loss_mat, batch.mask, algo.aggregation, norm=norm)
    out["actor/loss"] = loss.item()
    return loss, out


def step_tensors(trajs: list[Trajectory], results: list[RewardResult], tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step rewards `[B, S]` (NaN-padded) and the token index where each step ends `[B, S]` (−1 padded).

    A reward gives step scores with character spans of the completion; a step ends at the
    first token whose decoded prefix reaches the span's end.
    """
    S = max([len(r.steps or []) for r in results] + [1])
    rewards = torch.full((len(trajs), S), float("nan"))
    ends = torch.full((len(trajs), S), -1, dtype=torch.long)
    for i, (t, r) in enumerate(zip(trajs, results)):
        if not r.steps:
            continue
        prefix = [len(tokenizer.decode(t.completion_ids[: k + 1], skip_special_tokens=True)) for k in range(len(t.completion_ids))]
        spans = r.spans or [(0, len(t.completion))] * len(r.steps)
        for j, (score, (_, end)) in enumerate(zip(r.steps, spans)):
            rewards[i, j] = float(score)
            ends[i, j] = next((k for k, n in enumerate(prefix) if n >= end), len(prefix) - 1)
    return rewards, ends


#: what the trainer can hand to an estimator, by the names estimators declare in `fn.needs`
SUPPLIED = {
    "components": lambda b, x: b.components,
    "correct": lambda b, x: torch.nan_to_num(b.rewards, nan=0.0) >= 1.0,
    "logprobs": lambda b, x: b.old_logprobs.cpu(),
    "ref_logprobs": lambda b, x: x["ref_logprobs"].cpu(),
    "greedy_rewards": lambda b, x: x["greedy_rewards"],
    "step_rewards": lambda b, x: x["step_rewards"],
    "step_ends": lambda b, x: x["step_ends"],
}


def compute_advantages(batch: Batch, algo: AlgoConfig, extras: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Advantages `[B, T]` from the estimator named in the config, given the extras it declares.

    `extras` holds what the loop computed for this step (reference logprobs, greedy-rollout
    rewards, step rewards); an estimator whose needs cannot be met is refused in one line.
    """
    extras = extras or {}
    fn = ADVANTAGES.get(algo.advantage)
    needs = requirements(algo.advantage)
    derived = {"components", "correct", "logprobs"}
    missing = sorted(n for n in needs if n not in derived and n not in extras)
    if missing:
        hint = {"ref_logprobs": " (set algo.kl_coef > 0 to load a reference model)", "values": " (a learned critic is not supported by this trainer yet)"}
        raise AssayError(f"algo.advantage={algo.advantage!r} needs {', '.join(missing)}, which this run does not supply" + "".join(hint.get(m, "") for m in missing))
    if "components" in needs and batch.components.shape[1] == 0:
        raise AssayError(f"algo.advantage={algo.advantage!r} needs named reward components; use a composed reward block (docs/rewards.md)")
    kw = {n: SUPPLIED[n](batch, extras) for n in needs}
    if "kl_coef" not in algo.advantage_args and "ref_logprobs" in needs:
        kw["kl_coef"] = algo.kl_coef
    return fn(batch.rewards, batch.group, batch.mask.cpu(), **kw, **algo.advantage_args).to(batch.mask.device)
