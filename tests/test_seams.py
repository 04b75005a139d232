"""The seams new work plugs into: backends by name, token-exact trajectories with a loss mask,
extras by name, hyperparameters checked against their function."""

import subprocess
import sys

import pytest
import torch

from assay.algos import ADVANTAGES, bind_args
from assay.config import AlgoConfig
from assay.errors import AssayError
from assay.training import learner
from assay.training.learner import collate, compute_advantages
from assay.types import RewardResult, Sample, Trajectory


def assay(*args):
    return subprocess.run([sys.executable, "-m", "assay.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("override,needle", [
    ("rollout.backend=nope", "unknown rollout.backend 'nope'; known: openai, torch, vllm"),
    ("algo.advantage_args={bogus: 1}", "algo.advantage_args: unknown argument 'bogus' for grpo; accepted: eps"),
    ("algo.advantage_args={eps: lots}", "algo.advantage_args: eps='lots' is not a valid float for grpo"),
    ("algo.loss_args={dual_clp: 3}", "algo.loss_args: unknown argument 'dual_clp' for ppo_clip; accepted: dual_clip"),
    ("algo.loss_args={clip_low: 0.1}", "'clip_low' is not a hyperparameter of ppo_clip"),
])
def test_a_bad_backend_or_hyperparameter_is_one_line(tmp_path, override, needle):
    p = assay("train", override, f"output_dir={tmp_path}", "train.steps=1")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert needle in p.stderr, p.stderr
    assert not any(tmp_path.iterdir())  # refused before any folder was made


def test_hyperparameters_are_read_off_the_signature():
    gae = ADVANTAGES.get("gae")
    assert bind_args(gae, {"gamma": 0.9, "lam": 1}, ("rewards", "group", "mask"), "x") == {"gamma": 0.9, "lam": 1.0}
    with pytest.raises(AssayError, match="'values' is not a hyperparameter of gae"):
        bind_args(gae, {"values": 1}, ("rewards", "group", "mask"), "x")
    with pytest.raises(AssayError, match="accepted: gamma, lam, whiten"):
        bind_args(gae, {"gama": 0.9}, ("rewards", "group", "mask"), "x")


def traj(prompt, completion, logprobs, loss_mask=None, group=0):
    return Trajectory(Sample("s", "p"), "", prompt, completion, logprobs, True, group, loss_mask=loss_mask)


def test_single_turn_batches_are_what_they_were():
    """A trajectory without a loss mask, or with an all-ones one, gives exactly the batch written out here."""
    trajs = [traj([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3]), traj([4], [3], [-0.5], group=1)]
    res = [RewardResult(1.0), RewardResult(None)]
    for b in (collate(trajs, res, 0, torch.device("cpu")),
              collate([traj(t.prompt_ids, t.completion_ids, t.logprobs, [1] * len(t.completion_ids), t.group) for t in trajs], res, 0, torch.device("cpu"))):
        assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [0, 4, 3, 0, 0]]
        assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
        assert b.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 1, 1, 1]]
        assert b.mask.tolist() == [[1, 1, 1], [1, 0, 0]]
        torch.testing.assert_close(b.old_logprobs, torch.tensor([[-0.1, -0.2, -0.3], [-0.5, 0.0, 0.0]]))
        assert b.rewards[0] == 1.0 and b.rewards[1].isnan() and b.group.tolist() == [0, 1] and b.lengths.tolist() == [3, 1]


def test_tokens_the_model_was_shown_stay_out_of_the_loss(tiny_model_dir):
    """Tool output inside a completion: attended to, never trained on, whatever its advantage."""
    from assay.models import load_policy

    model, _ = load_policy(str(tiny_model_dir))
    model.train()
    # model turn [20, 21], tool output [30, 31, 32] (loss mask 0), model turn [22, 2]
    shown = traj([40, 41, 42], [20, 21, 30, 31, 32, 22, 2], [-1.0] * 7, [1, 1, 0, 0, 0, 1, 1])
    b = collate([shown], [RewardResult(1.0)], 0, torch.device("cpu"))
    assert b.attention_mask.tolist() == [[1] * 10] and b.mask.tolist() == [[1, 1, 0, 0, 0, 1, 1]] and b.lengths.tolist() == [7]
    assert b.old_logprobs.tolist() == [[-1.0, -1.0, 0.0, 0.0, 0.0, -1.0, -1.0]]

    def grads(adv):
        model.zero_grad(set_to_none=True)
        learner.accumulate_step(model, None, b, adv, AlgoConfig(loss="reinforce"), 1.0, 8, fast=False)
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    base = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]])
    other = torch.tensor([[1.0, 1.0, 9.0, -4.0, 7.0, 1.0, 1.0]])  # huge advantages on the shown tokens
    torch.testing.assert_close(grads(other), grads(base))
    assert grads(base).abs().max() > 0
    # estimators give the shown tokens nothing either
    adv = compute_advantages(collate([shown, traj([40], [20, 2], [-1.0, -1.0], group=0)], [RewardResult(1.0), RewardResult(0.0)], 0,
                                     torch.device("cpu")), AlgoConfig(advantage="grpo"))
    assert adv[0, 2:5].tolist() == [0.0, 0.0, 0.0] and adv[0, 0] > 0


def test_an_estimator_with_a_new_extra_touches_two_places(tiny_model_dir, tmp_path):
    """The example of assay.training.extras: one provider, one estimator, selected by module:attr."""
    from assay.config import load_config
    from assay.report.metrics import read_metrics
    from assay.training.rl import Trainer

    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", "run_name=x", "train.steps=2", "train.eval_n=4",
                             "reward_workers=0", "rollout.prompts_per_step=2", "rollout.group_size=3", "reward={name: random}",
                             "algo.advantage=_extra_example:shorter_prompts_first", "algo.advantage_args={scale: 0.5}"])
    rows = [r for r in read_metrics(Trainer(cfg).fit(progress=False).run_dir / "metrics.jsonl") if "actor/loss" in r]
    import _extra_example

    assert [r["step"] for r in rows] == [1, 2] and _extra_example.CALLS["prompt_len"] == 2
