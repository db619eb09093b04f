"""The runtime layout through the public API (`layout="runtime"`, docs/w12-format.md "Getting the runtime layout
from the API"): `w12.pack` / `load_file` / `convert` return a `TiledW12` on request, `unpack`, `decode_q8`,
`save_file`, `matmul` and `matmul_q8` take one, files and state dicts stay version 1 bit for bit. CPU tensors; the
GPU side is in test_runtime_layout_api_gpu.py."""

from __future__ import annotations

import gc
import io
import weakref

import pytest
import torch
from torch import nn

import autotune
import w12
from specpilot.testing import assert_bitwise_equal, bits_of
from w12 import io as w12_io
from w12 import layout
from w12.format import PLANES

from flow_emu import assert_same_planes, hostile_weight

# odd shapes: K below, at and above one 64-column group, masked tails, N not a multiple of 16, a single weight
SHAPES = [(1000, 130), (17, 64), (1, 1), (33, 200), (40, 257), (3, 129), (75, 63), (21, 4100)]


def _same_result(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, except that a NaN's payload may differ (the CPU linear's NaN payload follows memory alignment)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan)
    assert torch.equal(bits_of(got)[~nan], bits_of(want)[~nan])


def _in_window(N: int, K: int, seed: int) -> torch.Tensor:
    """Weights with no escapes: magnitudes in [0.1, 1), both signs (four exponents, no zeros)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.rand(N, K, generator=g) * 0.9 + 0.1
    sign = torch.randint(0, 2, (N, K), generator=g) * 2 - 1
    return (mag * sign).to(torch.bfloat16)


def _x(M: int, K: int, seed: int) -> torch.Tensor:
    return (torch.randn(M, K, generator=torch.Generator().manual_seed(seed)) * 1.5).to(torch.bfloat16)


# --- pack / unpack -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("N,K", SHAPES, ids=lambda v: str(v))
def test_pack_runtime_round_trips_bit_for_bit(N, K):
    w = hostile_weight(N, K, seed=N * 7 + K)
    p = w12.pack(w, layout="planes")
    t = w12.pack(w, layout="runtime")
    assert isinstance(t, layout.TiledW12) and (t.N, t.K) == (N, K) and t.shape == (N, K)
    if N > 5:  # salted rows: +-0, +-Inf, NaN payloads, subnormals and out-of-window values escape
        assert t.num_escapes == p.num_escapes > 0
    assert_bitwise_equal(w12.unpack(t), w)
    assert_bitwise_equal(t.unpack(), w)
    assert_bitwise_equal(w12.decode_q8(t), w12.decode_q8(p))
    assert torch.equal(t.tiles, layout.tile(p).tiles)
    assert_same_planes(layout.untile(t), p)


def test_hostile_weight_holds_every_special_value():
    """The weights above hold what the round trips claim to cover."""
    w = hostile_weight(33, 200, seed=1).float()
    bits = hostile_weight(33, 200, seed=1).view(torch.int16).int() & 0xFFFF
    assert torch.isnan(w).any() and torch.isposinf(w).any() and torch.isneginf(w).any()
    assert (bits == 0x8000).any() and (bits == 0).any()  # -0 and +0
    e = (bits >> 7) & 0xFF
    assert ((e == 0) & ((bits & 0x7F) != 0)).any()  # subnormals
    nan_payloads = bits[torch.isnan(w)].unique()
    assert nan_payloads.numel() >= 2


def test_pack_runtime_keeps_no_planes():
    """The W12Weight that pack tiles is gone once pack returns: its hi and lo planes are freed."""
    made = []
    real_tile = layout.tile

    def spy(packed):
        made.append((weakref.ref(packed.hi), weakref.ref(packed.lo)))
        return real_tile(packed)

    w = hostile_weight(40, 130, seed=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layout, "tile", spy)
        t = w12.pack(w, layout="runtime")
    gc.collect()
    assert len(made) == 1
    assert all(ref() is None for ref in made[0])
    assert isinstance(t, layout.TiledW12)
    assert_bitwise_equal(w12.unpack(t), w)


def test_pack_runtime_verify_flag():
    w = hostile_weight(20, 70, seed=3)
    assert_bitwise_equal(w12.unpack(w12.pack(w, False, layout="runtime")), w)
    with pytest.raises(TypeError, match="verify must be a bool"):
        w12.pack(w, "no", layout="runtime")


def test_unpack_rejects_other_types():
    with pytest.raises(TypeError, match="expected a W12Weight or TiledW12"):
        w12.unpack(torch.zeros(2, 2, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="expected a W12Weight or TiledW12"):
        w12.decode_q8("weight")


# --- bits per weight ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("N,K", [(2, 128), (1000, 130), (16, 128), (3, 129), (75, 191), (33, 200), (64, 4096),
                                 (7, 1000)], ids=lambda v: str(v))
def test_runtime_layout_is_at_most_12_5_bits_for_k_from_128(N, K):
    """Everything a GEMM reads of a `pack(layout="runtime")` weight (tiles, e0, row pointers), without escapes:
    <= 12.5 bits per weight for K >= 128, where the planes pad K to a multiple of 64."""
    w = _in_window(N, K, seed=N + K)
    t = w12.pack(w, layout="runtime")
    assert t.num_escapes == 0
    assert t.bits_per_weight <= 12.5, t
    assert t.nbytes == layout.Geometry(N, K).nbytes + 5 * N + 4
    if K == 130:
        assert w12.pack(w, layout="planes").bits_per_weight > 18.0 and t.bits_per_weight < 12.35


def test_runtime_layout_bits_with_gaussian_weights():
    """Gaussian weights (a few escapes) at a padded K stay under 12.5 bits; the planes do not."""
    w = (torch.randn(512, 200, generator=torch.Generator().manual_seed(5)) * 200**-0.5).to(torch.bfloat16)
    t = w12.pack(w, layout="runtime")
    assert t.bits_per_weight <= 12.5 < w12.pack(w, layout="planes").bits_per_weight


# --- files --------------------------------------------------------------------------------------------------------


def _entries():
    a = hostile_weight(33, 200, seed=11)
    b = hostile_weight(17, 64, seed=12)
    c = hostile_weight(1, 1, seed=13)
    d = hostile_weight(1000, 130, seed=14)
    bias = torch.randn(33, generator=torch.Generator().manual_seed(15))
    return {"l.a": a, "l.b": b, "l.c": c, "l.d": d}, bias


def _file_parts(path) -> tuple[int, dict, bytes]:
    """(header length, header as JSON, every byte after the header) of a safetensors file. safetensors keeps the
    metadata in a hash map and writes its keys in a different order from one save to the next (two saves of one
    W12Weight already differ there), so the header is compared as JSON and everything else byte for byte."""
    import json

    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8:8 + n]), raw[8 + n:]


def test_save_file_of_tiled_weights_is_byte_identical(tmp_path):
    weights, bias = _entries()
    planes = {k: w12.pack(w, layout="planes") for k, w in weights.items()}
    tiled = {k: w12.pack(w, layout="runtime") for k, w in weights.items()}
    mixed = {k: (tiled if i % 2 else planes)[k] for i, k in enumerate(weights)}
    files = []
    for i, entries in enumerate((planes, tiled, mixed)):
        path = tmp_path / f"f{i}.safetensors"
        w12.save_file(path, {**entries, "l.bias": bias}, metadata={"model": "m"})
        files.append(_file_parts(path))
    assert len(files[0][2]) > 100_000 and files[0][1]["__metadata__"]["model"] == "m"
    assert files[1] == files[0] and files[2] == files[0]
    assert all(len(p.read_bytes()) == len((tmp_path / "f0.safetensors").read_bytes())
               for p in tmp_path.glob("f*.safetensors"))
    out = w12.load_file(tmp_path / "f1.safetensors", layout="planes")
    for k, w in weights.items():
        assert isinstance(out[k], w12.W12Weight)
        assert_same_planes(out[k], planes[k])


def test_save_file_rejects_other_types(tmp_path):
    with pytest.raises(TypeError, match="expected a TiledW12, W12Weight or torch.Tensor"):
        w12.save_file(tmp_path / "x.safetensors", {"a": [1, 2]})


def test_load_file_runtime_layout(tmp_path):
    weights, bias = _entries()
    path = tmp_path / "m.safetensors"
    w12.save_file(path, {**{k: w12.pack(w, layout="planes") for k, w in weights.items()}, "l.bias": bias})
    out = w12.load_file(path, layout="runtime")
    assert set(out) == set(weights) | {"l.bias"}
    assert isinstance(out["l.bias"], torch.Tensor) and not isinstance(out["l.bias"], layout.TiledW12)
    assert_bitwise_equal(out["l.bias"], bias)
    for k, w in weights.items():
        t = out[k]
        assert isinstance(t, layout.TiledW12) and t.device == torch.device("cpu")
        assert torch.equal(t.tiles, layout.tile(w12.pack(w, layout="planes")).tiles)
        assert_bitwise_equal(w12.unpack(t), w)
    # and back to the same file
    w12.save_file(tmp_path / "again.safetensors", out)
    assert _file_parts(tmp_path / "again.safetensors") == _file_parts(path)


def test_load_file_tiles_one_weight_at_a_time(tmp_path):
    """When load_file tiles a weight, the padded planes of every weight tiled before it are already freed."""
    weights, _ = _entries()
    path = tmp_path / "m.safetensors"
    w12.save_file(path, {k: w12.pack(w, layout="planes") for k, w in weights.items()})
    seen = []
    real_tile = layout.tile

    def spy(packed):
        gc.collect()
        alive = [name for name, ref in seen if ref() is not None]
        assert not alive, f"planes of {alive} still alive while tiling the next weight"
        seen.append((packed.N, weakref.ref(packed.hi)))
        return real_tile(packed)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(w12_io, "tile", spy)
        out = w12.load_file(path, layout="runtime")
    assert len(seen) == len(weights)
    gc.collect()
    assert all(ref() is None for _, ref in seen)
    assert all(isinstance(v, layout.TiledW12) for v in out.values())


def test_load_file_runtime_still_checks_the_file(tmp_path):
    w = hostile_weight(33, 200, seed=16)
    path = tmp_path / "m.safetensors"
    w12.save_file(path, {"a": w12.pack(w, layout="planes")})
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10  # a byte of the last stored tensor
    path.write_bytes(bytes(raw))
    with pytest.raises(w12.W12CorruptFileError, match="checksum mismatch"):
        w12.load_file(path, layout="runtime")


# --- layout= and variant= errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["tiled", "Runtime", "", None, 1, ("runtime",)], ids=repr)
def test_bad_layout_values_are_refused(bad, tmp_path):
    w = hostile_weight(5, 70, seed=4)
    msg = r"layout must be one of 'planes', 'runtime', got "
    with pytest.raises(ValueError, match=r"w12\.pack: " + msg):
        w12.pack(w, layout=bad)
    path = tmp_path / "m.safetensors"
    w12.save_file(path, {"a": w12.pack(w, layout="planes")})
    with pytest.raises(ValueError, match=r"w12\.load_file: " + msg):
        w12.load_file(path, layout=bad)
    lin = nn.Linear(70, 5).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"w12\.W12Linear\.from_linear: " + msg):
        w12.W12Linear.from_linear(lin, layout=bad)
    model = nn.Sequential(nn.Linear(70, 5)).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"w12\.convert: " + msg):
        w12.convert(model, layout=bad)
    assert type(model[0]) is nn.Linear  # nothing converted


@pytest.mark.parametrize("fn", ["matmul", "matmul_q8"])
@pytest.mark.parametrize("variant", ["torch", "gemv", "auto"])
def test_variant_with_a_tiled_weight_is_refused(fn, variant):
    t = w12.pack(hostile_weight(20, 70, seed=5), layout="runtime")
    with pytest.raises(ValueError, match=rf"w12\.{fn}: variant='{variant}' does not apply to a TiledW12.*variant=None"):
        getattr(w12, fn)(_x(2, 70, seed=1), t, variant=variant)


def test_tiled_call_errors_name_the_public_call():
    t = w12.pack(hostile_weight(20, 70, seed=6), layout="runtime")
    with pytest.raises(ValueError, match=r"w12\.matmul: x has shape \(2, 71\)"):
        w12.matmul(_x(2, 71, seed=1), t)
    with pytest.raises(TypeError, match=r"w12\.matmul_q8: x must be bfloat16"):
        w12.matmul_q8(_x(2, 70, seed=1).float(), t)
    with pytest.raises(ValueError, match=r"w12\.matmul: bias must be a tensor of shape \(20,\)"):
        w12.matmul(_x(2, 70, seed=1), t, torch.zeros(3))
    with pytest.raises(ValueError, match=r"w12\.matmul: out must be a contiguous"):
        w12.matmul(_x(2, 70, seed=1), t, out=torch.empty(2, 21, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="packed must be a W12Weight or a TiledW12"):
        w12.matmul(_x(2, 70, seed=1), torch.zeros(20, 70, dtype=torch.bfloat16))


@pytest.mark.parametrize("q8", [False, True], ids=["exact", "q8"])
def test_torch_compile_runs_the_tiled_call_as_one_op(q8):
    """Under torch.compile(fullgraph=True) a call on a TiledW12 is one `specpilot_w12::matmul_tiled` node (the flow
    kernel's driver-API launch cannot be traced) and gives the eager bits, with a bias, a leading batch dim and into
    `out`. (The flow kernel itself under inductor: tests/w12/test_matmul_gpu.py.)"""
    t = w12.pack(hostile_weight(37, 150, seed=11), layout="runtime")
    x = _x(2, 150, seed=12).reshape(2, 1, 150).expand(2, 3, 150).contiguous()
    bias = _x(1, 37, seed=13)[0]
    fn = w12.matmul_q8 if q8 else w12.matmul
    eager = fn(x, t, bias)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(lambda a: fn(a, t, bias), fullgraph=True, backend=backend)(x)
    _same_result(got, eager)
    ops = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert ops.count("specpilot_w12.matmul_tiled") == 1, ops
    out = torch.empty_like(eager)
    torch._dynamo.reset()
    ret = torch.compile(lambda a, o: fn(a, t, bias, out=o), fullgraph=True, backend="eager")(x, out)
    assert ret is out
    _same_result(out, eager)


# --- matmul / matmul_q8 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q8", [False, True], ids=["exact", "q8"])
@pytest.mark.parametrize("N,K,M", [(37, 150, 1), (37, 150, 33), (1000, 130, 5), (17, 64, 4), (1, 1, 3)],
                         ids=lambda v: str(v))
def test_matmul_on_the_runtime_layout_is_the_planes_torch_path(N, K, M, q8):
    """On CPU tensors, w12.matmul / matmul_q8 on pack(layout="runtime") give the planes' torch path bit for bit,
    with a bias, into `out`, with a leading batch dim (NaN where it gives NaN: hostile rows hold NaN weights)."""
    w = hostile_weight(N, K, seed=N + K + M)
    p = w12.pack(w, layout="planes")
    t = w12.pack(w, layout="runtime")
    op = w12.matmul_q8 if q8 else w12.matmul
    x = _x(M, K, seed=M)
    b = (torch.randn(N, generator=torch.Generator().manual_seed(N)) * 0.1).to(torch.bfloat16)
    want = op(x, p, b, variant="torch")
    _same_result(op(x, t, b), want)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    assert op(x, t, b, out=out) is out
    _same_result(out, want)
    got3 = op(x.reshape(1, M, K), t)
    assert got3.shape == (1, M, N)
    _same_result(got3[0], op(x, p, variant="torch"))
    _same_result(op(x, t, b), w12.matmul_tiled(x, t, b, q8=q8))
    if N > 5:
        assert torch.isnan(want.float()).any()  # the comparison covers NaN rows too
    assert op(x[:0], t).shape == (0, N)


def test_matmul_q8_differs_from_matmul_on_a_tiled_weight():
    """matmul_q8 on a TiledW12 really reads the 8-bit view (not the exact weight)."""
    w = (torch.randn(64, 128, generator=torch.Generator().manual_seed(7)) * 0.1).to(torch.bfloat16)
    t = w12.pack(w, layout="runtime")
    x = _x(4, 128, seed=8)
    exact, q8 = w12.matmul(x, t), w12.matmul_q8(x, t)
    assert not torch.equal(exact, q8)
    _same_result(q8, w12.matmul_q8(x, w12.pack(w, layout="planes"), variant="torch"))


# --- TiledW12.to, torch.save / torch.load ------------------------------------------------------------------------


def test_to_moves_every_tensor():
    t = w12.pack(hostile_weight(33, 200, seed=9), layout="runtime")
    assert t.to("cpu") is t and t.cpu() is t
    m = t.to("meta")
    assert isinstance(m, layout.TiledW12) and (m.N, m.K) == (33, 200)
    assert all(x.is_meta for x in (m.tiles, m.e0, m.esc_rowptr, m.esc_col, m.esc_val))
    assert m.esc_col.shape == t.esc_col.shape and m.tiles.shape == t.tiles.shape
    with pytest.raises(TypeError, match="non_blocking must be a bool"):
        t.to("cpu", non_blocking="yes")


def test_torch_save_and_load_weights_only():
    w = hostile_weight(33, 200, seed=10)
    t = w12.pack(w, layout="runtime")
    buf = io.BytesIO()
    torch.save({"t": t, "p": w12.pack(w, layout="planes")}, buf)
    buf.seek(0)
    got = torch.load(buf, weights_only=True)
    u = got["t"]
    assert isinstance(u, layout.TiledW12) and (u.N, u.K) == (t.N, t.K)
    for name in ("tiles", "e0", "esc_rowptr", "esc_col", "esc_val"):
        a, b = getattr(u, name), getattr(t, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert_bitwise_equal(w12.unpack(u), w)
    assert_same_planes(got["p"], layout.untile(u))


# --- W12Linear ----------------------------------------------------------------------------------------------------


def _linear(N: int, K: int, seed: int, bias: bool = True) -> nn.Linear:
    lin = nn.Linear(K, N, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(hostile_weight(N, K, seed=seed))
    return lin


def _torch_path():
    return autotune.force("w12.matmul", variant="torch")


@pytest.mark.parametrize("N,K", [(37, 150), (1000, 130), (17, 64)], ids=lambda v: str(v))
def test_w12linear_holds_a_tiled_weight(N, K):
    lin = _linear(N, K, seed=N)
    planes = w12.W12Linear.from_linear(lin, layout="planes")
    tiled = w12.W12Linear.from_linear(lin, layout="runtime")
    assert isinstance(tiled.weight, layout.TiledW12) and tiled.is_tiled and not planes.is_tiled
    assert {n for n, _ in tiled.named_buffers()} == {"w_tiles", "w_e0", "w_esc_rowptr", "w_esc_col", "w_esc_val"}
    assert (tiled.in_features, tiled.out_features) == (K, N)
    assert_bitwise_equal(w12.unpack(tiled.weight), lin.weight.detach())
    x = _x(5, K, seed=K)
    with _torch_path():
        want = planes(x)
    _same_result(tiled(x), want)
    _same_result(w12.W12Linear(w12.pack(lin.weight.detach(), layout="runtime"), lin.bias)(x), want)
    assert "bits_per_weight" in repr(tiled)
    if K == 130:  # hostile rows: many escapes, 48 bits each in both forms; the padding only in the planes
        assert tiled.weight.bits_per_weight + 5 < planes.weight.bits_per_weight


def test_w12linear_tiled_state_dict_is_the_planes_one():
    lin = _linear(37, 150, seed=1)
    planes = w12.W12Linear.from_linear(lin, layout="planes")
    tiled = w12.W12Linear.from_linear(lin, layout="runtime")
    a, b = planes.state_dict(), tiled.state_dict()
    assert list(a) == list(b) == ["bias", *(f"w_{p}" for p in PLANES)]
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert set(tiled.state_dict(keep_vars=True)) == set(a)
    # torch.save of it loads into a planes layer as it is
    buf = io.BytesIO()
    torch.save(b, buf)
    buf.seek(0)
    fresh = w12.W12Linear.empty(150, 37)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert_same_planes(fresh.weight, planes.weight)


@pytest.mark.parametrize("src_tiled,dst_tiled", [(False, True), (True, False), (True, True)],
                         ids=["planes-to-tiled", "tiled-to-planes", "tiled-to-tiled"])
def test_w12linear_state_dicts_load_across_layouts(src_tiled, dst_tiled):
    """Different escape counts in source and destination; the loaded layer equals the source bit for bit."""
    src_lin, dst_lin = _linear(37, 150, seed=2), _linear(37, 150, seed=3)
    with torch.no_grad():
        dst_lin.weight[5:] = 0.25  # few escapes in the destination
    src = w12.W12Linear.from_linear(src_lin, layout="runtime" if src_tiled else "planes")
    dst = w12.W12Linear.from_linear(dst_lin, layout="runtime" if dst_tiled else "planes")
    assert src.weight.num_escapes != dst.weight.num_escapes
    result = dst.load_state_dict(src.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert dst.is_tiled == dst_tiled
    assert dst.weight.num_escapes == src.weight.num_escapes
    assert_bitwise_equal(w12.unpack(dst.weight), src_lin.weight.detach())
    if dst_tiled:
        assert torch.equal(dst.weight.tiles, w12.pack(src_lin.weight.detach(), layout="runtime").tiles)
    x = _x(3, 150, seed=4)
    with _torch_path():
        _same_result(dst(x), src(x))


def test_w12linear_tiled_refuses_bad_planes():
    src = w12.W12Linear.from_linear(_linear(37, 150, seed=5))
    dst = w12.W12Linear.from_linear(_linear(37, 150, seed=6), layout="runtime")
    before = dst.w_tiles.clone()
    sd = src.state_dict()
    bad = dict(sd, w_hi=torch.zeros(37, 64, dtype=torch.uint8))  # K padded to 64, not 192
    with pytest.raises(RuntimeError, match=r"is invalid after loading: w12\.W12Weight: hi has 64 columns"):
        dst.load_state_dict(bad)
    bad = dict(sd, w_esc_col=sd["w_esc_col"].flip(0).contiguous())
    bad["w_esc_col"][0] = 1000
    with pytest.raises(RuntimeError, match=r"is invalid after loading: w12\.W12Weight: esc_col\[0\] = 1000"):
        dst.load_state_dict(bad)
    partial = {k: v for k, v in sd.items() if k != "w_lo"}
    with pytest.raises(RuntimeError, match=r"planes \['w_lo'\] are missing"):
        dst.load_state_dict(partial, strict=False)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"w_hi\""):
        dst.load_state_dict({k: v for k, v in sd.items() if k != "w_hi"})
    assert dst.w_tiles.shape == before.shape


def test_w12linear_tiled_assign_load():
    src = w12.W12Linear.from_linear(_linear(37, 150, seed=7))
    dst = w12.W12Linear.from_linear(_linear(37, 150, seed=8), layout="runtime")
    dst.load_state_dict(src.state_dict(), assign=True)
    assert_bitwise_equal(w12.unpack(dst.weight), w12.unpack(src.weight))


def test_convert_runtime_layout():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(130, 63), nn.GELU(), nn.Linear(63, 200, bias=False)).to(torch.bfloat16)
    ref = nn.Sequential(nn.Linear(130, 63), nn.GELU(), nn.Linear(63, 200, bias=False)).to(torch.bfloat16)
    ref.load_state_dict(model.state_dict())
    report = w12.convert(model, layout="runtime")
    ref_report = w12.convert(ref, layout="planes")
    assert report.num_converted == 2
    assert all(isinstance(m, w12.W12Linear) and m.is_tiled for m in (model[0], model[2]))
    assert report.bytes_after == model[0].weight.nbytes + model[2].weight.nbytes
    assert model[0].weight.bits_per_weight < 12.5  # K = 130 (the K = 63 layer pays 40 bits a row on 63 weights)
    assert report.bits_per_weight + 2 < ref_report.bits_per_weight
    assert report.bytes_before == ref_report.bytes_before and report.escapes == ref_report.escapes
    x = _x(4, 130, seed=9)
    with _torch_path():
        _same_result(model(x), ref(x))
    a, b = model.state_dict(), ref.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_convert_runtime_then_move_and_cast():
    model = nn.Sequential(nn.Linear(130, 63)).to(torch.bfloat16)
    w12.convert(model, layout="runtime")
    t0 = model[0].weight
    model.to(torch.float16)  # integer buffers stay; the bias follows
    assert model[0].w_tiles.dtype == torch.uint8 and model[0].bias.dtype == torch.float16
    model.to("meta")
    assert model[0].w_tiles.is_meta and model[0].weight.tiles.is_meta and model[0].weight is not t0


def test_hf_save_pretrained_of_a_runtime_layout_model(tmp_path):
    """A transformers model converted with layout="runtime" saves the version-1 planes; from_pretrained (layers in
    the runtime layout, the default) gives the same logits."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    w12.convert(model, exclude="lm_head", layout="runtime")
    assert model.model.layers[0].mlp.down_proj.is_tiled
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    down = loaded.model.layers[0].mlp.down_proj
    assert isinstance(down, w12.W12Linear) and down.is_tiled
    assert torch.equal(down.weight.tiles, model.model.layers[0].mlp.down_proj.weight.tiles)
    with torch.no_grad(), _torch_path():
        got = loaded(ids).logits
    assert_bitwise_equal(got, want)
