"""specpilot.bench.blas_forms on the CPU: every call form computes the same product (within a bf16 rounding of the
fp64 one), a form's cuBLAS setting is restored after it, one-row forms refuse more rows, the table, and the refusal
to run without a GPU."""

from __future__ import annotations

import pytest
import torch

from specpilot.bench import blas_forms


@pytest.mark.parametrize("m", [1, 3])
def test_every_form_computes_the_product(m):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(48, 64, generator=g) * 0.1).to(torch.bfloat16)
    ref = x.double() @ w.double().T
    bias0 = torch.zeros(48, dtype=torch.bfloat16)
    forms = blas_forms.forms_for(m)
    assert ("mv_out" in forms) == (m == 1) and set(forms) <= set(blas_forms.FORMS)
    for form in forms:
        out = torch.full((m, 48), float("nan"), dtype=torch.bfloat16)
        got = blas_forms.call(form, x, w, out, bias0)
        assert got.data_ptr() == out.data_ptr(), form
        assert torch.allclose(got.double(), ref, rtol=2 ** -7, atol=1e-3), form
    with pytest.raises(ValueError, match="one row"):
        blas_forms.call("mv_out", torch.zeros(2, 64, dtype=torch.bfloat16), w, torch.empty(2, 48), bias0)
    with pytest.raises(ValueError, match="unknown form"):
        blas_forms.call("gemv", x, w, torch.empty(m, 48), bias0)


def test_settings_are_restored():
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    with blas_forms._setting("mm_out_noreduce"):
        assert matmul.allow_bf16_reduced_precision_reduction is False
    assert matmul.allow_bf16_reduced_precision_reduction == before


def test_table_and_no_gpu(monkeypatch, capsys):
    report = {"cells": [{"layer": "mlp.down_proj", "M": 1, "forms": {"mm_out": {
        "us": 50.0, "gemm_us": 47.5, "memset": True, "kernels": ["Memset (Device)", "nvjet_sm90_tst_splitK(x)"]}}}]}
    text = blas_forms.table(report)
    assert "| mlp.down_proj | 1 | mm_out | 50.00 | 47.50 | yes | Memset, nvjet_sm90_tst_splitK |" in text
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert blas_forms.main(["--layers", "mlp.down_proj"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err
