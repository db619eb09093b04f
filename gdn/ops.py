"""gdn ops in three layers: launch-only functions, torch custom-op registration, and public
functions that validate inputs and say how to fix a bad call. Run steps never sync the host."""

from __future__ import annotations

import operator

import torch
import triton

from autotune import forced, select_variant
from autotune.hardware import has_pdl, is_interpreter

from . import configs
from .guard import check_errors
from .plan import TreePlan

__all__ = ["tree_verify", "tree_conv1d", "commit", "validate_accepted", "check_errors", "VARIANTS"]

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


def _launch_verify(q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, node_req, sync, err, scale, use_l2,
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
                          _state_strides(pool, vk), cfg.pdl and has_pdl(q.device), err)
                return
            if not soft:
                raise ValueError(f"gdn.tree_verify: variant 'cuda' cannot take this call: {why}; use variant='wy'")
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
                args = (q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, nbuf, sync, err, scale, n_prod,
                        pool.shape[0], *common)
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
        gdn_tree_wy_kernel[grid](q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, nbuf, err, scale,
                                 pool.shape[0], *common,
                                 H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, USE_L2=use_l2, SPLIT=split, PDL=pdl, **ce,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra, **cap)
    elif variant == "recurrent":
        from .kernels.recurrent import gdn_tree_recurrent_kernel

        cfg = configs.recurrent_config(K, V, q.device)
        grid = (T, HV, triton.cdiv(V, cfg.BV))
        gdn_tree_recurrent_kernel[grid](q, k, v, g, beta, o, pool, state_idx, cu, anc, node_req, err, scale,
                                        pool.shape[0], *common,
                                        H=H, HV=HV, K=K, V=V, BK=BK, BV=cfg.BV, USE_L2=use_l2,
                                        num_warps=cfg.num_warps)
    else:
        raise ValueError(f"gdn.tree_verify: unknown variant {variant!r}; choose one of {VARIANTS}")


def _launch_conv(x, weight, bias, out, cstate, cidx, node_req, parent, depth, err, silu):
    T, D = x.shape
    if T == 0:
        return
    from .kernels.conv import gdn_tree_conv_kernel

    W = weight.shape[-1]
    cfg = configs.conv_config(D, x.device)
    grid = (T, triton.cdiv(D, cfg.BD))
    gdn_tree_conv_kernel[grid](x, weight, bias if bias is not None else x, out, cstate, cidx, node_req, parent,
                               depth, err, cstate.shape[0], x.stride(0), out.stride(0), weight.stride(0), weight.stride(-1),
                               cstate.stride(0), cstate.stride(1), cstate.stride(2), D=D, W=W, BD=cfg.BD,
                               HAS_BIAS=bias is not None, SILU=silu, num_warps=cfg.num_warps)


def _launch_commit(pool, k, v, g, beta, state_idx, cu, accepted, acc_len, par, err, use_l2, vk, cstate, x, cidx):
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
            k, v, g, beta, pool, state_idx, cu, accepted, acc_len, par, err, pool.shape[1], accepted.shape[1],
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            g.stride(0), g.stride(1), g.stride(2), beta.stride(0), beta.stride(1), beta.stride(2),
            pool.stride(0), *_state_strides(pool, vk), accepted.stride(0),
            H=H, HV=HV, K=K, V=V, BK=BK, BV=cfg.BV, USE_L2=use_l2, num_warps=cfg.num_warps)
    if cstate is not None:
        L, W1 = x.shape[0], cstate.shape[-1]
        cfg = configs.commit_config(1, 1, D, cstate.device)
        grid = (B, L, triton.cdiv(D, cfg.BD))
        gdn_commit_conv_kernel[grid](
            x, cstate, cidx, cu, accepted, acc_len, par, err, cstate.shape[1], accepted.shape[1], x.stride(0), x.stride(1), cstate.stride(0), cstate.stride(1),
            cstate.stride(2), cstate.stride(3), accepted.stride(0),
            D=D, W=W1 + 1, BD=cfg.BD, BW=max(2, triton.next_power_of_2(W1)), num_warps=cfg.num_warps)


# --------------------------------------------------------------------------------------------
# 2. Torch registration (mutate a preallocated out: the fakes are trivial).
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("specpilot_gdn::tree_verify", mutates_args=("o", "err"))
def _verify_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               o: torch.Tensor, pool: torch.Tensor, state_idx: torch.Tensor, cu: torch.Tensor, anc: torch.Tensor,
               depth: torch.Tensor, max_depth: torch.Tensor, node_req: torch.Tensor, sync: torch.Tensor,
               err: torch.Tensor, scale: float, use_l2: bool, vk: bool, variant: str, max_nodes: int) -> None:
    _launch_verify(q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, node_req, sync, err, scale, use_l2,
                   vk, variant, max_nodes)


@_verify_op.register_fake
def _(*args, **kwargs) -> None:
    return None


# Functional twin for `out=None` under torch.compile: allocating inside the op keeps the graph
# free of a fresh `empty` that is then mutated (functionalization rejects that pattern, e.g. when
# deterministic mode fills uninitialized memory with a copy_).
@torch.library.custom_op("specpilot_gdn::tree_verify_out", mutates_args=("err",))
def _verify_alloc_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     pool: torch.Tensor, state_idx: torch.Tensor, cu: torch.Tensor, anc: torch.Tensor,
                     depth: torch.Tensor, max_depth: torch.Tensor, node_req: torch.Tensor, sync: torch.Tensor,
                     err: torch.Tensor, scale: float, use_l2: bool, vk: bool, variant: str,
                     max_nodes: int) -> torch.Tensor:
    o = torch.empty_like(v)
    _launch_verify(q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, node_req, sync, err, scale, use_l2,
                   vk, variant, max_nodes)
    return o


@_verify_alloc_op.register_fake
def _(q, k, v, *args, **kwargs):
    return torch.empty_like(v)


@torch.library.custom_op("specpilot_gdn::tree_conv1d", mutates_args=("out", "err"))
def _conv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
             cstate: torch.Tensor, cidx: torch.Tensor, node_req: torch.Tensor, parent: torch.Tensor,
             depth: torch.Tensor, err: torch.Tensor, silu: bool) -> None:
    _launch_conv(x, weight, bias, out, cstate, cidx, node_req, parent, depth, err, silu)


@_conv_op.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op("specpilot_gdn::tree_conv1d_out", mutates_args=("err",))
def _conv_alloc_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cstate: torch.Tensor,
                   cidx: torch.Tensor, node_req: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor,
                   err: torch.Tensor, silu: bool) -> torch.Tensor:
    out = torch.empty_like(x)
    _launch_conv(x, weight, bias, out, cstate, cidx, node_req, parent, depth, err, silu)
    return out


@_conv_alloc_op.register_fake
def _(x, *args, **kwargs):
    return torch.empty_like(x)


@torch.library.custom_op("specpilot_gdn::commit", mutates_args=("pool", "cstate", "err"))
def _commit_op(pool: torch.Tensor | None, k: torch.Tensor | None, v: torch.Tensor | None, g: torch.Tensor | None,
               beta: torch.Tensor | None, state_idx: torch.Tensor, cu: torch.Tensor, accepted: torch.Tensor,
               acc_len: torch.Tensor, par: torch.Tensor, err: torch.Tensor, use_l2: bool, vk: bool,
               cstate: torch.Tensor | None, x: torch.Tensor | None, cidx: torch.Tensor) -> None:
    _launch_commit(pool, k, v, g, beta, state_idx, cu, accepted, acc_len, par, err, use_l2, vk, cstate, x, cidx)


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


# Validation helpers: every message is "gdn.<fn>: <what is wrong>; <how to fix>".

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _tensor(fn, name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"gdn.{fn}: {name} must be a torch.Tensor, got {type(t).__name__}; pass a tensor")
    return t


def _check_float(fn, **ts):
    for name, t in ts.items():
        if t is None:
            continue
        _tensor(fn, name, t)
        if t.dtype not in _FLOATS:
            raise TypeError(f"gdn.{fn}: {name} has dtype {t.dtype}; pass float32, bfloat16 or float16"
                            + (" (fp64: gdn.tree_reference / gdn.recurrent_reference take dtype=torch.float64)"
                               if t.dtype == torch.float64 else ""))


def _check_int(fn, name, t):
    _tensor(fn, name, t)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"gdn.{fn}: {name} has dtype {t.dtype}; pass an integer tensor (int32 or int64)")
    return t


def _check_same_device(fn="tree_verify", **ts):
    devs = {n: t.device for n, t in ts.items() if t is not None}
    if len(set(devs.values())) > 1:
        raise ValueError(f"gdn.{fn}: all tensors must be on one device, got {devs}; move them with .to(device) "
                         "(build the plan with build_tree_plan(..., device=...))")


def _check_gates(fn, g):
    # host tensors only: a device check would sync (the kernels flag POSITIVE_GATE instead)
    if torch.compiler.is_compiling():
        return  # a traced graph holds no host checks (the kernels' flags stay)
    if g is not None and g.device.type == "cpu" and g.numel() and bool((g > 0).any()):
        raise ValueError(f"gdn.{fn}: g has positive entries (max {float(g.max()):.3g}); g is the log-decay, "
                         "g <= 0 (exp(g) in (0, 1]): pass g = -exp(A_log) * softplus(a + dt_bias)")


def _indices(fn, name, idx, n, rows, device, unique=False):
    """`idx` as an int tensor [n] on `device`. Lists and CPU tensors are checked on the host against [0, rows)
    (no sync); device tensors are guarded in the kernels (gdn/guard.py)."""
    if isinstance(idx, (list, tuple)):
        try:
            idx = torch.tensor([operator.index(i) for i in idx], dtype=torch.int64)
        except TypeError:
            raise TypeError(f"gdn.{fn}: {name} must hold integers, got {idx!r}; pass pool row indices") from None
    _check_int(fn, name, idx)
    if idx.dim() != 1 or idx.numel() != n:
        raise ValueError(f"gdn.{fn}: {name} must be [B={n}] (one pool row per request), got {tuple(idx.shape)}")
    if idx.device.type == "cpu" and not torch.compiler.is_compiling():
        bad = ((idx < 0) | (idx >= rows)).nonzero()
        if bad.numel():
            r = int(bad[0, 0])
            raise ValueError(f"gdn.{fn}: {name}[{r}] = {int(idx[r])} is outside the pool's rows [0, {rows}); "
                             "pass a valid pool row for every request")
        if unique and n and torch.unique(idx).numel() != n:
            raise ValueError(f"gdn.{fn}: {name} {idx.tolist()} names a pool row twice; two requests cannot "
                             "commit into one row: give each request its own row")
    if idx.device.type == "cpu" and device.type != "cpu":
        idx = idx.to(device)
    elif idx.device != device:
        raise ValueError(f"gdn.{fn}: {name} is on {idx.device}, the data on {device}; move it with .to({device})")
    return idx


def _host_only(device) -> bool:
    # CPU tensors without the Triton interpreter: the torch reference runs them
    return device.type == "cpu" and not is_interpreter()


def _after(tree, device):
    # CPU calls are synchronous: raise from the guards' word at once (no sync to save)
    if device.type == "cpu" and not torch.compiler.is_compiling():
        check_errors(tree)


def _resolve_layout(state_layout, pool, HV, K, V, lead, fn="tree_verify"):
    if state_layout == "auto":
        if K == V:
            raise ValueError(f"gdn.{fn}: state_layout='auto' is ambiguous when K == V; pass 'kv' ([..., HV, K, V], "
                             "fla) or 'vk' ([..., HV, V, K], SGLang's pool)")
        state_layout = "kv" if tuple(pool.shape[-2:]) == (K, V) else "vk"
    if state_layout not in ("kv", "vk"):
        raise ValueError(f"gdn.{fn}: state_layout must be 'kv', 'vk' or 'auto', got {state_layout!r}")
    want = (HV, K, V) if state_layout == "kv" else (HV, V, K)
    if pool.dim() != lead + 3 or tuple(pool.shape[-3:]) != want:
        pre = "[L, pool, " if lead == 2 else "[pool, "
        raise ValueError(f"gdn.{fn}: state pool must be {pre}{', '.join(map(str, want))}] for "
                         f"state_layout={state_layout!r}, got {tuple(pool.shape)}; check the layout and head split")
    if pool.dtype != torch.float32:
        raise TypeError(f"gdn.{fn}: recurrent state must be float32 (got {pool.dtype}); keep the state pool in fp32, "
                        "e.g. allocate it with dtype=torch.float32")
    return state_layout == "vk"


def _check_plan(fn, tree):
    if not isinstance(tree, TreePlan):
        raise TypeError(f"gdn.{fn}: tree must be a gdn.TreePlan; build it once per step with "
                        "gdn.build_tree_plan(parents)")


def tree_verify(q, k, v, g, beta, state_pool, state_indices, tree: TreePlan, scale=None, use_qk_l2norm=False,
                state_layout="kv", variant=None, out=None):
    """Outputs of every node of a batch of token trees, from each request's committed state.

    q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV] (packed, request after request, as in `tree`), each fp32, bf16
    or fp16; g <= 0 (log-decay); state_pool fp32 [pool, HV, K, V] ("kv", fla) or [pool, HV, V, K] ("vk", SGLang);
    state_indices [B] (tensor or list): pool row of each request. Returns o [T, HV, V] in v's dtype. Writes no
    states. Variants: "cuda" (default on sm_80/sm_90 where the call fits it, gdn/cuda.py; otherwise the default
    runs "wy"), "wy" (Triton), "recurrent" (baseline), "reference" (torch). CPU tensors run the reference, or the
    Triton kernels under TRITON_INTERPRET=1.

    Guards: host indices (lists, CPU tensors) are range-checked at once. Device indices outside the pool skip
    their request (outputs not written) and raise a flag that gdn.check_errors(tree) turns into an error. A
    non-finite input of a node makes the outputs of that node's subtree NaN and of no other node."""
    fn = "tree_verify"
    _check_plan(fn, tree)
    _check_float(fn, q=q, k=k, v=v, g=g, beta=beta)
    _tensor(fn, "state_pool", state_pool)
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"gdn.{fn}: q and k must both be [T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    T, H, K = q.shape
    if v.dim() != 3 or v.shape[0] != T:
        raise ValueError(f"gdn.{fn}: v must be [T={T}, HV, V], got {tuple(v.shape)}")
    HV, V = v.shape[1], v.shape[2]
    if H == 0 or HV % H:
        raise ValueError(f"gdn.{fn}: value heads HV={HV} must be a multiple of key heads H={H} (grouped heads: value "
                         f"head h reads key head h // (HV // H)); check the head split of q/k vs v")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (T, HV):
            raise ValueError(f"gdn.{fn}: {name} must be [T, HV] = {(T, HV)} (one gate per token and value head), "
                             f"got {tuple(t.shape)}")
    if T != tree.total_nodes:
        raise ValueError(f"gdn.{fn}: the plan has {tree.total_nodes} nodes but the inputs have T={T}; rebuild the "
                         "plan for this step's trees")
    vk = _resolve_layout(state_layout, state_pool, HV, K, V, 1)
    _check_same_device(fn, q=q, k=k, v=v, g=g, beta=beta, state_pool=state_pool, tree=tree.cu_seqlens)
    state_indices = _indices(fn, "state_indices", state_indices, tree.batch, state_pool.shape[0], q.device)
    _check_gates(fn, g)
    if out is not None:
        _tensor(fn, "out", out)
        if out.shape != v.shape or out.dtype != v.dtype or out.device != v.device:
            raise ValueError(f"gdn.{fn}: out must match v ({tuple(v.shape)}, {v.dtype}, {v.device}), got "
                             f"({tuple(out.shape)}, {out.dtype}, {out.device}); allocate it with torch.empty_like(v)")
    scale = float(K ** -0.5 if scale is None else scale)
    if variant is not None and variant not in VARIANTS + ("auto",):
        raise ValueError(f"gdn.{fn}: unknown variant {variant!r}; choose one of {VARIANTS}")
    if _host_only(q.device) and variant != "cuda":
        variant = "reference"
    if variant is None:  # resolved at launch ("auto"), falling back to "wy" where "cuda" cannot run
        variant = "auto" if torch.compiler.is_compiling() or _default_variant() != "reference" else "reference"
    q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
    if out is None and variant != "reference" and torch.compiler.is_compiling():
        return _verify_alloc_op(q, k, v, g, beta, state_pool, state_indices, tree.cu_seqlens, tree.anc, tree.depth,
                                tree.max_depth, tree.node_req, tree.sync, tree.err, scale, bool(use_qk_l2norm), vk,
                                variant, tree.max_nodes)
    if out is None:
        out = torch.empty_like(v)
    if variant == "reference":
        return _reference_verify(q, k, v, g, beta, state_pool, state_indices, tree, scale, use_qk_l2norm, vk, out)
    _call(_verify_op, _launch_verify, q, k, v, g, beta, out, state_pool, state_indices, tree.cu_seqlens, tree.anc,
          tree.depth, tree.max_depth, tree.node_req, tree.sync, tree.err, scale, bool(use_qk_l2norm), vk, variant,
          tree.max_nodes)
    _after(tree, q.device)
    return out


def _reference_verify(q, k, v, g, beta, pool, idx, tree, scale, l2, vk, out):
    from .reference import chunk_reference, tree_reference

    cu = tree.cu_seqlens.tolist()  # host fallback only (no Triton device)
    par = tree.parent_local.tolist()
    lists = [par[a:b] for a, b in zip(cu, cu[1:])]
    idx = idx.tolist()
    bad = [i for i in idx if not 0 <= i < pool.shape[0]]
    if bad:
        raise ValueError(f"gdn.tree_verify: state index {bad[0]} is outside the pool's rows [0, {pool.shape[0]}); "
                         "pass a valid pool row for every request")
    if q.shape[0] == 0:
        return out
    o = tree_reference(q, k, v, g, beta, pool, idx, lists, scale=scale, use_qk_l2norm=l2,
                       state_layout="vk" if vk else "kv", fn=chunk_reference)
    return out.copy_(o)


def tree_conv1d(x, conv_state, weight, tree: TreePlan, bias=None, activation="silu", conv_state_indices=None,
                out=None):
    """Causal depthwise conv over each node's root path. x [T, D]; conv_state [pool, D, W-1]
    (column W-2 = most recent committed token, SGLang's layout); weight [D, W] or [D, 1, W].
    Row i of the result is conv(..., grandparent, parent, node) with committed columns filling in
    past the root. conv_state_indices [B] (tensor or list; default: request r uses row r). Does not write
    conv_state. Guards as tree_verify's: a device index outside conv_state skips its request's rows (not
    written) and flags CONV_STATE_INDEX for gdn.check_errors(tree)."""
    fn = "tree_conv1d"
    _check_plan(fn, tree)
    _check_float(fn, x=x, conv_state=conv_state, weight=weight, bias=bias)
    if x.dim() != 2 or x.shape[0] != tree.total_nodes:
        raise ValueError(f"gdn.{fn}: x must be [T={tree.total_nodes}, D], got {tuple(x.shape)}")
    D = x.shape[1]
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(f"gdn.{fn}: weight must be [D={D}, W] (or nn.Conv1d's [D, 1, W]), got {tuple(weight.shape)}")
    W = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[1] != D or conv_state.shape[2] != W - 1:
        raise ValueError(f"gdn.{fn}: conv_state must be [pool, D={D}, W-1={W - 1}] (last column = most recent "
                         f"token), got {tuple(conv_state.shape)}")
    if bias is not None and tuple(bias.shape) != (D,):
        raise ValueError(f"gdn.{fn}: bias must be [D={D}], got {tuple(bias.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"gdn.{fn}: activation must be None or 'silu', got {activation!r}")
    _check_same_device(fn, x=x, conv_state=conv_state, weight=weight, bias=bias, tree=tree.cu_seqlens)
    if conv_state_indices is None:
        conv_state_indices = torch.arange(tree.batch, dtype=torch.int32, device=x.device)  # (graph-capturable)
    conv_state_indices = _indices(fn, "conv_state_indices", conv_state_indices, tree.batch, conv_state.shape[0],
                                  x.device)
    if out is not None:
        _tensor(fn, "out", out)
        if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(f"gdn.{fn}: out must match x ({tuple(x.shape)}, {x.dtype}), got ({tuple(out.shape)}, "
                             f"{out.dtype}); allocate it with torch.empty_like(x)")
    x = _last_contig(x)
    if _host_only(x.device):
        from .reference import conv_reference

        out = torch.empty_like(x) if out is None else out
        if x.shape[0]:
            cu, par = tree.cu_seqlens.tolist(), tree.parent_local.tolist()
            lists = [par[a:b] for a, b in zip(cu, cu[1:])]
            out.copy_(conv_reference(x, conv_state, weight, lists, bias, activation, conv_state_indices.tolist()))
        return out
    if out is None and torch.compiler.is_compiling():
        return _conv_alloc_op(x, weight, bias, conv_state, conv_state_indices, tree.node_req, tree.parent,
                              tree.depth, tree.err, activation is not None)
    if out is None:
        out = torch.empty_like(x)
    _call(_conv_op, _launch_conv, x, weight, bias, out, conv_state, conv_state_indices, tree.node_req, tree.parent,
          tree.depth, tree.err, activation is not None)
    _after(tree, x.device)
    return out


def validate_accepted(tree: TreePlan, accepted, accepted_len) -> None:
    """Host-side check (syncs when the tensors are on a device): each accepted list is a root path of its
    request's tree. Then raises from the plan's guard word (gdn.check_errors), this being a sync point."""
    fn = "commit"
    _check_int(fn, "accepted", accepted)
    _check_int(fn, "accepted_len", accepted_len)
    cu = tree.cu_seqlens.tolist()
    par = tree.parent_local.tolist()
    acc, n_acc = accepted.tolist(), accepted_len.tolist()
    if accepted.dim() != 2 or len(n_acc) != tree.batch or len(acc) != tree.batch:
        raise ValueError(f"gdn.{fn}: accepted must be [B={tree.batch}, max_len] and accepted_len [B], got "
                         f"{tuple(accepted.shape)} and {tuple(accepted_len.shape)}")
    for r in range(tree.batch):
        n_nodes, ps = cu[r + 1] - cu[r], par[cu[r]:cu[r + 1]]
        if not 0 <= n_acc[r] <= len(acc[r]):
            raise ValueError(f"gdn.{fn}: request {r}: accepted_len {n_acc[r]} outside [0, {len(acc[r])}]; "
                             "accepted_len[r] counts the accepted nodes of request r")
        prev = -1
        for m, node in enumerate(acc[r][:n_acc[r]]):
            if not 0 <= node < n_nodes:
                raise ValueError(f"gdn.{fn}: request {r}: accepted node {node} outside the request's {n_nodes} "
                                 "nodes; indices are local to the request")
            if ps[node] != prev:
                raise ValueError(f"gdn.{fn}: request {r}: accepted[{m}]={node} has parent {ps[node]}, expected "
                                 f"{prev}; the accepted list must be a root path (root first, each node the child "
                                 "of the previous one)")
            prev = node
    check_errors(tree)


def _reference_commit(pool, cstate, idx, cidx, tree, accepted, acc_len, k, v, g, beta, x, l2, vk):
    # the torch path of commit (CPU tensors without the interpreter); inputs already validated on the host
    from .reference import commit_reference

    cu = tree.cu_seqlens.tolist()
    idx, cidx = idx.tolist(), cidx.tolist()
    L = pool.shape[0] if pool is not None else cstate.shape[0]
    T = tree.total_nodes
    for r in range(tree.batch):
        path = [cu[r] + int(j) for j in accepted[r, :int(acc_len[r])].tolist()]
        for li in range(L):
            S = pool[li, idx[r]] if pool is not None else None
            C = cstate[li, cidx[r]] if cstate is not None else None
            if S is not None:  # (stand-ins of one head, one column for the part that is not committed)
                S0, kk, vv, gg, bb = (S.transpose(-1, -2) if vk else S), k[li], v[li], g[li], beta[li]
            else:
                S0, kk, vv, gg, bb = torch.zeros(1, 1, 1), torch.zeros(T, 1, 1), torch.zeros(T, 1, 1), \
                    torch.zeros(T, 1), torch.zeros(T, 1)
            C0, xx = (C, x[li]) if C is not None else (torch.zeros(1, 0), torch.zeros(T, 1))
            S1, C1 = commit_reference(S0, C0, kk, vv, gg, bb, xx, path, use_qk_l2norm=l2)
            if S is not None:
                S.copy_(S1.transpose(-1, -2) if vk else S1)
            if C is not None:
                C.copy_(C1)


def commit(state_pool, conv_state, state_indices, tree: TreePlan, accepted, accepted_len, k=None, v=None, g=None,
           beta=None, x=None, use_qk_l2norm=False, state_layout="kv", conv_state_indices=None, validate=None):
    """Advance recurrent and conv states in place along each request's accepted root path.

    Nothing is stashed by verify: the caller passes this step's inputs, stacked per layer for a
    single launch over all layers: k [L, T, H, K], v [L, T, HV, V], g, beta [L, T, HV], x [L, T, D]
    (the conv input), with state_pool [L, pool, HV, K, V] (or "vk") and conv_state [L, pool, D, W-1].
    Without the leading L (one layer) the same shapes minus L. accepted [B, max_len] holds local node
    indices (root first), accepted_len [B]. Pass state_pool=None or conv_state=None to skip one.

    Guards: the kernels check every request's pool rows and accepted path on the device (accepted_len in
    [0, max_len], nodes inside the request, a root path); a request that fails is skipped (its states are
    not written) and flagged for gdn.check_errors(tree). `validate`: None (default) checks the path on the
    host when accepted, accepted_len and the plan are host tensors (no sync); True always (syncs, then raises
    from the guard word); False never (the device guards stay on).
    """
    fn = "commit"
    _check_plan(fn, tree)
    _check_int(fn, "accepted", accepted)
    _check_int(fn, "accepted_len", accepted_len)
    if accepted.dim() != 2 or accepted.shape[0] != tree.batch or tuple(accepted_len.shape) != (tree.batch,):
        raise ValueError(f"gdn.{fn}: accepted must be [B={tree.batch}, max_len] and accepted_len [B], got "
                         f"{tuple(accepted.shape)} and {tuple(accepted_len.shape)}")
    _check_float(fn, k=k, v=v, g=g, beta=beta, x=x, conv_state=conv_state)
    if state_pool is None and conv_state is None:
        return
    on_host = all(t.device.type == "cpu" for t in (accepted, accepted_len, tree.cu_seqlens))
    if validate or (validate is None and on_host and not torch.compiler.is_compiling()):
        validate_accepted(tree, accepted, accepted_len)
    single = (k.dim() == 3) if k is not None else (conv_state is not None and conv_state.dim() == 3)
    up = (lambda t: None if t is None else t.unsqueeze(0)) if single else (lambda t: t)
    state_pool, k, v, g, beta, conv_state, x = map(up, (state_pool, k, v, g, beta, conv_state, x))
    vk = False
    dev = (state_pool if state_pool is not None else conv_state).device
    if state_pool is not None:
        _tensor(fn, "state_pool", state_pool)
        if any(t is None for t in (k, v, g, beta)):
            raise ValueError(f"gdn.{fn}: committing the recurrent state needs k, v, g and beta of this step; pass "
                             "them, or state_pool=None")
        if k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"gdn.{fn}: k must be [L, T, H, K] and v [L, T, HV, V], got {tuple(k.shape)}, "
                             f"{tuple(v.shape)}")
        L, T, H, K = k.shape
        HV, V = v.shape[2], v.shape[3]
        if v.shape[:2] != (L, T) or T != tree.total_nodes or H == 0 or HV % H:
            raise ValueError(f"gdn.{fn}: k {tuple(k.shape)} and v {tuple(v.shape)} disagree with each other or with "
                             f"the plan's {tree.total_nodes} nodes (HV must be a multiple of H)")
        for name, t in (("g", g), ("beta", beta)):
            if tuple(t.shape) != (L, T, HV):
                raise ValueError(f"gdn.{fn}: {name} must be [L, T, HV] = {(L, T, HV)}, got {tuple(t.shape)}")
        vk = _resolve_layout(state_layout, state_pool, HV, K, V, 2, fn)
        if state_pool.shape[0] != L:
            raise ValueError(f"gdn.{fn}: state_pool has {state_pool.shape[0]} layers, inputs have {L}; stack one "
                             "pool per layer")
        k, v = _last_contig(k), _last_contig(v)
        _check_gates(fn, g)
    if conv_state is not None:
        if x is None or x.dim() != 3 or x.shape[1] != tree.total_nodes:
            raise ValueError(f"gdn.{fn}: committing the conv state needs x [L, T, D], the conv inputs of this step")
        if conv_state.dim() != 4 or conv_state.shape[0] != x.shape[0] or conv_state.shape[2] != x.shape[2]:
            raise ValueError(f"gdn.{fn}: conv_state must be [L, pool, D, W-1] matching x {tuple(x.shape)}, "
                             f"got {tuple(conv_state.shape)}")
        x = _last_contig(x)
    _check_same_device(fn, state_pool=state_pool, k=k, v=v, g=g, beta=beta, conv_state=conv_state, x=x,
                       tree=tree.cu_seqlens)
    for name, t in (("accepted", accepted), ("accepted_len", accepted_len)):
        if t.device != dev and t.device.type != "cpu":
            raise ValueError(f"gdn.{fn}: {name} is on {t.device}, the states on {dev}; move it with .to({dev})")
    accepted, accepted_len = accepted.to(dev), accepted_len.to(dev)
    B = tree.batch
    rows = state_pool.shape[1] if state_pool is not None else conv_state.shape[1]
    state_indices = _indices(fn, "state_indices", state_indices, B, rows, dev, unique=True)
    if conv_state is not None:
        cidx = state_indices if conv_state_indices is None else conv_state_indices
        cidx = _indices(fn, "conv_state_indices", cidx, B, conv_state.shape[1], dev, unique=True)
    else:
        cidx = state_indices
    accepted = accepted.contiguous()
    if _host_only(dev):
        _reference_commit(state_pool, conv_state, state_indices, cidx, tree, accepted, accepted_len, k, v, g, beta, x,
                          bool(use_qk_l2norm), vk)
        return
    _call(_commit_op, _launch_commit, state_pool, k, v, g, beta, state_indices, tree.cu_seqlens, accepted,
          accepted_len, tree.parent_local, tree.err, bool(use_qk_l2norm), vk, conv_state, x, cidx)
    _after(tree, dev)
