"""Search space of the W12 tensor-core kernel (`w12_matmul_tc_kernel`, `TcConfig`) for `autotune.tune`.

Shapes are dicts {"M", "N", "K"} (M tokens, weight [N, K]); the tuned key is the one `w12.matmul` looks up,
`M<bucket>-K<K>-N<N>`. The checks below are the ones that make a choice unrunnable or pointless before any
compile: the cp.async ring must fit the SM's shared memory, the decoded weight tile must stay in registers,
each split of K must hold enough iterations for its pipeline, and a token tile wider than M only multiplies
padding.
"""

from __future__ import annotations

import torch

import autotune
from autotune.tuner import SearchSpace

from .configs import _MIN_ITERS_PER_SPLIT, _SMEM_PER_SM, TcConfig, _pow2, tc_heuristic

__all__ = ["TC_SPACE", "tc_flops_bytes", "tc_valid"]

_MAX_DECODED_PER_THREAD = 128  # int32 values of the decoded [BN, BK] tile per thread; past this it spills


def tc_flops_bytes(shape, *, q8: bool = False) -> tuple[float, float]:
    """One call: 2MNK FLOPs; the packed weight (1.5 bytes per weight, 1 for q8, K padded to 64, 5 bytes of
    escapes and scales per row), bf16 x and out."""
    m, n, k = shape["M"], shape["N"], shape["K"]
    kp = -(-k // 64) * 64
    return 2.0 * m * n * k, n * kp * (1.0 if q8 else 1.5) + 5 * n + 4 + 2 * m * k + 2 * m * n


def tc_valid(p: dict, shape) -> str | None:
    m, k = shape["M"], shape["K"]
    stage = p["block_n"] * p["block_k"] * 1.5 + p["block_k"] * p["block_t"] * 2
    if p["num_stages"] * stage > _SMEM_PER_SM:
        return f"shared memory: {p['num_stages']} stages x {stage:.0f} B > {_SMEM_PER_SM} B per SM"
    per_thread = p["block_n"] * p["block_k"] // (32 * p["num_warps"])
    if per_thread > _MAX_DECODED_PER_THREAD:
        return f"registers: the decoded tile holds {per_thread} values per thread (> {_MAX_DECODED_PER_THREAD})"
    iters = -(-(-(-k // 64) * 64) // p["block_k"])
    if p["split_k"] > 1 and iters < p["split_k"] * _MIN_ITERS_PER_SPLIT:
        return f"divisibility: {iters} K iterations do not give {p['split_k']} splits of {_MIN_ITERS_PER_SPLIT}"
    if p["block_t"] > max(16, _pow2(m)):
        return f"padding: block_t={p['block_t']} is wider than M={m} rounds up to"
    return None


def _heuristic(shape) -> TcConfig:
    dev = torch.device("cuda" if autotune.has_cuda() else "cpu")
    return tc_heuristic(shape["M"], shape["N"], shape["K"], dev)


TC_SPACE = SearchSpace(
    op="w12.matmul", variant="tc",
    params={"block_n": [64, 128, 256], "block_t": [16, 32, 64], "block_k": [64, 128, 256], "split_k": [1, 2, 4, 8],
            "num_warps": [4, 8], "num_stages": [2, 3, 4, 5], "asm": [True, False]},
    make_config=lambda p: TcConfig(**p),
    flops_bytes=tc_flops_bytes, valid=tc_valid, heuristic=_heuristic,
    key=lambda s: autotune.shape_key(M=s["M"], N=s["N"], K=s["K"]),
)
