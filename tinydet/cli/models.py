"""The commands about model files: pull and models (the known models and the cache), info (what a
file holds) and convert (GGUF to a Hugging Face directory)."""

from __future__ import annotations

from collections import Counter

import click
import numpy as np

from ..errors import TinydetError
from .common import _progress, check_sha256_option, cli_errors


def _short(v) -> str:
    if isinstance(v, (list, np.ndarray)):
        items = list(v[:8])
        more = f", ... ({len(v)} items)" if len(v) > 8 else ""
        return "[" + ", ".join(repr(x.item() if hasattr(x, "item") else x) for x in items) + more + "]"
    s = repr(v)
    return s if len(s) <= 120 else s[:117] + "..."


@click.command()
@click.argument("model_name")
@check_sha256_option("Check the file against the known models' SHA-256.")
@cli_errors
def info(model_name, check_sha256):
    """Print a model's SHA-256, metadata, configuration and a tensor summary."""
    from ..formats import open_checkpoint
    from ..hashing import file_sha256
    from ..registry import resolve_model, verify_file

    path = resolve_model(model_name, verify=check_sha256)
    ck = open_checkpoint(path)
    click.echo(f"{'directory' if ck.format == 'huggingface' else 'file'}: {ck.path}")
    if check_sha256 and path.is_file():
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


@click.command()
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


@click.command()
@click.argument("name")
@check_sha256_option("Re-hash the file even if it is already cached.")
@cli_errors
def pull(name, check_sha256):
    """Download a known model into the cache and verify its SHA-256."""
    from ..registry import pull as pull_model

    click.echo(str(pull_model(name, progress=True, verify=check_sha256)))


@click.command()
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
