"""W12Linear and convert(): in-place conversion of plain and HF transformers models (built offline)."""

import importlib.util
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import w12
from specpilot.testing import assert_bitwise_equal


@pytest.fixture
def exact_ops(monkeypatch):
    """Stand-in `w12.ops` whose matmul is F.linear on the exact unpacked weight, so a converted
    model must reproduce the original bit for bit (this tests conversion, not the kernels)."""
    fake = types.ModuleType("w12.ops")
    fake.matmul = lambda x, w, bias=None: F.linear(x, w.unpack(), bias)
    monkeypatch.setitem(sys.modules, "w12.ops", fake)
    return fake


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(75, 63), nn.GELU(), nn.Linear(63, 33, bias=False)).to(torch.bfloat16)


def test_from_linear_and_forward(exact_ops):
    torch.manual_seed(0)
    lin = nn.Linear(75, 63).to(torch.bfloat16)
    wl = w12.W12Linear.from_linear(lin)
    assert (wl.in_features, wl.out_features) == (75, 63)
    assert_bitwise_equal(wl.weight.unpack(), lin.weight.detach())
    x = torch.randn(4, 75).bfloat16()
    assert_bitwise_equal(wl(x), lin(x).detach())
    assert "bits_per_weight" in repr(wl)


def test_from_linear_rejects_non_bf16():
    with pytest.raises(TypeError, match=r"\.to\(torch\.bfloat16\)"):
        w12.W12Linear.from_linear(nn.Linear(4, 4))


def test_buffers_follow_module(exact_ops):
    wl = w12.W12Linear.from_linear(nn.Linear(64, 8).to(torch.bfloat16))
    names = {n for n, _ in wl.named_buffers()}
    assert names == {f"w_{p}" for p in w12.format.PLANES}
    before = wl.weight
    wl.to(torch.float16)  # casts leave the integer planes alone; bias follows
    assert wl.w_hi.dtype == torch.uint8 and wl.bias.dtype == torch.float16
    sd = wl.state_dict()
    assert set(sd) == names | {"bias"}
    wl2 = w12.W12Linear.from_linear(nn.Linear(64, 8).to(torch.bfloat16))
    if wl2.w_esc_col.shape == wl.w_esc_col.shape:
        wl2.load_state_dict(sd)
        assert_bitwise_equal(wl2.weight.unpack(), before.unpack())


def test_convert_mlp(exact_ops):
    model = _mlp()
    x = torch.randn(3, 75).bfloat16()
    want = model(x).detach()
    report = w12.convert(model)
    assert isinstance(model[0], w12.W12Linear) and isinstance(model[2], w12.W12Linear)
    assert report.num_converted == 2 and not report.skipped
    assert report.bytes_before == 2 * (63 * 75 + 33 * 63)
    assert report.bytes_after == model[0].weight.nbytes + model[2].weight.nbytes
    assert report.bits_per_weight == pytest.approx(8 * report.bytes_after / (63 * 75 + 33 * 63))
    assert_bitwise_equal(model(x), want)
    s = str(report)
    assert "2 linear layers converted" in s and "bits per weight" in s


def test_convert_skips_and_patterns():
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "a": nn.Linear(8, 8).to(torch.bfloat16),
        "b": nn.Linear(8, 8),  # fp32: skipped
        "c": nn.Linear(8, 8).to(torch.bfloat16),
        "d": nn.Linear(8, 8).to(torch.bfloat16),
    })
    model["d"].weight = model["a"].weight  # tied
    report = w12.convert(model, include=["a", "b", "c*", "d"], exclude="c")
    assert [r.name for r in report.converted] == []
    reasons = dict(report.skipped)
    assert "float32" in reasons["b"] and "tied to" in reasons["a"] and "tied to" in reasons["d"]
    assert "c" not in reasons  # excluded silently
    model["d"].weight = nn.Parameter(model["a"].weight.detach().clone())
    report = w12.convert(model, exclude="c")
    assert sorted(r.name for r in report.converted) == ["a", "d"]
    assert isinstance(model["c"], nn.Linear) and isinstance(model["b"], nn.Linear)
    assert "skipped b: weight is torch.float32" in str(report)
    with pytest.raises(TypeError, match="nn.Module"):
        w12.convert(object())


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


@pytest.mark.slow
def test_convert_hf_llama(exact_ops):
    model = _tiny_llama()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    report = w12.convert(model, exclude="lm_head")
    assert report.num_converted == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert all(r.name.startswith("model.layers.") for r in report.converted)
    assert isinstance(model.model.layers[1].mlp.down_proj, w12.W12Linear)
    assert isinstance(model.lm_head, nn.Linear)
    with torch.no_grad():
        got = model(ids).logits
    assert_bitwise_equal(got, want)
    assert 12.0 < report.bits_per_weight < 16.0  # K = 96 pads to 128 in down_proj


def test_convert_hf_tied_lm_head():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    report = w12.convert(model, include="lm_head")
    assert report.num_converted == 0 and "tied to" in dict(report.skipped)["lm_head"]


@pytest.mark.skipif(importlib.util.find_spec("w12.ops") is None, reason="w12/ops.py not written yet")
def test_w12linear_real_ops_small():
    from specpilot.testing import assert_close

    torch.manual_seed(0)
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    wl = w12.W12Linear.from_linear(lin)
    x = torch.randn(2, 64).bfloat16()
    ref = w12.matmul_reference(x, wl.weight, wl.bias)
    assert_close(wl(x), ref, lin(x).detach())
