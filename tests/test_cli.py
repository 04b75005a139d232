"""The `assay` command: user errors are one line and a non-zero exit, never a traceback."""

import json
import subprocess
import sys

import pytest


def assay(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "assay.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def one_line_error(p, needle):
    assert p.returncode == 2, p.stderr
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("assay: error:"), p.stderr
    assert "Traceback" not in p.stderr
    assert needle in lines[0], lines[0]


def test_missing_model_path(tmp_path):
    one_line_error(assay("train", f"model.path={tmp_path / 'nope'}", f"output_dir={tmp_path}"), "is not a directory")
    one_line_error(assay("eval", "--model", str(tmp_path / "nope")), "is not a directory")


def test_malformed_jsonl_line_is_named(tmp_path, tiny_model_dir):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    p = assay("train", f"model.path={tiny_model_dir}", "data.task=null", f"data.path={data}", "reward=arithmetic", f"output_dir={tmp_path}")
    one_line_error(p, "d.jsonl:2: malformed JSON line")


def test_unknown_task():
    one_line_error(assay("eval", "--task", "sudoku"), "unknown task 'sudoku'; known: arithmetic, arithmetic_steps, code-fix, countdown, mix, shapes, sql-agent")
    one_line_error(assay("train", "data.task=sudoku", "train.steps=1"), "unknown task 'sudoku'")


@pytest.mark.parametrize("override,needle", [("train.steps=zero", "invalid config value train.steps='zero'"), ("algo.nope=1", "unknown config key 'algo.nope'")])
def test_invalid_override(override, needle):
    one_line_error(assay("train", override), needle)


def test_unknown_algorithm_lists_known(tiny_model_dir, tmp_path):
    one_line_error(assay("train", f"model.path={tiny_model_dir}", "algo.loss=nope", f"output_dir={tmp_path}", "train.steps=1"), "known: ")


def test_eval_json_on_bundled_model():
    p = assay("eval", "--n", "20", "--k", "2", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["n"] == 20 and 0.0 <= out["accuracy"] <= 1.0 and 0.0 <= out["pass@2"] <= 1.0 and out["mean_length"] > 0


# ---------------------------------------------------------------- data settings that would be silently ignored


def one_line(e) -> str:
    """The message of a user mistake raised in-process: one line, as the command prints it after `assay: error:`."""
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("overrides,needle", [
    (["data.path=d.jsonl", "data.task=countdown"], "invalid config value data.task='countdown': data.path='d.jsonl' is the training data"),
    (["data.path=d.jsonl", "data.task_args={terms: 3}"], "task arguments apply to a built-in task"),
    (["data.format=gsm8k"], "invalid config value data.format='gsm8k': it applies to a data file"),
    (["data.eval_path=held.jsonl"], "invalid config value data.eval_path='held.jsonl'"),
    (["data.fields={answer: a}"], "invalid config value data.fields={'answer': 'a'}"),
])
def test_data_settings_that_would_be_ignored_are_one_line(overrides, needle):
    from assay.config import load_config
    from assay.errors import AssayError

    with pytest.raises(AssayError) as e:
        load_config(None, overrides)
    assert needle in one_line(e)


def test_eval_settings_that_would_be_ignored_are_one_line():
    from assay.errors import AssayError
    from assay.eval.run import evaluate_model

    for kwargs, needle in (({"fields": {"answer": "a"}}, "--fields applies to a data file"), ({"chat": True}, "--chat applies"),
                           ({"format": "gsm8k", "task": "countdown"}, "--format applies to a data file, and --data is not given")):
        with pytest.raises(AssayError) as e:
            evaluate_model(**kwargs)
        assert needle in one_line(e)
    one_line_error(assay("eval", "--format", "gsm8k"), "--format applies to a data file, and --data is not given")  # and through the command


def test_one_completion_per_prompt_with_a_group_relative_estimator_is_one_line(tmp_path):
    """GRPO with rollout.group_size=1 trained nothing (every advantage 0, actor/skipped_frac 1.0); it is refused before any
    folder or model, naming the estimators that need groups; an estimator that needs none (REINFORCE++) is let through."""
    from assay.api import train
    from assay.errors import AssayError
    from assay.training.rl import check_group_size

    for advantage, needle in (("grpo", "rollout.group_size=1 with algo.advantage=grpo"),
                              ("rloo", "the ones that do: dr_grpo, frpo, gdpo, grpo, papo, passk, pure, ")):
        with pytest.raises(AssayError) as e:
            train(None, f"output_dir={tmp_path}", "rollout.group_size=1", f"algo.advantage={advantage}")
        assert needle in one_line(e)
    assert not any(tmp_path.iterdir())  # refused before any run folder
    for advantage in ("reinforce_pp", "remax", "gae", "grpo_process"):
        check_group_size(advantage, 1)


def test_a_field_mapped_to_a_missing_column_is_one_line(tmp_path):
    from assay.config import DataConfig
    from assay.data.datasets import build_source
    from assay.errors import AssayError

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(10)))
    for fields, needle in (({"prompt": "question", "answer": "solution"}, "d.jsonl: row 1 has no answer column 'solution'; its columns: question, answer"),
                           ({"prompt": "question", "answr": "answer"}, "unknown field mapping key 'answr'; allowed: prompt, answer, id"),
                           ({"prompt": "question", "id": "uid"}, "row 1 has no id column 'uid'"),
                           ({}, "row 1 has no prompt column 'prompt'; its columns: question, answer (map one with data.fields.prompt=COLUMN)")):
        with pytest.raises(AssayError) as e:
            build_source(DataConfig(path=str(data), fields=fields), 0, 5)
        assert needle in one_line(e)
    # the message names the columns there are, one level into an object, and says when rows sit under one key
    nested, under = tmp_path / "nested.jsonl", tmp_path / "under-a-key.json"
    nested.write_text(json.dumps({"meta": {"q": "1+1=", "a": "2"}, "n": 1}) + "\n")
    under.write_text(json.dumps({"data": [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(3)]}))
    for path, needle in ((nested, "its columns: meta.q, meta.a, n"), (under, "its columns: data (a list of 3 objects; rows kept under one key")):
        with pytest.raises(AssayError) as e:
            build_source(DataConfig(path=str(path)), 0, 5)
        assert needle in one_line(e)
    assert build_source(DataConfig(path=str(data), fields={"prompt": "question"}), 0, 5).heldout[0].answer is not None


def test_json_files_in_the_layouts_other_tools_write_are_read(tmp_path):
    """A `.json` file is read as `datasets` reads one: JSON Lines, an array of objects (Alpaca's layout, pretty-printed
    or on one line), or an object of columns; a byte-order mark (Windows' UTF-8) is skipped, gzipped files too.
    What is none of these is one line naming the file (and the line of a syntax error)."""
    import gzip

    from assay.data.datasets import read_rows
    from assay.errors import AssayError

    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "tests": [i, i]} for i in range(3)]
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    layouts = {
        "lines.json": "\n".join(json.dumps(r) for r in rows),
        "array.json": json.dumps(rows, indent=2),
        "one-line-array.json": json.dumps(rows),
        "columns.json": json.dumps(columns, indent=1),
        "bom.jsonl": "\ufeff" + "\r\n".join(json.dumps(r) for r in rows) + "\r\n",
        "bom-array.json": "\ufeff" + json.dumps(rows, indent=2),
    }
    for name, text in layouts.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        assert read_rows(str(tmp_path / name)) == rows, name
    with gzip.open(tmp_path / "array.json.gz", "wt") as f:
        f.write(json.dumps(rows, indent=2))
    assert read_rows(str(tmp_path / "array.json.gz")) == rows
    # a one-line object whose values are lists is one row, as JSON Lines (a conversation prompt is a list)
    (tmp_path / "row.json").write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": ["4"]}))
    assert read_rows(str(tmp_path / "row.json")) == [{"prompt": [{"role": "user", "content": "hi"}], "answer": ["4"]}]
    bad = {
        "broken.json": ('[\n  {"prompt": "a"},\n  {"prompt": }\n]', "broken.json:3: malformed JSON"),
        "scalars.json": ('[{"prompt": "a"}, 3]', "item 1 of the array is a int"),
        "ragged.json": ('{\n "prompt": ["a", "b"],\n "answer": ["1"]\n}', "an object of columns (lists of equal length)"),
        "lines-bad.json": ('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": \n', "lines-bad.json:3: malformed JSON line"),
        "array.jsonl": (json.dumps(rows, indent=2), "array.jsonl:1: malformed JSON line"),  # .jsonl means JSON Lines
        "cut.jsonl.gz": (gzip.compress((layouts["lines.json"] + "\n").encode() * 40)[:-30], "cannot read"),  # a gzip stream cut short
        "cut.json.gz": (gzip.compress(layouts["array.json"].encode() * 40)[:-30], "cannot read"),
        "plain.json.gz": (layouts["array.json"].encode(), "cannot read"),  # named .gz, not gzipped
    }
    for name, (text, needle) in bad.items():
        (tmp_path / name).write_bytes(text) if isinstance(text, bytes) else (tmp_path / name).write_text(text)
        with pytest.raises(AssayError) as e:
            read_rows(str(tmp_path / name))
        assert needle in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
    # through the command: `assay eval --data` on an Alpaca-style array
    (tmp_path / "alpaca.json").write_text(json.dumps([{"instruction": f"{i}+{i}=", "output": str(2 * i)} for i in range(4)], indent=4))
    p = assay("eval", "--data", str(tmp_path / "alpaca.json"), "--fields", "{prompt: instruction, answer: output}", "--reward", "arithmetic",
              "--n", "4", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["n"] == 4


def test_csv_files_as_spreadsheets_and_pandas_write_them_are_read(tmp_path):
    """A header row, quoted cells with commas, quotes and newlines, Windows line ends and byte-order mark, an empty cell
    (None, as `datasets` reads it), gzipped; a row wider than the header and a header without names are one line."""
    import csv
    import gzip

    from assay.data.datasets import read_rows
    from assay.errors import AssayError

    rows = [{"question": 'Say "hi", then 2+2=', "answer": "4", "note": None},
            {"question": "line one\nline two: 3+3=", "answer": "6", "note": "x" * 200_000}]
    with open(tmp_path / "excel.csv", "w", newline="", encoding="utf-8-sig") as f:  # Excel's "CSV UTF-8": BOM, CRLF
        w = csv.writer(f)
        w.writerow(["question", "answer", "note"])
        w.writerows([[r["question"], r["answer"], r["note"] or ""] for r in rows])
    assert read_rows(str(tmp_path / "excel.csv")) == rows
    text = (tmp_path / "excel.csv").read_bytes()
    assert text.startswith(b"\xef\xbb\xbf") and b"\r\n" in text
    with gzip.open(tmp_path / "excel.csv.gz", "wb") as f:
        f.write(text)
    assert read_rows(str(tmp_path / "excel.csv.gz")) == rows
    (tmp_path / "short.csv").write_text("prompt,answer,id\n1+1=,2\n\n2+2=,4,7\n")  # a short row's missing cells are empty
    assert read_rows(str(tmp_path / "short.csv")) == [{"prompt": "1+1=", "answer": "2", "id": None}, {"prompt": "2+2=", "answer": "4", "id": "7"}]
    # pandas' `to_csv` writes its index as a column without a name; a name may repeat: named as pandas names them
    import pandas as pd

    frame = pd.DataFrame({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]})
    frame.to_csv(tmp_path / "pandas.csv")
    (tmp_path / "twice.csv").write_text("prompt,prompt,,answer,prompt\na,b,c,d,e\n")
    for name in ("pandas.csv", "twice.csv"):
        assert list(read_rows(str(tmp_path / name))[0]) == list(pd.read_csv(tmp_path / name).columns), name
    assert read_rows(str(tmp_path / "pandas.csv"))[1] == {"Unnamed: 0": "1", "prompt": "2+2=", "answer": "4"}
    (tmp_path / "cut.csv.gz").write_bytes(gzip.compress(text * 50)[:-40])  # a copy that stopped: a gzip stream cut short
    bad = {"wide.csv": ("prompt,answer\n1+1=,2\n2+2=,4,extra\n", "wide.csv:3: 3 cells under a header of 2 columns"),
           "empty.csv": ("", "empty CSV file"),
           "cut.csv.gz": (None, "cannot read")}
    for name, (content, needle) in bad.items():
        if content is not None:
            (tmp_path / name).write_text(content)
        with pytest.raises(AssayError) as e:
            read_rows(str(tmp_path / name))
        assert needle in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
    p = assay("eval", "--data", str(tmp_path / "short.csv"), "--reward", "arithmetic", "--n", "2", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["n"] == 2, p.stderr


def test_text_that_windows_tools_write_is_read_or_refused_in_one_line(tmp_path):
    """UTF-16 with its byte-order mark (Windows PowerShell 5's `>`) is read as UTF-16; bytes that are not UTF-8 (a CSV
    saved in a Windows code page) are one line naming the file, line, column and byte, never replacement characters
    in a prompt or an answer. Config and reward YAML files too."""
    import gzip

    from assay.data.datasets import read_rows
    from assay.errors import AssayError

    rows = [{"prompt": "Combien font 2 + 2 ? Réponds.", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
    lines = "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n"
    (tmp_path / "ps.jsonl").write_bytes(lines.encode("utf-16"))  # little-endian with its mark, as PowerShell writes
    (tmp_path / "be.json").write_bytes(b"\xfe\xff" + json.dumps(rows, ensure_ascii=False, indent=2).encode("utf-16-be"))
    (tmp_path / "ps.csv").write_bytes(('prompt,answer\r\n"Combien font 2 + 2 ? Réponds.",4\r\n3+3=,6\r\n').encode("utf-16"))
    (tmp_path / "ps.jsonl.gz").write_bytes(gzip.compress(lines.encode("utf-16")))
    (tmp_path / "mac.csv").write_bytes('prompt,answer\r"Combien font 2 + 2 ? Réponds.",4\r3+3=,6\r'.encode())  # a classic Mac's line ends
    for name in ("ps.jsonl", "be.json", "ps.csv", "ps.jsonl.gz", "mac.csv"):
        assert read_rows(str(tmp_path / name)) == rows, name
    bad = {"ansi.csv": ("prompt,answer\r\n1+1=,2\r\nCafé: 3+3=,6\r\n".encode("cp1252"), "ansi.csv:3: not UTF-8 text (byte 0xe9 at column 4)"),
           "latin.jsonl": ('{"prompt": "a"}\n{"prompt": "été"}\n'.encode("latin-1"), "latin.jsonl:2: not UTF-8 text (byte 0xe9 at column 13)"),
           "latin.json": ('[{"prompt": "été"}]'.encode("latin-1"), "latin.json:1: not UTF-8 text"),
           "utf32.jsonl": ('{"prompt": "a"}'.encode("utf-32"), "utf32.jsonl:1: not UTF-8 text (byte 0xff at column 1)"),
           "cut16.jsonl": ("\ufeff{}".encode("utf-16-le") + b"\x00\xd8", "starts as UTF-16 but is not UTF-16 text")}
    for name, (data, needle) in bad.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(AssayError) as e:
            read_rows(str(tmp_path / name))
        assert needle in str(e.value) and "save it as UTF-8" in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
    (tmp_path / "ansi.yaml").write_bytes("train:\n  steps: 2  # café\n".encode("cp1252"))
    (tmp_path / "reward.yaml").write_bytes("name: arithmetic  # café\n".encode("cp1252"))
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1=", "completion": "2", "answer": "2"}\n')
    (tmp_path / "ansi.jinja").write_bytes("Café {{ messages[0]['content'] }}".encode("cp1252"))
    for args, needle in [(("train", str(tmp_path / "ansi.yaml")), "byte offset 24: 0xe9 is not utf-8 text"),
                         (("reward", "score", "--reward", str(tmp_path / "reward.yaml"), "--input", str(tmp_path / "rows.jsonl"),
                           "--output", str(tmp_path / "out.jsonl")), "byte offset 23: 0xe9 is not utf-8 text"),
                         (("train", f"model.chat_template={tmp_path / 'ansi.jinja'}", f"output_dir={tmp_path / 'runs'}"),
                          "is not UTF-8 text (byte 0xe9 at byte offset 3)")]:
        p = assay(*args)
        assert p.returncode != 0 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr
    (tmp_path / "u16.yaml").write_bytes("train:\n  steps: 0\n".encode("utf-16"))
    from assay.config import read_yaml_mapping

    assert read_yaml_mapping(str(tmp_path / "u16.yaml")) == {"train": {"steps": 0}}


def test_a_data_file_names_the_run_and_nested_columns_are_read(tmp_path, tiny_model_dir):
    """verl's parquet layout (the reference in `reward_model.ground_truth`), with data.task left at its default: the
    run trains on the file and says so (folder, summary, report), never "task: arithmetic"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from assay.config import DataConfig
    from assay.data.datasets import build_source

    rows = [{"data_source": "mine", "prompt": f"{i}+{i}=", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"index": i}} for i in range(40)]
    data = tmp_path / "verl-train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    fields = "{answer: reward_model.ground_truth, id: extra_info.index}"
    source = build_source(DataConfig(path=str(data), fields={"answer": "reward_model.ground_truth", "id": "extra_info.index"}), 0, 10)
    assert all(s.answer == str(2 * int(s.id)) and s.prompt == f"{s.id}+{s.id}=" for s in [*source.heldout, *source._rows])
    p = assay("train", f"model.path={tiny_model_dir}", f"data.path={data}", f"data.fields={fields}", "reward=arithmetic",
              f"output_dir={tmp_path / 'runs'}", "train.steps=1", "train.eval_n=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
              "rollout.max_new_tokens=3", "reward_workers=0", "train.threads=1", "--no-progress")
    assert p.returncode == 0, p.stderr
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.startswith("verl-train-") and f"data: {data}" in p.stderr and "task:" not in p.stderr
    page = (run / "report.html").read_text()
    assert f"<tr><th>data</th><td>{data}</td></tr>" in page and "<th>task</th>" not in page and "task: null" in page


def test_small_output_mistakes(tmp_path):
    """A YAML error names its line and column; `--k 0` gives no `pass@0: None`."""
    from assay.api import evaluate
    from assay.cli import _yaml_arg
    from assay.config import read_yaml_mapping
    from assay.errors import AssayError

    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: 3\n data: x\n")
    with pytest.raises(AssayError) as e:
        read_yaml_mapping(str(bad))
    assert f"config file {str(bad)!r} is not valid YAML: line 3, column 2: " in one_line(e)
    with pytest.raises(AssayError) as e:
        _yaml_arg("{terms: 3", "--task-args")
    assert "line 1, column 10: expected ',' or '}'" in one_line(e)
    out = evaluate("tiny-arith", n=5, k=0, workers=0)
    assert "pass@0" not in out and {"accuracy", "n", "mean_length"} <= set(out)
