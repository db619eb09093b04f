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
    wl2 = w12.W12Linear.from_linear(nn.Linear(64, 8).to(torch.bfloat16)).to(torch.float16)
    wl2.load_state_dict(sd)
    assert_bitwise_equal(wl2.weight.unpack(), before.unpack())


def _escape_heavy_mlp(seed, n_escapes):
    """A converted MLP whose first layer has `n_escapes` escapes (so two of them differ in escape count)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(75, 63), nn.GELU(), nn.Linear(63, 33, bias=False)).to(torch.bfloat16)
    special = torch.tensor([1e30, -1e-30, float("inf"), float("nan"), -3e20, 0.0, -0.0], dtype=torch.bfloat16)
    with torch.no_grad():
        model[0].weight.view(-1)[: n_escapes] = special.repeat(n_escapes // len(special) + 1)[:n_escapes] * 1
    w12.convert(model)
    return model


@pytest.mark.parametrize("n_src, n_dst", [(40, 0), (0, 40), (7, 300)], ids=["more-escapes", "fewer", "many"])
def test_state_dict_round_trip_between_converted_models(exact_ops, n_src, n_dst):
    src, dst = _escape_heavy_mlp(0, n_src), _escape_heavy_mlp(1, n_dst)
    assert src[0].weight.num_escapes != dst[0].weight.num_escapes
    x = torch.randn(3, 75).bfloat16()
    want = src(x)
    result = dst.load_state_dict(src.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    for a, b in ((src[0], dst[0]), (src[2], dst[2])):
        assert_bitwise_equal(b.weight.unpack(), a.weight.unpack())
        assert b.weight.num_escapes == a.weight.num_escapes
    assert_bitwise_equal(dst(x), want)
    # torch.save / torch.load(weights_only=True) of the state dict goes the same way
    import io

    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst2 = _escape_heavy_mlp(2, n_dst)
    dst2.load_state_dict(torch.load(buf, weights_only=True))
    assert_bitwise_equal(dst2(x), want)


def test_load_state_dict_rejects_bad_planes(exact_ops):
    src, dst = _escape_heavy_mlp(0, 10), _escape_heavy_mlp(1, 0)
    sd = src.state_dict()
    bad = dict(sd)
    bad["0.w_esc_col"] = sd["0.w_esc_col"][:-1].clone()  # no longer matches esc_val / esc_rowptr
    with pytest.raises(RuntimeError, match="esc_col .* and esc_val .* must be 1-D of equal length"):
        dst.load_state_dict(bad)
    bad = dict(sd)
    bad["0.w_esc_col"] = sd["0.w_esc_col"].flip(0).contiguous()  # columns out of order
    bad["0.w_esc_col"][0] = 1000
    with pytest.raises(RuntimeError, match=r"0 is invalid after loading: esc_col\[0\] = 1000 is outside"):
        dst.load_state_dict(bad)
    bad = dict(sd)
    bad["0.w_hi"] = torch.zeros(63, 64, dtype=torch.uint8)  # K padded to 64, not 128
    with pytest.raises(RuntimeError, match="size mismatch for 0.w_hi"):
        dst.load_state_dict(bad)
    partial = {k: v for k, v in sd.items() if k != "0.w_esc_val"}
    with pytest.raises(RuntimeError, match=r"planes \['0.w_esc_val'\] are missing"):
        dst.load_state_dict(partial, strict=False)


def test_empty_shell_loads_on_meta(exact_ops):
    src = _escape_heavy_mlp(0, 9)
    with torch.device("meta"):
        shell = nn.Sequential(w12.W12Linear.empty(75, 63), nn.GELU(), w12.W12Linear.empty(63, 33, bias=False))
    assert shell[0].w_hi.is_meta and shell[0].w_esc_col.shape == (0,)
    shell.load_state_dict(src.state_dict(), assign=True)
    x = torch.randn(2, 75).bfloat16()
    assert_bitwise_equal(shell(x), src(x))


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
