"""Search space of the certified head's Triton kernels (`HeadConfig`, variant "triton") for `autotune.tune`.

Shapes are dicts {"M" hidden rows, "V" vocabulary, "K" hidden size}. The tuned key is the one `head_config`
looks up, `K<K>-V<V>`: M is not part of it (a head plans once, at construction, for every M), so the study
times one M and its winner serves them all. Checks: the screen's int32 accumulator [rows, screen_bv] and the
exact kernel's bf16 weight tile [exact_bs, exact_bk] stay in registers. `exact_bk` fixes the summation order
of the exact logits: `argmax`/`topk` equal `logits()` of the same config bit for bit whatever it is.
"""

from __future__ import annotations

from autotune import shape_key
from autotune.tuner import SearchSpace

from .configs import HeadConfig, _heuristic

__all__ = ["HEAD_SPACE", "head_flops_bytes", "head_valid"]

_MAX_PER_THREAD = 128  # accumulator or tile values per thread before spills


def head_flops_bytes(shape) -> tuple[float, float]:
    """2 M V K FLOPs; the exact BF16 head read once, h read, the ids written (specpilot/bench/cases/lmhead.py:
    the screen reads about half of that, so a certified head can run below 1x this floor)."""
    m, v, k = shape["M"], shape["V"], shape["K"]
    return 2.0 * m * v * k, float(2 * (v * k + m * k) + 8 * m)


def head_valid(p: dict, shape) -> str | None:
    rows = min(p["max_rows"], max(16, 1 << (max(shape["M"], 1) - 1).bit_length()))
    acc = rows * p["screen_bv"] // (32 * p["screen_warps"])
    if acc > _MAX_PER_THREAD:
        return f"registers: the screen's [{rows}, {p['screen_bv']}] accumulator is {acc} values per thread"
    tile = p["exact_bs"] * p["exact_bk"] // (32 * p["exact_warps"])
    if tile > _MAX_PER_THREAD:
        return f"registers: the exact [{p['exact_bs']}, {p['exact_bk']}] tile is {tile} values per thread"
    if p["select_bv"] < p["screen_bv"]:
        return f"padding: select_bv={p['select_bv']} is narrower than screen_bv={p['screen_bv']}"
    return None


HEAD_SPACE = SearchSpace(
    op="lmhead.argmax", variant="triton",
    params={"screen_bv": [32, 64, 128], "screen_warps": [4, 8], "screen_stages": [2, 3, 4],
            "select_bv": [512, 1024, 2048], "exact_bs": [32, 64, 128], "exact_bk": [64, 128, 256],
            "exact_warps": [4, 8], "max_rows": [16, 32]},
    make_config=lambda p: HeadConfig(**p), flops_bytes=head_flops_bytes, valid=head_valid,
    heuristic=lambda s: _heuristic(False), key=lambda s: shape_key(V=s["V"], K=s["K"]),
)
