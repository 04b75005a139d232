"""`ShardedTrainer`: one rank of `torchrun --nproc-per-node N -m assay train ...` (see `assay.training.dist`).

It is `Trainer` with the steps that differ when N processes share a run:

- rollout: a rank generates and scores its share of the step's prompts (whole groups), holding
  the policy's whole weights only while it generates; the trajectories and rewards are gathered
  so every rank continues with the whole step, as one process would have;
- update: each rank trains on its share of every minibatch's groups with the minibatch's own
  denominator, FSDP2 summing the gradients; every rank runs exactly one forward and backward per
  minibatch (a rank without rows in one runs a masked row), so their collectives pair up;
- evaluation: each rank evaluates its share of the held-out problems; the figures are combined;
- signals: a step is never torn; at each step's end the ranks agree whether any was signalled,
  and all stop at the same step with one checkpoint;
- checkpoints: sharded (`dist.save_sharded`), a rank's random stream in its own file, the rest
  written once by rank 0; `--resume` reads them into any number of ranks, and reads a
  single-process checkpoint too. `final/` is assembled on rank 0 as one Hugging Face folder. A LoRA
  policy (`model.lora`) is sharded whole, base and adapters; its checkpoints hold the adapters alone and its
  `final/` is the adapter folder one process writes.

With `rollout.backend=vllm` every rank generates with its own engine, which takes the sharded
weights one FSDP2 unit at a time after each update (`dist.engine_weights`); nothing is gathered
for generation. With `rollout.backend=openai` every rank sends its share to one server, and rank 0
pushes the weights the ranks gather one unit at a time (`OpenAISampler`).

Left out, and refused in one line: a model outside the Llama family with the torch backend (its
generation reads the gathered weights through `StaticDecoder`, without the model's own forward;
an engine or a server generates with any model). Not applied: micro-batches
(`train.micro_batch_mb`; a rank's micro-batch count would have to match the others', so a rank
runs its share of a minibatch whole). The reference policy is replicated on every rank, not sharded;
a critic is sharded as the policy is, fits its share of the groups and checkpoints its own shards
(`dcp-critic/`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
from pathlib import Path
from typing import Any

import torch

from assay.errors import AssayError
from assay.models import save_tokenizer
from assay.models.llama import supported
from assay.models.lora import load_adapter
from assay.training.checkpoint import STATE_FILE, clean_leftovers, extra_stem, prune_checkpoints, publish, rng_state
from assay.training.dist import Ranks, full_state, full_weights, load_full_state, named_optimizer_state, save_sharded, shard, weighted_mean
from assay.training.learner import accumulate_step, policy_step
from assay.training.precision import step_means
from assay.training.rl import Trainer
from assay.training.runs import RUN_FILE, new_run_dir, run_record


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


class ShardedTrainer(Trainer):
    """A `Trainer` for one rank of a `torchrun` job; on its own (no `WORLD_SIZE`) it is a plain `Trainer`."""

    # -- set-up ------------------------------------------------------------------------
    def _join(self) -> Ranks:
        ranks = Ranks.from_env(torch.device(self.cfg.model.device))
        cfg = self.cfg
        if ranks.active:
            if cfg.rollout.backend not in ("torch", "vllm", "openai"):
                raise AssayError(f"torchrun with {ranks.world} processes: rollout.backend={cfg.rollout.backend} is not supported "
                                 "(torch and vllm generate on every rank, openai with one server that every rank sends its share to)")
            if cfg.model.dtype == "float16":  # FSDP2's mixed precision is set up for bf16 only; fp16 would train in fp32 unsaid
                raise AssayError(f"torchrun with {ranks.world} processes: model.dtype=float16 is not supported (sharded training "
                                 "casts to bf16 only; fp16 and its loss scaling run in one process); "
                                 "give model.dtype=bfloat16 or float32")
        return ranks

    def _policy_dtype(self) -> str:
        return "float32" if self.ranks.active else self.cfg.model.dtype  # bf16 comes from FSDP2's mixed precision, over fp32 shards

    def _check_run_dir(self, folder: Path | None) -> None:
        """Nothing yet: rank 0 alone checks and makes the folder (`_new_run_dir`); the others may not see it."""

    def _new_run_dir(self, folder: Path | None) -> Path:
        made: Any = None
        if self.ranks.main:
            try:
                made = new_run_dir(self.cfg, folder)
            except AssayError as e:
                made = e
        made = self.ranks.broadcast(made)
        if isinstance(made, AssayError):
            raise made
        return Path(made)

    def _stream_seed(self) -> int:
        return self.cfg.seed + 1_000_003 * self.ranks.rank  # each rank draws its own completions

    def _place(self) -> None:
        if not self.ranks.active:
            return
        why = supported(self.model) if self.cfg.rollout.backend == "torch" else None  # an engine or a server generates itself
        if why is not None:
            raise AssayError(f"torchrun: the torch backend generates from the gathered weights through assay's Llama-family decoder, "
                             f"which this model cannot take ({why}); rollout.backend=vllm or openai generates with any model")
        bf16 = self.cfg.model.dtype == "bfloat16"
        if self.ref is not None and bf16 and self.adapter is None:  # a LoRA run's reference is the policy, adapters off
            self.ref.to(torch.bfloat16)
        shard(self.model, self.ranks, bf16=bf16)
        for extra in self.extras.values():  # the critic, sharded as the policy is
            extra.shard(self.ranks, bf16)

    def generating(self):
        """The torch sampler reads the policy's whole weights (gathered for the block); an engine holds its own copy."""
        return full_weights(self.model) if self.cfg.rollout.backend == "torch" else contextlib.nullcontext()

    def _guard(self, signals):
        return signals.critical() if self.ranks.active else contextlib.nullcontext()

    def _raise_pending(self, signals) -> None:
        if not self.ranks.active:
            return signals.raise_pending()
        mine = signals.pending
        if self.ranks.any(mine is not None):  # one rank's signal stops every rank at this same step
            signals.pending = None
            raise signals.exception(mine if mine is not None else signal.SIGTERM)

    # -- a step ------------------------------------------------------------------------
    def _sample(self, prompts: list) -> tuple[list, list, float, float]:
        if not self.ranks.active:
            return super()._sample(prompts)
        share = self.ranks.share(len(prompts))
        if share.stop > share.start:
            trajs, results, generate_s, reward_s = super()._sample(prompts[share])
        else:
            with self.generating():  # gathering the weights is collective: every rank takes part
                trajs, results, generate_s, reward_s = [], [], 0.0, 0.0
        parts = self.ranks.gather((share.start, trajs, results, generate_s, reward_s))
        every_trajs, every_results = [], []
        for start, ts, rs, _, _ in parts:
            for t in ts:
                t.group += start  # the prompt's place in the whole step
            every_trajs.extend(ts)
            every_results.extend(rs)
        return every_trajs, every_results, max(p[3] for p in parts), max(p[4] for p in parts)

    def _update(self, batch, advantages) -> dict[str, float]:
        if not self.ranks.active:
            return super()._update(batch, advantages)
        from assay.algos import AGGREGATIONS

        cfg = self.cfg
        self.model.train()
        groups = torch.unique(batch.group)
        mine = groups[self.ranks.share(len(groups))]
        unit = getattr(AGGREGATIONS.get(cfg.algo.aggregation), "unit", None)
        if unit is None:
            raise AssayError(f"torchrun: algo.aggregation={cfg.algo.aggregation!r} declares no unit, so ranks cannot share its denominator")
        agg: dict[str, list[float]] = {}
        B = batch.rewards.shape[0]
        for _ in range(cfg.algo.epochs):
            for idx in torch.arange(B, device=self.device).chunk(cfg.algo.minibatches):
                sub = batch.select(idx)
                total = float(sub.mask.sum()) if unit == "token" else float(idx.numel())
                rows = idx[torch.isin(batch.group[idx], mine)]
                self.weights.zero_grad()
                if rows.numel():
                    m = accumulate_step(self.model, self.ref, batch.select(rows), advantages[rows], cfg.algo, cfg.rollout.temperature,
                                        cfg.rollout.max_new_tokens, 0, cfg.train.fast_forward, False, total=total)
                    share = (float(batch.mask[rows].sum()) if unit == "token" else float(rows.numel())) / max(total, 1.0)
                else:
                    m, share = self._idle_pass(batch.select(idx[:1]), advantages[idx[:1]]), 0.0
                m = weighted_mean(self.ranks, m, share)
                m["actor/grad_norm"] = self.weights.step(cfg.optim.grad_clip)
                for k, v in m.items():
                    agg.setdefault(k, []).append(v)
        self.model.eval()
        return step_means(agg)

    def _idle_pass(self, row, advantage) -> dict[str, float]:
        """A forward and backward that changes no gradient (a masked row), so this rank's collectives pair with the others'."""
        import dataclasses

        masked = dataclasses.replace(row, mask=torch.zeros_like(row.mask))
        loss, _ = policy_step(self.model, self.ref, masked, advantage, self.cfg.algo, self.cfg.rollout.temperature, self.cfg.rollout.max_new_tokens,
                              self.cfg.train.fast_forward)
        (loss * 0.0).backward()
        return {}

    def evaluate(self) -> dict[str, float]:
        heldout = self.source.heldout
        if not self.ranks.active or not heldout:
            return super().evaluate()
        share = self.ranks.share(len(heldout))
        if share.stop > share.start:
            mine = self._evaluate_on(heldout[share])
        else:
            with self.generating():  # the gather is collective: every rank takes part
                mine = {}
        return weighted_mean(self.ranks, mine, float(share.stop - share.start))

    # -- checkpoints -------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        state = super()._state()
        if self.ranks.active:  # the model's and optimizer's state are in the sharded files (the shards are fp32: no masters)
            state.pop("optimizer")
        return state

    def save(self) -> Path:
        if not self.ranks.active:
            return super().save()
        folder = self.ckpt_dir / f"step_{self.step:06d}"
        tmp = folder.with_name(f".tmp-{folder.name}")
        if self.ranks.main:
            self.sink.sync()
            self.samples.sync()
            self.trackers.flush()
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.ranks.barrier()
        save_sharded(tmp, self.model, self.opt, trainable_only=self.adapter is not None)  # a LoRA run: the adapters alone
        for extra in self.extras.values():
            extra.save_shards(tmp)
        torch.save(rng_state(self.generator), tmp / _rng_file(self.ranks.rank))
        state = self._state()
        self.ranks.barrier()
        if self.ranks.main:
            from safetensors.torch import save_file

            save_tokenizer(self.tokenizer, tmp)
            for name, extra in self.extras.items():
                if (t := extra.tensors()) is not None:
                    save_file({k: v.detach().cpu().contiguous() for k, v in t.items()}, tmp / f"{extra_stem(name)}.safetensors")
            (tmp / RUN_FILE).write_text(json.dumps(run_record(self.step, self.evaluated_at, self.cfg), indent=1))
            (tmp / "ranks.json").write_text(json.dumps({"world_size": self.ranks.world}))
            torch.save(state, tmp / STATE_FILE)  # last: a folder with this file is complete
            publish(tmp, folder)
            prune_checkpoints(self.ckpt_dir, self.cfg.train.keep_checkpoints, self.step)
        self.ranks.barrier()
        self._saved_at = self.step
        return folder

    def _clean_checkpoints(self) -> None:
        if self.ranks.main:
            clean_leftovers(self.ckpt_dir)
        self.ranks.barrier()

    def _checkpoint_to_resume(self) -> Path | None:
        """Rank 0 chooses, so that every rank continues from the same step whatever each could read."""
        if not self.ranks.active:
            return super()._checkpoint_to_resume()
        chosen, error = None, None
        if self.ranks.main:
            try:
                chosen = super()._checkpoint_to_resume()
            except AssayError as e:
                error = str(e)
        chosen, error = self.ranks.broadcast((None if chosen is None else str(chosen), error))
        if error is not None:
            raise AssayError(error)
        return None if chosen is None else Path(chosen)

    def _load_policy(self, ckpt: Path, state: dict[str, Any]) -> None:
        if not self.ranks.active or (ckpt / "dcp").is_dir():
            return super()._load_policy(ckpt, state)
        # a single process wrote it: its whole weights (a LoRA run's adapter) and AdamW state, spread over the ranks
        from safetensors.torch import load_file

        if self.adapter is not None:
            model, adapter = self._fresh_lora()
            load_adapter(adapter, ckpt)
            weights = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        else:
            weights = load_file(ckpt / "model.safetensors")
        load_full_state(self.model, self.opt, weights, named_optimizer_state(self.model, state["optimizer"]))

    def _saved_rng(self, ckpt: Path, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's own stream where the checkpoint's run had this rank; a rank it did not have starts its own from
        the checkpoint's step (the global streams are rank 0's)."""
        own = ckpt / _rng_file(self.ranks.rank)
        if own.is_file():
            return torch.load(own, weights_only=False)
        if not self.ranks.rank:
            return state["rng"]
        fresh = torch.Generator(device="cpu").manual_seed(self._stream_seed() + state["step"])  # the run's stream is on the CPU
        return {**state["rng"], "sampler": fresh.get_state()}

    def _wrap_up(self, last: dict[str, float], bar) -> dict[str, Any]:
        if not self.ranks.active:
            return super()._wrap_up(last, bar)
        from assay.report.model_card import card_files
        from assay.report.run_report import PLOTS, write_report
        from assay.training.checkpoint import save_checkpoint

        if self.evaluated_at != self.step:  # not watched: the run is over, and a run resumed for more steps never saw it
            self._log(self.evaluate(), last, bar)
        if self._saved_at != self.step:
            self.save()
        weights, _ = full_state(self.model, trainable_only=self.adapter is not None)  # every rank takes part; rank 0 holds it whole
        summary: dict[str, Any] = {}
        if self.ranks.main:
            config, summary = self.cfg.model_dump(mode="json"), self.summary()
            write_report(self.run_dir, config, summary)
            self.trackers.images(self.step, [self.run_dir / name for name in PLOTS])
            card = card_files(self.run_dir, config, summary, self.cfg.reward or self.source.reward)
            whole = _plain_model(self.model, weights, self.cfg.model.dtype) if self.adapter is None else self._plain_adapter(weights)
            save_checkpoint(self.run_dir / "final", whole, self.tokenizer, {"step": self.step}, files=card)
        self.ranks.barrier()
        return summary

    def _fresh_lora(self):
        """`(model, peft_model)`: a fresh, unsharded copy of the base model on the CPU with this run's adapters, as one process has it."""
        from assay.models import load_policy

        base, _ = load_policy(self.cfg.model.path, torch.device("cpu"), self.cfg.model.dtype, self.cfg.model.chat_template)
        return self._adapters_on(base)

    def _plain_adapter(self, weights: dict[str, torch.Tensor]):
        """peft's wrapper of `_fresh_lora`'s model with this run's adapters set to `weights` (the trainable ones, gathered),
        for `save_pretrained`: the adapter folder a single-process LoRA run writes."""
        model, adapter = self._fresh_lora()
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        missing = [n for n in trainable if n not in weights]
        if missing:
            raise AssayError(f"final/: the gathered state lacks {len(missing)} of the run's adapter weights (first: {missing[0]})")
        model.load_state_dict({n: weights[n] for n in trainable}, strict=False)
        return adapter


def _plain_model(sharded, weights: dict[str, torch.Tensor], dtype: str):
    """An ordinary (unsharded) model of `sharded`'s architecture holding `weights`, for `save_pretrained`."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(sharded.config)
    model.load_state_dict(weights, assign=True)
    model.tie_weights()
    return model.to(getattr(torch, dtype))


def trainer_class() -> type[Trainer]:
    """`ShardedTrainer` when `torchrun` started this process (`WORLD_SIZE` > 1), else `Trainer`."""
    import os

    return ShardedTrainer if int(os.environ.get("WORLD_SIZE", "1")) > 1 else Trainer
