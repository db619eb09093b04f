"""perf/w12_ladder.py on the CPU: its plan (cells, rows, builds), the table and files it writes, the refusal without
a GPU, the fp64 check it applies, its --build-only mode (NVRTC, no GPU) on one cell, and its --ab mode (the cells'
checks, the builds it plans, --build-only, the timing path with the kernel stood in by torch)."""

from __future__ import annotations

import json

import pytest
import torch

from w12.configs import FlowConfig
from w12.flow import ABLATIONS


def test_plan_covers_the_ladder_and_the_sweep(ladder):
    layers = ladder.layer_shapes(["in_proj", "gate_up", "o_proj"])
    assert layers == {"in_proj": (16480, 5120), "gate_up": (34816, 5120), "o_proj": (5120, 6144)}
    cells, builds = ladder.plan(layers, [1, 32], 132, sweep=True)
    assert len(cells) == 6
    for name, n, k, m, rows in cells:
        assert [r[0] for r in rows[:6]] == list("abcde") + ["e-fixed"] and rows[5][1].fixed and not rows[0][1].fixed
        assert len({r[1] for r in rows[:5]}) == 1  # one config through the ladder
        assert all(r[2] == "e" for r in rows[5:])
        base = rows[0][1]
        wg = {(r[1].warps, r[1].kw, r[1].cps, r[1].kc) for r in rows[6:] if r[1].wg}  # sm_90: the warpgroup build
        assert wg == {(8, 1, 2, 1), (8, 2, 2, 1), (16, 1, 1, 1), (16, 2, 1, 1), (16, 4, 1, 1), (4, 1, 4, 2),
                      (8, 2, 2, 2), (16, 4, 1, 2), (4, 1, 4, 4), (8, 2, 2, 4)}
        assert all(r[0].endswith("-g") for r in rows[6:] if r[1].wg)
        rows = [r for r in rows if not r[1].wg]
        two = {(r[1].warps, r[1].cps, r[1].kw) for r in rows[6:] if r[1].rb == 2}
        assert two == {(w, c, k) for w, c in ((8, 1), (4, 2)) for k in (min(base.kw, w), max(1, min(base.kw, w) // 2))}
        same = [r for r in rows[6:] if (r[1].warps, r[1].cps, r[1].rb, r[1].kc) == (base.warps, base.cps, 1, 1)]
        assert len(same) == 2 * len([k for k in (1, 2, 4, 8) if k <= base.warps]) - 1  # K splits x depths (the heuristic's, 8)
        other = {(r[1].warps, r[1].cps, r[1].kw) for r in rows[6:]
                 if r[1].warps != base.warps and r[1].rb == 1 and r[1].kc == 1 and r[1].warps > 2}
        assert other == {(w, c, min(k, w)) for w, c in ((4, 4), (8, 2), (16, 1)) if w != base.warps
                         for k in (base.kw, 2 * base.kw)}
        assert (base.warps, base.cps) == ((4, 4) if m <= 8 else (8, 2))  # gate_up at M <= 8: one wave of whole rows
        split = {(r[1].warps, r[1].kw, r[1].cps, r[1].kc) for r in rows[6:] if r[1].kc > 1}  # sm_90: clusters
        assert split == {(4, 4, 4, 2), (4, 4, 4, 4), (8, 8, 2, 2), (4, 2, 4, 2), (2, 2, 4, 2), (2, 2, 8, 2),
                         (4, 4, 5, 2), (2, 2, 5, 2), (4, 4, 6, 2)}  # and one wave of the 640 CTAs at 5-6 per SM
        small = {(r[1].warps, r[1].kw, r[1].cps) for r in rows[6:] if r[1].warps == 2 and r[1].kc == 1}
        assert small == {(2, 2, 8)}  # 2-warp CTAs at 8 per SM without the cluster split, beside it
    kws = {(name, m): rows[0][1].kw for name, n, k, m, rows in cells}
    assert kws == {("in_proj", 1): 2, ("gate_up", 1): 1, ("o_proj", 1): 4, ("in_proj", 32): 2, ("gate_up", 32): 8,
                   ("o_proj", 32): 4}
    assert {cfg.fixed for cfg, nt, step in builds} == {True, False}  # the fixed-base rows and their exact twins
    assert {(cfg.kw, step) for cfg, nt, step in builds if step in "cd" and cfg.kw == 1} == {(1, "c"), (1, "d")}
    sm80, _ = ladder.plan(layers, [1], 132, sweep=True, arch=(8, 0))
    assert all(r[1].kc == 1 and not r[1].wg for *_, rows in sm80 for r in rows)  # no clusters or wgmma before sm_90
    _, few = ladder.plan(ladder.layer_shapes(["o_proj"]), [1], 132, sweep=False)
    assert len(few) == 5 + 1 + 2  # steps a..e, the exact-base e, steps c and d at kw = 1
    cells, sel = ladder.plan(ladder.layer_shapes(["o_proj"]), [32], 132, sweep=True, only="e|e@.*-r2")
    assert [r[0] for r in cells[0][4]][0] == "e" and all(r[1].rb == 2 for r in cells[0][4][1:])
    assert len(cells[0][4]) == 1 + 4 and len(sel) == 5  # exact-base rows: each its own bitwise twin
    cells, abl = ladder.plan(ladder.layer_shapes(["o_proj"]), [1], 132, sweep=False, ablate=True)
    assert [r[0] for r in cells[0][4][6:]] == list(ABLATIONS) and len(abl) == len(few) + len(ABLATIONS)


def test_wg_probe_rows(ladder):
    """--wg-probe: the heuristic's step e and every warpgroup shape at its shipped build and at each of
    w12.flow.WG_VARIANTS' steps (with --ablate WG_ABLATIONS' too), each variant with the shipped build as its
    bitwise twin; M = 8, 16, 32 by default."""
    from w12.flow import WG_ABLATIONS, WG_VARIANTS

    args = ladder.parse(["--wg-probe", "--ablate", "--layers", "o_proj"])
    assert args.m == [8, 16, 32] and ladder.parse([]).m == [1, 32] and ladder.parse(["--wg-probe", "--m", "4"]).m == [4]
    cells, builds = ladder.plan(ladder.layer_shapes(args.layers), [32], 132, sweep=True, ablate=True, only=args.only,
                                wg_probe=True)
    rows = cells[0][4]
    assert rows[0][0] == "e" and not rows[0][1].wg and all(r[1].wg for r in rows[1:])
    shapes = {r[1] for r in rows[1:]}
    steps = ["e"] + list(WG_VARIANTS) + list(WG_ABLATIONS)
    assert len(rows) == 1 + len(shapes) * len(steps) == 1 + 10 * 5
    for cfg in shapes:
        mine = [(r[0], r[2]) for r in rows if r[1] == cfg]
        assert mine == [(f"e@{cfg.tag()}{st[1:]}", st) for st in steps]
        assert all((cfg, 4, st) in builds for st in steps)
    _, few = ladder.plan(ladder.layer_shapes(args.layers), [32], 132, sweep=True, only=args.only, wg_probe=True)
    assert not any(st in WG_ABLATIONS for _, _, st in few)  # the ablations only with --ablate


def test_table_and_files(ladder, tmp_path, monkeypatch):
    Row = ladder.Row
    rows = [Row("o_proj", 1, "cublas", "F.linear", us=20.0, p10=19.5, p90=20.5, nbytes=2 * 5120 * 6144),
            Row("o_proj", 1, "a", "flow-w8-k4-s4-c2", "56r", "runs (no product)", us=12.0, p10=11.9, p90=12.2,
                nbytes=1.5 * 5120 * 6144),
            Row("o_proj", 1, "e", "flow-w8-k4-s4-c2", "82r", status="FAILED: wrong"),
            Row("o_proj", 1, "e@x", "flow-w8-k8-s8-c2", "87r", status="skipped (time budget)")]
    assert rows[1].tbs() == pytest.approx(1.5 * 5120 * 6144 / 12e-6 / 1e12)
    table = ladder.format_table(rows)
    lines = table.splitlines()
    assert lines[0].startswith("| layer | M | row |") and len(lines) == 2 + len(rows)
    assert "| 1.67 |" in lines[3] and f"{100 * rows[1].tbs() / 4.28:.0f}%" in lines[3]  # 20 / 12 x cuBLAS
    assert "FAILED: wrong" in lines[4] and "skipped (time budget)" in lines[5]
    monkeypatch.setenv("OUT", str(tmp_path))
    ladder.write_outputs(rows, {"gpu": "fake"})
    data = json.loads((tmp_path / "w12-ladder.json").read_text())
    assert data["meta"]["gpu"] == "fake" and len(data["rows"]) == 4
    assert (tmp_path / "w12-ladder.md").read_text().strip() == table


def test_refuses_without_a_gpu(ladder, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert ladder.main([]) == 2
    assert "--build-only" in capsys.readouterr().err


def test_forms_refuses_without_a_gpu_and_parses_its_rows(ladder, capsys):
    args = ladder.parse(["--forms", "--forms-m", "1", "40", "--forms-fp16-m"])
    assert args.forms and args.forms_m == [1, 40] and args.forms_fp16_m == []
    assert ladder.parse([]).forms_fp16_m == [1, 8, 16, 32, 48]
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert ladder.main(["--forms"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_fp64_check(ladder):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    cols = torch.arange(0, 40, 3)
    ladder._check(torch.nn.functional.linear(x, w), x, w, cols, "same")
    bad = torch.nn.functional.linear(x, w)
    bad[0, 3] += 1.0
    with pytest.raises(AssertionError):
        ladder._check(bad, x, w, cols, "off")


@pytest.mark.slow
def test_build_only_one_cell(ladder, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path))
    assert ladder.main(["--build-only", "--arch", "90", "--layers", "o_proj", "--m", "1", "--no-sweep",
                        "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 cells, 8 builds for sm_90" in out and "0 failed or spilled" in out


def test_run_end_to_end_with_torch_stand_ins(ladder, monkeypatch):
    """The GPU path of the script on the CPU at small shapes: the flow kernel stood in by torch (the product each
    step computes), the timing loop by one call, the builds by a table; every row checked and reported."""
    import torch.nn.functional as F

    import w12
    from specpilot.bench import timing
    from w12 import flow, layout

    launched = []

    def launch_tiled(cfg, x, t, bias, out, *, step="e", defines=None, smem=None, q8=False):
        launched.append((cfg.tag(), step))
        w = w12.decode_q8(layout.untile(t)) if q8 else flow.ladder_weight(layout.untile(t), step)
        if w is not None:
            out.copy_(F.linear(x.float(), w.float()).to(out.dtype))

    monkeypatch.setattr(flow, "launch_tiled", launch_tiled)
    monkeypatch.setattr(w12.ops, "matmul", lambda x, p: F.linear(x.float(), w12.unpack(p).float()).to(x.dtype))
    monkeypatch.setattr(w12.ops, "matmul_q8", lambda x, p: F.linear(x.float(), w12.decode_q8(p).float()).to(x.dtype))
    monkeypatch.setattr(timing, "time_cuda", lambda fns, reps: (fns[-1](), timing.Timing((1e-5, 2e-5, 3e-5), "fake", 1))[1])
    monkeypatch.setattr(ladder, "precompile", lambda builds, arch, workers=8, q8=False: {b: "64r" for b in builds})
    args = ladder.parse(["--m", "1", "5", "--reps", "3"])
    rows = ladder.run(args, torch.device("cpu"), {"in_proj": (40, 130), "gate_up": (33, 64), "o_proj": (16, 200)})
    assert len(rows) == sum(2 + 6 + len(ladder.flow_configs(m, n, k, 132, True)) - 1
                            for n, k in ((40, 130), (33, 64), (16, 200)) for m in (1, 5))
    assert [r.status for r in rows if r.status != "ok"] == []
    assert all(r.us == pytest.approx(20.0) for r in rows)
    checks = {r.row: r.check for r in rows if r.layer == "o_proj" and r.M == 5}
    assert checks["a"] == checks["b"] == "runs (no product)"
    assert checks["c"] == checks["d"] == "fp64 ok (kw=1)"
    assert checks["e"] == "fp64 ok, repeats" and checks["w12"] == "fp64 ok"
    assert checks["e-fixed"] == "fp64 ok, = exact base"
    assert ("flow-w4-k1-s3-c4", "c") in launched and any(tag.endswith("-fixed") for tag, _ in launched)
    table = ladder.format_table(rows)
    assert table.count("\n") == len(rows) + 1

    # --q8: the 8-bit view's step e at every config, checked on its own weight, the default row matmul_q8
    launched.clear()
    rows = ladder.run(ladder.parse(["--q8", "--m", "1", "--no-sweep", "--configs", "w4-k2-s4-c4", "--reps", "3"]),
                      torch.device("cpu"), {"o_proj": (16, 200)})
    assert [r.row for r in rows] == ["cublas", "w12", "e", "e@flow-w4-k2-s4-c4"]
    assert [r.status for r in rows] == ["ok"] * 4 and rows[1].config == "default (matmul_q8)"
    assert rows[2].check == rows[3].check == "fp64 ok, repeats"
    assert rows[2].nbytes == 16 * 200 + 2.0 * (200 + 16)  # the view's hi bytes, x and out
    assert {step for _, step in launched} == {"e"}


def test_trace_summary(ladder):
    """The --trace phases from made-up stamps of 3 CTAs (ns): entry, SM, wait end, first tile, loop end, exit."""
    st = [[1000, 0, 1200, 2000, 9000, 9500, 0, 0],
          [1100, 1, 1300, 2100, 9800, 10400, 0, 0],
          [9600, 0, 9700, 10000, 12000, 13000, 0, 0]]  # a second-wave CTA, entered after the first exit
    s = ladder.trace_summary(st, nbytes=4.28e6, prev_end=1500)
    assert s["ctas"] == 3 and s["sms"] == 2
    assert s["span"] == pytest.approx(12.0) and s["stream"] == pytest.approx(1.0)
    assert s["overlap"] == pytest.approx(0.5)  # the launch before ended 0.5 µs after this one's first entry
    assert s["entry_skew"] == pytest.approx(0.1)  # the first wave: the CTAs that entered before the first exit
    assert s["wait"] == pytest.approx(0.2) and s["first_tile"] == pytest.approx(1.0)
    assert s["loop"] == pytest.approx(7.0) and s["epilogue"] == pytest.approx(0.6)
    assert s["tail"] == pytest.approx(2.6)  # last exit 13000 less the median exit 10400
    assert s["rate_tbs"] == pytest.approx(4.28e6 / 12e-6 / 1e12)
    row = {"run": "chain", "layer": "o_proj", "M": 1, "config": "flow-w4", **s}
    table = ladder.format_trace([row])
    assert "| chain | o_proj | 1 | flow-w4 | 3 | 12.00 | 1.00 | 0.50 |" in table
    with pytest.raises(ValueError, match="no CTA"):
        ladder.trace_summary([[0] * 8], nbytes=1.0)


def test_trace_variants(ladder):
    """--variant LABEL=ITEMS: defines, a CTA cap (a number or per launch), a layer's config; the label alone is the
    shipped build; anything else is refused."""
    from w12.configs import FlowConfig

    assert ladder.parse_variant("base") == ("base", {}, None, {})
    label, defines, cap, force = ladder.parse_variant("g=gate_up:w4-k1-s3-c4,cap:auto,W12F_X:1")
    assert (label, defines, cap) == ("g", {"W12F_X": 1}, "auto")
    assert force == {"gate_up": FlowConfig(warps=4, kw=1, stages=3, cps=4)}
    assert ladder.parse_variant("c4=cap:4")[2] == 4
    for bad in ("x=cap:many", "x=W12F_X:on", "x=lm_head:w4-k1-s3-c4", "x=stages:3"):
        with pytest.raises(ValueError, match="items are"):
            ladder.parse_variant(bad)


def test_weight_copies(ladder):
    """The rotated copies --forms and --ab time over: 3, or 2 above 10^9 weights (the LM head)."""
    assert ladder.weight_copies(5120, 6144) == ladder.weight_copies(34816, 5120) == 3
    assert ladder.weight_copies(10**5, 10**4) == 3 and ladder.weight_copies(10**5 + 1, 10**4) == 2
    assert ladder.weight_copies(*ladder.ab_layer_shape("lm_head")) == 2


def test_ab_cells_are_checked(ladder):
    cells = ladder.ab_parse_cells('[["o_proj", 32, [["a", "", {"W12F_WG_BAR": 0}], ["b", "w4-k2-s3-c4-q3-x1", {}]]]]')
    assert cells == [("o_proj", 32, [("a", "", {"W12F_WG_BAR": 0}), ("b", "w4-k2-s3-c4-q3-x1", {})])]
    assert ladder.ab_layer_shape("o_proj") == (5120, 6144) and ladder.ab_layer_shape("lm_head") == (248320, 5120)
    assert ladder.ab_timing_only() == {"W12F_XSTEP", "W12F_WG_FENCE", "W12F_WG_BAR", "W12F_WG_XCOPY"}
    for bad, what in [("[", "not JSON"), ("[]", "non-empty"), ('[["foo", 1, []]]', "unknown layer"),
                      ('[["o_proj", 65, []]]', "M must be"), ('[["o_proj", 1, [["a", ""]]]]', "a candidate is"),
                      ('[["o_proj", 40, [["a", "", {}]]]]', "warpgroup config"),
                      ('[["o_proj", 40, [["a", "w4-k2-s3-c4-q3-x1", {}]]]]', "warpgroup config"),
                      ('[["o_proj", 1, [["a", "", {"X": 1}]]]]', "W12F_"), ('[["o_proj", 1]]', "a cell is")]:
        with pytest.raises(ValueError, match=what):
            ladder.ab_parse_cells(bad)
    with pytest.raises(ValueError):
        ladder.ab_parse_cells('[["o_proj", 1, [["a", "not-a-tag", {}]]]]')


def test_ab_builds_hold_the_shipped_configs_and_the_candidates(ladder):
    cells = ladder.ab_parse_cells('[["o_proj", 32, [["a", "", {"W12F_WG_BAR": 0}], ["b", "w8-k2-s3-c2-p3-g", {}]]], '
                                  '["gate_up", 16, []]]')
    from unittest import mock

    import w12.configs as wc

    with mock.patch.object(wc, "sm_count", lambda device: 132):
        plan = ladder.ab_builds(cells, torch.device("cpu"))
    assert plan == {("flow-w4-k2-s3-c4-q3-x1", 4, ()): 5120, ("flow-w4-k2-s3-c4-q3-x1", 4, (("W12F_WG_BAR", 0),)): 5120,
                    ("flow-w8-k2-s3-c2-p3-g", 4, ()): 5120, ("flow-w4-k1-s3-c4", 2, ()): 34816}
    # above 32 rows: the shipped path's 32-row pieces, and the warpgroup candidate at 5-8 token tiles
    cells = ladder.ab_parse_cells('[["o_proj", 48, [["wg", "w8-k2-s3-c2-p3-g", {}]]]]')
    assert ladder.ab_pieces(48) == [(0, 32), (32, 48)] and ladder.ab_pieces(32) == [(0, 32)]
    with mock.patch.object(wc, "sm_count", lambda device: 132):
        plan = ladder.ab_builds(cells, torch.device("cpu"))
    assert plan == {("flow-w4-k2-s3-c4-q3-x1", 4, ()): 5120, ("flow-w4-k2-s3-c4-q3-x1-l", 2, ()): 5120,
                    ("flow-w8-k2-s3-c2-p3-g", 6, ()): 5120}


def test_ab_presets_and_their_combination(ladder):
    """--ab names presets, alone or joined by commas; a name that is not one leaves the argument to be read as JSON."""
    assert ladder.ab_preset("nothing") is None and ladder.ab_preset("xh,nothing") is None
    assert ladder.ab_preset("sk") is None  # stream-K left the package (docs/w12-kernels.md, "Stream-K")
    xh = ladder.ab_parse_cells(ladder.ab_preset("xh"))
    assert [(layer, m) for layer, m, _ in xh] == [("o_proj", 16), ("o_proj", 32), ("down_proj", 16), ("down_proj", 32)]
    xs = ladder.ab_parse_cells(ladder.ab_preset("xs"))
    both = ladder.ab_parse_cells(ladder.ab_preset("xh,xs"))
    assert len(both) == len(xh) + len(xs) and all(c in both for c in xh + xs)


def test_ab_preset_xs_holds_shared_ring_configs(ladder):
    """--ab xs: x through a shared ring on the 5120-row layers (o_proj at 16, 24 and 32 rows, down_proj at 16 and 32),
    on in_proj and qkv_proj at 32, on gate_up at 16, 24 and 32 and on the LM head at 32; every candidate an `xs`
    config, the shipped 5120-row shape among them."""
    cells = ladder.ab_parse_cells(ladder.ab_preset("xs"))
    assert [(layer, m) for layer, m, _ in cells] == [
        ("o_proj", 16), ("o_proj", 24), ("o_proj", 32), ("down_proj", 16), ("down_proj", 32), ("in_proj", 32),
        ("qkv_proj", 32), ("gate_up", 16), ("gate_up", 24), ("gate_up", 32), ("lm_head", 32)]
    assert all(FlowConfig.from_tag(tag).xs and not d for _, _, cands in cells for _, tag, d in cands)
    assert "w4-k2-s3-c4-q3-xs" in [tag for _, tag, _ in cells[2][2]]


def test_ab_refuses_without_a_gpu(ladder, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert ladder.main(["--ab", '[["o_proj", 1, []]]']) == 2
    assert "--build-only" in capsys.readouterr().err
    assert ladder.main(["--ab", '[["o_proj", 0, []]]']) == 2
    assert "M must be" in capsys.readouterr().err


@pytest.mark.slow
def test_ab_build_only_one_cell(ladder, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path))
    cells = tmp_path / "cells.json"
    cells.write_text(json.dumps([["o_proj", 1, [["s4", "w4-k4-s4-c4-q2", {}]]]]))
    assert ladder.main(["--ab", str(cells), "--build-only", "--arch", "90", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 builds for sm_90; 0 failed or spilled" in out and "flow-w4-k4-s4-c4-q2" in out


def test_ab_run_end_to_end_with_torch_stand_ins(ladder, monkeypatch):
    """--ab's timing path on the CPU at a small shape: the flow kernel stood in by torch (the weight's product, or a
    wrong one for a timing-only build), the builds by a table; every candidate checked, compared and timed."""
    import w12
    from w12 import flow

    monkeypatch.setattr(ladder, "ab_layer_shape", lambda name: (48, 128))
    monkeypatch.setattr(ladder, "ab_resources", lambda tag, nt, defines, n, arch=(9, 0): "96r")

    def launch(cfg, x, t, bias, out, defines=None, pdl=None):
        w = w12.unpack(t).float()
        y = x.float() @ w.T
        if defines and "W12F_WG_BAR" in defines:
            y = y + 1.0  # what a timing-only build may give
        out.copy_(y.to(out.dtype))

    monkeypatch.setattr(flow, "launch_tiled", launch)
    asked = []
    rule = ladder.weight_copies
    monkeypatch.setattr(ladder, "weight_copies", lambda n, k: asked.append((n, k)) or rule(n, k))
    cells = ladder.ab_parse_cells('[["o_proj", 3, [["same", "", {}], ["other", "w4-k1-s3-c4", {}], '
                                  '["nosync", "", {"W12F_WG_BAR": 0}]]]]')
    report = ladder.ab_run(cells, rounds=2, device="cpu")
    assert asked == [(48, 128)]  # the copies' rule, the one --forms uses
    (row,) = report["cells"]
    assert row["layer"] == "o_proj" and row["M"] == 3 and row["ship_us"] > 0 and row["cublas_us"] > 0
    same, other, nosync = (row["cands"][k] for k in ("same", "other", "nosync"))
    assert same["ok"] and same["same_bits_as_ship"] and not same["timing_only"] and same["ratio"] > 0
    assert other["tag"] == "flow-w4-k1-s3-c4" and other["ok"] and other["regs"] == "96r"
    assert nosync["timing_only"] and nosync["ok"] and not nosync["same_bits_as_ship"]


def test_ab_promote_stores_only_a_clear_plain_winner(ladder, monkeypatch, tmp_path):
    """--promote on a report: per cell the fastest plain candidate (no defines, checked, not timing only) goes through
    autotune.promote on its paired rounds; a clear gain becomes the tuned entry of the cell's shape key (into a
    temporary tuned file here), a level one and a cell above 32 rows store nothing."""
    import autotune
    from w12.configs import FlowConfig

    monkeypatch.setattr(ladder, "ab_layer_shape", lambda name: (5120, 6144))
    stored = []
    monkeypatch.setattr(autotune, "store_tuned", lambda *a, **kw: stored.append((a, kw)) or tmp_path / "h.json")

    def cand(tag, ratio, **kw):
        ship = [20.0 + 0.01 * (i % 3) for i in range(20)]
        return {"tag": tag, "defines": {}, "ok": True, "timing_only": False, "ratio": ratio, "ship_us": 20.0,
                "cand_us": 20.0 * ratio, "ship_samples_us": ship, "cand_samples_us": [t * ratio for t in ship], **kw}

    report = {"cells": [
        {"layer": "o_proj", "M": 32, "ship": "flow-w4-k2-s3-c4-q3-x1", "cands": {
            "fast": cand("flow-w4-k2-s3-c5-q4-h", 0.90), "faster-but-defines": cand("flow-w4-k2-s3-c4-q3", 0.80,
                                                                                    defines={"W12F_ESCX": 1}),
            "wrong": cand("flow-w4-k1-s3-c4", 0.70, ok=False), "broken": {"tag": "x", "error": "BUILD FAILED"}}},
        {"layer": "o_proj", "M": 16, "ship": "flow-w4-k2-s3-c4-q3-x1-l", "cands": {
            "level": cand("flow-w4-k2-s3-c4-q3-l-h", 0.999)}},
        {"layer": "o_proj", "M": 40, "ship": "pieces", "cands": {"fast": cand("flow-w8-k2-s3-c2-g", 0.8)}},
    ]}
    recs = ladder.ab_promote(report)
    assert [r["stored"] for r in recs] == [True, False, False]
    assert recs[0]["label"] == "fast" and recs[0]["decision"]["promoted"]
    assert recs[1]["label"] == "level" and not recs[1]["decision"]["promoted"]
    assert "32-row pieces" in recs[2]["note"]
    ((args, kw),) = stored
    assert args[:3] == ("w12.matmul", "flow", autotune.shape_key(M=32, N=5120, K=6144))
    assert args[3] == FlowConfig.from_tag("w4-k2-s3-c5-q4-h") and kw["extra"]["promotion"]["promoted"]
    assert report["cells"][0]["promotion"] is recs[0]


def test_batch_candidates_are_the_heuristic_and_its_neighbours(ladder, monkeypatch):
    from dataclasses import replace

    import w12.configs
    from w12.configs import BatchConfig, batch_heuristic

    monkeypatch.setattr(w12.configs, "sm_count", lambda device: 132)  # the H200's: the heuristic splits K here
    dev = torch.device("cpu")
    h = batch_heuristic(128, 5120, 6144, dev)
    cands = ladder.batch_candidates(128, 5120, 6144, dev, extra=["n64-t128-g1-k1-w4-s3", "n128-t64-g1-k2-w8-s2"])
    tags = [c.tag() for c in cands]
    assert cands[0] == h and len(set(tags)) == len(tags)
    assert any(c.block_t == 64 for c in cands) and any(c.num_stages == 4 for c in cands)
    assert h.split_k > 1 and replace(h, fixup=True) in cands and all(c.split_k > 1 for c in cands if c.fixup)
    assert BatchConfig.from_tag("n128-t64-g1-k2-w8-s2") in cands
    assert replace(h, block_n=128, num_warps=8) in cands
    assert any(c.block_n == 256 and c.block_t == 64 and c.num_warps == 16 for c in cands)
    assert all(c.block_t == 64 for c in ladder.batch_candidates(40, 5120, 6144, dev))
    # both k orders from 64 rows of x a program (the heuristic's is kt there), none below; all rows a program above 128
    own = ladder.batch_candidates(128, 5120, 6144, dev)  # without the extra tags, which are timed as given
    assert h.kt and all(replace(c, kt=not c.kt) in own for c in own if c.block_t >= 64)
    assert not any(c.kt for c in ladder.batch_candidates(32, 5120, 6144, dev))
    assert not any(c.block_t == 256 for c in cands)
    assert any(c.block_t == 256 and c.num_warps == 8 for c in ladder.batch_candidates(200, 5120, 6144, dev))


def test_batch_run_on_the_cpu_checks_and_times_every_candidate(ladder, monkeypatch):
    """--batch's procedure on the CPU: the batch kernel under the interpreter, matmul_tiled's torch path as the
    default, cuBLAS as F.linear; every candidate checked against the fp32 product and timed in pairs."""
    monkeypatch.setattr(ladder, "ab_layer_shape", lambda name: (40, 130))
    monkeypatch.setattr(ladder, "weight_copies", lambda n, k: 2)
    report = ladder.batch_run(["o_proj"], [33], rounds=2, extra=["n16-t16-g1-k1-w4-s1"], device="cpu")
    (row,) = report["cells"]
    assert row["M"] == 33 and row["default_us"] > 0 and row["cublas_us"] > 0
    assert "batch-n16-t16-g1-k1-w4-s1" in row["cands"]
    for tag, r in row["cands"].items():
        assert "error" not in r and r["ok"], (tag, r)
        assert len(r["cand_samples_us"]) == len(r["default_samples_us"]) == 2


def test_batch_promote_stores_a_key_only_where_it_wins_at_every_row_count(ladder, monkeypatch, tmp_path):
    import autotune
    from w12.configs import BatchConfig

    stored = []
    monkeypatch.setattr(autotune, "store_tuned", lambda *a, **kw: stored.append((a, kw)) or tmp_path / "h.json")

    def cand(ratio, ok=True):
        base = [50.0 + 0.01 * (i % 3) for i in range(20)]
        return {"ok": ok, "ratio": ratio, "cand_us": 50.0 * ratio, "default_us": 50.0, "default_samples_us": base,
                "cand_samples_us": [t * ratio for t in base]}

    a, b = "batch-n64-t128-g1-k3-w4-s3", "batch-n64-t64-g1-k2-w4-s3"
    cells = [  # o_proj: 65-128 rows, a wins at both counts; 33-64 rows, a wins at 40 and loses at 64
        {"layer": "o_proj", "M": 72, "N": 5120, "K": 6144, "cands": {a: cand(0.6), b: cand(0.7)}},
        {"layer": "o_proj", "M": 128, "N": 5120, "K": 6144, "cands": {a: cand(0.8), b: cand(0.9)}},
        {"layer": "o_proj", "M": 40, "N": 5120, "K": 6144, "cands": {a: cand(0.5), b: cand(0.9, ok=False)}},
        {"layer": "o_proj", "M": 64, "N": 5120, "K": 6144, "cands": {a: cand(1.1), b: cand(0.8)}},
    ]
    report = {"cells": cells}
    recs = ladder.batch_promote(report)
    assert [(r["key"], r["stored"]) for r in recs] == [(autotune.shape_key(M=128, N=5120, K=6144), True),
                                                       (autotune.shape_key(M=64, N=5120, K=6144), False)]
    assert recs[0]["tag"] == a and recs[1]["tag"] == a  # b failed its check at 40 rows
    ((args, kw),) = stored
    assert args[:3] == ("w12.matmul", "batch", autotune.shape_key(M=72, N=5120, K=6144))
    assert args[3] == BatchConfig.from_tag(a) and kw["extra"]["M"] == [72, 128]
    for row in cells:
        row.update(cublas_us=30.0, default_us=50.0)
    table = ladder.batch_table(report).splitlines()
    assert len(table) == 2 + len(cells)
    assert table[2].startswith("| o_proj | 72 | 30.0 | 50.0 | `batch-n64-t128-g1-k3-w4-s3` | 30.0 | 0.600 | 1.000 "
                               "| yes")
    assert table[4].endswith("| no |") and f"`{b}`" in table[5]  # M = 40: b failed its check; M = 64: b was faster


def test_batch_refuses_without_a_gpu(ladder, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert ladder.main(["--batch"]) == 2
    assert "--batch times on a CUDA GPU" in capsys.readouterr().err
