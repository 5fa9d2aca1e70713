"""The commands that check and measure a model on this machine: verify (the determinism matrix),
trace and diff (every op's hashes, and where two runs part), golden (golden hashes) and bench
(speed and memory)."""

from __future__ import annotations

import json
import sys
import time

import click

from ..errors import TinydetError
from ..packing.names import DTYPES
from .common import cli_errors, device_option, loader, model_option, no_memory_check_option, renamed


def _quantized(model) -> bool:
    """Whether a model loaded as native or int8 keeps any matrix quantized (int8 then has bits of its own)."""
    return any(kind not in ("f32", "f16") for kind in model.backend.storage().values())


@click.command()
@model_option
@click.option("--prompt", default="Once upon a time", show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True,
              help="Greedy tokens generated in each cell.")
@renamed("--new-tokens", "--max-tokens", "max_tokens", type=click.IntRange(min=1))
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(DTYPES),
              help="Default: fp32, fp16, native (which must give fp32's hashes), and int8 for a file with "
                   "quantized matrices (on the CPU).")
@click.option("--no-subprocess", is_flag=True, help="Skip the generic-CPU and reduced-NumPy-dispatch runs.")
@click.option("--json", "as_json", is_flag=True)
@click.option("--worker", default=None, hidden=True)
@device_option
@cli_errors
def verify(model_name, prompt, max_tokens, dtypes, no_subprocess, as_json, worker, device):
    """Run the determinism matrix and print a hash per cell; exit 1 on any difference. With a GPU
    --device, the matrix runs there and the CPU backend's run is one more cell that must match."""
    from ..api import load
    from ..registry import DEFAULT_MODEL
    from ..tools.verify import format_table, run_matrix, worker_hash

    name = model_name or DEFAULT_MODEL
    if worker is not None:  # one baseline cell, for the subprocess runs
        model = load(name, dtype=(dtypes or ("fp32",))[0], threads=1)
        click.echo(json.dumps({"hash": worker_hash(model, json.loads(worker), max_tokens)}))
        return
    first = load(name, dtype="fp32", threads=1, device=device)
    ids = first.prompt_ids(prompt)
    show = (lambda s: click.echo(f"\r{s[:70]:<70}", err=True, nl=False)) if sys.stderr.isatty() else None
    # The subprocess cells vary the CPU's compile target: for a GPU, the CPU backend itself is the cell.
    on_cpu = device == "cpu"
    loaded = {"fp32": first}
    if not dtypes:
        dtypes = ("fp32", "fp16", "native")
        loaded["native"] = load(name, dtype="native", threads=1, device=device)
        if _quantized(loaded["native"]):
            dtypes += ("int8",)  # the integer mode's cells too
    cells = run_matrix(lambda d, t: loaded[d] if d in loaded else load(name, dtype=d, threads=t, device=device), name, ids,
                       max_tokens, dtypes, on_cpu and not no_subprocess, show,
                       reference=None if on_cpu else lambda d: load(name, dtype=d, threads=1))
    if show:
        click.echo("", err=True)
    ok = all(c.ok for c in cells)
    if as_json:
        click.echo(json.dumps({"model": str(first.path), "model_sha256": first.sha256, "prompt_token_ids": ids,
                               "new_tokens": max_tokens, "passed": ok, "cells": [vars(c) for c in cells]}))
    else:
        click.echo(f"model {first.path}\nprompt {prompt!r} ({len(ids)} tokens), {max_tokens} greedy tokens\n")
        click.echo(format_table(cells))
        click.echo(f"\n{'PASSED' if ok else 'FAILED'}: {sum(c.ok for c in cells)}/{len(cells)} cells equal the baseline")
    sys.exit(0 if ok else 1)


@click.command()
@model_option
@click.option("--prompt", required=True)
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False))
@click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None)
@click.option("--chunk", type=click.IntRange(min=1), default=None, help="Prefill in chunks of N tokens.")
@click.option("--no-values", is_flag=True, help="Record hashes and statistics only, not the rows.")
@device_option
@no_memory_check_option
@cli_errors
def trace(model_name, prompt, out_path, dtype, threads, chunk, no_values, device):
    """Record every op's output hash and statistics, per layer and position, as JSON lines."""
    from ..tools.trace import run_trace, write_trace

    model = loader()(model_name, dtype, threads, False, device=device)
    ids = model.prompt_ids(prompt)
    tracer = run_trace(model, ids, chunk, keep_values=not no_values)
    write_trace(out_path, model, ids, tracer, {"chunk": chunk, "prompt": prompt})
    click.echo(f"wrote {len(tracer.records)} records to {out_path}")


@click.command()
@click.argument("a", type=click.Path(dir_okay=False))
@click.argument("b", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
@cli_errors
def diff(a, b, as_json):
    """Name the first op, layer and position where two traces part (exit 1 if they do)."""
    from ..tools.trace import diff_traces, format_diff

    d = diff_traces(a, b)
    click.echo(json.dumps(d) if as_json else format_diff(d))
    sys.exit(0 if d["identical"] else 1)


@click.command()
@model_option
@renamed("MODEL", "--model", "model_name")
@click.option("--check", "check_path", type=click.Path(dir_okay=False), default=None,
              help="Run a golden file's cases and compare the hashes (exit 1 on any difference).")
@click.option("--write", "write_path", type=click.Path(dir_okay=False), default=None,
              help="Run the default cases and write their hashes here.")
@click.option("--overwrite", is_flag=True, help="With --write: replace an existing golden file.")
@click.option("--threads", type=click.IntRange(min=1), default=None)
@click.option("--no-native", is_flag=True, help="With --check: skip re-running the fp32 cases with --dtype native.")
@device_option
@cli_errors
def golden(model_name, check_path, write_path, overwrite, threads, no_native, device):
    """Check or (re)generate golden hashes for a model: --write records them in a JSON file, --check
    runs a file's cases again here (another machine, thread count or tinydet version) and compares."""
    from ..tools.golden import (check_golden, default_cases, model_loader, n_checked, read_golden, run_cases,
                                write_golden)
    from ..registry import DEFAULT_MODEL, resolve_model

    if (check_path is None) == (write_path is None):
        raise TinydetError("golden: give exactly one of --check FILE or --write FILE")
    if write_path and device != "cpu":
        raise TinydetError("golden: --write records the CPU backend's hashes, the reference; check a GPU with --check")
    path = resolve_model(model_name or DEFAULT_MODEL)
    get = model_loader(path, threads, device=device)
    sha = get("fp32").sha256
    if check_path:
        data = read_golden(check_path)
        bad = check_golden(get, data, sha, native=not no_native)
        for line in bad:
            click.echo(line)
        n_cases = len(data["cases"])
        runs = f"{n_cases} golden cases" + ("" if no_native else
                                            f" and {n_checked(data) - n_cases} fp32 ones again with --dtype native")
        click.echo(f"FAILED: {len(bad)} hashes differ ({runs})" if bad else f"PASSED: every hash matches ({runs})")
        sys.exit(1 if bad else 0)
    dtypes = ("fp32", "fp16", "int8") if _quantized(get("int8")) else ("fp32", "fp16")
    results = run_cases(get, default_cases(path.name, dtypes))
    write_golden(write_path, path.name, sha, results, overwrite)
    click.echo(f"wrote {len(results)} cases to {write_path}")


@click.command()
@model_option
@renamed("MODEL", "--model", "model_name")
@click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Default: the CPUs available.")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens decoded after the prompt, all of them (an end-of-text token does not stop a bench).")
@renamed("--new-tokens", "--max-tokens", "max_tokens", type=click.IntRange(min=1))
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@device_option
@no_memory_check_option
@cli_errors
def bench(model_name, dtype, threads, prompt_tokens, max_tokens, repeats, as_json, device):
    """Prefill and decode speed, first-token latency and peak memory of a model on this machine."""
    from ..tools.bench import bench as run_bench
    from ..tools.bench import current_rss_bytes, format_report

    rss0 = current_rss_bytes()
    t0 = time.perf_counter()
    model = loader()(model_name, dtype, threads, False, device=device)
    load_s = time.perf_counter() - t0
    r = run_bench(model, prompt_tokens, max_tokens, repeats, load_seconds=load_s, rss_before_load=rss0)
    click.echo(json.dumps(r) if as_json else format_report(r))
