"""`assay serve model PATH`: a Hugging Face causal LM behind a small OpenAI-compatible server.

For tests and CPU work where vLLM is not installed: the judge rewards
(`assay.rewards.judge`) and `rollout.backend=openai` talk to it as to any
OpenAI-compatible server. Generation runs through `transformers`' `generate`, one request
at a time (a lock), on the device given (CPU by default); `post` blocks, so the server
(`assay.jsonhttp`) runs each call on a thread of its own, off its event loop.

* `GET /v1/models` -> `{"object": "list", "data": [{"id": NAME, "object": "model", ...}]}`
* `POST /v1/completions` with `prompt` (a string, or a list of token ids), `max_tokens`,
  `temperature` (0: greedy), `top_p`, `n`, `seed`, `stop` (a string or a list of them) ->
  `{"choices": [{"index", "text", "finish_reason", "logprobs": null}], "usage": {...}}`. With
  `logprobs` (an integer, as OpenAI's completions take it) each choice's `logprobs` holds
  `tokens` and `token_logprobs`: the sampled tokens' log-probabilities under the distribution
  they were sampled from (after temperature and top-p, as vLLM's `processed_logprobs`); with
  vLLM's `return_token_ids: true`, `token_ids` too, so `rollout.backend=openai` trains with it.
* `POST /v1/chat/completions` with `messages`, rendered by the tokenizer's chat template
  (generation prompt added); a model without a template is a 400 that says so. A message's
  `content` may be a list of OpenAI parts: `text`, and `image_url` with a `data:` URL, which a
  vision-language model (docs/multimodal.md) sees through its processor; a picture sent to a text
  model, or by an http URL (the server fetches nothing), is a 400.
* `GET /health` -> `{"status": "ok", "model", "requests"}`.

`finish_reason` is `stop` when the model sampled EOS or the text reached a stop string (cut
before it), else `length`. A body that is not JSON, a field of the wrong type or a prompt
too long for the model's context is a 400 `{"error": {"message": one line}}` (OpenAI's
shape); a `model` other than the served name a 404.

    >>> stop_at("46\\nnext", ["\\n"])
    ('46', True)
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Callable

from assay.errors import AssayError
from assay.jsonhttp import BadRequest, need_uvicorn, serve_until_signal
from assay.models import context_length

MAX_BODY = 8 * 2**20  # bytes: a larger request body is refused (413)
MAX_N = 64  # most completions in one request


def stop_at(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` cut before the earliest stop string, and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float, integer: bool = False) -> Any:
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise BadRequest(f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not low <= value <= high:
        raise BadRequest(f"'{key}' must be in [{low:g}, {high:g}], got {value!r}")
    return int(value) if integer else float(value)


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest(f"'stop' must be a string or a list of strings, got {stop!r}")
    return stops


class ModelService:
    """Holds the model and tokenizer; turns a parsed request body into a reply (BadRequest for a bad one).

    Args:
        path: a bundled model name or a Hugging Face causal LM folder.
        name: the model id clients send and `/v1/models` lists (default: `path` as given, as vLLM does).
        max_new_tokens: the most tokens one completion may have (a larger `max_tokens` is cut to it).
        device: where the model runs. chat_template: a Jinja file or text replacing the tokenizer's.
    """

    def __init__(self, path: str, name: str | None = None, max_new_tokens: int = 256, device: str = "cpu", chat_template: str | None = None):
        from assay.models import load_policy, resolve_model_path

        if max_new_tokens < 1:
            raise AssayError(f"serve model: --max-new-tokens must be >= 1, got {max_new_tokens}")
        resolve_model_path(path)  # a missing folder is one clear line before anything loads
        self.model, self.tokenizer = load_policy(path, device=device, chat_template=chat_template)
        self.model.eval()
        self.name = name or path  # as vLLM names a model: the path as given
        self.max_new_tokens, self.device = max_new_tokens, device
        self.context = context_length(self.model) or 0
        self.requests = 0
        self._lock = threading.Lock()  # one generate at a time: the model is not shared between threads

    # ---------------------------------------------------------------- routes

    routes = {"/v1/models": "GET", "/v1/completions": "POST", "/v1/chat/completions": "POST", "/health": "GET"}

    async def get(self, path: str) -> dict[str, Any]:
        if path == "/v1/models":
            return {"object": "list", "data": [{"id": self.name, "object": "model", "created": 0, "owned_by": "assay"}]}
        return {"status": "ok", "model": self.name, "requests": self.requests}

    @staticmethod
    def error_body(status: int, message: str) -> dict[str, Any]:
        """OpenAI's error shape."""
        return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error", "code": status}}

    def post(self, path: str, body: Any) -> dict[str, Any]:
        """The reply to a POST of `body` to `path` (a route); blocking: the server runs it on a thread."""
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.name:
            raise BadRequest(f"model {model!r} is not served here; served: {self.name!r}", 404)
        chat = path == "/v1/chat/completions"
        ids, vision = self._chat_ids(body) if chat else (self._prompt_ids(body), None)
        n = _number(body, "n", 1, 1, MAX_N, integer=True)
        max_tokens = min(_number(body, "max_tokens", 16, 1, 2**31, integer=True), self.max_new_tokens)
        temperature = _number(body, "temperature", 1.0, 0.0, 100.0)
        top_p = _number(body, "top_p", 1.0, 1e-6, 1.0)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest(f"'seed' must be an integer, got {seed!r}")
        stops = _stops(body)
        if self.context and len(ids) + max_tokens > self.context:
            raise BadRequest(f"the prompt's {len(ids)} tokens + max_tokens {max_tokens} exceed the model's context of {self.context} tokens")
        want_logprobs = not chat and body.get("logprobs") is not None and body.get("logprobs") is not False  # 0 asks for them
        outs, logprobs = self._generate(ids, n, max_tokens, temperature, top_p, seed, vision)
        choices, produced = [], 0
        for i, (out, lp) in enumerate(zip(outs, logprobs)):
            produced += len(out)
            eos = bool(out) and out[-1] == self.tokenizer.eos_token_id
            text, stopped = stop_at(self.tokenizer.decode(out, skip_special_tokens=True), stops)
            reason = "stop" if eos or stopped else "length"
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason})
                continue
            if stopped:  # the tokens up to the stop string's cut
                keep = next(k for k in range(len(out) + 1) if len(self.tokenizer.decode(out[:k], skip_special_tokens=True)) >= len(text))
                out, lp = out[:keep], lp[:keep]
            choice: dict[str, Any] = {"index": i, "text": text, "finish_reason": reason, "logprobs": None}
            if want_logprobs:
                choice["logprobs"] = {"tokens": self.tokenizer.convert_ids_to_tokens(out), "token_logprobs": lp, "top_logprobs": None}
            if body.get("return_token_ids") is True:
                choice["token_ids"] = out
            choices.append(choice)
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.name, "choices": choices,
                "usage": {"prompt_tokens": len(ids), "completion_tokens": produced, "total_tokens": len(ids) * n + produced}}

    # ---------------------------------------------------------------- prompts

    def _prompt_ids(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]  # OpenAI allows a batch of prompts; one is taken as it is
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in prompt):
                raise BadRequest(f"'prompt' token ids must be in [0, {vocab})")
            ids = list(prompt)
        else:
            raise BadRequest(f"'prompt' must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise BadRequest("'prompt' is empty")
        return ids

    def _chat_ids(self, body: dict[str, Any]) -> tuple[list[int], dict[str, Any] | None]:
        """The prompt ids of a chat request, and the processor's outputs when its messages hold pictures."""
        from assay.types import Sample
        from assay.vision.inputs import encode_sample, image_parts

        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, list)) for m in messages):
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects, each content a string or a list of parts")
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest(f"model {self.name!r} has no chat template; use /v1/completions, or start the server with --chat-template FILE")
        messages = [{**m, "content": _parts(m["content"], i)} for i, m in enumerate(messages)]
        if any(image_parts(messages)):
            if getattr(self.tokenizer, "processor", None) is None:
                raise BadRequest(f"model {self.name!r} is a language model and takes no pictures; send text parts only")
            try:
                return encode_sample(self.tokenizer, Sample("request", messages))
            except AssayError as e:
                raise BadRequest(str(e).splitlines()[0]) from None
        messages = [{**m, "content": "".join(p["text"] for p in m["content"])} if isinstance(m["content"], list) else m for m in messages]
        try:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        except Exception as e:  # a template's own errors (raise_exception, a role it does not know)
            raise BadRequest(f"the chat template failed on these messages: {type(e).__name__}: {e}".splitlines()[0]) from None
        return list(out["input_ids"]), None

    # ---------------------------------------------------------------- generation

    def _generate(self, ids: list[int], n: int, max_tokens: int, temperature: float, top_p: float, seed: int | None,
                  vision: dict[str, Any] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """`n` completions of `ids`, each cut after its first EOS `[n][≤ max_tokens]`, and each token's log-probability under
        the distribution it was drawn from (after temperature and top-p; greedy: the model's own); `vision`: the prompt's
        pictures, as the processor made them."""
        import torch

        sample = temperature > 0
        kwargs: dict[str, Any] = {"max_new_tokens": max_tokens, "do_sample": sample, "num_return_sequences": n if sample else 1,
                                  "pad_token_id": self.tokenizer.pad_token_id, "eos_token_id": self.tokenizer.eos_token_id,
                                  "output_scores": True, "return_dict_in_generate": True}
        if sample:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        x = torch.tensor([ids], device=self.device)  # [1, P]
        with self._lock, torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
            pictures = {k: torch.as_tensor(v, device=self.device) for k, v in (vision or {}).items()}
            gen = self.model.generate(x, attention_mask=torch.ones_like(x), **pictures, **kwargs)
            self.requests += 1
        out = gen.sequences[:, len(ids):]  # [n, T]
        scores = torch.stack(gen.scores, dim=1).float() if gen.scores else torch.zeros(out.shape[0], 0, 1, device=out.device)  # [n, T, V] processed
        lp = torch.log_softmax(scores, dim=-1).gather(-1, out[:, : scores.shape[1], None])[..., 0]  # [n, T]
        rows, lps = out.tolist(), lp.tolist()
        if not sample:  # greedy: n copies of the one completion
            rows, lps = rows * n, lps * n
        eos = self.tokenizer.eos_token_id
        cut = [row.index(eos) + 1 if eos in row else len(row) for row in rows]
        return [row[:k] for row, k in zip(rows, cut)], [lp[:k] for lp, k in zip(lps, cut)]


def _parts(content: Any, i: int) -> Any:
    """A message's content: a string as it is; a list of OpenAI parts as assay's (`text`, and `image` with the picture read
    from an `image_url` part's `data:` URL); anything else a 400 naming the message."""
    from assay.vision.inputs import load_image

    if isinstance(content, str):
        return content
    out = []
    for j, p in enumerate(content):
        where = f"message {i + 1}, part {j + 1}"
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            out.append({"type": "text", "text": p["text"]})
        elif kind == "image_url":
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url.startswith("data:"):  # never a path on this machine, never a fetch
                raise BadRequest(f"{where}: an image_url part needs {{\"url\": \"data:image/png;base64,...\"}} (the server reads no files "
                                 "and fetches no URLs)")
            try:
                out.append({"type": "image", "image": load_image(url, where)})
            except AssayError as e:
                raise BadRequest(str(e).splitlines()[0]) from None
        else:
            raise BadRequest(f"{where}: a part must be {{\"type\": \"text\", \"text\": ...}} or {{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}}")
    return out


def serve_model(path: str, host: str = "127.0.0.1", port: int = 8000, name: str | None = None, max_new_tokens: int = 256,
                device: str = "cpu", chat_template: str | None = None, ready: Callable[[str], None] | None = None, *,
                max_concurrency: int = 256, grace: float = 20.0) -> int:
    """Serve the model at `path` until SIGINT or SIGTERM, drain, return 0 (see `assay.jsonhttp` for the drain).

    Prints `assay: serving model NAME on http://HOST:PORT` (the bound port, so `--port 0`
    works) to stdout once the server accepts connections.
    """
    need_uvicorn("serve model")
    service = ModelService(path, name=name, max_new_tokens=max_new_tokens, device=device, chat_template=chat_template)
    return serve_until_signal(service, host, port, MAX_BODY, f"assay: serving model {service.name}", "serve model", ready,
                              max_concurrency=max_concurrency, grace=grace)
