"""Repairs for three known bugs of Triton's CPU interpreter (TRITON_INTERPRET=1).

1. `tl.dot` on bf16 operands: the interpreter keeps bf16 as raw uint16 and multiplies the
   raw bit patterns (Triton 3.6-3.9), so every bf16 dot is wrong. We widen bf16 to fp32
   exactly (a 16-bit shift) before the product.
2. With numpy >= 2.4, `int()` of a 1-element (not 0-d) array raises, and the interpreter's
   `tensor.__index__` does exactly that, so `for i in range(n)` over a tensor bound fails
   (Triton 3.6). We index with `.item()` instead.
3. fp32 -> bf16 casts (`x.to(tl.bfloat16)`) truncate the mantissa in the interpreter, where the GPU
   rounds to nearest even (Triton 3.6). We round to nearest even, NaN kept a quiet NaN.

`import autotune` calls `apply()` when TRITON_INTERPRET=1 is set, and every operator imports
autotune before it launches a kernel, so no caller needs to. `apply()` is idempotent; each repair
is checked by `tests/test_interpreter_fixes.py`.
Only the interpreter module is touched: compiled GPU kernels are unaffected.
"""

from __future__ import annotations

import functools

__all__ = ["apply"]


@functools.cache
def apply() -> bool:
    """Install the repairs. Returns False when Triton is not installed."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False

    builder_cls = interp.InterpreterBuilder
    orig_dot = builder_cls.create_dot

    def _widen(h):
        if h.dtype.scalar == tl.bfloat16:
            data = (h.data.astype(np.uint32) << 16).view(np.float32)
            return interp.TensorHandle(data, tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, _widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = create_dot

    orig_patch_tensor = interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        orig_patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0].item()))

    interp._patch_lang_tensor = _patch_lang_tensor

    orig_cast = builder_cls.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f = np.ascontiguousarray(src.data, dtype=np.float32)
            bits = f.view(np.uint32).astype(np.uint64)
            rne = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            out = np.where(np.isnan(f), ((bits >> 16) | 0x40).astype(np.uint16), rne)
            return interp.TensorHandle(out, tl.bfloat16)
        return orig_cast(self, src, dst_type)

    builder_cls.cast_impl = cast_impl
    return True
