"""The reward model: a causal LM's transformer with a scalar head, as a Hugging Face sequence classifier.

A reward model is `AutoModelForSequenceClassification` with `num_labels=1` (for the bundled
Qwen2 model, `Qwen2ForSequenceClassification`): the transformer of the causal LM it starts
from and a linear `score` head from the hidden state to one number, read at the last
non-padding token. Saved, it is an ordinary Hugging Face folder (`config.json` with
`architectures` and `num_labels: 1`, `model.safetensors` with the head, the tokenizer) that
`transformers`, TRL or OpenRLHF load as it is; `assay_rm.json` beside it keeps what assay
needs to score the same way it trained (the longest sequence).

A response is scored as the token ids of its prompt text (a conversation through the chat
template) followed by the response, tokenised as one string, then EOS, right-padded, so
padding never reaches a real token. An outcome reward model is saved so that the obvious
call scores the same way (`scoring_tokenizer`): its tokenizer appends EOS itself (and keeps
the last `max_length` tokens under `truncation=True`), and its config says `problem_type:
regression`, so `tok(prompt + response)` into `AutoModelForSequenceClassification`, and
`pipeline("text-classification")`, give the reward assay gives.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from assay.devices import check_device, generator_for
from assay.errors import AssayError
from assay.models import quiet_hf, resolve_model_path

RM_FILE = "assay_rm.json"


def pad_right(rows, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows right-padded to the longest: `input_ids` `[M, L]` and `attention_mask` `[M, L]`."""
    width = max(map(len, rows))
    ids = [list(row) + [pad_id] * (width - len(row)) for row in rows]
    mask = [[1] * len(row) + [0] * (width - len(row)) for row in rows]
    return torch.tensor(ids, dtype=torch.long, device="cpu"), torch.tensor(mask, dtype=torch.long, device="cpu")


def init_head(model, seed: int) -> None:
    """The score head drawn from its own seeded generator: N(0, initializer_range²), the run's RNG left alone."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    std = getattr(model.config, "initializer_range", 0.02)
    with torch.no_grad():
        w = model.score.weight
        w.copy_((torch.randn(w.shape, device="cpu", generator=generator_for(gen, "cpu")) * std).to(w.dtype))
        if getattr(model.score, "bias", None) is not None:
            model.score.bias.zero_()


def scoring_tokenizer(tok, max_length: int):
    """`tok`, changed in place so that its plain call encodes what an outcome reward model is scored on:
    the text's tokens then EOS (no BOS; `tok(prompt, response)` gives the response's tokens then EOS),
    and under `truncation=True` the last `max_length` tokens, as `Encoder` cuts.

    Through the tokenizer's own switches (`add_bos_token`, `add_eos_token`), which transformers
    saves and applies again on load; without an EOS token the tokenizer is left as it is.
    """
    if tok.eos_token_id is None:
        return tok
    from tokenizers.processors import TemplateProcessing

    tok.add_bos_token, tok.add_eos_token = False, True  # saved in tokenizer_config.json; the post-processor below is what they mean
    eos = tok.eos_token
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"$A:0 {eos}:0", pair=f"$A:0 $B:1 {eos}:1",
                                                              special_tokens=[(eos, tok.eos_token_id)])
    tok.truncation_side, tok.model_max_length = "left", max_length
    tok.init_kwargs["truncation_side"] = "left"  # what save_pretrained writes
    return tok


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def build_rm(path: str, seed: int = 0, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any]:
    """`(reward model, tokenizer)` from a causal LM (a bundled name or a Hugging Face folder): its transformer, a new seeded head."""
    from transformers import AutoModelForSequenceClassification

    check_device(device)
    folder = resolve_model_path(path)
    quiet_hf()
    try:
        tok = _tokenizer(folder)
        model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as e:
        raise AssayError(f"cannot build a reward model from {str(folder)!r}: {str(e).splitlines()[0]}") from None
    model.config.pad_token_id = tok.pad_token_id
    init_head(model, seed)
    return model.to(device), tok


def load_rm(path: str | Path, device: str = "cpu") -> tuple[Any, Any, dict[str, Any]]:
    """`(reward model, tokenizer, assay_rm.json)` of a saved reward-model folder (or a run's `final/` given its run folder)."""
    from transformers import AutoModelForSequenceClassification

    check_device(device)
    folder = Path(path)
    if (folder / "final" / "config.json").is_file():
        folder = folder / "final"
    if not (folder / "config.json").is_file():
        raise AssayError(f"reward model {str(path)!r}: no config.json there (expected the folder `assay rm train` wrote, or its run folder)")
    from assay.images.scorer import is_image_rm, load_scorer

    if is_image_rm(folder):  # a picture scorer (`kind=image`)
        model, tok = load_scorer(folder, device)
        return model, tok, json.loads((folder / RM_FILE).read_text()) if (folder / RM_FILE).is_file() else {"kind": "image"}
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("num_labels", len(cfg.get("id2label") or {0: 0})) != 1 or not any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or []):
        raise AssayError(f"reward model {str(path)!r} is not a one-label sequence classifier (architectures {cfg.get('architectures')})")
    quiet_hf()
    try:
        tok = _tokenizer(folder)
        model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise AssayError(f"cannot load reward model from {str(folder)!r}: {str(e).splitlines()[0]}") from None
    meta = json.loads((folder / RM_FILE).read_text()) if (folder / RM_FILE).is_file() else {}
    return model.to(device).eval(), tok, meta


def read_meta(path: str | Path) -> dict[str, Any]:
    """`assay_rm.json` of a reward-model folder (or of a run's `final/`); `{}` when there is none."""
    folder = Path(path)
    for f in (folder / "final" / RM_FILE, folder / RM_FILE):
        if f.is_file():
            return json.loads(f.read_text())
    return {}


def save_rm(folder: Path, model, tokenizer, meta: dict[str, Any]) -> None:
    """Write the Hugging Face folder and `assay_rm.json`; an outcome reward model's tokenizer and config as
    `scoring_tokenizer` and the module docstring say, so that a plain transformers call scores as assay does."""
    quiet_hf()
    folder.mkdir(parents=True, exist_ok=True)
    if meta.get("kind") == "image":  # a picture scorer: its own config and weights, the policy's tokenizer
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / RM_FILE).write_text(json.dumps(meta, indent=1))
        return
    if meta.get("kind", "orm") == "orm":  # the obvious call scores as assay does (module docstring)
        model.config.problem_type = "regression"  # pipeline("text-classification") returns the score itself, not its sigmoid
        scoring_tokenizer(tokenizer, int(meta.get("max_length", tokenizer.model_max_length)))
    model.save_pretrained(folder, safe_serialization=True)
    config = json.loads((folder / "config.json").read_text())
    config["num_labels"] = 1  # transformers writes only id2label; the count is what other tools read first
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(folder)
    (folder / RM_FILE).write_text(json.dumps(meta, indent=1))


def render_prompt(tokenizer, prompt: str | list[dict[str, Any]]) -> str:
    """A prompt as text: itself, or a conversation through the tokenizer's chat template with the generation prompt."""
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise AssayError("a conversational prompt needs a reward model whose tokenizer has a chat template (this one has none)")
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


class Encoder:
    """Token ids of (prompt, response) texts, with the prompt's length in tokens cached."""

    def __init__(self, tokenizer, max_length: int):
        self.tok, self.max_length = tokenizer, max_length
        self._prompts: dict[str, int] = {}  # prompt text -> its length in tokens

    def ids(self, prompt: str | list[dict[str, Any]], response: str) -> tuple[list[int], int]:
        """`(token ids, response length in tokens)`: the prompt text and the response tokenised as one string
        (as a plain `tok(prompt + response)` does), then EOS; a sequence over `max_length` loses tokens from its start.
        The response length, for the length term, is what the response adds to the prompt's own tokens (EOS included)."""
        text = render_prompt(self.tok, prompt)
        p = self._prompts.get(text)
        if p is None:
            p = self._prompts[text] = len(self.tok(text, add_special_tokens=False)["input_ids"])
            if len(self._prompts) > 100_000:
                self._prompts.clear()
        ids = self.tok(text + response, add_special_tokens=False)["input_ids"]
        if self.tok.eos_token_id is not None:
            ids = ids + [self.tok.eos_token_id]
        return ids[-self.max_length :], max(0, len(ids) - p)

    def inputs(self, items: list[tuple[Any, str]], device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """`({input_ids [M, L], attention_mask [M, L]}, response lengths [M])`, right-padded: the model's keyword inputs, as
        every encoder gives them (`assay.images.scorer.ImageEncoder` adds `pixel_values`)."""
        rows, lengths = zip(*(self.ids(p, r) for p, r in items))
        ids, mask = pad_right(rows, self.tok.pad_token_id)
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}, torch.tensor(lengths, dtype=torch.long, device=device)


def encoder_for(tok, meta: dict[str, Any]):
    """The encoder an outcome reward model of `assay_rm.json` `meta` scores with: text, or (`kind: image`) pictures."""
    if meta.get("kind") == "image":
        from assay.images.scorer import ImageEncoder

        return ImageEncoder(tok, int(meta.get("max_length", 8)), int(meta.get("sample_size", 16)))
    return Encoder(tok, int(meta.get("max_length", 256)))


def forward_scores(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rewards `[M]` of an encoder's inputs, through the model's own forward (a text model pools at the last non-pad token)."""
    return model(**inputs).logits[:, 0].float()


@torch.no_grad()
def score_texts(model, encoder: Encoder, items: list[tuple[Any, Any]], batch_size: int = 64) -> list[float]:
    """Rewards of `(prompt, response)` items (a response is a picture for an image reward model), `batch_size` per forward."""
    device = next(model.parameters()).device
    out: list[float] = []
    for i in range(0, len(items), batch_size):
        inputs, _ = encoder.inputs(items[i : i + batch_size], device)
        out += forward_scores(model, inputs).tolist()
    return out
