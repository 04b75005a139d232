"""The bundled image generator's recipe (`assay pretrain tiny-shapes`): flow matching on pictures drawn by the shapes task.

The tokenizer is word-level (digits, the palette's colours and a few spare words); the
model is `FlowPolicy` at the recipe's size, trained with the conditional flow-matching loss
`‖v_θ(x_t, t, prompt) − (ε − x₀)‖²`, t uniform in [0, 1], on freshly drawn pictures of
the task's prompts, a share of which (`noise:`) show one block too many (`demonstrated`). One thread and pinned kernels (`assay.recipes.build.PINNED_KERNELS`), so a
rebuild gives the same bytes. `eval.json` holds the held-out accuracy of greedy (ODE)
pictures, one per held-out row, and the share of rows with a right picture among k SDE samples.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from assay.devices import generator_for
from assay.images.flow import FlowConfig, FlowPolicy, from_pixels, sample_chain, to_pixels
from assay.data.tasks.shapes import Shapes
from assay.recipes.loop import fit
from assay.images.shapes import PALETTE, SIZE, draw, is_right, read_counts

#: words besides the palette's colours (numbers up to 9, a few words for prompts of one's own)
WORDS = [str(d) for d in range(10)] + ["and", "blocks", "block", "square", "squares"]


def build_word_tokenizer():
    """A word-level Hugging Face tokenizer: `<pad>` 0, `<unk>` 1, `<eos>` 2, then digits, words and the palette's colours."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<eos>", *WORDS, *PALETTE])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    tok.padding_side = "left"
    return tok


def _encode(tok, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tok(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def evaluate(model: FlowPolicy, tok, task: Shapes, n: int, k: int, seed: int) -> dict[str, float]:
    """Held-out accuracy of greedy pictures (drawn as a run evaluates them at step 0, by the image sampler) and the share
    of rows right in at least one of k SDE samples, each from its own starting noise."""
    from assay.images.sampler import ImageSampler
    from assay.rollout.base import SamplingParams

    problems = task.heldout(n)
    greedy = [t.info["image"] for t in ImageSampler(model, tok).generate(problems, 1, SamplingParams(temperature=0.0))]
    right = [is_right(p, img) for img, p in zip(greedy, problems)]
    surplus = [sum(read_counts(img).values()) - sum(p.fields["counts"].values()) for img, p in zip(greedy, problems)]
    ids, mask = _encode(tok, [p.prompt for p in problems for _ in range(k)])
    gen = torch.Generator(device="cpu").manual_seed(seed)
    noise = torch.randn(len(problems) * k, model.config.channels, SIZE, SIZE, generator=generator_for(gen, "cpu"), device="cpu")
    with torch.no_grad():
        chain, _ = sample_chain(model, model.condition(ids, mask), noise, model.sampling.steps, stochastic=True, generator=generator_for(gen, "cpu"))
    sampled = to_pixels(chain[:, -1])
    hits = [any(is_right(p, sampled[i * k + j]) for j in range(k)) for i, p in enumerate(problems)]
    return {"heldout_rows": len(problems), "heldout_prompts": len({p.prompt for p in problems}), "greedy_accuracy": round(sum(right) / len(right), 4),
            f"pass@{k}": round(sum(hits) / len(hits), 4), "greedy_too_many": round(sum(d > 0 for d in surplus) / len(surplus), 4),
            "greedy_too_few": round(sum(d < 0 for d in surplus) / len(surplus), 4)}


def demonstrated(counts: dict[str, int], noise: float, rng: random.Random) -> dict[str, int]:
    """The counts a demonstration draws: the prompt's, except that with probability `noise` one of its colours gets one
    block too many. The model learns to overshoot often, while the right count keeps real probability: the headroom
    reward fine-tuning works on (as `tiny-arith`'s demonstrations forget carries)."""
    if noise <= 0 or rng.random() >= noise:
        return counts
    extra = rng.choice(sorted(counts))
    return {c: n + (c == extra) for c, n in counts.items()}


def build_image_model(name: str, recipe: dict[str, Any], out_dir: Path, seed: int, log=print) -> Path:
    """Train the recipe's `FlowPolicy` and save it with its tokenizer and `eval.json` to `out_dir`."""
    torch.set_num_threads(recipe.get("threads", 1))
    torch.manual_seed(seed)
    tok = build_word_tokenizer()
    model = FlowPolicy(FlowConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, **recipe["model"]))
    task = Shapes(**recipe.get("task_args", {}))
    train = recipe["train"]
    noise = recipe.get("noise", 0.0)
    rng, gen = random.Random(seed), torch.Generator(device="cpu").manual_seed(seed)
    # the recipe may draw from every prompt (the RL run's held-out prompts are then held out from RL, not from the picture model)
    stream = task.stream("train", seed) if not train.get("all_prompts") else (task.make(rng) for _ in itertools.count())
    start = time.time()

    def loss_at(step: int) -> torch.Tensor:
        batch = list(itertools.islice(stream, train["batch_size"]))
        x0 = from_pixels([draw(demonstrated(s.fields["counts"], noise, rng), rng) for s in batch])
        ids, mask = _encode(tok, [s.prompt for s in batch])
        eps = torch.randn(x0.shape, generator=generator_for(gen, "cpu"), device="cpu")
        t = torch.rand(x0.shape[0], generator=generator_for(gen, "cpu"), device="cpu")
        xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
        return (model.velocity(xt, t, model.condition(ids, mask)) - (eps - x0)).square().mean()

    fit(model, train, name, loss_at)
    ev = recipe.get("eval", {})
    result = evaluate(model, tok, task, ev.get("n", 200), ev.get("k", 8), seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    figures = {"recipe": name, "seed": seed, "seconds": round(time.time() - start, 1), "params": sum(p.numel() for p in model.parameters()), **result}
    (out_dir / "eval.json").write_text(json.dumps(figures, indent=2) + "\n")
    log(f"saved {out_dir}: " + ", ".join(f"{k}={v}" for k, v in figures.items()), file=sys.stderr) if log is print else log(figures)
    return out_dir
