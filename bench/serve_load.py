"""Servers under load: `tinydet serve` against llama.cpp's own `llama-server`, same requests, same client.

    python bench/serve_load.py --q41 Q4_1.gguf --f32 F32.gguf --f16 F16.gguf \\
        --llama-server /path/to/llama-server [--clients 1,4,8,16] [--requests 3] [--rounds 3] [--threads 2] \\
        [--engines tinydet:fp32,tinydet:fp16,tinydet:native,llama:F32,llama:F16,llama:Q4_1] [--json OUT]

An engine may carry options of its own after @, joined by +: `tinydet:fp16@--prefill-chunk=512`.

For each concurrency level C and round, every engine is started in turn (the order rotating each
round) as a fresh server process with C slots (`llama-server -np C`, `tinydet serve --max-batch C`),
`--threads` threads, on 127.0.0.1; C client threads then each send the same fixed list of
`--requests` requests, one after another: a 128-token prompt (token ids, so every engine reads the
same tokens; a different slice of one English text per request), 64 new tokens, greedy,
`logprobs: 1`, streamed. The client is plain HTTP (httpx), the same for every engine.

Reported per engine and level, medians over rounds: aggregate generated tok/s (tokens / wall time of
the level), time to first token p50/p99, inter-token latency p50/p99 (gaps between streamed pieces),
and per request how many distinct completions (text) and distinct logprobs sequences it got across
all levels and rounds (1 = the answer did not depend on the load). For tinydet at each level it also
runs `Model.generate_batch` over the same requests (max_batch C) in a separate process, and reports
the server's throughput / generate_batch's (the server's own overhead).

tinydet runs the F32 file for fp32 and fp16 and the Q4_1 file for native, as tinydet computes fp32's
bits from either; llama-server runs each file in its own types. Only the standard library and httpx
are needed here; the servers run as subprocesses.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

TEXT = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(tokenizer_model: str, n: int, length: int = 128) -> list[list[int]]:
    """n prompts of `length` token ids: consecutive slices of one text, through tinydet's tokenizer of
    the model (the same ids as llama.cpp's: tinydet passes llama.cpp's tokenizer tests)."""
    out = subprocess.run([sys.executable, "-c", (
        "import json,sys,tinydet; m=tinydet.load(sys.argv[1]); print(json.dumps(m.tokenize(sys.argv[2])))"),
        tokenizer_model, TEXT], capture_output=True, text=True, check=True)
    ids = json.loads(out.stdout)
    assert len(ids) >= n * 40 + length, "the text is too short for that many prompts"
    return [ids[1 + 40 * i: 1 + 40 * i + length] for i in range(n)]


def parse_spec(spec: str) -> tuple[str, str, list[str]]:
    """'tinydet:fp16@--prefill-chunk=512+--max-queue=9' -> ('tinydet', 'fp16', [options]): an engine
    and, after @, options of its own (so two settings of one engine can be compared in one run)."""
    head, _, extra = spec.partition("@")
    kind, what = head.split(":")
    return kind, what, extra.split("+") if extra else []


class Server:
    def __init__(self, spec: str, files: dict, clients: int, threads: int, llama_server: str | None,
                 tinydet_args: str = ""):
        self.spec, self.port = spec, free_port()
        kind, what, extra = parse_spec(spec)
        if kind == "llama":
            ctx = max(4096, clients * 256)
            cmd = [llama_server, "-m", files[what], "-np", str(clients), "-t", str(threads), "-tb", str(threads),
                   "-c", str(ctx), "--host", "127.0.0.1", "--port", str(self.port), "--no-webui"]
        else:
            f = files["Q4_1"] if what == "native" else files["F32"]
            cmd = [sys.executable, "-m", "tinydet", "serve", "--model", f, "--dtype", what, "--threads",
                   str(threads), "--max-batch", str(clients), "--max-queue", "1024", "--port", str(self.port),
                   "--canary-interval", "0", "--served-model-name", "m", *tinydet_args.split(), *extra]
        self.cmd = cmd
        self.proc, self.url = start_server(spec, cmd, self.port)

    def stop(self):
        stop_server(self.proc)


def start_server(spec: str, cmd: list[str], port: int, timeout: float = 300) -> tuple[subprocess.Popen, str]:
    """Start a server process and wait until its /health answers 200: (process, base URL)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{spec}: server did not come up: {' '.join(cmd)}")
        time.sleep(0.2)


def stop_server(proc: subprocess.Popen, timeout: float = 30) -> None:
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def one_request(http: httpx.Client, url: str, ids: list[int], new_tokens: int) -> dict:
    body = {"model": "m", "prompt": ids, "max_tokens": new_tokens, "temperature": 0, "logprobs": 1, "stream": True}
    t0 = time.perf_counter()
    stamps, text, lps = [], [], []
    with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices", []):
                if ch.get("text"):
                    stamps.append(time.perf_counter())
                    text.append(ch["text"])
                if ch.get("logprobs"):
                    lps.append(ch["logprobs"])
    return {"t0": t0, "stamps": stamps, "text": "".join(text), "logprobs": json.dumps(lps, sort_keys=True)}


def run_level(url: str, reqs: list[list[list[int]]], new_tokens: int) -> tuple[float, list[dict]]:
    results: list[list[dict]] = [[] for _ in reqs]
    # One HTTP client per simulated user, made before the clock starts: making one builds an SSL
    # context (~20 ms of CPU), which is neither server's work and would run on the cores they share.
    # A new connection per request (cheap on 127.0.0.1): llama-server closes kept-alive ones at
    # times just as the next request goes out.
    https = [httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) for _ in reqs]
    errors: list[BaseException] = []

    def client(i):
        try:
            for ids in reqs[i]:
                results[i].append(one_request(https[i], url, ids, new_tokens))
        except BaseException as e:  # noqa: BLE001 - a lost request voids the level
            errors.append(e)

    try:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"{len(errors)} of {len(reqs)} clients failed: {errors[0]!r}")
        return time.perf_counter() - t0, [r for per in results for r in per]
    finally:
        for h in https:
            h.close()


def batch_tps(model: str, dtype: str, threads: int, flat: list[list[int]], clients: int, new_tokens: int) -> float:
    """generate_batch's aggregate tok/s over the same requests, in its own process."""
    code = ("import json,sys,time,tinydet\n"
            "m=tinydet.load(sys.argv[1],dtype=sys.argv[2],threads=int(sys.argv[3]))\n"
            "reqs=[dict(prompt=p,max_tokens=int(sys.argv[5])) for p in json.loads(sys.argv[6])]\n"
            "m.generate_batch(reqs[:2],max_batch=int(sys.argv[4]))\n"
            "t=time.perf_counter(); out=m.generate_batch(reqs,max_batch=int(sys.argv[4])); t=time.perf_counter()-t\n"
            "print(sum(len(g.token_ids) for g in out)/t)")
    r = subprocess.run([sys.executable, "-c", code, model, dtype, str(threads), str(clients), str(new_tokens),
                        json.dumps(flat)], capture_output=True, text=True, check=True)
    return float(r.stdout.strip())


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--q41", required=True)
    ap.add_argument("--f32", required=True)
    ap.add_argument("--f16", required=True)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=3, help="requests per client per level")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="llama:F32,tinydet:fp32,llama:F16,tinydet:fp16,llama:Q4_1,tinydet:native")
    ap.add_argument("--no-batch", action="store_true", help="skip the generate_batch comparison")
    ap.add_argument("--batch-every-round", action="store_true",
                    help="run generate_batch in every round (default: the first), its ratio the median of the rounds'")
    ap.add_argument("--tinydet-args", default="", help="more options for `tinydet serve`, e.g. '--prefill-chunk 512'")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    files = {"F32": a.f32, "F16": a.f16, "Q4_1": a.q41}
    engines = a.engines.split(",")
    levels = [int(c) for c in a.clients.split(",")]
    if any(e.startswith("llama:") for e in engines) and not a.llama_server:
        ap.error("--llama-server is needed for llama engines")
    pool = prompts(a.q41, max(levels) * a.requests + 1)
    warm = pool.pop()  # a prompt of its own, so no engine's prefix cache starts with a measured one
    rows, answers, batch = [], {}, {}
    for rnd in range(a.rounds):
        for c in levels:
            reqs = [pool[i * a.requests:(i + 1) * a.requests] for i in range(c)]
            order = engines[rnd % len(engines):] + engines[:rnd % len(engines)]
            for spec in order:
                srv = Server(spec, files, c, a.threads, a.llama_server, a.tinydet_args)
                try:
                    run_level(srv.url, [[warm]], a.new_tokens)  # warm-up, excluded
                    wall, res = run_level(srv.url, reqs, a.new_tokens)
                finally:
                    srv.stop()
                ntok = sum(len(r["stamps"]) for r in res)
                ttft = [r["stamps"][0] - r["t0"] for r in res if r["stamps"]]
                itl = [b - a_ for r in res for a_, b in zip(r["stamps"], r["stamps"][1:])]
                row = dict(engine=spec, clients=c, round=rnd, tok_s=ntok / wall, ttft_p50=pct(ttft, .5),
                           ttft_p99=pct(ttft, .99), itl_p50=pct(itl, .5), itl_p99=pct(itl, .99), tokens=ntok)
                rows.append(row)
                for k, r in enumerate(res):  # the k-th result answers pool[k] at every level
                    answers.setdefault(spec, {}).setdefault(k, []).append((r["text"], r["logprobs"]))
                print(json.dumps(row), flush=True)
                if spec.startswith("tinydet:") and not a.no_batch and (rnd == 0 or a.batch_every_round):
                    dtype = parse_spec(spec)[1]
                    f = files["Q4_1"] if dtype == "native" else files["F32"]
                    flat = [ids for per in reqs for ids in per]
                    tps = batch_tps(f, dtype, a.threads, flat, c, a.new_tokens)
                    batch.setdefault((spec, c), []).append(tps / row["tok_s"])  # generate_batch / server, this round
                    print(json.dumps(dict(engine=spec, clients=c, round=rnd, generate_batch_tok_s=tps)), flush=True)
    report(rows, answers, batch, engines, levels)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(rows=rows, batch_over_server={f"{k[0]}@{k[1]}": v for k, v in batch.items()},
                                                distinct={e: _distinct(v) for e, v in answers.items()}), indent=1))


def _distinct(per_request: dict) -> dict:
    texts = [len({t for t, _ in v}) for v in per_request.values()]
    lps = [len({lp for _, lp in v}) for v in per_request.values()]
    return {"requests": len(per_request), "max_distinct_texts": max(texts), "max_distinct_logprobs": max(lps),
            "requests_with_more_than_one_text": sum(x > 1 for x in texts),
            "requests_with_more_than_one_logprobs": sum(x > 1 for x in lps)}


def report(rows, answers, batch, engines, levels) -> None:
    print("\n| engine | clients | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | server / generate_batch |")
    print("|---|--:|--:|--:|--:|--:|")
    for c in levels:
        for e in engines:
            rs = [r for r in rows if r["engine"] == e and r["clients"] == c]
            med = {k: statistics.median(r[k] for r in rs) for k in ("tok_s", "ttft_p50", "ttft_p99", "itl_p50",
                                                                       "itl_p99")}
            b = batch.get((e, c))  # the median over rounds of the per-round ratios
            ratio = f"{1 / statistics.median(b):.2f}" if b else ""
            print(f"| {e} | {c} | {med['tok_s']:.1f} | {1e3 * med['ttft_p50']:.0f} / {1e3 * med['ttft_p99']:.0f} | "
                  f"{1e3 * med['itl_p50']:.1f} / {1e3 * med['itl_p99']:.1f} | {ratio} |")
    print("\n| engine | requests | max distinct completions | max distinct logprobs | requests with >1 text / logprobs |")
    print("|---|--:|--:|--:|--:|")
    for e in engines:
        d = _distinct(answers[e])
        print(f"| {e} | {d['requests']} | {d['max_distinct_texts']} | {d['max_distinct_logprobs']} | "
              f"{d['requests_with_more_than_one_text']} / {d['requests_with_more_than_one_logprobs']} |")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
