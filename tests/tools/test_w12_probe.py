"""perf/w12_ladder.py --even-split on the CPU: the tiles each of the probe's assignments gives each warp (every tile
once, the shares equal to one tile or one group-unit, a CTA's warps on one unit), the NVRTC builds of every variant of
w12/csrc/w12_probe.cu for sm_90 (no stack, no spills) and what their main loops read (x from global memory, from the
shared ring or held in registers), and the refusal to time without a GPU."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ladder():
    spec = importlib.util.spec_from_file_location("w12_ladder", ROOT / "perf" / "w12_ladder.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


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
    for name, warps, cps, assign, x in ladder.PROBE_VARIANTS:
        b = ladder.probe_build(warps, cps, assign, x)
        r = b.resources()
        assert r["stack"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0, (name, r)
        assert r["registers"] <= 65536 // (32 * warps * cps), (name, r)
        loop = mma_loop(sass(b.cubin))
        tiles = sum("HMMA" in t for t in loop) // 16  # 16 mma a tile at 4 n-tiles
        assert tiles >= 1, (name, loop)
        count = {op: sum(op in t for t in loop) / tiles for op in ("LDG.E.128", "BAR.SYNC", "LDS.128")}
        assert count == {"LDG.E.128": 8 if x == 1 else 0, "BAR.SYNC": 1 if x == 2 else 0,
                         "LDS.128": 2 + (8 if x == 2 else 0)}, (name, count)


def test_timing_needs_a_gpu(ladder, monkeypatch, capsys):
    monkeypatch.setattr(ladder, "PROBE_VARIANTS", [])
    monkeypatch.setattr(ladder.torch.cuda, "is_available", lambda: False)
    assert ladder.main(["--even-split"]) == 2
    assert "--build-only" in capsys.readouterr().err
