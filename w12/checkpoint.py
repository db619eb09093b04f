"""Pack a whole safetensors checkpoint into W12, streaming tensor by tensor, and measure real weights.

`pack_checkpoint(in_path, out_path)` reads and checks the input's header, then for each tensor
reads its bytes, packs it if it is a 2-D BF16 tensor matching `include` (numba codec on the CPU,
or `w12.pack` on a CUDA device) and W12 is smaller than BF16 for it, in the file and in memory, or copies
it verbatim otherwise, and appends the result to the output. Only one tensor is in memory at a time, so checkpoints larger than RAM or GPU memory
work. The header is written last into space reserved up front (an upper bound, padded with
spaces as the safetensors format allows). The output is what `w12.load_file` and
`w12.load_model_weights` read: format version, index and per-tensor checksums in its metadata.
A malformed or truncated input, or an output that cannot be written, raises `W12CheckpointError`.

Size: the file stores the planes compact (`w12.layout = compact`, see `w12.io`): 12 bits per
weight plus 40 bits of row metadata per row and 48 bits per escape, so any K >= 128 stays at
most 12.35 bits per weight before escapes. In memory, `load_file` builds the runtime layout by default
(`w12.layout`: unpadded tiles, 12 bits per weight plus at most 4 bits per row, and the same row metadata), about
as large as the file: 12.31 bits per weight for 1000 x 130. A tensor whose W12 form is not smaller than BF16, in
the file or in that layout (small K: K = 8 takes 17 bits), is kept in BF16 with the reason; a packed tensor above
`WARN_BITS` bits per weight in the file, and one whose version-1 planes (`layout="planes"`, rows padded to a
multiple of 64 columns: 18.03 bits per weight for 1000 x 130) would not be smaller than BF16 in memory, are listed
in the report's warnings.

`measure_real_weights(path)` / `measure_gaussian(...)`: bits per weight and escape rate of W12
on a checkpoint's float matrices (cast to BF16) and on Gaussian weights.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import W12CheckpointError
from .format import FORMAT_VERSION, PLANES, SizeStats, compact_nbytes, compact_planes, padded_k
from .io import _INDEX_KEY, _LAYOUT_KEY, _SUM_KEY, _VERSION_KEY
from .layout import Geometry

__all__ = ["pack_checkpoint", "CheckpointReport", "measure_real_weights", "measure_gaussian", "read_header",
           "WARN_BITS"]

WARN_BITS = 12.5  # a packed tensor above this many bits per weight is listed in the report's warnings

_PLANE_ST_DTYPE = {"hi": "U8", "lo": "U8", "e0": "U8", "esc_rowptr": "I32", "esc_col": "I32", "esc_val": "I16"}
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_NP_FLOAT = {"F16": np.float16, "F32": np.float32, "F64": np.float64}
_COPY_CHUNK = 64 << 20


def _bad(path, what: str) -> W12CheckpointError:
    return W12CheckpointError(f"{path}: {what}; it is not a valid safetensors file (truncated or corrupt?)")


def read_header(path) -> tuple[dict, dict, int]:
    """(tensor entries, metadata, byte offset of the data section) of a safetensors file.

    Checks what packing relies on: the header is a JSON object; every entry has a known dtype, a
    shape of non-negative ints and `data_offsets` inside the file whose length matches shape and
    dtype; metadata maps str to str. Raises `W12CheckpointError` saying what is wrong.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise _bad(path, f"{size} bytes is too short for a safetensors header")
        n = struct.unpack("<Q", raw)[0]
        if n > size - 8:
            raise _bad(path, f"the header length {n} exceeds the file's {size - 8} bytes after it")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _bad(path, f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _bad(path, f"the header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _bad(path, "__metadata__ must map strings to strings")
    data_len = size - 8 - n
    for name, ent in header.items():
        if not isinstance(ent, dict):
            raise _bad(path, f"entry {name!r} is not an object")
        dt, shape, off = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
        if dt not in _ST_ITEMSIZE:
            raise _bad(path, f"tensor {name!r} has unknown dtype {dt!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise _bad(path, f"tensor {name!r} has shape {shape!r}, expected a list of non-negative ints")
        if not (isinstance(off, list) and len(off) == 2 and all(type(o) is int for o in off)
                and 0 <= off[0] <= off[1] <= data_len):
            raise _bad(path, f"tensor {name!r} has data_offsets {off!r} outside the {data_len}-byte data section")
        want = _ST_ITEMSIZE[dt]
        for d in shape:
            want *= d
        if off[1] - off[0] != want:
            raise _bad(path, f"tensor {name!r} spans {off[1] - off[0]} bytes, but {dt} {shape} needs {want}")
    return header, meta, 8 + n


@dataclass
class CheckpointReport(SizeStats):
    path: str
    packed: list[tuple[str, tuple[int, int], int, int]] = field(default_factory=list)  # name, shape, file bytes, escapes
    copied: list[tuple[str, str]] = field(default_factory=list)  # name, why
    warnings: list[str] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0

    @property
    def num_weights(self) -> int:
        return sum(s[0] * s[1] for _, s, _, _ in self.packed)

    @property
    def escapes(self) -> int:
        return sum(e for *_, e in self.packed)

    @property
    def packed_bytes(self) -> int:
        return sum(b for _, _, b, _ in self.packed)

    def worst(self, n: int = 5) -> list[tuple[str, tuple[int, int], float]]:
        """The `n` packed tensors with the most bits per weight: (name, shape, bits)."""
        rows = [(name, shape, 8.0 * b / (shape[0] * shape[1])) for name, shape, b, _ in self.packed]
        return sorted(rows, key=lambda r: -r[2])[:n]

    def as_dict(self) -> dict:
        return {"output": self.path, "tensors packed": len(self.packed), "tensors copied": len(self.copied),
                "bytes in": self.bytes_in, "bytes out": self.bytes_out,
                "bits per weight (packed tensors, in the file)": round(self.bits_per_weight, 4),
                "escape rate": f"{self.escape_rate:.3e}", "seconds": round(self.seconds, 2)}

    def __str__(self) -> str:
        lines = [f"{k}: {v}" for k, v in self.as_dict().items()]
        if self.packed:
            lines.append("worst tensors (bits per weight):")
            lines += [f"  {bits:7.3f}  {name} [{s[0]} x {s[1]}]" for name, s, bits in self.worst()]
        kept = [(n, why) for n, why in self.copied if why.startswith("kept in BF16")]
        if kept:
            lines.append(f"kept in BF16 ({len(kept)}):")
            lines += [f"  {n}: {why}" for n, why in kept[:10]]
        return "\n".join(lines)


def _matches(name, include) -> bool:
    if include is None:
        return True
    pats = [include] if isinstance(include, str) else list(include)
    return any(fnmatch.fnmatchcase(name, p) for p in pats)


def _read(f, start: int, nbytes: int) -> np.ndarray:
    f.seek(start)
    buf = np.empty(nbytes, np.uint8)
    got = f.readinto(memoryview(buf))
    if got != nbytes:
        raise W12CheckpointError(f"short read ({got} of {nbytes} bytes): the input checkpoint is truncated")
    return buf


def _pack_bits(bits: np.ndarray, device: str, verify: bool) -> tuple[dict[str, np.ndarray], int]:
    """(compact planes as numpy arrays, bytes of the in-memory form `load_file` builds by default: the runtime
    layout)."""
    if torch.device(device).type == "cpu":
        from . import codec

        w = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        p = codec.pack(w, verify=verify)
    else:
        from .format import pack

        w = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(device)
        p = pack(w, verify=verify, layout="planes")  # the file holds the version-1 planes (compact_planes)
    return {k: t.cpu().numpy() for k, t in compact_planes(p).items()}, _memory_nbytes(p.N, p.K, p.num_escapes)


def _size_note(N: int, K: int, escapes: int) -> str:
    return (f"12 bits per weight + {40 / K:.2f} for 40 bits of row metadata per {K}-weight row"
            + (f" + {48 * escapes / (N * K):.2f} for {escapes} escapes" if escapes else ""))


def _memory_nbytes(N: int, K: int, escapes: int = 0) -> int:
    """Bytes of a W12 weight [N, K] in memory as `load_file` gives it by default, the runtime layout (`TiledW12.nbytes`:
    the tiles, `w12.layout.Geometry(N, K).nbytes`, `e0` [N], `esc_rowptr` [N+1] int32, 6 bytes per escape)."""
    return Geometry(N, K).nbytes + 5 * N + 4 + 6 * escapes


def _planes_nbytes(N: int, K: int, escapes: int = 0) -> int:
    """Bytes of the version-1 planes in memory (`layout="planes"`, `W12Weight.nbytes`): `hi` [N, Kp], `lo`
    [N, Kp/2] with rows padded to Kp = 64 ceil(K / 64), `e0`, `esc_rowptr`, 6 bytes per escape."""
    return N * padded_k(K) * 3 // 2 + 5 * N + 4 + 6 * escapes


def _memory_note(N: int, K: int, nbytes: int) -> str:
    """`nbytes`: the runtime layout's size (tiles, row metadata, escapes)."""
    return (f"{8 * nbytes / (N * K):.2f} bits per weight in memory as w12.load_file gives it (the runtime layout: "
            f"{40 / K:.2f} bits of row metadata per {K}-weight row), more than BF16's 16")


def pack_checkpoint(in_path, out_path, *, device="cpu", include=None, progress=True, verify=True) -> CheckpointReport:
    """Pack every 2-D BF16 tensor of a safetensors checkpoint whose name matches `include`
    (fnmatch pattern or list; default all) into W12, unless its W12 form would not be smaller than
    BF16, in the file or in memory (then it is kept, with the reason in `report.copied`); copy the
    other tensors verbatim.

    `device="cpu"` packs with the numba codec; a CUDA device packs with `w12.pack` there.
    Input metadata is kept (keys starting with `w12.` are dropped). Returns a `CheckpointReport`;
    packed tensors above `WARN_BITS` bits per weight are listed in `report.warnings`.
    Raises `W12CheckpointError` for an input that is not a well-formed safetensors file, one with
    no tensor to pack, or an output that cannot be written; its message starts with `w12.pack_checkpoint: `.
    """
    try:
        return _pack_checkpoint(in_path, out_path, device=device, include=include, progress=progress, verify=verify)
    except W12CheckpointError as e:
        if str(e).startswith(_PACK):
            raise
        raise W12CheckpointError(_PACK + str(e)) from e


_PACK = "w12.pack_checkpoint: "


def _pack_checkpoint(in_path, out_path, *, device, include, progress, verify) -> CheckpointReport:
    from tqdm.auto import tqdm

    for name, val in (("in_path", in_path), ("out_path", out_path)):
        if not isinstance(val, (str, os.PathLike)):
            raise TypeError(f"w12.pack_checkpoint: {name} must be a str or os.PathLike, got {type(val).__name__}; "
                            "pass the file's path")
    in_path, out_path = os.fspath(in_path), os.fspath(out_path)
    if os.path.abspath(in_path) == os.path.abspath(out_path):
        raise W12CheckpointError(f"w12.pack_checkpoint: out_path is in_path ({in_path}); packing never overwrites its "
                                 "input, pass another out_path")
    t0 = time.perf_counter()
    try:
        header, in_meta, data0 = read_header(in_path)
    except OSError as e:
        raise W12CheckpointError(f"w12.pack_checkpoint: cannot read {in_path}: {e.strerror or e}; check the "
                                 "path") from e
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    plan = []
    for name, ent in entries:
        shape, dt = ent["shape"], ent["dtype"]
        cand = dt == "BF16" and len(shape) == 2 and shape[0] * shape[1] > 0 and _matches(name, include)
        plan.append((name, ent, cand))
    if not any(c for *_, c in plan):
        if _INDEX_KEY in in_meta:
            raise W12CheckpointError(f"w12.pack_checkpoint: {in_path}: nothing to pack: it is already a W12 file; load "
                                     "it with w12.load_file or w12.load_model_weights")
        kinds = sorted({f"{e['dtype']} {len(e['shape'])}-D" for _, e, _ in plan})
        what = f"no tensor matches --include {include!r} among the 2-D BF16 ones" if include is not None and any(
            e["dtype"] == "BF16" and len(e["shape"]) == 2 for _, e, _ in plan) else \
            f"no non-empty 2-D BF16 tensor (found {', '.join(kinds) or 'no tensors'})"
        raise W12CheckpointError(f"w12.pack_checkpoint: {in_path}: nothing to pack: {what}; W12 packs 2-D BF16 weights "
                                 f"(cast the checkpoint to BF16 first, or widen --include)")
    names = {n for n, _, _ in plan}
    stored = {f"{n}.{p}" for n, _, c in plan if c for p in PLANES}
    if stored & names:
        raise W12CheckpointError(f"w12.pack_checkpoint: {in_path}: tensor names collide with W12 plane names: "
                                 f"{sorted(stored & names)[:5]}; rename those tensors, or leave their weights out with "
                                 "include=")

    # Reserve header space: the same header with every number at its upper bound and each candidate
    # stored both ways (planes and plain) is no shorter than the final one.
    big = 10**16
    draft, sums_draft, index_draft = {}, {}, {}
    for name, ent, cand in plan:
        if cand:
            N, K = ent["shape"]
            shapes = {"hi": [N, K], "lo": [N, (K + 1) // 2], "e0": [N], "esc_rowptr": [N],
                      "esc_col": [N * K], "esc_val": [N * K]}
            for p in PLANES:
                draft[f"{name}.{p}"] = {"dtype": _PLANE_ST_DTYPE[p], "shape": shapes[p], "data_offsets": [big, big]}
                sums_draft[f"{name}.{p}"] = "0" * 32
            index_draft[name] = {"kind": "w12", "N": big, "K": big}
        else:
            index_draft[name] = {"kind": "tensor"}
        draft[name] = {"dtype": ent["dtype"], "shape": ent["shape"], "data_offsets": [big, big]}
        sums_draft[name] = "0" * 32
    out_meta = {k: v for k, v in in_meta.items() if not k.startswith("w12.")}
    out_meta[_VERSION_KEY] = str(FORMAT_VERSION)
    out_meta[_LAYOUT_KEY] = "compact"

    def header_bytes(tensors, sums, index):
        meta = dict(out_meta, **{_INDEX_KEY: json.dumps(index, sort_keys=True),
                                 _SUM_KEY: json.dumps(sums, sort_keys=True)})
        return json.dumps({"__metadata__": meta, **tensors}, separators=(",", ":")).encode()

    reserve = -(-len(header_bytes(draft, sums_draft, index_draft)) // 8) * 8
    report = CheckpointReport(path=out_path, bytes_in=os.path.getsize(in_path))
    tensors, sums, index = {}, {}, {}
    tmp = f"{out_path}.tmp-{os.getpid()}"
    total = sum(e["data_offsets"][1] - e["data_offsets"][0] for _, e, _ in plan)
    try:
        with open(in_path, "rb") as fin, open(tmp, "wb") as fout, \
                tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="w12 pack") as bar:
            fout.write(b"\0" * (8 + reserve))
            pos = 0

            def emit(key, dtype, shape, arr):
                nonlocal pos
                b = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
                fout.write(memoryview(b))
                tensors[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + b.nbytes]}
                sums[key] = hashlib.blake2b(b, digest_size=16).hexdigest()
                pos += b.nbytes

            for name, ent, cand in plan:
                a, b = ent["data_offsets"]
                planes = None
                if cand:
                    N, K = ent["shape"]
                    if compact_nbytes(N, K) >= b - a:
                        why = (f"kept in BF16: W12 would take at least {8 * compact_nbytes(N, K) / (N * K):.2f} "
                               f"bits per weight ({_size_note(N, K, 0)})")
                    elif _memory_nbytes(N, K) >= b - a:
                        why = f"kept in BF16: W12 would take at least {_memory_note(N, K, _memory_nbytes(N, K))}"
                    else:
                        bits = _read(fin, data0 + a, b - a).view(np.uint16).reshape(N, K)
                        planes, mem_bytes = _pack_bits(bits, device, verify)
                        nbytes = sum(planes[p].nbytes for p in PLANES)
                        esc = int(planes["esc_col"].shape[0])
                        if nbytes >= b - a:
                            why = (f"kept in BF16: W12 takes {8 * nbytes / (N * K):.2f} bits per weight "
                                   f"({_size_note(N, K, esc)})")
                            planes = None
                        elif mem_bytes >= b - a:
                            why = f"kept in BF16: W12 takes {_memory_note(N, K, mem_bytes)}"
                            planes = None
                if planes is not None:
                    for p in PLANES:
                        emit(f"{name}.{p}", _PLANE_ST_DTYPE[p], planes[p].shape, planes[p])
                    index[name] = {"kind": "w12", "N": N, "K": K}
                    report.packed.append((name, (N, K), nbytes, esc))
                    if 8 * nbytes / (N * K) > WARN_BITS:
                        report.warnings.append(f"{name} [{N} x {K}]: {8 * nbytes / (N * K):.2f} bits per weight "
                                               f"> {WARN_BITS} in the file ({_size_note(N, K, esc)})")
                    planes_bytes = _planes_nbytes(N, K, esc)
                    if planes_bytes >= b - a:
                        report.warnings.append(
                            f"{name} [{N} x {K}]: {8 * planes_bytes / (N * K):.2f} bits per weight in memory as "
                            f"version-1 planes (load_file(..., layout=\"planes\"): rows padded to a multiple of 64 "
                            f"columns, K={K} -> Kp={padded_k(K)}), more than BF16's 16; the default runtime layout "
                            f"takes {8 * _memory_nbytes(N, K, esc) / (N * K):.2f}")
                else:
                    index[name] = {"kind": "tensor"}
                    tensors[name] = {"dtype": ent["dtype"], "shape": ent["shape"], "data_offsets": [pos, pos + b - a]}
                    h = hashlib.blake2b(digest_size=16)
                    for s in range(a, b, _COPY_CHUNK):
                        chunk = _read(fin, data0 + s, min(_COPY_CHUNK, b - s))
                        h.update(chunk)
                        fout.write(memoryview(chunk))
                    sums[name] = h.hexdigest()
                    pos += b - a
                    if not cand:
                        why = "not BF16" if ent["dtype"] != "BF16" else "not 2-D" if len(ent["shape"]) != 2 else \
                            "empty" if 0 in ent["shape"] else "excluded by include"
                    report.copied.append((name, why))
                bar.update(b - a)
            hdr = header_bytes(tensors, sums, index)
            assert len(hdr) <= reserve, "reserved header space too small (bug)"
            fout.seek(0)
            fout.write(struct.pack("<Q", reserve) + hdr + b" " * (reserve - len(hdr)))
        os.replace(tmp, out_path)
    except OSError as e:
        if e.filename == in_path:
            raise W12CheckpointError(f"w12.pack_checkpoint: cannot read {in_path}: {e.strerror or e}; check the "
                                     "path and that the file is complete") from e
        raise W12CheckpointError(f"w12.pack_checkpoint: cannot write {out_path}: {e.strerror or e}; pass an "
                                 "out_path in a writable folder with room for the packed file") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    report.bytes_out = os.path.getsize(out_path)
    report.seconds = time.perf_counter() - t0
    return report


# --- measurements ------------------------------------------------------------------------------

def _measure(weights) -> dict:
    from . import codec

    n = nbytes = esc = layers = 0
    for w in weights:
        p = codec.pack(w, verify=True)
        n += p.N * p.K
        nbytes += p.nbytes
        esc += p.num_escapes
        layers += 1
    return {"matrices": layers, "weights": n, "bytes": nbytes, "escapes": esc,
            "bits_per_weight": 8.0 * nbytes / n if n else 0.0, "escape_rate": esc / n if n else 0.0}


def measure_real_weights(path, min_numel: int = 4096) -> dict:
    """W12 bits/weight and escape rate over the 2-D float matrices (>= `min_numel` elements) of a
    safetensors checkpoint, each cast to BF16 first (round to nearest even)."""
    header, _, data0 = read_header(path)

    def gen():
        with open(path, "rb") as f:
            for name, ent in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                shape, dt = ent["shape"], ent["dtype"]
                if len(shape) != 2 or shape[0] * shape[1] < min_numel or dt not in (*_NP_FLOAT, "BF16"):
                    continue
                a, b = ent["data_offsets"]
                raw = _read(f, data0 + a, b - a)
                if dt == "BF16":
                    yield torch.from_numpy(raw.view(np.int16).reshape(shape)).view(torch.bfloat16)
                else:
                    yield torch.from_numpy(raw.view(_NP_FLOAT[dt]).reshape(shape).copy()).to(torch.bfloat16)

    return _measure(gen())


def measure_gaussian(N: int = 4096, K: int = 4096, std: float = 0.02, seed: int = 0, layers: int = 1) -> dict:
    """W12 bits/weight and escape rate on N(0, std^2) weights cast to BF16."""
    g = torch.Generator().manual_seed(seed)
    return _measure((torch.randn(N, K, generator=g) * std).bfloat16() for _ in range(layers))
