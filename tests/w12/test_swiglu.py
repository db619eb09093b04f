"""SwiGLU in the flow kernel's epilogue (`w12.matmul_swiglu`, the W12F_SWIGLU build) on the CPU: the row pairing
and its inverse, the reference path against the product's halves, the engine's paired projection against the
unpaired one, and the SwiGLU builds for sm_90 and sm_80 (no spills, no local memory, the store of half the rows)."""

from __future__ import annotations

import types

import pytest
import torch

import w12
from w12 import flow
from w12.configs import FlowConfig

from flow_emu import hostile_weight


def _gate_up(f: int, k: int, seed: int = 0) -> torch.Tensor:
    return (torch.randn(2 * f, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5).to(torch.bfloat16)


def test_pair_rows_puts_gate_and_up_rows_of_an_output_in_one_row_block():
    w = torch.arange(32 * 3, dtype=torch.float32).reshape(32, 3)
    p = w12.pair_rows(w)
    assert torch.equal(p[0:8], w[0:8]) and torch.equal(p[8:16], w[16:24])
    assert torch.equal(p[16:24], w[8:16]) and torch.equal(p[24:32], w[24:32])
    y = torch.randn(5, 32)
    g, u = w12.unpair_cols(w12.pair_rows(y.T).T)  # a product's columns come in the weight's row order
    assert torch.equal(g, y[:, :16]) and torch.equal(u, y[:, 16:])
    with pytest.raises(ValueError, match="multiple of 8"):
        w12.pair_rows(torch.zeros(24, 4))


@pytest.mark.parametrize("M", [1, 3, 40, 100])
def test_matmul_swiglu_is_swiglu_of_the_products_halves(M):
    """On the CPU (no flow kernel) the call is the product with the paired weight and SwiGLU of its paired columns
    (under the interpreter the Triton kernel of w12/kernels/swiglu.py, else unpair_cols and swiglu_reference): the
    product rows equal the unpaired weight's bit for bit (a row's sum does not depend on where the row sits), the
    output is swiglu_reference's bit for bit but for NaN payloads (NaN where it has NaN: -inf * 0 and NaN inputs
    give a NaN whose payload the platform picks), and within one bf16 rounding of F.silu(g) * u."""
    f, k = 48, 130
    w = hostile_weight(2 * f, k, seed=1)
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    plain = w12.matmul_tiled(x, w12.pack(w))
    paired = w12.pack(w12.pair_rows(w))
    g, u = w12.unpair_cols(w12.matmul_tiled(x, paired))
    assert torch.equal(torch.cat([g, u], -1).view(torch.int16), plain.view(torch.int16))
    got = w12.matmul_swiglu(x, paired)
    assert got.shape == (M, f) and got.dtype == torch.bfloat16
    ref = w12.swiglu_reference(plain[:, :f], plain[:, f:])
    nan = torch.isnan(got.float())
    assert bool(nan.any()) and torch.equal(nan, torch.isnan(ref.float()))  # the hostile rows reach the NaN case
    assert torch.equal(got.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])
    out = torch.empty(M, f, dtype=torch.bfloat16)
    assert w12.matmul_swiglu(x, paired, out=out) is out and torch.equal(out.view(torch.int16), got.view(torch.int16))
    gf, uf = plain[:, :f].float(), plain[:, f:].float()
    silu = (gf * torch.sigmoid(gf)).to(torch.bfloat16).float()
    finite = torch.isfinite(got.float())
    close = (got.float() - (silu * uf).to(torch.bfloat16).float()).abs() <= 2.0 ** -7 * (silu * uf).abs() + 1e-30
    assert bool((close | ~finite).all())
    with pytest.raises(ValueError, match="out must be a contiguous bf16"):
        w12.matmul_swiglu(x, paired, out=torch.empty(M, f + 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 16"):
        w12.matmul_swiglu(x, w12.pack(w[:24]))


def test_engine_paired_projection_gives_the_unpaired_products():
    """The engine's gate-and-up projection held paired: its product comes back in [gate | up] order, equal to the
    unpaired projection's bit for bit; its `swiglu` is matmul_swiglu; its planes are refused (they would be paired)."""
    from specpilot.engine.model import Linear, Kernels, swiglu

    f, k = 32, 64
    w = _gate_up(f, k)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    plain = Linear(tiled=w12.pack(w))
    paired = Linear(tiled=w12.pack(w12.pair_rows(w)), paired=True)
    kern = Kernels.choose(torch.device("cpu"))
    assert torch.equal(paired(x, kern).view(torch.int16), plain(x, kern).view(torch.int16))

    glue = types.SimpleNamespace(swiglu=swiglu)
    fused = paired.swiglu(x, kern, glue)
    assert torch.equal(fused.view(torch.int16), w12.matmul_swiglu(x, paired.tiled).view(torch.int16))
    assert plain.swiglu(x, kern, glue).shape == fused.shape
    with pytest.raises(ValueError, match="paired"):
        paired.ensure_packed()
    with pytest.raises(ValueError, match="runtime layout only"):
        Linear(weight=w, paired=True)


@pytest.mark.parametrize("M", [64, 97])
def test_swiglu_pairs_kernel_is_the_reference_bitwise_with_subnormals(M):
    """Outside the flow kernel (a forced batch config at 64 rows, the decode above 96) matmul_swiglu runs the Triton
    kernel of w12/kernels/swiglu.py on the product (the interpreter here): swiglu_reference's bits wherever the
    output is not NaN, the subnormal gates and outputs of hostile rows included (its integer widening and rounding;
    the interpreter's own bf16 conversions flush subnormals), for the full format and the 8-bit view, into `out`."""
    import contextlib

    import autotune
    from flow_emu import gaussian_x
    from w12.configs import BatchConfig

    assert autotune.is_interpreter()  # the kernel, not the reference's torch ops
    f, k = 64, 130
    t = w12.pack(w12.pair_rows(hostile_weight(2 * f, k, seed=11)))
    x = gaussian_x(M, k, seed=12, device="cpu")
    for q8 in (False, True):
        with contextlib.ExitStack() as stack:
            if M <= 96:
                for op in ("w12.matmul", "w12.matmul_q8"):
                    stack.enter_context(autotune.force(op, config=BatchConfig(block_n=64, block_t=64, split_k=1)))
            got = w12.matmul_swiglu(x, t, q8=q8)
            g, u = w12.unpair_cols(w12.matmul_tiled(x, t, q8=q8))
            out = torch.full((M, f), 7.0, dtype=torch.bfloat16)
            assert w12.matmul_swiglu(x, t, q8=q8, out=out) is out
        ref = w12.swiglu_reference(g, u)
        nan = torch.isnan(got.float())
        assert torch.equal(nan, torch.isnan(ref.float())) and torch.equal(nan, torch.isnan(out.float()))
        assert torch.equal(got.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])
        assert torch.equal(out.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])
        tiny = got.float().abs() < 2.0 ** -126
        assert bool((tiny & (got.float() != 0)).any())  # subnormal outputs reached


def test_swiglu_env_switch(monkeypatch):
    from specpilot.engine.model import swiglu_pairs

    monkeypatch.delenv("SPECPILOT_W12_SWIGLU", raising=False)
    assert swiglu_pairs() is True  # on by default
    monkeypatch.setenv("SPECPILOT_W12_SWIGLU", "0")
    assert swiglu_pairs() is False
    monkeypatch.setenv("SPECPILOT_W12_SWIGLU", "1")
    assert swiglu_pairs() is True
    monkeypatch.setenv("SPECPILOT_W12_SWIGLU", "yes")
    with pytest.raises(ValueError, match="0 or 1"):
        swiglu_pairs()


@pytest.mark.parametrize("tag,nt,arch", [("w4-k1-s3-c4", 1, (9, 0)), ("w4-k1-s3-c4", 1, (8, 0)),
                                         ("w4-k1-s3-c4", 2, (9, 0)), ("w4-k1-s6-c4-q2-g", 4, (9, 0)),
                                         ("w4-k1-s3-c5-xs", 4, (9, 0))])
def test_swiglu_builds_without_local_memory(tag, nt, arch, jit_cache):
    """The W12F_SWIGLU build of the configs the engine's gate_up takes (mma.sync, a cluster, the warpgroup build, x
    through the ring): no spills or local memory, the exponential in the epilogue, and an fp32-output build
    refused at compile time."""
    cfg = FlowConfig.from_tag(tag)
    b = flow.build(cfg, nt, arch, defines={"W12F_SWIGLU": 1, "W12F_FULL": 1})
    r = b.resources()
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, (tag, nt, r)
    ptx = b.ptx.read_text()
    assert ".local" not in ptx and "ex2.approx" in ptx and "st.global.u16" in ptx
    if arch == (9, 0) and nt == 1:
        with pytest.raises(Exception, match="W12F_SWIGLU writes bf16"):
            flow.build(cfg, nt, arch, defines={"W12F_SWIGLU": 1, "W12F_OUT32": 1})
