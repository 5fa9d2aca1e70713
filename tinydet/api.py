"""The library API: `tinydet.load(...)` returns a `Model`."""

from __future__ import annotations

import json
import os
import uuid
from datetime import datetime, timezone
from pathlib import Path
from collections.abc import Mapping
from typing import Callable, Iterator, Sequence

import numpy as np

from . import memory
from .backends import Backend, load_backend, open_device
from .engine import Engine, Generation, Request, check_context, generate, generate_batch, stream
from .engine.sequence import check_stop
from .engine.speculate import make_drafter, same_tokenizer, speculation
from .errors import TinydetError
from .formats import open_checkpoint
from .hashing import hash_ids, model_sha256
from .packing.names import DTYPES
from .sampling import SamplingParams
from .tokenizer import Tokenizer
from .tokenizer.core import TokenTypeError


def _is_list(value) -> bool:
    """Whether `value` is a list-like argument: a sequence or an array, but not a str, bytes or dict
    (which iterate as characters, ints and keys) nor a one-shot iterator."""
    return isinstance(value, (Sequence, np.ndarray)) and not isinstance(value, (str, bytes, bytearray))


class Model:
    """A loaded model: tokenizer, packed weights and the settings it runs with.

    One Model may be shared between threads without a lock: each call gets its own KV cache and
    scratch (the weights are only read), so concurrent generate, stream and generate_batch calls each
    give the bits they give alone (tests/test_concurrency.py)."""

    def __init__(self, path: Path, backend: Backend, tokenizer: Tokenizer, metadata: dict,
                 log: str | os.PathLike | None = None, speculative=None):
        self.path = path
        self.backend = backend
        self.tokenizer = tokenizer
        self.metadata = metadata
        self.config = backend.config
        self.dtype = backend.dtype
        self._sha256: str | None = None
        self.log = log  # a JSON-lines file that gets one line per request, or None
        self.speculative = speculative

    @property
    def speculative(self):
        """The drafter decoding checks proposals from, or None (settable: "ngram", prompt lookup; a dtype,
        this file in that mode drafting, e.g. "int8" for native; a draft model's file, name or loaded
        Model, its tokenizer checked to be this one's; or a drafter object: `engine/speculate.py`). It
        changes speed only: the tokens, logits and hashes are plain decoding's."""
        return self._drafter

    @speculative.setter
    def speculative(self, spec) -> None:
        if isinstance(spec, (str, os.PathLike)) and str(spec) not in ("", "ngram"):
            # a dtype: this file in that mode drafting; else a draft model's file or name
            try:
                spec = load(self.path if str(spec) in DTYPES else spec,
                            dtype=str(spec) if str(spec) in DTYPES else self.dtype, threads=self.threads)
            except TinydetError as e:
                raise TinydetError(f"speculative: {e}") from None
        if isinstance(spec, Model):
            why = same_tokenizer(self.tokenizer, spec.tokenizer)
            if why:
                raise TinydetError(f"speculative: the draft model {spec.path.name}'s tokenizer is not "
                                   f"{self.path.name}'s: {why}")
        self._drafter = make_drafter(spec)

    @property
    def threads(self) -> int:
        """Threads the backend's forward passes use (settable); the bits never depend on it."""
        return self.backend.threads

    @threads.setter
    def threads(self, n: int) -> None:
        self.backend.threads = n

    @property
    def sha256(self) -> str:
        """SHA-256 of the model file or directory (computed on first use, or known from an earlier
        load of the unchanged file: `hashing.model_sha256`)."""
        if self._sha256 is None:
            self._sha256 = model_sha256(self.path)
        return self._sha256

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(self._ids(ids, "ids"))

    def _ids(self, ids, name: str) -> list[int]:
        """`ids` as a list of this model's token ids (the tokenizer's own check: 1.5, "7" and True are not
        ids), else a one-line TokenTypeError/TokenInputError naming the argument."""
        if not _is_list(ids):
            raise TokenTypeError(f"{name}: expected a list of token ids, found {repr(ids)[:40]}")
        try:
            return [self.tokenizer._check_id(i) for i in ids]
        except TinydetError as e:
            raise type(e)(f"{name}: {e}") from None

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids for a prompt: text is tokenized; an empty prompt means "start from BOS"."""
        if isinstance(prompt, str):
            if prompt == "":
                if self.tokenizer.bos_id is None:
                    raise TinydetError("prompt: empty, and the model has no BOS token to start from")
                return [self.tokenizer.bos_id]
            return self.tokenize(prompt)
        ids = self._ids(prompt, "prompt")
        if not ids:
            return self.prompt_ids("")
        return ids

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 logits (len(token_ids), vocab) of a full causal pass from an empty cache."""
        ids = self._ids(token_ids, "token_ids")
        check_context(len(ids), 0, self.config.context_length)
        cache = self.backend.new_cache(len(ids))
        return self.backend.forward(ids, cache, all_logits=True)

    def _params(self, temperature, top_k, top_p, min_p, seed) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)

    SETTINGS = ("prompt", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "json_schema",
                "regex", "grammar")

    def request(self, prompt: str | Sequence[int] = "", max_tokens: int = 256, temperature: float = 0.0,
                top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 0,
                stop: Sequence[str] | None = None, logits: bool = False, prompt_logits: bool = False,
                json_schema=None, regex: str | None = None, grammar: str | None = None,
                prompt_logprobs: int | None = None) -> Request:
        """An engine `Request` with generate()'s settings (`logits`: events carry their logits rows;
        `prompt_logits`: also the rows predicting the prompt's tokens; `prompt_logprobs`: each prompt
        token's log-probability and that many alternatives, reused from the prefix cache where it has
        them)."""
        return Request(self.prompt_ids(prompt), self._params(temperature, top_k, top_p, min_p, seed), max_tokens,
                       check_stop(stop), logits, prompt_logits, self.constraint(json_schema, regex, grammar),
                       prompt_logprobs)

    def constraint(self, json_schema=None, regex: str | None = None, grammar: str | None = None):
        """The compiled constraint (`structured.py`) of at most one of a JSON Schema (a dict or JSON text;
        {"type": "object"} for any object), a regular expression or a grammar (Lark as llguidance reads
        it, or llama.cpp's GBNF); None for none. One that does not compile is a one-line TinydetError."""
        if json_schema is None and regex is None and grammar is None:
            return None
        from .structured import constraint

        return constraint(self.tokenizer, self.config.vocab_size, json_schema, regex, grammar)

    def engine(self, max_batch: int = 8, step_tokens: int | None = None, prefix_cache_bytes: int = 0) -> Engine:
        """A step-wise engine over this model (submit / step / cancel; see `engine.scheduler`), with a
        prefix cache of up to `prefix_cache_bytes` (0: none)."""
        return Engine(self.backend, self.tokenizer, max_batch, step_tokens, prefix_cache_bytes=prefix_cache_bytes,
                      speculative=self._drafter)

    @property
    def fingerprint(self) -> str:
        """What fixes this model's bits, as `tinydet-VERSION-BITS-MODEL-SOURCES`: tinydet's version,
        the arithmetic ("fp16", "int8", or "fp32" for fp32 and native, which give the same bits), the model's
        SHA-256 and the hash of the sources that compute results (`hashing.source_hash`), each cut to 12
        hex digits. Threads, batch size and the CPU are not in it: they do not change a bit."""
        from . import __version__
        from .hashing import source_hash

        bits = self.dtype if self.dtype in ("fp16", "int8") else "fp32"
        return f"tinydet-{__version__}-{bits}-{self.sha256[:12]}-{source_hash()[:12]}"

    def generate(self, prompt: str | Sequence[int] = "", max_tokens: int = 256, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 0,
                 stop: Sequence[str] | None = None, json_schema=None, regex: str | None = None,
                 grammar: str | None = None) -> Generation:
        """Generate up to `max_tokens` tokens. Greedy when temperature is 0. `json_schema`, `regex` or
        `grammar` constrain every token (`constraint`); the output may still end at `max_tokens`
        (finish_reason "length") before the constraint is complete."""
        r = self.request(prompt, max_tokens, temperature, top_k, top_p, min_p, seed, stop,
                         json_schema=json_schema, regex=regex, grammar=grammar)
        g = generate(self.backend, self.tokenizer, r, self._drafter)
        self._done(r, g)
        return g

    def _done(self, r: Request, g: Generation) -> None:
        g.settings = self._settings(r.params, r.max_tokens, r.stop)
        if r.constraint is not None:
            g.settings["constraint"] = r.constraint.describe()
        self._log(g)

    def _log(self, g: Generation) -> None:
        """Append one JSON line describing a finished request to `self.log`."""
        if self.log is None:
            return
        from . import __version__

        record = {
            "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "request_id": uuid.uuid4().hex, "tinydet_version": __version__, "model": str(self.path),
            "model_sha256": self.sha256, "prompt_hash": hash_ids(g.prompt_token_ids),
            "n_prompt_tokens": len(g.prompt_token_ids), "n_tokens": len(g.token_ids),
            "output_hash": g.output_hash, "logits_hash": g.logits_hash, "finish_reason": g.finish_reason,
            "settings": g.settings, "dtype": self.dtype, "threads": self.threads, "backend": self.backend.name,
            "timings": {"prefill_seconds": g.prefill_seconds, "decode_seconds": g.decode_seconds,
                        "compile_seconds": g.compile_seconds, "tokens_per_second": g.tokens_per_second},
        }
        if self._drafter is not None:
            record["speculative"] = speculation(g, self._drafter.name)
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def _settings(self, params: SamplingParams, max_tokens: int, stop) -> dict:
        # int(): check_request took any integer (a numpy one too); the log writes these as JSON.
        return dict(max_tokens=int(max_tokens), temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                    min_p=params.min_p, seed=params.seed, stop=list(stop or []), dtype=self.dtype,
                    threads=self.threads)

    def generate_batch(self, requests: Sequence[dict], max_batch: int = 8, step_tokens: int | None = None
                       ) -> list[Generation]:
        """Generate for several requests together (continuous batching, up to `max_batch` at once;
        prompts prefilled under `step_tokens` tokens a step, or whole). Each request is a dict with
        `prompt` and any of generate()'s settings; each result is bit-identical to `generate(**request)`
        alone."""
        if not _is_list(requests):
            raise TinydetError(f"requests: expected a list of request dicts, found {repr(requests)[:40]}")
        reqs = []
        for i, r in enumerate(requests):
            if not isinstance(r, Mapping):
                raise TinydetError(f"requests[{i}]: expected a dict of generate()'s settings, found {repr(r)[:40]}")
            unknown = set(r) - set(self.SETTINGS)
            if unknown:
                raise TinydetError(f"requests[{i}]: unknown settings {sorted(unknown)} (allowed: {sorted(self.SETTINGS)})")
            reqs.append(self.request(**r))
        out = generate_batch(self.backend, self.tokenizer, reqs, max_batch, step_tokens, self._drafter)
        for r, g in zip(reqs, out):
            self._done(r, g)
        return out

    def chat_plan(self, messages: Sequence[dict], tools=None, tool_choice=None, parallel_tool_calls: bool = True,
                  chat_template_kwargs: Mapping | None = None):
        """The chat request made ready (`chat.plan.ChatPlan`): the prompt rendered by the model's template
        with `tools` (OpenAI's function tools) and the template's options, the grammar that holds a
        call to its function's schema, and the parser of the answer."""
        from .chat.plan import plan_chat

        return plan_chat(self.tokenizer, messages, tools, tool_choice, parallel_tool_calls, chat_template_kwargs)

    def chat_prompt(self, messages: Sequence[dict], tools=None, tool_choice=None, parallel_tool_calls: bool = True,
                    chat_template_kwargs: Mapping | None = None) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template, ready for the reply."""
        plan = self.chat_plan(messages, tools, tool_choice, parallel_tool_calls, chat_template_kwargs)
        # The template writes any BOS itself, as in HF's apply_chat_template.
        return self.tokenize(plan.prompt, add_special=False)

    def chat(self, messages: Sequence[dict], max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, seed: int = 0, stop: Sequence[str] | None = None,
             json_schema=None, regex: str | None = None, grammar: str | None = None, tools=None, tool_choice=None,
             parallel_tool_calls: bool = True, chat_template_kwargs: Mapping | None = None) -> Generation:
        """The assistant's reply to `messages` ([{"role": "user", "content": "..."}, ...]). With `tools`
        (OpenAI's function tools; `tool_choice` "auto", "none", "required" or {"type": "function",
        "function": {"name": ...}}) the model may call them, each call held to its function's schema.
        The result's `message` has the reply read back: `content`, `reasoning_content` (thinking models)
        and `tool_calls`; `finish_reason` is "tool_calls" when the reply ended with calls."""
        plan = self.chat_plan(messages, tools, tool_choice, parallel_tool_calls, chat_template_kwargs)
        if plan.grammar is not None and (json_schema is not None or regex is not None or grammar is not None):
            raise TinydetError("tools: a call's grammar and json_schema/regex/grammar cannot both hold a reply "
                               "(use tool_choice 'none' for a constrained text reply)")
        ids = self.tokenize(plan.prompt, add_special=False)
        r = self.request(ids, max_tokens, temperature, top_k, top_p, min_p, seed, stop, json_schema=json_schema,
                         regex=regex, grammar=plan.grammar if plan.grammar is not None else grammar)
        g = generate(self.backend, self.tokenizer, r, self._drafter)
        self.read_chat(plan, g, chat_key(ids, seed))
        self._done(r, g)
        return g

    def read_chat(self, plan, g: Generation, key: str) -> Generation:
        """Read a chat answer `g` (generated from `plan.prompt` with `plan.grammar`) back: its `message`
        (reasoning, content, calls; ids derived from `key`, see `chat_key`) and finish reason "tool_calls"
        when it ended with calls. The text is fed to the parser token by token, as a server's stream feeds
        it; the parser's answer does not depend on where its pieces break."""
        parser = plan.parser(key)
        if plan.parses:
            decoder, left = self.tokenizer.stream(g.prompt_token_ids), len(g.text)
            for t in g.token_ids:
                piece = decoder.push(t)[:left]  # text past a stop string is not the answer's
                left -= len(piece)
                parser.feed(piece, t)
            parser.feed(decoder.flush()[:left])
            parser.finish()
        finish(g, parser.message, plan.parses)
        return g

    def stream(self, prompt: str | Sequence[int] = "", max_tokens: int = 256, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 0,
               stop: Sequence[str] | None = None, json_schema=None, regex: str | None = None,
               grammar: str | None = None) -> Iterator[str]:
        """Yield pieces of text as they are produced (the same tokens as `generate`)."""
        r = self.request(prompt, max_tokens, temperature, top_k, top_p, min_p, seed, stop,
                         json_schema=json_schema, regex=regex, grammar=grammar)
        for ev in stream(self.backend, self.tokenizer, r, self._drafter):
            if ev.text:
                yield ev.text
            if ev.result is not None:
                self._done(r, ev.result)


def chat_key(prompt_ids: Sequence[int], seed: int, index: int = 0) -> str:
    """What a chat answer's call ids derive from: its prompt, seed and choice index."""
    return f"{hash_ids(prompt_ids)}:{seed}:{index}"


def finish(g: Generation, message, parsed: bool) -> None:
    """Set a chat answer's `message` (the text as content where nothing was read back) and its finish
    reason "tool_calls" when it ended with calls."""
    from .chat.parse import ChatMessage

    g.message = message if parsed else ChatMessage(content=g.text)
    g.finish_reason = g.message.finish_reason(g.finish_reason)


def check_speculative(spec) -> None:
    """Refuse a `speculative` that names nothing: a string must be "ngram", a dtype, or a draft model's
    existing file or known name."""
    if isinstance(spec, (str, os.PathLike)) and str(spec) not in ("", "ngram", *DTYPES):
        from .registry import known_models

        if not Path(spec).exists() and str(spec).lower() not in known_models():
            raise TinydetError(f"speculative: expected ngram, a dtype ({', '.join(DTYPES)}: this file in that "
                               f"mode drafting) or a draft model's file or known name, found {str(spec)!r}")
    elif not isinstance(spec, (str, os.PathLike)):
        make_drafter(spec)


def load(model: str | os.PathLike | None = None, dtype: str = "fp32", threads: int | None = None,
         progress: Callable[[int, int, str], None] | None = None, verify: bool = False,
         log: str | os.PathLike | None = None, check_memory: bool | None = None, device: str = "cpu",
         panel_cache: bool | None = None, speculative=None) -> Model:
    """Load a model: a GGUF file, a Hugging Face directory (config.json + safetensors), or the name of
    a known model (`tinydet models`), pulled into the cache on first use; None means the default
    model. `dtype` is "fp32", "fp16" (weights and KV cache stored as binary16, arithmetic in
    float32) or "native" (each matrix kept as the file stores it, Q8_0/Q4_0/Q4_1 blocks dequantized
    inside the kernels: fp32's bits from a quarter to an eighth of its memory) or "int8" (native storage,
    quantized matrices computed in integers against activations quantized to 8-bit blocks, as
    llama.cpp computes them: deterministic, its own bits, within about llama.cpp's error of fp32's); `threads` defaults to the CPUs this process may use. `verify` re-hashes a known model's
    file even when the cache says it was checked. `log` names a file that gets one JSON line per request
    (time, request id, version, model SHA-256, prompt/output/logits hashes, settings, timings).
    Before packing, the memory the load needs (weights at `dtype` + a KV cache, `memory.check_memory`)
    is compared with what the machine has available, and a load that does not fit raises
    MemoryLimitError; `check_memory=False` (or, when it is None, TINYDET_NO_MEMORY_CHECK=1) skips that.
    `device` is "cpu", or "cuda" / "cuda:N" for an NVIDIA GPU through CuPy (the CPU's bits; weights are
    packed in host memory, then copied), or "cuda-host" (the GPU's kernels emulated on the CPU, slowly).
    `panel_cache` keeps a GGUF file's packed weights on disk after the first load and maps them on
    later ones (`packing/panelcache.py`); False, or (when it is None) TINYDET_NO_PANEL_CACHE=1,
    turns that off. `speculative` ("ngram", a dtype, a draft model) sets `Model.speculative`."""
    from .backends.threads import check_threads
    from .registry import DEFAULT_MODEL, resolve_model

    if dtype not in DTYPES:
        raise TinydetError(f"dtype: expected one of {', '.join(DTYPES)}, found {dtype!r}")
    check_threads(threads)
    check_speculative(speculative)  # a bad name fails before the load
    dev = open_device(device)
    ck = open_checkpoint(resolve_model(DEFAULT_MODEL if model is None else model, verify=verify), progress)
    if check_memory is None:
        check_memory = os.environ.get(memory.ENV_OVERRIDE, "") in ("", "0")
    if check_memory:
        memory.check_memory(ck.path, ck.config, ck.tensors, dtype)
    from .packing import panelcache

    source = ck.path if dev is None and ck.format == "gguf" and panelcache.enabled(panel_cache) else None
    return Model(ck.path, load_backend(dev, ck.config, ck.tensors, dtype, threads, source, progress), ck.tokenizer,
                 ck.metadata, log, speculative)
