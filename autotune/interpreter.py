"""Repairs for three known bugs of Triton's CPU interpreter (TRITON_INTERPRET=1), and four speed-ups.

1. `tl.dot` on bf16 operands: the interpreter keeps bf16 as raw uint16 and multiplies the
   raw bit patterns (Triton 3.6-3.9), so every bf16 dot is wrong. We widen bf16 to fp32
   exactly (a 16-bit shift) before the product.
2. With numpy >= 2.4, `int()` of a 1-element (not 0-d) array raises, and the interpreter's
   `tensor.__index__` does exactly that, so `for i in range(n)` over a tensor bound fails
   (Triton 3.6). We index with `.item()` instead.
3. fp32 -> bf16 casts (`x.to(tl.bfloat16)`) truncate the mantissa in the interpreter, where the GPU
   rounds to nearest even (Triton 3.6). We round to nearest even, NaN kept a quiet NaN.

Speed-ups, same results (Triton 3.6; each is installed only where the private function it replaces exists):

4. A call of one `@triton.jit` function from another re-patches `triton.language` on every call
   (`InterpretedFunction.__call__` -> `_patch_lang`, an `inspect.getmembers` walk of four modules, about
   1 ms). Inside a grid launch whose patch already covers the callee's language modules the walk changes
   nothing (patched members are no longer builtins, the rest are replaced by equivalent functions), so
   the call goes straight to the rewritten function. Kernels with a helper called in a loop (GDN's tree
   walks) spent a quarter of their interpreted time there.
5. `_get_np_dtype` rebuilt its 18-entry dtype table on every call; the table is built once.
6. Integer `+`, `-` and `*` on tensors narrower than 64 bits are checked for overflow
   (`sanitize_overflow`): the operation is redone in int64 and compared with the type's range, and
   the result goes to `device_assert`, which does nothing unless the builder's `debug` option is set.
   The interpreter's builder never sets it, so the check computed values nobody read: a third of
   the interpreted time of integer-heavy kernels (the W12 SwiGLU epilogue's, tree attention's index
   arithmetic). Where `debug` is off, `sanitize_overflow` is off with it.
7. Every tensor and block type the interpreter makes carries its shape as a `triton.language.tuple`, whose
   `tuple_type` formatted its printable name (`[:constexpr_type[16],...]`) when it was made: millions of
   strings a test module, printed only in error messages. The name is formatted when it is read.

`import autotune` calls `apply()` when TRITON_INTERPRET=1 is set, and every operator imports
autotune before it launches a kernel, so no caller needs to. `apply()` is idempotent; each repair
is checked by `tests/test_interpreter_fixes.py`.
Only the interpreter module is touched, and `triton.language`'s tuple type, whose printable name becomes a property
of the same value: compiled GPU kernels are unaffected.
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
    _skip_repeated_lang_patches(interp, tl)
    _cache_np_dtype_table(interp, tl, np)
    _overflow_checks_only_with_asserts(interp)
    _tuple_type_names_when_read(tl)
    return True


def _tuple_type_names_when_read(tl) -> None:
    """Speed-up 7 of the module docstring: `tuple_type.name` a property. Installed only where the original
    constructor sets exactly `types`, `fields` and a `name` equal to the property's."""
    cls = getattr(tl.core, "tuple_type", None)
    if cls is None or isinstance(vars(cls).get("name"), property):
        return

    def name(self):
        return "[" + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + "]"

    probe = cls([tl.constexpr_type(16), tl.float32], ["a", "b"])
    if set(vars(probe)) != {"types", "fields", "name"} or probe.name != name(probe):
        return

    def __init__(self, types, fields=None):
        self.types = types
        self.fields = fields or [""] * len(types)

    cls.__init__ = __init__
    cls.name = property(name)


def _overflow_checks_only_with_asserts(interp) -> None:
    """Speed-up 6 of the module docstring: the builders' options get `sanitize_overflow = debug`."""
    import dataclasses

    builder_cls = getattr(interp, "InterpreterBuilder", None)
    opts = getattr(interp, "InterpreterOptions", None)
    if builder_cls is None or opts is None or not {"debug", "sanitize_overflow"} <= {
            f.name for f in dataclasses.fields(opts)}:
        return

    def quiet(builder):
        o = builder.options
        if o.sanitize_overflow and not o.debug:
            builder.options = dataclasses.replace(o, sanitize_overflow=False)

    orig_init = builder_cls.__init__

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        quiet(self)

    builder_cls.__init__ = __init__
    for v in vars(interp).values():  # the module's own builder, made at import
        if isinstance(v, builder_cls):
            quiet(v)


def _lang_modules(fn, tl) -> frozenset:
    """The `triton.language` modules visible to `fn`: the ones `_patch_lang(fn)` patches."""
    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def _skip_repeated_lang_patches(interp, tl) -> None:
    """Speed-up 4 of the module docstring."""
    fn_cls = getattr(interp, "InterpretedFunction", None)
    orig_patch_lang = getattr(interp, "_patch_lang", None)
    scope_cls = getattr(interp, "_LangPatchScope", None)
    if fn_cls is None or orig_patch_lang is None or scope_cls is None or not hasattr(fn_cls, "rewrite"):
        return
    patched: set = set()  # ids of the language modules patched by the grid launch that runs now

    def _patch_lang(fn):
        scope = orig_patch_lang(fn)
        patched.update(_lang_modules(fn, tl))
        restore = scope.restore

        def restore_and_forget():
            patched.clear()
            restore()

        scope.restore = restore_and_forget
        return scope

    def __call__(self, *args, **kwargs):
        if not patched or not _lang_modules(self.fn, tl) <= patched:
            return orig_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    orig_call = fn_cls.__call__
    interp._patch_lang = _patch_lang
    fn_cls.__call__ = __call__


def _cache_np_dtype_table(interp, tl, np) -> None:
    """Speed-up 5 of the module docstring: `_get_np_dtype` with its table built once."""
    orig = getattr(interp, "_get_np_dtype", None)
    if orig is None:
        return
    table = {}
    for name in ("int1", "float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
                 "int64", "uint64", "bfloat16", "float8e5", "float8e5b16", "float8e4nv", "float8e4b8", "float8e4b15"):
        ty = getattr(tl, name, None)
        if ty is not None:
            table[ty] = orig(ty)
    u64 = np.dtype(np.uint64)

    def _get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return u64
        if isinstance(tt_dtype, tl.block_type):
            if isinstance(tt_dtype.element_ty, tl.pointer_type):
                return u64
            return table[tt_dtype.element_ty]
        return table[tt_dtype]

    interp._get_np_dtype = _get_np_dtype
