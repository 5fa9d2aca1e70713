"""The `tinydet` command: parses, calls the library, prints. Nothing else lives here."""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import sys
import threading
import time
from collections import Counter

import click
import numpy as np

from .. import __version__
# The library, before any command runs (`import tinydet` leaves it for first use): bench's load time
# and memory are the model's alone, as they were.
from .. import api  # noqa: F401
from ..errors import TinydetError


def _progress(label: str):
    """A stderr progress line for loading, shown only on a terminal."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int, name: str) -> None:
        click.echo(f"\rloading {label}: {done}/{total} tensors {name[:40]:<40}", err=True, nl=False)
        if done == total:
            click.echo("", err=True)

    return show


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt so that the same cleanups
    run (temporary files deleted, a download's .part kept to resume); not a KeyboardInterrupt, so
    that the chat's "Ctrl-C stops the reply" does not catch it."""


def _terminate(signum, frame):
    raise Terminated


def cli_errors(fn):
    """Bad input ends in one line on stderr and exit 1; Ctrl-C (exit 130), SIGTERM (exit 143) and a
    closed pipe end with one line at most, never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        on_main = threading.current_thread() is threading.main_thread()  # handlers can only be set there
        previous = signal.signal(signal.SIGTERM, _terminate) if on_main else None
        try:
            return fn(*args, **kwargs)
        except TinydetError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)
        except Terminated:
            click.echo("\nterminated", err=True)
            sys.exit(143)
        except BrokenPipeError:  # e.g. piped into `head`
            sys.stderr.close()
            sys.exit(0)
        finally:
            if previous is not None:  # None: not the main thread, or a handler set outside Python
                signal.signal(signal.SIGTERM, previous)
    return wrapper


_memory_check = True  # --no-memory-check turns it off for this process's loads


def _no_memory_check(ctx, param, value):
    global _memory_check
    _memory_check = not value  # set on every invocation (tests run many in one process)


no_memory_check_option = click.option(
    "--no-memory-check", is_flag=True, expose_value=False, callback=_no_memory_check,
    help="Load even when the estimated memory needed exceeds what is available (TINYDET_NO_MEMORY_CHECK=1).")


def _check_device(ctx, param, value):
    from ..backends import check_device

    try:
        return check_device(value)
    except TinydetError as e:
        raise click.BadParameter(str(e).partition(": ")[2]) from None


device_option = click.option(
    "--device", default="cpu", show_default=True, callback=_check_device, metavar="cpu|cuda[:N]|cuda-host",
    help="Where the forward pass runs: the CPU; an NVIDIA GPU through CuPy (the cuda12 or cuda13 extra), with the "
         "CPU's bits; or cuda-host, the GPU's kernels emulated on the CPU (slow: for checking them without a GPU).")


def model_options(fn):
    for opt in reversed([
        device_option,
        no_memory_check_option,
        click.option("--model", "model_name", default=None,
                     help="A GGUF file, a Hugging Face directory or a known model name (`tinydet models`). "
                          "Default: smollm2-135m-instruct, pulled on first use."),
        click.option("--dtype", type=click.Choice(["fp32", "fp16", "native"]), default="fp32", show_default=True,
                     help="fp32; fp16 (weights and KV cache as binary16); native (matrices kept as the file stores "
                          "them, Q8_0/Q4_0/Q4_1 dequantized in the kernels: the bits of fp32)."),
        click.option("--threads", type=click.IntRange(min=1), default=None, help="Default: the CPUs available."),
        click.option("--verify", is_flag=True, help="Re-hash a known model's file before use."),
        click.option("--log", "log_path", type=click.Path(dir_okay=False), default=None,
                     help="Append one JSON line per request to this file."),
    ]):
        fn = opt(fn)
    return fn


def sampling_options(fn):
    for opt in reversed([
        click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True),
        click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off."),
        click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True),
        click.option("--min-p", type=click.FloatRange(min=0, max=1), default=0.0, show_default=True),
        click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True),
        click.option("--stop", multiple=True, help="Stop when this text appears (repeatable)."),
    ]):
        fn = opt(fn)
    return fn


COMPILE_NOTICE = ("compiling kernels for this machine (once per tinydet version, dtype and weight type; cached "
                  "afterwards): a minute or two...")
_compile_notice = False  # the notice's listener is registered once per process


def _load(model_name, dtype, threads, verify, log_path=None, device="cpu"):
    from ..api import load
    from ..backends.cpu import on_first_compile

    global _compile_notice
    if not _compile_notice:
        _compile_notice = True
        on_first_compile(lambda: click.echo(COMPILE_NOTICE, err=True))
    return load(model_name, dtype=dtype, threads=threads, progress=_progress(model_name or "default model"),
                verify=verify, log=log_path, check_memory=None if _memory_check else False, device=device)


def _stream(pieces) -> None:
    for piece in pieces:
        click.echo(piece, nl=False)
        sys.stdout.flush()
    click.echo("")


@click.group()
@click.version_option(__version__, prog_name="tinydet")
def main():
    """tinydet: deterministic transformer inference — the same bits every time."""


@main.command()
@click.argument("prompt", default="")
@model_options
@sampling_options
@click.option("--chat", "as_chat", is_flag=True, help="Send PROMPT as a user message through the chat template.")
@click.option("--system", default=None, help="With --chat: a system message.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@cli_errors
def generate(prompt, model_name, device, dtype, threads, verify, log_path, max_tokens, temperature, top_k, top_p, min_p,
             seed, stop, as_chat, system, as_json):
    """Continue PROMPT (empty: start from BOS), streaming the text as it is produced."""
    model = _load(model_name, dtype, threads, verify, log_path, device)
    if as_chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = model.chat_prompt(messages)
    else:
        ids = model.prompt_ids(prompt)
    kwargs = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                  min_p=min_p, seed=seed, stop=list(stop))
    if not as_json:
        _stream(model.stream(ids, **kwargs))
        return
    t0 = time.perf_counter()
    g = model.generate(ids, **kwargs)
    total = time.perf_counter() - t0
    click.echo(json.dumps({
        "text": g.text,
        "token_ids": g.token_ids,
        "prompt_token_ids": g.prompt_token_ids,
        "finish_reason": g.finish_reason,
        "output_hash": g.output_hash,
        "logits_hash": g.logits_hash,
        "settings": dict(g.settings, chat=as_chat),
        "model": str(model.path),
        "model_sha256": model.sha256,
        "tinydet_version": __version__,
        "prefill_seconds": g.prefill_seconds,
        "decode_seconds": g.decode_seconds,
        "total_seconds": total,
        "tokens_per_second": g.tokens_per_second,
    }, ensure_ascii=False))


@contextlib.contextmanager
def _ctrl_c_flag():
    """While a chat reply is written, Ctrl-C sets the Event yielded instead of raising KeyboardInterrupt
    wherever the engine happens to be. Raised inside its queue's lock (Queue.put), the interrupt left
    that lock held and the engine's cleanup waited for it forever (2 hangs in some 200 tries); raised
    between taking a piece and printing it, it put in the history text never shown (1 in 10). The
    reply now stops after the piece being written. A second Ctrl-C raises at once: a long prefill
    yields no piece to stop after."""
    flag = threading.Event()
    on_main = threading.current_thread() is threading.main_thread()  # handlers can only be set there
    if not on_main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:  # e.g. ignored
        yield flag
        return

    def on_ctrl_c(signum, frame):
        if flag.is_set():
            raise KeyboardInterrupt
        flag.set()

    signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@main.command()
@model_options
@sampling_options
@click.option("--system", default=None, help="A system message to start the conversation with.")
@cli_errors
def chat(model_name, device, dtype, threads, verify, log_path, max_tokens, temperature, top_k, top_p, min_p, seed, stop,
         system):
    """Talk with a model through its chat template. History is kept. Ctrl-C while a reply is being
    written stops it and returns to the prompt (the reply stays in the history as far as it got); an
    empty line, /exit or Ctrl-D at the prompt ends (Ctrl-C there too, with exit status 130)."""
    model = _load(model_name, dtype, threads, verify, log_path, device)
    messages = [{"role": "system", "content": system}] if system else []
    kwargs = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                  min_p=min_p, seed=seed, stop=list(stop))
    while True:
        try:
            line = input("> ")
        except EOFError:  # Ctrl-D; Ctrl-C here ends the chat as it ends any command (exit 130)
            click.echo("")
            return
        if not line.strip() or line.strip() in ("/exit", "/quit"):
            return
        messages.append({"role": "user", "content": line})
        parts, stopped = [], False
        with _ctrl_c_flag() as ctrl_c:  # Ctrl-C stops this reply only, as llama.cpp's and ollama's chats do
            pieces = model.stream(model.chat_prompt(messages), **kwargs)
            try:
                for piece in pieces:
                    parts.append(piece)
                    click.echo(piece, nl=False)
                    sys.stdout.flush()
                    if ctrl_c.is_set():
                        stopped = True
                        break
            except KeyboardInterrupt:  # a second Ctrl-C
                stopped = True
            finally:
                pieces.close()
        if stopped:
            click.echo(" [stopped]", nl=False)
        click.echo("")
        messages.append({"role": "assistant", "content": "".join(parts)})


def _short(v) -> str:
    if isinstance(v, (list, np.ndarray)):
        items = list(v[:8])
        more = f", ... ({len(v)} items)" if len(v) > 8 else ""
        return "[" + ", ".join(repr(x.item() if hasattr(x, "item") else x) for x in items) + more + "]"
    s = repr(v)
    return s if len(s) <= 120 else s[:117] + "..."


@main.command()
@click.argument("model_name")
@click.option("--verify", is_flag=True, help="Check the file against the known models' SHA-256.")
@cli_errors
def info(model_name, verify):
    """Print a model's SHA-256, metadata, configuration and a tensor summary."""
    from ..formats import open_checkpoint
    from ..hashing import file_sha256
    from ..registry import resolve_model, verify_file

    path = resolve_model(model_name, verify=verify)
    ck = open_checkpoint(path)
    click.echo(f"{'directory' if ck.format == 'huggingface' else 'file'}: {ck.path}")
    if verify and path.is_file():
        digest, known, ok = verify_file(path)
        status = "not a known model" if known is None else (f"matches {known}" if ok else f"DOES NOT match {known}")
        click.echo(f"sha256: {digest} ({status})")
        if ok is False:
            raise TinydetError(f"{path}: sha256: does not match the manifest of {known}")
    else:
        click.echo(f"sha256: {file_sha256(ck.path)}")
    click.echo(f"format {ck.format}, architecture {ck.arch.name}, {len(ck.stored)} tensors; tokenizer: "
               f"{ck.tokenizer.vocab_size} tokens")
    click.echo("\nmetadata:")
    meta = ck.metadata.get("config", {}) if ck.format == "huggingface" else ck.metadata
    for k, v in meta.items():
        click.echo(f"  {k} = {_short(v)}")
    click.echo("\ntensors:")
    by_type = Counter(t for _, t, _ in ck.stored)
    params = sum(int(np.prod(shape, dtype=np.int64)) for _, _, shape in ck.stored)
    click.echo(f"  {params:,} parameters; by type: " + ", ".join(f"{n} {k}" for k, n in sorted(by_type.items())))
    for name, kind, shape in ck.stored:
        click.echo(f"  {name:<32} {kind:<5} {str(shape):<16}")
    click.echo("\nconfig:")
    for k, v in vars(ck.config).items():
        click.echo(f"  {k} = {v}")


@main.command()
@click.option("--model", "model_name", default=None, help="Model (default: smollm2-135m-instruct).")
@click.option("--prompt", default="Once upon a time", show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(["fp32", "fp16", "native"]),
              help="Default: all three (native must give fp32's hashes).")
@click.option("--no-subprocess", is_flag=True, help="Skip the generic-CPU and reduced-NumPy-dispatch runs.")
@click.option("--json", "as_json", is_flag=True)
@click.option("--worker", default=None, hidden=True)
@device_option
@cli_errors
def verify(model_name, prompt, new_tokens, dtypes, no_subprocess, as_json, worker, device):
    """Run the determinism matrix and print a hash per cell; exit 1 on any difference. With a GPU
    --device, the matrix runs there and the CPU backend's run is one more cell that must match."""
    from ..api import load
    from ..registry import DEFAULT_MODEL
    from ..tools.verify import format_table, run_matrix, worker_hash

    name = model_name or DEFAULT_MODEL
    if worker is not None:  # one baseline cell, for the subprocess runs
        model = load(name, dtype=(dtypes or ("fp32",))[0], threads=1)
        click.echo(json.dumps({"hash": worker_hash(model, json.loads(worker), new_tokens)}))
        return
    first = load(name, dtype="fp32", threads=1, device=device)
    ids = first.prompt_ids(prompt)
    show = (lambda s: click.echo(f"\r{s[:70]:<70}", err=True, nl=False)) if sys.stderr.isatty() else None
    # The subprocess cells vary the CPU's compile target: for a GPU, the CPU backend itself is the cell.
    on_cpu = device == "cpu"
    cells = run_matrix(lambda d, t: first if d == "fp32" else load(name, dtype=d, threads=t, device=device), name, ids,
                       new_tokens, dtypes or ("fp32", "fp16", "native"), on_cpu and not no_subprocess, show,
                       reference=None if on_cpu else lambda d: load(name, dtype=d, threads=1))
    if show:
        click.echo("", err=True)
    ok = all(c.ok for c in cells)
    if as_json:
        click.echo(json.dumps({"model": str(first.path), "model_sha256": first.sha256, "prompt_token_ids": ids,
                               "new_tokens": new_tokens, "passed": ok, "cells": [vars(c) for c in cells]}))
    else:
        click.echo(f"model {first.path}\nprompt {prompt!r} ({len(ids)} tokens), {new_tokens} greedy tokens\n")
        click.echo(format_table(cells))
        click.echo(f"\n{'PASSED' if ok else 'FAILED'}: {sum(c.ok for c in cells)}/{len(cells)} cells equal the baseline")
    sys.exit(0 if ok else 1)


@main.command()
@click.option("--model", "model_name", default=None, help="Model (default: smollm2-135m-instruct).")
@click.option("--prompt", required=True)
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False))
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "native"]), default="fp32", show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None)
@click.option("--chunk", type=click.IntRange(min=1), default=None, help="Prefill in chunks of N tokens.")
@click.option("--no-values", is_flag=True, help="Record hashes and statistics only, not the rows.")
@device_option
@no_memory_check_option
@cli_errors
def trace(model_name, prompt, out_path, dtype, threads, chunk, no_values, device):
    """Record every op's output hash and statistics, per layer and position, as JSON lines."""
    from ..tools.trace import run_trace, write_trace

    model = _load(model_name, dtype, threads, False, device=device)
    ids = model.prompt_ids(prompt)
    tracer = run_trace(model, ids, chunk, keep_values=not no_values)
    write_trace(out_path, model, ids, tracer, {"chunk": chunk, "prompt": prompt})
    click.echo(f"wrote {len(tracer.records)} records to {out_path}")


@main.command()
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


@main.command()
@click.argument("model_name")
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
    """Check or (re)generate golden hashes for a model."""
    from ..tools.golden import check_golden, default_cases, model_loader, n_checked, read_golden, run_cases, write_golden
    from ..registry import resolve_model

    if (check_path is None) == (write_path is None):
        raise TinydetError("golden: give exactly one of --check FILE or --write FILE")
    if write_path and device != "cpu":
        raise TinydetError("golden: --write records the CPU backend's hashes, the reference; check a GPU with --check")
    path = resolve_model(model_name)
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
    results = run_cases(get, default_cases(path.name))
    write_golden(write_path, path.name, sha, results, overwrite)
    click.echo(f"wrote {len(results)} cases to {write_path}")


@main.command()
@click.argument("model_name", required=False)
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "native"]), default="fp32", show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Default: the CPUs available.")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@device_option
@no_memory_check_option
@cli_errors
def bench(model_name, dtype, threads, prompt_tokens, new_tokens, repeats, as_json, device):
    """Prefill and decode speed, first-token latency and peak memory of MODEL on this machine
    (default: the default model)."""
    from ..tools.bench import bench as run_bench
    from ..tools.bench import current_rss_bytes, format_report

    rss0 = current_rss_bytes()
    t0 = time.perf_counter()
    model = _load(model_name, dtype, threads, False, device=device)
    load_s = time.perf_counter() - t0
    r = run_bench(model, prompt_tokens, new_tokens, repeats, load_seconds=load_s, rss_before_load=rss0)
    click.echo(json.dumps(r) if as_json else format_report(r))


def _cluster_module():
    try:
        from ..serve import cluster
    except ImportError as e:
        raise TinydetError(f"--ray needs the ray extra ({e.name} is missing): pip install 'tinydet[ray]'") from None
    return cluster


def _replica_spec(cluster, model_name, dtype, threads, max_batch, max_queue, prefill_chunk, prefix_cache_mb, api_key,
                  log_path, served_model_name, canary_file, canary_interval, verify) -> dict:
    """What each replica runs: the model resolved here (pulled and verified once) and pinned by its
    SHA-256, which every replica checks before its gate."""
    from pathlib import Path

    from ..hashing import file_sha256
    from ..registry import DEFAULT_MODEL, known_models, resolve_model

    name = model_name or DEFAULT_MODEL
    path = resolve_model(name, verify=verify).resolve()
    served = served_model_name or (name if name in known_models() else Path(name).name)
    return cluster.spec(str(path), dtype, threads or 1, served, max_batch, max_queue, prefill_chunk,
                        prefix_cache_mb << 20, api_key, log_path and str(Path(log_path).resolve()),
                        canary_file and str(Path(canary_file).resolve()), 60 * canary_interval,
                        sha256=file_sha256(path), check_memory=None if _memory_check else False)


def replica_options(fn):
    """The options of a served model, shared by `serve` and `rollout`."""
    options = [
        click.option("--model", "model_name", default=None, help="A GGUF file, a Hugging Face directory or a known "
                     "model name. Default: smollm2-135m-instruct."),
        click.option("--dtype", type=click.Choice(["fp32", "fp16", "native"]), default="fp32", show_default=True),
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="Default: the CPUs available; on Ray (--ray, rollout), 1 per replica."),
        click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
                     help="Sequences computed together (KV-cache slots)."),
        click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
                     help="Requests waiting for a slot before new ones get 429."),
        click.option("--prefill-chunk", type=click.IntRange(min=1), default=512, show_default=True,
                     help="Tokens per step (prompt chunks plus one per running sequence), so a long prompt does "
                          "not stall running streams."),
        click.option("--prefix-cache", "prefix_cache_mb", type=click.IntRange(min=0), default=256, show_default=True,
                     help="MiB of keys and values kept for prompt prefixes seen before (0 = off)."),
        click.option("--api-key", envvar="TINYDET_API_KEY", default=None,
                     help="Require `Authorization: Bearer KEY` on /v1 (or set TINYDET_API_KEY)."),
        click.option("--log", "log_path", type=click.Path(dir_okay=False), default=None,
                     help="Append one JSON line per request (answered or refused) to this file."),
        click.option("--served-model-name", default=None, help="The model's name in the API. Default: the known "
                     "model's name, or the file or directory name (rollout: the name in use)."),
        click.option("--canary", "canary_file", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="A golden file (`tinydet golden --write`) whose cases for this dtype are the determinism "
                          "canary. Default: the model manifest's golden case."),
        click.option("--canary-interval", type=click.FloatRange(min=0), default=10.0, show_default=True,
                     help="Minutes between canary runs after the one at start (0 = only at start)."),
        click.option("--verify", is_flag=True, help="Re-hash a known model's file before use."),
        no_memory_check_option,
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@main.command()
@replica_options
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0 = any free port.")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds running requests get to finish after SIGTERM.")
@click.option("--ray", "on_ray", is_flag=True, help="Serve replicas on Ray Serve (the ray extra), each gated by the "
              "model's golden hashes before it takes traffic.")
@click.option("--replicas", type=click.IntRange(min=1), default=None,
              help="With --ray: replicas of the model (each with --threads threads, default 1). Default: 2.")
@click.option("--ray-address", default=None, help="With --ray: the Ray cluster to join (e.g. auto, or "
              "ray://host:10001). Default: start a local one, stopped on exit.")
@device_option
@cli_errors
def serve(model_name, host, port, dtype, threads, max_batch, max_queue, prefill_chunk, prefix_cache_mb, api_key,
          log_path, served_model_name, canary_file, canary_interval, shutdown_timeout, verify, on_ray, replicas,
          ray_address, device):
    """Serve a model over OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics). Same system_fingerprint + same request + same seed = the same bytes, under any load."""
    import logging
    from pathlib import Path

    if on_ray and device != "cpu":
        raise TinydetError("--device: Ray replicas run on the CPU (--device cpu); serve a GPU without --ray")
    if on_ray:
        cluster = _cluster_module()
        spec = _replica_spec(cluster, model_name, dtype, threads, max_batch, max_queue, prefill_chunk, prefix_cache_mb,
                             api_key, log_path, served_model_name, canary_file, canary_interval, verify)
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        cluster.run(spec, replicas or 2, host, port, ray_address, shutdown_timeout,
                    echo=lambda m: click.echo(m, err=True))
        return
    if replicas is not None or ray_address is not None:
        raise TinydetError("--replicas and --ray-address go with --ray")

    try:
        from .. import serve as serving
        from ..serve.service import Service
    except ImportError as e:
        raise TinydetError(f"tinydet serve needs the serve extra ({e.name} is missing): "
                           "pip install 'tinydet[serve]'") from None
    from ..registry import DEFAULT_MODEL, known_models

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    name = model_name or DEFAULT_MODEL
    if served_model_name is None:
        served_model_name = name if name in known_models() else Path(name).name
    service = Service(lambda: _load(model_name, dtype, threads, verify, device=device), served_model_name, max_batch, max_queue,
                      prefill_chunk, prefix_cache_mb << 20, api_key, log_path, canary_file, 60 * canary_interval)
    serving.run(service, host, port, shutdown_timeout,
                on_bound=lambda p: click.echo(f"tinydet serve: {served_model_name} on http://{host}:{p} "
                                              "(loading; /health says when ready)", err=True))


@main.command()
@replica_options
@click.option("--replicas", type=click.IntRange(min=1), default=2, show_default=True,
              help="Replicas of the new version (each with --threads threads, default 1).")
@click.option("--ray-address", default="auto", show_default=True, help="The Ray cluster that runs `tinydet serve --ray`.")
@click.option("--probe", "probe_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help='Probe requests, JSON Lines of {"path": "/v1/completions", "body": {...}}. Default: three built in.')
@click.option("--steps", default="0.1,0.5,1", show_default=True,
              help="The new version's share of traffic at each step, increasing, the last 1.")
@click.option("--step-seconds", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="How long the new replicas must stay healthy at each step.")
@click.option("--record", "record_path", type=click.Path(dir_okay=False), default=None,
              help="Write the outcome (plan, fingerprint, the new baseline's probe hashes) to this JSON file.")
@click.option("--runtime-env", "runtime_env_json", default=None,
              help='Ray\'s runtime_env for the new replicas, as JSON: e.g. {"pip": ["tinydet==0.2.0"]} for another '
                   "tinydet version.")
@click.option("--dry-run", is_flag=True, help="Print the plan and change nothing.")
@cli_errors
def rollout(model_name, dtype, threads, max_batch, max_queue, prefill_chunk, prefix_cache_mb, api_key, log_path,
            served_model_name, canary_file, canary_interval, verify, replicas, ray_address, probe_file, steps,
            step_seconds, record_path, runtime_env_json, dry_run):
    """Roll a `tinydet serve --ray` deployment over to a new model or tinydet version: new replicas
    beside the old ones, each through its golden gate; probes compared with the old replicas' answers
    (byte-identical under the same fingerprint, else recorded as the new baseline); traffic shifted in
    steps; the old retired. Any failure rolls back (exit 1)."""
    import logging

    cluster = _cluster_module()
    from ..serve import rollout as ro

    try:
        shares = [float(x) for x in steps.split(",")]
    except ValueError:
        shares = []
    if not shares or shares[-1] != 1.0 or any(a >= b for a, b in zip([0.0, *shares], shares)):
        raise TinydetError(f"--steps {steps}: expected increasing shares in (0, 1], the last 1 (e.g. 0.1,0.5,1)")
    probes = ro.read_probes(probe_file) if probe_file else ro.DEFAULT_PROBES
    runtime_env = None
    if runtime_env_json:
        try:
            runtime_env = json.loads(runtime_env_json)
        except ValueError as e:
            raise TinydetError(f"--runtime-env: not JSON ({e})") from None
        if not isinstance(runtime_env, dict):
            raise TinydetError("--runtime-env: expected a JSON object")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cluster.connect(ray_address)
    try:
        table = cluster.current_table() if cluster.running() else None
        if not table or not table["backends"]:
            raise TinydetError(f"no tinydet deployment runs on the Ray cluster at {ray_address} "
                               "(start one with `tinydet serve --ray`)")
        if served_model_name is None:
            served_model_name = cluster.backend_info(table["backends"][0]["app"])["name"]
        spec = _replica_spec(cluster, model_name, dtype, threads, max_batch, max_queue, prefill_chunk, prefix_cache_mb,
                             api_key, log_path, served_model_name, canary_file, canary_interval, verify)
        try:
            out = ro.rollout(spec, replicas, probes, shares, step_seconds, dry_run, runtime_env, echo=click.echo)
        except ro.RolloutFailed as e:
            raise TinydetError(f"rollout failed and was rolled back: {e}") from None
        if record_path:
            from ..formats.jsonfile import write_json

            write_json(record_path, out)
        click.echo("dry run: nothing changed" if dry_run else f"rolled out: {out['fingerprint']}")
    finally:
        import ray

        ray.shutdown()


@main.command()
@click.argument("source")
@click.argument("out_dir")
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace OUT_DIR if it exists.")
@cli_errors
def convert(source, out_dir, dtype, overwrite):
    """Write a GGUF model (a path or a known name) as a Hugging Face directory (safetensors)."""
    from ..tools.convert import convert_gguf_to_hf
    from ..registry import resolve_model

    out = convert_gguf_to_hf(resolve_model(source), out_dir, dtype=dtype, overwrite=overwrite,
                             progress=_progress(source))
    click.echo(f"wrote {out}")


@main.command()
@click.argument("name")
@click.option("--verify", is_flag=True, help="Re-hash the file even if it is already cached.")
@cli_errors
def pull(name, verify):
    """Download a known model into the cache and verify its SHA-256."""
    from ..registry import pull as pull_model

    click.echo(str(pull_model(name, progress=True, verify=verify)))


@main.command()
@cli_errors
def models():
    """List the known models and which are cached."""
    from ..registry import list_models

    known = list_models()
    lw = max((len(m["license"]) for m in known), default=0)
    for m in known:
        where = m["cached"] or "not cached (tinydet pull " + m["name"] + ")"
        click.echo(f"{m['name']:<24} {m['size'] / 1e6:8.1f} MB  {m['license']:<{lw}}  {m['description']}")
        click.echo(f"{'':<24} {where}")
