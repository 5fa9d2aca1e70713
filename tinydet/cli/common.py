"""What every command shares: the error and signal handling (cli_errors), the options common to
several commands (model_option, model_options, sampling_options, device_option, no_memory_check_option,
no_panel_cache_option, check_sha256_option), old spellings kept as hidden aliases (renamed), C escapes
in text options (unescape) and loading a model with a progress line (_load, which the commands reach
through loader())."""

from __future__ import annotations

import functools
import re
import signal
import sys
import threading
import time

import click
from click.core import ParameterSource

# The dtypes and native's types by name, from their numba-free home: the command line names them
# without importing the packers or the kernels.
from ..packing.names import DTYPES, NATIVE_TYPES
from ..errors import TinydetError

_ESCAPE = re.compile(r"""\\(?:([ntr\\"'])|x([0-9A-Fa-f]{2})|u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8}))""")
_ESCAPED = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'"}
ESCAPES = r"\n, \t, \r, \\, \", \', \xNN, \uNNNN, \UNNNNNNNN"


def _escaped(m: re.Match) -> str:
    char, *code = m.groups()
    if char:
        return _ESCAPED[char]
    n = int(next(c for c in code if c), 16)
    return m.group(0) if n > 0x10FFFF or 0xD800 <= n < 0xE000 else chr(n)  # not a character: kept as typed


def unescape(text: str) -> str:
    """Command-line text with its C escapes read, as llama.cpp's -e reads them (ESCAPES; \\xNN and
    \\uNNNN are the character of that code point); any other backslash stays as typed."""
    return _ESCAPE.sub(_escaped, text)


def _unescape_all(ctx, param, value):
    return tuple(unescape(v) for v in value)


escape_option = click.option(
    "-e", "--escape", is_flag=True,
    help=f"Read C escapes ({ESCAPES}) in the prompt and --system, as llama.cpp's -e does. Without it they are "
         "taken as typed. --stop always reads them.")


class _UnlistedArgument(click.Argument):
    """A positional argument left out of the usage line: an old spelling, kept working (`renamed`)."""

    def get_usage_pieces(self, ctx):
        return []


def renamed(old: str, new: str, param: str, **attrs):
    """Keep `old`, the spelling before `new` (an option such as "--new-tokens", or "MODEL" for a positional
    argument), working but out of the help: its value goes to the command's parameter `param`, after a
    one-line note on stderr. Giving both is a usage error."""
    dest = "renamed_" + param

    def decorate(fn):
        @functools.wraps(fn)
        def command(*args, **kwargs):
            ctx = click.get_current_context()
            value = kwargs.pop(dest)
            if ctx.get_parameter_source(dest) is ParameterSource.COMMANDLINE:
                if ctx.get_parameter_source(param) is ParameterSource.COMMANDLINE:
                    raise click.UsageError(f"{new} and {old} (its old spelling) both given: give {new} once")
                click.echo(f"note: {old} is deprecated; use {new}", err=True)
                kwargs[param] = value
            return fn(*args, **kwargs)

        if old.startswith("-"):
            return click.option(old, dest, hidden=True, **attrs)(command)
        return click.argument(dest, cls=_UnlistedArgument, required=False, **attrs)(command)
    return decorate


def _progress(label: str, delay: float = 1.0):
    """A stderr progress line for loading (the tensors found, then the matrices packed), shown only
    on a terminal and only once the load has taken `delay` seconds: a fast load prints nothing."""
    if not sys.stderr.isatty():
        return None
    start = time.monotonic()

    def show(done: int, total: int, name: str) -> None:
        if time.monotonic() - start < delay:
            return
        click.echo(f"\rloading {label}: {done}/{total} {name[:40]:<40}", err=True, nl=False)
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
    closed pipe end with one line at most, never a traceback. While the command runs, both signals
    raise in the main thread, so that its cleanups run (a temporary directory deleted, a download's
    .part kept); before and after, __main__.py's handlers end the process at once."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        previous = {}
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _terminate)
            if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # a background job's stays ignored
                previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
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
            for sig, handler in previous.items():
                if handler is not None:  # None: a handler set outside Python
                    signal.signal(sig, handler)
    return wrapper


_memory_check = True  # --no-memory-check turns it off for this process's loads


def _no_memory_check(ctx, param, value):
    global _memory_check
    _memory_check = not value  # set on every invocation (tests run many in one process)


no_memory_check_option = click.option(
    "--no-memory-check", is_flag=True, expose_value=False, callback=_no_memory_check,
    help="Load even when the estimated memory needed exceeds what is available (TINYDET_NO_MEMORY_CHECK=1).")


_panel_cache = True  # --no-panel-cache turns it off for this process's loads


def _no_panel_cache(ctx, param, value):
    global _panel_cache
    _panel_cache = not value  # set on every invocation, as --no-memory-check


no_panel_cache_option = click.option(
    "--no-panel-cache", is_flag=True, expose_value=False, callback=_no_panel_cache,
    help="Pack the weights on every load; do not keep or use packed panels on disk (TINYDET_NO_PANEL_CACHE=1).")


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


DEFAULT_MODEL_NOTE = "Default: smollm2-135m-instruct, pulled on first use."
model_option = click.option("--model", "-m", "model_name", default=None, metavar="MODEL",
                            help="A GGUF file, a Hugging Face directory or a known model name (`tinydet models`). "
                                 + DEFAULT_MODEL_NOTE)


def check_sha256_option(help: str):
    """--check-sha256 (the command's `check_sha256`), and --verify, its old spelling: `tinydet verify` is
    another thing (the determinism matrix)."""
    def decorate(fn):
        fn = click.option("--check-sha256", "check_sha256", is_flag=True, help=help)(fn)
        return renamed("--verify", "--check-sha256", "check_sha256", is_flag=True)(fn)
    return decorate


DTYPE_HELP = (f"fp32; fp16 (weights and KV cache as binary16); native (matrices kept as the file stores them, "
              f"{', '.join(NATIVE_TYPES.values())} blocks dequantized in the kernels and F16 widened: the bits of "
              "fp32); int8 (native, but quantized matrices computed in integers against 8-bit activations, as "
              "llama.cpp does: deterministic, not fp32's bits).")


def model_options(fn):
    for opt in reversed([
        device_option,
        no_memory_check_option,
        no_panel_cache_option,
        model_option,
        click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True, help=DTYPE_HELP),
        click.option("--threads", type=click.IntRange(min=1), default=None, help="Default: the CPUs available."),
        check_sha256_option("Re-hash a known model's file against its manifest's SHA-256 before use."),
        click.option("--log", "log_path", type=click.Path(dir_okay=False), default=None,
                     help="Append one JSON line per request to this file."),
    ]):
        fn = opt(fn)
    return fn


speculative_option = click.option(
    "--speculative", default=None, metavar="ngram|DTYPE|MODEL",
    help="Check proposed tokens in each decoding pass: ngram (prompt lookup: what followed the last few tokens "
         "earlier in prompt + output), a dtype (this file in that mode drafting, e.g. int8 for native), or a "
         "draft model with the same tokenizer (a file or known name, at --dtype). The same tokens, logits and "
         "hashes; faster where the proposals are taken.")


# The command line's sampling: llama.cpp's default values, with a fixed seed, so that a first run reads well
# and gives the same text every time. The library and the server keep greedy and OpenAI's defaults.
SAMPLING_DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=0)


def sampling_options(fn):
    d = SAMPLING_DEFAULTS
    for opt in reversed([
        click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True),
        click.option("--temperature", type=click.FloatRange(min=0), default=d["temperature"], show_default=True,
                     help="0 = greedy (then --top-k, --top-p and --min-p do nothing). Sampling is seeded: the "
                          "same --seed gives the same text."),
        click.option("--top-k", type=click.IntRange(min=0), default=d["top_k"], show_default=True, help="0 = off."),
        click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=d["top_p"],
                     show_default=True, help="1 = off."),
        click.option("--min-p", type=click.FloatRange(min=0, max=1), default=d["min_p"], show_default=True,
                     help="0 = off."),
        click.option("--seed", type=click.IntRange(min=0), default=d["seed"], show_default=True),
        click.option("--stop", multiple=True, callback=_unescape_all,
                     help=f"Stop when this text appears (repeatable). C escapes are read: --stop '\\n' stops at "
                          f"a newline ({ESCAPES}; \\\\ for a backslash)."),
    ]):
        fn = opt(fn)
    return fn


def _read_text(ctx, param, value):
    """A file option's contents (UTF-8), or None."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"{value}: cannot be read ({e})") from None


def structured_options(fn):
    """--json-schema FILE, --regex, --grammar FILE: every token kept to one of them (`structured.py`)."""
    for opt in reversed([
        click.option("--json-schema", "json_schema", type=click.Path(dir_okay=False), callback=_read_text,
                     default=None, help="Write JSON valid under this JSON Schema (a file; {\"type\": \"object\"} "
                                        "for any object). Needs the structured extra."),
        click.option("--regex", default=None, help="Write text that matches this regular expression."),
        click.option("--grammar", type=click.Path(dir_okay=False), callback=_read_text, default=None,
                     help="Write text in this grammar (a file: Lark as llguidance reads it, or llama.cpp's GBNF)."),
    ]):
        fn = opt(fn)
    return fn


# A first run's compile, measured on 2 cores of a 2.x GHz Xeon (one core compiles): SmolLM2 135M from
# a fresh cache, load included; a quantized file's every further weight type adds to native's and
# int8's (bench/NOTES.md, "Cold start").
COMPILE_SECONDS = {"fp32": "about 35 s", "fp16": "about 90 s", "native": "about 2 min, more with more weight types",
                   "int8": "about 1 min"}
COMPILE_NOTICE = ("compiling kernels for this machine, once per tinydet version, dtype and weight type, cached "
                  "afterwards ({dtype}: {took} on a 2-core machine)...")
_compile_notice = False  # the notice's listener is registered once per process


def _load(model_name, dtype, threads, verify, log_path=None, device="cpu"):
    from ..api import load
    from ..backends.cpu import on_first_compile

    global _compile_notice
    if not _compile_notice:
        _compile_notice = True
        on_first_compile(lambda: click.echo(COMPILE_NOTICE.format(took=COMPILE_SECONDS.get(dtype, "a minute or two"),
                                                                  dtype=dtype), err=True))
    return load(model_name, dtype=dtype, threads=threads, progress=_progress(model_name or "default model"),
                verify=verify, log=log_path, check_memory=None if _memory_check else False, device=device,
                panel_cache=None if _panel_cache else False)


LOADER = "tinydet.cli._load"  # the click context's meta key under which `main` hands the commands their loader


def loader():
    """What the commands load models with: tinydet.cli._load as `main` found it when this run began
    (a patch of it there, as the tests make, reaches every command); this module's _load outside a run."""
    ctx = click.get_current_context(silent=True)
    return ctx.meta.get(LOADER, _load) if ctx is not None else _load


def json_object(option: str, text: str | None) -> dict | None:
    """An option's JSON object (None when the option is not given), else a one-line error naming it."""
    if text is None:
        return None
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise TinydetError(f"{option}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise TinydetError(f"{option}: expected a JSON object")
    return value
