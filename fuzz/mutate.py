"""Mutations of real inputs: raw bytes, the integer fields of a GGUF file found by walking its layout,
GGUF metadata and tensor tables rebuilt with wrong types and shapes (tests/ggufgen.build), JSON
documents and TOML text. Every function takes a `random.Random`, so a seed replays a campaign."""

from __future__ import annotations

import json
import random
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import ggufgen  # noqa: E402  (the GGUF writer the tests use)

# Integer boundaries where size arithmetic overflows: u32, i32, u64, i64 limits and their neighbours.
BOUNDARY = [0, 1, 2, 3, 7, 8, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**53 + 1,
            2**62, 2**63 - 1, 2**63, 2**64 - 1]
SIGNED = [-1, -2, -(2**31), -(2**63)]


def boundary_int(rng: random.Random) -> int:
    return rng.choice(BOUNDARY + SIGNED) if rng.random() < 0.9 else rng.randrange(-2**16, 2**16)


# ---------------------------------------------------------------------------------------- bytes

def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """Flipped bits, bytes set to 0x00/0xff, an aligned integer set to a boundary value, truncation,
    a deleted or duplicated chunk."""
    b = bytearray(data)
    if not b:
        return bytes(rng.randbytes(rng.randrange(1, 64)))
    op = rng.randrange(6)
    if op == 0:
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif op == 1:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.choice((0, 0xFF, 0x7F, 0x80))
    elif op == 2 and len(b) >= 8:
        i = rng.randrange(len(b) - 7) & ~3
        width = rng.choice((4, 8))
        b[i:i + width] = (boundary_int(rng) % 2**(8 * width)).to_bytes(width, "little")
    elif op == 3:
        del b[rng.randrange(len(b)):]
    elif op == 4:
        i = rng.randrange(len(b))
        del b[i:i + rng.randint(1, 64)]
    else:
        i = rng.randrange(len(b))
        b[i:i] = b[i:i + rng.randint(1, 64)]
    return bytes(b)


# ---------------------------------------------------------------------------- GGUF raw fields

@dataclass(frozen=True)
class Field:
    pos: int
    width: int  # bytes: 4 or 8
    kind: str  # count, strlen, vtype, etype, arrlen, scalar, ndims, dim, ttype, offset


def gguf_fields(data: bytes) -> list[Field]:
    """The integer fields of a well-formed GGUF file, by walking its layout (seeds only)."""
    out: list[Field] = [Field(8, 8, "count"), Field(16, 8, "count")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(pos):
        out.append(Field(pos, 8, "strlen"))
        return pos + 8 + struct.unpack_from("<Q", data, pos)[0]

    def value(pos, t, top):
        if t in sizes:
            if sizes[t] in (4, 8) and top:
                out.append(Field(pos, sizes[t], "scalar"))
            return pos + sizes[t]
        if t == 8:
            return string(pos)
        et, n = struct.unpack_from("<IQ", data, pos)
        out.append(Field(pos, 4, "etype"))
        out.append(Field(pos + 4, 8, "arrlen"))
        pos += 12
        if et in sizes:
            return pos + n * sizes[et]
        for _ in range(n):
            pos = value(pos, et, False) if et == 9 else pos + 8 + struct.unpack_from("<Q", data, pos)[0]
        return pos

    for _ in range(n_kv):
        pos = string(pos)
        out.append(Field(pos, 4, "vtype"))
        t = struct.unpack_from("<I", data, pos)[0]
        pos = value(pos + 4, t, True)
    for _ in range(n_tensors):
        pos = string(pos)
        out.append(Field(pos, 4, "ndims"))
        nd = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        for _ in range(nd):
            out.append(Field(pos, 8, "dim"))
            pos += 8
        out.append(Field(pos, 4, "ttype"))
        out.append(Field(pos + 4, 8, "offset"))
        pos += 12
    # String lengths are the most numerous; sample the structural fields more often.
    rare = [f for f in out if f.kind != "strlen"]
    return rare * 4 + [f for f in out if f.kind == "strlen"]


def mutate_gguf_field(rng: random.Random, data: bytes, fields: list[Field]) -> bytes:
    """One integer field (a count, a length, a type, a dimension, an offset) set to a boundary value
    or a small change of itself."""
    f = rng.choice(fields)
    b = bytearray(data)
    old = int.from_bytes(b[f.pos:f.pos + f.width], "little")
    if f.kind in ("vtype", "etype", "ttype"):
        new = rng.choice([rng.randrange(16), rng.randrange(64), 2**31 - 1, 2**32 - 1])
    elif rng.random() < 0.3:
        new = old + rng.choice((-1, 1, 2, 32, -32))
    else:
        new = boundary_int(rng)
    b[f.pos:f.pos + f.width] = (new % 2**(8 * f.width)).to_bytes(f.width, "little")
    return bytes(b)


# ------------------------------------------------------------------------- GGUF semantic level

def random_value(rng: random.Random, depth: int = 0):
    """A GGUF metadata value of any type, for ggufgen's writer."""
    t = rng.randrange(8)
    if t == 0:
        vt, bits, signed = rng.choice(((ggufgen.UINT32, 32, False), (ggufgen.UINT64, 64, False),
                                       (ggufgen.INT32, 32, True), (ggufgen.INT64, 64, True)))
        v = boundary_int(rng) % 2**bits  # wrapped into the type, as a writer's overflow would
        return ggufgen.typed(vt, v - 2**bits if signed and v >= 2**(bits - 1) else v)
    if t == 1:
        return rng.choice([0.0, -1.0, 1e-30, 1e30, float("nan"), float("inf"), -float("inf"), 1e4])
    if t == 2:
        return rng.choice(["", "none", "linear", "yarn", "llama", "gpt2", "\u0000", "x" * 1000, "8"])
    if t == 3:
        return rng.choice([True, False])
    if t == 4:
        return np.array([boundary_int(rng) % 2**32 for _ in range(rng.randint(0, 4))], np.uint32)
    if t == 5:
        return np.array([rng.random() for _ in range(rng.randint(0, 4))], np.float32)
    if t == 6 and depth < 3:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))] or ["a"]
    return ["a", "b"][: rng.randint(0, 2)] or ["x"]


def parse_seed(path: Path):
    """(metadata, tensors) of a seed file in the form ggufgen.build takes."""
    from tinydet.formats.gguf import GGUFFile

    g = GGUFFile(path)
    meta = {}
    for k, v in g.metadata.items():
        if isinstance(v, np.ndarray):
            v = np.array(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            v = ggufgen.typed(ggufgen.UINT32, v) if 0 <= v < 2**32 else ggufgen.typed(ggufgen.UINT64, v)
        meta[k] = v
    tensors = [(t.name, t.shape, t.ggml_type, g.tensor_bytes(t.name).tobytes()) for t in g.tensors.values()]
    return meta, tensors


def mutate_gguf_model(rng: random.Random, meta: dict, tensors: list) -> bytes:
    """The seed rebuilt with a metadata value of a wrong type or value, a key dropped, a tensor's
    name duplicated, its shape changed (overflowing products included) or its type changed."""
    meta, tensors = dict(meta), list(tensors)
    op = rng.randrange(6)
    keys = list(meta)
    if op == 0 or op == 1:
        for _ in range(rng.randint(1, 3)):
            meta[rng.choice(keys)] = random_value(rng)
    elif op == 2 and keys:
        del meta[rng.choice(keys)]
    elif op == 3 and len(tensors) > 1:
        i, j = rng.sample(range(len(tensors)), 2)
        tensors[i] = (tensors[j][0],) + tensors[i][1:]
    elif op == 4 and tensors:
        i = rng.randrange(len(tensors))
        name, shape, gtype, raw = tensors[i]
        shape = list(shape)
        choice = rng.randrange(4)
        if choice == 0:
            shape[rng.randrange(len(shape))] = rng.choice([2**32, 2**40, 2**62, 2**63 - 1, 2**64 - 1, 0, 1])
        elif choice == 1:
            shape = shape + [2**31]
        elif choice == 2:
            shape = shape[::-1]
        else:
            shape = [2**21, 2**21, 2**21][: rng.randint(1, 3)] + shape
        tensors[i] = (name, tuple(min(d, 2**64 - 1) for d in shape[:5]), gtype, raw)
    elif tensors:
        i = rng.randrange(len(tensors))
        name, shape, gtype, raw = tensors[i]
        tensors[i] = (name, shape, rng.choice([0, 1, 2, 3, 8, 12, 30, 31, 39]), raw)
    # A key arch-specific code reads: added with a random value now and then.
    if rng.random() < 0.3:
        arch = meta.get("general.architecture", "llama")
        arch = arch if isinstance(arch, str) else "llama"
        extra = rng.choice(["attention.key_length", "attention.value_length", "rope.scaling.type",
                            "rope.scaling.factor", "vocab_size", "attention.sliding_window",
                            "attention.sliding_window_pattern", "final_logit_softcapping", "rope.freq_base_swa",
                            "expert_count", "rope.dimension_count"])
        meta[f"{arch}.{extra}"] = random_value(rng)
    return ggufgen.build(meta, tensors)


# -------------------------------------------------------------------------------------- JSON

def random_json(rng: random.Random, depth: int = 0):
    t = rng.randrange(9)
    if t == 0:
        return boundary_int(rng) * rng.choice((1, 1, 2**64))
    if t == 1:
        return rng.choice([0.0, -0.0, 1e308, -1e-308, 0.5, float("nan"), float("inf")])
    if t == 2:
        return rng.choice(["", "F32", "BF16", "I64", "../x", "/etc/passwd", "model.safetensors",
                           "{{ x }}", "{% for x in range(10**9) %}{% endfor %}", "a" * 10000, "\ud800"])
    if t == 3:
        return rng.choice([True, False, None])
    if t == 4 and depth < 4:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if t == 5 and depth < 4:
        return {rng.choice(["a", "dtype", "shape", "data_offsets", "type", "content"]): random_json(rng, depth + 1)}
    if t == 6:
        return [2**rng.randrange(70) for _ in range(rng.randint(1, 4))]
    if t == 7:
        return [rng.choice([0, 1, 2**31, 2**63, 2**64 - 1, -1]), rng.choice([0, 1, 2**31, 2**63, 2**64 - 1, -1])]
    return "[" * 50 + "]" * 50


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:50]):  # long lists (vocabularies): their head is enough
            yield from _paths(v, prefix + (i,))


def mutate_json(rng: random.Random, obj, paths=None) -> str:
    """A JSON document with one node replaced, deleted or wrapped, or a key duplicated; then and
    again a byte-level mutation of the text, or nesting far past the recursion limit."""
    if rng.random() < 0.02:
        return '{"a": ' + "[" * 5000 + "]" * 5000 + "}"
    obj = json.loads(json.dumps(obj))  # a copy
    paths = paths if paths is not None else list(_paths(obj))
    for _ in range(rng.randint(1, 3)):
        p = rng.choice(paths)
        if not p:
            if rng.random() < 0.1:
                obj = random_json(rng)
            continue
        parent = obj
        try:
            for k in p[:-1]:
                parent = parent[k]
            last = p[-1]
            op = rng.randrange(4)
            if op == 0 and isinstance(parent, dict):
                del parent[last]
            elif op == 1:
                parent[last] = [parent[last]] if rng.random() < 0.5 else {"x": parent[last]}
            else:
                parent[last] = random_json(rng)
        except (KeyError, IndexError, TypeError):
            continue
    text = json.dumps(obj, ensure_ascii=rng.random() < 0.5)
    if rng.random() < 0.05 and text.startswith("{") and len(text) > 2:
        first = text[1:].split(",", 1)[0]
        text = "{" + first + ", " + text[1:]  # a duplicated key
    if rng.random() < 0.1:
        text = mutate_bytes(rng, text.encode("utf-8", "surrogatepass")).decode("utf-8", "replace")
    return text


# -------------------------------------------------------------------------------------- TOML

TOML_VALUES = ['""', '"../../etc/passwd"', '"/abs/path"', '"a b"', '-1', '0', '9223372036854775807',
               '18446744073709551616', 'inf', 'nan', 'true', '[]', '{}', '[1, "a"]', '1979-05-27T07:32:00Z',
               '"' + "f" * 64 + '"', '"http://example.com/x"', '"file:///etc/passwd"', '"https://[::1]/x"',
               '"\\u0000"', '"' + "a" * 5000 + '"', '[[1]]']


def mutate_toml(rng: random.Random, text: str) -> bytes:
    """A manifest with a value replaced, a line dropped or duplicated, or its bytes mutated."""
    lines = text.splitlines()
    op = rng.randrange(5)
    if op <= 1 and lines:
        i = rng.randrange(len(lines))
        if "=" in lines[i]:
            key = lines[i].split("=", 1)[0]
            lines[i] = f"{key}= {rng.choice(TOML_VALUES)}"
    elif op == 2 and lines:
        del lines[rng.randrange(len(lines))]
    elif op == 3 and lines:
        i = rng.randrange(len(lines))
        lines.insert(i, lines[i])
    else:
        return mutate_bytes(rng, text.encode())
    return ("\n".join(lines) + "\n").encode()


# ---------------------------------------------------------------------------- chat templates

# Jinja that runs away, reaches for Python internals, fails or does not parse; "@N@" is replaced by
# a boundary integer (or a size just past chat.MAX_CHARS).
JINJA_CONSTRUCTS = [
    "{% for i in range(@N@) %}{% endfor %}",
    "{% for i in range(@N@) %}{% for j in range(@N@) %}x{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for c in m.content * @N@ %}{{ c }}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(@N@) }}",
    "{% macro f() %}{{ caller() }}{% endmacro %}{% call f() %}{{ f() }}{% endcall %}",
    "{{ 'x' * @N@ }}", "{{ [1] * @N@ }}", "{{ (messages * @N@)|length }}", "{{ messages[0]['content'] * @N@ }}",
    "{{ ('x' * 8000000)|list|length }}", "{{ ('x' * 8000000)|sort|first }}", "{{ ('x' * 4000000)|unique|list }}",
    "{% set ns = namespace(l=[]) %}{% for i in range(@N@) %}{% set ns.l = ns.l + ['x' * 4000000] %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(@N@) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(@N@) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% set ns = namespace(x=7) %}{% for i in range(@N@) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "{{ ''.__class__ }}", "{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ cycler.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__.os }}", "{{ namespace.mro() }}", "{{ lipsum.__globals__ }}",
    "{{ raise_exception.__globals__['__builtins__'] }}", "{{ messages|attr('__class__') }}", "{{ self.__dict__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}", "{{ ''['__class__'] }}", "{{ (1).__class__.mro() }}",
    "{{ messages.pop() }}", "{{ messages.append(1) }}", "{{ {}.update(a=1) }}", "{{ strftime_now.__code__ }}",
    "{% set c = cycler(*range(@N@)) %}{{ c.next() }}{{ c.current }}", "{% set j = joiner('x' * @N@) %}{{ j() }}{{ j() }}",
    "{% set ns = namespace(a=@N@) %}{{ ns.a * ns.a }}", "{{ namespace(**{'x' * @N@: 1}) }}",
    "{{ 'x'|center(@N@) }}", "{{ 'a\n'|indent(@N@) }}", "{{ 'x'|truncate(@N@) }}", "{{ ('x ' * 1000)|wordwrap(@N@) }}",
    "{{ range(@N@)|batch(@N@)|list }}", "{{ range(@N@)|list|length }}", "{{ range(@N@)|join(',') }}",
    "{{ range(@N@)|sum }}", "{{ range(@N@)|sort|first }}", "{{ range(@N@)|slice(@N@)|list }}",
    "{{ range(@N@)|map('string')|join }}", "{{ messages|groupby('role') }}", "{{ messages|tojson(indent=@N@) }}",
    "{{ '%s'|format('x' * @N@) }}", "{{ '%*d' % (@N@, 1) }}", "{{ '%.*f' % (@N@, 1.5) }}", "{{ '{:@N@}'.format(1) }}",
    "{{ '{0:{1}}'.format(1, @N@) }}", "{{ 'x'.ljust(@N@) }}", "{{ 'x'.zfill(@N@) }}", "{{ '\t'.expandtabs(@N@) }}",
    "{{ 'x'.replace('', 'y' * @N@) }}", "{{ ('y' * 100000).join(['a'] * @N@) }}", "{{ @N@ ** @N@ }}",
    "{{ 2 ** @N@ }}", "{{ @N@ * @N@ * @N@ * @N@ }}", "{{ 1 / 0 }}", "{{ @N@ // 0 }}", "{{ @N@ % 0 }}",
    "{{ @N@|string|length }}", "{{ (@N@ * 1.0)|int }}", "{{ 1e308 * 10 }}", "{{ (1e308 * 10)|int }}",
    "{{ lipsum(@N@) }}", "{{ lipsum(1, True, @N@, @N@) }}", "{{ x|default('y' * @N@) }}", "{{ range(1, 2, 0) }}",
    "{{ messages|selectattr('role', 'equalto', 'user')|list }}", "{{ messages|map(attribute='nope')|list }}",
    "{{ messages|sum(attribute='content') }}", "{{ messages|dictsort }}", "{{ messages|max }}", "{{ messages[@N@] }}",
    "{{ messages[0]['content'][@N@:@N@] }}", "{{ messages[0]['content'][::0] }}", "{{ 'x'|int(base=@N@) }}",
    "{{ raise_exception('stop') }}", "{{ raise_exception() }}", "{{ raise_exception('a\nb') }}",
    "{{ raise_exception(messages) }}", "{{ raise_exception(@N@) }}", "{{ raise_exception('x' * @N@) }}",
    "{{ undefined_name }}", "{{ undefined_name.x.y }}", "{{ undefined_name() }}", "{{ undefined_name|length }}",
    "{% for x in undefined_name %}{% endfor %}", "{{ messages[0].nope.nope }}", "{{ messages[0]['content']() }}",
    "{{ strftime_now('%d' * @N@) }}", "{{ strftime_now(@N@) }}", "{{ strftime_now('%') }}",
    "{% if %}", "{% for %}", "{% endfor %}", "{% endif %}", "{% else %}", "{{", "}}", "{%", "%}", "{#", "{% raw %}",
    "{% macro %}", "{% set %}", "{% break %}", "{% continue %}", "{% include 'x' %}", "{% extends 'x' %}",
    "{% import 'x' as y %}", "{% from 'x' import y %}", "{% filter upper %}", "{% block b %}{% endblock %}",
    "{% with a = 1 %}", "{% endwith %}", "{% call %}", "{{ x | nofilter }}", "{{ x is notatest }}", "{% do 1 %}",
    "{{ " + "(" * 400 + "1" + ")" * 400 + " }}", "{{ " + "[" * 400 + "]" * 400 + " }}", "{% if 1 %}" * 300 + "{% endif %}" * 300,
    "{{ " + " + ".join(["1"] * 3000) + " }}", "{{ " + "-" * 3000 + "1 }}", "{% set x = " + "not " * 2000 + "1 %}",
]
TEMPLATE_SUFFIXES = [" * @N@", "|center(@N@)", "|indent(@N@)", ".__class__", "['__class__']", "|attr('__init__')",
                     "|list", "|tojson(indent=@N@)", "|sort", "|join(' ' * @N@)", "|batch(@N@)|list", "|slice(@N@)|list",
                     "|truncate(@N@)", "|wordwrap(@N@)", "|replace('', 'x' * @N@)", "|format(@N@)", "|int", "|float",
                     " ** @N@", "|string * @N@", "|first", "|last", "|random", "|trim * @N@", " ~ undefined_name",
                     "|unknownfilter", " + @N@", "[@N@]", ".nope", "()", "|tojson|length", "|length * @N@"]
TEMPLATE_CHARS = "{}%#-+~|()[]'\".,:=*/ \n\\xi0"
CHAT_SIZES = [0, 1, 2, 10, 100, 1000, 10**5, 10**6, 8 << 20, (8 << 20) + 1, 10**9, 2**31, 2**63 - 1, -1, -(2**63)]


def _construct(rng: random.Random, text: str) -> str:
    while "@N@" in text:
        text = text.replace("@N@", str(rng.choice(CHAT_SIZES) if rng.random() < 0.7 else boundary_int(rng)), 1)
    return text


def _tag_points(template: str) -> list[int]:
    """Where tags and expressions start or end: the places jinja constructs and splices fit."""
    return [0, len(template)] + [i for i in range(len(template)) if template.startswith(("{{", "{%", "{#"), i)] + [
        i + 2 for i in range(len(template)) if template.startswith(("}}", "%}", "#}"), i)]


def mutate_template(rng: random.Random, templates: list[str]) -> str:
    """A real template with characters flipped, fragments of two templates spliced, a jinja construct
    inserted between tags, a filter or operator appended to an expression, or a closing tag dropped."""
    t = rng.choice(templates)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(6)
        if op == 0 and t:
            for _ in range(rng.randint(1, 6)):
                i = rng.randrange(len(t))
                kind = rng.randrange(3)
                if kind == 0:
                    t = t[:i] + rng.choice(TEMPLATE_CHARS) + t[i + 1:]
                elif kind == 1:
                    t = t[:i] + t[i + rng.randint(1, 16):]
                else:
                    t = t[:i] + t[i:i + rng.randint(1, 32)] + t[i:]
        elif op == 1:
            u = rng.choice(templates)
            t = t[:rng.choice(_tag_points(t))] + u[rng.choice(_tag_points(u)):]
        elif op in (2, 3):
            i = rng.choice(_tag_points(t))
            t = t[:i] + _construct(rng, rng.choice(JINJA_CONSTRUCTS)) + t[i:]
        elif op == 4:
            ends = [i for i in range(len(t)) if t.startswith("}}", i)]
            if ends:
                i = rng.choice(ends)
                i -= t[i - 1:i] == "-"
                t = t[:i] + _construct(rng, rng.choice(TEMPLATE_SUFFIXES)) + " " + t[i:]
        else:
            tags = [i for i in range(len(t)) if t.startswith(("{%", "{{", "}}", "%}"), i)]
            if tags:
                i = rng.choice(tags)
                end = t.find("}", i + 2) if rng.random() < 0.5 else -1  # the whole tag, or its opener
                t = t[:i] + t[(end + 1 if end > 0 else i + 2):]
    if rng.random() < 0.05:
        t = mutate_bytes(rng, t.encode("utf-8", "surrogatepass")).decode("utf-8", "replace")
    if rng.random() < 0.02:
        t = t[:len(t) // 2] + "\ud800" + t[len(t) // 2:]  # a lone surrogate (valid in tokenizer_config.json)
    return t


CHAT_ROLES = ["system", "user", "assistant", "tool", "", "System", "ipython", "tool_results", "model", "developer",
              None, 5, ["user"], {"role": "user"}, "x" * 1000, "\u0000", "\ud800"]


def _content(rng: random.Random):
    return rng.choice(["", "Hi", " padded\n ", "\u0000", "\ud800", "{{ messages }}", "{% for %}", "<|im_end|>",
                       "x" * rng.choice((1000, 100_000, 1_000_000)), None, 5, 1.5, True, [], {},
                       [{"type": "text", "text": "hi"}, {"type": "image"}], {"content": "x"},
                       _nested(rng.randint(1, 400)), ["a"] * 1000])


def _nested(depth: int):
    v: object = "x"
    for _ in range(depth):
        v = [v] if depth % 2 else {"a": v}
    return v


def _tool_call(rng: random.Random):
    return rng.choice([{"id": "abcdefghi", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
                       {"function": {"name": "x" * 10000, "arguments": _nested(rng.randint(1, 400))}},
                       {"id": 5, "function": None}, {}, "call", None,
                       {"id": "abcdefghi", "function": {"name": "f", "arguments": "{\"x\": 1}"}}])


def mutate_messages(rng: random.Random, conversations: list[list[dict]]):
    """A real conversation with roles replaced, content removed or of another type, huge or nested,
    tool calls and tool results added, messages dropped, duplicated or shuffled; or not a list at all."""
    if rng.random() < 0.03:
        return rng.choice([[], None, 5, "user", {"role": "user", "content": "hi"}, [None], [[]], ["hi"]])
    msgs = [dict(m) for m in rng.choice(conversations)]
    for _ in range(rng.randint(0, 3)):
        if not msgs:
            break
        m = msgs[rng.randrange(len(msgs))]
        op = rng.randrange(8)
        if op == 0:
            m["role"] = rng.choice(CHAT_ROLES)
        elif op == 1:
            m.pop(rng.choice(["role", "content"]), None)
        elif op in (2, 3):
            m["content"] = _content(rng)
        elif op == 4:
            m["tool_calls"] = rng.choice([[_tool_call(rng)], [_tool_call(rng), _tool_call(rng)], [], None, "x"])
        elif op == 5:
            m.update(rng.choice([{"role": "tool", "tool_call_id": "abcdefghi"}, {"tool_call_id": 5},
                                 {"name": "f"}, {"tools": [{"function": {"name": "f"}}]}, {"__class__": "x"}]))
        elif op == 6:
            i = rng.randrange(len(msgs))
            msgs.insert(i, dict(msgs[i]))
        else:
            rng.shuffle(msgs)
    if rng.random() < 0.05 and len(json.dumps(msgs)) < 10_000:  # long conversations, not gigabyte files
        msgs = msgs * rng.choice((100, 1000))
    return msgs
