"""The `w12` LinearMethodBase through SGLang's real parallel linears (tensor-parallel size 1, gloo): the weights
are loaded with the layers' own weight loaders, packed and verified after loading; outputs equal F.linear over
the unpacked weights, bit for bit (on the CPU `w12.matmul` decodes and runs F.linear in fp32, one rounding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import w12

from specpilot.sglang import sharding


def _w(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)
    # a few values outside any 16-exponent window, so that rows carry escapes
    w.view(-1)[:: 97] = torch.tensor([3.0e4, -1.0e-30, float("inf"), 0.0], dtype=torch.bfloat16).repeat(
        w.numel() // 97 // 4 + 1)[: w.view(-1)[::97].numel()]
    return w


def _x(M, K, seed=7):
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _expected(x, w, b=None):
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)


def _finish(layer):
    from specpilot.sglang.quant import W12LinearMethod, packed_weight

    assert isinstance(layer.quant_method, W12LinearMethod)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.numel() == 0  # the BF16 copy is released
    return packed_weight(layer)


def _out(res):
    return res[0] if isinstance(res, tuple) else res


@pytest.mark.parametrize("M", [1, 5])
def test_column_parallel(sglang_tp1, M):
    from sglang.srt.layers.linear import ColumnParallelLinear

    from specpilot.sglang.quant import W12Config

    K, N = 96, 40
    layer = ColumnParallelLinear(K, N, bias=True, quant_config=W12Config(), prefix="col", params_dtype=torch.bfloat16)
    w, b = _w(N, K, seed=1), torch.randn(N).to(torch.bfloat16)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.data.copy_(b)
    p = _finish(layer)
    assert torch.equal(w12.unpack(p).view(torch.int16), w.view(torch.int16))
    assert p.num_escapes > 0
    x = _x(M, K)
    y = _out(layer(x))
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, _expected(x, w, b))


def test_row_parallel(sglang_tp1):
    from sglang.srt.layers.linear import RowParallelLinear

    from specpilot.sglang.quant import W12Config

    K, N = 130, 24  # K not a multiple of 64: the planes would pad each row to 192 columns
    layer = RowParallelLinear(K, N, bias=False, quant_config=W12Config(), prefix="row", params_dtype=torch.bfloat16)
    w = _w(N, K, seed=2)
    layer.weight.weight_loader(layer.weight, w)
    p = _finish(layer)
    assert torch.equal(w12.unpack(p).view(torch.int16), w.view(torch.int16))
    # the runtime layout, unpadded: 12 bits a weight plus each row's window, tail nibble and escapes
    planes = w12.pack(w, layout="planes")
    assert layer.w12_bits_per_weight == p.bits_per_weight < planes.bits_per_weight
    assert p.bits_per_weight <= 12.5 + 48 * p.num_escapes / (N * K)
    x = _x(3, K)
    assert torch.equal(_out(layer(x)), _expected(x, w))


def test_layer_keeps_its_runtime_layout_object(sglang_tp1):
    """The flow kernel keeps launch state on the `TiledW12` (programmatic dependent launch after a launch on the same
    weight), so the layer hands out one object while its buffers are the same tensors, and a new one over new
    buffers (a module moved with .to(), or buffers replaced)."""
    from sglang.srt.layers.linear import ColumnParallelLinear

    from specpilot.sglang.quant import W12Config, packed_weight

    layer = ColumnParallelLinear(64, 32, bias=False, quant_config=W12Config(), prefix="keep",
                                 params_dtype=torch.bfloat16)
    w = _w(32, 64, seed=3)
    layer.weight.weight_loader(layer.weight, w)
    p = _finish(layer)
    x = _x(2, 64)
    assert torch.equal(_out(layer(x)), _expected(x, w))
    assert packed_weight(layer) is p
    layer.w12_tiles = layer.w12_tiles.clone()  # a buffer replaced, as Module.to / _apply does
    q = packed_weight(layer)
    assert q is not p and q.tiles is layer.w12_tiles
    assert torch.equal(_out(layer(x)), _expected(x, w))


def test_merged_column_parallel(sglang_tp1):
    from sglang.srt.layers.linear import MergedColumnParallelLinear

    from specpilot.sglang.quant import W12Config

    K, sizes = 64, [24, 40]  # gate, up
    layer = MergedColumnParallelLinear(K, sizes, bias=False, quant_config=W12Config(), prefix="gate_up",
                                       params_dtype=torch.bfloat16)
    parts = [_w(n, K, seed=10 + i) for i, n in enumerate(sizes)]
    for i, wi in enumerate(parts):
        layer.weight.weight_loader(layer.weight, wi, i)
    assert layer.w12_partition_sizes == sizes
    p = _finish(layer)
    full = torch.cat(parts)
    assert torch.equal(w12.unpack(p).view(torch.int16), full.view(torch.int16))
    # per-row windows: the merged packing is the parts' packings stacked, and splits back into them exactly (the
    # layer holds the runtime layout; its planes are the version-1 form sharding cuts)
    assert isinstance(p, w12.layout.TiledW12)
    for q, wi in zip(sharding.split_n(w12.layout.untile(p), layer.w12_partition_sizes), parts):
        ref = w12.pack(wi, layout="planes")
        for name in ("hi", "lo", "e0", "esc_rowptr", "esc_col", "esc_val"):
            assert torch.equal(getattr(q, name), getattr(ref, name)), name
    x = _x(4, K)
    assert torch.equal(_out(layer(x)), _expected(x, full))


def test_qkv_parallel(sglang_tp1):
    from sglang.srt.layers.linear import QKVParallelLinear

    from specpilot.sglang.quant import W12Config

    H, D, heads, kv = 128, 32, 4, 2
    layer = QKVParallelLinear(H, D, heads, kv, bias=True, quant_config=W12Config(), prefix="qkv",
                              params_dtype=torch.bfloat16)
    q, k, v = _w(heads * D, H, seed=20), _w(kv * D, H, seed=21), _w(kv * D, H, seed=22)
    bq, bk, bv = (torch.randn(n).to(torch.bfloat16) for n in (heads * D, kv * D, kv * D))
    for sid, wi, bi in (("q", q, bq), ("k", k, bk), ("v", v, bv)):
        layer.weight.weight_loader(layer.weight, wi, sid)
        layer.bias.weight_loader(layer.bias, bi, sid)
    assert layer.w12_partition_sizes == [heads * D, kv * D, kv * D]
    p = _finish(layer)
    full = torch.cat([q, k, v])
    assert torch.equal(w12.unpack(p).view(torch.int16), full.view(torch.int16))
    x = _x(2, H)
    assert torch.equal(_out(layer(x)), _expected(x, full, torch.cat([bq, bk, bv])))


def test_excluded_layer_stays_bf16(sglang_tp1):
    from sglang.srt.layers.linear import ColumnParallelLinear
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    from specpilot.sglang.quant import W12Config

    cfg = W12Config(exclude=["*.keep"])
    layer = ColumnParallelLinear(64, 8, bias=False, quant_config=cfg, prefix="model.keep", params_dtype=torch.bfloat16)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    emb = VocabParallelEmbedding(256, 64, quant_config=cfg, prefix="embed_tokens", params_dtype=torch.bfloat16)
    head = ParallelLMHead(256, 64, quant_config=cfg, prefix="lm_head", params_dtype=torch.bfloat16)
    for m in (emb, head):
        assert type(m.quant_method).__name__ == "UnquantizedEmbeddingMethod"


def test_exclude_from_the_environment(sglang_tp1, monkeypatch):
    from sglang.srt.layers.linear import ColumnParallelLinear
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    from specpilot.sglang.quant import W12Config, W12LinearMethod

    monkeypatch.setenv("SPECPILOT_SGLANG_W12_EXCLUDE", "*.down_proj, model.layers.0.*")
    cfg = W12Config()  # as SGLang builds it: no arguments
    for prefix, kept in (("model.layers.3.mlp.down_proj", True), ("model.layers.0.mlp.gate_up_proj", True),
                         ("model.layers.1.mlp.gate_up_proj", False)):
        layer = ColumnParallelLinear(64, 8, bias=False, quant_config=cfg, prefix=prefix, params_dtype=torch.bfloat16)
        assert isinstance(layer.quant_method, UnquantizedLinearMethod if kept else W12LinearMethod), prefix


def test_mismatch_refuses_to_start(sglang_tp1, monkeypatch):
    from sglang.srt.layers.linear import ColumnParallelLinear

    from specpilot.sglang import quant
    from specpilot.sglang.quant import W12Config, W12LoadError

    layer = ColumnParallelLinear(64, 8, bias=False, quant_config=W12Config(), prefix="bad", params_dtype=torch.bfloat16)
    layer.weight.weight_loader(layer.weight, _w(8, 64, seed=3))
    real_unpack = w12.unpack

    def flipped(p):
        out = real_unpack(p).clone()
        out.view(torch.int16)[0, 0] ^= 1
        return out

    monkeypatch.setattr(quant.w12, "unpack", flipped)
    with pytest.raises(W12LoadError, match="refusing to start"):
        layer.quant_method.process_weights_after_loading(layer)


def test_non_bf16_weight_is_refused(sglang_tp1):
    from sglang.srt.layers.linear import ColumnParallelLinear

    from specpilot.sglang.quant import W12Config, W12LoadError

    layer = ColumnParallelLinear(64, 8, bias=False, quant_config=W12Config(), prefix="fp32", params_dtype=torch.float32)
    layer.weight.weight_loader(layer.weight, torch.randn(8, 64))
    with pytest.raises(W12LoadError, match="--dtype bfloat16"):
        layer.quant_method.process_weights_after_loading(layer)


def test_weight_update_restores_and_repacks(sglang_tp1):
    """SGLang's weight update (begin_weight_update ... end_weight_update): restore_weights_before_loading gives the BF16 parameter back (with its
    loader), new weights load through it, and postprocess_weights packs and verifies them again."""
    from sglang.srt.layers.linear import MergedColumnParallelLinear
    from sglang.srt.model_loader.loader import DefaultModelLoader

    from specpilot.sglang.quant import W12Config, packed_weight

    K, sizes = 64, [16, 16]
    layer = MergedColumnParallelLinear(K, sizes, bias=False, quant_config=W12Config(), prefix="upd",
                                       params_dtype=torch.bfloat16)
    old = [_w(n, K, seed=30 + i) for i, n in enumerate(sizes)]
    for i, wi in enumerate(old):
        layer.weight.weight_loader(layer.weight, wi, i)
    model = torch.nn.ModuleList([layer])
    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))
    assert layer.w12_k == K
    DefaultModelLoader.restore_weights_before_loading(model, torch.device("cpu"))
    assert layer.w12_k is None and not hasattr(layer, "w12_tiles")
    assert torch.equal(layer.weight.data.view(torch.int16), torch.cat(old).view(torch.int16))
    new = [_w(n, K, seed=40 + i) for i, n in enumerate(sizes)]
    for i, wi in enumerate(new):
        layer.weight.weight_loader(layer.weight, wi, i)
    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))
    assert torch.equal(w12.unpack(packed_weight(layer)).view(torch.int16), torch.cat(new).view(torch.int16))
    x = _x(2, K)
    assert torch.equal(_out(layer(x)), _expected(x, torch.cat(new)))
