"""`specpilot tune` on the CPU: --report prints the stored configs; tuning itself fails clearly (exit 2)."""

from dataclasses import dataclass

import pytest
import torch

import autotune
from autotune import config as cfgmod
from specpilot import cli


@dataclass(frozen=True)
class Cfg:
    block_n: int = 64
    num_warps: int = 4


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CONFIG_DIR", str(tmp_path / "shipped"))
    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cfgmod, "_WARNED", set())
    return tmp_path


def test_report_prints_entries_and_metadata(dirs, capsys, monkeypatch):
    monkeypatch.chdir(dirs)
    autotune.store_tuned("w12.matmul", "tc", "K6144-M8-N5120", Cfg(128, 8), extra={"over_floor": 1.23})
    autotune.store_tuned("tree_attn.tree_attention", "mma", "D256-G6", Cfg(32, 4), user=True)
    (dirs / "cache" / "configs" / "broken.json").write_text("{oops")
    with pytest.warns(UserWarning, match="ignoring"):
        assert cli.main(["tune", "--report"]) == 0
    out = capsys.readouterr().out
    assert f"shipped: {dirs / 'shipped'}" in out and f"user: {dirs / 'cache' / 'configs'}" in out
    assert "w12.matmul/tc/K6144-M8-N5120: block_n=128, num_warps=8" in out
    assert '"over_floor": 1.23' in out
    assert "tree_attn.tree_attention/mma/D256-G6: block_n=32, num_warps=4" in out
    assert "broken.json: not a tuned-config file, ignored" in out
    assert "gpu cpu" in out and "triton " in out


def test_report_with_nothing_stored(dirs, capsys, monkeypatch):
    monkeypatch.chdir(dirs)
    assert cli.main(["tune", "--report"]) == 0
    assert "(no tuned configs)" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_tuning_on_a_cpu_exits_2(dirs, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--op", "w12.matmul", "--shapes", "hybrid-27b", "--trials", "4"])
    assert e.value.code == 2
    assert "specpilot tune: tuning w12.matmul needs a GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["tune"])
    assert e.value.code == 2 and "--op" in capsys.readouterr().err


# ---- tuning end to end through the command line, with a fake backend (no GPU) ----------------------

import json  # noqa: E402

import numpy as np  # noqa: E402

from specpilot import tuning  # noqa: E402


class FakeBackend:
    """A known cost surface over SplitConfig (best: block_n=64, num_stages=2, programs_per_sm=3.0), a check
    that fails for 8 warps, and A/B rounds with a chosen gain of the candidate."""

    device = None
    floor_device = "h200"

    def __init__(self, gain=0.08):
        self.gain, self.compiled, self.timed = gain, [], []

    def check(self, space):
        return lambda cfg, shape: cfg.num_warps != 8

    def timer(self, space):
        def timer(cfg, shape):
            self.timed.append(cfg)
            base = 20e-6 * (1 + 0.2 * abs(np.log2(cfg.block_n / 64)) + 0.1 * abs(cfg.num_stages - 2)
                            + 0.1 * abs(cfg.programs_per_sm - 3.0))
            return [base * (1 + 0.001 * i) for i in range(5)]
        return timer

    def ab(self, space):
        def ab(cur, cand, shape):
            r = np.random.default_rng(1)
            a = 30e-6 * np.exp(r.normal(0, 0.005, 60))
            return list(a), list(a / (1 + self.gain) * np.exp(r.normal(0, 0.005, 60)))
        return ab

    def precompile(self, space):
        return lambda cfgs, shape: self.compiled.extend(cfgs)


@pytest.fixture
def fake(monkeypatch):
    fb = FakeBackend()
    monkeypatch.setattr(tuning, "make_backend", lambda *a, **k: fb)
    return fb


def _tune(tmp_path, *extra, trials=14):
    return cli.main(["tune", "--op", "tree_attn.tree_attention", "--variant", "wgmma", "--trials", str(trials),
                     "--only", "B1-N32-*", "--out", str(tmp_path / "out"), "--no-progress", *extra])


def test_tune_end_to_end_promotes_and_stores_in_the_user_cache(dirs, fake, capsys):
    assert _tune(dirs, "--storage", f"sqlite:///{dirs / 'studies.db'}") == 0
    assert (dirs / "studies.db").stat().st_size > 0
    out = capsys.readouterr().out
    assert "| tree_attn.tree_attention | wgmma | B1-N32-L32k | D256-G6-N32 |" in out and "promoted" in out
    rec = json.loads((dirs / "out" / tuning.DECISIONS).read_text())["records"]
    (r,) = rec
    assert r["promoted"] and r["stored"] and r["stored_in"] == "user cache" and r["pruned"] >= 1
    assert r["decision"]["lower_bound"] > r["decision"]["threshold"] and r["decision"]["n"] == 60
    assert r["current"]["block_m"] == 64 and r["tuned"]["num_warps"] != 8
    assert r["after_over_floor"] < r["before_over_floor"]
    assert fake.compiled and fake.compiled[0] == tuning.current_config(
        __import__("tree_attn.space").space.WGMMA_SPACE, r["shape"])  # the heuristic compiles and runs first
    assert all(c.num_warps != 8 for c in fake.timed)  # a failed check is never timed
    user = json.loads((dirs / "cache" / "configs" / "cpu.json").read_text())["entries"]
    entry = user["tree_attn.tree_attention/wgmma/D256-G6-N32"]
    assert entry["_"]["promotion"]["promoted"] and entry["block_n"] == r["tuned"]["block_n"]
    assert not (dirs / "shipped" / "cpu.json").exists()
    md = (dirs / "out" / tuning.TABLE).read_text()
    assert "before µs" in md and "95% lower bound" in md and "->" in md


def test_tune_keeps_the_current_config_without_a_real_gain(dirs, fake, capsys):
    fake.gain = 0.0
    assert _tune(dirs, "--ship", trials=10) == 0
    (r,) = json.loads((dirs / "out" / tuning.DECISIONS).read_text())["records"]
    assert r["decision"] is not None and not r["promoted"] and not r["stored"]
    assert "kept current" in capsys.readouterr().out
    assert not (dirs / "shipped" / "cpu.json").exists() and not (dirs / "cache" / "configs" / "cpu.json").exists()


def test_tune_records_a_failing_shape_and_exits_1(dirs, fake, capsys, monkeypatch):
    monkeypatch.setattr(FakeBackend, "check", lambda self, space: lambda cfg, shape: False)
    assert _tune(dirs, trials=3) == 1
    (r,) = json.loads((dirs / "out" / tuning.DECISIONS).read_text())["records"]
    assert "no config of tree_attn.tree_attention/wgmma ran" in r["error"] and "check failed" in r["error"]
    assert "failed:" in capsys.readouterr().out


def test_tune_usage_errors(dirs, fake, capsys):
    for argv, msg in ((["--op", "nope"], "unknown --op"), (["--op", "w12.matmul", "--only", "zzz"], "matches --only"),
                      (["--op", "gdn.tree_verify", "--variant", "x"], "has no variant")):
        with pytest.raises(SystemExit) as e:
            cli.main(["tune", *argv])
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_report_writes_the_time_over_floor_png(dirs, capsys):
    autotune.store_tuned("w12.matmul", "tc", "K6144-M64-N5120", Cfg(128, 8),
                         extra={"over_floor": 1.3, "floor_s": 1e-5, "heuristic_over_floor": 1.6})
    assert cli.main(["tune", "--report", "--out", str(dirs / "rep")]) == 0
    assert (dirs / "rep" / "tuned-configs.png").stat().st_size > 1000
    assert "figure:" in capsys.readouterr().out


def test_named_shapes_of_hybrid_27b():
    names = [n for n, _ in tuning.named_shapes("w12.matmul", "hybrid-27b", "*-M64")]
    assert len(names) == 7 and "mlp.down_proj-M64" in names and "lm_head-M64" in names
    assert [n for n, _ in tuning.named_shapes("gdn.tree_verify", "hybrid-27b")] == ["B1-N32", "B1-N16", "B1-N8",
                                                                                       "B24-N8", "B1-N1"]
    assert [n for n, _ in tuning.named_shapes("tree_attn.tree_attention", "hybrid-27b")] == ["B1-N32-L32k",
                                                                                                "B1-N1-L4k"]


@pytest.mark.parametrize("op", sorted(tuning.OPS))
def test_tuning_problem_builds_on_the_cpu(op):
    """Each operator's tuning problem builds its inputs at the tiny shapes (its imports from the bench cases hold)."""
    name, shape = tuning.named_shapes(op, "tiny")[0]
    prob = tuning.OPS[op].problem(shape, torch.device("cpu"))
    assert type(prob).__name__.endswith("Problem"), (op, name)


def test_lookup_benchmark_runs_on_the_cpu(tmp_path):
    from specpilot.bench import lookup

    res = lookup.run("cpu", calls=2000, launches=40, repeats=1)
    what = {r["what"]: r for r in res["rows"]}
    assert what["PlanCache.get, cached key"]["unit"] == "ns/call" and what["PlanCache.get, cached key"]["value"] > 0
    assert "lookup's share of an eager call" in what and res["device"] == "cpu"
