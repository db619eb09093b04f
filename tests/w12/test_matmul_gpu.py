"""w12.matmul / matmul_q8 on a GPU: real shapes, wgmma in the compiled kernel, CUDA graphs, torch.compile.

Run on the GPU machine:  python -m pytest tests/w12/test_matmul_gpu.py -q
"""

from concurrent.futures import ThreadPoolExecutor


import pytest
import torch
import torch.nn.functional as F
import triton

import autotune
import w12
from specpilot.bench.shapes import get_shape_set
from specpilot.testing import assert_bitwise_equal, assert_close, sass
from w12 import ops as wops
from w12 import cuda as wcuda
from w12.configs import GemvConfig, MmaConfig, TcConfig, TmaConfig
from w12.kernels import w12_matmul_gemv_kernel, w12_matmul_tc_kernel

from flow_emu import escaped_weight, gaussian_x

pytestmark = pytest.mark.gpu

_S = get_shape_set("hybrid-27b")
_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
REAL = [("mlp.down_proj", *_S.linears["mlp.down_proj"]), ("gdn.in_proj", *_S.linears["gdn.in_proj"]),
        ("attn.o_proj", *_S.linears["attn.o_proj"])]


def _dev():
    return torch.device("cuda")


def _check(out, x, w, p, bias=None, q8=False):
    ref = (w12.matmul_q8_reference if q8 else w12.matmul_reference)(x, p, bias)
    wd = w12.decode_q8(p) if q8 else w
    base = F.linear(x, wd.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return assert_close(out, ref, base)


@pytest.fixture(scope="module")
def packed_real():
    out = {}
    for i, (name, n, k) in enumerate(REAL):
        w = escaped_weight(n, k, seed=i)
        out[name] = (w, w12.pack(w, layout="planes"))
    return out


VARIANTS = ["mma", "tc", "gemv"]


@pytest.mark.parametrize("variant", VARIANTS)
# M = 1 (the CUDA-core GEMV under "tc"), 4 (GEMV_MAX_M), 16 and 32 (two and four 8-token tiles of "mma"); 2 and 8
# repeat those paths (slow)
@pytest.mark.parametrize("M", [1, pytest.param(2, marks=pytest.mark.slow), 4, pytest.param(8, marks=pytest.mark.slow),
                               16, 32])
@pytest.mark.parametrize("name", [r[0] for r in REAL])
def test_real_shapes(packed_real, name, M, variant):
    w, p = packed_real[name]
    x = gaussian_x(M, p.K, seed=M)
    with autotune.force("w12.matmul", variant=variant):
        out = w12.matmul(x, p)
        out_q8 = w12.matmul_q8(x, p)
    _check(out, x, w, p)
    _check(out_q8, x, w, p, q8=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_lm_head_and_prefill(variant):
    n, k = 32768 + 77, _S.hidden  # a vocab slice with an odd tail
    w = escaped_weight(n, k, seed=5)
    p = w12.pack(w, layout="planes")
    for M in (1, 100):
        x = gaussian_x(M, k, seed=M)
        with autotune.force("w12.matmul", variant=variant):
            _check(w12.matmul(x, p), x, w, p)


@pytest.mark.parametrize("variant", VARIANTS)
def test_nonfinite_fp16_bias_strides(variant):
    n, k = 1000, 4160
    w = escaped_weight(n, k, seed=9)
    w[3, 17], w[4, 99], w[5, 1000] = float("inf"), float("-inf"), float("nan")
    p = w12.pack(w, layout="planes")
    bias = gaussian_x(1, n, seed=10)[0]
    x = gaussian_x(3, 2 * k, seed=11)[:, ::2]
    with autotune.force("w12.matmul", variant=variant):
        _check(w12.matmul(x, p, bias), x, w, p, bias)
        xh = x.half()
        _check(w12.matmul(xh, p, bias.half()), xh, w, p, bias.half())


def _default_variant():
    """The variant an automatic bf16 M=1 call plans (w12.ops._plan)."""
    x = torch.empty(1, 64, dtype=torch.bfloat16, device=_dev())
    return wops._plan(wops.OP, None, x, torch.empty(8, 64, dtype=torch.uint8, device=_dev())).variant


def test_default_variant_by_generation():
    v = _default_variant()
    assert v == ("mma" if wcuda.available(_dev()) else "tc" if autotune.has_wgmma() else "gemv")


def _tiered(cfgs, fast):
    """`make test-gpu` runs the configs at positions `fast` (one per code path: split, ring, async copy, wide
    rows, ...); the rest repeat a path at another size and carry the slow mark (`make test-gpu-full`)."""
    return [c if i in fast else pytest.param(c, marks=pytest.mark.slow) for i, c in enumerate(cfgs)]


MMA_ODD = [MmaConfig(1, 1, 2), MmaConfig(2, 4, 3), MmaConfig(4, 2, 2), MmaConfig(1, 2, 4, wr=4), MmaConfig(2, 8, 2, wr=2),
           MmaConfig(1, 16, 2), MmaConfig(2, 4, 4, async_copy=True), MmaConfig(1, 4, 3, wr=2, async_copy=True),
           MmaConfig(4, 2, 6, async_copy=True), MmaConfig(1, 4, 2, split=3), MmaConfig(2, 4, 4, async_copy=True, split=7)]
TMA_ODD = [TmaConfig(2, 4, 6), TmaConfig(1, 8, 8), TmaConfig(4, 4, 3), TmaConfig(1, 1, 2), TmaConfig(2, 8, 4, split=3),
           TmaConfig(1, 4, 5, split=7), TmaConfig(2, 4, 2, split=64), TmaConfig(1, 8, 6, ahead=True),
           TmaConfig(2, 4, 2, split=3, ahead=True), TmaConfig(1, 4, 3, split=64, ahead=True), TmaConfig(1, 4, 6, wg=True),
           TmaConfig(1, 8, 4, split=3, wg=True), TmaConfig(1, 4, 2, split=64, wg=True), TmaConfig(1, 16, 3),
           TmaConfig(1, 16, 4, split=3, ahead=True), TmaConfig(1, 8, 6, xcp=True), TmaConfig(2, 4, 3, split=7, xcp=True),
           TmaConfig(1, 4, 6, wg=True, xcp=True), TmaConfig(1, 8, 6, sk=2), TmaConfig(2, 4, 3, sk=1, xcp=True),
           TmaConfig(1, 4, 2, sk=4), TmaConfig(1, 8, 6, xbox=True), TmaConfig(2, 4, 3, split=7, xbox=True),
           TmaConfig(1, 2, 4, xbox=True), TmaConfig(1, 4, 4, sk=2, xbox=True)]


@pytest.fixture(scope="module", autouse=True)
def _prebuild_cuda_kernels(request):
    """Compile the CUDA configs of the selected tests in parallel up front (NVRTC takes ~1-2 s per
    cubin and releases the GIL; one at a time the odd-shape tests would spend minutes compiling on a
    fresh machine)."""
    if not wcuda.available(_dev()):
        return
    arch = torch.cuda.get_device_capability()
    cfgs = {item.callspec.params["cfg"] for item in request.session.items
            if hasattr(item, "callspec") and isinstance(item.callspec.params.get("cfg"), (MmaConfig, TmaConfig))}
    cfgs = [c for c in cfgs if not (isinstance(c, TmaConfig) and arch[0] != 9)]
    jobs = [(c, nt, q8) for c in cfgs for nt in (1, 2, 4) for q8 in (False, True)]
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda j: wcuda.build(j[0], j[1], j[2], arch), jobs))


@pytest.mark.parametrize("cfg", _tiered(MMA_ODD, {0, 1, 3, 6, 9}), ids=lambda c: c.tag())
@pytest.mark.parametrize("N,K", [(75, 4100), (1000, 4160), (4099, 64)], ids=lambda v: str(v))
def test_mma_configs_odd_shapes(cfg, N, K):
    """Every kernel shape on ragged N (rows past N), K not a multiple of 64 (x padded), all M tiles,
    bias in three dtypes, escapes incl. -0.0 and non-finite weights; outputs fully written."""
    _odd_shapes(cfg, N, K)


@pytest.mark.hopper
@pytest.mark.parametrize("cfg", _tiered(TMA_ODD, {0, 4, 6, 7, 10, 15, 18, 21}), ids=lambda c: c.tag())
@pytest.mark.parametrize("N,K", [(75, 4100), (1000, 4160), (4099, 64)], ids=lambda v: str(v))
def test_tma_configs_odd_shapes(cfg, N, K):
    """The sm_90 TMA kernel on the same cases: rows past N come from TMA's zero fill, a ring shorter
    or longer than the K loop, splits with no chunk at all (K = 64 with split 3..64)."""
    _odd_shapes(cfg, N, K)


@pytest.mark.hopper
@pytest.mark.parametrize("cfg", _tiered([TmaConfig(1, 4, 8), TmaConfig(1, 4, 8, ahead=True), TmaConfig(1, 8, 6),
                                          TmaConfig(1, 8, 6, split=3, ahead=True), TmaConfig(1, 4, 8, xcp=True),
                                          TmaConfig(1, 8, 6, split=3, xcp=True), TmaConfig(1, 8, 6, sk=2),
                                          TmaConfig(1, 4, 8, xcp=True, sk=2), TmaConfig(1, 1, 4), TmaConfig(1, 2, 4),
                                          TmaConfig(1, 4, 8, xcp=True), TmaConfig(1, 4, 8, xbox=True),
                                          TmaConfig(1, 2, 4, xbox=True), TmaConfig(1, 8, 6, split=3, xbox=True)],
                                         {0, 1, 4, 6, 8, 11}), ids=lambda c: c.tag())
def test_tma_launches_with_changing_tensor_maps(cfg):
    """Launches alternating two weights and two x (so every tensor map changes between launches),
    each queued behind a short sleep kernel, many CTAs per SM refilling their rings ~40 times: every
    result must equal that pair's first result bit for bit, and the reference. Without the consumers'
    proxy fence before each stage release, the 2-D TMA box of x failed this in up to ~10% of launches
    at M = 16, and 16- and 32-row CTAs and cw4-st8-xcp up to every launch."""
    ws = [escaped_weight(16384, 5120, seed=7 + i) for i in range(2)]
    ps = [w12.pack(w, layout="planes") for w in ws]
    xs = [gaussian_x(16, 5120, seed=8 + i) for i in range(2)]
    firsts = {}
    with autotune.force("w12.matmul", config=cfg):
        for it in range(48):
            a, b = it % 2, (it // 2) % 2
            torch.cuda._sleep(5000)
            out = w12.matmul(xs[a], ps[b])
            if (a, b) not in firsts:
                _check(out, xs[a], ws[b], ps[b])
                firsts[a, b] = out
            else:
                assert_bitwise_equal(out, firsts[a, b])


def _odd_shapes(cfg, N, K):
    w = escaped_weight(N, K, seed=N + K)
    w[1, 3], w[2, 7], w[min(4, N - 1), 1] = float("inf"), float("nan"), -0.0
    p = w12.pack(w, layout="planes")
    for M, bdt in ((1, torch.bfloat16), (5, torch.float32), (8, torch.float16), (13, None), (32, torch.bfloat16)):
        x = gaussian_x(M, K, seed=M)
        bias = None if bdt is None else gaussian_x(1, N, seed=M + 1)[0].to(bdt)
        with autotune.force("w12.matmul", config=cfg):
            out = w12.matmul(x, p, bias)
            out_q8 = w12.matmul_q8(x, p, bias)
        _check(out, x, w, p, bias)
        _check(out_q8, x, w, p, bias, q8=True)


def test_mma_signed_zero_and_bad_input():
    """An all -0.0 row (escapes only) gives F.linear's zeros bit for bit; fp16 x and M > 32 fall back
    to Triton under the default variant, but a forced MmaConfig says why it cannot run them."""
    w = escaped_weight(64, 128, seed=1)
    w[5] = -0.0
    p = w12.pack(w, layout="planes")
    x = gaussian_x(2, 128, seed=2).abs()
    out = w12.matmul(x, p)
    assert_bitwise_equal(out[:, 5].contiguous(), F.linear(x, w)[:, 5].contiguous())
    assert w12.matmul(x.half(), p).dtype == torch.float16
    assert w12.matmul(gaussian_x(40, 128, seed=3), p).shape == (40, 64)
    with autotune.force("w12.matmul", config=MmaConfig()):
        with pytest.raises(ValueError, match=r"^w12\.matmul: the CUDA kernel \(MmaConfig\) cannot take this call: x must "
                                             r"be bfloat16, got torch\.float16; force a TcConfig or GemvConfig"):
            w12.matmul(x.half(), p)
        with pytest.raises(ValueError, match=r"cannot take this call: 1 <= M <= 32 tokens, got M=40; force a TcConfig"):
            w12.matmul(gaussian_x(40, 128, seed=3), p)


def _launch_direct(kernel, cfg, x, p, **extra):
    M, K = x.shape
    out = torch.empty(M, p.N, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(p.N, cfg.block_n), triton.cdiv(M, cfg.block_t), 1)
    return kernel[grid](x, p.hi, p.lo, p.e0, p.esc_rowptr, p.esc_col, p.esc_val, out, out, out, M, p.N, K, p.Kp,
                        p.Kp // 2, x.stride(0), x.stride(1), HAS_BIAS=False, Q8=False, SELECT_ZERO=False, ZERO_DENSE=False, SPLIT_K=1,
                        SPLIT=False,
                        BLOCK_N=cfg.block_n, BLOCK_T=cfg.block_t, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages, **extra)


@pytest.mark.hopper
@pytest.mark.parametrize("cfg", [TcConfig(128, 16, 128, 1, 8, 4), TcConfig(64, 16, 256, 1, 4, 3),
                                 TcConfig(128, 32, 128, 1, 8, 3), TcConfig(64, 16, 128, 1, 4, 4, fuse=True)], ids=str)
def test_tc_kernel_uses_wgmma(cfg):
    p = w12.pack(escaped_weight(512, 1024, seed=1), layout="planes")
    x = gaussian_x(cfg.block_t, 1024, seed=2)
    ck = _launch_direct(w12_matmul_tc_kernel, cfg, x, p, X_F16=False, FUSE=cfg.fuse)
    ptx = ck.asm["ptx"]
    if "wgmma" not in ptx:  # SASS needs nvdisasm; only consulted when the PTX lacks it
        assert "HGMMA" in ck.asm["sass"], f"tl.dot did not lower to wgmma on sm_90 for {cfg}"


@pytest.mark.hopper
@pytest.mark.parametrize("nt", [1, 2, 4])
def test_tma_wg_kernel_uses_wgmma(nt):
    """TmaConfig(wg=True) must reach the tensor cores through wgmma (HGMMA in SASS), not mma.sync."""
    cubin = wcuda.build(TmaConfig(1, 8, 6, wg=True), nt, False, torch.cuda.get_device_capability())
    text = sass(cubin)
    assert "HGMMA" in text and "HMMA" not in text.replace("HGMMA", "")


def test_gemv_kernel_uses_no_tensor_cores():
    p = w12.pack(escaped_weight(256, 1024, seed=1), layout="planes")
    x = gaussian_x(1, 1024, seed=2)
    ck = _launch_direct(w12_matmul_gemv_kernel, GemvConfig(32, 1, 256, 1, 4, 2), x, p)
    ptx = ck.asm["ptx"]
    assert "wgmma" not in ptx and "mma.sync" not in ptx


@pytest.mark.parametrize("cfg", [None, TcConfig(64, 16, 128, 4, 4, 3), GemvConfig(32, 1, 256, 5, 4, 2),
                                 MmaConfig(2, 4, 2), MmaConfig(1, 8, 3, wr=2), MmaConfig(1, 8, 4, async_copy=True),
                                 MmaConfig(1, 4, 2, split=4)] + ([TmaConfig(2, 4, 6), TmaConfig(1, 8, 6, split=4),
                                                                  TmaConfig(1, 8, 6, sk=2)] if _HOPPER else []),
                         ids=["default", "tc-split4", "gemv-split5", "mma", "mma-wr2", "mma-async", "mma-split4"]
                         + (["tma", "tma-split4", "tma-sk2"] if _HOPPER else []))
def test_cuda_graph_replay_equals_eager(cfg):
    n, k = _S.linears["mlp.down_proj"]
    w = escaped_weight(n, k, seed=3)
    p = w12.pack(w, layout="planes")
    x = gaussian_x(1, k, seed=4)
    bias = gaussian_x(1, n, seed=5)[0]
    def ctx():
        if cfg is not None:
            return autotune.force("w12.matmul", config=cfg)
        return autotune.force("w12.matmul", variant=_default_variant())

    with ctx():
        eager = w12.matmul(x, p, bias)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            w12.matmul(x, p, bias)  # warm up: compile outside capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_out = w12.matmul(x, p, bias)
    g.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(static_out, eager)
    x.copy_(gaussian_x(1, k, seed=6))  # new input, same graph
    g.replay()
    torch.cuda.synchronize()
    with ctx():
        assert_bitwise_equal(static_out, w12.matmul(x, p, bias))


@pytest.fixture
def poison_outside_compile(monkeypatch):
    """tests/conftest.py fills every torch.empty with NaN. Under torch.compile that poisoning
    (a) runs on inductor's own internal tensors (pad_mm's lazy init makes requires_grad leaves:
    fill_ raises "a leaf Variable that requires grad is being used in an in-place operation")
    and (b) would be traced into the graph as a mutation of a fresh buffer. Poison only eager,
    grad-free allocations here; the eager reference call below still gets NaN-filled outputs."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if torch.compiler.is_compiling() or t.requires_grad:
            return t
        if t.is_floating_point():
            with torch.no_grad():
                t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)
    yield


@pytest.mark.parametrize("layout", ["planes", "runtime"])
@pytest.mark.parametrize("q8", [False, True])
def test_torch_compile_fullgraph_equals_eager(q8, layout, poison_outside_compile):
    """w12.matmul / matmul_q8 under inductor and under CUDA graphs (mode="reduce-overhead"): the eager bits, on the
    version-1 planes (the registered Triton / CUDA ops) and on a TiledW12 (one opaque op: the flow kernel, 40 rows in
    two 32-row pieces)."""
    n, k = 4096, 2048
    p = w12.pack(escaped_weight(n, k, seed=7), layout=layout)
    bias = gaussian_x(1, n, seed=8)[0]
    fn = w12.matmul_q8 if q8 else w12.matmul

    def f(x):
        return torch.relu(fn(x, p, bias)) * 2

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    for M in (1, 16) if layout == "planes" else (1, 16, 32, 40):
        x = gaussian_x(M, k, seed=M)
        assert_bitwise_equal(cf(x), f(x))
    cg = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    x = gaussian_x(4, k, seed=9)
    for _ in range(3):
        got = cg(x)
    assert_bitwise_equal(got, f(x))


@pytest.mark.hopper
@pytest.mark.parametrize("cfg", _tiered([TmaConfig(1, 8, 6, split=3), TmaConfig(2, 4, 4), TmaConfig(1, 8, 6, sk=2),
                                          MmaConfig(2, 4, 2, split=3), MmaConfig(1, 8, 2)],
                                         {0, 2, 3, 4}), ids=lambda c: c.tag())
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_pdl_chain_waits_for_the_previous_kernel(cfg, graph, monkeypatch):
    """Programmatic dependent launch (sm_90): each kernel of a 6-layer chain reads the output of the
    one before, which a fill has just set to NaN, and the split-K workspace is shared. A kernel that
    read x, the workspace or its output before griddepcontrol.wait would see NaN or stale partials.
    With PDL the chain equals the same chain launched without it, bit for bit, and the reference."""
    n, m = 1024, 4
    ps = [w12.pack(escaped_weight(n, n, seed=20 + i), layout="planes") for i in range(6)]
    x = gaussian_x(m, n, seed=7)
    ys = [x] + [torch.empty(m, n, device=_dev(), dtype=torch.bfloat16) for _ in ps]

    def chain():
        for y in ys[1:]:
            y.fill_(float("nan"))
        for i, p in enumerate(ps):
            wcuda.launch(cfg, ys[i], p.hi, p.lo, p.e0, p.esc_rowptr, p.esc_col, p.esc_val, None, ys[i + 1])

    results = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("SPECPILOT_PDL", pdl)
        assert wcuda.pdl_enabled(_dev()) == (pdl == "1")
        if graph:
            chain()  # warm up: build and load outside capture
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain()
            for _ in range(3):
                g.replay()
        else:
            for _ in range(3):
                chain()
        torch.cuda.synchronize()
        results[pdl] = [y.clone() for y in ys[1:]]
    for a, b in zip(results["0"], results["1"]):
        assert_bitwise_equal(b, a)
    y = x
    for p, out in zip(ps, results["1"]):
        _check(out, y, w12.unpack(p), p)
        y = out
