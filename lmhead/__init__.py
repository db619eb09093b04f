"""A certified greedy LM head: a cheap screen with a rigorous bound drops the tokens that cannot win,
and the survivors are recomputed exactly, so `argmax` and `topk` equal the exact head's, always.

* `CertifiedHead(weight, screen="auto")`: a BF16 head `[V, H]` or a `w12.W12Weight`; screens "int8"
  (an INT8 copy with BF16 group scales), "int4" (codes in [-7, 7] two to a byte, the same scales: half the
  bytes, a looser bound), "w12" (the W12 8-bit view: no second copy), "none".
* `.argmax(hidden)`, `.topk(hidden, k)`, `.logits(hidden)`, `.stats()`; `argmax` answers `NAN_ID` (-1) for a
  row whose exact logits hold a NaN.
* `screen_bounds(head, hidden)`: the interval [L, U] of every exact logit.
* `exact_logits_reference`, `argmax_reference`: fp64 oracles. docs/lmhead.md derives the bound.
* Early fallback: after a call whose rows overflowed the capacity, the next calls with as many rows skip the
  screen for a run of calls (doubling up to `MAX_SKIP`); `early_fallback_reference` models its decisions.
"""

from .ops import DEFAULT_CAPACITY, GROUP, MAX_SKIP, NAN_ID, SCREENS, VARIANTS, CertifiedHead, screen_bounds
from .reference import argmax_reference, early_fallback_reference, exact_logits_reference, int8_screen_reference

__all__ = ["CertifiedHead", "screen_bounds", "SCREENS", "DEFAULT_CAPACITY", "GROUP", "VARIANTS", "NAN_ID", "MAX_SKIP",
           "exact_logits_reference", "argmax_reference", "int8_screen_reference", "early_fallback_reference"]

_SUBMODULES = ("configs", "kernels", "ops", "reference", "space")


def __getattr__(name):
    # submodules that `import lmhead` does not load, on first attribute access (`lmhead.space.HEAD_SPACE`)
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
