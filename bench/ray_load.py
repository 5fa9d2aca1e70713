"""Replicas on Ray Serve against one server: `tinydet serve --ray --replicas R` (1 thread each) and
`tinydet serve --threads T`, same requests, same client (serve_load.py's).

    python bench/ray_load.py --model SmolLM2-135M-Instruct.Q4_1.gguf [--dtype fp32] [--clients 8]
        [--requests 2] [--new-tokens 64] [--rounds 3] [--engines single:2,ray:1,ray:2,ray:1x2] [--json]

`single:T` is one `tinydet serve` process with T threads; `ray:R` a local Ray cluster with R replicas
of one thread each behind the ingress (`ray:RxT`: of T threads each). Every engine gets --clients slots per replica. For each round
the engines run in turn (the order rotating), each started fresh; C client threads send --requests
requests each (128-token prompts, --new-tokens greedy tokens, logprobs 1, streamed).

Reported per engine, medians over rounds: aggregate generated tok/s, time to first token p50/p99, and
how many distinct completions and logprobs sequences each request got across all engines and rounds
(1 = the answer depended neither on the load nor on which replica or server computed it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import free_port, pct, prompts, run_level, start_server, stop_server  # noqa: E402


class Server:
    def __init__(self, spec: str, model: str, dtype: str, clients: int):
        kind, n = spec.split(":")
        n, _, threads = n.partition("x")
        self.spec, self.port = spec, free_port()
        cmd = [sys.executable, "-m", "tinydet", "serve", "--model", model, "--dtype", dtype, "--max-batch",
               str(clients), "--max-queue", "1024", "--port", str(self.port), "--canary-interval", "0",
               "--served-model-name", "m"]
        cmd += ["--threads", n] if kind == "single" else ["--ray", "--replicas", n, "--threads", threads or "1"]
        self.proc, self.url = start_server(spec, cmd, self.port, timeout=600)

    def stop(self):
        stop_server(self.proc, timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default="single:2,ray:1,ray:2,ray:1x2")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    a = ap.parse_args()
    engines = a.engines.split(",")
    ids = prompts(a.model, a.clients * a.requests)
    reqs = [ids[i * a.requests:(i + 1) * a.requests] for i in range(a.clients)]
    rows: dict = {e: {"tps": [], "ttft": []} for e in engines}
    answers: dict = {}
    for rnd in range(a.rounds):
        for e in engines[rnd % len(engines):] + engines[:rnd % len(engines)]:
            server = Server(e, a.model, a.dtype, a.clients)
            try:
                wall, results = run_level(server.url, reqs, a.new_tokens)
            finally:
                server.stop()
            tokens = sum(len(r["stamps"]) for r in results)
            rows[e]["tps"].append(tokens / wall)
            rows[e]["ttft"] += [r["stamps"][0] - r["t0"] for r in results if r["stamps"]]
            for i, r in enumerate(results):
                answers.setdefault(i, set()).add((r["text"], r["logprobs"]))
            print(f"round {rnd + 1} {e}: {tokens / wall:.1f} tok/s", file=sys.stderr)
    out = {e: {"tok_s": statistics.median(v["tps"]), "rounds": [round(x, 1) for x in v["tps"]],
               "ttft_p50_ms": 1e3 * pct(v["ttft"], 0.5), "ttft_p99_ms": 1e3 * pct(v["ttft"], 0.99)}
           for e, v in rows.items()}
    distinct = {"texts": max(len({t for t, _ in s}) for s in answers.values()),
                "logprobs": max(len({lp for _, lp in s}) for s in answers.values())}
    if a.json:
        print(json.dumps({"engines": out, "distinct_per_request_max": distinct}))
        return
    print(f"{'engine':<10} {'tok/s':>8}  rounds                 ttft p50   ttft p99")
    for e, r in out.items():
        print(f"{e:<10} {r['tok_s']:8.1f}  {str(r['rounds']):<22} {r['ttft_p50_ms']:7.0f} ms {r['ttft_p99_ms']:7.0f} ms")
    print(f"distinct answers per request, across every engine and round: {distinct['texts']} text, "
          f"{distinct['logprobs']} logprobs sequence")


if __name__ == "__main__":
    main()
