"""The in-process torch sampler (`rollout.backend=torch`): batched generation with a KV cache.

Each prompt is prefilled once and its cache is shared by its G completions; finished
sequences leave the batch, so late steps only pay for sequences still running. The
sampler records the logprob of every token it draws, under the same temperature the
trainer uses, so the trainer can score exactly what was sampled and needs no second
pass to get the old policy's logprobs.

Two decoding paths give the same tokens and logprobs: `StaticDecoder`
(`assay.rollout.decoder`, a preallocated cache, for the Llama family) and the generic
Hugging Face path with a `DynamicCache` for every other model. `TorchSampler.path` says
which one a model gets.

On a CUDA device the loop never waits for the device between tokens: a token is drawn
without reading anything back (`_pick`), bookkeeping is tensor arithmetic on the device, and
whether any row is still running is read back only every `check_every` steps. The batch
keeps its rows (finished ones are ignored, not dropped), so each step has the same shapes
and `StaticDecoder` replays it as a CUDA graph (`cuda_graphs`). On a CPU, where reading
back costs nothing, finished rows leave the batch as before.
"""

from __future__ import annotations

import warnings

import torch

from assay.devices import generator_for, release_memory
from assay.models.llama import supported
from assay.rollout.base import SAMPLERS, SamplingParams, encode_prompt, pad_id, stop_ids
from assay.rollout.decoder import StaticDecoder, cache_arg, compile_failed, compiled_calls, hf_prefill, unviewed
from assay.types import Sample, Trajectory
from assay.vision.inputs import VisionInputs, encode_sample, has_images, placeholder_ids


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = [[pad] * (width - len(r)) + list(r) for r in rows]
    mask = [[0] * (width - len(r)) + [1] * len(r) for r in rows]
    return torch.tensor(ids, dtype=torch.long, device="cpu"), torch.tensor(mask, dtype=torch.long, device="cpu")


def _pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None,
          banned: torch.Tensor | None = None, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return (tokens [A], logprobs [A]) under the sampling temperature.

    `banned`: token ids masked out of the distribution (a vision-language model's picture placeholders).
    `fused`: draw through `torch.compile` (`rollout.compile`; the same tokens, logprobs to rounding).

    The draw is the exponential race, argmax of p / q with q ~ Exp(1), which is how
    `torch.multinomial` draws one sample (the same tokens for the same generator state) but
    without its validity checks, which read values back from the device at every call.

    At a large vocabulary this is a step's largest traffic after the weights: each pass over
    `[A, V]` fp32 values at the 0.5B benchmark shape (128 rows × 151,936) moves 78 MB. Eagerly,
    five passes: the probabilities (read straight from bf16 logits), the race's draws, their
    quotient and its argmax; the drawn token's logprob is the log of its probability (no
    `[A, V]` log-softmax). `fused` leaves only the race's draws and two reading passes.
    """
    if banned is not None:
        logits = logits.index_fill(-1, banned, float("-inf"))
    if params.temperature <= 0:
        tok = logits.argmax(dim=-1)
        return tok, torch.log_softmax(logits, dim=-1, dtype=torch.float32).gather(-1, tok[:, None])[:, 0]
    race = None
    if fused and params.top_p >= 1.0:
        race = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(generator=generator_for(gen, logits.device))
        drawn = _fused_race(logits, race, params.temperature)
        if drawn is not None:
            return drawn
    if params.temperature != 1.0:
        logits = logits.float() / params.temperature
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [A, V]
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        kept = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    else:
        kept = probs
    if race is None:
        race = torch.empty_like(probs).exponential_(generator=generator_for(gen, probs.device))
    tok = torch.div(kept, race, out=race).argmax(dim=-1)
    return tok, probs.gather(-1, tok[:, None])[:, 0].log()


def _race(logits: torch.Tensor, race: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The exponential race over `softmax(logits / temperature)` with the draws `race` `[A, V]`: (tokens, logprobs)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    tok = (logp.exp() / race).argmax(dim=-1)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


_COMPILED_RACE = None


def _fused_race(logits: torch.Tensor, race: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`_race` through `torch.compile` (made on first use, shared by every sampler), or None once compiling it has failed."""
    global _COMPILED_RACE
    if _COMPILED_RACE is False:
        return None
    try:
        with compiled_calls():
            if _COMPILED_RACE is None:
                _COMPILED_RACE = torch.compile(_race, dynamic=True)
            return _COMPILED_RACE(unviewed(logits), race, temperature)
    except Exception as e:  # Inductor's failures have many types; the eager draw takes the same race
        _COMPILED_RACE = False
        compile_failed("the token draw", "drawing eagerly", e, stacklevel=3)
        return None


class _HFStepper:
    """Decoding through the model's own forward with a growing `DynamicCache` (any causal LM)."""

    def __init__(self, model):
        self.model = model
        self.cache_arg = cache_arg(model)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, repeat: int, max_new_tokens: int, **inputs) -> torch.Tensor:
        logits, self.cache = hf_prefill(self.model, ids, mask, **inputs)
        if repeat > 1:
            self.cache.batch_repeat_interleave(repeat)
        self.mask = mask.repeat_interleave(repeat, 0)
        return logits

    def select(self, idx: torch.Tensor) -> None:
        self.cache.batch_select_indices(idx)
        self.mask = self.mask[idx]

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        out = self.model(input_ids=tok[:, None], attention_mask=self.mask, position_ids=pos, use_cache=True, **{self.cache_arg: self.cache})
        return out.logits[:, -1]


class TorchSampler:
    """Generates completions with a Hugging Face causal LM in this process (the `Sampler` interface).

    It shares the learner's model object, so a weight update is seen at once:
    `update_weights` only records the new policy version (and takes a different model
    object when given one); `sleep` hands cached device memory back before the update;
    `wake` and `close` have nothing to do.

    Args:
        model, tokenizer: the policy and its tokenizer (left padding is applied here).
        device: where the prompts go; the model must already be there (default: the model's device).
        fast: use `StaticDecoder` when the model supports it (set False to force the
            generic Hugging Face path, for example to compare the two).
        compact_frac: finished rows are dropped from the batch once at least this fraction
            of the running rows has finished (dropping copies the cache); 0 never drops them.
            Default: 0.25 on a CPU, 0 elsewhere (a fixed batch never reads back which rows run).
        cuda_graphs: on a CUDA device, replay `StaticDecoder`'s step as a CUDA graph.
        compile: run `StaticDecoder`'s step through `torch.compile` (fewer, fused kernels; the
            first call compiles, which takes tens of seconds).
        check_every: read back whether any row still runs every this many steps (each read
            waits for the device; at most this many steps are wasted at the end). Default: 1
            on a CPU (reading back is free there), 16 elsewhere.
    """

    def __init__(self, model, tokenizer, device: str | torch.device | None = None, fast: bool = True, compact_frac: float | None = None,
                 cuda_graphs: bool = True, check_every: int | None = None, compile: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.stop = torch.tensor(stop_ids(model, tokenizer), dtype=torch.long, device=self.device)  # EOS, end of turn
        self.pad_id = pad_id(tokenizer)
        held = placeholder_ids(model)  # a VLM's picture placeholders: never sampled
        self.banned = torch.tensor(held, dtype=torch.long, device=self.device) if held else None
        on_cpu = self.device.type == "cpu"
        self.fast = fast
        self.compact_frac = compact_frac if compact_frac is not None else (0.25 if on_cpu else 0.0)
        self.check_every = max(1, check_every if check_every is not None else (1 if on_cpu else 16))
        self.cuda_graphs, self.compile = cuda_graphs, compile
        self.version = 0

    def update_weights(self, model, version: int) -> None:
        """The learner updated `model` in place (the same object this sampler holds): record the version."""
        self.model = model
        self.version = version

    def sleep(self) -> None:
        """Between rollout and update: what generation cached on the device goes back to it."""
        release_memory(self.device)

    def wake(self) -> None:
        pass

    def close(self) -> None:
        release_memory(self.device)

    @property
    def path(self) -> str:
        """`static` (StaticDecoder) or `hf` (generic), with the reason when the fast path is not taken.

        Judged without a length; `generate` also takes the fast path for a sliding-window
        model when its sequences fit in the window. `+cuda-graph` when steps are replayed as a CUDA graph.
        """
        why = supported(self.model) if self.fast else "fast=False"
        if why is not None:
            return f"hf ({why})"
        return "static" + ("+compiled" if self.compile else "") + ("+cuda-graph" if self._graphs else "")

    @property
    def _graphs(self) -> bool:
        return self.cuda_graphs and self.device.type == "cuda"

    def encode(self, samples: list[Sample]) -> list[list[int]]:
        return self._encode_all(samples)[0]

    def _encode_all(self, samples: list[Sample]) -> tuple[list[list[int]], list[dict | None]]:
        """Each prompt's ids and, for a prompt with pictures, its processor outputs (`assay.vision.inputs`)."""
        pairs = [(list(s.prompt_ids), s.vision) if s.prompt_ids is not None else encode_sample(self.tokenizer, s) if has_images(s)
                 else (encode_prompt(self.tokenizer, s), None) for s in samples]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    @torch.no_grad()
    def generate(self, samples: list[Sample], n: int, params: SamplingParams, generator: torch.Generator | None = None) -> list[Trajectory]:
        """Sample `n` completions per prompt; trajectories come grouped, prompt by prompt.

        `generator` is the caller's stream, on any device: a draw on this sampler's device uses
        one seeded from it (`assay.devices.generator_for`).
        """
        was_training = self.model.training
        if was_training:  # a Hugging Face model's train()/eval() walks every module: ~1 ms, so only when it changes
            self.model.eval()
        prompt_ids, vision = self._encode_all(samples)
        inputs = VisionInputs.collate(vision, self.device).kwargs() if any(v is not None for v in vision) else {}
        try:
            tokens, logprobs, lengths = self._decode(prompt_ids, n, params, generator_for(generator, self.device), **inputs)
        finally:
            if was_training:
                self.model.train()
        stop = set(self.stop.tolist())
        finished = [tokens[r][k - 1] in stop for r, k in enumerate(lengths)]  # ended on EOS, not on the limit
        trajs = []
        for row in range(len(samples) * n):
            g, k = row // n, lengths[row]
            ids_row = tokens[row][:k]
            text = self.tokenizer.decode(ids_row, skip_special_tokens=True)
            info = {"vision": vision[g]} if vision[g] is not None else {}
            trajs.append(Trajectory(samples[g], text, prompt_ids[g], ids_row, logprobs[row][:k], finished[row], group=g, version=self.version, info=info))
        return trajs

    def _capture(self, stepper: StaticDecoder, tok: torch.Tensor, pos: torch.Tensor):
        """The decoder's step as a CUDA graph, or False (steps run eagerly) when this model's step cannot be captured."""
        try:
            return stepper.graphed(tok, pos)
        except RuntimeError as e:
            warnings.warn(f"assay: the torch sampler cannot record a decoding step as a CUDA graph ({str(e).splitlines()[0]}); "
                          "decoding eagerly (rollout.cuda_graphs=false skips the attempt)", stacklevel=2)
            self.cuda_graphs = False
            return False

    def _decode(self, prompt_ids: list[list[int]], n: int, params: SamplingParams, gen: torch.Generator | None, **inputs):
        """Token ids `[B][steps]`, their logprobs and each row's length, as lists (the one read-back of the call).

        `inputs`: what else the model's forward takes for the prompts (a VLM's `pixel_values`), given at the prefill only.
        """
        dev = self.device
        ids, mask = _left_pad(prompt_ids, self.pad_id)
        fast = self.fast and not inputs and supported(self.model, max_len=ids.shape[1] + params.max_new_tokens) is None
        stepper = StaticDecoder(self.model, self.compile) if fast else _HFStepper(self.model)
        ids, mask = ids.to(dev), mask.to(dev)
        logits = stepper.prefill(ids, mask, n, params.max_new_tokens, **inputs)
        if n > 1:
            logits = logits.repeat_interleave(n, 0)
        graphs = fast and self._graphs
        compact = 0.0 if graphs else self.compact_frac  # a recorded step keeps its batch
        total, steps = len(prompt_ids) * n, params.max_new_tokens
        tokens = torch.full((total, steps), self.pad_id, dtype=torch.long, device=dev)
        logprobs = torch.zeros((total, steps), dtype=torch.float32, device=dev)
        lengths = torch.full((total,), steps, dtype=torch.long, device=dev)
        next_pos = mask.sum(-1, keepdim=True).repeat_interleave(n, 0)  # [B, 1]
        active = torch.arange(total, device=dev)  # batch rows still in the cache
        running = torch.ones(total, dtype=torch.bool, device=dev)  # of those, not finished yet
        graph = None
        for step in range(steps):
            tok, lp = _pick(logits, params, gen, self.banned, fused=self.compile)
            # a finished row's column is padding: written as such, with no read-back of which rows run
            tokens[:, step].index_copy_(0, active, torch.where(running, tok, self.pad_id))
            logprobs[:, step].index_copy_(0, active, torch.where(running, lp, 0.0))
            ended = running & torch.isin(tok, self.stop)
            lengths.index_copy_(0, active, torch.where(ended, step + 1, lengths.index_select(0, active)))
            running = running & ~ended
            if step == steps - 1:
                break
            if (step + 1) % self.check_every == 0:
                alive = int(running.sum())
                if alive == 0:
                    break
                if compact and alive <= (1 - compact) * running.numel():
                    keep = running.nonzero()[:, 0]
                    stepper.select(keep)
                    active, tok, next_pos, running = active[keep], tok[keep], next_pos[keep], running[keep]
            if graphs and graph is None:
                graph = self._capture(stepper, tok, next_pos)
            logits = graph.step(tok, next_pos) if graph else stepper.step(tok, next_pos)
            next_pos = next_pos + 1
        if fast and self.compile and not stepper.compile:  # compiling failed (and warned): later calls do not try again
            self.compile = False
        return tokens.tolist(), logprobs.tolist(), lengths.tolist()


@SAMPLERS.register("torch")
def torch_sampler(model, tokenizer, rollout=None, device="cpu") -> TorchSampler:
    """The in-process sampler over the learner's own model."""
    return TorchSampler(model, tokenizer, device, cuda_graphs=getattr(rollout, "cuda_graphs", True), compile=getattr(rollout, "compile", False))
