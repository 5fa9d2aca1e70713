"""Concurrent use: two processes pulling one model download it once (the lock on its cache entry)
and both end with the verified file; eight threads sharing one Model through generate, stream and
generate_batch each get the bits the same request gets alone; two models with different dtypes and
thread counts run at once and keep their own settings and bits."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numba
import pytest

import tinydet
from test_registry import DATA, final_path, isolated, server, url_source, write_manifest  # noqa: F401 (fixtures)
from tinydet import registry

# --------------------------------------------------------------------------------- two processes


def _holds(pid: int, path: Path) -> bool:
    """Whether process `pid` has `path` open (it holds, or waits for, the lock on it)."""
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def test_two_processes_pulling_at_once_download_once(isolated, server):
    """The server holds the first request until the second process is seen at the lock (or, with no
    lock, until its own request arrives): so the two pulls truly overlap."""
    if not Path(f"/proc/{os.getpid()}/fd").is_dir():
        pytest.skip("needs /proc/PID/fd to see both processes at the lock")
    write_manifest(isolated, sources=[url_source(server, "/tiny.bin")])
    lock = final_path().parent / ".lock"
    gate = threading.Event()
    server.routes["/tiny.bin"].mode = "gated"
    real_get = server.RequestHandlerClass.do_GET

    class Gated(server.RequestHandlerClass):
        def do_GET(self):
            if self.server.routes[self.path].mode == "gated":
                gate.wait(120)
                self.server.routes[self.path].mode = "ok"
            real_get(self)

    server.RequestHandlerClass = Gated
    env = dict(os.environ, NUMBA_CACHE_DIR=numba.config.CACHE_DIR)
    procs = [subprocess.Popen([sys.executable, "-m", "tinydet", "pull", "tiny"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env) for _ in range(2)]
    deadline = time.monotonic() + 300
    while not gate.is_set() and time.monotonic() < deadline:
        if all(_holds(p.pid, lock) for p in procs) or len(server.log) >= 2 or any(p.poll() is not None for p in procs):
            gate.set()
        time.sleep(0.01)
    gate.set()
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err.decode()
        assert out.decode().strip() == str(final_path())
    assert [path for path, _, _ in server.log] == ["/tiny.bin"]  # one download between them
    assert final_path().read_bytes() == DATA and registry.verify_file(final_path())[1:] == ("tiny", True)
    assert sorted(p.name for p in final_path().parent.iterdir()) == [".lock", "tiny.bin", "tiny.bin.verified"]


# ----------------------------------------------------------------------------- threads, one Model

JOBS = [dict(prompt="Once upon a time", max_tokens=24),
        dict(prompt="The little dog", max_tokens=20, temperature=0.8, seed=1),
        dict(prompt="Lily went to the park", max_tokens=16, temperature=1.0, top_k=40, seed=2),
        dict(prompt="One day", max_tokens=24, temperature=0.7, top_p=0.9, seed=3)]


def _bits(g) -> tuple:
    return g.token_ids, g.output_hash, g.logits_hash, g.text


def _run_threads(n: int, work) -> list[str]:
    """Run work(i) on n threads started together; the errors each raised or reported."""
    errors, barrier = [], threading.Barrier(n)

    def run(i):
        try:
            barrier.wait()
            errors.extend(work(i))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(f"thread {i}: {e!r}")

    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(600)
    assert not any(t.is_alive() for t in ts), "a thread did not finish within 600 s"
    return errors


def test_eight_threads_sharing_one_model_get_their_solo_bits(stories_models):
    model = stories_models["fp32"]
    solo = [_bits(model.generate(**j)) for j in JOBS]
    pairs = [(i, (i + 1) % len(JOBS)) for i in range(len(JOBS))]
    solo_batch = {p: [_bits(g) for g in model.generate_batch([JOBS[p[0]], JOBS[p[1]]])] for p in pairs}
    assert all(solo_batch[(a, b)] == [solo[a], solo[b]] for a, b in pairs)  # batching alone changes nothing

    def work(i):
        j = i % len(JOBS)
        bad = []
        for _ in range(2):
            if _bits(model.generate(**JOBS[j])) != solo[j]:
                bad.append(f"thread {i}: generate differs from alone")
            if "".join(model.stream(**JOBS[j])) != solo[j][3]:
                bad.append(f"thread {i}: stream differs from alone")
            pair = pairs[j]
            if [_bits(g) for g in model.generate_batch([JOBS[pair[0]], JOBS[pair[1]]])] != solo_batch[pair]:
                bad.append(f"thread {i}: generate_batch differs from alone")
        return bad

    assert _run_threads(8, work) == []


def test_two_models_of_different_dtypes_and_threads_at_once(stories_path):
    """fp32 on 1 thread and fp16 on 2, side by side on four Python threads: each keeps its dtype,
    its thread count (as numba sees it inside the pass) and its own bits."""
    limit = numba.config.NUMBA_NUM_THREADS
    models = {"fp32": tinydet.load(stories_path, dtype="fp32", threads=1),
              "fp16": tinydet.load(stories_path, dtype="fp16", threads=min(2, limit))}
    want = {d: _bits(m.generate(**JOBS[0])) for d, m in models.items()}
    assert want["fp32"][2] != want["fp16"][2]  # the two dtypes do compute different bits
    seen = {d: set() for d in models}
    for d, m in models.items():
        m.backend.hooks.append(lambda layer, op, pos, slots, rows, d=d: seen[d].add(numba.get_num_threads()))
    names = sorted(models)

    def work(i):
        d = names[i % 2]
        bad = []
        for _ in range(3):
            g = models[d].generate(**JOBS[0])
            if _bits(g) != want[d]:
                bad.append(f"{d}: bits differ from alone")
            if (g.settings["dtype"], g.settings["threads"]) != (d, models[d].threads):
                bad.append(f"{d}: settings {g.settings['dtype']}, {g.settings['threads']} threads")
        return bad

    assert _run_threads(4, work) == []
    assert seen == {"fp32": {1}, "fp16": {min(2, limit)}}


# --------------------------------------------------------------------------------- numba's cache


def test_kernels_saved_at_once_keep_their_own_machine_code(tmp_path, monkeypatch):
    """Processes compiling different signatures of one kernel at once (servers started together on a
    fresh cache, parallel test workers) each save into numba's cache. numba's own save reads the index,
    takes the first free data file, then rewrites the index: savers that all read it before any wrote
    would all take `f.1.nbc`, and the index would point signatures at each other's code. tinydet's
    save (installed with the CPU backend) locks the index; here eight threads save at once, each
    reading the index slowly, and every signature still loads its own data."""
    from numba.core.caching import IndexDataCacheFile

    import tinydet.backends.cpu  # noqa: F401 (installs the locked save)

    assert IndexDataCacheFile._tinydet_locked
    slow_read = IndexDataCacheFile._load_index

    def load_index(self):
        overloads = slow_read(self)
        time.sleep(0.05)  # every unlocked saver reads the empty index before the first one writes
        return overloads

    monkeypatch.setattr(IndexDataCacheFile, "_load_index", load_index)
    files = [IndexDataCacheFile(str(tmp_path), "kernel-12.py311", "stamp") for _ in range(8)]
    threads = [threading.Thread(target=f.save, args=((f"signature {i}",), f"machine code {i}".encode()))
               for i, f in enumerate(files)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.setattr(IndexDataCacheFile, "_load_index", slow_read)
    fresh = IndexDataCacheFile(str(tmp_path), "kernel-12.py311", "stamp")
    assert [fresh.load((f"signature {i}",)) for i in range(8)] == [f"machine code {i}".encode() for i in range(8)]
    assert len(list(tmp_path.glob("kernel-12.py311.*.nbc"))) == 8
