"""Launch configs of the lmhead kernels, and the screen the automatic choice uses per GPU (measured)."""

from __future__ import annotations

from dataclasses import dataclass

from autotune import get_config, shape_key

__all__ = ["HeadConfig", "head_config", "AUTO_SCREEN"]


@dataclass(frozen=True)
class HeadConfig:
    screen_bv: int = 64  # vocabulary rows per screen program
    screen_warps: int = 4
    screen_stages: int = 3
    select_bv: int = 1024  # vocabulary rows per selection program
    exact_bs: int = 64  # rows per exact-recompute program (survivors, or the whole vocabulary on fallback)
    exact_bk: int = 128  # columns per step of the exact dot (fixes the order of every exact logit)
    exact_warps: int = 4
    max_rows: int = 32  # hidden rows per screen launch (more: several launches)
    # calls of at most this many hidden rows read them in two int8 parts (the first part's rounding quantised
    # again), which shrinks the hidden states' term of the bound about 250-fold: free in the dot while 2 M rows
    # fit its 16-row tile (docs/lmhead.md, "Hidden states in two parts")
    split_rows: int = 8


def _heuristic(interpret: bool) -> HeadConfig:
    if interpret:  # small blocks: quick interpreter steps on the CPU tests' tiny heads
        return HeadConfig(screen_bv=16, screen_stages=1, select_bv=64, exact_bs=16, exact_bk=64)
    return HeadConfig()


def head_config(variant: str, V: int, H: int, interpret: bool, device=None) -> HeadConfig:
    return get_config("lmhead.argmax", variant, HeadConfig, lambda: _heuristic(interpret),
                      key=shape_key(V=V, K=H), device=device)


# screen="auto": the screen measured fastest per GPU (by gpu slug) for a BF16 head and a W12 head; a GPU
# not listed here runs the plain exact head ("none"): the screen pays only where its read is fast enough
# (the paper measured the certified head slower than the plain one on an RTX PRO 6000).
AUTO_SCREEN: dict[str, dict[str, str]] = {
    "h200": {"bf16": "int8", "w12": "int8"},  # perf/results/h200/20261201T150759-lmhead.argmax.json
    # the INT8 screen 1.65x cuBLAS + argmax at one row, 1.30x at 32 (W12 head 1.62 / 1.27x), the plain W12 exact
    # head 0.87x: perf/results/h100-sxm/20261206T071827-lmhead.argmax.json
    "h100-sxm": {"bf16": "int8", "w12": "int8"},
}
