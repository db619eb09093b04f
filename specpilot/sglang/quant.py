"""The `w12` quantization method for SGLang: BF16 linear weights packed losslessly at load time.

`W12Config` is a `QuantizationConfig` whose `get_config_filenames()` is `[]`, so SGLang builds it with
no arguments for `--quantization w12` on a plain BF16 checkpoint (and on a W12-packed one, which
`specpilot.sglang.checkpoint` decodes while SGLang reads it).

`W12LinearMethod`:
* `create_weights` makes the same BF16 `weight` parameter as SGLang's unquantized method
  (`[sum(output_partition_sizes), input_size_per_partition]`, `input_dim=1`, `output_dim=0`, the
  layer's `weight_loader`), so SGLang's own loaders shard it for tensor parallelism (column-parallel
  along N, row-parallel along K) and fill the merged parts (QKV, gate/up) in place;
* `process_weights_after_loading` packs this rank's weight with `w12.pack`, decodes it again with
  `w12.unpack` and compares bit for bit; a mismatch raises `W12LoadError` and the server does not
  start. The BF16 weight is then released; the weight stays on the layer in the runtime layout
  (`w12.layout.TiledW12`: five buffers, `w12_tiles`, `w12_e0` and the escape list), the form the flow
  kernel streams;
* `apply` is `w12.matmul(x, packed, bias)` on that layout (the flow kernel on a GPU; docs/w12.md).

Per-row exponent windows make a merged weight's packing the same as packing each part alone and
stacking them, and a rank's N shard the same as the N slice of the packed whole
(`specpilot.sglang.sharding`). Embeddings and the LM head are never quantized by this method.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from typing import Any, Optional

import torch
from torch.nn import Parameter

import w12
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.quantization.base_config import LinearMethodBase, QuantizationConfig, QuantizeMethodBase
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.utils import set_weight_attrs
from w12.layout import TiledW12, tile

logger = logging.getLogger("specpilot.sglang")

__all__ = ["W12Config", "W12LinearMethod", "W12LoadError", "NAME"]

NAME = "w12"
_BUF = "w12_"  # layer buffers: w12_tiles, w12_e0, w12_esc_rowptr, w12_esc_col, w12_esc_val
_TENSORS = ("tiles", "e0", "esc_rowptr", "esc_col", "esc_val")  # w12.layout.TiledW12.tensors() order


class W12LoadError(RuntimeError):
    """A weight did not survive packing bit for bit: the server must not start on it."""


EXCLUDE_ENV = "SPECPILOT_SGLANG_W12_EXCLUDE"


class W12Config(QuantizationConfig):
    """`--quantization w12`. `exclude`: fnmatch patterns of layer prefixes kept in BF16 (default: the
    comma-separated patterns in $SPECPILOT_SGLANG_W12_EXCLUDE, since SGLang builds this config with no
    arguments), e.g. `*.mlp.down_proj,model.layers.0.*`."""

    def __init__(self, exclude: Optional[list[str]] = None):
        super().__init__()
        if exclude is None:
            exclude = [p.strip() for p in os.environ.get(EXCLUDE_ENV, "").split(",") if p.strip()]
        self.exclude = list(exclude)

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # the Triton and CUDA C++ kernels need sm_80+; CPU tensors take the PyTorch path

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # no file: SGLang builds W12Config() and the weights are packed at load

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "W12Config":
        return cls(exclude=config.get("exclude"))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        if isinstance(layer, LinearBase):
            if any(fnmatch.fnmatchcase(prefix, p) for p in self.exclude):
                return UnquantizedLinearMethod()
            return W12LinearMethod()
        return None  # embeddings, the LM head, MoE: SGLang's unquantized methods

    def get_scaled_act_names(self) -> list[str]:
        return []


def packed_weight(layer: torch.nn.Module) -> TiledW12:
    """The layer's weight in the runtime layout over its buffers (so `.to(device)` on the module moves it). The
    object is kept on the layer while its buffers are the same tensors: the flow kernel keeps launch state on it
    (programmatic dependent launch after a launch on the same weight)."""
    bufs = tuple(getattr(layer, _BUF + n) for n in _TENSORS)
    t = getattr(layer, "_w12_tiled", None)
    if t is None or any(a is not b for a, b in zip(t.tensors(), bufs)):
        t = TiledW12(*bufs, N=layer.w12_n, K=layer.w12_k)
        layer._w12_tiled = t
    return t


def pack_verified(weight: torch.Tensor, where: str = "weight") -> w12.W12Weight:
    """`w12.pack(weight, layout="planes")`, then `w12.unpack` compared with `weight` bit for bit; `W12LoadError` if
    not equal. The planes, as the layer's buffers hold them and `sharding` slices them by rows."""
    if weight.dtype != torch.bfloat16:
        raise W12LoadError(f"specpilot.sglang.w12: {where} is {weight.dtype}; W12 stores BF16 weights only; "
                           "load the model with --dtype bfloat16")
    try:
        p = w12.pack(weight, layout="planes")
    except w12.W12Error as e:
        raise W12LoadError(f"specpilot.sglang.w12: {where} {tuple(weight.shape)} failed W12 packing: {e}; "
                           "refusing to start on a changed weight") from e
    got = w12.unpack(p).view(torch.int16)
    want = weight.view(torch.int16)
    if got.shape != want.shape or not torch.equal(got, want):
        bad = int((got != want).sum()) if got.shape == want.shape else -1
        raise W12LoadError(f"specpilot.sglang.w12: {where} {tuple(weight.shape)}: w12.unpack(w12.pack(w)) differs from "
                           f"the loaded weight ({bad} elements); refusing to start on a changed weight. This is a bug "
                           "in w12: report it with the weight, and run without --quantization w12 meanwhile")
    return p


class W12LinearMethod(LinearMethodBase):
    """Linear layers on W12 weights: BF16 parameters for SGLang's loaders, packed after loading."""

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        weight = Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
                           requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        layer.w12_partition_sizes = list(output_partition_sizes)
        layer.w12_weight_attrs = {"input_dim": 1, "output_dim": 0, **extra_weight_attrs}
        layer.w12_k = None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "w12_k", None) is not None:
            return  # packed already (SGLang calls this again after a weight update that did not restore it)
        weight = layer.weight.data
        where = getattr(layer, "prefix", None) or type(layer).__name__
        p = pack_verified(weight, where)
        t = tile(p)
        del p  # the padded planes go; the runtime layout shares e0 and the escape list
        for name, buf in zip(_TENSORS, t.tensors()):
            layer.register_buffer(_BUF + name, buf, persistent=False)
        layer.w12_k = t.K
        layer.w12_n = t.N
        layer._w12_tiled = t
        # release the BF16 copy; keep a 0-element parameter of the same dtype and device for code that reads
        # layer.weight.dtype / .device
        layer.weight = Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False)
        layer.w12_bits_per_weight = t.bits_per_weight

    def restore_weights_before_loading(self, layer: torch.nn.Module) -> None:
        """SGLang's weight updates (`update_weights_from_*` between `begin_weight_update` and
        `end_weight_update`) call this first: the BF16 parameter comes back (decoded, bit for bit, with its weight
        loader), the packed buffers go, and `process_weights_after_loading` packs the new weights again."""
        if getattr(layer, "w12_k", None) is None:
            return
        w = w12.unpack(packed_weight(layer))
        weight = Parameter(w, requires_grad=False)
        set_weight_attrs(weight, layer.w12_weight_attrs)
        layer.weight = weight
        for name in _TENSORS:
            delattr(layer, _BUF + name)
        layer._w12_tiled = None
        layer.w12_k = None

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return w12.matmul(x, packed_weight(layer), bias)
