"""`gdn` tree verify and commit in SGLang's hybrid GDN backend (switch `SPECPILOT_SGLANG_GDN`, off by default).

SGLang's target verify of a GDN layer (`GDNAttnBackend.forward_extend`) runs its conv kernel and its verify kernel
(chosen in `GDNKernelDispatcher.__init__`), and both write one snapshot per draft token: the SSM state
(`MambaPool.SpeculativeState.intermediate_ssm`, `[layers, requests + 1, draft tokens, HV, V, K]`) and the conv
window (`intermediate_conv_window`). `HybridLinearAttnBackend.update_mamba_state_after_mtp_verify` then copies
the accepted token's snapshots into the state pool. This module replaces both ends, through three AROUND hooks
of SGLang's `HookRegistry` (`TARGETS`):

* `init_hook` on `GDNAttnBackend.__init__`: after SGLang's own constructor, the backend is checked for what this
  path needs (an fp32 SSM pool, a speculative pool without ReplaySSM, not the unified pool; `_inactive_reason`
  lists every condition). Where it holds, the per-draft-token snapshot buffers the pool allocated are released
  (`intermediate_ssm` and the conv windows; the pool's state object is replaced by one holding none) and the bytes
  released are logged. Where it does not, the backend keeps SGLang's own path and the reason is logged.
* `verify_hook` on `GDNAttnBackend.forward_extend`: a target-verify forward runs `gdn.tree_conv1d` and
  `gdn.tree_verify` from the committed conv and SSM states (read, not written), with the draft tree taken from
  `forward_metadata.retrieve_next_token` / `retrieve_next_sibling` (SGLang's first-child / next-sibling links;
  a chain when they are absent). Each layer's step inputs (conv input, k, v, g, beta) are kept for the commit.
  Every other mode is SGLang's.
* `commit_hook` on `HybridLinearAttnBackend.update_mamba_state_after_mtp_verify`: the accepted path of each
  request is the root path of its last accepted draft token (`last_correct_step_indices`); `gdn.commit` advances
  the SSM and conv states of every layer along it, in the rows the verify read. The radix cache's Mamba track
  slots (`mamba_track_indices`, `mamba_steps_to_track`) get the committed row advanced along the root path of the
  tracked token, as SGLang's scatter of that token's snapshot would write them.

Host work (tree links to parent lists, the plan) is done once per forward, at its first GDN layer, and syncs.
CUDA-graph capture of target verify is refused (the plan is a host step): start SGLang with --disable-cuda-graph.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F

import gdn

logger = logging.getLogger("specpilot.sglang")

__all__ = ["FN", "TARGETS", "init_hook", "verify_hook", "commit_hook", "tree_parents", "gates", "verify_layer",
           "commit_step", "GDNStep", "snapshot_bytes", "stash_bytes_per_token", "calls"]

FN = "specpilot.sglang.gdn"
_GDN = "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend"
_HYBRID = "sglang.srt.layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend"
TARGETS = (f"{_GDN}.__init__", f"{_GDN}.forward_extend", f"{_HYBRID}.update_mamba_state_after_mtp_verify")
calls = {"verify": 0, "commit": 0, "sglang_verify": 0, "sglang_commit": 0}  # layer verifies / step commits per path


# -- pure functions (tensors in, tensors out; the self-check and tests call them directly) -------------------


def tree_parents(next_token, next_sibling, B: int, n: int) -> list[list[int]]:
    """Local parent lists of B draft trees of n tokens from SGLang's first-child / next-sibling links
    (`retrieve_next_token`, `retrieve_next_sibling` [B, n], local indices, -1 for none); token 0 is the root.
    None for both: chains. Host step (one sync); raises on links that are not one tree over all n tokens."""
    if next_token is None:
        return [[i - 1 for i in range(n)] for _ in range(B)]
    nt = next_token.reshape(-1, n)[:B].tolist()
    ns = next_sibling.reshape(-1, n)[:B].tolist()
    out = []
    for r in range(B):
        par = [-2] * n
        par[0] = -1
        stack = [0]
        while stack:
            i = stack.pop()
            c = nt[r][i]
            while c != -1:
                if not 0 <= c < n or par[c] != -2:
                    raise ValueError(f"{FN}: request {r}: the draft tree links reach token {c} twice or outside "
                                     f"[0, {n}); retrieve_next_token / retrieve_next_sibling must link one tree over "
                                     "the request's draft tokens (as SGLang's build_tree_kernel_efficient writes them)")
                par[c] = i
                stack.append(c)
                c = ns[r][c]
        if -2 in par:
            raise ValueError(f"{FN}: request {r}: draft token {par.index(-2)} is not reached from the root by "
                             "retrieve_next_token / retrieve_next_sibling; pass the links of one tree over all "
                             f"{n} draft tokens")
        if any(p >= i for i, p in enumerate(par)):
            i = next(i for i, p in enumerate(par) if p >= i)
            raise ValueError(f"{FN}: request {r}: draft token {i} has parent {par[i]} >= {i}; SGLang orders draft "
                             "tokens parent before child, and gdn needs that order")
        out.append(par)
    return out


def gates(A_log, dt_bias, a, b):
    """SGLang's GDN gates in fp32 (fused_gdn_gating): g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)
    return g, torch.sigmoid(b.float())


@dataclasses.dataclass
class GDNStep:
    """One target-verify forward: its tree plan, the state rows the verify read, and each layer's step inputs
    (keyed by the pool's layer index: conv input x [T, D], k [T, H, K], v [T, HV, V], g and beta [T, HV])."""

    meta: object
    plan: gdn.TreePlan
    parents: list
    rows: torch.Tensor
    layers: dict = dataclasses.field(default_factory=dict)


def verify_layer(step: GDNStep, pool_layer: int, mixed_qkv, a, b, conv_weights, conv_bias, activation, A_log,
                 dt_bias, conv_states, ssm_states, shape, *, variant=None):
    """One GDN layer's verify outputs [1, T, HV, V] (SGLang's layout) from the committed states, which are not
    written; the step inputs are kept in `step.layers[pool_layer]`. shape = (Hq, Hk, HV, K, V)."""
    Hq, Hk, HV, K, V = shape
    T = mixed_qkv.shape[0]
    if Hq != Hk:
        raise ValueError(f"{FN}: the layer has {Hq} query heads and {Hk} key heads; gdn.tree_verify takes q and k "
                         "with one head count")
    if ssm_states.dtype != torch.float32:
        raise TypeError(f"{FN}: the SSM state pool is {ssm_states.dtype}; gdn.tree_verify and gdn.commit keep the "
                        "state in fp32: start SGLang with --mamba-ssm-dtype float32, or set SPECPILOT_SGLANG_GDN=0")
    x = gdn.tree_conv1d(mixed_qkv, conv_states, conv_weights, step.plan, bias=conv_bias,
                        activation=activation if activation else None, conv_state_indices=step.rows, variant=variant)
    q, k, v = torch.split(x, [Hq * K, Hk * K, HV * V], dim=-1)
    q, k, v = q.reshape(T, Hq, K), k.reshape(T, Hk, K), v.reshape(T, HV, V)
    g, beta = gates(A_log, dt_bias, a.reshape(T, HV), b.reshape(T, HV))
    o = gdn.tree_verify(q, k, v, g, beta, ssm_states, step.rows, step.plan, scale=K ** -0.5, use_qk_l2norm=True,
                        state_layout="vk", variant=variant)
    step.layers[pool_layer] = (mixed_qkv, k, v, g, beta)
    return o.reshape(1, T, HV, V)


def _accepted(step: GDNStep, steps, what: str):
    """accepted [B, n] and accepted_len [B] of the root paths ending at local draft tokens `steps` (-1: none)."""
    B = step.plan.batch
    if len(steps) < B:
        raise ValueError(f"{FN}: {what} has {len(steps)} entries for {B} verified requests; pass one per request")
    n = max((len(p) for p in step.parents), default=1)
    acc = torch.zeros(B, max(n, 1), dtype=torch.int64)
    acc_len = torch.zeros(B, dtype=torch.int64)
    for r in range(B):
        if steps[r] >= len(step.parents[r]):
            raise ValueError(f"{FN}: request {r}: {what} names draft token {steps[r]}, outside its "
                             f"{len(step.parents[r])} draft tokens; pass local draft-token indices")
        path = gdn.reference.root_path(step.parents[r], steps[r]) if steps[r] >= 0 else []
        acc[r, :len(path)] = torch.tensor(path, dtype=torch.int64)
        acc_len[r] = len(path)
    return acc, acc_len


def commit_step(step: GDNStep, last_step, temporal, conv, track_rows=None, track_steps=None, *,
                variant=None) -> None:
    """Advance the SSM pool `temporal` [L, slots, HV, V, K] and the conv pool `conv` [L, slots, D, W-1] in the
    step's rows along each request's accepted path: the root path of draft token `last_step[r]` (-1: nothing
    accepted). Every pool layer must have been verified in this step.

    `track_rows`, `track_steps` [B] (SGLang's `mamba_track_indices`, `mamba_steps_to_track`): where
    track_steps[r] >= 0, row track_rows[r] also receives the states after the root path of draft token
    track_steps[r] (the radix cache's snapshot), computed from the committed row before it advances."""
    L = temporal.shape[0]
    missing = [i for i in range(L) if i not in step.layers]
    if missing:
        raise RuntimeError(f"{FN}: the commit after verify has no verify inputs of pool layers {missing}; every GDN "
                           "layer of the pool runs in a target-verify forward before its commit (a layer skipped "
                           "by the model cannot be committed by gdn.commit)")
    src = [int(i) for i in step.rows.tolist()]
    if any(r < 0 for r in src) or len(set(src)) != len(src):
        raise ValueError(f"{FN}: the verified requests' state rows {src} hold a negative or a shared row (padded batch "
                         "rows); gdn.commit writes one row per request: serve without padded verify batches (DP "
                         "attention pads them), or set SPECPILOT_SGLANG_GDN=0")
    acc, acc_len = _accepted(step, [int(i) for i in last_step.reshape(-1).tolist()], "last_correct_step_indices")
    xs, ks, vs, gs, bs = (torch.stack([step.layers[i][j] for i in range(L)]) for j in range(5))
    inputs = dict(k=ks, v=vs, g=gs, beta=bs, x=xs, use_qk_l2norm=True, state_layout="vk", variant=variant)
    if track_rows is not None:
        B = step.plan.batch
        t_rows = [int(i) for i in track_rows.reshape(-1)[:B].tolist()]
        t_steps = [int(i) for i in track_steps.reshape(-1)[:B].tolist()]
        sel = [r for r in range(B) if t_steps[r] >= 0 and t_rows[r] >= 0]
        if sel:
            dst, frm = torch.tensor([t_rows[r] for r in sel]), torch.tensor([src[r] for r in sel])
            temporal[:, dst] = temporal[:, frm]
            conv[:, dst] = conv[:, frm]
            # the other requests run an empty path in their own rows (gdn.commit takes one row per request)
            t_acc, t_len = _accepted(step, [t_steps[r] if r in sel else -1 for r in range(B)],
                                     "mamba_steps_to_track")
            rows = [t_rows[r] if r in sel else src[r] for r in range(B)]
            gdn.commit(temporal, conv, torch.tensor(rows, dtype=step.rows.dtype), step.plan, t_acc, t_len, **inputs)
    gdn.commit(temporal, conv, step.rows, step.plan, acc, acc_len, **inputs)
    gdn.check_errors(step.plan)  # a device guard's flag (a bad row or path skips its request) raises here


def snapshot_bytes(cache) -> tuple[int, int]:
    """Bytes of SGLang's per-draft-token snapshot buffers in a SpeculativeState: (SSM, conv windows). A conv
    window that is an overlapping view is counted by the storage it views."""
    ssm = cache.intermediate_ssm
    ssm_b = ssm.numel() * ssm.element_size() if ssm is not None else 0
    seen, conv_b = set(), 0
    for w in cache.intermediate_conv_window or []:
        st = w.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            conv_b += st.nbytes()
    return ssm_b, conv_b


def stash_bytes_per_token(D: int, HV: int, act_bytes: int) -> int:
    """Bytes a verified draft token keeps per layer until its commit: the conv input and the conv output (k and v
    are views of it), in the activation dtype, and g and beta (fp32)."""
    return 2 * D * act_bytes + 2 * HV * 4


# -- SGLang hooks -------------------------------------------------------------------------------------------


def _inactive_reason(backend) -> str | None:
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
    from sglang.srt.utils import is_npu

    if type(backend).forward_extend is not GDNAttnBackend.forward_extend:
        return f"{type(backend).__name__} overrides forward_extend, which the verify hook is on"
    if is_npu():
        return "Ascend NPUs commit through their own hybrid backend, which the commit hook is not on"
    pool = getattr(backend.req_to_token_pool, "mamba_pool", None)
    cache = getattr(pool, "mamba_cache", None)
    if cache is None or not hasattr(cache, "intermediate_ssm"):
        return "the Mamba pool keeps no speculative state (no target verify on this worker)"
    if getattr(backend, "is_draft_worker", False):
        return "a draft worker's backend (it runs no target verify)"
    if any(getattr(cache, f, None) is not None for f in ("replayssm_d", "replayssm_rawv", "replayssm_g")):
        return "ReplaySSM is on (--enable-linear-replayssm*), whose rings own the rollback"
    if cache.temporal.dtype != torch.float32:
        return f"the SSM pool is {cache.temporal.dtype} (gdn keeps fp32 states; --mamba-ssm-dtype float32)"
    if getattr(backend, "enable_unified_memory", False):
        return "the unified memory pool translates state indices"
    if len(cache.conv) != 1:
        return f"the pool holds {len(cache.conv)} conv states per layer (GDN has one)"
    from sglang.srt.layers.attention.linear.utils import pp_spec_stable_rows_enabled

    if pp_spec_stable_rows_enabled():
        return "pipeline-parallel speculative rows are on (a delayed batch's commit names its rows by request)"
    return None


def init_hook(original, self, *args, **kwargs):
    """GDNAttnBackend.__init__, then: decide whether verify and commit run on gdn, and release the snapshots."""
    original(self, *args, **kwargs)
    self._sp_gdn_step = None
    why = _inactive_reason(self)
    self._sp_gdn = why is None
    if why is not None:
        logger.warning("%s: SGLang's verify and commit stay on this GDN backend: %s", FN, why)
        return
    pool = self.req_to_token_pool.mamba_pool
    cache = pool.mamba_cache
    ssm_b, conv_b = snapshot_bytes(cache)
    pool.mamba_cache = dataclasses.replace(cache, intermediate_ssm=None, intermediate_conv_window=[])
    if hasattr(pool, "_intermediate_conv_window_phys"):
        pool._intermediate_conv_window_phys = []
    L, slots, HV, V, K = cache.temporal.shape
    D = cache.conv[0].shape[-2]
    keep = stash_bytes_per_token(D, HV, cache.conv[0].element_size())
    per_tok = (HV * V * K * cache.temporal.element_size() + D * cache.conv[0].shape[-1] * cache.conv[0].element_size())
    logger.warning("%s: target verify runs gdn.tree_verify and the commit gdn.commit; released SGLang's "
                   "per-draft-token snapshot buffers: intermediate_ssm %.3f GiB, conv windows %.3f GiB (%d layers). "
                   "A verified draft token keeps %d bytes per layer until its commit instead of a %d-byte snapshot", FN,
                   ssm_b / 2 ** 30, conv_b / 2 ** 30, L, keep, per_tok)


def _in_capture(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _step_for(self, forward_batch) -> GDNStep:
    meta = self.forward_metadata
    st = self._sp_gdn_step
    if st is not None and st.meta is meta:
        return st
    spec = forward_batch.spec_info
    if getattr(spec, "ragged_verify_layout", None) is not None:
        raise ValueError(f"{FN}: a ragged verify batch (per-request draft counts) is not taken by "
                         "SPECPILOT_SGLANG_GDN; serve with one draft-token count per request, or set "
                         "SPECPILOT_SGLANG_GDN=0")
    n = int(spec.draft_token_num)
    B = int(meta.query_start_loc.numel()) - 1
    parents = tree_parents(meta.retrieve_next_token, meta.retrieve_next_sibling, B, n)
    rows = meta.mamba_cache_indices[:B]
    plan = gdn.build_tree_plan(parents, device=rows.device)
    st = self._sp_gdn_step = GDNStep(meta=meta, plan=plan, parents=parents, rows=rows)
    return st


def verify_hook(original, self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
    """GDNAttnBackend.forward_extend: target verify on gdn where this backend took the switch."""
    if not (getattr(self, "_sp_gdn", False) and forward_batch.forward_mode.is_target_verify()
            and self.mis_metadata is None):
        if forward_batch.forward_mode.is_target_verify():
            calls["sglang_verify"] += 1
        return original(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    if not isinstance(mixed_qkv, torch.Tensor):
        raise TypeError(f"{FN}: target verify got a fused projection tuple, not the packed mixed_qkv; the GDN "
                        "verify path takes mixed_qkv [T, D]")
    if _in_capture(mixed_qkv):
        raise RuntimeError(f"{FN}: CUDA-graph capture of target-verify forwards is not supported with "
                           "SPECPILOT_SGLANG_GDN=1 (its tree plan is a host step per forward); start SGLang with "
                           "--disable-cuda-graph, or set SPECPILOT_SGLANG_GDN=0")
    step = _step_for(self, forward_batch)
    pool = self.req_to_token_pool
    idx = pool.mamba2_layer_index(layer.layer_id)
    cache = pool.mamba_pool.mamba_cache
    out = verify_layer(step, idx, mixed_qkv, a, b, layer.conv_weights, layer.bias, layer.activation, layer.A_log,
                       layer.dt_bias, cache.conv[0][idx], cache.temporal[idx],
                       (layer.num_q_heads, layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim))
    calls["verify"] += 1
    return out


def commit_hook(original, self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, model,
                req_pool_indices=None):
    """HybridLinearAttnBackend.update_mamba_state_after_mtp_verify: gdn.commit along the accepted paths."""
    lin = self.linear_attn_backend
    if not getattr(lin, "_sp_gdn", False):
        calls["sglang_commit"] += 1
        return original(self, last_correct_step_indices, mamba_track_indices, mamba_steps_to_track, model,
                        req_pool_indices)
    step = lin._sp_gdn_step
    if step is None:
        raise RuntimeError(f"{FN}: a commit after verify with no verified step on this GDN backend; SGLang "
                           "commits after a target-verify forward, which keeps the step's inputs")
    if mamba_track_indices is not None:
        if mamba_steps_to_track is None:
            raise ValueError(f"{FN}: mamba_track_indices without mamba_steps_to_track; SGLang passes both for the "
                             "radix cache's Mamba track slots")
        mamba_track_indices = lin._translate_mamba_indices(mamba_track_indices)  # virtual -> physical, as SGLang's
    cache = lin.req_to_token_pool.mamba_pool.mamba_cache
    try:
        commit_step(step, last_correct_step_indices, cache.temporal, cache.conv[0], mamba_track_indices,
                    mamba_steps_to_track)
    finally:
        lin._sp_gdn_step = None  # the step's inputs are spent either way
    calls["commit"] += 1
