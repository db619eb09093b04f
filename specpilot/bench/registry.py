"""One registry of benchmark cases.

An operator package adds cases by decorating a provider in `specpilot/bench/cases/<op>.py`:

    @register("w12", ops=("w12.matmul", "w12.matmul_q8", "decode_step"))
    def _cases(shapes: ModelShapes, device: torch.device) -> list[Case]:
        ...

`ops` names every `Case.op` the provider yields (the names `specpilot info` lists); `--ops` takes either
the provider's name (all its cases) or one of those op names (its cases, with the baselines of their groups).

A `Case` is lazy: nothing is allocated until the runner calls `case.setup()`, which returns a
`Prepared` holding `fns` (callables over *rotated* input sets, so timing does not read from
L2) and `check` (raises if the op's output is wrong on those inputs). The runner reports a
case only when its `check` passed in the same run. Cases with the same `group` are timed
side by side; `baseline` names the variant in the group that ratios are taken against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .shapes import ModelShapes

__all__ = ["Case", "Prepared", "register", "providers", "declared_ops", "collect", "rotations", "load_errors"]


@dataclass
class Prepared:
    fns: list[Callable[[], Any]]  # one per rotated input set; each runs the op once
    check: Callable[[], None] | None = None  # raises AssertionError on a wrong result
    graph_safe: bool = True  # may be captured in a CUDA graph for timing
    teardown: Callable[[], None] | None = None


@dataclass
class Case:
    op: str  # e.g. "linear", "lm_head", "gdn.tree_verify"
    variant: str  # e.g. "cublas", "w12.tc", "w12.gemv", "recurrent"
    shape: str  # readable id, e.g. "mlp.down_proj-M4" (also the JSON "shape")
    dims: dict[str, int]
    flops: float  # useful FLOPs of one call
    bytes: float  # fewest bytes one call must move (each input read once, output written once)
    setup: Callable[[], Prepared]
    group: str = ""  # cases timed side by side; defaults to shape
    baseline: str | None = None  # variant in the group to take ratios against
    extra: dict[str, Any] = field(default_factory=dict)
    # set up, timed and torn down before the group's next case is set up: for inputs that do not fit the device
    # beside the other cases' (the 64-layer decode step's BF16 set and W12 packs on an 80 GB GPU); its ratio is
    # still taken against the group's baseline, timed in the same run but not interleaved with it
    alone: bool = False

    def __post_init__(self):
        if not self.group:
            self.group = self.shape


_PROVIDERS: dict[str, Callable[[ModelShapes, torch.device], list[Case]]] = {}
_OPS: dict[str, tuple[str, ...]] = {}


def register(op: str, ops: tuple[str, ...] = ()):
    """Register a case provider under `op` (the name `--ops` selects); `ops`: the `Case.op` names its cases carry
    (default: `op` alone)."""

    def deco(fn):
        _PROVIDERS[op] = fn
        _OPS[op] = tuple(ops) or (op,)
        return fn

    return deco


def providers() -> dict[str, Callable]:
    _load_builtin()
    return dict(_PROVIDERS)


def declared_ops() -> dict[str, tuple[str, ...]]:
    """Provider name -> the op names of its cases."""
    return {name: _OPS.get(name, (name,)) for name in providers()}


def collect(shapes: ModelShapes, device: torch.device, ops: list[str] | None = None,
            on_error: Callable[[str, Exception], None] | None = None) -> list[Case]:
    """Cases of the selected providers (all when `ops` is empty). `ops` holds provider names (all their cases)
    or case op names (`declared_ops`; those cases and the baselines of their groups). A provider that raises is
    reported to `on_error(name, exc)` and skipped, or re-raised when `on_error` is None.
    Cases with the same (op, variant, shape) from two providers (e.g. the cuBLAS baseline that
    both "linear" and "w12" register) are kept once, the first provider's."""
    provs = providers()
    decl = declared_ops()
    wanted_ops: set[str] = set()
    if ops:
        case_ops = {o for names in decl.values() for o in names}
        unknown = [o for o in ops if o not in provs and o not in case_ops]
        if unknown:
            raise ValueError(f"unknown op(s) {', '.join(unknown)}; pass one of {', '.join(known_ops())}")
        wanted_ops = {o for o in ops if o not in provs}
    out: list[Case] = []
    seen: set[tuple[str, str, str]] = set()
    for name, fn in provs.items():
        whole = not ops or name in ops
        if not whole and not wanted_ops & set(decl.get(name, (name,))):
            continue
        try:
            cases = fn(shapes, device)
        except Exception as e:
            if on_error is None:
                raise
            on_error(name, e)
            continue
        if not whole:  # the selected ops' cases and the baselines of their groups
            keep = {(c.group, c.baseline) for c in cases if c.op in wanted_ops}
            cases = [c for c in cases if c.op in wanted_ops or (c.group, c.variant) in keep]
        for c in cases:
            key = (c.op, c.variant, c.shape)
            if key not in seen:
                seen.add(key)
                out.append(c)
    return out


def known_ops() -> list[str]:
    """Every name `--ops` takes: each provider, then its case ops, as "provider (op, op, ...)"."""
    return [name + (f" ({', '.join(o for o in ops if o != name)})" if set(ops) - {name} else "")
            for name, ops in declared_ops().items()]


_LOAD_ERRORS: dict[str, str] = {}


def load_errors() -> dict[str, str]:
    """Case modules that failed to import (module -> error), so one broken operator package
    does not take the other benchmarks down with it. Callers should print these."""
    _load_builtin()
    return dict(_LOAD_ERRORS)


def _load_builtin() -> None:
    import importlib
    import pkgutil

    from . import cases

    for m in pkgutil.iter_modules(cases.__path__):
        name = f"{cases.__name__}.{m.name}"
        try:
            importlib.import_module(name)
            _LOAD_ERRORS.pop(name, None)
        except Exception as e:
            _LOAD_ERRORS[name] = f"{type(e).__name__}: {e}"


def rotations(bytes_per_set: float, device: torch.device, l2_multiple: float = 3.0, cap: int = 16) -> int:
    """How many input sets to rotate so each call reads cold data (sets x bytes > 3 x L2)."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return int(min(cap, max(1, -(-l2_multiple * l2 // max(bytes_per_set, 1)))))
