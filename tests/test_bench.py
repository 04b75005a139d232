"""`assay bench train`: the FLOP formula worked by hand, and each side of the bench on a tiny model through the command."""

import doctest
import importlib
import json

import pytest
import torch
import yaml

from assay.bench.flops import TokenCounter, executed_flops, ideal_step_flops, matmul_params
from assay.cli import main

#: a model and step small enough that one warm-up and one timed step take about a second
SMALL = {"model": {"hidden": 32, "layers": 1, "heads": 2, "intermediate": 64}, "max_new_tokens": 8, "matmul_sizes": [128]}


def test_ideal_flops_by_hand():
    # N = 1000; prompts of 3 and 5 tokens, G = 2; completions of 2, 4 tokens (prompt 0) and 1, 3 (prompt 1)
    # generate: 2·1000·(3 + 5 + 2 + 4 + 1 + 3)                   = 36_000
    # train:    6·1000·((3+2) + (3+4) + (5+1) + (5+3)) = 6000·26  = 156_000
    # extra:    one more forward, 2·1000·26                        = 52_000
    f = ideal_step_flops(1000, [3, 5], [2, 4, 1, 3], group_size=2, extra_forwards=1)
    assert f == {"generate": 36_000, "train": 156_000, "extra": 52_000, "total": 244_000}
    assert ideal_step_flops(1000, [3, 5], [2, 4, 1, 3], group_size=2)["total"] == 192_000
    with pytest.raises(ValueError):
        ideal_step_flops(1000, [3], [1, 2, 3], group_size=2)


def test_executed_flops_by_hand():
    # 2·N per token without grad, 6·N with: 2·10·7 + 6·10·3 = 140 + 180
    assert executed_flops(10, nograd_tokens=7, grad_tokens=3) == 320
    # gradient checkpointing reruns the forward of every grad token: + 2·10·3
    assert executed_flops(10, nograd_tokens=7, grad_tokens=3, recompute=1) == 380


@pytest.mark.parametrize("name", ["assay.bench.flops", "assay.bench.profile"])
def test_docstring_examples(name):
    assert doctest.testmod(importlib.import_module(name)).failed == 0


@pytest.mark.parametrize("tied", [True, False])
def test_matmul_params_by_hand(tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # hidden 8, 1 layer, 2 heads (and 2 kv heads), intermediate 16, vocabulary 10:
    #   q, k, v: 3·(8·8 + 8 bias) = 216;  o: 8·8 = 64;  gate, up, down: 3·8·16 = 384
    #   two layer norms and the final norm: 3·8 = 24;  LM head: 10·8 = 80
    #   216 + 64 + 384 + 24 + 80 = 768, tied or not: an untied input embedding is a lookup, not a matmul
    cfg = Qwen2Config(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=16, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(cfg)
    assert matmul_params(model) == 768
    assert sum(p.numel() for p in model.parameters()) == (768 if tied else 848)


def test_token_counter_splits_grad_and_no_grad(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    counter = TokenCounter(model)
    ids = torch.ones((3, 5), dtype=torch.long)
    with torch.no_grad():
        model(input_ids=ids)
    model(input_ids=ids[:2])
    assert counter.reset() == {"nograd": 15, "grad": 10}
    assert counter.reset() == {"nograd": 0, "grad": 0}
    counter.close()


def bench(tmp_path, *args, config=SMALL):
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "bench.json"
    rc = main(["bench", "train", "--config", str(path), "--steps", "1", "--warmup", "1", "--threads", "1", "--json", str(out), *args])
    return rc, (json.loads(out.read_text()) if out.is_file() else None)


def check_framework(s, report):
    """Figures of one framework's run: present, positive, counted as the bench config says."""
    assert s["steps_measured"] == 1 and len(s["steps"]) == 2 and len(s["warmup_s"]) == 1
    assert s["completions_per_step"] == 64 and all(st["completions"] == 64 for st in s["steps"])
    for key in ("s_per_step_mean", "s_per_step_min", "completions_per_s", "generated_tokens_per_s", "peak_rss_mib", "ideal_gflop_per_step", "limit_s_per_step", "fraction_of_limit"):
        assert s[key] > 0, key
    assert 1 <= s["mean_completion_tokens"] <= 8
    assert s["peak_rss_mib"] >= s["rss_before_steps_mib"]
    assert s["other_load_cores"] is None or s["other_load_cores"] >= 0
    step = s["steps"][-1]
    assert step["completion_tokens"] == sum(step["completion_lens"]) and len(step["prompt_lens"]) == 8
    # the limit is the formula's FLOPs over the measured matmul rate
    ideal = ideal_step_flops(s["n_params"], step["prompt_lens"], step["completion_lens"], group_size=8)["total"]
    assert s["ideal_gflop_per_step"] == pytest.approx(ideal / 1e9)
    assert s["limit_s_per_step"] == pytest.approx(ideal / (report["matmul"]["gflops"] * 1e9))
    # what the model really processed covers at least each distinct prompt once and every completion
    # token but the last (the shared-prefix forward, assay.training.forward); padding only adds
    assert step["grad_tokens"] >= sum(step["prompt_lens"]) + step["completion_tokens"] - 64
    assert step["nograd_tokens"] >= sum(step["prompt_lens"]) + step["completion_tokens"] - 64  # the last token of a completion is never fed back


def test_bench_assay_side_through_the_command(tmp_path, capsys):
    rc, report = bench(tmp_path, "--vs", "none")
    assert rc == 0
    assert list(report["frameworks"]) == ["assay"] and "ratio_assay_over_trl" not in report
    check_framework(report["frameworks"]["assay"], report)
    assert report["model"]["n_params"] == report["frameworks"]["assay"]["n_params"] > 0
    assert report["matmul"]["gflops"] > 0 and report["matmul"]["threads"] == 1
    printed = capsys.readouterr().out
    for needle in ("s/step (mean)", "completions/s", "peak RSS (MiB)", "GFLOP/s fp32", "FLOPs/step = 2N", "of the compute-bound limit"):
        assert needle in printed


@pytest.mark.slow
def test_bench_trl_side_through_the_command(tmp_path, capsys):
    pytest.importorskip("trl")
    pytest.importorskip("accelerate")
    rc, report = bench(tmp_path, "--vs", "trl")
    assert rc == 0
    assert list(report["frameworks"]) == ["trl", "assay"]
    for s in report["frameworks"].values():
        check_framework(s, report)
    trl, assay = report["frameworks"]["trl"], report["frameworks"]["assay"]
    assert trl["n_params"] == assay["n_params"] and trl["extra_forwards"] == assay["extra_forwards"] == 0
    # both frameworks were handed the same prompts in the same order
    assert [st["prompt_lens"] for st in trl["steps"]] == [st["prompt_lens"] for st in assay["steps"]]
    r = report["ratio_assay_over_trl"]
    assert r["completions_per_s"] == pytest.approx(assay["completions_per_s"] / trl["completions_per_s"])
    assert r["peak_rss"] == pytest.approx(assay["peak_rss_mib"] / trl["peak_rss_mib"])
    assert "assay / TRL: completions/s" in capsys.readouterr().out


def test_vs_trl_without_trl_is_one_line(tmp_path, capsys, monkeypatch):
    import assay.bench.train as bench_train

    monkeypatch.setattr(bench_train, "installed", lambda module: module != "trl")
    rc, _ = bench(tmp_path, "--vs", "trl")
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert rc == 2 and len(err) == 1 and "pip install -e .[bench]" in err[0] and err[0].startswith("assay: error:")


@pytest.mark.parametrize("config,needle", [
    ({"modle": {}}, "unknown bench config key 'modle'; allowed here: model, task"),
    ({"model": {"hiden": 8}}, "unknown bench config key 'model.hiden'; allowed here: path, hidden"),
    ({"group_size": 1}, "invalid bench config value group_size=1"),
    ({"model": {"path": "no-such-model"}}, "model path 'no-such-model' is not a directory"),
])
def test_bad_bench_config_is_one_line(tmp_path, capsys, config, needle):
    rc, _ = bench(tmp_path, "--vs", "none", config=config)
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert rc == 2 and len(err) == 1 and needle in err[0], err
