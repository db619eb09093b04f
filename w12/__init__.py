"""W12: lossless 12-bit storage for BF16 weights (docs/w12-format.md) and its GEMM kernels.

`matmul`, `matmul_q8` and `matmul_tiled` live in `w12.ops` (the kernels) and are imported on first use, as is every
submodule named as an attribute (`w12.configs.MmaConfig`, `w12.hf`, `w12.checkpoint`): `import w12`
loads neither Triton nor transformers.
"""

from __future__ import annotations

import sys

import torch

from .errors import W12CheckpointError, W12CorruptFileError, W12Error, W12FormatError, W12VerificationError
from .format import FORMAT_VERSION, W12Weight, pack, unpack
from .io import load_file, save_file
from .layout import TiledW12
from .nn import ConversionReport, W12Linear, convert, load_model_weights
from .reference import (
    decode_q8,
    matmul_q8_reference,
    matmul_reference,
    pack_reference,
    unpack_reference,
)

torch.serialization.add_safe_globals([W12Weight, TiledW12])

if "transformers" in sys.modules:
    # transformers is already loaded: register the "w12" quantization method (w12/hf.py) so that
    # from_pretrained on a W12 checkpoint cannot fall back to a model with re-initialised linears.
    # Without transformers, nothing is imported; `import w12.hf` registers it explicitly.
    from . import hf as _hf  # noqa: F401

__all__ = [
    "FORMAT_VERSION",
    "W12Weight",
    "TiledW12",
    "pack",
    "unpack",
    "W12Error",
    "W12FormatError",
    "W12VerificationError",
    "W12CorruptFileError",
    "W12CheckpointError",
    "save_file",
    "load_file",
    "W12Linear",
    "convert",
    "load_model_weights",
    "ConversionReport",
    "pack_reference",
    "unpack_reference",
    "decode_q8",
    "matmul_reference",
    "matmul_q8_reference",
    "matmul",
    "matmul_q8",
    "matmul_tiled",
    "matmul_swiglu",
    "pair_rows",
    "unpair_cols",
    "swiglu_reference",
]

_LAZY_OPS = ("matmul", "matmul_q8", "matmul_tiled", "matmul_swiglu", "pair_rows", "unpair_cols", "swiglu_reference")
_SUBMODULES = ("checkpoint", "codec", "configs", "cuda", "flow", "hf", "kernels", "layout", "ops", "space")


def __getattr__(name):
    if name in _LAZY_OPS:
        from . import ops

        return getattr(ops, name)
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'w12' has no attribute {name!r}")
