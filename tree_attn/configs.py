"""Launch configs of the tree_attn kernels: a frozen dataclass, an analytical heuristic by default,
tuned entries (autotune/configs/<gpu>.json, keys `tree_attn.tree_attention/<variant>/<bucket>`) when
present."""

from __future__ import annotations

from dataclasses import dataclass

from autotune import bucket_m, get_config, shape_key

__all__ = ["SplitConfig", "WSConfig", "split_config", "split_key", "ws_config", "ws_consumers", "MMA_ROWS_SM90",
           "SMALL_ROWS"]

# Triton lowers tl.dot to wgmma on sm_90 only when a program's tile has a multiple of 64 rows and a
# multiple of 4 warps; the "mma" variant keeps its tile at 32 rows on sm_90 so that it runs the
# mma.sync code that sm_80/sm_89/sm_120 run (the portable variant, checked on Hopper).
MMA_ROWS_SM90 = 32


@dataclass(frozen=True)
class SplitConfig:
    """One split-KV program: `block_m` rows of (tree node, query head of the GQA group), pairs packed
    node-major, against `block_n` keys per step of its key range."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    # split-KV programs resident per SM: one wave of the GPU is programs_per_sm x SMs programs
    # (tree_attn.plan sizes its splits in whole waves)
    programs_per_sm: float = 1.0
    merge_warps: int = 2
    merge_parts: int = 16  # partials the merge loads at once (a power of two)
    # fixed work of one prefix item in key blocks (q tile load, partial output written and merged), for
    # the schedule's cost model
    item_cost: int = 32


@dataclass(frozen=True)
class WSConfig:
    """One program of the warp-specialised CUDA kernel (variant "ws", tree_attn/csrc/tree_attn_ws.cu): `consumers`
    warpgroups of 64 rows each share every K/V block of `block_n` keys, which the producer warpgroup gathers into a
    ring of `num_stages` stages (K and V of a stage complete and are released on mbarriers of their own); the
    request's tree block is folded into its last prefix split. `producers` warpgroups (1 or 2) issue the copies: the
    rate at which one SM's cp.async copies land grows with the warps that issue them. setmaxnreg gives each producer
    warpgroup `producer_regs` and each consumer `consumer_regs` registers (where the warpgroups are more than two)."""

    consumers: int = 2
    block_n: int = 64
    num_stages: int = 2
    producer_regs: int = 56
    consumer_regs: int = 216
    pingpong: bool = False  # two consumers take turns to issue their S products (named barriers)
    kv_ahead: bool = False  # the producer issues block b + 1's K before block b's V
    q_in_regs: bool = False  # each consumer holds its q rows' A fragments in registers (S reads only K)
    overlap: bool = False  # S of block b issued before P V of block b - 1, whose wgmma runs beside b's softmax
    programs_per_sm: float = 1.0
    merge_warps: int = 2
    merge_parts: int = 16
    item_cost: int = 8  # fixed work of one item in key blocks (its q rows, its partial written and merged)
    producers: int = 1  # producer warpgroups
    # two consumers on one tile's alternate blocks ("halves": the group's second tile has no row) take two splits an
    # item, so that their CTA does a full group's MMA work; False: one split, so that its copies are a full group's
    pair_halves: bool = True
    # 2-CTA clusters: the two groups of a request over one key range run as a pair, each CTA copying half of every
    # K/V block and forwarding it into the other's ring (distributed shared memory), so that each K/V row is read
    # once for both groups (two consumers, one split a halves item, an even number of stages)
    cluster: bool = False

    @property
    def block_m(self) -> int:
        """Rows of one work item (the merge's partial rows)."""
        return 64 * self.consumers

    def smem_bytes(self, head_dim: int) -> int:
        """Shared memory of one CTA: the q rows, the K/V ring and its mbarriers (the kernel's layout), and up to
        1024 bytes to align them."""
        bars = (48 if self.cluster else 32) * self.num_stages + 8
        return 1024 + head_dim * 2 * (self.block_m + 2 * self.num_stages * self.block_n) + bars


# trees of at most this many nodes merge in few programs (nodes x query heads), each over many partials: they load
# 64 partials at a time in 8 warps (hybrid-27b at one token and 4k keys on an H100: 19.3 -> 16.0-16.7 us a call;
# in the engine's one-token step, 6.9-7.1 -> 5.2 us a merge)
FEW_NODES = 4


# trees of at most this many rows (nodes x query heads of a KV head) take one 16-row tile on sm_90: tl.dot lowers
# to mma.sync there, with a quarter of the 64-row tile's accumulator and softmax (H100, hybrid-27b at one token
# over 4k keys, the engine's W12 AR step: tree attention 0.326 -> 0.261 ms a step; docs/tree_attn.md)
SMALL_ROWS = 16


def _heuristic(variant: str, head_dim: int, cc_major: int, interpret: bool, nodes: int = 32,
               group: int | None = None) -> SplitConfig:
    if interpret:  # small tiles: several splits at the tiny lengths of CPU tests, quick interpreter steps
        return SplitConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    merge = dict(merge_warps=8, merge_parts=64) if nodes <= FEW_NODES else {}
    if variant == "wgmma" and cc_major == 9 and group is not None and nodes * group <= SMALL_ROWS:
        return SplitConfig(block_m=SMALL_ROWS, block_n=64, num_warps=4, num_stages=2, programs_per_sm=1.0, **merge)
    # H200, hybrid-27b (D=256, G=6), one 32-node tree at 32k: 64 x 32 tiles, 3 stages and 2 programs per
    # SM were the fastest of 32 configs (docs/tree_attn.md)
    bn = 64 if head_dim <= 128 else 32
    if variant == "mma":
        rows = MMA_ROWS_SM90 if cc_major == 9 else 64
        return SplitConfig(block_m=rows, block_n=bn, num_warps=4, num_stages=3 if cc_major >= 9 else 2,
                           programs_per_sm=2.0, **merge)
    return SplitConfig(block_m=64, block_n=bn, num_warps=4, num_stages=3, programs_per_sm=2.0, **merge)


def split_config(variant: str, head_dim: int, group: int, cc_major: int, interpret: bool, device=None,
                 nodes: int = 32) -> SplitConfig:
    """`nodes`: the step's largest tree (its node count bucketed to a power of two keys the tuned entries: a
    one-token step and a 32-node tree are different problems for the same kernel)."""
    return get_config("tree_attn.tree_attention", variant, SplitConfig,
                      lambda: _heuristic(variant, head_dim, cc_major, interpret, nodes, group),
                      key=split_key(head_dim, group, nodes), device=device)


def split_key(head_dim: int, group: int, nodes: int) -> str:
    """The tuned key of the split kernel's configs: `D<D>-G<G>-N<nodes bucket>`."""
    return shape_key(D=head_dim, G=group, N=bucket_m(max(1, nodes)))


def ws_consumers(rows: int) -> int:
    """Consumer warpgroups for a step whose largest request has `rows` (nodes x G) rows: one up to 64, else two
    sharing each K/V block (three do not fit the registers at D = 256: tree_attn_ws.cu's header). Also the C of the
    tuned entries' key."""
    return 1 if rows <= 64 else 2


def _ws_heuristic(rows: int) -> WSConfig:
    # One consumer keeps three stages of 64 keys (224 KB with D = 256 and its 64 q rows). Two keep four of 32 keys
    # (192 KB with their 128 q rows): where they split one tile's blocks (halves) each consumer has stages of its
    # own, two of four, where two of 64 keys would leave each one stage and no load ahead of the block it computes.
    # Two producer warpgroups: the copies bound the kernel, and one SM's land faster with more warps issuing them;
    # halves items of one split, so that no CTA copies twice the keys of the others (H100, specpilot.bench.ws_phases:
    # 88.5 -> 62.8 us at 8 nodes and 32k keys, 246 -> 132 at 32 nodes; docs/tree_attn.md).
    if ws_consumers(rows) == 1:
        return WSConfig(consumers=1, block_n=64, num_stages=3, producers=2, consumer_regs=232)
    return WSConfig(consumers=2, block_n=32, num_stages=4, producers=2, producer_regs=40, pair_halves=False)


def ws_config(head_dim: int, group: int, rows: int, device=None) -> WSConfig:
    """The "ws" kernel's config for a step whose largest request has `rows` (nodes x group) rows."""
    return get_config("tree_attn.tree_attention", "ws", WSConfig, lambda: _ws_heuristic(rows),
                      key=shape_key(D=head_dim, G=group, C=ws_consumers(rows)), device=device)
