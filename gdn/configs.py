"""Launch configs of the gdn kernels: frozen dataclasses, analytical heuristics by default,
tuned entries (autotune/configs/<gpu>.json, keys `gdn.<op>/<variant>/<bucket>`) when present."""

from __future__ import annotations

from dataclasses import dataclass

import triton

from autotune import get_config, has_wgmma, shape_key

__all__ = ["WYConfig", "RecurrentConfig", "ConvConfig", "CommitConfig", "wy_config", "recurrent_config",
           "conv_config", "commit_config", "VARIANTS"]

# GPU-generation dispatch. The same WY kernel serves both: tl.dot lowers to wgmma on sm_90 and
# to mma.sync on sm_80. "recurrent" (no tensor cores) is the stock baseline, forced by name.
VARIANTS = {8: "wy", 9: "wy"}


@dataclass(frozen=True)
class WYConfig:
    BV: int = 32
    num_warps: int = 4
    num_stages: int = 1
    dot_precision: str = "tf32x3"  # fp32 operands: "ieee" (no tensor cores), "tf32x3" (~fp32), "tf32"
    min_bt: int = 16  # node tile floor; 64 on sm_90 so every tl.dot has M=64 and lowers to wgmma


@dataclass(frozen=True)
class RecurrentConfig:
    BV: int = 32
    num_warps: int = 4


@dataclass(frozen=True)
class ConvConfig:
    BD: int = 256
    num_warps: int = 4


@dataclass(frozen=True)
class CommitConfig:
    BV: int = 32
    BD: int = 256
    num_warps: int = 4


def _bv(V: int) -> int:
    return max(16, min(32, triton.next_power_of_2(V)))


def wy_config(max_nodes: int, K: int, V: int, device=None) -> WYConfig:
    def heuristic():
        min_bt = 64 if has_wgmma(device) else 16
        bt = max(min_bt, triton.next_power_of_2(max_nodes))
        # [BT, K] q and k tiles live in registers next to the [K, BV] state tile.
        return WYConfig(BV=_bv(V), num_warps=8 if bt * K >= 64 * 128 else 4, min_bt=min_bt)

    return get_config("gdn.tree_verify", "wy", WYConfig, heuristic, key=shape_key(M=max_nodes, K=K, V=V),
                      device=device)


def recurrent_config(K: int, V: int, device=None) -> RecurrentConfig:
    return get_config("gdn.tree_verify", "recurrent", RecurrentConfig, lambda: RecurrentConfig(BV=_bv(V)),
                      key=shape_key(K=K, V=V), device=device)


def conv_config(D: int, device=None) -> ConvConfig:
    return get_config("gdn.tree_conv1d", "triton", ConvConfig,
                      lambda: ConvConfig(BD=min(256, triton.next_power_of_2(D))), key=shape_key(D=D), device=device)


def commit_config(K: int, V: int, D: int, device=None) -> CommitConfig:
    return get_config("gdn.commit", "triton", CommitConfig,
                      lambda: CommitConfig(BV=_bv(V), BD=min(256, triton.next_power_of_2(max(D, 1)))),
                      key=shape_key(K=K, V=V, D=D), device=device)
