"""Vision-language policies: pictures in prompts from data, the processor seam, sampler/learner agreement, training, eval controls."""

from __future__ import annotations

import io
import json
import random

import numpy as np
import pytest
import torch

from assay.batch import collate
from assay.data.tasks.visual import VisualCount, draw_blocks
from assay.errors import AssayError
from assay.images.shapes import PALETTE
from assay.models.logprobs import token_logprobs
from assay.rollout.base import SamplingParams, encode_prompt
from assay.rollout.torch_sampler import TorchSampler
from assay.types import RewardResult, Sample
from assay.vision.inputs import blank_pictures, has_images, jsonable, resolve_images, shuffle_pictures
from assay.vision.model import build_tiny_vlm


@pytest.fixture(scope="module")
def vlm():
    from assay.models import quiet_hf

    quiet_hf()
    model, tok = build_tiny_vlm(seed=0)
    return model.eval(), tok


def _picture(n: int, colour: str = "red", seed: int = 0):
    rng = random.Random(seed)
    return draw_blocks([(colour, c) for c in rng.sample(range(36), n)], 24, 4)


def _ask(img, text="red?", **extra) -> Sample:
    return Sample("q", [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": text}]}], "1", **extra)


def test_the_task_draws_what_it_asks_and_keeps_its_splits_apart():
    task = VisualCount()
    rng = random.Random(0)
    for _ in range(100):
        s = task.make(rng)
        pixels = np.asarray(s.prompt[0]["content"][0]["image"])
        colour = s.fields["colour"]
        blocks = int((pixels == PALETTE[colour]).all(-1).sum()) // 9  # each block is 3×3 pixels of its colour
        assert blocks == int(s.answer) and s.prompt[0]["content"][1]["text"] == f"{colour}?"
    held = task.heldout(50)
    assert [s.id for s in held] == [s.id for s in VisualCount().heldout(50)]  # the same list in every run
    keys = {task.key(s) for s in held}
    stream = task.stream("train", seed=3)
    assert not any(task.key(next(stream)) in keys for _ in range(300))
    blank = VisualCount(blank=True).heldout(5)
    assert [s.answer for s in blank] == [s.answer for s in held[:5]] and not np.asarray(blank[0].prompt[0]["content"][0]["image"]).any()


def test_prompt_tokens_come_from_the_processor_and_count_the_image_tokens(vlm):
    model, tok = vlm
    ids = encode_prompt(tok, _ask(_picture(2)))
    image_id = model.config.image_token_index
    assert ids.count(image_id) == 36 and tok.decode([i for i in ids if i != image_id]) == "red?="
    with pytest.raises(AssayError, match="without an image processor"):
        from assay.models import build_char_tokenizer

        encode_prompt(build_char_tokenizer(), _ask(_picture(2)))


def test_sampler_and_learner_agree_on_pictures_several_images_turns_and_text_rows(vlm):
    """The learner's logprobs of what the torch sampler drew, for one-picture, two-picture two-turn and text-only prompts in one batch."""
    model, tok = vlm
    two = Sample("two", [{"role": "user", "content": [{"type": "image", "image": _picture(1)}, {"type": "text", "text": "red?"}]},
                         {"role": "assistant", "content": "1"},
                         {"role": "user", "content": [{"type": "text", "text": " and "}, {"type": "image", "image": _picture(3, "blue")},
                                                      {"type": "text", "text": "blue?"}]}], "3")
    text = Sample("text", [{"role": "user", "content": "12+3"}], "15")
    samples = [_ask(_picture(2)), two, text]
    trajs = TorchSampler(model, tok).generate(samples, 3, SamplingParams(max_new_tokens=4, temperature=1.0), torch.Generator().manual_seed(0))
    assert [t.info["vision"]["pixel_values"].shape[0] if "vision" in t.info else 0 for t in trajs[::3]] == [1, 2, 0]
    batch = collate(trajs, [RewardResult(1.0)] * len(trajs), tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch, 1.0)
        part = batch.select(torch.tensor([8, 3, 0]))  # rows of each kind, out of order: each keeps its own pictures
        lp_part, _ = token_logprobs(model, part, 1.0)
    assert batch.mask.sum() > 0
    assert torch.allclose(lp * batch.mask, batch.old_logprobs, atol=1e-5)
    assert torch.allclose(lp_part * part.mask, part.old_logprobs, atol=1e-5)


def test_the_picture_placeholder_is_never_sampled_and_engines_that_cannot_carry_pictures_refuse(vlm):
    from assay.config import RolloutConfig
    from assay.rollout.base import make_sampler

    model, tok = vlm
    image_id = model.config.image_token_index
    kept = model.lm_head.weight[image_id].clone()
    with torch.no_grad():  # make <image> the likeliest token everywhere: the sampler must still never write it
        model.lm_head.weight[image_id] += 5.0
    try:
        trajs = TorchSampler(model, tok).generate([_ask(_picture(2))], 32, SamplingParams(max_new_tokens=4, temperature=1.0),
                                                  torch.Generator().manual_seed(0))
        assert not any(image_id in t.completion_ids for t in trajs)
        batch = collate(trajs, [RewardResult(1.0)] * len(trajs), tok.pad_token_id, torch.device("cpu"))
        with torch.no_grad():
            lp, ent = token_logprobs(model, batch, 1.0, with_entropy=True)
        assert torch.allclose(lp * batch.mask, batch.old_logprobs, atol=1e-5) and torch.isfinite(ent).all()
    finally:
        with torch.no_grad():
            model.lm_head.weight[image_id] = kept
    with pytest.raises(AssayError, match="rollout.backend=openai .* pictures"):
        make_sampler("openai", model, tok, RolloutConfig(backend="openai", server_url="http://127.0.0.1:9"))


def test_pictures_change_the_answer_distribution(vlm):
    """Not decoration: the same question about two different pictures gives different logprobs (the vision tower is in the path)."""
    model, tok = vlm
    greedy = TorchSampler(model, tok).generate([_ask(_picture(1)), _ask(_picture(4, "green"))], 1, SamplingParams(max_new_tokens=2, temperature=0.0))
    assert greedy[0].logprobs != greedy[1].logprobs


def _write_data(folder):
    """The same 6 rows as JSONL with paths, Parquet with bytes in an images column, and a datasets folder with an Image feature."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (folder / "pics").mkdir()
    rows, blobs, pics = [], [], []
    for i in range(6):
        img = _picture(i % 4 + 1, seed=i)
        img.save(folder / "pics" / f"{i}.png")
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        blobs.append(buf.getvalue())
        pics.append(img)
        rows.append({"id": str(i), "answer": str(i % 4 + 1)})
    part = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "red?"}]}]
    (folder / "d.jsonl").write_text("".join(json.dumps({**r, "prompt": [{"role": "user", "content": [
        {"type": "image", "image": f"pics/{r['id']}.png"}, {"type": "text", "text": "red?"}]}]}) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist([{**r, "prompt": part, "images": [{"bytes": b, "path": None}]} for r, b in zip(rows, blobs)]),
                   folder / "d.parquet")
    feats = datasets.Features({"id": datasets.Value("string"), "answer": datasets.Value("string"),
                               "prompt": [{"role": datasets.Value("string"), "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
                               "images": datasets.Sequence(datasets.Image())})
    datasets.Dataset.from_dict({"id": [r["id"] for r in rows], "answer": [r["answer"] for r in rows], "prompt": [part] * 6,
                                "images": [[p] for p in pics]}, features=feats).save_to_disk(str(folder / "ds"))
    return pics


def test_jsonl_parquet_and_datasets_folders_give_the_same_pictures(tmp_path):
    from assay.config import DataConfig
    from assay.data.datasets import samples_from

    pics = _write_data(tmp_path)
    for name in ("d.jsonl", "d.parquet", "ds"):
        samples = samples_from(str(tmp_path / name), DataConfig(task=None, path=str(tmp_path / name)))
        assert len(samples) == 6 and all(has_images(s) for s in samples) and "images" not in samples[0].fields
        got = [s.prompt[0]["content"][0]["image"] for s in sorted(samples, key=lambda s: s.id)]
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, pics)), name
        json.dumps([jsonable(s.prompt) for s in samples])  # logs and prompt keys take them
    from assay.config import load_config
    from assay.training.rl import Trainer

    # and a run trains on one with no code: data.path, the verifier named
    cfg = load_config(None, [f"output_dir={tmp_path}", "run_name=own", "model.path=tiny-count", f"data.path={tmp_path / 'd.parquet'}",
                             "data.eval_fraction=0.34", "reward.name=arithmetic", "train.steps=2", "train.eval_every=2", "reward_workers=0",
                             "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=3", "train.threads=1"])
    rows = Trainer(cfg).fit(progress=False).run_dir / "metrics.jsonl"
    assert any("eval/image_reliance" in json.loads(line) for line in rows.read_text().splitlines())


@pytest.mark.parametrize("case, match", [("missing", "cannot read picture"), ("garbage", "not a readable picture"),
                                         ("huge", "larger than"), ("url", "is a URL"), ("unpaired", "images column has 0")])
def test_a_bad_picture_is_one_line_naming_its_row(tmp_path, monkeypatch, case, match):
    import assay.vision.inputs as inputs

    (tmp_path / "junk.png").write_bytes(b"not a png at all")
    _picture(1).save(tmp_path / "ok.png")
    value = {"missing": "nope.png", "garbage": "junk.png", "huge": "ok.png", "url": "https://example.com/a.png", "unpaired": None}[case]
    if case == "huge":
        monkeypatch.setattr(inputs, "MAX_PIXELS", 100)
    part = {"type": "image"} if value is None else {"type": "image", "image": value}
    s = Sample("row-7", [{"role": "user", "content": [part, {"type": "text", "text": "red?"}]}], "1")
    with pytest.raises(AssayError, match=match) as e:
        resolve_images([s], tmp_path, "data.jsonl")
    assert "row id 'row-7'" in str(e.value) and "\n" not in str(e.value)


def test_picture_controls_keep_questions_and_answers(vlm):
    from assay.vision.inputs import describe_pictures

    rows = VisualCount().heldout(4)
    shuffled, blank = shuffle_pictures(rows), blank_pictures(rows)
    said = describe_pictures(rows)
    assert not any(has_images(s) for s in said) and said[0].prompt[0]["content"][0]["text"].startswith("blocks: ")
    with pytest.raises(AssayError, match="needs an image_description column"):
        describe_pictures([_ask(_picture(1))])

    def pic(s):
        return np.asarray(s.prompt[0]["content"][0]["image"])

    assert all(np.array_equal(pic(shuffled[i]), pic(rows[(i + 1) % 4])) for i in range(4))
    assert not any(pic(b).any() for b in blank) and [s.answer for s in blank] == [s.answer for s in rows]
    assert [s.prompt[0]["content"][1] for s in shuffled] == [s.prompt[0]["content"][1] for s in rows]


def _vision_cfg(tmp_path, name, steps, *more):
    from assay.config import load_config

    return load_config(None, [f"output_dir={tmp_path}", f"run_name={name}", "model.path=tiny-count", "data.task=visual_count",
                              f"train.steps={steps}", "train.eval_every=2", "train.eval_n=16", "train.save_every=1", "reward_workers=0",
                              "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3", "train.threads=1", *more])


def test_a_vision_run_trains_checks_the_pictures_and_resumes_bit_for_bit(tmp_path):
    """The text loop unchanged: the reliance metrics at each evaluation, a final/ that loads as a VLM, exact resume."""
    from _train_helpers import weights

    from assay.models import load_policy
    from assay.report.metrics import read_metrics
    from assay.training.rl import Trainer

    full = Trainer(_vision_cfg(tmp_path, "full", 4)).fit(progress=False).run_dir
    cut = Trainer(_vision_cfg(tmp_path, "cut", 2)).fit(progress=False).run_dir
    Trainer(_vision_cfg(tmp_path, "cut", 4), run_dir=cut, resume=True).fit(progress=False)
    rows = read_metrics(full / "metrics.jsonl")
    evals = [r for r in rows if "eval/image_reliance" in r]
    assert evals and all(r["eval/image_reliance"] == pytest.approx(r["eval/accuracy"] - r["eval/accuracy_shuffled_images"]) for r in evals)

    def steps(d):
        return [{k: v for k, v in r.items() if not k.startswith(("perf/", "eval/")) and not k.endswith("_per_s")}
                for r in read_metrics(d / "metrics.jsonl") if "actor/loss" in r]

    assert steps(full) == steps(cut)
    a, b = weights(full / "final"), weights(cut / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model, tok = load_policy(str(full / "final"))
    assert model.policy_kind == "vision" and tok.processor is not None
    sample = json.loads((full / "samples.jsonl").read_text().splitlines()[0])
    assert "<image>×36" in sample["prompt_text"] and sample["prompt"][0]["content"][0]["image"].startswith("<image 24x24")


def test_eval_images_controls_from_the_command_line(capsys):
    from assay.cli import main

    assert main(["eval", "--model", "tiny-count", "--task", "visual_count", "--n", "24", "--k", "0", "--images", "shuffle", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["images"] == "shuffle" and out["n"] == 24
    assert main(["eval", "--model", "tiny-count", "--task", "visual_count", "--n", "8", "--k", "0", "--images", "describe", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["images"] == "describe"
    assert main(["eval", "--model", "tiny-arith", "--n", "4", "--k", "0", "--images", "blank"]) == 2
    assert "none of these 4 has one" in capsys.readouterr().err


@pytest.mark.parametrize("reliance, fires", [(0.02, True), (0.3, False)])
def test_the_blind_monitor_fires_when_accuracy_rises_without_looking(reliance, fires):
    from assay.config import MonitorConfig
    from assay.training.hacking import HackingMonitor

    monitor = HackingMonitor(MonitorConfig())
    fired = []
    for step, acc in ((0, 0.30), (10, 0.45), (20, 0.60)):
        metrics = {"eval/accuracy": acc, "eval/accuracy_shuffled_images": acc - reliance, "eval/image_reliance": reliance}
        fired += [line for line in monitor.check(step, metrics)[1]]
    assert any(line.startswith("blind: held-out accuracy rose from 0.300 to 0.450") for line in fired) is fires
    restored = HackingMonitor(MonitorConfig())
    restored.load_state_dict(monitor.state_dict())
    assert restored.reliance == monitor.reliance


def test_a_judge_sees_the_pictures_through_assay_serve_model(vlm):
    """`assay serve model tiny-count` takes OpenAI image_url parts; a judge sends the prompt's pictures with its question, so its
    verdict is what the served model answers about that picture (here: the judge template asks tiny-count to count)."""
    import sys

    from test_judge import Proc

    from assay.rewards.judge import Judge
    from assay.types import Trajectory
    from assay.vision.inputs import data_url

    server = Proc([sys.executable, "-m", "assay.cli", "serve", "model", "tiny-count", "--port", "0", "--max-new-tokens", "3"], "serving model")
    try:
        pictures = [_picture(n, seed=n) for n in (1, 2, 3, 4)]
        ask = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(pictures[1])}}, {"type": "text", "text": "red?"}]}]
        status, body = server.post("/v1/chat/completions", {"messages": ask, "max_tokens": 2, "temperature": 0})
        assert status == 200 and body["usage"]["prompt_tokens"] == 36 + len("red?="), body
        for bad, why in (({"type": "image_url", "image_url": {"url": "/etc/passwd"}}, "data:image/png;base64"),
                         ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "not a readable picture"),
                         ({"type": "audio"}, "a part must be")):
            status, body = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [bad]}], "max_tokens": 1})
            assert status == 400 and why in body["error"]["message"], body
        # the judge: pointwise, its template the policy's own question; the rating it parses is the served model's count
        rows = [Trajectory(_ask(p), "red?", [], [], [], True) for p in pictures]
        seen = Judge(url=server.url, template="{completion}", low=0, high=9, max_tokens=2, cache=False)(rows)
        tok = vlm[1]
        served, _ = load_policy_tiny_count()
        direct = TorchSampler(served, tok).generate([_ask(p) for p in pictures], 1, SamplingParams(max_new_tokens=2, temperature=0.0))
        assert [r.components["rating"] for r in seen] == [float(t.completion) for t in direct]
        blind = Judge(url=server.url, template="{completion}", low=0, high=9, max_tokens=2, cache=False, pictures=False)(rows)
        assert len({r.components["rating"] for r in seen}) > 1 and len({r.score for r in blind}) == 1  # without the pictures: one answer for all
    finally:
        assert server.stop() == 0


def load_policy_tiny_count():
    from assay.models import load_policy

    model, tok = load_policy("tiny-count")
    return model.eval(), tok


def test_an_environment_may_show_a_picture_and_the_learner_sees_it_too(vlm):
    """A two-turn episode whose second observation is a picture: its image tokens are shown tokens (mask 0) inside the
    completion, the next turn is sampled with the picture, and the learner's logprobs of the sampled turns match."""
    from assay.envs import Environment, Step
    from assay.rollout.multiturn import Budget, MultiTurn

    model, tok = vlm

    class ShowsPicture(Environment):
        chat_role = "user"

        def reset(self, sample):
            self.turns = 0
            return [{"type": "text", "text": "look"}]

        def step(self, action):
            self.turns += 1
            if self.turns == 1:
                return Step([{"type": "image", "image": _picture(3)}, {"type": "text", "text": "red?"}], 0.0, False, {})
            return Step("", float(action.strip() == "3"), True, {})

    loop = MultiTurn(TorchSampler(model, tok), tok, ShowsPicture, Budget(max_turns=3, max_tokens=200, max_seconds=60), chat=True)
    trajs = loop.run([Sample("s", [{"role": "user", "content": "look"}])], 4, SamplingParams(max_new_tokens=3, temperature=1.0),
                     torch.Generator().manual_seed(0))
    image_id = model.config.image_token_index
    assert len(trajs) == 4
    for t in trajs:
        assert t.info["vision"]["pixel_values"].shape[0] == 1 and t.completion_ids.count(image_id) == 36
        assert all(m == 0 for i, m in zip(t.completion_ids, t.loss_mask) if i == image_id) and len(t.turns) == 2
    batch = collate(trajs, [RewardResult(1.0)] * len(trajs), tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch, 1.0)
    assert torch.allclose(lp * batch.mask, batch.old_logprobs, atol=1e-5)
    plain = MultiTurn(TorchSampler(model, tok), tok, ShowsPicture, Budget(max_turns=3, max_tokens=200, max_seconds=60), chat=False)
    with pytest.raises(AssayError, match="a plain-text episode takes text"):
        plain.run([Sample("s", "look")], 1, SamplingParams(max_new_tokens=3, temperature=1.0))


def test_model_freeze_keeps_the_vision_tower_and_refuses_a_pattern_that_matches_nothing(tmp_path):
    from assay.models import load_policy
    from assay.training.rl import Trainer

    run = Trainer(_vision_cfg(tmp_path, "frozen", 2, "model.freeze=[vision_tower, multi_modal_projector]")).fit(progress=False)
    before, _ = load_policy("tiny-count")
    after, _ = load_policy(str(run.run_dir / "final"))
    moved = {n for (n, p), (_, q) in zip(before.named_parameters(), after.named_parameters()) if not torch.equal(p, q)}
    assert moved and all("language_model" in n or "lm_head" in n for n in moved)
    assert run.final["trainable parameters"] < sum(p.numel() for p in before.parameters())
    for bad, why in (("vison_tower", "matches no parameter"), ("(", "is not a regular expression")):
        with pytest.raises(AssayError, match=why):
            Trainer(_vision_cfg(tmp_path, f"bad{len(why)}", 1, f"model.freeze=['{bad}']"))
