"""Proofs that the two interpreter repairs in autotune/interpreter.py are in force, and that
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
p = w12.pack(torch.randn(40, 130, generator=g).bfloat16())
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
