"""Image content parts: reading them from data, encoding them with the model's processor, carrying them to the learner.

A prompt with pictures is a conversation whose messages' `content` is a list of parts,
`{"type": "text", "text": ...}` and `{"type": "image", "image": ...}` (the layout of Hugging
Face chat templates, TRL and verl). `resolve_images` reads each part's picture when data is
loaded — a path (relative to the data file), bytes, a `datasets` `Image` cell
(`{"bytes", "path"}`), a `data:` URL or a Pillow image — into an RGB Pillow image, so a bad
picture is one line naming its row before anything runs; a part with no picture takes the
next one from the row's `images` column (TRL's layout).

`encode_sample` is the one place a prompt with pictures becomes token ids: the tokenizer's
processor (`tokenizer.processor`, `assay.vision.model`) renders the conversation, expands
each `<image>` into the model's image tokens and turns the pictures into `pixel_values`.
Those image tokens are prompt tokens, so they count against the prompt-length limit and
never enter the loss. A trajectory carries its prompt's processor outputs as numpy arrays
in `info["vision"]`; `collate` gathers them into `Batch.vision` (`VisionInputs`), whose
`kwargs()` the learner passes to the model's forward.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
from pathlib import Path
from typing import Any

from assay.errors import AssayError
from assay.types import Sample

#: a picture of more pixels than this is refused when data is read (Pillow's own bomb guard is 89M)
MAX_PIXELS = 4096 * 4096
#: processor outputs that are token-level (the sampler and the learner build their own)
TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def image_parts(prompt: Any) -> list[dict[str, Any]]:
    """The `{"type": "image"}` content parts of a conversation, in order (none for plain text)."""
    if not isinstance(prompt, list):
        return []
    return [p for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and p.get("type") == "image"]


def has_images(sample: Sample) -> bool:
    return bool(image_parts(sample.prompt))


def _open(data: bytes, where: str):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_PIXELS:
            raise AssayError(f"{where}: the picture is {img.width}×{img.height}, larger than {MAX_PIXELS:,} pixels")
        return img.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise AssayError(f"{where}: not a readable picture ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None


def load_image(value: Any, where: str, base: Path | None = None):
    """An RGB Pillow image from a path, bytes, a `datasets` Image cell, a `data:` URL or a Pillow image; one line for anything else."""
    from PIL import Image

    if isinstance(value, Image.Image):
        if value.width * value.height > MAX_PIXELS:
            raise AssayError(f"{where}: the picture is {value.width}×{value.height}, larger than {MAX_PIXELS:,} pixels")
        return value.convert("RGB")
    if isinstance(value, (bytes, bytearray)):
        return _open(bytes(value), where)
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # a `datasets` Image cell as Parquet stores it
        return load_image(value["bytes"] if value.get("bytes") else value.get("path"), where, base)
    if isinstance(value, str):
        if value.startswith("data:"):
            try:
                return _open(base64.b64decode(value.split(",", 1)[1]), where)
            except (IndexError, ValueError):
                raise AssayError(f"{where}: a data: URL that is not base64 picture data") from None
        if value.startswith(("http://", "https://")):
            raise AssayError(f"{where}: picture {value[:80]!r} is a URL; assay reads pictures from disk only (download it and give its path)")
        path = Path(value).expanduser()
        if not path.is_absolute() and base is not None:
            path = base / path
        try:
            return _open(path.read_bytes(), f"{where} ({value})")
        except OSError as e:
            raise AssayError(f"{where}: cannot read picture {value!r}: {e.strerror}") from None
    raise AssayError(f"{where}: an image part holds {type(value).__name__}; allowed: a path, bytes, a data: URL, "
                     "a datasets Image cell or a Pillow image")


def resolve_images(samples: list[Sample], base: Path | None, source: str) -> list[Sample]:
    """`samples` with every image part's picture read (see the module docstring); rows without pictures unchanged."""
    out = []
    for s in samples:
        spare = s.fields.get("images")
        spare = list(spare) if isinstance(spare, (list, tuple)) else [spare] if spare is not None else []
        if not isinstance(s.prompt, list) or not (image_parts(s.prompt) or spare):
            out.append(s)
            continue
        where = f"{source}: row id {s.id!r}"
        messages, n = [], 0
        for m in s.prompt:
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for p in content:
                    if isinstance(p, dict) and p.get("type") == "image":
                        value = next((p[k] for k in ("image", "path", "url") if p.get(k) is not None), None)
                        if value is None:
                            if n >= len(spare):
                                raise AssayError(f"{where}: image part {n + 1} has no picture and the row's images column has "
                                                 f"{len(spare)} (give the part an image, or the row an images list)")
                            value = spare[n]
                        p = {"type": "image", "image": load_image(value, f"{where}, image {n + 1}", base)}
                        n += 1
                    parts.append(p)
                m = {**m, "content": parts}
            messages.append(m)
        if not n:
            raise AssayError(f"{where}: the row has an images column but no {{\"type\": \"image\"}} content part to put them in")
        fields = {k: v for k, v in s.fields.items() if k != "images"}
        out.append(dataclasses.replace(s, prompt=messages, fields=fields))
    return out


def picture_key(img) -> str:
    """A short stable name of a picture's pixels: `<image W×H sha1:…>`."""
    digest = hashlib.sha1(img.tobytes()).hexdigest()[:12]
    return f"<image {img.width}x{img.height} {digest}>"


def data_url(img) -> str:
    """A Pillow image as a `data:image/png;base64,…` URL (how OpenAI-compatible servers take a picture inline)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def jsonable(prompt: Any) -> Any:
    """`prompt` with each picture replaced by `picture_key` (for logs, sample files and prompt keys)."""
    if not image_parts(prompt):
        return prompt
    from PIL import Image

    return [{**m, "content": [{**p, "image": picture_key(p["image"]) if isinstance(p.get("image"), Image.Image) else str(p.get("image"))[:80]}
                              if isinstance(p, dict) and p.get("type") == "image" else p for p in m["content"]]}
            if isinstance(m.get("content"), list) else m for m in prompt]


def placeholder_ids(model: Any) -> tuple[int, ...]:
    """The token ids a vision-language model's forward replaces with picture features (none for a text LM).

    They are prompt tokens only: every sampler masks them out of the distribution it samples from and the
    learner masks them alike, so the policy never writes one (a sampled `<image>` would make the learner's
    forward look for a picture that is not there) and all three compute the same logprobs.
    """
    cfg = getattr(model, "config", None)
    ids = (getattr(cfg, "image_token_index", None), getattr(cfg, "image_token_id", None))
    return tuple(sorted({int(i) for i in ids if isinstance(i, int)}))


def processor_of(tokenizer: Any, sid: str = "?"):
    processor = getattr(tokenizer, "processor", None)
    if processor is None:
        raise AssayError(f"prompt id {sid!r} has pictures but the policy is a language model without an image processor; "
                         "give a vision-language model (model.path=tiny-count, or a Hugging Face VLM folder)")
    return processor


def encode_sample(tokenizer: Any, sample: Sample) -> tuple[list[int], dict[str, Any] | None]:
    """`(prompt ids [P], processor outputs or None)` of a prompt with pictures, through the tokenizer's processor.

    The outputs are numpy arrays by name (`pixel_values`, and `image_sizes` or `image_grid_thw` where the
    processor makes them), each with the prompt's pictures along its first axis.
    """
    messages = sample.prompt
    prefill = bool(messages) and messages[-1].get("role") == "assistant"
    return render_pictures(tokenizer, messages, not prefill, sample.template_args or {}, sample.id, continue_final=prefill)


def render_pictures(tokenizer: Any, messages: list[dict[str, Any]], generation: bool, template_args: dict[str, Any],
                    sid: str = "?", continue_final: bool = False) -> tuple[list[int], dict[str, Any]]:
    """`(ids, processor outputs)` of a conversation with pictures through the tokenizer's processor: with the generation
    prompt, or continuing the final assistant message (`continue_final`), or as the conversation stands."""
    processor = processor_of(tokenizer, sid)
    prefill = continue_final
    try:
        out = processor.apply_chat_template(messages, add_generation_prompt=generation, continue_final_message=prefill, tokenize=True,
                                            return_dict=True, return_tensors="np", **template_args)
    except AssayError:
        raise
    except Exception as e:
        raise AssayError(f"prompt id {sid!r}: the processor failed on this conversation: {type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
    ids = [int(i) for i in out["input_ids"][0]]
    return ids, {k: v for k, v in out.items() if k not in TOKEN_KEYS}


class VisionInputs:
    """Each row's processor outputs (`info["vision"]`), on the learner's device; rows without pictures hold None.

    Indexing with row indices selects rows (as `Batch.select` does with every field);
    `kwargs()` is what the model's forward takes for the rows, each output concatenated
    along its first axis in row order, the order of the image tokens in the batch.
    """

    def __init__(self, rows: list[dict[str, Any] | None]):
        self.rows = rows

    @classmethod
    def collate(cls, rows: list[dict[str, Any] | None], device) -> "VisionInputs":
        import torch

        return cls([None if r is None else {k: torch.as_tensor(v, device=device) for k, v in r.items()} for r in rows])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx) -> "VisionInputs":
        import torch

        order = idx.tolist() if torch.is_tensor(idx) else list(range(len(self.rows)))[idx] if isinstance(idx, slice) else list(idx)
        return VisionInputs([self.rows[i] for i in order])

    def kwargs(self) -> dict[str, Any]:
        """Each processor output of the rows with pictures, concatenated along the first axis. Where rows differ in a
        later axis (Idefics3's `[1, pictures, 3, H, W]` for prompts with different numbers of pictures), each is
        zero-padded to the largest first, which is how such processors pad a batch themselves."""
        present = [r for r in self.rows if r is not None]
        return {k: _cat_padded([r[k] for r in present]) for k in present[0]} if present else {}


def _cat_padded(tensors: list):
    import torch
    import torch.nn.functional as F

    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for t in tensors:
        pad = [x for d in reversed(range(1, t.dim())) for x in (0, shape[d - 1] - t.shape[d])]
        padded.append(F.pad(t, pad) if any(pad) else t)
    return torch.cat(padded)


def _map_pictures(samples: list[Sample], pick) -> list[Sample]:
    """`samples` with image part j of row i replaced by the part `pick(i, j, part)` returns."""
    out = []
    for i, s in enumerate(samples):
        if not has_images(s):
            out.append(s)
            continue
        j = 0
        messages = []
        for m in s.prompt:
            if isinstance(m.get("content"), list):
                parts = []
                for p in m["content"]:
                    if isinstance(p, dict) and p.get("type") == "image":
                        p = pick(i, j, p)
                        j += 1
                    parts.append(p)
                m = {**m, "content": parts}
            messages.append(m)
        out.append(dataclasses.replace(s, prompt=messages))
    return out


def blank_pictures(samples: list[Sample]) -> list[Sample]:
    """Every picture replaced by a black one of its size: what a policy answers when it cannot see."""
    from PIL import Image

    return _map_pictures(samples, lambda i, j, p: {**p, "image": Image.new("RGB", p["image"].size)})


def shuffle_pictures(samples: list[Sample]) -> list[Sample]:
    """Each row's pictures taken from the next row that has pictures (the last row's from the first): the same questions,
    someone else's pictures. A policy that answers these as well as the real ones does not use the pictures."""
    rows = [i for i, s in enumerate(samples) if has_images(s)]
    if len(rows) < 2:
        return samples
    donor = {i: samples[rows[(k + 1) % len(rows)]] for k, i in enumerate(rows)}
    pictures = {i: [p["image"] for p in image_parts(d.prompt)] for i, d in donor.items()}
    return _map_pictures(samples, lambda i, j, p: {**p, "image": pictures[i][j % len(pictures[i])]})


def describe_pictures(samples: list[Sample]) -> list[Sample]:
    """Each picture replaced by a text part with the row's description of it (its `image_description` column: one text, or
    one per picture): the text-only baseline. A row with pictures and no description is one line naming it."""
    said: dict[int, list[str]] = {}
    for i, s in enumerate(samples):
        if has_images(s):
            text = s.fields.get("image_description")
            text = [text] if isinstance(text, str) else text
            if not isinstance(text, list) or not text or not all(isinstance(x, str) for x in text):
                raise AssayError(f"row id {s.id!r}: --images describe needs an image_description column (a text, or one per picture)")
            said[i] = text
    return _map_pictures(samples, lambda i, j, p: {"type": "text", "text": said[i][min(j, len(said[i]) - 1)]})


#: `assay eval --images` and the trainer's held-out check: what becomes of the pictures
PICTURE_CONTROLS = {"keep": lambda samples: samples, "blank": blank_pictures, "shuffle": shuffle_pictures, "describe": describe_pictures}
