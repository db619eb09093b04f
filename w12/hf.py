"""Hugging Face `transformers` integration: the quantization method "w12" (config + `HfQuantizer`).

Importing this module registers both with transformers (`register_quantization_config`,
`register_quantizer`); import it before `from_pretrained` on a W12 checkpoint, or transformers
does not know the method.

    import w12.hf

    # convert while loading a BF16 checkpoint (packs after the weights are loaded)
    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16,
                                                 quantization_config=w12.hf.W12Config(exclude="lm_head"))
    # or convert a model in memory
    w12.hf.quantize(model, exclude="lm_head")

    model.save_pretrained(out_dir)                      # the version-1 planes, config names the W12 modules
    model = AutoModelForCausalLM.from_pretrained(out_dir)

`save_pretrained` (wrapped once by this module) refuses a model holding `W12Linear` layers that its
config's quantization_config does not list, as `from_pretrained` would re-initialise them at random.

Loading a W12 checkpoint is strict: the config lists the converted modules, which are replaced by
`W12Linear` shells before loading; every parameter and persistent buffer of the model must come
from the checkpoint (a missing or mismatched one raises `W12CheckpointError` instead of being
re-initialised), and every W12 weight is validated (deep) after loading. The escape lists are the
only tensors whose shape is data; the loader is told so (`param_needs_quantization`) and replaces
their placeholders whatever their length.

The W12 layers of a loaded or converted model hold the runtime layout (`w12.convert`'s default): the shells
take the version-1 planes by name, as the checkpoint stores them, and are tiled in place once validated
(a layer whose weight is on the meta device, as with offloading, keeps the planes).
"""

from __future__ import annotations

import functools
import re

import torch
from torch import nn
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .errors import W12CheckpointError, W12FormatError
from .format import FORMAT_VERSION
from .nn import _RESIZABLE, ConversionReport, W12Linear, convert

__all__ = ["QUANT_METHOD", "W12Config", "W12HfQuantizer", "quantize", "attach"]

QUANT_METHOD = "w12"
_RESIZABLE_LEAVES = tuple(f"w_{p}" for p in _RESIZABLE)  # W12Linear's escape-list buffers


def _patterns(p) -> list[str] | None:
    if p is None:
        return None
    return [p] if isinstance(p, str) else list(p)


class W12Config(QuantizationConfigMixin):
    """`quantization_config` for W12. `include` / `exclude`: fnmatch patterns on module names for
    converting while loading a BF16 checkpoint (as `w12.convert`); `modules`: the converted
    modules, filled in by the conversion and read when a W12 checkpoint is loaded."""

    def __init__(self, include=None, exclude=None, modules=None, format_version: int = FORMAT_VERSION,
                 quant_method: str = QUANT_METHOD, **kwargs):
        if quant_method != QUANT_METHOD:
            raise ValueError(f"W12Config: quant_method must be {QUANT_METHOD!r}, got {quant_method!r}")
        if int(format_version) != FORMAT_VERSION:
            raise W12CheckpointError(f"W12Config: checkpoint has W12 format version {format_version}, this w12 reads "
                                     f"{FORMAT_VERSION}; upgrade specpilot or re-convert the model")
        if kwargs:
            raise ValueError(f"W12Config: unknown fields {sorted(kwargs)}")
        self.quant_method = QUANT_METHOD
        self.include = _patterns(include)
        self.exclude = _patterns(exclude)
        self.modules = None if modules is None else sorted(modules)
        self.format_version = FORMAT_VERSION

    def to_dict(self) -> dict:
        return {"quant_method": QUANT_METHOD, "include": self.include, "exclude": self.exclude,
                "modules": self.modules, "format_version": self.format_version}


class W12HfQuantizer(HfQuantizer):
    """Loads W12 checkpoints strictly (`pre_quantized`), or converts a BF16 model after loading."""

    requires_calibration = False

    def __init__(self, quantization_config: W12Config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        if self.pre_quantized and quantization_config.modules is None:
            raise W12CheckpointError("the checkpoint's W12 quantization_config has no 'modules' list; it was not "
                                     "written by w12 (save with model.save_pretrained after w12.hf.quantize)")

    def _process_model_before_weight_loading(self, model, **kwargs):
        if not self.pre_quantized:
            return model
        for name in self.quantization_config.modules:
            try:
                mod = model.get_submodule(name)
            except AttributeError:
                raise W12CheckpointError(f"W12 checkpoint lists module {name!r}, which the model does not have; "
                                         f"the config and the architecture disagree") from None
            if type(mod) is not nn.Linear:
                raise W12CheckpointError(f"W12 checkpoint lists {name!r}, but it is a {type(mod).__name__}, not "
                                         f"an nn.Linear")
            shell = W12Linear.empty(mod.in_features, mod.out_features, bias=mod.bias is not None,
                                    device=mod.weight.device, dtype=mod.weight.dtype)
            model.set_submodule(name, shell)
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        # Read by the loader to allow a shape that differs from the placeholder: only the escape
        # lists, whose length is the weight's escape count.
        mod_name, _, leaf = param_name.rpartition(".")
        if not self.pre_quantized or leaf not in _RESIZABLE_LEAVES:
            return False
        try:
            return isinstance(model.get_submodule(mod_name), W12Linear)
        except AttributeError:
            return False

    def _process_model_after_weight_loading(self, model, **kwargs):
        if not self.pre_quantized:
            report = convert(model, include=self.quantization_config.include, exclude=self.quantization_config.exclude)
            self.quantization_config.modules = _w12_modules(model)
            model._w12_report = report
            return model
        ignore = list(getattr(model, "_keys_to_ignore_on_load_missing", None) or [])
        # The loader flags each tensor it set (and tied ones); anything else was created empty and
        # would be initialised at random.
        not_loaded = [k for k, t in model.state_dict(keep_vars=True).items()
                      if not getattr(t, "_is_hf_initialized", False)
                      and not any(re.search(p, k) for p in ignore)]
        if not_loaded:
            raise W12CheckpointError(
                f"W12 checkpoint: {len(not_loaded)} model tensors were not loaded (missing from the checkpoint or "
                f"of the wrong shape): {not_loaded[:8]}; refusing to initialise them at random")
        for name, mod in model.named_modules():
            if isinstance(mod, W12Linear):
                try:
                    mod.weight.validate(deep=True)
                except W12FormatError as e:
                    raise W12CheckpointError(f"W12 checkpoint: weight {name!r} is invalid: {e}") from e
                if mod.weight.device.type != "meta":
                    mod._retile()  # the runtime layout, as w12.convert gives (module doc)
        return model

    def is_serializable(self, safe_serialization=None) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def _w12_modules(model: nn.Module) -> list[str]:
    return sorted(n for n, m in model.named_modules() if isinstance(m, W12Linear))


def quantize(model, include=None, exclude=None, verify: bool = True) -> ConversionReport:
    """`w12.convert` a transformers model in place and attach the W12 quantization config and
    quantizer, so `model.save_pretrained` writes a checkpoint that `from_pretrained` loads back.
    (`w12.convert` and `w12.load_model_weights` attach them too when given a `PreTrainedModel`.)"""
    if not hasattr(model, "config"):
        raise TypeError(f"w12.hf.quantize: expects a transformers PreTrainedModel, got {type(model).__name__}; "
                        f"use w12.convert for other modules")
    report = convert(model, include=include, exclude=exclude, verify=verify)
    attach(model, include=include, exclude=exclude)
    return report


def attach(model, include=None, exclude=None) -> None:
    """Attach the W12 quantization config (listing the model's `W12Linear` modules) and quantizer to a
    transformers model, so `save_pretrained` records them and `from_pretrained` rebuilds the W12 layers
    instead of initialising plain linears at random."""
    if not hasattr(model, "config"):
        raise TypeError(f"w12.hf.attach: expects a transformers PreTrainedModel, got {type(model).__name__}; other "
                        "modules save with model.state_dict() and load into a converted model")
    cfg = W12Config(include=include, exclude=exclude, modules=_w12_modules(model))
    model.config.quantization_config = cfg
    model.hf_quantizer = W12HfQuantizer(cfg, pre_quantized=True)
    model.is_quantized = True
    model.quantization_method = QUANT_METHOD


def _check_saveable(model) -> None:
    """Refuse to save a model whose W12 layers its config does not list: `from_pretrained` would load their
    planes nowhere and initialise plain linears at random, without an error."""
    mods = _w12_modules(model)
    if not mods:
        return
    cfg = getattr(getattr(model, "config", None), "quantization_config", None)
    if isinstance(cfg, dict):
        listed = cfg.get("modules") if cfg.get("quant_method") == QUANT_METHOD else None
    else:
        listed = getattr(cfg, "modules", None) if getattr(cfg, "quant_method", None) == QUANT_METHOD else None
    if listed is None or sorted(listed) != mods:
        off = sorted(set(mods) ^ set(listed or ())) or mods
        lists = "no W12 quantization_config" if listed is None else f"a W12 quantization_config of {len(listed)}"
        raise W12CheckpointError(
            f"w12.hf.save_pretrained: the model holds {len(mods)} W12 layers but its config has {lists} (first "
            f"difference: {off[0]!r}), so from_pretrained would initialise layers at random; call "
            "w12.hf.attach(model) before saving (w12.convert and w12.hf.quantize on the whole model do it)")


def _guard_save_pretrained() -> None:
    """Wrap `PreTrainedModel.save_pretrained` (once) with `_check_saveable`."""
    from transformers import PreTrainedModel

    save = PreTrainedModel.save_pretrained
    if getattr(save, "_w12_checked", False):
        return

    @functools.wraps(save)
    def save_pretrained(self, *args, **kwargs):
        _check_saveable(self)
        return save(self, *args, **kwargs)

    save_pretrained._w12_checked = True
    PreTrainedModel.save_pretrained = save_pretrained


_guard_save_pretrained()
if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
    register_quantization_config(QUANT_METHOD)(W12Config)
if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
    register_quantizer(QUANT_METHOD)(W12HfQuantizer)
