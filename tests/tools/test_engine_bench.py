"""The engine benchmark's idle-time accounting (`specpilot.bench.engine.idle_gaps`) on made-up kernel records: the
gap before a kernel is charged to its category, overlaps give none, spaces between calls are left out."""

import pytest

from specpilot.bench.engine import exclusive_time, idle_gaps, markdown


def test_gaps_are_charged_to_the_kernel_that_follows():
    # two calls of: gemm [0, 10], w12 [12, 20] (2 µs idle), rmsnorm [20.5, 21] (0.5 µs idle);
    # the second call starts 1000 µs later (between calls: not counted)
    one = [("sm90_gemm_bf16", 0.0, 10.0), ("w12_flow_kernel", 12.0, 20.0), ("triton_rmsnorm", 20.5, 21.0)]
    recs = one + [(n, a + 1000.0, b + 1000.0) for n, a, b in one]
    got = idle_gaps(recs, reps=2)
    assert got["ms"] == {"w12 GEMM": 2e-3, "other (norms, gates, copies)": 0.5e-3}
    assert got["us_per_gap"] == {"w12 GEMM": 2.0, "other (norms, gates, copies)": 0.5}
    assert list(got["ms"]) == ["w12 GEMM", "other (norms, gates, copies)"]  # largest first


def test_overlapping_kernels_leave_no_gap():
    # a kernel that starts before the previous one ends (programmatic dependent launch), then a gap measured
    # from the later of the two ends, not from the last start
    recs = [("w12_a", 0.0, 10.0), ("w12_b", 8.0, 15.0), ("gdn_tree_verify", 16.0, 20.0), ("w12_c", 19.0, 30.0)]
    got = idle_gaps(recs, reps=1)
    assert got["ms"] == {"gdn verify": 1e-3}


def test_markdown_prints_the_idle_line():
    row = {"ar_ms": 10.0, "ar_floor_ms": 8.0, "ar_over_floor": 1.25, "verify_ms": 12.0, "verify_over_ar": 1.2,
           "implied": {t: {"tokens_per_s": 1.0, "speedup_vs_ar": 1.0} for t in ("4", "6", "8")},
           "ar_breakdown": {"ms": {"w12 GEMM": 8.0}, "kernels_per_call": 3.0,
                            "idle": {"ms": {"w12 GEMM": 0.4}, "us_per_gap": {"w12 GEMM": 1.5}}}}
    md = markdown({"shapes": "s", "prefix": 1, "nodes": 32, "gpu": "g", "torch": "t", "cuda": "c", "formats": {"w12": row}})
    assert "Idle before each kind (ms): w12 GEMM 0.40 (1.5 µs each)." in md


def test_top_pairs_name_the_kernels_around_each_gap():
    # per call: gemm [0, 10], then conv after 3 µs, then verify after 1 µs; templated names lose their arguments
    one = [("sm90_gemm_bf16<128, 64>(float*)", 0.0, 10.0), ("gdn_tree_conv_kernel", 13.0, 14.0),
           ("gdn_tree_verify(int)", 15.0, 20.0)]
    recs = one + [(n, a + 1000.0, b + 1000.0) for n, a, b in one]
    got = idle_gaps(recs, reps=2)["top_pairs"]
    assert list(got) == ["sm90_gemm_bf16 -> gdn_tree_conv_kernel", "gdn_tree_conv_kernel -> gdn_tree_verify"]
    assert got["sm90_gemm_bf16 -> gdn_tree_conv_kernel"] == {"ms": 3e-3, "gaps": 1.0, "us_per_gap": 3.0}
    assert idle_gaps(recs, reps=2, top_pairs=1)["top_pairs"].keys() == {"sm90_gemm_bf16 -> gdn_tree_conv_kernel"}


def test_a_copy_record_is_device_time_not_idle():
    # conv [0, 1], a graph's memcpy node [1.5, 4.5], then the WY kernel at 5: 0.5 µs before the copy (charged to
    # it), 0.5 before the kernel, not the 4 µs the gap would be without the copy's record
    recs = [("gdn_tree_conv_kernel", 0.0, 1.0), ("Memcpy DtoD (Device -> Device)", 1.5, 4.5),
            ("gdn_tree_cuda_kernel", 5.0, 9.0)]
    got = idle_gaps(recs, reps=1)
    assert got["ms"] == {"memcpy / memset": 0.5e-3, "gdn verify": 0.5e-3}
    assert list(got["top_pairs"]) == ["gdn_tree_conv_kernel -> Memcpy DtoD",
                                      "Memcpy DtoD -> gdn_tree_cuda_kernel"]


def test_exclusive_time_charges_each_moment_once():
    # a flow kernel launched early (programmatic dependent launch) that waits from 8 to 10 on the norm before it:
    # the profiler's durations give 13 µs of w12 for a 15 µs call; each moment charged once gives the norm its
    # 10 µs and the GEMM the 5 µs after it; a kernel inside another's span adds nothing; gaps count for no one
    recs = [("triton_rmsnorm", 0.0, 10.0), ("w12_flow_kernel", 8.0, 15.0), ("lmhead_screen", 11.0, 14.0),
            ("gdn_tree_conv_kernel", 17.0, 20.0)]
    got = exclusive_time(recs + [(n, a + 1000.0, b + 1000.0) for n, a, b in recs], reps=2)
    assert got == {"other (norms, gates, copies)": 10e-3, "w12 GEMM": 5e-3, "gdn verify": 3e-3}
    assert list(got) == ["other (norms, gates, copies)", "w12 GEMM", "gdn verify"]


def test_gpu_state_parses_nvidia_smi_and_survives_its_absence():
    import subprocess

    from specpilot.bench.engine import gpu_state

    class Out:
        stdout = "1980, 3201, 41, 312.55\n"

    seen = []

    def fake(cmd, **kw):
        seen.append(cmd)
        return Out()

    assert gpu_state(3, run=fake) == {"sm_mhz": 1980.0, "mem_mhz": 3201.0, "temp_c": 41.0, "power_w": 312.55}
    assert seen[0][0] == "nvidia-smi" and "--id=3" in seen[0]

    def missing(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")

    def timeout(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, 10)

    class Odd:
        stdout = "[N/A], 3201, 41, 300\n"

    assert gpu_state(0, run=missing) is None and gpu_state(0, run=timeout) is None
    assert gpu_state(0, run=lambda cmd, **kw: Odd()) is None


def test_interleaved_rounds_alternate_the_order():
    from specpilot.bench.engine import _pooled, interleaved_rounds
    from specpilot.bench.timing import Timing

    assert interleaved_rounds(1, ("bf16", "w12")) == [["bf16", "w12"]]
    assert interleaved_rounds(4, ("bf16", "w12")) == [["bf16", "w12"], ["w12", "bf16"]] * 2
    with pytest.raises(ValueError, match="rounds"):
        interleaved_rounds(0, ("bf16",))
    got = _pooled([Timing((1.0, 3.0), "cuda_events", 1), Timing((2.0,), "cuda_events", 1)])
    assert got.samples == (1.0, 3.0, 2.0) and got.median == 2.0


def test_markdown_prints_the_rounds():
    row = {"ar_ms": 10.0, "ar_floor_ms": 8.0, "ar_over_floor": 1.25, "verify_ms": 12.0, "verify_over_ar": 1.2,
           "implied": {t: {"tokens_per_s": 1.0, "speedup_vs_ar": 1.0} for t in ("4", "6", "8")},
           "ar_ms_by_round": [10.0, 10.5], "verify_ms_by_round": [12.0, 12.25]}
    md = markdown({"shapes": "s", "prefix": 1, "nodes": 32, "gpu": "g", "torch": "t", "cuda": "c", "rounds": 2,
                   "formats": {"w12": row}})
    assert "timed in 2 rounds" in md and "w12 AR 10.00 / 10.50, verify 12.00 / 12.25" in md


def test_engine_bench_refuses_the_w12_screen_for_a_bf16_model():
    """--head-screen w12 reads a W12 head's 8-bit view: with the BF16 model among the formats the run stops before
    building anything, naming the way out; the markdown names each format's screen."""
    import pytest

    from specpilot.bench import engine

    with pytest.raises(ValueError, match="formats=\\('w12',\\)"):
        engine.run(formats=("bf16", "w12"), head_screen="w12")
    row = {"ar_ms": 2.0, "ar_floor_ms": 1.0, "ar_over_floor": 2.0, "verify_ms": 3.0, "verify_over_ar": 1.5,
           "implied": {t: {"tokens_per_s": 1.0, "speedup_vs_ar": 1.0} for t in ("4", "6", "8")}, "head_screen": "int4"}
    md = engine.markdown({"shapes": "tiny", "prefix": 8, "nodes": 4, "gpu": "g", "torch": "t", "cuda": "c",
                          "formats": {"w12": row}})
    assert "screen (`none`: the plain exact head): w12 int4." in md


def test_engine_bench_in_a_process_per_format_pools_the_rounds(tmp_path):
    """run_processes: each format in a process of its own per round, the order alternating, the first round's with
    the profile; a format's samples of all rounds pooled, each round's medians kept, the derived fields recomputed
    from the pooled medians; a process that leaves no result file stops the run."""
    import json as _json

    import pytest

    from specpilot.bench import engine

    calls = []
    base = {"bf16": 20.0, "w12": 16.0}

    def spawn(args, env):
        assert env == {}
        fmt = args[args.index("--formats") + 1]
        out = args[args.index("--out") + 1]
        calls.append((fmt, "--no-profile" in args))
        r = sum(1 for f, _ in calls if f == fmt) - 1
        ar = [base[fmt] + r + 0.1 * i for i in range(3)]
        row = {"ar_ms": ar[1], "verify_ms": 2 * ar[1], "ar_samples_ms": ar, "verify_samples_ms": [2 * x for x in ar],
               "timing_method": "cuda_events", "timing_calls": 1, "ar_floor_ms": 10.0, "head_screen": "none"}
        res = {"shapes": "tiny", "prefix": 8, "nodes": 4, "gpu": "g", "torch": "t", "cuda": "c", "formats": {fmt: row}}
        engine.write_run(out, "engine", res, "")

    res = engine.run_processes(["--shapes", "tiny"], ("bf16", "w12"), rounds=3, out=tmp_path, log=lambda s: None,
                               spawn=spawn)
    assert calls == [("bf16", False), ("w12", False), ("w12", True), ("bf16", True), ("bf16", True), ("w12", True)]
    w = res["formats"]["w12"]
    assert w["ar_ms_by_round"] == pytest.approx([16.1, 17.1, 18.1])
    assert len(w["ar_samples_ms"]) == 9 and w["ar_ms"] == pytest.approx(17.1)
    assert w["ar_over_floor"] == pytest.approx(1.71) and w["verify_over_ar"] == pytest.approx(2.0)
    assert res["processes"] and res["rounds"] == 3
    written = _json.loads(next(tmp_path.glob("*-engine.json")).read_text())
    assert written["formats"]["bf16"]["ar_ms"] == pytest.approx(21.1)
    assert "a process of its own" in next(tmp_path.glob("*-engine.md")).read_text()
    with pytest.raises(RuntimeError, match="wrote 0 result files"):
        engine.run_processes([], ("w12",), out=None, log=lambda s: None, spawn=lambda args, env: None)
    with pytest.raises(ValueError, match="unknown format"):
        engine.run_processes([], ("w16",), log=lambda s: None, spawn=lambda args, env: None)


def test_engine_bench_process_format_runs_the_w12_model_under_its_environment(tmp_path):
    """run_processes' "w12-glue-swiglu": a W12 process with SPECPILOT_W12_SWIGLU=0, its row under its own name."""
    from specpilot.bench import engine

    seen = []

    def spawn(args, env):
        fmt = args[args.index("--formats") + 1]
        seen.append((fmt, env))
        row = {"ar_ms": 1.0, "verify_ms": 2.0, "ar_samples_ms": [1.0], "verify_samples_ms": [2.0],
               "timing_method": "cuda_events", "timing_calls": 1, "ar_floor_ms": 1.0}
        engine.write_run(args[args.index("--out") + 1], "engine", {"gpu": "g", "formats": {fmt: row}}, "")

    res = engine.run_processes([], ("w12", "w12-glue-swiglu"), log=lambda s: None, spawn=spawn)
    assert seen == [("w12", {}), ("w12", {"SPECPILOT_W12_SWIGLU": "0"})]
    assert set(res["formats"]) == {"w12", "w12-glue-swiglu"}


def test_floor_rates_name_their_source():
    """Each row records the rates its floors divide by and their source, and the markdown says them: a floor at a
    datasheet's rate is not a floor at a measured one."""
    from specpilot.bench import engine

    got = engine._floor_rates("h100-sxm")
    assert got == {"copy_tbs": pytest.approx(3.04), "matmul_tflops": pytest.approx(813.0),
                   "source": "measured on the H100 SXM (autotune.GPUS)"}
    row = {"ar_ms": 10.0, "ar_floor_ms": 8.0, "ar_over_floor": 1.25, "verify_ms": 12.0, "verify_over_ar": 1.2,
           "implied": {t: {"tokens_per_s": 1.0, "speedup_vs_ar": 1.0} for t in ("4", "6", "8")},
           "floor_rates": {"copy_tbs": 3.35, "matmul_tflops": 989.0, "source": "datasheet of the H100 SXM"}}
    md = markdown({"shapes": "s", "prefix": 1, "nodes": 32, "gpu": "g", "torch": "t", "cuda": "c",
                   "formats": {"w12": row}})
    assert "Floors: the step's bytes at 3.35 TB/s and its FLOPs at 989 TFLOP/s (datasheet of the H100 SXM)." in md
