"""The deployment benchmark (specpilot.bench.deploy): the batch verify steps as CUDA graphs at several node budgets
beside the B-row autoregressive step, and the two-level verification's Q pass at one request. On the CPU the whole
script runs at tiny shapes (--dry: the graphs' bodies eagerly); on the GPU at small budgets, every step a graph."""

import json

import pytest
import torch

from specpilot.bench import deploy


def _check(res: dict, batches, budgets, formats=("bf16", "w12")):
    assert list(res["formats"]) == list(formats)
    for fmt in formats:
        e = res["formats"][fmt]
        assert e["weight_bytes"] > 0 and e["params"] > 0 and e["kv_bytes_per_request"] > 0
        steps = e["steps"]
        assert [(r["batch"], r["budget"]) for r in steps] == [(B, n) for B in batches for n in (0,) + budgets]
        for r in steps:
            assert r["rows"] == r["batch"] + r["budget"]
            assert r["draft_nodes"] <= r["budget"] and r["ms"] > 0 and r["p10_ms"] <= r["p90_ms"]
            assert r["ms_per_request"] == pytest.approx(r["ms"] / r["batch"])
            if r["budget"]:
                assert set(r["implied"]) == {"2", "4", "6"} and r["draft_nodes"] > 0
            else:
                assert r["over_ar"] == 1.0 and r["tokens_per_s"] > 0
        one = e["one_request"]
        assert one["exact_rows"] == res["nodes"] and one["exact_ms"] > 0
        assert ("q_pass_ms" in one) == (fmt == "w12") and "q_pass_error" not in one
    q = res["q_pass"]
    assert q["ms"] > 0 and q["over_w12_exact"] > 0 and q["over_bf16_exact"] > 0


def test_deploy_dry_run_writes_its_json_and_table_cpu(tmp_path):
    assert deploy.main(["--dry", "--out", str(tmp_path)]) == 0
    (js,), (md,) = tmp_path.glob("*-deploy.json"), tmp_path.glob("*-deploy.md")
    res = json.loads(js.read_text())
    assert res["dry"] and res["device"] == "cpu" and not res["fused_glue"]
    assert (res["shapes"], res["prefix"], res["nodes"]) == ("tiny", deploy.DRY["prefix"], deploy.DRY["nodes"])
    _check(res, deploy.DRY["batches"], deploy.DRY["budgets"])
    text = md.read_text()
    assert text == deploy.markdown(res)
    assert "CPU dry run" in text and "| w12 | 3 | 8 | 11 |" in text and "| bf16 | 2 | AR | 2 |" in text
    assert text.count("\n| bf16 |") == 2 * 3 + 1 and "BF16 exact step" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without CUDA")
def test_deploy_needs_cuda_or_dry(capsys):
    assert deploy.main([]) == 2
    assert "--dry" in capsys.readouterr().out


@pytest.mark.gpu
def test_deploy_runs_gpu(tmp_path):
    # small shapes and budgets, every step a captured graph timed under CUDA events, beside its byte floor
    res = deploy.run(shapes="tiny", overrides=deploy.DRY["overrides"], prefix=128, batches=(2, 4), budgets=(8, 16),
                     nodes=8, positions=4, reps=5, out=tmp_path)
    assert not res["dry"] and res["fused_glue"] and res["gpu"]
    _check(res, (2, 4), (8, 16))
    for e in res["formats"].values():
        assert all(r["method"] == "cuda_events" and r["floor_ms"] > 0 for r in e["steps"])
    assert len(list(tmp_path.glob("*-deploy.json"))) == len(list(tmp_path.glob("*-deploy.md"))) == 1


def test_deploy_dry_run_profiles_one_step_cpu(tmp_path):
    # --profile B,BUDGET: each format's operators of one step, the largest first, in the JSON and the table
    assert deploy.main(["--dry", "--batches", "2", "--budgets", "4", "--profile", "3,4", "--out", str(tmp_path)]) == 0
    (js,), (md,) = tmp_path.glob("*-deploy.json"), tmp_path.glob("*-deploy.md")
    res = json.loads(js.read_text())
    for fmt in ("bf16", "w12"):
        pr = res["formats"][fmt]["profile"]
        assert (pr["batch"], pr["budget"], pr["rows"]) == (3, 4, 7) and pr["total_ms"] > 0
        ms = [k["ms"] for k in pr["kernels"]]
        assert ms == sorted(ms, reverse=True) and all(k["calls"] >= 1 for k in pr["kernels"])
    assert "under torch.profiler" in md.read_text()
    with pytest.raises(SystemExit):
        deploy.main(["--dry", "--profile", "8"])
