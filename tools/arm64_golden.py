"""Run a golden file's cases one by one and print, for each, the expected and obtained hashes and
PASS/FAIL as soon as it finishes (so a run cut short still says how far it got).

tools/arm64_golden.sh runs this under qemu-aarch64; it runs natively too:

    python tools/arm64_golden.py MODEL GOLDEN.json [--dtype fp32,native] [--threads N]

`--dtype` picks the cases to run (fp32 and fp16 are the file's; native re-runs the fp32 ones, as
`tinydet golden --check` does), so two processes can share the cases. Exit 1 on any difference.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import numba
import numpy as np

import tinydet
from tinydet.hashing import file_sha256
from tinydet.tools.golden import SETTINGS, golden_runs, model_loader, read_golden, run_cases


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("golden")
    ap.add_argument("--dtype", default="fp32,fp16,native", help="comma-separated: fp32, fp16, native")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    t0 = time.perf_counter()
    data = read_golden(a.golden)
    dtypes = a.dtype.split(",")
    wants = [c for c in golden_runs(data) if c.get("dtype") in dtypes]  # check_golden's runs, these dtypes'
    print(f"{platform.machine()} python {platform.python_version()} numpy {np.__version__} numba "
          f"{numba.__version__} tinydet {tinydet.__version__}; {len(wants)} cases ({a.dtype})", flush=True)
    sha = file_sha256(a.model)
    if sha != data["model_sha256"]:
        print(f"FAIL: model file SHA-256 is {sha}, the golden file is for {data['model_sha256']}")
        return 1
    load = model_loader(a.model, a.threads)
    n_bad = 0
    for i, want in enumerate(wants, 1):
        t = time.perf_counter()
        req = {k: want[k] for k in SETTINGS if k in want}
        have = run_cases(load, [req])[0]
        ok = all(want[h] == have[h] for h in ("output_hash", "logits_hash"))
        n_bad += not ok
        print(f"[{i}/{len(wants)}] {'PASS' if ok else 'FAIL'} {req} ({time.perf_counter() - t:.1f} s)", flush=True)
        for h in ("output_hash", "logits_hash"):
            print(f"    {h:11s} expected {want[h][:16]} obtained {have[h][:16]}"
                  f"{'' if want[h] == have[h] else '  DIFFERS'}", flush=True)
    print(f"{'FAILED' if n_bad else 'PASSED'}: {len(wants) - n_bad}/{len(wants)} cases match "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
