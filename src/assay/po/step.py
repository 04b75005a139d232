"""One preference update: sequence log-probabilities, the named loss, its mean, the metrics.

Offline (`assay po train`) and online (`assay train algo.objective=NAME`) training both call
`Objective.step`. Rows are `PairRow`s (a chosen and a rejected trajectory of one prompt) or,
for an unpaired loss on an unpaired file, `SingleRow`s. The reference's log-probabilities of
every row are computed once (`Objective.reference`, no gradient) and handed in as a tensor
`[R, k]`; the policy's are computed in micro-batches of rows whose gradients add up to the
whole batch's (each micro-batch's loss sum is divided by the batch's count of pairs, or of
responses for an unpaired loss). A pair's two responses share their prompt, so the
learner's shared-prefix forward (`assay.models.logprobs.token_logprobs`) runs it once.
"""

from __future__ import annotations

from typing import Any

import torch

from assay.batch import collate
from assay.models.logprobs import token_logprobs
from assay.po.data import PairRow, SingleRow, mismatched
from assay.po.losses import PREFERENCE_LOSSES, Pairs, Singles, loss_args
from assay.types import RewardResult, Trajectory

Row = PairRow | SingleRow


def sequence_logps(model, trajs: list[Trajectory], pad_id: int, device, fast: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`(Σ log π(y|x) [M], tokens [M])` of each trajectory's completion under `model` at temperature 1, over the tokens its
    loss mask marks as the model's; with a gradient when grad is enabled."""
    batch = collate(trajs, [RewardResult(0.0)] * len(trajs), pad_id, device)
    lp, _ = token_logprobs(model, batch, 1.0, fast=fast)  # [M, T]
    return (lp * batch.mask).sum(-1), batch.mask.sum(-1)


class Objective:
    """A named preference loss with its checked hyperparameters, applied to rows.

    Args:
        name: a `PREFERENCE_LOSSES` name (or `module:attr`). args: its hyperparameters (`loss_args`, checked).
        pad_id, device: of the learner. fast: the shared-prefix forward. micro_batch: rows per forward (0: all).
        where: the config key of `args`, for messages.
    """

    def __init__(self, name: str, args: dict[str, Any], pad_id: int, device, fast: bool = True, micro_batch: int = 0,
                 where: str = "loss_args"):
        self.name, self.fn = name, PREFERENCE_LOSSES.get(name)
        self.args = loss_args(name, args, where)
        self.paired = getattr(self.fn, "paired", True)  # the loss takes pairs (else labelled single responses)
        self.uses_ref = getattr(self.fn, "reference", True)
        self.pad_id, self.device, self.fast, self.micro = pad_id, device, fast, micro_batch

    # ---------------------------------------------------------------- rows → responses

    @staticmethod
    def responses(rows: list[Row]) -> list[Trajectory]:
        """The rows' responses: every chosen, then every rejected (pairs), or each row's one."""
        if rows and isinstance(rows[0], PairRow):
            return [r.chosen for r in rows] + [r.rejected for r in rows]  # type: ignore[union-attr]
        return [r.traj for r in rows]  # type: ignore[union-attr]

    @staticmethod
    def kl_responses(rows: list[Row], partners: list[Row] | None = None) -> list[Trajectory]:
        """Each row's prompt with its partner row's responses, in the order of `responses` (KTO's mismatched pairs);
        without `partners`, row i's partner is row i − 1 (the last row's, the first's), as TRL's KTO collator pairs them."""
        partners = partners if partners is not None else rows[-1:] + rows[:-1]
        a, b = Objective.responses(rows), Objective.responses(partners)
        return [mismatched(x, y) for x, y in zip(a, b)]

    def columns(self, rows: list[Row]) -> int:
        """Reference values per row: a pair's two responses (a single row's one), doubled when the loss needs mismatched ones."""
        k = 2 if rows and isinstance(rows[0], PairRow) else 1
        return k if self.paired else 2 * k

    def check_rows(self, rows: list[Row], source: str) -> None:
        from assay.errors import AssayError

        if rows and isinstance(rows[0], SingleRow) and self.paired:
            raise AssayError(f"{source}: unpaired rows (completion, label) need an unpaired loss (kto); {self.name} trains on pairs")

    # ---------------------------------------------------------------- log-probabilities

    def _logps(self, model, trajs: list[Trajectory], chunk: int) -> torch.Tensor:
        out = [sequence_logps(model, trajs[i : i + chunk], self.pad_id, self.device, self.fast)[0] for i in range(0, len(trajs), chunk)]
        return torch.cat(out) if out else torch.zeros(0, device=self.device)

    @torch.no_grad()
    def reference(self, model, rows: list[Row], partners: list[Row] | None = None, chunk: int = 64) -> torch.Tensor:
        """The reference values of every row `[R, k]` (CPU, fp32): Σ log π_ref of its responses, then of its mismatched
        responses when the loss needs them; `[R, 0]` for a loss that reads no reference."""
        R = len(rows)
        if not self.uses_ref:
            return torch.zeros(R, 0, device="cpu")
        k = self.columns(rows) // (1 if self.paired else 2)
        cols = [self._logps(model, self.responses(rows), chunk).view(k, R).t()]  # [R, k]
        if not self.paired:
            cols.append(self._logps(model, self.kl_responses(rows, partners), chunk).view(k, R).t())
        return torch.cat(cols, 1).float().cpu()

    # ---------------------------------------------------------------- the loss

    def _inputs(self, rows: list[Row], lp: torch.Tensor, lens: torch.Tensor, ref: torch.Tensor, kl_pol, kl_ref):
        """`(policy, reference)` inputs of the loss for `rows` (ref `[n, k]` on the device)."""
        n = len(rows)
        if isinstance(rows[0], PairRow):
            if self.paired:
                pol = Pairs(lp[:n], lp[n:], lens[:n], lens[n:])
                return pol, (Pairs(ref[:, 0], ref[:, 1], lens[:n], lens[n:]) if self.uses_ref else None)
            good = torch.cat([torch.ones(n, dtype=torch.bool, device=lp.device), torch.zeros(n, dtype=torch.bool, device=lp.device)])
            return Singles(lp, lens, good, kl_pol), Singles(torch.cat([ref[:, 0], ref[:, 1]]), lens, good, kl_ref)
        good = torch.tensor([r.desirable for r in rows], dtype=torch.bool, device=lp.device)  # type: ignore[union-attr]
        return Singles(lp, lens, good, kl_pol), Singles(ref[:, 0], lens, good, kl_ref)

    def step(self, model, rows: list[Row], ref: torch.Tensor, partners: list[Row] | None = None, backward: bool = True,
             prefix: str = "po/", micro: int | None = None, loss_scale: float = 1.0) -> dict[str, float]:
        """The loss of `rows` (mean over pairs, or responses for an unpaired loss) and, with `backward`, its gradient
        accumulated into the model's parameters (the optimizer step is the caller's). `ref [R, k]` from `reference`;
        `micro` rows per forward (None: the objective's `micro_batch`); `loss_scale` multiplies the loss before the backward
        (`MasterWeights.loss_scale`). Returns the batch's metrics under `prefix`
        (docs/metrics.md)."""
        if not rows:
            return {}
        ref = ref.to(self.device)
        n_resp = len(self.responses(rows))
        k = n_resp // len(rows)
        kl_pol = kl_ref = None
        if not self.paired:  # KTO's reference point z0 is a batch mean: every micro-batch gets the whole batch's
            with torch.no_grad():
                kl_pol = self._logps(model, self.kl_responses(rows, partners), 64)
            kl_ref = ref[:, k:].t().reshape(-1)
        units = len(rows) * (1 if self.paired else k)  # what the mean is over
        step = (self.micro if micro is None else micro) or len(rows)
        sums: dict[str, float] = {}
        chosen, rejected, lp_c, lp_r = [], [], [], []
        for s in range(0, len(rows), step):
            sub = rows[s : s + step]
            with torch.set_grad_enabled(backward):
                trajs = self.responses(sub)
                lp, lens = sequence_logps(model, trajs, self.pad_id, self.device, self.fast)
                pol, rf = self._inputs(sub, lp, lens, ref[s : s + step], kl_pol, kl_ref)
                out = self.fn(pol, rf, **self.args)
                loss = out.loss.sum() / units
            if backward:
                (loss * loss_scale).backward()
            share = out.loss.numel() / units
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
            for key, v in out.metrics.items():
                sums[key] = sums.get(key, 0.0) + v * share
            chosen.append(out.chosen_reward)
            rejected.append(out.rejected_reward)
            good = pol.desirable if isinstance(pol, Singles) else None
            lp_c.append(lp.detach()[: len(sub)] if good is None else lp.detach()[good])
            lp_r.append(lp.detach()[len(sub) :] if good is None else lp.detach()[~good])
        return {f"{prefix}{k}": v for k, v in {**sums, **_reward_metrics(chosen, rejected, lp_c, lp_r, isinstance(rows[0], PairRow))}.items()}


def _mean(parts: list[torch.Tensor]) -> float | None:
    x = torch.cat(parts) if parts else torch.zeros(0, device="cpu")
    return float(x.double().mean()) if x.numel() else None


def _reward_metrics(chosen, rejected, lp_c, lp_r, paired_rows: bool) -> dict[str, float]:
    out = {"reward_chosen": _mean(chosen), "reward_rejected": _mean(rejected), "logp_chosen": _mean(lp_c), "logp_rejected": _mean(lp_r)}
    if paired_rows:
        c, r = torch.cat(chosen).double(), torch.cat(rejected).double()
        out.update(reward_margin=float((c - r).mean()), reward_accuracy=float((c > r).double().mean()))
    return {k: v for k, v in out.items() if v is not None}
