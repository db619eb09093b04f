"""`W12Linear` and `convert`: swap a model's BF16 `nn.Linear` layers for W12 ones in place.

    report = w12.convert(model, exclude=["lm_head"])
    print(report)

The planes are registered as integer buffers (`w_hi`, `w_lo`, ...), so `model.to(device)`,
`state_dict()` and dtype casts behave (casts leave integer buffers alone). `forward` calls
`w12.matmul` from `w12.ops`, imported on first use.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from .format import PLANES, W12Weight, pack

__all__ = ["W12Linear", "convert", "ConversionReport", "LayerRecord"]


class W12Linear(nn.Module):
    """A linear layer `y = x @ W.T + b` whose BF16 weight is stored in W12."""

    def __init__(self, weight: W12Weight, bias: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(weight, W12Weight):
            raise TypeError(f"W12Linear needs a W12Weight (from w12.pack), got {type(weight).__name__}")
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.N):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({weight.N},)")
        self.in_features = weight.K
        self.out_features = weight.N
        for p in PLANES:
            self.register_buffer(f"w_{p}", getattr(weight, p))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._cached = weight

    @classmethod
    def from_linear(cls, linear: nn.Linear, verify: bool = True) -> "W12Linear":
        """Pack `linear.weight` (must be BF16) on its own device; the bias is kept as is."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"W12Linear.from_linear expects an nn.Linear, got {type(linear).__name__}")
        if linear.weight.dtype != torch.bfloat16:
            raise TypeError(
                f"W12Linear.from_linear needs a BF16 weight, got {linear.weight.dtype}; convert the layer "
                f"with .to(torch.bfloat16) first"
            )
        return cls(pack(linear.weight.detach(), verify=verify), linear.bias)

    @property
    def weight(self) -> W12Weight:
        """The packed weight; rebuilt (shallow checks only) if a buffer was replaced, e.g. by `.to()`."""
        c = self._cached
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
class ConversionReport:
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
    def escape_rate(self) -> float:
        n = self.num_weights
        return self.escapes / n if n else 0.0

    @property
    def bits_per_weight(self) -> float:
        n = self.num_weights
        return 8.0 * self.bytes_after / n if n else 0.0

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


def convert(model: nn.Module, include=None, exclude=None, verify: bool = True) -> ConversionReport:
    """Replace `nn.Linear` modules of `model` in place by `W12Linear`.

    `include` / `exclude`: fnmatch patterns (a string or a list) on qualified module names, e.g.
    `"model.layers.*.mlp.*"`; default: every linear, nothing excluded. Layers that cannot be
    converted losslessly or safely are skipped and listed in the report: non-BF16 weights,
    subclasses of `nn.Linear` (their forward may differ), weights on the meta device, and weights
    tied to another parameter (packing would keep both copies).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"w12.convert expects an nn.Module, got {type(model).__name__}")
    report = ConversionReport()
    owners: dict[int, list[str]] = {}
    for pname, prm in model.named_parameters(remove_duplicate=False):
        if prm.device.type != "meta":
            owners.setdefault(prm.data_ptr(), []).append(pname)
    todo = []
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
            continue
        if w.device.type == "meta":
            report.skipped.append((name, "weight is on the meta device (load the real weights first)"))
            continue
        sharers = [p for p in owners.get(w.data_ptr(), []) if p != f"{name}.weight"]
        if sharers:
            report.skipped.append((name, f"weight is tied to {sharers[0]}; packing would keep both copies"))
            continue
        todo.append((name, mod))
    for name, mod in todo:
        new = W12Linear.from_linear(mod, verify=verify)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        report.converted.append(
            LayerRecord(name, (new.out_features, new.in_features), mod.weight.nbytes, new.weight.nbytes,
                        new.weight.num_escapes)
        )
    return report
