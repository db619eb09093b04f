"""gdn ops in three layers: launch-only functions, torch custom-op registration, and public
functions that validate inputs and say how to fix a bad call. Run steps never sync the host."""

from __future__ import annotations

import torch
import triton

from autotune import forced, select_variant
from autotune.hardware import has_pdl, is_interpreter

from . import configs
from .plan import TreePlan

__all__ = ["tree_verify", "tree_conv1d", "commit", "validate_accepted", "VARIANTS"]

VARIANTS = ("cuda", "wy", "recurrent", "reference")


def _default_variant() -> str:
    return select_variant("gdn.tree_verify", configs.VARIANTS, fallback="reference")


# --------------------------------------------------------------------------------------------
# 1. Launch-only functions.
# --------------------------------------------------------------------------------------------


def _state_strides(pool: torch.Tensor, vk: bool):
    s = pool.stride()
    return (s[-4], s[-3], s[-1], s[-2]) if vk else (s[-4], s[-3], s[-2], s[-1])


_RESIDENT: dict = {}


def _all_resident(kernel, programs, args, kw, device) -> bool:
    """Whether `programs` programs of `kernel` (as compiled for these arguments) all fit on the GPU at
    once: the one-launch split inverse spins its consumers on flags that producers of the same grid
    raise, so it runs only where no program can be left waiting for a slot (registers, shared memory
    and threads per SM, times the SM count). The interpreter runs programs in order: always true."""
    if is_interpreter():
        return True
    key = (device, programs, tuple(a.dtype if isinstance(a, torch.Tensor) else type(a) for a in args),
           tuple(sorted(kw.items())))
    hit = _RESIDENT.get(key)
    if hit is None:
        ck = kernel.warmup(*args, grid=(programs,), **kw)
        ck._init_handles()
        props = torch.cuda.get_device_properties(device)
        warps = kw["num_warps"]
        per_warp = -(-ck.n_regs * 32 // 256) * 256  # registers are allocated per warp, 256 at a time
        by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * warps)
        smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
        by_smem = smem // (ck.metadata.shared + 1024)  # 1 KB reserved per block
        by_threads = props.max_threads_per_multi_processor // (32 * warps)
        hit = programs <= props.multi_processor_count * min(by_regs, by_smem, by_threads, 32)
        _RESIDENT[key] = hit
    return hit


def _launch_verify(q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, node_req, sync, scale, use_l2,
                   vk, variant, max_nodes):
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    B = cu.numel() - 1
    if T == 0 or B == 0:
        return
    soft = variant == "auto"  # the default, not asked for by name: fall back to the Triton kernel when needed
    if soft:
        variant = _default_variant()
    if variant == "cuda":
        from . import cuda as gcuda

        if soft and isinstance(forced("gdn.tree_verify")[1], configs.WYConfig):
            variant = "wy"  # a pinned Triton config keeps the Triton kernel
        else:
            cfg = configs.cuda_config(max_nodes, K, V, q.device, batch=B, HV=HV)
            why = gcuda.unsupported(q, k, v, g, beta, o, pool, state_idx, vk, max_nodes, cfg)
            if why is None:
                gcuda.run(cfg, q, k, v, g, beta, o, pool, state_idx, cu, anc, scale, use_l2, vk, max_nodes,
                          _state_strides(pool, vk), cfg.pdl and has_pdl(q.device))
                return
            if not soft:
                raise ValueError(f"gdn.tree_verify variant 'cuda' cannot take this call: {why}; use variant='wy'")
            variant = "wy"
    BK = max(16, triton.next_power_of_2(K))
    common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
              g.stride(1), beta.stride(0), beta.stride(1), o.stride(0), o.stride(1), *_state_strides(pool, vk))
    if variant == "wy":
        from .kernels.wy import gdn_tree_wy_kernel

        cfg = configs.wy_config(max_nodes, K, V, q.device, batch=B, HV=HV)
        BT = max(16, cfg.min_bt, triton.next_power_of_2(max_nodes))
        split = cfg.split and q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16
        ce = configs.wy_constexprs(cfg)
        grid = (B, HV, triton.cdiv(V, cfg.BV))
        pdl = cfg.pdl and has_pdl(q.device)
        extra = {"launch_pdl": True} if pdl else {}
        nbuf = o  # read only with inverse="split"
        cap = {"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}
        if ce["INV"] == 4:
            from .kernels.wy import gdn_tree_flag_kernel, gdn_tree_split_kernel

            # the fold's N per (request, value head): 4 BT^2 bytes each, written by the first launch and read
            # by the second; a fresh buffer per call (stream-ordered reuse by the caching allocator)
            nbuf = torch.empty(B, HV, BT, BT, device=q.device, dtype=torch.float32)
            if cfg.handoff == "flag" and HV <= sync.shape[-1]:
                # one launch: B * HV producer programs first, then the (request, value head, V block) ones
                n_prod = B * HV
                fgrid = (n_prod * (1 + triton.cdiv(V, cfg.BV)),)
                args = (q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, nbuf, sync, scale, n_prod,
                        *common)
                kw = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=cfg.BV, USE_L2=use_l2, PREC=ce["PREC"],
                          PREC_S=ce["PREC_S"], SPLIT=split, STACK=cfg.stack, ISTACK=cfg.inverse_stack,
                          ILOOP=cfg.inverse_loop, PREC_I=ce["PREC_I"], PDL=pdl, SKIP=ce["SKIP"],
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cap)
                if _all_resident(gdn_tree_flag_kernel, fgrid[0], args, kw, q.device):
                    gdn_tree_flag_kernel[fgrid](*args, **kw, **extra)
                    return
            gdn_tree_split_kernel[(B, HV)](q, k, g, beta, nbuf, cu, anc, depth, max_depth, scale, *common[:4],
                                           *common[6:10], H=H, HV=HV, K=K, BT=BT, BK=BK, USE_L2=use_l2,
                                           PREC=ce["PREC"], SPLIT=split, PREC_I=ce["PREC_I"], PDL=pdl,
                                           STACK=cfg.inverse_stack, ILOOP=cfg.inverse_loop, SKIP=ce["SKIP"],
                                           num_warps=cfg.inverse_warps, num_stages=1, **extra,
                                           **({"maxnreg": cfg.inverse_maxnreg} if cfg.inverse_maxnreg else {}))
        gdn_tree_wy_kernel[grid](q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, nbuf, scale, *common,
                                 H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, USE_L2=use_l2, SPLIT=split, PDL=pdl, **ce,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra, **cap)
    elif variant == "recurrent":
        from .kernels.recurrent import gdn_tree_recurrent_kernel

        cfg = configs.recurrent_config(K, V, q.device)
        grid = (T, HV, triton.cdiv(V, cfg.BV))
        gdn_tree_recurrent_kernel[grid](q, k, v, g, beta, o, pool, state_idx, cu, anc, node_req, scale, *common,
                                        H=H, HV=HV, K=K, V=V, BK=BK, BV=cfg.BV, USE_L2=use_l2,
                                        num_warps=cfg.num_warps)
    else:
        raise ValueError(f"unknown gdn.tree_verify variant {variant!r}; choose one of {VARIANTS}")


def _launch_conv(x, weight, bias, out, cstate, cidx, node_req, parent, depth, silu):
    T, D = x.shape
    if T == 0:
        return
    from .kernels.conv import gdn_tree_conv_kernel

    W = weight.shape[-1]
    cfg = configs.conv_config(D, x.device)
    grid = (T, triton.cdiv(D, cfg.BD))
    gdn_tree_conv_kernel[grid](x, weight, bias if bias is not None else x, out, cstate, cidx, node_req, parent,
                               depth, x.stride(0), out.stride(0), weight.stride(0), weight.stride(-1),
                               cstate.stride(0), cstate.stride(1), cstate.stride(2), D=D, W=W, BD=cfg.BD,
                               HAS_BIAS=bias is not None, SILU=silu, num_warps=cfg.num_warps)


def _launch_commit(pool, k, v, g, beta, state_idx, cu, accepted, acc_len, use_l2, vk, cstate, x, cidx):
    B = cu.numel() - 1
    if B == 0:
        return
    from .kernels.commit import gdn_commit_conv_kernel, gdn_commit_state_kernel

    D = x.shape[-1] if x is not None else 1
    if pool is not None:
        L, _, H, K = k.shape
        HV, V = v.shape[2], v.shape[3]
        cfg = configs.commit_config(K, V, D, pool.device)
        BK = max(16, triton.next_power_of_2(K))
        grid = (B, L * HV, triton.cdiv(V, cfg.BV))
        gdn_commit_state_kernel[grid](
            k, v, g, beta, pool, state_idx, cu, accepted, acc_len,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            g.stride(0), g.stride(1), g.stride(2), beta.stride(0), beta.stride(1), beta.stride(2),
            pool.stride(0), *_state_strides(pool, vk), accepted.stride(0),
            H=H, HV=HV, K=K, V=V, BK=BK, BV=cfg.BV, USE_L2=use_l2, num_warps=cfg.num_warps)
    if cstate is not None:
        L, W1 = x.shape[0], cstate.shape[-1]
        cfg = configs.commit_config(1, 1, D, cstate.device)
        grid = (B, L, triton.cdiv(D, cfg.BD))
        gdn_commit_conv_kernel[grid](
            x, cstate, cidx, cu, accepted, acc_len, x.stride(0), x.stride(1), cstate.stride(0), cstate.stride(1),
            cstate.stride(2), cstate.stride(3), accepted.stride(0),
            D=D, W=W1 + 1, BD=cfg.BD, BW=max(2, triton.next_power_of_2(W1)), num_warps=cfg.num_warps)


# --------------------------------------------------------------------------------------------
# 2. Torch registration (mutate a preallocated out: the fakes are trivial).
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("specpilot_gdn::tree_verify", mutates_args=("o",))
def _verify_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               o: torch.Tensor, pool: torch.Tensor, state_idx: torch.Tensor, cu: torch.Tensor, anc: torch.Tensor,
               depth: torch.Tensor, max_depth: torch.Tensor, node_req: torch.Tensor, sync: torch.Tensor, scale: float,
               use_l2: bool, vk: bool, variant: str, max_nodes: int) -> None:
    _launch_verify(q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, node_req, sync, scale, use_l2,
                   vk, variant, max_nodes)


@_verify_op.register_fake
def _(*args, **kwargs) -> None:
    return None


# Functional twin for `out=None` under torch.compile: allocating inside the op keeps the graph
# free of a fresh `empty` that is then mutated (functionalization rejects that pattern, e.g. when
# deterministic mode fills uninitialized memory with a copy_).
@torch.library.custom_op("specpilot_gdn::tree_verify_out", mutates_args=())
def _verify_alloc_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     pool: torch.Tensor, state_idx: torch.Tensor, cu: torch.Tensor, anc: torch.Tensor,
                     depth: torch.Tensor, max_depth: torch.Tensor, node_req: torch.Tensor, sync: torch.Tensor,
                     scale: float, use_l2: bool, vk: bool, variant: str, max_nodes: int) -> torch.Tensor:
    o = torch.empty_like(v)
    _launch_verify(q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, node_req, sync, scale, use_l2,
                   vk, variant, max_nodes)
    return o


@_verify_alloc_op.register_fake
def _(q, k, v, *args, **kwargs):
    return torch.empty_like(v)


@torch.library.custom_op("specpilot_gdn::tree_conv1d", mutates_args=("out",))
def _conv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
             cstate: torch.Tensor, cidx: torch.Tensor, node_req: torch.Tensor, parent: torch.Tensor,
             depth: torch.Tensor, silu: bool) -> None:
    _launch_conv(x, weight, bias, out, cstate, cidx, node_req, parent, depth, silu)


@_conv_op.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op("specpilot_gdn::tree_conv1d_out", mutates_args=())
def _conv_alloc_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cstate: torch.Tensor,
                   cidx: torch.Tensor, node_req: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor,
                   silu: bool) -> torch.Tensor:
    out = torch.empty_like(x)
    _launch_conv(x, weight, bias, out, cstate, cidx, node_req, parent, depth, silu)
    return out


@_conv_alloc_op.register_fake
def _(x, *args, **kwargs):
    return torch.empty_like(x)


@torch.library.custom_op("specpilot_gdn::commit", mutates_args=("pool", "cstate"))
def _commit_op(pool: torch.Tensor | None, k: torch.Tensor | None, v: torch.Tensor | None, g: torch.Tensor | None,
               beta: torch.Tensor | None, state_idx: torch.Tensor, cu: torch.Tensor, accepted: torch.Tensor,
               acc_len: torch.Tensor, use_l2: bool, vk: bool, cstate: torch.Tensor | None, x: torch.Tensor | None,
               cidx: torch.Tensor) -> None:
    _launch_commit(pool, k, v, g, beta, state_idx, cu, accepted, acc_len, use_l2, vk, cstate, x, cidx)


@_commit_op.register_fake
def _(*args, **kwargs) -> None:
    return None


def _call(op, launch, *args):
    # Eager calls skip the custom-op dispatcher (~10 us); compiled graphs see the registered op.
    if torch.compiler.is_compiling():
        return op(*args)
    return launch(*args)


# --------------------------------------------------------------------------------------------
# 3. Public functions.
# --------------------------------------------------------------------------------------------


def _last_contig(x):
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def _resolve_layout(state_layout, pool, HV, K, V, lead):
    if state_layout == "auto":
        if K == V:
            raise ValueError("state_layout='auto' is ambiguous when K == V: pass 'kv' ([..., HV, K, V], fla) "
                             "or 'vk' ([..., HV, V, K], SGLang's pool)")
        state_layout = "kv" if tuple(pool.shape[-2:]) == (K, V) else "vk"
    if state_layout not in ("kv", "vk"):
        raise ValueError(f"state_layout must be 'kv', 'vk' or 'auto', got {state_layout!r}")
    want = (HV, K, V) if state_layout == "kv" else (HV, V, K)
    if pool.dim() != lead + 3 or tuple(pool.shape[-3:]) != want:
        pre = "[L, pool, " if lead == 2 else "[pool, "
        raise ValueError(f"state pool must be {pre}{', '.join(map(str, want))}] for state_layout={state_layout!r}, "
                         f"got {tuple(pool.shape)}")
    if pool.dtype != torch.float32:
        raise TypeError(f"recurrent state must be float32 (got {pool.dtype}): keep the state pool in fp32, "
                        "e.g. allocate it with dtype=torch.float32")
    return state_layout == "vk"


def _check_same_device(**ts):
    devs = {n: t.device for n, t in ts.items() if t is not None}
    if len(set(devs.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devs}")


def tree_verify(q, k, v, g, beta, state_pool, state_indices, tree: TreePlan, scale=None, use_qk_l2norm=False,
                state_layout="kv", variant=None, out=None):
    """Outputs of every node of a batch of token trees, from each request's committed state.

    q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV] (packed, request after request, as in `tree`);
    state_pool fp32 [pool, HV, K, V] ("kv", fla) or [pool, HV, V, K] ("vk", SGLang);
    state_indices [B]: pool row of each request (each in [0, pool): not checked on the device).
    Returns o [T, HV, V] in v's dtype. Writes no states. Variants: "cuda" (default on sm_80/sm_90 where nvcc is
    present and the call fits it, gdn/cuda.py; otherwise the default runs "wy"), "wy" (Triton), "recurrent"
    (baseline), "reference" (torch)."""
    if not isinstance(tree, TreePlan):
        raise TypeError("tree must be a gdn.TreePlan: build it once per step with gdn.build_tree_plan(parents)")
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    T, H, K = q.shape
    if v.dim() != 3 or v.shape[0] != T:
        raise ValueError(f"v must be [T={T}, HV, V], got {tuple(v.shape)}")
    HV, V = v.shape[1], v.shape[2]
    if HV % H:
        raise ValueError(f"value heads HV={HV} must be a multiple of key heads H={H} (grouped heads: value head h "
                         f"reads key head h // (HV // H)); check the head split of q/k vs v")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (T, HV):
            raise ValueError(f"{name} must be [T, HV] = {(T, HV)} (one gate per token and value head), "
                             f"got {tuple(t.shape)}")
    if T != tree.total_nodes:
        raise ValueError(f"the plan has {tree.total_nodes} nodes but the inputs have T={T}: rebuild the plan "
                         "for this step's trees")
    vk = _resolve_layout(state_layout, state_pool, HV, K, V, 1)
    if state_indices.dim() != 1 or state_indices.numel() != tree.batch:
        raise ValueError(f"state_indices must be [B={tree.batch}], got {tuple(state_indices.shape)}")
    if state_indices.dtype.is_floating_point:
        raise TypeError("state_indices must be an integer tensor")
    _check_same_device(q=q, k=k, v=v, g=g, beta=beta, state_pool=state_pool, state_indices=state_indices,
                       tree=tree.cu_seqlens)
    scale = float(K ** -0.5 if scale is None else scale)
    if variant is None:  # resolved at launch ("auto"), falling back to "wy" where "cuda" cannot run
        variant = "auto" if torch.compiler.is_compiling() or _default_variant() != "reference" else "reference"
    if variant not in VARIANTS + ("auto",):
        raise ValueError(f"unknown gdn.tree_verify variant {variant!r}; choose one of {VARIANTS}")
    q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
    if out is None and variant != "reference" and torch.compiler.is_compiling():
        return _verify_alloc_op(q, k, v, g, beta, state_pool, state_indices, tree.cu_seqlens, tree.anc, tree.depth,
                                tree.max_depth, tree.node_req, tree.sync, scale, bool(use_qk_l2norm), vk,
                                variant, tree.max_nodes)
    if out is None:
        out = torch.empty_like(v)
    if variant == "reference":
        return _reference_verify(q, k, v, g, beta, state_pool, state_indices, tree, scale, use_qk_l2norm, vk, out)
    _call(_verify_op, _launch_verify, q, k, v, g, beta, out, state_pool, state_indices, tree.cu_seqlens, tree.anc,
          tree.depth, tree.max_depth, tree.node_req, tree.sync, scale, bool(use_qk_l2norm), vk, variant, tree.max_nodes)
    return out


def _reference_verify(q, k, v, g, beta, pool, idx, tree, scale, l2, vk, out):
    from .reference import chunk_reference, tree_reference

    cu = tree.cu_seqlens.tolist()  # host fallback only (no Triton device)
    par = tree.parent_local.tolist()
    lists = [par[a:b] for a, b in zip(cu, cu[1:])]
    o = tree_reference(q, k, v, g, beta, pool, idx.tolist(), lists, scale=scale, use_qk_l2norm=l2,
                       state_layout="vk" if vk else "kv", fn=chunk_reference)
    return out.copy_(o)


def tree_conv1d(x, conv_state, weight, tree: TreePlan, bias=None, activation="silu", conv_state_indices=None,
                out=None):
    """Causal depthwise conv over each node's root path. x [T, D]; conv_state [pool, D, W-1]
    (column W-2 = most recent committed token, SGLang's layout); weight [D, W] or [D, 1, W].
    Row i of the result is conv(..., grandparent, parent, node) with committed columns filling in
    past the root. conv_state_indices [B] (default: request r uses row r). Does not write conv_state."""
    if not isinstance(tree, TreePlan):
        raise TypeError("tree must be a gdn.TreePlan: build it with gdn.build_tree_plan(parents)")
    if x.dim() != 2 or x.shape[0] != tree.total_nodes:
        raise ValueError(f"x must be [T={tree.total_nodes}, D], got {tuple(x.shape)}")
    D = x.shape[1]
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"weight must be [D={D}, W] (or nn.Conv1d's [D, 1, W]), got {tuple(weight.shape)}")
    W = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[1] != D or conv_state.shape[2] != W - 1:
        raise ValueError(f"conv_state must be [pool, D={D}, W-1={W - 1}] (last column = most recent token), "
                         f"got {tuple(conv_state.shape)}")
    if bias is not None and tuple(bias.shape) != (D,):
        raise ValueError(f"bias must be [D={D}], got {tuple(bias.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    if conv_state_indices is None:
        conv_state_indices = torch.arange(tree.batch, device=x.device, dtype=torch.int32)
    if conv_state_indices.numel() != tree.batch:
        raise ValueError(f"conv_state_indices must be [B={tree.batch}], got {tuple(conv_state_indices.shape)}")
    _check_same_device(x=x, conv_state=conv_state, weight=weight, tree=tree.cu_seqlens)
    x = _last_contig(x)
    if out is None and torch.compiler.is_compiling():
        return _conv_alloc_op(x, weight, bias, conv_state, conv_state_indices, tree.node_req, tree.parent,
                              tree.depth, activation is not None)
    if out is None:
        out = torch.empty_like(x)
    _call(_conv_op, _launch_conv, x, weight, bias, out, conv_state, conv_state_indices, tree.node_req, tree.parent,
          tree.depth, activation is not None)
    return out


def validate_accepted(tree: TreePlan, accepted, accepted_len) -> None:
    """Host-side check (syncs): each accepted list is a root path of its request's tree."""
    cu = tree.cu_seqlens.tolist()
    par = tree.parent_local.tolist()
    acc, n_acc = accepted.tolist(), accepted_len.tolist()
    if len(n_acc) != tree.batch or len(acc) != tree.batch:
        raise ValueError(f"accepted must be [B={tree.batch}, max_len] and accepted_len [B]")
    for r in range(tree.batch):
        n_nodes, ps = cu[r + 1] - cu[r], par[cu[r]:cu[r + 1]]
        if not 0 <= n_acc[r] <= len(acc[r]):
            raise ValueError(f"request {r}: accepted_len {n_acc[r]} outside [0, {len(acc[r])}]")
        prev = -1
        for m, node in enumerate(acc[r][:n_acc[r]]):
            if not 0 <= node < n_nodes:
                raise ValueError(f"request {r}: accepted node {node} outside the request's {n_nodes} nodes "
                                 "(indices are local to the request)")
            if ps[node] != prev:
                raise ValueError(f"request {r}: accepted[{m}]={node} has parent {ps[node]}, expected {prev}: "
                                 "the accepted list must be a root path (root first, each node the child of "
                                 "the previous one)")
            prev = node


def commit(state_pool, conv_state, state_indices, tree: TreePlan, accepted, accepted_len, k=None, v=None, g=None,
           beta=None, x=None, use_qk_l2norm=False, state_layout="kv", conv_state_indices=None, validate=False):
    """Advance recurrent and conv states in place along each request's accepted root path.

    Nothing is stashed by verify: the caller passes this step's inputs, stacked per layer for a
    single launch over all layers: k [L, T, H, K], v [L, T, HV, V], g, beta [L, T, HV], x [L, T, D]
    (the conv input), with state_pool [L, pool, HV, K, V] (or "vk") and conv_state [L, pool, D, W-1].
    Without the leading L (one layer) the same shapes minus L. accepted [B, max_len] holds local node
    indices (root first), accepted_len [B]. Pass state_pool=None or conv_state=None to skip one.
    `validate=True` checks the paths on the host (syncs); leave it off in captured graphs.
    """
    if not isinstance(tree, TreePlan):
        raise TypeError("tree must be a gdn.TreePlan: build it with gdn.build_tree_plan(parents)")
    if accepted.dim() != 2 or accepted.shape[0] != tree.batch or tuple(accepted_len.shape) != (tree.batch,):
        raise ValueError(f"accepted must be [B={tree.batch}, max_len] and accepted_len [B], got "
                         f"{tuple(accepted.shape)} and {tuple(accepted_len.shape)}")
    if validate:
        validate_accepted(tree, accepted, accepted_len)
    single = (k.dim() == 3) if k is not None else (conv_state is not None and conv_state.dim() == 3)
    up = (lambda t: None if t is None else t.unsqueeze(0)) if single else (lambda t: t)
    state_pool, k, v, g, beta, conv_state, x = map(up, (state_pool, k, v, g, beta, conv_state, x))
    vk = False
    if state_pool is not None:
        if any(t is None for t in (k, v, g, beta)):
            raise ValueError("committing the recurrent state needs k, v, g and beta of this step")
        if k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"k must be [L, T, H, K] and v [L, T, HV, V], got {tuple(k.shape)}, {tuple(v.shape)}")
        L, T, H, K = k.shape
        HV, V = v.shape[2], v.shape[3]
        if v.shape[:2] != (L, T) or T != tree.total_nodes or HV % H:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree with each other or with the "
                             f"plan's {tree.total_nodes} nodes (HV must be a multiple of H)")
        for name, t in (("g", g), ("beta", beta)):
            if tuple(t.shape) != (L, T, HV):
                raise ValueError(f"{name} must be [L, T, HV] = {(L, T, HV)}, got {tuple(t.shape)}")
        vk = _resolve_layout(state_layout, state_pool, HV, K, V, 2)
        if state_pool.shape[0] != L:
            raise ValueError(f"state_pool has {state_pool.shape[0]} layers, inputs have {L}")
        k, v = _last_contig(k), _last_contig(v)
    if conv_state is not None:
        if x is None or x.dim() != 3 or x.shape[1] != tree.total_nodes:
            raise ValueError("committing the conv state needs x [L, T, D], the conv inputs of this step")
        if conv_state.dim() != 4 or conv_state.shape[0] != x.shape[0] or conv_state.shape[2] != x.shape[2]:
            raise ValueError(f"conv_state must be [L, pool, D, W-1] matching x {tuple(x.shape)}, "
                             f"got {tuple(conv_state.shape)}")
        x = _last_contig(x)
        if conv_state_indices is None:
            conv_state_indices = state_indices
    cidx = conv_state_indices if conv_state_indices is not None else state_indices
    _check_same_device(state_pool=state_pool, conv_state=conv_state, accepted=accepted, tree=tree.cu_seqlens)
    _call(_commit_op, _launch_commit, state_pool, k, v, g, beta, state_indices, tree.cu_seqlens, accepted,
          accepted_len, bool(use_qk_l2norm), vk, conv_state, x, cidx)
