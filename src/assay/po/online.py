"""`assay train algo.objective=NAME`: online iterative preference training and best-of-N SFT in the RL loop.

Everything a GRPO run does stays: prompts, the sampler (torch, vLLM or a server), any reward
block, group selection, held-out evaluation, checkpoints, exact resume, signals, the report.
Only the step from scored groups to an update changes (`PreferenceTrainer.learn`):

* a preference loss (`dpo`, `ipo`, `kto`, ...; `assay.po.losses`): pairs are formed from each
  group (`preference.pairs`, `preference.margin`; ties dropped and counted, `assay.po.pairs`),
  the reference's log-probabilities of every pair are computed once for the step (the policy
  as the step began, `preference.reference=round`, or the starting model kept, `initial`), and
  the loss takes `algo.epochs` passes of `algo.minibatches` optimizer steps over the pairs.
  This is iterative (online) DPO with a round of one step: Xiong et al., "Iterative Preference
  Learning from Human Feedback: Bridging Theory and Practice for RLHF under KL-Constraint"
  (2023), arXiv:2312.11456, and Dong et al., "RLHF Workflow: From Reward Modeling to Online
  RLHF" (2024), arXiv:2405.07863, with assay's reward in place of their preference model; the
  pairs are the policy's own fresh samples, as in Guo et al., "Direct Language Model Alignment
  from Online AI Feedback" (2024), arXiv:2402.04792.
* `raft`: SFT (mean token NLL, `algo.aggregation`) on each group's best `preference.raft_keep`
  completions scoring at least `preference.raft_min_reward`. Dong et al., "RAFT: Reward rAnked
  FineTuning for Generative Foundation Model Alignment" (2023), arXiv:2304.06767, with the
  ranking done within each prompt's group.

With a reward that gives no verdicts (a judge, the policy judging itself: `assay.po.selfjudge`)
and a task verifier beside it, the verifier scores the same completions as a canary (`canary/*`).
Left out: several optimizer epochs over a round's whole pair set between samplings (take
`algo.epochs` > 1 for that), and a torchrun job of several processes.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from assay.batch import collate
from assay.config import RunConfig
from assay.errors import AssayError
from assay.po.data import PairRow
from assay.po.pairs import pairs_of
from assay.po.selfjudge import CanaryGates, canary_metrics
from assay.po.step import Objective
from assay.rollout.base import pad_id, sampler_metrics
from assay.training.groups import split_groups
from assay.training.learner import accumulate_step
from assay.training.precision import step_means
from assay.training.rl import Trainer

OBJECTIVES = ("pg", "raft")  # besides the preference losses


def trainer_class() -> Callable[..., Trainer]:
    """`assay.training.sharded.trainer_class()` with the objective's trainer: a factory `(cfg, run_dir, resume) -> trainer`
    that builds `PreferenceTrainer` for an objective other than `pg`."""
    from assay.training.sharded import trainer_class as base

    cls = base()
    return lambda cfg, **kw: trainer_for(cfg, cls)(cfg, **kw)


def trainer_for(cfg: RunConfig, cls: type) -> type:
    """The trainer class of `cfg`'s objective: `cls` (one process, or one rank of a torchrun job) for `pg`,
    `PreferenceTrainer` for the others (one process only)."""
    if cfg.algo.objective == "pg":
        return cls
    if cls is not Trainer:
        raise AssayError(f"algo.objective={cfg.algo.objective} runs in one process; run it without torchrun")
    return PreferenceTrainer


def check_objective(cfg: RunConfig) -> None:
    """One line for an objective that is no loss, a loss argument it does not take, or a setting it cannot use."""
    from assay.po.losses import PREFERENCE_LOSSES, loss_args

    name = cfg.algo.objective
    if name == "pg":
        return
    if name != "raft":
        if name not in PREFERENCE_LOSSES and ":" not in name:
            raise AssayError(f"unknown algo.objective {name!r}; known: pg, raft, {', '.join(PREFERENCE_LOSSES.names())}")
        loss_args(name, cfg.preference.loss_args, "preference.loss_args")
    if cfg.rollout.group_size < 2:
        raise AssayError(f"rollout.group_size={cfg.rollout.group_size} with algo.objective={name}: pairs and best-of-N need two completions "
                         "of a prompt or more; set rollout.group_size to 2 or more")
    if cfg.algo.kl_coef > 0:
        raise AssayError(f"algo.kl_coef={cfg.algo.kl_coef} with algo.objective={name}: a preference loss keeps the policy near its reference "
                         "through its own β (preference.loss_args), and raft has no KL term; set algo.kl_coef=0")


class PreferenceTrainer(Trainer):
    """The RL loop with a preference objective in place of the policy-gradient update (see the module doc)."""

    def __init__(self, cfg: RunConfig, run_dir=None, resume: bool = False):
        check_objective(cfg)
        super().__init__(cfg, run_dir, resume)
        pref = cfg.preference
        self.raft = cfg.algo.objective == "raft"
        micro = 0
        if self.micro_batch_tokens:  # rows per forward within the activation budget (a pair is two sequences)
            micro = max(1, self.micro_batch_tokens // (2 * int(getattr(self.model.config, "max_position_embeddings", 512) or 512)))
        self.objective = None if self.raft else Objective(cfg.algo.objective, pref.loss_args, pad_id(self.tokenizer), self.device,
                                                          cfg.train.fast_forward, micro, "preference.loss_args")
        self.initial_ref = None
        if self.objective is not None and self.objective.uses_ref and pref.reference == "initial":
            from assay.models import load_policy

            self.initial_ref, _ = load_policy(cfg.model.path, self.device, cfg.model.dtype, cfg.model.chat_template)
            self.initial_ref.eval().requires_grad_(False)
        self.health = CanaryGates.around(self.health, pref.canary_floor)
        if self.executor.verifier is not None:  # its own canary already re-scores every completion
            self.watch.drop_canary()
        if self.resumed_health is not None:  # the loop restored the plain gates' state; the canary's own is in the same record
            self.health.load_state_dict(self.resumed_health)

    def learn(self, rollout) -> dict[str, float]:
        """Pairs (or the best completions) of the collected groups, the update, the step's metrics."""
        trajs, results, metrics, t0 = rollout
        self._last = (trajs, results)
        t_upd = time.perf_counter()
        groups = split_groups(trajs, results)
        self.rest_sampler()
        skipped = self.weights.skipped
        update, chosen = self._raft(groups) if self.raft else self._preference(groups)
        metrics.update({**update, **self.weights.metrics(skipped)})
        metrics.update(self._canary(trajs, chosen))
        self.sampler.update_weights(self.model, self.step + 1)
        metrics.update(sampler_metrics(self.sampler))
        t_end = time.perf_counter()
        metrics.update({"perf/step_s": t_end - t0, "perf/update_s": t_end - t_upd, "perf/tokens_per_s": metrics["rollout/tokens"] / (t_end - t0),
                        "actor/lr": self.sched.get_last_lr()[0], "perf/threads": float(self.threads.threads),
                        "perf/other_load": self.threads.other_load})
        self.sched.step()
        return metrics

    def _steps(self, n: int):
        """Index parts of `n` rows: `algo.epochs` passes of `algo.minibatches` optimizer steps."""
        for _ in range(self.cfg.algo.epochs):
            yield from torch.arange(n, device="cpu").chunk(self.cfg.algo.minibatches) if n else [torch.arange(0, device="cpu")]

    def _optimizer_step(self, ran: bool) -> float:
        if not ran:  # nothing to learn from this step: zero gradients, so AdamW's moments and weight decay advance as usual
            for p in self.model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        return self.weights.step(self.cfg.optim.grad_clip)

    def _preference(self, groups) -> tuple[dict[str, float], Any]:
        pref, objective = self.cfg.preference, self.objective
        got = pairs_of(groups, pref.pairs, pref.margin)
        rows = [PairRow(c[0], r[0]) for c, r in got.pairs]
        partners = rows[-1:] + rows[:-1]
        ref_model = self.initial_ref if self.initial_ref is not None else self.model  # `round`: the policy as the step began
        ref = objective.reference(ref_model, rows, partners) if rows else torch.zeros(0, 0, device="cpu")  # type: ignore[union-attr]
        self.model.train()
        sums: dict[str, list[float]] = {}
        for idx in self._steps(len(rows)):
            self.weights.zero_grad()
            part = idx.tolist()
            m = objective.step(self.model, [rows[i] for i in part], ref[idx], [partners[i] for i in part],  # type: ignore[union-attr]
                               loss_scale=self.weights.loss_scale) if part else {}
            m["actor/grad_norm"] = self._optimizer_step(bool(part))
            for k, v in m.items():
                sums.setdefault(k, []).append(v)
        self.model.eval()
        out = step_means(sums)
        out.update({"po/pairs": float(len(rows)), "po/ties": float(got.ties), "po/unpaired_groups": float(got.unpaired)})
        return out, [(r.chosen, r.rejected) for r in rows]

    def _raft(self, groups) -> tuple[dict[str, float], Any]:
        pref, cfg = self.cfg.preference, self.cfg
        kept = []
        for g in groups:
            good = [(t, r) for t, r in g if r.score is not None and r.error is None and r.score >= pref.raft_min_reward]
            kept += sorted(good, key=lambda x: -x[1].score)[: pref.raft_keep]  # stable: among equals, the first sampled
        algo = cfg.algo.model_copy(update={"loss": "reinforce", "loss_args": {}, "kl_coef": 0.0, "entropy_coef": 0.0})
        out: dict[str, list[float]] = {}
        batch = collate([t for t, _ in kept], [r for _, r in kept], pad_id(self.tokenizer), self.device) if kept else None
        self.model.train()
        for idx in self._steps(len(kept)):
            self.weights.zero_grad()
            m: dict[str, float] = {}
            if batch is not None and idx.numel():
                sub = batch.select(idx)
                # REINFORCE with advantage 1 on every kept token is the NLL's gradient: SFT, aggregated as algo.aggregation says
                m = accumulate_step(self.model, None, sub, sub.mask.clone(), algo, 1.0, cfg.rollout.max_new_tokens, self.micro_batch_tokens,
                                    cfg.train.fast_forward, loss_scale=self.weights.loss_scale)
                m = {"raft/nll": m["actor/loss"]}
            m["actor/grad_norm"] = self._optimizer_step(bool(m))
            for k, v in m.items():
                out.setdefault(k, []).append(v)
        self.model.eval()
        res = step_means(out)
        res["raft/kept"] = float(len(kept))
        return res, [t for t, _ in kept]

    def _canary(self, trajs, chosen) -> dict[str, float]:
        verifier = self.executor.verifier  # the task's verifier, when the run's reward gives no verdicts
        if verifier is None:
            return {}
        verified = {id(t): r.score for t, r in zip(trajs, verifier.score(trajs))}
        if self.raft:
            return canary_metrics(verified, trajs, kept=chosen)
        return canary_metrics(verified, trajs, pairs=chosen)
