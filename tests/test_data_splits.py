"""Held-out rows are never trained on: built-in tasks and user data in every supported format."""

import json

import pytest

from assay.config import DataConfig
from assay.data.datasets import build_source, prompt_key
from assay.errors import AssayError


def rows(n, dup_every=0):
    """n rows `{q, a}`; with dup_every, every dup_every-th row repeats the previous prompt (a dataset with repeats)."""
    out = []
    for i in range(n):
        j = i - 1 if dup_every and i % dup_every == 0 and i else i
        out.append({"q": f"{j}+{j}=", "a": str(2 * j), "uid": f"r{i}"})
    return out


def write(path, data, fmt):
    if fmt == "jsonl":
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = path.with_suffix(".parquet")
        pq.write_table(pa.Table.from_pylist(data), path)
    else:
        import datasets

        datasets.Dataset.from_list(data).save_to_disk(str(path))
    return str(path)


def trained_prompts(source, epochs=3):
    """Every prompt the source hands out over a few epochs of its training rows."""
    n = len(source._rows) if source._rows is not None else 200
    return {prompt_key(s) for s in source.next_batch(epochs * n)}


FIELDS = {"prompt": "q", "answer": "a", "id": "uid"}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "datasets"])
@pytest.mark.parametrize("dup_every", [0, 3])
def test_the_automatic_split_never_trains_on_a_held_out_prompt(tmp_path, fmt, dup_every):
    path = write(tmp_path / "train", rows(60, dup_every), fmt)
    src = build_source(DataConfig(task=None, path=path, fields=FIELDS, eval_fraction=0.2), seed=3, eval_n=1000)
    held = {prompt_key(s) for s in src.heldout}
    assert len(src.heldout) >= 12 and held
    trained = trained_prompts(src)
    assert trained and not trained & held
    # nothing is lost either: every prompt is on exactly one side
    assert trained | held == {r["q"] for r in rows(60, dup_every)}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "datasets"])
def test_an_eval_file_is_never_trained_on_even_when_the_files_overlap(tmp_path, fmt, caplog):
    train = rows(40)
    heldout = train[30:] + [{"q": "99+99=", "a": "198", "uid": "x"}]  # the last 10 training rows are also in the eval file
    src = build_source(DataConfig(task=None, path=write(tmp_path / "train", train, fmt), eval_path=write(tmp_path / "eval", heldout, fmt), fields=FIELDS),
                       seed=0, eval_n=1000)
    held = {prompt_key(s) for s in src.heldout}
    assert len(held) == 11
    assert not trained_prompts(src) & held
    assert "10 training rows repeat a held-out prompt" in caplog.text


def test_a_split_that_leaves_nothing_to_train_on_is_refused(tmp_path):
    path = write(tmp_path / "one", [{"q": "1+1=", "a": "2"}], "jsonl")
    with pytest.raises(AssayError, match="leaves none to train on"):
        build_source(DataConfig(task=None, path=path, fields={"prompt": "q", "answer": "a"}), seed=0, eval_n=10)
    same = write(tmp_path / "same", [{"q": "1+1=", "a": "2"}] * 5, "jsonl")
    with pytest.raises(AssayError, match="every training row is also in the held-out data"):
        build_source(DataConfig(task=None, path=same, eval_path=same, fields={"prompt": "q", "answer": "a"}), seed=0, eval_n=10)


@pytest.mark.parametrize("task,args", [("arithmetic", {}), ("arithmetic", {"terms": 3, "ops": "+-*"}), ("countdown", {})])
def test_built_in_tasks_never_train_on_a_held_out_problem(task, args):
    src = build_source(DataConfig(task=task, task_args=args), seed=1, eval_n=2000)
    held = {prompt_key(s) for s in src.heldout}
    assert len(held) == 2000
    assert not trained_prompts(src, epochs=20) & held  # 4000 training problems
