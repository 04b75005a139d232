"""Preference losses: pure functions of sequence log-probabilities, registered by name.

A *paired* loss takes the policy's and the reference's log-probabilities of each pair's
chosen response y_w and rejected response y_l (`Pairs`: Σ_t log π(y_t | x, y_<t) and the
token counts, `[N]` each) and returns a `Loss`: the loss of each pair `[N]`, the implicit
reward of each chosen and rejected response `[N]` (what `po/reward_*` report) and metrics.
The *unpaired* loss (KTO) takes `Singles`: one response per row with a desirable/undesirable
label. The trainer takes the mean over pairs (or rows); no loss aggregates itself.

Throughout, with ρ_w = log π(y_w|x) − log π_ref(y_w|x) and ρ_l likewise, z = ρ_w − ρ_l.

    >>> import torch
    >>> pol = Pairs(torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([1.0]), torch.tensor([1.0]))
    >>> ref = Pairs(torch.tensor([-1.5]), torch.tensor([-1.5]), torch.tensor([1.0]), torch.tensor([1.0]))
    >>> round(dpo(pol, ref, beta=0.1).loss.item(), 6)    # −log σ(0.1 · ((−1 + 1.5) − (−2 + 1.5)))
    0.644397
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from assay.algos.args import bind_args
from assay.errors import AssayError
from assay.registry import Registry

PREFERENCE_LOSSES: Registry = Registry("preference loss")


@dataclass
class Pairs:
    """Sequence log-probabilities of N pairs under one model."""

    chosen: torch.Tensor  # [N] Σ log π(y_w | x)
    rejected: torch.Tensor  # [N] Σ log π(y_l | x)
    chosen_len: torch.Tensor  # [N] tokens of y_w (float)
    rejected_len: torch.Tensor  # [N] tokens of y_l (float)


@dataclass
class Singles:
    """Sequence log-probabilities of M labelled responses under one model (KTO's unpaired rows)."""

    logps: torch.Tensor  # [M] Σ log π(y | x)
    lengths: torch.Tensor  # [M] tokens (float)
    desirable: torch.Tensor  # [M] bool
    kl_logps: torch.Tensor | None = None  # [M] Σ log π(y' | x) of a mismatched response y' (KTO's reference point)


@dataclass
class Loss:
    """What a preference loss returns: per-pair (or per-row) loss and the implicit rewards it implies."""

    loss: torch.Tensor  # [N] (unpaired: [M])
    chosen_reward: torch.Tensor  # [N] (unpaired: the desirable rows')
    rejected_reward: torch.Tensor  # [N] (unpaired: the undesirable rows')
    metrics: dict[str, float] = field(default_factory=dict)


#: every hyperparameter a loss may take, with its allowed range (checked when a run starts)
LIMITS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "beta": ("> 0", lambda x: x > 0),
    "label_smoothing": ("in [0, 0.5)", lambda x: 0 <= x < 0.5),
    "gamma": (">= 0", lambda x: x >= 0),
    "desirable_weight": ("> 0", lambda x: x > 0),
    "undesirable_weight": ("> 0", lambda x: x > 0),
}


def preference_loss(name: str, *, paired: bool = True, reference: bool = True) -> Callable:
    """Register a loss under `name`; `paired=False` for a loss over labelled single responses,
    `reference=False` for one that never reads the reference (no reference model is needed)."""

    def deco(fn: Callable) -> Callable:
        fn.paired, fn.reference = paired, reference  # type: ignore[attr-defined]
        return PREFERENCE_LOSSES.register(name)(fn)

    return deco


DATA_ARGS = ("policy", "ref")


def loss_args(name: str, given: dict[str, Any], where: str = "loss_args") -> dict[str, Any]:
    """`given` checked against the loss's signature and `LIMITS`: one `AssayError` line for an unknown
    name, argument, type or out-of-range value."""
    fn = PREFERENCE_LOSSES.get(name)
    out = bind_args(fn, given, DATA_ARGS, where)
    for key, p in inspect.signature(fn).parameters.items():
        value = out.get(key, p.default)
        if key in LIMITS and not isinstance(value, bool) and value is not inspect.Parameter.empty:
            rule, ok = LIMITS[key]
            if not ok(value):
                raise AssayError(f"{where}: {key}={given.get(key, value)!r} for {name} must be {rule}")
    return out


def _logsig_pair(z: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """−(1 − ε) log σ(z) − ε log σ(−z) `[N]`."""
    loss = -F.logsigmoid(z)
    return loss if label_smoothing == 0 else (1 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-z)


def _ratios(policy: Pairs, ref: Pairs) -> tuple[torch.Tensor, torch.Tensor]:
    return policy.chosen - ref.chosen, policy.rejected - ref.rejected  # [N], [N]


@preference_loss("dpo")
def dpo(policy: Pairs, ref: Pairs, beta: float = 0.1) -> Loss:
    """DPO's sigmoid loss: −log σ(β z), rewards β ρ.

    Rafailov et al., "Direct Preference Optimization: Your Language Model is Secretly a Reward
    Model" (2023), arXiv:2305.18290, eq. 7. TRL's `DPOTrainer(loss_type="sigmoid")`.
    """
    rw, rl = _ratios(policy, ref)
    return Loss(-F.logsigmoid(beta * (rw - rl)), beta * rw.detach(), beta * rl.detach())


@preference_loss("cdpo")
def cdpo(policy: Pairs, ref: Pairs, beta: float = 0.1, label_smoothing: float = 0.1) -> Loss:
    """Conservative DPO: DPO against labels flipped with probability ε, −(1−ε) log σ(β z) − ε log σ(−β z).

    Mitchell, "A note on DPO with noisy preferences & relationship to IPO" (2023, a note
    without an arXiv id); the label-smoothed loss TRL's DPOTrainer had as `label_smoothing`.
    Its gradient vanishes at a finite margin, so the policy stops pushing a pair it may have wrong.
    """
    rw, rl = _ratios(policy, ref)
    return Loss(_logsig_pair(beta * (rw - rl), label_smoothing), beta * rw.detach(), beta * rl.detach())


@preference_loss("robust")
def robust(policy: Pairs, ref: Pairs, beta: float = 0.1, label_smoothing: float = 0.1) -> Loss:
    """Robust DPO (rDPO): the unbiased loss under labels flipped with known rate ε,
    ((1−ε)(−log σ(β z)) − ε(−log σ(−β z))) / (1 − 2ε).

    Chowdhury, Kini and Natarajan, "Provably Robust DPO: Aligning Language Models with Noisy
    Feedback" (2024), arXiv:2403.00409, eq. 8. TRL's `loss_type="robust"`.
    """
    rw, rl = _ratios(policy, ref)
    z = beta * (rw - rl)
    loss = ((1 - label_smoothing) * -F.logsigmoid(z) - label_smoothing * -F.logsigmoid(-z)) / (1 - 2 * label_smoothing)
    return Loss(loss, beta * rw.detach(), beta * rl.detach())


@preference_loss("ipo")
def ipo(policy: Pairs, ref: Pairs, beta: float = 0.1, length_normalize: bool = True) -> Loss:
    """IPO: the squared loss (z̄ − 1/(2β))², β the regularisation τ of the paper.

    Azar et al., "A General Theoretical Paradigm to Understand Learning from Human Preferences"
    (2023), arXiv:2310.12036, eq. 17. With `length_normalize` (the default) z̄ uses per-token
    mean log-ratios ρ/|y|, as TRL's `loss_type="ipo"` does (confirmed with the authors, TRL
    says); false: the paper's sequence sums. Rewards β ρ (sums), as TRL logs them.
    """
    rw, rl = _ratios(policy, ref)
    z = rw / policy.chosen_len.clamp(min=1) - rl / policy.rejected_len.clamp(min=1) if length_normalize else rw - rl
    return Loss((z - 1 / (2 * beta)) ** 2, beta * rw.detach(), beta * rl.detach())


@preference_loss("hinge")
def hinge(policy: Pairs, ref: Pairs, beta: float = 0.1) -> Loss:
    """Hinge loss on the normalised likelihood, max(0, 1 − β z).

    SLiC's calibration loss (Zhao et al., "SLiC-HF: Sequence Likelihood Calibration with Human
    Feedback" (2023), arXiv:2305.10425) with the reference ratio and 1/β margin of RSO (Liu et
    al., "Statistical Rejection Sampling Improves Preference Optimization" (2023),
    arXiv:2309.06657, eq. 9); TRL's `loss_type="hinge"`. SLiC's own regulariser is left out.
    """
    rw, rl = _ratios(policy, ref)
    return Loss(torch.relu(1 - beta * (rw - rl)), beta * rw.detach(), beta * rl.detach())


@preference_loss("simpo", reference=False)
def simpo(policy: Pairs, ref: Pairs | None = None, beta: float = 2.0, gamma: float = 0.5) -> Loss:
    """SimPO: reference-free and length-normalised, −log σ(β/|y_w| log π(y_w) − β/|y_l| log π(y_l) − γ).

    Meng, Xia and Chen, "SimPO: Simple Preference Optimization with a Reference-Free Reward"
    (2024), arXiv:2405.14734, eq. 6 (γ the target reward margin). Rewards β log π / |y|.
    TRL's `CPOTrainer(loss_type="simpo", cpo_alpha=0)` (`simpo_gamma` = γ).
    """
    cw = beta * policy.chosen / policy.chosen_len.clamp(min=1)
    cl = beta * policy.rejected / policy.rejected_len.clamp(min=1)
    return Loss(-F.logsigmoid(cw - cl - gamma), cw.detach(), cl.detach())


def _log_odds(avg_logp: torch.Tensor) -> torch.Tensor:
    """log(p / (1 − p)) of p = exp(avg_logp) < 1."""
    return avg_logp - torch.log(-torch.expm1(avg_logp))


@preference_loss("orpo", reference=False)
def orpo(policy: Pairs, ref: Pairs | None = None, beta: float = 0.1) -> Loss:
    """ORPO: SFT on the chosen response plus an odds-ratio term, −log p̄(y_w) − β log σ(log odds(y_w) − log odds(y_l)).

    Hong, Lee and Thorne, "ORPO: Monolithic Preference Optimization without Reference Model"
    (2024), arXiv:2403.07691, eqs. 6–7 (β is their λ); p̄ = exp(mean token log-prob), as in the
    paper and TRL's `ORPOTrainer`. The SFT term is each pair's mean token NLL (TRL takes the
    token mean over the whole batch: the same when chosen responses have equal lengths).
    Rewards β log p̄, as TRL logs them.
    """
    aw, al = policy.chosen / policy.chosen_len.clamp(min=1), policy.rejected / policy.rejected_len.clamp(min=1)
    ratio = F.logsigmoid(_log_odds(aw) - _log_odds(al))  # [N]
    nll = -aw
    metrics = {"nll": float(nll.detach().mean()), "log_odds_ratio": float(ratio.detach().mean())}
    return Loss(nll - beta * ratio, beta * aw.detach(), beta * al.detach(), metrics)


@preference_loss("kto", paired=False)
def kto(policy: Singles, ref: Singles, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> Loss:
    """KTO: λ_D (1 − σ(β(ρ − z₀))) for a desirable response, λ_U (1 − σ(β(z₀ − ρ))) for an undesirable one.

    Ethayarajh et al., "KTO: Model Alignment as Prospect Theoretic Optimization" (2024),
    arXiv:2402.01306, eq. 8. z₀ = max(0, mean(log π(y'|x) − log π_ref(y'|x))) over the batch's
    mismatched responses y' (each row's prompt with another row's response), without gradient,
    as TRL's `KTOTrainer`. Rewards β ρ.
    """
    if policy.kl_logps is None or ref.kl_logps is None:
        raise AssayError("kto needs the log-probabilities of mismatched responses (Singles.kl_logps) under the policy and the reference")
    z0 = (policy.kl_logps - ref.kl_logps).mean().detach().clamp(min=0)
    rho = policy.logps - ref.logps  # [M]
    good = policy.desirable
    loss = torch.where(good, desirable_weight * (1 - torch.sigmoid(beta * (rho - z0))),
                       undesirable_weight * (1 - torch.sigmoid(beta * (z0 - rho))))
    reward = beta * rho.detach()
    return Loss(loss, reward[good], reward[~good], {"kl": float(z0)})
