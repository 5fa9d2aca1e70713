"""The `tinydet` command: parses, calls the library, prints. Nothing else lives here."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter

import click
import numpy as np

from . import __version__
from .errors import TinydetError


def _fail(e: Exception) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(1)


def _progress(label: str):
    """A stderr progress line for loading, shown only on a terminal."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int, name: str) -> None:
        end = "\n" if done == total else ""
        click.echo(f"\rloading {label}: {done}/{total} tensors {name[:40]:<40}", err=True, nl=False)
        if end:
            click.echo("", err=True)

    return show


@click.group()
@click.version_option(__version__, prog_name="tinydet")
def main():
    """tinydet: deterministic transformer inference — the same bits every time."""


@main.command()
@click.argument("prompt", default="")
@click.option("--model", "model_path", required=True, help="Path to a GGUF model file.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True)
@click.option("--min-p", type=click.FloatRange(min=0, max=1), default=0.0, show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable).")
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Default: the CPUs available.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def generate(prompt, model_path, max_tokens, temperature, top_k, top_p, min_p, seed, stop, dtype, threads, as_json):
    """Continue PROMPT (empty: start from BOS), streaming the text as it is produced."""
    from .api import load
    from .kernels import cache_is_warm

    try:
        model = load(model_path, dtype=dtype, threads=threads, progress=_progress(model_path))
        if not cache_is_warm():
            click.echo("compiling kernels (first run only; cached afterwards)...", err=True)
        kwargs = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                      min_p=min_p, seed=seed, stop=list(stop))
        if as_json:
            t0 = time.perf_counter()
            g = model.generate(prompt, **kwargs)
            total = time.perf_counter() - t0
            click.echo(json.dumps({
                "text": g.text,
                "token_ids": g.token_ids,
                "prompt_token_ids": g.prompt_token_ids,
                "finish_reason": g.finish_reason,
                "output_hash": g.output_hash,
                "logits_hash": g.logits_hash,
                "settings": g.settings,
                "model": str(model.path),
                "model_sha256": model.sha256,
                "tinydet_version": __version__,
                "prefill_seconds": g.prefill_seconds,
                "decode_seconds": g.decode_seconds,
                "total_seconds": total,
                "tokens_per_second": g.tokens_per_second,
            }, ensure_ascii=False))
        else:
            for piece in model.stream(prompt, **kwargs):
                click.echo(piece, nl=False)
                sys.stdout.flush()
            click.echo("")
    except TinydetError as e:
        _fail(e)
    except KeyboardInterrupt:
        click.echo("\ninterrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:  # e.g. piped into `head`: stop quietly
        sys.stderr.close()
        sys.exit(0)


def _short(v) -> str:
    if isinstance(v, (list, np.ndarray)):
        items = list(v[:8])
        more = f", ... ({len(v)} items)" if len(v) > 8 else ""
        return "[" + ", ".join(repr(x.item() if hasattr(x, "item") else x) for x in items) + more + "]"
    s = repr(v)
    return s if len(s) <= 120 else s[:117] + "..."


@main.command()
@click.argument("model_path")
def info(model_path):
    """Print a model file's metadata, configuration and a tensor summary."""
    from .api import file_sha256
    from .config import config_from_gguf
    from .gguf import GGUFFile

    try:
        g = GGUFFile(model_path)
        click.echo(f"file: {g.path}")
        click.echo(f"sha256: {file_sha256(g.path)}")
        click.echo(f"GGUF version {g.version}, {len(g.metadata)} metadata keys, {len(g.tensors)} tensors, "
                   f"alignment {g.alignment}")
        click.echo("\nmetadata:")
        for k, v in g.metadata.items():
            click.echo(f"  {k} = {_short(v)}")
        click.echo("\ntensors:")
        by_type = Counter()
        params = 0
        nbytes = 0
        for t in g.tensors.values():
            by_type[t.type_name] += 1
            params += t.n_elements
            nbytes += t.nbytes
        click.echo(f"  {params:,} parameters in {nbytes:,} bytes; by type: "
                   + ", ".join(f"{n} {k}" for k, n in sorted(by_type.items())))
        for t in list(g.tensors.values()):
            click.echo(f"  {t.name:<32} {t.type_name:<5} {str(t.shape):<16}")
        click.echo("\nconfig:")
        cfg = config_from_gguf(g)
        for k, v in vars(cfg).items():
            click.echo(f"  {k} = {v}")
    except TinydetError as e:
        _fail(e)


if __name__ == "__main__":
    main()
