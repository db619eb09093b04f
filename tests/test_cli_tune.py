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


def test_report_prints_entries_and_metadata(dirs, capsys):
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


def test_report_with_nothing_stored(dirs, capsys):
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
