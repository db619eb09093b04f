"""w12.matmul / w12.matmul_q8 on the CPU: the Triton kernels under the interpreter vs the fp64 oracle.

Tolerances are derived (specpilot.testing.assert_close): the kernel's error against fp64 may be
at most 2x that of a same-precision F.linear on the unpacked weight. Exactness claims (escapes,
one-hot inputs) are checked bitwise.
"""

import re

import pytest
import torch
import torch.nn.functional as F

import autotune
import w12
from specpilot.testing import assert_bitwise_equal, assert_close
from w12.configs import GemvConfig, TcConfig, pick_split_k

# The kernels run under the interpreter on CPU, compiled where CUDA exists (same tests).
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VARIANTS = ("tc", "gemv")
# Small forced configs: keep the interpreter quick and exercise split-K, several row and token tiles.
TC_SMALL = TcConfig(block_n=32, block_t=16, block_k=64, split_k=2, num_warps=4, num_stages=2)
GEMV_SMALL = GemvConfig(block_n=16, block_t=2, block_k=64, split_k=3, num_warps=4, num_stages=1)


def _weight(n, k, seed, escapes=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * k**-0.5
    if escapes and n * k > 4:
        flat = w.view(-1)
        idx = torch.randperm(n * k, generator=g)[: max(2, n * k // 40)]
        vals = torch.tensor([0.0, 1e-30, -3e-25, 2.0**20, -(2.0**-40), 0.0, 5e8, -0.0])
        flat[idx] = vals[torch.arange(idx.numel()) % vals.numel()]
    return w.to(torch.bfloat16).to(DEV)


def _x(shape, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def _check(out, x, w, packed, bias=None, q8=False):
    ref = (w12.matmul_q8_reference if q8 else w12.matmul_reference)(x, packed, bias)
    wd = (w12.decode_q8(packed) if q8 else w).to(x.dtype)
    base = F.linear(x, wd, None if bias is None else bias.to(x.dtype))
    assert out.dtype == x.dtype and out.shape == ref.shape
    return assert_close(out, ref, base)


SHAPES = [(1, 1, 1), (1, 63, 75), (3, 130, 256), (16, 63, 130), (33, 130, 75), (1, 130, 256)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("M,N,K", SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
def test_matmul_matches_reference(variant, M, N, K):
    w = _weight(N, K, seed=N + K)
    p = w12.pack(w, layout="planes")
    x = _x((M, K), seed=M)
    with autotune.force("w12.matmul", variant=variant):
        out = w12.matmul(x, p)
    _check(out, x, w, p)


@pytest.mark.parametrize("cfg", [TC_SMALL, GEMV_SMALL, TcConfig(32, 16, 128, 2, 4, 2, fuse=True),
                                 TcConfig(block_n=16, block_t=16, block_k=128, split_k=1, num_warps=4, num_stages=1,
                                          select_zero=True),
                                 GemvConfig(block_n=64, block_t=4, block_k=128, split_k=1, select_zero=True)],
                         ids=["tc-split2", "gemv-split3", "tc-fuse-split2", "tc-select", "gemv-select"])
@pytest.mark.parametrize("M", [1, 5, pytest.param(20, marks=pytest.mark.slow)])
def test_forced_configs(cfg, M):
    N, K = 70, 300
    w = _weight(N, K, seed=7)
    p = w12.pack(w, layout="planes")
    x = _x((M, K), seed=3)
    bias = _x((N,), seed=4)
    with autotune.force("w12.matmul", config=cfg):
        out = w12.matmul(x, p, bias)
    _check(out, x, w, p, bias)


@pytest.mark.parametrize("variant", VARIANTS)
def test_batch_dims_bias_noncontiguous(variant):
    N, K = 40, 130
    w = _weight(N, K, seed=11)
    p = w12.pack(w, layout="planes")
    bias = _x((N,), seed=12)
    big = _x((2, 3, 2 * K), seed=13)
    x = big[..., ::2]  # non-contiguous along K
    xt = _x((K, 3), seed=14).t()  # [3, K] with stride (1, 3)
    with autotune.force("w12.matmul", variant=variant):
        out = w12.matmul(x, p, bias)
        out_t = w12.matmul(xt, p)
    assert out.shape == (2, 3, N)
    _check(out, x, w, p, bias)
    _check(out_t, xt, w, p)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp16_activations(variant):
    N, K = 63, 130
    w = _weight(N, K, seed=21, escapes=False)
    p = w12.pack(w, layout="planes")
    x = _x((3, K), seed=22, dtype=torch.float16)
    bias = _x((N,), seed=23, dtype=torch.float16)
    with autotune.force("w12.matmul", variant=variant):
        out = w12.matmul(x, p, bias)
    assert out.dtype == torch.float16
    _check(out, x, w, p, bias)
    with autotune.force("w12.matmul", config=TcConfig(32, 16, 128, 1, 4, 2, fuse=True)):  # tf32 path, one dot
        _check(w12.matmul(x, p, bias), x, w, p, bias)


@pytest.mark.parametrize("variant", VARIANTS)
def test_nonfinite_and_zero_rows(variant):
    N, K = 12, 75
    w = _weight(N, K, seed=31)
    w[0] = 0.0  # zero row
    w[1] = -0.0
    w[2, 5] = float("inf")
    w[3, 7] = float("-inf")
    w[4, 9] = float("nan")
    w[5, 1], w[5, 2] = float("inf"), float("-inf")  # NaN or +-Inf, by the signs of x
    w[6, :] = 3e-39  # subnormal row (e0 = 0)
    w[7, :] = 2.0**100
    p = w12.pack(w, layout="planes")
    x = _x((4, K), seed=32)
    x[1, 5] = 0.0  # 0 * Inf -> NaN, as in F.linear
    with autotune.force("w12.matmul", variant=variant):
        out = w12.matmul(x, p)
    ref = w12.matmul_reference(x, p)
    assert torch.isnan(out[:, 4]).all() and torch.isnan(out[1, 2]) and torch.isinf(out[:, 3]).all()
    assert torch.isnan(ref).any() and torch.isinf(ref).any()
    _check(out, x, w, p)  # NaN and Inf positions must match the fp64 reference exactly
    assert_bitwise_equal(out[:, 0], ref[:, 0].to(torch.bfloat16), "zero row")


@pytest.mark.parametrize("cfg", [TcConfig(block_n=16, block_t=16, block_k=64, num_warps=4, select_zero=True),
                                 GemvConfig(block_n=16, block_t=16, block_k=64, select_zero=True),
                                 TcConfig(block_n=16, block_t=16, block_k=64, num_warps=4, split_k=2,
                                          select_zero=True),
                                 TcConfig(block_n=16, block_t=16, block_k=128, num_warps=4, select_zero=True,
                                          fuse=True)],
                         ids=["tc", "gemv", "tc-split2", "tc-fuse"])
def test_one_hot_rows_recover_weight_bitwise(cfg):
    """x = I: every output is one product w*1 (plus zeros), so the result is W^T bit for bit,
    escapes included (with select_zero; the default decode trades this for a cheaper hot path)."""
    N, K = 20, 16
    w = _weight(N, K, seed=41)
    w[3, 4] = 1e-30  # tiny escape beside normal weights
    w[5, :] = 0.0
    p = w12.pack(w, layout="planes")
    assert p.num_escapes > 0
    x = torch.eye(K, dtype=torch.bfloat16, device=DEV)
    with autotune.force("w12.matmul", config=cfg):
        out = w12.matmul(x, p)
    # + 0.0 maps -0.0 to +0.0: a sum of zero products is +0.0 in F.linear too
    assert_bitwise_equal(out + 0.0, w.t().contiguous() + 0.0, "one-hot")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("M,N,K", [(1, 63, 130), (5, 130, 75)], ids=["M1-N63-K130", "M5-N130-K75"])
def test_matmul_q8(variant, M, N, K):
    w = _weight(N, K, seed=51)
    p = w12.pack(w, layout="planes")
    x = _x((M, K), seed=52)
    with autotune.force("w12.matmul", variant=variant):
        out = w12.matmul_q8(x, p)
    _check(out, x, w, p, q8=True)
    # and the documented distance to the exact product: <= 2^-4 * sum |x| |w| (+ rounding)
    exact = w12.matmul_reference(x, p)
    bound = 2.0**-4 * (x.double().abs() @ w.double().abs().T) + 2.0**-7 * exact.abs() + 1e-30
    assert bool(((out.double() - exact).abs() <= bound).all())


def test_q8_forced_config_and_split():
    N, K = 33, 260
    w = _weight(N, K, seed=61)
    p = w12.pack(w, layout="planes")
    x = _x((2, K), seed=62)
    bias = _x((N,), seed=63)
    for cfg in (TC_SMALL, GEMV_SMALL):
        with autotune.force("w12.matmul_q8", config=cfg):
            out = w12.matmul_q8(x, p, bias)
        _check(out, x, w, p, bias, q8=True)


def test_default_dispatch_and_empty():
    w = _weight(10, 64, seed=71)
    p = w12.pack(w, layout="planes")
    x = _x((2, 64), seed=72)
    _check(w12.matmul(x, p), x, w, p)  # interpreter -> the portable variant
    out = w12.matmul(torch.empty(0, 64, dtype=torch.bfloat16, device=DEV), p)
    assert out.shape == (0, 10)


def test_torch_fallback_variant():
    w = _weight(10, 70, seed=81)
    p = w12.pack(w, layout="planes")
    x = _x((3, 70), seed=82)
    with autotune.force("w12.matmul", variant="torch"):
        _check(w12.matmul(x, p), x, w, p)
        _check(w12.matmul_q8(x, p), x, w, p, q8=True)


def test_bad_inputs_say_how_to_fix():
    w = _weight(8, 64, seed=91)
    p = w12.pack(w, layout="planes")
    x = _x((2, 64), seed=92)
    with pytest.raises(ValueError, match="last dim of x must be K=64"):
        w12.matmul(_x((2, 63), seed=1), p)
    with pytest.raises(TypeError, match=r"x.to\(torch.bfloat16\)"):
        w12.matmul(x.float(), p)
    with pytest.raises(TypeError, match=r"w12.pack"):
        w12.matmul(x, w)
    with pytest.raises(ValueError, match="packed.to"):
        w12.matmul(torch.empty(2, 64, dtype=torch.bfloat16, device="meta"), p)
    with pytest.raises(ValueError, match="bias must be a tensor of shape"):
        w12.matmul(x, p, torch.zeros(9, dtype=torch.bfloat16, device=DEV))
    bad = w12.pack(w, layout="planes")
    bad.lo = bad.lo[:, :-1].contiguous()
    with pytest.raises(w12.W12FormatError, match="lo has shape"):
        w12.matmul(x, bad)
    bad = w12.pack(w, layout="planes")
    bad.e0 = bad.e0.int()
    with pytest.raises(w12.W12FormatError, match="re-pack"):
        w12.matmul_q8(x, bad)
    with pytest.raises(ValueError, match="w12.matmul: unknown variant 'nope'"):
        with autotune.force("w12.matmul", variant="nope"):
            w12.matmul(x, p)
    with pytest.raises(ValueError, match=r"w12.matmul_q8: unknown variant 'nope'; choose one of"):
        w12.matmul_q8(x, p, variant="nope")
    with pytest.raises(ValueError, match=r"w12.matmul: out must be a contiguous .* shape \(2, 8\)"):
        w12.matmul(x, p, out=torch.empty(2, 9, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match=r"w12.matmul: out must be .*torch.bfloat16"):
        w12.matmul(x, p, out=torch.empty(2, 8, dtype=torch.float16, device=DEV))


def test_error_messages_share_one_prefix_style():
    """Every public w12 error reads `w12.<function>: <what is wrong>; <how to fix>`."""
    w = _weight(8, 64, seed=91)
    p = w12.pack(w, layout="planes")
    x = _x((2, 64), seed=92)
    bad_calls = [lambda: w12.matmul(_x((2, 63), seed=1), p), lambda: w12.matmul(x.float(), p),
                 lambda: w12.matmul(x, w), lambda: w12.matmul(x, p, torch.zeros(9, device=DEV)),
                 lambda: w12.matmul(x, p, torch.zeros(8, dtype=torch.int32, device=DEV)),
                 lambda: w12.matmul(x, p, variant="nope"), lambda: w12.matmul_q8(x, p, out=x)]
    for call in bad_calls:
        with pytest.raises((TypeError, ValueError)) as e:
            call()
        assert re.match(r"w12\.matmul(_q8)?: [^;]+; \S", str(e.value)), str(e.value)


@pytest.mark.parametrize("variant", VARIANTS + ("torch",))
def test_variant_and_out_keywords(variant):
    """`variant=` picks the kernel like `autotune.force`; `out=` is written in place and returned."""
    N, K = 24, 130
    w = _weight(N, K, seed=93)
    p = w12.pack(w, layout="planes")
    x = _x((2, 3, K), seed=94)
    with autotune.force("w12.matmul", variant=variant):
        want = w12.matmul(x, p)
        want_q8 = w12.matmul_q8(x, p)
    out = torch.empty(2, 3, N, dtype=torch.bfloat16, device=DEV)
    assert w12.matmul(x, p, variant=variant, out=out) is out
    assert_bitwise_equal(out, want)
    assert_bitwise_equal(w12.matmul_q8(x, p, variant=variant), want_q8)
    with autotune.force("w12.matmul", variant="gemv" if variant != "gemv" else "tc"):  # the keyword wins
        assert_bitwise_equal(w12.matmul(x, p, variant=variant), want)


def test_plan_is_cached_per_shape_key():
    """One plan per (op, bucketed M, N, K, dtype, ...): a second call of the bucket reuses it, a forced
    config is part of the key, and autotune.clear_plans() (store_tuned calls it) forgets them."""
    from w12 import ops as wops

    N, K = 24, 130
    p = w12.pack(_weight(N, K, seed=95), layout="planes")
    autotune.clear_plans()
    w12.matmul(_x((3, K), seed=96), p)
    assert len(wops._PLANS) == 1
    w12.matmul(_x((4, K), seed=97), p)  # same bucket (M -> 4)
    plan = next(iter(wops._PLANS._plans.values()))
    assert len(wops._PLANS) == 1 and isinstance(plan, autotune.Plan)
    # no CUDA C++ kernels on this machine: the automatic choice is the generation's Triton variant
    want = wops.VARIANTS.default(DEV) if wops.wcuda.available(DEV) else wops._TRITON.default(DEV)
    assert plan.variant == want and plan.kernel in ("tc", "gemv", "mma")
    with autotune.force("w12.matmul", config=GEMV_SMALL):
        w12.matmul(_x((3, K), seed=96), p)
    assert len(wops._PLANS) == 2
    autotune.clear_plans()
    assert len(wops._PLANS) == 0


def test_registered_op_and_compile():
    """The torch op (triton_op) gives the eager result; dynamo traces matmul with fullgraph=True.
    (Backend "eager": under the interpreter wrap_triton leaves kernels untraced, so AOT/inductor
    tracing is checked on the GPU, tests/w12/test_matmul_gpu.py.)"""
    w = _weight(20, 64, seed=101)
    p = w12.pack(w, layout="planes")
    x = _x((3, 64), seed=102)
    eager = w12.matmul(x, p)
    via_op = torch.ops.specpilot_w12.matmul(x, p.hi, p.lo, p.e0, p.esc_rowptr, p.esc_col, p.esc_val, None, False,
                                            "gemv")
    assert_bitwise_equal(via_op, eager)
    torch._dynamo.reset()
    f = torch.compile(lambda a: w12.matmul(a, p), fullgraph=True, backend="eager")
    assert_bitwise_equal(f(x), eager)
    out = torch.empty_like(eager)
    g = torch.compile(lambda a, o: w12.matmul(a, p, variant="gemv", out=o), fullgraph=True, backend="eager")
    g(x, out)
    assert_bitwise_equal(out, via_op)


def test_pick_split_k():
    assert pick_split_k(tiles=1000, n_iters=100, slots=132) == 1
    s = pick_split_k(tiles=40, n_iters=136, slots=264)  # down_proj-like: 40 row tiles, K=17408/128
    assert 2 <= s <= 34 and 40 * s >= 0.8 * 264
    assert pick_split_k(tiles=40, n_iters=3, slots=264) == 1  # too few iterations to split


def _emulate_pk_decode(h: torch.Tensor, lo: torch.Tensor, e0: torch.Tensor, mode: str) -> torch.Tensor:
    """The PTX op sequence of `pk_decode.asm_text(mode, 'bf16')` on int64 torch tensors (32-bit wrap).
    h, lo, e0: integer tensors of one shape, 4 elements per pack along the last dim
    (length divisible by 4). Returns the bf16 bit patterns (int64 0..0xFFFF) per element."""
    M32 = 0xFFFFFFFF
    h4 = h.long().reshape(-1, 4)
    l4 = lo.long().reshape(-1, 4)
    e4 = (e0.long() << 7).reshape(-1, 4)
    if mode == "q8":  # the caller passes the view's row constant (tc._q8_base)
        e4 = torch.where(e4 > 0, e4 + 8, 0)
    outs = []
    for p in range(2):
        t = h4[:, 2 * p] | (h4[:, 2 * p + 1] << 16)  # prmt {b, 0, b', 0}
        n = l4[:, 2 * p] | (l4[:, 2 * p + 1] << 16)
        e2 = e4[:, 2 * p] | (e4[:, 2 * p + 1] << 16)  # two int16 elements in one register
        s = ((t << 8) & M32) & 0x80008000
        w = ((t << 4) & M32) & 0x07F007F0
        if mode != "q8":
            if mode == "hi":
                n = n >> 4
            w |= n & 0x000F000F
        w = ((w + e2) & M32) | s
        outs += [w & 0xFFFF, w >> 16]
    o = torch.stack([outs[0], outs[1], outs[2], outs[3]], dim=1)
    return o.reshape(h.shape)


@pytest.mark.parametrize("mode", ["lo", "hi", "q8"])
def test_packed_asm_decode_logic_bitexact(mode):
    """The op sequence of the packed PTX decode (kernels/pk_decode.py), emulated on CPU, equals
    the plain decode for every hi byte x nibble and e0 across [0, 240], with mixed e0 per pack."""
    from w12.kernels import pk_decode

    hi = torch.arange(256).repeat_interleave(16)  # 4096 codes: hi x nibble
    nib = torch.arange(16).repeat(256)
    lo = nib if mode == "lo" else (nib << 4) | ((nib * 7) & 0xF)  # the other nibble is noise
    if mode == "lo":
        lo = lo | (((nib * 5) & 0xF) << 4)
    for e0s in ([0], [1], [112], [127], [240], [3, 240, 0, 77]):
        e0 = torch.tensor(e0s).repeat(4096 // len(e0s))
        got = _emulate_pk_decode(hi, lo, e0, mode)
        E = e0 << 7
        if mode == "q8":
            want = hi * 16 + (hi & 0x80) * 240 + torch.where(E > 0, E + 8, 0)
        else:
            want = hi * 16 + (hi & 0x80) * 240 + nib + E  # tc._decode_bits (SELECT_ZERO=False)
        assert torch.equal(got, want), (mode, e0s)
    # and the text the kernels use carries the same structure (one add of the row base per pair)
    assert pk_decode.asm_text(mode, "bf16").count("add.u32 w, w,") == 2


def _run_ptx(text: str, inputs: list[int], n_out: int) -> list[int]:
    """A reader of the few 32-bit PTX instructions pk_decode emits (mov, prmt in its default mode, sign replication
    included, shl, shr, and, or, add, mul.lo), run on Python ints: the outputs $0..$(n_out - 1) for the inputs
    $n_out, ..."""
    regs = {f"${n_out + i}": v & 0xFFFFFFFF for i, v in enumerate(inputs)}

    def val(x):
        return regs[x] if x in regs else int(x, 0)

    for ins in text.strip("{} ").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        if op == "prmt.b32":
            pool, sel = val(a[1]) | (val(a[2]) << 32), val(a[3])
            r = 0
            for i in range(4):  # a selector nibble's bit 3 replicates the selected byte's sign over the byte
                b = (pool >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF
                r |= ((0xFF if b & 0x80 else 0) if (sel >> (4 * i + 3)) & 1 else b) << (8 * i)
        else:
            x, y = val(a[1]), (val(a[2]) if len(a) > 2 else 0)
            r = {"mov.b32": lambda: x, "shl.b32": lambda: x << y, "shr.b32": lambda: x >> y, "and.b32": lambda: x & y,
                 "or.b32": lambda: x | y, "add.u32": lambda: x + y, "mul.lo.u32": lambda: x * y}[op]()
        regs[a[0]] = r & 0xFFFFFFFF
    return [regs[f"${i}"] for i in range(n_out)]


@pytest.mark.parametrize("mode", ["lo", "hi", "q8", "lo0", "hi0", "lo4", "hi4"])
def test_packed_asm_text_run_instruction_by_instruction(mode):
    """The PTX text itself (not a transcription of it), run instruction by instruction on every hi byte x nibble
    with mixed row bases, equals the plain decode: for 'lo0' / 'hi0' the one of lmhead's exact logits, code 0 ->
    +0.0 (lmhead.kernels.screen._code_w12); 'lo4' / 'hi4' (the batch kernel's four instructions a pair) the same
    bits as 'lo' / 'hi'."""
    from w12.kernels import pk_decode

    text = pk_decode.asm_text(mode, "bf16")
    g = torch.Generator().manual_seed(5)
    hi = torch.arange(256).repeat_interleave(16)
    nib = torch.arange(16).repeat(256)
    other = torch.randint(0, 16, (4096,), generator=g)  # the byte's other nibble: noise
    lo = (nib << 4) | other if mode in ("hi", "hi0", "hi4") else nib | (other << 4)
    e0 = torch.tensor([0, 1, 112, 127, 240, 3, 77, 200]).repeat(512)
    E = e0 << 7
    if mode == "q8":
        E = torch.where(E > 0, E + 8, 0)
    got = torch.empty(4096, dtype=torch.long)
    for i in range(0, 4096, 4):
        pack = lambda t: sum(int(t[i + k]) << (8 * k) for k in range(4))  # noqa: E731
        e2 = [int(E[i]) | (int(E[i + 1]) << 16), int(E[i + 2]) | (int(E[i + 3]) << 16)]
        w0, w1 = _run_ptx(text, [pack(hi), pack(lo), *e2], 2)
        got[i:i + 4] = torch.tensor([w0 & 0xFFFF, w0 >> 16, w1 & 0xFFFF, w1 >> 16])
    c = (hi << 4) | nib
    if mode == "q8":
        want = hi * 16 + (hi & 0x80) * 240 + E
    else:
        want = ((c & 0x7FF) + E) | ((c & 0x800) << 4)
        if mode in ("lo0", "hi0"):
            want = torch.where(c == 0, 0, want)
    assert torch.equal(got, want)


@pytest.mark.slow
def test_asm_configs_run_plain_decode_on_cpu():
    """asm=True / tok2d=True configs are valid everywhere; off-GPU the plain decode runs."""
    w = _weight(40, 130, seed=91)
    p = w12.pack(w, layout="planes")
    for M, cfg in ((3, GemvConfig(16, 4, 64, 2, 4, 1, asm=True, tok2d=True)),
                   (2, GemvConfig(16, 2, 64, 1, 4, 1, tok2d=True)),
                   (1, GemvConfig(8, 1, 128, 1, 4, 1, tok2d=True)),
                   (5, TcConfig(32, 16, 64, 2, 4, 2, asm=True)),
                   (5, TcConfig(32, 16, 128, 2, 4, 2, asm=True, fuse=True))):
        x = _x((M, 130), seed=M + 90)
        with autotune.force("w12.matmul", config=cfg):
            _check(w12.matmul(x, p), x, w, p)
            _check(w12.matmul_q8(x, p), x, w, p, q8=True)
    with pytest.raises(ValueError, match="tok2d"):
        GemvConfig(block_t=8, tok2d=True)


def test_h200_tuned_file_is_accepted_and_dispatches(monkeypatch):
    """autotune/configs/h200.json as the H200 sees it (GPU name and Triton major.minor match): the
    sm_90 "tc" variant runs the tuned GEMV at M=1, the GEMV at M=2 only where a `tc.gemv` entry
    says it won, and the tensor-core kernel above."""
    from autotune import config as ac
    from w12 import ops as wops

    data = __import__("json").loads(ac.Path(ac.__file__).parent.joinpath("configs", "h200.json").read_text())
    monkeypatch.setattr(ac, "has_cuda", lambda: True)
    monkeypatch.setattr(ac, "is_interpreter", lambda: False)
    monkeypatch.setattr(ac, "gpu_name", lambda device=None: data["meta"]["gpu"])
    monkeypatch.setattr(ac, "gpu_slug", lambda device=None: "h200")
    monkeypatch.delenv("SPECPILOT_TUNED_CONFIGS", raising=False)
    monkeypatch.delenv("SPECPILOT_CONFIG_DIR", raising=False)
    ac._TUNED.clear()
    autotune.clear_plans()
    try:
        if autotune.versions()["triton"].split(".")[:2] != str(data["meta"]["triton"]).split(".")[:2]:
            pytest.skip("this Triton's major.minor differs from the tuned file's: the policy ignores it")
        entries = autotune.load_tuned()
        assert entries, "the H200 file was rejected"
        def plan(op, M, N, K):  # meta tensors: the plan reads shapes, dtypes and the device only
            x = torch.empty(M, K, dtype=torch.bfloat16, device="meta")
            return wops._plan(op, "tc", x, torch.empty(N, K, dtype=torch.uint8, device="meta"))[1:]

        kname, cfg = plan(wops.OP, 1, 5120, 17408)
        assert kname == "gemv" and cfg == GemvConfig(**{k: v for k, v in
                                                        entries["w12.matmul/gemv/K17408-M1-N5120"].items() if k != "_"})
        for (M, N, K) in ((2, 248320, 5120), (2, 5120, 6144), (4, 248320, 5120), (16, 5120, 17408)):
            key = autotune.shape_key(M=M, N=N, K=K)
            for op in (wops.OP, wops.OP_Q8):
                kname, cfg = plan(op, M, N, K)
                want = "gemv" if f"{op}/tc.gemv/{key}" in entries else "tc"
                assert kname == want and isinstance(cfg, GemvConfig if want == "gemv" else TcConfig), (op, key)
        assert any("/tc.gemv/" in k for k in entries)
    finally:
        ac._TUNED.clear()
        autotune.clear_plans()


def test_cpu_tensors_without_the_interpreter_use_the_torch_variant(monkeypatch):
    """No Triton backend for CPU tensors: the automatic variant is "torch" (and "torch" by name), and a Triton or
    CUDA variant asked for by name, or a forced kernel config, raises with the fix instead of running the torch
    path under its name."""
    import autotune.dispatch

    monkeypatch.setattr(autotune.dispatch, "is_interpreter", lambda: False)
    monkeypatch.setattr(autotune.hardware, "is_interpreter", lambda: False)  # autotune.hardware.host_only reads it
    monkeypatch.setattr(autotune, "is_interpreter", lambda: False)
    w = _weight(10, 70, seed=83).cpu()
    p = w12.pack(w, layout="planes")
    x = _x((3, 70), seed=84).cpu()
    _check(w12.matmul(x, p), x, w, p)
    _check(w12.matmul(x, p, variant="torch"), x, w, p)
    for variant in ("tc", "gemv", "mma"):
        with pytest.raises(ValueError, match=rf"^w12\.matmul: variant '{variant}' cannot run on CPU tensors without "
                                             r"the Triton interpreter; .*TRITON_INTERPRET=1.*variant=None or 'torch'"):
            w12.matmul(x, p, variant=variant)
    with autotune.force("w12.matmul", config=GemvConfig()):
        with pytest.raises(ValueError, match=r"^w12\.matmul: the forced GemvConfig is a kernel config, and no kernel "
                                             r"runs CPU tensors without the Triton interpreter; "):
            w12.matmul(x, p)


@pytest.mark.parametrize("variant, cfg", [("tc", TcConfig(block_n=16, block_t=16, block_k=128, num_warps=4, num_stages=1)),
                                          ("gemv", GemvConfig(block_n=16, block_t=2, block_k=256, num_stages=1))])
def test_no_partial_k_tile_reads_past_the_planes(variant, cfg, monkeypatch):
    """The Triton kernels read whole BLOCK_K tiles of hi and lo without a mask: a config whose block_k does not
    divide the padded width (K = 64 or 130: Kp = 64 or 192) launches with block_k = 64, so no tile reads past a
    row or past the planes' end; a block_k that divides it is kept."""
    from w12 import ops

    name = "w12_matmul_tc_kernel" if variant == "tc" else "w12_matmul_gemv_kernel"
    real = getattr(ops, name)
    seen = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((args[13], kw["BLOCK_K"]))  # (Kp, BLOCK_K)
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(ops, name, Spy())
    for K in (64, 130, 256):
        w = _weight(20, K, seed=K)
        p = w12.pack(w, layout="planes")
        x = _x((2, K), seed=K)
        with autotune.force("w12.matmul", config=cfg):
            out = w12.matmul(x, p)
        _check(out, x, w, p)
    want_bk = {64: 64, 192: 64, 256: cfg.block_k if 256 % cfg.block_k == 0 else 64}
    assert seen == [(kp, want_bk[kp]) for kp in (64, 192, 256)]
