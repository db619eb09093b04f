"""Pure PyTorch references for Gated DeltaNet tree verification (obviously correct, slow).

Recurrence per value head (fla conventions), state S [K, V]:
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale q_t)
Value head h reads key head h // (HV // H). A tree node's state is the sequential state after
its root path (ancestors root first, then itself).

Non-finite inputs: the sequential forms see only a node's root path, so a NaN/Inf reaches its
descendants and no other node. The dense WY form (`chunk_reference`) would spread it through 0 x NaN
in its products; it replaces non-finite entries by 0 before the products (selection) and sets the
outputs of the affected subtree to NaN, as the kernels do.
"""

from __future__ import annotations

import torch

__all__ = [
    "recurrent_reference", "chunk_reference", "tree_reference", "conv_reference", "commit_reference",
    "root_path", "l2norm",
]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def root_path(parents, i: int) -> list[int]:
    """Local indices root first, ending with `i`."""
    path = []
    while i >= 0:
        path.append(i)
        i = int(parents[i])
    return path[::-1]


def _prep(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, dtype):
    T, H, K = q.shape
    HV = v.shape[1]
    if HV % H:
        raise ValueError(f"value heads {HV} must be a multiple of key heads {H}")
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (K ** -0.5 if scale is None else scale)
    rep = HV // H
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)  # [T, HV, K]
    return q, k, v, g, beta, initial_state.to(dtype)


def _step(S, k, v, g, beta):
    # S [HV, K, V]; k [HV, K]; v [HV, V]; g, beta [HV]
    S = S * torch.exp(g)[:, None, None]
    u = beta[:, None] * (v - torch.einsum("hkv,hk->hv", S, k))
    return S + k[:, :, None] * u[:, None, :]


def recurrent_reference(q, k, v, g, beta, initial_state, scale=None, parents=None, use_qk_l2norm=False,
                        return_states=False, dtype=torch.float32):
    """Sequential oracle for one request. q,k [T,H,K]; v [T,HV,V]; g,beta [T,HV];
    initial_state [HV,K,V]. Returns o [T,HV,V] (and per-node states [T,HV,K,V])."""
    q, k, v, g, beta, S0 = _prep(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, dtype)
    T = q.shape[0]
    parents = list(range(-1, T - 1)) if parents is None else [int(p) for p in parents]
    # a node's state is its parent's state stepped by the node's inputs: each state is computed once, from its
    # parent's stored one, by the same operations in the same order as a walk down the root path would apply
    # (so the states are those of that walk, bit for bit), in T steps instead of the sum of the nodes' depths
    states: dict[int, torch.Tensor] = {}
    o = []
    for i in range(T):
        path, j = [], i
        while j >= 0 and j not in states:
            path.append(j)
            j = parents[j]
        S = S0 if j < 0 else states[j]
        for n in reversed(path):
            S = _step(S, k[n], v[n], g[n], beta[n])
            states[n] = S
        o.append(torch.einsum("hkv,hk->hv", states[i], q[i]))
    o = torch.stack(o) if T else v.new_zeros(v.shape)
    if return_states:
        return o, (torch.stack([states[i] for i in range(T)]) if T else S0.new_zeros((0, *S0.shape)))
    return o


def chunk_reference(q, k, v, g, beta, initial_state, scale=None, parents=None, use_qk_l2norm=False,
                    dtype=torch.float32):
    """WY (chunk) form for one request, the algorithm the `wy` kernel runs, in torch:
    A = ProperAncestor ⊙ (beta_i k_i.k_j e^{G_i-G_j});  U = (I+A)^{-1} (beta⊙V - beta⊙e^G⊙(K S0));
    o = e^G ⊙ (Q S0) + (AncestorOrSelf ⊙ (q_i.k_j) e^{G_i-G_j}) U."""
    q, k, v, g, beta, S0 = _prep(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, dtype)
    T = q.shape[0]
    parents = list(range(-1, T - 1)) if parents is None else [int(p) for p in parents]
    M = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        M[i, root_path(parents, i)] = True
    M = M.to(q.device)
    strict = M & ~torch.eye(T, dtype=torch.bool, device=q.device)
    q, k, v, g, beta = (x.transpose(0, 1) for x in (q, k, v, g, beta))  # head-major
    zero = torch.zeros((), dtype=dtype, device=q.device)
    # non-finite entries: 0 before the products, and which rows held them (state inputs / the query)
    bad_q = ~torch.isfinite(q).all(-1)  # [HV, T]
    bad_s = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1) & torch.isfinite(g) & torch.isfinite(beta))
    q, k, v, g, beta = (torch.where(torch.isfinite(x), x, zero) for x in (q, k, v, g, beta))
    G = torch.where(M[None], g[:, None, :], zero).sum(-1)  # [HV, T]
    dG = torch.where(M, G[:, :, None] - G[:, None, :], zero)
    decay = torch.where(M, torch.exp(dG), zero)  # masked before exp
    A = torch.where(strict, beta[:, :, None] * (k @ k.transpose(1, 2)) * decay, zero)
    eG = torch.exp(G)
    rhs = beta[..., None] * (v - eG[..., None] * (k @ S0))
    bad_s = bad_s | ~torch.isfinite(A).all(-1) | ~torch.isfinite(rhs).all(-1)
    A, rhs = torch.where(torch.isfinite(A), A, zero), torch.where(torch.isfinite(rhs), rhs, zero)
    eye = torch.eye(T, dtype=dtype, device=q.device)
    U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    U = torch.where(torch.isfinite(U), U, zero)
    o = eG[..., None] * (q @ S0) + torch.where(M, q @ k.transpose(1, 2) * decay, zero) @ U
    # a node whose own q, or whose own or an ancestor's state inputs, held a non-finite entry
    poison = bad_q | (M[None] & bad_s[:, None, :]).any(-1)  # [HV, T]
    o = torch.where(poison[..., None], torch.full((), float("nan"), dtype=dtype, device=q.device), o)
    return o.transpose(0, 1)


def tree_reference(q, k, v, g, beta, state_pool, state_indices, parents_list, scale=None, use_qk_l2norm=False,
                   state_layout="kv", dtype=torch.float32, fn=recurrent_reference):
    """Ragged batch helper: packed tokens, one parent list per request. Returns o [T, HV, V]."""
    out, t0 = [], 0
    for r, ps in enumerate(parents_list):
        n = len(ps)
        si = int(state_indices[r])
        if not 0 <= si < state_pool.shape[0]:
            raise ValueError(f"gdn.tree_reference: state_indices[{r}] = {si} is outside the pool's rows "
                             f"[0, {state_pool.shape[0]}); pass a valid pool row for every request")
        S0 = state_pool[si]
        if state_layout == "vk":
            S0 = S0.transpose(-1, -2)
        sl = slice(t0, t0 + n)
        out.append(fn(q[sl], k[sl], v[sl], g[sl], beta[sl], S0, scale=scale, parents=ps,
                      use_qk_l2norm=use_qk_l2norm, dtype=dtype))
        t0 += n
    return torch.cat(out) if out else v.to(dtype)


def conv_reference(x, conv_state, weight, parents_list, bias=None, activation="silu", conv_state_indices=None,
                   dtype=torch.float32):
    """Per-path causal depthwise conv. x [T, D]; conv_state [pool, D, W-1] (last column = most
    recent committed token); weight [D, W]. Node i at depth d sees the sequence
    conv_state[:, :] ++ x[root path of i] and convolves its last W entries."""
    W = weight.shape[-1]
    weight = weight.reshape(weight.shape[0], W).to(dtype)
    out, t0 = [], 0
    for r, ps in enumerate(parents_list):
        si = r if conv_state_indices is None else int(conv_state_indices[r])
        if not 0 <= si < conv_state.shape[0]:
            raise ValueError(f"gdn.conv_reference: conv state index {si} of request {r} is outside the conv state's "
                             f"rows [0, {conv_state.shape[0]}); pass a valid row for every request")
        hist = conv_state[si].to(dtype)  # [D, W-1]
        for i in range(len(ps)):
            path = [t0 + j for j in root_path(ps, i)]
            seq = torch.cat([hist, x[path].to(dtype).T], 1)[:, -W:]  # [D, W]
            y = (seq * weight).sum(1)
            if bias is not None:
                y = y + bias.to(dtype)
            if activation in ("silu", "swish"):
                y = torch.nn.functional.silu(y)
            out.append(y)
        t0 += len(ps)
    return torch.stack(out)


def commit_reference(state, conv_state, k, v, g, beta, x, path, use_qk_l2norm=False, dtype=torch.float32):
    """State and conv state of one request/layer after consuming the packed tokens `path` in order.
    state [HV, K, V]; conv_state [D, W-1]; k [T, H, K]; x [T, D]."""
    HV, H = v.shape[1], k.shape[1]
    kk = k.to(dtype)
    if use_qk_l2norm:
        kk = l2norm(kk)
    kk = kk.repeat_interleave(HV // H, 1)
    S = state.to(dtype)
    for j in path:
        S = _step(S, kk[j], v[j].to(dtype), g[j].to(dtype), beta[j].to(dtype))
    W1 = conv_state.shape[-1]
    seq = torch.cat([conv_state.to(dtype), x[list(path)].to(dtype).T.reshape(x.shape[1], len(path))], 1)
    return S, seq[:, seq.shape[1] - W1:]
