"""Packed panels kept on disk: a model file's `CPUWeights` for one dtype, written once after packing
and memory-mapped on later loads (no packing, and the pages are the page cache's, not copies).

  <cache>/panels/<model SHA-256>-<dtype>-<source hash>.tdp
      magic b"TDPANEL1" · uint64 header length · 32 bytes: SHA-256 of the data's chunk sums ·
      32 bytes: SHA-256 of the header · the header (JSON: the key, the data length, each array's
      offset, dtype and shape, and how the weights' attributes are rebuilt from the arrays) · the
      arrays, each at a multiple of 4096 bytes from the file's start.

The key names everything that decides the bytes: the model file's SHA-256, the dtype, and
`hashing.source_hash()` (the packers, formats and kernels: any edit gives a new file, and the old ones
of that model and dtype are removed). The model's SHA-256 is looked up by the file's (device, inode,
size, mtime_ns) (`hashing.model_sha256`), so a repeated load does not read the whole model to hash it;
a first load hashes the file in a thread while it packs.

Before use a file is checked whole: its magic, header hash, key and length, then every byte of the
data against the stored checksum (`_chunk_sums`, an integer mix of each 8-byte word and its index,
summed per MiB in parallel: any one changed word changes its chunk's sum, and it runs at memory speed).
A file that fails is removed and the model packed again. Files are written in a thread while the
freshly packed model is already in use (the process waits for it at exit), to a temporary name renamed
under a lock, so that processes starting together never see half a file; a read-only or full disk
gives a one-line warning and a normal load. TINYDET_NO_PANEL_CACHE=1 (or `load(panel_cache=False)`)
turns the cache off. Only dtypes whose panels are not much larger than the file are kept (native and
int8, whose panels are the file's bytes moved; fp16 of an F16 file; fp32 of an F32 file): fp32 panels
of a 4-bit file would take eight times its disk space.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
from numba import njit, prange

from .. import numerics  # noqa: F401  (first: numba's cache directory, before the checksum kernels compile)
from ..hashing import file_sha256, indexed_sha256, remember_sha256, source_hash
from ..paths import cache_base, file_lock
from .intpanels import IntPanels
from .layout import MixedPanels, QPanels

ENV_OFF = "TINYDET_NO_PANEL_CACHE"
MAGIC = b"TDPANEL1"
_PREFIX = struct.Struct("<8sQ32s32s")  # magic, header length, data checksum, header SHA-256
_ALIGN = 4096
_CHUNK_WORDS = 1 << 17  # 8-byte words per checksum chunk (1 MiB)
MAX_GROWTH = 1.25  # panels kept only when at most this times the model file's size
_FIELDS = ("qs", "d", "m", "sc", "qh")


def enabled(flag: bool | None = None) -> bool:
    """The cache is used unless `flag` is False, or (flag None) TINYDET_NO_PANEL_CACHE is set to
    anything but "" or "0"."""
    if flag is not None:
        return bool(flag)
    return os.environ.get(ENV_OFF, "") in ("", "0")


def cache_dir() -> Path:
    return cache_base() / "panels"


@njit(nogil=True, cache=True)
def _chunk_sum(words, base, c):
    """The sum, mod 2**64, of mix(w ^ (i * golden)) over the words w of `words` at file word index
    i = base + their index that fall in chunk c. The mix (xorshift, odd multiply, xorshift) is a
    bijection, so one changed word always changes its chunk's sum; the index makes moved words count.
    Integer sums are exact, so a chunk may be summed in pieces (the arrays written one after another)
    and on any machine: the same result."""
    s = np.uint64(0)
    for i in range(max(base, c * _CHUNK_WORDS), min(base + words.shape[0], (c + 1) * _CHUNK_WORDS)):
        x = words[i - base] ^ (np.uint64(i) * np.uint64(0x9E3779B97F4A7C15))
        x ^= x >> np.uint64(31)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(29)
        s += x
    return s


@njit(parallel=True, cache=True)
def _chunk_sums(words, base, out):
    """Add to out[c] `_chunk_sum` of every chunk c that `words` (at word index `base`) reaches."""
    for c in prange(base // _CHUNK_WORDS, (base + words.shape[0] + _CHUNK_WORDS - 1) // _CHUNK_WORDS):
        out[c] += _chunk_sum(words, base, c)


@njit(nogil=True, cache=True)
def _chunk_sums_serial(words, base, out):
    """`_chunk_sums` on the calling thread alone, the GIL let go: for a writer in the background, which
    must not launch parallel regions beside the model's (numba's workqueue layer takes one at a time)."""
    for c in range(base // _CHUNK_WORDS, (base + words.shape[0] + _CHUNK_WORDS - 1) // _CHUNK_WORDS):
        out[c] += _chunk_sum(words, base, c)


def _digest(sums: np.ndarray) -> bytes:
    return hashlib.sha256(sums.astype("<u8").tobytes()).digest()


def checksum(data: np.ndarray) -> bytes:
    """SHA-256 of the chunk sums of `data` (uint8, a multiple of 8 bytes long)."""
    words = data.view(np.uint64)
    sums = np.zeros(-(-words.shape[0] // _CHUNK_WORDS), np.uint64)
    _chunk_sums(words, 0, sums)
    return _digest(sums)


def _checksum_arrays(arrays: list[np.ndarray], length: int, sums_fn=_chunk_sums) -> bytes:
    """`checksum` of the data region `write` lays out (each array, then zeros to a multiple of 4096),
    from the arrays in memory: reading the written file back would map all of it next to them."""
    sums = np.zeros(-(-length // (8 * _CHUNK_WORDS)), np.uint64)
    pos = 0  # bytes
    for a in arrays:
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        whole = flat.size // 8 * 8
        if whole:
            sums_fn(flat[:whole].view(np.uint64), pos // 8, sums)
        tail = np.zeros(-(-a.nbytes // _ALIGN) * _ALIGN - whole, np.uint8)
        tail[:flat.size - whole] = flat[whole:]
        sums_fn(tail.view(np.uint64), (pos + whole) // 8, sums)
        pos += whole + tail.size
    return _digest(sums)


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# --------------------------------------------------------------------------- weights <-> arrays

def _describe(obj, arrays: list, ids: dict):
    """A JSON description of one attribute of the weights; its arrays appended to `arrays` once."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    if isinstance(obj, (tuple, list)):
        return {"tuple" if isinstance(obj, tuple) else "list": [_describe(x, arrays, ids) for x in obj]}
    if isinstance(obj, np.ndarray):
        if id(obj) not in ids:
            ids[id(obj)] = len(arrays)
            arrays.append(obj)
        return {"array": ids[id(obj)]}
    if isinstance(obj, (QPanels, IntPanels)):
        return {"qpanels" if isinstance(obj, QPanels) else "intpanels": [obj.ggml_type, obj.n, obj.k],
                "fields": [_describe(getattr(obj, f), arrays, ids) for f in _FIELDS]}
    if isinstance(obj, MixedPanels):
        return {"mixed": [obj.n, obj.k], "parts": [_describe(p, arrays, ids) for p in obj.parts],
                "table": _describe(obj.table, arrays, ids)}
    raise TypeError(f"panel cache: cannot store a {type(obj).__name__}")  # the load then packs, uncached


def _rebuild(desc, arrays: list[np.ndarray]):
    if desc is None:
        return None
    if "value" in desc:
        return desc["value"]
    if "tuple" in desc or "list" in desc:
        items = [_rebuild(x, arrays) for x in desc.get("tuple", desc.get("list"))]
        return tuple(items) if "tuple" in desc else items
    if "array" in desc:
        return arrays[desc["array"]]
    if "qpanels" in desc:
        t, n, k = desc["qpanels"]
        return QPanels(t, n, k, *(_rebuild(f, arrays) for f in desc["fields"]))
    if "intpanels" in desc:
        t, n, k = desc["intpanels"]
        return IntPanels(t, n, k, *(_rebuild(f, arrays) for f in desc["fields"]))
    n, k = desc["mixed"]
    return MixedPanels(n, k, tuple(_rebuild(p, arrays) for p in desc["parts"]), _rebuild(desc["table"], arrays))


def _layout(weights) -> tuple[dict, list[np.ndarray]]:
    arrays, ids = [], {}
    attrs = {name: _describe(v, arrays, ids) for name, v in sorted(vars(weights).items())}
    return attrs, arrays


# --------------------------------------------------------------------------- files

def cache_path(sha: str, dtype: str) -> Path:
    return cache_dir() / f"{sha}-{dtype}-{source_hash()[:16]}.tdp"


def _key(sha: str, dtype: str) -> dict:
    return {"model_sha256": sha, "dtype": dtype, "source": source_hash(), "byteorder": sys.byteorder}


def read(path: Path, key: dict) -> dict | None:
    """The weights' attributes from a cache file, its arrays views of a private map of it; None when
    the file is missing, or is not whole and exactly what `key` names (then it is removed)."""
    try:
        f = open(path, "rb")
    except OSError:
        return None
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            if size < _PREFIX.size:
                raise ValueError("short")
            magic, hlen, data_sum, head_sum = _PREFIX.unpack(f.read(_PREFIX.size))
            if magic != MAGIC or hlen > size - _PREFIX.size:
                raise ValueError("magic")
            head = f.read(hlen)
            if hashlib.sha256(head).digest() != head_sum:
                raise ValueError("header")
            header = json.loads(head)
            start, length = header["data_offset"], header["data_length"]
            if header["key"] != key or start % _ALIGN or length % _ALIGN or start + length != size:
                raise ValueError("key")
            # A private (copy-on-write) map: writable arrays, as the kernels were compiled for, whose
            # pages stay the page cache's as long as nothing writes them (nothing does).
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            buf = np.frombuffer(mm, np.uint8)
            if checksum(buf[start:start + length]) != data_sum:
                raise ValueError("data")
            arrays = [buf[off:off + int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize].view(dt).reshape(shape)
                      for off, dt, shape in header["arrays"]]
            return {name: _rebuild(d, arrays) for name, d in header["attrs"].items()}
        except (ValueError, KeyError, TypeError, OSError, struct.error):
            _unlink(path)
            return None


def _sweep(folder: Path, age: float = 3600.0) -> None:
    """Remove temporary files an hour old: what a writer killed outright (no cleanup ran) left."""
    now = time.time()
    for tmp in folder.glob("*.tdp.*.tmp"):
        try:
            if now - tmp.stat().st_mtime > age:
                tmp.unlink()
        except OSError:
            pass


def write(path: Path, key: dict, weights, sums_fn=_chunk_sums) -> None:
    """Write `weights` (a CPUWeights) to `path`: a temporary file, checksummed (by `sums_fn`), then
    renamed."""
    attrs, arrays = _layout(weights)
    entries, off = [], 0
    for a in arrays:
        entries.append((off, a.dtype.str, list(a.shape)))
        off += -(-a.nbytes // _ALIGN) * _ALIGN
    length = off
    header = {"key": key, "attrs": attrs, "data_length": length, "data_offset": 0, "arrays": entries}
    # the header's length depends on the offsets it lists: fix the data offset, then shift every array
    head_room = -(-(_PREFIX.size + len(json.dumps(header)) + 24 * len(arrays) + 64) // _ALIGN) * _ALIGN
    header["data_offset"] = head_room
    header["arrays"] = [(o + head_room, dt, shape) for o, dt, shape in entries]
    head = json.dumps(header).encode()
    if _PREFIX.size + len(head) > head_room:
        raise AssertionError("panel cache header outgrew its room")
    path.parent.mkdir(parents=True, exist_ok=True)
    _sweep(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w+b") as f:
            f.write(bytes(head_room))
            for a in arrays:
                f.write(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))
                f.write(bytes(-a.nbytes % _ALIGN))
            f.seek(0)
            f.write(_PREFIX.pack(MAGIC, len(head), _checksum_arrays(arrays, length, sums_fn), hashlib.sha256(head).digest())
                    + head)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _pack_hashing(model_path: Path, pack: Callable[[], object]):
    """(pack(), the file's SHA-256 or None if it could not be read), the hash computed in a thread
    meanwhile (hashlib lets go of the GIL)."""
    result = {}

    def hash_it():
        try:
            result["sha"] = file_sha256(model_path)
        except OSError:
            pass
    hasher = threading.Thread(target=hash_it, name="tinydet-sha256", daemon=True)
    hasher.start()
    try:
        weights = pack()
    finally:
        hasher.join()
    return weights, result.get("sha")


_writers: dict[Path, threading.Thread] = {}  # cache files being written in the background, by path
_writers_lock = threading.Lock()


def wait(path: Path | None = None) -> None:
    """Return once the cache file at `path` (every one, when None) is no longer being written."""
    with _writers_lock:
        pending = list(_writers.values()) if path is None else [_writers[path]] if path in _writers else []
    for t in pending:
        t.join()


def _store(path: Path, key: dict, weights, sha: str, dtype: str) -> None:
    """Write the cache file (unless another process has meanwhile) and remove that model's files of
    older sources; a disk that refuses gives a one-line warning. Runs in a thread of low priority while
    the model is used: its checksum is serial and lets go of the GIL, so the forward passes keep the
    cores and the interpreter."""
    if sys.platform.startswith("linux"):  # Linux takes a thread's id for PRIO_PROCESS; elsewhere it names a process
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except OSError:
            pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(str(path) + ".lock"):
            if not path.exists():
                write(path, key, weights, _chunk_sums_serial)
        for old in path.parent.glob(f"{sha}-{dtype}-*.tdp"):  # files of an older source
            if old != path:
                _unlink(old)
    except Exception as e:  # noqa: BLE001 - the model is in use already: a failed write only warns
        why = e.strerror if isinstance(e, OSError) and e.strerror else e
        sys.stderr.write(f"tinydet: packed panels not cached ({why}); loading normally\n")
    finally:
        with _writers_lock:
            if _writers.get(path) is threading.current_thread():
                del _writers[path]


def load_or_pack(model_path: Path, dtype: str, pack: Callable[[], object], rebuild: Callable[[dict], object]):
    """The weights of `model_path` for `dtype`: from the cache when a whole, current file is there,
    else `pack()`ed and (when small enough) written for next time, in a thread, so that the model is
    ready as soon as it is packed (not a daemon: the process waits for the file at exit, and a file cut
    short is only ever a temporary name). `rebuild(attrs)` makes the weights object from the cached
    attributes."""
    model_path = Path(model_path).resolve()
    sha, weights = indexed_sha256(model_path), None
    if sha is None:  # a file not seen before: hashed while it is packed
        weights, sha = _pack_hashing(model_path, pack)
        if sha is None:
            return weights
        remember_sha256(model_path, sha)
    key, path = _key(sha, dtype), cache_path(sha, dtype)
    if weights is None:
        wait(path)  # this process's own write of it, still under way
        attrs = read(path, key)
        if attrs is not None:
            return rebuild(attrs)
        weights = pack()
    try:
        _, arrays = _layout(weights)
    except TypeError:  # weights holding something this file cannot describe: packed on every load
        return weights
    if sum(a.nbytes for a in arrays) > MAX_GROWTH * model_path.stat().st_size:
        return weights
    # daemon=False outright: a thread inherits its creator's flag, and `tinydet serve` loads in a daemon
    writer = threading.Thread(target=_store, args=(path, key, weights, sha, dtype), name="tinydet-panel-cache",
                              daemon=False)
    with _writers_lock:
        if path in _writers:  # another thread of this process writes it
            return weights
        _writers[path] = writer
    writer.start()
    return weights
