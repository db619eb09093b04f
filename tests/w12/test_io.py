"""w12.save_file / load_file: round trips and refusal of corrupt, truncated or foreign files."""

import json
import os
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file as st_save

import autotune
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
    assert isinstance(out["layer.a"], w12.TiledW12)  # the runtime layout by default
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
        "layers.0.q.weight": (torch.randn(63, 180, generator=g) * 0.02).bfloat16(),  # Kp = 192: 13 bits in memory
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
            assert isinstance(got, w12.TiledW12)
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
    with pytest.raises(ValueError, match="out_path is in_path"):
        pack_checkpoint(src, src, progress=False)


def test_measure_helpers(tmp_path):
    from w12.checkpoint import measure_gaussian, measure_real_weights

    src, _ = _checkpoint(tmp_path)
    m = measure_real_weights(src, min_numel=64)
    assert m["matrices"] == 3 and m["weights"] == 63 * 180 + 33 * 64 + 80
    g = measure_gaussian(64, 128, layers=2)
    assert g["weights"] == 2 * 64 * 128 and 12.3125 <= g["bits_per_weight"] < 12.5  # 40 bits of row metadata per 128 weights


# --- compact files and bits per weight --------------------------------------------------------

SHAPES = [(1000, 130), (3, 129), (1, 128), (1, 191), (2, 161), (7, 1000), (64, 256)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_file_bits_per_weight_k_ge_128(tmp_path, shape):
    """Any K >= 128 stays <= 12.5 bits per weight in a file (Gaussian weights, few escapes) and in the runtime layout
    `load_file` builds; `pack_checkpoint` packs every such tensor, and warns where the version-1 planes would take
    16 bits or more in memory (K = 129, 130: rows padded to Kp = 192)."""
    from w12.checkpoint import pack_checkpoint
    from w12.format import compact_nbytes, padded_k

    N, K = shape
    w = (torch.randn(N, K, generator=torch.Generator().manual_seed(N * K)) * 0.02).bfloat16()
    st_save({"w": w}, str(tmp_path / "in.safetensors"))
    report = pack_checkpoint(tmp_path / "in.safetensors", tmp_path / "out.safetensors", progress=False)
    (name, got_shape, nbytes, esc), = report.packed
    assert got_shape == shape and nbytes == compact_nbytes(N, K, esc)
    assert report.bits_per_weight <= 12.5, str(report)
    assert report.worst()[0][0] == "w" and "worst tensors (bits per weight)" in str(report)
    assert not [m for m in report.warnings if "in the file" in m]
    planes_warned = [m for m in report.warnings if "as version-1 planes" in m]
    assert len(planes_warned) == (12 * padded_k(K) / K + 40 / K >= 16)
    # in memory the escape list's row pointers keep their leading 0 (4 bytes a weight, which a one-row weight notices)
    assert w12.load_file(tmp_path / "out.safetensors")["w"].bits_per_weight <= 12.5 + 32 / (N * K)
    assert_bitwise_equal(w12.load_file(tmp_path / "out.safetensors")["w"].unpack(), w)
    # w12.save_file writes the same compact planes
    w12.save_file(tmp_path / "saved.safetensors", {"w": w12.pack(w)})
    assert os.path.getsize(tmp_path / "saved.safetensors") < 12.5 / 8 * N * K + 2048  # planes + header


def test_pack_keeps_bf16_where_w12_is_not_smaller(tmp_path):
    from w12.checkpoint import pack_checkpoint

    g = torch.Generator().manual_seed(3)
    t = {"tiny_k": (torch.randn(4, 8, generator=g) * 0.02).bfloat16(),    # 17.1 bits in the file and in memory: kept
         "k96": (torch.randn(10, 96, generator=g) * 0.02).bfloat16(),     # 12.4 in the file and the runtime layout,
                                                                          # 16.45 as planes: packed, with a warning
         "k64": (torch.randn(30, 64, generator=g) * 0.02).bfloat16(),     # 12.6 in the file
         "big": (torch.randn(16, 256, generator=g) * 0.02).bfloat16()}
    st_save(t, str(tmp_path / "in.safetensors"))
    report = pack_checkpoint(tmp_path / "in.safetensors", tmp_path / "out.safetensors", progress=False)
    assert sorted(n for n, *_ in report.packed) == ["big", "k64", "k96"]
    why = dict(report.copied)
    assert why["tiny_k"].startswith("kept in BF16: W12 would take at least 17.")
    warn = "\n".join(report.warnings)
    assert "k64 [30 x 64]: 12.6" in warn and "> 12.5 in the file" in warn
    assert ("k96 [10 x 96]: 16.45 bits per weight in memory as version-1 planes (load_file(..., layout=\"planes\"): "
            "rows padded to a multiple of 64 columns, K=96 -> Kp=128), more than BF16's 16; the default runtime "
            "layout takes 12.4") in warn
    assert "big" not in warn
    assert [r[0] for r in report.worst(2)] == ["k64", "k96"]
    text = str(report)
    assert "kept in BF16 (1):" in text and "tiny_k" in text
    out = w12.load_file(tmp_path / "out.safetensors")
    for k, v in t.items():
        got = out[k].unpack() if isinstance(out[k], w12.TiledW12) else out[k]
        assert_bitwise_equal(got, v)


def _write_raw(path, header: bytes, data: bytes = b"", n=None):
    with open(path, "wb") as f:
        f.write((len(header) if n is None else n).to_bytes(8, "little") + header + data)


def _hdr(**entries):
    return json.dumps(entries).encode()


BAD_INPUTS = {
    "empty": (b"", None, None, "too short"),
    "header-past-end": (b"{}", b"", 1000, "exceeds the file"),
    "not-json": (b"{nope", b"", None, "not JSON"),
    "json-list": (b"[1, 2]", b"", None, "not an object"),
    "unknown-dtype": (_hdr(w={"dtype": "Q7", "shape": [2, 2], "data_offsets": [0, 8]}), b"\0" * 8, None,
                      "unknown dtype 'Q7'"),
    "bad-shape": (_hdr(w={"dtype": "BF16", "shape": [2, -2], "data_offsets": [0, 8]}), b"\0" * 8, None,
                  "non-negative ints"),
    "offsets-past-data": (_hdr(w={"dtype": "BF16", "shape": [64, 128], "data_offsets": [0, 16384]}), b"\0" * 100,
                          None, "outside the 100-byte data section"),
    "size-mismatch": (_hdr(w={"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 8]}), b"\0" * 8, None,
                      "needs 12"),
    "bad-metadata": (_hdr(__metadata__={"a": 1}), b"", None, "must map strings to strings"),
    "only-fp32": (_hdr(w={"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}), b"\0" * 16, None,
                  r"nothing to pack: no non-empty 2-D BF16 tensor \(found F32 2-D\)"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_pack_checkpoint_bad_input(tmp_path, case):
    from w12.checkpoint import pack_checkpoint

    header, data, n, match = BAD_INPUTS[case]
    src = tmp_path / "in.safetensors"
    _write_raw(src, header, data or b"", n) if header else src.write_bytes(b"")
    with pytest.raises(w12.W12CheckpointError, match=match) as err:
        pack_checkpoint(src, tmp_path / "out.safetensors", progress=False)
    assert str(err.value).startswith("w12.pack_checkpoint: ")
    assert not (tmp_path / "out.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in.safetensors"]  # no temporary left behind


def test_pack_checkpoint_truncated_and_unwritable(tmp_path):
    from w12.checkpoint import pack_checkpoint

    src, _ = _checkpoint(tmp_path)
    raw = src.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(w12.W12CheckpointError, match="outside the .*-byte data section"):
        pack_checkpoint(cut, tmp_path / "out.safetensors", progress=False)
    with pytest.raises(w12.W12CheckpointError, match="nothing to pack: no tensor matches --include 'nope'"):
        pack_checkpoint(src, tmp_path / "out.safetensors", include="nope", progress=False)
    pack_checkpoint(src, tmp_path / "packed.safetensors", progress=False)
    with pytest.raises(w12.W12CheckpointError, match="already a W12 file"):
        pack_checkpoint(tmp_path / "packed.safetensors", tmp_path / "again.safetensors", progress=False)
    (tmp_path / "adir").mkdir()
    with pytest.raises(w12.W12CheckpointError, match="cannot write .*adir"):
        pack_checkpoint(src, tmp_path / "adir", progress=False)
    with pytest.raises(w12.W12CheckpointError, match="cannot write /proc/"):
        pack_checkpoint(src, "/proc/w12-test-out.safetensors", progress=False)
    with pytest.raises(w12.W12CheckpointError, match=r"^w12\.pack_checkpoint: out_path is in_path .*pass another"):
        pack_checkpoint(src, src, progress=False)
    with pytest.raises(w12.W12CheckpointError, match=r"^w12\.pack_checkpoint: short read .*truncated"):
        with mock.patch("w12.checkpoint._read", side_effect=w12.W12CheckpointError("short read (1 of 2 bytes): the "
                                                                                  "input checkpoint is truncated")):
            pack_checkpoint(src, tmp_path / "out2.safetensors", progress=False)


def test_compact_planes_round_trip_and_checks():
    from w12.format import compact_nbytes, compact_planes, from_compact_planes

    for K in (1, 2, 63, 64, 65, 127, 130):
        w = (torch.randn(5, K, generator=torch.Generator().manual_seed(K)) * 0.02).bfloat16()
        w[0, 0] = float("nan")
        p = w12.pack(w, layout="planes")
        c = compact_planes(p)
        assert c["hi"].shape == (5, K) and c["lo"].shape == (5, (K + 1) // 2) and c["esc_rowptr"].shape == (5,)
        assert sum(t.nbytes for t in c.values()) == compact_nbytes(5, K, p.num_escapes)
        q = from_compact_planes(c, K).validate(deep=True)
        for name in PLANES:
            assert torch.equal(getattr(q, name), getattr(p, name)), (K, name)
    c = compact_planes(w12.pack(torch.ones(3, 5, dtype=torch.bfloat16), layout="planes"))
    with pytest.raises(w12.W12FormatError, match="do not fit K=6"):
        from_compact_planes(c, 6)
    c["lo"][0, -1] |= 0x10
    with pytest.raises(w12.W12FormatError, match="padding nibble after column 4"):
        from_compact_planes(c, 5)


def test_loaded_weight_without_escapes_runs_the_triton_kernels(tmp_path):
    """A weight without escapes, loaded on the CPU as planes: its empty escape tensors own their storage (in the file
    an empty tensor sits where the next one's bytes start, e0's here), so a Triton kernel (the interpreter on a CPU)
    that takes e0 and the escapes as separate buffers gives the product of the packed weight, bit for bit."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(64, 128, generator=g) * 0.02).bfloat16()
    p = w12.pack(w, layout="planes")
    assert p.esc_col.numel() == 0
    w12.save_file(tmp_path / "f.safetensors", {"w": p})
    q = w12.load_file(tmp_path / "f.safetensors", layout="planes")["w"]
    ptrs = {n: getattr(q, n).untyped_storage().data_ptr() for n in ("e0", "esc_col", "esc_val")}
    assert ptrs["e0"] not in (ptrs["esc_col"], ptrs["esc_val"])
    x = torch.randn(2, 128, generator=g).bfloat16()
    if not autotune.is_interpreter():
        pytest.skip("the Triton kernels run on a CPU under the interpreter only")
    assert_bitwise_equal(w12.matmul(x, q, variant="gemv"), w12.matmul(x, p, variant="gemv"))
