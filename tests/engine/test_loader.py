"""The loader fuses the checkpoint's projections one layer at a time: a model built in W12 holds one layer's BF16
weights while it converts them, not the whole model's (hybrid-27b: 51 GB of BF16 beside its 38.5 GB of W12, which
does not fit an 80 GB GPU)."""

import weakref
from collections.abc import Mapping

import pytest
import torch

from specpilot.engine import HybridModel, Kernels
from specpilot.engine.loader import HybridConfig, fuse_layer_weights
from specpilot.engine.synthetic import SyntheticTensors, hf_config

LAYERS = 4


def _tiny():
    return hf_config("hybrid-27b", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                     layer_types=["linear_attention", "full_attention"] * (LAYERS // 2), num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2,
                     linear_key_head_dim=16, linear_value_head_dim=16)


class _Watched(Mapping):
    """The synthetic tensors, each layer's down projection returned watched (a weak reference; the loader keeps that
    one as it is, the others it concatenates): `alive(i)` says whether layer i's is still held."""

    def __init__(self, cfg):
        self.src, self.refs = SyntheticTensors(cfg, "cpu"), {}

    def __getitem__(self, name):
        t = self.src[name]
        if name.endswith("mlp.down_proj.weight"):
            self.refs[int(name.split(".")[1])] = weakref.ref(t)
        return t

    def __iter__(self):
        return iter(self.src)

    def __len__(self):
        return len(self.src)

    def alive(self, i: int) -> bool:
        return i in self.refs and self.refs[i]() is not None


def test_fuse_layer_weights_yields_layer_by_layer():
    cfg = HybridConfig.from_hf(_tiny())
    tensors = _Watched(_tiny())
    layers = fuse_layer_weights(cfg, tensors)
    first = next(layers)
    assert 0 in tensors.refs and 1 not in tensors.refs  # no later layer was read yet
    assert first["down"].shape == (64, 96)
    del first
    second = next(layers)
    assert not tensors.alive(0) and tensors.alive(1)  # the first layer's weights went with the caller's reference
    assert set(second) >= {"qkv", "o_proj", "gate_up", "down"}


@pytest.mark.parametrize("fmt", ["w12", "bf16"])
def test_a_model_holds_one_layer_of_bf16_weights_while_it_converts(fmt, monkeypatch):
    """While layer i is fused, no earlier layer's BF16 weight is held in W12 (in BF16 the model keeps them all)."""
    hf = _tiny()
    cfg = HybridConfig.from_hf(hf)
    tensors = _Watched(hf)
    held = []
    fuse = fuse_layer_weights

    def watched_fuse(c, t):
        layers = fuse(c, t)
        for i in range(c.layers):
            d = next(layers)
            held.append(sum(tensors.alive(j) for j in range(i)))  # earlier layers' down projections still alive
            yield d
            d = None  # this wrapper holds no layer the model let go

    monkeypatch.setattr("specpilot.engine.loader.fuse_layer_weights", watched_fuse)
    kernels = Kernels.choose(torch.device("cpu"), "reference")
    model = HybridModel(cfg, tensors, device="cpu", fmt=fmt, kernels=kernels, head_screen="none")
    assert len(model.layers) == LAYERS and len(held) == LAYERS
    assert held == ([0] * LAYERS if fmt == "w12" else list(range(LAYERS))), held
