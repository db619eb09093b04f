"""The W12 runtime layout (w12/layout.py): tile(v1) and back is the identity on the planes, bit for bit; the tile buffer
holds each byte where docs/w12-format.md ("Runtime layout") says; the bits per weight in memory stay at or below
12.5 for K >= 128 with no row padded to 16 rows or 64 columns."""

from __future__ import annotations

import pytest
import torch

import w12
from w12 import layout

from flow_emu import assert_same_planes, hostile_weight

def decode_documented(t: layout.TiledW12) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo nibble) of every weight [N, K], read from the tile buffer at the offsets the module doc gives, one
    element at a time: an independent reading of the documented byte order."""
    geo = t.geometry
    buf = t.tiles.tolist()
    hi = torch.zeros(t.N, t.K, dtype=torch.int32)
    nib = torch.zeros(t.N, t.K, dtype=torch.int32)
    for n in range(t.N):
        b, r = divmod(n, 16)
        R = geo.rows(b)
        for k in range(t.K):
            c, j = divmod(k, 64)
            if c < geo.KF:
                base = geo.tile_offset(b, c)
                hi[n, k] = buf[base + 64 * r + j]
                p_, jj = divmod(j, 16)
                byte = buf[base + 64 * R + 32 * r + 8 * p_ + (jj % 8)]
                nib[n, k] = (byte >> 4) if jj >= 8 else (byte & 0xF)
            else:
                base = geo.tail_offset(b)
                hi[n, k] = buf[base + geo.kr * r + j]
                byte = buf[base + R * geo.kr + (geo.kr + 1) // 2 * r + j // 2]
                nib[n, k] = (byte >> 4) if j % 2 else (byte & 0xF)
    return hi, nib


@pytest.mark.parametrize("N,K", [(1, 1), (16, 64), (17, 63), (75, 200), (33, 130), (5, 4100), (40, 257), (3, 129)],
                         ids=lambda v: str(v))
def test_tile_and_untile_are_exact_inverses(N, K):
    w = hostile_weight(N, K, seed=N * 1000 + K)
    p = w12.pack(w, layout="planes")
    t = layout.tile(p)  # torch.empty is NaN/0xA5-poisoned in tests: every byte must be written
    assert t.tiles.numel() == layout.Geometry(N, K).nbytes
    back = layout.untile(t)
    assert_same_planes(back, p)
    back.validate(deep=True)
    assert torch.equal(w12.unpack(back).view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize("N,K", [(35, 200), (16, 64), (20, 63), (7, 129)], ids=lambda v: str(v))
def test_bytes_sit_where_the_doc_says(N, K):
    p = w12.pack(hostile_weight(N, K, seed=K), layout="planes")
    t = layout.tile(p)
    hi, nib = decode_documented(t)
    code = (hi << 4) | nib
    from w12.format import _codes

    assert torch.equal(code, _codes(p.hi, p.lo)[:, :K])


def test_hostile_rows_round_trip_on_wide_weights():
    """Every hostile row kind at a K with a masked tail and a partial row block; the escapes are those of pack."""
    w = hostile_weight(21, 4100, seed=3)
    p = w12.pack(w, layout="planes")
    assert p.num_escapes > 100 and int(p.e0.min()) == 0 and int(p.e0.max()) > 200
    t = layout.tile(p)
    assert t.e0 is p.e0 and t.esc_val is p.esc_val
    assert_same_planes(layout.untile(t), p)


@pytest.mark.parametrize("N,K", [(1000, 130), (4096, 4100), (75, 4100), (16, 128), (2, 129), (3, 136), (75, 191)],
                         ids=["N1000-K130", "N4096-K4100", "N75-K4100", "N16-K128", "N2-K129", "N3-K136", "N75-K191"])
def test_bits_per_weight_at_most_12_5_for_k_from_128(N, K):
    """All bytes a GEMM reads (tiles, e0, escape row pointers; no escapes here) per weight, measured on a layout
    built from planes: <= 12.5 bits for every K >= 128 (N >= 2: one row alone pays the row pointers' leading 0,
    72 bits of metadata). The version-1 planes pad K to 64 (1000 x 130: 18.3 bits)."""
    g = torch.Generator().manual_seed(N + K)
    Kp = -(-K // 64) * 64
    code = torch.randint(1, 4096, (N, Kp), generator=g, dtype=torch.int32)
    code[:, K:] = 0
    nib = (code & 0xF).to(torch.uint8).view(N, Kp // 64, 2, 32)
    p = w12.W12Weight((code >> 4).to(torch.uint8), (nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(N, Kp // 2),
                      torch.full((N,), 110, dtype=torch.uint8), torch.zeros(N + 1, dtype=torch.int32),
                      torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int16), K)
    t = layout.tile(p)
    assert t.bits_per_weight <= 12.5, t
    # 12 bits a weight, at most 4 more a row (an odd masked tail), 40 a row of metadata
    assert 8 * t.tiles.numel() <= 12 * N * K + 4 * N
    assert t.nbytes == t.tiles.numel() + 5 * N + 4
    if K == 130:
        assert p.bits_per_weight > 18 and t.bits_per_weight < 12.35


def test_geometry_offsets():
    geo = layout.Geometry(75, 4100)
    assert (geo.KF, geo.kr, geo.NF, geo.nr, geo.row_blocks) == (64, 4, 4, 11, 5)
    assert geo.SB == 64 * 1536 + 16 * 6 and geo.tile_offset(1, 2) == geo.SB + 2 * 1536
    assert geo.tile_offset(4, 1) == 4 * geo.SB + 96 * 11 and geo.tail_offset(4) == 4 * geo.SB + 96 * 11 * 64
    assert geo.nbytes == 75 * (96 * 64 + 6)
    assert all(geo.tile_offset(b, c) % 16 == 0 for b in range(5) for c in range(64))
    with pytest.raises(ValueError, match="N and K must be >= 1"):
        layout.Geometry(0, 5)


def test_tiled_checks_its_inputs():
    p = w12.pack(hostile_weight(20, 70, seed=1), layout="planes")
    t = layout.tile(p)
    with pytest.raises(ValueError, match="build it with w12.layout.tile"):
        layout.TiledW12(t.tiles[:-1], p.e0, p.esc_rowptr, p.esc_col, p.esc_val, 20, 70)
    with pytest.raises(TypeError, match="expected a W12Weight"):
        layout.tile(torch.zeros(3, 3))
    with pytest.raises(TypeError, match="expected a TiledW12"):
        layout.untile(p)
    assert "bits_per_weight" in repr(t)
