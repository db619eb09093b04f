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
    # aligned; off 4 bytes; n = 1; n not a multiple of 16
    cases = [(x[:4096], 4096), (x[1:4097], 4096), (x[:4096], 1), (x[:4096], 4000)]
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
