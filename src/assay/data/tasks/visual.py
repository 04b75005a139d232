"""`visual_count`: a picture of coloured blocks and a question, "how many red?", for vision-language policies.

The picture is `size`×`size` RGB on black, cut into cells of `cell` pixels; each block is a
square of one palette colour (`assay.images.shapes.PALETTE`) in a cell of its own, so no two
blocks touch. The prompt is a conversation: one user message holding the picture (an image
content part) and the colour asked about; the answer is the number of blocks of that colour,
checked by the `arithmetic` verifier (the whole completion must be that integer). The other
colours' blocks are distractors. `blank=True` sends an all-black picture with the same
question and answer: the control run that shows how much a policy gains without seeing. Each row's
`image_description` ("blocks: 2 red, 1 blue") is what `assay eval --images describe` says instead of the picture.
See docs/multimodal.md.
"""

from __future__ import annotations

import random

from assay.data.tasks.base import TASKS, Task
from assay.errors import AssayError
from assay.images.shapes import PALETTE
from assay.types import Sample

#: the colours a question asks about (all of the palette's but white, which the tiny model's recipe keeps for distractors)
ASKED = ("red", "green", "blue", "yellow")


def draw_blocks(blocks: list[tuple[str, int]], size: int, cell: int):
    """A Pillow RGB picture with a `cell - 1`-pixel square of `colour` in each `(colour, cell index)` of `blocks`."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size))
    pen = ImageDraw.Draw(img)
    per_row = size // cell
    for colour, at in blocks:
        x, y = (at % per_row) * cell, (at // per_row) * cell
        pen.rectangle([x, y, x + cell - 2, y + cell - 2], fill=PALETTE[colour])
    return img


@TASKS.register("visual_count")
class VisualCount(Task):
    """How many blocks of one colour a picture shows: 1..`max_count` of the asked colour, 0..`distractors` of each other.

    Args:
        max_count: the most blocks of the asked colour.
        distractors: the most blocks of each other colour (white included).
        size, cell: the picture's side and a cell's side, in pixels (`(size // cell)²` cells).
        blank: send an all-black picture instead (the question and answer unchanged): the control that tells
            whether a policy uses the picture.
    """

    reward = "arithmetic"

    def __init__(self, max_count: int = 4, distractors: int = 2, size: int = 24, cell: int = 4, blank: bool = False,
                 heldout_fraction: float = 0.2):
        cells = (size // max(cell, 1)) ** 2
        if max_count < 1 or distractors < 0 or cell < 2 or size < cell or max_count + distractors * (len(PALETTE) - 1) > cells:
            raise AssayError(f"visual_count: need max_count >= 1, distractors >= 0, 2 <= cell <= size and room for every block "
                             f"({cells} cells); got max_count={max_count}, distractors={distractors}, size={size}, cell={cell}")
        self.max_count, self.distractors, self.size, self.cell, self.blank = max_count, distractors, size, cell, blank
        self.heldout_fraction = heldout_fraction

    def make(self, rng: random.Random) -> Sample:
        colour = rng.choice(ASKED)
        counts = {c: (rng.randint(1, self.max_count) if c == colour else rng.randint(0, self.distractors)) for c in PALETTE}
        kinds = [c for c, n in counts.items() for _ in range(n)]
        blocks = list(zip(kinds, rng.sample(range((self.size // self.cell) ** 2), len(kinds))))
        picture = draw_blocks([] if self.blank else blocks, self.size, self.cell)
        layout = " ".join(f"{c}@{at}" for c, at in sorted(blocks, key=lambda b: b[1]))
        prompt = [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": f"{colour}?"}]}]
        said = ", ".join(f"{n} {c}" for c, n in counts.items() if n) if not self.blank else "nothing"
        return Sample(id="", prompt=prompt, answer=str(counts[colour]),
                      fields={"colour": colour, "counts": counts, "layout": layout, "image_description": f"blocks: {said}"})

    def key(self, sample: Sample) -> str:
        return f"{sample.fields['colour']}? {sample.fields['layout']}"
