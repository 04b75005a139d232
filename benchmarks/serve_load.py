"""Load on `assay serve rewards`: N concurrent clients on loopback, every reply checked.

Starts `assay serve rewards --reward math` from this checkout (and, with `--vs REF`, the
server of git revision REF from the same repository, one after the other in the same run),
then runs `--clients` concurrent clients, each on its own keep-alive connection, each
sending `--requests` requests of `--items` items in OpenRLHF's shape (`/get_reward`:
`query` = prompt + response, `prompts`, `labels`), verl's batch shape (`/compute_score`: a
list of `{data_source, solution_str, ground_truth, extra_info}`) or both in turn
(`--shape mixed`). Every item has a known reward (a right or a wrong boxed sum; each prompt
holds a few-shot example whose own box is right, so scoring the prompt would be caught).

Per server it reports requests answered correctly, failures by kind (`connect:`/`io:` an
exception class, `http:` a status other than 200, `wrong`: a reply whose rewards are not
the expected ones, `unfinished`: cut by `--max-seconds`), items/s (items answered correctly
over the wall time of the whole load) and latency percentiles of the answered requests;
with `--vs`, the ratio of items/s. Bounded in count (clients × requests) and in time
(`--max-seconds` per server). One JSON object per server on stdout, the table on stderr.

    PYTHONPATH=src python benchmarks/serve_load.py --clients 32 --requests 20 --items 16 --vs 5021c99
    PYTHONPATH=src python benchmarks/serve_load.py --clients 256 --requests 5 --items 16 --workers 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- items with known rewards


def make_items(seed: int, n: int) -> list[dict[str, Any]]:
    """`n` items: a prompt holding a right few-shot box, a response with a right or wrong box, the label, the expected reward."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        a, b = rng.randrange(10, 1000), rng.randrange(10, 1000)
        right = rng.random() < 0.5
        given = a + b if right else a + b + rng.randrange(1, 9)
        prompt = f"Example: 2+5 = \\boxed{{7}}.\nCompute {a}+{b}. Put the answer in \\boxed{{}}.\n"
        items.append({"prompt": prompt, "response": f"Adding, {a}+{b} gives \\boxed{{{given}}}.", "label": str(a + b),
                      "expected": 1.0 if right else 0.0})
    return items


def openrlhf_request(items: list[dict[str, Any]]) -> tuple[str, Any]:
    return "/get_reward", {"query": [i["prompt"] + i["response"] for i in items], "prompts": [i["prompt"] for i in items],
                           "labels": [i["label"] for i in items]}


def verl_request(items: list[dict[str, Any]]) -> tuple[str, Any]:
    return "/compute_score", [{"data_source": "math", "solution_str": i["response"], "ground_truth": i["label"],
                               "extra_info": {"prompt": i["prompt"]}} for i in items]


def rewards_of(path: str, reply: Any) -> list[float] | None:
    """The rewards in a reply of either shape; None for a reply of the wrong shape."""
    try:
        if path == "/get_reward":
            return [float(x) for x in reply["rewards"]]
        return [float(x["score"]) for x in reply]
    except (KeyError, TypeError, ValueError):
        return None


# ---------------------------------------------------------------- a keep-alive HTTP/1.1 client


class Connection:
    """One keep-alive connection; `post` reconnects when the server closed it after its last reply."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, payload: Any) -> tuple[int, Any]:
        """`(status, parsed JSON body)`; raises OSError (prefixed 'connect:' when no connection could be made)."""
        if self.writer is None:
            try:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            except OSError as e:
                raise ConnectError(type(e).__name__) from None
        data = json.dumps(payload).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        try:
            await self.writer.drain()
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.close()
            raise ConnectionResetError("closed without a reply") from None
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
        body = await self.reader.readexactly(int(headers.get("content-length", 0)))
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, json.loads(body) if body else None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class ConnectError(OSError):
    pass


def client_requests(k: int, args: argparse.Namespace) -> list[tuple[str, Any, list[float]]]:
    """Client k's requests, made before the clock starts: `(path, payload, expected rewards)`."""
    out = []
    for r in range(args.requests):
        items = make_items(args.seed * 1_000_003 + k * 1009 + r, args.items)
        shape = args.shape if args.shape != "mixed" else ("openrlhf", "verl")[(k + r) % 2]
        path, payload = (openrlhf_request if shape == "openrlhf" else verl_request)(items)
        out.append((path, payload, [i["expected"] for i in items]))
    return out


async def client(host: str, port: int, requests: list[tuple[str, Any, list[float]]], out: dict[str, Any]) -> None:
    conn = Connection(host, port)
    try:
        for path, payload, expected in requests:
            start = time.perf_counter()
            try:
                status, reply = await conn.post(path, payload)
            except ConnectError as e:
                out["failures"].append(f"connect:{e}")
                continue
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                conn.close()
                out["failures"].append(f"io:{type(e).__name__}")
                continue
            if status != 200:
                out["failures"].append(f"http:{status}")
                continue
            if rewards_of(path, reply) != expected:
                out["failures"].append("wrong")
                continue
            out["latencies"].append(time.perf_counter() - start)
            out["items"] += len(expected)
    finally:
        conn.close()


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def load(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run the clients against `url` within `--max-seconds`; the figures of the run."""
    host, port = url.split("://")[1].rsplit(":", 1)
    out: dict[str, Any] = {"failures": [], "latencies": [], "items": 0}
    work = [client_requests(k, args) for k in range(args.clients)]
    start = time.perf_counter()
    tasks = [asyncio.create_task(client(host, int(port), requests, out)) for requests in work]
    done, pending = await asyncio.wait(tasks, timeout=args.max_seconds)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    seconds = time.perf_counter() - start
    total = args.clients * args.requests
    out["failures"] += ["unfinished"] * (total - len(out["latencies"]) - len(out["failures"]))
    kinds: dict[str, int] = {}
    for f in out["failures"]:
        kinds[f] = kinds.get(f, 0) + 1
    lat = out["latencies"]
    return {"requests": total, "ok": len(lat), "failures": len(out["failures"]), "failure_kinds": kinds,
            "items_ok": out["items"], "seconds": round(seconds, 3), "items_per_s": round(out["items"] / seconds, 1),
            **{f"p{int(q * 100)}_s": None if percentile(lat, q) is None else round(percentile(lat, q), 4) for q in (0.5, 0.9, 0.99)},
            "max_s": round(max(lat), 4) if lat else None}


# ---------------------------------------------------------------- servers


def source_of(ref: str, into: Path) -> Path:
    """The `src/` folder of git revision `ref` of this repository, extracted under `into`."""
    archive = into / "src.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], stdout=f, check=True)
    with tarfile.open(archive) as t:
        t.extractall(into, filter="data")
    return into / "src"


def start_server(src: Path, args: argparse.Namespace, extra: list[str]) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "assay.cli", "serve", "rewards", "--reward", args.reward, "--port", "0",
           "--workers", str(args.workers), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = proc.stdout.readline()
    if "serving reward" not in line:
        proc.kill()
        raise SystemExit(f"serve_load: the server at {src} did not start: {line!r}")
    return proc, line.split(" on ")[-1].strip()


def cpu_seconds(root: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of process `root` and each process below it, read from /proc."""
    parent, cpu = {}, {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(d.name)] = int(fields[1])
            cpu[int(d.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    tree, todo = {root}, [root]
    while todo:
        up = todo.pop()
        kids = {p for p, pp in parent.items() if pp == up}
        tree |= kids
        todo += kids
    return {p: cpu[p] for p in tree if p in cpu}


def measure(name: str, src: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    proc, url = start_server(src, args, extra)
    try:
        before = cpu_seconds(proc.pid)
        row = {"server": name, "clients": args.clients, "requests_each": args.requests, "items_each": args.items, "shape": args.shape,
               "workers": args.workers, **asyncio.run(load(url, args))}
        after = cpu_seconds(proc.pid)
        row["server_cpu_s"] = round(sum(c - before.get(p, 0.0) for p, c in after.items()), 2)
        row["process_cpu_share"] = sorted((round((c - before.get(p, 0.0)) / row["seconds"], 2) for p, c in after.items()), reverse=True)
        row["server_cpu_ms_per_item"] = round(1000 * row["server_cpu_s"] / row["items_ok"], 4) if row["items_ok"] else None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            row_exit = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            row_exit = "killed"
    row["exit"] = row_exit
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=32, help="concurrent clients, each on its own connection (default 32)")
    p.add_argument("--requests", type=int, default=20, help="requests per client (default 20)")
    p.add_argument("--items", type=int, default=16, help="items per request (default 16)")
    p.add_argument("--shape", choices=["openrlhf", "verl", "mixed"], default="mixed", help="request shape (default mixed: both in turn)")
    p.add_argument("--reward", default="math")
    p.add_argument("--workers", type=int, default=2, help="the server's reward workers (default 2)")
    p.add_argument("--vs", default=None, metavar="REF", help="also measure the server of this git revision, in the same run")
    p.add_argument("--rounds", type=int, default=1, help="with --vs: alternate the servers this many times (default 1)")
    p.add_argument("--server-args", default="", help="extra arguments for this checkout's server, e.g. '--batch-window 0.01'")
    p.add_argument("--max-seconds", type=float, default=300.0, help="bound on each load run; unfinished requests are failures (default 300)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.clients < 1 or args.requests < 1 or args.items < 1:
        raise SystemExit("serve_load: --clients, --requests and --items must be >= 1")
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="serve-load-"))
    try:
        old = source_of(args.vs, tmp) if args.vs else None
        for _ in range(args.rounds if old else 1):
            rows.append(measure("this checkout", ROOT / "src", args, args.server_args.split()))
            if old:
                rows.append(measure(f"git {args.vs}", old, args, []))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for row in rows:
        print(json.dumps(row))
    report(rows)


def report(rows: list[dict[str, Any]]) -> None:
    keys = ("server", "ok", "failures", "items_per_s", "p50_s", "p90_s", "p99_s", "max_s", "server_cpu_ms_per_item", "exit")
    print("  ".join(f"{k.replace('server_', ''):>14}" for k in keys), file=sys.stderr)
    for row in rows:
        print("  ".join(f"{str(row[k]):>14}" for k in keys), file=sys.stderr)
        if row["failure_kinds"]:
            print(f"{'':>14}  failures: {row['failure_kinds']}", file=sys.stderr)
    new = [r["items_per_s"] for r in rows if r["server"] == "this checkout"]
    old = [r["items_per_s"] for r in rows if r["server"] != "this checkout"]
    if new and old and min(old) > 0:
        print(f"items/s ratio, this checkout / {rows[1]['server']}: {sum(new) / len(new) / (sum(old) / len(old)):.2f} "
              f"(means over {len(new)} round(s))", file=sys.stderr)


if __name__ == "__main__":
    main()
