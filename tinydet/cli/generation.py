"""The commands that generate text: generate (one prompt) and chat (a conversation)."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time

import click

from .. import __version__
from ..api import check_speculative
from ..engine.speculate import speculation
from .common import (cli_errors, escape_option, json_object, loader, model_options, sampling_options,
                     speculative_option, structured_options, unescape)


def _read_tools(path):
    """The tools of a JSON file (OpenAI's list of function tools, or an object with a "tools" list),
    checked before the load; None without --tools."""
    if path is None:
        return None
    from ..chat.tools import check_tools
    from ..errors import TinydetError

    try:
        data = json.loads(open(path, encoding="utf-8").read())
    except OSError as e:
        raise TinydetError(f"--tools {path}: cannot read ({e.strerror})") from None
    except ValueError as e:
        raise TinydetError(f"--tools {path}: not JSON ({e})") from None
    tools = data.get("tools") if isinstance(data, dict) else data
    try:
        return check_tools(tools)
    except TinydetError as e:
        raise TinydetError(f"--tools {path}: {e}") from None


def _tool_choice(choice: str | None):
    if choice in (None, "auto", "none", "required"):
        return choice
    return {"type": "function", "function": {"name": choice}}


def tools_options(fn):
    for opt in reversed([
        click.option("--tools", "tools_path", type=click.Path(dir_okay=False), default=None,
                     help="A JSON file of OpenAI function tools the model may call (with --chat for generate)."),
        click.option("--tool-choice", default=None,
                     help="auto (default with tools), none, required, or a function's name: that call."),
        click.option("--template-kwargs", default=None,
                     help='JSON object of the chat template\'s options, e.g. \'{"enable_thinking": false}\'.'),
    ]):
        fn = opt(fn)
    return fn


def _stream(pieces) -> None:
    for piece in pieces:
        click.echo(piece, nl=False)
        sys.stdout.flush()
    click.echo("")


@click.command()
@click.argument("prompt", default="")
@model_options
@sampling_options
@click.option("--chat", "as_chat", is_flag=True, help="Send PROMPT as a user message through the chat template.")
@click.option("--system", default=None, help="With --chat (refused without): a system message.")
@escape_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text: the text, "
              "token ids, hashes, settings, the model's SHA-256 and system_fingerprint, and timings (a first "
              "call's kernel compile or cache load in compile_seconds, apart from prefill and decode).")
@speculative_option
@structured_options
@tools_options
@cli_errors
def generate(prompt, model_name, device, dtype, threads, check_sha256, log_path, max_tokens, temperature, top_k, top_p,
             min_p, seed, stop, as_chat, system, escape, as_json, speculative, json_schema, regex, grammar, tools_path,
             tool_choice, template_kwargs):
    """Continue PROMPT (empty: start from BOS), streaming the text as it is produced. Sampling is seeded
    (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, seed 0: llama.cpp's values with a fixed seed), so
    the same command gives the same text every time; --temperature 0 is greedy. With --chat and --json,
    the reply's reasoning and tool calls are reported apart from its content."""
    chat_only = [name for name, given in (("--system", system is not None), ("--tools", tools_path is not None),
                                          ("--tool-choice", tool_choice is not None),
                                          ("--template-kwargs", template_kwargs is not None)) if given]
    if chat_only and not as_chat:
        raise click.UsageError(f"{', '.join(chat_only)} only with --chat (they go through the chat template)")
    if escape:
        prompt, system = unescape(prompt), system and unescape(system)
    tools, options = _read_tools(tools_path), json_object("--template-kwargs", template_kwargs)
    check_speculative(speculative)  # before the load
    if json_schema is not None:
        from ..structured import check_schema_text

        check_schema_text(json_schema)  # before the load
    model = loader()(model_name, dtype, threads, check_sha256, log_path, device)
    model.speculative = speculative
    kwargs = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                  min_p=min_p, seed=seed, stop=list(stop), json_schema=json_schema, regex=regex, grammar=grammar)
    model.constraint(json_schema, regex, grammar)  # compiled (or refused) before any output
    t0 = time.perf_counter()
    if as_chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        chat_kw = dict(tools=tools, tool_choice=_tool_choice(tool_choice), chat_template_kwargs=options)
        plan = model.chat_plan(messages, **chat_kw)
        if plan.grammar is not None:
            model.constraint(grammar=plan.grammar)  # a tool's schema llguidance refuses: before any output
        if not as_json and not plan.parses:
            _stream(model.stream(model.tokenize(plan.prompt, add_special=False), **kwargs))
            return
        g = model.chat(messages, **kwargs, **chat_kw)
        if not as_json:  # the reply read back: reasoning, content, calls
            _print_message(g.message)
            return
    else:
        ids = model.prompt_ids(prompt)
        if not as_json:
            _stream(model.stream(ids, **kwargs))
            return
        g = model.generate(ids, **kwargs)
    total = time.perf_counter() - t0
    extra = {"speculative": speculation(g, model.speculative.name)} if model.speculative else {}
    click.echo(json.dumps({
        "text": g.text,
        "token_ids": g.token_ids,
        "prompt_token_ids": g.prompt_token_ids,
        "finish_reason": g.finish_reason,
        "output_hash": g.output_hash,
        "logits_hash": g.logits_hash,
        **({"message": g.message.openai()} if g.message is not None else {}),
        "settings": dict(g.settings, chat=as_chat),
        "model": str(model.path),
        "model_sha256": model.sha256,
        "tinydet_version": __version__,
        "system_fingerprint": model.fingerprint,
        "compile_seconds": g.compile_seconds,
        "prefill_seconds": g.prefill_seconds,
        "decode_seconds": g.decode_seconds,
        "total_seconds": total,
        "tokens_per_second": g.tokens_per_second,
        **extra,
    }, ensure_ascii=False))


def _print_message(message) -> None:
    if message.reasoning_content:
        click.echo(click.style(f"[reasoning] {message.reasoning_content}", dim=True))
    if message.content:
        click.echo(message.content)
    for c in message.tool_calls:
        click.echo(click.style(f"[call {c.id}] {c.name}({c.arguments})", bold=True))


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


@click.command()
@model_options
@sampling_options
@click.option("--system", default=None, help="A system message to start the conversation with.")
@escape_option
@speculative_option
@tools_options
@cli_errors
def chat(model_name, device, dtype, threads, check_sha256, log_path, max_tokens, temperature, top_k, top_p, min_p, seed,
         stop, system, escape, speculative, tools_path, tool_choice, template_kwargs):
    """Talk with a model through its chat template. History is kept. Ctrl-C while a reply is being
    written stops it and returns to the prompt (the reply stays in the history as far as it got); an
    empty line, /exit or Ctrl-D at the prompt ends (Ctrl-C there too, with exit status 130). With
    --tools the model may call them: each call is shown, you type its result, and the model goes on.
    Sampling is seeded, as generate's (--temperature 0: greedy). With -e, each line typed has its C
    escapes read too."""
    tools, options = _read_tools(tools_path), json_object("--template-kwargs", template_kwargs)
    check_speculative(speculative)  # before the load
    read = unescape if escape else (lambda text: text)
    system = system and read(system)
    model = loader()(model_name, dtype, threads, check_sha256, log_path, device)
    model.speculative = speculative
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
        messages.append({"role": "user", "content": read(line)})
        if tools is not None or options:
            _agent_turn(model, messages, kwargs, dict(tools=tools, tool_choice=_tool_choice(tool_choice),
                                                       chat_template_kwargs=options))
            continue
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


def _agent_turn(model, messages: list, kwargs: dict, chat_kw: dict) -> None:
    """One user turn with tools: replies (each call shown, its result typed by the user as a tool
    message) until the model answers without calling."""
    for _ in range(16):  # a model that only ever calls is stopped here
        g = model.chat(messages, **kwargs, **chat_kw)
        _print_message(g.message)
        messages.append(g.message.openai())
        if not g.message.tool_calls:
            return
        for c in g.message.tool_calls:
            try:
                result = input(f"result of {c.name} [{c.id}]> ")
            except EOFError:
                result = ""
            messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
        if chat_kw.get("tool_choice") not in (None, "auto", "none"):
            chat_kw = dict(chat_kw, tool_choice="auto")  # a forced call once: then the model may answer
    click.echo("[16 replies of calls in a row: back to you]")
