"""Search spaces of the W12 kernels for `autotune.tune`: the Triton tensor-core kernel (`TC_SPACE`, `TcConfig`,
variant "tc") and the CUDA C++ kernels that are the default at M <= 32 on sm_80+ (`MMA_SPACE`, `MmaConfig`,
variant "mma"; `TMA_SPACE`, `TmaConfig`, sm_90, variant "tma": where a tuned "tma" entry exists it takes the
cell, w12/ops.py).

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

from .configs import (_MIN_ITERS_PER_SPLIT, _SMEM_PER_SM, FlowConfig, MmaConfig, TcConfig, TmaConfig, _pow2, flow_config,
                      flow_heuristic, mma_heuristic, tc_heuristic)

__all__ = ["TC_SPACE", "MMA_SPACE", "TMA_SPACE", "FLOW_SPACE", "tc_flops_bytes", "tc_valid",
           "cuda_valid", "tma_current", "flow_valid"]

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


def _smem_limit() -> int:
    if autotune.has_cuda():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin - 64
    return _SMEM_PER_SM


def _config_at(cls, p: dict, m: int, max_m: int, kernels: str):
    """(config, None) when M fits the kernels and `p` builds a config, else (None, the reason)."""
    if not 0 < m <= max_m:
        return None, f"tokens: {kernels} take 1 <= M <= {max_m}, got M={m}"
    try:
        return cls(**p), None
    except ValueError as e:
        return None, f"config: {e}"


def cuda_valid(cls):
    """The validity check of a CUDA C++ kernel's config class at a shape: the config builds, its CTA's shared
    memory fits (at the shape's token tiles), M fits the kernel, and a split of K keeps >= 2 chunks per split."""

    def valid(p: dict, shape) -> str | None:
        from . import cuda as wcuda

        m, k = shape["M"], shape["K"]
        cfg, why = _config_at(cls, p, m, wcuda.MAX_M, "the CUDA kernels")
        if why is not None:
            return why
        smem = wcuda.smem_bytes(cfg, wcuda.n_tiles(m), False)
        if smem > _smem_limit():
            return f"shared memory: {smem} B per CTA"
        chunks = -(-k // 64)
        if getattr(cfg, "split", 1) > 1 and chunks < 2 * cfg.split:
            return f"divisibility: {chunks} chunks of K do not give {cfg.split} splits of 2"
        return None

    return valid


def _key(s) -> str:
    return autotune.shape_key(M=s["M"], N=s["N"], K=s["K"])


def _cuda_heuristic(shape) -> MmaConfig:
    dev = torch.device("cuda" if autotune.has_cuda() else "cpu")
    return mma_heuristic(shape["M"], shape["N"], shape["K"], dev)


MMA_SPACE = SearchSpace(
    op="w12.matmul", variant="mma",
    params={"mt": [1, 2], "wk": [2, 4, 8, 16], "pipe": [2, 3, 4], "wr": [1, 2], "async_copy": [False, True],
            "split": [1, 2, 4]},
    make_config=lambda p: MmaConfig(**p),
    flops_bytes=tc_flops_bytes, valid=cuda_valid(MmaConfig), heuristic=_cuda_heuristic, key=_key,
)

def tma_current(shape, device=None):
    """The config that runs a `tma` cell today (w12/ops.py): its stored `tma` entry, else the `mma` kernel's
    config. A stored `tma` entry takes the cell from the `mma` kernel, so a `tma` winner must beat that."""
    key = _key(shape)
    if f"w12.matmul/tma/{key}" in autotune.load_tuned(device):
        return autotune.get_config("w12.matmul", "tma", TmaConfig, TmaConfig, key=key, device=device)
    return autotune.get_config("w12.matmul", "mma", MmaConfig, lambda: _cuda_heuristic(shape), key=key, device=device)


TMA_SPACE = SearchSpace(
    op="w12.matmul", variant="tma",
    params={"mt": [1, 2], "cw": [4, 8], "stages": [4, 6, 8], "split": [1, 2, 4], "xcp": [False, True],
            "sk": [0, 2]},
    make_config=lambda p: TmaConfig(**p),
    flops_bytes=tc_flops_bytes, valid=cuda_valid(TmaConfig), heuristic=lambda s: TmaConfig(), key=_key,
    current=tma_current,
)


def flow_valid(p: dict, shape) -> str | None:
    """The flow kernel's config at a shape: it builds (kw divides warps, warps x cps <= 32; x sets ahead, `xd`, and x
    reloaded by halves, `xh`, only in the mma.sync build, `xh` with xd = 0; the K split through memory, `kg`, only
    with kc > 1), M fits, its CTAs' shared memory fits the SM at cps CTAs, a cluster split (kc > 1 without kg) has a
    GPU with clusters, the warpgroup build (wg) a GPU with wgmma, and every warp gets a 64-column unit of K."""
    from . import flow

    m, k = shape["M"], shape["K"]
    cfg, why = _config_at(FlowConfig, p, m, flow.MAX_M, "the flow kernel's builds")
    if why is not None:
        return why
    smem = flow.smem_bytes(cfg, flow.n_tiles(m))
    if smem * cfg.cps > _SMEM_PER_SM:
        return f"shared memory: {cfg.cps} CTAs x {smem} B per SM"
    if cfg.kc > 1 and not cfg.kg and not (autotune.has_cuda() and torch.cuda.get_device_capability()[0] >= 9):
        return "config: a K split across CTAs needs thread-block clusters (sm_90)"
    if cfg.wg and not (autotune.has_cuda() and torch.cuda.get_device_capability() == (9, 0)):
        return "config: the warpgroup build needs wgmma (sm_90)"
    if -(-k // 64) < cfg.kw * cfg.kc:
        return f"divisibility: {-(-k // 64)} units of K for {cfg.kw * cfg.kc} pieces"
    return None


FLOW_SPACE = SearchSpace(
    op="w12.matmul", variant="flow",
    params={"warps": [2, 4, 8, 16], "kw": [1, 2, 4, 8], "stages": [3, 4, 6], "cps": [1, 2, 4, 8], "kc": [1, 2, 3],
            "wg": [False, True], "xd": [0, 1, 2], "kg": [False, True], "late": [False, True],
            "escx": [False, True], "xh": [False, True]},
    make_config=lambda p: FlowConfig(**p),
    flops_bytes=tc_flops_bytes, valid=flow_valid, key=_key,
    heuristic=lambda s: flow_heuristic(s["M"], s["N"], s["K"], torch.device("cuda" if autotune.has_cuda() else "cpu")),
    current=lambda s, device=None: flow_config(s["M"], s["N"], s["K"], device or torch.device(
        "cuda" if autotune.has_cuda() else "cpu")),
)
