"""Triton launches with less host work per call, for the operators' eager paths.

`JITFunction.run` does per call: its binder (each argument's specialization, the same C++ Triton uses), a cache
key built from that specialization and `str(options)`, a check that the kernel's global values have not changed,
the grid's canonicalisation and the launcher. `launch(fn, grid, *args, **kwargs)` keeps the binder and the
launcher and drops the rest: it keys its own cache of compiled kernels by the binder's specialization (so a kernel
is reused exactly where Triton would reuse it) and the launch options, and calls the compiled kernel's launcher.
On the H200's host, one launch of tree_attn's split kernel (45 arguments) took 57 µs through `fn[grid](...)`, of
which the binder took 17 and the launcher 17.

The first call of a specialization, a launch hook (profilers), a function with pre-run hooks, the interpreter, or a
Triton without these internals go through `fn[grid](...)` itself.
"""

import torch

_KERNELS: dict = {}  # (fn, device, specialization, options) -> compiled kernel


def _binder(fn, device):
    try:
        return fn.device_caches[device][4]
    except (AttributeError, IndexError, KeyError, TypeError):
        return None


def _hooked(knobs) -> bool:
    """Whether a launch hook is set (a profiler's): Triton keeps them in chains, empty when none is."""
    return any(h is not None and getattr(h, "calls", True)
               for h in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))


def launch(fn, grid: tuple, *args, **kwargs):
    """`fn[grid](*args, **kwargs)` for a `@triton.jit` function on the current CUDA device; returns the compiled
    kernel. `grid`: a tuple of 1-3 ints."""
    from triton import knobs

    if getattr(fn, "device_caches", None) is None or _hooked(knobs) or getattr(fn, "pre_run_hooks", None):
        return fn[grid](*args, **kwargs)  # the interpreter's function; a profiler; the function's own run hooks
    device = torch.cuda.current_device()
    binder = _binder(fn, device)
    if binder is None:
        return fn[grid](*args, **kwargs)
    # the options JITFunction.run adds before its binder, so that the specialization and options are its own
    extra = {"debug": kwargs.get("debug", fn.debug) or knobs.runtime.debug,
             "instrumentation_mode": knobs.compilation.instrumentation_mode}
    bound, spec, options = binder(*args, **{**kwargs, **extra})
    key = (fn, device, tuple(spec), tuple(options.items()))
    try:
        kernel = _KERNELS.get(key)
    except TypeError:  # an option Triton takes that cannot be hashed: its own path
        return fn[grid](*args, **kwargs)
    if kernel is None:
        kernel = fn[grid](*args, **kwargs)  # compiles or finds it, and launches
        if getattr(kernel, "function", None) is not None and hasattr(kernel, "packed_metadata"):
            _KERNELS[key] = kernel
        return kernel
    g = tuple(grid) + (1, 1)
    kernel.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), kernel.function,
               kernel.packed_metadata, None, None, None, *bound.values())
    return kernel


def clear() -> None:
    """Forget the compiled kernels kept for `launch` (Triton's own caches keep theirs)."""
    _KERNELS.clear()
