"""W12 slices along N and K (specpilot.sglang.sharding) decode to the same slices of the unpacked weight, bit for
bit, and tensor-parallel runs over two gloo processes give the single-process results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import w12

from specpilot.sglang import sharding

from tests_sglang.tp_workers import run_two_ranks


def _weight(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * 0.02).to(torch.bfloat16)
    flat = w.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[: max(4, flat.numel() // 50)]
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e30, -1e-38, 0.0, -0.0, 65504.0],
                            dtype=torch.bfloat16)
    flat[idx] = specials.repeat(idx.numel() // specials.numel() + 1)[: idx.numel()]
    return w


def _bits(t):
    return t.view(torch.int16)


@pytest.mark.parametrize("N,K", [(37, 130), (8, 64), (63, 500)], ids=lambda v: str(v))
def test_slice_n_exact(N, K):
    w = _weight(N, K, seed=N)
    p = w12.pack(w, layout="planes")
    assert p.num_escapes > 0
    for a, b in ((0, N), (0, 1), (N // 3, N - 2), (N - 1, N)):
        q = sharding.slice_n(p, a, b).validate(deep=True)
        assert torch.equal(_bits(w12.unpack(q)), _bits(w[a:b]))


@pytest.mark.parametrize("N,K", [(37, 130), (9, 256), (5, 500)], ids=lambda v: str(v))
def test_slice_k_exact(N, K):
    w = _weight(N, K, seed=K)
    p = w12.pack(w, layout="planes")
    for a, b in ((0, K), (0, 64), (64, K), (0, K // 2 + 3), (64, 64 + 37), (7, K - 5), (K - 1, K)):
        q = sharding.slice_k(p, a, b).validate(deep=True)
        assert q.K == b - a
        assert torch.equal(_bits(w12.unpack(q)), _bits(w[:, a:b])), (a, b)


def test_split_concat_round_trip():
    w = _weight(48, 128, seed=3)
    p = w12.pack(w, layout="planes")
    parts = sharding.split_n(p, [16, 8, 24])
    assert [q.N for q in parts] == [16, 8, 24]
    back = sharding.concat_n(parts).validate(deep=True)
    for name in ("hi", "lo", "e0", "esc_rowptr", "esc_col", "esc_val"):
        assert torch.equal(getattr(back, name), getattr(p, name)), name


def test_merged_shard_layout():
    """A merged weight's rank shard holds every logical part's rank slice, stacked."""
    sizes, K = [32, 16, 16], 96
    w = _weight(sum(sizes), K, seed=4)
    p = w12.pack(w, layout="planes")
    for rank in range(2):
        got = w12.unpack(sharding.shard_merged_n(p, sizes, rank, 2))
        want, r0 = [], 0
        for s in sizes:
            want.append(w[r0 + rank * s // 2 : r0 + (rank + 1) * s // 2])
            r0 += s
        assert torch.equal(_bits(got), _bits(torch.cat(want)))


def test_bad_ranges_say_how_to_fix():
    p = w12.pack(_weight(8, 64), layout="planes")
    with pytest.raises(ValueError, match="specpilot.sglang.slice_n"):
        sharding.slice_n(p, 4, 4)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 3"):
        sharding.shard_n(p, 0, 3)
    with pytest.raises(ValueError, match="output_partition_sizes"):
        sharding.split_n(p, [3, 4])


def test_tp2_sharded_linears_gloo():
    """Two gloo ranks: N-sharded W12 (all-gather) equals the single-process output bit for bit; K-sharded W12
    (all-reduce of the ranks' BF16 partial products) equals the same split computed in one process, bit for bit,
    and the unsplit product within the rounding of two BF16 partial sums."""
    res = run_two_ranks("linears")
    assert res["n_equal"], res
    assert res["k_equal_split"], res
    assert res["k_close"], res


def test_tp2_certified_argmax_gloo():
    """Two gloo ranks, each a certified head over its half of the vocabulary (with exact ties across the halves):
    the combined argmax equals torch.argmax over the whole exact logits, bit for bit."""
    res = run_two_ranks("argmax")
    assert res["equal"], res
    assert res["ties_to_lowest"], res
