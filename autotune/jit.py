"""JIT builds and launches of the CUDA C++ kernels (w12/csrc, gdn/csrc) through cuda-python.

Build: NVRTC (`cuda.bindings.nvrtc`, from the nvidia-cuda-nvrtc wheel) compiles one source with its
defines to a CUBIN for one exact GPU architecture ("sm_90a" where a kernel uses wgmma), plus the PTX
and ptxas's resource report of the same compilation. The CUDA headers (cuda_bf16.h, ...) come from
the nvidia-cuda-runtime wheel, found by `cuda.pathfinder` (which also honours CUDA_HOME), so no CUDA
toolkit is needed, and NVRTC runs without a GPU. Results are cached on disk under
`$SPECPILOT_CACHE/jit` (default `~/.cache/specpilot/jit`), keyed by the source, the headers beside it,
the defines and options, the NVRTC version and the CUDA headers' fingerprint; files are written to a
temporary name and renamed, so no reader sees half a file, and a per-key file lock makes processes that need
the same specialisation at once build it once between them.

Launch: `cuda.bindings.driver` loads the CUBIN into torch's primary context (`cuModuleLoadData`), and
`Kernel.launch` runs it with `cuLaunchKernelEx` on the stream it is given (torch's current stream, so
CUDA-graph capture records it), with programmatic dependent launch when asked. `tensor_map_2d` encodes
TMA descriptors (`cuTensorMapEncodeTiled`).

`Spec` names one specialisation (source, kernel, architecture, defines, options); its `compile()` and
`load(device)` are all an operator's launch layer needs. Nothing here runs at import time.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BuildError", "Build", "Spec", "Kernel", "FunctionCache", "compile", "compile_ptx", "load", "available",
           "unavailable", "arch_name", "cache_root", "nvrtc_version", "include_dirs", "tensor_map_2d", "PTR", "I32",
           "I64", "F32", "BY_ADDRESS", "SHARED_HEADERS"]

# kernel argument types for `Kernel.launch` (cuda-bindings packs each value as its ctypes type)
PTR, I32, I64, F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
BY_ADDRESS = None  # a cuda-bindings struct (e.g. the CUtensorMap of tensor_map_2d), passed by its address

_INSTALL = "pip install cuda-bindings cuda-pathfinder nvidia-cuda-nvrtc nvidia-cuda-runtime"
_FORMAT = "1"  # part of every cache key: bump when the cached files' layout changes


class BuildError(RuntimeError):
    """A CUDA C++ kernel could not be compiled (the message holds NVRTC's log), or NVRTC or the CUDA
    headers are missing."""


# --------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------


def cache_root() -> Path:
    return Path(os.environ.get("SPECPILOT_CACHE") or str(Path.home() / ".cache" / "specpilot"))


@functools.cache
def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise BuildError(f"autotune.jit: cuda-python's NVRTC bindings are not installed; {_INSTALL}") from e
    try:
        err, major, minor = nvrtc.nvrtcVersion()  # loads libnvrtc (cuda.pathfinder finds the wheel's copy)
    except Exception as e:  # the library itself is missing: cuda-pathfinder raises its own error types
        raise BuildError(f"autotune.jit: libnvrtc could not be loaded ({e}); {_INSTALL}") from e
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise BuildError(f"autotune.jit: nvrtcVersion failed ({err})")
    return nvrtc, (int(major), int(minor))


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library in use."""
    return _nvrtc()[1]


@functools.cache
def include_dirs() -> tuple[str, ...]:
    """Where the CUDA headers the kernels include (cuda_bf16.h, cuda_fp16.h) are: the nvidia-cuda-runtime
    wheel's include directory, or CUDA_HOME's, as `cuda.pathfinder` finds them. NVRTC has them not built in."""
    found = None
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
    except ImportError:
        pass
    if found is None:  # an older cuda-pathfinder: the runtime wheel's layouts, then CUDA_HOME
        import site
        import sysconfig

        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        roots = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
        cands = [Path(r) / "nvidia" / sub / "include" for r in roots for sub in ("cu13", "cuda_runtime")]
        cands += [Path(home) / "include"] if home else []
        found = next((str(c) for c in cands if (c / "cuda_bf16.h").is_file()), None)
    if found is None or not (Path(found) / "cuda_bf16.h").is_file():
        raise BuildError(f"autotune.jit: the CUDA headers (cuda_bf16.h) were not found; {_INSTALL}, or set CUDA_HOME")
    return (found,)


SHARED_HEADERS = Path(__file__).with_name("csrc")  # CUDA headers the operators' kernels share (nothing imports upward)


def _shared_headers() -> list[Path]:
    return sorted(p for p in SHARED_HEADERS.iterdir() if p.suffix in (".cuh", ".h"))


@functools.cache
def _headers_fingerprint() -> str:
    # names and sizes of the CUDA headers: another header release gives other cache keys
    h = hashlib.sha256()
    for d in include_dirs():
        for p in sorted(Path(d).glob("*.h*")):
            h.update(f"{p.name}:{p.stat().st_size};".encode())
    return h.hexdigest()


def arch_name(cc: tuple[int, int], *, wgmma: bool = False) -> str:
    """The NVRTC target of compute capability `cc`: "sm_80", "sm_90"; "sm_90a" with `wgmma` (the
    architecture-specific features wgmma needs exist only there)."""
    name = f"sm_{cc[0]}{cc[1]}"
    if wgmma:
        if cc != (9, 0):
            raise ValueError(f"autotune.jit.arch_name: wgmma needs sm_90, got {name}")
        name += "a"
    return name


_RESOURCES = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


@dataclass(frozen=True)
class Build:
    """The files of one compilation: the CUBIN, its PTX, and NVRTC's log (with ptxas's resource report)."""

    cubin: Path
    ptx: Path
    log: Path

    def resources(self) -> dict[str, int]:
        """ptxas's report of the kernel: registers, stack, spill_stores, spill_loads (bytes)."""
        text = self.log.read_text()
        m, r = _RESOURCES.search(text), _REGISTERS.search(text)
        if m is None or r is None:
            raise ValueError(f"no ptxas resource report in {self.log}")
        return dict(registers=int(r.group(1)), stack=int(m.group(1)), spill_stores=int(m.group(2)),
                    spill_loads=int(m.group(3)))


def _define_items(defines: Mapping[str, object] | None) -> tuple[tuple[str, str], ...]:
    items = []
    for k, v in sorted((defines or {}).items()):
        if not re.fullmatch(r"[A-Za-z_]\w*", k):
            raise ValueError(f"autotune.jit: define name {k!r} is not a C identifier")
        items.append((k, str(int(v)) if isinstance(v, bool) else str(v)))
    return tuple(items)


def compile(source: Path | str, *, arch: str, defines: Mapping[str, object] | None = None, options: Sequence[str] = (),
            headers: Sequence[Path] | None = None, name: str | None = None) -> Build:
    """Compile `source` for `arch` ("sm_80", "sm_90a", ...) with `-D` `defines` and extra NVRTC `options`;
    cached on disk. `headers`: the project headers the source includes, part of the cache key (default:
    every *.cuh / *.h beside the source, whose directory is on the include path). The headers the operators share
    (`SHARED_HEADERS`, autotune/csrc: mbarrier.cuh) are on the include path of every build and always part of its
    key. Raises BuildError."""
    source = Path(source)
    opts, stem = _stem(_content_key(source, arch, headers), source, arch, defines, options, name, ["-Xptxas=-v"])
    out = _build_at(stem)
    if _built(out):
        return out
    stem.parent.mkdir(parents=True, exist_ok=True)
    # one build per key on the machine: processes that need the same specialisation at once (pytest-xdist
    # workers, the tuner's precompile threads) wait on the first builder's lock, then read its files
    with _key_lock(stem.with_suffix(".lock")):
        if _built(out):
            return out
        cubin, ptx, log = _nvrtc_compile(_nvrtc()[0], source, opts + _include_opts(source))
        _write(((out.log, log), (out.ptx, ptx), (out.cubin, cubin)), stem.parent)  # the cubin last: it means done
    return out


def compile_ptx(source: Path | str, *, arch: str, defines: Mapping[str, object] | None = None,
                options: Sequence[str] = (), headers: Sequence[Path] | None = None, name: str | None = None) -> Path:
    """The PTX of `compile(...)` with the same arguments, without running ptxas: the full build's file where it is
    cached, else NVRTC's output for the virtual target (compute_90a for sm_90a), cached under a key of its own.
    The instructions are those of the full build's PTX (its internal symbols' mangled names differ: NVRTC hashes
    the options into them); ptxas is most of a build's time, and a check of the instructions needs none of it.
    Raises BuildError."""
    source = Path(source)
    content = _content_key(source, arch, headers)  # the source and headers read and hashed once for both keys
    full = _build_at(_stem(content, source, arch, defines, options, name, ["-Xptxas=-v"])[1])
    if _built(full):
        return full.ptx
    opts, stem = _stem(content, source, "compute_" + arch[3:], defines, options, name, [])
    out = stem.with_suffix(".ptx")
    if out.is_file():
        return out
    stem.parent.mkdir(parents=True, exist_ok=True)
    with _key_lock(stem.with_suffix(".lock")):
        if not out.is_file():
            _, ptx, _ = _nvrtc_compile(_nvrtc()[0], source, opts + _include_opts(source), cubin=False)
            _write(((out, ptx),), stem.parent)
    return out


def _content_key(source: Path, arch: str, headers: Sequence[Path] | None):
    """The part of a build's cache key that every target shares: a sha256 over the source, its headers (default:
    every *.cuh / *.h beside it) and the shared headers. Checks that `arch` is a real target."""
    if not re.fullmatch(r"sm_\d+a?", arch):
        raise ValueError(f"autotune.jit: arch must be a real target such as 'sm_90', got {arch!r}")
    if headers is None:
        headers = sorted(p for p in source.parent.iterdir() if p.suffix in (".cuh", ".h"))
    key = hashlib.sha256()
    key.update(source.read_bytes())
    for h in [*headers, *_shared_headers()]:
        key.update(b"\0" + Path(h).name.encode() + b"\0" + Path(h).read_bytes())
    return key


def _stem(content, source: Path, arch: str, defines, options, name, extra) -> tuple[list[str], Path]:
    """(NVRTC options, cache stem) of a build for `arch`: `content` (`_content_key`) with the options and NVRTC's
    version."""
    opts = [f"-arch={arch}", "-std=c++17", *extra, *(f"-D{k}={v}" for k, v in _define_items(defines)), *options]
    version = _nvrtc()[1]
    key = content.copy()
    key.update("\0".join([_FORMAT, *opts, f"nvrtc-{version[0]}.{version[1]}", _headers_fingerprint()]).encode())
    return opts, cache_root() / "jit" / f"{name or source.stem}-{key.hexdigest()[:20]}"


def _build_at(stem: Path) -> Build:
    return Build(stem.with_suffix(".cubin"), stem.with_suffix(".ptx"), stem.with_suffix(".log"))


def _include_opts(source: Path) -> list[str]:
    return [f"-I{source.parent}", f"-I{SHARED_HEADERS}", *(f"-I{d}" for d in include_dirs())]


def _write(files, folder: Path) -> None:
    """Each (path, bytes) through a temporary file renamed into place, in order."""
    for path, data in files:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".tmp-", delete=False) as f:
            f.write(data)
        os.replace(f.name, path)


def _built(out: Build) -> bool:
    return out.cubin.is_file() and out.ptx.is_file() and out.log.is_file()


_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def _key_lock(path: Path):
    # an exclusive lock on `path`: fcntl.flock between processes (released by the OS if a holder dies), and a
    # threading.Lock between threads of one process (flock locks belong to the open file, not to the thread)
    with _THREAD_LOCKS_GUARD:
        tlock = _THREAD_LOCKS.setdefault(str(path), threading.Lock())
    with tlock:
        try:
            import fcntl
        except ImportError:  # no flock (Windows): concurrent builders each compile; the renames stay atomic
            yield
            return
        with open(path, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def _nvrtc_compile(nvrtc, source: Path, opts: list[str], cubin: bool = True) -> tuple[bytes, bytes, bytes]:
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    err, prog = nvrtc.nvrtcCreateProgram(source.read_bytes(), source.name.encode(), 0, [], [])
    if err != ok:
        raise BuildError(f"autotune.jit: nvrtcCreateProgram failed for {source.name} ({err})")
    try:
        raw = [o.encode() for o in opts]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(raw), raw)
        # NVRTC writes into the buffers it is given: bytearrays, never bytes (b" " * 1 is the interpreter's one
        # shared b" ", and an empty log, the size 1 of a PTX-only build, would overwrite it for the whole process)
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = bytearray(n)
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = bytes(log).rstrip(b"\0 ")
        if res != ok:
            flags = " ".join(o for o in opts if not o.startswith("-I"))
            raise BuildError(f"autotune.jit: NVRTC {'.'.join(map(str, nvrtc_version()))} failed on {source.name} "
                             f"({flags}):\n{log.decode(errors='replace')[-4000:]}")
        if cubin:
            _, n = nvrtc.nvrtcGetCUBINSize(prog)
            buf = bytearray(n)
            nvrtc.nvrtcGetCUBIN(prog, buf)
            cubin = bytes(buf)
        else:  # a virtual target: PTX only
            cubin = b""
        _, n = nvrtc.nvrtcGetPTXSize(prog)
        ptx = bytearray(n)
        nvrtc.nvrtcGetPTX(prog, ptx)
        return cubin, bytes(ptx).rstrip(b"\0"), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# --------------------------------------------------------------------------------------
# Driver: availability, load, launch
# --------------------------------------------------------------------------------------


@functools.cache
def _driver():
    from cuda.bindings import driver

    (err,) = driver.cuInit(0)
    _check(driver, err, "cuInit")
    return driver


def _check(driver, err, what: str) -> None:
    if err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        raise RuntimeError(f"autotune.jit: {what} failed: {err.name} ({(msg or b'?').decode()})")


@functools.cache
def _device_reason(index: int) -> str | None:
    import torch

    cc = torch.cuda.get_device_capability(index)
    if cc[0] < 8:
        return f"needs an sm_80+ CUDA GPU (mma.sync with bf16); cuda:{index} is sm_{cc[0]}{cc[1]}"
    try:
        _driver()
    except Exception as e:  # no libcuda, or cuInit failed
        return f"needs an sm_80+ CUDA GPU with the NVIDIA driver library (libcuda): {e}"
    try:
        _nvrtc()
        include_dirs()
    except BuildError as e:
        return f"needs an sm_80+ CUDA GPU and NVRTC with the CUDA headers: {e}"
    return None


def unavailable(device=None) -> str | None:
    """Why the CUDA C++ kernels cannot run on `device` (None: the current CUDA device), or None when they
    can: an sm_80+ GPU, the driver library and NVRTC with the CUDA headers. Checked once per device."""
    import torch

    if device is not None and torch.device(device).type != "cuda":
        return f"needs an sm_80+ CUDA GPU; the tensors are on {torch.device(device).type}"
    if not torch.cuda.is_available():
        return "needs an sm_80+ CUDA GPU; torch sees none"
    index = None if device is None else torch.device(device).index
    return _device_reason(torch.cuda.current_device() if index is None else index)


def available(device=None) -> bool:
    """`unavailable(device) is None`."""
    return unavailable(device) is None


class Kernel:
    """One loaded kernel: its module and function handles in torch's primary context of `device`."""

    __slots__ = ("module", "function", "name", "device")

    def __init__(self, module, function, name: str, device: int):
        self.module, self.function, self.name, self.device = module, function, name, device

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        """Raise the dynamic shared-memory limit to `nbytes` (needed above the default 48 KiB)."""
        driver = _driver()
        (err,) = driver.cuFuncSetAttribute(
            self.function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
        _check(driver, err, f"cuFuncSetAttribute({self.name}, MAX_DYNAMIC_SHARED_SIZE_BYTES={nbytes})")

    def read_global_u32(self, name: str) -> int:
        """The value of the module's `extern "C" __device__ unsigned int` variable `name`."""
        driver = _driver()
        err, ptr, size = driver.cuModuleGetGlobal(self.module, name.encode())
        _check(driver, err, f"cuModuleGetGlobal({name})")
        if size != 4:
            raise ValueError(f"autotune.jit: {name} has {size} bytes, not 4")
        val = ctypes.c_uint32()
        (err,) = driver.cuMemcpyDtoH(ctypes.addressof(val), ptr, 4)
        _check(driver, err, "cuMemcpyDtoH")
        return int(val.value)

    def launch(self, grid: tuple[int, int, int], block: int, smem: int, stream: int, values: tuple, types: tuple, *,
               pdl: bool = False) -> None:
        """Run on `stream` (a CUstream handle as int, e.g. `torch.cuda.current_stream().cuda_stream`) with
        arguments `values`, each packed as the ctypes type at the same place of `types` (PTR, I32, I64, F32,
        or BY_ADDRESS). `pdl`: programmatic dependent launch (the kernel may start before the previous
        kernel in the stream ends; it must call griddepcontrol.wait before reading that kernel's output)."""
        driver = _driver()
        conf = _launch_config(driver, grid, block, smem, stream, pdl)
        (err,) = driver.cuLaunchKernelEx(conf, self.function, (values, types), 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            _check(driver, err, f"cuLaunchKernelEx({self.name}, grid={grid}, block={block}, smem={smem})")


_CONFIGS: dict[tuple, object] = {}


def _launch_config(driver, grid, block, smem, stream, pdl):
    key = (grid, block, smem, stream, pdl)
    conf = _CONFIGS.get(key)
    if conf is None:
        conf = driver.CUlaunchConfig()
        conf.gridDimX, conf.gridDimY, conf.gridDimZ = grid
        conf.blockDimX, conf.blockDimY, conf.blockDimZ = block, 1, 1
        conf.sharedMemBytes = smem
        conf.hStream = stream
        if pdl:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            conf.attrs = [attr]
            conf.numAttrs = 1
        if len(_CONFIGS) >= 4096:
            _CONFIGS.clear()
        _CONFIGS[key] = conf
    return conf


def load(image: bytes, kernel: str, device: int) -> Kernel:
    """Load the CUBIN `image` into torch's primary context of CUDA device `device` and find `kernel`."""
    import torch

    driver = _driver()
    with torch.cuda.device(device):
        torch.cuda.current_stream()
        torch.empty(1, device=f"cuda:{device}")  # makes torch's primary context current on this thread
        err, mod = driver.cuModuleLoadData(image)
        _check(driver, err, f"cuModuleLoadData({kernel})")
        err, fn = driver.cuModuleGetFunction(mod, kernel.encode())
        _check(driver, err, f"cuModuleGetFunction({kernel})")
    return Kernel(mod, fn, kernel, device)


def tensor_map_2d(ptr: int, elem_bytes: int, rows: int, cols: int, row_stride_bytes: int, box_cols: int,
                  box_rows: int, *, swizzle: bool = False):
    """The TMA descriptor (CUtensorMap, 128 bytes; pass it as BY_ADDRESS) of a 2-D tensor at `ptr`:
    `rows` x `cols` elements of 1 or 2 bytes, columns contiguous, rows `row_stride_bytes` apart; box
    `box_cols` x `box_rows`; out-of-bounds elements read as zeros; `swizzle`: TMA's 128-byte swizzle.
    L2 promotion of 256 bytes."""
    driver = _driver()
    dtype = {1: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
             2: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16}[elem_bytes]
    sw = driver.CUtensorMapSwizzle
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t  # the bindings take their own integer types in these lists
    err, tmap = driver.cuTensorMapEncodeTiled(
        dtype, 2, ptr, [u64(cols), u64(rows)], [u64(row_stride_bytes)], [u32(box_cols), u32(box_rows)],
        [u32(1), u32(1)],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        sw.CU_TENSOR_MAP_SWIZZLE_128B if swizzle else sw.CU_TENSOR_MAP_SWIZZLE_NONE,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    _check(driver, err, f"cuTensorMapEncodeTiled(rows={rows}, cols={cols}, box={box_cols}x{box_rows})")
    return tmap


class FunctionCache(dict):
    """Loaded kernels by key; `get_or_make` makes each once, also when threads race for it (checked again
    under a lock). A dict, so `clear()` drops every loaded kernel."""

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


# --------------------------------------------------------------------------------------
# One specialisation
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One specialisation of a kernel: `source`, the `kernel` entry point in it, the NVRTC target `arch`
    ("sm_90a"), `-D` `defines` (a mapping; stored sorted) and extra NVRTC `options`; `name` is the cache
    files' readable stem. Hashable, so it can key a cache of loaded kernels."""

    source: Path
    kernel: str
    arch: str
    defines: tuple[tuple[str, str], ...] = ()
    options: tuple[str, ...] = ()
    name: str = field(default="", compare=False)

    def __post_init__(self):
        object.__setattr__(self, "source", Path(self.source))
        d = self.defines
        object.__setattr__(self, "defines", _define_items(d if isinstance(d, Mapping) else dict(d)))
        object.__setattr__(self, "options", tuple(self.options))

    def compile(self) -> Build:
        return compile(self.source, arch=self.arch, defines=dict(self.defines), options=self.options,
                       name=self.name or None)

    def ptx(self) -> Path:
        """The PTX of `compile()` without ptxas (`compile_ptx`): for checks of the instructions alone."""
        return compile_ptx(self.source, arch=self.arch, defines=dict(self.defines), options=self.options,
                           name=self.name or None)

    def file(self, out: str) -> Path:
        """The build's file `out`: "cubin", "ptx" (without ptxas: `ptx()`) or "log" (NVRTC's log with ptxas's
        resource report)."""
        return self.ptx() if out == "ptx" else getattr(self.compile(), out)

    def load(self, device: int) -> Kernel:
        """Compile (or take from the disk cache) and load into CUDA device `device`."""
        return load(self.compile().cubin.read_bytes(), self.kernel, device)

    def load_sized(self, device: int, smem_global: str, refuse) -> tuple[Kernel, int]:
        """`load(device)` for a kernel whose dynamic shared memory per CTA is its module's u32 global
        `smem_global`: (kernel, those bytes), the kernel's limit raised where they pass the default 48 KiB;
        ValueError(refuse(bytes, limit)) where the GPU's opt-in limit per block is smaller."""
        import torch

        kernel = self.load(device)
        smem = kernel.read_global_u32(smem_global)
        limit = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
        if smem > limit:
            raise ValueError(refuse(smem, limit))
        if smem > 48 << 10:
            kernel.set_max_dynamic_smem(smem)
        return kernel, smem
