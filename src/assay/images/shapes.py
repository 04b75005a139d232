"""The bundled image task: "2 red 1 blue" → a 16×16 picture with two red blocks and one blue one.

Pictures are drawn with Pillow on a black canvas: each block a 3×3 square of one palette
colour, never touching another block, so a right picture has exactly one 4-connected
component per block. The checker (`read_counts`, `ShapeCount`) reads a picture back the way
the math verifier reads an answer: every pixel goes to its nearest palette colour (or to
nothing when it is near none), components of one colour are found by flood fill, and
components of at least `MIN_PIXELS` pixels are counted. A picture is right when the count
of every colour equals the prompt's (colours the prompt does not name: zero). The task and its
rewards (`shapes`, `image_contrast`) are in `assay.data.tasks.shapes`.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from assay.types import Sample

#: colour name → RGB
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 200, 60), "blue": (60, 90, 240), "yellow": (235, 215, 40), "white": (235, 235, 235),
}
SIZE = 16  # pixels a side
BLOCK = 3  # pixels a side of one block
#: a component of fewer pixels is noise, not a block
MIN_PIXELS = 3
#: a pixel farther than this (Euclidean, RGB) from every palette colour and from black belongs to none
MAX_DISTANCE = 110.0


def parse_prompt(prompt: str) -> dict[str, int]:
    """`"2 red 1 blue"` → `{"red": 2, "blue": 1}`; ValueError for anything else."""
    words = prompt.split()
    if not words or len(words) % 2:
        raise ValueError(f"expected 'COUNT COLOUR [COUNT COLOUR]', got {prompt!r}")
    counts: dict[str, int] = {}
    for n, colour in zip(words[::2], words[1::2]):
        if colour not in PALETTE or colour in counts or not n.isdigit():
            raise ValueError(f"expected 'COUNT COLOUR [COUNT COLOUR]' with colours from {', '.join(PALETTE)}, got {prompt!r}")
        counts[colour] = int(n)
    return counts


def draw(counts: dict[str, int], rng: random.Random) -> np.ndarray:
    """A `[SIZE, SIZE, 3]` uint8 picture with `counts[colour]` blocks of each colour, none touching another."""
    from PIL import Image, ImageDraw

    spots = _layout(sum(counts.values()), rng)
    img = Image.new("RGB", (SIZE, SIZE))
    pen = ImageDraw.Draw(img)
    colours = [c for c, n in counts.items() for _ in range(n)]
    for colour, (x, y) in zip(colours, spots):
        pen.rectangle([x, y, x + BLOCK - 1, y + BLOCK - 1], fill=PALETTE[colour])
    return np.asarray(img, dtype=np.uint8).copy()


def _layout(n: int, rng: random.Random, tries: int = 200) -> list[tuple[int, int]]:
    """Top-left corners of `n` blocks a pixel apart at least: random places, a fresh layout when one gets stuck."""
    for _ in range(tries):
        taken: list[tuple[int, int]] = []
        for _ in range(n):
            for _ in range(100):
                x, y = rng.randint(0, SIZE - BLOCK), rng.randint(0, SIZE - BLOCK)
                if all(abs(x - a) > BLOCK or abs(y - b) > BLOCK for a, b in taken):
                    taken.append((x, y))
                    break
            else:
                break
        if len(taken) == n:
            return taken
    raise ValueError(f"cannot place {n} blocks on a {SIZE}x{SIZE} canvas")


def classify(image: np.ndarray) -> np.ndarray:
    """`[H, W]` palette index per pixel: 0 black, 1.. the palette's colours in order, -1 near none."""
    refs = np.array([(0, 0, 0), *PALETTE.values()], dtype=np.float32)  # [C+1, 3]
    d = np.linalg.norm(image.astype(np.float32)[:, :, None, :] - refs[None, None], axis=-1)  # [H, W, C+1]
    label = d.argmin(-1)
    label[d.min(-1) > MAX_DISTANCE] = -1
    return label


def components(mask: np.ndarray) -> list[int]:
    """Sizes of the 4-connected components of a boolean `[H, W]` mask."""
    seen = np.zeros_like(mask, dtype=bool)
    H, W = mask.shape
    sizes = []
    for i in range(H):
        for j in range(W):
            if not mask[i, j] or seen[i, j]:
                continue
            stack, size = [(i, j)], 0
            seen[i, j] = True
            while stack:
                a, b = stack.pop()
                size += 1
                for c, d in ((a + 1, b), (a - 1, b), (a, b + 1), (a, b - 1)):
                    if 0 <= c < H and 0 <= d < W and mask[c, d] and not seen[c, d]:
                        seen[c, d] = True
                        stack.append((c, d))
            sizes.append(size)
    return sizes


def read_counts(image: np.ndarray) -> dict[str, int]:
    """How many blocks of each palette colour `image` `[H, W, 3]` (uint8) shows."""
    label = classify(image)
    return {name: sum(s >= MIN_PIXELS for s in components(label == k + 1)) for k, name in enumerate(PALETTE)}


def is_right(sample: Sample, image: np.ndarray) -> bool | None:
    """Whether `image` shows what `sample`'s prompt asks for; None when the prompt is not one the checker reads."""
    try:
        want = parse_prompt(str(sample.answer or sample.prompt))
    except ValueError:
        return None
    got = read_counts(image)
    return all(got[c] == want.get(c, 0) for c in PALETTE)


def grid(images: list[np.ndarray], columns: int = 8, scale: int = 4, captions: list[str] | None = None,
         right: list[bool | None] | None = None) -> Any:
    """A PIL picture of `images` in rows of `columns`, each enlarged `scale` times (nearest neighbour), framed green
    (`right`), red (wrong) or grey (unknown), with its caption under it."""
    from PIL import Image, ImageDraw

    H, W = images[0].shape[:2] if images else (SIZE, SIZE)
    tw, th = W * scale + 4, H * scale + 4 + (12 if captions else 0)
    rows = max(1, -(-len(images) // columns))
    sheet = Image.new("RGB", (columns * tw, rows * th), (40, 40, 40))
    pen = ImageDraw.Draw(sheet)
    for k, image in enumerate(images):
        x, y = (k % columns) * tw, (k // columns) * th
        ok = right[k] if right else None
        pen.rectangle([x, y, x + W * scale + 3, y + H * scale + 3], fill={True: (40, 180, 60), False: (200, 40, 40)}.get(ok, (90, 90, 90)))
        tile = Image.fromarray(np.asarray(image, dtype=np.uint8)).resize((W * scale, H * scale), Image.NEAREST)
        sheet.paste(tile, (x + 2, y + 2))
        if captions:
            pen.text((x + 2, y + H * scale + 4), captions[k][:14], fill=(230, 230, 230))
    return sheet
