"""autotune.jit on the CPU: NVRTC builds (no GPU needed), the disk cache and its key, errors, availability.

Loading and launching need a GPU: tests/w12/test_matmul_gpu.py and tests/gdn/test_gdn_cuda_gpu.py run them."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import autotune
from autotune import jit

KERNEL = r"""
#include <cuda_bf16.h>
#include "helper.cuh"
#ifndef SCALE
#define SCALE 2
#endif
extern "C" __device__ unsigned int tiny_smem_bytes = 64;
extern "C" __global__ void tiny_kernel(const __nv_bfloat16* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = twice(__bfloat162float(x[i])) * SCALE;
}
"""
HELPER = "__device__ __forceinline__ float twice(float v) { return 2.0f * v; }\n"


@pytest.fixture()
def src(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "csrc"
    d.mkdir()
    (d / "helper.cuh").write_text(HELPER)
    (d / "tiny.cu").write_text(KERNEL)
    return d / "tiny.cu"


def _count_compiles(monkeypatch) -> list:
    calls = []
    real = jit._nvrtc_compile

    def counting(*a, **kw):
        calls.append(a)
        return real(*a, **kw)

    monkeypatch.setattr(jit, "_nvrtc_compile", counting)
    return calls


def test_compile_ptx_skips_ptxas_and_gives_the_builds_instructions(src, tmp_path, monkeypatch):
    """compile_ptx: NVRTC to the virtual target (no CUBIN made), cached under its own key; its instructions are
    the full build's (internal symbols aside); once the full build is cached, its PTX file is the answer."""
    calls = _count_compiles(monkeypatch)
    p = jit.compile_ptx(src, arch="sm_80", defines={"SCALE": 3})
    assert p.suffix == ".ptx" and not p.with_suffix(".cubin").exists() and len(calls) == 1
    # its NVRTC log is empty (one byte): the buffer NVRTC wrote it into was not the interpreter's shared b" "
    assert b" " == bytes([32]) and b" ".join([b"a", b"b"]) == b"a b"
    assert ".target sm_80" in p.read_text() and ".entry tiny_kernel" in p.read_text()
    assert jit.compile_ptx(src, arch="sm_80", defines={"SCALE": 3}) == p and len(calls) == 1  # cached

    def body(text):  # the kernel's instructions: from its entry on
        return text[text.index(".entry tiny_kernel"):]
    full = jit.compile(src, arch="sm_80", defines={"SCALE": 3})
    assert len(calls) == 2 and body(full.ptx.read_text()) == body(p.read_text())
    assert jit.compile_ptx(src, arch="sm_80", defines={"SCALE": 3}) == full.ptx and len(calls) == 2
    assert jit.Spec(src, "tiny_kernel", "sm_80", {"SCALE": 3}).ptx() == full.ptx
    with pytest.raises(ValueError, match="real target"):
        jit.compile_ptx(src, arch="compute_80")


def test_compile_gives_cubin_ptx_and_resources(src, tmp_path):
    b = jit.compile(src, arch="sm_80", defines={"SCALE": 3})
    assert b.cubin.read_bytes()[:4] == b"\x7fELF"
    ptx = b.ptx.read_text()
    assert ".target sm_80" in ptx and ".entry tiny_kernel" in ptx and "tiny_smem_bytes" in ptx
    res = b.resources()
    assert res["registers"] > 0 and res["stack"] == res["spill_stores"] == res["spill_loads"] == 0
    assert b.cubin.parent == tmp_path / "cache" / "jit"
    assert not list(b.cubin.parent.glob(".tmp-*")), "temporary files left behind"


def test_cache_hits_and_its_key(src, monkeypatch):
    calls = _count_compiles(monkeypatch)
    a = jit.compile(src, arch="sm_90")
    assert jit.compile(src, arch="sm_90") == a and len(calls) == 1  # a hit: no second compilation
    variants = [jit.compile(src, arch="sm_90", defines={"SCALE": 5}), jit.compile(src, arch="sm_80"),
                jit.compile(src, arch="sm_90", options=["-Xptxas=-O1"])]
    (src.parent / "helper.cuh").write_text(HELPER.replace("2.0f", "3.0f"))  # a header beside the source
    variants.append(jit.compile(src, arch="sm_90"))
    assert len({v.cubin for v in [a, *variants]}) == 5 and len(calls) == 5


def test_shared_headers_are_on_every_include_path_and_in_the_key(src, monkeypatch, tmp_path):
    """autotune/csrc (jit.SHARED_HEADERS: mbarrier.cuh) is on the include path of any source, and a change to a
    header there gives new cache keys."""
    src.write_text(src.read_text().replace('#include "helper.cuh"', '#include "helper.cuh"\n#include "mbarrier.cuh"')
                   .replace("if (i < n)", "if (i == n) mbar_init(smem_u32(y), 1);\n  if (i < n)"))
    calls = _count_compiles(monkeypatch)
    a = jit.compile(src, arch="sm_90")
    assert "mbarrier.init.shared" in a.ptx.read_text()
    shared = tmp_path / "shared"
    shared.mkdir()
    for h in jit.SHARED_HEADERS.iterdir():
        (shared / h.name).write_text(h.read_text())
    (shared / "mbarrier.cuh").write_text((jit.SHARED_HEADERS / "mbarrier.cuh").read_text() + "\n// changed\n")
    monkeypatch.setattr(jit, "SHARED_HEADERS", shared)
    b = jit.compile(src, arch="sm_90")
    assert b.cubin != a.cubin and len(calls) == 2


def test_concurrent_builders_of_one_spec_agree(src):
    out, errs = [], []

    def build():
        try:
            out.append(jit.compile(src, arch="sm_90", defines={"SCALE": 7}))
        except Exception as e:  # pragma: no cover - reported below
            errs.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errs and len(set(out)) == 1
    assert out[0].cubin.read_bytes()[:4] == b"\x7fELF"


def test_concurrent_processes_build_a_spec_once(src, tmp_path):
    # pytest-xdist workers and the tuner's threads share one cache: the per-key lock makes the first builder
    # compile and the others wait and read its files (each process counts its own NVRTC compilations)
    script = tmp_path / "build.py"
    script.write_text(
        "import sys\n"
        "from autotune import jit\n"
        "calls = []\n"
        "real = jit._nvrtc_compile\n"
        "jit._nvrtc_compile = lambda *a: calls.append(1) or real(*a)\n"
        f"b = jit.compile({str(src)!r}, arch='sm_90', defines={{'SCALE': 11}})\n"
        "print(len(calls), b.cubin)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sorted(int(o[0]) for o in outs) == [0, 0, 1], f"NVRTC ran {[o[0] for o in outs]} times per process"
    assert len({o[1] for o in outs}) == 1


def test_wgmma_targets_sm90a(src):
    assert jit.arch_name((9, 0), wgmma=True) == "sm_90a" and jit.arch_name((8, 6)) == "sm_86"
    with pytest.raises(ValueError, match="wgmma needs sm_90"):
        jit.arch_name((8, 0), wgmma=True)
    assert ".target sm_90a" in jit.compile(src, arch="sm_90a").ptx.read_text()
    with pytest.raises(ValueError, match="real target"):
        jit.compile(src, arch="compute_90")


def test_build_error_holds_the_log(src):
    src.write_text(KERNEL.replace("y[i] =", "y[i] = undefined_name +"))
    with pytest.raises(autotune.BuildError, match="undefined_name") as e:
        jit.compile(src, arch="sm_80")
    assert isinstance(e.value, RuntimeError) and autotune.BuildError is jit.BuildError


def test_one_build_error_type():
    from gdn import cuda as gcuda
    from w12 import cuda as wcuda

    assert wcuda.BuildError is gcuda.BuildError is autotune.BuildError
    assert not hasattr(wcuda, "CudaBuildError") and not hasattr(gcuda, "CudaBuildError")


def test_spec_is_a_hashable_key(src):
    a = jit.Spec(src, "tiny_kernel", "sm_90", {"SCALE": 3, "B": True})
    b = jit.Spec(str(src), "tiny_kernel", "sm_90", {"B": 1, "SCALE": "3"}, name="other")
    assert a == b and hash(a) == hash(b) and a.defines == (("B", "1"), ("SCALE", "3"))
    with pytest.raises(ValueError, match="C identifier"):
        jit.Spec(src, "tiny_kernel", "sm_90", {"A-B": 1})
    assert a.compile().cubin.is_file()


def test_unavailable_without_a_gpu_says_why():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    why = jit.unavailable()
    assert why.startswith("needs an sm_80+ CUDA GPU") and not jit.available()
    assert "cpu" in jit.unavailable(torch.device("cpu"))


def test_nvrtc_version_and_headers():
    assert jit.nvrtc_version() >= (12, 0)
    (inc,) = jit.include_dirs()
    assert (__import__("pathlib").Path(inc) / "cuda_bf16.h").is_file()


def test_function_cache_makes_each_once():
    cache = jit.FunctionCache()
    made = []
    barrier = threading.Barrier(4)

    def get():
        barrier.wait()
        cache.get_or_make("k", lambda: made.append(1) or object())

    threads = [threading.Thread(target=get) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and len(cache) == 1


def test_import_builds_and_probes_nothing():
    """Importing the packages neither loads NVRTC nor initialises the driver nor asks about a device."""
    code = ("import sys, autotune, w12, gdn, w12.cuda, gdn.cuda; from autotune import jit; "
            "print('cuda.bindings.nvrtc' in sys.modules, jit._nvrtc.cache_info().currsize, "
            "jit._driver.cache_info().currsize, jit._device_reason.cache_info().currsize)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "0", "0", "0"], out


def test_tensor_map_arguments_convert():
    """cuTensorMapEncodeTiled's dimension lists take the bindings' own integer types; plain ints fail in the
    binding before the driver is reached. Without a driver the call fails later, at the driver, not with a
    TypeError."""
    try:
        jit.tensor_map_2d(1 << 20, 1, 64, 256, 256, 64, 64, swizzle=True)
    except TypeError as e:
        raise AssertionError(f"argument conversion failed: {e}") from e
    except Exception:
        pass  # no driver or no GPU here: the arguments got through to the library call


def test_load_sized_reads_checks_and_raises_the_limit(monkeypatch):
    """Spec.load_sized (the CUDA C++ launch layers' loader): the kernel's dynamic shared memory from its u32 global,
    refused with the caller's message above the GPU's opt-in limit, the kernel's limit raised only past 48 KiB."""
    import types

    import torch

    raised = []

    class FakeKernel:
        def __init__(self, smem):
            self.smem = smem

        def read_global_u32(self, name):
            assert name == "k_smem"
            return self.smem

        def set_max_dynamic_smem(self, n):
            raised.append(n)

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda idx: types.SimpleNamespace(shared_memory_per_block_optin=227 << 10))
    spec = jit.Spec("k.cu", "k", "sm_90a")
    for smem, want_raised in ((40 << 10, []), (200 << 10, [200 << 10])):
        raised.clear()
        monkeypatch.setattr(jit.Spec, "load", lambda self, device, s=smem: FakeKernel(s))
        kernel, got = spec.load_sized(0, "k_smem", lambda s, lim: f"needs {s} of {lim}")
        assert got == smem and kernel.smem == smem and raised == want_raised
    monkeypatch.setattr(jit.Spec, "load", lambda self, device: FakeKernel(230 << 10))
    with pytest.raises(ValueError, match=f"needs {230 << 10} of {227 << 10}"):
        spec.load_sized(0, "k_smem", lambda s, lim: f"needs {s} of {lim}")
