"""The `assay` command: argument handling only; the work lives in the packages."""

from __future__ import annotations

import argparse
import json
import sys

from assay.errors import AssayError


def cmd_train(args: argparse.Namespace) -> int:
    from assay.config import load_config
    from assay.train.rl import Trainer

    config_path, overrides = None, list(args.overrides)
    if args.config and "=" not in args.config:
        config_path = args.config
    elif args.config:
        overrides.insert(0, args.config)
    cfg = load_config(config_path, overrides)
    run_dir = None
    if args.resume:
        from pathlib import Path

        run_dir = Path(args.resume)
        if not run_dir.is_dir():
            raise AssayError(f"--resume: run folder {args.resume!r} does not exist")
    trainer = Trainer(cfg, run_dir=run_dir, resume=bool(args.resume))
    print(f"run folder: {trainer.run_dir}", file=sys.stderr)
    result = trainer.fit(progress=not args.no_progress)
    for k, v in result.final.items():
        print(f"{k}: {v}", file=sys.stderr)
    print(f"report: {result.run_dir / 'report.html'}", file=sys.stderr)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from assay.data.tasks import make_task
    from assay.eval.policy import evaluate
    from assay.models import load_policy
    from assay.rewards.base import REWARDS
    from assay.rollout.sampler import TorchSampler

    task_args = json.loads(args.task_args) if args.task_args else {}
    task = make_task(args.task, **task_args)
    model, tok = load_policy(args.model, args.device)
    reward = REWARDS.get(task.reward)()
    problems = task.heldout(args.n)
    r = evaluate(TorchSampler(model, tok, args.device), reward, problems, args.max_new_tokens, k=args.k, seed=args.seed)
    out = {"model": args.model, "task": args.task, **r.as_dict()}
    if args.json:
        print(json.dumps(out))
    else:
        for key, v in out.items():
            print(f"{key:>12}: {v:.4f}" if isinstance(v, float) else f"{key:>12}: {v}")
    return 0


def cmd_pretrain(args: argparse.Namespace) -> int:
    from assay.recipes.build import build_bundled

    build_bundled(args.name, args.out, seed=args.seed)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="assay", description="RL post-training of language models with first-class rewards.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="run RL training (GRPO on the bundled model by default)")
    t.add_argument("config", nargs="?", help="a YAML config file (optional)")
    t.add_argument("overrides", nargs="*", help="dotted overrides, for example train.steps=100 algo.advantage=rloo")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint")
    t.add_argument("--no-progress", action="store_true", help="no live progress bar")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="greedy accuracy, pass@k and length on a task's held-out split")
    e.add_argument("--model", default="tiny-arith", help="bundled model name or Hugging Face folder")
    e.add_argument("--task", default="arithmetic", help="built-in task name")
    e.add_argument("--task-args", default=None, help='task arguments as JSON, for example \'{"terms": 3}\'')
    e.add_argument("--n", type=int, default=500, help="held-out problems (default 500)")
    e.add_argument("--k", type=int, default=8, help="pass@k samples per problem (0: skip; default 8)")
    e.add_argument("--max-new-tokens", type=int, default=6)
    e.add_argument("--device", default="cpu")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(fn=cmd_eval)

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

    r = sub.add_parser("pretrain", help="rebuild a bundled model from its recipe")
    r.add_argument("name", nargs="?", default="tiny-arith", help="recipe name (default tiny-arith)")
    r.add_argument("--out", default=None, help="output folder (default: the recipe's own model folder)")
    r.add_argument("--seed", type=int, default=None, help="override the recipe's seed")
    r.set_defaults(fn=cmd_pretrain)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except AssayError as e:
        print(f"assay: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("assay: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
