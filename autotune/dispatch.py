"""The dispatch types every operator shares: `Variants` (the registry), `Plan` (one call's decision)
and `PlanCache` (plans by shape key).

An operator's `ops.py` declares `VARIANTS = autotune.Variants(...)`, turns each call into one
`Plan` in a single `_plan(...)` function, caches it in a `PlanCache` under a key that holds
everything the decision reads (shape bucket, dtypes, device, the forced variant and config), and
launches from the plan alone. `clear_plans()` empties every cache; `store_tuned` and `drop_tuned`
call it, so a newly tuned entry is used by the next call.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Hashable, NamedTuple

import torch

from .config import forced
from .hardware import compute_capability, has_cuda, host_only, is_interpreter

__all__ = ["Variants", "Plan", "PlanCache", "clear_plans", "which_variant"]


class Plan(NamedTuple):
    """What one call runs. `variant`: the variant asked for or chosen by GPU generation ("mma", "cuda");
    `kernel`: what the launch runs for it ("tc", "gemv", "wy", "reference"); `config`: that kernel's
    launch config (a frozen dataclass), None where it has none."""

    variant: str
    kernel: str
    config: Any = None


@dataclasses.dataclass(frozen=True)
class Variants:
    """An operator's kernel variants. `by_arch` maps a compute-capability major to the default variant,
    `known` lists every name a caller may ask for, `fallback` is the torch path: the only variant that runs
    CPU tensors without the Triton interpreter. `portable`: the Triton variant the interpreter runs, where the
    smallest `by_arch` entry is a CUDA C++ variant (which never runs there). `cuda_only`: variants that run on CUDA
    tensors only, under the interpreter too (a CUDA C++ kernel asked for by name): `choose` refuses them for other
    tensors with that reason. `public=False` keeps an internal table out of the registry that `which_variant` reads
    (one public table per op name)."""

    op: str
    by_arch: dict[int, str]
    known: tuple[str, ...]
    fallback: str = "torch"
    portable: str | None = None
    cuda_only: tuple[str, ...] = ()
    public: bool = dataclasses.field(default=True, compare=False)

    def __post_init__(self):
        stray = [v for v in (*self.by_arch.values(), self.fallback, self.portable or self.fallback, *self.cuda_only)
                 if v not in self.known]
        if stray:
            raise ValueError(f"autotune.Variants({self.op!r}): {stray} are not in known={self.known}")
        if self.public:
            _REGISTRY[self.op] = self

    def check(self, variant: str, where: str | None = None) -> str:
        """`variant` itself, or a ValueError (prefixed `where`, default `op`) that lists the known ones."""
        if variant not in self.known:
            raise ValueError(f"{where or self.op}: unknown variant {variant!r}; choose one of {self.known}")
        return variant

    def default(self, device: torch.device | None = None) -> str:
        """The variant for `device` (a torch device; None: the current CUDA device) by GPU generation.

        The entry of the device's compute-capability major; else the largest major below it, never 9
        (sm_90 variants use Hopper-only instructions). Under the interpreter `portable`, else the smallest
        key; `fallback` for CPU tensors without the interpreter and where no key fits."""
        if is_interpreter():
            return self.portable or (self.by_arch[min(self.by_arch)] if self.by_arch else self.fallback)
        if not has_cuda() or (device is not None and torch.device(device).type != "cuda"):
            return self.fallback
        index = None if device is None else torch.device(device).index
        major = compute_capability(index)[0]
        if major in self.by_arch:
            return self.by_arch[major]
        below = [k for k in self.by_arch if k <= major and k != 9]
        return self.by_arch[max(below)] if below else self.fallback

    def choose(self, variant: str | None, device: torch.device | None = None, where: str | None = None
               ) -> tuple[str, bool]:
        """(variant, by_name): the `variant=` keyword, else the variant `autotune.force(op, ...)` pins,
        else `default(device)`. `by_name` is True when the caller named it: a named variant that cannot
        take the call raises, an automatic one may fall back to another kernel. A named variant other than
        `fallback` on CPU tensors without the Triton interpreter raises here: no kernel of it can run there,
        and running the torch path under its name would hide that."""
        if variant is None:
            variant = forced(self.op)[0]
        if variant is None:
            return self.default(device), False
        self.check(variant, where)
        if variant in self.cuda_only and (device is None or torch.device(device).type != "cuda"):
            raise ValueError(f"{where or self.op}: variant {variant!r} is a CUDA C++ kernel and the tensors are on "
                             f"{device}; pass CUDA tensors, or variant=None")
        if variant != self.fallback and device is not None and host_only(device):
            raise ValueError(
                f"{where or self.op}: variant {variant!r} cannot run on CPU tensors without the Triton interpreter; "
                f"start Python with TRITON_INTERPRET=1 set (before torch or triton is imported) to run it under "
                f"the interpreter, or pass variant=None or {self.fallback!r} for the torch path")
        return variant, True

    def pick(self, variant: str | None = None, device: torch.device | str | None = None) -> str:
        """The variant a call on `device` (a torch device or its name; None: the current CUDA device, or the CPU
        where there is no GPU) runs for `variant=` (None: the automatic choice, or what `autotune.force`
        pins in this scope). Raises as the call would for a variant that cannot run there. Where a CUDA C++
        variant ("mma", "cuda") cannot take a call (fp16 inputs, shapes it does not cover), an automatic
        choice runs the generation's Triton kernel: the call's `autotune.Plan` names the kernel."""
        if device is None:
            device = torch.device("cuda") if has_cuda() else torch.device("cpu")
        return self.choose(variant, torch.device(device))[0]


_REGISTRY: dict[str, Variants] = {}


def which_variant(op: str, device: torch.device | str | None = None, *, variant: str | None = None) -> str:
    """The variant a call of `op` ("w12.matmul", "gdn.tree_verify", ...) on `device` runs here: `Variants.pick`
    of the op's table. The op's package must be loaded (its `ops` module, e.g. `import w12.ops`)."""
    table = _REGISTRY.get(op)
    if table is None:
        raise ValueError(f"autotune.which_variant: no variant table for {op!r} is loaded (loaded: {sorted(_REGISTRY)}); "
                         f"import the operator's ops module first, e.g. import {op.split('.')[0]}.ops")
    return table.pick(variant, device)


_CACHES: "weakref.WeakSet[PlanCache]" = weakref.WeakSet()


class PlanCache:
    """Plans of one operator by key. The key must hold everything `make` reads, so a hit is the plan
    that `make` would build again; at `limit` entries the cache starts over (shape sets are small)."""

    def __init__(self, limit: int = 4096):
        self._plans: dict[Hashable, Plan] = {}
        self._limit = limit
        _CACHES.add(self)

    def get(self, key: Hashable, make: Callable[[], Plan]) -> Plan:
        plan = self._plans.get(key)
        if plan is None:
            plan = make()
            if len(self._plans) >= self._limit:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


def clear_plans() -> None:
    """Forget every cached plan of every operator (after tuned configs change, or in tests)."""
    for cache in list(_CACHES):
        cache.clear()
