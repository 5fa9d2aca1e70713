"""Tool calls at scale: the share of required and named calls that parse and validate against their
function's schema (checked by `jsonschema`), and decode tok/s with tools offered and a call being
written against the same prompt unconstrained.

    python bench/tools.py [--model smollm2-135m-instruct] [--model gemma3-270m] [--requests 200]
                          [--dtype native] [--threads 2] [--max-tokens 160] [--speed-tokens 64] [--json]

A model file without a chat template (Gemma 3 270M's on PyPI is the base model's) gets Gemma 3's own,
as tests/gemma3gen.py keeps it. Requests: --requests per model, varied: 6 tool sets (one function of scalars, enums and bounds, nested
objects, arrays, several functions, a function of no arguments) x 8 prompts (questions, instructions,
chit-chat, code) x tool_choice required or one named function x greedy or temperature 0.7 (seeded).
A call counts as valid when the answer's `tool_calls` is non-empty and each call's arguments parse as
JSON and validate against its schema; a request cut by --max-tokens inside its call is reported apart
("cut": no call to check). Decode tok/s is `Generation`'s (tokens after the first over the time after
the first token); the speed pair alternates within each round, medians over rounds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import jsonschema

import tinydet


def fn(name, desc, props, required=None):
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": list(props) if required is None else required,
        "additionalProperties": False}}}


STR = {"type": "string", "maxLength": 40}
TOOLSETS = [
    [fn("get_weather", "The weather in a city.", {"city": STR, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}})],
    [fn("book_flight", "Book a flight.", {"origin": STR, "destination": STR, "passengers": {"type": "integer", "minimum": 1,
                                                                                             "maximum": 9}})],
    [fn("create_event", "Add a calendar event.", {"title": STR, "when": {"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}, "hour": {"type": "integer", "minimum": 0,
                                                                                       "maximum": 23}},
        "required": ["date", "hour"], "additionalProperties": False}})],
    [fn("tag_items", "Tag items.", {"items": {"type": "array", "items": STR, "minItems": 1, "maxItems": 4},
                                    "label": STR})],
    [fn("search", "Search the web.", {"query": STR, "top": {"type": "integer", "minimum": 1, "maximum": 10}}, ["query"]),
     fn("calculator", "Evaluate arithmetic.", {"expression": STR}), fn("send_email", "Send an email.",
                                                                         {"to": STR, "subject": STR, "body": STR})],
    [fn("get_time", "The current time.", {})],
]
PROMPTS = ["What's the weather in Lisbon?", "Book me a trip from Oslo to Rome for two.",
           "Remind me about the dentist next Tuesday at 3pm.", "Tag these: apples, pears, plums.",
           "How much is 17 times 23?", "Tell me something nice.", "Write a Python function that reverses a list.",
           "Email Sam that the meeting moved to Friday."]


def requests(n: int):
    combos = itertools.cycle(itertools.product(range(len(TOOLSETS)), range(len(PROMPTS)), (False, True), (0.0, 0.7)))
    for i, (t, p, named, temp) in zip(range(n), combos):
        tools = TOOLSETS[t]
        pick = tools[i % len(tools)]["function"]["name"]
        choice = {"type": "function", "function": {"name": pick}} if named else "required"
        yield tools, PROMPTS[p], choice, temp, i


def check(g, tools) -> str:
    """"valid", "cut" (max_tokens inside the call) or "invalid"."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    calls = g.message.tool_calls
    if not calls:
        return "cut" if g.finish_reason == "length" else "invalid"
    try:
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])
    except (ValueError, KeyError, jsonschema.ValidationError):
        return "invalid"
    return "valid"


def run(model_name, args) -> dict:
    model = tinydet.load(model_name, dtype=args.dtype, threads=args.threads)
    if model.tokenizer.chat_template is None:  # Gemma 3 270M's file (the base model's) carries none
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from gemma3gen import CHAT_TEMPLATE  # Gemma 3's own template, as the tests keep it

        model.tokenizer.chat_template = CHAT_TEMPLATE
    counts = {"valid": 0, "cut": 0, "invalid": 0}
    for tools, prompt, choice, temp, i in requests(args.requests):
        g = model.chat([{"role": "user", "content": prompt}], max_tokens=args.max_tokens, tools=tools,
                       tool_choice=choice, temperature=temp, seed=i, parallel_tool_calls=False)
        counts[check(g, tools)] += 1
    # speed: one call being written (named, so every step is inside the call) vs the same prompt plain
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    speeds = {"tools": [], "plain": []}
    for _ in range(args.rounds):
        g = model.chat(msgs, max_tokens=args.speed_tokens, tools=TOOLSETS[4], tool_choice="required")
        speeds["tools"].append(g.tokens_per_second)
        ids = model.chat_prompt(msgs, tools=TOOLSETS[4])  # the same prompt, tools in it, no grammar
        speeds["plain"].append(model.generate(ids, max_tokens=len(g.token_ids)).tokens_per_second)
    tools_tps, plain_tps = statistics.median(speeds["tools"]), statistics.median(speeds["plain"])
    return {"model": model_name, "dtype": args.dtype, "requests": args.requests, **counts,
            "valid_share": counts["valid"] / max(1, counts["valid"] + counts["invalid"]),
            "decode_tps_tools": tools_tps, "decode_tps_plain": plain_tps, "ratio": tools_tps / plain_tps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=None)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--dtype", default="native")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--speed-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.json:  # a line per model, as each is done
        for m in args.model or ["smollm2-135m-instruct", "gemma3-270m"]:
            print(json.dumps(run(m, args)), flush=True)
        return
    rows = [run(m, args) for m in args.model or ["smollm2-135m-instruct", "gemma3-270m"]]
    print(f"{'model':24} {'requests':>8} {'valid':>6} {'cut':>4} {'invalid':>7} {'tools tok/s':>11} "
          f"{'plain tok/s':>11} {'ratio':>6}")
    for r in rows:
        print(f"{r['model']:24} {r['requests']:>8} {r['valid']:>6} {r['cut']:>4} {r['invalid']:>7} "
              f"{r['decode_tps_tools']:>11.1f} {r['decode_tps_plain']:>11.1f} {r['ratio']:>6.2f}")


if __name__ == "__main__":
    sys.exit(main())
