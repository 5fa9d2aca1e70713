"""Golden hashes: fixed requests whose output and logits hashes are recorded in the repository.

A golden file (JSON) names the model file by SHA-256 and lists cases: a request (prompt, dtype and
sampling settings) and the expected `output_hash` and `logits_hash`. A hash changes only on purpose,
with the reason in CHANGELOG.md; `tinydet golden --write` refuses to replace a file without
`--overwrite`.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import TinydetError
from ..jsonfile import write_json

SETTINGS = ("prompt", "dtype", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "json_schema", "regex",
            "grammar", "messages", "tools", "tool_choice", "chat_template")
HASHES = ("output_hash", "logits_hash", "message_hash")  # message_hash: a chat case's reply read back
# The tool-calling cases (a model with a chat template, where llguidance is installed): a required call,
# a sampled auto request, and a required call after reasoning under a template that opens <think> (as
# DeepSeek-R1's does; `chat_template` replaces the model's own for that case).
GOLDEN_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                "required": ["city"], "additionalProperties": False}}}]
THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
# The structured-outputs case (where llguidance is installed): JSON every model can finish in a few tokens.
STRUCTURED_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                      "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                     "required": ["name", "age"], "additionalProperties": False}


def default_cases(model_name: str, dtypes=("fp32", "fp16")) -> list[dict]:
    """The requests recorded for a model: greedy and seeded top-p sampling, in each of `dtypes` (fp32
    and fp16; int8 too for a file with quantized matrices), and one seeded request held to a JSON Schema."""
    if "stories" in model_name.lower():
        prompts, n = ["", "Once upon a time", "Lily and Ben went to the park."], 64
    else:
        prompts, n = ["Once upon a time", "The three primary colours are", "def fibonacci(n):"], 32
    cases = []
    for dtype in dtypes:
        for p in prompts:
            cases.append(dict(prompt=p, dtype=dtype, max_tokens=n, temperature=0.0))
            cases.append(dict(prompt=p, dtype=dtype, max_tokens=n, temperature=0.8, top_p=0.95, seed=42))
    from .. import structured

    if structured.available():
        cases.append(dict(prompt=prompts[1], dtype="fp32", max_tokens=n, temperature=0.8, top_p=0.95, seed=42,
                          json_schema=STRUCTURED_SCHEMA))
        if "stories" not in model_name.lower():  # stories260K has no chat template
            ask = [{"role": "user", "content": "What is the weather in Paris?"}]
            cases += [dict(messages=ask, tools=GOLDEN_TOOLS, tool_choice="required", dtype="fp32", max_tokens=n,
                           temperature=0.0),
                      dict(messages=ask, tools=GOLDEN_TOOLS, tool_choice="auto", dtype="fp32", max_tokens=n,
                           temperature=0.8, top_p=0.95, seed=42),
                      dict(messages=ask, tools=GOLDEN_TOOLS, tool_choice="required", chat_template=THINK_TEMPLATE,
                           dtype="fp32", max_tokens=2 * n, temperature=0.0)]
    if "stories" in model_name.lower():
        # The published llama2.c greedy text (256 tokens from BOS) pins this case to an outside reference.
        cases.insert(0, dict(prompt="", dtype="fp32", max_tokens=256, temperature=0.0))
    return cases


def run_cases(load, cases: list[dict]) -> list[dict]:
    """Run each case; `load(dtype)` returns a Model. Returns the cases with their hashes filled in."""
    out = []
    for case in cases:
        unknown = set(case) - set(SETTINGS) - set(HASHES)
        if unknown:
            raise TinydetError(f"golden case {case}: unknown fields {sorted(unknown)}")
        model = load(case["dtype"])
        kw = {k: case[k] for k in SETTINGS if k in case and k not in ("dtype",)}
        hashes = _run_chat(model, kw) if "messages" in kw else {}
        g = hashes.pop("g", None) or model.generate(**kw)
        out.append({**{k: case[k] for k in SETTINGS if k in case}, "output_hash": g.output_hash,
                    "logits_hash": g.logits_hash, **hashes})
    return out


def _run_chat(model, kw: dict) -> dict:
    """A chat case through Model.chat (under its own template where it names one): the result and the
    hash of its reply read back (content, reasoning, calls and their ids)."""
    import hashlib

    kw = dict(kw)
    template = kw.pop("chat_template", None)
    saved = model.tokenizer.chat_template
    if template is not None:
        model.tokenizer.chat_template = template
    try:
        g = model.chat(kw.pop("messages"), **kw)
    finally:
        model.tokenizer.chat_template = saved
    text = json.dumps(g.message.openai(), sort_keys=True, ensure_ascii=False)
    return {"g": g, "message_hash": hashlib.sha256(text.encode("utf-8")).hexdigest()}


def read_golden(path) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TinydetError(f"{path}: no such golden file") from None
    except json.JSONDecodeError as e:
        raise TinydetError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    for field in ("model", "model_sha256", "cases"):
        if field not in data:
            raise TinydetError(f"{path}: {field}: missing")
    return data


def write_golden(path, model_name: str, model_sha256: str, results: list[dict], overwrite: bool = False) -> None:
    path = Path(path)
    if path.exists() and not overwrite:
        raise TinydetError(f"{path}: exists; golden hashes change only on purpose — pass --overwrite and "
                           "record the reason in CHANGELOG.md")
    write_json(path, {"model": model_name, "model_sha256": model_sha256,
                      "note": "Regenerate with `tinydet golden MODEL --write FILE --overwrite`; say why in CHANGELOG.md.",
                      "cases": results})


def model_loader(path, threads: int | None = None, device: str = "cpu", **loaded):
    """`load(dtype)` for run_cases / check_golden: each dtype's Model loaded once (on `device`), on first
    use; `loaded` gives Models already at hand, by dtype."""
    from ..api import load

    models = dict(loaded)

    def get(dtype):
        if dtype not in models:
            models[dtype] = load(path, dtype=dtype, threads=threads, device=device)
        return models[dtype]

    return get


def check_golden(load, data: dict, model_sha256: str, native: bool = True) -> list[str]:
    """Mismatches as readable lines (empty when every hash matches). With `native`, every fp32 case
    runs again with dtype "native", which must give fp32's hashes."""
    if data["model_sha256"] != model_sha256:
        return [f"model file SHA-256 is {model_sha256}, the golden file is for {data['model_sha256']}"]
    wants = golden_runs(data, native)
    got = run_cases(load, [{k: c[k] for k in SETTINGS if k in c} for c in wants])
    bad = []
    for want, have in zip(wants, got):
        for h in HASHES:
            if h in want and want[h] != have.get(h):
                req = {k: want[k] for k in SETTINGS if k in want}
                bad.append(f"{req}: {h} {have[h][:16]} != golden {want[h][:16]}")
    return bad


def golden_runs(data: dict, native: bool = True) -> list[dict]:
    """The runs check_golden makes for `data`: its cases, and with `native` every fp32 case again with
    dtype "native" (which must give fp32's hashes)."""
    runs = list(data["cases"])
    if native:
        runs += [{**c, "dtype": "native"} for c in data["cases"] if c.get("dtype") == "fp32"]
    return runs


def n_checked(data: dict, native: bool = True) -> int:
    """How many runs check_golden makes for `data`."""
    return len(golden_runs(data, native))
