"""The node-budget benchmark (specpilot.bench.budgets): batched decoding at fixed budgets and at budget="auto", every
run's outputs checked against the autoregressive batch steps (budget 0). On the CPU the full-size model's path runs
at tiny shapes (--dry); on the GPU the shipped tiny model, every step a CUDA graph."""

import json

import pytest
import torch

from specpilot.bench import budgets


def _check(res: dict, want):
    assert [r["budget"] for r in res["runs"]] == want
    for r in res["runs"]:
        assert r["identical"], f"budget {r['budget']}: outputs differ from budget 0"
        assert r["steps"] > 0 and 0 < r["tokens"] <= res["prompts"] * res["tokens"]
        assert r["tokens_per_s"] > 0 and r["mean_step_ms"] > 0 and r["setup_s"] >= 0
    auto = [r for r in res["runs"] if r["budget"] == "auto"]
    for r in auto:
        assert "0" in r["costs_ms"] and all(v > 0 for v in r["costs_ms"].values())
        assert sum(r["steps_by_budget"].values()) == r["steps"]
        assert set(r["steps_by_budget"]) <= set(r["costs_ms"])


def test_budgets_dry_run_writes_its_json_and_table_cpu(tmp_path):
    argv = ["--dry", "--rows", "3", "--prompts", "4", "--tokens", "12", "--budgets", "6,auto", "--out", str(tmp_path)]
    assert budgets.main(argv) == 0
    (js,), (md,) = tmp_path.glob("*-budgets.json"), tmp_path.glob("*-budgets.md")
    res = json.loads(js.read_text())
    assert res["dry"] and res["device"] == "cpu" and (res["rows"], res["prompts"], res["tokens"]) == (3, 4, 12)
    _check(res, [0, 6, "auto"])  # budget 0 runs first, as the reference
    text = md.read_text()
    assert "| auto |" in text and "steps per budget taken" in text and "not figures of anything" in text


def test_budgets_arguments_cpu():
    with pytest.raises(SystemExit):
        budgets.main(["--dry", "--budgets", "8,fast"])
    with pytest.raises(SystemExit):
        budgets.main(["--dry", "--budgets", "-8"])
    with pytest.raises(SystemExit):
        budgets.main(["--dry", "--rows", "0"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_budgets_tiny_model_gpu():
    res = budgets.run("tiny", "w12", rows=4, prompts=6, tokens=48, budgets=(0, 16, "auto"), device="cuda")
    _check(res, [0, 16, "auto"])
    assert res["runs"][1]["tokens_per_step"] > res["runs"][0]["tokens_per_step"]  # drafts land on the trained model
