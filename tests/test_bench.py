"""Bench runner and report on the CPU, with tiny fake cases; and the cuBLAS baseline cases."""

import json

import pytest
import torch

from autotune import hardware as hw
from specpilot.bench import Case, Prepared, collect, get_shape_set, report, runner, timing
from specpilot.bench.cases import linear as linear_cases

ROW_FIELDS = {
    "gpu", "gpu_slug", "torch", "triton", "cuda", "specpilot", "op", "variant", "shape", "dims", "status",
    "error", "median_us", "p10_us", "p90_us", "tbs", "tflops", "floor_us", "over_floor", "baseline",
    "baseline_us", "speedup", "timestamp", "method",
}


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hw, "_CEILINGS", {})
    # Known CPU roofs, so the runner does not spend test time measuring.
    hw._CEILINGS["cpu"] = hw.Ceilings(device="cpu", copy_tbs=0.02, bf16_tflops=0.5, measured_at="test")


def _case(variant, *, n=256, fail=False, calls=None, check=True, setup_error=False):
    calls = calls if calls is not None else []

    def setup():
        if setup_error:
            raise RuntimeError("out of memory (pretend)")
        xs = [torch.randn(n, n, generator=torch.Generator().manual_seed(i)) for i in range(2)]

        def fn(x):
            calls.append(variant)
            return x @ x

        def chk():
            if fail:
                raise AssertionError("wrong answer (on purpose)")

        return Prepared(fns=[lambda x=x: fn(x) for x in xs], check=chk if check else None)

    return Case(op="fake", variant=variant, shape=f"N{n}", dims={"N": n}, flops=2.0 * n**3,
                bytes=3 * 4.0 * n * n, setup=setup, baseline="ref")


def test_runner_rows_json_and_report(tmp_path):
    calls = []
    cases = [_case("ref", calls=calls), _case("fast", calls=calls), _case("broken", fail=True, calls=calls),
             _case("ref", n=63, calls=calls)]
    res = runner.run(cases, "cpu", out_dir=tmp_path, reps=5, warmup=1, shapes="fake", log=None)
    assert len(res) == 4
    by = {(r["variant"], r["shape"]): r for r in res}
    ok = by[("fast", "N256")]
    assert ROW_FIELDS <= set(ok)
    assert ok["status"] == "ok" and ok["method"] == "perf_counter"
    assert ok["p10_us"] <= ok["median_us"] <= ok["p90_us"]
    assert ok["tflops"] == pytest.approx(ok["flops"] / ok["median_us"] / 1e6)
    assert ok["tbs"] == pytest.approx(ok["bytes"] / ok["median_us"] / 1e6)
    assert ok["floor_us"] == pytest.approx(hw.byte_floor(ok["flops"], ok["bytes"], "cpu") * 1e6)
    assert ok["over_floor"] == pytest.approx(ok["median_us"] / ok["floor_us"])
    assert ok["baseline_us"] == by[("ref", "N256")]["median_us"]
    assert ok["speedup"] == pytest.approx(ok["baseline_us"] / ok["median_us"])
    assert by[("ref", "N256")]["speedup"] == 1.0
    assert ok["gpu"] == "cpu" and ok["torch"] == torch.__version__
    # A failed check: reported as such, never timed.
    bad = by[("broken", "N256")]
    assert bad["status"] == "check_failed" and "on purpose" in bad["error"]
    assert bad["median_us"] is None and bad["speedup"] is None
    assert "broken" not in calls
    # One JSON file per run, with meta and rows.
    assert res.path.parent == tmp_path and res.path.name.endswith("-fake.json")
    data = json.loads(res.path.read_text())
    assert data["meta"]["ceilings"]["copy_tbs"] == 0.02 and data["meta"]["ceilings_source"] == "measured"
    assert data["meta"]["ok"] == 3 and data["meta"]["failed"] == 1 and data["meta"]["shapes"] == "fake"
    assert [r["variant"] for r in data["rows"]] == [r["variant"] for r in res]
    # Report: markdown table + geomean + PNG, and render() regenerates both from the JSON.
    md, png = report.write(res, res.meta, res.path)
    text = md.read_text()
    assert "| fake | fast | N256 |" in text and "geomean" in text
    assert "check_failed" in text and "| fake | broken |" not in text
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    md.unlink()
    png.unlink()
    md2, png2 = report.render(res.path)
    assert md2.read_text() == text and png2.exists()


def test_runner_setup_failure_and_missing_check(tmp_path):
    res = runner.run([_case("ref", setup_error=True), _case("nocheck", check=False)], torch.device("cpu"),
                     out_dir=tmp_path, reps=2, warmup=0, measure=False, write=False, log=None)
    assert [r["status"] for r in res] == ["setup_failed", "no_check"]
    assert all(r["median_us"] is None for r in res)
    assert res.path is None and not list(tmp_path.iterdir())


def test_runner_rejects_bad_reps():
    with pytest.raises(ValueError):
        runner.run([], "cpu", reps=0, write=False, measure=False, log=None)


def test_report_shows_floors_only_where_they_hold():
    row = {"op": "a", "variant": "v", "shape": "s", "status": "ok", "median_us": 10.0, "tbs": 1.0, "tflops": 1.0,
           "floor_us": 5.0, "over_floor": 2.0, "speedup": None, "baseline": None}
    gpu = {"device": "cuda:0", "ceilings_source": "measured", "ceilings": {"copy_tbs": 4.0, "bf16_tflops": 700.0}}
    text = report.markdown([row], gpu)
    assert "| floor µs | ×floor |" in text and "| 5 | 2 |" in text and report.floor_note([row], gpu) is None
    for c in report.LEGEND:  # every column is explained under the table
        assert f"- **{c}**: " in text
    beaten = dict(row, median_us=4.0, over_floor=0.8)
    text = report.markdown([row, beaten], gpu)
    assert "floor µs" not in text.split("\n\n")[1] and "1 rows ran faster than their floor" in text
    cpu = dict(gpu, device="cpu")
    text = report.markdown([row], cpu)
    assert "×floor" not in text and "No floor column: on the CPU" in text
    assert report.floor_note([row], dict(gpu, ceilings_source="datasheet")).startswith("No floor column")


def test_geomean():
    rows = [{"op": "a", "variant": "v", "status": "ok", "speedup": s} for s in (2.0, 8.0)]
    rows.append({"op": "a", "variant": "v", "status": "check_failed", "speedup": None})
    assert report.geomeans(rows) == {("a", "v"): (pytest.approx(4.0), 2)}


def test_linear_cases_cpu_tiny_only():
    cpu = torch.device("cpu")
    assert collect(get_shape_set("hybrid-27b"), cpu, ["linear"]) == []
    cases = collect(get_shape_set("tiny"), cpu, ["linear"])
    tiny = get_shape_set("tiny")
    assert len(cases) == 6 * (len(tiny.linears) + 1)
    assert {c.op for c in cases} == {"linear", "lm_head"}
    c = next(c for c in cases if c.shape == "mlp.down_proj-M4")
    n, k = tiny.linears["mlp.down_proj"]
    assert c.dims == {"M": 4, "N": n, "K": k} and c.flops == 2 * 4 * n * k
    assert c.bytes == 2 * (4 * k + n * k + 4 * n) and c.variant == c.baseline == "torch"  # the CPU matmul


def test_linear_case_checks_pass_and_catch_errors():
    cases = collect(get_shape_set("tiny"), torch.device("cpu"), ["linear"])
    for shape in ("gdn.in_proj-M32", "lm_head-M8"):
        prep = next(c for c in cases if c.shape == shape).setup()
        prep.check()
        assert prep.graph_safe and len(prep.fns) == 1
    # The argmax check rejects a wrong pick but accepts a tie within rounding.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g).bfloat16()
    w = torch.randn(100, 64, generator=g).bfloat16()
    good = (x.float() @ w.float().T).argmax(-1)
    linear_cases.check_argmax(good, x, w)
    with pytest.raises(AssertionError, match="argmax row"):
        linear_cases.check_argmax((x.float() @ w.float().T).argmin(-1), x, w)
    w_tie = torch.cat([w, w[good[0]][None]])  # a duplicate of row 0's winner at the end
    linear_cases.check_argmax(torch.tensor([100, *good[1:].tolist()]), x, w_tie)
    with pytest.raises(AssertionError, match="int64"):
        linear_cases.check_argmax(good.int(), x, w)


def test_tree_attn_cases_cpu_tiny_only():
    cpu, op = torch.device("cpu"), "tree_attn.tree_attention"
    assert collect(get_shape_set("hybrid-27b"), cpu, [op]) == []
    cases = collect(get_shape_set("tiny"), cpu, [op])
    assert {c.group: c.baseline for c in cases} == {"B1-N5-L40": "flex", "B3-N4-L5-40": "flex",
                                                    "chain-B1-N4-L24": "sdpa"}
    assert "flex" not in {c.variant for c in cases}  # torch.compile'd flex: CUDA only
    c = next(c for c in cases if c.shape == "B3-N4-L5-40" and c.variant == "mma")
    H, Hkv, D = 2, 1, 64  # tiny's heads; D rounded up to a supported head dim
    assert c.flops == 4 * H * D * sum(4 * (L + 4) for L in (37, 5, 20))
    assert c.bytes == 2 * Hkv * D * 2 * (62 + 12) + 2 * 12 * H * D * 2
    next(c for c in cases if c.variant == "sdpa-mask").setup().check()  # the peer's mask, against the reference
    # the default kernel on a plan with its schedule built on the device, checked against the reference
    next(c for c in cases if c.shape == "B3-N4-L5-40" and c.variant == "wgmma-device").setup().check()
    # the one call and its eager baseline (run on a host plan) come together, neither CUDA-graph timed
    one = {c.variant: c for c in cases if c.shape == "B1-N5-L40"}
    for v in ("tree_attention", "tree_attention-kept", "run-eager"):
        prep = one[v].setup()
        assert not prep.graph_safe
        prep.check()


def test_lmhead_cases_cpu_tiny_only():
    from specpilot.bench.cases import lmhead as lmhead_cases

    cpu, op = torch.device("cpu"), "lmhead.argmax"
    assert collect(get_shape_set("hybrid-27b"), cpu, [op]) == []
    cases = collect(get_shape_set("tiny"), cpu, [op])
    groups = {"lm_head-M1", "lm_head-M4", "lm_head-peaked-M1", "lm_head-flat-M1"}
    assert {c.group: c.baseline for c in cases} == dict.fromkeys(groups, "torch")  # F.linear on a CPU
    assert {c.op for c in cases} == {"lm_head"}
    for g in groups:  # every group has its F.linear baseline, also when "linear" is not selected
        assert sorted(c.variant for c in cases if c.group == g) == sorted(["torch", *lmhead_cases.VARIANTS[1:]])
    v, k = get_shape_set("tiny").lm_head
    c = next(c for c in cases if c.shape == "lm_head-M4" and c.variant == "certified-int8")
    base = next(c for c in cases if c.shape == "lm_head-M4" and c.variant == "torch")
    assert c.dims == base.dims == {"M": 4, "V": v, "K": k} and c.flops == base.flops == 2 * 4 * v * k
    assert c.bytes == base.bytes == 2 * (v * k + 4 * k) + 8 * 4  # the BF16 head's floor for every variant
    assert c.extra["regime"] == "moderate" and c.extra["screen"] == "int8"
    # With "linear" too, its lm_head baseline is kept once per group.
    both = collect(get_shape_set("tiny"), cpu, ["linear", op])
    assert sum(c.shape == "lm_head-M1" and c.variant == "torch" for c in both) == 1
    # The regimes' hidden states reach their planted margins; the peer's check passes on them.
    w = linear_cases._weights(v, k, 1, cpu, 5)[0]
    for regime, margin in (("peaked", 8.0), ("moderate", 1.5)):
        _, gap = lmhead_cases._hidden(w, 8, regime, 11)
        assert margin - 0.3 < gap["gap_sigma_min"] <= gap["gap_sigma_mean"] < margin + 0.3, (regime, gap)
    peer = next(c for c in cases if c.group == "lm_head-peaked-M1" and c.variant == "torch")
    prep = peer.setup()
    prep.check()
    assert peer.extra["measured"]["gap_sigma_min"] > 7.5  # filled in setup, seen by the runner's row
    prep.teardown()


def test_bench_on_tiny_linear(tmp_path):
    cases = [c for c in collect(get_shape_set("tiny"), torch.device("cpu"), ["linear"]) if c.dims["M"] == 4]
    res = runner.run(cases, "cpu", out_dir=tmp_path, reps=3, warmup=1, log=None)
    assert all(r["status"] == "ok" and r["median_us"] > 0 for r in res), [r["error"] for r in res]
    assert res.path.name.endswith("-linear-lm_head.json")


def test_cpu_case_budget(tmp_path):
    import time

    def setup():
        return Prepared(fns=[lambda: time.sleep(0.02)], check=lambda: None)

    case = Case(op="slow", variant="v", shape="s", dims={}, flops=1.0, bytes=1.0, setup=setup)
    res = runner.run([case], "cpu", reps=1000, warmup=0, case_budget_s=0.05, write=False, log=None)
    assert 1 <= res[0]["samples"] <= 3 and res[0]["status"] == "ok"


def test_timing_cpu_rotates_and_reports_quantiles():
    calls = []
    t = timing.time_fns([lambda: calls.append(0), lambda: calls.append(1)], "cpu", reps=6, warmup=2)
    assert t.method == "perf_counter" and t.calls == 1 and len(t.samples) == 6
    assert calls == [0, 1] * 4  # warm-up and timed calls cycle through the rotated inputs
    assert t.p10 <= t.median <= t.p90
    assert timing.quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and timing.quantile([1.0, 2.0], 0.25) == 1.25
    assert timing.time_cpu(lambda: None, reps=2, warmup=0).samples.__len__() == 2  # one callable is fine
    with pytest.raises(ValueError, match="empty"):
        timing.time_cpu([])
    with pytest.raises(ValueError, match="reps"):
        timing.time_cpu(lambda: None, reps=0)


def test_one_cuda_event_timing_loop():
    """CUDA events are read in one place above the ground floor: specpilot/bench/timing.py (autotune/hardware.py
    times its roofs itself: the ground floor imports nothing of specpilot)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    needle = "elapsed" + "_time("
    users = sorted(str(p.relative_to(root)) for d in ("specpilot", "perf", "tests", "w12", "gdn", "tree_attn", "lmhead")
                   for p in (root / d).rglob("*.py") if needle in p.read_text())
    assert users == ["specpilot/bench/timing.py"], users


# --------------------------------------------------------------------------------------
# GPU: the CUDA-graph timing path and its fallbacks (run by perf/gpu_check.sh).
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_runner_cuda_graph_and_fallbacks(tmp_path):
    dev = torch.device("cuda")
    cases = [c for c in collect(get_shape_set("llama-3.1-8b"), dev, ["linear"]) if c.shape == "attn.o_proj-M4"]
    assert len(cases) == 1

    def syncing_case(variant, graph_safe):
        def setup():
            x = torch.randn(1024, device=dev)
            return Prepared(fns=[lambda: float(x.sum().item())], check=lambda: None, graph_safe=graph_safe)

        return Case(op="sync", variant=variant, shape="N1024", dims={"N": 1024}, flops=1024.0, bytes=4096.0,
                    setup=setup)

    cases += [syncing_case("declared", False), syncing_case("undeclared", True)]
    res = runner.run(cases, dev, out_dir=tmp_path, reps=10, warmup=2, log=None)
    by = {r["variant"]: r for r in res}
    lin = by["cublas"]
    assert lin["status"] == "ok", lin["error"]
    assert lin["method"] == "cuda_graph" and lin["calls_per_sample"] >= lin["rotations"] >= 1
    assert 0 < lin["median_us"] < 1e4 and lin["floor_us"] > 0 and lin["over_floor"] > 0.5
    assert lin["speedup"] == 1.0 and lin["gpu"] != "cpu"
    # A host sync cannot be captured: eager CUDA events instead, declared or not.
    assert by["declared"]["method"] == "cuda_events" and by["declared"]["status"] == "ok"
    assert by["undeclared"]["method"] == "cuda_events" and by["undeclared"]["status"] == "ok"
    assert res.meta["ceilings_source"] == "measured"


def test_collect_keeps_one_case_per_op_variant_shape(monkeypatch):
    """Two providers registering the same baseline (as "linear" and "w12" both do for cuBLAS)
    yield it once; a provider that raises goes to on_error and the others still run."""
    from specpilot.bench import registry

    def mk(variant):
        return Case(op="linear", variant=variant, shape="s-M1", dims={"M": 1}, flops=1.0, bytes=1.0,
                    setup=lambda: Prepared(fns=[lambda: None]))

    provs = {"a": lambda s, d: [mk("cublas"), mk("x")], "b": lambda s, d: [mk("cublas"), mk("y")],
             "bad": lambda s, d: 1 / 0}
    monkeypatch.setattr(registry, "providers", lambda: provs)
    errors = []
    cases = registry.collect(get_shape_set("tiny"), torch.device("cpu"), on_error=lambda n, e: errors.append(n))
    assert [c.variant for c in cases] == ["cublas", "x", "y"]
    assert errors == ["bad"]
    with pytest.raises(ZeroDivisionError):
        registry.collect(get_shape_set("tiny"), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"unknown op\(s\) nope"):
        registry.collect(get_shape_set("tiny"), torch.device("cpu"), ["nope"])


class _FakeNWCWeight:
    """nwc.NWCWeight's calls that the "nwc" peer makes, without compression: the BF16 bytes are its "data"."""

    def __init__(self, w, device="cuda", block=None, elem="bf16", scale=None, layout=None, lossy=False):
        self.out_features, self.in_features, self.block, self.layout = *w.shape, 4096, 0
        bits = w.contiguous().view(torch.int16) ^ int(lossy)  # lossy: every weight's lowest bit flipped
        self._t = {"data": bits.view(torch.uint8).flatten().to(device), "bases": torch.zeros(3, dtype=torch.int32),
                   "hdr": torch.zeros(96, dtype=torch.uint8), "lut": torch.zeros(7, dtype=torch.int32),
                   "low": torch.zeros(5, dtype=torch.uint8)}

    @classmethod
    def from_tensors(cls, out_f, in_f, block, data, bases, hdr, lut, low, device="cuda", elem="bf16", scale=None,
                     layout=0):
        self = cls.__new__(cls)
        self.out_features, self.in_features, self.block, self.layout = out_f, in_f, block, layout
        self._t = {"data": data, "bases": bases, "hdr": hdr, "lut": lut, "low": low}
        return self

    def tensors(self):
        return dict(self._t)

    def dequant(self):
        return self._t["data"].view(torch.bfloat16).view(self.out_features, self.in_features)


class _FakeNWCLinear(torch.nn.Module):
    def __init__(self, linear=None, device="cuda", block=None, w=None, bias=None, elem="bf16"):
        super().__init__()
        self.w = w

    def forward(self, x):
        return torch.nn.functional.linear(x, self.w.dequant())


def test_w12_nwc_peer_missing_and_plumbing(monkeypatch, capsys):
    """The "nwc" peer: absent without the package (one line on stderr, probed once); at M = 1 on CUDA only; its
    case reports the stored bytes and fails its check on a wrong output or a lossy round trip."""
    import sys
    import types

    from specpilot.bench.cases import w12 as w12_cases

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setitem(sys.modules, "nwc", None)  # `import nwc` raises ImportError
    w12_cases._nwc.cache_clear()
    try:
        assert w12_cases._peer_variants(cuda, 1) == [] and w12_cases._peer_variants(cuda, 1) == []
    finally:
        w12_cases._nwc.cache_clear()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bench w12: peer nwc skipped: ModuleNotFoundError"), err
    assert "nwc" not in {c.variant for c in collect(get_shape_set("tiny"), cpu, ["w12"])}

    def fake(weight=_FakeNWCWeight, linear=_FakeNWCLinear):
        return types.SimpleNamespace(__version__="fake", NWCWeight=weight, NWCLinear=linear)

    monkeypatch.setattr(w12_cases, "_nwc", fake)
    assert [w12_cases._peer_variants(cuda, m) for m in (1, 4)] == [["nwc"], []]
    assert w12_cases._peer_variants(cpu, 1) == []
    n, k = 75, 63
    case = w12_cases._case("attn.o_proj", n, k, 1, "nwc", cpu)
    assert (case.op, case.group, case.baseline) == ("nwc.linear", "attn.o_proj-M1", "torch")  # F.linear on a CPU
    prep = case.setup()
    prep.check()
    stored = 2 * n * k + 3 * 4 + 96 + 7 * 4 + 5
    assert case.bytes == stored + 2 * (k + n)
    assert case.extra["nwc"] == {"version": "fake", "stored_bytes": stored, "bits_per_weight": 8 * stored / (n * k)}
    prep.teardown()

    class Wrong(_FakeNWCLinear):
        def forward(self, x):
            return super().forward(x) * 1.01

    for bad, what in ((fake(linear=Wrong), "error"), (fake(weight=lambda w, **kw: _FakeNWCWeight(w, **kw, lossy=True)),
                                                       "elements differ bitwise")):
        monkeypatch.setattr(w12_cases, "_nwc", lambda bad=bad: bad)
        prep = w12_cases._case("attn.o_proj", n, k, 1, "nwc", cpu).setup()
        with pytest.raises(AssertionError, match=what):
            prep.check()
    w12_cases._Weights.release()


def test_group_is_warmed_before_its_first_timing(monkeypatch):
    """On CUDA the runner runs every timed case of a group for GROUP_WARM_S before timing the first one, so the
    group's first case (often its baseline) is not timed on an idle GPU; on a CPU it does not."""
    events = []

    def prep(tag):
        return runner.Prepared(fns=[lambda: events.append(("call", tag))], check=lambda: None)

    monkeypatch.setattr(runner, "_sync", lambda device: None)
    monkeypatch.setattr(runner, "GROUP_WARM_S", 0.0)
    assert runner._warm_group([prep("a"), prep("b")], torch.device("cpu")) == 0 and events == []
    assert runner._warm_group([prep("a"), prep("b")], torch.device("cuda")) == 1
    assert events == [("call", "a"), ("call", "b")]
    monkeypatch.setattr(runner, "GROUP_WARM_S", 0.05)
    events.clear()
    assert runner._warm_group([prep("a")], torch.device("cuda")) >= 2 and len(events) >= 2


def test_a_case_alone_is_torn_down_before_the_next_is_set_up():
    """A group holding a Case.alone case sets up, times and tears down each case before the next one's setup (the
    decode step's BF16 set and W12 packs do not fit an 80 GB GPU together), and still takes every ratio against the
    group's baseline; a group without one sets all its cases up first."""
    for alone in (True, False):
        events = []

        def case(variant, alone=alone):
            def setup():
                events.append(("setup", variant))
                return Prepared(fns=[lambda: None], check=lambda: None,
                                teardown=lambda: events.append(("teardown", variant)))
            return Case(op="decode_step", variant=variant, shape="s", dims={"M": 1}, flops=1.0, bytes=1.0,
                        setup=setup, baseline="base", alone=alone and variant == "w12")

        rows = runner._run_group([case("base"), case("w12")], torch.device("cpu"), reps=3, warmup=1, common={},
                                 log=lambda s: None)
        assert [r["status"] for r in rows] == ["ok", "ok"]
        assert rows[1]["baseline_us"] == rows[0]["median_us"] and rows[1]["speedup"] > 0
        order = [e for e in events if e[0] in ("setup", "teardown")]
        if alone:
            assert order == [("setup", "base"), ("teardown", "base"), ("setup", "w12"), ("teardown", "w12")]
        else:
            assert order == [("setup", "base"), ("setup", "w12"), ("teardown", "base"), ("teardown", "w12")]


def test_screen_widths_on_the_tiny_head(tmp_path):
    """specpilot.bench.screens on the tiny head: every interval holds its fp64 logit (checked inside), the radius
    grows as the codes narrow and shrinks with the hidden states' second part, the counts lie in 1..V; the JSON
    holds every (regime, width, parts) once."""
    from specpilot.bench import screens
    from specpilot.bench.cases import lmhead as cases

    path = tmp_path / "s.json"
    assert screens.main(["--shapes", "tiny", "--rows", "3", "--bits", "4", "6", "8", "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    rows = {(r["regime"], r["bits"], r["hidden_parts"]): r for r in out["screens"]}
    assert len(rows) == len(out["screens"]) == len(cases.REGIMES) * 3 * 2
    for regime in cases.REGIMES:
        radius = [rows[(regime, b, 1)]["radius_over_sigma"] for b in (4, 6, 8)]
        assert radius[0] > radius[1] > radius[2], (regime, radius)
        for b in (4, 6, 8):
            one, two = rows[(regime, b, 1)], rows[(regime, b, 2)]
            assert two["radius_over_sigma"] < one["radius_over_sigma"], (regime, b)
            assert all(1 <= n <= out["V"] for n in one["survivors"] + two["survivors"])
    assert rows[("peaked", 8, 2)]["survivors"] == [1, 1, 1]


def test_screen_widths_catch_a_bound_that_misses(monkeypatch):
    """The interval check is live: with the per-group maxima read as 0 (both Hölder halves of the radius gone) the
    intervals shrink to the screen's values, which miss the fp64 logits, and it raises."""
    from specpilot.bench import screens

    w = (torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16)
    h = torch.randn(2, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    screens.screen_survivors(w, h, 8, 2)
    real = screens._per_group
    monkeypatch.setattr(screens, "_per_group", lambda x, g, how: real(x, g, how) * (0 if how == "max" else 1))
    with pytest.raises(AssertionError, match="misses its fp64 logit"):
        screens.screen_survivors(w, h, 8, 2)
