"""`rollout.backend=openai`: any OpenAI-compatible completions server.

Requests go to `POST {server_url}/v1/completions`, one per prompt with `n` completions,
at most `rollout.max_concurrency` in flight, each with `rollout.request_timeout` and up to
`rollout.max_retries` retries (connection errors, timeouts, 429 and 5xx answers; doubling
backoff). The prompt is sent as token ids (`encode_prompt`) and, where the server supports
it (vLLM's `return_token_ids`), the sampled token ids come back as ids: no detokenise and
retokenise round trip. Without them the returned token strings are mapped through the
tokenizer's vocabulary, and a token outside it is one error line, never a silent retokenise.

Weights (`rollout.weight_sync`): with `push` (or `auto`, when the server offers them) the
learner's weights go to the server after every update through vLLM's weight-transfer
routes with assay's `assay_http` backend (`assay.rollout.weight_transfer`), followed by the
probe check (`assay.rollout.sync`). In a `torchrun` job every rank generates its share with
the one server, and rank 0 alone talks to its weight routes: the sharded policy is gathered one
FSDP2 unit at a time on every rank (`dist.engine_weights`) and rank 0 sends each, the ranks
wait for the push to finish before any generates, and the push's outcome and the check's verdict
are rank 0's, on every rank (a server that fails the push stops every rank at the same step). Otherwise the server is fixed: the run says once that
it trains off-policy, every trajectory carries the server's version 0, and
`engine/staleness` logs how many updates the server is behind.

A vLLM server should run with `--logprobs-mode processed_logprobs` (logprobs after
temperature, like the learner's); one that returns them before temperature is caught by
the first generation at a temperature other than 1 and stopped with one line.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from assay.devices import generator_for
from assay.errors import AssayError
from assay.log import log
from assay.models import text_config
from assay.rollout.base import SamplingParams, encode_prompt
from assay.rollout.http import JsonClient
from assay.rollout.sync import check_sync, learner_probe_logprobs, probe_ids, tolerance_for
from assay.rollout.weight_transfer import BACKEND, encode_chunks
from assay.training.dist import engine_weights, is_sharded
from assay.types import Sample, Trajectory
from assay.vision.inputs import placeholder_ids


class OpenAISampler:
    """Generates with an OpenAI-compatible server (the `Sampler` interface); see the module docstring.

    Args:
        model, tokenizer: the learner's policy (for weight pushes and the probe check) and its tokenizer.
        rollout: the run's `rollout` section (`server_url`, `server_model`, `api_key_env`,
            `max_concurrency`, `request_timeout`, `max_retries`, `weight_sync`, `verify_sync`,
            `sync_tolerance`).
    """

    def __init__(self, model, tokenizer, rollout, device: str | torch.device = "cpu"):
        if not rollout.server_url:
            raise AssayError("rollout.backend=openai needs rollout.server_url, for example rollout.server_url=http://127.0.0.1:8000")
        from assay.training.dist import Ranks

        self.ranks = Ranks.from_env(torch.device(device))  # the torchrun job this process is a rank of (alone: rank 0 of 1)
        self.tokenizer, self.eos_id = tokenizer, tokenizer.eos_token_id
        self.client = JsonClient(rollout.server_url, os.environ.get(rollout.api_key_env), rollout.request_timeout, rollout.max_retries)
        self.pool = ThreadPoolExecutor(max_workers=rollout.max_concurrency, thread_name_prefix="assay-openai")
        self.served = rollout.server_model or self._first_model()
        self.verify, self.tolerance = rollout.verify_sync, tolerance_for(model, rollout.sync_tolerance)
        self.probe = probe_ids(text_config(model).vocab_size, avoid=placeholder_ids(model))
        self.model, self.version, self.learner_version = model, 0, 0
        self._metrics: dict[str, float] = {}
        self.push = self._choose_sync(rollout.weight_sync)
        if self.push:
            self.update_weights(model, 0)
            if rollout.temperature not in (0.0, 1.0):  # now, while the policy is whole on every rank (before torchrun shards it)
                self._on_main(lambda: self._check_temperature(model, rollout.temperature))
        elif self.verify:
            self._warn_if_different(model)

    # -- server set-up -----------------------------------------------------------------
    def _first_model(self) -> str:
        models = self.client.get("/v1/models").get("data") or []
        if not models:
            raise AssayError(f"server {self.client.base}: /v1/models lists no model; set rollout.server_model")
        return models[0]["id"]

    def _on_main(self, fn: Callable[[], Any]) -> Any:
        """`fn()` run on rank 0 alone, its result (or its `AssayError`, raised) on every rank: one rank talks to the server."""
        out: Any = None
        if self.ranks.main:
            try:
                out = fn()
            except AssayError as e:
                out = e
        out = self.ranks.broadcast(out)
        if isinstance(out, AssayError):
            raise out
        return out

    def _choose_sync(self, mode: str) -> bool:
        """Whether weights are pushed: `push` requires the routes, `auto` uses them when offered, `none` never (rank 0 asks
        the server; every rank follows its answer)."""
        return self._on_main(lambda: self._ask_server(mode))

    def _ask_server(self, mode: str) -> bool:
        if mode == "none":
            log.warning(f"rollout.backend=openai: weight_sync=none: training off-policy from the fixed server {self.client.base} "
                        "(engine/staleness counts the updates it is behind)")
            return False
        why = self.client.try_post("/init_weight_transfer_engine", {"init_info": {}})
        if why is None:
            return True
        if mode == "push":
            raise AssayError(f"server {self.client.base} takes no weight updates ({why}); start vLLM with VLLM_SERVER_DEV_MODE=1 and "
                             f"--weight-transfer-config '{{\"backend\": \"{BACKEND}\"}}' (docs/engines.md), or set rollout.weight_sync=none")
        log.warning(f"rollout.backend=openai: the server {self.client.base} takes no weight updates ({why}); training off-policy "
                    "from a fixed server (engine/staleness counts the updates it is behind)")
        return False

    def _warn_if_different(self, model) -> None:
        if not self.ranks.main:
            return
        engine = self.probe_logprobs()
        if engine is None:
            return
        diff = sum(abs(a - b) for a, b in zip(engine, learner_probe_logprobs(model, self.probe))) / max(1, len(engine))
        if diff > self.tolerance:
            log.warning(f"rollout.backend=openai: the fixed server's logprobs of a probe differ from the learner's by {diff:.3g} on "
                        "average: it serves other weights than the policy being trained")

    # -- weights -----------------------------------------------------------------------
    def update_weights(self, model, version: int) -> None:
        """Push `model`'s weights and check them (weight sync on), or count the staleness (a fixed server)."""
        self.model, self.learner_version = model, version
        if not self.push:
            self._metrics["engine/staleness"] = float(version - self.version)
            return
        t0 = time.perf_counter()
        sharded = is_sharded(model)
        failed: AssayError | None = None
        if self.ranks.main:
            chunks = encode_chunks(model, weights=engine_weights(model) if sharded else None)
            try:
                self._push(chunks, version)
            except AssayError as e:
                failed = e
                if sharded:  # the other ranks gather every unit with this one: go through the rest before saying so
                    for _ in chunks:
                        pass
        elif sharded:
            for _ in engine_weights(model):  # each unit's gather is collective: rank 0 sends what every rank gathers
                pass
        failed = self.ranks.broadcast(failed)  # no rank generates before the server holds the new weights, or all stop
        if failed is not None:
            raise failed
        self.version = version
        self._metrics.update({"engine/sync_s": time.perf_counter() - t0, "engine/staleness": 0.0})
        if self.verify:
            learner = learner_probe_logprobs(model, self.probe)  # a sharded forward: every rank takes part
            self._metrics.update(self._on_main(lambda: check_sync(self._served_probe(), learner, self.tolerance,
                                                                  f"server {self.client.base}", version)))

    def _push(self, chunks, version: int) -> None:
        """Rank 0's side of a push: generation paused, the weights in `chunks` sent, the version named, generation resumed."""
        self.client.post("/pause", {}, params={"mode": "wait"})
        self.client.post("/start_weight_update", {})
        for chunk in chunks:
            self.client.post("/update_weights", {"update_info": chunk})
        self.client.post("/finish_weight_update", {"weight_version": str(version)})
        self.client.post("/reset_prefix_cache", {})  # cached prompt blocks hold keys and values of the old weights
        self.client.post("/resume", {})

    def _served_probe(self) -> list[float]:
        engine = self.probe_logprobs()
        if engine is None:
            raise AssayError(f"server {self.client.base} returns no prompt logprobs, so the weight sync cannot be checked; "
                             "set rollout.verify_sync=false to push without checking")
        return engine

    def probe_logprobs(self) -> list[float] | None:
        """The server's log p(probe[t] | probe[:t]) (vLLM's `prompt_logprobs`), or None when it has none."""
        body = {"model": self.served, "prompt": self.probe, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        steps = self.client.post("/v1/completions", body)["choices"][0].get("prompt_logprobs")
        if not steps:
            return None
        return [step[str(tok)]["logprob"] for tok, step in zip(self.probe[1:], steps[1:])]

    def metrics(self) -> dict[str, float]:
        """`engine/sync_s`, `engine/sync_diff_mean|max` (pushes), `engine/staleness`; then cleared."""
        out, self._metrics = self._metrics, {}
        return out

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- generation --------------------------------------------------------------------
    def generate(self, samples: list[Sample], n: int, params: SamplingParams, generator: torch.Generator | None = None) -> list[Trajectory]:
        """`n` completions per prompt, grouped prompt by prompt, one request per prompt."""
        prompt_ids = [encode_prompt(self.tokenizer, s) for s in samples]
        seed = None if generator is None else int(torch.randint(0, 2**30, (1,), device="cpu", generator=generator_for(generator, "cpu")))
        bodies = [self._body(ids, n, params, None if seed is None else seed + i * n) for i, ids in enumerate(prompt_ids)]
        answers = list(self.pool.map(lambda b: self.client.post("/v1/completions", b), bodies))
        trajs = []
        for g, (sample, ids, answer) in enumerate(zip(samples, prompt_ids, answers)):
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            trajs.extend(self._trajectory(sample, ids, c, g) for c in choices)
        if len(trajs) != len(samples) * n:
            raise AssayError(f"server {self.client.base} returned {len(trajs)} completions for {len(samples)} prompts × {n}")
        return trajs

    def _body(self, ids: list[int], n: int, params: SamplingParams, seed: int | None) -> dict[str, Any]:
        body = {"model": self.served, "prompt": ids, "n": n, "max_tokens": params.max_new_tokens, "temperature": params.temperature,
                "top_p": params.top_p, "logprobs": 0, "return_token_ids": True, "stop_token_ids": [self.eos_id],
                "skip_special_tokens": False}
        if seed is not None:
            body["seed"] = seed
        return body

    def _trajectory(self, sample: Sample, prompt_ids: list[int], choice: dict[str, Any], group: int) -> Trajectory:
        lp = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        if ids is None:
            if not lp and choice.get("text"):
                raise AssayError(f"server {self.client.base} returned completions without their tokens' logprobs (the request asks for "
                                 "them, `logprobs: 0`); rollout.backend=openai needs a server that returns them (vLLM, assay serve model)")
            ids = self._ids_of(lp.get("tokens") or [])
        logprobs = [float(x) for x in (lp.get("token_logprobs") or [])]
        if len(logprobs) != len(ids):
            raise AssayError(f"server {self.client.base} returned {len(logprobs)} logprobs for {len(ids)} tokens")
        finished = choice.get("finish_reason") == "stop"
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Trajectory(sample, text, list(prompt_ids), list(ids), logprobs, finished, group=group, version=self.version,
                          finish_reason=choice.get("finish_reason") or ("stop" if finished else "length"))

    def _ids_of(self, tokens: list[str]) -> list[int]:
        ids = self.tokenizer.convert_tokens_to_ids(tokens)
        unknown = self.tokenizer.unk_token_id
        if any(i is None or (i == unknown and t != self.tokenizer.unk_token) for i, t in zip(ids, tokens)):
            raise AssayError(f"server {self.client.base} returned no token ids and token strings outside the tokenizer's "
                             "vocabulary; use a server that supports return_token_ids (vLLM)")
        return list(ids)

    def _check_temperature(self, model, temperature: float) -> None:
        """Stop when the server's logprobs are the untempered ones (a vLLM server without `--logprobs-mode processed_logprobs`):
        four completions of the probe's start, sampled at the run's temperature from the server that now holds the learner's
        weights, scored by the learner at that temperature and at 1."""
        from assay.rollout.base import pad_id
        from assay.batch import collate
        from assay.models.logprobs import token_logprobs
        from assay.types import RewardResult

        prompt = self.probe[:8]
        answer = self.client.post("/v1/completions", self._body(prompt, 4, SamplingParams(8, temperature), seed=0))
        trajs = [self._trajectory(Sample("temperature-check", ""), prompt, c, 0) for c in answer["choices"]]
        trajs = [t for t in trajs if t.completion_ids]
        if not trajs:
            return
        batch = collate(trajs, [RewardResult(0.0)] * len(trajs), pad_id(self.tokenizer), next(model.parameters()).device)
        served = torch.nn.utils.rnn.pad_sequence([torch.tensor(t.logprobs, dtype=torch.float32, device="cpu") for t in trajs], batch_first=True)
        width = served.shape[1]
        with torch.no_grad():
            gaps = [float(((token_logprobs(model, batch, t, fast=False)[0][:, :width].cpu() - served) * batch.mask[:, :width].cpu()).abs().sum())
                    for t in (temperature, 1.0)]
        if gaps[1] < gaps[0]:
            raise AssayError(f"server {self.client.base} returns logprobs before temperature (vLLM's default); start it with "
                             "--logprobs-mode processed_logprobs so they are the sampled distribution's")
