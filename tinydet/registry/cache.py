"""The download cache: where a known model's file lives, its `.verified` stamp and the lock.

Files live at `cache_dir()/<name>/<filename>` (`$TINYDET_CACHE_DIR/models`, else
`$XDG_CACHE_HOME/tinydet/models` or `~/.cache/tinydet/models`). A file at the final name is always
complete and verified. Next to it `<filename>.verified` records the size, mtime and SHA-256 of the last
check, so a cached file is re-hashed only when it changed (or always with verify=True); a mismatch is an
error.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from ..errors import TinydetError
from ..hashing import file_sha256
from ..paths import cache_base
from .manifest import Manifest, _index, get_manifest, load_manifest


class IntegrityError(TinydetError):
    """A known model's cached file does not match its manifest's SHA-256."""

    def __init__(self, path, name: str):
        self.path = str(path)
        self.name = name
        super().__init__(f"{self.path}: sha256: file no longer matches its manifest SHA-256 ({name}); "
                         f"delete it or run `tinydet pull {name}` again")


def cache_dir() -> Path:
    """`$TINYDET_CACHE_DIR/models`, else `$XDG_CACHE_HOME/tinydet/models` or `~/.cache/tinydet/models`."""
    return cache_base() / "models"


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
