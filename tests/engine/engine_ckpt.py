"""Tiny random Qwen3.5 checkpoints written with `transformers` (the oracle) for the engine tests."""

import torch
import transformers

# (seed, overrides): attention placed differently, GQA ratios, head sizes and vocabularies that differ
SHAPES = {
    "gdn3-attn1-v97": (0, dict(vocab_size=97)),
    "attn-first-kv1-v131": (1, dict(vocab_size=131, num_key_value_heads=1,
                                    layer_types=["full_attention", "linear_attention", "linear_attention",
                                                 "full_attention"])),
    "gdn-k1v4-d128-v64": (2, dict(vocab_size=64, head_dim=128, linear_num_key_heads=1, linear_value_head_dim=32,
                                  linear_key_head_dim=32)),
}


def make_config(**overrides):
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              max_position_embeddings=2048, tie_word_embeddings=False)
    kw.update(overrides)
    return transformers.Qwen3_5TextConfig(**kw)


def write_checkpoint(path, seed: int, **overrides):
    """A random BF16 Qwen3_5ForCausalLM saved as config.json + model.safetensors; its norm weights are drawn
    too (0 at init would leave the (1 + w) scaling untested). Returns the model loaded back from `path`, as a user
    loads it: the model cast to BF16 has BF16 rotary frequencies (inv_freq is a buffer), the loaded one fp32."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    cfg = make_config(**overrides)
    model = transformers.Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1)
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    return transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


