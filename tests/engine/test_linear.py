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
