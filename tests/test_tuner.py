"""autotune.tuner on the CPU: objective plumbing with a fake timer, pruning, SQLite resume, promotion, store."""

import json
from dataclasses import dataclass

import numpy as np
import optuna
import pytest

import autotune
from autotune import config as cfgmod
from autotune.tuner import SearchSpace, tune

optuna.logging.set_verbosity(optuna.logging.WARNING)

SHAPE = {"M": 8, "N": 4096, "K": 4096}
FLOOR = autotune.byte_floor(2 * 8 * 4096 * 4096, 4096 * 4096 * 2, "h200")


@dataclass(frozen=True)
class Cfg:
    block: int = 64
    warps: int = 4
    stages: int = 2

    def __post_init__(self):
        if self.stages == 5:
            raise ValueError("stages=5 is not a pipeline depth this kernel has")


def cost(c: Cfg) -> float:
    """A known cost surface: the minimum, 1.10 x the floor, is at block=128, warps=8, stages=3."""
    return FLOOR * (1.10 + 0.3 * abs(np.log2(c.block / 128)) + 0.2 * abs(np.log2(c.warps / 8)) + 0.1 * abs(c.stages - 3))


def fake_timer(calls=None):
    def timer(c, shape):
        if calls is not None:
            calls.append(c)
        r = np.random.default_rng(hash((c.block, c.warps, c.stages)) % 2**32)
        return list(cost(c) * np.exp(r.normal(0, 0.002, 9)))
    return timer


def space(**kw):
    base = dict(op="toy.matmul", variant="tc", params={"block": [32, 64, 128, 256], "warps": [2, 4, 8], "stages": [1, 2, 3, 4]},
                make_config=lambda p: Cfg(**p), flops_bytes=lambda s: (2 * s["M"] * s["N"] * s["K"], s["N"] * s["K"] * 2),
                heuristic=lambda s: Cfg())
    base.update(kw)
    return SearchSpace(**base)


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CONFIG_DIR", str(tmp_path / "configs"))
    cfgmod._TUNED.clear()
    yield tmp_path / "configs"
    cfgmod._TUNED.clear()


def test_objective_finds_the_best_of_a_known_surface(store_dir):
    calls = []
    (res,) = tune("toy.matmul", [SHAPE], space=space(), timer=fake_timer(calls), trials=48, floor_device="h200",
                  store=False)
    assert res.config == Cfg(128, 8, 3)
    assert res.over_floor == pytest.approx(1.10, rel=0.01)
    assert res.median_s == pytest.approx(1.10 * FLOOR, rel=0.01)
    assert res.heuristic_over_floor == pytest.approx(cost(Cfg()) / FLOOR, rel=0.01)
    assert calls[0] == Cfg()  # the heuristic is the first trial
    assert len(set(calls)) == len(calls)  # a choice is timed once
    assert res.key == "K4096-M8-N4096" and res.trials == 48 and not res.stored


def test_invalid_failing_and_raising_configs_are_pruned(store_dir):
    def valid(p, shape):
        return "smem: 256 x 4 stages over 227 KB" if p["block"] == 256 and p["stages"] == 4 else None

    def check(c, shape):
        if c.warps == 2 and c.block == 32:
            raise autotune.BuildError("autotune.jit: ptxas ran out of registers; lower the block")
        return c.block != 64 or c.warps != 4 or c.stages != 1

    def timer(c, shape):
        if c.block == 256 and c.warps == 8:
            raise autotune.BuildError("autotune.jit: no such kernel; skip it")
        return fake_timer()(c, shape)

    sp = space(params={"block": [32, 64, 256], "warps": [2, 4, 8], "stages": [1, 4, 5]}, valid=valid, check=check,
               heuristic=None)
    (res,) = tune("toy.matmul", [SHAPE], space=sp, timer=timer, trials=27, floor_device="h200", store=False,
                  storage=None, study_name="prune")
    # 16 of the 27 choices are pruned (stages=5, invalid, check raises or fails, timer raises); TPE draws some twice
    assert res.trials == 27 and res.pruned >= 5
    # the winner is none of the pruned kinds
    c = res.config
    assert c.stages != 5 and valid(vars(c), SHAPE) is None and check(c, SHAPE) and not (c.block == 256 and c.warps == 8)


def test_pruning_reasons_recorded_in_storage(store_dir, tmp_path):
    db = f"sqlite:///{tmp_path / 'prune.db'}"
    sp = space(params={"block": [64, 256], "warps": [4], "stages": [2, 5]}, heuristic=None,
               valid=lambda p, s: "block 256 does not divide N" if p["block"] == 256 else None)
    tune("toy.matmul", [SHAPE], space=sp, timer=fake_timer(), trials=12, floor_device="h200", store=False,
         storage=db, study_name="p")
    study = optuna.load_study(study_name="p/tc/K4096-M8-N4096", storage=db)
    reasons = {t.user_attrs.get("pruned") for t in study.trials if t.state == optuna.trial.TrialState.PRUNED}
    assert "invalid: block 256 does not divide N" in reasons
    assert any(r and r.startswith("config: stages=5") for r in reasons)
    assert study.best_trial.params == {"block": 64, "warps": 4, "stages": 2}


def test_nothing_runs_raises(store_dir):
    sp = space(valid=lambda p, s: "never", heuristic=None)
    with pytest.raises(RuntimeError, match=r"autotune.tune: no config of toy.matmul/tc .*invalid: never"):
        tune("toy.matmul", [SHAPE], space=sp, timer=fake_timer(), trials=3, floor_device="h200", store=False)
    with pytest.raises(ValueError, match=r"autotune.tune: the space declares op"):
        tune("other.op", [SHAPE], space=sp, timer=fake_timer(), floor_device="h200")


def test_sqlite_persistence_and_resume(store_dir, tmp_path):
    db = f"sqlite:///{tmp_path / 'studies.db'}"
    calls = []
    kw = dict(space=space(), timer=fake_timer(calls), floor_device="h200", store=False, storage=db, study_name="s")
    (a,) = tune("toy.matmul", [SHAPE], trials=5, **kw)
    assert a.trials == 5 and 1 <= len(calls) <= 5
    n_first = len(calls)
    (b,) = tune("toy.matmul", [SHAPE], trials=5, **kw)  # resumed: already 5 trials, nothing new runs
    assert len(calls) == n_first and b.trials == 5 and b.config == a.config
    (c,) = tune("toy.matmul", [SHAPE], trials=12, **kw)  # resumed: 7 more
    assert c.trials == 12 and c.over_floor <= a.over_floor and len(calls) > n_first
    study = optuna.load_study(study_name="s/tc/K4096-M8-N4096", storage=db)
    assert len(study.trials) == 12 and study.trials[0].params == {"block": 64, "warps": 4, "stages": 2}


def test_store_receives_the_winner_with_metadata(store_dir):
    (res,) = tune("toy.matmul", [SHAPE], space=space(), timer=fake_timer(), trials=40, floor_device="h200")
    assert res.stored
    data = json.loads((store_dir / "cpu.json").read_text())
    entry = data["entries"]["toy.matmul/tc/K4096-M8-N4096"]
    assert {k: entry[k] for k in ("block", "warps", "stages")} == {"block": 128, "warps": 8, "stages": 3}
    meta = entry["_"]
    assert meta["over_floor"] == pytest.approx(1.10, rel=0.01) and meta["floor_s"] == pytest.approx(FLOOR)
    assert meta["study"] == "toy.matmul/tc/K4096-M8-N4096" and meta["trials"] == 40 and meta["promotion"] is None
    assert set(data["meta"]) >= {"gpu", "torch", "triton", "cuda", "specpilot"}


def _ab(gain):
    def ab(current, candidate, shape):
        r = np.random.default_rng(5)
        a = 1e-4 * np.exp(r.normal(0, 0.01, 60))
        return a, a / (1 + gain) * np.exp(r.normal(0, 0.01, 60))
    return ab


def test_promotion_rule_gates_the_store(store_dir):
    sp = space(params={"block": [64, 128], "warps": [4, 8], "stages": [2, 3]})
    (res,) = tune("toy.matmul", [SHAPE], space=sp, timer=fake_timer(), trials=8, floor_device="h200", ab=_ab(0.0))
    assert res.decision is not None and not res.decision.promoted and not res.stored
    assert not (store_dir / "cpu.json").exists()
    (res,) = tune("toy.matmul", [SHAPE], space=sp, timer=fake_timer(), trials=8, floor_device="h200", ab=_ab(0.08))
    assert res.decision.promoted and res.stored
    meta = json.loads((store_dir / "cpu.json").read_text())["entries"]["toy.matmul/tc/K4096-M8-N4096"]["_"]
    assert meta["promotion"]["promoted"] is True and meta["promotion"]["lower_bound"] > meta["promotion"]["threshold"]
    assert res.to_dict()["decision"]["gain"] == pytest.approx(0.08, abs=0.01)


def test_precompile_hook_gets_the_valid_configs(store_dir):
    seen = []
    sp = space(params={"block": [64, 128], "warps": [4], "stages": [2, 5]})
    tune("toy.matmul", [SHAPE], space=sp, timer=fake_timer(), trials=2, floor_device="h200", store=False,
         precompile=lambda cfgs, shape: seen.append((cfgs, shape)))
    assert seen == [([Cfg(64, 4, 2), Cfg(128, 4, 2)], SHAPE)]
