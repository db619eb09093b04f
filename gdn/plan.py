"""Tree plan: built once per decoding step from parent indices, shared by every GDN layer.

Plan step (may sync the host when `validate=True`): checks the topology, derives per-node
ancestor bitmasks, depths and request maps with a handful of device ops (pointer jumping, no
per-node host loop). Run steps (`tree_verify`, `tree_conv1d`, `commit`) only read these
fixed-size buffers, so they never sync and can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import operator

import torch

from .guard import new_error_word

__all__ = ["TreePlan", "build_tree_plan", "MAX_NODES", "SYNC_HEADS"]

MAX_NODES = 64  # one int64 ancestor bitmask per node
SYNC_HEADS = 256  # value heads covered by TreePlan.sync (more: tree_verify uses two launches)


@dataclass(frozen=True)
class TreePlan:
    """Topology of a batch of ragged token trees (nodes packed request after request).

    Local index = position inside the request; parents are local, -1 = child of the committed
    state. Nodes are topologically ordered (parent < child).
    """

    cu_seqlens: torch.Tensor  # int32 [B+1] request offsets into the packed tokens
    parent: torch.Tensor  # int32 [T] packed index of the parent, -1 for roots
    parent_local: torch.Tensor  # int32 [T] local parent index, -1 for roots
    anc: torch.Tensor  # int64 [T] bit j set <=> local node j is an ancestor-or-self
    depth: torch.Tensor  # int32 [T] 0 for roots
    node_req: torch.Tensor  # int32 [T] request of each node
    max_depth: torch.Tensor  # int32 [B] deepest node per request (0 when empty)
    # int32 [B, SYNC_HEADS] zeros: the hand-over flags of tree_verify's one-launch split inverse
    # (WYConfig.handoff="flag", gdn/kernels/wy.py). Every call leaves them at 0 again; so a plan
    # serves one stream at a time (layers run one after another), never two kernels at once.
    sync: torch.Tensor
    batch: int
    total_nodes: int
    max_nodes: int  # static bound on nodes per request (sets tile sizes), <= 64
    # int32 [1] error word of the kernels' index guards (gdn/guard.py): bits OR-ed on the device when a
    # request is skipped; gdn.check_errors(plan) reads, clears and raises
    err: torch.Tensor | None = None

    def __post_init__(self):
        if self.err is None:
            object.__setattr__(self, "err", new_error_word(self.cu_seqlens.device))

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    @classmethod
    def build(cls, parents, cu_seqlens=None, device=None, **kw) -> "TreePlan":
        return build_tree_plan(parents, cu_seqlens, device, **kw)


def _as_int(r: int, i: int, p) -> int:
    # parents are indices: 0.7 must not become 0 silently
    if isinstance(p, torch.Tensor) and p.numel() == 1 and not p.dtype.is_floating_point:
        return int(p)
    try:
        return operator.index(p)
    except TypeError:
        raise TypeError(f"gdn.build_tree_plan: request {r} node {i}: parent {p!r} is not an integer; "
                        "pass integer local parent indices (-1 for a root)") from None


def _requests(parents) -> list:
    """`parents` as a list of per-request parent sequences, or a TypeError saying how to pass them."""
    fn = "gdn.build_tree_plan"
    if isinstance(parents, (str, bytes)) or not hasattr(parents, "__iter__"):
        raise TypeError(f"{fn}: parents must be a list of per-request parent lists, got {type(parents).__name__}; "
                        "pass e.g. [[-1, 0, 0, 1]] for one request")
    out = list(parents)
    for r, ps in enumerate(out):
        if isinstance(ps, torch.Tensor) and ps.dim() == 1:
            continue
        if isinstance(ps, (str, bytes)) or not hasattr(ps, "__len__") or isinstance(ps, torch.Tensor):
            flat = all(not hasattr(p, "__len__") or isinstance(p, torch.Tensor) and p.dim() == 0 for p in out)
            hint = (f"wrap it in a list for one request: [{list(out)!r}]" if flat else
                    "pass one parent list per request")
            raise TypeError(f"{fn}: parents[{r}] is {ps!r}, not a list of parent indices; parents is a list of "
                            f"per-request parent lists: {hint}")
    return out


def _check_host(parents: Sequence[Sequence[int]]) -> None:
    for r, ps in enumerate(parents):
        if len(ps) > MAX_NODES:
            raise ValueError(
                f"gdn.build_tree_plan: request {r} has {len(ps)} nodes; at most {MAX_NODES} per request are supported "
                "(one int64 ancestor bitmask per node): prune the tree or split the request"
            )
        for i, p in enumerate(ps):
            p = int(p)
            if p < -1 or p >= len(ps):
                raise ValueError(
                    f"gdn.build_tree_plan: request {r} node {i}: parent {p} points outside the request; pass -1 for "
                    f"a child of the committed state, or a local index in [0, {len(ps)})"
                )
            if p >= i:
                raise ValueError(
                    f"gdn.build_tree_plan: request {r} node {i}: parent {p} >= {i}; nodes must be topologically ordered "
                    "(parent before child): sort the tree breadth- or depth-first and remap the indices"
                )


def _check_max_nodes(max_nodes, lists) -> None:
    big = max([len(x) for x in lists] + [0])
    if max_nodes < big:
        raise ValueError(f"gdn.build_tree_plan: max_nodes={max_nodes} but a request has {big} nodes; pass "
                         f"max_nodes >= {big} (or leave it None)")


def build_tree_plan(parents, cu_seqlens=None, device=None, *, max_nodes: int | None = None,
                    validate: bool = True) -> TreePlan:
    """Plan for a batch of trees.

    parents: a list (one per request) of local parent lists, or a flat int tensor of local
    parents for packed nodes together with `cu_seqlens` [B+1]. With a device tensor and
    `validate=False` plus an explicit `max_nodes`, the plan is built without any host sync.
    """
    fn = "gdn.build_tree_plan"
    if max_nodes is not None and (isinstance(max_nodes, bool) or not isinstance(max_nodes, int)):
        raise TypeError(f"{fn}: max_nodes must be an int, got {type(max_nodes).__name__} {max_nodes!r}; pass an int "
                        f"in [1, {MAX_NODES}], or None")
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"{fn}: device {device!r} is not a torch device; pass e.g. 'cuda', 'cuda:0' or "
                             "'cpu'") from None
    if isinstance(parents, torch.Tensor):
        if cu_seqlens is None:
            raise ValueError("gdn.build_tree_plan: a flat parents tensor needs cu_seqlens [B+1] (request offsets); "
                             "or pass a list of per-request parent lists")
        dev = torch.device(device) if device is not None else parents.device
        if parents.dtype.is_floating_point or parents.dtype.is_complex or parents.dtype == torch.bool:
            raise TypeError(f"gdn.build_tree_plan: parents must be an integer tensor, got {parents.dtype}; "
                            "pass integer local parent indices (-1 for a root)")
        p = parents.to(dev, torch.int32)
        try:
            cu = torch.as_tensor(cu_seqlens)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"gdn.build_tree_plan: cu_seqlens must be an int tensor or list [B+1], got "
                            f"{type(cu_seqlens).__name__}; pass request offsets [0, n0, n0 + n1, ...]") from None
        if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
            raise TypeError(f"gdn.build_tree_plan: cu_seqlens must hold integers, got {cu.dtype}; pass request "
                            "offsets [0, n0, n0 + n1, ...]")
        cu = cu.to(dev, torch.int32)
        if p.dim() != 1 or cu.dim() != 1:
            raise ValueError(f"gdn.build_tree_plan: parents must be 1-D [T] and cu_seqlens 1-D [B+1], got "
                             f"{tuple(p.shape)}, {tuple(cu.shape)}; flatten the packed parents")
        if validate or max_nodes is None:
            cu_h, p_h = cu.cpu().tolist(), p.cpu().tolist()  # plan step: host sync allowed
            if cu_h[0] != 0 or cu_h[-1] != len(p_h) or any(b < a for a, b in zip(cu_h, cu_h[1:])):
                raise ValueError(f"gdn.build_tree_plan: cu_seqlens must rise from 0 to T={len(p_h)}, got {cu_h}; "
                                 "pass request offsets [0, n0, n0 + n1, ...]")
            lists = [p_h[a:b] for a, b in zip(cu_h, cu_h[1:])]
            if validate:
                _check_host(lists)
            if max_nodes is None:
                max_nodes = max([len(x) for x in lists] + [1])
            _check_max_nodes(max_nodes, lists)
        batch, total = cu.numel() - 1, p.numel()
    else:
        lists = [[_as_int(r, i, x) for i, x in enumerate(ps)] for r, ps in enumerate(_requests(parents))]
        if validate:
            _check_host(lists)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        lens = [len(x) for x in lists]
        cu_h = [0]
        for n in lens:
            cu_h.append(cu_h[-1] + n)
        flat = [x for ps in lists for x in ps]
        p = torch.tensor(flat, dtype=torch.int32).to(dev)
        cu = torch.tensor(cu_h, dtype=torch.int32).to(dev)
        batch, total = len(lists), len(flat)
        if max_nodes is None:
            max_nodes = max(lens + [1])
        _check_max_nodes(max_nodes, lists)
    if max_nodes > MAX_NODES:
        raise ValueError(f"gdn.build_tree_plan: max_nodes={max_nodes} > {MAX_NODES}; at most {MAX_NODES} nodes per "
                         "request: prune the tree or split the request")
    anc, depth, gpar, req, max_depth = _derive(p, cu, batch)
    sync = torch.zeros(batch, SYNC_HEADS, dtype=torch.int32, device=dev)
    return TreePlan(cu_seqlens=cu, parent=gpar, parent_local=p, anc=anc, depth=depth, node_req=req,
                    max_depth=max_depth, sync=sync, batch=batch, total_nodes=total, max_nodes=int(max_nodes),
                    err=new_error_word(dev))


def _derive(p: torch.Tensor, cu: torch.Tensor, batch: int):
    """Ancestor bitmasks and depths by pointer jumping: 6 rounds cover paths of 64 nodes."""
    dev, T = p.device, p.numel()
    idx = torch.arange(T, device=dev, dtype=torch.int64)
    req = torch.searchsorted(cu[1:].to(torch.int64), idx, right=True)
    bos = cu.to(torch.int64)[req.clamp(max=max(batch - 1, 0))] if T else idx
    local = idx - bos
    p64 = p.to(torch.int64)
    up = torch.where(p64 >= 0, p64 + bos, torch.full_like(p64, -1))
    gpar = up.to(torch.int32)
    anc = torch.bitwise_left_shift(torch.ones_like(local), local)
    seg = torch.ones_like(local)
    for _ in range(6):
        has = up >= 0
        upc = up.clamp(min=0)
        anc = torch.where(has, anc | anc[upc], anc)
        seg = torch.where(has, seg + seg[upc], seg)
        up = torch.where(has, up[upc], up)
    depth = seg - 1
    max_depth = torch.zeros(batch, dtype=torch.int64, device=dev)
    if T:
        max_depth = max_depth.scatter_reduce(0, req, depth, "amax", include_self=True)
    return anc, depth.to(torch.int32), gpar, req.to(torch.int32), max_depth.to(torch.int32)
