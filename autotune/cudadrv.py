"""nvcc and the CUDA driver API through ctypes: what the CUDA C++ kernels (w12/csrc, gdn/csrc) share.

`nvcc_path()` finds the compiler (`SPECPILOT_NVCC`, `PATH`, `$CUDA_HOME/bin`, `/usr/local/cuda/bin`);
`compile_cached` builds one source with its flags into `$SPECPILOT_CACHE/<subdir>` (default
`~/.cache/specpilot`) under a key of the source bytes, the flags and the nvcc version, so an edited
kernel or another compiler never reuses a stale binary; `launch` goes through `cuLaunchKernelEx`, with
programmatic dependent launch when asked. No C++ extension build and no extra Python package.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

__all__ = ["nvcc_path", "nvcc_version", "libcuda", "check", "LaunchAttr", "LaunchConfig", "compile_cached",
           "cache_root", "available", "launch", "load_kernel", "allow_dynamic_smem", "read_global_u32", "FunctionCache",
           "PROGRAMMATIC_STREAM_SERIALIZATION"]

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


@functools.cache
def nvcc_path() -> str | None:
    cands = [os.environ.get("SPECPILOT_NVCC"), shutil.which("nvcc")]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        cands.append(str(Path(home) / "bin" / "nvcc"))
    cands.append("/usr/local/cuda/bin/nvcc")
    for c in cands:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    return None


@functools.cache
def nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def cache_root() -> Path:
    return Path(os.environ.get("SPECPILOT_CACHE") or str(Path.home() / ".cache" / "specpilot"))


def compile_cached(source: Path, flags: list[str], *, subdir: str, name: str, extra: bytes = b"", out: str = "cubin",
                   error: type[Exception] = RuntimeError) -> Path:
    """nvcc -`out` `flags` `source`, cached as `<subdir>/<name>-<key>.<out>`; `extra`: the bytes of headers the
    source includes (part of the key). Raises `error` with nvcc's output when it fails."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise error("nvcc not found: set SPECPILOT_NVCC or put CUDA's bin directory on PATH")
    key = hashlib.sha256(source.read_bytes() + extra + "\0".join(flags + [out, nvcc_version(nvcc)]).encode()).hexdigest()
    path = cache_root() / subdir / f"{name}-{key[:20]}.{out}"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        dst = Path(tmp) / path.name
        r = subprocess.run([nvcc, f"-{out}", *flags, str(source), "-o", str(dst)], capture_output=True, text=True)
        if r.returncode != 0:
            raise error(f"nvcc failed for {name}:\n{r.stderr[-4000:]}")
        os.replace(dst, path)  # atomic: concurrent builders never see half a file
    return path


def available(device=None) -> bool:
    """A CUDA device of compute capability >= 8.0 (`device`, or the current one), nvcc and libcuda are all
    there: what the CUDA C++ kernels need (mma.sync with bf16)."""
    import torch

    if not torch.cuda.is_available() or nvcc_path() is None:
        return False
    if device is not None and torch.device(device).type != "cuda":
        return False
    index = None if device is None else torch.device(device).index
    if torch.cuda.get_device_capability(torch.cuda.current_device() if index is None else index)[0] < 8:
        return False
    try:
        libcuda()
    except OSError:
        return False
    return True


class LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttr)), ("numAttrs", ctypes.c_uint)]


@functools.cache
def libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    vp, u32, sz = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t
    lib.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
    lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
    lib.cuModuleGetGlobal_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(sz), vp, ctypes.c_char_p]
    lib.cuMemcpyDtoH_v2.argtypes = [vp, ctypes.c_uint64, sz]
    lib.cuFuncSetAttribute.argtypes = [vp, ctypes.c_int, ctypes.c_int]
    lib.cuLaunchKernel.argtypes = [vp, u32, u32, u32, u32, u32, u32, u32, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)]
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), vp, ctypes.POINTER(vp), ctypes.POINTER(vp)]
    i32 = ctypes.c_int
    lib.cuTensorMapEncodeTiled.argtypes = [vp, i32, u32, vp, u64p, u64p, u32p, u32p, i32, i32, i32, i32]
    return lib


def check(res: int, what: str) -> None:
    if res != 0:
        msg = ctypes.c_char_p()
        libcuda().cuGetErrorString(res, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA error {res} ({(msg.value or b'?').decode()})")


class FunctionCache(dict):
    """Loaded kernels by key; `get_or_make` builds each once, also when threads race for it (checked again under
    a lock). A dict, so `clear()` drops every loaded kernel."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()

    def get_or_make(self, key, make):
        hit = self.get(key)
        if hit is not None:
            return hit
        with self._lock:
            if key not in self:
                self[key] = make()
            return self[key]


def load_kernel(image: bytes, name: bytes, index: int):
    """(module, function) of kernel `name` in the cubin `image`, loaded into torch's primary context of device
    `index` (made current on this thread first)."""
    import torch

    with torch.cuda.device(index):
        torch.cuda.current_stream()
        torch.empty(1, device=f"cuda:{index}")
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        check(libcuda().cuModuleLoadData(ctypes.byref(mod), image), "cuModuleLoadData")
        check(libcuda().cuModuleGetFunction(ctypes.byref(fn), mod, name), "cuModuleGetFunction")
    return mod, fn


def allow_dynamic_smem(fn, nbytes: int) -> None:
    """Raise `fn`'s dynamic shared-memory limit to `nbytes` (needed above the default 48 KB)."""
    check(libcuda().cuFuncSetAttribute(fn, 8, nbytes), "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")


def read_global_u32(module: ctypes.c_void_p, name: bytes) -> int:
    """The value of a module's `extern "C" __device__ unsigned int` variable (a layout constant)."""
    ptr, size = ctypes.c_uint64(), ctypes.c_size_t()
    check(libcuda().cuModuleGetGlobal_v2(ctypes.byref(ptr), ctypes.byref(size), module, name), f"cuModuleGetGlobal({name})")
    val = ctypes.c_uint32()
    check(libcuda().cuMemcpyDtoH_v2(ctypes.byref(val), ptr.value, 4), "cuMemcpyDtoH")
    return int(val.value)


def launch(fn, grid: tuple[int, int, int], threads: int, smem: int, stream: int, vals: list, *, pdl: bool,
           what: str) -> None:
    """Launch `fn` on `stream` with the ctypes argument values `vals` (each passed by address)."""
    params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
    if pdl:
        attr = LaunchAttr(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        conf = LaunchConfig(*grid, threads, 1, 1, smem, ctypes.c_void_p(stream), ctypes.pointer(attr), 1)
        res = libcuda().cuLaunchKernelEx(ctypes.byref(conf), fn, params, None)
    else:
        res = libcuda().cuLaunchKernel(fn, *grid, threads, 1, 1, smem, ctypes.c_void_p(stream), params, None)
    check(res, what)
