"""A fuzz campaign: mutated inputs through each target, with figures.

    python fuzz/campaign.py [--target NAME]... [--inputs N] [--seconds S] [--seed K] [--no-trace-memory]

Per target: inputs, ok, refused, escapes, hangs, over-allocations, inputs/s. Each failing input is
saved under fuzz/crashes/<target>/<n>/ (its files, args.json for the CLI, outcome.txt) to replay.
Everything runs in a scratch directory under /tmp, which is also the working directory."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tinydet  # noqa: E402,F401  (first: sizes numba's thread pool)
from harness import FAILURES, run_one  # noqa: E402
from targets import TARGETS, make_scratch, write_case  # noqa: E402

CRASHES = HERE / "crashes"
SAVE_PER_FAILURE = 5  # reproducers saved per kind of failure (exception type and innermost frame)


def save_crash(target: str, files: dict[str, bytes], outcome) -> Path:
    """The failing input under the next free number, so that runs add to what earlier ones saved."""
    root = CRASHES / target
    root.mkdir(parents=True, exist_ok=True)
    n = len(list(root.iterdir()))
    while (root / f"{n:04d}").exists():
        n += 1
    d = root / f"{n:04d}"
    d.mkdir()
    for name, data in files.items():
        p = d / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    (d / "outcome.txt").write_text(f"{outcome.kind}: {outcome.detail}\n", encoding="utf-8")
    return d


def campaign(name: str, inputs: int, seconds: float, seed: int, time_limit: float, trace_memory: bool,
             scratch: Path) -> dict:
    t = TARGETS[name]
    rng = random.Random(f"{seed}:{name}")
    t0 = time.perf_counter()
    _ = getattr(t, "seeds", None)  # build the seeds before the clock counts inputs
    counts: Counter = Counter()
    saved: Counter = Counter()
    case = scratch / name / "case"
    case.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    n = 0
    while n < inputs and time.perf_counter() - start < seconds:
        files = t.make(rng)
        write_case(case, files)
        size = sum(len(v) for v in files.values())
        out = run_one(lambda: t.run(case), size, time_limit, trace_memory)
        counts[out.kind] += 1
        n += 1
        if out.kind in FAILURES:
            # One defect can fail thousands of inputs (each a model file): keep a few of each.
            sig = out.kind + " " + out.detail.split(":")[0] + " " + out.detail.rpartition(" at ")[2]
            saved[sig] += 1
            if saved[sig] <= SAVE_PER_FAILURE:
                d = save_crash(name, files, out)
                print(f"[{name}] {out.kind}: {out.detail}  -> {d}", flush=True)
    elapsed = time.perf_counter() - start
    return {"target": name, "inputs": n, "seconds": round(elapsed, 1), "setup_s": round(start - t0, 1),
            "ok": counts["ok"], "refused": counts["refused"], "escape": counts["escape"], "hang": counts["hang"],
            "alloc": counts["alloc"], "inputs_per_s": round(n / elapsed, 1) if elapsed else 0.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", action="append", choices=sorted(TARGETS), help="default: all")
    ap.add_argument("--inputs", type=int, default=10_000, help="per target")
    ap.add_argument("--seconds", type=float, default=60.0, help="per target")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=10.0, help="per input, seconds")
    ap.add_argument("--no-trace-memory", action="store_true", help="faster, without the allocation check")
    ap.add_argument("--json", dest="json_path", help="also write the figures here")
    a = ap.parse_args(argv)
    scratch = make_scratch()
    cwd = os.getcwd()
    os.chdir(scratch)  # a relative path a target makes lands in the scratch directory
    rows = []
    try:
        for name in a.target or list(TARGETS):
            r = campaign(name, a.inputs, a.seconds, a.seed, a.time_limit, not a.no_trace_memory, scratch)
            rows.append(r)
            print(json.dumps(r), flush=True)
    finally:
        os.chdir(cwd)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{'target':12} {'inputs':>8} {'seconds':>8} {'ok':>7} {'refused':>8} {'escape':>7} {'hang':>5} "
          f"{'alloc':>6} {'in/s':>8}")
    for r in rows:
        print(f"{r['target']:12} {r['inputs']:8} {r['seconds']:8} {r['ok']:7} {r['refused']:8} {r['escape']:7} "
              f"{r['hang']:5} {r['alloc']:6} {r['inputs_per_s']:8}")
    if a.json_path:
        Path(a.json_path).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 1 if any(r["escape"] or r["hang"] or r["alloc"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
