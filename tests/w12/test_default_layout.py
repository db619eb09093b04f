"""The runtime layout (w12.layout.TiledW12) is the default in-memory form: `w12.pack`, `w12.load_file`,
`w12.convert`, `W12Linear.from_linear` and `w12.load_model_weights` give it without `layout=`, and it is exactly
`w12.layout.tile` of the version-1 planes that `layout="planes"` gives."""

import pytest
import torch
from torch import nn

import w12
from w12 import layout
from w12.layout import TENSORS

from flow_emu import hostile_weight

SHAPES = [(1, 1), (17, 64), (37, 150), (75, 4100), (33, 200)]


def _same_tiled(a: w12.TiledW12, b: w12.TiledW12) -> None:
    assert isinstance(a, w12.TiledW12) and isinstance(b, w12.TiledW12)
    assert (a.N, a.K) == (b.N, b.K)
    for t in TENSORS:
        x, y = getattr(a, t), getattr(b, t)
        assert x.dtype == y.dtype and torch.equal(x, y), t


@pytest.mark.parametrize("N,K", SHAPES, ids=lambda v: str(v))
def test_pack_default_is_the_tiled_planes(N, K):
    w = hostile_weight(N, K, seed=N + K)
    t = w12.pack(w)
    assert isinstance(t, w12.TiledW12) and t.shape == torch.Size((N, K))
    _same_tiled(t, layout.tile(w12.pack(w, layout="planes")))
    assert isinstance(w12.pack(w, layout="planes"), w12.W12Weight)


@pytest.mark.parametrize("N,K", SHAPES, ids=lambda v: str(v))
def test_unpack_of_the_default_is_the_weight_bitwise(N, K):
    w = hostile_weight(N, K, seed=3 * N + K)
    got = w12.unpack(w12.pack(w))
    assert got.dtype == torch.bfloat16 and got.shape == w.shape
    assert torch.equal(got.view(torch.int16), w.view(torch.int16))
    assert torch.equal(w12.pack(w, verify=False).tiles, w12.pack(w).tiles)  # verify does not change the bytes


def test_load_file_default_gives_tiled_entries(tmp_path):
    a, b = hostile_weight(37, 150, seed=1), hostile_weight(5, 64, seed=2)
    bias = torch.randn(37)
    path = tmp_path / "m.safetensors"
    w12.save_file(path, {"a.weight": w12.pack(a), "b.weight": w12.pack(b, layout="planes"), "a.bias": bias})
    out = w12.load_file(path)
    assert isinstance(out["a.weight"], w12.TiledW12) and isinstance(out["b.weight"], w12.TiledW12)
    assert isinstance(out["a.bias"], torch.Tensor) and torch.equal(out["a.bias"], bias)
    planes = w12.load_file(path, layout="planes")
    for name, w in (("a.weight", a), ("b.weight", b)):
        assert isinstance(planes[name], w12.W12Weight)
        _same_tiled(out[name], layout.tile(planes[name]))
        assert torch.equal(w12.unpack(out[name]).view(torch.int16), w.view(torch.int16))


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(75, 63), nn.GELU(), nn.Linear(63, 33, bias=False)).to(torch.bfloat16)


def test_convert_default_layers_are_tiled():
    model = _mlp()
    x = torch.randn(3, 75).bfloat16()
    weights = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    report = w12.convert(model)
    assert report.num_converted == 2
    assert all(isinstance(m, w12.W12Linear) and m.is_tiled for m in (model[0], model[2]))
    for m, w in zip((model[0], model[2]), weights):
        assert isinstance(m.weight, w12.TiledW12)
        assert torch.equal(w12.unpack(m.weight).view(torch.int16), w.view(torch.int16))
    # the report counts the runtime layout's bytes
    assert report.bytes_after == model[0].weight.nbytes + model[2].weight.nbytes
    planes = _mlp()
    w12.convert(planes, layout="planes")
    assert not planes[0].is_tiled and isinstance(planes[0].weight, w12.W12Weight)
    assert torch.equal(model(x), planes(x))  # both decode to the same weights (the torch path on the CPU)


def test_from_linear_default_is_tiled():
    lin = _mlp()[0]
    assert w12.W12Linear.from_linear(lin).is_tiled
    assert not w12.W12Linear.from_linear(lin, layout="planes").is_tiled


@pytest.mark.parametrize("layout_arg", [None, "runtime", "planes"])
def test_load_model_weights_layout(tmp_path, layout_arg):
    src = _mlp()
    path = tmp_path / "w.safetensors"
    w12.save_file(path, {"0.weight": w12.pack(src[0].weight.detach()), "0.bias": src[0].bias.detach(),
                         "2.weight": w12.pack(src[2].weight.detach())})
    fresh = _mlp(seed=1)
    kw = {} if layout_arg is None else {"layout": layout_arg}
    report = w12.load_model_weights(fresh, path, **kw)
    assert report.num_converted == 2
    tiled = layout_arg != "planes"
    assert all(isinstance(m, w12.W12Linear) and m.is_tiled == tiled for m in (fresh[0], fresh[2]))
    for i in (0, 2):
        assert torch.equal(w12.unpack(fresh[i].weight).view(torch.int16), src[i].weight.view(torch.int16))
    assert torch.equal(fresh[0].bias, src[0].bias)
    with pytest.raises(ValueError, match=r"^w12\.load_model_weights: layout must be one of"):
        w12.load_model_weights(_mlp(), path, layout="tiles")


def test_retile_in_place_keeps_the_module():
    """W12Linear._retile (used after transformers loads a W12 checkpoint's planes): the same module object, then in
    the runtime layout, with the same state dict and outputs."""
    wl = w12.W12Linear.from_linear(_mlp()[0], layout="planes")
    sd = {k: v.clone() for k, v in wl.state_dict().items()}
    x = torch.randn(4, 75).bfloat16()
    want = wl(x)
    planes = wl.weight
    wl._retile()
    assert wl.is_tiled and [n for n, _ in wl.named_buffers()] == [f"w_{t}" for t in TENSORS]
    _same_tiled(wl.weight, layout.tile(planes))
    assert wl.w_e0 is planes.e0 and wl.w_esc_col is planes.esc_col  # shared, not copied
    assert torch.equal(wl(x), want)
    got = wl.state_dict()
    assert list(got) == list(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    wl._retile()  # already tiled: nothing to do
    assert wl.is_tiled


def test_planes_attributes_on_the_default_form_say_where_they_are():
    t = w12.pack((torch.randn(20, 70, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16())
    for name in ("hi", "lo", "Kp"):
        with pytest.raises(AttributeError, match='layout="planes"'):
            getattr(t, name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        t.nope
    assert not hasattr(t, "hi") and hasattr(t, "tiles")
