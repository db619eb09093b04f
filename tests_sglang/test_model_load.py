"""The shipped tiny Qwen3.5 (W12-packed file) through SGLang's real model loader with `--quantization w12` on the
CPU: SGLang's Qwen3.5 class, its `load_weights` and its merged/parallel linears; the W12 file is read decoded,
every linear is packed again and verified. Each packed layer decodes to the checkpoint's tensors, merged in
SGLang's order, bit for bit; embeddings and the LM head stay BF16."""

from __future__ import annotations

import re

import pytest
import torch

import w12

# SGLang module -> the checkpoint tensors it merges, in order
MERGED = {
    "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
    "linear_attn.in_proj_qkvz": ["linear_attn.in_proj_qkv", "linear_attn.in_proj_z"],
    "linear_attn.in_proj_ba": ["linear_attn.in_proj_b", "linear_attn.in_proj_a"],
    "qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "o_proj": ["self_attn.o_proj"],
    "linear_attn.out_proj": ["linear_attn.out_proj"],
    "mlp.down_proj": ["mlp.down_proj"],
}


@pytest.fixture(scope="module")
def loaded(sglang_tp1):
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import get_model

    sa = sglang_tp1.server_args
    mc = ModelConfig.from_server_args(sa)
    assert mc.quantization == "w12"
    model = get_model(model_config=mc, load_config=LoadConfig(load_format=sa.load_format),
                      device_config=DeviceConfig("cpu"))
    ckpt = {k: (w12.unpack(v) if isinstance(v, w12.W12Weight) else v)
            for k, v in w12.load_file(sglang_tp1.model_dir / "model.w12.safetensors", layout="planes").items()}
    return model, ckpt


def test_every_linear_is_w12_and_bit_exact(loaded):
    from sglang.srt.layers.linear import LinearBase

    from specpilot.sglang.quant import W12LinearMethod, packed_weight

    model, ckpt = loaded
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    seen = 0
    for name, m in model.named_modules():
        if not isinstance(m, LinearBase):
            continue
        if name.endswith("linear_attn.conv1d"):  # SGLang builds the GDN conv as a linear without a quant config
            assert m.quant_config is None, name
            continue
        assert isinstance(m.quant_method, W12LinearMethod), name
        layer, suffix = re.match(r"model\.layers\.(\d+)\.(.+)$", name).groups()
        want = torch.cat([ckpt[f"model.layers.{layer}.{src}.weight"] for src in MERGED[suffix]])
        got = w12.unpack(packed_weight(m))
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
        assert sum(m.w12_partition_sizes) == got.shape[0]
        seen += 1
    assert seen == 19  # 3 GDN layers x 5 linears + 1 attention layer x 4


def test_embeddings_and_head_stay_bf16(loaded):
    model, ckpt = loaded
    emb = model.model.embed_tokens
    head = model.lm_head
    for m, key in ((emb, "model.embed_tokens.weight"), (head, "lm_head.weight")):
        assert type(m.quant_method).__name__ == "UnquantizedEmbeddingMethod"
        assert m.weight.dtype == torch.bfloat16
        assert torch.equal(m.weight.data[: ckpt[key].shape[0]].view(torch.int16), ckpt[key].view(torch.int16))


def test_gdn_parameters_load_as_stored(loaded):
    model, ckpt = loaded
    params = dict(model.named_parameters())
    for key in ("model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.dt_bias", "model.norm.weight"):
        assert torch.equal(params[key].data.float(), ckpt[key].float()), key
