"""Proofs that the interpreter repairs in autotune/interpreter.py are in force, and that
importing autotune (which every operator does) applies them: conftest.py only sets TRITON_INTERPRET.

Each kernel test runs a kernel that is wrong (or raises) under an unrepaired Triton 3.6 interpreter.
On a GPU they run compiled, where they must pass as well.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from autotune import interpreter
from specpilot.testing import assert_close


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])  # [M, K]
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])  # [K, N]
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))


@triton.jit
def _loop_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, n):  # a loop over a runtime (tensor) bound
        acc += tl.load(x_ptr + i * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.arange(0, BLOCK), acc)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dot_low_precision_operands(device, dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 32, generator=g).to(dtype).to(device)
    b = torch.randn(32, 16, generator=g).to(dtype).to(device)
    c = torch.empty(16, 16, dtype=torch.float32, device=device)
    _dot_kernel[(1,)](a, b, c, 16, 16, 32)
    ref = a.double() @ b.double()
    # fp32 accumulation of exact bf16 products: within fp32 rounding of the fp64 product.
    assert_close(c, ref, (a.float() @ b.float()), msg="tl.dot")
    # An unrepaired interpreter multiplies raw bf16 bit patterns: errors of order 1e4.
    assert (c.double() - ref).abs().max() < 1e-3


def test_loop_over_tensor_bound(device):
    x = torch.arange(5 * 8, dtype=torch.float32, device=device).reshape(5, 8)
    out = torch.empty(8, dtype=torch.float32, device=device)
    _loop_kernel[(1,)](x, out, 5, BLOCK=8)
    torch.testing.assert_close(out, x.sum(0), rtol=0, atol=0)


def test_apply_is_idempotent():
    assert interpreter.apply() is interpreter.apply()


def test_repairs_apply_on_import_of_an_operator():
    """A fresh process with TRITON_INTERPRET=1 and no setup call: w12.matmul on bf16 (the loop over a
    tensor bound, and bf16 tl.dot in "tc") matches its fp64 reference."""
    code = """
import torch, w12
g = torch.Generator().manual_seed(0)
p = w12.pack(torch.randn(40, 130, generator=g).bfloat16(), layout="planes")
x = torch.randn(3, 130, generator=g).bfloat16()
ref = w12.matmul_reference(x, p)
for variant in (None, "tc"):
    err = (w12.matmul(x, p, variant=variant).double() - ref).abs().max().item()
    assert err <= 0.02 * ref.abs().max().item(), (variant, err)
print("repaired")
"""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "repaired" in r.stdout, r.stderr[-3000:]


@triton.jit
def _to_bf16_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m).to(tl.bfloat16), mask=m)


def test_fp32_to_bf16_rounds_to_nearest_even(device):
    # ties both ways, values just above and below a tie, ±0, ±Inf, NaN, fp32 and bf16 subnormals, overflow to Inf
    bits = [0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x00000000, 0x80000000, 0x7F800000, 0xFF800000,
            0x7FC00000, 0x00008000, 0x00018000, 0x00000001, 0x807F8000, 0x7F7FFFFF, 0xBF7FFFFF, 0x3EAAAAAB]
    x = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([x, torch.randn(48, generator=torch.Generator().manual_seed(3)) * 1e3])
    y = torch.empty(x.numel(), dtype=torch.bfloat16, device=device)
    _to_bf16_kernel[(1,)](x.to(device), y, x.numel(), BLOCK=64)
    want = x.to(torch.bfloat16)
    got = y.cpu()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@triton.jit
def _axpy(acc, x, a):
    return acc + tl.math.exp(x * 0.0) * a * x  # tl.math and tensor ops inside a jit helper


@triton.jit
def _helper_loop_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, n):
        acc = _axpy(acc, tl.load(x_ptr + i * BLOCK + offs), i + 1)
    tl.store(out_ptr + offs, tl.sum(acc[None, :], axis=0))


def test_helper_calls_in_a_loop_patch_the_language_once(device, monkeypatch):
    """Speed-up 4: a jit helper called n times inside a kernel adds no `triton.language` patching after the
    launch's own, and computes what it computes without the shortcut."""
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(5)).to(device)
    want = (x.double() * torch.arange(1, 7, dtype=torch.float64, device=device)[:, None]).sum(0)
    patches = []
    if not torch.cuda.is_available():
        from triton.runtime import interpreter as interp

        orig = interp._patch_builtin
        monkeypatch.setattr(interp, "_patch_builtin", lambda *a: (patches.append(a[0]), orig(*a))[1])
    per_launch = []
    for n in (1, 6):
        out = torch.empty(16, dtype=torch.float32, device=device)
        before = len(patches)
        _helper_loop_kernel[(1,)](x, out, n, BLOCK=16)
        per_launch.append(len(patches) - before)
        torch.testing.assert_close(out.double(), want if n == 6 else x[0].double(), rtol=1e-6, atol=1e-5)
    if not torch.cuda.is_available():  # the launch's own patches only: as many for 6 helper calls as for 1
        assert per_launch[0] > 0 and per_launch[0] == per_launch[1], per_launch


@triton.jit
def _int_ops_kernel(a_ptr, b_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offs)
    b = tl.load(b_ptr + offs)
    tl.store(out_ptr + offs * 3, a + b)
    tl.store(out_ptr + offs * 3 + 1, a - b)
    tl.store(out_ptr + offs * 3 + 2, a * b)


def test_integer_ops_wrap_without_the_dead_overflow_check(device, monkeypatch):
    """Speed-up 6: int32 +, - and * wrap as on the GPU (overflowing pairs included), and under the interpreter
    no overflow check is computed while asserts are off, in the module's builder and in new ones."""
    i32 = torch.iinfo(torch.int32)
    a = torch.tensor([i32.max, i32.min, -7, 123456789, 0, 1, -1, 65536], dtype=torch.int32)
    b = torch.tensor([1, 1, 5, 987654321, i32.min, i32.max, i32.min, 65536], dtype=torch.int32)
    out = torch.empty(8, 3, dtype=torch.int32, device=device)
    checks = []
    if not torch.cuda.is_available():
        from triton.language import semantic
        from triton.runtime import interpreter as interp

        assert not interp.interpreter_builder.options.sanitize_overflow
        assert not interp.InterpreterBuilder().options.sanitize_overflow
        orig = semantic.TritonSemantic.device_assert  # where each check's result went, to be dropped
        monkeypatch.setattr(semantic.TritonSemantic, "device_assert",
                            lambda self, *args: (checks.append(1), orig(self, *args))[1])
    _int_ops_kernel[(1,)](a.to(device), b.to(device), out, BLOCK=8)
    wide = a.long(), b.long()
    want = torch.stack([wide[0] + wide[1], wide[0] - wide[1], wide[0] * wide[1]], 1)
    want = ((want + 2**31) % 2**32 - 2**31).to(torch.int32)  # two's complement wrap-around
    assert torch.equal(out.cpu(), want)
    assert not checks


def test_tuple_type_names_are_formatted_when_read():
    """Speed-up 7: a tuple type's name, formatted on reading, is the string the constructor used to format."""
    import triton.language as tl

    t = tl.core.tuple_type([tl.constexpr_type(16), tl.float32, tl.pointer_type(tl.bfloat16)], ["", "x", ""])
    assert t.name == str(t) == "[:constexpr_type[16],x:fp32,:pointer<bf16>]"
    shape = tl.core.block_type(tl.float32, [4, 8]).shape  # a tl.tuple, as every tensor's shape is
    assert shape.type.name == "[:constexpr_type[4],:constexpr_type[8]]"
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert isinstance(vars(tl.core.tuple_type)["name"], property)
