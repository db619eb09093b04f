"""specpilot.ceiling: the floors of each kernel class counted by hand on a small model, the ceiling formula,
the factors and the prediction on synthetic measurements, the PNG, the CLI, bad arguments, and the committed
H200 report against what the code computes from the committed engine JSON."""

import json
import math
from pathlib import Path

import pytest

from autotune.hardware import GpuSpec
from specpilot import ceiling, cli
from specpilot.bench.shapes import ModelShapes
from specpilot.testing import raises_helpful

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "perf" / "results" / "h200"
ENGINE = H200 / "20261202T125349-engine.json"
PEROP = [H200 / f for f in ("20261202T130213-linear-w12.json", "20261201T073851-gdn.json",
                            "20261201T140207-tree_attn.tree_attention.json", "20261201T150759-lmhead.argmax.json")]

# 1 TB/s and 1 TFLOP/s BF16 (2 TOP/s INT8), nothing measured: a floor is max(flops / 1e12, bytes / 1e12) seconds
# (no fraction), the paper's max(flops / 0.6e12, bytes / 0.9e12).
GPU = ceiling.peaks(GpuSpec("unit", 1.0, 1.0, 2.0, 0.0, 1, (0, 0), False))

# Two layers: one Gated DeltaNet (1 key head, 2 value heads of 32, conv 4), one attention (2 query heads,
# 1 KV head of 64); hidden 128, ffn 256, vocab 1000; linear "a" [96, 128] twice, "b" [128, 96] three times
# (K = 96 pads to 128 in W12).
SMALL = ModelShapes(name="small", hidden=128, ffn=256, vocab=1000, layers=2, attn_layers=1, attn_q_heads=2,
                    attn_kv_heads=1, attn_head_dim=64, gdn_layers=1, gdn_k_heads=1, gdn_v_heads=2, gdn_head_dim=32,
                    conv_width=4, linears={"a": (96, 128), "b": (128, 96)}, linear_counts={"a": 2, "b": 3})


def _floor_ms(flops, nbytes):
    return 1e3 * max(flops / 1e12, nbytes / 1e12)


def _paper_ms(flops, nbytes):
    return 1e3 * max(flops / 0.6e12, nbytes / 0.9e12)


def test_floors_by_hand_bf16_verify():
    c = ceiling.step_costs(SMALL, 4, prefix=100, weights="bf16", gpu=GPU, screen="int8", accepted=2)
    assert list(c) == list(ceiling.CLASSES)
    a, b = c["linears"].parts
    # a: 2*4*96*128 FLOPs; 2*96*128 weight bytes + 2*4*(96 + 128) activation bytes; two calls
    assert (a.name, a.calls, a.flops, a.bytes) == ("a", 2, 2 * 98304, 2 * 26368)
    assert (b.name, b.calls, b.flops, b.bytes) == ("b", 3, 3 * 98304, 3 * 26368)
    assert c["linears"].flops == 491520 and c["linears"].bytes == 131840
    assert a.floor_ms == pytest.approx(2 * _floor_ms(98304, 26368)) and a.bound == "compute"
    assert a.paper_floor_ms == pytest.approx(2 * _paper_ms(98304, 26368))  # the paper's, beside it
    # INT8 screen: codes 1000*128, 3 BF16 tables of 1000 x 1 groups, 3 fp32 norms per row, h in BF16 and INT8,
    # fp32 upper bounds written and read back, ids out; 2*4*1000*128 INT8 ops at half the BF16 cost
    head = 128000 + 6000 + 12000 + 4 * 128 * 3 + 2 * 4 * 1000 * 4 + 4 * 8
    assert c["lm head"].bytes == head == 179568 and c["lm head"].flops == 512000
    # GDN verify: q, k (4*1*32*2 each), v and o (4*2*32*2 each), g and beta (4*2*6), the state 2*32*32*4
    assert c["gdn verify"].bytes == 512 + 512 + 48 + 8192 + 512
    assert c["gdn verify"].flops == 2 * (4 * 16 * 32 + 4 * 4 * 32 * 32 + 4 * 16 * 32)
    # conv: C = 2*32 + 2*32 = 128 channels; x in and y out, the 3-column conv state, the 4-tap weights
    assert c["gdn conv"].bytes == 2 * 4 * 128 * 2 + 128 * 3 * 2 + 128 * 4 * 2 and c["gdn conv"].flops == 4 * 128 * 2 * 4
    # commit of 2 nodes: the state read and written, each node's k, v, g/beta and conv input, the conv state
    assert c["gdn commit"].bytes == 2 * 8192 + 2 * (64 + 128 + 12 + 256) + 2 * 128 * 3 * 2
    assert c["gdn commit"].flops == 2 * 2 * 6 * 32 * 32
    # tree attention: K and V of 100 cached tokens, q in and o out, the tree's own k and v; 4*T*H*D*(prefix + T)
    assert c["tree attention"].bytes == 2 * 100 * 64 * 2 + 2 * 4 * 2 * 64 * 2 + 2 * 4 * 64 * 2 == 28672
    assert c["tree attention"].flops == 4 * 4 * 2 * 64 * 104 and c["tree attention"].bound == "compute"
    # glue: norms, residual adds and silu*up per layer (16896 x 2 layers), the GDN layer's gates and output
    # norm (1776: no copies, the conv and the commit read the stash in place), the attention layer's norms, rotary, copies, gate and KV commit (12544), embedding
    # gather and final norm (4384); no FLOPs
    assert c["glue"].bytes == 2 * 16896 + 1776 + 12544 + 4384 and c["glue"].flops == 0
    for k, cost in c.items():
        assert cost.floor_ms == pytest.approx(_floor_ms(cost.flops, cost.bytes)), k
    assert ceiling.step_floor_ms(c) == pytest.approx(sum(_floor_ms(x.flops, x.bytes) for x in c.values()))


def test_floors_by_hand_w12_and_exact_head():
    c = ceiling.step_costs(SMALL, 1, prefix=0, weights="w12", gpu=GPU, screen="none", escapes=0.01)
    a, b = c["linears"].parts
    # W12: N*Kp*1.5 + N*5 + 4 + 6*E with E = round(0.01 * 12288) = 123; b's K = 96 pads to 128
    assert ceiling.linear_bytes(96, 128, "w12", 0.01) == 96 * 128 * 1.5 + 480 + 4 + 738 == 19654
    assert ceiling.linear_bytes(128, 96, "w12", 0.01) == 128 * 128 * 1.5 + 640 + 4 + 738 == 25958
    assert a.bytes == 2 * (19654 + 2 * (96 + 128)) and b.bytes == 3 * (25958 + 2 * (128 + 96))
    # the exact head reads the whole W12 head: 1000 x 128 (no padding), E = round(0.01 * 128000) = 1280
    assert c["lm head"].bytes == 1000 * 128 * 1.5 + 5000 + 4 + 6 * 1280 + 128 * 2 + 8
    assert c["lm head"].flops == 2 * 1000 * 128
    assert c["tree attention"].bytes == 2 * 2 * 64 * 2 + 2 * 64 * 2  # no prefix: q, o, the root's k and v
    ar, ver = (ceiling.step_costs(SMALL, r, weights="bf16", gpu=GPU) for r in (1, 8))
    assert ver["linears"].bytes - ar["linears"].bytes == 7 * 2 * (2 * 224 + 3 * 224)  # only activations grow


def test_datasheet_and_measured_peaks(tmp_path):
    pk = ceiling.peaks("H200")  # the rates measured on the H200 (autotune.GPUS), not the datasheet's
    assert (pk.gpu, pk.bandwidth_tbs, pk.bf16_tflops) == ("h200", 4.28, 793.0) and "measured" in pk.source
    assert (pk.datasheet_bandwidth_tbs, pk.datasheet_bf16_tflops) == (4.8, 989.0)
    b = ceiling.peaks("b200")  # nothing measured: the datasheet, said so
    assert (b.bandwidth_tbs, b.bf16_tflops) == (8.0, 2250.0) and b.source.startswith("datasheet")
    d = ceiling.peaks("h200", "datasheet")  # asked for: the datasheet whatever was measured
    assert (d.bandwidth_tbs, d.bf16_tflops, d.source) == (4.8, 989.0, "datasheet")
    f = tmp_path / "bench.json"
    f.write_text(json.dumps({"meta": {"ceilings": {"copy_tbs": 4.25, "bf16_tflops": 793.0}}, "rows": []}))
    m = ceiling.peaks("h200", f)
    assert (m.bandwidth_tbs, m.bf16_tflops) == (4.25, 793.0) and m.int8_tops == pytest.approx(793.0 * 1979 / 989)
    c = ceiling.step_costs("hybrid-27b", 1, weights="bf16", gpu=m)
    assert c["linears"].floor_ms == pytest.approx(1e3 * c["linears"].bytes / 4.25e12)  # never discounted
    assert c["linears"].paper_floor_ms == pytest.approx(1e3 * c["linears"].bytes / (0.9 * 4.8e12))


def test_ceiling_formula():
    assert ceiling.ceiling_speedup(4, 24.5, 20.35) == pytest.approx(4 * 20.35 / 24.5)
    assert ceiling.ceiling_speedup(8, 2.0, 2.0) == 8.0
    with raises_helpful("specpilot.ceiling", "t_verify"):
        ceiling.ceiling_speedup(4, 0.0, 1.0)
    with raises_helpful("specpilot.ceiling", "tau"):
        ceiling.ceiling_speedup(float("nan"), 1.0, 1.0)


def _engine(ar_cats, v_cats, ar_ms, v_ms):
    return {"shapes": "small", "prefix": 100, "nodes": 4, "gpu": "unit",
            "formats": {"bf16": {"ar_ms": ar_ms, "verify_ms": v_ms,
                                 "ar_breakdown": {"ms": ar_cats, "kernels_per_call": 10.0},
                                 "verify_breakdown": {"ms": v_cats, "kernels_per_call": 12.0}}}}


def test_measured_groups_factors_and_prediction():
    ar = {"cuBLAS GEMM": 1.0, "lm head": 0.2, "gdn verify": 0.1, "gdn conv": 0.01, "gdn commit": 0.04,
          "tree attention": 0.05, "other (norms, gates, copies)": 0.5}
    ver = {**ar, "cuBLAS GEMM": 1.5, "lm head": 0.4, "other (norms, gates, copies)": 0.7, "new thing": 0.1}
    eng = _engine(ar, ver, 2.0, 3.5)
    ma, mv = (ceiling.engine_measured(eng, "bf16", s) for s in ("ar", "verify"))
    assert ma["groups"]["gdn commit"] == pytest.approx(0.05)  # "gdn conv" is the commit's conv-state kernel
    assert ma["groups"]["gdn verify + conv"] == 0.1 and ma["outside_ms"] == pytest.approx(2.0 - 1.9)
    assert mv["groups"]["unmapped"] == 0.1 and mv["unmapped"] == ["new thing"]
    assert mv["outside_ms"] == pytest.approx(3.5 - 2.9) and mv["kernels"] == 12.0
    copies = ceiling.engine_measured(_engine({**ar, "memcpy / memset": 0.03}, ver, 2.0, 3.5), "bf16", "ar")
    assert copies["groups"]["glue"] == pytest.approx(0.53) and copies["unmapped"] == []  # a graph's copy nodes: glue
    # a PDL run: the breakdown's exclusive_ms (each moment charged once) wins over the profiler's durations
    pdl = _engine(ar, ver, 2.0, 3.5)
    pdl["formats"]["bf16"]["ar_breakdown"]["exclusive_ms"] = {**ar, "cuBLAS GEMM": 0.8}
    assert ceiling.engine_measured(pdl, "bf16", "ar")["groups"]["linears"] == pytest.approx(0.8)
    assert ceiling.engine_measured(pdl, "bf16", "verify")["groups"]["linears"] == pytest.approx(1.5)

    cv = ceiling.step_costs(SMALL, 4, prefix=100, weights="bf16", gpu=GPU)
    ca = ceiling.step_costs(SMALL, 1, prefix=100, weights="bf16", gpu=GPU)
    rows = {r["group"]: r for r in ceiling.compare(cv, mv)}
    fl = cv["linears"].floor_ms
    assert rows["linears"]["floor_ms"] == fl and rows["linears"]["over_floor"] == pytest.approx(1.5 / fl)
    assert rows["unmapped"]["over_floor"] is None
    f = ceiling.factors([4, 8], 8.0, cv, mv)
    above = sum(r["measured_ms"] - r["floor_ms"] for r in rows.values())  # every group is above its floor here
    assert f["above_floor_ms"] == pytest.approx(above)
    assert f["floor"] == pytest.approx(3.5 / (3.5 - above)) and f["outside"] == pytest.approx(3.5 / 2.9)
    assert f["acceptance"] == {"4": 2.0, "8": 1.0}
    assert f["largest"]["8"] == "floor" and f["largest"]["4"] == max(
        {"floor": f["floor"], "outside": f["outside"], "acceptance": 2.0}.items(), key=lambda kv: kv[1])[0]
    assert ceiling.factors([4], None, cv, mv)["acceptance"] == {"4": None}

    # per-operator rows time the linears (each times its count) and tree attention (times its layers); the
    # commit row commits 3 nodes, not the step's 1, so the commit comes from the AR step like the rest
    bench = {"rows": [
        {"op": "linear", "variant": "cublas", "shape": "a-M4", "median_us": 100.0, "status": "ok"},
        {"op": "linear", "variant": "cublas", "shape": "b-M4", "median_us": 200.0, "status": "ok"},
        {"op": "tree_attn.tree_attention", "variant": "wgmma", "shape": "B1-N4-L1k", "median_us": 70.0,
         "status": "ok"},
        {"op": "gdn.commit", "variant": "triton", "shape": "commit-B1-N4-L1", "median_us": 9.0, "status": "ok",
         "dims": {"accepted": 3}},
        {"op": "linear", "variant": "cublas", "shape": "b-M8", "median_us": 1.0, "status": "failed"}]}
    po = ceiling.perop_times([bench], SMALL, 4, prefix=1024, weights="bf16", screen="int8")
    assert set(po) == {"linears", "tree attention"}
    assert po["linears"]["ms"] == pytest.approx((2 * 100 + 3 * 200) / 1e3) and po["tree attention"]["ms"] == 0.07
    p = ceiling.predict_verify(ca, cv, ma, po)
    g = p["groups"]
    assert g["linears"]["method"] == "per-operator benchmark" and g["linears"]["ms"] == pytest.approx(0.8)
    ga, gv = ceiling._group_floors(ca), ceiling._group_floors(cv)
    assert g["glue"]["ms"] == pytest.approx(0.5 + gv["glue"] - ga["glue"])
    assert g["gdn commit"]["ms"] == pytest.approx(0.05 + gv["gdn commit"] - ga["gdn commit"])
    assert p["outside_ms"] == pytest.approx(0.1)
    assert p["step_ms"] == pytest.approx(sum(x["ms"] for x in g.values()) + 0.1)

    # W12 linears: the flow kernel's rows (what the engine runs on a GPU) where they cover every linear, else the
    # planes' mma rows
    def w12_rows(variant, us):
        return [{"op": "w12.matmul", "variant": variant, "shape": f"{n}-M4", "median_us": us, "status": "ok"}
                for n in ("a", "b")]

    both = {"rows": w12_rows("w12.mma", 100.0) + w12_rows("w12.flow", 50.0)}
    po = ceiling.perop_times([both], SMALL, 4, prefix=1024, weights="w12", screen="int8")
    assert po["linears"]["ms"] == pytest.approx(5 * 50 / 1e3) and "w12.flow" in po["linears"]["sources"][0]
    partial = {"rows": w12_rows("w12.mma", 100.0) + w12_rows("w12.flow", 50.0)[:1]}
    po = ceiling.perop_times([partial], SMALL, 4, prefix=1024, weights="w12", screen="int8")
    assert po["linears"]["ms"] == pytest.approx(5 * 100 / 1e3) and "w12.mma" in po["linears"]["sources"][0]


def test_png_and_cli_table(tmp_path, capsys):
    png, js, md = tmp_path / "c.png", tmp_path / "c.json", tmp_path / "c.md"
    code = cli.main(["ceiling", "--measured", str(ENGINE), "--tau", "4,8", "--tau-ideal", "8.2", "--png", str(png),
                     "--json", str(js), "--md", str(md), "--perop", *map(str, PEROP)])
    out = capsys.readouterr().out
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert "# Ceiling: hybrid-27b on the H200, one request, prefix 4096, 32-row verify" in out
    # the measured-vs-floor table carries the engine's own numbers: BF16 verify GEMMs 13.020 ms, step 16.370 ms
    assert "| linears | 11.382 | 12.447 | 1.09 | 11.469 | 13.020 | 1.14 |" in out
    assert "**16.370**" in out and "**18.570**" in out
    assert "| 8 | " in out and "Predicted verify step" in out
    rep = json.loads(js.read_text())
    assert rep["formats"]["w12"]["measured"]["verify"]["step_ms"] == pytest.approx(18.570, abs=1e-3)
    assert md.read_text() == out[: len(md.read_text())]


def test_floors_without_measurement(capsys):
    assert cli.main(["ceiling", "--shapes", "llama-3.1-8b", "--gpu", "a100", "--weights", "w12"]) == 0
    out = capsys.readouterr().out
    assert "## w12: byte floors per kernel class (LM head screen: none)" in out
    assert "measured against the floor" not in out and "| 4 | " in out


def test_bad_arguments(capsys, tmp_path):
    pre = "specpilot.ceiling"
    with raises_helpful(pre, "weights"):
        ceiling.step_costs(SMALL, 1, weights="fp8", gpu=GPU)
    with raises_helpful(pre, "rows"):
        ceiling.step_costs(SMALL, 0, gpu=GPU)
    with raises_helpful(pre, "accepted"):
        ceiling.step_costs(SMALL, 4, gpu=GPU, accepted=5)
    with raises_helpful(pre, "escapes"):
        ceiling.step_costs(SMALL, 1, gpu=GPU, escapes=-0.1)
    with raises_helpful(pre, "screen"):
        ceiling.step_costs(SMALL, 1, gpu=GPU, screen="fp4")
    with raises_helpful(pre, "unknown shape set"):
        ceiling.step_costs("gpt-5", 1, gpu=GPU)
    with raises_helpful(pre, "unknown GPU 'tpu'"):
        ceiling.peaks("tpu")
    with raises_helpful(pre, "no measured roofs"):
        ceiling.peaks("h200", {"ceilings": {}})
    with raises_helpful(pre, "taus"):
        ceiling.report(taus=[4, -1])
    with raises_helpful(pre, "nodes"):
        ceiling.report(nodes=1)
    with raises_helpful(pre, "prefix=4096", "--prefix 4096"):
        ceiling.report(measured=ENGINE, prefix=2048)
    with raises_helpful(pre, "'NVIDIA H200'", "--gpu h200"):
        ceiling.report(gpu="a100", measured=ENGINE)
    with raises_helpful(pre, "no 'w12' results"):
        ceiling.engine_measured(_engine({}, {}, 1.0, 1.0), "w12", "ar")
    with raises_helpful(pre, "not a results file"):
        ceiling.perop_times([{"meta": {}}], SMALL, 4)
    with pytest.raises(SystemExit) as e:
        cli.main(["ceiling", "--measured", str(tmp_path / "missing.json")])
    assert e.value.code == 2
    assert "specpilot: error: specpilot.ceiling.report: cannot read" in capsys.readouterr().err


def test_committed_h200_report_is_current(monkeypatch):
    """perf/results/h200/ceiling-hybrid-27b.json is what `specpilot ceiling` computes from the committed engine
    and per-operator JSONs with the options it records (paths relative to the repository root)."""
    monkeypatch.chdir(ROOT)
    committed = json.loads((H200 / "ceiling-hybrid-27b.json").read_text())
    rep = ceiling.report(committed["shapes"], committed["gpu"], nodes=committed["nodes"], prefix=committed["prefix"],
                         taus=committed["taus"], tau_ideal=committed["tau_ideal"], measured=committed["measured"],
                         perop=committed["perop"], escapes=committed["escapes"])
    rep = json.loads(json.dumps(rep))
    for w in ("bf16", "w12"):
        a, b = rep["formats"][w], committed["formats"][w]
        for key in ("ar_floor_ms", "verify_floor_ms"):
            assert math.isclose(a[key], b[key], rel_tol=1e-9), (w, key)
        assert math.isclose(a["prediction"]["step_ms"], b["prediction"]["step_ms"], rel_tol=1e-9), w
        assert list(a["ceiling"]) == list(b["ceiling"]) == ["4", "6", "8"]
        for tau in a["ceiling"]:
            assert a["ceiling"][tau] == pytest.approx(b["ceiling"][tau]), (w, tau)
    assert (H200 / "ceiling-hybrid-27b.md").read_text() == ceiling.markdown(rep)
