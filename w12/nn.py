"""`W12Linear` and `convert`: swap a model's BF16 `nn.Linear` layers for W12 ones in place.

    report = w12.convert(model, exclude=["lm_head"])
    print(report)

A layer holds its weight in the runtime layout (a `TiledW12`), the default of `convert`, `W12Linear.from_linear`
and `load_model_weights` because it is what the flow kernel streams (tile-contiguous, unpadded, about 12.1 bits per
weight), or in the version-1 planes (a `W12Weight`, `layout="planes"`), which `variant=` and kernel selection, row
sharding and the older kernels read. The weight's tensors are registered as integer buffers, so
`model.to(device)`, `state_dict()` and dtype casts behave (casts leave integer buffers alone): `w_tiles` (not
persistent) and the shared `w_e0`, `w_esc_rowptr`, `w_esc_col`, `w_esc_val` in the runtime layout; `w_hi`,
`w_lo`, `w_e0`, ... in the planes. The state dict is the version-1 planes either way (a runtime-layout layer's
`w_hi`, `w_lo` are untiled when it is taken, so a state dict of such a model briefly holds those planes).
`load_state_dict` between converted models takes each weight's own escape count (the escape lists differ in
length per weight) and validates the planes it loaded; a runtime-layout layer tiles the planes it loads, so the
two kinds of layer load each other's state dicts. `forward` calls `w12.matmul` from `w12.ops`, imported on first
use, on the layer's `TiledW12` or `W12Weight`.

`load_model_weights(model, path)` loads a file written by `specpilot pack` (or `w12.save_file`)
into a model built from its config: W12 entries replace their `nn.Linear`, plain tensors are
copied, and anything missing, unexpected or mismatched is an error.

Why buffers and not a tensor subclass (torchao's pattern): the planes are what the kernels and
the safetensors files take, under the names they already have, and an escape list's length is
data, so a subclass's `copy_` would have to replace its inner tensors exactly as
`_load_from_state_dict` does here; a subclass also needs dispatch rules for every op that
touches a parameter (`to`, `detach`, `copy_`, FSDP, compile tracing) for no gain here.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import W12CheckpointError, W12FormatError
from .format import PLANE_DTYPES, PLANES, SizeStats, W12Weight, check_layout_arg, pack, padded_k
from .layout import TENSORS, TiledW12, tile, untile

__all__ = ["W12Linear", "convert", "ConversionReport", "LayerRecord", "load_model_weights"]

# Planes whose length is data (the escape count) and so may differ between two weights of one shape.
_RESIZABLE = ("esc_col", "esc_val")


class W12Linear(nn.Module):
    """A linear layer `y = x @ W.T + b` whose BF16 weight is stored in W12: a `TiledW12` (the runtime layout,
    `w12.pack(weight)`) or a `W12Weight` (the version-1 planes, `w12.pack(weight, layout="planes")`). The state
    dict holds the version-1 planes either way (module doc)."""

    def __init__(self, weight: W12Weight | TiledW12, bias: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(weight, (W12Weight, TiledW12)):
            raise TypeError(f"w12.W12Linear: needs a W12Weight or TiledW12 (from w12.pack), got "
                            f"{type(weight).__name__}; pass w12.pack(weight), or build it with "
                            "w12.W12Linear.from_linear(linear)")
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.N):
            raise ValueError(f"w12.W12Linear: bias has shape {tuple(bias.shape)}, expected ({weight.N},); pass the "
                             "layer's bias vector or None")
        self.in_features = weight.K
        self.out_features = weight.N
        self._hold(weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def _hold(self, weight: W12Weight | TiledW12) -> None:
        """Register `weight`'s tensors as the layer's buffers: `w_tiles` (not persistent: the state dict holds hi and
        lo) and the shared `w_e0`, `w_esc_*` for a `TiledW12`, the planes for a `W12Weight`."""
        if isinstance(weight, TiledW12):
            self.register_buffer("w_tiles", weight.tiles, persistent=False)
            for p in TENSORS[1:]:
                self.register_buffer(f"w_{p}", getattr(weight, p))
        else:
            for p in PLANES:
                self.register_buffer(f"w_{p}", getattr(weight, p))
        self._cached = weight

    @property
    def is_tiled(self) -> bool:
        """True where the layer holds its weight in the runtime layout (`weight` is a `TiledW12`)."""
        return "w_tiles" in self._buffers

    @classmethod
    def from_linear(cls, linear: nn.Linear, verify: bool = True, *, layout: str = "runtime") -> "W12Linear":
        """Pack `linear.weight` (must be BF16) on its own device; the bias is kept as is. `layout`: as for
        `w12.pack`: "runtime" (default) a `TiledW12`, the layout the flow kernel streams (tile-contiguous,
        unpadded, about 12.1 bits per weight); "planes" a `W12Weight`, the form that `variant=` and kernel
        selection, row sharding and the older kernels read."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"w12.W12Linear.from_linear: expected an nn.Linear, got {type(linear).__name__}; pass "
                            "an nn.Linear layer")
        if linear.weight.dtype != torch.bfloat16:
            raise TypeError(
                f"w12.W12Linear.from_linear: needs a BF16 weight, got {linear.weight.dtype}; convert the layer "
                f"with .to(torch.bfloat16) first"
            )
        check_layout_arg("w12.W12Linear.from_linear", layout)
        return cls(pack(linear.weight.detach(), verify=verify, layout=layout), linear.bias)

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool = True, *, device=None,
              dtype: torch.dtype = torch.bfloat16) -> "W12Linear":
        """A layer holding the all-zero weight in the version-1 planes (valid planes, no escapes), to load a state
        dict into (a loader that sets the buffers by name, as transformers' does, finds `w_hi` and `w_lo`).
        `dtype` is the bias's; `device` may be "meta"."""
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (in_features, out_features)):
            raise TypeError(f"w12.W12Linear.empty: in_features and out_features must be ints, got {in_features!r}, "
                            f"{out_features!r}; pass the layer's sizes as ints")
        if in_features < 1 or out_features < 1:
            raise ValueError(f"w12.W12Linear.empty: needs in_features, out_features >= 1, got {in_features}, "
                             f"{out_features}; pass the sizes of a non-empty layer")
        N, Kp = out_features, padded_k(in_features)
        z = {
            "hi": torch.zeros(N, Kp, dtype=torch.uint8, device=device),
            "lo": torch.zeros(N, Kp // 2, dtype=torch.uint8, device=device),
            "e0": torch.zeros(N, dtype=torch.uint8, device=device),
            "esc_rowptr": torch.zeros(N + 1, dtype=torch.int32, device=device),
            "esc_col": torch.zeros(0, dtype=PLANE_DTYPES["esc_col"], device=device),
            "esc_val": torch.zeros(0, dtype=PLANE_DTYPES["esc_val"], device=device),
        }
        b = torch.zeros(N, dtype=dtype, device=device) if bias else None
        return cls(W12Weight(**z, K=in_features), b)

    def _retile(self) -> None:
        """Hold the weight in the runtime layout in place: `w_tiles` (`w12.layout.tile` of the planes) replaces
        `w_hi` and `w_lo`; the module object, its bias, `w_e0` and the escape list stay (as do hooks on the
        module). Nothing to do where `is_tiled`."""
        if self.is_tiled:
            return
        t = tile(self.weight)  # shares w_e0 and the escape list
        for p in PLANES:
            del self._buffers[f"w_{p}"]
        self._hold(t)  # in the order of a layer built on a TiledW12

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if not self.is_tiled:
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        # the runtime layout saves as the version-1 planes, in the order and under the names a planes layer has
        for name, prm in self._parameters.items():
            if prm is not None:
                destination[prefix + name] = prm if keep_vars else prm.detach()
        planes = untile(self.weight)
        for p in PLANES:
            t = getattr(planes, p) if p in ("hi", "lo") else getattr(self, f"w_{p}")
            destination[f"{prefix}w_{p}"] = t if keep_vars else t.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        hilo = {}
        if self.is_tiled:  # hi and lo are tiled below; the rest loads as in a planes layer
            hilo = {p: state_dict[f"{prefix}w_{p}"] for p in ("hi", "lo") if f"{prefix}w_{p}" in state_dict}
            state_dict = {k: v for k, v in state_dict.items() if k not in (f"{prefix}w_hi", f"{prefix}w_lo")}
            if strict:
                missing_keys.extend(f"{prefix}w_{p}" for p in ("hi", "lo") if p not in hilo)
        # The escape lists' length is the weight's escape count: take the incoming one.
        for p in _RESIZABLE:
            cur, new = self._buffers.get(f"w_{p}"), state_dict.get(f"{prefix}w_{p}")
            if isinstance(new, torch.Tensor) and cur is not None and new.dim() == 1 and new.shape != cur.shape:
                self._buffers[f"w_{p}"] = torch.empty(new.shape, dtype=cur.dtype, device=cur.device)
        n_err = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        present = [p for p in PLANES if f"{prefix}w_{p}" in state_dict or p in hilo]
        if not present or len(error_msgs) > n_err:
            return
        if len(present) != len(PLANES):
            absent = [f"{prefix}w_{p}" for p in PLANES if p not in present]
            error_msgs.append(f"W12 weight {prefix[:-1] or '(root)'}: planes {absent} are missing from the state dict; "
                              f"a W12 weight loads whole (all of {list(PLANES)})")
            return
        try:
            if self.is_tiled:
                self._load_tiles(hilo, local_metadata.get("assign_to_params_buffers", False))
            else:
                w = self.weight
                w.validate(deep=w.device.type != "meta")
        except W12FormatError as e:
            error_msgs.append(f"W12 weight {prefix[:-1] or '(root)'} is invalid after loading: {e}")

    def _load_tiles(self, hilo: dict, assign: bool) -> None:
        """A runtime-layout layer's load: the incoming hi and lo with the loaded e0 and escape list, checked as a
        planes layer checks them, then tiled into `w_tiles`."""
        dev = self.w_e0.device
        hi, lo = (hilo[p].to(dev) if isinstance(hilo[p], torch.Tensor) else hilo[p] for p in ("hi", "lo"))
        w = W12Weight(hi, lo, *(getattr(self, f"w_{p}") for p in PLANES[2:]), K=self.in_features)
        if w.N != self.out_features:
            raise W12FormatError(f"w12.W12Linear: the loaded planes have {w.N} rows, the layer has "
                                 f"{self.out_features}")
        w.validate(deep=dev.type != "meta")
        tiles = tile(w).tiles
        if assign:
            self._buffers["w_tiles"] = tiles
        else:
            with torch.no_grad():
                self.w_tiles.copy_(tiles)

    @property
    def weight(self) -> W12Weight | TiledW12:
        """The packed weight (a `TiledW12` where `is_tiled`); rebuilt (shallow checks only) if a buffer was
        replaced, e.g. by `.to()`."""
        c = self._cached
        if self.is_tiled:
            if c is None or any(getattr(c, p) is not getattr(self, f"w_{p}") for p in TENSORS):
                c = TiledW12(*(getattr(self, f"w_{p}") for p in TENSORS), self.out_features, self.in_features)
                self._cached = c
            return c
        if c is None or any(getattr(c, p) is not getattr(self, f"w_{p}") for p in PLANES):
            c = W12Weight(**{p: getattr(self, f"w_{p}") for p in PLANES}, K=self.in_features)
            self._cached = c
        return c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .ops import matmul

        return matmul(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        w = self.weight
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"escapes={w.num_escapes}, bits_per_weight={w.bits_per_weight:.3f}")


@dataclass(frozen=True)
class LayerRecord:
    name: str
    shape: tuple[int, int]
    bytes_before: int
    bytes_after: int
    escapes: int


@dataclass
class ConversionReport(SizeStats):
    """What `convert` did: layers converted (with sizes) and layers skipped (with the reason)."""

    converted: list[LayerRecord] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def num_converted(self) -> int:
        return len(self.converted)

    @property
    def num_weights(self) -> int:
        return sum(r.shape[0] * r.shape[1] for r in self.converted)

    @property
    def bytes_before(self) -> int:
        return sum(r.bytes_before for r in self.converted)

    @property
    def bytes_after(self) -> int:
        return sum(r.bytes_after for r in self.converted)

    @property
    def escapes(self) -> int:
        return sum(r.escapes for r in self.converted)

    @property
    def packed_bytes(self) -> int:
        return self.bytes_after

    def __str__(self) -> str:
        lines = [
            f"W12 conversion: {self.num_converted} linear layers converted, {len(self.skipped)} skipped",
        ]
        if self.converted:
            saved = 1 - self.bytes_after / self.bytes_before
            lines += [
                f"  weights: {self.bytes_before / 2**20:.2f} MiB BF16 -> {self.bytes_after / 2**20:.2f} MiB W12 "
                f"({saved:.1%} smaller)",
                f"  bits per weight: {self.bits_per_weight:.3f}   escapes: {self.escapes} ({self.escape_rate:.3e} per weight)",
            ]
        for name, why in self.skipped:
            lines.append(f"  skipped {name}: {why}")
        return "\n".join(lines)


def _matches(name: str, patterns) -> bool:
    if isinstance(patterns, str):
        patterns = [patterns]
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def convert(model: nn.Module, include=None, exclude=None, verify: bool = True, *,
            layout: str = "runtime") -> ConversionReport:
    """Replace `nn.Linear` modules of `model` in place by `W12Linear`.

    `layout`: "runtime" (default) gives each layer a `TiledW12`, the layout the flow kernel streams
    (tile-contiguous, unpadded, about 12.1 bits per weight), and the report's bytes are those of the runtime
    layout; "planes" a `W12Weight` (`w12.pack`'s `layout`), the form that `variant=` and kernel selection, row
    sharding and the older kernels read. The state dict is the version-1 planes either way.

    `include` / `exclude`: fnmatch patterns (a string or a list) on qualified module names, e.g.
    `"model.layers.*.mlp.*"`; default: every linear, nothing excluded. Layers that cannot be
    converted losslessly or safely are skipped and listed in the report: non-BF16 weights,
    subclasses of `nn.Linear` (their forward may differ), weights on the meta device, and weights
    tied to another parameter (packing would keep both copies). A call that finds only non-BF16 layers to
    convert raises (cast the model first), as does an `include` that matches no linear layer.

    A transformers `PreTrainedModel` also gets W12's quantization config (as `w12.hf.quantize` attaches it),
    so `save_pretrained` / `from_pretrained` round-trip the W12 layers bit for bit.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"w12.convert: expected an nn.Module, got {type(model).__name__}; pass the model (or the "
                        "module) whose nn.Linear layers to convert")
    if not isinstance(verify, bool):
        raise TypeError(f"w12.convert: verify must be a bool, got {type(verify).__name__} {verify!r}; pass True or "
                        "False")
    check_layout_arg("w12.convert", layout)
    for arg, val in (("include", include), ("exclude", exclude)):
        if val is not None and not isinstance(val, str) and not (
                isinstance(val, (list, tuple, set, frozenset)) and all(isinstance(v, str) for v in val)):
            raise TypeError(f"w12.convert: {arg} must be a pattern string or a list of them, got {val!r}; pass e.g. "
                            f"{arg}='*.mlp.*' or {arg}=['lm_head']")
    report = ConversionReport()
    linears = [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear) and name]
    if include is not None and linears and not any(_matches(n, include) for n in linears):
        raise ValueError(f"w12.convert: include={include!r} matches none of the model's {len(linears)} linear layers "
                         f"(e.g. {linears[0]!r}); patterns are fnmatch patterns on qualified module names, e.g. "
                         f"'*.mlp.*'")
    owners: dict[int, list[str]] = {}
    for pname, prm in model.named_parameters(remove_duplicate=False):
        if prm.device.type != "meta":
            owners.setdefault(prm.data_ptr(), []).append(pname)
    todo, wrong_dtype = [], []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or not name:
            continue
        if include is not None and not _matches(name, include):
            continue
        if exclude is not None and _matches(name, exclude):
            continue
        if type(mod) is not nn.Linear:
            report.skipped.append((name, f"{type(mod).__name__} subclasses nn.Linear (custom forward); not converted"))
            continue
        w = mod.weight
        if w.dtype != torch.bfloat16:
            report.skipped.append((name, f"weight is {w.dtype}, W12 needs bfloat16 (cast the model first)"))
            wrong_dtype.append((name, w.dtype))
            continue
        if w.device.type == "meta":
            report.skipped.append((name, "weight is on the meta device (load the real weights first)"))
            continue
        sharers = [p for p in owners.get(w.data_ptr(), []) if p != f"{name}.weight"]
        if sharers:
            report.skipped.append((name, f"weight is tied to {sharers[0]}; packing would keep both copies"))
            continue
        todo.append((name, mod))
    if not todo and wrong_dtype:
        dtypes = sorted({str(d) for _, d in wrong_dtype})
        raise TypeError(f"w12.convert: nothing to convert: {len(wrong_dtype)} matching linear layers hold "
                        f"{' / '.join(dtypes)} weights (e.g. {wrong_dtype[0][0]!r}) and W12 packs bfloat16; cast the "
                        f"model first: model.to(torch.bfloat16)")
    for name, mod in todo:
        new = W12Linear.from_linear(mod, verify=verify, layout=layout)
        model.set_submodule(name, new)
        report.converted.append(
            LayerRecord(name, (new.out_features, new.in_features), mod.weight.nbytes, new.weight.nbytes,
                        new.weight.num_escapes)
        )
    if report.converted:
        _attach_hf(model, include, exclude)
    return report


def _attach_hf(model: nn.Module, include=None, exclude=None) -> None:
    """A transformers model that holds W12 layers gets W12's quantization config (w12.hf.attach): without it,
    `save_pretrained` writes planes that `from_pretrained` ignores, initialising plain linears at random."""
    import sys

    if "transformers" not in sys.modules:  # a PreTrainedModel exists only where transformers is loaded
        return
    from . import hf  # also guards save_pretrained: a converted submodule of a model is caught there

    if isinstance(model, sys.modules["transformers"].PreTrainedModel):
        hf.attach(model, include=include, exclude=exclude)


def load_model_weights(model: nn.Module, path, *, device=None, layout: str = "runtime") -> ConversionReport:
    """Load a W12 safetensors file (from `specpilot pack`, `w12.checkpoint.pack_checkpoint` or
    `w12.save_file`) into `model`, a model of the checkpoint's architecture (e.g. built from its
    config, with random or meta weights).

    Every W12 entry `X.weight` replaces the `nn.Linear` module `X` by a `W12Linear` (its bias, if
    any, is loaded from `X.bias` like any other tensor); a W12 entry for anything else (an
    embedding, a weight tied to another parameter) is decoded, exactly, and loaded as BF16; every
    plain tensor is copied into the parameter or buffer of that name (assigned, where the model's tensor is on the meta device).
    The load is strict: a parameter or persistent buffer of the model that the file lacks (tied
    parameters count once), an entry the model has no place for, or a shape or dtype mismatch
    raises `W12CheckpointError` listing them, before the model is changed.

    `device`: where the loaded tensors go; default: the device of the model tensor each replaces
    (CPU where that is meta). `layout`: the form of the new layers' weights, as for `convert`: "runtime" (default)
    a `TiledW12`, tiled on that device, "planes" a `W12Weight`. Returns a `ConversionReport` of the layers
    replaced.
    """
    from .io import load_file

    if not isinstance(model, nn.Module):
        raise TypeError(f"w12.load_model_weights: expected an nn.Module, got {type(model).__name__}; pass a model "
                        "built from the checkpoint's config")
    check_layout_arg("w12.load_model_weights", layout)
    # checksummed and deep-validated; planes, so each layer is tiled on its own device and other entries decode
    entries = load_file(path, layout="planes")
    current = model.state_dict(keep_vars=True)
    aliases: dict[int, int] = {}
    for t in current.values():
        aliases[id(t)] = aliases.get(id(t), 0) + 1
    problems: list[str] = []
    swaps: list[tuple[str, nn.Module, W12Weight]] = []
    plain: dict[str, torch.Tensor] = {}
    for name, v in entries.items():
        if not isinstance(v, W12Weight):
            plain[name] = v
            continue
        mod_name, _, leaf = name.rpartition(".")
        try:
            mod = model.get_submodule(mod_name) if leaf == "weight" else None
        except AttributeError:
            mod = None
        if isinstance(mod, W12Linear) or type(mod) is nn.Linear and aliases.get(id(mod.weight)) == 1:
            if (mod.out_features, mod.in_features) != (v.N, v.K):
                problems.append(f"{name}: W12 weight is [{v.N}, {v.K}], the model's layer is "
                                f"[{mod.out_features}, {mod.in_features}]")
                continue
            swaps.append((mod_name, mod, v))
        else:
            # Not a plain (untied) nn.Linear weight, e.g. an embedding: W12 is lossless, so load it decoded.
            plain[name] = v.unpack()
    replaced = {f"{m}.weight" for m, _, _ in swaps} | {f"{m}.w_{p}" for m, _, _ in swaps for p in PLANES}
    for k, t in plain.items():
        ref = current.get(k)
        if ref is None:
            problems.append(f"{k}: in the file, but the model has no parameter or buffer of that name")
        elif tuple(ref.shape) != tuple(t.shape):
            problems.append(f"{k}: file has shape {tuple(t.shape)}, the model {tuple(ref.shape)}")
        elif ref.dtype != t.dtype:
            problems.append(f"{k}: file has dtype {t.dtype}, the model {ref.dtype}; cast the model first "
                            f"(e.g. model.to({t.dtype}))")
    provided = set(plain) | replaced
    loaded_ids = {id(current[k]) for k in plain if k in current}
    missing = [k for k, t in current.items() if k not in provided and id(t) not in loaded_ids]
    if missing:
        problems.append(f"{len(missing)} model tensors are not in the file: {missing[:8]}")
    if problems:
        raise W12CheckpointError(f"w12.load_model_weights: {path} does not match the model: " + "; ".join(problems[:10]))

    def dest(ref: torch.Tensor):
        if device is not None:
            return torch.device(device)
        return torch.device("cpu") if ref.device.type == "meta" else ref.device

    report = ConversionReport()
    for mod_name, mod, w in swaps:
        ref = current[f"{mod_name}.weight"] if f"{mod_name}.weight" in current else current[f"{mod_name}.w_hi"]
        w = w.to(dest(ref))
        if layout == "runtime":
            w = tile(w)
        bias = None
        if mod.bias is not None:
            bias = torch.zeros(w.N, dtype=mod.bias.dtype, device=w.device)  # filled from the file below
        new = W12Linear(w, bias)
        model.set_submodule(mod_name, new)
        report.converted.append(LayerRecord(mod_name, (w.N, w.K), 2 * w.N * w.K, w.nbytes, w.num_escapes))
    targets = model.state_dict(keep_vars=True)
    by_id: dict[int, list[str]] = {}
    for k, t in targets.items():
        by_id.setdefault(id(t), []).append(k)
    with torch.no_grad():
        for k, t in plain.items():
            ref = targets[k]
            if ref.device.type == "meta" or device is not None and ref.device != torch.device(device):
                value = t.to(dest(ref))
                if isinstance(ref, nn.Parameter):
                    value = nn.Parameter(value, requires_grad=ref.requires_grad and value.is_floating_point())
                for alias in by_id[id(ref)]:  # tied names share the new tensor
                    mod_name, _, leaf = alias.rpartition(".")
                    mod = model.get_submodule(mod_name)
                    (mod._parameters if leaf in mod._parameters else mod._buffers)[leaf] = value
            else:
                ref.copy_(t)
    if swaps:
        _attach_hf(model)
    return report
