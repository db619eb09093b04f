"""Reading a Qwen3.5 hybrid checkpoint: the config through transformers, the tensors from safetensors.

A checkpoint directory holds `config.json` and either BF16 `*.safetensors` or a W12 file from
`specpilot pack` (recognised by its header, whatever its name). Text-only checkpoints (`qwen3_5_text`)
name their tensors `model.layers.N...`; the multimodal wrapper (`qwen3_5`) names them
`model.language_model.layers.N...` and keeps the text config under `text_config`. Both load; vision tensors are ignored.

The engine fuses the projections that read the same input into one weight (rows concatenated):
the GDN in-projection (qkv, z, b, a), attention's q (with its gate), k and v, and the MLP's gate and
up. Rows are independent in BF16 and in W12 (each row keeps its own exponent window), so the fused
weight is exactly the stacked originals, and a W12 checkpoint is decoded, stacked and packed again
bit for bit (`w12.pack` verifies).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["HybridConfig", "load_config", "load_tensors", "fuse_layer_weights"]

_PREFIXES = ("model.language_model.", "model.")


@dataclass(frozen=True)
class HybridConfig:
    """The shapes of a Qwen3.5 text model, read from its Hugging Face config."""

    vocab: int
    hidden: int
    ffn: int
    layers: int
    layer_types: tuple[str, ...]  # "linear_attention" (GDN) or "full_attention"
    eps: float
    # gated full attention
    q_heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # Gated DeltaNet
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_width: int
    tie_embeddings: bool
    eos_token_id: int | None

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def attn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @classmethod
    def from_hf(cls, cfg) -> "HybridConfig":
        """From a `transformers` Qwen3_5TextConfig (or a Qwen3_5Config holding one as `text_config`)."""
        cfg = getattr(cfg, "text_config", None) or cfg
        types = tuple(cfg.layer_types)
        unknown = sorted(set(types) - {"linear_attention", "full_attention"})
        if unknown:
            raise ValueError(f"specpilot.engine.HybridConfig.from_hf: layer types {unknown} are not Qwen3.5's; "
                             "this engine runs "
                             "'linear_attention' (Gated DeltaNet) and 'full_attention' layers")
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        rot = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"specpilot.engine.HybridConfig.from_hf: rope_type {rope['rope_type']!r} is not "
                             "supported; the engine "
                             "implements the default rotary embedding (Qwen3.5's text positions)")
        if getattr(cfg, "attention_bias", False):
            raise ValueError("specpilot.engine.HybridConfig.from_hf: attention_bias=True is not supported; "
                             "Qwen3.5's projections have "
                             "no bias")
        eos = getattr(cfg, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return cls(vocab=cfg.vocab_size, hidden=cfg.hidden_size, ffn=cfg.intermediate_size,
                   layers=cfg.num_hidden_layers, layer_types=types, eps=float(cfg.rms_norm_eps),
                   q_heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
                   rotary_dim=rot, rope_theta=float(rope.get("rope_theta", 10000.0)),
                   k_heads=cfg.linear_num_key_heads, v_heads=cfg.linear_num_value_heads,
                   k_dim=cfg.linear_key_head_dim, v_dim=cfg.linear_value_head_dim,
                   conv_width=cfg.linear_conv_kernel_dim, tie_embeddings=bool(cfg.tie_word_embeddings),
                   eos_token_id=None if eos is None else int(eos))


def load_config(path) -> tuple[HybridConfig, object]:
    """(HybridConfig, the transformers config) of a checkpoint directory."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"specpilot.engine.load_config: {path} has no config.json; pass a Hugging Face "
                                "checkpoint "
                                "directory (config.json and safetensors)")
    hf = AutoConfig.from_pretrained(str(path))
    if getattr(hf, "model_type", None) not in ("qwen3_5", "qwen3_5_text"):
        raise ValueError(f"specpilot.engine.load_config: {path} holds a {hf.model_type!r} model; the engine "
                         "runs Qwen3.5 "
                         "hybrids (model_type 'qwen3_5' or 'qwen3_5_text')")
    return HybridConfig.from_hf(hf), hf


def load_tensors(path) -> tuple[dict, bool]:
    """({name without the text-model prefix: tensor or W12Weight}, packed): every safetensors file of the
    directory. A file is W12 by its header (the `w12.index` metadata `specpilot pack` and `w12.save_file`
    write), whatever its name; W12 files win when both forms are present."""
    import w12
    from safetensors.torch import load_file
    from w12.io import read_metadata

    path = Path(path)
    found = sorted(path.glob("*.safetensors"))
    packed = [f for f in found if "w12.index" in read_metadata(f)]
    files = packed or found
    if not files:
        raise FileNotFoundError(f"specpilot.engine.load_tensors: {path} has no *.safetensors file; pass a checkpoint "
                                "directory "
                                "(BF16 safetensors, or a W12 file from `specpilot pack`)")
    out = {}
    for f in files:
        # planes: the layers are decoded to BF16 and fused here, and a W12 head keeps its planes (lmhead slices them)
        entries = w12.load_file(f, layout="planes") if packed else load_file(str(f))
        for name, t in entries.items():
            out[_strip(name)] = t
    return out, bool(packed)


def _strip(name: str) -> str:
    if name.startswith("lm_head."):
        return name
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def _bf16(t) -> torch.Tensor:
    if isinstance(t, torch.Tensor):
        return t
    return t.unpack()


def fuse_layer_weights(cfg: HybridConfig, tensors: dict) -> Iterator[dict]:
    """Layer by layer: {name: BF16 tensor} with the fused projections (module docstring) and the small tensors
    (norms, conv, A_log, dt_bias) as they are. A generator, so that a caller that converts each layer (to W12, to its
    device) holds one layer's BF16 weights at a time, not the model's (hybrid-27b: 51 GB). Raises on a missing tensor,
    naming it, when its layer is reached."""
    def get(name):
        if name not in tensors:
            raise KeyError(f"specpilot.engine.fuse_layer_weights: the checkpoint has no tensor {name!r}; pass a "
                           f"Qwen3.5 text checkpoint with {cfg.layers} layers")
        return _bf16(tensors[name])

    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        d = {"input_norm": get(p + "input_layernorm.weight"), "post_norm": get(p + "post_attention_layernorm.weight"),
             "gate_up": torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
             "down": get(p + "mlp.down_proj.weight")}
        if kind == "linear_attention":
            a = p + "linear_attn."
            d.update(in_proj=torch.cat([get(a + "in_proj_qkv.weight"), get(a + "in_proj_z.weight"),
                                        get(a + "in_proj_b.weight"), get(a + "in_proj_a.weight")]),
                     out_proj=get(a + "out_proj.weight"), conv=get(a + "conv1d.weight").reshape(cfg.conv_dim, -1),
                     A_log=get(a + "A_log"), dt_bias=get(a + "dt_bias"), norm=get(a + "norm.weight"))
        else:
            a = p + "self_attn."
            d.update(qkv=torch.cat([get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")]),
                     o_proj=get(a + "o_proj.weight"), q_norm=get(a + "q_norm.weight"), k_norm=get(a + "k_norm.weight"))
        yield d
