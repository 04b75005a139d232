"""A learned image reward: a small convolutional scorer of (prompt, picture), trained with `assay rm train kind=image`.

`ImageScorer` reads a picture `[3, H, W]` in [−1, 1] through three convolutions, modulates the
middle one by the prompt (FiLM: "FiLM: Visual Reasoning with a General Conditioning Layer",
Perez et al., AAAI 2018, arXiv:1709.07871), and maps the flattened features and the prompt's
vector to one score. The prompt is read as the image policy reads it (word embeddings at fixed
positions, `assay.images.flow.embed_prompt`) with the policy's own tokenizer, so it scores the
prompts the policy is trained on. It trains like a text reward model, Bradley–Terry on
(chosen, rejected) pairs ("Rank Analysis of Incomplete Block Designs", Bradley & Terry, 1952,
as in ImageReward, Xu et al., NeurIPS 2023, arXiv:2304.05977, and PickScore, Kirstain et al.,
NeurIPS 2023, arXiv:2305.01569): the same loop, losses, checkpoints, evaluation and `rm` reward
(docs/reward-models.md), with `ImageEncoder` in place of the text `Encoder`.

A picture in a pair file is any of: a path (relative to the file), a `data:image/png;base64,…`
URI (what `assay rm pairs --task shapes` writes), a `{"bytes": …}` or `{"path": …}` mapping (how
Hugging Face `datasets` stores an `Image` column in Parquet), a PIL image or a `[H, W, 3]` uint8
array. Pictures of another size are resized to the scorer's (bilinear).
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from assay.devices import seeded
from assay.errors import AssayError
from assay.images.flow import embed_prompt

MODEL_TYPE = "assay-image-rm"
WEIGHTS = "model.safetensors"


@dataclass
class ScorerConfig:
    """The scorer's shape: picture size, convolution widths, prompt encoder size."""

    vocab_size: int
    sample_size: int = 16
    channels: int = 3
    widths: tuple[int, ...] = (32, 64, 64)
    text_dim: int = 32
    hidden: int = 128
    max_prompt_tokens: int = 8
    pad_token_id: int = 0
    model_type: str = MODEL_TYPE
    architectures: tuple[str, ...] = ("ImageScorer",)
    num_labels: int = 1

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["widths"], out["architectures"] = list(self.widths), list(self.architectures)
        return out


@dataclass
class ScorerOutput:
    """What a forward returns, as a Hugging Face sequence classifier does: `logits` `[M, 1]`."""

    logits: torch.Tensor


class ImageScorer(nn.Module):
    """(prompt token ids, picture) → one score; `forward(input_ids, attention_mask, pixel_values)` as `AutoModelForSequenceClassification`."""

    def __init__(self, config: ScorerConfig):
        super().__init__()
        self.config = config
        w1, w2, w3 = config.widths
        self.embed = nn.Embedding(config.vocab_size, config.text_dim, padding_idx=config.pad_token_id)
        self.position = nn.Parameter(torch.zeros(config.max_prompt_tokens, config.text_dim, device="cpu"))
        self.text = nn.Sequential(nn.Linear(config.max_prompt_tokens * config.text_dim, config.hidden), nn.SiLU())
        self.film = nn.Linear(config.hidden, 2 * w2)  # scale and shift of the middle features
        self.conv1 = nn.Conv2d(config.channels, w1, 3, padding=1)
        self.conv2 = nn.Conv2d(w1, w2, 3, stride=2, padding=1)
        self.conv3 = nn.Conv2d(w2, w3, 3, stride=2, padding=1)
        side = -(-(-(-config.sample_size // 2)) // 2)  # two stride-2 convolutions
        self.head = nn.Sequential(nn.Linear(w3 * side * side + config.hidden, config.hidden), nn.SiLU(), nn.Linear(config.hidden, 1))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixel_values: torch.Tensor) -> ScorerOutput:
        text = self.text(embed_prompt(self.embed, self.position, input_ids, attention_mask, self.config.pad_token_id))  # [M, hidden]
        scale, shift = self.film(text).chunk(2, dim=-1)
        x = nn.functional.silu(self.conv1(pixel_values))
        x = nn.functional.silu(self.conv2(x) * (1 + scale[:, :, None, None]) + shift[:, :, None, None])
        x = nn.functional.silu(self.conv3(x))
        return ScorerOutput(self.head(torch.cat([x.flatten(1), text], dim=-1)))

    def save_pretrained(self, folder: str | Path, **_: Any) -> None:
        """`config.json` and `model.safetensors`, as a Hugging Face folder."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, folder / WEIGHTS)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "ImageScorer":
        from safetensors.torch import load_file

        folder = Path(folder)
        raw = json.loads((folder / "config.json").read_text())
        known = {k: v for k, v in raw.items() if k in ScorerConfig.__dataclass_fields__}
        known["widths"], known["architectures"] = tuple(known.get("widths", (32, 64, 64))), tuple(known.get("architectures", ("ImageScorer",)))
        model = cls(ScorerConfig(**known))
        model.load_state_dict(load_file(folder / WEIGHTS))
        return model.eval()


def is_image_rm(folder: str | Path) -> bool:
    """True when `folder/config.json` describes an `ImageScorer`."""
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def build_scorer(policy: str, seed: int = 0, device: str = "cpu") -> tuple[ImageScorer, Any]:
    """`(scorer, tokenizer)`: a new scorer, its weights drawn from `seed` (the run's RNG left alone), reading prompts with the
    tokenizer of the image policy `policy` (a bundled name such as `tiny-shapes`, or its folder) at that policy's picture size."""
    from transformers import AutoTokenizer

    from assay.images.flow import is_image_policy
    from assay.models import quiet_hf, resolve_model_path

    folder = resolve_model_path(policy)
    if not is_image_policy(folder):
        raise AssayError(f"model={policy!r}: kind=image builds its scorer on an image policy's tokenizer and picture size "
                         "(for example model=tiny-shapes); this folder holds no image policy")
    quiet_hf()
    policy_cfg = json.loads((folder / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(folder)
    cfg = ScorerConfig(vocab_size=int(policy_cfg["vocab_size"]), sample_size=int(policy_cfg.get("sample_size", 16)),
                       channels=int(policy_cfg.get("channels", 3)), max_prompt_tokens=int(policy_cfg.get("max_prompt_tokens", 8)),
                       pad_token_id=int(policy_cfg.get("pad_token_id", 0)))
    with seeded(seed):
        model = ImageScorer(cfg)
    return model.to(device), tok


def load_scorer(folder: Path, device: str = "cpu") -> tuple[ImageScorer, Any]:
    from transformers import AutoTokenizer

    from assay.models import quiet_hf

    quiet_hf()
    try:
        return ImageScorer.from_pretrained(folder).to(device).eval(), AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise AssayError(f"cannot load image reward model from {str(folder)!r}: {str(e).splitlines()[0]}") from None


# -- pictures ---------------------------------------------------------------------------------
def to_data_uri(image: np.ndarray) -> str:
    """A `[H, W, 3]` uint8 picture as a `data:image/png;base64,…` URI (lossless)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(image, dtype=np.uint8)).save(buf, format="PNG", optimize=False)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def decode_image(value: Any, size: int | None = None, base: Path | None = None, where: str = "picture") -> np.ndarray:
    """A picture in any form the module doc lists → `[size, size, 3]` uint8 (its own size when `size` is None).

    Anything else, or bytes that are not a picture, is one `AssayError` naming `where`."""
    from PIL import Image, UnidentifiedImageError

    try:
        if isinstance(value, np.ndarray):
            img = Image.fromarray(value.astype(np.uint8) if value.dtype != np.uint8 else value)
        elif isinstance(value, Image.Image):
            img = value
        elif isinstance(value, dict) and value.get("bytes") is not None:
            img = Image.open(io.BytesIO(value["bytes"]))
        elif isinstance(value, dict) and value.get("path"):
            img = Image.open(Path(base or ".") / value["path"])
        elif isinstance(value, str) and value.startswith("data:image/"):
            img = Image.open(io.BytesIO(base64.b64decode(value.split(",", 1)[1], validate=True)))
        elif isinstance(value, str) and value:
            img = Image.open(Path(base or ".") / value)
        else:
            raise AssayError(f"{where}: expected a picture (a path, a data:image URI, a {{bytes}} or {{path}} mapping), got {str(value)[:60]!r}")
        img = img.convert("RGB")
    except AssayError:
        raise
    except (OSError, ValueError, UnidentifiedImageError, TypeError) as e:
        raise AssayError(f"{where}: not a readable picture ({str(e).splitlines()[0][:120]})") from None
    if size is not None and img.size != (size, size):
        img = img.resize((size, size), Image.BILINEAR)
    out = np.asarray(img, dtype=np.uint8)
    if out.ndim != 3 or out.shape[2] != 3:
        raise AssayError(f"{where}: expected an RGB picture, got shape {out.shape}")
    return out


def decode_comparisons(comparisons: list, size: int, source: str) -> list:
    """The comparisons of a pair file with every chosen and rejected picture decoded (paths read relative to the file)."""
    base = Path(source).parent if Path(source).is_file() else Path(source)
    for i, c in enumerate(comparisons, 1):  # as read, before any split: i is the row's place in the file
        c.chosen = [decode_image(v, size, base, f"{source}: row {i}, chosen") for v in c.chosen]
        c.rejected = [decode_image(v, size, base, f"{source}: row {i}, rejected") for v in c.rejected]
    return comparisons


class ImageEncoder:
    """Model inputs of (prompt, picture) items: prompt token ids (left-padded) and pictures in [−1, 1]; the image
    counterpart of `assay.rm.model.Encoder` (responses have no length: the length term is zero)."""

    modality = "image"  # what a response is: the `rm` reward hands it a trajectory's picture

    def __init__(self, tokenizer, max_length: int = 8, size: int = 16):
        self.tok, self.max_length, self.size = tokenizer, max_length, size
        self._ids: dict[str, list[int]] = {}

    def _prompt(self, prompt: Any) -> list[int]:
        if not isinstance(prompt, str):
            raise AssayError(f"an image reward model reads text prompts, got {type(prompt).__name__}")
        if prompt not in self._ids:
            ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
            if len(ids) > self.max_length:
                raise AssayError(f"prompt {prompt[:40]!r} has {len(ids)} tokens; this image reward model reads at most {self.max_length}")
            self._ids[prompt] = ids
        return self._ids[prompt]

    def inputs(self, items: list[tuple[Any, Any]], device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """`({input_ids, attention_mask, pixel_values}, lengths)` of `(prompt, picture)` items; lengths are zeros."""
        from assay.images.flow import from_pixels

        rows = [self._prompt(p) for p, _ in items]
        width = max([len(r) for r in rows] + [1])
        pad = self.tok.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long, device="cpu")
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device="cpu")
        pixels = from_pixels([decode_image(img, self.size, where="picture") if not _ready(img, self.size) else img for _, img in items])
        inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device), "pixel_values": pixels.to(device)}
        return inputs, torch.zeros(len(items), dtype=torch.long, device=device)


def _ready(img: Any, size: int) -> bool:
    return isinstance(img, np.ndarray) and img.dtype == np.uint8 and img.shape == (size, size, 3)
