"""The plugin entry point: registered under `sglang.srt.plugins`, loaded by SGLang's own `load_plugins`, one switch
per feature, and a self-check whose failure is logged at ERROR."""

from __future__ import annotations

import logging
import subprocess
import sys
from importlib.metadata import entry_points

from pathlib import Path

import pytest

TINY = Path(__file__).resolve().parents[1] / "specpilot" / "models" / "tiny_stdlib"


def test_entry_point_is_registered():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "specpilot"]
    assert len(eps) == 1, "pip install -e . registers the entry point from pyproject.toml"
    from specpilot.sglang.plugin import register

    assert eps[0].load() is register


_LOAD = """
import logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.layers.quantization import QUANTIZATION_METHODS
from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES
from sglang.srt.plugins.hook_registry import HookRegistry
from specpilot.sglang.plugin import STATUS
print("STATUS", sorted(STATUS.items()))
print("W12", "w12" in QUANTIZATION_METHODS, "w12" in QUANTIZATION_CHOICES)
print("HEAD_HOOK", "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head" in HookRegistry._patched)
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
print("TREE", "specpilot_tree" in ATTENTION_BACKENDS, "specpilot_tree" in ATTENTION_BACKEND_CHOICES)
print("GDN_HOOKS", [t for t in HookRegistry._patched if "gdn_backend" in t or "update_mamba_state" in t])
if "w12" in QUANTIZATION_CHOICES:  # the launch_server command line, parsed after load_plugins() as SGLang does
    from sglang.srt.server_args import prepare_server_args
    sa = prepare_server_args(["--model-path", sys.argv[1], "--quantization", "w12", "--device", "cpu"])
    print("CLI", sa.quantization)
if "specpilot_tree" in ATTENTION_BACKEND_CHOICES:
    from sglang.srt.server_args import prepare_server_args
    sa = prepare_server_args(["--model-path", sys.argv[1], "--attention-backend", "specpilot_tree", "--device", "cpu"])
    print("CLI_TREE", sa.attention_backend)
"""


def _load(env):
    import os

    e = dict(os.environ)
    e["SPECPILOT_SGLANG_GDN"] = ""  # the suite's fixture turns it on in this process only (its test stand-ins)
    e.update(env)
    r = subprocess.run([sys.executable, "-c", _LOAD, str(TINY)], capture_output=True, text=True, env=e, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_sglang_load_plugins_runs_it():
    """SGLang's own loader, with SGLANG_PLUGINS naming the plugin: all four features on."""
    out = _load({"SGLANG_PLUGINS": "specpilot", "SPECPILOT_SGLANG_HEAD": "1", "SPECPILOT_SGLANG_TREE_ATTN": "1"})
    assert "Executed general plugin: specpilot" in out
    assert "self-check passed" in out
    assert ("STATUS [('certified_head', 'ok'), ('gdn', 'off'), ('tree_attn', 'ok'), ('w12', 'ok'), "
            "('w12_checkpoint', 'ok')]" in out)
    assert "W12 True True" in out and "HEAD_HOOK True" in out and "TREE True True" in out
    assert "CLI w12" in out and "CLI_TREE specpilot_tree" in out


def test_switches_turn_features_off():
    out = _load({"SGLANG_PLUGINS": "specpilot", "SPECPILOT_SGLANG_W12": "0", "SPECPILOT_SGLANG_HEAD": "0",
                 "SPECPILOT_SGLANG_TREE_ATTN": "0"})
    assert ("STATUS [('certified_head', 'off'), ('gdn', 'off'), ('tree_attn', 'off'), ('w12', 'off'), "
            "('w12_checkpoint', 'ok')]" in out)
    assert "W12 False False" in out and "HEAD_HOOK False" in out
    assert "TREE False False" in out  # SGLang's backend registry and --attention-backend choices untouched


def test_tree_attn_is_off_by_default():
    e = {"SGLANG_PLUGINS": "specpilot"}
    import os

    if "SPECPILOT_SGLANG_TREE_ATTN" in os.environ:  # the suite's fixture turns it on in this process only
        e["SPECPILOT_SGLANG_TREE_ATTN"] = ""
    out = _load(e)
    assert "('tree_attn', 'off')" in out and "TREE False False" in out and "CLI_TREE" not in out
    assert "('gdn', 'off')" in out and "GDN_HOOKS []" in out  # SGLang's GDN backend is not hooked


def test_other_plugin_names_leave_it_out():
    out = _load({"SGLANG_PLUGINS": "someone_else"})
    assert "Skipping plugin specpilot" in out
    assert "STATUS []" in out


def test_failed_self_check_is_loud(monkeypatch, caplog):
    from specpilot.sglang import plugin

    def broken():
        raise RuntimeError("w12.matmul differs")

    feats = [(f, env, reg, broken if f == "w12" else chk) for f, env, reg, chk in plugin._FEATURES]
    monkeypatch.setattr(plugin, "_FEATURES", tuple(feats))
    monkeypatch.setenv("SPECPILOT_SGLANG_HEAD", "0")
    with caplog.at_level(logging.WARNING, logger="specpilot.sglang"):
        status = plugin.register()
    assert status["w12"].startswith("failed: RuntimeError: w12.matmul differs")
    assert any(r.levelno == logging.ERROR and "SELF-CHECK FAILED" in r.getMessage() for r in caplog.records)


def test_bad_switch_value(monkeypatch):
    from specpilot.sglang import plugin

    monkeypatch.setenv("SPECPILOT_SGLANG_W12", "maybe")
    with pytest.raises(ValueError, match="set it to 1 or 0"):
        plugin.switch("SPECPILOT_SGLANG_W12")
