"""perf/w12_ladder.py --even-split on the CPU: the tiles each of the probe's assignments gives each warp (every tile
once, the shares equal to one tile or one group-unit, a CTA's warps on one unit), the NVRTC builds of every variant of
w12/csrc/w12_probe.cu for sm_90 (no stack, no spills) and what their main loops read (x from global memory, from the
shared ring or held in registers), and the refusal to time without a GPU."""

from __future__ import annotations

from collections import Counter

import pytest


@pytest.mark.parametrize("R,U", [(320, 96), (320, 272), (7, 5)])
@pytest.mark.parametrize("assign,ctas,warps", [(0, 264, 8), (1, 132, 16), (1, 264, 8), (2, 132, 16), (2, 264, 8),
                                               (2, 3, 4)])
def test_every_tile_once_and_even_shares(ladder, assign, ctas, warps, R, U):
    seqs = ladder.probe_items(assign, R, U, ctas, warps)
    seen = Counter(t for s in seqs for t in s if t[0] < R)
    assert set(seen) == {(r, c) for r in range(R) for c in range(U)} and set(seen.values()) == {1}
    if assign == 2:  # every warp of a CTA on the same unit, its own row block of the group
        for b in range(ctas):
            cta = seqs[b * warps:(b + 1) * warps]
            assert all(len(s) == len(cta[0]) for s in cta)
            for i in range(len(cta[0])):
                units, blocks = {s[i][1] for s in cta}, [s[i][0] for s in cta]
                assert len(units) == 1 and blocks == list(range(blocks[0], blocks[0] + warps))
        lens = [len(seqs[b * warps]) for b in range(ctas)]
    else:
        lens = [len(s) for s in seqs]
        if assign == 1:  # contiguous runs in row-block-major order
            for s in filter(None, seqs):
                start = s[0][0] * U + s[0][1]
                assert [r * U + c for r, c in s] == list(range(start, start + len(s)))
    assert max(lens) - min(lens) <= 1


@pytest.mark.slow
def test_variants_build_and_read_x_as_named(ladder, jit_cache, capsys):
    from specpilot.testing import mma_loop, sass

    assert ladder.main(["--even-split", "--build-only"]) == 0
    assert capsys.readouterr().out.count("0 bytes spilled") == len(ladder.PROBE_VARIANTS)
    for name, warps, cps, assign, x, full in ladder.PROBE_VARIANTS:
        b = ladder.probe_build(warps, cps, assign, x, full)
        r = b.resources()
        assert r["stack"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0, (name, r)
        assert r["registers"] <= 65536 // (32 * warps * cps), (name, r)
        loop = mma_loop(sass(b.cubin))
        tiles = sum("HMMA" in t for t in loop) // 16  # 16 mma a tile at 4 n-tiles
        assert tiles >= 1, (name, loop)
        count = {op: sum(op in t for t in loop) / tiles for op in ("LDG.E.128", "BAR.SYNC", "LDS.128")}
        assert count == {"LDG.E.128": 8 if x == 1 else 0, "BAR.SYNC": 1 if x == 2 else 0,
                         "LDS.128": 2 + (8 if x == 2 else 0)}, (name, count)


@pytest.mark.parametrize("assign,ctas,warps,R,U", [
    (a, c, w, R, U) for a in (1, 2) for c, w in ((132, 16), (264, 8)) for R, U in ((320, 96), (320, 272))
] + [(1, 11, 4, 40, 9), (2, 11, 4, 40, 9), (2, 7, 4, 26, 5)])
def test_whole_product_pieces_cover_each_row_block_once_in_order(ladder, assign, ctas, warps, R, U):
    """The whole-product build's fix-up (W12P_FULL), as probe_pieces ports it: a row block's pieces, from workers
    p0..p1 in order, hold exactly its units, each worker's piece a contiguous range after the one before; no two
    pieces share a workspace slot; and every worker has at most two keys, the slots' two sides."""
    assert ladder.probe_fits(assign, R, U, ctas, warps) is None
    seqs = ladder.probe_items(assign, R, U, ctas, warps)
    per_worker = warps if assign == 2 else 1
    pieces = ladder.probe_pieces(assign, R, U, ctas, warps)
    used = Counter(slot for ps in pieces.values() for _, slot in ps)
    assert set(used.values()) == {1}
    assert max(used) < ctas * warps * 2
    for rb, ps in pieces.items():
        units = []
        for worker, _ in ps:
            warp = worker * per_worker + (rb % warps if assign == 2 else 0)
            mine = [c for r, c in seqs[warp] if r == rb]
            assert mine == list(range(mine[0], mine[0] + len(mine))), (rb, worker)
            units += mine
        assert units == list(range(U)), rb
    keys = [{r // (warps if assign == 2 else 1) for r, _ in s} for s in seqs]
    assert max(len(k) for k in keys) <= 2


def test_whole_product_refuses_shapes_it_cannot_split(ladder):
    assert "some would have none" in ladder.probe_fits(1, 2, 3, 132, 16)
    assert "more than two keys" in ladder.probe_fits(2, 320, 4, 2, 16)


def test_only_picks_the_variants(ladder, monkeypatch, capsys):
    built = []

    class Build:
        def resources(self):
            return dict(registers=96, stack=0, spill_stores=0, spill_loads=0)

    monkeypatch.setattr(ladder, "probe_build", lambda *a: built.append(a) or Build())
    assert ladder.main(["--even-split", "--build-only", "--only", "full-.*"]) == 0
    full = [v for v in ladder.PROBE_VARIANTS if v[0].startswith("full-")]
    assert len(built) == len(full) >= 1 and all(a[4] == 1 for a in built)
    assert capsys.readouterr().out.count("registers") == len(full)


def test_timing_needs_a_gpu(ladder, monkeypatch, capsys):
    monkeypatch.setattr(ladder, "PROBE_VARIANTS", [])
    monkeypatch.setattr(ladder.torch.cuda, "is_available", lambda: False)
    assert ladder.main(["--even-split"]) == 2
    assert "--build-only" in capsys.readouterr().err
