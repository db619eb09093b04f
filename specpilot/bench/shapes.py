"""Shape sets named after real models."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ModelShapes", "SHAPE_SETS", "get_shape_set"]


@dataclass(frozen=True)
class ModelShapes:
    name: str
    hidden: int
    ffn: int
    vocab: int
    layers: int
    attn_layers: int
    attn_q_heads: int
    attn_kv_heads: int
    attn_head_dim: int
    gdn_layers: int = 0
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_head_dim: int = 0
    conv_width: int = 4
    attn_output_gate: bool = False
    # name -> (N, K) in nn.Linear layout (out x in); counts are per model.
    linears: dict[str, tuple[int, int]] = field(default_factory=dict)
    linear_counts: dict[str, int] = field(default_factory=dict)

    @property
    def lm_head(self) -> tuple[int, int]:
        return (self.vocab, self.hidden)


def _hybrid_27b() -> ModelShapes:
    h, ffn, kh, vh, d = 5120, 17408, 16, 48, 128
    aq, akv, ad = 24, 4, 256
    qk, v = kh * d, vh * d  # 2048, 6144
    linears = {
        # GDN in-projection: q, k, v, z (output gate) and the b/a (beta, decay) heads, fused.
        "gdn.in_proj": (2 * qk + 2 * v + 2 * vh, h),  # 16480 x 5120
        "gdn.out_proj": (h, v),  # 5120 x 6144
        # Gated attention: q carries its output gate (2 x 24 x 256), plus k and v.
        "attn.qkv_proj": (2 * aq * ad + 2 * akv * ad, h),  # 14336 x 5120
        "attn.o_proj": (h, aq * ad),  # 5120 x 6144
        "mlp.gate_up_proj": (2 * ffn, h),  # 34816 x 5120
        "mlp.down_proj": (h, ffn),  # 5120 x 17408
    }
    counts = {"gdn.in_proj": 48, "gdn.out_proj": 48, "attn.qkv_proj": 16, "attn.o_proj": 16,
              "mlp.gate_up_proj": 64, "mlp.down_proj": 64}
    return ModelShapes(
        name="hybrid-27b", hidden=h, ffn=ffn, vocab=248320, layers=64, attn_layers=16,
        attn_q_heads=aq, attn_kv_heads=akv, attn_head_dim=ad, gdn_layers=48, gdn_k_heads=kh,
        gdn_v_heads=vh, gdn_head_dim=d, conv_width=4, attn_output_gate=True,
        linears=linears, linear_counts=counts,
    )


def _llama_8b() -> ModelShapes:
    h, ffn, q, kv, d = 4096, 14336, 32, 8, 128
    linears = {
        "attn.qkv_proj": ((q + 2 * kv) * d, h),  # 6144 x 4096
        "attn.o_proj": (h, q * d),  # 4096 x 4096
        "mlp.gate_up_proj": (2 * ffn, h),  # 28672 x 4096
        "mlp.down_proj": (h, ffn),  # 4096 x 14336
    }
    counts = {k: 32 for k in linears}
    return ModelShapes(
        name="llama-3.1-8b", hidden=h, ffn=ffn, vocab=128256, layers=32, attn_layers=32,
        attn_q_heads=q, attn_kv_heads=kv, attn_head_dim=d, linears=linears, linear_counts=counts,
    )


def _tiny() -> ModelShapes:
    """CPU-interpreter scale: same structure as hybrid-27b, small enough to run in seconds."""
    h, ffn, kh, vh, d = 64, 96, 2, 4, 16
    linears = {
        "gdn.in_proj": (2 * kh * d + 2 * vh * d + 2 * vh, h),
        "gdn.out_proj": (h, vh * d),
        "mlp.gate_up_proj": (2 * ffn, h),
        "mlp.down_proj": (h, ffn),
    }
    return ModelShapes(
        name="tiny", hidden=h, ffn=ffn, vocab=500, layers=4, attn_layers=1, attn_q_heads=2,
        attn_kv_heads=1, attn_head_dim=32, gdn_layers=3, gdn_k_heads=kh, gdn_v_heads=vh,
        gdn_head_dim=d, attn_output_gate=True, linears=linears, linear_counts={k: 4 for k in linears},
    )


SHAPE_SETS: dict[str, ModelShapes] = {s.name: s for s in (_hybrid_27b(), _llama_8b(), _tiny())}


def get_shape_set(name: str) -> ModelShapes:
    try:
        return SHAPE_SETS[name]
    except KeyError:
        raise ValueError(f"unknown shape set {name!r}; known: {sorted(SHAPE_SETS)}") from None
