"""Rebuild a bundled model from its recipe (`assay pretrain NAME`).

A recipe folder `recipes/NAME/` holds `recipe.yaml` and, once built, `model/` (a Hugging
Face folder) with `eval.json`, the held-out figures measured right after the build.
A recipe trains from scratch (`model:`, its size) or from another bundled model (`base:`,
optionally `add_chars:`, characters appended to its character tokenizer, such as the newline
that `tiny-steps` writes between lines), on noisy (prompt, answer) pairs (`noise:`,
`corruption:`; `assay.recipes.noisy`) or on episodes of an environment (`env:`, `demos:`;
`assay.recipes.demos`), whose `eval.json` then holds the held-out accuracy with the tool and without it.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from assay.errors import AssayError
from assay.models import BUNDLED_DIR, build_char_tokenizer, build_tiny_model, quiet_hf


#: kernel choices a bundled model is built with, so a rebuild gives the same bytes on any x86-64
#: machine with AVX2: torch's vectorised CPU kernels and MKL's matrix products both take their
#: AVX2 code paths (Intel MKL's "conditional numerical reproducibility"), one thread each
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def pin_kernels() -> None:
    """Set `PINNED_KERNELS` in the environment (a value already set is kept); call before torch is imported."""
    if "torch" in sys.modules:
        raise AssayError("pin_kernels() must run before torch is imported (run `assay pretrain`, or set the variables yourself)")
    for k, v in PINNED_KERNELS.items():
        os.environ.setdefault(k, v)


def load_recipe(name: str) -> dict[str, Any]:
    path = BUNDLED_DIR / name / "recipe.yaml"
    if not path.is_file():
        known = sorted(p.parent.name for p in BUNDLED_DIR.glob("*/recipe.yaml"))
        raise AssayError(f"unknown recipe {name!r}; known: {', '.join(known)}")
    return yaml.safe_load(path.read_text())


def from_base(base: str, add_chars: str, seed: int):
    """`(model, tokenizer)` of the bundled `base`, its character tokenizer extended by `add_chars`.

    Existing token ids keep their embeddings; each new character gets a new row drawn from
    N(0, 0.02²) with a generator seeded by `seed`, so the rebuild is deterministic.
    """
    import torch

    from assay.devices import generator_for
    from assay.models import ALPHABET, load_policy

    model, base_tok = load_policy(str(BUNDLED_DIR / base / "model"))
    if not add_chars:
        return model, base_tok
    tok = build_char_tokenizer(ALPHABET + add_chars)
    old, new = base_tok.get_vocab(), tok.get_vocab()
    if any(new.get(t) != i for t, i in old.items()):
        raise AssayError(f"recipe base {base!r}: its tokenizer is not the bundled character tokenizer, so add_chars cannot extend it")
    n_old = len(base_tok)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[n_old:] = torch.randn(len(tok) - n_old, emb.shape[1], device="cpu", generator=generator_for(gen, "cpu")) * 0.02
    return model, tok


def build_bundled(name: str, out: str | None = None, seed: int | None = None, log=print, device: str = "cpu") -> Path:
    """Train the recipe's model (from scratch, or from the bundled model `base:`) and save it (with `eval.json`) to `out`.

    On `device` (`cuda`: the weights are built on the CPU from the seed, trained there and
    moved back to be saved); only a CPU build is byte-identical to the committed model.
    """
    import torch
    from rich.progress import Progress

    from assay.data.tasks import make_task
    from assay.devices import check_device
    from assay.training.sft import SFTConfig, sft

    quiet_hf()
    recipe = load_recipe(name)
    seed = recipe["seed"] if seed is None else seed
    out_dir = Path(out) if out else BUNDLED_DIR / name / "model"
    if recipe.get("kind") == "image":  # a picture generator (assay.images.recipe)
        from assay.images.recipe import build_image_model

        return build_image_model(name, recipe, out_dir, seed, log)
    if recipe.get("kind") == "vision":  # a vision-language model (assay.vision.recipe)
        from assay.vision.recipe import build_vision_model

        return build_vision_model(name, recipe, out_dir, seed, log)
    torch.set_num_threads(recipe.get("threads", 1))  # one thread: the same weights on any machine
    task = make_task(recipe["task"], **recipe["task_args"])
    if recipe.get("base"):
        model, tok = from_base(recipe["base"], recipe.get("add_chars", ""), seed)
    else:
        tok = build_char_tokenizer()
        model = build_tiny_model(tok, seed=seed, **recipe["model"])
    model.to(check_device(device))
    rng = random.Random(seed)
    stream = task.stream("train", seed)
    cfg = SFTConfig(seed=seed, **recipe["sft"])
    batches, encode = _batches(recipe, task, tok, stream, cfg.batch_size, rng)
    start = time.time()
    with Progress(transient=True) as bar:
        job = bar.add_task(f"pretrain {name}", total=cfg.steps)
        sft(model, tok, batches, cfg, on_step=lambda s, loss: bar.update(job, completed=s + 1, description=f"pretrain {name} loss {loss:.3f}"),
            encode=encode)
    result = _evaluate(recipe, task, model, tok, seed)
    model.to("cpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    figures = {"recipe": name, "seed": seed, "seconds": round(time.time() - start, 1), "params": sum(p.numel() for p in model.parameters()), **result}
    (out_dir / "eval.json").write_text(json.dumps(figures, indent=2) + "\n")
    log(f"saved {out_dir}: " + ", ".join(f"{k}={v}" for k, v in figures.items()), file=sys.stderr) if log is print else log(figures)
    return out_dir


def _batches(recipe: dict[str, Any], task, tok, stream, batch_size: int, rng: random.Random):
    """The SFT batches of a recipe and their encoder: noisy (prompt, answer) pairs, or episodes of `env:` (`demos:`)."""
    if "env" not in recipe:
        from assay.recipes.noisy import noisy_answers

        return (list(noisy_answers(itertools.islice(stream, batch_size), recipe["noise"], recipe["corruption"], rng)) for _ in itertools.count()), None
    from functools import partial

    from assay.envs.base import env_factory
    from assay.recipes.demos import episode_rows, tool_demos
    from assay.training.sft import encode_rows

    make_env, demos = env_factory(recipe["env"]["name"], recipe["env"].get("args")), recipe["demos"]
    batches = (episode_rows(tool_demos(itertools.islice(stream, batch_size), tok, make_env, demos["tool_rate"], demos["corruption"], rng))
               for _ in itertools.count())
    return batches, partial(encode_rows, tok.pad_token_id)


def _evaluate(recipe: dict[str, Any], task, model, tok, seed: int) -> dict[str, Any]:
    """The held-out figures of a freshly built model: greedy accuracy and pass@k; with `env:`, with and without the tool."""
    from assay.eval.policy import evaluate
    from assay.rewards.base import REWARDS
    from assay.rollout.torch_sampler import TorchSampler

    ev, heldout = recipe["eval"], task.heldout(recipe["eval"]["n"])
    plain = evaluate(TorchSampler(model, tok), REWARDS.get(task.reward)(), heldout, ev["max_new_tokens"], k=ev["k"], seed=seed)
    if "env" not in recipe:
        return plain.as_dict()
    import torch

    from assay.config import EnvConfig
    from assay.rollout.base import SamplingParams
    from assay.rollout.multiturn import episode_sampler

    env = EnvConfig(**recipe["env"])
    episodes = episode_sampler(TorchSampler(model, tok), model, tok, env, model.config.max_position_embeddings)
    tool = evaluate(episodes, REWARDS.get("episode")(), heldout, ev["max_new_tokens"])
    greedy_calls = episodes.metrics()["agent/tool_calls_per_episode"]
    sampled = episodes.generate(heldout, 1, SamplingParams(ev["max_new_tokens"], temperature=1.0), torch.Generator(device="cpu").manual_seed(seed))
    episodes.metrics()
    return {"n": len(heldout), "accuracy_no_tool": plain.accuracy, "accuracy_tool": tool.accuracy, "tool_calls_per_episode_greedy": greedy_calls,
            "tool_call_rate_sampled": sum(1 for t in sampled if t.info["tool_calls"]) / len(sampled),
            "reward_sampled": sum(t.info["reward"] or 0.0 for t in sampled) / len(sampled)}
