"""Loading policies, and building the project's own tiny models and tokenizer.

assay's bundled models use a character-level tokenizer built with `tokenizers` and a
Qwen2-architecture causal LM from `transformers`, saved in Hugging Face format, so any
Hugging Face causal LM folder can take their place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from assay.errors import AssayError

#: every character the built-in tasks use, plus room for user data in plain ASCII
ALPHABET = "".join(chr(c) for c in range(32, 127))
SPECIAL = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}
BUNDLED_DIR = Path(__file__).parent.parent / "recipes"


def build_char_tokenizer(alphabet: str = ALPHABET):
    """A character-level fast tokenizer: one token per character, plus pad/eos/bos/unk.

    A newline in `alphabet` (the `tiny-steps` recipe's multi-line solutions) is a character like
    any other; without one the split pattern is `.`, as the bundled `tiny-arith` was built with.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL.values())}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n|." if "\n" in alphabet else "."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL, padding_side="left")


def build_tiny_model(tokenizer, hidden: int = 256, layers: int = 4, heads: int = 4, intermediate: int = 1024, seed: int = 0, max_positions: int = 256,
                     arch: str = "qwen2", eos_ids: list[int] | None = None):
    """A randomly initialised causal LM sized for CPU experiments (fp32), tied embeddings.

    Args:
        arch: `qwen2` (the bundled models' architecture) or `llama`.
        eos_ids: the generation config's stop tokens (default: the tokenizer's EOS), for
            example EOS and an end-of-turn token (`assay.models.chat.stop_token_ids`).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kinds = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
    if arch not in kinds:
        raise AssayError(f"unknown tiny-model architecture {arch!r}; known: {', '.join(kinds)}")
    config_cls, model_cls = kinds[arch]
    config = config_cls(
        vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, intermediate_size=intermediate, max_position_embeddings=max_positions,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = model_cls(config).float()
    init_weights(model, seed)
    if eos_ids:
        model.generation_config.eos_token_id = list(eos_ids)
    return model


def init_weights(model, seed: int, std: float = 0.02) -> None:
    """Set every parameter from one seeded generator, in name order: N(0, std²) for matrices and
    embeddings, 1 for norm weights, 0 for biases.

    The same weights for a seed whatever `transformers`' own initialisation does in a given
    release, so a recipe rebuilds the same model after an upgrade.
    """
    import torch

    from assay.devices import generator_for

    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, device="cpu", generator=generator_for(gen, "cpu")) * std)


def resolve_model_path(path: str) -> Path:
    """A folder for `path`: a bundled model name (`tiny-arith`) or a directory on disk."""
    bundled = BUNDLED_DIR / path / "model"
    if "/" not in path and bundled.is_dir():
        return bundled
    p = Path(os.path.expanduser(path))
    if not p.is_dir():
        known = ", ".join(sorted(d.name for d in BUNDLED_DIR.iterdir() if (d / "model").is_dir())) if BUNDLED_DIR.is_dir() else ""
        raise AssayError(f"model path {path!r} is not a directory (bundled models: {known or 'none'})")
    if not (p / "config.json").is_file() and not (p / "adapter_config.json").is_file():
        raise AssayError(f"model path {path!r} has no config.json; expected a Hugging Face model folder (or a LoRA adapter folder)")
    return p


def quiet_hf() -> None:
    """Silence transformers' and the hub's own progress bars and warnings (assay draws its own)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:
        pass


def text_config(model):
    """The config of `model`'s language model: its own, or a vision-language model's `text_config` (context length, vocabulary)."""
    cfg = model.config
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else cfg


def context_length(model) -> int | None:
    """How many positions the policy's language model takes (`max_position_embeddings`), or None when its config does not say."""
    n = getattr(text_config(model), "max_position_embeddings", None)
    return int(n) if n else None


def disable_dropout(model) -> int:
    """Every dropout of `model` to 0 (its `nn.Dropout` modules, and the rates attention layers read at forward time,
    `attention_dropout`); returns how many were not 0. RL scores tokens in training mode: a dropout there would make the
    learner's logprobs differ from the sampler's."""
    import torch

    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p:
            module.p, changed = 0.0, changed + 1
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and rate:
            module.attention_dropout, changed = 0.0, changed + 1
    return changed


def freeze(model, patterns: list[str]) -> None:
    """Stop the parameters whose names match any of `patterns` (`re.search`) from training; one line for a pattern that is
    not a regular expression or matches nothing."""
    import re

    names = [n for n, _ in model.named_parameters()]
    for pattern in patterns:
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise AssayError(f"model.freeze: {pattern!r} is not a regular expression ({e})") from None
        hits = {n for n in names if rx.search(n)}
        if not hits:
            kind = getattr(model.config, "model_type", "the model")
            raise AssayError(f"model.freeze: {pattern!r} matches no parameter of {kind!r}; its names look like {names[0]!r} … {names[-1]!r}")
        for n, p in model.named_parameters():
            if n in hits:
                p.requires_grad_(False)


def save_tokenizer(tokenizer, folder) -> None:
    """Write `tokenizer` to a model folder: with its processor (`tokenizer.processor`, a vision-language model's) when it has one."""
    processor = getattr(tokenizer, "processor", None)
    (processor if processor is not None else tokenizer).save_pretrained(folder)


def read_chat_template(template: str) -> str:
    """A chat template given as a Jinja file or as the template text itself."""
    path = Path(os.path.expanduser(template))
    if path.is_file():
        try:
            return path.read_bytes().decode("utf-8-sig")
        except OSError as e:
            raise AssayError(f"model.chat_template: cannot read {template}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise AssayError(f"model.chat_template: {template} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at byte offset "
                             f"{e.start}); save it as UTF-8") from None
    if "{{" in template or "{%" in template:
        return template
    raise AssayError(f"model.chat_template={template!r} is neither a file nor Jinja template text")


def is_vision_policy(folder: Path) -> bool:
    """True for a Hugging Face folder of a vision-language model (its config has a `vision_config`)."""
    try:
        return "vision_config" in json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def load_vision_policy(folder: Path, device: str = "cpu", dtype: str = "float32", chat_template: str | None = None) -> tuple[Any, Any]:
    """`(model, tokenizer)` of a VLM folder; the tokenizer carries the folder's processor as `tokenizer.processor`."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(folder)
        model = AutoModelForImageTextToText.from_pretrained(folder, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as e:
        raise AssayError(f"cannot load the vision-language model in {str(folder)!r}: {str(e).splitlines()[0]}") from None
    tok = processor.tokenizer
    if chat_template is not None:
        processor.chat_template = read_chat_template(chat_template)
    if getattr(processor, "chat_template", None):
        tok.chat_template = processor.chat_template
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.processor = processor
    model.policy_kind = "vision"
    return model.to(device), tok


def load_policy(path: str, device: str = "cpu", dtype: str = "float32", chat_template: str | None = None) -> tuple[Any, Any]:
    """Load `(model, tokenizer)` from a bundled name or a Hugging Face folder on disk.

    `chat_template` (a Jinja file or text) replaces the tokenizer's own template. A LoRA adapter
    folder (a LoRA run's `final/`) loads as its base model with the adapter merged in.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from assay.devices import check_device
    from assay.models.lora import base_path, is_adapter_folder, merge_adapter

    check_device(device)  # one line for a device this machine lacks, before any weights are read
    folder = resolve_model_path(path)
    quiet_hf()
    from assay.images.flow import is_image_policy

    if is_image_policy(folder):  # a picture generator (docs/images.md): the same loop, another kind of policy
        from assay.images.flow import load_image_policy

        return load_image_policy(folder, device, dtype)
    if is_vision_policy(folder):  # a vision-language model (docs/multimodal.md): prompts may hold pictures
        return load_vision_policy(folder, device, dtype, chat_template)
    if is_adapter_folder(folder):
        return merge_adapter(folder, *load_policy(base_path(folder), device, dtype, chat_template), chat_template)
    try:
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as e:
        raise AssayError(f"cannot load model from {str(folder)!r}: {str(e).splitlines()[0]}") from None
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if chat_template is not None:
        tok.chat_template = read_chat_template(chat_template)
    return model.to(device), tok


def export(src: Path, out: Path, merge: bool) -> Path:
    """A Hugging Face folder at `out` from a model or adapter folder `src`: with `merge`, an adapter folded into its base weights."""
    import shutil

    from assay.models.lora import is_adapter_folder

    src, out = Path(src), Path(out)
    if out.exists() and any(out.iterdir()):
        raise AssayError(f"--out {str(out)!r} exists and is not empty; choose a new folder")
    if not is_adapter_folder(src):
        if merge and not (src / "config.json").is_file():
            raise AssayError(f"{str(src)!r} is neither a model folder nor an adapter folder")
        shutil.copytree(src, out, dirs_exist_ok=True)  # already whole: nothing to merge
        return out
    if not merge:
        shutil.copytree(src, out, dirs_exist_ok=True)
        return out
    quiet_hf()
    model, tok = load_policy(str(src))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    if (src / "README.md").is_file():
        shutil.copy(src / "README.md", out / "README.md")
    return out
