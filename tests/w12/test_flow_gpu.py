"""The flow kernel (FlowConfig, w12/csrc/w12_flow.cu) on a GPU: odd shapes against fp64, the fixed-base build equal
to the exact-base build bit for bit on hostile rows and hostile x, the ladder's partial steps against the weight each
computes, the forced path of w12.matmul, CUDA-graph replay and repeatability.

Run on the GPU machine:  python -m pytest tests/w12/test_flow_gpu.py -q
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import autotune
import w12
from specpilot.testing import assert_close
from w12 import flow, layout
from w12.configs import FlowConfig, MmaConfig

from flow_emu import escaped_weight, gaussian_x, hostile_weight, one_unit_tiny_case

pytestmark = pytest.mark.gpu

# the default (exact base), fixed-base builds at other splits, depths and CTA sizes, two row blocks per warp, one
# row block a CTA with K in 4 pieces, 3 ring slots and x one unit ahead, and the shape of gate_up and the LM head at
# 9..16 tokens (4 row blocks a CTA, each warp one over the whole K, 3 ring slots)
CONFIGS = [FlowConfig(), FlowConfig(warps=8, kw=8, stages=6, fixed=True),
           FlowConfig(warps=4, kw=1, stages=3, fixed=True), FlowConfig(warps=16, kw=4, cps=1, evict=False),
           FlowConfig(fixed=True), FlowConfig(warps=8, kw=2, cps=1, rb=2), FlowConfig(warps=4, kw=4, rb=2),
           FlowConfig(warps=4, kw=4, stages=3, cps=4, xd=1), FlowConfig(warps=4, kw=1, stages=3, cps=4)]


def _salt(x: torch.Tensor, nonfinite: bool = True) -> torch.Tensor:
    """x (bf16, CUDA) with a tenth of its entries, seeded, set to +-subnormals and +-0, and with `nonfinite` to
    +-Inf and NaN as well; in place."""
    vals = [1e-40, -1e-40, 0.0, -0.0] + ([float("inf"), float("-inf"), float("nan")] if nonfinite else [])
    n = x.numel()
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(3))[: n // 10].cuda()
    x.view(-1)[idx] = torch.tensor(vals, device="cuda").to(torch.bfloat16)[idx % len(vals)]
    return x


def _run(cfg, x, t, bias=None, step="e", **kw):
    """`cfg`'s product into a NaN-filled output (`kw`: launch_tiled's q8, defines, ...), synchronized."""
    out = torch.full((x.shape[0], t.N), float("nan"), device="cuda", dtype=torch.bfloat16)
    flow.launch_tiled(cfg, x, t, bias, out, step=step, **kw)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.tag())
@pytest.mark.parametrize("M,N,K", [(1, 75, 200), (5, 40, 130), (13, 17, 64), (32, 130, 4100), (24, 1000, 63),
                                   (9, 5120, 6144)], ids=lambda v: str(v))
def test_flow_matches_fp64(cfg, M, N, K):
    w = escaped_weight(N, K, seed=N + K)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = gaussian_x(M, K, seed=M)
    bias = (gaussian_x(1, N, seed=N)[0] * 0.1) if N % 2 else None  # a seeded generator, never the global CUDA one
    out = _run(cfg, x, t, bias)
    assert_close(out, w12.matmul_reference(x, p, bias), F.linear(x, w, bias))


@pytest.mark.parametrize("xkind", ["normal", "tiny", "huge", "subnormal", "nonfinite"])
@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.fixed][:2] + [FlowConfig(fixed=True)], ids=lambda c: c.tag())
def test_fixed_base_equals_exact_base_bitwise(cfg, xkind):
    """Rows with e0 from 0 to ~230 (zeros, subnormals, huge and tiny rows, salted escapes) and x that is normal,
    2^-70, 2^60, subnormal-salted or NaN/Inf-salted: the guard sends the rows outside the identity's range to the
    exact base, so the two builds agree bit for bit (NaN payloads included)."""
    N, K, M = 70, 300, 11
    p = w12.pack(hostile_weight(N, K, seed=1).cuda(), layout="planes")
    t = layout.tile(p)
    x = gaussian_x(M, K, seed=2).float()
    x = {"normal": x, "tiny": x * 2.0**-70, "huge": x * 2.0**60}.get(xkind, x).to(torch.bfloat16)
    if xkind in ("subnormal", "nonfinite"):
        _salt(x, nonfinite=xkind == "nonfinite")
    fixed = _run(cfg, x, t)
    assert cfg.fixed
    exact = _run(FlowConfig(cfg.warps, cfg.kw, cfg.stages, cfg.cps, fixed=False), x, t)
    assert torch.equal(fixed.view(torch.int16), exact.view(torch.int16))


@pytest.mark.parametrize("xkind", ["normal", "nonfinite"])
@pytest.mark.parametrize("M,N", [(32, 70), (9, 37), (1, 130)], ids=lambda v: str(v))
def test_two_row_blocks_per_warp_equal_one_bitwise(M, N, xkind):
    """rb = 2 (one x fragment feeds two row blocks) against rb = 1 at the same split, on hostile rows (zeros,
    subnormals, huge and tiny rows, salted escapes) and x salted with NaN, +-Inf, +-0 and subnormals, with an odd
    number of row blocks (the last row group's second block past the weight) and a partial last block."""
    K = 300
    p = w12.pack(hostile_weight(N, K, seed=N).cuda(), layout="planes")
    t = layout.tile(p)
    x = gaussian_x(M, K, seed=M)
    if xkind == "nonfinite":
        _salt(x)
    for warps, kw, cps in ((8, 2, 1), (4, 4, 2), (8, 8, 1)):
        one = _run(FlowConfig(warps=warps, kw=kw, cps=cps), x, t)
        two = _run(FlowConfig(warps=warps, kw=kw, cps=cps, rb=2), x, t)
        assert torch.equal(one.view(torch.int16), two.view(torch.int16)), (warps, kw)


@pytest.mark.parametrize("unit", [0, 3, 7, 8])
def test_every_unit_reaches_the_guard(unit):
    """x non-zero in one K unit only, in a CTA with 3 of 4 row blocks active: the fold of that unit reaches the
    guard, so the fixed-base build gives the exact-base build's bits (tests/w12/test_flow_kernel.py shows, in the
    fp32 model, that without the guard it would not)."""
    w, _, x = one_unit_tiny_case(unit)
    t = layout.tile(w12.pack(w.cuda(), layout="planes"))
    x = x.cuda()
    fixed = _run(FlowConfig(warps=8, kw=2, fixed=True), x, t)
    exact = _run(FlowConfig(warps=8, kw=2), x, t)
    assert torch.equal(fixed.view(torch.int16), exact.view(torch.int16))


@pytest.mark.parametrize("step", ["c", "d"])
def test_partial_ladder_steps_at_kw_1(step):
    N, K, M = 200, 1000, 7
    w = escaped_weight(N, K, seed=5)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = gaussian_x(M, K, seed=6)
    out = _run(FlowConfig(warps=8, kw=1), x, t, step=step)
    wl = flow.ladder_weight(p, step)
    assert_close(out, F.linear(x.double(), wl.double()), F.linear(x, wl))
    for s in "ab":  # run, write nothing
        assert torch.isnan(_run(FlowConfig(), x, t, step=s).float()).all()


# the K split across the CTAs of a cluster (sm_90): the 5120-row layers' candidate shapes, with two row blocks per
# warp and with four ranks
KC_CONFIGS = [FlowConfig(warps=4, kw=4, cps=4, kc=2), FlowConfig(warps=4, kw=2, cps=4, kc=4),
              FlowConfig(warps=8, kw=4, cps=2, kc=2, rb=2), FlowConfig(warps=2, kw=2, cps=4, kc=2),
              FlowConfig(warps=4, kw=4, cps=4, kc=3), FlowConfig(warps=4, kw=2, stages=3, cps=4, kc=3, xd=1, late=True),
              FlowConfig(warps=4, kw=2, stages=3, cps=4, kc=3, xd=1)]


@pytest.mark.hopper
@pytest.mark.parametrize("cfg", KC_CONFIGS, ids=lambda c: c.tag())
@pytest.mark.parametrize("M,N,K", [(1, 75, 200), (5, 40, 130), (13, 17, 64), (32, 130, 4100), (24, 1000, 63),
                                   (9, 5120, 6144)], ids=lambda v: str(v))
def test_k_split_across_ctas_matches_fp64(cfg, M, N, K):
    """Against fp64, and bit for bit run to run (rank 0 adds the CTAs' sums in rank order, whatever order they
    arrive in); K = 64 and 130 give ranks with no full unit, 17 and 75 rows a partial and an inactive row block."""
    _check_fp64_and_repeats(cfg, M, N, K, repeats=3)


def _check_fp64_and_repeats(cfg, M: int, N: int, K: int, repeats: int) -> None:
    """`cfg` at (M, N, K) against fp64 (a bias where N is odd), then `repeats` more runs equal to it bit for bit."""
    w = escaped_weight(N, K, seed=N + K)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = gaussian_x(M, K, seed=M)
    bias = (gaussian_x(1, N, seed=N)[0] * 0.1) if N % 2 else None
    out = _run(cfg, x, t, bias)
    assert_close(out, w12.matmul_reference(x, p, bias), F.linear(x, w, bias))
    for _ in range(repeats):
        assert torch.equal(_run(cfg, x, t, bias).view(torch.int16), out.view(torch.int16))


def _assert_graph_of_three_replays(cfg, x, t, want) -> None:
    """Three launches of `cfg` captured in one CUDA graph under programmatic dependent launch, their outputs
    NaN-filled before each of two replays: each equals `want` bit for bit."""
    outs = [torch.full_like(want, float("nan")) for _ in range(3)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for o in outs:
            flow.launch_tiled(cfg, x, t, None, o, pdl=True)
    for _ in range(2):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for o in outs:
            assert torch.equal(o.view(torch.int16), want.view(torch.int16)), cfg.tag()


def _hostile_case(xkind: str, seed: int, N: int = 70, K: int = 300):
    """Hostile rows (zeros, subnormals, huge and tiny rows, salted escapes) and x, normal or salted with NaN, +-Inf,
    +-0 and subnormals; with the outputs where x is non-finite at a column that holds an escape of the row (there
    the kernels give NaN: w12.matmul's documented difference)."""
    M = 11
    p = w12.pack(hostile_weight(N, K, seed=seed).cuda(), layout="planes")
    x = gaussian_x(M, K, seed=seed + 1)
    if xkind == "nonfinite":
        _salt(x)
    esc = torch.zeros(N, K, dtype=torch.bool, device="cuda")
    rows = torch.repeat_interleave(torch.arange(N, device="cuda"), (p.esc_rowptr[1:] - p.esc_rowptr[:-1]).long())
    esc[rows, p.esc_col.long()] = True
    nan_at = (~torch.isfinite(x.float())).double() @ esc.double().T > 0
    return p, x, nan_at


def _assert_close_hostile(out, ref64, base, nan_at):
    """assert_close with NaN expected at `nan_at`, and the baseline's error taken as 0 where the reference is not
    finite (there only the kind of value is compared)."""
    ref = ref64.double().clone()
    ref[nan_at] = float("nan")
    b = base.double().clone()
    bad = ~torch.isfinite(ref)
    b[bad] = ref[bad]
    assert_close(out, ref, b)


@pytest.mark.hopper
@pytest.mark.parametrize("xkind", ["normal", "nonfinite"])
def test_k_split_across_ctas_on_hostile_rows(xkind):
    """The split against fp64 on hostile rows and hostile x (NaN and infinities where the reference has them)."""
    p, x, nan_at = _hostile_case(xkind, seed=4)
    t = layout.tile(p)
    for cfg in KC_CONFIGS:
        _assert_close_hostile(_run(cfg, x, t), w12.matmul_reference(x, p), F.linear(x, w12.unpack(p)), nan_at)


# the K split through global memory (kg): any sm_80+ GPU, up to 8 CTAs, with x sets ahead and with two row blocks
# per warp; the warpgroup build's (sm_90) in KG_WG_CONFIGS
KG_CONFIGS = [FlowConfig(warps=4, kw=4, cps=4, kc=2, kg=True), FlowConfig(warps=2, kw=2, cps=4, kc=6, kg=True, xd=1),
              FlowConfig(warps=8, kw=4, cps=2, kc=3, rb=2, kg=True), FlowConfig(warps=4, kw=2, cps=4, kc=8, kg=True)]
KG_WG_CONFIGS = [FlowConfig(warps=8, kw=2, cps=2, kc=3, kg=True, wg=True),
                 FlowConfig(warps=8, kw=2, stages=3, cps=2, kc=3, kg=True, wg=True),
                 FlowConfig(warps=4, kw=1, cps=4, kc=8, kg=True, wg=True)]


def _kg_configs():
    return KG_CONFIGS + (KG_WG_CONFIGS if torch.cuda.get_device_capability() == (9, 0) else [])


@pytest.mark.parametrize("M,N,K", [(1, 75, 200), (5, 40, 130), (13, 17, 64), (32, 130, 4100), (24, 1000, 63),
                                   (32, 5120, 6144)], ids=lambda v: str(v))
def test_k_split_through_memory_matches_fp64(M, N, K):
    """Against fp64, and bit for bit over 3 more runs (the last CTA of a group adds the slots in rank order whichever
    CTA it is; the counters go back to zero between launches); K = 64 and 130 give CTAs with no full unit."""
    for cfg in _kg_configs():
        if cfg.wg and M <= 8:
            continue
        _check_fp64_and_repeats(cfg, M, N, K, repeats=3)


@pytest.mark.hopper
@pytest.mark.parametrize("M", [1, 11, 32])
def test_k_split_through_memory_equals_the_cluster_build_bitwise(M):
    """The same adds in the same order as the cluster build: its bits, on hostile rows and x salted with NaN, +-Inf,
    +-0 and subnormals; in a CUDA graph of three launches replayed twice and under programmatic dependent launch
    (the next launch may start while this one's CTAs add), the same bits again."""
    p, x, _ = _hostile_case("nonfinite", seed=21)
    x = torch.cat([x] * 3)[:M]
    t = layout.tile(p)
    for cfg in [c for c in _kg_configs() if c.kc <= 4] + [dataclasses.replace(KC_CONFIGS[1], kg=True)]:
        want = _run(dataclasses.replace(cfg, kg=False), x, t)
        got = _run(cfg, x, t)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), cfg.tag()
        _assert_graph_of_three_replays(cfg, x, t, want)


@pytest.mark.parametrize("cfg", [FlowConfig(), pytest.param(KC_CONFIGS[0], marks=pytest.mark.hopper)],
                         ids=lambda c: c.tag())
def test_forced_config_graph_replay_and_repeatability(cfg):
    N, K, M = 1030, 5120, 4
    w = escaped_weight(N, K, seed=7)
    p = w12.pack(w, layout="planes")
    x = gaussian_x(M, K, seed=8)
    with autotune.force("w12.matmul", config=cfg):
        y = w12.matmul(x, p)
        y2 = w12.matmul(x, p)
        out = torch.empty_like(y)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            w12.matmul(x, p, out=out)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(y.view(torch.int16), y2.view(torch.int16))
    assert torch.equal(out.view(torch.int16), y.view(torch.int16))
    assert torch.equal(_run(cfg, x, layout.tile(p)).view(torch.int16), y.view(torch.int16))
    assert_close(y, w12.matmul_reference(x, p), F.linear(x, w))
    with autotune.force("w12.matmul_q8", config=cfg):  # a forced config belongs to one op name
        q = w12.matmul_q8(x, p)
        assert torch.equal(w12.matmul_q8(x, p).view(torch.int16), q.view(torch.int16))
    wq = w12.decode_q8(p)
    assert_close(q, w12.matmul_q8_reference(x, p), F.linear(x, wq))
    with autotune.force("w12.matmul_q8", config=FlowConfig(fixed=True)):
        with pytest.raises(ValueError, match="exact base only"):
            w12.matmul_q8(x, p)


Q8_CONFIGS = [FlowConfig(), FlowConfig(warps=4, kw=4, cps=4), FlowConfig(warps=8, kw=8),
              FlowConfig(warps=4, kw=4, rb=2), pytest.param(FlowConfig(warps=4, kw=4, cps=4, kc=2),
                                                            marks=pytest.mark.hopper)]


@pytest.mark.parametrize("cfg", Q8_CONFIGS, ids=lambda c: c.tag())
@pytest.mark.parametrize("M,N,K", [(1, 75, 200), (13, 17, 64), (32, 130, 4100), (24, 1000, 63), (9, 5120, 6144)],
                         ids=lambda v: str(v))
def test_q8_build_matches_the_8_bit_view(cfg, M, N, K):
    """The 8-bit view's build (hi bytes only) against fp64 with `w12.decode_q8`'s weight, and bit for bit run to
    run."""
    w = escaped_weight(N, K, seed=N + K + 1)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = gaussian_x(M, K, seed=M + 1)
    bias = (gaussian_x(1, N, seed=N)[0] * 0.1) if N % 2 else None
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    flow.launch_tiled(cfg, x, t, bias, out, q8=True)
    again = torch.empty_like(out)
    flow.launch_tiled(cfg, x, t, bias, again, q8=True)
    torch.cuda.synchronize()
    wq = w12.decode_q8(p)
    assert_close(out, w12.matmul_q8_reference(x, p, bias), F.linear(x, wq, bias))
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))


@pytest.mark.parametrize("xkind", ["normal", "nonfinite"])
def test_q8_build_on_hostile_rows(xkind):
    """The 8-bit view's build against fp64 with `w12.decode_q8`'s weight on hostile rows and hostile x."""
    p, x, nan_at = _hostile_case(xkind, seed=6)
    t = layout.tile(p)
    out = torch.full((x.shape[0], p.hi.shape[0]), float("nan"), device="cuda", dtype=torch.bfloat16)
    flow.launch_tiled(FlowConfig(warps=4, kw=2, cps=4), x, t, None, out, q8=True)
    _assert_close_hostile(out, w12.matmul_q8_reference(x, p), F.linear(x, w12.decode_q8(p)), nan_at)


@pytest.mark.parametrize("q8", [False, True], ids=["exact", "q8"])
@pytest.mark.parametrize("M,dtype", [(1, torch.bfloat16), (8, torch.bfloat16), (17, torch.bfloat16),
                                     (32, torch.bfloat16), (33, torch.bfloat16), (100, torch.bfloat16),
                                     (4, torch.float16)], ids=lambda v: str(v))
def test_matmul_tiled(M, dtype, q8):
    """w12.matmul_tiled on the runtime layout alone: the flow kernel at 1..32 bf16 rows, the decoded weight and
    F.linear above 32 rows or for fp16 x; against fp64 (the 8-bit view's weight for q8), with a bias."""
    N, K = 1030, 1000
    w = escaped_weight(N, K, seed=M + 3)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = gaussian_x(M, K, seed=M).to(dtype)
    bias = gaussian_x(1, N, seed=N)[0].to(dtype) * 0.1
    got = w12.matmul_tiled(x, t, bias, q8=q8)
    wd = w12.decode_q8(p) if q8 else w
    ref = (w12.matmul_q8_reference if q8 else w12.matmul_reference)(x, p, bias)
    assert got.dtype == dtype and got.shape == (M, N)
    assert_close(got, ref, F.linear(x, wd.to(dtype), bias))


@pytest.mark.parametrize("M", [33, 72, 96])
def test_matmul_tiled_in_32_row_pieces(M, monkeypatch):
    """`w12.ops.CHUNK_MAX_M` (96 by default): above 32 rows, the flow kernel once per 32-row piece of x, with a bias,
    against fp64; the 8-bit view too."""
    monkeypatch.setattr(w12.ops, "CHUNK_MAX_M", 96)
    N, K = 1030, 1000
    w = escaped_weight(N, K, seed=M + 5)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = gaussian_x(M, K, seed=M + 6)
    bias = gaussian_x(1, N, seed=N)[0] * 0.1
    for q8 in (False, True):
        got = w12.matmul_tiled(x, t, bias, q8=q8)
        wd = w12.decode_q8(p) if q8 else w
        assert_close(got, (w12.matmul_q8_reference if q8 else w12.matmul_reference)(x, p, bias),
                     F.linear(x, wd, bias))


def test_matmul_tiled_forced_config_and_graph_replay():
    N, K, M = 5120, 6144, 4
    w = escaped_weight(N, K, seed=11)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = gaussian_x(M, K, seed=12)
    y = w12.matmul_tiled(x, t)
    with autotune.force("w12.matmul", config=FlowConfig(warps=8, kw=8)):
        y2 = w12.matmul_tiled(x, t)
    assert_close(y2, w12.matmul_reference(x, p), F.linear(x, w))
    with autotune.force("w12.matmul", config=MmaConfig()):
        with pytest.raises(TypeError, match="runs the flow and batch kernels only"):
            w12.matmul_tiled(x, t)
    out = torch.empty_like(y)
    graph = torch.cuda.CUDAGraph()
    w12.matmul_tiled(x, t, out=out)  # loads the kernel outside the capture
    with torch.cuda.graph(graph):
        w12.matmul_tiled(x, t, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), y.view(torch.int16))


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("N,K", [(5120, 6144), (37, 150), (1000, 63), (300, 581)], ids=lambda v: str(v))
def test_decode_tiled_is_unpack_bitwise(N, K, groups, monkeypatch):
    """The runtime layout's Triton decode on the GPU, one or 4 column groups a program: w12.unpack's and
    w12.decode_q8's bits, hostile rows included."""
    from w12 import ops
    from w12.ops import decode_tiled

    monkeypatch.setattr(ops, "UNTILE_GROUPS", groups)
    p = w12.pack(hostile_weight(N, K, seed=N + K).cuda() if N < 2000 else escaped_weight(N, K, seed=N), layout="planes")
    t = layout.tile(p)
    assert torch.equal(decode_tiled(t).view(torch.int16), w12.unpack(p).view(torch.int16))
    assert torch.equal(decode_tiled(t, q8=True).view(torch.int16), w12.decode_q8(p).view(torch.int16))


@pytest.mark.hopper
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("cfg", [FlowConfig(warps=4, kw=4, cps=4), FlowConfig(warps=4, kw=4, cps=4, kc=2)],
                         ids=lambda c: c.tag())
def test_chain_under_programmatic_dependent_launch(cfg, graph):
    """Six flow kernels, each reading the previous one's output as x, launched with programmatic dependent launch
    (each may start, and stream its first tiles, while the previous one runs): every output equals the chain
    launched without it, bit for bit, and a layout written in place between two launches is read after the write.
    The outputs are filled with NaN before each chain, so a read of x before the previous kernel wrote it shows."""
    n, m = 1024, 4
    ts = [layout.tile(w12.pack(escaped_weight(n, n, seed=40 + i), layout="planes")) for i in range(6)]
    x = gaussian_x(m, n, seed=9)
    ys = [x] + [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in ts]
    _chain_with_and_without_pdl(cfg, ts, ys, graph, runs=3)
    # the default launch: the first one after an in-place write to the layout waits for the kernel that wrote it.
    # -W has W's windows and escape positions, so its tiles and escape values overwrite W's in place
    w0 = escaped_weight(n, n, seed=40)
    p0, pn = w12.pack(w0, layout="planes"), w12.pack(-w0, layout="planes")
    assert torch.equal(pn.e0, p0.e0) and torch.equal(pn.esc_rowptr, p0.esc_rowptr) and torch.equal(pn.esc_col, p0.esc_col)
    flow.launch_tiled(cfg, x, ts[0], None, ys[1])
    ref = ys[1].clone()
    ts[0].tiles.copy_(layout.tile(pn).tiles)
    ts[0].esc_val.copy_(pn.esc_val)  # the kernel right before the next launch writes the layout
    flow.launch_tiled(cfg, x, ts[0], None, ys[1])
    torch.cuda.synchronize()
    assert not torch.equal(ys[1].view(torch.int16), ref.view(torch.int16))
    assert_close(ys[1], w12.matmul_reference(x, pn), F.linear(x, -w0))


def _chain_with_and_without_pdl(cfg, ts, ys, graph: bool, runs: int) -> None:
    """ys[i + 1] = ys[i] @ W_i^T by the flow kernel for each layout of `ts`, the outputs NaN-filled first, `runs`
    times without programmatic dependent launch and `runs` times with it, eager or as one CUDA graph (captured after
    an eager chain that builds and loads the kernels): no NaN, and both ways equal bit for bit."""

    def chain(pdl):
        for y in ys[1:]:
            y.fill_(float("nan"))
        for i, t in enumerate(ts):
            flow.launch_tiled(cfg, ys[i], t, None, ys[i + 1], pdl=pdl)

    results = {}
    for pdl in (False, True):
        if graph:
            chain(pdl)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain(pdl)
            for _ in range(runs):
                g.replay()
        else:
            for _ in range(runs):
                chain(pdl)
        torch.cuda.synchronize()
        results[pdl] = [y.clone() for y in ys[1:]]
    for a, b in zip(results[False], results[True]):
        assert not torch.isnan(a).any()
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


# the warpgroup build: one warpgroup per CTA, two splitting K, four splitting K at one CTA per SM, and with the K
# split across the CTAs of a cluster
WG_CONFIGS = [FlowConfig(warps=4, kw=1, cps=4, wg=True), FlowConfig(warps=8, kw=2, cps=2, wg=True),
              FlowConfig(warps=16, kw=4, cps=1, wg=True), FlowConfig(warps=8, kw=1, cps=2, kc=2, wg=True),
              FlowConfig(warps=16, kw=2, cps=1, wg=True), FlowConfig(warps=4, kw=1, cps=4, kc=4, wg=True),
              FlowConfig(warps=8, kw=2, cps=2, kc=3, wg=True), FlowConfig(warps=16, kw=2, stages=3, cps=1, wg=True)]


# builds of the warpgroup build that must give the shipped one's bits: each unit's wgmma waited for before the next
# (W12F_WG_DEPTH = 1: the same operations in the same order, one A register set, 2 x slots); x staged through stmatrix
# (W12F_WG_STM: the same slot bytes), at 1-4 token tiles (tokens past M zero)
WG_TWINS = [({"W12F_WG_DEPTH": 1}, 16), ({"W12F_WG_DEPTH": 1}, 32), ({"W12F_WG_STM": 1}, 1), ({"W12F_WG_STM": 1}, 9),
            ({"W12F_WG_STM": 1}, 20), ({"W12F_WG_STM": 1}, 32)]


@pytest.mark.hopper
@pytest.mark.parametrize("defines,M", WG_TWINS, ids=[f"{'-'.join(d)}-M{m}" for d, m in WG_TWINS])
def test_warpgroup_variants_equal_the_shipped_build_bitwise(defines, M):
    """Two wgmma groups in flight (the decode of a unit overlapping the previous unit's wgmma) against each unit
    waited for, and x through stmatrix against the 4-byte stores: the same bits, on hostile rows and x salted with
    NaN, +-Inf, +-0 and subnormals."""
    p, x, _ = _hostile_case("nonfinite", seed=9)
    x = torch.cat([x] * 3)[:M]
    t = layout.tile(p)
    for cfg in WG_CONFIGS:
        want = _run(cfg, x, t)
        got = _run(cfg, x, t, defines=defines)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), cfg.tag()


@pytest.mark.parametrize("q8", [False, True], ids=["full", "q8"])
@pytest.mark.parametrize("M", [1, 11, 32])
def test_full_row_blocks_build_equals_the_general_one_bitwise(q8, M):
    """The build whose copies sit at fixed offsets (W12F_FULL; the default where N % 16 == 0 and M > 8, forced here
    at every M): the general build's bits for
    the mma.sync configs, two row blocks a warp (the last warp's second block past the weight), the cluster and
    memory K splits and (sm_90) the warpgroup build, on hostile rows (80 of them) and x salted with NaN, +-Inf, +-0
    and subnormals."""
    p = w12.pack(hostile_weight(80, 300, seed=23).cuda(), layout="planes")
    x = gaussian_x(M, 300, seed=24)
    _salt(x)
    t = layout.tile(p)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    cfgs = CONFIGS + KG_CONFIGS + ((KC_CONFIGS + WG_CONFIGS + KG_WG_CONFIGS) if hopper else [])
    for cfg in cfgs + [FlowConfig(warps=2, kw=1, cps=4, rb=2)]:
        if q8 and (cfg.fixed or cfg.wg):
            continue
        want = _run(cfg, x, t, q8=q8, defines={"W12F_FULL": 0})
        got = _run(cfg, x, t, q8=q8, defines={"W12F_FULL": 1})
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), cfg.tag()


X_SET_CONFIGS = CONFIGS + KC_CONFIGS + [FlowConfig(warps=4, kw=2, stages=3, cps=5, kc=4)]


@pytest.mark.parametrize("cfg", X_SET_CONFIGS, ids=lambda c: c.tag())
@pytest.mark.parametrize("ahead", [dict(xd=1), dict(xd=2), dict(xd=0, xh=True)], ids=["x1", "x2", "halves"])
@pytest.mark.parametrize("q8", [False, True], ids=["full", "q8"])
def test_x_sets_equal_one_copied_set_bitwise(cfg, ahead, q8):
    """x held in xd + 1 register sets loaded xd units ahead (FlowConfig.xd = 1, 2: the loop unrolled by 2 or 3, the
    masked tail's x taken from the set it landed in), and one set reloaded by halves (xh: each half takes the next
    unit's once the mma that read it are issued, the masked tail's x the last reload), against one set copied each
    unit (xd = 0), at 1, 11 and 32 tokens: the same bits for every K split (warps of 1 to 4 units, odd and even
    counts, with the masked tail, warps without a unit), the fixed base with its guard, two row blocks per warp,
    the cluster split (sm_90) and the 8-bit view, on hostile rows and x salted with NaN, +-Inf, +-0 and
    subnormals."""
    if cfg.kc > 1 and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("a K split across a cluster needs sm_90")
    if q8 and cfg.fixed:
        pytest.skip("the 8-bit view builds on the exact base only")
    p, x, _ = _hostile_case("nonfinite", seed=13)
    t = layout.tile(p)
    for M in (1, 11, 32):
        xm = torch.cat([x] * 3)[:M]
        want = _run(dataclasses.replace(cfg, xd=0), xm, t, q8=q8)
        got = _run(dataclasses.replace(cfg, **ahead), xm, t, q8=q8)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (cfg.tag(), M)


# x staged in shared memory (FlowConfig.xs): the K splits of the register builds above that it takes (exact base; one
# and two row blocks a warp), and the candidates' shapes: 4 warps of one K piece in clusters (one and two row blocks a
# warp) and through memory, 8 warps in two; a cluster whose sums outgrow rank 0's 2-slot rings at 4 token tiles; 2 warps
# of one K piece in clusters of 4
XS_CONFIGS = [dataclasses.replace(c, xd=0) for c in CONFIGS + KC_CONFIGS + KG_CONFIGS if not c.fixed] + \
    [FlowConfig(warps=4, kw=1, stages=3, cps=5, kc=4), FlowConfig(warps=4, kw=1, stages=3, cps=5, kc=4, kg=True),
     FlowConfig(warps=8, kw=2, stages=3, cps=2), FlowConfig(warps=4, kw=1, stages=4, cps=4),
     FlowConfig(warps=4, kw=1, stages=3, cps=4, rb=2, kc=4), FlowConfig(warps=4, kw=1, stages=2, cps=4, kc=4),
     FlowConfig(warps=2, kw=1, stages=3, cps=8, kc=4)]


@pytest.mark.parametrize("cfg", XS_CONFIGS, ids=lambda c: c.tag())
@pytest.mark.parametrize("q8", [False, True], ids=["full", "q8"])
def test_x_staged_in_shared_memory_equals_the_register_build_bitwise(cfg, q8):
    """x copied into a shared ring per K piece by the warps that read it (xs) against the same config with x loaded
    into registers: the same bits at 1, 11 and 32 tokens (tokens past M zero-filled), on 70 hostile rows (the last
    CTA's row groups past the last block copy x and meet the barriers without rows) over K = 300 (the masked tail's x
    from global memory) and on 160 rows over K = 1024 (full row blocks, W12F_FULL at M > 8), x salted with NaN, +-Inf,
    +-0 and subnormals, both formats."""
    if cfg.kc > 1 and not cfg.kg and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("a K split across a cluster needs sm_90")
    for N, K, seed in ((70, 300, 13), (160, 1024, 31)):
        p, x, _ = _hostile_case("nonfinite", seed=seed, N=N, K=K)
        t = layout.tile(p)
        for M in (1, 11, 32):
            xm = torch.cat([x] * 3)[:M]
            want = _run(cfg, xm, t, q8=q8)
            got = _run(dataclasses.replace(cfg, xs=True), xm, t, q8=q8)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (cfg.tag(), N, M)


@pytest.mark.parametrize("M,N,K", [(32, 5120, 6144), (24, 1000, 63), (16, 17408 // 4, 512)], ids=lambda v: str(v))
def test_x_staged_in_shared_memory_matches_fp64(M, N, K):
    """The staged-x candidates at the 5120-row layers' shape and small ones (K under one unit: the tail alone)
    against fp64."""
    w = escaped_weight(N, K, seed=N + K)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = gaussian_x(M, K, seed=M)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    for cfg in [FlowConfig(warps=4, kw=1, stages=3, cps=5, kc=4, kg=True, xs=True),
                FlowConfig(warps=4, kw=1, stages=4, cps=4, xs=True)] + \
            ([FlowConfig(warps=4, kw=1, stages=3, cps=5, kc=4, xs=True),
              FlowConfig(warps=4, kw=1, stages=3, cps=4, rb=2, kc=4, xs=True),
              FlowConfig(warps=2, kw=1, stages=3, cps=8, kc=4, xs=True)] if hopper else []):
        assert_close(_run(cfg, x, t), w12.matmul_reference(x, p), F.linear(x, w), msg=cfg.tag())


@pytest.mark.parametrize("define", ["W12F_LATE", "W12F_ESCX"])
@pytest.mark.parametrize("q8", [False, True], ids=["full", "q8"])
@pytest.mark.parametrize("M", [1, 11, 32])
def test_prologue_variants_equal_the_shipped_build_bitwise(define, q8, M):
    """W12F_LATE (the first tile copies before the decode constants and the escapes' dependent loads) and W12F_ESCX
    (x at each row's first escape column copied into shared memory before the main loop): the shipped build's bits
    for the mma.sync configs, the cluster and memory K splits and (sm_90) the warpgroup build, on hostile rows and x
    salted with NaN, +-Inf, +-0 and subnormals."""
    p, x, _ = _hostile_case("nonfinite", seed=17)
    x = torch.cat([x] * 3)[:M]
    t = layout.tile(p)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    cfgs = CONFIGS + KG_CONFIGS + ((KC_CONFIGS + WG_CONFIGS + KG_WG_CONFIGS) if hopper else [])
    for cfg in cfgs:
        if q8 and (cfg.fixed or cfg.wg):
            continue
        want = _run(cfg, x, t, q8=q8)
        got = _run(cfg, x, t, q8=q8, defines={define: 1})
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), cfg.tag()


@pytest.mark.hopper
def test_warpgroup_descriptor_orientation():
    """32 tokens (4 token groups, where the descriptor's two byte offsets differ): the build as shipped against fp64.
    Its twin with the offsets swapped (W12F_WG_SWAP = 1, its reads kept inside a padded allocation) is run too, so
    that a failure says which orientation the hardware takes."""
    M, N, K = 32, 256, 512
    w = escaped_weight(N, K, seed=21)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = gaussian_x(M, K, seed=22)
    ref, base = w12.matmul_reference(x, p), F.linear(x, w)
    cfg = WG_CONFIGS[0]
    results = {}
    for swap in (0, 1):
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        flow.launch_tiled(cfg, x, t, None, out, defines={"W12F_WG_SWAP": swap}, smem=flow.smem_bytes(cfg, 4) + 4096)
        torch.cuda.synchronize()
        try:
            assert_close(out, ref, base)
            results[swap] = "matches fp64"
        except AssertionError as e:
            results[swap] = f"differs ({str(e).splitlines()[0][:120]})"
    assert results[0] == "matches fp64", f"W12F_WG_SWAP=0: {results[0]}; W12F_WG_SWAP=1: {results[1]}"


@pytest.mark.hopper
@pytest.mark.parametrize("cfg", WG_CONFIGS, ids=lambda c: c.tag())
@pytest.mark.parametrize("M,N,K", [(1, 75, 200), (5, 40, 130), (13, 17, 64), (32, 130, 4100), (24, 1000, 63),
                                   (16, 5120, 6144), (32, 16480, 5120)], ids=lambda v: str(v))
def test_warpgroup_matches_fp64(cfg, M, N, K):
    """The warpgroup build against fp64, and bit for bit run to run; 17 and 75 rows leave row blocks of a warpgroup
    past the weight, K = 63, 130 and 4100 a masked tail (a unit of the loop here), K = 64 pieces with no unit."""
    _check_fp64_and_repeats(cfg, M, N, K, repeats=2)


@pytest.mark.hopper
@pytest.mark.parametrize("xkind", ["normal", "nonfinite"])
@pytest.mark.parametrize("M", [11, 32])
def test_warpgroup_on_hostile_rows(xkind, M):
    """The warpgroup build against fp64 on hostile rows (zeros, subnormals, huge and tiny rows, salted escapes) and
    x salted with NaN, +-Inf, +-0 and subnormals (NaN where the reference has it), and its 8-bit view against
    w12.decode_q8's weight."""
    p, x, nan_at = _hostile_case(xkind, seed=8)
    if M != x.shape[0]:
        x = torch.cat([x] * 3)[:M]
        nan_at = torch.cat([nan_at] * 3)[:M]
    t = layout.tile(p)
    for cfg in WG_CONFIGS:
        _assert_close_hostile(_run(cfg, x, t), w12.matmul_reference(x, p), F.linear(x, w12.unpack(p)), nan_at)
    out = torch.full((M, p.hi.shape[0]), float("nan"), device="cuda", dtype=torch.bfloat16)
    flow.launch_tiled(WG_CONFIGS[1], x, t, None, out, q8=True)
    _assert_close_hostile(out, w12.matmul_q8_reference(x, p), F.linear(x, w12.decode_q8(p)), nan_at)


@pytest.mark.hopper
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_warpgroup_chain_graph_and_pdl(graph):
    """Six warpgroup-build kernels at M = 24, each reading the previous one's output (NaN-filled before each
    chain), with and without programmatic dependent launch, eager and as one CUDA graph: equal bit for bit, no NaN."""
    n, m = 1024, 24
    cfg = WG_CONFIGS[1]
    ts = [layout.tile(w12.pack(escaped_weight(n, n, seed=60 + i), layout="planes")) for i in range(6)]
    ys = [gaussian_x(m, n, seed=61)] + [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in ts]
    _chain_with_and_without_pdl(cfg, ts, ys, graph, runs=1)


# the warpgroup build at 5-8 token tiles (33-64 rows in one launch): 8-warp CTAs (two per SM, and one; the K in 2
# pieces and in 1), the K split through global memory, and 4-warp CTAs in 2-CTA clusters (16-warp CTAs need more
# than the H200's 227 KB of shared memory a CTA at 7-8 token tiles)
WIDE_CONFIGS = ["w8-k2-s3-c2-g", "w8-k2-s3-c1-g", "w8-k1-s4-c1-g", "w8-k2-s3-c2-p3-g", "w4-k1-s4-c4-q2-g"]


@pytest.mark.parametrize("M", [33, 40, 57, 64])
@pytest.mark.parametrize("tag", WIDE_CONFIGS)
def test_warpgroup_build_at_5_to_8_token_tiles(tag, M):
    """33..64 rows in one launch of the warpgroup build (two wgmma a k-step, the second on the x slot's token groups
    4..): against fp64 on Gaussian rows with escapes and a bias, and bit for bit what the same config gives on the
    rows' 32-row pieces, each token's sums being the same sequence of k-steps."""
    cfg = FlowConfig.from_tag("flow-" + tag)
    N, K = (1024 if M % 2 else 1030), 1000  # N % 16 == 0: the full-row-block build
    w = escaped_weight(N, K, seed=M)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)
    x = gaussian_x(M, K, seed=M + 1)
    bias = gaussian_x(1, N, seed=N)[0] * 0.1
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    flow.launch_tiled(cfg, x, t, bias, out)
    pieces = torch.full_like(out, float("nan"))
    for lo in range(0, M, 32):
        flow.launch_tiled(cfg, x[lo:lo + 32], t, bias, pieces[lo:lo + 32])
    torch.cuda.synchronize()
    assert_close(out, w12.matmul_reference(x, p, bias), F.linear(x, w, bias))
    assert torch.equal(out.view(torch.int16), pieces.view(torch.int16))


@pytest.mark.parametrize("M", [40, 64])
def test_warpgroup_build_at_5_to_8_token_tiles_on_hostile_rows(M):
    """Hostile rows (NaN, +-Inf, subnormal and out-of-window weights) and the 8-bit view at 5-8 token tiles: the bits
    of the 32-row pieces, NaN where they are NaN."""
    cfg = FlowConfig.from_tag("flow-w8-k2-s3-c2-g")
    w = hostile_weight(300, 581, seed=M).cuda()
    t = w12.pack(w)
    x = gaussian_x(M, 581, seed=M)
    for q8 in (False, True):
        out = torch.empty(M, 300, device="cuda", dtype=torch.bfloat16)
        pieces = torch.empty_like(out)
        flow.launch_tiled(cfg, x, t, None, out, q8=q8)
        for lo in range(0, M, 32):
            flow.launch_tiled(cfg, x[lo:lo + 32], t, None, pieces[lo:lo + 32], q8=q8)
        torch.cuda.synchronize()
        nan = torch.isnan(pieces)
        assert torch.equal(torch.isnan(out), nan)
        assert torch.equal(out.view(torch.int16)[~nan], pieces.view(torch.int16)[~nan])


@pytest.mark.parametrize("q8", [False, True], ids=["full", "q8"])
@pytest.mark.parametrize("M", [1, 5, 16, 24, 32, 40])
def test_swiglu_epilogue_equals_the_reference_bitwise(M, q8):
    """w12.matmul_swiglu (the W12F_SWIGLU build, per 32-row piece) against swiglu_reference of matmul_tiled's halves
    on the same GPU: the same configs' sums give the same bf16 gate and up, and both sides take CUDA's expf and
    IEEE division, so the outputs are equal bit for bit (NaN against NaN), on hostile rows with salted x."""
    f, k = 1024, 1000
    w = hostile_weight(2 * f, k, seed=7).cuda()
    t = w12.pack(w12.pair_rows(w))
    x = _salt(gaussian_x(M, k, seed=8))
    got = w12.matmul_swiglu(x, t, q8=q8)
    ref = w12.swiglu_reference(*w12.unpair_cols(w12.matmul_tiled(x, t, q8=q8)))
    torch.cuda.synchronize()
    nan = torch.isnan(got.float())
    assert torch.equal(nan, torch.isnan(ref.float()))
    assert torch.equal(got.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])
    plain = w12.matmul_tiled(x, w12.pack(w), q8=q8)  # the paired rows' products are the unpaired ones
    g, u = w12.unpair_cols(w12.matmul_tiled(x, t, q8=q8))
    assert torch.equal(torch.cat([g, u], -1).view(torch.int16), plain.view(torch.int16))


@pytest.mark.parametrize("q8", [False, True], ids=["full", "q8"])
@pytest.mark.parametrize("M", [64, 97, 160])
def test_swiglu_outside_the_flow_kernel_equals_the_reference_bitwise(M, q8):
    """Where the flow kernel's epilogue does not take the call (above 96 rows, or a batch kernel config, forced here
    at 64), w12.matmul_swiglu runs matmul_tiled and the Triton kernel on the product's paired columns
    (w12/kernels/swiglu.py): swiglu_reference's bits of the same product on the same GPU (CUDA's expf and IEEE
    division on both sides; NaN where it has NaN), on hostile rows with salted x, into `out` as well."""
    from w12.configs import BatchConfig

    f, k = 1024, 1000
    w = hostile_weight(2 * f, k, seed=11).cuda()
    t = w12.pack(w12.pair_rows(w))
    x = _salt(gaussian_x(M, k, seed=12))
    with contextlib.ExitStack() as stack:
        if M <= 96:
            for op in ("w12.matmul", "w12.matmul_q8"):
                stack.enter_context(autotune.force(op, config=BatchConfig(block_n=64, block_t=64, split_k=1)))
        got = w12.matmul_swiglu(x, t, q8=q8)
        ref = w12.swiglu_reference(*w12.unpair_cols(w12.matmul_tiled(x, t, q8=q8)))
        out = torch.full((M, f), 7.0, dtype=torch.bfloat16, device="cuda")
        assert w12.matmul_swiglu(x, t, q8=q8, out=out) is out
    torch.cuda.synchronize()
    nan = torch.isnan(got.float())
    assert torch.equal(nan, torch.isnan(ref.float())) and torch.equal(nan, torch.isnan(out.float()))
    assert torch.equal(got.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])
    assert torch.equal(out.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


@pytest.mark.parametrize("tag", ["w4-k1-s3-c4", "w4-k1-s6-c4-q2-g", "w4-k1-s3-c5-xs", "w4-k2-s3-c4-q3-x1"])
def test_swiglu_epilogue_at_forced_configs(tag):
    """The W12F_SWIGLU build of mma.sync, warpgroup, ring and cluster configs at 1, 16 and 32 rows, forced: the
    reference's bits."""
    f, k = 512, 640
    w = escaped_weight(2 * f, k, seed=9).cuda()
    t = w12.pack(w12.pair_rows(w))
    cfg = FlowConfig.from_tag(tag)
    for M in (1, 16, 32):
        if cfg.wg and M <= 16:
            continue
        x = gaussian_x(M, k, seed=M)
        with autotune.force("w12.matmul", config=cfg):
            got = w12.matmul_swiglu(x, t)
            ref = w12.swiglu_reference(*w12.unpair_cols(w12.matmul_tiled(x, t)))
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), (tag, M)
