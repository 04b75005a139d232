"""Image reward models: pictures in every form a pair file holds, the scorer, `assay rm train kind=image`, the `rm` reward on
an image policy's pictures, and `assay rm pairs --task shapes`."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from assay.errors import AssayError  # noqa: E402
from assay.images.scorer import ImageEncoder, build_scorer, decode_image, to_data_uri  # noqa: E402
from assay.images.shapes import draw  # noqa: E402
from assay.report.metrics import read_metrics  # noqa: E402
from assay.rewards.spec import build_reward  # noqa: E402
from assay.rm.config import load_rm_config  # noqa: E402
from assay.rm.model import load_rm  # noqa: E402
from assay.rm.train import train_rm  # noqa: E402
from assay.types import Sample, Trajectory  # noqa: E402


def picture(prompt_counts, seed=0):
    return draw(prompt_counts, random.Random(seed))


def png_bytes(img):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def test_a_picture_reads_the_same_in_every_form_a_pair_file_holds(tmp_path):
    img = picture({"red": 2, "blue": 1})
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png_bytes(img))
    forms = [img, to_data_uri(img), "pics/a.png", {"bytes": png_bytes(img), "path": None}, {"path": "pics/a.png"}]
    for form in forms:
        assert np.array_equal(decode_image(form, 16, tmp_path), img), type(form)
    big = decode_image(np.kron(img, np.ones((2, 2, 1), dtype=np.uint8)), 16)  # another size: resized to the scorer's
    assert big.shape == (16, 16, 3)
    for bad, needle in ((42, "expected a picture"), ("data:image/png;base64,bm90IGEgcG5n", "not a readable picture"),
                        ("missing.png", "not a readable picture"), ({"bytes": b"\x00\x01"}, "not a readable picture")):
        with pytest.raises(AssayError, match=needle):
            decode_image(bad, 16, tmp_path, where="pairs.jsonl: row 3, chosen")


def test_the_scorer_reads_a_prompt_the_same_whatever_its_padding_and_reloads_to_the_same_scores(tmp_path):
    model, tok = build_scorer("tiny-shapes", seed=1)
    assert torch.equal(build_scorer("tiny-shapes", seed=1)[0].conv1.weight, model.conv1.weight)  # the seed decides the weights
    enc = ImageEncoder(tok, model.config.max_prompt_tokens, model.config.sample_size)
    items = [("2 red 1 blue", picture({"red": 2, "blue": 1})), ("3 green", picture({"green": 3}, 1))]
    inputs, lengths = enc.inputs(items)
    assert inputs["pixel_values"].shape == (2, 3, 16, 16) and lengths.tolist() == [0, 0]
    scores = model(**inputs).logits[:, 0]
    alone = model(**enc.inputs(items[1:])[0]).logits[:, 0]  # no padding in a batch of one: the same score
    assert torch.allclose(scores[1:], alone, atol=1e-6)
    from assay.rm.model import save_rm

    save_rm(tmp_path / "rm", model, tok, {"kind": "image", "max_length": 8, "sample_size": 16})
    again, _, meta = load_rm(tmp_path / "rm")
    assert meta["kind"] == "image" and torch.allclose(again(**inputs).logits[:, 0], scores, atol=1e-6)
    with pytest.raises(AssayError, match="at most 8"):
        enc.inputs([("1 red " * 5, items[0][1])])


def separable_pairs(n=96):
    """Right drawings (chosen) against the same prompt's drawing with one block too many (rejected)."""
    rng, colours, rows = random.Random(0), ["red", "green", "blue", "yellow", "white"], []
    for i in range(n):
        c = rng.choice(colours)
        k = rng.randint(1, 3)
        rows.append({"id": str(i), "prompt": f"{k} {c}", "chosen": to_data_uri(draw({c: k}, rng)),
                     "rejected": to_data_uri(draw({c: k + 1}, rng))})
    return rows


def rm_args(tmp_path, data, name, *extra):
    return ["kind=image", "model=tiny-shapes", f"data.path={data}", f"output_dir={tmp_path}", f"run_name={name}", "train.threads=1",
            "train.batch_size=16", "optim.lr=1e-3", "optim.warmup_steps=2", "data.eval_fraction=0.25", *extra]


def test_rm_train_kind_image_learns_the_pairs_resumes_exactly_and_scores_an_image_policy_pictures(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in separable_pairs()))
    common = ["train.eval_every=10", "train.save_every=10"]
    whole = train_rm(load_rm_config(None, rm_args(tmp_path, data, "whole", "train.steps=40", *common)))
    rows = read_metrics(whole.run_dir / "metrics.jsonl")
    accs = [r["eval/pair_accuracy"] for r in rows if "eval/pair_accuracy" in r]
    assert accs[-1] >= 0.9 and accs[-1] > accs[0], accs
    meta = json.loads((whole.model_dir / "assay_rm.json").read_text())
    assert meta["kind"] == "image" and meta["sample_size"] == 16
    train_rm(load_rm_config(None, rm_args(tmp_path, data, "cut", "train.steps=20", *common)))
    resumed = train_rm(resume=tmp_path / "cut", overrides=["train.steps=40"])
    from safetensors.torch import load_file

    a, b = load_file(whole.model_dir / "model.safetensors"), load_file(resumed.model_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # the `rm` reward reads the picture an image policy drew (info["image"]); a trajectory without one fails alone
    reward = build_reward({"name": "rm", "args": {"path": str(whole.run_dir)}})
    right, extra = draw({"blue": 2}, random.Random(5)), draw({"blue": 3}, random.Random(5))
    trajs = [Trajectory(Sample("a", "2 blue", "2 blue"), "<image>", [], [0], [0.0], True, info={"image": img}) for img in (right, extra)]
    trajs.append(Trajectory(Sample("b", "2 blue", "2 blue"), "no picture", [], [0], [0.0], True))
    got = reward(trajs)
    assert got[0].score > got[1].score and "info['image']" in (got[2].error or "")

    # `assay rm eval` on a pair file of pictures
    p = subprocess.run([sys.executable, "-m", "assay", "rm", "eval", "--path", str(whole.run_dir), "--data", str(data)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "pair_accuracy" in p.stdout + p.stderr


def test_kind_image_refuses_what_a_picture_scorer_does_not_do(tmp_path):
    for extra, needle in (("loss.length_coef=0.1", "pictures have no length"), ("lora={r: 4}", "lora with kind=image")):
        with pytest.raises(AssayError, match=needle):
            load_rm_config(None, rm_args(tmp_path, "p.jsonl", "x", extra))
    with pytest.raises(AssayError, match="no image policy"):
        build_scorer("tiny-arith")


def test_rm_pairs_for_the_shapes_task_are_the_policy_pictures_ranked_by_the_checker(tmp_path):
    from assay.data.tasks.shapes import ShapeCount

    out = tmp_path / "pairs.jsonl"
    p = subprocess.run([sys.executable, "-m", "assay", "rm", "pairs", "--task", "shapes", "--n", "6", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and len({r["id"] for r in rows}) == 6
    checker = ShapeCount(credit="error")
    for r in rows:  # lossless: the checker scores the written pictures as it scored the drawn ones
        sample = Sample(r["id"], r["prompt"], r["prompt"])
        for side in ("chosen", "rejected"):
            img = decode_image(r[side], 16)
            traj = Trajectory(sample, "<image>", [], [0], [0.0], True, info={"image": img})
            assert checker.score(traj).score == pytest.approx(r[f"{side}_score"], abs=1e-6)
        assert r["chosen_score"] > r["rejected_score"] and r["subset"] == ("right" if r["chosen_score"] == 1.0 else "closer")
    p = subprocess.run([sys.executable, "-m", "assay", "rm", "pairs", "--task", "shapes", "--mix", "{random: 1}", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "drop --mix" in p.stderr


def test_a_parquet_file_with_datasets_image_columns_reads_as_picture_pairs(tmp_path):
    """Pick-a-Pic's layout once mapped: a caption and two `Image` columns, stored by `datasets` as {bytes, path} structs."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    from assay.images.scorer import decode_comparisons
    from assay.rm.data import read_comparisons

    rng = random.Random(0)
    pics = [(draw({"red": k}, rng), draw({"red": k + 1}, rng)) for k in (1, 2, 3)]
    rows = [{"caption": f"{k} red", "jpg_0": {"bytes": png_bytes(a), "path": None}, "jpg_1": {"bytes": png_bytes(b), "path": None}}
            for k, (a, b) in zip((1, 2, 3), pics)]
    path = tmp_path / "pick.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    comps = decode_comparisons(read_comparisons(str(path), {"prompt": "caption", "chosen": "jpg_0", "rejected": "jpg_1"}), 16, str(path))
    assert [c.prompt for c in comps] == ["1 red", "2 red", "3 red"]
    assert all(np.array_equal(c.chosen[0], a) and np.array_equal(c.rejected[0], b) for c, (a, b) in zip(comps, pics))
