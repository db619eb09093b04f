"""Save and load W12 weights (and plain tensors) in a safetensors file, with integrity checks.

A `W12Weight` called `name` is stored as the six tensors `name.hi`, `name.lo`, ..., `name.esc_val`;
a plain tensor is stored under its own name. A `TiledW12` (the runtime layout) is stored as the
`W12Weight` it untiles to (the same tensors and metadata): a file never holds the runtime layout.
The safetensors metadata holds:

* `w12.format_version`: the W12 format version (`1`),
* `w12.index`: JSON `{name: {"kind": "w12", "N": N, "K": K} | {"kind": "tensor"}}`,
* `w12.checksums`: JSON `{stored tensor name: blake2b-128 hex of its raw bytes}`,
* `w12.layout`: `compact`: `hi` is stored as `[N, K]` and `lo` as `[N, ceil(K/2)]` with the low
  nibbles in column order, without the kernels' row padding to a multiple of 64 columns
  (`w12.format.compact_planes`), so a file takes 12 bits per weight for any K plus row metadata
  and escapes; loading rebuilds the padded, interleaved planes. Files without the key hold the
  padded planes as they are in memory,
* the caller's own `metadata` (keys must not start with `w12.`).

`load_file` checks all of it: a truncated file, a flipped byte, a missing tensor or bad metadata
raises `W12CorruptFileError` (a `W12FormatError`, hence a `ValueError`); it never loads silently.
`load_file` returns every W12 entry as a `TiledW12` (the runtime layout, which the flow kernel streams), tiled
after those checks; `load_file(path, layout="planes")` returns the `W12Weight`s the file holds.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file as _st_save_file

from .errors import W12CorruptFileError, W12FormatError
from .format import FORMAT_VERSION, PLANES, W12Weight, check_layout_arg, compact_planes, from_compact_planes
from .layout import TiledW12, tile, untile

__all__ = ["save_file", "load_file", "tensor_checksum"]

_VERSION_KEY = "w12.format_version"
_INDEX_KEY = "w12.index"
_SUM_KEY = "w12.checksums"
_LAYOUT_KEY = "w12.layout"
_LAYOUTS = ("padded", "compact")


def _check_path(fn: str, path) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{fn}: path must be a str or os.PathLike, got {type(path).__name__} {path!r}; pass the "
                        "file's path")


def tensor_checksum(t: torch.Tensor) -> str:
    """blake2b-128 of a tensor's raw bytes (dtype and shape are checked separately)."""
    b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(b, digest_size=16).hexdigest()


def _flatten(tensors: Mapping[str, W12Weight | TiledW12 | torch.Tensor]):
    flat, index = {}, {}
    for name, v in tensors.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"w12.save_file: tensor names must be non-empty strings, got {name!r}")
        if isinstance(v, TiledW12):
            v = untile(v)  # the version-1 planes, one weight at a time: the file is that of the W12Weight
        if isinstance(v, W12Weight):
            index[name] = {"kind": "w12", "N": v.N, "K": v.K}
            for p, t in compact_planes(v).items():
                flat[f"{name}.{p}"] = t
        elif isinstance(v, torch.Tensor):
            index[name] = {"kind": "tensor"}
            flat[name] = v
        else:
            raise TypeError(f"w12.save_file: {name!r}: expected a TiledW12, W12Weight or torch.Tensor, got "
                            f"{type(v).__name__}; pass w12.pack(weight) or a tensor")
    clash = set(index) & {f"{n}.{p}" for n, e in index.items() if e["kind"] == "w12" for p in PLANES}
    if clash or len(flat) != sum(len(PLANES) if e["kind"] == "w12" else 1 for e in index.values()):
        raise ValueError(f"w12.save_file: tensor names collide with W12 plane names ({sorted(clash)}); rename them")
    return flat, index


def save_file(path, tensors: Mapping[str, W12Weight | TiledW12 | torch.Tensor],
              metadata: Mapping[str, str] | None = None):
    """Write `tensors` (W12Weight, TiledW12 or plain tensors) to a safetensors file at `path` (atomically). A
    TiledW12 is written as the W12Weight it untiles to (`w12.layout.untile`): the same stored tensors, byte for byte,
    and the same metadata."""
    _check_path("w12.save_file", path)
    if not isinstance(tensors, Mapping):
        raise TypeError(f"w12.save_file: tensors must be a mapping of names to W12Weight or torch.Tensor, "
                        f"got {type(tensors).__name__}; pass a dict such as {{'layer.weight': w12.pack(weight)}}")
    meta = {}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"w12.save_file: metadata must map str to str, got {k!r}: {type(v).__name__}")
        if k.startswith("w12."):
            raise ValueError(f"w12.save_file: metadata key {k!r} is reserved (keys starting with 'w12.' belong to the format)")
        meta[k] = v
    flat, index = _flatten(tensors)
    flat = {k: t.detach().contiguous().cpu() for k, t in flat.items()}
    meta[_VERSION_KEY] = str(FORMAT_VERSION)
    meta[_LAYOUT_KEY] = "compact"
    meta[_INDEX_KEY] = json.dumps(index, sort_keys=True)
    meta[_SUM_KEY] = json.dumps({k: tensor_checksum(t) for k, t in flat.items()}, sort_keys=True)
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        _st_save_file(flat, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_metadata(path) -> dict[str, str]:
    """The safetensors metadata of a file (raises W12CorruptFileError if the header is unreadable)."""
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors raises its own error type for bad headers
        raise W12CorruptFileError(f"w12.load_file: {path}: not a readable safetensors file ({e}); the file is truncated or corrupt") from e


def _corrupt(path, what: str) -> W12CorruptFileError:
    return W12CorruptFileError(f"w12.load_file: {path}: {what}; the file is corrupt or was not written by w12.save_file - re-create it")


def load_file(path, device="cpu", *, layout: str = "runtime") -> dict[str, TiledW12 | W12Weight | torch.Tensor]:
    """Load a file written by `save_file`; every tensor is checksummed and every W12Weight is
    validated (deep) before it is moved to `device`.

    `layout`: "runtime" (default) gives each W12 entry as a `TiledW12` on `device` (`w12.layout.tile`, after the
    checks, one weight at a time, so only one weight's version-1 planes exist on `device` at once): the default,
    as it is what the flow kernel streams, tile-contiguous and unpadded (about 12.1 bits per weight). "planes"
    gives the `W12Weight` (the version-1 planes), which `variant=` and kernel selection, row sharding and the older
    kernels read. Plain tensors are returned as they are either way."""
    _check_path("w12.load_file", path)
    check_layout_arg("w12.load_file", layout)
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"w12.load_file: {path} does not exist; check the path")
    try:
        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata() or {})
            keys = set(f.keys())
            if _VERSION_KEY not in meta or _INDEX_KEY not in meta or _SUM_KEY not in meta:
                raise _corrupt(path, f"missing W12 metadata ({_VERSION_KEY}, {_INDEX_KEY}, {_SUM_KEY})")
            if meta[_VERSION_KEY] != str(FORMAT_VERSION):
                raise W12CorruptFileError(
                    f"w12.load_file: {path}: W12 format version {meta[_VERSION_KEY]!r}, this w12 reads version {FORMAT_VERSION}; "
                    f"upgrade specpilot or re-pack the weights"
                )
            file_layout = meta.get(_LAYOUT_KEY, "padded")
            if file_layout not in _LAYOUTS:
                raise _corrupt(path, f"unknown plane layout {file_layout!r} (this w12 reads {list(_LAYOUTS)})")
            try:
                index = json.loads(meta[_INDEX_KEY])
                sums = json.loads(meta[_SUM_KEY])
            except json.JSONDecodeError as e:
                raise _corrupt(path, f"unparseable W12 metadata ({e})") from e
            if not isinstance(index, dict) or not isinstance(sums, dict):
                raise _corrupt(path, "W12 metadata is not a JSON object")
            expected = set()
            for name, entry in index.items():
                kind = entry.get("kind") if isinstance(entry, dict) else None
                if kind == "w12":
                    expected.update(f"{name}.{p}" for p in PLANES)
                elif kind == "tensor":
                    expected.add(name)
                else:
                    raise _corrupt(path, f"unknown kind {kind!r} for {name!r} in the W12 index")
            if expected != keys or set(sums) != keys:
                missing, extra = sorted(expected - keys), sorted(keys - expected)
                raise _corrupt(path, f"tensors do not match the W12 index (missing {missing[:5]}, unexpected {extra[:5]})")
            raw = {}
            for k in sorted(keys):
                t = f.get_tensor(k)
                if tensor_checksum(t) != sums[k]:
                    raise _corrupt(path, f"checksum mismatch in tensor {k!r}")
                # an empty tensor gets storage of its own: the file's would sit at the address of the next one's bytes
                # (a weight without escapes: esc_val where e0 starts), which Triton's interpreter takes for one buffer
                raw[k] = t if t.numel() else torch.empty(t.shape, dtype=t.dtype)
    except W12FormatError:
        raise
    except Exception as e:
        raise W12CorruptFileError(
            f"w12.load_file: {path}: not a readable safetensors file ({type(e).__name__}: {e}); it is truncated or corrupt"
        ) from e
    out = {}
    for name, entry in index.items():
        if entry["kind"] == "tensor":
            out[name] = raw[name].to(device)
            continue
        try:
            planes = {p: raw[f"{name}.{p}"] for p in PLANES}
            if file_layout == "compact":
                w = from_compact_planes(planes, int(entry["K"]))
            else:
                w = W12Weight(**planes, K=int(entry["K"]))
            w.validate(deep=True)
        except (W12FormatError, KeyError, TypeError, ValueError) as e:
            raise _corrupt(path, f"W12 weight {name!r} is invalid: {e}") from e
        if w.N != int(entry.get("N", -1)):
            raise _corrupt(path, f"W12 weight {name!r} has {w.N} rows, the index says {entry.get('N')}")
        w = w.to(device)
        out[name] = tile(w) if layout == "runtime" else w
        del w  # with layout="runtime", the planes of this weight go before the next one is built
    return out
