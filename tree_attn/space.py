"""Search spaces of the split-KV tree attention kernels for `autotune.tune`: the Triton kernel (`SplitConfig`,
variants "wgmma" and "mma") and the warp-specialised CUDA C++ kernel (`WSConfig`, variant "ws", sm_90).

Shapes are dicts {"D" head dim, "G" query heads per KV head, "H" query heads, "Hkv" KV heads, "L" prefix keys,
"N" tree nodes}; the tuned key is the one `split_config` looks up, `D<D>-G<G>-N<nodes bucket>`. Checks: the K/V
ring and the q tile fit shared memory, the fp32 accumulator fits the registers, and the "mma" variant keeps its 32-row
tile on sm_90 (`MMA_ROWS_SM90`: 64 rows there lower to wgmma, which "wgmma" already is). The "ws" space's
checks are the kernel's own (`tree_attn.cuda.config_problem`: consumers, keys a block, stages, the register split
of setmaxnreg, shared memory); its key adds C, the consumer warpgroups the shape's rows (N x G) call for by
default (`ws_config`'s key).
"""

from __future__ import annotations

from autotune import shape_key
from autotune.tuner import SearchSpace

from .configs import (MMA_ROWS_SM90, SMALL_ROWS, SplitConfig, WSConfig, _heuristic, _ws_heuristic, split_key,
                      ws_consumers)

__all__ = ["WGMMA_SPACE", "MMA_SPACE", "WS_SPACE", "split_flops_bytes", "split_valid", "ws_valid"]

_SMEM_PER_SM = 227 << 10
_MAX_ACC_PER_THREAD = 128  # fp32 accumulator values per thread before spills


def split_flops_bytes(shape) -> tuple[float, float]:
    """One request of N nodes over L prefix keys (docs of specpilot/bench/cases/tree_attn.py): QK^T and PV over
    every key a row may see; bf16 K and V read once, q read and out written."""
    h, hkv, d, n, length = shape["H"], shape["Hkv"], shape["D"], shape["N"], shape["L"]
    return 4.0 * h * d * n * (length + n), 2.0 * hkv * d * 2 * (length + n) + 2.0 * n * h * d * 2


def _valid(variant: str):
    def valid(p: dict, shape) -> str | None:
        d = shape["D"]
        smem = p["num_stages"] * p["block_n"] * d * 2 * 2 + p["block_m"] * d * 2
        if smem > _SMEM_PER_SM:
            return f"shared memory: {p['num_stages']} stages of K/V [{p['block_n']}, {d}] and q = {smem} B > {_SMEM_PER_SM} B"
        acc = p["block_m"] * d // (32 * p["num_warps"])
        if acc > _MAX_ACC_PER_THREAD:
            return f"registers: the [{p['block_m']}, {d}] fp32 accumulator is {acc} values per thread (> {_MAX_ACC_PER_THREAD})"
        if variant == "mma" and p["block_m"] != MMA_ROWS_SM90:
            return f"variant mma keeps {MMA_ROWS_SM90}-row tiles (64 rows lower to wgmma on sm_90)"
        if variant == "wgmma" and p["block_m"] == SMALL_ROWS:
            if shape["N"] * shape["G"] > SMALL_ROWS:
                return f"config: {SMALL_ROWS}-row tiles (mma.sync) are for trees of at most {SMALL_ROWS} rows"
        elif variant == "wgmma" and (p["block_m"] % 64 or p["num_warps"] % 4):
            return f"wgmma needs a multiple of 64 rows and of 4 warps ({SMALL_ROWS} rows: small trees, mma.sync)"
        return None
    return valid


def split_valid(variant: str):
    """The validity check of `variant`'s space."""
    return _valid(variant)


def _space(variant: str) -> SearchSpace:
    return SearchSpace(
        op="tree_attn.tree_attention", variant=variant,
        params={"block_m": [16, 32, 64, 128], "block_n": [16, 32, 64, 128], "num_warps": [4, 8], "num_stages": [1, 2, 3, 4],
                "programs_per_sm": [1.0, 2.0, 3.0], "merge_warps": [1, 2, 4, 8], "merge_parts": [8, 16, 32, 64]},
        make_config=lambda p: SplitConfig(**p), flops_bytes=split_flops_bytes, valid=_valid(variant),
        heuristic=lambda s: _heuristic(variant, s["D"], 9, False, s["N"], s["G"]),
        key=lambda s: split_key(s["D"], s["G"], s["N"]))


WGMMA_SPACE = _space("wgmma")
MMA_SPACE = _space("mma")


def ws_valid(p: dict, shape) -> str | None:
    """The "ws" kernel's checks of one choice (tree_attn_ws.cu's static_asserts and shared memory)."""
    from .cuda import config_problem

    return config_problem(WSConfig(**p), shape["D"])


def _ws_key(shape) -> str:
    return shape_key(D=shape["D"], G=shape["G"], C=ws_consumers(shape["N"] * shape["G"]))


# the producer's registers: 56 builds without spills; 24 spills some of its values (measured by NVRTC over the whole
# space) but leaves two consumers 240 each, which q in registers needs; 40 fits two producer warpgroups beside two
# consumers of 216 (their 16-row copy loops unrolled by 8: no spills)
WS_SPACE = SearchSpace(
    op="tree_attn.tree_attention", variant="ws",
    params={"consumers": [1, 2], "block_n": [32, 64], "num_stages": [2, 3, 4, 5], "producers": [1, 2],
            "pair_halves": [True, False], "producer_regs": [24, 40, 56],
            "consumer_regs": [200, 216, 232, 240], "pingpong": [False, True], "kv_ahead": [False, True], "q_in_regs": [False, True], "overlap": [False, True],
            "item_cost": [4, 8, 16, 32], "merge_parts": [8, 16, 32]},
    make_config=lambda p: WSConfig(**p), flops_bytes=split_flops_bytes, valid=ws_valid,
    heuristic=lambda s: _ws_heuristic(s["N"] * s["G"]), key=_ws_key)
