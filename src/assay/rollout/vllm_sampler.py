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
from assay.models.lora import merged_weights
from assay.rollout.base import SamplingParams, encode_prompt
from assay.rollout.sync import check_sync, learner_probe_logprobs, probe_ids, tolerance_for
from assay.training.dist import engine_weights, is_sharded
from assay.types import Sample, Trajectory

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
        "max_model_len": int(getattr(model.config, "max_position_embeddings", 2048)),
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
        self.probe = probe_ids(model.config.vocab_size)
        self._folder = tempfile.TemporaryDirectory(prefix="assay-vllm-")
        model.config.save_pretrained(self._folder.name)
        kwargs = engine_kwargs(model, self._folder.name, self.device, self.sleep_mode, rollout.engine_args)
        try:
            with process_state_kept():
                self.llm = LLM(**kwargs)
        except (ValueError, RuntimeError, TypeError) as e:
            self._folder.cleanup()
            raise AssayError(f"rollout.backend=vllm: the engine did not start: {str(e).splitlines()[0]}") from None
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
        self._wake(["kv_cache"])
        self.model, self.version = model, version
        self._metrics["engine/sync_s"] = time.perf_counter() - t0
        if self.verify:
            self._metrics.update(self.check(model))

    def check(self, model) -> dict[str, float]:
        """The probe check against `model` (`assay.rollout.sync.check_sync`); raises when they differ."""
        return check_sync(self.probe_logprobs(), learner_probe_logprobs(model, self.probe), self.tolerance, "vLLM engine", self.version)

    def probe_logprobs(self) -> list[float]:
        """The engine's log p(probe[t] | probe[:t]), t = 1 … L−1 (prompt logprobs: temperature 1)."""
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        params = VSP(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=self.probe)], params, use_tqdm=False)[0]
        return [step[tok].logprob for tok, step in zip(self.probe[1:], out.prompt_logprobs[1:])]

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
        from vllm.inputs import TokensPrompt

        self.wake()
        prompt_ids = [encode_prompt(self.tokenizer, s) for s in samples]
        greedy = params.temperature <= 0
        per_request = 1 if greedy else n  # vLLM refuses n > 1 when greedy; the copies would be equal anyway
        seed = None if generator is None else int(torch.randint(0, 2**30, (1,), device="cpu", generator=generator_for(generator, "cpu")))
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
        sps = [self._params(params, per_request, None if seed is None else seed + i * per_request) for i in range(len(samples))]
        outs = self.llm.generate(requests, sps, use_tqdm=False)
        trajs = []
        for g, (sample, ids, out) in enumerate(zip(samples, prompt_ids, outs)):
            completions = sorted(out.outputs, key=lambda c: c.index) * (n if greedy else 1)
            trajs.extend(self._trajectory(sample, ids, c, g) for c in completions)
        return trajs

    def _params(self, params: SamplingParams, n: int, seed: int | None):
        from vllm import SamplingParams as VSP

        return VSP(n=n, temperature=max(params.temperature, 0.0), top_p=params.top_p, max_tokens=params.max_new_tokens, logprobs=0,
                   seed=seed, stop_token_ids=[self.eos_id], detokenize=False)

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
