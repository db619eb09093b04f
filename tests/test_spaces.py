"""The declared search spaces: every one yields valid configs at hybrid-27b shapes, and builds its dataclass."""

import dataclasses
import itertools

import pytest

from gdn.configs import CudaConfig, WYConfig
from gdn.space import CUDA_SPACE, WY_SPACE
from lmhead.configs import HeadConfig
from lmhead.space import HEAD_SPACE
from specpilot import tuning
from specpilot.bench.shapes import get_shape_set
from tree_attn.configs import SplitConfig, WSConfig
from tree_attn.space import MMA_SPACE, WGMMA_SPACE, WS_SPACE
from w12.configs import FlowConfig, MmaConfig, TcConfig, TmaConfig
from w12.space import FLOW_SPACE
from w12.space import MMA_SPACE as W12_MMA_SPACE
from w12.space import TC_SPACE, TMA_SPACE

S = get_shape_set("hybrid-27b")
W12_SHAPES = [{"M": m, "N": n, "K": k} for (n, k) in S.linears.values() for m in (1, 8, 32)]
ATTN_SHAPES = [{"D": S.attn_head_dim, "G": S.attn_q_heads // S.attn_kv_heads, "H": S.attn_q_heads,
                "Hkv": S.attn_kv_heads, "L": 32768, "N": n} for n in (8, 32)]
GDN_SHAPES = [s for _, s in tuning.named_shapes("gdn.tree_verify", "hybrid-27b")]
HEAD_SHAPES = [dict(M=m, V=S.vocab, K=S.hidden) for m in (1, 32)]
CASES = [(TC_SPACE, TcConfig, W12_SHAPES), (WGMMA_SPACE, SplitConfig, ATTN_SHAPES), (MMA_SPACE, SplitConfig, ATTN_SHAPES),
         (WS_SPACE, WSConfig, ATTN_SHAPES),
         (WY_SPACE, WYConfig, GDN_SHAPES), (CUDA_SPACE, CudaConfig, GDN_SHAPES), (HEAD_SPACE, HeadConfig, HEAD_SHAPES),
         (W12_MMA_SPACE, MmaConfig, W12_SHAPES), (TMA_SPACE, TmaConfig, W12_SHAPES), (FLOW_SPACE, FlowConfig, W12_SHAPES)]
REJECTS = {"wy": False, "cuda": False}  # every choice of these runs at hybrid-27b's V=128


@pytest.mark.parametrize("space, cls, shapes", CASES, ids=lambda x: getattr(x, "variant", None) or "")
def test_every_space_has_valid_configs_at_hybrid_27b(space, cls, shapes):
    grid = list(space.grid())
    # the largest grids are sampled with a stride (the flow space's has 110k points): a full scan of every shape
    # took most of this test's time and found nothing the sample does not
    sample = grid[::max(1, len(grid) // 8192)]
    for shape in shapes:
        ok = list(itertools.islice(space.configs(shape), 512))
        assert ok, (space.op, space.variant, shape)
        norm = space.variant == "wy"  # the WY space resets the split-only fields of other inverses
        assert all(isinstance(c, cls) and (norm or dataclasses.asdict(c).items() >= p.items()) for p, c in ok)
        flops, nbytes = space.flops_bytes(shape)
        assert flops > 0 and nbytes > 0
        reasons = {space.valid(p, shape) for p in sample} - {None}
        if REJECTS.get(space.variant, True):
            assert reasons, (space.op, space.variant, shape)  # the checks reject some choices at every shape
        else:
            assert len(ok) == min(len(grid), 512)
        # every rejection names its kind
        assert all(r.split(":")[0] in {"shared memory", "registers", "divisibility", "padding", "config", "tokens"}
                   or "variant" in r
                   or "wgmma" in r for r in reasons)


def test_keys_match_the_lookups(monkeypatch):
    assert TC_SPACE.key({"M": 5, "N": 5120, "K": 6144}) == "K6144-M8-N5120"
    # the largest tree's node count, bucketed (8 and 32 nodes here; one token is N1)
    assert [WGMMA_SPACE.key(s) for s in ATTN_SHAPES] == ["D256-G6-N8", "D256-G6-N32"]
    assert WGMMA_SPACE.key(dict(ATTN_SHAPES[0], N=1)) == "D256-G6-N1"
    # "ws": one consumer warpgroup for 8 nodes x 6 heads, two for 32 x 6 (ws_config's key)
    assert [WS_SPACE.key(s) for s in ATTN_SHAPES] == ["C1-D256-G6", "C2-D256-G6"]
    assert HEAD_SPACE.key(HEAD_SHAPES[1]) == "K5120-V248320"
    # the keys the operators' lookups build at call time
    import autotune
    from gdn import configs as gc
    from lmhead import configs as lc

    seen = []
    monkeypatch.setattr(gc, "get_config", lambda op, var, cls, h, key, device=None: seen.append((op, var, key)) or h())
    monkeypatch.setattr(lc, "get_config", lambda op, var, cls, h, key, device=None: seen.append((op, var, key)) or h())
    b24 = next(s for s in GDN_SHAPES if s["B"] == 24)
    gc.wy_config(b24["M"], b24["K"], b24["V"], batch=b24["B"], HV=b24["HV"])
    gc.cuda_config(b24["M"], b24["K"], b24["V"], batch=b24["B"], HV=b24["HV"])
    lc.head_config("triton", S.vocab, S.hidden, False)
    assert seen == [("gdn.tree_verify", "wy", WY_SPACE.key(b24)), ("gdn.tree_verify", "cuda", CUDA_SPACE.key(b24)),
                    ("lmhead.argmax", "triton", HEAD_SPACE.key(HEAD_SHAPES[0]))]
    assert WY_SPACE.key(b24) == "B32-K128-M8-V128" and autotune.bucket_m(24) == 32
    from tree_attn import configs as tc

    seen.clear()
    monkeypatch.setattr(tc, "get_config", lambda op, var, cls, h, key, device=None: seen.append((op, var, key)) or h())
    for shape in ATTN_SHAPES:
        tc.ws_config(shape["D"], shape["G"], shape["N"] * shape["G"])
    assert seen == [("tree_attn.tree_attention", "ws", WS_SPACE.key(s)) for s in ATTN_SHAPES]
    seen.clear()
    shapes = [*ATTN_SHAPES, dict(ATTN_SHAPES[0], N=1)]
    for shape in shapes:
        tc.split_config("wgmma", shape["D"], shape["G"], 9, False, nodes=shape["N"])
    assert seen == [("tree_attn.tree_attention", "wgmma", WGMMA_SPACE.key(s)) for s in shapes]


def test_tree_attn_plans_look_up_the_largest_trees_bucket(monkeypatch):
    """tree_attn.plan asks for the split kernel's config under the key of its largest tree (max_nodes when given):
    a one-token step, a 3-node tree and a plan sized for 20 nodes look up N1, N4 and N32 (head_dim 64 with 7 heads
    a KV head: no other test's cached plan)."""
    import torch

    import tree_attn
    from tree_attn import configs as tc

    seen = []
    real = tc.get_config
    monkeypatch.setattr(tc, "get_config", lambda op, var, cls, h, key, device=None: seen.append(key) or real(
        op, var, cls, h, key=key, device=device))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for nodes, max_nodes in ((1, None), (3, None), (3, 20)):
        qo = torch.tensor([0, nodes], dtype=torch.int32)
        kv = torch.tensor([0, 8 + nodes], dtype=torch.int32)
        idx = torch.arange(8 + nodes, dtype=torch.int32)
        mask = torch.tensor([(1 << (i + 1)) - 1 for i in range(nodes)], dtype=torch.int64)
        tree_attn.plan(qo, kv, idx, mask, num_qo_heads=7, num_kv_heads=1, head_dim=64, cache_slots=64,
                       nodes_in_cache=True, variant="mma", max_nodes=max_nodes)
    assert seen == ["D64-G7-N1", "D64-G7-N4", "D64-G7-N32"], seen


def test_heuristics_are_points_of_their_spaces():
    for space, shapes in ((WY_SPACE, GDN_SHAPES), (CUDA_SPACE, GDN_SHAPES), (HEAD_SPACE, HEAD_SHAPES)):
        for shape in shapes:
            p = space.params_of(space.heuristic(shape))
            assert p is not None and space.valid(p, shape) is None and space.make_config(p) == space.heuristic(shape)
    assert MMA_SPACE.params_of(MMA_SPACE.heuristic(ATTN_SHAPES[0])) is not None
    assert WGMMA_SPACE.params_of(WGMMA_SPACE.heuristic(ATTN_SHAPES[0])) is not None
    for shape in ATTN_SHAPES:
        p = WS_SPACE.params_of(WS_SPACE.heuristic(shape))
        assert p is not None and WS_SPACE.valid(p, shape) is None
    assert isinstance(TC_SPACE.heuristic(W12_SHAPES[0]), TcConfig)
    for shape in W12_SHAPES:  # the flow heuristic (kc = 1 here: no clusters on this machine) is a point of its space
        h = FLOW_SPACE.heuristic(shape)
        p = FLOW_SPACE.params_of(h)
        assert p is not None and FLOW_SPACE.valid(p, shape) is None and FLOW_SPACE.make_config(p) == h
        assert FLOW_SPACE.current(shape) == h  # no tuned flow entry is shipped


def test_w12_checks_reject_what_cannot_run():
    shape = {"M": 8, "N": 5120, "K": 6144}
    big = dict(block_n=256, block_t=64, block_k=256, split_k=1, num_warps=8, num_stages=5, asm=True)
    assert TC_SPACE.valid(big, shape).startswith("shared memory")
    assert TC_SPACE.valid(dict(big, num_stages=2, num_warps=4, block_t=16), shape).startswith("registers")
    ok = dict(block_n=64, block_t=16, block_k=128, split_k=2, num_warps=4, num_stages=4, asm=True)
    assert TC_SPACE.valid(ok, shape) is None
    assert TC_SPACE.valid(dict(ok, split_k=8, block_k=256), {"M": 8, "N": 5120, "K": 1024}).startswith("divisibility")
    assert TC_SPACE.valid(dict(ok, block_t=64), shape).startswith("padding")
    flow = dict(warps=4, kw=2, stages=3, cps=4, kc=1, wg=False, xd=0, kg=False, late=False, escx=False, xh=True)
    assert FLOW_SPACE.valid(flow, {"M": 32, "N": 5120, "K": 6144}) is None
    assert "xh=True" in FLOW_SPACE.valid(dict(flow, xd=1), {"M": 32, "N": 5120, "K": 6144})


def test_wy_space_folds_fields_the_inverse_ignores():
    p = dict(inverse="square", BV=64, num_warps=8, stack=True, pdl=True, maxnreg=None, inverse_warps=8,
             inverse_stack=True, inverse_loop=True, inverse_maxnreg=128)
    assert WY_SPACE.make_config(p) == WYConfig(BV=64, num_warps=8, stack=True, pdl=True)
    assert WY_SPACE.make_config(dict(p, inverse="split")).inverse_maxnreg == 128
    assert CUDA_SPACE.valid(dict(BV=64, pdl=True, min_blocks=2, split_warps=False, unroll_out=4, unroll_ks=8),
                            dict(GDN_SHAPES[0], V=96)).startswith("divisibility")
    assert HEAD_SPACE.valid(dict(screen_bv=128, screen_warps=4, screen_stages=2, select_bv=1024, exact_bs=128,
                                 exact_bk=256, exact_warps=4, max_rows=32), HEAD_SHAPES[1]).startswith("registers")


def test_w12_tma_baseline_is_what_runs_the_cell(fake_h200):
    """A stored `tma` entry takes a W12 cell from the `mma` kernel (w12/ops.py), so the `tma` space's baseline is
    the `mma` config until a `tma` entry exists, then that entry."""
    import autotune

    shape = {"M": 1, "N": 17408 // 2, "K": 5120}
    key = TMA_SPACE.key(shape)
    assert isinstance(tuning.current_config(TMA_SPACE, shape), MmaConfig)
    mma = MmaConfig(mt=1, wk=8, pipe=3)
    autotune.store_tuned("w12.matmul", "mma", key, mma, user=True)
    assert tuning.current_config(TMA_SPACE, shape) == mma
    tma = TmaConfig(mt=1, cw=4, stages=4, split=4)
    autotune.store_tuned("w12.matmul", "tma", key, tma, user=True)
    assert tuning.current_config(TMA_SPACE, shape) == tma
    assert tuning.current_config(W12_MMA_SPACE, shape) == mma  # the mma space keeps its own entry
