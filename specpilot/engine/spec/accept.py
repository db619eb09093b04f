"""Greedy tree acceptance on the device, without a host sync.

After a verify pass the target's argmax is known after the committed token (the root) and after every
tree node. A node is accepted when its token equals the target's argmax at its parent and its parent is
accepted (the root always is). Siblings carry distinct tokens (the tree builder deduplicates them), so at
most one child of an accepted node matches and the accepted nodes form one root path: the longest path
whose every node is the target's own greedy choice. The bonus token is the target's argmax at the
path's last node (at the root when nothing is accepted): greedy decoding emits the accepted tokens and
then the bonus, exactly what autoregressive decoding would have produced.

The result is `gdn.commit`'s format: `accepted` [B, max_len] local node indices, root first, padded with
-1, and `accepted_len` [B]. Everything is a fixed number of tensor operations (one pass per depth level
up to `max_depth`), so CUDA graphs capture it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Acceptance", "greedy_accept", "greedy_accept_reference", "accepted_slots"]

_WHERE = "specpilot.engine.spec.accept"  # the module as error messages name it


class Acceptance(NamedTuple):
    accepted: torch.Tensor  # int32 [B, max_depth]: local node indices of the accepted path, root first, -1 after
    accepted_len: torch.Tensor  # int32 [B]
    bonus: torch.Tensor  # int64 [B]: the target's argmax after the last accepted node (after the root if none)


def _check(fn, tokens, parents, depths, n_nodes, target_next):
    for name, t in (("tokens", tokens), ("parents", parents), ("depths", depths), ("n_nodes", n_nodes),
                    ("target_next", target_next)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_WHERE}.{fn}: {name} must be a torch.Tensor, got {type(t).__name__}; pass "
                            "the tree builder's buffers")
        if t.dtype.is_floating_point:
            raise TypeError(f"{_WHERE}.{fn}: {name} has dtype {t.dtype}; pass integer indices / tokens")
        if t.device != tokens.device:
            raise ValueError(f"{_WHERE}.{fn}: {name} is on {t.device} but tokens are on {tokens.device}; "
                             "move them to one device")
    if tokens.dim() != 2:
        raise ValueError(f"{_WHERE}.{fn}: tokens has shape {tuple(tokens.shape)}; pass [B, N] (one row of "
                         "node tokens per request)")
    B, N = tokens.shape
    for name, t in (("parents", parents), ("depths", depths)):
        if tuple(t.shape) != (B, N):
            raise ValueError(f"{_WHERE}.{fn}: {name} has shape {tuple(t.shape)} but tokens is [{B}, {N}]; "
                             "pass the same [B, N] buffers")
    if tuple(n_nodes.shape) != (B,):
        raise ValueError(f"{_WHERE}.{fn}: n_nodes has shape {tuple(n_nodes.shape)}; pass [B={B}]")
    if tuple(target_next.shape) != (B, N + 1):
        raise ValueError(f"{_WHERE}.{fn}: target_next has shape {tuple(target_next.shape)}; pass [B, N + 1] "
                         f"= [{B}, {N + 1}]: the target's argmax after the root (column 0) and after node i (1 + i)")


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, n_nodes: torch.Tensor,
                  target_next: torch.Tensor, max_depth: int) -> Acceptance:
    """The accepted root path of every request (module docstring). tokens, parents (local, -1 for a root's
    children), depths (0 for the root's children): [B, N] with n_nodes [B] valid entries per row (the rest
    ignored); target_next [B, N + 1]; max_depth: a bound on the trees' depth (the drafter's positions).
    Trusts the tree's structure (parents inside the request and before their children): the builder makes it."""
    _check("greedy_accept", tokens, parents, depths, n_nodes, target_next)
    B, N = tokens.shape
    dev = tokens.device
    idx = torch.arange(N, device=dev)
    live = idx[None, :] < n_nodes[:, None]
    par = parents.long()
    root_child = par < 0
    # the target's choice at each node's parent: column 0 for the root's children, 1 + parent otherwise
    want = target_next.gather(1, torch.where(root_child, torch.zeros_like(par), par + 1))
    match = live & (tokens.long() == want)
    acc = match & root_child
    for _ in range(max(max_depth - 1, 0)):  # one level deeper per pass; parents precede their children
        acc = match & (root_child | acc.gather(1, par.clamp(0, N - 1)))
    dep = depths.long()
    length = acc.sum(1)
    # the accepted nodes sorted by depth (one per level): place node i at slot depth[i]
    accepted = torch.full((B, max(max_depth, 1) + 1), -1, dtype=torch.int64, device=dev)
    slot = torch.where(acc, dep, torch.full_like(dep, accepted.shape[1] - 1))
    accepted.scatter_(1, slot, torch.where(acc, idx[None, :].expand(B, N), torch.full_like(dep, -1)))
    accepted = accepted[:, :max(max_depth, 1)]
    last = accepted.gather(1, (length - 1).clamp(min=0)[:, None])[:, 0]
    bonus = target_next.gather(1, torch.where(length > 0, last + 1, torch.zeros_like(last))[:, None])[:, 0]
    return Acceptance(accepted.to(torch.int32), length.to(torch.int32), bonus.long())


def greedy_accept_reference(parents: list[list[int]], tokens: list[list[int]], target_next: list[list[int]]):
    """Plain-Python oracle: walk from the root, at each node take the child whose token is the target's choice.
    Returns (accepted lists, bonus tokens)."""
    paths, bonus = [], []
    for par, tok, nxt in zip(parents, tokens, target_next):
        path, at = [], -1
        while True:
            want = nxt[0] if at < 0 else nxt[at + 1]
            child = [i for i, p in enumerate(par) if p == at and tok[i] == want]
            if not child:
                bonus.append(want)
                break
            at = child[0]
            path.append(at)
        paths.append(path)
    return paths, bonus


def accepted_slots(node_slots: torch.Tensor, acc: Acceptance) -> tuple[torch.Tensor, torch.Tensor]:
    """KV commit by remapping: (kept [B, max_len] int32, the KV-cache slots of the accepted nodes in path
    order, -1 after; freed [B, N] bool, the nodes whose slots return to the pool). The request's KV list
    becomes its prefix followed by `kept[:accepted_len]`: no K/V row moves. node_slots [B, N] holds each
    tree node's slot (where verify wrote its K/V; tree_attn's nodes-in-cache layout)."""
    if node_slots.dim() != 2 or node_slots.shape[0] != acc.accepted.shape[0]:
        raise ValueError(f"{_WHERE}.accepted_slots: node_slots has shape {tuple(node_slots.shape)}; pass "
                         f"[B={acc.accepted.shape[0]}, N], one slot per tree node")
    B, N = node_slots.shape
    idx = acc.accepted.long()
    kept = torch.where(idx >= 0, node_slots.gather(1, idx.clamp(0, N - 1)).long(), torch.full_like(idx, -1))
    used = torch.zeros(B, N + 1, dtype=torch.bool, device=node_slots.device)
    used.scatter_(1, torch.where(idx >= 0, idx, torch.full_like(idx, N)), True)
    return kept.to(torch.int32), ~used[:, :N]
