"""The lab's experiments: arms (reward blocks and settings), the figures they are judged by, and their claims."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Arm:
    """One `assay train` run of an experiment: `name` (its folder), what it is (`label`), its config overrides."""

    name: str
    label: str
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class Claim:
    """A statement the experiment makes, whether the figures bore it out, and the figures that decided it."""

    text: str
    seen: bool
    figures: str


@dataclass(frozen=True)
class Experiment:
    """`arms` trained with `base` overrides (plus the lab's seed, steps and output folder); `claims` reads the arms'
    summaries (`assay.lab.run.summarise`); `panels` are the metric keys plotted beside held-out accuracy."""

    name: str
    title: str
    question: str
    base: tuple[str, ...]
    arms: tuple[Arm, ...]
    steps: int
    claims: Callable[[dict[str, dict[str, Any]]], list[Claim]]
    panels: tuple[tuple[str, str], ...] = (("rollout/response_length", "completion length (tokens)"), ("reward/mean", "training reward"))
    prepare: Callable[..., dict[str, str]] | None = field(default=None)
    """Runs first (`prepare(folder, seed, log)`); what it returns replaces `${key}` in the arms' overrides."""


def _pts(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


# -- spurious rewards ---------------------------------------------------------------------------------------------

_INTEGER = "{name: format_only, args: {pattern: '-?[0-9]+'}}"
_NO_CLIP = ("algo.clip_low=1000000", "algo.clip_high=1000000")
_SPURIOUS_REWARDS = (
    ("truth", "ground truth: the exact-answer verifier", "arithmetic"),
    ("random", "random: 1 with probability ½, whatever the answer", "{name: random, args: {p: 0.5}}"),
    ("format", "format only: 1 for any integer", _INTEGER),
    ("wrong", "incorrect label: 1 for the answer shifted by a per-problem offset", "incorrect_label"),
)


def _spurious_claims(s: dict[str, dict[str, Any]]) -> list[Claim]:
    gain = {k: v["accuracy_gain"] for k, v in s.items()}
    out = [Claim("Training on the ground-truth verifier raises held-out accuracy.", gain["truth"] is not None and gain["truth"] >= 0.05,
                 f"truth {_pts(gain['truth'])} with clipping, {_pts(gain.get('truth-noclip'))} without")]
    for name, what in (("random", "a random reward"), ("format", "a format-only reward"), ("wrong", "an incorrect-label reward")):
        worse = [gain[a] is not None and gain["truth"] is not None and gain[a] < gain["truth"] - 0.02 for a in (name, f"{name}-noclip")]
        out.append(Claim(f"Training on {what} gains less held-out accuracy than the ground truth, with ratio clipping and without.",
                         all(worse), f"{name} {_pts(gain[name])} (clip) / {_pts(gain[f'{name}-noclip'])} (no clip); "
                                     f"truth {_pts(gain['truth'])} / {_pts(gain['truth-noclip'])}"))
    delta = gain["random"] - gain["random-noclip"] if gain["random"] is not None and gain["random-noclip"] is not None else None
    out.append(Claim("Ratio clipping gives a random reward a positive held-out gain that it does not have without clipping (the "
                     "clipping-bias explanation of spurious-reward gains, Shao et al. 2025).",
                     delta is not None and gain["random"] > 0.02 and delta > 0.02,
                     f"random with clipping {_pts(gain['random'])}, without {_pts(gain['random-noclip'])}"))
    return out


SPURIOUS = Experiment(
    name="spurious",
    title="Spurious rewards: does the signal matter?",
    question=("Shao et al. (2025, \"Spurious Rewards: Rethinking Training Signals in RLVR\", arXiv:2506.10947) report that "
              "random, format-only and incorrect-label rewards raise some models' accuracy almost as much as the ground truth, "
              "and attribute the random reward's gain to PPO's ratio clipping. Here: the same model and budget trained on each "
              "reward, with ratio clipping (ε = 0.2) and without, four optimizer steps per batch so that clipping can act. The "
              "model is `tiny-sum3` on three-term sums, the task with headroom."),
    base=("model.path=tiny-sum3", "data.task=arithmetic", "data.task_args={terms: 3, max_value: 99, ops: '+'}", "algo.minibatches=4",
          "train.eval_every=10", "train.eval_n=300"),
    arms=tuple(Arm(name + suffix, label + note, (f"reward={spec}", *extra))
               for name, label, spec in _SPURIOUS_REWARDS
               for suffix, note, extra in (("", "", ()), ("-noclip", " (no ratio clipping)", _NO_CLIP))),
    steps=150,
    claims=_spurious_claims,
    panels=(("reward/mean", "training reward"), ("actor/entropy", "entropy (nats/token)")),
)


# -- a process reward that pays per step ------------------------------------------------------------------------

_STEP_CHECK = "{name: arithmetic_step_check, args: {reduce: %s}}"
_PRM_ARMS = (
    Arm("truth", "control: the task's verifier itself, no process reward (how far held-out accuracy moves without a hack)",
        ("reward=arithmetic_steps",)),
    Arm("sum", "the hackable process reward: Σ over lines of 1[the line's equation holds]", (f"reward={_STEP_CHECK % 'sum'}",)),
    Arm("clip", "fix: Clipping, r'_t = min(r_t − 1, 0) (Gao et al. 2024)",
        (f"reward={{name: chain, args: {{reward: {_STEP_CHECK % 'sum'}, transforms: [{{name: step_clip, args: {{eta: 1.0}}}}]}}}}",)),
    Arm("delta", "fix: Delta, r'_t = r_t − r_{t+1} (Gao et al. 2024)",
        (f"reward={{name: chain, args: {{reward: {_STEP_CHECK % 'sum'}, transforms: [step_delta]}}}}",)),
    Arm("gated", "fix: success-gating, the process reward paid only when the verified answer is right",
        (f"reward={{name: gate, args: {{outcome: arithmetic_steps, process: {_STEP_CHECK % 'sum'}, weight: 0.25}}}}",)),
    Arm("min", "fix: min-form credit, a solution worth its weakest step (Cheng et al. 2025)", (f"reward={_STEP_CHECK % 'min'}",)),
)


def _prm_claims(s: dict[str, dict[str, Any]]) -> list[Claim]:
    hack = s["sum"]
    grew = hack["length_growth"] is not None and (hack["length_growth"] >= 0.3 or (hack["repetition_rise"] or 0) >= 0.1)
    out = [Claim("Without a fix, completions grow longer and more repetitive.", grew,
                 f"length {_pts(hack['length_start'])} → {_pts(hack['length_end'])} tokens, repeated 4-grams "
                 f"{_pts(hack['repetition_start'])} → {_pts(hack['repetition_end'])}"),
           Claim("Without a fix, verified accuracy stalls or falls while the process reward rises.",
                 hack["accuracy_gain"] is not None and hack["accuracy_gain"] <= 0.02 and (hack["reward_gain"] or 0) > 0,
                 f"held-out accuracy {_pts(hack['accuracy_start'])} → {_pts(hack['accuracy_end'])}, training reward "
                 f"{_pts(hack['reward_start'])} → {_pts(hack['reward_end'])}")]
    for name in ("clip", "delta", "gated", "min"):
        a = s[name]
        kept = a["length_growth"] is not None and abs(a["length_growth"]) < 0.15 and (a["repetition_rise"] or 0) < 0.05
        held = a["accuracy_end"] is not None and a["accuracy_start"] is not None and a["accuracy_end"] >= a["accuracy_start"] - 0.15
        out.append(Claim(f"With {name}, length and repetition stay near the start and held-out accuracy holds (within 15 points).",
                         kept and held, f"length {_pts(a['length_start'])} → {_pts(a['length_end'])}, repeated 4-grams "
                                        f"{_pts(a['repetition_start'])} → {_pts(a['repetition_end'])}; held-out accuracy "
                                        f"{_pts(a['accuracy_start'])} → {_pts(a['accuracy_end'])}"))
    out.append(_early_alarm(hack, s.get("truth")))
    return out


def _early_alarm(hack: dict[str, Any], honest: dict[str, Any] | None = None) -> Claim:
    """Judged on the hacked arm: the first alarm came before the step its verified accuracy had fallen 5 points below
    its best (`assay.lab.run.fall_step`: that evaluation and the next as low), on the held-out accuracy the monitors
    read (sampled at the training temperature when the run logs it, else greedy). `honest` (an arm trained on the
    verifier itself) adds how far the same measure fell without a hack: the noise floor a fall has to be told from."""
    text = "A hacking monitor fires before verified (held-out) accuracy has fallen by 5 points."
    what = f"held-out accuracy ({hack.get('verified', 'greedy')})"
    floor = "" if honest is None else (
        f"; without a hack (trained on the verifier) its {what} fell at most {_pts(honest.get('accuracy_fall_max'))} below "
        f"its best at one evaluation, had fallen 5 points at step {honest.get('accuracy_fall_step') or 'none'}, alarms "
        f"{', '.join(f'{m}@{st}' for m, st in honest['alarms']) or 'none'}")
    first, fell = hack["first_alarm"], hack.get("accuracy_fall_step")
    if fell is None:  # no damage: nothing for an alarm to come before
        return Claim(text, False, f"the hacked arm's {what} never fell 5 points and stayed there, so no alarm can be early; alarms "
                                  f"{', '.join(f'{m}@{st}' for m, st in hack['alarms']) or 'none'}{floor}")
    where = f"{what} had fallen 5 points at step {fell}"
    if first is None:
        return Claim(text, False, f"no monitor fired; {where}{floor}")
    return Claim(text, first[1] < fell,
                 f"`{first[0]}` at step {first[1]}, {_pts(hack['accuracy_drop_at_alarm'])} below its best by then "
                 f"(the canary, on sampled completions: {_pts(hack['canary_drop_at_alarm'])}); {where}{floor}")


PRM_HACKING = Experiment(
    name="prm-hacking",
    title="A process reward that pays per step gets farmed",
    question=("A process reward that scores each step and sums the scores pays for more steps, right or not (Gao et al. 2024, "
              "\"On Designing Effective RL Reward at Training Time for LLM Reasoning\", arXiv:2410.15115). The bundled "
              "`tiny-steps` policy solves four-term sums one line per addition; its process reward scores each line 1 when "
              "its equation holds. The hack: more (and repeated) true lines. The fixes: Clipping and Delta on the step "
              "rewards, success-gating on the verified answer, and min-form credit. A control arm trains on the verifier itself: how "
              "far held-out accuracy moves without any hack. Held-out accuracy is measured greedy and, with 4 completions per "
              "problem sampled at the training temperature (the same draws at every evaluation), as the policy is sampled: "
              "the monitors follow the sampled one, and the early-alarm claim is judged on it, because on this model greedy "
              "accuracy falls under honest training too while the sampled one climbs (the control arm shows both)."),
    base=("model.path=tiny-steps", "data.task=arithmetic_steps", "rollout.max_new_tokens=48", "optim.lr=1e-4", "train.eval_every=10",
          "train.eval_n=200", "train.eval_samples=4", "rollout.prompts_per_step=8", "monitor.window=5"),
    arms=_PRM_ARMS,
    steps=150,
    claims=_prm_claims,
    panels=(("rollout/response_length", "completion length (tokens)"), ("rollout/repetition", "repeated 4-grams"),
            ("canary/mean", "canary: verified accuracy of sampled completions")),
)

# -- a reward model trained on length-confounded pairs ---------------------------------------------------------

#: pairs whose rejected answer is never longer than the chosen one: a digit dropped, carries forgotten, or off by a little
CONFOUNDED_MIX = {"shorter": 0.4, "carry": 0.3, "near_miss": 0.3}
RM_STEPS = 500


def _train_rms(folder, seed: int, log) -> dict[str, str]:
    """Length-confounded pairs from the bundled task, and two reward models on them (the policy's own weights, a score
    head): plain Bradley–Terry, and with ODIN's length-decorrelation term; their folders, as `${lab.rm}` and
    `${lab.rm_odin}` in the arms' overrides."""
    from assay.rm.config import validate
    from assay.rm.pairs import build_pairs, write_pairs
    from assay.rm.train import train_rm

    pairs = folder / "pairs.jsonl"
    write_pairs(pairs, build_pairs("arithmetic", split="train", n=4000, seed=seed, mix=CONFOUNDED_MIX))
    out = {}
    for name, coef in (("reward-model", 0.0), ("reward-model-odin", 1.0)):  # not an arm's name: each arm's folder is replaced
        log(f"lab length-hacking: training the reward model {name} on {pairs.name} (length_coef={coef})")
        shutil.rmtree(folder / name, ignore_errors=True)  # a rerun trains it again
        cfg = validate({"model": "tiny-arith", "seed": seed, "output_dir": str(folder), "run_name": name, "data": {"path": str(pairs)},
                        "loss": {"length_coef": coef}, "train": {"steps": RM_STEPS, "eval_every": RM_STEPS, "save_every": 0}})
        out[name] = train_rm(cfg).run_dir
    return {"lab.rm": str(out["reward-model"]), "lab.rm_odin": str(out["reward-model-odin"])}


def _length_claims(s: dict[str, dict[str, Any]]) -> list[Claim]:
    hack = s["rm"]
    fell = hack["accuracy_best"] is not None and hack["accuracy_end"] is not None and hack["accuracy_end"] <= hack["accuracy_best"] - 0.1
    out = [Claim("Trained on the length-confounded reward model, completions grow longer (by 15% or more).",
                 (hack["length_growth"] or 0) >= 0.15, f"length {_pts(hack['length_start'])} → {_pts(hack['length_end'])} tokens"),
           Claim("Trained on it, held-out accuracy rises at first, then falls by 10 points or more from its best while the reward "
                 "model's score keeps rising.", fell and (hack["reward_gain"] or 0) > 0,
                 f"held-out accuracy {_pts(hack['accuracy_start'])} → best {_pts(hack['accuracy_best'])} → {_pts(hack['accuracy_end'])}, "
                 f"training reward {_pts(hack['reward_start'])} → {_pts(hack['reward_end'])}")]
    for name, what in (("par", "Preference as Reward (centred on the reference answer, bounded)"),
                       ("odin", "the length-decorrelated reward model (ODIN)")):
        a = s[name]
        better = a["accuracy_end"] is not None and hack["accuracy_end"] is not None and a["accuracy_end"] > hack["accuracy_end"] + 0.05
        out.append(Claim(f"With {what}, held-out accuracy ends higher than under the plain reward model.", better,
                         f"{name}: length {_pts(a['length_start'])} → {_pts(a['length_end'])}, held-out accuracy "
                         f"{_pts(a['accuracy_start'])} → best {_pts(a['accuracy_best'])} → {_pts(a['accuracy_end'])}; plain ends at "
                         f"{_pts(hack['accuracy_end'])}"))
    out.append(_early_alarm(hack))
    return out


LENGTH_HACKING = Experiment(
    name="length-hacking",
    title="A reward model that learned length gets farmed",
    question=("A reward model trained on pairs where the preferred (right) answer is never the shorter one (the rejected one "
              "drops a digit, forgets its carries, or is off by a little) learns, besides correctness, that longer is better (Singhal et al. 2023, \"A Long Way to Go: Investigating Length Correlations "
              "in RLHF\", arXiv:2310.03716). RL against it writes longer answers. The fixes: Preference as Reward, a bounded "
              "reward centred on a reference (Fu et al. 2025, \"Reward Shaping to Mitigate Reward Hacking in RLHF\", "
              "arXiv:2502.18770; here the reference is the problem's reference answer), and a reward model trained with "
              "ODIN's length-decorrelation term (Chen et al. 2024, \"ODIN: Disentangled Reward Mitigates Hacking in RLHF\", "
              "arXiv:2402.07319). Both reward models are trained first, on the same pairs."),
    base=("model.path=tiny-arith", "data.task=arithmetic", "rollout.max_new_tokens=8", "train.eval_every=5", "train.eval_n=300",
          "monitor.window=5"),
    arms=(Arm("rm", "the reward model trained on length-confounded pairs", ("reward={name: rm, args: {path: ${lab.rm}}}",)),
          Arm("par", "fix: Preference as Reward around that reward model, centred on the reference answer",
              ("reward={name: par, args: {reward: {name: rm, args: {path: ${lab.rm}}}, reference_field: answer}}",)),
          Arm("odin", "fix: the reward model trained with ODIN's length-decorrelation term (length_coef=1)",
              ("reward={name: rm, args: {path: ${lab.rm_odin}}}",))),
    steps=150,
    claims=_length_claims,
    prepare=_train_rms,
)

# -- a learned image reward beside the verified checker ------------------------------------------------------------

#: pictures per pair file, and steps of the picture scorer trained on them
IMAGE_PAIRS, IMAGE_RM_STEPS = 600, 600


def _train_image_rm(folder, seed: int, log) -> dict[str, str]:
    """Pairs of `tiny-shapes`' own pictures ranked by the checker, and a picture scorer trained on them (`kind=image`);
    its folder, as `${lab.image_rm}` in the arms' overrides."""
    from assay.images.pairs import build_image_pairs
    from assay.rm.config import validate
    from assay.rm.pairs import write_pairs
    from assay.rm.train import train_rm

    pairs = folder / "pairs.jsonl"
    log(f"lab image-rewards: {IMAGE_PAIRS} pairs of tiny-shapes' pictures, ranked by the shapes checker -> {pairs.name}")
    write_pairs(pairs, build_image_pairs("tiny-shapes", "shapes", n=IMAGE_PAIRS, seed=seed, per_group=3))
    log(f"lab image-rewards: training the picture scorer on {pairs.name} ({IMAGE_RM_STEPS} steps)")
    shutil.rmtree(folder / "image-rm", ignore_errors=True)
    cfg = validate({"kind": "image", "model": "tiny-shapes", "seed": seed, "output_dir": str(folder), "run_name": "image-rm",
                    "data": {"path": str(pairs)}, "loss": {"center_coef": 0.01}, "train": {"steps": IMAGE_RM_STEPS, "batch_size": 32, "eval_every": IMAGE_RM_STEPS,
                                                             "save_every": 0}})
    return {"lab.image_rm": str(train_rm(cfg).run_dir)}


def _image_claims(s: dict[str, dict[str, Any]]) -> list[Claim]:
    check, learned, both = s["truth"], s["learned"], s["both"]
    real = learned["canary_end"] is not None and learned["canary_start"] is not None and learned["canary_end"] >= learned["canary_start"]
    hacked = not real and (learned["reward_gain"] or 0) > 0
    out = [Claim("Training on the verified checker raises held-out accuracy.", (check["accuracy_gain"] or 0) >= 0.03,
                 f"held-out accuracy {_pts(check['accuracy_start'])} → {_pts(check['accuracy_end'])} (best {_pts(check['accuracy_best'])})"),
           Claim("Training on the learned picture scorer alone raises its own score.", (learned["reward_gain"] or 0) > 0,
                 f"training reward {_pts(learned['reward_start'])} → {_pts(learned['reward_end'])}"),
           Claim("The verified checker tells whether that rise is real: a monitor fires when the scorer rises while the checker "
                 "falls, and stays quiet when both rise.", bool(learned["alarms"]) == hacked,
                 f"checker on the sampled pictures {_pts(learned['canary_start'])} → {_pts(learned['canary_end'])}, held-out "
                 f"{_pts(learned['accuracy_start'])} → {_pts(learned['accuracy_end'])}; alarms "
                 f"{', '.join(f'{m}@{st}' for m, st in learned['alarms']) or 'none'}"),
           Claim("Both rewards together (GDPO: each normalised in its group, weighted 1:1) end at a held-out accuracy at least "
                 "that of the learned scorer alone.", both["accuracy_end"] is not None and learned["accuracy_end"] is not None
                 and both["accuracy_end"] >= learned["accuracy_end"],
                 f"both {_pts(both['accuracy_end'])}, learned alone {_pts(learned['accuracy_end'])}, checker alone {_pts(check['accuracy_end'])}")]
    return out


_IMAGE_RM = "{name: rm, args: {path: ${lab.image_rm}}}"
IMAGE_REWARDS = Experiment(
    name="image-rewards",
    title="A learned picture reward beside the verified checker",
    question=("Image reward models are learned and get hacked like text ones (ImageReward, Xu et al. 2023, arXiv:2304.05977; "
              "the reward-hacking results of DDPO, Black et al. 2023, arXiv:2305.13301). Here the bundled `tiny-shapes` "
              "generator (Flow-GRPO) trains on three rewards with the same budget: the verified checker (counts of coloured "
              "blocks read back from the picture), a picture scorer trained with `assay rm train kind=image` on pairs of the "
              "generator's own pictures ranked by that checker, and both together with each reward normalised within its "
              "group before the user's weights apply (GDPO: Liu et al. 2026, arXiv:2601.05242), so a reward's scale does "
              "not decide its share. The checker re-scores every arm's pictures (the canary) and judges held-out accuracy."),
    base=("model.path=tiny-shapes", "data.task=shapes", "image.train_steps=5", "image.noise_level=1.2", "optim.lr=1e-4",
          "rollout.prompts_per_step=4", "rollout.group_size=8", "train.eval_every=10", "train.eval_n=200", "monitor.window=5"),
    arms=(Arm("truth", "the verified checker (credit: error)", ("reward={name: shapes, args: {credit: error}}",)),
          Arm("learned", "the learned picture scorer alone (the checker only watches: the canary)",
              (f"reward={_IMAGE_RM}",)),
          Arm("both", "both: checker and scorer, GDPO-normalised, weights 1:1",
              ("reward={name: weighted, args: {components: {checker: {name: shapes, args: {credit: error}}, "
               "learned: " + _IMAGE_RM + "}}}", "algo.advantage=gdpo"))),
    steps=60,
    claims=_image_claims,
    panels=(("reward/mean", "training reward"), ("canary/mean", "canary: the checker on the sampled pictures")),
    prepare=_train_image_rm,
)

EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (SPURIOUS, PRM_HACKING, LENGTH_HACKING, IMAGE_REWARDS)}
