"""gdn ops in three layers: launch-only functions (`_plan_*` makes the one decision of a call, an
`autotune.Plan` cached per shape key, and `_launch_*` runs it), torch custom-op registration, and
public functions that validate inputs and say how to fix a bad call. Run steps never sync the host
(the "reference" variants, host loops for CPU tensors without the Triton interpreter, do). Every launch
takes the plan's error word (gdn/guard.py): a request with a bad index is skipped and flagged there."""

from __future__ import annotations

import operator

import torch
import triton

import autotune
from autotune.hardware import has_pdl, host_only, is_interpreter

from . import configs
from .guard import (ACCEPTED_LEN, ACCEPTED_NODE, ACCEPTED_PATH, COMMIT_STATE_INDEX, CONV_STATE_INDEX, POSITIVE_GATE,
                    VERIFY_STATE_INDEX, check_errors)
from .plan import TreePlan

__all__ = ["tree_verify", "tree_conv1d", "commit", "validate_accepted", "check_errors", "VARIANTS", "CONV_VARIANTS",
           "COMMIT_VARIANTS"]

OP_VERIFY, OP_CONV, OP_COMMIT = "gdn.tree_verify", "gdn.tree_conv1d", "gdn.commit"
# "cuda": gdn/csrc/gdn_tree.cu (mma.sync, sm_80+) where it takes the call (gdn/cuda.py: unsupported), else the
# Triton WY kernel "wy" (tl.dot: wgmma on sm_90, mma.sync on sm_80); either, chosen automatically, runs the one-node
# kernel "one" (gdn/kernels/one.py) for plans of one node a request. "recurrent" (no tensor cores) is the
# stock baseline; "reference" the torch code of gdn/reference.py, the only variant of CPU tensors without the
# interpreter (Triton has no CPU backend: a kernel variant named there raises, autotune.Variants.choose).
VARIANTS = autotune.Variants(OP_VERIFY, by_arch={9: "cuda", 8: "cuda"},
                             known=("cuda", "wy", "one", "recurrent", "reference"), fallback="reference", portable="wy")
CONV_VARIANTS = autotune.Variants(OP_CONV, by_arch={8: "triton"}, known=("triton", "reference"), fallback="reference")
COMMIT_VARIANTS = autotune.Variants(OP_COMMIT, by_arch={8: "triton"}, known=("triton", "reference"), fallback="reference")
_PLANS = autotune.PlanCache()


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


def _facts(*ts: torch.Tensor) -> tuple:
    """What a plan may read of its tensors: dtype, shape and strides of each, and whether all are 16-byte aligned."""
    return (*((t.dtype, tuple(t.shape), t.stride()) for t in ts), all(t.data_ptr() % 16 == 0 for t in ts))


def _plan_verify(variant: str | None, q, k, v, g, beta, o, pool, state_idx, vk: bool, max_nodes: int) -> autotune.Plan:
    """The one decision of a tree_verify call (T, B >= 1), cached per shape key: the tensors' facts, the layout,
    the plan's node bound, and what `autotune.force` pins. Variant: the `variant=` keyword > `force` >
    `VARIANTS` by GPU; an automatic "cuda" runs "wy" where the CUDA kernel cannot take the call."""
    forced = autotune.forced(OP_VERIFY)
    key = (variant, forced, vk, max_nodes, state_idx.dtype, state_idx.numel(), q.device, is_interpreter(),
           _facts(q, k, v, g, beta, o, pool))
    return _PLANS.get(key, lambda: _make_verify_plan(variant, forced[1], q, k, v, g, beta, o, pool, state_idx, vk,
                                                     max_nodes))


def _make_verify_plan(variant, forced_cfg, q, k, v, g, beta, o, pool, state_idx, vk, max_nodes) -> autotune.Plan:
    device = q.device
    variant, by_name = VARIANTS.choose(variant, device)
    K, HV, V, B = q.shape[-1], v.shape[1], v.shape[2], state_idx.numel()
    kernel = variant
    if (not by_name and variant in ("cuda", "wy") and max_nodes == 1
            and (forced_cfg is None or isinstance(forced_cfg, configs.OneConfig))):
        kernel = "one"  # one node a request: two state products and a rank-one correction (gdn/kernels/one.py)
    elif variant == "one" and max_nodes > 1:
        raise ValueError(f"{OP_VERIFY}: variant 'one' takes plans of one node a request, and this plan allows "
                         f"{max_nodes}; build it with max_nodes=1, or use variant='cuda' or 'wy'")
    if kernel == "cuda" and not by_name and isinstance(forced_cfg, configs.WYConfig):
        kernel = "wy"  # a pinned Triton config keeps the Triton kernel
    elif kernel == "cuda":
        from . import cuda as gcuda

        cfg = configs.cuda_config(max_nodes, K, V, device, batch=B, HV=HV)
        # the only capability question of the call: can the CUDA kernel take it
        why = gcuda.unsupported(q, k, v, g, beta, o, pool, state_idx, vk, max_nodes, cfg)
        if why is None:
            return autotune.Plan(variant, "cuda", cfg)
        if by_name:
            raise ValueError(f"{OP_VERIFY}: variant 'cuda' cannot take this call: {why}; use variant='wy'")
        kernel = "wy"
    if host_only(device):
        return autotune.Plan(variant, "reference")
    if kernel == "one":
        return autotune.Plan(variant, "one", configs.one_config(K, V, device))
    if kernel == "wy":
        return autotune.Plan(variant, "wy", configs.wy_config(max_nodes, K, V, device, batch=B, HV=HV))
    if kernel == "recurrent":
        return autotune.Plan(variant, "recurrent", configs.recurrent_config(K, V, device))
    return autotune.Plan(variant, "reference")


def _verify(variant: str | None, q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, node_req, sync,
            err, scale, use_l2, vk, max_nodes) -> None:
    """o = tree_verify(...): plan, then launch (the body of eager calls and of the registered ops)."""
    if q.shape[0] == 0 or cu.numel() == 1:
        return
    plan = _plan_verify(variant, q, k, v, g, beta, o, pool, state_idx, vk, max_nodes)
    _launch_verify(plan, q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, node_req, sync, err, scale,
                   use_l2, vk, max_nodes)


def _launch_verify(plan: autotune.Plan, q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, node_req,
                   sync, err, scale, use_l2, vk, max_nodes):
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    B = cu.numel() - 1
    cfg = plan.config
    if plan.kernel == "reference":
        _reference_verify(q, k, v, g, beta, o, pool, state_idx, cu, anc, err, scale, use_l2, vk)
        return
    if plan.kernel == "cuda":
        from . import cuda as gcuda

        gcuda.run(cfg, q, k, v, g, beta, o, pool, state_idx, cu, anc, scale, use_l2, vk, max_nodes,
                  _state_strides(pool, vk), cfg.pdl and has_pdl(q.device), err)
        return
    BK = max(16, triton.next_power_of_2(K))
    common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
              g.stride(1), beta.stride(0), beta.stride(1), o.stride(0), o.stride(1), *_state_strides(pool, vk))
    if plan.kernel == "one":
        from .kernels.one import gdn_one_kernel

        pdl = cfg.pdl and has_pdl(q.device)
        gdn_one_kernel[(triton.cdiv(V, cfg.BV), HV, B)](
            q, k, v, g, beta, o, pool, state_idx, cu, err, scale, pool.shape[0], *common, H=H, HV=HV, K=K, V=V, BK=BK,
            BV=cfg.BV, USE_L2=use_l2, PDL=pdl, EARLY=cfg.early, num_warps=cfg.num_warps,
            **({"launch_pdl": True} if pdl else {}))
        return
    if plan.kernel == "wy":
        from .kernels.wy import gdn_tree_wy_kernel

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
                args = (q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, nbuf, sync, err, scale,
                        n_prod, pool.shape[0], *common)
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
                                 pool.shape[0], *common, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, USE_L2=use_l2,
                                 SPLIT=split, PDL=pdl, **ce, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                 **extra, **cap)
    else:
        from .kernels.recurrent import gdn_tree_recurrent_kernel

        grid = (T, HV, triton.cdiv(V, cfg.BV))
        gdn_tree_recurrent_kernel[grid](q, k, v, g, beta, o, pool, state_idx, cu, anc, node_req, err, scale,
                                        pool.shape[0], *common, H=H, HV=HV, K=K, V=V, BK=BK, BV=cfg.BV, USE_L2=use_l2,
                                        num_warps=cfg.num_warps)


def _plan_conv(variant: str | None, x: torch.Tensor) -> autotune.Plan:
    """The one decision of a tree_conv1d call, cached per (D, dtype, device, forced variant and config)."""
    forced = autotune.forced(OP_CONV)
    key = (OP_CONV, variant, forced, x.shape[1], x.dtype, x.device, is_interpreter())
    return _PLANS.get(key, lambda: _make_conv_plan(variant, x))


def _make_conv_plan(variant: str | None, x: torch.Tensor) -> autotune.Plan:
    variant, _ = CONV_VARIANTS.choose(variant, x.device)
    if variant == "reference" or host_only(x.device):
        return autotune.Plan(variant, "reference")
    return autotune.Plan(variant, "triton", configs.conv_config(x.shape[1], x.device))


def _conv(variant: str | None, x, weight, bias, out, cstate, cidx, node_req, parent, depth, err, silu) -> None:
    """out = tree_conv1d(...): plan, then launch (the body of eager calls and of the registered ops)."""
    if x.shape[0]:
        _launch_conv(_plan_conv(variant, x), x, weight, bias, out, cstate, cidx, node_req, parent, depth, err, silu)


def _launch_conv(plan: autotune.Plan, x, weight, bias, out, cstate, cidx, node_req, parent, depth, err, silu):
    T, D = x.shape
    if plan.kernel == "reference":
        _reference_conv(x, weight, bias, out, cstate, cidx, node_req, parent, err, silu)
        return
    from .kernels.conv import gdn_tree_conv_kernel

    W = weight.shape[-1]
    cfg = plan.config
    grid = (T, triton.cdiv(D, cfg.BD))
    extra = {"PDL": True, "launch_pdl": True} if cfg.pdl and has_pdl(x.device) else {}
    gdn_tree_conv_kernel[grid](x, weight, bias if bias is not None else x, out, cstate, cidx, node_req, parent,
                               depth, err, cstate.shape[0], x.stride(0), out.stride(0), weight.stride(0),
                               weight.stride(-1), cstate.stride(0), cstate.stride(1), cstate.stride(2), D=D, W=W,
                               BD=cfg.BD, HAS_BIAS=bias is not None, SILU=silu, num_warps=cfg.num_warps, **extra)


def _plan_commit(variant: str | None, k, v, x, device: torch.device) -> autotune.Plan:
    """The one decision of a commit call, cached per (K, V, D, device, forced variant and config). The config is
    the pair (state kernel's, conv kernel's)."""
    K, V = (k.shape[-1], v.shape[-1]) if k is not None else (1, 1)
    D = x.shape[-1] if x is not None else 1
    forced = autotune.forced(OP_COMMIT)
    key = (OP_COMMIT, variant, forced, K, V, D, device, is_interpreter())
    return _PLANS.get(key, lambda: _make_commit_plan(variant, K, V, D, device))


def _make_commit_plan(variant: str | None, K: int, V: int, D: int, device: torch.device) -> autotune.Plan:
    variant, _ = COMMIT_VARIANTS.choose(variant, device)
    if variant == "reference" or host_only(device):
        return autotune.Plan(variant, "reference")
    return autotune.Plan(variant, "triton", (configs.commit_config(K, V, D, device),
                                             configs.commit_config(1, 1, D, device)))


def _commit(variant: str | None, pool, k, v, g, beta, state_idx, cu, accepted, acc_len, par, err, use_l2, vk, cstate,
            x, cidx) -> None:
    """Advance the states in place: plan, then launch (the body of eager calls and of the registered op)."""
    if cu.numel() > 1:
        plan = _plan_commit(variant, k, v, x, (pool if pool is not None else cstate).device)
        _launch_commit(plan, pool, k, v, g, beta, state_idx, cu, accepted, acc_len, par, err, use_l2, vk, cstate, x,
                       cidx)


def _launch_commit(plan: autotune.Plan, pool, k, v, g, beta, state_idx, cu, accepted, acc_len, par, err, use_l2, vk,
                   cstate, x, cidx):
    B = cu.numel() - 1
    if plan.kernel == "reference":
        _reference_commit(pool, k, v, g, beta, state_idx, cu, accepted, acc_len, par, err, use_l2, vk, cstate, x,
                          cidx)
        return
    from .kernels.commit import gdn_commit_conv_kernel, gdn_commit_state_kernel

    D = x.shape[-1] if x is not None else 1
    if pool is not None:
        L, _, H, K = k.shape
        HV, V = v.shape[2], v.shape[3]
        cfg = plan.config[0]
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
        cfg = plan.config[1]
        grid = (B, L, triton.cdiv(D, cfg.BD))
        gdn_commit_conv_kernel[grid](
            x, cstate, cidx, cu, accepted, acc_len, par, err, cstate.shape[1], accepted.shape[1], x.stride(0),
            x.stride(1), cstate.stride(0), cstate.stride(1), cstate.stride(2), cstate.stride(3), accepted.stride(0),
            D=D, W=W1 + 1, BD=cfg.BD, BW=max(2, triton.next_power_of_2(W1)), num_warps=cfg.num_warps)


def _local_parents(cu, anc) -> list[list[int]]:
    """Each request's local parent list, from the ancestor bitmasks: a node's parent is its deepest strict
    ancestor, the highest set bit of its mask without its own (nodes are topologically ordered)."""
    cu_h, anc_h = cu.tolist(), anc.tolist()
    return [[((a & (2**64 - 1)) & ~(1 << i)).bit_length() - 1 for i, a in enumerate(anc_h[s:e])]
            for s, e in zip(cu_h, cu_h[1:])]


# The reference launches keep the kernels' guards (gdn/guard.py), so a registered op that runs one holds the same
# contract: a request with an index outside its pool, or (commit) an accepted list that is not a root path of its
# tree, is skipped (nothing of it written) and its bits are OR-ed into err.


def _reference_verify(q, k, v, g, beta, o, pool, state_idx, cu, anc, err, scale, use_l2, vk) -> None:
    from .reference import chunk_reference, tree_reference

    cu_h, rows = cu.tolist(), pool.shape[0]
    for r, (ps, si) in enumerate(zip(_local_parents(cu, anc), state_idx.tolist())):
        if not 0 <= si < rows:
            err.bitwise_or_(VERIFY_STATE_INDEX)
        elif ps:
            sl = slice(cu_h[r], cu_h[r + 1])
            o[sl].copy_(tree_reference(q[sl], k[sl], v[sl], g[sl], beta[sl], pool, [si], [ps], scale=scale,
                                       use_qk_l2norm=use_l2, state_layout="vk" if vk else "kv", fn=chunk_reference))
    if bool((g > 0).any()):  # computed, but flagged as the kernels do
        err.bitwise_or_(POSITIVE_GATE)


def _reference_conv(x, weight, bias, out, cstate, cidx, node_req, parent, err, silu) -> None:
    from .reference import conv_reference

    lists: list[list[int]] = [[] for _ in range(cidx.numel())]
    first: dict[int, int] = {}  # request -> packed index of its first node
    for t, (p, r) in enumerate(zip(parent.tolist(), node_req.tolist())):
        start = first.setdefault(r, t)
        lists[r].append(p - start if p >= 0 else -1)
    t0 = 0
    for ps, si in zip(lists, cidx.tolist()):
        sl = slice(t0, t0 + len(ps))
        t0 += len(ps)
        if not 0 <= si < cstate.shape[0]:
            err.bitwise_or_(CONV_STATE_INDEX)
        elif ps:
            out[sl].copy_(conv_reference(x[sl], cstate, weight, [ps], bias, "silu" if silu else None, [si]))


def _accepted_bits(path: list[int], n_acc: int, max_len: int, parents: list[int]) -> int:
    """The commit kernels' check of one accepted list: 0 for a root path of the request's tree (`parents`,
    local), else its ACCEPTED_LEN / ACCEPTED_NODE / ACCEPTED_PATH bits."""
    if not 0 <= n_acc <= max_len:
        return ACCEPTED_LEN
    bits, prev = 0, -1
    for node in path[:n_acc]:
        if not 0 <= node < len(parents):
            bits, prev = bits | ACCEPTED_NODE, -2
            continue
        if parents[node] != prev:
            bits |= ACCEPTED_PATH
        prev = node
    return bits


def _reference_commit(pool, k, v, g, beta, state_idx, cu, accepted, acc_len, par, err, use_l2, vk, cstate, x,
                      cidx) -> None:
    from .reference import commit_reference

    cu_h, par_h, acc, n = cu.tolist(), par.tolist(), accepted.tolist(), acc_len.tolist()
    sidx, cidx = state_idx.tolist(), cidx.tolist()
    layers = (pool if pool is not None else cstate).shape[0]
    for r in range(len(cu_h) - 1):
        start = cu_h[r]
        bits = _accepted_bits(acc[r], n[r], accepted.shape[1], par_h[start:cu_h[r + 1]])
        state_ok = pool is not None and 0 <= sidx[r] < pool.shape[1]
        conv_ok = cstate is not None and 0 <= cidx[r] < cstate.shape[1]
        flag = bits | (COMMIT_STATE_INDEX if (pool is not None and not state_ok)
                       or (cstate is not None and not conv_ok) else 0)
        if flag:
            err.bitwise_or_(flag)
        if bits:  # each part guards its own row; a bad path skips both
            continue
        path = [start + j for j in acc[r][: n[r]]]
        for layer in range(layers if path else 0):
            if state_ok:
                row = pool[layer, sidx[r]]
                s0 = row.transpose(-1, -2) if vk else row
                no_conv = s0.new_zeros(1, 1), s0.new_zeros(k.shape[1], 1)  # commit_reference also steps a conv state
                s1, _ = commit_reference(s0, no_conv[0], k[layer], v[layer], g[layer], beta[layer], no_conv[1], path,
                                         use_qk_l2norm=use_l2)
                row.copy_(s1.transpose(-1, -2) if vk else s1)
            if conv_ok:
                c = cstate[layer, cidx[r]]
                seq = torch.cat([c, x[layer, path].T], 1)
                c.copy_(seq[:, seq.shape[1] - c.shape[1]:])


# --------------------------------------------------------------------------------------------
# 2. Torch registration (mutate a preallocated out: the fakes are trivial).
# --------------------------------------------------------------------------------------------


# `variant` in the registered ops: a name of the op's Variants, or "auto" (the automatic choice, planned inside the
# op, where `autotune.force` is readable: dynamo cannot read that context variable).


def _named(variant: str) -> str | None:
    return None if variant == "auto" else variant


@torch.library.custom_op("specpilot_gdn::tree_verify", mutates_args=("o", "err"))
def _verify_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               o: torch.Tensor, pool: torch.Tensor, state_idx: torch.Tensor, cu: torch.Tensor, anc: torch.Tensor,
               depth: torch.Tensor, max_depth: torch.Tensor, node_req: torch.Tensor, sync: torch.Tensor,
               err: torch.Tensor, scale: float, use_l2: bool, vk: bool, variant: str, max_nodes: int) -> None:
    _verify(_named(variant), q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, node_req, sync, err,
            scale, use_l2, vk, max_nodes)


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
    _verify(_named(variant), q, k, v, g, beta, o, pool, state_idx, cu, anc, depth, max_depth, node_req, sync, err,
            scale, use_l2, vk, max_nodes)
    return o


@_verify_alloc_op.register_fake
def _(q, k, v, *args, **kwargs):
    return torch.empty_like(v)


@torch.library.custom_op("specpilot_gdn::tree_conv1d", mutates_args=("out", "err"))
def _conv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
             cstate: torch.Tensor, cidx: torch.Tensor, node_req: torch.Tensor, parent: torch.Tensor,
             depth: torch.Tensor, err: torch.Tensor, silu: bool, variant: str) -> None:
    _conv(_named(variant), x, weight, bias, out, cstate, cidx, node_req, parent, depth, err, silu)


@_conv_op.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op("specpilot_gdn::tree_conv1d_out", mutates_args=("err",))
def _conv_alloc_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cstate: torch.Tensor,
                   cidx: torch.Tensor, node_req: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor,
                   err: torch.Tensor, silu: bool, variant: str) -> torch.Tensor:
    out = torch.empty_like(x)
    _conv(_named(variant), x, weight, bias, out, cstate, cidx, node_req, parent, depth, err, silu)
    return out


@_conv_alloc_op.register_fake
def _(x, *args, **kwargs):
    return torch.empty_like(x)


@torch.library.custom_op("specpilot_gdn::commit", mutates_args=("pool", "cstate", "err"))
def _commit_op(pool: torch.Tensor | None, k: torch.Tensor | None, v: torch.Tensor | None, g: torch.Tensor | None,
               beta: torch.Tensor | None, state_idx: torch.Tensor, cu: torch.Tensor, accepted: torch.Tensor,
               acc_len: torch.Tensor, par: torch.Tensor, err: torch.Tensor, use_l2: bool, vk: bool,
               cstate: torch.Tensor | None, x: torch.Tensor | None, cidx: torch.Tensor, variant: str) -> None:
    _commit(_named(variant), pool, k, v, g, beta, state_idx, cu, accepted, acc_len, par, err, use_l2, vk, cstate, x,
            cidx)


@_commit_op.register_fake
def _(*args, **kwargs) -> None:
    return None


# --------------------------------------------------------------------------------------------
# 3. Public functions. Eager calls skip the custom-op dispatcher (~10 us); compiled graphs see the
# registered ops.
# --------------------------------------------------------------------------------------------


def _last_contig(x):
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


# Validation helpers: `fn` is the public name ("gdn.tree_verify"); every message reads
# "<fn>: <what is wrong>; <how to fix>".

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _tensor(fn, name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}; pass a tensor")
    return t


def _check_float(fn, **ts):
    for name, t in ts.items():
        if t is None:
            continue
        _tensor(fn, name, t)
        if t.dtype not in _FLOATS:
            raise TypeError(f"{fn}: {name} has dtype {t.dtype}; pass float32, bfloat16 or float16"
                            + (" (fp64: gdn.tree_reference / gdn.recurrent_reference take dtype=torch.float64)"
                               if t.dtype == torch.float64 else ""))


def _check_int(fn, name, t):
    _tensor(fn, name, t)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{fn}: {name} has dtype {t.dtype}; pass an integer tensor (int32 or int64)")
    return t


def _check_gates(fn, g):
    # host tensors only: a device check would sync (the kernels flag POSITIVE_GATE instead)
    if torch.compiler.is_compiling():
        return  # a traced graph holds no host checks (the kernels' flags stay)
    if g is not None and g.device.type == "cpu" and g.numel() and bool((g > 0).any()):
        raise ValueError(f"{fn}: g has positive entries (max {float(g.max()):.3g}); g is the log-decay, "
                         "g <= 0 (exp(g) in (0, 1]): pass g = -exp(A_log) * softplus(a + dt_bias)")


def _indices(fn, name, idx, n, rows, device, unique=False):
    """`idx` as an int tensor [n] on `device`. Lists and CPU tensors are checked on the host against [0, rows)
    (no sync); device tensors are guarded in the kernels (gdn/guard.py)."""
    if isinstance(idx, (list, tuple)):
        try:
            idx = torch.tensor([operator.index(i) for i in idx], dtype=torch.int64)
        except TypeError:
            raise TypeError(f"{fn}: {name} must hold integers, got {idx!r}; pass pool row indices") from None
    _check_int(fn, name, idx)
    if idx.dim() != 1 or idx.numel() != n:
        raise ValueError(f"{fn}: {name} must be [B={n}], got {tuple(idx.shape)}; pass one pool row per request")
    if idx.device.type == "cpu" and not torch.compiler.is_compiling():
        bad = ((idx < 0) | (idx >= rows)).nonzero()
        if bad.numel():
            r = int(bad[0, 0])
            raise ValueError(f"{fn}: {name}[{r}] = {int(idx[r])} is outside the pool's rows [0, {rows}); "
                             "pass a valid pool row for every request")
        if unique and n and torch.unique(idx).numel() != n:
            raise ValueError(f"{fn}: {name} {idx.tolist()} names a pool row twice; two requests cannot "
                             "commit into one row: give each request its own row")
    if idx.device.type == "cpu" and device.type != "cpu":
        idx = idx.to(device)
    elif idx.device != device:
        raise ValueError(f"{fn}: {name} is on {idx.device}, the data on {device}; move it with .to({device})")
    return idx


def _after(tree, device):
    # CPU calls are synchronous: raise from the guards' word at once (no sync to save)
    if device.type == "cpu" and not torch.compiler.is_compiling():
        check_errors(tree)


def _resolve_layout(fn, state_layout, pool, HV, K, V, lead):
    if state_layout == "auto":
        if K == V:
            raise ValueError(f"{fn}: state_layout='auto' is ambiguous when K == V; pass 'kv' ([..., HV, K, V], fla) "
                             "or 'vk' ([..., HV, V, K], SGLang's pool)")
        state_layout = "kv" if tuple(pool.shape[-2:]) == (K, V) else "vk"
    if state_layout not in ("kv", "vk"):
        raise ValueError(f"{fn}: state_layout must be 'kv', 'vk' or 'auto', got {state_layout!r}; pass one of those")
    want = (HV, K, V) if state_layout == "kv" else (HV, V, K)
    if pool.dim() != lead + 3 or tuple(pool.shape[-3:]) != want:
        pre = "[L, pool, " if lead == 2 else "[pool, "
        raise ValueError(f"{fn}: state pool must be {pre}{', '.join(map(str, want))}] for "
                         f"state_layout={state_layout!r}, got {tuple(pool.shape)}; check the layout and head dims")
    if pool.dtype != torch.float32:
        raise TypeError(f"{fn}: recurrent state must be float32, got {pool.dtype}; keep the state pool in fp32, "
                        "e.g. allocate it with dtype=torch.float32")
    return state_layout == "vk"


def _check_same_device(fn, **ts):
    devs = {n: t.device for n, t in ts.items() if t is not None}
    if len(set(devs.values())) > 1:
        raise ValueError(f"{fn}: all tensors must be on one device, got {devs}; move them with .to(device) "
                         "(build the plan with build_tree_plan(..., device=...))")


def _number(fn, name, x, default: float, what: str) -> float:
    """`x` as a float (None: `default`), or a TypeError saying how to pass it."""
    if x is None:
        return float(default)
    try:
        if isinstance(x, (str, bytes, bool)):
            raise TypeError
        return float(x)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{fn}: {name} must be a number, got {type(x).__name__} {x!r}; pass a float, or None for "
                        f"{what} = {default:.4g}") from None


def _check_plan(fn, tree) -> None:
    if not isinstance(tree, TreePlan):
        raise TypeError(f"{fn}: tree must be a gdn.TreePlan, got {type(tree).__name__}; build it once per step "
                        "with gdn.build_tree_plan(parents)")


def tree_verify(q, k, v, g, beta, state_pool, state_indices, tree: TreePlan, scale=None, use_qk_l2norm=False,
                state_layout="kv", *, variant: str | None = None, out: torch.Tensor | None = None):
    """Outputs of every node of a batch of token trees, from each request's committed state.

    q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV] (packed, request after request, as in `tree`), each fp32, bf16
    or fp16; g <= 0 (log-decay); state_pool fp32 [pool, HV, K, V] ("kv", fla) or [pool, HV, V, K] ("vk", SGLang);
    state_indices [B] (tensor or list): pool row of each request.
    Returns o [T, HV, V] in v's dtype (written into `out` when given). Writes no states.

    `variant` (None: by GPU, `gdn.ops.VARIANTS`): "cuda" (the default on sm_80/sm_90, gdn/cuda.py; where
    it cannot take the call the default runs "wy", while asking for it by name raises with the reason), "wy"
    (Triton), "recurrent" (baseline), "reference" (torch). CPU tensors run the Triton kernels under
    TRITON_INTERPRET=1; without it only "reference" runs them (the automatic choice there), and a kernel variant
    asked for by name raises. `autotune.which_variant("gdn.tree_verify", device)` says which variant runs.

    Guards: host indices (lists, CPU tensors) are range-checked at once. Device indices outside the pool skip
    their request (outputs not written) and raise a flag that gdn.check_errors(tree) turns into an error. A
    non-finite input of a node makes the outputs of that node's subtree NaN and of no other node."""
    fn = OP_VERIFY
    _check_plan(fn, tree)
    _check_float(fn, q=q, k=k, v=v, g=g, beta=beta)
    _tensor(fn, "state_pool", state_pool)
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"{fn}: q and k must both be [T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}; "
                         "pass packed tokens (one row per tree node)")
    T, H, K = q.shape
    if v.dim() != 3 or v.shape[0] != T:
        raise ValueError(f"{fn}: v must be [T={T}, HV, V], got {tuple(v.shape)}; pass one row per tree node")
    HV, V = v.shape[1], v.shape[2]
    if H == 0 or HV % H:
        raise ValueError(f"{fn}: value heads HV={HV} must be a multiple of key heads H={H} (grouped heads: value "
                         f"head h reads key head h // (HV // H)); check the head split of q/k vs v")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (T, HV):
            raise ValueError(f"{fn}: {name} must be [T, HV] = {(T, HV)} (one gate per token and value head), "
                             f"got {tuple(t.shape)}; pass one value per node and value head")
    if T != tree.total_nodes:
        raise ValueError(f"{fn}: the plan has {tree.total_nodes} nodes but the inputs have T={T}; rebuild the plan "
                         "for this step's trees")
    vk = _resolve_layout(fn, state_layout, state_pool, HV, K, V, 1)
    _check_same_device(fn, q=q, k=k, v=v, g=g, beta=beta, state_pool=state_pool, tree=tree.cu_seqlens)
    state_indices = _indices(fn, "state_indices", state_indices, tree.batch, state_pool.shape[0], q.device)
    _check_gates(fn, g)
    if variant is not None:
        VARIANTS.choose(variant, q.device)  # a variant that cannot run here raises at the call, whatever T
    if out is not None and (_tensor(fn, "out", out).shape != v.shape or out.device != v.device
                            or out.dtype not in (v.dtype, torch.float32) or out.stride(-1) != 1):
        raise ValueError(f"{fn}: out must match v ({tuple(v.shape)}, {v.dtype} or float32, on {v.device}, unit "
                         f"stride in the last dim), got ({tuple(out.shape)}, {out.dtype}, {out.device}); allocate "
                         "it with torch.empty_like(v)")
    scale = _number(fn, "scale", scale, K ** -0.5, "K**-0.5")
    q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
    args = (state_pool, state_indices, tree.cu_seqlens, tree.anc, tree.depth, tree.max_depth, tree.node_req,
            tree.sync, tree.err, scale, bool(use_qk_l2norm), vk)
    if torch.compiler.is_compiling():
        if out is None:
            return _verify_alloc_op(q, k, v, g, beta, *args, variant or "auto", tree.max_nodes)
        _verify_op(q, k, v, g, beta, out, *args, variant or "auto", tree.max_nodes)
        return out
    out = torch.empty_like(v) if out is None else out
    _verify(variant, q, k, v, g, beta, out, *args, tree.max_nodes)
    _after(tree, q.device)
    return out


def tree_conv1d(x, conv_state, weight, tree: TreePlan, bias=None, activation="silu", conv_state_indices=None, *,
                variant: str | None = None, out: torch.Tensor | None = None):
    """Causal depthwise conv over each node's root path. x [T, D]; conv_state [pool, D, W-1]
    (column W-2 = most recent committed token, SGLang's layout); weight [D, W] or [D, 1, W].
    Row i of the result is conv(..., grandparent, parent, node) with committed columns filling in
    past the root. conv_state_indices [B] (tensor or list; default: request r uses row r). Does not write
    conv_state.
    `variant` (None: by GPU, `gdn.ops.CONV_VARIANTS`): "triton", or "reference" (torch; the only variant of CPU
    tensors without the interpreter). `out`: a preallocated [T, D] tensor of x's dtype, written and returned.
    Guards as tree_verify's: a device index outside conv_state skips its request's rows (not written) and flags
    CONV_STATE_INDEX for gdn.check_errors(tree)."""
    fn = OP_CONV
    _check_plan(fn, tree)
    _check_float(fn, x=x, conv_state=conv_state, weight=weight, bias=bias)
    if x.dim() != 2 or x.shape[0] != tree.total_nodes:
        raise ValueError(f"{fn}: x must be [T={tree.total_nodes}, D], got {tuple(x.shape)}; pass one row per tree "
                         "node")
    D = x.shape[1]
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(f"{fn}: weight must be [D={D}, W] (or nn.Conv1d's [D, 1, W]), got {tuple(weight.shape)}; "
                         "pass the depthwise conv weight")
    W = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[1] != D or conv_state.shape[2] != W - 1:
        raise ValueError(f"{fn}: conv_state must be [pool, D={D}, W-1={W - 1}] (last column = most recent token), "
                         f"got {tuple(conv_state.shape)}; check D and the kernel width")
    if bias is not None and tuple(bias.shape) != (D,):
        raise ValueError(f"{fn}: bias must be [D={D}], got {tuple(bias.shape)}; pass the conv bias or None")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"{fn}: activation must be None or 'silu', got {activation!r}; pass one of those")
    _check_same_device(fn, x=x, conv_state=conv_state, weight=weight, bias=bias, tree=tree.cu_seqlens)
    if conv_state_indices is None:
        conv_state_indices = torch.arange(tree.batch, device=x.device, dtype=torch.int32)  # (graph-capturable)
    conv_state_indices = _indices(fn, "conv_state_indices", conv_state_indices, tree.batch, conv_state.shape[0],
                                  x.device)
    if variant is not None:
        CONV_VARIANTS.choose(variant, x.device)
    if out is not None and (_tensor(fn, "out", out).shape != x.shape or out.dtype != x.dtype
                            or out.device != x.device or out.stride(-1) != 1):
        raise ValueError(f"{fn}: out must match x ({tuple(x.shape)}, {x.dtype}, on {x.device}, unit stride in the "
                         f"last dim), got ({tuple(out.shape)}, {out.dtype}, {out.device}); allocate it with "
                         "torch.empty_like(x)")
    x = _last_contig(x)
    args = (conv_state, conv_state_indices, tree.node_req, tree.parent, tree.depth, tree.err, activation is not None)
    if torch.compiler.is_compiling():
        if out is None:
            return _conv_alloc_op(x, weight, bias, *args, variant or "auto")
        _conv_op(x, weight, bias, out, *args, variant or "auto")
        return out
    out = torch.empty_like(x) if out is None else out
    _conv(variant, x, weight, bias, out, *args)
    _after(tree, x.device)
    return out


def validate_accepted(tree: TreePlan, accepted, accepted_len) -> None:
    """Host-side check (syncs when the tensors are on a device): each accepted list is a root path of its
    request's tree. Then raises from the plan's guard word (gdn.check_errors), this being a sync point."""
    fn = OP_COMMIT
    _check_plan(fn, tree)
    _check_int(fn, "accepted", accepted)
    _check_int(fn, "accepted_len", accepted_len)
    cu = tree.cu_seqlens.tolist()
    par = tree.parent_local.tolist()
    acc, n_acc = accepted.tolist(), accepted_len.tolist()
    if accepted.dim() != 2 or len(n_acc) != tree.batch or len(acc) != tree.batch:
        raise ValueError(f"{fn}: accepted must be [B={tree.batch}, max_len] and accepted_len [B], got "
                         f"{tuple(accepted.shape)} and {tuple(accepted_len.shape)}; pass one row per request")
    for r in range(tree.batch):
        n_nodes, ps = cu[r + 1] - cu[r], par[cu[r]:cu[r + 1]]
        if not 0 <= n_acc[r] <= len(acc[r]):
            raise ValueError(f"{fn}: request {r}: accepted_len {n_acc[r]} outside [0, {len(acc[r])}]; "
                             "accepted_len[r] counts the accepted nodes of request r")
        prev = -1
        for m, node in enumerate(acc[r][:n_acc[r]]):
            if not 0 <= node < n_nodes:
                raise ValueError(f"{fn}: request {r}: accepted node {node} outside the request's {n_nodes} "
                                 "nodes; indices are local to the request")
            if ps[node] != prev:
                raise ValueError(f"{fn}: request {r}: accepted[{m}]={node} has parent {ps[node]}, expected "
                                 f"{prev}; the accepted list must be a root path (root first, each node the child "
                                 "of the previous one)")
            prev = node
    check_errors(tree)


def commit(state_pool, conv_state, state_indices, tree: TreePlan, accepted, accepted_len, k=None, v=None, g=None,
           beta=None, x=None, use_qk_l2norm=False, state_layout="kv", conv_state_indices=None, validate=None, *,
           variant: str | None = None):
    """Advance recurrent and conv states in place along each request's accepted root path.

    Nothing is stashed by verify: the caller passes this step's inputs, stacked per layer for a
    single launch over all layers: k [L, T, H, K], v [L, T, HV, V], g, beta [L, T, HV], x [L, T, D]
    (the conv input), with state_pool [L, pool, HV, K, V] (or "vk") and conv_state [L, pool, D, W-1].
    Without the leading L (one layer) the same shapes minus L. accepted [B, max_len] holds local node
    indices (root first), accepted_len [B]. Pass state_pool=None or conv_state=None to skip one.
    state_indices and conv_state_indices: tensors or lists, one distinct row per request.
    `variant` (None: by GPU, `gdn.ops.COMMIT_VARIANTS`): "triton", or "reference" (torch, a host loop; the only
    variant of CPU tensors without the interpreter). No `out`: the states are updated in place.

    Guards: the kernels check every request's pool rows and accepted path on the device (accepted_len in
    [0, max_len], nodes inside the request, a root path); a request that fails is skipped (its states are
    not written) and flagged for gdn.check_errors(tree). `validate`: None (default) checks the path on the
    host when accepted, accepted_len and the plan are host tensors (no sync); True always (syncs, then raises
    from the guard word); False never (the device guards stay on).
    """
    fn = OP_COMMIT
    _check_plan(fn, tree)
    _check_int(fn, "accepted", accepted)
    _check_int(fn, "accepted_len", accepted_len)
    if accepted.dim() != 2 or accepted.shape[0] != tree.batch or tuple(accepted_len.shape) != (tree.batch,):
        raise ValueError(f"{fn}: accepted must be [B={tree.batch}, max_len] and accepted_len [B], got "
                         f"{tuple(accepted.shape)} and {tuple(accepted_len.shape)}; pass one row per request")
    _check_float(fn, k=k, v=v, g=g, beta=beta, x=x, conv_state=conv_state)
    if variant is not None:
        COMMIT_VARIANTS.check(variant)
    if state_pool is None and conv_state is None:
        return
    on_host = all(t.device.type == "cpu" for t in (accepted, accepted_len, tree.cu_seqlens))
    if validate or (validate is None and on_host and not torch.compiler.is_compiling()):
        validate_accepted(tree, accepted, accepted_len)
    single = (k.dim() == 3) if k is not None else (conv_state is not None and conv_state.dim() == 3)
    up = (lambda t: None if t is None else t.unsqueeze(0)) if single else (lambda t: t)
    state_pool, k, v, g, beta, conv_state, x = map(up, (state_pool, k, v, g, beta, conv_state, x))
    vk = False
    if state_pool is not None:
        _tensor(fn, "state_pool", state_pool)
        if any(t is None for t in (k, v, g, beta)):
            raise ValueError(f"{fn}: committing the recurrent state needs k, v, g and beta of this step; pass them, "
                             "or state_pool=None to commit the conv state only")
        if k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"{fn}: k must be [L, T, H, K] and v [L, T, HV, V], got {tuple(k.shape)}, "
                             f"{tuple(v.shape)}; stack the layers' inputs (or pass one layer without L)")
        L, T, H, K = k.shape
        HV, V = v.shape[2], v.shape[3]
        if v.shape[:2] != (L, T) or T != tree.total_nodes or H == 0 or HV % H:
            raise ValueError(f"{fn}: k {tuple(k.shape)} and v {tuple(v.shape)} disagree with each other or with the "
                             f"plan's {tree.total_nodes} nodes; pass this step's inputs (HV a multiple of H)")
        for name, t in (("g", g), ("beta", beta)):
            if tuple(t.shape) != (L, T, HV):
                raise ValueError(f"{fn}: {name} must be [L, T, HV] = {(L, T, HV)}, got {tuple(t.shape)}; "
                                 "pass one value per layer, node and value head")
        vk = _resolve_layout(fn, state_layout, state_pool, HV, K, V, 2)
        if state_pool.shape[0] != L:
            raise ValueError(f"{fn}: state_pool has {state_pool.shape[0]} layers, inputs have {L}; pass the pools "
                             "of the same layers")
        k, v = _last_contig(k), _last_contig(v)
        _check_gates(fn, g)
    if conv_state is not None:
        if x is None or x.dim() != 3 or x.shape[1] != tree.total_nodes:
            raise ValueError(f"{fn}: committing the conv state needs x [L, T, D], the conv inputs of this step; "
                             "pass them, or conv_state=None to commit the recurrent state only")
        if conv_state.dim() != 4 or conv_state.shape[0] != x.shape[0] or conv_state.shape[2] != x.shape[2]:
            raise ValueError(f"{fn}: conv_state must be [L, pool, D, W-1] matching x {tuple(x.shape)}, "
                             f"got {tuple(conv_state.shape)}; check L and D")
        x = _last_contig(x)
    _check_same_device(fn, state_pool=state_pool, k=k, v=v, g=g, beta=beta, conv_state=conv_state, x=x,
                       tree=tree.cu_seqlens)
    dev = (state_pool if state_pool is not None else conv_state).device
    if variant is not None:
        COMMIT_VARIANTS.choose(variant, dev)  # a variant that cannot run here raises at the call
    for name, t in (("accepted", accepted), ("accepted_len", accepted_len)):
        if t.device != dev and t.device.type != "cpu":
            raise ValueError(f"{fn}: {name} is on {t.device}, the states on {dev}; move it with .to({dev})")
    accepted, accepted_len = accepted.to(dev).contiguous(), accepted_len.to(dev)
    B = tree.batch
    rows = state_pool.shape[1] if state_pool is not None else conv_state.shape[1]
    given = state_indices  # as passed: host indices are range-checked against each pool they address
    state_indices = _indices(fn, "state_indices", given, B, rows, dev, unique=True)
    cidx = state_indices
    if conv_state is not None and conv_state_indices is not None:
        cidx = _indices(fn, "conv_state_indices", conv_state_indices, B, conv_state.shape[1], dev, unique=True)
    elif conv_state is not None and state_pool is not None:  # the same rows, in the conv pool too
        cidx = _indices(fn, "state_indices", given, B, conv_state.shape[1], dev, unique=True)
    args = (state_pool, k, v, g, beta, state_indices, tree.cu_seqlens, accepted, accepted_len, tree.parent_local,
            tree.err, bool(use_qk_l2norm), vk, conv_state, x, cidx)
    if torch.compiler.is_compiling():
        _commit_op(*args, variant or "auto")
    else:
        _commit(variant, *args)
        _after(tree, dev)
