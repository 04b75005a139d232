"""The RL loop: sample → score → advantages → policy update → metrics, checkpoint.

Reads top to bottom. Every decision (which generation backend, estimator, extra, loss,
aggregation, reward) is a plugin looked up by name; this file only moves data between
them. With an `env:` block the sampler runs whole episodes of an environment
(`assay.rollout.multiturn.EpisodeSampler`) and the default reward is the episode's; nothing
else here changes. Several processes (`torchrun`) run `ShardedTrainer` (`assay.training.sharded`),
which overrides the few steps that differ. With `rollout.max_staleness` > 0 a producer thread
makes the rollouts (`assay.training.async_rollouts`): the loop takes each step's batch from it
instead of generating it, and publishes the weights after each update; nothing else changes.
Saving a step and resuming from one are `Checkpoints`' (`assay.training.resume`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from assay.config import RunConfig
from assay.devices import activation_budget_mb, check_device, set_matmul_precision
from assay.data.datasets import PromptLimit, PromptSource, build_source
from assay.errors import AssayError
from assay.eval.policy import evaluate
from assay.images.flow import configure as configure_images
from assay.models import context_length, disable_dropout, freeze, load_policy, resolve_model_path
from assay.models.llama import enable_checkpointing
from assay.models.lora import AdapterOff, apply_lora
from assay.report.figures import heldout_figures, recent_reward, time_to_accuracy
from assay.report.metrics import JsonlSink
from assay.report.model_card import card_files
from assay.report.run_report import PLOTS, write_report
from assay.report.trackers import Trackers
from assay.rewards.executor_factory import make_executor
from assay.rollout.base import SamplingParams, make_sampler, pad_id, sampler_metrics
from assay.rollout.multiturn import counting_off, episode_sampler
from assay.training.checks import check_group_size, check_plugins  # noqa: F401  (check_group_size: re-exported)
from assay.training.async_rollouts import AsyncHealth, AsyncRollouts
from assay.training.dist import NullSink, Ranks
from assay.training.checkpoint import STATE_FILE, save_checkpoint
from assay.algos import mismatch_correction, requirements
from assay.data.selection import DynamicFilter
from assay.training.extras import StepData, build_extras
from assay.training.groups import GoldInjector, PromptPicker, join_groups, scores, split_groups
from assay.threads import ThreadGovernor
from assay.training.hacking import HackingAlarm, Watch
from assay.training.health import HealthGates, RunCannotLearn, log_samples, rollout_metrics
from assay.training.precision import MasterWeights, lr_schedule, step_means
from assay.training.learner import (accumulate_step, activation_bytes_per_token, collate, compute_advantages, estimator_args, skips_inert_rows,
                                     takes_forward_process, token_logprobs)
from assay.training.interrupt import Preempted, StopSignals
from assay.training.old_policy import OldPolicy
from assay.training.progress import RunProgress
from assay.training.resume import Checkpoints
from assay.training.runs import RunFolderLock, RunResult, check_run_dir, new_run_dir, write_config
from assay.vision.inputs import has_images, shuffle_pictures


class Trainer(Checkpoints):
    """Holds everything one run needs; `fit()` runs the loop."""

    def __init__(self, cfg: RunConfig, run_dir: Path | None = None, resume: bool = False):
        self.cfg = cfg
        check_plugins(cfg)
        self.threads = ThreadGovernor(cfg.train.threads)
        torch.manual_seed(cfg.seed)
        # what a config, a data file or an output folder can get wrong is one line before the model loads (seconds)
        self.source: PromptSource = build_source(cfg.data, cfg.seed, cfg.train.eval_n)
        if resume and run_dir is None:
            raise AssayError("--resume needs the run folder to continue")
        if not resume:
            self._check_run_dir(run_dir)
        self.ranks = self._join()  # one process; a `torchrun` job's ranks in `ShardedTrainer`
        # one process trains in a folder: a resume holds it before the model loads (a second one is refused at once)
        self.folder_lock = RunFolderLock(run_dir) if resume and self.ranks.main else None  # type: ignore[arg-type]
        self.device = self.ranks.device(check_device(cfg.model.device))
        set_matmul_precision(self.device, cfg.model.tf32)
        self.model, self.tokenizer = load_policy(cfg.model.path, self.device, self._policy_dtype(), cfg.model.chat_template)
        configure_images(self.model, cfg)  # an image policy's sampling settings (nothing for a language model)
        if cfg.model.disable_dropout:  # before the reference and the critic are copied from it
            disable_dropout(self.model)
        self.adapter = self._lora()  # peft's wrapper when only adapters train (`model.lora`), else None
        freeze(self.model, cfg.model.freeze)  # `model.freeze`: these parameters keep their weights
        self.ref = None
        if cfg.algo.kl_coef > 0:  # with adapters: the same model with them off, no second copy
            self.ref = AdapterOff(self.adapter) if self.adapter is not None else copy.deepcopy(self.model).eval().requires_grad_(False)
        context = context_length(self.model)
        if context:
            if cfg.rollout.max_new_tokens >= context:
                raise AssayError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves no room for a prompt: the model takes {context} positions")
            self.source.limit(PromptLimit(self.tokenizer, context - cfg.rollout.max_new_tokens, cfg.data.overlong, context))
        self.picker = PromptPicker(self.source, cfg.selection, cfg.rollout.prompts_per_step, cfg.seed)
        self.gold = GoldInjector(self.tokenizer, cfg.selection.gold_field, cfg.selection.success) if cfg.selection.inject_gold else None
        self.adv_args = estimator_args(cfg.algo)
        self.extras = build_extras(self, requirements(cfg.algo.advantage), cfg.algo.advantage)  # the critic too, when `values` is needed
        self.executor = make_executor(cfg, self.source.reward if cfg.env is None else "episode")
        self.watch = Watch.for_run(cfg, self.source.reward)  # hacking monitors, canary; before the run folder: a bad block leaves nothing
        self.run_dir = Path(run_dir) if resume else self._new_run_dir(run_dir)
        if not resume and self.ranks.main:  # a new run, once its folder is made
            self.folder_lock = RunFolderLock(self.run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        if cfg.cluster.ray and cfg.cluster.rollout_workers:  # generation on Ray actors (assay.cluster)
            from assay.cluster import RaySampler, connect

            connect(cfg.cluster)
            self.sampler = RaySampler(self.model, self.tokenizer, cfg, self.device)
        else:
            self.sampler = make_sampler(cfg.rollout.backend, self.model, self.tokenizer, cfg.rollout, self.device)
        if cfg.env is not None:  # each rollout is an episode of the environment
            self.sampler = episode_sampler(self.sampler, self.model, self.tokenizer, cfg.env, context)
        self.rollout_sampler, self.rollout_model = self.sampler, self.model  # an asynchronous run's producer brings its own
        self.async_: AsyncRollouts | None = None
        self.async_health = AsyncHealth()
        self.resumed_versions: dict[int, dict[str, torch.Tensor]] = {}
        self.resumed_from: Path | None = None  # the checkpoint `--resume` continued from
        self.resumed_health: dict[str, Any] | None = None  # its health gates' state, for gates a subclass wraps around them
        self._wall_offset, self._wall_t0 = 0.0, time.perf_counter()
        if cfg.train.activation_checkpointing:  # the model's own forward and assay's (models/llama.py) both read this flag
            enable_checkpointing(self.model)
        mb = activation_budget_mb(cfg.train.micro_batch_mb, self.device)  # MiB → padded tokens per forward/backward pass (0: no limit)
        per_token = activation_bytes_per_token(self.model, cfg.train.activation_checkpointing)
        self.micro_batch_tokens = max(1, int(mb * 2**20 / per_token)) if mb else 0
        self.params = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p)
        self.generator = torch.Generator(device="cpu").manual_seed(self._stream_seed())  # a sampler on a device seeds its own from it
        self._place()  # before the optimizer: a sharded policy's optimizer steps its shards
        self.old = OldPolicy(self) if cfg.algo.old_ema else None  # a rollout policy that trails the trained one, sampling from now on
        fused = cfg.optim.fused and self.device.type in ("cpu", "cuda")
        self.weights = MasterWeights(self.model.parameters(), lambda ps: torch.optim.AdamW(
            ps, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay, fused=fused))  # fp32 masters for a bf16 policy
        self.opt = self.weights.optimizer
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_schedule(cfg.optim, cfg.train.steps))
        self.health = HealthGates(cfg.train.stop_unscored_steps, cfg.train.zero_var_warn, cfg.train.zero_var_steps,
                                  cfg.rollout.max_new_tokens if cfg.data.path else None)  # a data file's answers may not fit the limit
        self.alarm_stop: str | None = None  # the alarm that ends the run (`train.on_alarm=stop`)
        self.step = 0
        self.evaluated_at: int | None = None  # the step whose held-out evaluation has been logged
        self._saved_at: int | None = None
        self.trackers = Trackers([], self.run_dir, {})  # the run's trackers open when `fit` starts
        if resume:
            self._resume()
        main = self.ranks.main  # only one process writes the run's files
        if main:
            write_config(self.run_dir, cfg)
        self.sink = JsonlSink(self.run_dir / "metrics.jsonl", truncate_after=self.step) if main else NullSink()
        self.samples = JsonlSink(self.run_dir / "samples.jsonl", truncate_after=self.step) if main else NullSink()

    # -- where a run of several processes differs (`assay.training.sharded`) ------------
    def _join(self) -> Ranks:
        return Ranks()

    def _policy_dtype(self) -> str:
        return self.cfg.model.dtype

    def _check_run_dir(self, folder: Path | None) -> None:
        """Refuse, before anything loads, a run folder that `_new_run_dir` would refuse."""
        check_run_dir(self.cfg, folder)

    def _new_run_dir(self, folder: Path | None) -> Path:
        return new_run_dir(self.cfg, folder)

    def _lora(self):
        """Adapters on the policy (`model.lora`, `assay.models.lora`): `self.model` keeps them in place; peft's wrapper, or None."""
        if self.cfg.model.lora is None:
            return None
        self.model, adapter = self._adapters_on(self.model)
        return adapter

    def _adapters_on(self, model) -> tuple[Any, Any]:
        """`(model, peft_model)`: `model` with this run's adapters (`model.lora`), as `assay.models.lora.apply_lora` gives them."""
        return apply_lora(model, self.cfg.model.lora, str(resolve_model_path(self.cfg.model.path).resolve()), seed=self.cfg.seed)

    @property
    def saved_model(self):
        """What a checkpoint and `final/` save: the adapter of a LoRA run, else the policy."""
        return self.adapter if self.adapter is not None else self.model

    def _stream_seed(self) -> int:
        """The seed of the run's own random stream (the sampler's draws)."""
        return self.cfg.seed

    def _place(self) -> None:
        """Put the policy where it trains (one process: where it was loaded)."""

    def generating(self) -> contextlib.AbstractContextManager:
        """Hold the policy's whole weights while a sampler reads them (one process: always)."""
        return contextlib.nullcontext()

    def _guard(self, signals) -> contextlib.AbstractContextManager:
        """What a step's rollout runs under: a signal stops it at once (several processes: only between steps)."""
        return contextlib.nullcontext()

    def _raise_pending(self, signals) -> None:
        signals.raise_pending()

    @property
    def finished(self) -> bool:
        """Every step trained, evaluated and saved, and `final/` written: nothing is left to do."""
        return self.step >= self.cfg.train.steps and self.evaluated_at == self.step and (self.run_dir / "final" / STATE_FILE).is_file()

    # -- one step ----------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One whole step: `learn(collect())`."""
        return self.learn(self.collect())

    def collect(self) -> tuple[list, list, dict[str, float], float]:
        """Generate and score this step's rollouts (changes no weights)."""
        self.threads.update()  # first, the cores other processes left free
        return self._collect()

    def _collect(self) -> tuple[list, list, dict[str, float], float]:
        """`collect` without the thread count (what an asynchronous run's producer calls)."""
        t0 = time.perf_counter()
        trajs, results, metrics = self._rollout()
        return trajs, results, metrics, t0

    def learn(self, rollout) -> dict[str, float]:
        """Advantages and the policy (and critic) update on collected rollouts; the step's metrics."""
        cfg = self.cfg
        trajs, results, metrics, t0 = rollout
        self._last = (trajs, results)
        t_rew = time.perf_counter()
        prompts = list({t.group: t.sample for t in trajs}.values())  # one per group, in group order
        batch = collate(trajs, results, pad_id(self.tokenizer), self.device)
        step = StepData(batch, trajs, results, prompts)
        extras = {name: extra(step) for name, extra in self.extras.items()}  # what the estimator declared it needs
        advantages = compute_advantages(batch, cfg.algo, extras, self.adv_args)  # [B, T]
        if cfg.algo.mismatch not in (None, "none") and cfg.algo.epochs * cfg.algo.minibatches == 1:
            batch = dataclasses.replace(batch, behaviour=batch.old_logprobs)  # one optimizer step: its own forward is π_old
        elif cfg.algo.mismatch not in (None, "none"):
            batch, mismatch = self._correct_mismatch(batch, advantages)
            metrics.update(mismatch)
        if takes_forward_process(cfg.algo):  # DiffusionNFT: the noisings and the rollout policy's velocities, before any step
            batch = dataclasses.replace(batch, draws=(self.model if self.old is None else self.old.model).draw_noisings(batch, self.generator))
        self.rest_sampler()
        skipped = self.weights.skipped
        metrics.update(self._update(batch, advantages))
        metrics.update(self.weights.metrics(skipped))
        self.sampler.update_weights(self.model, self.step + 1)
        if self.old is not None:
            metrics.update(self.old.after_update(self.model, self.step))
        if self.async_ is not None:
            self.async_.publish(self.step + 1)
        metrics.update(sampler_metrics(self.sampler))
        for name, extra in self.extras.items():  # after the policy: the critic fits the returns its values gave
            metrics.update(extra.after_update(step, extras[name]))
        t_end = time.perf_counter()
        metrics.update({
            "perf/step_s": t_end - t0, "perf/update_s": t_end - t_rew,
            "perf/tokens_per_s": metrics["rollout/tokens"] / (t_end - t0), "actor/lr": self.sched.get_last_lr()[0],
            "perf/threads": float(self.threads.threads), "perf/other_load": self.threads.other_load,
        })
        self.sched.step()
        return metrics

    def rest_sampler(self) -> None:
        """The sampler lets go of device memory for the update (not while an asynchronous run's producer samples)."""
        if self.async_ is None:
            self.sampler.sleep()

    def _rollout(self) -> tuple[list, list, dict[str, float]]:
        """Generate and score until the step's groups are chosen (one round, or DAPO's rounds).

        Prompts come from the picker; every round's groups are reported to it, then get
        the reference solution where all failed (`selection.inject_gold`), then pass DAPO's
        filter (`selection.dynamic`). Rollout and reward metrics cover every generated
        completion; if no round kept a group, the last round is trained on as it is.
        """
        cfg, n = self.cfg, self.cfg.rollout.prompts_per_step
        dynamic = DynamicFilter(n, cfg.selection.max_rounds) if cfg.selection.dynamic else None
        every: tuple[list, list] = ([], [])
        summed = {"perf/generate_s": 0.0, "perf/reward_s": 0.0, "selection/gold_injected": 0.0, "selection/gold_rejected": 0.0}  # over rounds
        while True:
            trajs, results, generate_s, reward_s = self._sample(self.picker.next(n))
            summed["perf/generate_s"] += generate_s
            summed["perf/reward_s"] += reward_s
            for t in trajs:  # group ids unique over the step's rounds, for the reward-health metrics
                t.group += len(every[0]) // cfg.rollout.group_size
            every[0].extend(trajs)
            every[1].extend(results)
            groups = split_groups(trajs, results)
            self.picker.observe(groups)
            if self.gold is not None:
                groups, counts = self.gold(groups, self.executor.scorer(training=False), self._logprobs_of)
                summed.update({k: summed[k] + v for k, v in counts.items()})
            if dynamic is None:
                break
            dynamic.add(groups, [scores(g) for g in groups])
            if dynamic.done:
                break
        metrics = rollout_metrics(*every, verdicts=self.executor.verdicts)
        metrics.update(self.executor.health(every[1], every[0]))
        metrics.update(self.picker.metrics())
        metrics.update({k: v for k, v in summed.items() if k.startswith("perf/") or self.gold is not None})
        metrics["rollout/tokens"] = sum(len(t.completion_ids) for t in every[0])
        if dynamic is not None:
            metrics.update(dynamic.metrics())
            groups = dynamic.take()[0] or groups
        trajs, results = join_groups(groups)
        return trajs, results, metrics

    def _sample(self, prompts: list) -> tuple[list, list, float, float]:
        """G completions of each prompt and their rewards, and the seconds each took."""
        t0 = time.perf_counter()
        with self.generating():
            trajs = self.rollout_sampler.generate(prompts, self.cfg.rollout.group_size, self.params, self.generator)
        t1 = time.perf_counter()
        results = self.executor.score(trajs, training=True)
        return trajs, results, t1 - t0, time.perf_counter() - t1

    def _correct_mismatch(self, batch, advantages):
        """Recompute the sampled tokens' logprobs with the trainer (no grad); TIS/MIS weights for the loss (a batch that takes
        several optimizer steps: with one, the update's own forward gives them, `Batch.behaviour`).

        The trainer's logprobs become π_old of the policy ratio (the proximal policy of decoupled
        PPO); the weights π_trainer/π_sampler, truncated or masked, multiply the per-token policy
        loss. Only the rows the update runs are recomputed (with `train.skip_zero_advantage`, rows
        whose advantage is not 0 everywhere): the others add nothing to the loss, and keep the
        sampler's logprobs with weight 0.
        """
        algo = self.cfg.algo
        live = ((advantages != 0) & batch.mask.bool()).any(-1)  # [B]
        rows = live.nonzero()[:, 0] if self.cfg.train.skip_zero_advantage and skips_inert_rows(algo, self.ref) and not live.all() else None
        part = batch if rows is None else batch.select(rows)
        with torch.no_grad():
            trainer_lp = token_logprobs(self.model, part, self.cfg.rollout.temperature, fast=self.cfg.train.fast_forward)[0] if part.mask.shape[0] \
                else part.old_logprobs  # [b, T]
        weights, metrics = mismatch_correction(trainer_lp, part.old_logprobs, part.mask, algo.mismatch, algo.mismatch_cap, algo.mismatch_floor, algo.mismatch_level)
        if rows is None:
            return dataclasses.replace(batch, old_logprobs=trainer_lp * batch.mask, is_weights=weights), metrics
        old, every = batch.old_logprobs.clone(), torch.zeros_like(batch.old_logprobs)
        old[rows], every[rows] = trainer_lp * part.mask, weights
        return dataclasses.replace(batch, old_logprobs=old, is_weights=every), metrics

    def _logprobs_of(self, trajs, results) -> list[list[float]]:
        """The rollout policy's logprobs of completions no sampler drew (injected reference solutions)."""
        batch = collate(trajs, results, pad_id(self.tokenizer), self.device)
        with torch.no_grad():
            lp, _ = token_logprobs(self.rollout_model, batch, self.cfg.rollout.temperature, fast=self.cfg.train.fast_forward)
        return [lp[i, : len(t.completion_ids)].tolist() for i, t in enumerate(trajs)]

    def _update(self, batch, advantages) -> dict[str, float]:
        cfg = self.cfg
        self.model.train()
        agg: dict[str, list[float]] = {}
        B = batch.rewards.shape[0]
        for _ in range(cfg.algo.epochs):
            for idx in torch.arange(B, device=self.device).chunk(cfg.algo.minibatches):
                self.weights.zero_grad()
                m = accumulate_step(self.model, self.ref, batch.select(idx), advantages[idx], cfg.algo, cfg.rollout.temperature,
                                    cfg.rollout.max_new_tokens, self.micro_batch_tokens, cfg.train.fast_forward,
                                    cfg.train.skip_zero_advantage, loss_scale=self.weights.loss_scale)
                m["actor/grad_norm"] = self.weights.step(cfg.optim.grad_clip)
                for k, v in m.items():
                    agg.setdefault(k, []).append(v)
        self.model.eval()
        return step_means(agg)

    def evaluate(self) -> dict[str, float]:
        """Held-out greedy accuracy (verified; sampled too with `train.eval_samples`), the mean of a learned reward, and length
        (nothing without held-out data)."""
        out = self._evaluate_on(self.source.heldout) if self.source.heldout else {}
        pictures = getattr(self.sampler, "save_greedy", None)  # an image policy: the held-out pictures, for the report
        if pictures is not None and self.ranks.main and self.source.heldout:
            pictures(self.run_dir / "images" / f"heldout_step{self.step:06d}.png")
        return out

    def _evaluate_on(self, problems: list) -> dict[str, float]:
        verifier, reward = self.executor.heldout_scorers()
        with counting_off(self.sampler), self.generating():  # held-out episodes stay out of the step's agent/* metrics
            samples = self.cfg.train.eval_samples if verifier is not None else 0
            r = evaluate(self.sampler, verifier, problems, self.cfg.rollout.max_new_tokens, k=samples, seed=self.cfg.seed,
                         temperature=self.cfg.rollout.temperature, top_p=self.cfg.rollout.top_p, reward=reward)
            shuffled = None
            if r.accuracy is not None and any(has_images(p) for p in problems):  # does the policy use the pictures?
                shuffled = evaluate(self.sampler, verifier, shuffle_pictures(problems), self.cfg.rollout.max_new_tokens).accuracy
        out = {"eval/accuracy": r.accuracy, "eval/mean_reward": r.mean_reward, "eval/mean_length": r.mean_length,
               "eval/sampled_accuracy": r.sampled, f"eval/pass@{samples}": r.pass_at_k}
        if shuffled is not None:
            out.update({"eval/accuracy_shuffled_images": shuffled, "eval/image_reliance": r.accuracy - shuffled})
        return {k: v for k, v in out.items() if v is not None}

    # -- the loop ----------------------------------------------------------------------
    def fit(self, progress: bool = True) -> RunResult:
        """Train to `train.steps`, evaluate, save, write the report and `final/`.

        Ctrl-C and SIGTERM stop it at a safe point with a checkpoint of the last finished
        step (`assay.training.interrupt`); `KeyboardInterrupt` or `Preempted` then propagates.
        """
        cfg = self.cfg
        last: dict[str, float] = {}
        with RunProgress(cfg.train.steps, self.step, enabled=progress) as bar, contextlib.ExitStack() as stack, \
                StopSignals(notify=bar.note) as signals:
            if self.folder_lock is not None:
                stack.callback(self.folder_lock.release)  # last: after the files are closed
            stack.callback(self.executor.close)
            stack.callback(self.watch.close)
            self.trackers = Trackers(cfg.train.report_to if self.ranks.main else [], self.run_dir, cfg.model_dump(mode="json"), self._saved_at)
            stack.callback(self.trackers.close)
            self._wall_t0 = time.perf_counter()
            if self.step < cfg.train.steps:
                self._start_producer(cfg.rollout.max_staleness)
            if self.async_ is not None:
                stack.callback(self.async_.close)
            try:
                if self.step == 0 and self.evaluated_at is None:
                    with signals.critical():
                        self._log(self._watch(self.evaluate(), [], [], bar), last, bar)
                    self._raise_pending(signals)
                while self.step < cfg.train.steps:
                    rollout = self._next_rollout(signals)
                    with signals.critical():
                        self._finish_step(self.learn(rollout), last, bar)
                    self._raise_pending(signals)
                    if self.health.stop:
                        raise RunCannotLearn(self.health.stop)
                    if self.alarm_stop:
                        raise HackingAlarm(f"{self.alarm_stop} (train.on_alarm=stop; the run is in {self.run_dir}, "
                                           f"a checkpoint of step {self.step} saved)")
                with signals.critical():
                    summary = self._wrap_up(last, bar)
                self._raise_pending(signals)  # a signal during the last step's wrap-up: the run is complete anyway
            except (KeyboardInterrupt, Preempted, RunCannotLearn, HackingAlarm) as e:
                if self.async_ is not None:
                    self.async_.close()  # after the batch it is making; the checkpoint has the position before the next one
                if not signals.torn and self._saved_at != self.step:
                    self.save()
                if isinstance(e, (RunCannotLearn, HackingAlarm)) and self.ranks.main:  # the report shows why, with the samples
                    write_report(self.run_dir, cfg.model_dump(mode="json"), {**self.summary(), "stopped": str(e)})
                raise
            finally:
                self.sink.close()
                self.samples.close()
        return RunResult(self.run_dir, summary)

    def _start_producer(self, k: int) -> None:
        """From here on the rollouts come from a producer thread `k` versions ahead (`assay.training.async_rollouts`); 0: none."""
        if k and self.ranks.active:
            raise AssayError(f"rollout.max_staleness={k} under torchrun: asynchronous rollouts run in one process for now (docs/async.md)")
        self.async_ = AsyncRollouts(self, k) if k else None

    def _next_rollout(self, signals) -> tuple:
        """This step's scored rollouts: generated now, or taken from the producer (a signal while waiting stops at once either
        way: no weight has changed, and the checkpoint holds the position before this step's batch)."""
        if self.async_ is not None:
            return self.async_.take(self.step)
        snapshot = self._snapshot()
        try:
            with self._guard(signals):
                return self.collect()
        except BaseException:
            self._restore(snapshot)  # no weight changed: the checkpoint is the last finished step's
            raise

    def _wrap_up(self, last: dict[str, float], bar) -> dict[str, Any]:
        """The last evaluation and checkpoint, the report, its plots to the trackers, and `final/` with its model card."""
        if self.evaluated_at != self.step:  # not watched: the run is over, and a run resumed for more steps never saw it
            self._log(self.evaluate(), last, bar)
        if self._saved_at != self.step:
            self.save()
        config, summary = self.cfg.model_dump(mode="json"), self.summary()
        write_report(self.run_dir, config, summary)
        self.trackers.images(self.step, [self.run_dir / name for name in PLOTS])
        card = card_files(self.run_dir, config, summary, self.cfg.reward or self.source.reward)
        save_checkpoint(self.run_dir / "final", self.saved_model, self.tokenizer, {"step": self.step}, files=card)
        return summary

    def _finish_step(self, metrics: dict[str, float], last: dict[str, float], bar) -> None:
        """Count the step; health gates, samples; evaluate, log and save when due."""
        cfg = self.cfg
        self.step += 1
        trajs, results = self._last
        warning = self.health.check(self.step, metrics, trajs, results)
        if self.async_ is not None:
            warning = "; ".join(w for w in (warning, self.async_health.check(metrics)) if w) or None
        if warning:
            metrics["warning"] = warning
            bar.note(f"assay: warning: step {self.step}: {warning}")
        log_samples(self.samples, self.step, trajs, results, cfg.train, self.tokenizer, bar.note)
        if cfg.train.eval_every and self.step % cfg.train.eval_every == 0 and self.step < cfg.train.steps:
            metrics.update(self.evaluate())
        self._watch(metrics, trajs, results, bar)
        self._log(metrics, last, bar, evaluated="eval/mean_length" in metrics)
        if cfg.train.save_every and self.step % cfg.train.save_every == 0 and self.step < cfg.train.steps:
            self.save()

    def _watch(self, metrics: dict[str, Any], trajs: list, results: list, bar) -> dict[str, Any]:
        """The canary's figures and the hacking monitors' signals and alarms, added to this step's `metrics` (returned)."""
        if self.watch.check(self.step, metrics, trajs, results):
            bar.note(f"assay: alarm: step {self.step}: {metrics['alarm']}")
            if self.cfg.train.on_alarm == "stop":
                self.alarm_stop = f"step {self.step}: {metrics['alarm']}"
        return metrics

    def _log(self, metrics: dict[str, float], last: dict[str, float], bar, evaluated: bool = True) -> None:
        if evaluated:
            self.evaluated_at = self.step
        if metrics:
            metrics["perf/wall_s"] = self._wall()
            self.sink.log(self.step, metrics)
            self.trackers.log(self.step, metrics)
        last.update(metrics)
        bar.update(self.step, last)

    def summary(self) -> dict[str, Any]:
        """The run's final figures (held-out accuracy at start and end, recent training reward, time), from `metrics.jsonl`."""
        from assay.report.metrics import read_metrics

        rows = read_metrics(self.run_dir / "metrics.jsonl")
        return {
            "steps": self.step, **heldout_figures(rows), "held-out problems": len(self.source.heldout), **recent_reward(rows),
            "trainable parameters": sum(p.numel() for p in self.weights.params),
            "model": self.cfg.model.path, **({"task": self.cfg.data.task} if self.cfg.data.task else {"data": self.cfg.data.path}),
            "total time (s)": round(sum(r.get("perf/step_s", 0) for r in rows), 1), **time_to_accuracy(rows),
        }
