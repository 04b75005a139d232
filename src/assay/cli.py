"""The `assay` command: argument handling only; the work lives in the packages."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from assay.errors import AssayError


def split_train_args(items: list[str]) -> tuple[str | None, list[str]]:
    """`(config file, overrides)` from the positional arguments, in any order: the one without `=` is the file."""
    files = [a for a in items if "=" not in a]
    if len(files) > 1:
        raise AssayError(f"give at most one config file; got {', '.join(map(repr, files))} (overrides are key=value)")
    return (files[0] if files else None), [a for a in items if "=" in a]


def _stopped(e: BaseException, command: str) -> int:
    """The exit code of a run stopped by Ctrl-C (130) or SIGTERM (143) after its checkpoint was
    saved, with the line that resumes it; re-raised when it stopped before anything was saved."""
    how, code = ("interrupted", 130) if isinstance(e, KeyboardInterrupt) else (str(e), 128 + e.signum)  # type: ignore[attr-defined]
    if getattr(e, "run_dir", None) is None:
        raise e
    print(f"assay: {how} at step {e.step}; checkpoint saved; continue with: {command} --resume {e.run_dir}",  # type: ignore[attr-defined]
          file=sys.stderr)
    return code


def _check_resume_restart(args: argparse.Namespace, config_path: str | None) -> None:
    """--resume and --restart run a folder's own config: neither goes with a config file, nor with the other."""
    if args.resume and args.restart:
        raise AssayError("give one of --resume (continue from the newest checkpoint) and --restart (start again from the beginning)")
    flag = "--resume" if args.resume else "--restart" if args.restart else None
    if flag and config_path:
        raise AssayError(f"{flag} runs the folder's own config; drop {config_path!r} (give overrides as key=value)")


def cmd_lab(args: argparse.Namespace) -> int:
    from assay.lab import run_lab

    if args.steps is not None and args.steps < 1:
        raise AssayError(f"lab: --steps must be at least 1, got {args.steps}")
    page = run_lab(args.experiment, args.out, args.steps, args.seed, progress=not args.no_progress, arms=args.arms)
    print(f"lab page: {page}", file=sys.stderr)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from assay.api import train
    from assay.training.hacking import HackingAlarm
    from assay.training.interrupt import Preempted

    config_path, overrides = split_train_args(args.args)
    _check_resume_restart(args, config_path)
    try:
        result = train(config_path, *overrides, resume=args.resume, restart=args.restart, progress=not args.no_progress)
    except (KeyboardInterrupt, Preempted) as e:
        return _stopped(e, "assay train")
    except HackingAlarm as e:  # train.on_alarm=stop: the report and a checkpoint are written
        print(f"assay: stopped by a hacking alarm: {e}", file=sys.stderr)
        return 3
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
        for k, v in result.final.items():
            print(f"{k}: {v}", file=sys.stderr)
        print(f"report: {result.run_dir / 'report.html'}", file=sys.stderr)
    return 0


def _yaml_arg(text: str | None, name: str) -> Any:
    """A JSON or YAML value given on the command line (`--task-args '{terms: 3}'`)."""
    import yaml

    from assay.config import yaml_problem

    if text is None:
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise AssayError(f"{name}: {text!r} is not valid YAML or JSON: {yaml_problem(e)}") from None


def cmd_eval(args: argparse.Namespace) -> int:
    from assay.eval.run import evaluate_model

    if args.best_of is not None:
        return cmd_eval_best_of(args)
    if args.verifier is not None:
        raise AssayError("--verifier goes with --best-of (without it, --reward is the verifier)")

    out = evaluate_model(args.model, task=args.task, task_args=_yaml_arg(args.task_args, "--task-args"), data=args.data,
                         fields=_yaml_arg(args.fields, "--fields"), format=args.format, chat=args.chat, system_prompt=args.system_prompt,
                         chat_template_kwargs=_yaml_arg(args.chat_template_kwargs, "--chat-template-kwargs"),
                         chat_template=args.chat_template, run=args.run, reward=args.reward, n=args.n, k=args.k,
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature, backend=args.backend, device=args.device,
                         seed=args.seed, workers=args.workers, server_url=args.server_url, env=_yaml_arg(args.env, "--env"),
                         images=args.images)
    if args.json:
        print(json.dumps(out))
    else:
        width = max(map(len, out))
        for key, v in out.items():
            print(f"{key:>{width}}: {v:.4f}" if isinstance(v, float) else f"{key:>{width}}: {v}")
    return 0


def cmd_eval_best_of(args: argparse.Namespace) -> int:
    from assay.eval import bestof
    from assay.eval.run import evaluate_best_of

    out = evaluate_best_of(args.model, select=args.reward, best_of=args.best_of, verifier=args.verifier, task=args.task,
                           task_args=_yaml_arg(args.task_args, "--task-args"), data=args.data, fields=_yaml_arg(args.fields, "--fields"),
                           format=args.format, chat=args.chat, system_prompt=args.system_prompt,
                           chat_template_kwargs=_yaml_arg(args.chat_template_kwargs, "--chat-template-kwargs"),
                           chat_template=args.chat_template, run=args.run, n=args.n, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, backend=args.backend, device=args.device, seed=args.seed, workers=args.workers,
                           server_url=args.server_url, env=_yaml_arg(args.env, "--env"))
    json_path, png_path = bestof.write(out, args.out)
    if args.json:
        print(json.dumps({k: v for k, v in out.items() if k != "per_problem"}))
    else:
        print(f"best-of-n by {out['selector']}, verified by {out['verifier']}, on {out['problems']} problems:")
        print(bestof.table(out["curve"]))
    sys.stdout.flush()
    print(f"wrote {json_path} and {png_path}", file=sys.stderr)
    return 0


def cmd_pretrain(args: argparse.Namespace) -> int:
    from assay.recipes.build import pin_kernels

    pin_kernels()  # before torch loads: the same floating-point code paths on any x86 machine
    from assay.recipes.build import build_bundled

    build_bundled(args.name, args.out, seed=args.seed, device=args.device)
    return 0


def cmd_reward_score(args: argparse.Namespace) -> int:
    from assay.rewards.scoring import score_file

    score_file(args.reward, args.input, args.output, workers=args.workers, timeout=args.timeout)
    return 0


def cmd_reward_list(args: argparse.Namespace) -> int:
    from assay.rewards.scoring import list_rewards

    rows = list_rewards()
    width = max(len(n) for n, _ in rows)
    for name, doc in rows:
        print(f"{name:<{width}}  {doc}")
    return 0


def cmd_serve_rewards(args: argparse.Namespace) -> int:
    from assay.rewards.serve import serve

    return serve(args.reward, host=args.host, port=args.port, workers=args.workers, timeout=args.timeout, max_batch=args.max_batch,
                 batch_window=args.batch_window, batch_items=args.batch_items, max_concurrency=args.max_concurrency, grace=args.grace)


def cmd_serve_model(args: argparse.Namespace) -> int:
    from assay.rollout.serve_model import serve_model

    return serve_model(args.path, host=args.host, port=args.port, name=args.name, max_new_tokens=args.max_new_tokens,
                       device=args.device, chat_template=args.chat_template, max_concurrency=args.max_concurrency, grace=args.grace)


def _server_options(p: argparse.ArgumentParser, concurrency: int) -> None:
    """The options both servers share: how many requests at once, how long a drain may take."""
    p.add_argument("--max-concurrency", type=int, default=concurrency,
                   help=f"most requests handled at once; more are answered 503 with Retry-After (default {concurrency})")
    p.add_argument("--grace", type=float, default=20.0,
                   help="seconds SIGTERM/SIGINT lets requests in flight finish before the server exits (default 20)")


def _serve_parser(sub) -> None:
    """`assay serve rewards`: a reward over HTTP for OpenRLHF, verl and assay clients (docs/serving.md)."""
    s = sub.add_parser("serve", help="serve a reward over HTTP to other trainers (OpenRLHF, verl), or a model to judges (docs/serving.md)")
    ssub = s.add_subparsers(dest="serve_command", required=True)
    r = ssub.add_parser("rewards", help="POST /get_reward (OpenRLHF), /compute_score (verl), /score (assay); GET /health")
    r.add_argument("--reward", required=True, help="a registered reward name, module:attr, or a YAML reward block")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    r.add_argument("--port", type=int, default=8000, help="port (0: any free one, printed at start; default 8000)")
    r.add_argument("--workers", type=int, default=2, help="reward worker processes (0: in the server process; default 2)")
    r.add_argument("--timeout", type=float, default=5.0, help="seconds per item before it is unscored (default 5)")
    r.add_argument("--max-batch", type=int, default=4096, help="most items in one request (default 4096)")
    r.add_argument("--batch-window", type=float, default=0.005,
                   help="seconds a batch waits for more requests after its first one arrived (default 0.005)")
    r.add_argument("--batch-items", type=int, default=1024, help="most items scored in one batch of the workers (default 1024)")
    _server_options(r, 2048)
    r.set_defaults(fn=cmd_serve_rewards)
    m = ssub.add_parser("model", help="a Hugging Face causal LM as an OpenAI-compatible server: /v1/models, /v1/completions, /v1/chat/completions")
    m.add_argument("path", help="a bundled model name (tiny-arith) or a Hugging Face causal LM folder")
    m.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    m.add_argument("--port", type=int, default=8000, help="port (0: any free one, printed at start; default 8000)")
    m.add_argument("--name", default=None, help="the model id clients send (default: PATH as given)")
    m.add_argument("--max-new-tokens", type=int, default=256, help="most tokens per completion; larger max_tokens are cut to it (default 256)")
    m.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template that replaces the tokenizer's")
    m.add_argument("--device", default="cpu")
    _server_options(m, 256)
    m.set_defaults(fn=cmd_serve_model)


def cmd_rm_train(args: argparse.Namespace) -> int:
    from assay.rm.config import load_rm_config
    from assay.rm.train import train_rm
    from assay.training.interrupt import Preempted

    config_path, overrides = split_train_args(args.args)
    _check_resume_restart(args, config_path)
    try:
        if args.resume or args.restart:
            result = train_rm(resume=args.resume, restart=args.restart, overrides=overrides, progress=not args.no_progress)
        else:
            result = train_rm(load_rm_config(config_path, overrides), progress=not args.no_progress)
    except (KeyboardInterrupt, Preempted) as e:
        return _stopped(e, "assay rm train")
    for k, v in result.final.items():
        if k.startswith("eval/"):
            print(f"{k}: {v}", file=sys.stderr)
    print(f"reward model: {result.model_dir}", file=sys.stderr)
    return 0


def cmd_rm_pairs(args: argparse.Namespace) -> int:
    from assay.data.tasks import make_task
    from assay.rm.pairs import build_pairs, write_pairs

    task_args = _yaml_arg(args.task_args, "--task-args")
    if args.n is not None and args.n < 1:
        raise AssayError(f"rm pairs: --n must be at least 1, got {args.n}")
    if getattr(make_task(args.task, **(task_args or {})), "modality", "text") == "image":  # pictures an image policy draws
        from assay.images.pairs import build_image_pairs

        if args.mix is not None:
            raise AssayError(f"--mix chooses kinds of wrong integer answers; task {args.task!r} pairs pictures (drop --mix)")
        rows = build_image_pairs(args.model or "tiny-shapes", args.task, task_args, split=args.split, n=args.n or 1000, seed=args.seed,
                                 group=args.group, per_group=args.per_group, progress=not args.no_progress)
    elif args.model is not None or args.group != 8 or args.per_group != 2:
        raise AssayError(f"--model, --group and --per-group draw pictures for a picture task (such as shapes); task {args.task!r} pairs "
                         "reference answers with wrong ones")
    else:
        rows = build_pairs(args.task, task_args, split=args.split, n=args.n or 4000, seed=args.seed, mix=_yaml_arg(args.mix, "--mix"))
    write_pairs(args.out, rows)
    print(f"{len(rows)} pairs -> {args.out}", file=sys.stderr)
    return 0


def cmd_rm_eval(args: argparse.Namespace) -> int:
    from assay.rm.eval import evaluate_path

    out = evaluate_path(args.path, args.data, fields=_yaml_arg(args.fields, "--fields"), device=args.device, batch_size=args.batch_size,
                        threshold=args.threshold)
    if args.plot:
        if "calibration" not in out:
            raise AssayError("rm eval: --plot draws the calibration of an outcome reward model's pairs; this evaluation has none")
        from assay.rm.eval import plot_calibration

        print(f"calibration plot -> {plot_calibration(out, args.plot)}", file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    else:
        for key, v in out.items():
            if key == "calibration":
                v = ", ".join(f"{b['confidence']:.2f}:{b['accuracy']:.2f} ({b['pairs']})" for b in v)
            print(f"{key:>28}: {v:.4f}" if isinstance(v, float) else f"{key:>28}: {v}")
    return 0


def cmd_rm_label_steps(args: argparse.Namespace) -> int:
    from assay.rm.label_steps import label_steps, write_rows

    rows = label_steps(args.model, args.task, _yaml_arg(args.task_args, "--task-args"), split=args.split, problems=args.problems,
                       samples=args.samples, rollouts=args.rollouts, steps=args.steps, label=args.label, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, backend=args.backend, device=args.device, seed=args.seed, server_url=args.server_url,
                       progress=not args.no_progress, keep_rollouts=args.keep_rollouts)
    write_rows(args.out, rows)
    print(f"{len(rows)} solutions, {sum(len(r['steps']) for r in rows)} labelled steps -> {args.out}", file=sys.stderr)
    return 0


def _label_steps_parser(rsub) -> None:
    s = rsub.add_parser("label-steps", help="Monte Carlo step labels (Math-Shepherd): roll out from every step of sampled solutions, "
                        "label each step with its verified success rate")
    s.add_argument("--out", required=True, metavar="FILE", help="output JSONL (prompt, steps, labels, completion, spans), read by kind=prm")
    s.add_argument("--model", default="tiny-arith", help="the policy: a bundled name or a Hugging Face folder (default tiny-arith)")
    s.add_argument("--task", default="arithmetic", help="built-in task whose verifier checks rollouts (default arithmetic)")
    s.add_argument("--task-args", default=None, help="task arguments as YAML or JSON, for example '{terms: 3}'")
    s.add_argument("--split", choices=["train", "heldout"], default="train", help="the task's split (default train)")
    s.add_argument("--problems", type=int, default=200, help="problems (default 200)")
    s.add_argument("--samples", type=int, default=2, help="solutions sampled per problem (default 2)")
    s.add_argument("--rollouts", type=int, default=8, help="K: rollouts from each step prefix (default 8)")
    s.add_argument("--steps", default="newline", help="how solutions are cut: newline, chars:N, a marker such as '\n\n', or module:function "
                   "(the bundled model writes one line of digits: use chars:1)")
    s.add_argument("--label", choices=["soft", "hard"], default="soft", help="soft: share of right rollouts; hard: 1 if any is right")
    s.add_argument("--keep-rollouts", action="store_true", help="also write `finished`: each rollout's finished solution and whether it is right")
    s.add_argument("--max-new-tokens", type=int, default=8, help="length limit of solutions and rollouts (default 8)")
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--backend", default="torch", help="generation backend (rollout.backend: torch, vllm, openai)")
    s.add_argument("--server-url", default=None, help="with --backend openai: the OpenAI-compatible server")
    s.add_argument("--device", default="cpu")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--no-progress", action="store_true", help="no live progress bar")
    s.set_defaults(fn=cmd_rm_label_steps)


def _rm_parser(sub) -> None:
    """`assay rm`'s subcommands."""
    rm = sub.add_parser("rm", help="reward models: build preference pairs, train a Bradley-Terry model, measure it (docs/reward-models.md)")
    rsub = rm.add_subparsers(dest="rm_command", required=True)
    t = rsub.add_parser("train", help="train a Bradley-Terry reward model on preference pairs (kind=prm: a process reward model on step labels)")
    t.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                   help="a YAML config file (optional) and dotted overrides, for example data.path=pairs.jsonl train.steps=500 loss.margin=0.5")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint (overrides may change train.steps, "
                   "eval/save cadence, threads)")
    t.add_argument("--restart", metavar="RUN_DIR", help="start the run in RUN_DIR again from the beginning with its config.yaml "
                   "(a run that stopped before its first checkpoint)")
    t.add_argument("--no-progress", action="store_true", help="no live progress bar")
    t.set_defaults(fn=cmd_rm_train)
    p = rsub.add_parser("pairs", help="preference pairs from a built-in task: chosen verified correct, rejected verified wrong")
    p.add_argument("--out", required=True, metavar="FILE", help="output JSONL (prompt, chosen, rejected, subset, id, answer)")
    p.add_argument("--task", default="arithmetic", help="built-in task with integer answers (default arithmetic), or a picture task "
                   "(shapes: pairs of pictures an image policy draws, ranked by the task's checker)")
    p.add_argument("--model", default=None, help="a picture task's image policy that draws the pictures (default tiny-shapes)")
    p.add_argument("--task-args", default=None, help="task arguments as YAML or JSON, for example '{terms: 3}'")
    p.add_argument("--split", choices=["train", "heldout"], default="train", help="the task's split to draw problems from (default train)")
    p.add_argument("--n", type=int, default=None, help="pairs (default 4000; 1000 for a picture task)")
    p.add_argument("--group", type=int, default=8, help="a picture task: pictures drawn per prompt (default 8)")
    p.add_argument("--per-group", type=int, default=2, help="a picture task: pairs taken from each group, best against worst first (default 2)")
    p.add_argument("--mix", default=None, help="kind weights as YAML, for example '{near_miss: 1, longer: 1}' (kinds: near_miss, carry, random, longer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="a picture task: no progress bar")
    p.set_defaults(fn=cmd_rm_pairs)
    e = rsub.add_parser("eval", help="pairwise and best-of-N accuracy of a reward model on comparisons (RewardBench 2 rows too); "
                        "first-error F1 of a process reward model on ProcessBench rows")
    e.add_argument("--path", required=True, metavar="RM", help="the reward model folder, or the run folder whose final/ holds it")
    e.add_argument("--data", required=True, metavar="FILE", help="JSONL/Parquet/datasets folder with prompt, chosen, rejected (strings or lists)")
    e.add_argument("--fields", default=None, help="column mapping, for example '{prompt: question}'")
    e.add_argument("--device", default="cpu")
    e.add_argument("--batch-size", type=int, default=64, help="sequences per forward (default 64)")
    e.add_argument("--threshold", type=float, default=0.5, help="process reward models: a step scored below this is wrong (default 0.5)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.add_argument("--plot", default=None, metavar="PNG", help="also save a reliability diagram of the pairs' calibration here")
    e.set_defaults(fn=cmd_rm_eval)
    _label_steps_parser(rsub)


def cmd_po_train(args: argparse.Namespace) -> int:
    from assay.po.config import load_po_config
    from assay.po.train import train_po
    from assay.training.interrupt import Preempted

    config_path, overrides = split_train_args(args.args)
    _check_resume_restart(args, config_path)
    try:
        if args.resume or args.restart:
            result = train_po(resume=args.resume, restart=args.restart, overrides=overrides, progress=not args.no_progress)
        else:
            result = train_po(load_po_config(config_path, overrides), progress=not args.no_progress)
    except (KeyboardInterrupt, Preempted) as e:
        return _stopped(e, "assay po train")
    for k, v in result.final.items():
        if k.startswith("eval/"):
            print(f"{k}: {v}", file=sys.stderr)
    print(f"model: {result.model_dir}\nreport: {result.run_dir / 'report.html'}", file=sys.stderr)
    return 0


def cmd_po_pairs(args: argparse.Namespace) -> int:
    from assay.po.pairs import sample_pairs, write_rows

    rows, counts = sample_pairs(args.model, args.prompts, args.group_size, task=args.task, task_args=_yaml_arg(args.task_args, "--task-args"),
                                data=args.data, fields=_yaml_arg(args.fields, "--fields"), reward=_yaml_arg(args.reward, "--reward"),
                                mode=args.pairs, margin=args.margin, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                seed=args.seed, backend=args.backend, device=args.device, server_url=args.server_url, workers=args.workers)
    write_rows(args.out, rows)
    if args.json:
        print(json.dumps(counts))
    print(f"{len(rows)} pairs from {int(counts['completions'])} completions ({int(counts['ties'])} ties, "
          f"{int(counts['truncated'])} cut at the length limit left out) -> {args.out}", file=sys.stderr)
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    from assay.bench.config import load_bench_config
    from assay.bench.train import check_json_path, render, run_bench, write_json

    cfg = load_bench_config(args.config, steps=args.steps, warmup=args.warmup, threads=args.threads,
                            prompts_per_step=args.prompts, group_size=args.generations, max_new_tokens=args.max_new_tokens)
    if args.json:
        check_json_path(args.json)
    report = run_bench(cfg, vs=args.vs, profile_dir=args.profile)
    render(report)
    if args.json:
        write_json(report, args.json)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from assay.models import export

    src = Path(args.src)
    if not src.is_dir():
        raise AssayError(f"export: {args.src!r} is not a folder (a run folder, a checkpoint, or a model or adapter folder)")
    if (src / "final").is_dir():  # a run folder: its trained model
        src = src / "final"
    out = export(src, Path(args.out), merge=args.merge)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _export_parser(sub) -> None:
    """`assay export`: a run's model as a standalone Hugging Face folder (a LoRA adapter merged into its base with --merge)."""
    x = sub.add_parser("export", help="write a run's model as a Hugging Face folder; --merge folds a LoRA adapter into its base weights")
    x.add_argument("src", metavar="RUN_OR_FOLDER", help="a run folder (its final/), a checkpoint folder, or a model or adapter folder")
    x.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new, or empty)")
    x.add_argument("--merge", action="store_true", help="fold a LoRA adapter into its base model's weights: a plain Hugging Face model "
                   "(without it an adapter folder is written as an adapter, with its base model's path)")
    x.set_defaults(fn=cmd_export)


def _eval_parser(sub) -> None:
    """`assay eval`'s arguments."""
    e = sub.add_parser("eval", help="greedy accuracy, pass@k and length on a task's held-out split, a data file, or a run's held-out data")
    e.add_argument("--model", default=None, help="bundled model name or Hugging Face folder (default: the run's final/ with --run, else tiny-arith)")
    e.add_argument("--task", default=None, help="built-in task name (default arithmetic)")
    e.add_argument("--task-args", default=None, help="task arguments as YAML or JSON, for example '{terms: 3}'")
    e.add_argument("--data", default=None, metavar="FILE", help="a JSONL, JSON or CSV file (gzipped too), a Parquet file or a datasets folder to evaluate "
                   "(needs --reward or --format)")
    e.add_argument("--fields", default=None, help="column mapping for --data, as in training: '{prompt: question, answer: solution}'")
    e.add_argument("--format", default=None, help="the layout of --data: gsm8k, math, mbpp, humaneval, apps (brings its reward; docs/data.md)")
    e.add_argument("--chat", action="store_true", help="send plain-text prompts as a user message through the model's chat template")
    e.add_argument("--system-prompt", default=None, help="a system message first in every conversation")
    e.add_argument("--chat-template-kwargs", default=None, help="chat template arguments as YAML or JSON, for example '{enable_thinking: false}'")
    e.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template that replaces the tokenizer's")
    e.add_argument("--run", default=None, metavar="RUN_DIR", help="a run folder: evaluate on its own held-out data with its reward "
                   "(and its environment: each problem an episode)")
    e.add_argument("--env", default=None, help="an environment (calculator, sql-agent, code-fix, module:attr, or a block "
                   "'{name: calculator, args: {syntax: bracket}, max_turns: 3}'): each problem is an episode, scored by its reward")
    e.add_argument("--reward", default=None, help="a reward name, module:attr, YAML file or inline YAML block (default: the task's or run's)")
    e.add_argument("--n", type=int, default=500, help="problems (default 500)")
    e.add_argument("--k", type=int, default=8, help="pass@k samples per problem (0: skip; default 8)")
    e.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the pass@k samples (default 1.0)")
    e.add_argument("--max-new-tokens", type=int, default=None, help="completion length limit (default: the run's, else 6)")
    e.add_argument("--backend", default="torch", help="generation backend: torch, vllm or openai (rollout.backend; default torch)")
    e.add_argument("--server-url", default=None, help="--backend openai: the OpenAI-compatible server (rollout.server_url)")
    e.add_argument("--device", default="cpu")
    e.add_argument("--workers", type=int, default=2, help="reward worker processes (0: score in this process)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--best-of", type=int, default=None, metavar="N", help="sample N completions per problem, pick the one --reward scores "
                   "highest, and report its verified accuracy against n = 1, 2, 4, ..., N with pass@n and maj@n (docs/reward-models.md)")
    e.add_argument("--verifier", default=None, help="with --best-of: the reward that checks the picked answer (default: the task's, format's or run's)")
    e.add_argument("--out", default="bestof", metavar="DIR", help="with --best-of: folder for bestof.json and bestof.png (default ./bestof)")
    e.add_argument("--images", default="keep", choices=["keep", "blank", "shuffle", "describe"],
                   help="prompts with pictures: keep them (default), blank them, give each row the next row's (does the policy look?), "
                        "or put the row's image_description in their place (the text-only baseline)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(fn=cmd_eval)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="assay", description="RL post-training of language models with first-class rewards.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="run RL training (GRPO on the bundled model by default)")
    t.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                   help="a YAML config file (optional) and dotted overrides, in any order, for example train.steps=100 algo.advantage=rloo")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint, with the run's own config "
                   "(overrides may change train.steps, eval/save cadence, threads)")
    t.add_argument("--restart", metavar="RUN_DIR", help="start the run in RUN_DIR again from the beginning with its config.yaml "
                   "(a run that stopped before its first checkpoint) and any overrides")
    t.add_argument("--no-progress", action="store_true", help="no live progress bar")
    t.set_defaults(fn=cmd_train)

    _eval_parser(sub)
    _export_parser(sub)
    _rm_parser(sub)
    from assay.po.cli import add_po_parser

    add_po_parser(sub, train=cmd_po_train, pairs=cmd_po_pairs)
    _serve_parser(sub)

    rw = sub.add_parser("reward", help="score files with any reward; list the registered rewards")
    rsub = rw.add_subparsers(dest="reward_command", required=True)
    sc = rsub.add_parser("score", help="score JSONL rows (prompt, completion, answer, other fields)")
    sc.add_argument("--reward", required=True, help="a registered reward name, module:attr, or a YAML reward block")
    sc.add_argument("--input", required=True, help="input JSONL")
    sc.add_argument("--output", required=True, help="output JSONL (id, score, components, info, error)")
    sc.add_argument("--workers", type=int, default=2, help="worker processes (0: in this process; default 2)")
    sc.add_argument("--timeout", type=float, default=5.0, help="seconds per item before it is failed (default 5)")
    sc.set_defaults(fn=cmd_reward_score)
    ls = rsub.add_parser("list", help="every registered reward with its one-line doc")
    ls.set_defaults(fn=cmd_reward_list)

    b = sub.add_parser("bench", help="benchmarks: time a GRPO training step against TRL and the compute-bound limit")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    bt = bsub.add_parser("train", help="the same GRPO step under TRL's GRPOTrainer and assay's trainer, each in its own process")
    bt.add_argument("--vs", choices=["trl", "none"], default="trl", help="framework to compare with (none: assay alone; default trl)")
    bt.add_argument("--config", default=None, metavar="FILE.yaml", help="bench config (model, task, step shape; see docs/performance.md)")
    bt.add_argument("--steps", type=int, default=None, help="timed steps (default 5)")
    bt.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 1)")
    bt.add_argument("--threads", type=int, default=None, help="torch threads in every run (default: all cores this process may use)")
    bt.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8)")
    bt.add_argument("--generations", type=int, default=None, help="completions per prompt (default 8)")
    bt.add_argument("--max-new-tokens", type=int, default=None, help="completion length limit (default 32)")
    bt.add_argument("--json", default=None, metavar="OUT", help="also write every figure to this JSON file")
    bt.add_argument("--profile", default=None, metavar="DIR", help="record each run with py-spy into DIR (slows the runs)")
    bt.set_defaults(fn=cmd_bench_train)

    lab = sub.add_parser("lab", help="the reward-integrity lab: watch a reward get hacked and see which fix stops it (docs/integrity.md)")
    lab.add_argument("experiment", choices=["spurious", "prm-hacking", "length-hacking", "image-rewards"], help="which experiment")
    lab.add_argument("--out", default="runs/lab", help="output folder (default runs/lab; the experiment writes OUT/EXPERIMENT/)")
    lab.add_argument("--steps", type=int, default=None, help="training steps per arm (default: the experiment's own budget)")
    lab.add_argument("--seed", type=int, default=0, help="the seed every arm trains with (default 0)")
    lab.add_argument("--arms", nargs="+", default=None, help="train only these arms (their names are on the experiment's page); "
                     "the claims, which compare arms, are then not judged")
    lab.add_argument("--no-progress", action="store_true", help="no progress bars")
    lab.set_defaults(fn=cmd_lab)
    r = sub.add_parser("pretrain", help="rebuild a bundled model from its recipe")
    r.add_argument("name", nargs="?", default="tiny-arith", help="recipe name (default tiny-arith)")
    r.add_argument("--out", default=None, help="output folder (default: the recipe's own model folder)")
    r.add_argument("--seed", type=int, default=None, help="override the recipe's seed")
    r.add_argument("--device", default="cpu", help="torch device (default cpu; only a CPU build is byte-identical to the bundled model)")
    r.set_defaults(fn=cmd_pretrain)
    return p


def _one_process_unless_train(args) -> None:
    """Under `torchrun` only `assay train` shares the work between the processes; any other command would run whole in
    every one of them, all writing the same folder, so it is refused in one line."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 or args.command == "train":
        return
    name = " ".join(x for x in (args.command, getattr(args, f"{args.command}_command", None)) if x)
    raise AssayError(f"assay {name} runs in one process; run it without torchrun (under torchrun only `assay train` shares "
                     "its work between the processes: docs/scaling.md)")


def main(argv: list[str] | None = None) -> int:
    from assay.log import setup_cli_logging

    setup_cli_logging()
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    trains = args.command == "train" or getattr(args, "rm_command", None) == "train" or getattr(args, "po_command", None) == "train"
    if rest and trains and not any(r.startswith("-") for r in rest):
        args.args += rest  # positionals after an option (`CONFIG --no-progress k=v`): options and overrides in any order
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        _one_process_unless_train(args)
        code = args.fn(args)
    except AssayError as e:
        print(f"assay: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("assay: interrupted", file=sys.stderr)
        code = 130
    if argv is None and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:  # a torchrun rank's own process
        from assay.training.dist import exit_rank

        exit_rank(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
