"""w12.save_file / load_file: round trips and refusal of corrupt, truncated or foreign files."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file as st_save

import w12
from specpilot.testing import assert_bitwise_equal
from w12.format import PLANES


def _weights():
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(63, 75, generator=g) * 0.02).bfloat16()
    a[3, 4] = float("nan")
    a[10, 0] = 1e30
    b = (torch.randn(5, 64, generator=g) * 0.1).bfloat16()  # likely no escapes: empty escape planes
    bias = torch.randn(63, generator=g)
    return a, b, bias


@pytest.fixture
def saved(tmp_path):
    a, b, bias = _weights()
    path = tmp_path / "model.safetensors"
    w12.save_file(path, {"layer.a": w12.pack(a), "layer.b": w12.pack(b), "layer.bias": bias}, metadata={"model": "tiny"})
    return path, a, b, bias


def test_round_trip(saved):
    path, a, b, bias = saved
    out = w12.load_file(path)
    assert set(out) == {"layer.a", "layer.b", "layer.bias"}
    assert isinstance(out["layer.a"], w12.W12Weight)
    assert_bitwise_equal(out["layer.a"].unpack(), a)
    assert_bitwise_equal(out["layer.b"].unpack(), b)
    assert_bitwise_equal(out["layer.bias"], bias)
    from w12.io import read_metadata

    meta = read_metadata(path)
    assert meta["model"] == "tiny" and meta["w12.format_version"] == "1"
    assert json.loads(meta["w12.index"])["layer.a"] == {"kind": "w12", "N": 63, "K": 75}


def _plane_offset(path, key):
    """Byte offset in the file of the first byte of stored tensor `key`."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return 8 + n + header[key]["data_offsets"][0]


@pytest.mark.parametrize("plane", PLANES[:5], ids=lambda p: p)
def test_corrupt_byte_in_plane(saved, plane):
    path = saved[0]
    off = _plane_offset(path, f"layer.a.{plane}")
    with open(path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(w12.W12CorruptFileError, match="checksum mismatch in tensor 'layer.a." + plane):
        w12.load_file(path)


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01], ids=["half", "last-byte", "header"])
def test_truncated(saved, keep):
    path = saved[0]
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep) if keep < 0.99 else size - 1)
    with pytest.raises(w12.W12CorruptFileError, match="truncated or corrupt"):
        w12.load_file(path)


def _rewrite_meta(path, tmp_path, **changes):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for k, v in changes.items():
        k = k.replace("__", ".")
        if v is None:
            meta.pop(k)
        else:
            meta[k] = v
    out = tmp_path / "bad.safetensors"
    st_save(tensors, str(out), metadata=meta)
    return out


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"w12__format_version": "2"}, "format version '2'"),
        ({"w12__checksums": None}, "missing W12 metadata"),
        ({"w12__index": "{not json"}, "unparseable"),
        ({"w12__index": json.dumps({"layer.a": {"kind": "w12", "N": 63, "K": 75}})}, "do not match the W12 index"),
        ({"w12__index": json.dumps({"layer.a": {"kind": "w12", "N": 63, "K": 200}, "layer.b": {"kind": "w12", "N": 5, "K": 64},
                                    "layer.bias": {"kind": "tensor"}})}, "'layer.a' is invalid"),
        ({"w12__index": json.dumps({"layer.a": {"kind": "w12", "N": 60, "K": 75}, "layer.b": {"kind": "w12", "N": 5, "K": 64},
                                    "layer.bias": {"kind": "tensor"}})}, "index says 60"),
    ],
    ids=["version", "no-checksums", "bad-json", "missing-entries", "wrong-K", "wrong-N"],
)
def test_wrong_metadata(saved, tmp_path, changes, match):
    bad = _rewrite_meta(saved[0], tmp_path, **changes)
    with pytest.raises(w12.W12CorruptFileError, match=match):
        w12.load_file(bad)


def test_plain_safetensors_file_refused(tmp_path):
    p = tmp_path / "plain.safetensors"
    st_save({"x": torch.zeros(2)}, str(p))
    with pytest.raises(w12.W12CorruptFileError, match="missing W12 metadata"):
        w12.load_file(p)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        w12.save_file(tmp_path / "x.safetensors", {"a": torch.zeros(1)}, metadata={"w12.index": "{}"})
    with pytest.raises(TypeError, match="W12Weight or torch.Tensor"):
        w12.save_file(tmp_path / "x.safetensors", {"a": [1, 2]})
    with pytest.raises(FileNotFoundError):
        w12.load_file(tmp_path / "missing.safetensors")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_load_to_device_cpu(saved):
    out = w12.load_file(saved[0], device="cpu")
    assert out["layer.a"].device == torch.device("cpu")


# --- w12.checkpoint.pack_checkpoint ----------------------------------------------------------

def _checkpoint(tmp_path):
    g = torch.Generator().manual_seed(7)
    t = {
        "layers.0.q.weight": (torch.randn(63, 75, generator=g) * 0.02).bfloat16(),
        "layers.0.k.weight": (torch.randn(33, 64, generator=g) * 0.02).bfloat16(),
        "layers.0.norm.weight": torch.ones(75, dtype=torch.bfloat16),  # 1-D: copied
        "embed.weight": torch.randn(10, 8, generator=g),  # fp32: copied
        "conv.weight": torch.randn(2, 3, 4, generator=g).bfloat16(),  # 3-D: copied
        "steps": torch.arange(5),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
    }
    t["layers.0.q.weight"][1, 1] = float("-inf")
    path = tmp_path / "in.safetensors"
    st_save(t, str(path), metadata={"format": "pt"})
    return path, t


@pytest.mark.parametrize("include", [None, "layers.*.q.*"], ids=["all", "q-only"])
def test_pack_checkpoint_round_trip(tmp_path, include):
    from w12.checkpoint import pack_checkpoint

    src, t = _checkpoint(tmp_path)
    dst = tmp_path / "out.safetensors"
    report = pack_checkpoint(src, dst, include=include, progress=False)
    out = w12.load_file(dst)
    assert set(out) == set(t)
    packed = {"layers.0.q.weight"} | ({"layers.0.k.weight"} if include is None else set())
    for name, v in t.items():
        got = out[name]
        if name in packed:
            assert isinstance(got, w12.W12Weight)
            assert_bitwise_equal(got.unpack(), v)
        else:
            assert isinstance(got, torch.Tensor)
            assert_bitwise_equal(got, v)
    assert len(report.packed) == len(packed) and len(report.copied) == len(t) - len(packed)
    assert report.escapes >= 1 and report.bits_per_weight > 12
    assert "bits per weight" in str(report)
    from w12.io import read_metadata

    assert read_metadata(dst)["format"] == "pt"
    # a flipped byte in the packed output is caught too
    off = _plane_offset(dst, "layers.0.q.weight.lo")
    with open(dst, "r+b") as f:
        f.seek(off + 3)
        b = f.read(1)
        f.seek(off + 3)
        f.write(bytes([b[0] ^ 0x80]))
    with pytest.raises(w12.W12CorruptFileError, match="checksum"):
        w12.load_file(dst)


def test_pack_checkpoint_refuses_overwrite(tmp_path):
    from w12.checkpoint import pack_checkpoint

    src, _ = _checkpoint(tmp_path)
    with pytest.raises(ValueError, match="differ"):
        pack_checkpoint(src, src, progress=False)


def test_measure_helpers(tmp_path):
    from w12.checkpoint import measure_gaussian, measure_real_weights

    src, _ = _checkpoint(tmp_path)
    m = measure_real_weights(src, min_numel=64)
    assert m["matrices"] == 3 and m["weights"] == 63 * 75 + 33 * 64 + 80
    g = measure_gaussian(64, 128, layers=2)
    assert g["weights"] == 2 * 64 * 128 and 12.3125 <= g["bits_per_weight"] < 12.5  # 40 bits of row metadata per 128 weights
