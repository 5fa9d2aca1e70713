"""Where the GPU backend's kernels (kernels.cu) run: `CudaDevice`, an NVIDIA GPU through CuPy, or
`HostDevice`, the same source built by the host's C++ compiler into a serial emulator that runs each
launch's threads one after another on the CPU.

For the GPU, `nvrtc_build` builds the source with NVRTC (through cuda-bindings) for the GPU's own
architecture (sm_90 on an H100/H200) into PTX and, from that PTX, machine code (a cubin), and CuPy loads
the cubin: CuPy's own compile path (RawModule from source) appends -ftz=true to every build, which
would flush subnormals to zero, so it is not used; and a driver older than NVRTC refuses NVRTC's PTX
(CUDA's minor-version compatibility covers machine code, not PTX), so PTX is loaded only for a GPU
newer than NVRTC knows. The PTX of that build is what tests/test_cuda.py lints.

The emulator exists so that a machine without a GPU can check the kernels' arithmetic. A KERNEL's
threads never read what another thread of the same launch writes, so running them in any order
computes what the GPU computes. A BLOCK_KERNEL's threads share shared memory between barriers: the
emulator runs each thread block as one call, in which each stretch between barriers loops over the
block's threads (kernels.cu's FOR_THREADS and SYNC). No kernel uses warp operations or atomics. Both
builds keep every float operation as written (NVRTC: --fmad=false and IEEE division and square root;
the host: -ffp-contract=off, SSE arithmetic), so the emulator's bits are the GPU's bits for the same
operations; what it cannot check is NVRTC's code generation and the GPU itself (tests/test_cuda.py
lints the PTX for the first; tools/gpu_check.sh is the check on a GPU).

A device gives: `xp` (cupy or numpy), `context()` (inside which its array operations are ordered with
its kernels), `to_device(array)`, `to_host(array)`, `put(array, host array)`, and `launch(name, grid,
block, args)`, each argument checked against the kernel's C signature (a wrong dtype or a missing
argument raises here instead of reading the wrong bytes on the device).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from ...errors import TinydetError
from ...paths import cache_base

SOURCE_PATH = Path(__file__).with_name("kernels.cu")
# NVRTC's options: no contraction into FMA (its default fuses a * b + c), IEEE division and square
# root, subnormals kept (the defaults, written out so that a changed default cannot move a bit).
NVRTC_OPTIONS = ("--fmad=false", "--prec-div=true", "--prec-sqrt=true", "--ftz=false", "--std=c++14")
HOST_FLAGS = ("-O2", "-std=c++14", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")

_POINTERS = {"float": np.float32, "double": np.float64, "long long": np.int64, "void": None}
_SCALARS = {"int": np.int32, "long long": np.int64, "float": np.float32, "double": np.float64}


@lru_cache(maxsize=None)
def source() -> str:
    return SOURCE_PATH.read_text(encoding="utf-8")


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        raise TinydetError("device cuda: cuda-bindings (NVRTC's Python binding) is not installed (pip install "
                           "'tinydet[cuda12]' or 'tinydet[cuda13]', matching your CUDA driver)") from None
    return nvrtc


def nvrtc_arch(cc: int) -> str:
    """The -arch for a GPU of compute capability `cc` (90 for sm_90): its own (machine code), or, for a
    GPU newer than NVRTC knows, the newest virtual architecture below it (PTX, which the driver then
    compiles for the GPU)."""
    nvrtc = _nvrtc()
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    fit = [a for a in archs if a <= cc] if err == nvrtc.nvrtcResult.NVRTC_SUCCESS else []
    if not fit:
        raise TinydetError(f"device cuda: NVRTC cannot build for compute capability {cc / 10:.1f}")
    return f"sm_{cc}" if cc in fit else f"compute_{max(fit)}"


def nvrtc_build(code: str, arch: str, options: tuple = NVRTC_OPTIONS) -> tuple[str, bytes | None]:
    """`code` built by NVRTC for `arch` with `options`: the PTX text and, for a real architecture
    ("sm_90"), the machine code ptxas made of that PTX (None for a virtual one, "compute_90")."""
    nvrtc = _nvrtc()
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    err, prog = nvrtc.nvrtcCreateProgram(code.encode(), SOURCE_PATH.name.encode(), 0, [], [])
    if err != ok:
        raise TinydetError(f"NVRTC: {err}")
    try:
        opts = [f"-arch={arch}".encode(), *(o.encode() for o in options)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != ok:
            _, n = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * n
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise TinydetError(f"NVRTC could not build {SOURCE_PATH.name} for {arch}:\n"
                               f"{log.decode(errors='replace').strip()[-4000:]}")
        _, n = nvrtc.nvrtcGetPTXSize(prog)
        ptx = b" " * n
        nvrtc.nvrtcGetPTX(prog, ptx)
        cubin = None
        if arch.startswith("sm_"):
            _, n = nvrtc.nvrtcGetCUBINSize(prog)
            cubin = b" " * n
            nvrtc.nvrtcGetCUBIN(prog, cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return ptx.decode().rstrip("\0"), cubin


def _cached(name: str, key: str, make) -> Path:
    """A file under the cache (`name` with `key` in it) made once by make(tmp_path), renamed into place
    whole, so that a concurrent or interrupted build never leaves half a file under the final name."""
    path = cache_base() / name.format(key=key)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            part = Path(tmp) / "part"
            make(part)
            os.replace(part, path)
    return path


_MACROS = ("STORAGE_KERNELS", "INT_KERNELS")  # kernels.cu's kernel-making macros: MACRO(NAME, KIND) lines


@lru_cache(maxsize=None)
def _kernel_decls() -> list[tuple[bool, str, str]]:
    """(is a BLOCK_KERNEL, name, parameter text) of every kernel in the source, those inside a macro of
    _MACROS (`NAME_##NAME`) expanded for each of its MACRO(NAME, KIND) lines."""
    src = source()
    out = []
    pattern = r"\b(BLOCK_)?KERNEL (\w+(?:##NAME)?)\(([^)]*)\)"
    spans = []
    for macro in _MACROS:
        m = re.search(rf"^#define {macro}\(NAME, KIND\)(?:.*\\\n)*.*$", src, re.M)
        if m is None:
            continue
        spans.append((m.start(), m.end()))
        names = re.findall(rf"^{macro}\((\w+), \w+\)$", src, re.M)
        for blk, name, params in re.findall(pattern, m.group(0)):
            out += [(bool(blk), name.replace("##NAME", n), params) for n in names]
    for m in re.finditer(pattern, src):
        if not any(a <= m.start() < b for a, b in spans):
            out.append((bool(m.group(1)), m.group(2), m.group(3)))
    return out


@lru_cache(maxsize=None)
def block_kernels() -> frozenset[str]:
    """The BLOCK_KERNELs (expanded as in `signatures`): the emulator runs each of their blocks as one call."""
    return frozenset(name for blk, name, _ in _kernel_decls() if blk)


@lru_cache(maxsize=None)
def signatures() -> dict[str, list[tuple[str, object, bool]]]:
    """Each kernel's parameters as (name, dtype or None for void*, is_pointer), from the source (the
    kernels a macro makes, `gemm_##NAME` and the like, expanded for every line that uses it)."""
    out = {}
    for _, name, params in _kernel_decls():
        plist = []
        for p in " ".join(params.replace("\\", " ").split()).split(","):
            m = re.fullmatch(r"\s*(?:const )?([a-z ]+?)\s*(\*?)\s*(\w+)\s*", p)
            if m is None:
                raise TinydetError(f"{SOURCE_PATH.name}: cannot read the parameter {p.strip()!r} of {name}")
            base, ptr, pname = m.groups()
            table = _POINTERS if ptr else _SCALARS
            if base not in table:
                raise TinydetError(f"{SOURCE_PATH.name}: parameter {pname} of {name}: unsupported type {base}")
            plist.append((pname, table[base], bool(ptr)))
        out[name] = plist
    return out


def check_args(name: str, args: tuple, is_array) -> list:
    """args converted for the launch: scalars to the parameter's NumPy type, arrays checked for dtype
    and C-contiguity."""
    sig = signatures().get(name)
    if sig is None:
        raise TinydetError(f"kernel {name!r}: not in {SOURCE_PATH.name}")
    if len(args) != len(sig):
        raise TinydetError(f"kernel {name}: expected {len(sig)} arguments, found {len(args)}")
    out = []
    for a, (pname, dtype, ptr) in zip(args, sig):
        if ptr:
            if not is_array(a) or not a.flags.c_contiguous or (dtype is not None and a.dtype != dtype):
                want = "any" if dtype is None else np.dtype(dtype).name
                raise TinydetError(f"kernel {name}: {pname} must be a C-contiguous device array of {want}")
            out.append(a)
        else:
            out.append(dtype(a))
    return out


MAX_THREADS = 1024  # a thread block's limit on NVIDIA GPUs (and kernels.cu's MAX_THREADS)


def check_block(name: str, bx: int, by: int) -> None:
    """A block shape the kernel can run: at most MAX_THREADS threads, a BLOCK_KERNEL's in one dimension."""
    if bx * by > MAX_THREADS or (name in block_kernels() and by != 1):
        raise TinydetError(f"kernel {name}: a block of {bx} x {by} threads (at most {MAX_THREADS}; block kernels "
                           "one-dimensional)")


class HostDevice:
    """kernels.cu built for the host CPU: each launch runs its threads in a loop (module docstring);
    `reverse` runs them, and the blocks, in the opposite order (a check that no thread reads what
    another writes in the same step: the results must not change)."""

    name = "host"
    xp = np

    def __init__(self, reverse: bool = False):
        self._lib = _host_library()
        self._fns = {}
        self.reverse = reverse

    @staticmethod
    def context():
        return contextlib.nullcontext()

    @staticmethod
    def to_device(a):
        return np.ascontiguousarray(a)

    @staticmethod
    def to_host(a):
        return a

    @staticmethod
    def put(dst, host) -> None:
        """dst[...] = host (a host array of dst's shape)."""
        dst[...] = host

    def launch(self, name: str, grid: tuple, block: tuple, args: tuple) -> None:
        args = check_args(name, args, lambda a: isinstance(a, np.ndarray))
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = getattr(self._lib, f"launch_{name}")
            fn.restype = None
            fn.argtypes = [ctypes.c_int] * 4 + [_ctype(d, p) for _, d, p in signatures()[name]]
        gx, gy = (tuple(grid) + (1,))[:2]
        bx, by = (tuple(block) + (1,))[:2]
        check_block(name, bx, by)
        self._lib.emu_set_reverse(int(self.reverse))
        fn(gx, gy, bx, by, *(a.ctypes.data if isinstance(a, np.ndarray) else a.item() for a in args))


def _ctype(dtype, ptr):
    if ptr:
        return ctypes.c_void_p
    return {np.int32: ctypes.c_int, np.int64: ctypes.c_longlong, np.float32: ctypes.c_float,
            np.float64: ctypes.c_double}[dtype]


_CTYPES_C = {np.float32: "float", np.float64: "double", np.int64: "long long", None: "void", np.int32: "int"}


def _launchers() -> str:
    """C++ launch loops, one per kernel: launch_NAME(gx, gy, bx, by, args...) runs every thread (a
    BLOCK_KERNEL: every block, whose call runs its threads)."""
    out = []
    blocks = block_kernels()
    for name, sig in signatures().items():
        params = ", ".join(f"{_CTYPES_C[d]}{'*' if p else ''} {n}" for n, d, p in sig)
        names = ", ".join(n for n, _, _ in sig)
        if name in blocks:
            out.append(
                f'extern "C" void launch_{name}(int l_gx, int l_gy, int l_bx, int l_by, {params}) {{\n'
                "    gridDim.x = l_gx; gridDim.y = l_gy; gridDim.z = 1; blockDim.x = l_bx; blockDim.y = 1;\n"
                "    blockDim.z = 1; blockIdx.z = 0; threadIdx.y = 0; threadIdx.z = 0;\n"
                "    for (int l_y = 0; l_y < l_gy; l_y++) for (int l_x = 0; l_x < l_gx; l_x++) {\n"
                "        blockIdx.x = emu_reverse ? l_gx - 1 - l_x : l_x; blockIdx.y = emu_reverse ? l_gy - 1 - l_y : l_y;\n"
                f"        {name}({names});\n"
                "    }\n}\n")
            continue
        out.append(  # loop variables prefixed so that no kernel parameter shadows them
            f'extern "C" void launch_{name}(int l_gx, int l_gy, int l_bx, int l_by, {params}) {{\n'
            "    gridDim.x = l_gx; gridDim.y = l_gy; gridDim.z = 1; blockDim.x = l_bx; blockDim.y = l_by;\n"
            "    blockDim.z = 1; blockIdx.z = 0; threadIdx.z = 0;\n"
            "    for (int l_y = 0; l_y < l_gy; l_y++) for (int l_x = 0; l_x < l_gx; l_x++)\n"
            "        for (int l_ty = 0; l_ty < l_by; l_ty++) for (int l_tx = 0; l_tx < l_bx; l_tx++) {\n"
            "            blockIdx.x = l_x; blockIdx.y = l_y; threadIdx.x = l_tx; threadIdx.y = l_ty;\n"
            "            if (emu_reverse) { blockIdx.x = l_gx - 1 - l_x; blockIdx.y = l_gy - 1 - l_y;\n"
            "                               threadIdx.x = l_bx - 1 - l_tx; threadIdx.y = l_by - 1 - l_ty; }\n"
            f"            {name}({names});\n"
            "        }\n}\n")
    return "\n".join(out)


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise TinydetError("the GPU kernels' host emulator needs a C++ compiler (g++ or clang++; set CXX)")
    return cxx


@lru_cache(maxsize=None)
def _host_library() -> ctypes.CDLL:
    """kernels.cu + launchers built once per source and compiler, cached beside numba's cache."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    code = source() + "\n" + _launchers()
    key = hashlib.sha256("\0".join((code, version, *HOST_FLAGS)).encode()).hexdigest()[:16]

    def build(out: Path) -> None:
        src = out.with_name("kernels.cpp")
        src.write_text(code, encoding="utf-8")
        r = subprocess.run([cxx, *HOST_FLAGS, str(src), "-o", str(out)], capture_output=True, text=True)
        if r.returncode != 0:
            raise TinydetError(f"building {SOURCE_PATH.name} for the host failed:\n{r.stderr[-4000:]}")

    return ctypes.CDLL(str(_cached("cuda-host/kernels-{key}.so", key, build)))


class CudaDevice:
    """An NVIDIA GPU through CuPy: kernels.cu built by `nvrtc_build` for the GPU's architecture when it is
    opened (cached), loaded by CuPy. Every operation runs on one stream of its own (`context`), in the
    order issued."""

    name = "cuda"

    def __init__(self, index: int = 0):
        try:
            import cupy
        except ImportError:
            raise TinydetError("device cuda: CuPy is not installed (pip install 'tinydet[cuda12]' or "
                               "'tinydet[cuda13]', matching your CUDA driver)") from None
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # CuPy raises its CUDARuntimeError when there is no driver
            raise TinydetError(f"device cuda: no usable NVIDIA GPU ({_first_line(e)})") from None
        if not 0 <= index < count:
            raise TinydetError(f"device cuda:{index}: this machine has {count} GPU(s)")
        self.xp = cupy
        self.index = index
        self._dev = cupy.cuda.Device(index)
        self.arch = arch = nvrtc_arch(int(self._dev.compute_capability))
        _, major, minor = _nvrtc().nvrtcVersion()
        key = hashlib.sha256("\0".join((source(), arch, f"{major}.{minor}", *NVRTC_OPTIONS)).encode()).hexdigest()[:16]
        built = {}

        def write(out: Path, kind: str) -> None:
            if not built:
                built["ptx"], built["cubin"] = nvrtc_build(source(), arch)
            if kind == "ptx":
                out.write_text(built["ptx"])
            else:
                out.write_bytes(built["cubin"])

        # the PTX is kept beside the machine code that ptxas made of it, to read and lint
        self.ptx = _cached("cuda/kernels-{key}.ptx", key, lambda out: write(out, "ptx"))
        binary = self.ptx
        if arch.startswith("sm_"):
            binary = _cached("cuda/kernels-{key}.cubin", key, lambda out: write(out, "cubin"))
        with self._dev:
            try:
                module = cupy.RawModule(path=str(binary))
                # every kernel resolved now: the module loads here, not inside a CUDA graph's capture
                self._fns = {name: module.get_function(name) for name in signatures()}
                self.stream = cupy.cuda.Stream(non_blocking=True)  # as CuPy advises for graph capture
            except Exception as e:
                raise TinydetError(f"device cuda: loading {binary.name} failed: {_first_line(e)}") from None
        self.name = f"cuda:{index} ({cupy.cuda.runtime.getDeviceProperties(index)['name'].decode()})"

    @contextlib.contextmanager
    def context(self):
        """This GPU current, and its stream: CuPy's own operations (copies, indexing, allocation) inside
        are ordered with the kernels."""
        with self._dev, self.stream:
            yield

    def to_device(self, a):
        with self._dev, self.stream:
            return self.xp.asarray(np.ascontiguousarray(a))

    def to_host(self, a):
        with self._dev, self.stream:
            return self.xp.asnumpy(a)  # waits for the stream's work before it

    def put(self, dst, host) -> None:
        with self._dev, self.stream:
            dst.set(np.ascontiguousarray(host, dst.dtype))

    def launch(self, name: str, grid: tuple, block: tuple, args: tuple) -> None:
        args = check_args(name, args, lambda a: isinstance(a, self.xp.ndarray))
        check_block(name, *(tuple(block) + (1,))[:2])
        fn = self._fns[name]
        with self._dev, self.stream:  # every operation on one stream: each sees the ones before it
            fn(tuple(grid), tuple(block), tuple(args))


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
