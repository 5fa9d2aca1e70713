"""Backends: where a model's forward pass runs. `base.py` says what a backend does; `threads.py` how
many host threads it may use; `cpu/` is the numba CPU backend, `cupy/` the GPU backend (CUDA kernels
through CuPy, with the CPU's bits). Both take the weights as `packing/` packs them. Nothing here imports
upward."""

from __future__ import annotations

import re

from .base import Backend, KVCache

__all__ = ["Backend", "KVCache", "DEVICES", "check_device", "load_backend", "open_device"]

# "cpu"; "cuda" or "cuda:N" (an NVIDIA GPU through CuPy); "cuda-host" (the GPU kernels run by a serial
# emulator on the CPU: slow, for checking the kernels on a machine without a GPU).
DEVICES = ("cpu", "cuda", "cuda:N", "cuda-host")


def check_device(device: str) -> str:
    from ..errors import TinydetError

    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?|cuda-host", device):
        raise TinydetError(f"device: expected one of {', '.join(DEVICES)}, found {device!r}")
    return device


def open_device(device: str):
    """The device object of a GPU `device` (DEVICES), or None for "cpu". Opened before a model loads, so
    that a missing CuPy or GPU is reported at once."""
    check_device(device)
    if device == "cpu":
        return None
    from .cupy import CudaDevice, HostDevice

    return HostDevice() if device == "cuda-host" else CudaDevice(int(device.partition(":")[2] or 0))


def load_backend(device, config, tensors: dict, dtype: str, threads: int | None, source=None,
                 progress=None) -> Backend:
    """Pack a checkpoint's tensors for `device`: a name of DEVICES, or what `open_device` returned.
    `source`, the model file, lets the CPU backend keep its packed panels (`packing/panelcache.py`);
    `progress(done, total, name)` hears of the CPU backend's packing."""
    if isinstance(device, str):
        device = open_device(device)
    if device is None:
        from .cpu import CPUBackend

        return CPUBackend(config, tensors, dtype, threads, source, progress)
    from .cupy import CudaBackend

    return CudaBackend(config, tensors, dtype, threads, device)
