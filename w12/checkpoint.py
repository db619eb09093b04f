"""Pack a whole safetensors checkpoint into W12, streaming tensor by tensor, and measure real weights.

`pack_checkpoint(in_path, out_path)` reads the input's header, then for each tensor reads its
bytes, packs it if it is a 2-D BF16 tensor matching `include` (numba codec on the CPU, or
`w12.pack` on a CUDA device) or copies it verbatim otherwise, and appends the result to the
output. Only one tensor is in memory at a time, so checkpoints larger than RAM or GPU memory
work. The header is written last into space reserved up front (an upper bound, padded with
spaces as the safetensors format allows). The output is what `w12.load_file` reads: format
version, index and per-tensor checksums in its metadata.

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

from .format import FORMAT_VERSION, PLANES, padded_k
from .io import _INDEX_KEY, _SUM_KEY, _VERSION_KEY

__all__ = ["pack_checkpoint", "CheckpointReport", "measure_real_weights", "measure_gaussian", "read_header"]

_PLANE_ST_DTYPE = {"hi": "U8", "lo": "U8", "e0": "U8", "esc_rowptr": "I32", "esc_col": "I32", "esc_val": "I16"}
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_NP_FLOAT = {"F16": np.float16, "F32": np.float32, "F64": np.float64}
_COPY_CHUNK = 64 << 20


def read_header(path) -> tuple[dict, dict, int]:
    """(tensor entries, metadata, byte offset of the data section) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        n = struct.unpack("<Q", raw)[0]
        if n > os.path.getsize(path) - 8:
            raise ValueError(f"{path}: header length {n} exceeds the file; it is truncated or not safetensors")
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", None) or {}
    return header, meta, 8 + n


@dataclass
class CheckpointReport:
    path: str
    packed: list[tuple[str, tuple[int, int], int, int]] = field(default_factory=list)  # name, shape, bytes, escapes
    copied: list[tuple[str, str]] = field(default_factory=list)  # name, why
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
    def escape_rate(self) -> float:
        n = self.num_weights
        return self.escapes / n if n else 0.0

    @property
    def bits_per_weight(self) -> float:
        n = self.num_weights
        return 8.0 * sum(b for _, _, b, _ in self.packed) / n if n else 0.0

    def as_dict(self) -> dict:
        return {"output": self.path, "tensors packed": len(self.packed), "tensors copied": len(self.copied),
                "bytes in": self.bytes_in, "bytes out": self.bytes_out,
                "bits per weight (packed tensors)": round(self.bits_per_weight, 4),
                "escape rate": f"{self.escape_rate:.3e}", "seconds": round(self.seconds, 2)}

    def __str__(self) -> str:
        return "\n".join(f"{k}: {v}" for k, v in self.as_dict().items())


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
        raise ValueError(f"short read ({got} of {nbytes} bytes): the input checkpoint is truncated")
    return buf


def _pack_bits(bits: np.ndarray, device: str, verify: bool) -> dict[str, np.ndarray]:
    if torch.device(device).type == "cpu":
        from . import codec

        w = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        p = codec.pack(w, verify=verify)
    else:
        from .format import pack

        w = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(device)
        p = pack(w, verify=verify).to("cpu")
    return {k: t.numpy() for k, t in p.planes().items()}


def pack_checkpoint(in_path, out_path, *, device="cpu", include=None, progress=True, verify=True) -> CheckpointReport:
    """Pack every 2-D BF16 tensor of a safetensors checkpoint whose name matches `include`
    (fnmatch pattern or list; default all) into W12; copy the other tensors verbatim.

    `device="cpu"` packs with the numba codec; a CUDA device packs with `w12.pack` there.
    Input metadata is kept (keys starting with `w12.` are dropped). Returns a `CheckpointReport`.
    """
    from tqdm.auto import tqdm

    in_path, out_path = os.fspath(in_path), os.fspath(out_path)
    if os.path.abspath(in_path) == os.path.abspath(out_path):
        raise ValueError("out_path must differ from in_path (packing never overwrites its input)")
    t0 = time.perf_counter()
    header, in_meta, data0 = read_header(in_path)
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    plan, index = [], {}
    for name, ent in entries:
        shape, dt = ent["shape"], ent["dtype"]
        if dt == "BF16" and len(shape) == 2 and shape[0] * shape[1] > 0 and _matches(name, include):
            plan.append((name, ent, True))
            index[name] = {"kind": "w12", "N": shape[0], "K": shape[1]}
        else:
            plan.append((name, ent, False))
            index[name] = {"kind": "tensor"}
    stored = {f"{n}.{p}" for n, e in index.items() if e["kind"] == "w12" for p in PLANES}
    if stored & set(index):
        raise ValueError(f"tensor names collide with W12 plane names: {sorted(stored & set(index))[:5]}")

    # Reserve header space: the same header with every number at its upper bound is no shorter.
    big = 10**16
    draft, sums_draft = {}, {}
    for name, ent, do_pack in plan:
        if do_pack:
            N, K = ent["shape"]
            shapes = {"hi": [N, padded_k(K)], "lo": [N, padded_k(K) // 2], "e0": [N], "esc_rowptr": [N + 1],
                      "esc_col": [N * K], "esc_val": [N * K]}
            for p in PLANES:
                draft[f"{name}.{p}"] = {"dtype": _PLANE_ST_DTYPE[p], "shape": shapes[p], "data_offsets": [big, big]}
                sums_draft[f"{name}.{p}"] = "0" * 32
        else:
            draft[name] = {"dtype": ent["dtype"], "shape": ent["shape"], "data_offsets": [big, big]}
            sums_draft[name] = "0" * 32
    out_meta = {k: v for k, v in in_meta.items() if not k.startswith("w12.")}
    out_meta[_VERSION_KEY] = str(FORMAT_VERSION)
    out_meta[_INDEX_KEY] = json.dumps(index, sort_keys=True)

    def header_bytes(tensors, sums):
        meta = dict(out_meta, **{_SUM_KEY: json.dumps(sums, sort_keys=True)})
        return json.dumps({"__metadata__": meta, **tensors}, separators=(",", ":")).encode()

    reserve = -(-len(header_bytes(draft, sums_draft)) // 8) * 8
    report = CheckpointReport(path=out_path, bytes_in=os.path.getsize(in_path))
    tensors, sums = {}, {}
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

            for name, ent, do_pack in plan:
                a, b = ent["data_offsets"]
                if do_pack:
                    N, K = ent["shape"]
                    bits = _read(fin, data0 + a, b - a).view(np.uint16).reshape(N, K)
                    planes = _pack_bits(bits, device, verify)
                    nbytes = 0
                    for p in PLANES:
                        emit(f"{name}.{p}", _PLANE_ST_DTYPE[p], planes[p].shape, planes[p])
                        nbytes += planes[p].nbytes
                    report.packed.append((name, (N, K), nbytes, int(planes["esc_col"].shape[0])))
                else:
                    tensors[name] = {"dtype": ent["dtype"], "shape": ent["shape"], "data_offsets": [pos, pos + b - a]}
                    h = hashlib.blake2b(digest_size=16)
                    for s in range(a, b, _COPY_CHUNK):
                        chunk = _read(fin, data0 + s, min(_COPY_CHUNK, b - s))
                        h.update(chunk)
                        fout.write(memoryview(chunk))
                    sums[name] = h.hexdigest()
                    pos += b - a
                    why = "not BF16" if ent["dtype"] != "BF16" else "not 2-D" if len(ent["shape"]) != 2 else \
                        "empty" if 0 in ent["shape"] else "excluded by include"
                    report.copied.append((name, why))
                bar.update(b - a)
            hdr = header_bytes(tensors, sums)
            assert len(hdr) <= reserve, "reserved header space too small (bug)"
            fout.seek(0)
            fout.write(struct.pack("<Q", reserve) + hdr + b" " * (reserve - len(hdr)))
        os.replace(tmp, out_path)
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
