"""The declared search spaces: every one yields valid configs at hybrid-27b shapes, and builds its dataclass."""

import dataclasses

import pytest

from specpilot.bench.shapes import get_shape_set
from tree_attn.configs import SplitConfig
from tree_attn.space import MMA_SPACE, WGMMA_SPACE
from w12.configs import TcConfig
from w12.space import TC_SPACE

S = get_shape_set("hybrid-27b")
W12_SHAPES = [{"M": m, "N": n, "K": k} for (n, k) in S.linears.values() for m in (1, 8, 32)]
ATTN_SHAPES = [{"D": S.attn_head_dim, "G": S.attn_q_heads // S.attn_kv_heads, "H": S.attn_q_heads,
                "Hkv": S.attn_kv_heads, "L": 32768, "N": n} for n in (8, 32)]
CASES = [(TC_SPACE, TcConfig, W12_SHAPES), (WGMMA_SPACE, SplitConfig, ATTN_SHAPES), (MMA_SPACE, SplitConfig, ATTN_SHAPES)]


@pytest.mark.parametrize("space, cls, shapes", CASES, ids=lambda x: getattr(x, "variant", None) or "")
def test_every_space_has_valid_configs_at_hybrid_27b(space, cls, shapes):
    grid = list(space.grid())
    for shape in shapes:
        ok = list(space.configs(shape))
        assert ok, (space.op, space.variant, shape)
        assert all(isinstance(c, cls) and dataclasses.asdict(c).items() >= p.items() for p, c in ok)
        assert len(ok) < len(grid)  # the checks reject some choices at every shape
        flops, nbytes = space.flops_bytes(shape)
        assert flops > 0 and nbytes > 0
        reasons = {space.valid(p, shape) for p in grid} - {None}
        assert all(r.split(":")[0] in {"shared memory", "registers", "divisibility", "padding"} or "variant" in r
                   or "wgmma" in r for r in reasons)


def test_keys_match_the_lookups():
    assert TC_SPACE.key({"M": 5, "N": 5120, "K": 6144}) == "K6144-M8-N5120"
    assert WGMMA_SPACE.key(ATTN_SHAPES[0]) == "D256-G6"


def test_heuristics_are_points_of_their_spaces():
    assert MMA_SPACE.params_of(MMA_SPACE.heuristic(ATTN_SHAPES[0])) is not None
    assert WGMMA_SPACE.params_of(WGMMA_SPACE.heuristic(ATTN_SHAPES[0])) is not None
    assert isinstance(TC_SPACE.heuristic(W12_SHAPES[0]), TcConfig)


def test_w12_checks_reject_what_cannot_run():
    shape = {"M": 8, "N": 5120, "K": 6144}
    big = dict(block_n=256, block_t=64, block_k=256, split_k=1, num_warps=8, num_stages=5, asm=True)
    assert TC_SPACE.valid(big, shape).startswith("shared memory")
    assert TC_SPACE.valid(dict(big, num_stages=2, num_warps=4, block_t=16), shape).startswith("registers")
    ok = dict(block_n=64, block_t=16, block_k=128, split_k=2, num_warps=4, num_stages=4, asm=True)
    assert TC_SPACE.valid(ok, shape) is None
    assert TC_SPACE.valid(dict(ok, split_k=8, block_k=256), {"M": 8, "N": 5120, "K": 1024}).startswith("divisibility")
    assert TC_SPACE.valid(dict(ok, block_t=64), shape).startswith("padding")
