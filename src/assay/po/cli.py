"""`assay po`: the parser of the preference subcommands, `train` and `pairs`; their commands are in `assay.cli`."""

from __future__ import annotations

from typing import Callable


def add_po_parser(sub, train: Callable, pairs: Callable) -> None:
    """`assay po train` and `assay po pairs` (docs/preference.md), run by the commands `train` and `pairs`."""
    po = sub.add_parser("po", help="preference optimisation: DPO-family training on pair files, pairs sampled from a model (docs/preference.md)")
    psub = po.add_subparsers(dest="po_command", required=True)
    t = psub.add_parser("train", help="offline preference training (dpo, cdpo, robust, ipo, hinge, simpo, orpo, kto) on a pair file")
    t.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                   help="a YAML config file (optional) and dotted overrides, for example data.path=pairs.jsonl loss=ipo loss_args.beta=0.5")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint (overrides may change "
                   "train.steps, eval/save cadence, threads, time limit)")
    t.add_argument("--restart", metavar="RUN_DIR", help="start the run in RUN_DIR again from the beginning with its config.yaml "
                   "(a run that stopped before its first checkpoint)")
    t.add_argument("--no-progress", action="store_true", help="no live progress bar")
    t.set_defaults(fn=train)
    p = psub.add_parser("pairs", help="sample G completions per prompt from a model, score them with any reward, write the pairs")
    p.add_argument("--out", required=True, metavar="FILE", help="output JSONL (prompt, chosen, rejected, chosen_reward, rejected_reward, answer)")
    p.add_argument("--model", default="tiny-arith", help="the policy that samples: a bundled name or a Hugging Face folder (default tiny-arith)")
    p.add_argument("--task", default="arithmetic", help="built-in task whose training prompts are sampled (default arithmetic)")
    p.add_argument("--task-args", default=None, help="task arguments as YAML or JSON, for example '{terms: 3}'")
    p.add_argument("--data", default=None, metavar="FILE", help="a prompt file instead of the task (with --fields and --reward)")
    p.add_argument("--fields", default=None, help="column mapping for --data, for example '{prompt: question, answer: solution}'")
    p.add_argument("--reward", default=None, help="the reward that scores completions: a name, module:attr or a YAML block (default: the task's)")
    p.add_argument("--prompts", type=int, default=1000, help="prompts, taken in the order `assay train` draws them (default 1000)")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (default 8)")
    p.add_argument("--pairs", choices=["best_worst", "all"], default="best_worst", help="which pairs of a group (default best_worst)")
    p.add_argument("--margin", type=float, default=0.0, help="rewards that differ by this much or less are a tie, never a pair (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--backend", default="torch", help="generation backend: torch, vllm or openai (default torch)")
    p.add_argument("--server-url", default=None, help="--backend openai: the OpenAI-compatible server")
    p.add_argument("--device", default="cpu")
    p.add_argument("--workers", type=int, default=0, help="reward worker processes (default 0: in this process)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="also print the counts as one JSON object")
    p.set_defaults(fn=pairs)
