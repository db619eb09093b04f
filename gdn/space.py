"""Search spaces of the GDN tree-verify kernels for `autotune.tune`: the Triton WY kernel (`WYConfig`,
variant "wy") and the CUDA C++ kernel (`CudaConfig`, variant "cuda", the default on sm_80+).

Shapes are dicts {"B" requests, "M" nodes per request, "H" key heads, "HV" value heads, "K", "V"}: one
layer's call on B draft trees of M nodes. The tuned key is the one `configs.wy_config` / `cuda_config` look
up, `B<bucket>-K<K>-M<bucket>-V<V>`. The choices are the fields `WYConfig` and `CudaConfig` document;
`pieces=2` (16 mantissa bits of the state) and the diagnostic `skip`/`trace` fields are not choices: the
tuner only ranks configs that compute the exact result.
"""

from __future__ import annotations

import torch

import autotune
from autotune import bucket_m, shape_key
from autotune.tuner import SearchSpace

from .configs import CudaConfig, WYConfig, cuda_heuristic, wy_constexprs, wy_heuristic

__all__ = ["WY_SPACE", "CUDA_SPACE", "verify_flops_bytes"]

_SPLIT_ONLY = {"inverse_warps": 4, "inverse_stack": False, "inverse_loop": False, "inverse_maxnreg": None}


def verify_flops_bytes(shape) -> tuple[float, float]:
    """One layer: the WY form's products per (request, value head); q, k, v, g, beta and each request's fp32
    state read once, o written once (specpilot/bench/cases/gdn.py counts the same)."""
    b, m, h, hv, k, v = shape["B"], shape["M"], shape["H"], shape["HV"], shape["K"], shape["V"]
    t = b * m
    flops = float(b * hv * (4 * m * m * k + 4 * m * k * v + 4 * m * m * v))
    return flops, float(2 * t * h * k * 2 + t * hv * v * 2 + t * hv * 6 + b * hv * k * v * 4 + t * hv * v * 2)


def _key(shape) -> str:
    return shape_key(B=bucket_m(shape["B"]), M=shape["M"], K=shape["K"], V=shape["V"])


def _device():
    return torch.device("cuda" if autotune.has_cuda() else "cpu")


def _wy_config(p: dict) -> WYConfig:
    """The split-only fields are ignored by the other inverses: they take their defaults, so the tuner sees one
    config (and times it once) however they were drawn."""
    p = dict(p)
    if p["inverse"] != "split":
        p.update(_SPLIT_ONLY)
    cfg = WYConfig(**p)
    wy_constexprs(cfg)  # the launcher's own validation: ValueError prunes the choice
    return cfg


def _wy_valid(p: dict, shape) -> str | None:
    if p["BV"] > shape["V"] or shape["V"] % p["BV"]:
        return f"divisibility: BV={p['BV']} does not divide V={shape['V']}"
    return None


WY_SPACE = SearchSpace(
    op="gdn.tree_verify", variant="wy",
    params={"inverse": ["square", "loop", "fold", "split"], "BV": [32, 64], "num_warps": [4, 8],
            "stack": [False, True], "pdl": [False, True], "maxnreg": [None, 128, 168],
            "inverse_warps": [4, 8], "inverse_stack": [False, True], "inverse_loop": [False, True],
            "inverse_maxnreg": [None, 128]},
    make_config=_wy_config, flops_bytes=verify_flops_bytes, valid=_wy_valid,
    heuristic=lambda s: wy_heuristic(s["M"], s["K"], s["V"], _device(), batch=s["B"], HV=s["HV"]), key=_key,
)


def _cuda_valid(p: dict, shape) -> str | None:
    if shape["V"] % p["BV"]:
        return f"divisibility: BV={p['BV']} does not divide V={shape['V']}"
    if p["split_warps"] and p["BV"] < 16:
        return "variant: split_warps needs two groups of mma warps (BV >= 16)"
    threads = (p["BV"] // 8 + 1) * 32
    if p["min_blocks"] * threads > 2048:
        return f"registers: {p['min_blocks']} CTAs of {threads} threads exceed the SM's 2048 threads"
    return None


CUDA_SPACE = SearchSpace(
    op="gdn.tree_verify", variant="cuda",
    params={"BV": [16, 32, 64], "pdl": [False, True], "min_blocks": [1, 2, 3], "split_warps": [False, True],
            "unroll_out": [1, 2, 4, 8], "unroll_ks": [2, 4, 8]},
    make_config=lambda p: CudaConfig(**p), flops_bytes=verify_flops_bytes, valid=_cuda_valid,
    heuristic=lambda s: cuda_heuristic(s["V"]), key=_key,
)
