"""The runtime layout through the public API on a GPU (`layout="runtime"`, docs/w12-format.md "Getting the runtime
layout from the API"): `w12.matmul` / `matmul_q8` on `w12.pack(w, layout="runtime")` are `w12.matmul_tiled` on
`w12.layout.tile(w12.pack(w, layout="planes"))` bit for bit, `load_file(device="cuda", layout="runtime")`,
`unpack` / `decode_q8` through the tile decode, `TiledW12.to`, and `W12Linear` holding a `TiledW12`.

Run on the GPU machine:  python -m pytest tests/w12/test_runtime_layout_api_gpu.py -q
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import w12
from specpilot.testing import assert_bitwise_equal, bits_of
from w12 import layout

from flow_emu import escaped_weight, gaussian_x, hostile_weight

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("q8", [False, True], ids=["exact", "q8"])
@pytest.mark.parametrize("M", [1, 8, 32, 40])
@pytest.mark.parametrize("N,K,kind", [(1030, 1000, "gauss"), (37, 150, "hostile")], ids=lambda v: str(v))
def test_matmul_on_pack_runtime_is_matmul_tiled(N, K, kind, M, q8):
    """The flow kernel (40 rows: two 32-row pieces) through w12.matmul / matmul_q8 on pack(layout="runtime"),
    with a bias and into `out`: the bits of w12.matmul_tiled on tile(pack(w))."""
    w = escaped_weight(N, K, seed=M + N) if kind == "gauss" else hostile_weight(N, K, seed=M + N).cuda()
    t = w12.pack(w, layout="runtime")
    ref = layout.tile(w12.pack(w, layout="planes"))
    assert isinstance(t, layout.TiledW12) and t.device.type == "cuda"
    assert torch.equal(t.tiles, ref.tiles)
    x = gaussian_x(M, K, seed=M)
    bias = gaussian_x(1, N, seed=N)[0] * 0.1
    op = w12.matmul_q8 if q8 else w12.matmul
    got = op(x, t, bias)
    want = w12.matmul_tiled(x, ref, bias, q8=q8)
    torch.cuda.synchronize()
    assert got.shape == (M, N) and got.dtype == torch.bfloat16
    assert torch.equal(bits_of(got), bits_of(want))
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert op(x, t, bias, out=out) is out
    torch.cuda.synchronize()
    assert torch.equal(bits_of(out), bits_of(want))
    with pytest.raises(ValueError, match="does not apply to a TiledW12"):
        op(x, t, bias, variant="mma")


def test_load_file_runtime_on_cuda(tmp_path):
    weights = {"a": escaped_weight(1030, 1000, seed=1).cpu(), "b": hostile_weight(37, 150, seed=2),
               "c": hostile_weight(1000, 130, seed=3)}
    bias = torch.randn(1030)
    path = tmp_path / "m.safetensors"
    w12.save_file(path, {**{k: w12.pack(w, layout="planes") for k, w in weights.items()}, "bias": bias})
    out = w12.load_file(path, device="cuda", layout="runtime")
    assert out["bias"].device.type == "cuda" and torch.equal(out["bias"].cpu(), bias)
    for k, w in weights.items():
        t = out[k]
        assert isinstance(t, layout.TiledW12) and t.device.type == "cuda"
        assert all(x.is_cuda for x in (t.tiles, t.e0, t.esc_rowptr, t.esc_col, t.esc_val))
        p = w12.pack(w.cuda(), layout="planes")
        ref = layout.tile(p)
        assert torch.equal(t.tiles, ref.tiles)
        assert_bitwise_equal(w12.unpack(t).cpu(), w)
        assert torch.equal(bits_of(w12.decode_q8(t)), bits_of(w12.decode_q8(p)))
        x = gaussian_x(8, w.shape[1], seed=4)
        y = w12.matmul(x, t)
        torch.cuda.synchronize()
        assert torch.equal(bits_of(y), bits_of(w12.matmul_tiled(x, ref)))


@pytest.mark.parametrize("N,K", [(37, 150), (1000, 63), (300, 581), (1, 1)], ids=lambda v: str(v))
def test_unpack_decode_q8_and_moves_on_cuda(N, K):
    w = hostile_weight(N, K, seed=N + K).cuda()
    p = w12.pack(w, layout="planes")
    t = w12.pack(w, layout="runtime")
    assert_bitwise_equal(w12.unpack(t), w)
    assert torch.equal(bits_of(w12.decode_q8(t)), bits_of(w12.decode_q8(p)))
    c = t.cpu()
    assert c.device.type == "cpu" and t.to("cuda") is t
    assert_bitwise_equal(w12.unpack(c), w.cpu())
    back = c.cuda()
    assert back.device.type == "cuda" and torch.equal(back.tiles, t.tiles) and torch.equal(back.esc_val, t.esc_val)
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    u = torch.load(buf, weights_only=True)
    assert isinstance(u, layout.TiledW12) and u.device.type == "cuda" and torch.equal(u.tiles, t.tiles)
    buf.seek(0)
    assert torch.load(buf, weights_only=True, map_location="cpu").device.type == "cpu"


def test_w12linear_with_a_tiled_weight_on_cuda():
    lin = nn.Linear(1000, 1030).to("cuda", torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(escaped_weight(1030, 1000, seed=5))
    tiled = w12.W12Linear.from_linear(lin, layout="runtime")
    planes = w12.W12Linear.from_linear(lin, layout="planes")
    assert tiled.is_tiled and tiled.w_tiles.is_cuda
    x = gaussian_x(4, 1000, seed=6)
    y = tiled(x)
    want = w12.matmul_tiled(x, layout.tile(w12.pack(lin.weight.detach(), layout="planes")), lin.bias)
    torch.cuda.synchronize()
    assert torch.equal(bits_of(y), bits_of(want))
    sd, ref = tiled.state_dict(), planes.state_dict()
    assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in sd)
    moved = tiled.to("cpu")
    assert moved.weight.device.type == "cpu"
    assert_bitwise_equal(w12.unpack(moved.weight), lin.weight.detach().cpu())
