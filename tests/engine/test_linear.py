"""The engine's projections (`specpilot.engine.Linear`) held as W12 planes or in the runtime layout alone: the same
products, and a model re-held as W12 keeps the head's planes."""

from __future__ import annotations

import pytest
import torch

import w12
from specpilot.engine import Kernels, Linear


@pytest.mark.parametrize("q8", [False, True], ids=["exact", "q8"])
def test_tiled_linear_equals_the_planes(q8):
    """On the CPU the runtime layout's product is the planes' torch path: the same bits (finite weights)."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(48, 200, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(5, 200, generator=g).to(torch.bfloat16)
    kernels = Kernels.choose(torch.device("cpu"))
    planes = Linear.make(w, "w12", "cpu")
    tiled = Linear.make(w, "w12", "cpu", tiled=True)
    assert planes.packed is not None and tiled.packed is None and tiled.tiled is not None
    assert tiled.shape == planes.shape == (48, 200)
    assert torch.equal(tiled(x, kernels, q8=q8).view(torch.int16), planes(x, kernels, q8=q8).view(torch.int16))
    # the planes come back bit for bit where a caller needs them (the head, a conversion)
    assert torch.equal(tiled.ensure_packed().hi, planes.packed.hi) and torch.equal(tiled.packed.lo, planes.packed.lo)
    assert torch.equal(w12.unpack(tiled.packed).view(torch.int16), w.view(torch.int16))


def test_fused_glue_default_follows_the_device(monkeypatch):
    """Engine.from_pretrained(fused_glue=None), the default: the fused Triton glue on a GPU with the kernels, the
    torch glue (the reference path) on the CPU and with kernels='reference'; a non-bool is refused with the fix."""
    from specpilot.engine import Engine, engine as engine_mod
    from specpilot.models import tiny_stdlib_path

    seen = []
    real = engine_mod.HybridModel.__init__

    def spy(self, *args, **kw):
        seen.append((str(kw["device"]), kw["fused_glue"]))
        real(self, *args, **{**kw, "device": "cpu", "fused_glue": False})  # built on the CPU whatever was asked

    monkeypatch.setattr(engine_mod.HybridModel, "__init__", spy)
    monkeypatch.setattr(engine_mod.inputs, "device", lambda fn, value: torch.device(value or "cpu"))
    path = tiny_stdlib_path()
    Engine.from_pretrained(path, device="cpu", max_len=64)
    Engine.from_pretrained(path, device="cuda", max_len=64, kernels="reference", graphs=False)
    with pytest.raises(TypeError, match=r"fused_glue='yes' is a str; pass True or False \(or None\)"):
        Engine.from_pretrained(path, device="cpu", max_len=64, fused_glue="yes")
    assert seen == [("cpu", False), ("cuda", False)]
    seen.clear()
    try:
        Engine.from_pretrained(path, device="cuda", max_len=64, graphs=False)
    except Exception:  # the CPU model under a CUDA engine may refuse later; the choice was made before
        pass
    assert seen == [("cuda", True)]
