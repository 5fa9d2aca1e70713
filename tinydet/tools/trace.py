"""Per-op traces and their diff: make drift visible.

`trace` runs a prompt and records, for every layer, op and position, the SHA-256 of the op's float32
output row and a few statistics (and, unless turned off, the row itself) as JSON lines after a header
naming the machine, versions and settings. `diff` walks two traces in computation order and names
the first op, layer and position where they part, and by how much.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..errors import TinydetError

FORMAT = "tinydet-trace/1"


@dataclass
class Tracer:
    """Collects records: `record` is an op hook (`backends.base.Hook`) that reads every op's rows."""
    keep_values: bool = True
    records: list = field(default_factory=list)

    def record(self, layer, op, pos, slots, rows) -> None:
        rows = np.ascontiguousarray(rows, dtype="<f4")
        for i in range(rows.shape[0]):
            r = rows[i]
            wide = r.astype(np.float64)
            rec = {"layer": layer, "op": op, "slot": int(slots[i]), "pos": int(pos[i]),
                   "sha256": hashlib.sha256(r.tobytes()).hexdigest(),
                   "min": float(wide.min()), "max": float(wide.max()), "mean": float(wide.mean()),
                   "absmax": float(np.abs(wide).max())}
            if self.keep_values:
                rec["values"] = base64.b64encode(r.tobytes()).decode()
            self.records.append(rec)


def machine_info() -> dict:
    import numba

    info = {"platform": platform.platform(), "machine": platform.machine(), "python": sys.version.split()[0],
            "numpy": np.__version__, "numba": numba.__version__, "cpu_name": numba.config.CPU_NAME or "host",
            "cpu_features": numba.config.CPU_FEATURES or "host",
            "npy_disable_cpu_features": os.environ.get("NPY_DISABLE_CPU_FEATURES", "")}
    try:
        import llvmlite.binding as ll

        info["host_cpu"] = ll.get_host_cpu_name()
    except Exception:  # noqa: BLE001 - informational only
        pass
    return info


def run_trace(model, prompt_ids: Sequence[int], chunk: int | None = None, keep_values: bool = True) -> Tracer:
    """Trace the forward pass of `prompt_ids` (in chunks of `chunk` tokens; None = one pass)."""
    backend = model.backend
    tracer = Tracer(keep_values)
    ids = list(prompt_ids)
    cache = backend.new_cache(len(ids))
    step = chunk or len(ids)
    for i in range(0, len(ids), step):
        backend.forward_batch([(0, ids[i:i + step])], cache, all_logits=True, hook=tracer.record)
    return tracer


def write_trace(path, model, prompt_ids, tracer: Tracer, settings: dict) -> None:
    from .. import __version__

    header = {"format": FORMAT, "tinydet_version": __version__, "model": str(model.path),
              "model_sha256": model.sha256, "dtype": model.dtype, "backend": model.backend.name,
              "threads": model.threads,
              "prompt_token_ids": list(prompt_ids), "settings": settings, "machine": machine_info()}
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for r in tracer.records:
            f.write(json.dumps(r) + "\n")


def read_trace(path) -> tuple[dict, list[dict]]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        raise TinydetError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise TinydetError(f"{path}: line {e.lineno}: not JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise TinydetError(f"{path}: not valid UTF-8 ({e.reason})") from None
    except RecursionError:
        raise TinydetError(f"{path}: a line is nested too deeply") from None
    if not lines or not isinstance(lines[0], dict) or lines[0].get("format") != FORMAT:
        raise TinydetError(f"{path}: format: expected a {FORMAT} header line")
    return lines[0], lines[1:]


OPS = ("embedding", "attn_norm", "q", "k", "v", "rope_q", "rope_k", "attention", "attn_output", "attn_residual",
       "ffn_norm", "gate", "up", "activation", "down", "ffn_residual", "final_norm", "logits")
_RANK = {op: i for i, op in enumerate(OPS)}


def _key(r):
    return (r["slot"], r["pos"], r["layer"], r["op"])


def _order(r):
    # Dependency order: earlier layers first, ops in computation order, then positions; so the first
    # record that differs is where two runs begin to part, however each run was chunked.
    layer = -1 if r["op"] == "embedding" else (10**9 if r["layer"] is None else r["layer"])
    return (layer, _RANK.get(r["op"], len(OPS)), r["slot"], r["pos"])


def diff_traces(a_path, b_path) -> dict:
    """Compare two traces. Returns {"identical": bool, "header_differences": {...}, "first": {...} or None,
    "n_compared": int}. Records are compared in computation order; positions that only one side has
    are reported, not compared."""
    ha, ra = read_trace(a_path)
    hb, rb = read_trace(b_path)
    header_diff = {}
    for k in sorted(set(ha) | set(hb)):
        if k in ("format",):
            continue
        if ha.get(k) != hb.get(k):
            if isinstance(ha.get(k), dict) and isinstance(hb.get(k), dict):
                for kk in sorted(set(ha[k]) | set(hb[k])):
                    if ha[k].get(kk) != hb[k].get(kk):
                        header_diff[f"{k}.{kk}"] = (ha[k].get(kk), hb[k].get(kk))
            else:
                header_diff[k] = (ha.get(k), hb.get(k))
    index_b = {_key(r): r for r in rb}
    first = None
    n = 0
    for r in sorted(ra, key=_order):
        other = index_b.get(_key(r))
        if other is None:
            continue
        n += 1
        if r["sha256"] != other["sha256"]:
            first = {"layer": r["layer"], "op": r["op"], "pos": r["pos"], "slot": r["slot"],
                     "a": {k: r[k] for k in ("min", "max", "mean", "absmax")},
                     "b": {k: other[k] for k in ("min", "max", "mean", "absmax")}}
            if "values" in r and "values" in other:
                va = np.frombuffer(base64.b64decode(r["values"]), "<f4").astype(np.float64)
                vb = np.frombuffer(base64.b64decode(other["values"]), "<f4").astype(np.float64)
                if va.shape == vb.shape:
                    d = np.abs(va - vb)
                    first["max_abs_diff"] = float(d.max())
                    first["n_different"] = int((va != vb).sum())
                    first["n_elements"] = int(va.size)
                    first["argmax"] = int(d.argmax())
            break
    return {"identical": first is None and len(ra) == len(rb), "header_differences": header_diff,
            "first": first, "n_compared": n, "n_records": (len(ra), len(rb))}


def format_diff(d: dict) -> str:
    lines = []
    for k, (a, b) in d["header_differences"].items():
        lines.append(f"setting {k}: {a!r} vs {b!r}")
    f = d["first"]
    if f is None:
        if d["n_records"][0] != d["n_records"][1]:
            lines.append(f"the {d['n_compared']} records both traces have are identical, but they hold "
                         f"{d['n_records'][0]} and {d['n_records'][1]} records")
        else:
            lines.append(f"identical: {d['n_compared']} records, every hash equal")
        return "\n".join(lines)
    where = f"layer {f['layer']}" if f["layer"] is not None else "outside the layers"
    msg = f"first difference: op {f['op']}, {where}, position {f['pos']}"
    if "max_abs_diff" in f:
        msg += (f": max |a-b| = {f['max_abs_diff']:.3e} at element {f['argmax']}, "
                f"{f['n_different']} of {f['n_elements']} elements differ")
    lines.append(msg)
    lines.append(f"  a: min {f['a']['min']:.6g} max {f['a']['max']:.6g} mean {f['a']['mean']:.6g} "
                 f"absmax {f['a']['absmax']:.6g}")
    lines.append(f"  b: min {f['b']['min']:.6g} max {f['b']['max']:.6g} mean {f['b']['mean']:.6g} "
                 f"absmax {f['b']['absmax']:.6g}")
    return "\n".join(lines)
