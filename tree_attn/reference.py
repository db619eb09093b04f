"""Plain-torch oracle for tree attention: one request at a time, explicit boolean masks, no splits.

Every node of request r attends to r's whole prefix and to the nodes of r's tree that its mask row
names (its ancestors and itself). The prefix keys come from the cache through `kv_indices` (token
slots); the tree's keys from `k_new`/`v_new`, or, when those are None, from the last n_r slots of r's
`kv_indices` in local node order.
"""

from __future__ import annotations

import torch

__all__ = ["tree_attention_reference", "mask_matrix", "slot_rows"]


def slot_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows `[len(slots), Hkv, D]` of a token-slot cache `[slots, Hkv, D]` or a paged cache
    `[pages, page_size, Hkv, D]` (slot s is page s // page_size, offset s % page_size)."""
    slots = slots.long()
    if cache.dim() == 4:
        ps = cache.shape[1]
        return cache[slots // ps, slots % ps]
    return cache[slots]


def mask_matrix(tree_mask: torch.Tensor, n: int) -> torch.Tensor:
    """bool [n, n]: entry (i, j) is bit j of tree_mask[i] (node i sees local node j)."""
    j = torch.arange(n, device=tree_mask.device)
    return ((tree_mask[:n, None] >> j) & 1).bool()


def tree_attention_reference(q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, *, sm_scale=None,
                             k_new=None, v_new=None, dtype=torch.float32):
    """(out [T, H, D], lse [T, H]) in `dtype` (fp32, or fp64 for an oracle of the oracle).

    lse is the natural log of sum_j exp(sm_scale * q.k_j) over every key the node sees."""
    T, H, D = q.shape
    Hkv = k_cache.shape[-2]
    G = H // Hkv
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    out = torch.zeros(T, H, D, dtype=dtype, device=q.device)
    lse = torch.zeros(T, H, dtype=dtype, device=q.device)
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    for r in range(len(qo) - 1):
        q0, n = qo[r], qo[r + 1] - qo[r]
        if n == 0:
            continue
        idx = kv_indices[kv[r]:kv[r + 1]]
        if k_new is None:
            pre, own = idx[:len(idx) - n], idx[len(idx) - n:]
            kt, vt = slot_rows(k_cache, own), slot_rows(v_cache, own)
        else:
            pre = idx
            kt, vt = k_new[q0:q0 + n], v_new[q0:q0 + n]
        keys = torch.cat([slot_rows(k_cache, pre), kt]).to(dtype)  # [L + n, Hkv, D]
        vals = torch.cat([slot_rows(v_cache, pre), vt]).to(dtype)
        L = len(pre)
        seen = torch.ones(n, L + n, dtype=torch.bool, device=q.device)
        seen[:, L:] = mask_matrix(tree_mask[q0:q0 + n], n)
        keys = keys.repeat_interleave(G, dim=1)  # [L + n, H, D]
        vals = vals.repeat_interleave(G, dim=1)
        s = torch.einsum("nhd,lhd->hnl", q[q0:q0 + n].to(dtype), keys) * scale
        s = s.masked_fill(~seen[None], float("-inf"))
        lse[q0:q0 + n] = torch.logsumexp(s, dim=-1).transpose(0, 1)
        p = torch.softmax(s, dim=-1)
        out[q0:q0 + n] = torch.einsum("hnl,lhd->nhd", p, vals)
    return out, lse
