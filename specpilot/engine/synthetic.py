"""Synthetic Qwen3.5 hybrids at real sizes: random weights, generated on the device by name.

`hf_config("hybrid-27b")` is the `transformers` config of the shape set of that name
(`specpilot.bench.shapes`); `SyntheticTensors(config)` maps every tensor name of that model to a random
tensor drawn on access from a generator seeded by (seed, name), so the engine and the `transformers`
peer can be given the same weights without either holding two copies.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping

import torch

from ..bench.shapes import get_shape_set

__all__ = ["hf_config", "SyntheticTensors"]

STD = 0.02


def hf_config(shapes: str = "hybrid-27b", **overrides):
    """A `transformers.Qwen3_5TextConfig` with the dimensions of the shape set `shapes`."""
    from transformers import Qwen3_5TextConfig

    s = get_shape_set(shapes)
    if not s.gdn_layers:
        raise ValueError(f"specpilot.engine.synthetic: {shapes!r} has no Gated DeltaNet layers; pass a Qwen3.5 "
                         "hybrid shape set such as 'hybrid-27b'")
    every = s.layers // s.attn_layers
    types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(s.layers)]
    kw = dict(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.ffn, num_hidden_layers=s.layers,
              layer_types=types, num_attention_heads=s.attn_q_heads, num_key_value_heads=s.attn_kv_heads,
              head_dim=s.attn_head_dim, linear_num_key_heads=s.gdn_k_heads, linear_num_value_heads=s.gdn_v_heads,
              linear_key_head_dim=s.gdn_head_dim, linear_value_head_dim=s.gdn_head_dim,
              linear_conv_kernel_dim=s.conv_width, tie_word_embeddings=False, max_position_embeddings=65536)
    kw.update(overrides)
    return Qwen3_5TextConfig(**kw)


def _shapes(cfg) -> dict[str, tuple[int, ...]]:
    h, ffn = cfg.hidden_size, cfg.intermediate_size
    kd, vd = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
    hv = cfg.linear_num_value_heads
    qd, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = {"embed_tokens.weight": (cfg.vocab_size, h), "norm.weight": (h,), "lm_head.weight": (cfg.vocab_size, h)}
    for i, t in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                    p + "mlp.down_proj.weight": (h, ffn)})
        if t == "linear_attention":
            a = p + "linear_attn."
            out.update({a + "in_proj_qkv.weight": (2 * kd + vd, h), a + "in_proj_z.weight": (vd, h),
                        a + "in_proj_b.weight": (hv, h), a + "in_proj_a.weight": (hv, h),
                        a + "conv1d.weight": (2 * kd + vd, 1, cfg.linear_conv_kernel_dim),
                        a + "A_log": (hv,), a + "dt_bias": (hv,), a + "norm.weight": (cfg.linear_value_head_dim,),
                        a + "out_proj.weight": (h, vd)})
        else:
            a = p + "self_attn."
            out.update({a + "q_proj.weight": (2 * qd, h), a + "k_proj.weight": (kvd, h),
                        a + "v_proj.weight": (kvd, h), a + "o_proj.weight": (h, qd),
                        a + "q_norm.weight": (cfg.head_dim,), a + "k_norm.weight": (cfg.head_dim,)})
    return out


class SyntheticTensors(Mapping):
    """name -> BF16 tensor on `device`, drawn when accessed (the same values on every access). Names are
    the engine's (`layers.0.mlp.up_proj.weight`, `lm_head.weight`): a `transformers` model's parameter
    names without the `model.` prefix.

    Projections and embeddings ~ N(0, 0.02^2); zero-centred norms 0 (scale 1); the GDN output norm 1;
    A_log = log(U(1, 16)); dt_bias 1; the conv taps ~ N(0, 0.25)."""

    def __init__(self, cfg, device, seed: int = 0):
        self.cfg, self.device, self.seed = cfg, torch.device(device), int(seed)
        self.shapes = _shapes(cfg)

    def __len__(self) -> int:
        return len(self.shapes)

    def __iter__(self):
        return iter(self.shapes)

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        gen = torch.Generator(self.device).manual_seed((self.seed << 32) ^ zlib.crc32(name.encode()))
        t = torch.empty(shape, dtype=torch.float32, device=self.device)
        if name.endswith("A_log"):
            t.uniform_(1.0, 16.0, generator=gen).log_()
        elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            t.fill_(1.0)
        elif name.endswith("norm.weight"):
            t.zero_()
        elif "conv1d" in name:
            t.normal_(0.0, 0.5, generator=gen)
        else:
            t.normal_(0.0, STD, generator=gen)
        return t.to(torch.bfloat16)

    def weight_bytes(self) -> int:
        """BF16 bytes of every tensor but the embedding (a decoding step reads its rows, not the table)."""
        return 2 * sum(math.prod(s) for n, s in self.shapes.items() if "embed_tokens" not in n)
