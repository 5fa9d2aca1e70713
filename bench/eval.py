"""lm-evaluation-harness against `tinydet serve`: a multiple-choice task's wall time with the prefix cache
off, on (a fresh server: the choices after a context's first take it from the cache), and on again
(the same task a second time on that server), at each `num_concurrent`; every run's per-sample results
must be identical.

    python bench/eval.py --model SmolLM2-135M-Instruct.Q4_1.gguf [--dtype fp32] [--concurrency 1,8]
        [--docs 12] [--threads 2] [--tasks tinydet_mc] [--server-args "--max-batch 32"] [--cache on,off]
        [--json OUT]

The task set is tests/evaltask.py's (stories of 200-400 tokens, 4 choices each: 4 requests per
document, each scoring its whole prompt with echo). Each server is a fresh `tinydet serve` process
(--max-batch 8 unless --server-args say otherwise); lm-eval's `local-completions` client runs here, tokenizing with the server's
/tokenize. Needs the eval extra (lm-eval[api]).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import evaltask  # noqa: E402

NAME = "m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, dtype: str, threads: int, extra: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tinydet", "serve", "--model", model, "--dtype", dtype, "--threads",
               str(threads), "--port", str(self.port), "--served-model-name", NAME, *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {self.proc.stderr.read()[-2000:]}")
            time.sleep(0.2)

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    def stop(self):
        self.proc.terminate()
        self.proc.wait(60)


def evaluate(url: str, folder: Path, tasks: list[str], concurrency: int) -> tuple[float, dict]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(folder), include_defaults=False)
    t0 = time.perf_counter()
    out = simple_evaluate(model="local-completions",
                          model_args={"model": NAME, "base_url": f"{url}/v1/completions",
                                      "num_concurrent": concurrency, "max_retries": 1},
                          tasks=tasks, task_manager=manager, log_samples=True)
    return time.perf_counter() - t0, out


def digest(out: dict) -> str:
    rows = {t: sorted(r, key=lambda x: x["doc_id"]) for t, r in out["samples"].items()}
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tasks", default="tinydet_mc")
    ap.add_argument("--server-args", default="", help="more options for tinydet serve, e.g. '--max-batch 32'")
    ap.add_argument("--cache", default="off,on", help="prefix cache settings to run: off, on or both")
    ap.add_argument("--json")
    a = ap.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("lm-eval").setLevel(logging.WARNING)
    folder = Path(tempfile.mkdtemp(prefix="tinydet-eval-"))
    evaltask.write(folder, n_mc=a.docs, long=True)
    tasks = a.tasks.split(",")
    rows = []
    for c in [int(x) for x in a.concurrency.split(",")]:
        for cache in a.cache.split(","):
            extra = (["--prefix-cache", "0"] if cache == "off" else []) + a.server_args.split()
            server = Server(a.model, a.dtype, a.threads, extra)
            try:
                runs = ["cold", "again"] if cache == "on" else ["cold"]
                for run in runs:
                    before = server.metric("tinydet_prompt_tokens_computed_total")
                    wall, out = evaluate(server.url, folder, tasks, c)
                    computed = server.metric("tinydet_prompt_tokens_computed_total") - before
                    row = dict(concurrency=c, prefix_cache=cache, run=run, wall_s=round(wall, 2),
                               prompt_tokens_computed=int(computed), samples=digest(out),
                               results={t: {k: v for k, v in r.items() if isinstance(v, float)}
                                        for t, r in out["results"].items()})
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                server.stop()
    digests = {r["samples"] for r in rows}
    print(f"per-sample results identical across all {len(rows)} runs: {len(digests) == 1}")
    for c in sorted({r["concurrency"] for r in rows}):
        if {r["prefix_cache"] for r in rows} != {"off", "on"}:
            break
        by = {(r["prefix_cache"], r["run"]): r["wall_s"] for r in rows if r["concurrency"] == c}
        print(f"num_concurrent {c}: cache off {by[('off', 'cold')]:.1f} s, on {by[('on', 'cold')]:.1f} s "
              f"({by[('off', 'cold')] / by[('on', 'cold')]:.2f}x), again {by[('on', 'again')]:.1f} s "
              f"({by[('off', 'cold')] / by[('on', 'again')]:.2f}x)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
