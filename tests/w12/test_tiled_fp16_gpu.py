"""fp16 x on the runtime layout on a GPU: `w12.matmul` / `matmul_q8` on a `TiledW12` run the flow kernel's
fp32-output build (W12F_OUT32) on x's two bf16 halves up to 48 rows (`w12.ops.fp16_by_bf16_pair`), and decode the
weight above. The fp32-output build's sums round to the bf16 build's output bit for bit, in every build family
the shipped configs use. The CPU side: tests/w12/test_tiled_fp16.py.

Run on the GPU machine:  python -m pytest tests/w12/test_tiled_fp16_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

import autotune
import w12
from specpilot.testing import bits_of, capture_graph
from w12 import flow, layout
from w12.configs import FlowConfig

from flow_emu import escaped_weight, gaussian_x, hostile_weight
from fp16_check import INF_COL, assert_fp16_product, fp16_x

pytestmark = pytest.mark.gpu


def _weights(N, K, kind, seed):
    if kind == "gauss":
        return escaped_weight(N, K, seed=seed)
    w = hostile_weight(N, K, seed=seed)
    w[0, INF_COL] = float("inf")  # a Gaussian row but for one +Inf, where fp16_x's hostile x has lo = 0
    return w.cuda()


@pytest.mark.parametrize("q8", [False, True], ids=["exact", "q8"])
@pytest.mark.parametrize("M", [1, 5, 16, 17, 40, 48, 49])
@pytest.mark.parametrize("N,K,kind", [(1030, 1000, "gauss"), (37, 150, "hostile"), (300, 581, "hostile")],
                         ids=lambda v: str(v))
def test_fp16_x_on_the_runtime_layout(N, K, kind, M, q8):
    w = _weights(N, K, kind, seed=N + M)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = fp16_x(M, K, seed=M, device="cuda", hostile=kind == "hostile")
    bias = (gaussian_x(1, N, seed=N, dtype=torch.float32)[0] * 0.1).to(torch.float16)
    op = w12.matmul_q8 if q8 else w12.matmul
    got = op(x, t, bias)
    torch.cuda.synchronize()
    assert got.dtype == torch.float16 and got.shape == (M, N)
    wd = w12.decode_q8(p) if q8 else w
    ref = (w12.matmul_q8_reference if q8 else w12.matmul_reference)(x, p, bias)
    assert_fp16_product(got, ref, x, wd)
    out = torch.full((1, M, N), float("nan"), device="cuda", dtype=torch.float16)
    assert w12.matmul_tiled(x[None], t, bias, q8=q8, out=out) is out
    torch.cuda.synchronize()
    assert torch.equal(bits_of(out[0]), bits_of(got))  # the same path, the same bits, through out= and a batch dim


def test_fp16_x_on_the_runtime_layout_under_a_cuda_graph():
    w = escaped_weight(1030, 1000, seed=3)
    t = w12.pack(w, layout="runtime")
    x = fp16_x(12, 1000, seed=4, device="cuda", hostile=False)
    want = w12.matmul(x, t)
    out = torch.empty_like(want)
    graph = capture_graph(lambda: w12.matmul(x, t, out=out))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits_of(out), bits_of(want))


# one config of each build family the shipped configs use: the cluster K split with x loaded ahead (mma.sync), the
# warpgroup build, the warpgroup build split through global memory, the early first-escape x, two row blocks a warp
_CONFIGS = ["w4-k4-s3-c4-q2-e", "w4-k2-s3-c4-q3-x1", "w16-k2-s3-c1-g", "w4-k1-s6-c4-q2-g", "w8-k2-s3-c2-p3-g",
            "w8-k2-s4-c2"]


@pytest.mark.parametrize("q8", [False, True], ids=["exact", "q8"])
@pytest.mark.parametrize("M", [1, 8, 32])
@pytest.mark.parametrize("tag", _CONFIGS)
def test_fp32_output_build_rounds_to_the_bf16_build_bitwise(tag, M, q8):
    cfg = FlowConfig.from_tag("flow-" + tag)
    if q8 and cfg.wg:
        pytest.skip("the 8-bit view's heuristic keeps the mma.sync build; its warpgroup build is not shipped")
    N, K = (1024 if M == 32 else 1030), 1000  # N % 16 == 0 above 8 rows: the full-row-block build (W12F_FULL)
    w = hostile_weight(N, K, seed=M).cuda()
    t = w12.pack(w, layout="runtime")
    x = gaussian_x(M, K, seed=M + 1)
    x[0, :7] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -3e38])
    bias = gaussian_x(1, N, seed=N)[0]
    o16 = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    o32 = torch.empty(M, N, device="cuda", dtype=torch.float32)
    flow.launch_tiled(cfg, x, t, bias, o16, q8=q8)
    flow.launch_tiled(cfg, x, t, bias, o32, q8=q8)
    torch.cuda.synchronize()
    r = o32.to(torch.bfloat16)
    nan = torch.isnan(o16)
    assert torch.equal(torch.isnan(r), nan)
    assert torch.equal(bits_of(r)[~nan], bits_of(o16)[~nan])
    with autotune.force("w12.matmul_q8" if q8 else "w12.matmul", config=cfg):
        via_api = (w12.matmul_q8 if q8 else w12.matmul)(x, t, bias)
    torch.cuda.synchronize()
    assert torch.equal(bits_of(via_api)[~nan], bits_of(o16)[~nan])


def test_fp16_decode_path_ignores_the_tf32_flag():
    """Above 48 rows fp16 x takes the decode path's fp32 products; a caller's allow_tf32 = True must not round their
    operands to TF32 (the same bits as with it off), and the flag is the caller's again after the call."""
    w = escaped_weight(1030, 1000, seed=5)
    t = w12.pack(w, layout="runtime")
    x = fp16_x(64, 1000, seed=6, device="cuda", hostile=False)
    flags = torch.backends.cuda.matmul
    before = flags.allow_tf32
    try:
        flags.allow_tf32 = False
        want = w12.matmul(x, t)
        flags.allow_tf32 = True
        got = w12.matmul(x, t)
        assert flags.allow_tf32 is True
    finally:
        flags.allow_tf32 = before
    torch.cuda.synchronize()
    assert torch.equal(bits_of(got), bits_of(want))
