"""W12 format: exhaustive bit-exact round trips, odd shapes, escapes, window choice, errors."""

import io

import pytest
import torch
import torch.nn.functional as F

import w12
import w12.format as fmt
from specpilot.testing import assert_bitwise_equal
from w12.reference import decode_q8, matmul_reference, pack_reference, unpack_reference

from flow_emu import assert_same_planes


def bf16_of_bits(bits) -> torch.Tensor:
    """BF16 tensor from ints in [0, 65535]."""
    b = torch.as_tensor(bits, dtype=torch.int32)
    return (b - ((b & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)


def bits_of(w: torch.Tensor) -> torch.Tensor:
    return w.contiguous().view(torch.int16).int() & 0xFFFF


def gaussian(N, K, seed=0, std=0.02):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, K, generator=g) * std).bfloat16()


ALL = bf16_of_bits(torch.arange(65536))
# (256, 256) and (1024, 64) stay in the fast loop; the other shapes run with the slow tests
EXHAUSTIVE_SHAPES = [(256, 256), (1024, 64)] + [pytest.param(s, marks=pytest.mark.slow)
                                             for s in [(1, 65536), (65536, 1), (512, 128), (128, 512), (64, 1024)]]
ORDERS = ["sorted", "perm", "reversed", "interleaved"]


def _order(name):
    if name == "sorted":
        return torch.arange(65536)
    if name == "reversed":
        return torch.arange(65535, -1, -1)
    if name == "interleaved":  # sign-flipped neighbours: +x, -x, +y, -y ...
        return torch.arange(65536).view(2, 32768).t().reshape(-1)
    return torch.randperm(65536, generator=torch.Generator().manual_seed(1234))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", EXHAUSTIVE_SHAPES, ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_exhaustive_round_trip(shape, order):
    w = ALL[_order(order)].reshape(shape)
    p = w12.pack(w, layout="planes")  # verify=True also checks
    assert_bitwise_equal(w12.unpack(p), w)
    assert_bitwise_equal(p.unpack(), w)
    p.validate(deep=True)


@pytest.mark.parametrize("shape", [(256, 256), (2048, 32)], ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_exhaustive_matches_reference(shape):
    w = ALL[_order("perm")].reshape(shape)
    p, r = w12.pack(w, layout="planes"), pack_reference(w)
    assert_same_planes(p, r)
    assert_bitwise_equal(unpack_reference(p), w)


def _hostile_row(K, e_lo=120):
    """A row whose bulk sits in [e_lo, e_lo + 15], salted with every awkward pattern."""
    g = torch.Generator().manual_seed(K)
    e = e_lo + torch.arange(K) % 16  # every bin of the window populated: the window is unambiguous
    bits = (torch.randint(0, 2, (K,), generator=g) << 15) | (e << 7) | torch.randint(0, 128, (K,), generator=g)
    hostile = [
        0x7FC0, 0x7F81, 0xFFFF, 0x7FFF, 0xFFC1,  # NaNs with payloads, both signs
        0x7F80, 0xFF80,  # +-Inf
        0x0000, 0x8000,  # +-0
        0x0001, 0x007F, 0x8001, 0x807F,  # subnormals
        e_lo << 7,  # the reserved pattern s=0, off=0, m=0 (row's e0 == e_lo)
        (e_lo << 7) | 0x8000,  # its negative twin: dense (code 0x800)
        (e_lo - 1) << 7 | 5, (e_lo + 16) << 7 | 3,  # just outside the window
    ]
    inner = torch.arange(K)[(torch.arange(K) % 16 != 0) & (torch.arange(K) % 16 != 15)]  # keep the edge bins
    pos = inner[torch.randperm(inner.numel(), generator=g)[: len(hostile)]]
    bits[pos] = torch.tensor(hostile)
    return bits, pos, hostile


@pytest.mark.parametrize("K", [64, 75, 130], ids=lambda k: f"K{k}")
def test_hostile_rows(K):
    rows = [_hostile_row(K, e_lo=100 + 3 * i) for i in range(5)]
    w = bf16_of_bits(torch.stack([r[0] for r in rows]))
    p = w12.pack(w, layout="planes")
    assert_bitwise_equal(p.unpack(), w)
    assert_same_planes(p, pack_reference(w))
    p.validate(deep=True)
    rowptr = p.esc_rowptr.tolist()
    for n, (_, pos, hostile) in enumerate(rows):
        assert int(p.e0[n]) == 100 + 3 * n
        esc_cols = set(p.esc_col[rowptr[n] : rowptr[n + 1]].tolist())
        # every hostile value but the negative twin of the reserved pattern escapes; nothing else does
        expected = {int(c) for c, h in zip(pos, hostile) if h != ((100 + 3 * n) << 7) | 0x8000}
        assert esc_cols == expected


ODD_SHAPES = [(1, 1), (3, 5), (63, 75), (7, 1), (2000, 3), (5, 129), (4, 64), (2, 500), (1, 63), (33, 65)]


@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_odd_shapes(shape):
    N, K = shape
    w = gaussian(N, K, seed=N * 1000 + K)
    w[0, 0] = float("inf")  # at least one escape everywhere
    p = w12.pack(w, layout="planes")
    assert p.shape == torch.Size(shape) and (p.N, p.K) == shape and p.Kp == -(-K // 64) * 64
    assert p.hi.shape == (N, p.Kp) and p.lo.shape == (N, p.Kp // 2) and p.e0.shape == (N,)
    assert_bitwise_equal(p.unpack(), w)
    if N * K <= 5000:
        assert_same_planes(p, pack_reference(w))
        assert_bitwise_equal(unpack_reference(p), w)
    p.validate(deep=True)


def test_non_contiguous_and_parameter_input():
    w = gaussian(75, 63).t()  # non-contiguous [63, 75]
    p = w12.pack(torch.nn.Parameter(w), layout="planes")
    assert_bitwise_equal(p.unpack(), w.contiguous())


def test_escape_count_and_layout():
    K = 100
    vals = torch.full((2, K), 1.5).bfloat16()  # e = 127 everywhere
    vals[0, 7] = 1e30
    vals[0, 3] = 0.0  # +0 with e0 = 112 != 0: escape
    vals[0, 99] = float("-inf")
    vals[1, 50] = float("nan")
    p = w12.pack(vals, layout="planes")
    assert p.esc_rowptr.tolist() == [0, 3, 4]
    assert p.esc_col.tolist() == [3, 7, 99, 50]
    assert_bitwise_equal(p.esc_val, bits_of(vals)[[0, 0, 0, 1], [3, 7, 99, 50]].to(torch.int32).sub(
        (bits_of(vals)[[0, 0, 0, 1], [3, 7, 99, 50]] & 0x8000) << 1).to(torch.int16))
    codes = fmt._codes(p.hi, p.lo)
    assert codes[0, [3, 7, 99]].tolist() == [0, 0, 0] and codes[1, 50].item() == 0
    assert p.num_escapes == 4
    assert p.escape_rate == pytest.approx(4 / 200)
    assert p.nbytes == int(2 * 128 * 1.5 + 2 * 5 + 4 + 6 * 4)
    assert p.bits_per_weight == pytest.approx(8 * p.nbytes / 200)


def test_lo_interleave_layout():
    # column k gets code k (m = k & 0x7F, e = e0), so the nibbles are easy to read back
    K = 128
    cols = torch.arange(K)
    w = bf16_of_bits((127 << 7) | (cols & 0x7F)).reshape(1, K)
    p = w12.pack(w, layout="planes")
    assert int(p.e0[0]) == 112  # smallest window holding e = 127
    codes = ((15 << 7) | (cols & 0x7F)).tolist()
    for g in range(2):
        for i in range(32):
            want = (codes[64 * g + i] & 0xF) | ((codes[64 * g + 32 + i] & 0xF) << 4)
            assert int(p.lo[0, 32 * g + i]) == want
    assert p.hi[0].tolist() == [c >> 4 for c in codes]


def _row_with_exponents(exps):
    return bf16_of_bits(torch.tensor([(e << 7) | 1 for e in exps])).reshape(1, -1)


@pytest.mark.parametrize(
    "exps, e0",
    [
        ([10] * 5 + [30] * 5, 0),  # tie between windows covering 10 and 30: smallest e0
        ([100] * 3 + [110] * 3 + [125] * 4, 110),  # [110, 125] holds 7
        ([127] * 8 + [200] * 7, 112),  # bulk at 127, window ends at it (smallest e0)
        ([255] * 6 + [1] * 5, 240),  # capped at 240; the Infs/NaNs still escape
        ([0] * 4, 0),
    ],
    ids=["tie", "best-span", "smallest", "cap240", "zeros"],
)
def test_window_choice(exps, e0):
    w = _row_with_exponents(exps)
    p = w12.pack(w, layout="planes")
    assert int(p.e0[0]) == e0
    assert int(pack_reference(w).e0[0]) == e0
    if e0 == 240:
        assert p.num_escapes == len(exps)  # exponent 255 always escapes; e=1 is outside [240, 255]
    assert_bitwise_equal(p.unpack(), w)


def test_verify_failure_raises(monkeypatch):
    real = fmt._decode

    def corrupt(packed):
        out = real(packed).clone()
        v = out.view(torch.int16)
        v[1, 2] ^= 1
        return out

    monkeypatch.setattr(fmt, "_decode", corrupt)
    w = gaussian(4, 9)
    with pytest.raises(w12.W12VerificationError, match=r"1 of 36 elements differ, first at \(1, 2\)"):
        w12.pack(w)
    w12.pack(w, verify=False)  # no check, no error


def test_verify_in_row_chunks(monkeypatch):
    """The check decodes row chunks (bounded temporaries): hostile rows with escapes in every chunk pass, and a
    corrupted element in a later chunk is reported at its own row, counted over the whole weight."""
    monkeypatch.setattr(fmt, "_CHUNK_ELEMS", 2 * 192)  # two rows of Kp = 192 a chunk
    w = bf16_of_bits(torch.stack([_hostile_row(130, e_lo=100 + 3 * i)[0] for i in range(5)]))
    p = w12.pack(w, layout="planes")  # verifies in 3 chunks
    assert p.num_escapes > 0
    assert_bitwise_equal(p.unpack(), w)
    real = fmt._decode

    def corrupt(packed):
        out = real(packed).clone()
        if packed.N == 1:  # the last chunk: row 4
            out.view(torch.int16)[0, 7] ^= 1
        return out

    monkeypatch.setattr(fmt, "_decode", corrupt)
    with pytest.raises(w12.W12VerificationError, match=r"1 of 650 elements differ, first at \(4, 7\)"):
        fmt.verify_packed(p, w)


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (torch.randn(3, 4), TypeError, r"\.to\(torch\.bfloat16\)"),
        (torch.randn(3, 4).half(), TypeError, r"\.to\(torch\.bfloat16\)"),
        (torch.randn(4).bfloat16(), ValueError, "2-D"),
        (torch.randn(2, 3, 4).bfloat16(), ValueError, "2-D"),
        (torch.zeros(0, 5, dtype=torch.bfloat16), ValueError, "empty"),
        (torch.zeros(5, 0, dtype=torch.bfloat16), ValueError, "empty"),
        ([[1.0]], TypeError, "torch.Tensor"),
    ],
    ids=["fp32", "fp16", "1d", "3d", "N0", "K0", "list"],
)
def test_bad_input(bad, exc, match):
    with pytest.raises(exc, match=match):
        w12.pack(bad)


def test_unpack_bad_input():
    with pytest.raises(TypeError, match="W12Weight"):
        w12.unpack(torch.zeros(2, 2))


@pytest.mark.parametrize("weights_only", [None, True], ids=["default", "weights_only"])
def test_torch_save_load(weights_only):
    w = ALL[_order("perm")].reshape(128, 512)
    p = w12.pack(w, layout="planes")
    buf = io.BytesIO()
    torch.save({"layer": p, "n": 3}, buf)
    buf.seek(0)
    kw = {} if weights_only is None else {"weights_only": weights_only}
    q = torch.load(buf, **kw)["layer"]
    assert isinstance(q, w12.W12Weight)
    assert_same_planes(p, q)
    assert_bitwise_equal(q.unpack(), w)


def test_to_and_attributes():
    p = w12.pack(gaussian(3, 70), layout="planes")
    q = p.to("cpu")
    assert q.device == torch.device("cpu") and p.cpu().device.type == "cpu"
    assert_same_planes(p, q)
    assert p.dtype == torch.bfloat16
    assert "W12Weight(shape=(3, 70)" in repr(p)


def _replace(p, **planes):
    K = planes.pop("K", p.K)
    d = p.planes()
    d.update(planes)
    return w12.W12Weight(**d, K=K)


def test_validate_shallow():
    p = w12.pack(gaussian(4, 70), layout="planes")
    cases = [
        (dict(hi=p.hi.int()), "hi has dtype"),
        (dict(lo=p.lo[:, :-1].contiguous()), "lo has shape"),
        (dict(e0=p.e0[:3].contiguous()), "rows"),
        (dict(esc_rowptr=p.esc_rowptr[:-1].contiguous()), "esc_rowptr has shape"),
        (dict(esc_col=torch.zeros(1, dtype=torch.int32)), "equal length"),
        (dict(hi=p.hi.t().contiguous().t()), "not contiguous"),
        (dict(K=200), "pads to"),
    ]
    for kw, match in cases:
        with pytest.raises(w12.W12FormatError, match=match):
            _replace(p, **kw)
    assert issubclass(w12.W12FormatError, ValueError)


def test_validate_deep():
    w = gaussian(4, 70)
    w[1, 5] = float("inf")
    w[1, 9] = float("nan")
    w[2, 0] = 1e30
    p = w12.pack(w, layout="planes")
    p.validate(deep=True)
    assert p.esc_rowptr.tolist() == [0, 0, 2, 3, 3]
    cases = [
        (dict(esc_rowptr=torch.tensor([0, 2, 0, 3, 3], dtype=torch.int32)), "decreases at row 1"),
        (dict(esc_rowptr=torch.tensor([0, 0, 2, 3, 4], dtype=torch.int32)), "end at E=3"),
        (dict(esc_col=torch.tensor([5, 70, 0], dtype=torch.int32)), r"outside \[0, 70\)"),
        (dict(esc_col=torch.tensor([9, 5, 0], dtype=torch.int32)), "not strictly increasing within row 1"),
        (dict(esc_col=torch.tensor([5, 6, 0], dtype=torch.int32)), "non-zero dense code"),
        (dict(e0=torch.tensor([0, 250, 0, 0], dtype=torch.uint8)), "e0"),
    ]
    for kw, match in cases:
        q = _replace(p, **kw)  # shallow checks pass
        with pytest.raises(w12.W12FormatError, match=match) as ei:
            q.validate(deep=True)
        assert "w12.pack" in str(ei.value)
    hi = p.hi.clone()
    hi[0, 100] = 1  # padding column (K = 70, Kp = 128)
    with pytest.raises(w12.W12FormatError, match="padding"):
        _replace(p, hi=hi).validate(deep=True)


def test_decode_q8():
    w = gaussian(16, 300, seed=5)
    w[3, 7] = float("nan")
    w[4, 8] = 1e30
    w[5] = 1.0
    w[5, 10] = 2.0**-15 * (1 + 3 / 128)  # the lowest bin of row 5's window (hi byte 0, not an escape)
    w[6] = 0.0  # a row of zeros
    p = w12.pack(w, layout="planes")
    q = decode_q8(p)
    assert q.dtype == torch.bfloat16 and q.shape == w.shape
    esc = torch.zeros_like(w, dtype=torch.bool)
    rows = torch.repeat_interleave(torch.arange(16), (p.esc_rowptr[1:] - p.esc_rowptr[:-1]).long())
    esc[rows, p.esc_col.long()] = True
    assert_bitwise_equal(q[esc], w[esc])  # escapes exact
    h = p.hi[:, :300]
    keep = ~esc & (w != 0)
    rel = ((q.double() - w.double()).abs() / w.double().abs())[keep]
    assert float(rel.max()) <= 2.0**-4
    # every hi byte reads its bin's midpoint, 0 included (no select): the lowest bin of a row too
    assert int(p.e0[5]) == 112 and int(h[5, 10]) == 0 and not bool(esc[5, 10])
    assert q[5, 10].item() == 2.0**-15 * (1 + 8 / 128)
    # where e0 = 0 each byte reads the lowest value of its bin: a row of zeros reads zeros
    assert int(p.e0[6]) == 0 and not bool(esc[6].any())
    assert_bitwise_equal(q[6], w[6].to(torch.bfloat16))


def test_matmul_reference():
    w = gaussian(33, 70, seed=3)
    p = w12.pack(w, layout="planes")
    x = torch.randn(2, 5, 70, generator=torch.Generator().manual_seed(0)).bfloat16()
    b = torch.randn(33).bfloat16()
    y = matmul_reference(x, p, b)
    assert y.dtype == torch.float64 and y.shape == (2, 5, 33)
    assert torch.equal(y, F.linear(x.double(), w.double(), b.double()))
    with pytest.raises(ValueError, match="features"):
        matmul_reference(torch.randn(2, 71), p)


def test_lazy_ops_import():
    import importlib.util

    assert "matmul" in w12.__all__ and "matmul_q8" in w12.__all__
    if importlib.util.find_spec("w12.ops") is None:
        with pytest.raises(ImportError):
            w12.matmul  # noqa: B018
    with pytest.raises(AttributeError):
        w12.no_such_thing  # noqa: B018


@pytest.mark.gpu
def test_pack_on_cuda_matches_cpu():
    w = ALL[_order("perm")].reshape(256, 256)
    pc = w12.pack(w, layout="planes")
    pg = w12.pack(w.cuda(), layout="planes")
    assert pg.device.type == "cuda"
    assert_same_planes(pc, pg)
    assert_bitwise_equal(pg.unpack().cpu(), w)
    assert_same_planes(pc, pg.to("cpu"))
