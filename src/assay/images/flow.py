"""A text-conditional flow-matching image policy, and the stochastic sampler that gives each denoising step a likelihood.

The model (`FlowPolicy`) is a `diffusers` `UNet2DModel` that predicts the velocity
`v = ε − x₀` of the straight path `x_t = (1 − t)·x₀ + t·ε` (rectified flow: "Flow Straight and
Fast", Liu et al., ICLR 2023, arXiv:2209.03003; "Flow Matching for Generative Modeling",
Lipman et al., ICLR 2023, arXiv:2210.02747), conditioned on the prompt through a small text
encoder (word embeddings at fixed positions, an MLP) whose output is added to the UNet's
timestep embedding. Pictures are `[3, H, W]` in [−1, 1]; t runs from 1 (noise) to 0 (picture).

Sampling follows Flow-GRPO ("Flow-GRPO: Training Flow Matching Models via Online RL",
Liu et al., 2025, arXiv:2505.05470): the deterministic ODE `dx = v dt` is replaced by an SDE
with the same marginals,

    x_{t+Δt} = x_t + [v + σ_t²/(2t)·(x_t + (1 − t)·v)]·Δt + σ_t·√(−Δt)·ε,   σ_t = a·√(t / (1 − t)),

so each step is a Gaussian whose mean the policy sets: its log-density is the step's
log-likelihood, and a trajectory of K steps is K actions. As in the paper's code the
log-density is averaged over the picture's dimensions (a per-dimension log-likelihood), and
σ at t = 1 takes the first grid point below 1 in its denominator. Temperature 0 samples the
ODE (`x_{t+Δt} = x_t + v·Δt`): deterministic, for evaluation.

`FlowPolicy.action_logprobs` recomputes the steps' log-likelihoods of a batch's stored
chains (`Batch.actions`), which is what the learner's `token_logprobs` calls for a policy
whose actions are not tokens (docs/architecture.md, "Policies whose actions are not tokens").
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from assay.devices import generator_for
from assay.errors import AssayError

MODEL_TYPE = "assay-flow"
WEIGHTS = "model.safetensors"
#: a LoRA run's adapter folder carries the policy's `sampling` here, as `config.json` does for a whole policy
SAMPLING_FILE = "sampling.json"
#: the layers `model.lora` puts adapters on in an image policy when the run names none of its own: every convolution and
#: timestep projection of the UNet's ResNet blocks, and its input and output convolutions (the text encoder stays frozen)
LORA_TARGETS = ("conv_in", "conv1", "conv2", "time_emb_proj", "conv_out")


@dataclass
class Sampling:
    """How the policy samples pictures: its `generation_config`. Saved in `config.json`; a run's `image:` section overrides it.

    Attributes:
        steps: denoising steps of a training rollout (SDE): the actions of one trajectory.
        eval_steps: steps of a greedy (temperature 0) picture: the ODE, deterministic.
        noise_level: `a` in σ_t = a·√(t/(1−t)), how much noise the SDE injects per step.
        train_steps: how many of the first (noisiest) steps are the actions (SDE steps that train); the rest of the
            chain follows the ODE, so nothing but the actions tells a group's pictures apart (MixGRPO's mixed ODE–SDE
            sampling: Li et al., "MixGRPO: Unlocking Flow-based GRPO Efficiency with Mixed ODE-SDE", 2025,
            arXiv:2507.21802, with the SDE window fixed at the start). None: every step is an action.
        shared_noise: the pictures of one prompt's group start from the same noise, so what tells them apart is the
            SDE's steps, which are the actions, not the starting noise, which no action chose ("DanceGRPO: Unleashing
            GRPO on Visual Generation", Xue et al., 2025, arXiv:2505.07818). False: each picture its own starting noise.
        kernel: the stochastic step whose density is an action's likelihood: `sde`, Flow-GRPO's SDE (`noise_level`), or
            `ddim`, the DDIM step with noise `eta` (`ddim_step`; η = 1 is DDPM's ancestral step), DDPO's sampler.
        eta: η of the `ddim` kernel, in (0, 1].
    """

    steps: int = 10
    eval_steps: int = 20
    noise_level: float = 0.7
    train_steps: int | None = None
    shared_noise: bool = True
    kernel: str = "sde"
    eta: float = 1.0

    @property
    def actions(self) -> int:
        """The number of steps of a training rollout that are actions (`train_steps`, at most `steps`)."""
        return min(self.steps, self.train_steps or self.steps)


@dataclass
class FlowConfig:
    """The architecture: picture size, UNet widths, text encoder size. `model_type` tells `load_policy` what it is."""

    vocab_size: int
    sample_size: int = 16
    channels: int = 3
    block_out_channels: tuple[int, ...] = (32, 64, 64)
    layers_per_block: int = 1
    norm_num_groups: int = 8
    text_dim: int = 32
    max_prompt_tokens: int = 8
    pad_token_id: int = 0
    sampling: dict[str, Any] = field(default_factory=dict)
    model_type: str = MODEL_TYPE

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["block_out_channels"] = list(self.block_out_channels)
        return out

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "FlowConfig":
        """The config of a saved policy folder (as a Hugging Face config class reads one; `peft` calls it when saving adapters)."""
        raw = json.loads((Path(folder) / "config.json").read_text())
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(**{**known, "block_out_channels": tuple(known.get("block_out_channels", (32, 64, 64)))})


class FlowPolicy(nn.Module):
    """Prompt token ids → a velocity field over pictures; a policy whose actions are denoising steps."""

    #: what kind of policy this is: the trainer picks the `image` sampler for it
    policy_kind = "image"
    #: `model.lora` on it (`assay.models.lora.apply_lora`): no task head, adapters on `LORA_TARGETS` unless the run names others
    peft_task = None
    lora_targets = LORA_TARGETS

    def __init__(self, config: FlowConfig):
        super().__init__()
        from diffusers import UNet2DModel

        self.config = config
        self.sampling = Sampling(**config.sampling)
        width = config.block_out_channels[0] * 4  # the UNet's timestep-embedding size
        self.embed = nn.Embedding(config.vocab_size, config.text_dim, padding_idx=config.pad_token_id)
        self.position = nn.Parameter(torch.zeros(config.max_prompt_tokens, config.text_dim, device="cpu"))
        self.text = nn.Sequential(nn.Linear(config.max_prompt_tokens * config.text_dim, width), nn.SiLU(), nn.Linear(width, width))
        levels = len(config.block_out_channels)
        self.unet = UNet2DModel(sample_size=config.sample_size, in_channels=config.channels, out_channels=config.channels,
                                block_out_channels=tuple(config.block_out_channels), layers_per_block=config.layers_per_block,
                                down_block_types=("DownBlock2D",) * levels, up_block_types=("UpBlock2D",) * levels,
                                class_embed_type="identity", norm_num_groups=config.norm_num_groups)

    # -- the model ---------------------------------------------------------------------
    def condition(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`[B, E]` conditioning vectors of prompts given as token ids `[B, L]` with their attention mask (any padding side)."""
        return self.text(embed_prompt(self.embed, self.position, ids, mask, self.config.pad_token_id))

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """The predicted velocity `ε − x₀` at pictures `x [B, C, H, W]`, times `t [B]` in [0, 1], conditioning `cond [B, E]`."""
        return self.unet(x, t * 1000.0, class_labels=cond).sample

    def action_logprobs(self, batch, temperature: float = 1.0, with_entropy: bool = False) -> tuple[torch.Tensor, None]:
        """Log-likelihood `[B, K]` of each stored denoising step of `batch.actions` (`[B, K+1, C, H, W]` chains) under the SDE.

        No entropy: each step's entropy is fixed by the noise schedule, not by the policy.
        `temperature` is unused (the SDE's noise level is `sampling.noise_level`).
        """
        chain = _chains(batch)
        B = chain.shape[0]
        K = batch.response_len  # the first K steps of the chain are the actions
        grid = time_grid(chain.shape[1] - 1, chain.device)
        P = batch.input_ids.shape[1] - batch.response_len
        cond = self.condition(batch.input_ids[:, :P], batch.attention_mask[:, :P]).repeat_interleave(K, 0)
        t, t_next = grid[:K].repeat(B), grid[1 : K + 1].repeat(B)
        x = chain[:, :K].reshape(B * K, *chain.shape[2:])
        mean, std = step_kernel(self.sampling, x, self.velocity(x, t, cond), t, t_next, grid[1])
        return gaussian_logprob(chain[:, 1 : K + 1].reshape(B * K, *chain.shape[2:]), mean, std).view(B, K), None

    @torch.no_grad()
    def draw_noisings(self, batch, generator: torch.Generator | None = None) -> "Noisings":
        """Fresh noisings of each batch picture and the policy's velocity there, as it is now: the rollout policy's side of a
        loss on the forward process (DiffusionNFT), fixed for every optimizer step the batch takes.

        Each picture `x₀` (the last latent of its stored chain, `batch.actions`) is noised once per action column,
        `x_t = (1 − t)·x₀ + t·ε`, t ~ U(0, 1) and ε ~ N(0, I) drawn on the CPU from `generator`.
        """
        chain = _chains(batch)
        B, K, x0 = chain.shape[0], batch.response_len, chain[:, -1]
        t = torch.rand(B, K, generator=generator_for(generator, "cpu"), device="cpu").to(x0.device)
        noise = torch.randn((B, K, *x0.shape[1:]), generator=generator_for(generator, "cpu"), device="cpu").to(x0.device)
        was_training = self.training
        self.eval()
        old = self.forward_process(batch, Noisings(t, noise, None))[0]
        self.train(was_training)
        return Noisings(t, noise, old)

    def forward_process(self, batch, noisings: "Noisings | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The velocities `v [B, K, C, H, W]` the policy predicts at the batch's noisings (`batch.draws`, or `noisings`) of
        its pictures, and their flow-matching targets `ε − x₀`."""
        chain, draws = _chains(batch), batch.draws if noisings is None else noisings
        if draws is None:
            raise AssayError("a loss on the forward process needs the batch's noisings (Batch.draws: FlowPolicy.draw_noisings)")
        B, K, x0 = chain.shape[0], draws.t.shape[1], chain[:, -1]
        tt = draws.t.view(B, K, *(1,) * (x0.dim() - 1))
        xt = (1 - tt) * x0[:, None] + tt * draws.noise
        P = batch.input_ids.shape[1] - batch.response_len
        cond = self.condition(batch.input_ids[:, :P], batch.attention_mask[:, :P]).repeat_interleave(K, 0)
        v = self.velocity(xt.flatten(0, 1), draws.t.flatten(), cond).view(xt.shape)
        return v, draws.noise - x0[:, None]

    # -- files -------------------------------------------------------------------------
    def save_pretrained(self, folder: str | Path, safe_serialization: bool = True, **_: Any) -> None:
        """`config.json` (with the current `sampling`) and `model.safetensors`, as a Hugging Face folder."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.config.sampling = asdict(self.sampling)
        (folder / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, folder / WEIGHTS)

    def adapter_files(self) -> dict[str, str]:
        """What an adapter folder (a LoRA run's checkpoint or `final/`) holds beside the adapter: the current `sampling`,
        which the base policy's `config.json` does not have (`read_adapter_files` puts it back on the merged policy)."""
        return {SAMPLING_FILE: json.dumps(asdict(self.sampling), indent=2) + "\n"}

    def read_adapter_files(self, folder: str | Path) -> None:
        """Take `sampling` from an adapter folder's `sampling.json`, if it has one (older folders do not)."""
        path = Path(folder) / SAMPLING_FILE
        if not path.is_file():
            return
        try:
            raw = json.loads(path.read_text())
            self.sampling = Sampling(**{k: v for k, v in raw.items() if k in Sampling.__dataclass_fields__})
        except (ValueError, TypeError, AttributeError) as e:
            raise AssayError(f"{path}: not the sampling settings of an image policy: {e}") from None
        check_sampling(self.sampling)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "FlowPolicy":
        from safetensors.torch import load_file

        folder = Path(folder)
        model = cls(FlowConfig.from_pretrained(folder))
        model.load_state_dict(load_file(folder / WEIGHTS))
        return model.eval()


def pack_prompt(ids: torch.Tensor, mask: torch.Tensor, L: int, pad_id: int) -> torch.Tensor:
    """Prompt token ids `[B, W]` with their attention mask (any padding side) → `[B, L]`: each prompt's real tokens from the
    left, then padding, so a word sits at the same position whatever the padding. A prompt over `L` tokens is an `AssayError`."""
    counts = mask.sum(-1)
    if counts.numel() and int(counts.max()) > L:
        raise AssayError(f"a prompt of {int(counts.max())} tokens is longer than this image model reads ({L}: max_prompt_tokens)")
    slot = (mask.cumsum(-1) - 1).clamp(min=0)  # each real token's place from the left
    packed = torch.full((ids.shape[0], L + 1), pad_id, dtype=torch.long, device=ids.device)
    packed.scatter_(1, torch.where(mask.bool(), slot, torch.full_like(slot, L)), ids)  # padding lands in the spare column L
    return packed[:, :L]


def embed_prompt(embed: nn.Embedding, position: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, pad_id: int) -> torch.Tensor:
    """`[B, L·E]`: each prompt's words embedded at fixed positions (`pack_prompt`, L = `position`'s rows), padding zero;
    how the image policy and the picture scorer (`assay.images.scorer`) read a prompt."""
    tokens = pack_prompt(ids, mask, position.shape[0], pad_id)
    return ((embed(tokens) + position) * (tokens != pad_id).unsqueeze(-1)).flatten(1)


@dataclass
class Noisings:
    """Each batch picture noised K times for a loss on the forward process: times `t [B, K]`, noise `[B, K, C, H, W]`, and
    the rollout policy's velocity there `old_velocity` (None while it is being computed). Rows select like a tensor's."""

    t: torch.Tensor
    noise: torch.Tensor
    old_velocity: torch.Tensor | None

    def __getitem__(self, idx) -> "Noisings":
        return Noisings(self.t[idx], self.noise[idx], None if self.old_velocity is None else self.old_velocity[idx])


def _chains(batch) -> torch.Tensor:
    if batch.actions is None:
        raise AssayError("an image policy's batch has no denoising chains (Batch.actions); it was not sampled by the image sampler")
    return batch.actions


def is_image_policy(folder: Path) -> bool:
    """True when `folder/config.json` describes a `FlowPolicy`."""
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


# -- the SDE -------------------------------------------------------------------------------
def time_grid(steps: int, device: Any = "cpu") -> torch.Tensor:
    """`[steps + 1]` times from 1 (noise) down to 0 (picture), evenly spaced."""
    return torch.linspace(1.0, 0.0, steps + 1, device=device)


def noise_std(t: torch.Tensor, noise_level: float, t_cap: torch.Tensor | float) -> torch.Tensor:
    """σ_t = a·√(t/(1−t)); at t = 1 the denominator takes `t_cap` (the first grid time below 1), as Flow-GRPO does."""
    t = torch.as_tensor(t, device=t.device if torch.is_tensor(t) else "cpu")
    return noise_level * torch.sqrt(t / (1 - torch.where(t >= 1.0, torch.as_tensor(t_cap, dtype=t.dtype, device=t.device), t)))


def sde_step(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor, noise_level: float,
             t_cap: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of `x_{t_next}` given `x_t` and the velocity `v` (shapes `[B, ...]`, times `[B]`)."""
    shape = (-1,) + (1,) * (x.dim() - 1)
    t, dt = t.view(shape), (t_next - t).view(shape)
    sigma = noise_std(t, noise_level, t_cap)
    mean = x * (1 + sigma**2 / (2 * t) * dt) + v * (1 + sigma**2 * (1 - t) / (2 * t)) * dt
    return mean, sigma * torch.sqrt(-dt)


def ddim_step(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor,
              eta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of the DDIM step from `t` to `t_next` < `t` with noise η, written for the straight path.

    DDIM ("Denoising Diffusion Implicit Models", Song et al., ICLR 2021, arXiv:2010.02502) steps from the model's
    estimates of the picture and the noise, here `x̂₀ = x_t − t·v` and `ε̂ = x_t + (1 − t)·v`:

        x_s = (1 − s)·x̂₀ + √(s² − σ²)·ε̂ + σ·z,   σ² = η²·s²·(1 − SNR_t / SNR_s),   SNR_t = (1 − t)² / t²,

    the variance-preserving step of the paper rescaled to `x_t = (1 − t)·x₀ + t·ε` (the signal (1 − t), the noise t). η = 1
    is DDPM's ancestral step ("Denoising Diffusion Probabilistic Models", Ho et al., NeurIPS 2020, arXiv:2006.11239), η = 0
    the ODE step `x_t + v·(s − t)`. DDPO samples with it and trains on its per-step densities ("Training Diffusion Models
    with Reinforcement Learning", Black et al., ICLR 2024, arXiv:2305.13301). At s = 0 the step is deterministic (σ = 0);
    an action's step must end above 0.
    """
    shape = (-1,) + (1,) * (x.dim() - 1)
    t, s = t.view(shape), t_next.view(shape)
    x0, eps = x - t * v, x + (1 - t) * v
    ratio = ((1 - t) * s) ** 2 / ((t * (1 - s)) ** 2)  # SNR_t / SNR_s, in [0, 1) for s < t
    var = (eta**2) * s**2 * (1 - ratio)
    mean = (1 - s) * x0 + torch.sqrt((s**2 - var).clamp(min=0)) * eps
    return mean, torch.sqrt(var)


def step_kernel(sampling: "Sampling", x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor,
                t_cap: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of one stochastic step under `sampling.kernel` (`sde` or `ddim`)."""
    if sampling.kernel == "ddim":
        return ddim_step(x, v, t, t_next, sampling.eta)
    return sde_step(x, v, t, t_next, sampling.noise_level, t_cap)


def gaussian_logprob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """`[B]` log N(x; mean, std²) averaged over every dimension but the first."""
    lp = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.mean(dim=tuple(range(1, lp.dim())))


@torch.no_grad()
def sample_chain(model: FlowPolicy, cond: torch.Tensor, noise: torch.Tensor, steps: int, stochastic: bool,
                 generator: torch.Generator | None = None, sde_steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Denoise `noise [B, C, H, W]` in `steps` steps: the chain `[B, steps+1, C, H, W]` (noise first, picture last) and,
    when `stochastic`, the log-likelihood `[B, sde_steps]` of each of the first `sde_steps` steps (all by default), which
    are stochastic steps of the policy's kernel (`step_kernel`); the rest run the ODE, deterministic, as every step does
    when not `stochastic`.

    The steps' noise is drawn on the CPU from `generator` and moved to the model's device, so a seed gives the same
    pictures on any device's arithmetic.
    """
    grid = time_grid(steps, noise.device)
    B = noise.shape[0]
    sde_steps = steps if sde_steps is None else sde_steps
    x, chain, lps = noise, [noise], []
    for k in range(steps):
        t, t_next = grid[k].expand(B), grid[k + 1].expand(B)
        v = model.velocity(x, t, cond)
        if stochastic and k < sde_steps:
            mean, std = step_kernel(model.sampling, x, v, t, t_next, grid[1])
            eps = torch.randn(x.shape, generator=generator_for(generator, "cpu"), dtype=x.dtype, device="cpu").to(x.device)
            x = mean + std * eps
            lps.append(gaussian_logprob(x, mean, std))
        else:
            x = x + v * (t_next - t).view(-1, 1, 1, 1)
        chain.append(x)
    return torch.stack(chain, 1), (torch.stack(lps, 1) if stochastic else None)


def seeded_noise(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal noise of `shape` from its own CPU stream seeded by `seed` (a greedy picture's starting noise)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=generator_for(gen, "cpu"), device="cpu")


def to_pixels(x: torch.Tensor) -> list:
    """Pictures `[B, C, H, W]` in [−1, 1] → a list of `[H, W, C]` uint8 numpy arrays."""
    arr = ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return list(arr)


def from_pixels(images) -> torch.Tensor:
    """`[H, W, C]` uint8 arrays → `[B, C, H, W]` float pictures in [−1, 1]."""
    import numpy as np

    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def load_image_policy(folder: Path, device: Any = "cpu", dtype: str = "float32") -> tuple[FlowPolicy, Any]:
    """`(model, tokenizer)` of an image policy folder (`config.json` with `model_type: assay-flow`)."""
    from transformers import AutoTokenizer

    if dtype != "float32":
        raise AssayError(f"model.dtype={dtype!r}: the image policy trains in float32 only")
    try:
        tok = AutoTokenizer.from_pretrained(folder)
        model = FlowPolicy.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise AssayError(f"cannot load image policy from {str(folder)!r}: {str(e).splitlines()[0]}") from None
    tok.padding_side = "left"
    return model.to(device), tok


def configure(model: Any, cfg: Any) -> None:
    """Apply a run's `image:` section to an image policy's `sampling`, and refuse in one line what an image policy does not
    do yet (rollouts ahead of the learner, rollout workers on Ray, several learner processes); for a language model, refuse only a loss on the forward
    process (`nft`)."""
    from assay.algos import loss_reads

    forward = loss_reads(cfg.algo.loss) == "forward_process"
    if getattr(model, "policy_kind", "text") != "image":
        if forward:
            raise AssayError(f"algo.loss={cfg.algo.loss}: a loss on the forward process trains a picture generator (docs/images.md); "
                             f"{cfg.model.path} is a language model")
        return
    refused = {"rollout.max_staleness > 0": cfg.rollout.max_staleness > 0,
               "cluster.rollout_workers > 0": bool(cfg.cluster.ray and cfg.cluster.rollout_workers),
               "cluster.learner_workers > 1": bool(cfg.cluster.ray and cfg.cluster.learner_workers > 1),
               "several processes (torchrun)": int(os.environ.get("WORLD_SIZE", "1") or 1) > 1}
    for what, asked in refused.items():
        if asked:
            raise AssayError(f"{what}: an image policy trains in one process on fresh rollouts for now (docs/images.md)")
    if forward:
        unused = {f"algo.mismatch={cfg.algo.mismatch}": cfg.algo.mismatch not in (None, "none"),
                  f"algo.entropy_coef={cfg.algo.entropy_coef}": cfg.algo.entropy_coef > 0}
        for what, asked in unused.items():
            if asked:
                raise AssayError(f"{what} with algo.loss={cfg.algo.loss}: a loss on the forward process reads no step likelihoods, "
                                 f"so it has no importance weights or entropy to use")
    for name in ("steps", "eval_steps", "noise_level", "train_steps", "shared_noise", "kernel", "eta"):
        value = getattr(cfg.image, name)
        if value is not None:
            setattr(model.sampling, name, value)
    check_sampling(model.sampling)


def check_sampling(sampling: Sampling) -> None:
    """One line for a sampling setting no step can take: the `ddim` kernel's last step is deterministic (σ = 0 at t = 0), so
    it cannot be an action."""
    if sampling.kernel not in ("sde", "ddim"):
        raise AssayError(f"image.kernel={sampling.kernel!r}: allowed sde (Flow-GRPO) or ddim (DDPO)")
    if sampling.kernel == "ddim" and sampling.actions >= sampling.steps:
        raise AssayError(f"image.kernel=ddim with {sampling.actions} actions of {sampling.steps} steps: DDIM's last step is "
                         f"deterministic, so at most {sampling.steps - 1} steps can train (image.train_steps)")
