"""LoRA adapters on the policy, through `peft` (`model.lora`; the `lora` extra).

Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (2021), arXiv:2106.09685: a
linear layer computes W·x + s·B·A·x with W frozen, A `[r, in]`, B `[out, r]` and s = alpha/r;
only A and B train (B starts at 0, so training starts from the base model).

`peft` puts its layers in place inside the model (`q_proj` becomes a `lora.Linear` around
the original `base_layer`), so the model's own forward applies them. assay's fast paths do
not call those modules: they read weights and fuse them (`assay.models.llama`'s forward,
`assay.rollout.decoder.StaticDecoder`). They read every projection through `weight_of`, which
gives the effective weight W + s·B·A (differentiable in A and B), so a LoRA delta is never
ignored; `unsupported` names what they cannot fold (DoRA and the other variants, a bias on B,
fan-in-fan-out layouts, and adapter dropout while training), and those models take the
model's own forward instead. `tests/test_lora.py` fails if either path drops a delta.

The reference policy of a KL term is the same model with its adapters switched off
(`AdapterOff`), not a second copy. A run's checkpoints and `final/` hold the adapter
(`adapter_config.json`, `adapter_model.safetensors`); `assay.models.load_policy` reads one
back merged into its base model, and `assay.models.export` writes a merged Hugging Face folder.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from assay.devices import seeded
from assay.errors import AssayError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def require_peft():
    """The `peft` module, or one line saying how to install it."""
    try:
        import peft
    except ImportError:
        raise AssayError("model.lora needs peft, which is not installed: pip install 'assay[lora]' (scripts/setup.sh installs it)") from None
    return peft


def apply_lora(model, settings, base: str | None = None, task: str | None = "CAUSAL_LM", seed: int = 0) -> tuple[Any, Any]:
    """Put adapters on `model` (`assay.config.LoraSettings`); returns `(model, peft_model)`.

    `model` is the same object with `peft`'s layers in place (what the sampler and the learner
    run; only the adapters require grad); `peft_model` wraps it for saving and for switching
    the adapters off. `base`: the folder the base model came from, written into the saved
    adapter's config (an absolute path, so `assay eval --model RUN/final` finds it from anywhere).
    `task="SEQ_CLS"` (a reward model): peft also trains the score head whole, beside the adapters. A model that is no
    Hugging Face task model says so itself: `peft_task` (None: no task head) replaces `task`, and `lora_targets` replaces
    the Llama-family default of `target_modules` (an image policy: its UNet's convolutions, `assay.images.flow`).
    A's initial values are drawn from `seed` (the global random streams are left as they were).
    """
    peft = require_peft()
    task = getattr(model, "peft_task", task)
    own = getattr(model, "lora_targets", None)
    if own is not None and settings.target_modules == type(settings).model_fields["target_modules"].default_factory():
        settings = settings.model_copy(update={"target_modules": list(own)})
    config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=settings.target_modules, bias="none", task_type=task)
    try:
        with warnings.catch_warnings(), seeded(seed, next(model.parameters()).device):  # peft draws A from torch's global stream
            warnings.simplefilter("ignore", FutureWarning)  # peft reads a transformers attribute that warns it is deprecated
            wrapped = peft.get_peft_model(model, config)
    except ValueError as e:  # no module matched target_modules, or one peft cannot adapt
        raise AssayError(f"model.lora.target_modules={settings.target_modules!r}: {str(e).splitlines()[0]}") from None
    if base is not None:
        wrapped.peft_config["default"].base_model_name_or_path = base
    return wrapped.get_base_model(), wrapped


def load_adapter(peft_model, folder: Path) -> None:
    """Put the adapter weights saved in `folder` (a checkpoint of a LoRA run) into `peft_model`."""
    from safetensors.torch import load_file

    peft = require_peft()
    result = peft.set_peft_model_state_dict(peft_model, load_file(Path(folder) / ADAPTER_WEIGHTS))
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if missing:
        raise AssayError(f"{folder}: the saved adapter lacks {len(missing)} of this run's adapter weights (first: {missing[0]})")


def is_lora_layer(module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def _live_adapters(linear) -> list[str]:
    """The adapters a LoRA layer applies now (none when disabled, or merged into the base weight)."""
    if linear.disable_adapters or linear.merged:
        return []
    return [a for a in linear.active_adapters if a in linear.lora_A]


def weight_of(linear) -> torch.Tensor:
    """The weight `linear` applies: its own, or for a `peft` LoRA layer W + Σ s·B·A over its live adapters `[out, in]`."""
    base = getattr(linear, "base_layer", None)
    if base is None or not is_lora_layer(linear):
        return linear.weight
    w = base.weight
    for a in _live_adapters(linear):  # peft keeps adapters in fp32 over a bf16 base: the sum takes the base's dtype
        w = w + ((linear.lora_B[a].weight @ linear.lora_A[a].weight) * linear.scaling[a]).to(w.dtype)
    return w


def bias_of(linear) -> torch.Tensor | None:
    """The bias `linear` applies (a LoRA layer's is its base layer's)."""
    return getattr(linear, "base_layer", linear).bias if is_lora_layer(linear) else linear.bias


def unsupported(model, training: bool = False) -> str | None:
    """Why assay's fused forward cannot fold `model`'s adapters into its weights, or None (also None without adapters)."""
    for name, m in model.named_modules():
        if not is_lora_layer(m) or name.endswith(("embed_tokens", "lm_head")):  # called as modules by the fast paths
            continue
        for a in _live_adapters(m):
            if getattr(m, "lora_variant", {}).get(a) is not None or getattr(m, "use_dora", {}).get(a):
                return f"a LoRA variant (DoRA or another) on {name}"
            if getattr(m, "fan_in_fan_out", False) or m.lora_B[a].bias is not None:
                return f"a LoRA layout assay does not fold ({name})"
            if training and m.training and not isinstance(m.lora_dropout[a], torch.nn.Identity):
                return "LoRA dropout while training"
    return None


def merged_weights(model, skip: tuple[str, ...] = ()) -> list[tuple[str, torch.Tensor]]:
    """`model`'s parameters under their Hugging Face names, every name (tied ones too), what an inference engine loads:
    a LoRA layer's as its effective weight W + Σ s·B·A (peft's own delta: linear and embedding layers), its A and B left
    out. Without adapters: exactly `named_parameters(remove_duplicate=False)`. `skip`: name prefixes left out."""
    layers = {name: m for name, m in model.named_modules() if is_lora_layer(m)}
    out = []
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if skip and name.startswith(skip):
                continue
            owner, _, rest = name.rpartition(".base_layer.")
            if owner in layers and rest in ("weight", "bias"):
                if rest == "weight":
                    for a in _live_all(layers[owner]):
                        p = p + layers[owner].get_delta_weight(a)
                out.append((f"{owner}.{rest}", p.detach()))
            elif not any(f".{part}" in name for part in ("lora_", "base_layer.")):
                out.append((name, p.detach()))
    return out


def _live_all(layer) -> list[str]:
    """The adapters a LoRA layer of any kind (linear or embedding) applies now."""
    if layer.disable_adapters or layer.merged:
        return []
    names = {*layer.lora_A, *getattr(layer, "lora_embedding_A", {})}
    return [a for a in layer.active_adapters if a in names]


def has_adapters(model) -> bool:
    return any(is_lora_layer(m) for m in model.modules())


class AdapterOff:
    """The policy with its adapters switched off: the KL reference, with no second copy of the weights.

    `assay.models.logprobs.token_logprobs` takes it wherever it takes a model.
    """

    def __init__(self, peft_model):
        self.peft = peft_model

    @contextlib.contextmanager
    def model(self) -> Iterator[Any]:
        """The underlying model, its adapters off while inside."""
        with self.peft.disable_adapter():
            yield self.peft.get_base_model()


def base_path(folder: Path) -> str:
    """The base model an adapter folder was trained on (`base_model_name_or_path` of its config)."""
    try:
        config = json.loads((Path(folder) / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise AssayError(f"{folder}: cannot read {ADAPTER_CONFIG}: {e}") from None
    base = config.get("base_model_name_or_path")
    if not base:
        raise AssayError(f"{folder}/{ADAPTER_CONFIG} names no base model (base_model_name_or_path)")
    if not Path(base).is_dir() and "/" in base:
        raise AssayError(f"{folder}: its base model {base!r} is not on this machine; copy it there, or edit "
                         f"base_model_name_or_path in {ADAPTER_CONFIG}")
    return base


def is_adapter_folder(folder: Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file() and not (Path(folder) / "config.json").is_file()


def merge_adapter(folder: Path, model, tok, chat_template: str | None = None) -> tuple[Any, Any]:
    """`(model, tokenizer)`: the adapter of `folder` (a LoRA run's `final/`) merged into `model`, its base loaded
    from `base_model_name_or_path`; the tokenizer the adapter folder's own where the run saved one there, else `tok`."""
    from transformers import AutoTokenizer

    peft = require_peft()
    with warnings.catch_warnings():  # peft reads a transformers attribute that warns it is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        model = peft.PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    if hasattr(model, "read_adapter_files"):  # an image policy's sampling settings, saved beside its adapter
        model.read_adapter_files(folder)
    try:
        own = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):
        return model, tok
    own.padding_side = "left"
    if own.pad_token_id is None:
        own.pad_token = own.eos_token
    if chat_template is not None:
        own.chat_template = tok.chat_template
    return model, own
