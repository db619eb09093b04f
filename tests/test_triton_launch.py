"""autotune.launch_triton: the compiled kernel's launcher behind Triton's own binder.

* under the interpreter it is `fn[grid](...)` (the CPU tests of every operator that launches through it);
* on a GPU a second call of the same specialization takes the kept kernel and gives the bits of `fn[grid]`; another
  specialization (a pointer off 16-byte alignment, an int argument of 1) gets its own kernel.
"""

import pytest
import torch
import triton
import triton.language as tl

import autotune
from autotune import triton_launch


@triton.jit
def _scaled_copy(x, y, n, scale, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) * scale, mask=i < n)


def _device():
    return "cuda" if torch.cuda.is_available() and not autotune.is_interpreter() else "cpu"


def test_interpreter_or_gpu_gives_the_copy():
    dev = _device()
    x = torch.randn(300, device=dev)
    y = torch.empty_like(x)
    autotune.launch_triton(_scaled_copy, (3,), x, y, 300, 2.0, BLOCK=128)
    assert torch.equal(y, x * 2.0)


@pytest.mark.gpu
def test_kept_kernels_follow_the_specialization():
    if _device() != "cuda":
        pytest.skip("needs a CUDA device")
    triton_launch.clear()
    x = torch.randn(4096 + 16, device="cuda")
    # aligned; off 4 bytes; n = 1 (a constant to Triton); n not a multiple of 16 (4000 is one: it shares 4096's kernel)
    cases = [(x[:4096], 4096), (x[1:4097], 4096), (x[:4096], 1), (x[:4096], 4001)]
    for src, n in cases:
        want = torch.zeros(4096, device="cuda")
        _scaled_copy[(32,)](src, want, n, 3.0, BLOCK=128)
        for _ in range(2):  # the first call compiles or finds the kernel through Triton; the second takes it kept
            got = torch.zeros(4096, device="cuda")
            k = autotune.launch_triton(_scaled_copy, (32,), src, got, n, 3.0, BLOCK=128)
            torch.cuda.synchronize()
            assert torch.equal(got, want), (src.data_ptr() % 16, n)
    kept = [key for key in triton_launch._KERNELS if key[0] is _scaled_copy]
    assert len(kept) == 4  # one per specialization
    assert k is triton_launch._KERNELS[kept[-1]]


class _FakeKernel:
    function, packed_metadata = "fn-handle", "packed"

    def __init__(self):
        self.calls = []

    def run(self, *a):
        self.calls.append(a)


class _FakeJit:
    """What launch_triton reads of a JITFunction: its binder (Triton's: argument values -> bound arguments,
    specialization, options), `debug`, and `fn[grid](...)` (Triton's own launch, which returns the kernel)."""
    debug = False

    def __init__(self):
        self.jit_calls, self.kernels = [], {}

        def binder(x, n, BLOCK=4, **options):
            spec = [("*fp32", "D" if x % 16 == 0 else ""), ("i32", "D" if n % 16 == 0 else ""), ("constexpr", BLOCK)]
            return {"x": x, "n": n, "BLOCK": BLOCK}, spec, options

        self.device_caches = {0: ({}, {}, None, None, binder)}

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            key = (args[0] % 16 == 0, args[1] % 16 == 0, kwargs.get("BLOCK"))
            return self.kernels.setdefault(key, _FakeKernel())
        return run


def test_the_launch_logic_on_a_fake_jit(monkeypatch):
    """Without a GPU: the first call of a specialization goes through fn[grid] (with the caller's keywords only),
    later ones call the kept kernel's launcher with Triton's argument order (grid, stream, function, metadata, no
    hooks, every bound argument); another specialization, the function's pre-run hooks or a launch hook go through
    fn[grid] again."""
    from triton import knobs

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    triton_launch.clear()
    fn = _FakeJit()
    k = triton_launch.launch(fn, (3,), 32, 64, BLOCK=8, num_warps=4)
    assert fn.jit_calls == [((3,), (32, 64), {"BLOCK": 8, "num_warps": 4})] and not k.calls
    assert triton_launch.launch(fn, (5, 2), 48, 16, BLOCK=8, num_warps=4) is k  # same specialization: kept
    assert len(fn.jit_calls) == 1
    assert k.calls == [(5, 2, 1, 77, "fn-handle", "packed", None, None, None, 48, 16, 8)]
    other = triton_launch.launch(fn, (3,), 33, 64, BLOCK=8, num_warps=4)  # a pointer off 16 bytes
    assert other is not k and len(fn.jit_calls) == 2
    triton_launch.launch(fn, (3,), 32, 64, BLOCK=8, num_warps=8)  # other options: Triton's path again
    assert len(fn.jit_calls) == 3
    triton_launch.launch(fn, (3,), 32, 64, BLOCK=8, num_warps=4, extern=[1])  # an option that cannot be hashed
    assert len(fn.jit_calls) == 4 and fn.jit_calls[-1][2]["extern"] == [1]
    triton_launch.launch(fn, (3,), 32, 64, BLOCK=8, num_warps=4, debug=True)  # the caller's debug reaches Triton
    assert fn.jit_calls[-1][2]["debug"] is True
    fn.pre_run_hooks = [lambda *a, **kw: None]
    triton_launch.launch(fn, (3,), 32, 64, BLOCK=8, num_warps=4)  # the function's own run hooks: Triton runs them
    assert len(fn.jit_calls) == 6 and len(k.calls) == 1
    fn.pre_run_hooks = []
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    triton_launch.launch(fn, (3,), 32, 64, BLOCK=8, num_warps=4)  # a profiler's hook: always Triton's path
    assert len(fn.jit_calls) == 7 and len(k.calls) == 1
    triton_launch.clear()
