"""Fuzz targets: each makes inputs from real seed files and runs one of them through tinydet.

A target's `make(rng)` returns the input as files (name relative to the case directory -> bytes, plus,
for the CLI, an argument list); `run(case_dir)` feeds them to tinydet. The campaign and the tests
write every case under a scratch directory in /tmp and run there: no path a target passes lies
outside it (`case_path` checks).

Seeds: stories260K (../shared/models or $TINYDET_SHARED_MODELS) and the tiny checkpoints of each
architecture the tests' generators make (tests/qwen2gen.py, gemma3gen.py, spmgen.py), built once into
$TINYDET_FUZZ_SEEDS (default /tmp/tinydet-fuzz-seeds)."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import sys
import tempfile
from functools import cached_property
from pathlib import Path

from tinydet.errors import TinydetError

from mutate import (gguf_fields, mutate_bytes, mutate_gguf_field, mutate_gguf_model, mutate_json, mutate_messages,
                    mutate_template, mutate_toml, parse_seed, _paths)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
SHARED_MODELS = Path(os.environ.get("TINYDET_SHARED_MODELS", ROOT.parent / "shared" / "models"))
SEED_DIR = Path(os.environ.get("TINYDET_FUZZ_SEEDS", Path(tempfile.gettempdir()) / "tinydet-fuzz-seeds"))

GGUF_ARCHS = [("qwen2gen", "qwen2"), ("qwen2gen", "qwen3"), ("qwen2gen", "llama3"), ("gemma3gen", None),
              ("spmgen", "mistral"), ("spmgen", "phi3"), ("gemma2gen", None), ("smollm3gen", None),
              ("moegen", "qwen3moe"), ("moegen", "mixtral"), ("moegen", "olmoe"), ("gptossgen", None)]


def make_scratch() -> Path:
    """A fresh scratch directory under the system's temporary directory."""
    return Path(tempfile.mkdtemp(prefix="tinydet-fuzz-")).resolve()


def case_path(case: Path, name: str) -> Path:
    """`name` inside the case directory, refusing anything that would resolve outside it."""
    p = (case / name).resolve()
    if not name or case.resolve() not in p.parents:
        raise RuntimeError(f"fuzz input path {name!r} leaves the scratch directory {case}")
    return p


def write_case(case: Path, files: dict[str, bytes]) -> None:
    """Empty the case directory (it must lie in the temporary directory) and write the files."""
    tmp = Path(tempfile.gettempdir()).resolve()
    assert tmp in case.resolve().parents and case.name == "case", case
    if case.exists():
        shutil.rmtree(case)
    case.mkdir(parents=True)
    for name, data in files.items():
        p = case_path(case, name)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def _gen(module: str):
    return __import__(module)


def gguf_seeds() -> list[Path]:
    """stories260K and one tiny GGUF per architecture (plus a Q8_0 one), built on first use."""
    SEED_DIR.mkdir(parents=True, exist_ok=True)
    out = []
    stories = SHARED_MODELS / "stories260K.gguf"
    if stories.exists():
        out.append(stories)
    for module, arch in GGUF_ARCHS + [("qwen2gen", "q8_0")]:
        p = SEED_DIR / f"{module}-{arch}.gguf"
        if not p.exists():
            g = _gen(module)
            if arch == "q8_0":
                g.write_gguf(p, quant="q8_0")
            elif arch is None:
                g.write_gguf(p)
            elif module == "spmgen":
                g.write_gguf(p, arch=arch)
            else:
                g.write_gguf(p, arch=arch)
        out.append(p)
    return out


def hf_seeds() -> list[Path]:
    """One tiny Hugging Face directory per architecture (needs torch and transformers, first use only),
    each with a shard index naming its one safetensors file."""
    SEED_DIR.mkdir(parents=True, exist_ok=True)
    out = []
    for module, arch in GGUF_ARCHS:
        d = SEED_DIR / f"hf-{module}-{arch}"
        if not (d / "config.json").exists():
            g = _gen(module)
            g.write_hf_dir(d) if arch is None else g.write_hf_dir(d, arch=arch)
            from tinydet.formats.safetensors import SafetensorsFile

            names = list(SafetensorsFile(d / "model.safetensors").tensors)
            (d / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
        out.append(d)
    return out


class Target:
    name = ""
    cheap = True  # parser-level: thousands of inputs a second-ish, fit for the test suite

    def make(self, rng: random.Random) -> dict[str, bytes]:
        raise NotImplementedError

    def run(self, case: Path) -> None:
        raise NotImplementedError


class GGUF(Target):
    """GGUFFile, the config, the tokenizer and the tensor table (open_gguf) on mutated GGUF files."""
    name = "gguf"

    @cached_property
    def seeds(self):
        out = []
        for p in gguf_seeds():
            data = p.read_bytes()
            out.append((data, gguf_fields(data), parse_seed(p)))
        return out

    def make(self, rng):
        data, fields, (meta, tensors) = rng.choice(self.seeds)
        op = rng.random()
        if op < 0.35:
            out = mutate_gguf_field(rng, data, fields)
        elif op < 0.7:
            out = mutate_gguf_model(rng, meta, tensors)
        else:
            out = mutate_bytes(rng, data)
        if rng.random() < 0.1:
            out = mutate_bytes(rng, out)
        return {"model.gguf": out}

    def run(self, case):
        from tinydet.formats.gguf_model import open_gguf

        ck = open_gguf(case_path(case, "model.gguf"))  # GGUFFile, config, tokenizer, tensor table
        ids = ck.tokenizer.encode("Hello, world! 123")
        ck.tokenizer.decode(ids)


class LoadGGUF(GGUF):
    """tinydet.load and a short greedy generate on mutated GGUF files (the whole path: packing too)."""
    name = "load_gguf"
    cheap = False

    def run(self, case):
        import tinydet

        m = tinydet.load(case_path(case, "model.gguf"), threads=1)
        m.generate("Once upon", max_tokens=3)


class Safetensors(Target):
    """SafetensorsFile and every tensor's value, on headers mutated as JSON (offsets, dtypes, shapes,
    the header length)."""
    name = "safetensors"

    @cached_property
    def seeds(self):
        out = []
        for d in hf_seeds()[:3]:
            raw = (d / "model.safetensors").read_bytes()
            n = struct.unpack_from("<Q", raw)[0]
            header = json.loads(raw[8:8 + n])
            out.append((header, list(_paths(header)), raw[8 + n:]))
        return out

    def make(self, rng):
        header, paths, body = rng.choice(self.seeds)
        text = mutate_json(rng, header, paths).encode("utf-8", "surrogatepass")
        n = len(text)
        if rng.random() < 0.1:
            n = rng.choice([0, 1, 2, n - 1, n + 1, 2**32, 2**63, 2**64 - 1, len(text) + len(body) + 1])
        return {"model.safetensors": struct.pack("<Q", n % 2**64) + text + body}

    def run(self, case):
        from tinydet.formats.safetensors import SafetensorsFile

        f = SafetensorsFile(case_path(case, "model.safetensors"))
        for name in f.tensors:
            f.get(name)


HF_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "model.safetensors.index.json"]


class HFDir(Target):
    """open_checkpoint of a Hugging Face directory with one of its JSON files mutated, then the
    tokenizer and the chat template."""
    name = "hf_dir"

    @cached_property
    def seeds(self):
        out = []
        for d in hf_seeds():
            files = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
            parsed = {n: json.loads(files[n]) for n in HF_FILES if n in files}
            out.append((files, parsed, {n: list(_paths(v)) for n, v in parsed.items()}))
        return out

    def make(self, rng):
        files, parsed, paths = rng.choice(self.seeds)
        files = dict(files)
        name = rng.choice(list(parsed))
        if rng.random() < 0.05:
            del files[name]
        else:
            files[name] = mutate_json(rng, parsed[name], paths[name]).encode("utf-8", "surrogatepass")
        return files

    def run(self, case):
        from tinydet.chat import render_chat
        from tinydet.formats import open_checkpoint

        ck = open_checkpoint(case)
        tok = ck.tokenizer
        tok.decode(tok.encode("Hello, world! <|im_start|>"))
        if tok.chat_template:
            render_chat(tok.chat_template, [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}])


class Manifest(Target):
    """load_manifest on mutated copies of models/*.toml."""
    name = "manifest"

    @cached_property
    def seeds(self):
        return [p.read_text(encoding="utf-8") for p in sorted((ROOT / "models").glob("*.toml"))]

    def make(self, rng):
        i = rng.randrange(len(self.seeds))
        self._stem = ["gemma3-270m", "smollm2-135m-instruct", "stories260k"][i % 3]
        text = self.seeds[i]
        return {f"{self._name(text)}.toml": mutate_toml(rng, text)}

    @staticmethod
    def _name(text):
        for line in text.splitlines():
            if line.startswith("name ="):
                return line.split('"')[1]
        return "m"

    def run(self, case):
        from tinydet.registry.manifest import load_manifest

        for p in case.iterdir():
            load_manifest(p)


class CLIRefusal(TinydetError):
    """The CLI exited with an error message (status 1 or 2)."""


class CLI(Target):
    """tinydet's commands through click's CliRunner with mutated arguments; every path is a file of the
    case directory (a mutated stories260K, a trace, a missing name), never anything outside it."""
    name = "cli"
    cheap = False

    COMMANDS = ["generate", "info", "trace", "diff", "convert", "golden", "bench", "models", "chat"]
    VALUES = ["0", "-1", "1", "2", "4294967296", "18446744073709551616", "nan", "inf", "-inf", "1e309", "",
              "x", "fp16", "fp32", "native", "int8", "\u00e9", "--", "-", "0.5"]
    OPTIONS = ["--max-tokens", "--temperature", "--top-k", "--top-p", "--min-p", "--seed", "--threads",
               "--dtype", "--stop", "--system", "--prompt-tokens", "--new-tokens", "--repeats", "--chunk",
               "--json", "--chat", "--overwrite", "--no-values", "--verify", "--no-native"]

    @cached_property
    def gguf(self):
        return GGUF()

    def make(self, rng):
        files = {}
        if rng.random() < 0.5:
            files["m.gguf"] = (SHARED_MODELS / "stories260K.gguf").read_bytes()
        else:
            files["m.gguf"] = self.gguf.make(rng)["model.gguf"]
        files["t.jsonl"] = rng.choice([b"", b"{}\n", b'{"format": "x"}\n', b"\xff\n", mutate_bytes(rng, b'{"a": 1}\n')])
        cmd = rng.choice(self.COMMANDS)
        # Path placeholders, resolved inside the case directory by `run`.
        args = [cmd]
        if cmd in ("generate", "chat"):
            args += ["--model", "@m.gguf"]
            if cmd == "generate":
                args.append(rng.choice(["Once", "", "\u0000", "x" * 300]))
        elif cmd in ("info", "bench", "golden"):
            args += ["--model", "@m.gguf"] if cmd != "info" else ["@m.gguf"]
            if cmd == "golden":
                args += [rng.choice(["--check", "--write"]), "@g.json"]
        elif cmd == "trace":
            args += ["--model", "@m.gguf", "--out", "@o.jsonl"]
        elif cmd == "diff":
            args += ["@t.jsonl", rng.choice(["@t.jsonl", "@missing.jsonl"])]
        elif cmd == "convert":
            args += ["@m.gguf", rng.choice(["@out", "@m.gguf"])]
        for _ in range(rng.randint(0, 3)):
            args += [rng.choice(self.OPTIONS), rng.choice(self.VALUES)]
        if cmd in ("generate", "trace", "bench"):
            args += ["--max-tokens", "2"] if cmd == "generate" else []
            if cmd == "bench":
                args += ["--prompt-tokens", "2", "--new-tokens", "2", "--repeats", "1"]
        files["args.json"] = json.dumps(args).encode()
        return files

    def run(self, case):
        from click.testing import CliRunner

        from tinydet.cli import main

        args = [str(case_path(case, a[1:])) if a.startswith("@") else a
                for a in json.loads(case_path(case, "args.json").read_bytes())]
        env = {"TINYDET_CACHE_DIR": str(case_path(case, "cache")), "TINYDET_MODELS_DIR": str(case_path(case, "models"))}
        r = CliRunner().invoke(main, args, env=env, input="hi\n")
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            raise r.exception
        out = r.output
        if r.exit_code not in (0, 1, 2):
            raise RuntimeError(f"exit status {r.exit_code}")
        if "Traceback" in out:
            raise RuntimeError(f"a traceback in the output: {out[-300:]}")
        if r.exit_code:
            # A refusal (1) or a usage error (2): click's usage text spans lines, tinydet's own error is
            # its last line; counted as a refusal with that line.
            last = out.strip().splitlines()[-1] if out.strip() else f"exit {r.exit_code} without a message"
            raise CLIRefusal(last)


class API(Target):
    """Model.generate / stream / generate_batch / tokenize / chat_prompt on stories260K (loaded once)
    with mutated arguments."""
    name = "api"

    VALUES = [0, 1, -1, 2, 2**31 - 1, 2**32, 2**63, 2**64, -2**63, 0.0, -0.0, 0.5, 1.0, 2.0, 1e308, -1e-9,
              float("nan"), float("inf"), -float("inf"), True, False, None, "", "1", "x", [], ["\n"], [None],
              b"a", {"a": 1}, ["a"] * 100]
    PROMPTS = ["", "Once upon", "\u0000", "\ud800", "x" * 3000, [], [1], [1, 2, 3], [-1], [511], [512], [2**63],
               [1.5], ["a"], [True], None, 5, b"Once", [1] * 3000]

    @cached_property
    def model(self):
        import tinydet

        return tinydet.load(SHARED_MODELS / "stories260K.gguf", threads=1)

    def make(self, rng):
        call = rng.choice(["generate", "stream", "generate_batch", "tokenize", "detokenize", "chat_prompt", "logits"])
        kw = {}
        for k in rng.sample(["max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop"], rng.randint(0, 3)):
            kw[k] = rng.choice(self.VALUES)
        if "max_tokens" not in kw or (isinstance(kw["max_tokens"], int) and kw["max_tokens"] > 8):
            kw["max_tokens"] = rng.choice([0, 1, 2, 3])  # bounded: the point is the checks, not long runs
        prompt = rng.choice(self.PROMPTS)
        spec = {"call": call, "prompt": prompt, "kw": kw}
        # JSON keeps NaN, inf, huge integers and lone surrogates; bytes values are tagged.
        return {"call.json": json.dumps(spec, default=lambda b: {"__bytes__": b.hex()}).encode()}

    def run(self, case):
        spec = json.loads(case_path(case, "call.json").read_text(),
                          object_hook=lambda d: bytes.fromhex(d["__bytes__"]) if "__bytes__" in d else d)
        m, call, prompt, kw = self.model, spec["call"], spec["prompt"], spec["kw"]
        if call == "generate":
            m.generate(prompt, **kw)
        elif call == "stream":
            for _ in m.stream(prompt, **kw):
                pass
        elif call == "generate_batch":
            m.generate_batch([{"prompt": prompt, **kw}, {"prompt": "Once", "max_tokens": 1}])
        elif call == "tokenize":
            m.tokenize(prompt)
        elif call == "detokenize":
            m.detokenize(prompt)
        elif call == "chat_prompt":
            m.chat_prompt([{"role": "user", "content": prompt}])
        else:
            m.logits(prompt)


class Structured(Target):
    """Model.generate on stories260K (at most 4 new tokens) constrained by mutated JSON Schemas, regexes and
    grammars (Lark and GBNF) of the shapes users send (tests/schemas.py): an output, or a TinydetError."""
    name = "structured"

    @cached_property
    def model(self):
        import tinydet

        return tinydet.load(SHARED_MODELS / "stories260K.gguf", threads=1)

    def make(self, rng):
        from schemas import GRAMMARS, REGEXES, SCHEMAS

        kind = rng.choice(["json_schema", "json_schema", "regex", "grammar"])
        if kind == "json_schema":
            value = mutate_json(rng, rng.choice(list(SCHEMAS.values())))
        else:
            seed = rng.choice(list((REGEXES if kind == "regex" else GRAMMARS).values()))
            value = mutate_bytes(rng, seed.encode()).decode("utf-8", "replace")
        spec = {"kind": kind, "value": value, "max_tokens": rng.randint(1, 4), "temperature": rng.choice([0.0, 1.0])}
        return {"constraint.json": json.dumps(spec).encode()}

    def run(self, case):
        spec = json.loads(case_path(case, "constraint.json").read_text())
        self.model.generate("Once", max_tokens=spec["max_tokens"], temperature=spec["temperature"],
                            **{spec["kind"]: spec["value"]})


def chat_templates() -> dict[str, str]:
    """The real chat templates at hand: those the seed GGUFs carry (Qwen2/Qwen3's ChatML, Llama 3.2's,
    Gemma 3's, Mistral's, Phi-3's, from the tests' generators) and SmolLM2's from the test cache when a
    test run has fetched it (never fetched here)."""
    from tinydet.formats.gguf import GGUFFile

    out = {}
    for p in gguf_seeds():
        t = GGUFFile(p).metadata.get("tokenizer.chat_template")
        if isinstance(t, str):
            out[p.stem] = t
    test_cache = Path(os.environ.get("TINYDET_TEST_CACHE", Path.home() / ".cache" / "tinydet" / "test-models"))
    smollm = test_cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if smollm.exists():
        out["smollm2"] = GGUFFile(smollm).metadata["tokenizer.chat_template"]
    return out


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "Weather?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"id": "abcdefghi", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "sunny", "tool_call_id": "abcdefghi"}, {"role": "user", "content": "Thanks"}],
]


class ChatTemplate(Target):
    """render_chat (what Model.chat_prompt and the server call) on mutated real chat templates and
    mutated conversations: a str, or a ChatTemplateError / TinydetError."""
    name = "chat_template"
    # The render's own time bound, shortened as tests/test_safety.py does: the mechanism is the same at
    # chat.MAX_SECONDS, and runaway inputs (a good share) then cost a quarter second, not five.
    render_seconds = 0.25

    @cached_property
    def seeds(self):
        return list(chat_templates().values())

    def make(self, rng):
        template = mutate_template(rng, self.seeds) if rng.random() < 0.9 else rng.choice(self.seeds)
        messages = mutate_messages(rng, CONVERSATIONS) if rng.random() < 0.5 else rng.choice(CONVERSATIONS)
        spec = {"template": template, "messages": messages,
                "bos_token": rng.choice(["", "<s>", "<bos>", "<|begin_of_text|>", "{{ x }}", "\ud800", "b" * 10000]),
                "eos_token": rng.choice(["", "</s>", "<eos>", "<|im_end|>"]),
                "add_generation_prompt": rng.choice([True, False, True, None, 0, "no"])}
        return {"chat.json": json.dumps(spec).encode()}  # ASCII: lone surrogates survive as escapes

    def run(self, case):
        from tinydet import chat

        spec = json.loads(case_path(case, "chat.json").read_text())
        old, chat.MAX_SECONDS = chat.MAX_SECONDS, self.render_seconds
        try:
            out = chat.render_chat(spec["template"], spec["messages"], bos_token=spec["bos_token"],
                                   eos_token=spec["eos_token"], add_generation_prompt=spec["add_generation_prompt"])
        finally:
            chat.MAX_SECONDS = old
        if not isinstance(out, str):
            raise RuntimeError(f"render_chat returned a {type(out).__name__}")


TOOL_SEEDS = [
    [{"type": "function", "function": {"name": "weather", "description": "The weather.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}],
    [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number", "minimum": 0}}}}},
     {"type": "function", "function": {"name": "noop"}}],
]
CHOICES = ["auto", "none", "required", {"type": "function", "function": {"name": "add"}}, {"type": "function"},
           "weather", None, 3, {"type": "function", "function": {"name": "weather"}}]


class Tools(Target):
    """Model.chat with tools on stories260K (given a ChatML template; at most 4 new tokens): mutated
    tools, tool_choice and conversations with tool calls, as the server passes them: a reply, or a
    TinydetError (ToolError naming the field, a schema llguidance refuses, a template error)."""
    name = "tools"

    @cached_property
    def model(self):
        import tinydet

        m = tinydet.load(SHARED_MODELS / "stories260K.gguf", threads=1)
        m.tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                                     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
        return m

    def make(self, rng):
        tools = mutate_json(rng, rng.choice(TOOL_SEEDS)) if rng.random() < 0.8 else rng.choice(TOOL_SEEDS)
        messages = mutate_messages(rng, CONVERSATIONS) if rng.random() < 0.5 else rng.choice(CONVERSATIONS)
        spec = {"tools": tools, "tool_choice": rng.choice(CHOICES), "messages": messages,
                "parallel": rng.choice([True, False]), "max_tokens": rng.randint(1, 4),
                "temperature": rng.choice([0.0, 1.0])}
        return {"tools.json": json.dumps(spec).encode()}

    def run(self, case):
        spec = json.loads(case_path(case, "tools.json").read_text())
        g = self.model.chat(spec["messages"], max_tokens=spec["max_tokens"], temperature=spec["temperature"],
                            tools=spec["tools"], tool_choice=spec["tool_choice"], parallel_tool_calls=spec["parallel"])
        json.dumps(g.message.openai())  # the reply is OpenAI's JSON


TARGETS = {t.name: t for t in (GGUF(), LoadGGUF(), Safetensors(), HFDir(), Manifest(), CLI(), API(), ChatTemplate(),
                               Structured(), Tools())}
