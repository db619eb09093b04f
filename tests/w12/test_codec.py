"""numba CPU codec: bit-identical to the torch path both ways, plus pack/unpack benchmarks."""

import numpy as np
import pytest
import torch

import w12
from specpilot.testing import assert_bitwise_equal
from w12 import codec
from w12.format import PLANES

ALL = (torch.arange(65536, dtype=torch.int32) - ((torch.arange(65536, dtype=torch.int32) & 0x8000) << 1)).to(
    torch.int16).view(torch.bfloat16)


def _same_planes(a, b):
    assert (a.N, a.K, a.Kp) == (b.N, b.K, b.Kp)
    for p in PLANES:
        assert_bitwise_equal(getattr(a, p), getattr(b, p), msg=p)


def _weights():
    g = torch.Generator().manual_seed(0)
    yield "N256-K256-all", ALL[torch.randperm(65536, generator=g)].reshape(256, 256)
    yield "N65536-K1-all", ALL.reshape(65536, 1)
    yield "N1024-K64-all", ALL.flip(0).reshape(1024, 64)
    for N, K in [(1, 1), (3, 5), (63, 75), (7, 1), (2000, 3), (5, 129)]:
        w = (torch.randn(N, K, generator=g) * 0.02).bfloat16()
        w[0, 0] = float("nan")
        yield f"N{N}-K{K}", w


CASES = list(_weights())


@pytest.mark.parametrize("w", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_codec_matches_torch(w):
    pt = w12.pack(w, layout="planes")
    pn = codec.pack(w)  # verify=True: numba decode checked too
    _same_planes(pt, pn)
    assert_bitwise_equal(codec.unpack(pt), w)  # torch-packed -> numba-unpacked
    assert_bitwise_equal(w12.unpack(pn), w)  # numba-packed -> torch-unpacked


def test_codec_numpy_api():
    bits = ALL.reshape(128, 512).view(torch.int16).numpy().view(np.uint16)
    planes = codec.pack_bits(bits)
    assert planes["K"] == 512 and planes["esc_val"].dtype == np.int16
    assert np.array_equal(codec.unpack_bits(planes), bits)
    with pytest.raises(TypeError, match="uint16"):
        codec.pack_bits(bits.astype(np.int32))
    with pytest.raises(ValueError, match="empty"):
        codec.pack_bits(np.zeros((0, 4), np.uint16))
    with pytest.raises(TypeError, match="bfloat16"):
        codec.pack(torch.zeros(2, 2))


def _bench_weight():
    return (torch.randn(2048, 2048, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()


def test_bench_codec_pack(benchmark):
    w = _bench_weight()
    codec.pack(w[:2, :64], verify=False)  # compile outside the timing
    p = benchmark(codec.pack, w, verify=False)
    assert p.shape == w.shape


def test_bench_codec_unpack(benchmark):
    w = _bench_weight()
    p = codec.pack(w)
    out = benchmark(codec.unpack, p)
    assert_bitwise_equal(out, w)


def test_bench_torch_pack(benchmark):
    w = _bench_weight()
    p = benchmark(w12.pack, w, verify=False, layout="planes")
    assert p.shape == w.shape


def test_bench_torch_unpack(benchmark):
    w = _bench_weight()
    p = w12.pack(w, layout="planes")
    out = benchmark(w12.unpack, p)
    assert_bitwise_equal(out, w)
