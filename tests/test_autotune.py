"""autotune: GPU table, byte floors, lazy predicates, measured ceilings, the config mechanism."""

import dataclasses
import json
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import autotune
from autotune import config as cfgmod
from autotune import hardware as hw


# --------------------------------------------------------------------------------------
# GPU table
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "torch_name, slug, bw, bf16, cap, wgmma",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm", 3.35, 989.0, (9, 0), True),
        ("NVIDIA H200", "h200", 4.8, 989.0, (9, 0), True),
        ("NVIDIA A100-SXM4-80GB", "a100", 2.039, 312.0, (8, 0), False),
        ("NVIDIA L40S", "l40s", 0.864, 362.0, (8, 9), False),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx-pro-6000", 1.792, 503.8, (12, 0), False),
        ("NVIDIA B200", "b200", 8.0, 2250.0, (10, 0), False),
    ],
    ids=["H100-SXM", "H200", "A100", "L40S", "RTX-PRO-6000", "B200"],
)
def test_gpu_table(torch_name, slug, bw, bf16, cap, wgmma):
    spec = autotune.GPUS[slug]
    assert autotune.gpu_spec(torch_name) is spec
    assert autotune.gpu_spec(slug) is spec
    assert (spec.bandwidth_tbs, spec.bf16_tflops, spec.capability, spec.has_wgmma) == (bw, bf16, cap, wgmma)
    assert spec.int8_tops >= spec.bf16_tflops and spec.sm_count > 0
    # wgmma is a Hopper-only instruction: the table agrees with the capability.
    assert spec.has_wgmma == (spec.capability == (9, 0))


def test_gpu_table_unknown_and_cpu():
    assert autotune.gpu_spec("Radeon 9000") is None
    assert autotune.gpu_name("cpu") == "cpu"
    assert autotune.gpu_slug("cpu") == "cpu"
    assert autotune.has_wgmma("cpu") is False


# --------------------------------------------------------------------------------------
# byte floor
# --------------------------------------------------------------------------------------


def test_byte_floor_bandwidth_bound():
    # 1 GB on an H200: bytes at the measured 4.28 TB/s (autotune.GPUS), no fraction, dominate a trivial FLOP count.
    t = autotune.byte_floor(flops=1e6, bytes=1e9, device="h200")
    assert t == pytest.approx(1e9 / 4.28e12, rel=1e-12)
    assert autotune.floor_rates("h200")[2] == "measured on the H200 (autotune.GPUS)"
    # the paper's floor, beside it: 90% of the datasheet's 4.8 TB/s
    assert autotune.paper_floor(1e6, 1e9, "h200") == pytest.approx(1e9 / (0.9 * 4.8e12), rel=1e-12)


def test_byte_floor_compute_bound():
    # A large GEMM on an H100: FLOPs at its measured 813 TFLOP/s (autotune.GPUS, no fraction), the paper's at 60% of
    # the datasheet's 989. An A100, which has no measured rates here, takes its datasheet's 312 (said so by
    # floor_rates).
    n = 8192
    t = autotune.byte_floor(flops=2.0 * n**3, bytes=3 * 2 * n * n, device="H100 SXM")
    assert t == pytest.approx(2.0 * n**3 / 813e12, rel=1e-12)
    assert autotune.floor_rates("H100 SXM")[2] == "measured on the H100 SXM (autotune.GPUS)"
    assert autotune.paper_floor(2.0 * n**3, 3 * 2 * n * n, "H100 SXM") == pytest.approx(2.0 * n**3 / (0.6 * 989e12))
    assert autotune.byte_floor(2.0 * n**3, 3 * 2 * n * n, "a100") == pytest.approx(2.0 * n**3 / 312e12, rel=1e-12)
    assert autotune.floor_rates("a100")[2].startswith("datasheet")


def test_byte_floor_takes_the_slower_and_validates():
    t_bw = autotune.byte_floor(0, 1e9, "b200")
    t_fl = autotune.byte_floor(1e13, 0, "b200")
    assert autotune.byte_floor(1e13, 1e9, "b200") == max(t_bw, t_fl)
    with pytest.raises(ValueError, match="^autotune.byte_floor: flops and bytes must be non-negative"):
        autotune.byte_floor(-1, 0, "h200")
    with pytest.raises(ValueError, match="^autotune.paper_floor: no datasheet for 'cpu'"):
        autotune.paper_floor(1.0, 1.0, torch.device("cpu"))


@pytest.fixture
def fresh_ceilings(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hw, "_CEILINGS", {})
    return tmp_path


def test_byte_floor_measured_vs_datasheet(fresh_ceilings):
    # Nothing measured for this CPU and no datasheet entry: a clear error.
    with pytest.raises(ValueError, match="measure_ceilings"):
        autotune.byte_floor(1.0, 1.0, "cpu")
    hw._CEILINGS["cpu"] = hw.Ceilings(device="cpu", copy_tbs=0.05, bf16_tflops=1.0)
    bw, rate, src = autotune.peak_rates("cpu")
    assert (bw, rate, src) == (0.05e12, 1.0e12, "measured")
    assert autotune.byte_floor(0, 1e9, torch.device("cpu")) == pytest.approx(1e9 / 0.05e12)  # measured, undiscounted
    assert autotune.byte_floor(1e12, 0, None) == pytest.approx(1e12 / 1.0e12)
    # Naming a GPU asks for its datasheet, whatever this machine measured.
    assert autotune.peak_rates("h200") == (4.8e12, 989e12, "datasheet")


# --------------------------------------------------------------------------------------
# lazy, cached predicates
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_import_does_not_touch_cuda():
    code = """
import torch
def boom(*a, **k):
    raise RuntimeError("CUDA touched at import time")
for n in ("get_device_name", "get_device_capability", "get_device_properties", "current_device",
          "is_available", "device_count", "init", "synchronize"):
    setattr(torch.cuda, n, boom)
import autotune, autotune.config, autotune.hardware, autotune.interpreter
import specpilot.testing, specpilot.bench, specpilot.bench.runner, specpilot.bench.report, specpilot.cli
from specpilot.bench import registry
registry.providers()  # imports every case module
assert not [e for e in registry.load_errors().values() if "touched" in e], registry.load_errors()
try:
    autotune.gpu_name()
except RuntimeError:
    print("lazy-ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "lazy-ok" in r.stdout


def test_predicates_cached(monkeypatch):
    calls = {"name": 0, "cap": 0}

    def name(i):
        calls["name"] += 1
        return "NVIDIA H200"

    def cap(i):
        calls["cap"] += 1
        return (9, 0)

    hw._name_of.cache_clear()
    hw.compute_capability.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", cap)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    try:
        assert autotune.gpu_name() == "NVIDIA H200" and autotune.gpu_name() == "NVIDIA H200"
        assert autotune.gpu_slug() == "h200"
        assert autotune.has_wgmma() and autotune.has_wgmma()
        assert calls == {"name": 1, "cap": 1}
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert autotune.has_wgmma() is False  # never under the interpreter
    finally:
        hw._name_of.cache_clear()
        hw.compute_capability.cache_clear()


# --------------------------------------------------------------------------------------
# measured ceilings
# --------------------------------------------------------------------------------------


def test_measure_ceilings_cpu_cached(fresh_ceilings, monkeypatch):
    c = autotune.measure_ceilings(copy_bytes=1 << 20, matmul_n=64)
    assert c.device == "cpu" and c.copy_tbs > 0 and c.bf16_tflops > 0 and c.measured_at
    disk = json.loads((fresh_ceilings / "ceilings.json").read_text())
    assert disk["cpu"]["copy_tbs"] == c.copy_tbs

    def no_timing(*a, **k):
        raise AssertionError("re-measured although cached")

    monkeypatch.setattr(hw, "_time_cpu", no_timing)
    assert autotune.measure_ceilings(copy_bytes=1 << 20, matmul_n=64) is c
    monkeypatch.setattr(hw, "_CEILINGS", {})  # a new process: read back from disk
    assert autotune.cached_ceilings() == c
    assert autotune.measure_ceilings() == c
    with pytest.raises(AssertionError, match="re-measured"):
        autotune.measure_ceilings(refresh=True, copy_bytes=1 << 20, matmul_n=64)


# --------------------------------------------------------------------------------------
# config mechanism
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cfg:
    block_n: int = 64
    warps: int = 4


@pytest.mark.parametrize("m, b", [(1, 1), (2, 2), (3, 4), (5, 8), (16, 16), (17, 32), (63, 64), (500, 512)])
def test_bucket_m(m, b):
    assert autotune.bucket_m(m) == b


def test_bucket_m_rejects_zero_and_shape_key():
    with pytest.raises(ValueError):
        autotune.bucket_m(0)
    assert autotune.shape_key(N=5120, M=3, K=17408) == "K17408-M4-N5120"
    assert autotune.shape_key(M=75, N=63) == "M128-N63"


def test_force_scoping_and_nesting():
    assert autotune.forced("w") == (None, None)
    with autotune.force("w", variant="gemv"):
        assert autotune.forced("w") == ("gemv", None)
        with autotune.force("w", variant="tc", config=Cfg(128, 8)):
            assert autotune.forced("w") == ("tc", Cfg(128, 8))
            assert autotune.forced("other") == (None, None)
        assert autotune.forced("w") == ("gemv", None)
    assert autotune.forced("w") == (None, None)
    with pytest.raises(ValueError):
        with autotune.force("w"):
            pass


def test_force_is_context_local():
    seen = []
    with autotune.force("w", variant="tc"):
        t = threading.Thread(target=lambda: seen.append(autotune.forced("w")))
        t.start()
        t.join()
    assert seen == [(None, None)]


def test_variants_choose_and_forced_config():
    v = autotune.Variants("w", by_arch={9: "tc_sm90", 8: "gemv"}, known=("tc_sm90", "gemv", "torch"))
    # Under the interpreter (the CPU test session) the portable (smallest-key) variant wins.
    assert v.default() == "gemv" and v.choose(None) == ("gemv", False)
    assert v.choose("tc_sm90") == ("tc_sm90", True)  # the keyword
    with autotune.force("w", variant="tc_sm90"):
        assert v.choose(None) == ("tc_sm90", True)
        assert v.choose("gemv") == ("gemv", True)  # the keyword beats force
    with pytest.raises(ValueError, match=r"w.f: unknown variant 'x'; choose one of \('tc_sm90', 'gemv', 'torch'\)"):
        v.choose("x", where="w.f")
    with pytest.raises(ValueError, match="not in known"):
        autotune.Variants("w", by_arch={9: "tc"}, known=("gemv", "torch"))
    with autotune.force("w", config=Cfg(32, 2)):
        assert autotune.get_config("w", "gemv", Cfg, Cfg, key="M1") == Cfg(32, 2)
    with autotune.force("w", config={"block_n": 1}):
        with pytest.raises(TypeError):
            autotune.get_config("w", "gemv", Cfg, Cfg, key="M1")


def test_variants_default_by_generation(monkeypatch):
    """The device's major; else the largest major below it, never the sm_90-only 9; CPU tensors and
    GPUs below every key get the fallback."""
    import autotune.dispatch as dispatch

    v = autotune.Variants("w", by_arch={9: "hopper", 8: "ampere"}, known=("hopper", "ampere", "torch"))
    monkeypatch.setattr(dispatch, "is_interpreter", lambda: False)
    monkeypatch.setattr(dispatch, "has_cuda", lambda: True)
    for major, want in ((9, "hopper"), (8, "ampere"), (10, "ampere"), (12, "ampere"), (7, "torch")):
        monkeypatch.setattr(dispatch, "compute_capability", lambda index=None, m=major: (m, 0))
        assert v.default(torch.device("cuda", 0)) == want, major
    assert v.default(torch.device("cpu")) == "torch"


def test_cuda_only_variant_named_off_cuda(monkeypatch):
    """A variant declared cuda_only, asked for by name, is refused for CPU tensors with or without the interpreter
    (no Triton fallback runs it); automatic choices and the other variants are unaffected."""
    import autotune.dispatch as dispatch

    v = autotune.Variants("w", by_arch={9: "hopper", 8: "ampere"}, known=("hopper", "ampere", "cxx", "torch"),
                          cuda_only=("cxx",), public=False)
    for interp in (False, True):
        monkeypatch.setattr(dispatch, "is_interpreter", lambda i=interp: i)
        with pytest.raises(ValueError, match="variant 'cxx' is a CUDA C\\+\\+ kernel.*on cpu"):
            v.choose("cxx", torch.device("cpu"))
    assert v.choose("ampere", torch.device("cpu")) == ("ampere", True)  # the interpreter runs it
    with pytest.raises(ValueError, match="not in known"):
        autotune.Variants("w", by_arch={8: "ampere"}, known=("ampere", "torch"), cuda_only=("cxx",), public=False)


def test_plan_cache_keys_and_clear(fake_h200):
    made = []

    def make(tag):
        made.append(tag)
        return autotune.Plan("v", tag, None)

    cache = autotune.PlanCache(limit=2)
    assert cache.get(("a",), lambda: make("a")) == autotune.Plan("v", "a")
    assert cache.get(("a",), lambda: make("again")).kernel == "a" and made == ["a"]
    cache.get(("b",), lambda: make("b"))
    cache.get(("c",), lambda: make("c"))  # past the limit: starts over
    assert len(cache) == 1
    autotune.store_tuned("w", "v", "M1", Cfg(1, 1))  # a tuned entry changed: every plan is made again
    assert len(cache) == 0


def _heuristic():
    return Cfg(64, 4)


def test_tuned_lookup(fake_h200):
    key = autotune.shape_key(M=3, N=5120, K=17408)
    assert autotune.get_config("w12", "gemv", Cfg, _heuristic, key=key) == Cfg(64, 4)
    path = autotune.store_tuned("w12", "gemv", key, Cfg(256, 8), extra={"us": 12.5})
    assert path == fake_h200 / "h200.json"
    data = json.loads(path.read_text())
    assert data["meta"]["gpu"] == "NVIDIA H200"
    assert set(data["meta"]) >= {"torch", "triton", "cuda", "specpilot"}
    assert autotune.get_config("w12", "gemv", Cfg, _heuristic, key=key) == Cfg(256, 8)
    # Other buckets and variants fall back to the heuristic; force beats the tuned entry.
    assert autotune.get_config("w12", "gemv", Cfg, _heuristic, key="K17408-M64-N5120") == Cfg(64, 4)
    assert autotune.get_config("w12", "tc", Cfg, _heuristic, key=key) == Cfg(64, 4)
    with autotune.force("w12", config=Cfg(16, 1)):
        assert autotune.get_config("w12", "gemv", Cfg, _heuristic, key=key) == Cfg(16, 1)


def test_drop_tuned(fake_h200):
    key = autotune.shape_key(M=1, N=5120, K=6144)
    assert not autotune.drop_tuned("w12", "gemv", key)  # no file yet
    autotune.store_tuned("w12", "gemv", key, Cfg(256, 8))
    autotune.store_tuned("w12", "tc", key, Cfg(32, 2))
    assert autotune.drop_tuned("w12", "gemv", key)
    assert not autotune.drop_tuned("w12", "gemv", key)
    assert autotune.get_config("w12", "gemv", Cfg, _heuristic, key=key) == Cfg(64, 4)
    assert autotune.get_config("w12", "tc", Cfg, _heuristic, key=key) == Cfg(32, 2)


def test_w12_mma_variant_runs_a_tuned_tma_entry_only_where_tma_runs(fake_h200, monkeypatch):
    """variant 'mma' on sm_90: a tuned 'tma' entry (the TMA kernel won that cell) beats the
    register-pipelined kernel's entry or heuristic; where TMA cannot run, the 'mma' path stays."""
    from w12 import cuda as wcuda
    from w12 import ops as wops
    from w12.configs import MmaConfig, TmaConfig

    key = autotune.shape_key(M=1, N=5120, K=6144)
    autotune.store_tuned("w12.matmul", "tma", key, TmaConfig(1, 8, 6, split=3))
    autotune.store_tuned("w12.matmul", "mma", autotune.shape_key(M=8, N=5120, K=6144), MmaConfig(2, 4, 3))
    monkeypatch.setattr(wcuda, "unavailable", lambda device=None: None)  # as on an sm_90 GPU

    def plan(op, M):  # meta tensors: a plan reads shapes, dtypes and the device only
        x = torch.empty(M, 6144, dtype=torch.bfloat16, device="meta")
        return wops._plan(op, "mma", x, torch.empty(5120, 6144, dtype=torch.uint8, device="meta"))

    for tma_ok in (True, False):
        autotune.clear_plans()
        monkeypatch.setattr(wcuda, "tma_available", lambda device=None, ok=tma_ok: ok)
        _, kernel, cfg = plan("w12.matmul", 1)
        assert kernel == "mma"
        if tma_ok:
            assert cfg == TmaConfig(1, 8, 6, split=3)
        else:
            assert isinstance(cfg, MmaConfig)
        assert plan("w12.matmul", 8) == ("mma", "mma", MmaConfig(2, 4, 3))
        assert isinstance(plan("w12.matmul_q8", 1).config, MmaConfig)  # per op
    autotune.clear_plans()


def test_tuned_file_of_another_gpu_is_ignored(fake_h200):
    (fake_h200 / "h200.json").write_text(json.dumps({
        "meta": {"gpu": "NVIDIA H100 80GB HBM3", "triton": autotune.versions()["triton"]},
        "entries": {"w12/gemv/M1": {"block_n": 512, "warps": 16}},
    }))
    assert autotune.get_config("w12", "gemv", Cfg, _heuristic, key="M1") == Cfg(64, 4)


def _write_old_triton(folder):
    (folder / "h200.json").write_text(json.dumps({
        "meta": {"gpu": "NVIDIA H200", "triton": "2.1.0", "torch": "2.1", "cuda": "12.1", "specpilot": "0"},
        "entries": {"w12/gemv/M1": {"block_n": 512, "warps": 16, "_": {"us": 3.0}}},
    }))


def test_triton_mismatch_warns_once_and_ignores(fake_h200):
    _write_old_triton(fake_h200)
    with pytest.warns(UserWarning, match="SPECPILOT_TUNED_CONFIGS=any"):
        assert autotune.get_config("w12", "gemv", Cfg, _heuristic, key="M1") == Cfg(64, 4)
    cfgmod._TUNED.clear()  # even when the file is read again, the warning is not repeated
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert autotune.get_config("w12", "gemv", Cfg, _heuristic, key="M1") == Cfg(64, 4)
    assert not [w for w in rec if "tuned with Triton" in str(w.message)]


def test_triton_mismatch_policy_any_and_off(fake_h200, monkeypatch):
    _write_old_triton(fake_h200)
    monkeypatch.setenv("SPECPILOT_TUNED_CONFIGS", "any")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert autotune.get_config("w12", "gemv", Cfg, _heuristic, key="M1") == Cfg(512, 16)
    monkeypatch.setenv("SPECPILOT_TUNED_CONFIGS", "off")
    assert autotune.get_config("w12", "gemv", Cfg, _heuristic, key="M1") == Cfg(64, 4)


def test_tuned_configs_never_used_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(cfgmod, "_TUNED", {})
    (tmp_path / "cpu.json").write_text(json.dumps({"meta": {}, "entries": {"w12/gemv/M1": {"block_n": 1}}}))
    assert autotune.load_tuned() == {}


def test_versions():
    v = autotune.versions()
    assert set(v) == {"torch", "triton", "cuda", "specpilot"}
    assert v["torch"] == torch.__version__
