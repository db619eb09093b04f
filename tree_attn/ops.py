"""tree_attn ops in three layers: launch-only functions (`_plan` makes the kernel decision of a call, an
`autotune.Plan` cached per shape key; `_launch` runs it from a `TreeAttnPlan`'s buffers), the torch
custom-op registration, and the public functions (`plan`, `run`, `tree_attention`) that validate inputs
and say how to fix a bad call.

The plan step (`plan`, `TreeAttnPlan.update`) runs on the host once per decoding step: it checks the
masks, indptr arrays and slot indices, and writes the split-KV schedule into fixed-size device buffers.
The run step reads only those buffers: it never syncs the host and allocates nothing that depends on
the data, so CUDA graphs capture it. It trusts the plan's indices (they were checked there) and checks
the shapes, dtypes and devices of its tensors against the plan.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

import autotune
from autotune.hardware import compute_capability, host_only, is_interpreter

from . import cuda
from .configs import SplitConfig, WSConfig, split_config, ws_config
from .kernels import split as _k
from .kernels.split import tree_attn_merge_kernel, tree_attn_split_kernel
from .reference import tree_attention_reference

__all__ = ["tree_attention", "plan", "run", "check_metadata", "TreeAttnPlan", "MAX_NODES", "HEAD_DIMS", "VARIANTS",
           "unsupported", "compiled_ptx"]

OP = "tree_attn.tree_attention"
MAX_NODES = 64  # one int64 mask word per node
HEAD_DIMS = (64, 128, 256)
# "wgmma": tl.dot on 64-row tiles, lowered to wgmma on sm_90; "mma": the same kernel at tiles Triton lowers
# to mma.sync (sm_80/sm_89/sm_120, and 32-row tiles on sm_90); "ws": the warp-specialised CUDA C++ kernel
# (tree_attn/csrc/tree_attn_ws.cu, sm_90 only; by name until it is measured to win); "reference":
# tree_attn/reference.py (CPU tensors without the Triton interpreter).
VARIANTS = autotune.Variants(OP, by_arch={9: "wgmma", 8: "mma"}, known=("wgmma", "mma", "ws", "reference"),
                             fallback="reference", cuda_only=("ws",))
_PLANS = autotune.PlanCache()
_INTERPRET_SMS = 4  # "SMs" the schedule fills under the interpreter (several splits at tiny lengths)
# The one-call path's kept plans (`keep_plan=True`). A model calls `tree_attention` once per attention layer with the
# same step metadata (qo_indptr, kv_indptr, kv_indices, tree_mask); the plan, a host step with a device sync, is the
# same for every layer. An entry is reused only for the very same four tensor objects (weak references: a freed tensor whose memory
# a new one takes never matches), unchanged since (torch's version counters, shared by every view of their storage),
# the same call shape, and the same stream (the plan's scratch buffers are written by each run).
_ONE_CALL: dict = {}
_ONE_CALL_MAX = 16
# The one-call path's device schedule (the default of `tree_attention`): scratch per (device, stream, KV heads,
# row block, head dim), grown to the largest call, and one status word pair per device (`check_metadata`).
# DEVICE_WAVES caps the waves of work items the device schedule may choose (the host plan's model tries up
# to 8): the scratch holds DEVICE_WAVES waves plus two items per row block.
_DEVICE_SCRATCH: dict = {}
_DEVICE_LAST: dict = {}  # (device, stream) -> the last call's (shape key, metadata tensors, plan)
_STATUS: dict = {}
_SMS: dict = {}  # device -> its SM count
DEVICE_WAVES = 4
DEVICE_MAX_BATCH = 1024


# --------------------------------------------------------------------------------------------
# 1. Launch-only functions.
# --------------------------------------------------------------------------------------------


def unsupported(*, head_dim: int) -> str | None:
    """Why the kernels cannot take calls of this shape (None: they can). The reference takes any head_dim,
    when asked for by name (variant="reference")."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not supported by the kernels (they take {HEAD_DIMS})"
    return None


def _plan(variant: str | None, device: torch.device, head_dim: int, group: int, rows: int = 64,
          dtype: torch.dtype = torch.bfloat16) -> autotune.Plan:
    """`rows`: the largest request's rows (nodes x group), which set the "ws" kernel's consumer warpgroups."""
    chosen, by_name = VARIANTS.choose(variant, device, where="tree_attn.plan")
    if chosen == "ws":
        cfg = ws_config(head_dim, group, rows, device)
        why = cuda.unsupported(device, head_dim, dtype, cfg)
        if why is not None:
            raise ValueError(f"tree_attn.plan: variant 'ws' cannot run this call: {why}; pass variant=None for the "
                             "default kernel")
        key = ("ws", str(device), head_dim, group, cfg.consumers, dtype, autotune.forced(OP))
        return _PLANS.get(key, lambda: autotune.Plan("ws", "ws", cfg))
    # an automatic choice raises too, also where it would run the reference (CPU tensors): the same call must
    # not be refused on the GPU only
    why = None if chosen == "reference" and by_name else unsupported(head_dim=head_dim)
    if why is not None:
        raise ValueError(f"tree_attn.plan: {why}; pass variant='reference' to run the torch reference, which takes "
                         "any head_dim")
    nodes = autotune.bucket_m(max(1, -(-rows // group)))  # the largest tree's nodes: part of the tuned key
    key = (chosen, str(device), head_dim, group, nodes, autotune.forced(OP), is_interpreter())

    def make() -> autotune.Plan:
        if chosen == "reference" or host_only(device):
            return autotune.Plan(chosen, "reference")
        cc = compute_capability(device.index)[0] if device.type == "cuda" else 0
        return autotune.Plan(chosen, "split", split_config(chosen, head_dim, group, cc, is_interpreter(), device,
                                                           nodes=nodes))

    return _PLANS.get(key, make)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRET_SMS
    n = _SMS.get(device)
    if n is None:
        n = _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def _launch(kernel: str, cfg: SplitConfig | None, tn: int, q, k_cache, v_cache, k_new, v_new, qo_indptr, kv_indptr, kv_indices,
            tree_mask, node_req, items, req_table, po, plse, out, lse, sm_scale: float, status=None, device_args=None):
    """Run one plan's schedule; returns the split kernel's compiled handle (None for the reference). `status`
    (the one-call path): no schedule was planned; the kernels build it and check the metadata on the device,
    with po's first dimension as the bound on work items and `items` as their scratch. `device_args`: that
    path's `_device_args`, which its plan keeps (built here when None)."""
    T, H, D = q.shape
    if T == 0:
        return None
    if kernel == "reference":
        o, l = tree_attention_reference(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask,
                                        sm_scale=sm_scale, k_new=k_new, v_new=v_new)
        out.copy_(o)
        if lse is not None:
            lse.copy_(l)
        return None
    Hkv = k_cache.shape[-2]
    G = H // Hkv
    kn, vn, strides, page = cache_args(q, k_cache, v_cache, k_new, v_new)
    new = k_new is not None
    if kernel == "ws":
        why = cuda.misaligned(q, k_cache, v_cache, *((k_new, v_new) if new else ()))
        if why is not None:
            raise ValueError(f"tree_attn.run: variant 'ws' copies rows 16 bytes at a time: {why}; pass contiguous "
                             "tensors, or plan with variant=None")
        cuda.run(cfg, q, k_cache, v_cache, kn, vn, strides, page, new, qo_indptr, kv_indptr, kv_indices, tree_mask,
                 items, po, plse, sm_scale * 1.4426950408889634)
        merge_dev, merge_kw = _host_merge_args(cfg, qo_indptr, req_table, Hkv, G, D)
        _merge(q, po, plse, out, lse, node_req, qo_indptr, req_table, merge_dev, merge_kw)
        return None
    if status is None:  # the plan's schedule: (item, KV head) programs
        grid, dev = (items.shape[0], Hkv), (kv_indptr, req_table, items, 0, 0, 0, 0, 0, 0, 0)
        split_kw = _split_kw(cfg, tn, Hkv, G, D, new)
        merge_dev, merge_kw = _host_merge_args(cfg, qo_indptr, req_table, Hkv, G, D)
    else:  # the schedule built by the kernels: item-major programs over the bound (kernels/split.py)
        if device_args is None:
            device_args = _device_args(cfg, tn, T, H, Hkv, D, new, qo_indptr, kv_indptr, kv_indices, tree_mask,
                                       req_table, po, status, q.device)
        head, tail, split_kw, merge_dev, merge_kw = device_args
        grid, dev = (po.shape[0] * Hkv,), (*head, _cache_slots(k_cache), *tail)
    handle = autotune.launch_triton(
        tree_attn_split_kernel, grid, q, k_cache, v_cache, kn, vn, qo_indptr, kv_indices, tree_mask, items, po, plse,
        sm_scale * 1.4426950408889634, q.stride(0), q.stride(1), *strides, *dev, PAGE=page, **split_kw)
    _merge(q, po, plse, out, lse, node_req, qo_indptr, req_table, merge_dev, merge_kw)
    return handle


def _split_kw(cfg: SplitConfig, tn: int, Hkv: int, G: int, D: int, new: bool) -> dict:
    """The split kernel's launch keywords that both schedules pass (the caches' page size is the call's)."""
    return dict(HKV=Hkv, G=G, D=D, BM=cfg.block_m, BN=cfg.block_n, TN=tn, NEW=new, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)


def _merge_kw(cfg, Hkv: int, G: int, D: int) -> dict:
    """The merge kernel's launch keywords that both schedules pass."""
    return dict(HKV=Hkv, G=G, D=D, BM=cfg.block_m, BP=cfg.merge_parts, num_warps=cfg.merge_warps)


def _host_merge_args(cfg, qo_indptr, req_table, Hkv: int, G: int, D: int) -> tuple:
    """(the merge's arguments after out's strides, its keywords) on a host schedule: the plan's node_req and request
    table tell each node's request, so no device checks."""
    return (qo_indptr, qo_indptr, req_table, 0, 0, 0), _merge_kw(cfg, Hkv, G, D)


def _device_args(cfg: SplitConfig, tn: int, T: int, H: int, Hkv: int, D: int, new: bool, qo_indptr, kv_indptr,
                 kv_indices, tree_mask, req_table, po, status, device) -> tuple:
    """What a run with the schedule built on the device passes its two kernels besides the call's tensors, the
    caches' strides, slots and page size, and the LSE: fixed by its plan, so the plan keeps it. (split arguments
    before the slot count, after it, split keywords, merge arguments after out's strides, merge keywords: the merge
    finds each node's request and checks its mask.)"""
    B = qo_indptr.shape[0] - 1
    lanes = _lanes(B)
    return ((kv_indptr, req_table, status, B, T, kv_indices.shape[0]),
            (_target_items(device, Hkv, cfg), cfg.item_cost, po.shape[0]),
            dict(_split_kw(cfg, tn, Hkv, H // Hkv, D, new), DEVICE=True, BB=lanes, WAVES=DEVICE_WAVES),
            (kv_indptr, tree_mask, status, B, T, kv_indices.shape[0]),
            dict(_merge_kw(cfg, Hkv, H // Hkv, D), DEVICE=True, NEW=new, BB=lanes))


def _cache_slots(c: torch.Tensor) -> int:
    """Token slots of a token-slot cache [slots, Hkv, D] or a paged one [pages, page_size, Hkv, D]."""
    return c.shape[0] * (c.shape[1] if c.dim() == 4 else 1)


def _lanes(B: int) -> int:
    """The device schedule's lanes for B requests (a power of two, at least 16: few distinct compiles)."""
    return max(16, 1 << (max(B, 1) - 1).bit_length())


def cache_args(q, k_cache, v_cache, k_new, v_new) -> tuple:
    """(k_new or q, v_new or q, the 10 element strides, page size) as both split kernels take them: the caches'
    (page, offset in page, KV head) strides (a token-slot cache: offset 0), then k_new's and v_new's (token, head)
    strides (zeros without them; q stands in for their pointers)."""
    paged = k_cache.dim() == 4
    ks, vs = k_cache.stride(), v_cache.stride()
    k_strides = (ks[0], ks[1], ks[2]) if paged else (ks[0], 0, ks[1])
    v_strides = (vs[0], vs[1], vs[2]) if paged else (vs[0], 0, vs[1])
    if k_new is None:
        return q, q, (*k_strides, *v_strides, 0, 0, 0, 0), k_cache.shape[1] if paged else 1
    kns = (k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1))
    return k_new, v_new, (*k_strides, *v_strides, *kns), k_cache.shape[1] if paged else 1


def _merge(q, po, plse, out, lse, node_req, qo_indptr, req_table, dev: tuple, kw: dict) -> None:
    """Combine the request's partials (block_m rows per item) by log-sum-exp into out (and lse). `dev`, `kw`: the
    schedule's remaining arguments and keywords (`_host_merge_args`, `_device_args`)."""
    T, H, _ = q.shape
    autotune.launch_triton(
        tree_attn_merge_kernel, (T, H), po, plse, out, lse if lse is not None else plse, node_req, qo_indptr,
        req_table, out.stride(0), out.stride(1), *dev, WRITE_LSE=lse is not None, **kw)


def _tree_block(max_nodes: int) -> int:
    """Keys of the tree block: the largest tree rounded up to a power of two, at least 16 (tl.dot)."""
    return max(16, 1 << max(0, (max_nodes - 1).bit_length()))


# --------------------------------------------------------------------------------------------
# 2. The plan: schedule and buffers.
# --------------------------------------------------------------------------------------------


@dataclass
class TreeAttnPlan:
    """The split-KV schedule of one step in fixed-size device buffers, read by `run`.

    `items` holds `capacity` work items (request, row block, lo, hi) of int32; lo >= 0: the prefix
    slots kv_indices[lo:hi], lo = -1: the tree block (hi: where the nodes' own slots start in
    kv_indices when they are in the cache). Unused items have request -1. `req_table` holds per
    request (first item, splits + 1, row blocks). `po`/`plse` are the partial outputs and base-2 LSEs."""

    qo_indptr: torch.Tensor  # int32 [B+1]
    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # int32 [kv_capacity]: the step's slots first
    tree_mask: torch.Tensor  # int64 [T]
    node_req: torch.Tensor  # int32 [T]
    items: torch.Tensor  # int32 [capacity, 4]
    req_table: torch.Tensor  # int32 [B, 3]
    po: torch.Tensor | None  # fp32 [capacity, Hkv, block_m, D]
    plse: torch.Tensor | None  # fp32 [capacity, Hkv, block_m]
    batch: int
    total_nodes: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    cache_slots: int
    nodes_in_cache: bool
    dtype: torch.dtype
    dispatch: autotune.Plan
    capacity: int
    num_items: int
    split_len: int  # prefix keys per split
    tree_block: int  # keys of the tree block (a power of two >= the largest tree)
    # the one-call path's device schedule (`tree_attention`): the kernels build the schedule and check the
    # metadata on the device each run, recording problems here; num_items and split_len are then -1 (known
    # on the device only), `capacity` is the bound on work items, and `items` their scratch
    status: torch.Tensor | None = None
    device_args: tuple | None = None  # that schedule's launch arguments (`_device_args`), which the plan fixes

    @property
    def device(self) -> torch.device:
        return self.items.device

    @property
    def variant(self) -> str:
        return self.dispatch.variant

    def update(self, qo_indptr, kv_indptr, kv_indices, tree_mask, *, validate: bool = True) -> "TreeAttnPlan":
        """Refill these buffers in place for a new step (same batch and node count, a schedule that fits
        `capacity` items and kv_indices that fit the kv_indices buffer), so a CUDA graph captured on this
        plan replays the new step. Host step: the inputs may be on the plan's device (read with a sync) or on
        the CPU (no sync; copied into the buffers). A plan with schedule="device" is only refilled: no schedule
        and, with validate=False, no read of the inputs' values on the host (device inputs: no sync)."""
        fn = "tree_attn.TreeAttnPlan.update"
        _check_meta_tensors(fn, qo_indptr, kv_indptr, kv_indices, tree_mask, self.device, host_ok=True)
        if qo_indptr.shape[0] - 1 != self.batch or tree_mask.shape[0] != self.total_nodes:
            raise ValueError(f"{fn}: the step has {qo_indptr.shape[0] - 1} requests and {tree_mask.shape[0]} nodes "
                             f"but the plan was built for {self.batch} and {self.total_nodes}; build a new plan with "
                             "tree_attn.plan")
        used = kv_indices.shape[0]
        if used > self.kv_indices.shape[0]:
            raise ValueError(f"{fn}: {used} kv_indices exceed the plan's buffer of {self.kv_indices.shape[0]}; "
                             "build the plan with a larger kv_capacity")
        if self.status is not None:  # schedule="device": the kernels read kv_indptr[0..B], so its length too
            if kv_indptr.shape[0] != self.batch + 1:
                raise ValueError(f"{fn}: the step has {qo_indptr.shape[0] - 1} requests and {tree_mask.shape[0]} "
                                 f"nodes but kv_indptr has {kv_indptr.shape[0]} entries; both indptr arrays are "
                                 f"[B+1] = [{self.batch + 1}]")
            if validate:
                qo, kv, mask = _host_values(qo_indptr, kv_indptr, tree_mask)
                _validate(fn, qo, kv, kv_indices, mask, self.cache_slots, self.nodes_in_cache)
            self.qo_indptr.copy_(qo_indptr)
            self.kv_indptr.copy_(kv_indptr)
            self.kv_indices[:used].copy_(kv_indices)
            self.tree_mask.copy_(tree_mask)
            return self
        qo, kv, mask = _host_values(qo_indptr, kv_indptr, tree_mask)
        if validate:
            _validate(fn, qo, kv, kv_indices, mask, self.cache_slots, self.nodes_in_cache)
        largest = max([qo[r + 1] - qo[r] for r in range(self.batch)] + [1])
        if largest > self.tree_block:
            raise ValueError(f"{fn}: a request has {largest} nodes but the plan's tree block holds {self.tree_block}; "
                             "build the plan with max_nodes=64 to reuse it for any tree")
        items, table, node_req, split_len, count = _schedule(fn, qo, kv, self.nodes_in_cache, self.num_qo_heads //
                                                             self.num_kv_heads, self.dispatch.config,
                                                             _target_items(self.device, self.num_kv_heads,
                                                                           self.dispatch.config),
                                                             self.capacity)
        self.qo_indptr.copy_(torch.tensor(qo, dtype=torch.int32))
        self.kv_indptr.copy_(torch.tensor(kv, dtype=torch.int32))
        self.kv_indices[:used].copy_(kv_indices)
        self.tree_mask.copy_(tree_mask)
        self.node_req.copy_(node_req)
        self.items.copy_(items)
        self.req_table.copy_(table)
        self.num_items, self.split_len = count, split_len
        return self


def _target_items(device: torch.device, hkv: int, cfg: SplitConfig | None) -> int:
    if cfg is None:
        return 1
    return max(1, round(cfg.programs_per_sm * _sm_count(device) / hkv))


def _split_blocks(tiles: list[float], lens: list[int], bn: int, target: int, item_cost: int, waves: int = 8) -> int:
    """Key blocks per prefix split: the count that minimises the modelled time, whole waves (1 to `waves`) of
    `target` prefix items times the blocks of one item plus `item_cost` (its fixed work: the q tile, the partial
    output written and merged). The tree items are short and fill the last wave's gaps: not counted. The
    device schedule (kernels/split.py `_split_len`) computes the same with waves = DEVICE_WAVES."""
    blocks = [-(-L // bn) for L in lens]
    total = math.ceil(sum(t * b for t, b in zip(tiles, blocks)))  # tiles may be fractional (halves groups)
    if total == 0:
        return 1

    def items(per):
        return sum(t * -(-b // per) for t, b in zip(tiles, blocks))

    best = None
    for w in range(1, waves + 1):
        per = max(1, -(-total // (w * target)))
        cost = (-(-items(per) // target) * (per + item_cost), -per)  # ties: fewer, longer splits
        if best is None or cost < best[0]:
            best = (cost, per)
    return best[1]


def _schedule(fn, qo, kv, nodes_in_cache, group, cfg: SplitConfig | WSConfig | None, target: int,
              capacity: int | None, waves: int = 8):
    """(items [capacity, 4], req_table [B, 3], node_req [T], split_len, items used), all int32 CPU tensors.

    One split length for every request (`_split_blocks`; `target` prefix items fill one wave of the
    GPU, the KV heads being the grid's second axis). Items run split-major, row block minor, so the row
    blocks of one split read the same K/V rows close together in time (L2). The Triton kernel takes the tree
    block as an item of its own (lo = -1); the "ws" kernel folds it into the request's last split (the item
    whose hi is the prefix's end; a request without prefix keys has one item with lo = hi).

    With two consumers and `pair_halves`, a group whose second 64-row tile has no row ("halves": its two consumers
    split one tile's keys) takes two splits in one item: [lo of split c, hi of split c + 1) for even c, so that its
    CTA does the work of a full group's; the item's group field carries the distance to the slot of split c + 1 in
    its upper 16 bits, and that slot is an unused item whose LSE rows the pair's CTA sets to -inf (the merge skips
    them).

    With `cluster` (2-CTA clusters), a request of two groups starts at an even item (an unused item before it
    where needed), so that its two groups of each split are the CTAs 2i and 2i + 1 of one cluster; the items are an
    even number."""
    fold = isinstance(cfg, WSConfig)
    clustered = fold and cfg.cluster
    B = len(qo) - 1
    bm, bn = (cfg.block_m, cfg.block_n) if cfg is not None else (64, 64)
    ns = [qo[r + 1] - qo[r] for r in range(B)]
    lens = [kv[r + 1] - kv[r] - (ns[r] if nodes_in_cache else 0) for r in range(B)]
    tiles = [-(-n * group // bm) for n in ns]
    pairs = fold and cfg.consumers == 2 and cfg.pair_halves

    def halves(r, t):  # the group's second tile has no row
        return pairs and bm * t + 64 >= ns[r] * group

    # the CTAs' work in full groups: a halves group's items take two splits each, in half the CTAs
    work = [t - 0.5 * sum(halves(r, g) for g in range(t)) for r, t in enumerate(tiles)]
    per = _split_blocks(work, lens, bn, target, cfg.item_cost if cfg is not None else 0, waves)

    def count(per_split):
        if fold:  # (clustered: at most one unused item before each request of two groups)
            return sum(t * max(1, -(-L // (per_split * bn))) + (clustered and t == 2) for t, L in zip(tiles, lens) if t)
        return sum(t * (-(-L // (per_split * bn)) + 1) for t, L in zip(tiles, lens) if t)

    if capacity is not None:
        longest = max([-(-L // bn) for L in lens] + [1])
        while count(per) > capacity and per < longest:
            per = min(per * 2, longest)
        if count(per) > capacity:
            raise ValueError(f"{fn}: the step needs {count(per)} work items even with one split per request, more "
                             f"than capacity={capacity}; plan with a larger capacity (or capacity=None)")
    split_len = per * bn
    items = []
    table = [[0, 0, 0] for _ in range(B)]
    node_req = []
    for r in range(B):
        node_req += [r] * ns[r]
        if not tiles[r]:
            continue
        splits = max(1, -(-lens[r] // split_len)) if fold else -(-lens[r] // split_len)
        if clustered and tiles[r] == 2 and len(items) % 2:
            items.append([-1, 0, 0, 0])
        table[r] = [len(items), splits if fold else splits + 1, tiles[r]]
        end = kv[r] + lens[r]
        for c in range(splits):
            lo = kv[r] + c * split_len
            hi = min(lo + split_len, end)
            for t in range(tiles[r]):
                if not halves(r, t):
                    items.append([r, t, lo, hi])
                elif c % 2:  # taken by the item of split c - 1
                    items.append([-1, 0, 0, 0])
                elif c + 1 < splits:
                    items.append([r, t | tiles[r] << 16, lo, min(lo + 2 * split_len, end)])
                else:
                    items.append([r, t, lo, hi])
        if not fold:
            items += [[r, t, -1, kv[r] + lens[r]] for t in range(tiles[r])]
    used = len(items)
    size = capacity if capacity is not None else max(used, 1)
    if clustered and size % 2:  # whole clusters
        size += 1
    items += [[-1, 0, 0, 0]] * (size - used)
    return (torch.tensor(items, dtype=torch.int32).reshape(size, 4), torch.tensor(table, dtype=torch.int32).reshape(B, 3),
            torch.tensor(node_req, dtype=torch.int32), split_len, used)


def _host_inputs(fn, qo_indptr, kv_indptr, kv_indices, tree_mask, device=None, host_ok: bool = False):
    """(qo, kv) as lists and the masks as an int64 CPU tensor, after the dtype, rank and device checks.
    kv_indices stays where it is (it can be long); `_validate` checks it there. `host_ok`: CPU tensors are
    accepted too (they are read without a device sync)."""
    _check_meta_tensors(fn, qo_indptr, kv_indptr, kv_indices, tree_mask, device, host_ok)
    return _host_values(qo_indptr, kv_indptr, tree_mask)


def _host_values(qo_indptr, kv_indptr, tree_mask):
    """(qo, kv) as lists and the masks as an int64 CPU tensor (a sync for device tensors)."""
    return qo_indptr.tolist(), kv_indptr.tolist(), tree_mask.cpu()


def _check_meta_tensors(fn, qo_indptr, kv_indptr, kv_indices, tree_mask, device=None, host_ok: bool = False):
    """The metadata tensors' types, dtypes, ranks and devices (no read of their values)."""
    for name, t, dt in (("qo_indptr", qo_indptr, torch.int32), ("kv_indptr", kv_indptr, torch.int32),
                        ("kv_indices", kv_indices, torch.int32), ("tree_mask", tree_mask, torch.int64)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}; pass torch.tensor(..., "
                            f"dtype={dt})")
        if t.dtype != dt:
            raise TypeError(f"{fn}: {name} has dtype {t.dtype}; pass it as {dt}")
        if t.dim() != 1:
            raise ValueError(f"{fn}: {name} must be 1-D, got shape {tuple(t.shape)}; pass a flat tensor "
                             f"({name}.reshape(-1) if the values are right)")
        if device is not None and t.device != torch.device(device) and not (host_ok and t.device.type == "cpu"):
            raise ValueError(f"{fn}: {name} is on {t.device} but the call runs on {device}; move it there")


def _validate(fn, qo, kv, kv_indices, mask, cache_slots, nodes_in_cache):
    """Check one step's indptr arrays, slot indices and masks (host step: one sync for the slots)."""
    B = len(qo) - 1
    if len(kv) != len(qo):
        raise ValueError(f"{fn}: qo_indptr has {len(qo)} entries but kv_indptr has {len(kv)}; both are [B+1] for "
                         "the same B requests")
    if B < 0:
        raise ValueError(f"{fn}: qo_indptr is empty; it needs B+1 entries, starting with 0")
    for name, ptr, total, what in (("qo_indptr", qo, mask.shape[0], "tree_mask / q rows"),
                                   ("kv_indptr", kv, kv_indices.shape[0], "kv_indices")):
        if ptr[0] != 0:
            raise ValueError(f"{fn}: {name}[0] = {ptr[0]}; it must start at 0")
        bad = [r for r in range(B) if ptr[r + 1] < ptr[r]]
        if bad:
            raise ValueError(f"{fn}: {name} decreases at request {bad[0]} ({ptr[bad[0]]} -> {ptr[bad[0] + 1]}); "
                             "it must be non-decreasing offsets")
        if ptr[-1] != total:
            raise ValueError(f"{fn}: {name}[-1] = {ptr[-1]} but there are {total} entries of {what}; the last offset "
                             "must equal that length")
    if kv_indices.numel():
        out = (kv_indices < 0) | (kv_indices >= cache_slots)
        if bool(out.any()):
            first = int(out.nonzero()[0, 0])
            raise ValueError(f"{fn}: kv_indices[{first}] = {int(kv_indices[first])} is outside the cache's "
                             f"{cache_slots} token slots; every slot must be in [0, slots)")
    ns = [qo[r + 1] - qo[r] for r in range(B)]
    for r, n in enumerate(ns):
        if n > MAX_NODES:
            raise ValueError(f"{fn}: request {r} has {n} tree nodes, more than {MAX_NODES}; split the tree or "
                             "the request")
        if nodes_in_cache and kv[r + 1] - kv[r] < n:
            raise ValueError(f"{fn}: request {r} lists {kv[r + 1] - kv[r]} kv slots but has {n} nodes; without "
                             "k_new/v_new its last n kv_indices entries must be its nodes' slots")
    T = mask.shape[0]
    if T == 0:
        return
    # per node: its request's first node and size, its local index; bits j of every mask as a [T, 64] table
    n_of = torch.repeat_interleave(torch.tensor(ns), torch.tensor(ns))
    first = torch.repeat_interleave(torch.tensor(qo[:-1]), torch.tensor(ns))
    local = torch.arange(T) - first
    j = torch.arange(MAX_NODES)
    bits = ((mask[:, None] >> j) & 1).bool()
    stray = bits & (j[None, :] >= n_of[:, None])
    if stray.any():
        t, b = (int(x) for x in stray.nonzero()[0])
        r = int(torch.searchsorted(torch.tensor(qo), t, right=True)) - 1
        raise ValueError(f"{fn}: tree_mask of node {t} (request {r}, local {int(local[t])}) sets bit {b}, but the "
                         f"request has {ns[r]} nodes; bits must name local nodes 0..{ns[r] - 1}")
    own = bits[torch.arange(T), local]
    if not own.all():
        t = int((~own).nonzero()[0, 0])
        raise ValueError(f"{fn}: tree_mask of node {t} (local {int(local[t])}) lacks its own bit {int(local[t])}; "
                         "every node must see itself")
    # ancestor-closed: every node j that node t sees has a mask inside t's
    seen_masks = mask[(first[:, None] + j[None, :]).clamp(max=T - 1)]  # [T, 64]: mask of local node j
    open_ = bits & ((seen_masks & ~mask[:, None]) != 0)
    if open_.any():
        t, b = (int(x) for x in open_.nonzero()[0])
        raise ValueError(f"{fn}: tree_mask is not ancestor-closed: node {t} sees local node {b} but not all of node "
                         f"{b}'s ancestors; a node's mask must include the masks of the nodes it sees")


def plan(qo_indptr, kv_indptr, kv_indices, tree_mask, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
         cache_slots: int, nodes_in_cache: bool = False, dtype: torch.dtype = torch.bfloat16,
         variant: str | None = None, capacity: int | None = None, kv_capacity: int | None = None,
         max_nodes: int | None = None, validate: bool = True, schedule: str = "host") -> TreeAttnPlan:
    """Check one step's trees and indices and build its split-KV schedule (host step: may sync).

    `cache_slots`: token slots of the cache (pages * page_size for a paged cache); kv_indices outside
    [0, cache_slots) raise here. `nodes_in_cache`: no k_new/v_new; the last n_r kv_indices entries of
    request r are its nodes' slots in local order. `capacity` fixes the number of work items (the
    split kernel's grid) and `kv_capacity` the kv_indices buffer, so `update` can refill the plan for
    later steps under one CUDA graph, with `max_nodes` the largest tree any of those steps holds; by
    default all three fit this step.

    `schedule="device"` (the Triton kernels): the plan holds no schedule; `run` builds it on the device from the
    plan's metadata buffers each call and checks them there (`check_metadata` raises what it finds), and `update`
    only copies the next step's metadata into those buffers (no schedule, no host read of device tensors with
    validate=False). Its work-item bound comes from the shapes (`capacity` must be None), its tree block fits any
    tree of the plan's node count, and `kv_capacity` sizes the kv_indices buffer as for the host schedule."""
    fn = "tree_attn.plan"
    if schedule not in ("host", "device"):
        raise ValueError(f"{fn}: schedule={schedule!r}; pass 'host' (the schedule built here) or 'device' (built by "
                         "the kernels at each run)")
    if schedule == "device" and capacity is not None:
        raise ValueError(f"{fn}: capacity={capacity} sizes the host schedule; with schedule='device' the bound on "
                         "work items comes from the shapes: pass capacity=None")
    device = tree_mask.device if isinstance(tree_mask, torch.Tensor) else None
    qo, kv, mask = _host_inputs(fn, qo_indptr, kv_indptr, kv_indices, tree_mask, device)
    for name, val, optional in (("num_qo_heads", num_qo_heads, False), ("num_kv_heads", num_kv_heads, False),
                                ("head_dim", head_dim, False), ("cache_slots", cache_slots, False),
                                ("capacity", capacity, True), ("kv_capacity", kv_capacity, True),
                                ("max_nodes", max_nodes, True)):
        if (val is not None or not optional) and (isinstance(val, bool) or not isinstance(val, int)):
            raise TypeError(f"{fn}: {name} must be an int, got {type(val).__name__} {val!r}; pass an int"
                            + (", or None" if optional else ""))
    if num_kv_heads <= 0 or num_qo_heads <= 0 or num_qo_heads % num_kv_heads:
        raise ValueError(f"{fn}: {num_qo_heads} query heads are not a multiple of {num_kv_heads} KV heads; GQA needs "
                         "H = G * Hkv")
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{fn}: dtype {dtype} is not supported; q, k and v must be bfloat16 or float16")
    if validate:
        _validate(fn, qo, kv, kv_indices, mask, cache_slots, nodes_in_cache)
    largest = max([qo[r + 1] - qo[r] for r in range(len(qo) - 1)] + [1])
    if max_nodes is not None and not largest <= max_nodes <= MAX_NODES:
        raise ValueError(f"{fn}: max_nodes={max_nodes} is outside [{largest}, {MAX_NODES}] (the largest tree of "
                         f"this step has {largest} nodes); pass a value in that range, or None")
    group = num_qo_heads // num_kv_heads
    dispatch = _plan(variant, device, head_dim, group, (max_nodes or largest) * group, dtype)
    cfg = dispatch.config
    n_kv = kv_indices.shape[0]
    kv_buf = torch.zeros(max(n_kv, kv_capacity or 0, 1), dtype=torch.int32, device=device)
    kv_buf[:n_kv].copy_(kv_indices)
    if schedule == "device":
        if dispatch.kernel != "split":
            raise ValueError(f"{fn}: schedule='device' is the Triton kernels' and this plan runs "
                             f"{dispatch.variant!r}; pass schedule='host', or a variant of the Triton kernels")
        if cache_slots == 0:  # the device checks read the cache's last slot in place of one outside it
            raise ValueError(f"{fn}: schedule='device' needs a cache of at least one token slot, got cache_slots=0; "
                             "pass schedule='host'")
        B, T = len(qo) - 1, mask.shape[0]
        cap = _device_capacity(device, num_kv_heads, cfg, T, B, group)
        return _device_scheduled((qo_indptr.clone(), kv_indptr.clone(), kv_buf, tree_mask.clone()),
                                 _device_scratch(cap, B, num_kv_heads, cfg.block_m, head_dim, device), cap,
                                 num_qo_heads, num_kv_heads, head_dim, int(cache_slots), nodes_in_cache, dtype,
                                 dispatch)
    items, table, node_req, split_len, used = _schedule(fn, qo, kv, nodes_in_cache, group, cfg,
                                                        _target_items(device, num_kv_heads, cfg), capacity)
    size = items.shape[0]
    po = plse = None
    if cfg is not None:
        po = torch.empty(size, num_kv_heads, cfg.block_m, head_dim, dtype=torch.float32, device=device)
        plse = torch.empty(size, num_kv_heads, cfg.block_m, dtype=torch.float32, device=device)
    return TreeAttnPlan(
        qo_indptr=qo_indptr.clone(), kv_indptr=kv_indptr.clone(), kv_indices=kv_buf, tree_mask=tree_mask.clone(),
        node_req=node_req.to(device), items=items.to(device), req_table=table.to(device), po=po, plse=plse,
        batch=len(qo) - 1, total_nodes=mask.shape[0], num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, cache_slots=int(cache_slots), nodes_in_cache=nodes_in_cache, dtype=dtype,
        dispatch=dispatch, capacity=size, num_items=used, split_len=split_len,
        tree_block=_tree_block(max_nodes or largest))


# --------------------------------------------------------------------------------------------
# 3. Torch registration.
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("specpilot_tree_attn::run", mutates_args=("items", "req_table", "po", "plse", "out", "lse",
                                                                          "status"))
def _run_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor | None,
            v_new: torch.Tensor | None, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
            tree_mask: torch.Tensor, node_req: torch.Tensor, items: torch.Tensor, req_table: torch.Tensor,
            po: torch.Tensor | None, plse: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor | None,
            sm_scale: float, kernel: str, cfg: list[int], tree_block: int, status: torch.Tensor | None) -> None:
    config = _cfg_of(kernel, cfg)
    _launch(kernel, config, tree_block, q, k_cache, v_cache, k_new, v_new, qo_indptr, kv_indptr, kv_indices, tree_mask, node_req,
            items, req_table, po, plse, out, lse, sm_scale, status=status)


@_run_op.register_fake
def _(*args, **kwargs) -> None:
    return None


def _cfg_ints(cfg: SplitConfig | WSConfig | None) -> list[int]:
    if isinstance(cfg, WSConfig):
        return [cfg.consumers, cfg.block_n, cfg.num_stages, cfg.producer_regs, cfg.consumer_regs, int(cfg.pingpong),
                int(cfg.kv_ahead), int(cfg.q_in_regs), int(cfg.overlap), cfg.merge_warps, cfg.merge_parts,
                cfg.producers, int(cfg.pair_halves), int(cfg.cluster)]
    return [] if cfg is None else [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.merge_warps,
                                   cfg.merge_parts]


def _cfg_of(kernel: str, cfg: list[int]) -> SplitConfig | WSConfig | None:
    """The launch config `_cfg_ints` flattened (the custom op takes ints)."""
    if not cfg:
        return None
    if kernel == "ws":
        return WSConfig(*cfg[:5], pingpong=bool(cfg[5]), kv_ahead=bool(cfg[6]), q_in_regs=bool(cfg[7]),
                        overlap=bool(cfg[8]), merge_warps=cfg[9], merge_parts=cfg[10], producers=cfg[11],
                        pair_halves=bool(cfg[12]), cluster=bool(cfg[13]))
    return SplitConfig(*cfg[:4], merge_warps=cfg[4], merge_parts=cfg[5])


# --------------------------------------------------------------------------------------------
# 4. Public functions.
# --------------------------------------------------------------------------------------------


def _check_cache(fn, name, c, p: TreeAttnPlan, dtype, device):
    if not isinstance(c, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(c).__name__}; pass the cache tensor")
    if c.dim() not in (3, 4):
        raise ValueError(f"{fn}: {name} has shape {tuple(c.shape)}; pass a token-slot cache [slots, Hkv, D] or a "
                         "paged cache [pages, page_size, Hkv, D]")
    if c.shape[-2:] != (p.num_kv_heads, p.head_dim):
        raise ValueError(f"{fn}: {name} has shape {tuple(c.shape)} but the plan has Hkv={p.num_kv_heads}, "
                         f"D={p.head_dim}; its last two dims must be [{p.num_kv_heads}, {p.head_dim}]")
    slots = _cache_slots(c)
    if slots < p.cache_slots:
        raise ValueError(f"{fn}: {name} has {slots} token slots but the plan checked indices against "
                         f"{p.cache_slots}; plan with cache_slots={slots}")
    _check_tensor(fn, name, c, dtype, device)


def _check_tensor(fn, name, t, dtype, device):
    if t.dtype != dtype:
        raise TypeError(f"{fn}: {name} has dtype {t.dtype} but q has {dtype}; q, k and v must share one dtype")
    if t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device} but q is on {device}; move it to {device}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{fn}: {name} must be contiguous in its last dim (stride {t.stride(-1)}); pass "
                         f"{name}.contiguous()")


def run(plan: TreeAttnPlan, q, k_cache, v_cache, *, k_new=None, v_new=None, sm_scale=None, out=None,
        return_lse: bool = False):
    """Attention of every tree node over its prefix and its ancestors-or-self, from a `TreeAttnPlan`.

    Returns out `[T, H, D]` (q's dtype), or (out, lse) with lse fp32 `[T, H]` (natural log) when
    `return_lse`. Never syncs the host; CUDA graphs capture it. Trusts the plan's indices."""
    fn = "tree_attn.run"
    p = plan
    if not isinstance(p, TreeAttnPlan):
        raise TypeError(f"{fn}: plan is a {type(p).__name__}, not a tree_attn.TreeAttnPlan; build it with "
                        "tree_attn.plan(...)")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{fn}: q must be a torch.Tensor, got {type(q).__name__}; pass q as [T, H, D]")
    shape = (p.total_nodes, p.num_qo_heads, p.head_dim)
    if tuple(q.shape) != shape:
        raise ValueError(f"{fn}: q has shape {tuple(q.shape)} but the plan has T={shape[0]} nodes, H={shape[1]} "
                         f"heads and D={shape[2]}; q must be [{shape[0]}, {shape[1]}, {shape[2]}]")
    if q.dtype != p.dtype:
        fix = (f"plan with dtype={q.dtype}, or pass q.to({p.dtype})" if q.dtype in (torch.bfloat16, torch.float16)
               else f"tree_attn runs bfloat16 or float16: pass q.to({p.dtype}) (and caches of that dtype)")
        raise TypeError(f"{fn}: q has dtype {q.dtype} but the plan was built for {p.dtype}; {fix}")
    if q.device != p.device:
        raise ValueError(f"{fn}: q is on {q.device} but the plan's buffers are on {p.device}; plan on {q.device}")
    return _run(fn, p, q, k_cache, v_cache, k_new, v_new, sm_scale, out, return_lse)


def _run(fn, p: TreeAttnPlan, q, k_cache, v_cache, k_new, v_new, sm_scale, out, return_lse: bool):
    """`run` after its checks of q against the plan (shape, dtype, device): the other tensors' checks, the
    outputs, the launch."""
    shape = (p.total_nodes, p.num_qo_heads, p.head_dim)
    dtype, device = q.dtype, q.device
    _check_tensor(fn, "q", q, dtype, device)
    _check_cache(fn, "k_cache", k_cache, p, dtype, device)
    _check_cache(fn, "v_cache", v_cache, p, dtype, device)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{fn}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape; "
                         "they must have the same layout")
    if (k_new is None) != (v_new is None):
        raise ValueError(f"{fn}: k_new is {'missing' if k_new is None else 'given'} but v_new is "
                         f"{'missing' if v_new is None else 'given'}; pass both, or neither when the nodes are "
                         "already in the cache")
    if (k_new is None) != p.nodes_in_cache:
        raise ValueError(f"{fn}: the plan was built with nodes_in_cache={p.nodes_in_cache} but k_new/v_new are "
                         f"{'missing' if k_new is None else 'given'}; plan with nodes_in_cache={k_new is None}")
    if k_new is not None:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            want = (p.total_nodes, p.num_kv_heads, p.head_dim)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{fn}: {name} is {got}; it must be [T, Hkv, D] = {list(want)}")
            _check_tensor(fn, name, t, dtype, device)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    elif not isinstance(out, torch.Tensor) or out.shape != shape or out.dtype != dtype:
        got = (tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{fn}: out is {got}; it must be {list(shape)} of {dtype}")
    else:
        _check_tensor(fn, "out", out, dtype, device)
    lse = torch.empty(shape[:2], dtype=torch.float32, device=device) if return_lse else None
    if sm_scale is not None and (isinstance(sm_scale, (str, bytes, bool)) or not hasattr(sm_scale, "__float__")):
        raise TypeError(f"{fn}: sm_scale must be a number, got {type(sm_scale).__name__} {sm_scale!r}; pass a float, "
                        f"or None for head_dim**-0.5 = {p.head_dim ** -0.5:.4g}")
    scale = p.head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    args = (q, k_cache, v_cache, k_new, v_new, p.qo_indptr, p.kv_indptr, p.kv_indices, p.tree_mask, p.node_req,
            p.items, p.req_table, p.po, p.plse, out, lse, scale)
    if torch.compiler.is_compiling():
        torch.ops.specpilot_tree_attn.run(*args, p.dispatch.kernel, _cfg_ints(p.dispatch.config), p.tree_block,
                                          p.status)
    else:
        _launch(p.dispatch.kernel, p.dispatch.config, p.tree_block, *args, status=p.status, device_args=p.device_args)
    return (out, lse) if return_lse else out


def tree_attention(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, *, sm_scale=None, k_new=None,
                   v_new=None, out=None, return_lse: bool = False, variant: str | None = None, keep_plan: bool = False):
    """`plan` then `run` in one call (the plan step checks the inputs and may sync the host).

    `keep_plan=True`: the plan is kept for the next call with the same four metadata tensor objects, unchanged
    since (their torch version counters), the same shapes and the same stream, so the layers of one decoding step
    plan once (the first call) and run on that plan; a step with new metadata tensors, or the same ones written in
    place by torch, plans again. Only for metadata that nothing writes behind torch's back: a write by a custom
    CUDA or Triton kernel does not move the version counter, and the kept plan would be stale.

    q `[T, H, D]` ragged by qo_indptr; caches `[slots, Hkv, D]` or `[pages, page_size, Hkv, D]` with
    kv_indices listing token slots per request (kv_indptr); tree_mask int64 `[T]`, bit j: local node j
    is an ancestor of the node or the node itself (gdn.TreePlan.anc). k_new/v_new `[T, Hkv, D]`: the
    nodes' own keys/values; without them the last n_r kv_indices entries of each request are its nodes."""
    fn = "tree_attn.tree_attention"
    if not keep_plan:
        p = _device_hit(q, k_cache, (qo_indptr, kv_indptr, kv_indices, tree_mask), k_new is None, variant)
        if p is not None:  # the same metadata tensors and shapes as the call before on this stream: its plan, and
            # its checks, which the same objects and shapes pass again (`_run` checks the caches, k_new, v_new, out)
            return _run(fn, p, q, k_cache, v_cache, k_new, v_new, sm_scale, out, return_lse)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}; pass a tensor")
    if q.dim() != 3:
        raise ValueError(f"{fn}: q has shape {tuple(q.shape)}; it must be [T, H, D]")
    if k_cache.dim() not in (3, 4):
        raise ValueError(f"{fn}: k_cache has shape {tuple(k_cache.shape)}; pass [slots, Hkv, D] or "
                         "[pages, page_size, Hkv, D]")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{fn}: q has dtype {q.dtype}; q, k and v must be bfloat16 or float16")
    if k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"{fn}: q has head dim {q.shape[-1]} but k_cache has {k_cache.shape[-1]}; they must match")
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("qo_indptr", qo_indptr),
                    ("tree_mask", tree_mask)):
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but q is on {q.device}; move it to {q.device}")
    if isinstance(tree_mask, torch.Tensor) and tree_mask.dim() == 1 and tree_mask.shape[0] != q.shape[0]:
        raise ValueError(f"{fn}: tree_mask has {tree_mask.shape[0]} entries but q has {q.shape[0]} rows; one mask "
                         "word per tree node")
    slots = _cache_slots(k_cache)
    p = None if keep_plan else _device_plan(fn, q, k_cache, qo_indptr, kv_indptr, kv_indices, tree_mask, slots,
                                            k_new is None, variant)
    if p is not None:
        return run(p, q, k_cache, v_cache, k_new=k_new, v_new=v_new, sm_scale=sm_scale, out=out,
                   return_lse=return_lse)
    if keep_plan:
        meta = (qo_indptr, kv_indptr, kv_indices, tree_mask)
        shape = (q.shape[1], k_cache.shape[-2], q.shape[-1], slots, k_new is None, q.dtype, variant, *_stream_key(q))
        p = _one_call_plan(meta, shape)
    if p is None:
        p = globals()["plan"](qo_indptr, kv_indptr, kv_indices, tree_mask, num_qo_heads=q.shape[1],
                              num_kv_heads=k_cache.shape[-2], head_dim=q.shape[-1], cache_slots=slots,
                              nodes_in_cache=k_new is None, dtype=q.dtype, variant=variant)
        if keep_plan:
            _keep_one_call_plan(meta, shape, p)
    return run(p, q, k_cache, v_cache, k_new=k_new, v_new=v_new, sm_scale=sm_scale, out=out, return_lse=return_lse)


def _device_plan(fn, q, k_cache, qo_indptr, kv_indptr, kv_indices, tree_mask, slots: int, nodes_in_cache: bool,
                 variant) -> "TreeAttnPlan | None":
    """A plan whose schedule the kernels build on the device (no host read of the metadata), with scratch sized
    from the shapes, kept for the calls after it with the same metadata tensors (`_device_hit`); None where the
    call takes the host plan instead (the torch reference or the "ws" kernel, or more than DEVICE_MAX_BATCH
    requests)."""
    meta = (qo_indptr, kv_indptr, kv_indices, tree_mask)
    where = _stream_key(q)
    _check_meta_tensors(fn, qo_indptr, kv_indptr, kv_indices, tree_mask, q.device)
    if qo_indptr.shape[0] != kv_indptr.shape[0]:
        raise ValueError(f"{fn}: qo_indptr has {qo_indptr.shape[0]} entries but kv_indptr has {kv_indptr.shape[0]}; "
                         "both are [B+1] for the same B requests")
    B, (T, H, D), Hkv = qo_indptr.shape[0] - 1, q.shape, k_cache.shape[-2]
    if B < 0:
        raise ValueError(f"{fn}: qo_indptr is empty; it needs B+1 entries, starting with 0")
    if B > DEVICE_MAX_BATCH or H % Hkv or slots == 0:  # the device checks read the last slot for a bad one
        return None
    dispatch = _plan(variant, q.device, D, H // Hkv, min(T, MAX_NODES) * (H // Hkv), q.dtype)
    if dispatch.kernel != "split":
        return None
    cfg = dispatch.config
    cap = _device_capacity(q.device, Hkv, cfg, T, B, H // Hkv)
    key = (*where, Hkv, cfg.block_m, D)
    have = _DEVICE_SCRATCH.get(key)
    if have is None or have[0].shape[0] < cap or have[3].shape[0] < 3 * B:
        have = _device_scratch(max(cap, have[0].shape[0] if have else 0), max(B, have[3].shape[0] // 3 if have else 0),
                               Hkv, cfg.block_m, D, q.device)
        _DEVICE_SCRATCH[key] = have
    p = _device_scheduled(meta, have, cap, H, Hkv, D, slots, nodes_in_cache, q.dtype, dispatch)
    _DEVICE_LAST[where] = (_device_shape(q, k_cache, meta, slots, nodes_in_cache, variant), meta, p)
    return p


def _stream_key(q) -> tuple:
    """(device, raw stream) of q's current stream: a device plan's scratch is written by each run on it."""
    dev = q.device
    return dev, (torch._C._cuda_getCurrentRawStream(dev.index) if dev.type == "cuda" else 0)


def _device_shape(q, k_cache, meta, slots: int, nodes_in_cache: bool, variant) -> tuple:
    """What a device plan depends on besides its metadata tensors' identity: the call's shapes, dtype, variant."""
    qo_indptr, kv_indptr, kv_indices, tree_mask = meta
    return (q.shape, k_cache.shape[-2], slots, nodes_in_cache, q.dtype, variant, autotune.forced(OP), is_interpreter(),
            qo_indptr.shape[0], kv_indptr.shape[0], kv_indices.shape[0], tree_mask.shape[0])


def _device_hit(q, k_cache, meta, nodes_in_cache: bool, variant) -> "TreeAttnPlan | None":
    """The device plan of the call before on q's device and stream, where this call passes the same four metadata
    tensor objects with the same shapes (so the checks they passed hold), the same q shape and dtype, and a cache of
    the same KV heads and slots; None otherwise. The layers of one step call with the same metadata tensors, whose
    values the kernels read on the device: the same tensors take the same plan. It reads no value."""
    if not isinstance(q, torch.Tensor) or not isinstance(k_cache, torch.Tensor) or k_cache.dim() not in (3, 4):
        return None
    last = _DEVICE_LAST.get(_stream_key(q))
    if last is None or any(a is not b for a, b in zip(last[1], meta)):
        return None
    slots = _cache_slots(k_cache)
    return last[2] if last[0] == _device_shape(q, k_cache, meta, slots, nodes_in_cache, variant) else None


def _device_scheduled(meta, scratch, cap: int, H: int, Hkv: int, D: int, slots: int, nodes_in_cache: bool,
                      dtype, dispatch) -> "TreeAttnPlan":
    """The plan `run` launches with the schedule built on the device: metadata `meta` (qo_indptr, kv_indptr,
    kv_indices, tree_mask), read by the kernels at each run, and the first `cap` items of `scratch`
    (`_device_scratch`). Its tree block fits any tree of its node count."""
    qo_indptr, kv_indptr, kv_indices, tree_mask = meta
    po, plse, items, table = scratch
    B, T = qo_indptr.shape[0] - 1, tree_mask.shape[0]
    req_table, po, status, tn = table[:3 * B].view(B, 3), po[:cap], _status(qo_indptr.device), _tree_block(
        max(1, min(T, MAX_NODES)))
    return TreeAttnPlan(
        qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, tree_mask=tree_mask, node_req=qo_indptr,
        items=items, req_table=req_table, po=po, plse=plse[:cap], batch=B, total_nodes=T, num_qo_heads=H,
        num_kv_heads=Hkv, head_dim=D, cache_slots=slots, nodes_in_cache=nodes_in_cache, dtype=dtype,
        dispatch=dispatch, capacity=cap, num_items=-1, split_len=-1, tree_block=tn, status=status,
        device_args=_device_args(dispatch.config, tn, T, H, Hkv, D, not nodes_in_cache, qo_indptr, kv_indptr,
                                 kv_indices, tree_mask, req_table, po, status, qo_indptr.device))


def _device_capacity(device, Hkv: int, cfg: SplitConfig, T: int, B: int, G: int) -> int:
    """The device schedule's bound on work items for T nodes of B requests: DEVICE_WAVES waves of items and two
    per row block (tests/tree_attn/test_tree_attn_device_schedule.py checks it holds)."""
    return DEVICE_WAVES * _target_items(device, Hkv, cfg) + 2 * (T * G // cfg.block_m + min(B, T))


def _device_scratch(cap: int, B: int, Hkv: int, bm: int, D: int, device) -> tuple:
    """(partial outputs, their LSEs, work-item scratch, request table) of a device schedule of `cap` items."""
    return (torch.empty(cap, Hkv, bm, D, dtype=torch.float32, device=device),
            torch.empty(cap, Hkv, bm, dtype=torch.float32, device=device),
            torch.empty(cap * Hkv * 8, dtype=torch.int32, device=device),
            torch.empty(max(3 * B, 3), dtype=torch.int32, device=device))


def _status(device) -> torch.Tensor:
    """The device's record of the first metadata problem the device checks found (`check_metadata`)."""
    status = _STATUS.get(device)
    if status is None:
        status = _STATUS[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return status


# what each code of the device checks' status means (tree_attn/kernels/split.py); {d} is the detail word
METADATA_PROBLEMS = {
    _k.BAD_QO_INDPTR.value: "qo_indptr is not the offsets of the tree nodes{at}: it must start at 0, never decrease, "
                            "and end at q's row count; pass cumulative node counts",
    _k.BAD_KV_INDPTR.value: "kv_indptr is not the offsets of kv_indices{at}: it must start at 0, never decrease, and "
                            "end at or before len(kv_indices); pass cumulative slot counts",
    _k.TOO_MANY_NODES.value: "request {d} has more than 64 tree nodes (one int64 mask word per node); split the tree "
                             "or the request",
    _k.FEW_NODE_SLOTS.value: "request {d} lists fewer kv slots than it has nodes; without k_new/v_new its last n "
                             "kv_indices entries must be its nodes' slots",
    _k.BAD_SLOT.value: "kv_indices[{d}] is outside the cache's token slots; every slot must be in [0, slots)",
    _k.BAD_MASK.value: "tree_mask of node {d} breaks the tree rules: a bit at or past its request's node count, no "
                       "bit of its own, or a seen node whose ancestors it does not see; pass ancestor-or-self masks "
                       "(gdn.TreePlan.anc)",
    _k.OVER_CAPACITY.value: "the step needs {d} work items, more than the bound the one-call path sized from the "
                            "shapes; call tree_attn.plan and tree_attn.run",
}


def check_metadata(device=None) -> None:
    """Raise the first problem the one-call `tree_attention` found in its metadata on `device` (default: the
    current CUDA device, or the CPU) since the last check, and clear it. Syncs the host with the device.

    The one-call path reads no metadata on the host: its kernels check the indptr arrays, the slot indices and
    the masks on the device, write NaN for the rows of a call they cannot trust, and record the first
    problem, which this raises as tree_attn.plan would have (ValueError)."""
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:  # "cuda": the current device, as tensors name it
        device = torch.device("cuda", torch.cuda.current_device())
    status = _STATUS.get(device)
    if status is None:
        return
    code, detail = status.tolist()
    if code == 0:
        return
    status.zero_()
    at = f" (first at request {detail})" if detail >= 0 else ""
    what = METADATA_PROBLEMS.get(code, "an unknown problem (code {d})").format(d=detail, at=at)
    raise ValueError(f"tree_attn.tree_attention: {what}")


def _one_call_plan(meta, shape) -> "TreeAttnPlan | None":
    """The plan `tree_attention` built for these very metadata tensors, unchanged since, and this call shape."""
    if not all(isinstance(t, torch.Tensor) for t in meta):
        return None
    hit = _ONE_CALL.get(tuple(id(t) for t in meta) + shape)
    if hit is None:
        return None
    refs, versions, p = hit
    if any(r() is not t for r, t in zip(refs, meta)) or versions != tuple(t._version for t in meta):
        return None
    return p


def _keep_one_call_plan(meta, shape, p: "TreeAttnPlan") -> None:
    if len(_ONE_CALL) >= _ONE_CALL_MAX:
        _ONE_CALL.clear()
    key = tuple(id(t) for t in meta) + shape
    drop = lambda _ref, k=key: _ONE_CALL.pop(k, None)  # noqa: E731  (the entry goes with any of its tensors)
    _ONE_CALL[key] = (tuple(weakref.ref(t, drop) for t in meta), tuple(t._version for t in meta), p)


def compiled_ptx(plan: TreeAttnPlan, q, k_cache, v_cache, *, k_new=None, v_new=None) -> str:
    """The PTX of the split kernel as `run` launches it for these arguments (runs it once)."""
    p = plan
    if p.dispatch.kernel == "reference":
        raise ValueError("tree_attn.compiled_ptx: the plan runs the torch reference (no kernel); plan on a GPU")
    if p.dispatch.kernel == "ws":
        raise ValueError("tree_attn.compiled_ptx: the plan runs the CUDA C++ kernel; its PTX is "
                         "tree_attn.cuda.build(config, head_dim, group, out='ptx')")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    handle = _launch(p.dispatch.kernel, p.dispatch.config, p.tree_block, q, k_cache, v_cache, k_new, v_new, p.qo_indptr,
                     p.kv_indptr, p.kv_indices, p.tree_mask, p.node_req, p.items, p.req_table, p.po, p.plse, out, None,
                     p.head_dim ** -0.5)
    return handle.asm["ptx"]
