"""The learned critic of `gae`, `evpo` and `turn_gae`: a value model beside the policy, with its own optimizer.

As in OpenRLHF and verl, the critic is a separate model initialised from the policy's
backbone weights, with a scalar head in place of the LM head. It reads the same packed
`Batch` as the policy and gives V_t, the value of the state before completion token t.
Its target is the GAE return of `assay.algos.compute_gae` on every response token
(`gae_targets`), or the estimator's own `value_targets` (`turn_gae`: each turn's return
on the turn's first token), and it is trained on PPO's clipped value loss
(`assay.algos.value_loss`), aggregated as `token-mean`.
"""

from __future__ import annotations

import copy

import torch

from assay.algos import aggregate, compute_gae, explained_variance, value_loss
from assay.algos.losses import masked_mean
from assay.config import CriticConfig
from assay.devices import generator_for
from assay.training.precision import MasterWeights, step_means


def gae_targets(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's targets under `gae` and `evpo`: the token-level GAE returns, on every scored response token.

    Returns:
        `(returns [B, T], on [B, T] bool)`.
    """
    _, returns = compute_gae(rewards, values, mask, gamma, lam)  # [B, T]
    return returns, mask.bool() & ~torch.isnan(rewards)[:, None]  # unscored rows have no target


class ValueModel(torch.nn.Module):
    """A causal-LM backbone plus a linear head from the hidden state to one value."""

    def __init__(self, policy, seed: int = 0):
        super().__init__()
        self.backbone = copy.deepcopy(policy.base_model)  # the transformer without its LM head
        hidden = policy.config.hidden_size
        self.head = torch.nn.Linear(hidden, 1)
        gen = torch.Generator(device="cpu").manual_seed(seed)  # its own stream: building a critic leaves the run's RNG alone
        std = getattr(policy.config, "initializer_range", 0.02)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(self.head.weight.shape, device="cpu", generator=generator_for(gen, "cpu")) * std)
            self.head.bias.zero_()
        ref = next(policy.parameters())
        self.head.to(device=ref.device, dtype=ref.dtype)
        self.requires_grad_(True)

    def forward(self, batch) -> torch.Tensor:
        """Values `[B, T]`: position P+t−1 (the state that predicts token t) for each completion token t."""
        T = batch.response_len
        out = self.backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
        h = out.last_hidden_state[:, -(T + 1) : -1]  # [B, T, H]
        return self.head(h)[..., 0].float()


class Critic:
    """The value model, its AdamW and one update per step.

    Per step the trainer calls `values(batch)` before the policy update (the estimator's
    `values` extra) and `update(batch, values, gamma, lam, epochs, minibatches)` after it.
    """

    def __init__(self, policy, cfg: CriticConfig, seed: int = 0):
        self.cfg = cfg
        self.model = ValueModel(policy, seed).eval()
        self.ranks = None  # set by `shard`: the ranks of a torchrun job, each fitting its share of the groups
        self._optimizer()

    def _optimizer(self) -> None:
        cfg = self.cfg
        self.weights = MasterWeights(self.model.parameters(), lambda ps: torch.optim.AdamW(  # fp32 masters for a bf16 critic
            ps, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay))
        self.opt = self.weights.optimizer

    def shard(self, ranks, bf16: bool = False) -> None:
        """Shard the value model over a torchrun job's ranks with FSDP2, as the policy is (`assay.training.dist.shard`): each
        rank keeps 1/N of its weights and AdamW state, and `fit` trains each rank on its share of the groups."""
        from assay.training.dist import shard

        shard(self.model, ranks, bf16=bf16)
        self.ranks = ranks
        self._optimizer()  # over the shards

    @torch.no_grad()
    def values(self, batch) -> torch.Tensor:
        """V `[B, T]` of the rollout (detached, 0 on padding): the critic's side of the advantage."""
        return self.model(batch) * batch.mask

    def update(self, batch, old_values: torch.Tensor, gamma: float, lam: float, epochs: int, minibatches: int) -> dict[str, float]:
        """Fit V to the GAE returns of `old_values` (`gae_targets`); returns the `critic/` metrics.

        Args:
            batch: the step's `Batch`; old_values: `[B, T]` from `values(batch)` before any update.
            gamma, lam: the estimator's GAE parameters, so the targets are its returns.
            epochs, minibatches: passes over the batch and optimizer steps per pass.
        """
        returns, on = gae_targets(batch.rewards.to(batch.mask.device), old_values, batch.mask, gamma, lam)
        return self.fit(batch, old_values, returns, on, epochs, minibatches)

    def fit(self, batch, old_values: torch.Tensor, returns: torch.Tensor, on: torch.Tensor, epochs: int, minibatches: int) -> dict[str, float]:
        """Fit V to `returns [B, T]` on the tokens where `on [B, T]` is true; returns the `critic/` metrics.

        `returns` and `on` come from the estimator's value targets (`gae_targets`, or the
        estimator's own `value_targets`, e.g. `turn_gae`'s on each turn's first token).
        """
        mask = batch.mask
        scored = on.to(mask.dtype)  # tokens with a target
        out = {
            "critic/explained_variance": explained_variance(old_values, returns, scored),
            "critic/value_mean": masked_mean(old_values, scored).item(),  # over the tokens it fits
        }
        agg: dict[str, list[float]] = {}
        skipped = self.weights.skipped
        self.model.train()
        B = mask.shape[0]
        for _ in range(epochs):
            for idx in torch.arange(B, device=mask.device).chunk(minibatches):
                m = scored[idx]
                if m.sum() == 0:
                    continue
                self.weights.zero_grad()
                if self.ranks is not None and self.ranks.active:
                    step = self._sharded_pass(batch, idx, old_values, returns, scored)
                else:
                    loss_mat, lm = value_loss(self.model(batch.select(idx)), old_values[idx], returns[idx], m, clip=self.cfg.value_clip)
                    loss = aggregate(loss_mat, m, "token-mean")
                    self.weights.backward(loss)
                    step = {"critic/loss": loss.item(), "critic/vf_clip_frac": lm["vf_clip_frac"]}
                step["critic/grad_norm"] = self.weights.step(self.cfg.grad_clip)
                for k, v in step.items():
                    agg.setdefault(k, []).append(v)
        self.model.eval()
        out.update({**step_means(agg), **self.weights.metrics(skipped, "critic/")})
        return out

    def _sharded_pass(self, batch, idx: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, scored: torch.Tensor) -> dict[str, float]:
        """This rank's part of one minibatch's backward: its share of the minibatch's groups, the loss summed over its tokens
        and divided by the whole minibatch's scored tokens, so that FSDP2's sum of the ranks' gradients is the single
        process's `token-mean` gradient. A rank with no rows runs a masked row (every rank must run the same forwards)."""
        from assay.training.dist import weighted_mean

        groups = torch.unique(batch.group)
        mine = groups[self.ranks.share(len(groups))]
        total = float(scored[idx].sum())
        rows = idx[torch.isin(batch.group[idx], mine)]
        if rows.numel():
            m = scored[rows]
            loss_mat, lm = value_loss(self.model(batch.select(rows)), old_values[rows], returns[rows], m, clip=self.cfg.value_clip)
            loss = (loss_mat * m).sum() / total
            step, share = {"critic/loss": loss.item(), "critic/vf_clip_frac": lm["vf_clip_frac"]}, float(m.sum()) / total
        else:
            row = idx[:1]
            loss = self.model(batch.select(row)).sum() * 0.0
            step, share = {}, 0.0
        loss.backward()
        return weighted_mean(self.ranks, step, share, sums=("critic/loss",))

    # -- checkpoints -------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """The weights, for `critic.safetensors` in a checkpoint."""
        return {k: v.detach().contiguous() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict:
        """AdamW's state, and the fp32 master weights when the critic's weights are bf16."""
        return {"optimizer": self.opt.state_dict(), "master_weights": self.weights.master_state()}

    def load(self, tensors: dict[str, torch.Tensor], state: dict) -> None:
        """Weights from `critic.safetensors` and `state_dict()`'s state (or, from older checkpoints, AdamW's state alone).
        A sharded critic takes a single process's checkpoint whole, each rank keeping its shards of it."""
        if self.ranks is not None:
            from assay.training.dist import load_full_state, named_optimizer_state

            opt = state["optimizer"] if "optimizer" in state else state
            load_full_state(self.model, self.opt, tensors, named_optimizer_state(self.model, opt))
            return
        self.model.load_state_dict(tensors)
        self.weights.load_master(state.get("master_weights") if "optimizer" in state else None)
        self.opt.load_state_dict(state["optimizer"] if "optimizer" in state else state)
