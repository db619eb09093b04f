"""Launch-config mechanism shared by every operator.

* Each kernel variant's launch config is a frozen dataclass; an analytical heuristic gives
  the default.
* Tuned configs are data: one JSON file per GPU (`autotune/configs/<gpu-slug>.json`, or the
  folder named by SPECPILOT_CONFIG_DIR), keyed ``op/variant/<shape bucket>``, with M bucketed
  to powers of two.
* `force(...)` is a scoped context manager that pins a variant or a config (tests, tuning).

Two files per GPU: the shipped one (`autotune/configs/<gpu-slug>.json`, or SPECPILOT_CONFIG_DIR) and the
user's own (`<cache>/configs/<gpu-slug>.json`, where <cache> is SPECPILOT_CACHE_DIR, else
$XDG_CACHE_HOME/specpilot, else ~/.cache/specpilot). A user entry takes precedence over the shipped entry
of the same key; each file passes the mismatch policy on its own. A file that is not valid JSON or not a
tuned-config file is ignored with a warning (once per file and process).

Mismatch policy: a tuned file records the GPU, torch, Triton and library versions it was
tuned with. Entries are used when the GPU name matches. When the Triton major.minor differs
the file is ignored (configs may not even compile) and a warning is emitted once; set
SPECPILOT_TUNED_CONFIGS=any to use it anyway, or =off to never use tuned configs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
from importlib import metadata
import os
import warnings
from pathlib import Path
from typing import Any, Callable, TypeVar

from .hardware import gpu_name, gpu_slug, has_cuda, is_interpreter

__all__ = [
    "bucket_m",
    "shape_key",
    "force",
    "forced",
    "get_config",
    "tuned_file",
    "load_tuned",
    "store_tuned",
    "versions",
]

T = TypeVar("T")

_FORCED: contextvars.ContextVar[dict] = contextvars.ContextVar("specpilot_forced", default={})


def bucket_m(m: int) -> int:
    """Round M up to a power of two (1, 2, 4, ...)."""
    if m < 1:
        raise ValueError(f"M must be >= 1, got {m}")
    return 1 << (int(m) - 1).bit_length()


def shape_key(**dims: int) -> str:
    """Canonical shape bucket: M is bucketed, other dims kept, keys sorted. `M1-K5120-N17408`."""
    parts = []
    for k in sorted(dims):
        v = bucket_m(dims[k]) if k == "M" else int(dims[k])
        parts.append(f"{k}{v}")
    return "-".join(parts)


@contextlib.contextmanager
def force(op: str, *, variant: str | None = None, config: Any = None):
    """Pin `op` to `variant` and/or `config` inside the `with` block (thread/task local)."""
    if variant is None and config is None:
        raise ValueError("force() needs a variant, a config, or both")
    cur = dict(_FORCED.get())
    cur[op] = (variant, config)
    token = _FORCED.set(cur)
    try:
        yield
    finally:
        _FORCED.reset(token)


def forced(op: str) -> tuple[str | None, Any]:
    return _FORCED.get().get(op, (None, None))


# --------------------------------------------------------------------------------------
# Tuned configs as data.
# --------------------------------------------------------------------------------------


@functools.cache
def versions() -> dict[str, str]:
    import torch

    try:
        import triton

        tv = triton.__version__
    except ImportError:  # pragma: no cover - triton is a hard dependency on GPU machines
        tv = "none"
    try:
        pv = metadata.version("specpilot")  # the distribution, not the package: autotune imports nothing above it
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        pv = "0+unknown"
    return {"torch": torch.__version__, "triton": tv, "cuda": str(torch.version.cuda), "specpilot": pv}


def _config_dir() -> Path:
    return Path(os.environ.get("SPECPILOT_CONFIG_DIR") or Path(__file__).parent / "configs")


def _user_dir() -> Path:
    root = os.environ.get("SPECPILOT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "specpilot")
    return Path(root) / "configs"


def tuned_file(device=None, *, user: bool = False) -> Path:
    """The shipped tuned-config file of this GPU, or with `user=True` the user's own (module doc)."""
    return (_user_dir() if user else _config_dir()) / f"{gpu_slug(device)}.json"


_WARNED: set[str] = set()


def _read_file(path: Path) -> dict:
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("meta"), dict) or not isinstance(data.get("entries"), dict):
        raise ValueError(f"{path}: not a tuned-config file (needs 'meta' and 'entries')")
    return data


_TUNED: dict[tuple[str, str], dict] = {}


def load_tuned(device=None) -> dict:
    """Entries of the tuned file for this GPU after the mismatch policy; {} when none apply.

    Read once per (GPU, policy) and process; `store_tuned` invalidates it."""
    k = (gpu_slug(device) if has_cuda() else "cpu", os.environ.get("SPECPILOT_TUNED_CONFIGS", "match"))
    if k not in _TUNED:
        _TUNED[k] = _read_tuned(device)
    return _TUNED[k]


def _read_tuned(device=None) -> dict:
    policy = os.environ.get("SPECPILOT_TUNED_CONFIGS", "match")
    if policy == "off" or not has_cuda() or is_interpreter():
        return {}
    return {**_read_one(tuned_file(device), policy, device), **_read_one(tuned_file(device, user=True), policy, device)}


def _read_or_warn(path: Path) -> dict | None:
    """The parsed file, or None (with a warning once) when it is not valid JSON or not a tuned-config file."""
    try:
        return _read_file(path)
    except (OSError, ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        if str(path) not in _WARNED:
            _WARNED.add(str(path))
            warnings.warn(f"autotune.load_tuned: ignoring {path}: {e}; fix or delete the file", stacklevel=4)
        return None


def _read_one(path: Path, policy: str, device=None) -> dict:
    if not path.exists():
        return {}
    data = _read_or_warn(path)
    if data is None:
        return {}
    meta = data["meta"]
    if meta.get("gpu") and meta["gpu"] != gpu_name(device):
        return {}
    mine = versions()["triton"].split(".")[:2]
    theirs = str(meta.get("triton", "")).split(".")[:2]
    if policy != "any" and mine != theirs:
        if str(path) not in _WARNED:
            _WARNED.add(str(path))
            warnings.warn(
                f"{path} was tuned with Triton {meta.get('triton')}, this is {versions()['triton']}: "
                "ignoring it (set SPECPILOT_TUNED_CONFIGS=any to use it anyway)",
                stacklevel=3,
            )
        return {}
    return data["entries"]


def store_tuned(op: str, variant: str, key: str, config: Any, *, device=None, extra: dict | None = None,
                user: bool = False) -> Path:
    """Write one tuned entry (a dataclass) into this GPU's file (the user's own with `user=True`), stamping
    versions in `meta`. A corrupt file is replaced, with the warning `load_tuned` gives."""
    path = tuned_file(device, user=user)
    data = (_read_or_warn(path) if path.exists() else None) or {"meta": {}, "entries": {}}
    data["meta"] = {"gpu": gpu_name(device), **versions()}
    entry = dataclasses.asdict(config)
    if extra:
        entry["_"] = extra
    data["entries"][f"{op}/{variant}/{key}"] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    _forget_tuned()
    return path


def drop_tuned(op: str, variant: str, key: str, *, device=None, user: bool = False) -> bool:
    """Remove one tuned entry from this GPU's file (the user's own with `user=True`); False if it was not there."""
    path = tuned_file(device, user=user)
    if not path.exists():
        return False
    data = json.loads(path.read_text())
    if data.get("entries", {}).pop(f"{op}/{variant}/{key}", None) is None:
        return False
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    _forget_tuned()
    return True


def _forget_tuned() -> None:
    """The tuned file changed: re-read it, and re-plan every operator (plans hold configs)."""
    from .dispatch import clear_plans  # dispatch imports this module

    _TUNED.clear()
    clear_plans()


def get_config(op: str, variant: str, cls: type[T], heuristic: Callable[[], T], *, key: str, device=None) -> T:
    """The launch config for one call: forced > tuned JSON entry > analytical heuristic."""
    _, cfg = forced(op)
    if cfg is not None:
        if not isinstance(cfg, cls):
            raise TypeError(f"force({op!r}, config=...) expects a {cls.__name__}, got {type(cfg).__name__}")
        return cfg
    entry = load_tuned(device).get(f"{op}/{variant}/{key}")
    if entry is not None:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in entry.items() if k in fields})
    return heuristic()
