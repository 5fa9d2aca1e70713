"""Where a test run's time goes to numba. Imported with `$TINYDET_COMPILE_LOG` set to a folder, this
module writes, per process, a line for every kernel compiled (not loaded from the cache) with the test
that caused it; `python tests/compilelog.py FOLDER` sums them per test file, per test and per kernel.
To see the subprocesses' compiles too (the other numba targets), import it from a `sitecustomize.py`
on PYTHONPATH (`import sys; sys.path.insert(0, "tests"); import compilelog`): each process inherits
PYTEST_CURRENT_TEST, so a subprocess's compiles count under the test that started it.

numba fires `numba:compile` only on a cache miss, around the compile itself; a kernel compiled inside
another's compile is counted in the outer one only (its own line says `nested`)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

LOG = os.environ.get("TINYDET_COMPILE_LOG")


def _install(folder: str) -> None:
    # numba sizes its thread pool at import: leave the room tinydet leaves (tinydet/__init__.py), or a
    # subprocess that imports this first could not run 3 or 4 threads
    os.environ.setdefault("NUMBA_NUM_THREADS", str(max(os.cpu_count() or 1, 4)))
    from numba.core import event

    out = open(Path(folder) / f"{os.getpid()}.jsonl", "a", buffering=1, encoding="utf-8")
    depth = [0]
    started: list[float] = []

    class Listener(event.Listener):
        def on_start(self, ev):
            depth[0] += 1
            started.append(time.thread_time())

        def on_end(self, ev):
            depth[0] -= 1
            s = time.thread_time() - started.pop()  # CPU time of the compiling thread: the same on a busy machine
            d = ev.data or {}
            disp = d.get("dispatcher")
            name = getattr(getattr(disp, "py_func", None), "__qualname__", "?")
            mod = getattr(getattr(disp, "py_func", None), "__module__", "?")
            args = d.get("args") or ()
            sig = ",".join(str(a) for a in args)
            out.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" (")[0],
                                  "kernel": f"{mod}.{name}", "s": round(s, 3), "nested": depth[0] > 0,
                                  "target": os.environ.get("NUMBA_CPU_NAME", "host"), "sig": sig[:2000]}) + "\n")

    event.register("numba:compile", Listener())


if LOG:
    Path(LOG).mkdir(parents=True, exist_ok=True)
    _install(LOG)


def main(folder: str) -> None:
    rows = [json.loads(line) for p in Path(folder).glob("*.jsonl") for line in p.open(encoding="utf-8")]
    top = [r for r in rows if not r["nested"]]
    by_file, by_test, by_kernel = defaultdict(float), defaultdict(float), defaultdict(lambda: [0.0, 0])
    for r in top:
        by_file[r["test"].split("::")[0]] += r["s"]
        by_test[r["test"]] += r["s"]
        k = by_kernel[(r["kernel"], r["target"])]
        k[0] += r["s"]
        k[1] += 1
    print(f"compiles: {len(top)} top-level, {sum(r['s'] for r in top):.0f} s")
    print("\nper file:")
    for f, s in sorted(by_file.items(), key=lambda kv: -kv[1])[:40]:
        print(f"  {s:8.1f} s  {f}")
    print("\nper test:")
    for t, s in sorted(by_test.items(), key=lambda kv: -kv[1])[:60]:
        print(f"  {s:8.1f} s  {t}")
    seen = defaultdict(list)
    for r in rows:  # nested ones too: a kernel compiled twice is twice the work wherever it sits
        seen[(r["kernel"], r["target"], r["sig"])].append(r["s"])
    twice = {k: v for k, v in seen.items() if len(v) > 1}
    print(f"\ncompiled more than once (in several processes, or again after a cache miss): {len(twice)} "
          f"specializations, {sum(sum(v) - max(v) for v in twice.values()):.0f} s beyond the first")
    for (k, tgt, _), v in sorted(twice.items(), key=lambda kv: -(sum(kv[1]) - max(kv[1])))[:15]:
        print(f"  {sum(v) - max(v):8.1f} s  {len(v)}x  {k}  [{tgt}]")
    print("\nper kernel and target:")
    for (k, tgt), (s, n) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:40]:
        print(f"  {s:8.1f} s  {n:4d}x  {k}  [{tgt}]")


if __name__ == "__main__":
    main(sys.argv[1])
