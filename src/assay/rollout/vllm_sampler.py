"""`rollout.backend=vllm`: a vLLM engine in the training process, synced in place after each update.

The engine is built from the policy's config alone (`load_format="dummy"`, no tokenizer:
assay gives it token ids and decodes what it returns), then takes the learner's weights
through vLLM's in-place reload (`Worker.reload_weights(weights_iterator=...)`, the layerwise
reload that also re-runs each layer's post-load processing, such as the CPU backend's
repacked GEMM weights). The same path runs after every optimizer step; nothing is written
to disk. Every sync is checked: the engine's logprobs of a fixed probe must equal the
learner's (`assay.rollout.sync`).

What the engine reports, and why it equals what the learner computes:
- token ids in and out (`TokensPrompt`; the sampled ids, EOS included);
- logprobs with `logprobs_mode="processed_logprobs"`: vLLM's default (`raw_logprobs`) is
  log-softmax of the raw logits, *before* temperature; the processed ones are taken after
  temperature (and after top-k/top-p, so with `top_p < 1` they are the logprobs of the
  truncated distribution the token was actually drawn from, which is what importance
  weights need); with `top_p = 1` they are log softmax(logits / T), the learner's numbers;
- the engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so the weights are
  handed over as tensors, with no copy through a socket.

On a CUDA device the engine sleeps during the update (vLLM's sleep mode, level 1: weights
offloaded, KV cache dropped) and `update_weights` wakes it weights first, loads the new
ones, then wakes the KV cache; the probe check runs after, so a sync skipped by sleep mode
cannot go unnoticed.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import time
from typing import Any, Iterable, Iterator

import torch

from assay.devices import generator_for
from assay.errors import AssayError
from assay.models import context_length, save_tokenizer, text_config
from assay.models.lora import merged_weights
from assay.rollout.base import SamplingParams, encode_prompt, render_chat
from assay.rollout.sync import check_sync, learner_probe_logprobs, picture_probe, probe_ids, tolerance_for
from assay.training.dist import engine_weights, is_sharded
from assay.types import Sample, Trajectory
from assay.vision.inputs import encode_sample, has_images, image_parts, placeholder_ids

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: the engines alive in this process (ids of their samplers)
_LIVE: set[int] = set()
#: KV cache of the engine on a CPU (vLLM otherwise sizes it from the machine's whole memory)
CPU_KV_CACHE_BYTES = 1 << 30


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """Build an in-process engine without it changing the trainer's process.

    vLLM's CPU worker replaces `torch.set_num_threads` and drops torch to one thread (right
    for a serving process, not for a learner that shares it), and every worker reseeds the
    global RNGs; all of that is put back. `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the
    engine core in this process.
    """
    import numpy as np

    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    rng, py_rng, np_rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
        random.setstate(py_rng)
        np.random.set_state(np_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        if saved is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


def engine_kwargs(model: Any, folder: str, device: torch.device, sleep: bool, extra: dict[str, Any]) -> dict[str, Any]:
    """`vllm.LLM(**kwargs)` for `model`'s architecture in `folder` (config only; weights come by sync)."""
    dtype = next(model.parameters()).dtype
    if dtype not in DTYPES:
        raise AssayError(f"rollout.backend=vllm: the policy's dtype {dtype} is not one vLLM runs ({', '.join(DTYPES.values())})")
    kwargs: dict[str, Any] = {
        "model": folder, "load_format": "dummy", "skip_tokenizer_init": True, "dtype": DTYPES[dtype], "seed": 0,
        "logprobs_mode": "processed_logprobs", "generation_config": "vllm",
        "max_model_len": context_length(model) or 2048,
    }
    if device.type == "cpu":
        kwargs.update(enforce_eager=True, kv_cache_memory_bytes=CPU_KV_CACHE_BYTES)
    else:
        kwargs.update(gpu_memory_utilization=0.3, enable_sleep_mode=sleep)
    kwargs.update(extra)
    return kwargs


class VLLMSampler:
    """Generates with a colocated vLLM engine (the `Sampler` interface); see the module docstring.

    Args:
        model, tokenizer: the learner's policy (its weights are synced into the engine at
            once and after every `update_weights`) and its tokenizer (prompts are encoded
            with `encode_prompt`; completions decoded here).
        rollout: the run's `rollout` section (`engine_args`, `sleep`, `verify_sync`, `sync_tolerance`).
        device: the learner's device; the engine runs on the same kind.
    """

    def __init__(self, model, tokenizer, rollout, device: str | torch.device = "cpu"):
        from vllm import LLM

        self.tokenizer, self.device = tokenizer, torch.device(device)
        self.eos_id = tokenizer.eos_token_id
        self.verify, self.tolerance = rollout.verify_sync, tolerance_for(model, rollout.sync_tolerance)
        self.sleep_mode = rollout.sleep if rollout.sleep is not None else self.device.type == "cuda"
        self.sleeping: set[str] = set()
        self.probe = probe_ids(text_config(model).vocab_size, avoid=placeholder_ids(model))
        self.vision = getattr(model, "policy_kind", "text") == "vision"
        banned = set(placeholder_ids(model))  # never sampled (`assay.vision.inputs.placeholder_ids`)
        self.allowed = [i for i in range(text_config(model).vocab_size) if i not in banned] if banned else None
        self._folder = tempfile.TemporaryDirectory(prefix="assay-vllm-")
        model.config.save_pretrained(self._folder.name)
        extra = dict(rollout.engine_args)
        if self.vision:  # vLLM's multimodal processor needs the tokenizer and the processor's files (no skip_tokenizer_init)
            save_tokenizer(tokenizer, self._folder.name)
            extra = {"skip_tokenizer_init": False, "limit_mm_per_prompt": {"image": 4}, **extra}
        kwargs = engine_kwargs(model, self._folder.name, self.device, self.sleep_mode, extra)
        self.picture_probe = self._request(picture_probe()) if self.vision else None
        try:
            with process_state_kept():
                self.llm = LLM(**kwargs)
        except (ValueError, RuntimeError, TypeError) as e:
            self._folder.cleanup()
            hint = ""
            if self.vision and "failed to be inspected" in str(e):
                hint = (" (vLLM could not import its implementation of this vision-language architecture; several, LLaVA and "
                        "Qwen2-VL among them, need torchvision, which this environment lacks: install the torchvision that matches torch)")
            raise AssayError(f"rollout.backend=vllm: the engine did not start: {str(e).splitlines()[0]}{hint}") from None
        _LIVE.add(id(self))
        self._metrics: dict[str, float] = {}
        self.version = -1
        self.update_weights(model, 0)

    # -- weights -----------------------------------------------------------------------
    def update_weights(self, model, version: int) -> None:
        """Load `model`'s weights into the engine in place, check them with the probe, stamp `version`."""
        t0 = time.perf_counter()
        self._wake(["weights"])
        # every name, tied ones included: vLLM's layerwise reload processes its LM head only when
        # `lm_head.weight` arrives, and a tied copy left out keeps the engine's old values there
        if is_sharded(model):  # a torchrun rank's FSDP2 shards: gathered and handed over one unit at a time
            weights: Iterable[tuple[str, torch.Tensor]] = engine_weights(model)
        else:
            weights = merged_weights(model)  # a LoRA policy's layers as W + s·B·A (assay.models.lora)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()  # cached prompt blocks hold keys and values of the old weights
        if self.vision:  # and cached picture features were computed by the old vision tower
            self.llm.llm_engine.reset_encoder_cache()
        self._wake(["kv_cache"])
        self.model, self.version = model, version
        self._metrics["engine/sync_s"] = time.perf_counter() - t0
        if self.verify:
            self._metrics.update(self.check(model))

    def check(self, model) -> dict[str, float]:
        """The probe check against `model` (`assay.rollout.sync.check_sync`); raises when they differ.

        A vision-language policy's check also scores a fixed prompt with a picture (`picture_probe`), through the vision tower.
        """
        learner = learner_probe_logprobs(model, self.probe)
        if self.picture_probe is not None:
            learner += learner_probe_logprobs(model, self.picture_probe[0], self.picture_probe[1])
        return check_sync(self.probe_logprobs(), learner, self.tolerance, "vLLM engine", self.version)

    def probe_logprobs(self) -> list[float]:
        """The engine's log p(probe[t] | probe[:t]), t = 1 … L−1 (prompt logprobs: temperature 1); then the picture probe's."""
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        params = VSP(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        probes = [(self.probe, TokensPrompt(prompt_token_ids=self.probe))]
        if self.picture_probe is not None:
            probes.append((self.picture_probe[0], self.picture_probe[2]))
        outs = self.llm.generate([request for _, request in probes], params, use_tqdm=False)
        return [step[tok].logprob for (ids, _), out in zip(probes, outs) for tok, step in zip(ids[1:], out.prompt_logprobs[1:])]

    def metrics(self) -> dict[str, float]:
        """`engine/sync_s` (seconds of the last sync), `engine/sync_diff_mean|max` (its probe check); then cleared."""
        out, self._metrics = self._metrics, {}
        return out

    # -- memory ------------------------------------------------------------------------
    def sleep(self) -> None:
        """Offload the weights and drop the KV cache (sleep mode, on a GPU); a no-op otherwise."""
        if self.sleep_mode and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = {"weights", "kv_cache"}

    def wake(self) -> None:
        self._wake(["weights", "kv_cache"])

    def _wake(self, tags: list[str]) -> None:
        todo = [t for t in tags if t in self.sleeping]
        if todo:
            self.llm.wake_up(tags=todo)
            self.sleeping -= set(todo)

    def close(self) -> None:
        """Shut the engine down and free its memory.

        In-process engines share vLLM's process-wide distributed state, and shutting one
        down tears that state down; so only the last one alive shuts down, the others are
        let go (their memory is freed when collected).
        """
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        del self.llm
        _LIVE.discard(id(self))
        core = llm.llm_engine.engine_core
        if _LIVE:  # its finalizer would shut the engine core down, state and all, when it is collected
            finalizer = getattr(core, "_finalizer", None)
            if finalizer is not None:
                finalizer.detach()
        else:
            with contextlib.suppress(Exception):
                core.shutdown()
        del llm, core
        if not _LIVE:
            shutdown_vllm_state()
        self._folder.cleanup()

    # -- generation --------------------------------------------------------------------
    def generate(self, samples: list[Sample], n: int, params: SamplingParams, generator: torch.Generator | None = None) -> list[Trajectory]:
        """`n` completions per prompt, grouped prompt by prompt; `generator` seeds the engine's requests."""

        self.wake()
        requests, prompt_ids, vision = [], [], []
        for s in samples:
            ids, pictures, request = self._request(s)
            requests.append(request)
            prompt_ids.append(ids)
            vision.append(pictures)
        greedy = params.temperature <= 0
        per_request = 1 if greedy else n  # vLLM refuses n > 1 when greedy; the copies would be equal anyway
        seed = None if generator is None else int(torch.randint(0, 2**30, (1,), device="cpu", generator=generator_for(generator, "cpu")))
        sps = [self._params(params, per_request, None if seed is None else seed + i * per_request) for i in range(len(samples))]
        outs = self.llm.generate(requests, sps, use_tqdm=False)
        trajs = []
        for g, (sample, ids, out) in enumerate(zip(samples, prompt_ids, outs)):
            if vision[g] is not None and list(out.prompt_token_ids) != ids:
                raise AssayError(f"rollout.backend=vllm: prompt id {sample.id!r}: the engine expanded the pictures into "
                                 f"{len(out.prompt_token_ids)} prompt tokens, the model's processor into {len(ids)}; they must be the same tokens")
            completions = sorted(out.outputs, key=lambda c: c.index) * (n if greedy else 1)
            for c in completions:
                t = self._trajectory(sample, ids, c, g)
                if vision[g] is not None:
                    t.info["vision"] = vision[g]
                trajs.append(t)
        return trajs

    def _request(self, sample: Sample):
        """`(prompt ids as the learner sees them, the processor's outputs or None, the engine's request)`.

        A prompt with pictures goes to the engine as its chat template renders it, one placeholder a
        picture, with the pictures beside it: vLLM expands the placeholders itself (given ids already
        expanded, it would expand them again); `generate` checks that its expansion equals the processor's.
        """
        from vllm.inputs import TokensPrompt

        if sample.vision is not None:
            raise AssayError(f"rollout.backend=vllm: prompt id {sample.id!r} is a turn of an episode that showed pictures; "
                             "such episodes run on rollout.backend=torch (docs/multimodal.md)")
        if not has_images(sample) or sample.prompt_ids is not None:
            ids = encode_prompt(self.tokenizer, sample)
            return ids, None, TokensPrompt(prompt_token_ids=ids)
        ids, vision = encode_sample(self.tokenizer, sample)
        short = render_chat(self.tokenizer, sample.prompt, sample.template_args or {}, sample.id)
        pictures = [p["image"] for p in image_parts(sample.prompt)]
        return ids, vision, TokensPrompt(prompt_token_ids=short, multi_modal_data={"image": pictures if len(pictures) > 1 else pictures[0]})

    def _params(self, params: SamplingParams, n: int, seed: int | None):
        from vllm import SamplingParams as VSP

        return VSP(n=n, temperature=max(params.temperature, 0.0), top_p=params.top_p, max_tokens=params.max_new_tokens, logprobs=0,
                   seed=seed, stop_token_ids=[self.eos_id], detokenize=False, allowed_token_ids=self.allowed)

    def _trajectory(self, sample: Sample, prompt_ids: list[int], c: Any, group: int) -> Trajectory:
        ids = list(c.token_ids)
        logprobs = [step[tok].logprob for tok, step in zip(ids, c.logprobs)]
        finished = bool(ids) and ids[-1] == self.eos_id
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Trajectory(sample, text, list(prompt_ids), ids, logprobs, finished, group=group, version=self.version)


def shutdown_vllm_state() -> None:
    """Tear down the process-wide state an in-process engine leaves, so another can start later."""
    import gc

    with contextlib.suppress(Exception):
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
