"""The command line's surface: C escapes in text options, the spellings shared by every command (old
ones kept as hidden aliases that say so), options that go together, generate's seeded default sampling,
its JSON timings and fingerprint, and serve's help against the server's routes."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import tinydet
from tinydet import cli
from tinydet.cli import main
from tinydet.cli.common import unescape


@pytest.mark.parametrize("typed, read", [
    (r"a\nb", "a\nb"), (r"\t\r", "\t\r"), (r"\\n", "\\n"), (r"\"\'", "\"'"), (r"\x41\x7e", "A~"),
    (r"\u00e9\u4e2d", "é中"), (r"\U0001F600", "\U0001F600"),
    (r"\q \x4 \u12 end\\", r"\q \x4 \u12 end" + "\\"),  # not escapes (or incomplete): kept as typed
    (r"\ud800", r"\ud800"), (r"\U00110000", r"\U00110000"),  # not characters: kept as typed
    ("no escapes", "no escapes"), ("\\", "\\"),
])
def test_unescape(typed, read):
    assert unescape(typed) == read


@pytest.fixture
def runner(monkeypatch, stories_models):
    """The commands load stories260K fp32 (already loaded) whatever --model says."""
    model = stories_models["fp32"]
    monkeypatch.setattr(cli, "_load", lambda *a, **k: model)
    return CliRunner(), model


def _json(r) -> dict:
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_stop_reads_escapes(runner):
    invoke, model = runner[0].invoke, runner[1]
    full = model.generate("Once upon", max_tokens=30).text
    assert "Lily" in full
    for stop in (r"\x4cily", r"\u004cily", "Lily"):
        out = _json(invoke(main, ["generate", "Once upon", "--max-tokens", "30", "--temperature", "0", "--json",
                                  "--stop", stop]))
        assert out["finish_reason"] == "stop" and out["text"] == full[:full.index("Lily")]
        assert out["settings"]["stop"] == ["Lily"]
    out = _json(invoke(main, ["generate", "Once upon", "--max-tokens", "2", "--json",
                              "--stop", r"\n", "--stop", r"a\\n"]))
    assert out["settings"]["stop"] == ["\n", "a\\n"]


def test_escape_flag_reads_the_prompt(runner):
    invoke, model = runner[0].invoke, runner[1]
    args = ["--max-tokens", "2", "--json"]
    plain = _json(invoke(main, ["generate", "Once upon", *args]))
    escaped = _json(invoke(main, ["generate", r"Once\x20upon", "-e", *args]))
    typed = _json(invoke(main, ["generate", r"Once\x20upon", *args]))
    assert escaped["prompt_token_ids"] == plain["prompt_token_ids"] == model.prompt_ids("Once upon")
    assert typed["prompt_token_ids"] == model.prompt_ids(r"Once\x20upon") != plain["prompt_token_ids"]


def test_default_sampling_is_seeded_and_temperature_0_is_greedy(runner):
    invoke, model = runner[0].invoke, runner[1]
    out = _json(invoke(main, ["generate", "Once upon", "--max-tokens", "40", "--json"]))
    want = model.generate("Once upon", max_tokens=40, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=0)
    assert out["token_ids"] == want.token_ids and out["logits_hash"] == want.logits_hash
    assert {k: out["settings"][k] for k in ("temperature", "top_k", "top_p", "min_p", "seed")} == \
        dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=0)
    greedy = model.generate("Once upon", max_tokens=40)  # the library's default: greedy
    assert out["token_ids"] != greedy.token_ids  # else this test could not tell the defaults apart
    out = _json(invoke(main, ["generate", "Once upon", "--max-tokens", "40", "--json", "--temperature", "0"]))
    assert out["token_ids"] == greedy.token_ids


def test_compile_clock():
    """numba's compiler-lock events, nested or not, summed once: the clock moves by their wall time."""
    from numba.core import event

    from tinydet.backends.compiletime import compile_seconds

    c0, t0 = compile_seconds(), time.perf_counter()
    event.start_event("numba:compiler_lock")
    event.start_event("numba:compiler_lock")  # a compile inside a compile
    time.sleep(0.2)
    event.end_event("numba:compiler_lock")
    assert compile_seconds() - c0 >= 0.2  # read while one is open
    event.end_event("numba:compiler_lock")
    t1, c1 = time.perf_counter(), compile_seconds()
    assert 0.2 <= c1 - c0 <= t1 - t0
    time.sleep(0.05)
    assert compile_seconds() == c1  # no event open: the clock stands


def test_json_reports_compile_apart_and_the_fingerprint(runner, monkeypatch):
    """A first call's compile (here a compile clock that jumps 1000 s in the prompt's pass) is reported
    as compile_seconds, not as prefill or decode time."""
    from tinydet.engine import scheduler

    invoke, model = runner[0].invoke, runner[1]
    forward, clock = model.backend.forward_batch, [0.0]

    def compiling_forward(*args, **kwargs):
        clock[0] += 1000.0 if clock[0] == 0 else 0.0
        return forward(*args, **kwargs)

    monkeypatch.setattr(scheduler, "compile_seconds", lambda: clock[0])
    monkeypatch.setattr(model.backend, "forward_batch", compiling_forward)
    out = _json(invoke(main, ["generate", "Once upon", "--max-tokens", "3", "--json"]))
    assert out["system_fingerprint"] == model.fingerprint
    assert out["compile_seconds"] == 1000.0 and out["prefill_seconds"] == 0.0
    assert 0 < out["decode_seconds"] < 1000 and out["tokens_per_second"] > 0.001
    g = model.generate("Once upon", max_tokens=3)  # the clock stands: nothing to take out
    assert g.compile_seconds == 0 and g.prefill_seconds > 0


def test_system_and_tools_need_chat(runner, tmp_path):
    invoke = runner[0].invoke
    r = invoke(main, ["generate", "hi", "--system", "Be brief."])
    assert r.exit_code == 2 and "--system only with --chat" in r.output and "Traceback" not in r.output
    r = invoke(main, ["generate", "hi", "--tool-choice", "required", "--template-kwargs", "{}"])
    assert r.exit_code == 2 and "--tool-choice, --template-kwargs only with --chat" in r.output


def test_old_spellings_work_with_a_note(runner, stories_path):
    invoke = runner[0].invoke
    r = invoke(main, ["bench", str(stories_path), "--new-tokens", "2", "--prompt-tokens", "4", "--repeats", "1",
                      "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["new_tokens"] == 2
    assert r.stderr.splitlines() == ["note: MODEL is deprecated; use --model",
                                     "note: --new-tokens is deprecated; use --max-tokens"]
    r = invoke(main, ["info", str(stories_path), "--verify"])
    assert r.exit_code == 0 and "(matches stories260k)" in r.stdout
    assert r.stderr == "note: --verify is deprecated; use --check-sha256\n"
    r = invoke(main, ["info", str(stories_path), "--check-sha256"])
    assert r.exit_code == 0 and "(matches stories260k)" in r.stdout and r.stderr == ""
    r = invoke(main, ["generate", "Once", "-m", str(stories_path), "--verify", "--max-tokens", "1"])
    assert r.exit_code == 0 and "note: --verify is deprecated; use --check-sha256" in r.stderr


def test_old_and_new_spelling_together_are_refused(runner, stories_path):
    invoke = runner[0].invoke
    r = invoke(main, ["bench", "-m", str(stories_path), "--max-tokens", "2", "--new-tokens", "3"])
    assert r.exit_code == 2 and "--max-tokens and --new-tokens (its old spelling) both given" in r.output
    r = invoke(main, ["golden", str(stories_path), "--model", str(stories_path), "--check", "x.json"])
    assert r.exit_code == 2 and "--model and MODEL (its old spelling) both given" in r.output


def test_help_hides_the_old_spellings():
    for command in ("generate", "chat", "verify", "bench", "golden", "trace", "serve", "rollout", "info", "pull"):
        r = CliRunner().invoke(main, [command, "--help"])
        assert r.exit_code == 0, r.output
        assert "--new-tokens" not in r.output and "--verify" not in r.output, command
    for command in ("generate", "chat", "verify", "bench", "golden", "trace", "serve", "rollout"):
        out = CliRunner().invoke(main, [command, "--help"]).output
        assert "-m, --model MODEL" in out, command
        assert re.search(r"Usage: .* \[OPTIONS\]\n", out) or "[PROMPT]" in out, out  # no positional MODEL


def test_dtype_help_names_native_types():
    from tinydet.packing.names import NATIVE_TYPES

    out = " ".join(CliRunner().invoke(main, ["generate", "--help"]).output.split())
    assert ", ".join(NATIVE_TYPES.values()) in out and "Q6_K" in out and "MXFP4" in out


def test_serve_help_lists_every_route():
    src = (Path(tinydet.__file__).parent / "serve" / "app.py").read_text(encoding="utf-8")
    routes = re.findall(r'Route\("([^"]+)"', src)
    assert "/tokenize" in routes and len(routes) >= 10
    out = CliRunner().invoke(main, ["serve", "--help"]).output
    for path in routes:
        assert re.sub(r"\{name:path\}", "NAME", path) in out, path
