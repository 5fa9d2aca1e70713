"""The `tinydet` command: parses, calls the library, prints. Nothing else lives here. This is the
group, `main`; the commands are in modules by family (generation, models, checks, serving), and
what they share in common. Submodules never import this package: `main` hands them _load."""

from __future__ import annotations

import click

from .. import __version__
# The library, before any command runs (`import tinydet` leaves it for first use): bench's load time
# and memory are the model's alone, as they were.
from .. import api  # noqa: F401
from .checks import bench, diff, golden, trace, verify
from .common import LOADER, _load
from .generation import chat, generate
from .models import convert, info, models, pull
from .serving import rollout, serve


@click.group()
@click.version_option(__version__, prog_name="tinydet")
@click.pass_context
def main(ctx):
    """tinydet: deterministic transformer inference — the same bits every time.

    The commands that run a model take it as --model/-m (a GGUF file, a Hugging Face directory or a
    known name; default smollm2-135m-instruct); pull, info and convert take theirs as an argument."""
    ctx.meta[LOADER] = _load  # read here at each run, so that a patch of tinydet.cli._load reaches the commands


for _command in (generate, chat, info, verify, trace, diff, golden, bench, serve, rollout, convert, pull, models):
    main.add_command(_command)
