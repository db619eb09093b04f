"""`specpilot_tree`: an SGLang attention backend that runs `tree_attn` on the target-verify forward.

SGLang's factory for it (`create_backend`, registered under `NAME` by the plugin when
`SPECPILOT_SGLANG_TREE_ATTN=1`) builds the backend SGLang would have used otherwise (the inner backend)
and returns it as an instance of a direct subclass of the inner's own class (`wrap`). Every mode but target
verify, and every attribute SGLang reads off a backend (flags, `verify_mask`, `forward_metadata`, CUDA-graph
state), stays the inner's. Subclassing, not a proxy object: SGLang reads dozens of class-level flags and
properties off its backends, and a proxy would answer them with the base class's defaults.

Target verify, per forward (`init_forward_metadata`, the host step; it may sync):

* the tree: `forward_batch.spec_info.custom_mask` (EagleVerifyInput), FULL_MASK layout (per request
  `[n, seq_len + n]`) or QLEN_ONLY (`[n, n]`), converted to tree_attn's ancestor bits (int64 per draft
  token, bit j: local draft token j is an ancestor or the token itself) and checked (own bit, ancestor-closed);
* the prefix: `req_to_token[req_pool_indices[r], :seq_lens[r]]` from the runner's `ReqToTokenPool`;
* one `tree_attn.plan` per layer shape, checked once.

Per layer (`forward_extend`, where SGLang sends target verify): the draft tokens' K/V are written to
`out_cache_loc` as every SGLang backend does, then `tree_attn.run` attends each draft token to its request's
prefix and its ancestors-or-self, with `k_new`/`v_new` the layer's own K/V. A layer tree_attn cannot take
(logit cap, sliding window, cross attention, KV-cache dtype other than q's, head_dim outside tree_attn's,
extra attention inputs) runs the inner backend's verify, whose metadata is built too, with one warning per
reason.

CUDA graphs of target verify (SGLang's decode graph runner captures one graph per batch size, with a fixed number
of draft tokens per request): at capture (`init_forward_metadata_out_graph(..., in_capture=True)`) the batch gets a
plan state of its own, whose `tree_attn` plans are built on the first (warm-up) forward with fixed buffers: a work
item `capacity` that fits any prefix length, a kv_indices buffer of the batch size times the context length, and
the node budget. Before each replay (`init_forward_metadata_out_graph(view)`, not called from
`init_forward_metadata`) the new step's tree and prefix slots are written into those buffers (`TreeAttnPlan.update`,
a host step), so the captured kernels read them. Padded rows (`num_padding`, the rows a replay adds to reach the
captured batch size) attend as chains over the slots SGLang gives them; their outputs are not used. Decode and
other modes are captured by the inner as before.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

import tree_attn

logger = logging.getLogger("specpilot.sglang")

__all__ = ["NAME", "INNER_ENV", "FULL_MASK", "QLEN_ONLY", "ancestor_bits", "check_tree", "prefix_slots",
           "TreeVerifyState", "wrap", "create_backend", "inner_backend_name", "calls"]

NAME = "specpilot_tree"
INNER_ENV = "SPECPILOT_SGLANG_TREE_ATTN_INNER"
FN = "specpilot.sglang.tree_attn"
FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2  # SGLang's TreeMaskMode values
calls = {"tree_attn": 0, "inner": 0}  # target-verify layer forwards that took each path (tests, self-check)
GRAPH_ITEMS = 512  # tree_attn work items a captured verify plan holds beyond one split per request


def _mask_mode(custom_mask: torch.Tensor, B: int, n: int, prefix_sum: int, declared) -> int:
    """Which layout custom_mask holds: the backend's verify buffer declares it; otherwise its size tells."""
    if declared is not None:
        mode = int(declared)
    else:
        full, qlen = n * prefix_sum + B * n * n, B * n * n
        mode = QLEN_ONLY if custom_mask.numel() == qlen and full != qlen else FULL_MASK
    if mode == QLEN_ONLY_BITPACKING:
        raise ValueError(f"{FN}: the verify mask is bit-packed (TreeMaskMode.QLEN_ONLY_BITPACKING), which this backend "
                         "does not read; use a mask layout of FULL_MASK or QLEN_ONLY (SGLang's default on GPUs and "
                         "CPUs)")
    need = (n * prefix_sum + B * n * n) if mode == FULL_MASK else B * n * n
    if custom_mask.numel() < need:
        raise ValueError(f"{FN}: spec_info.custom_mask has {custom_mask.numel()} entries, fewer than the {need} of "
                         f"{B} requests of {n} draft tokens over {prefix_sum} prefix tokens in the "
                         f"{'FULL_MASK' if mode == FULL_MASK else 'QLEN_ONLY'} layout; pass the verify input SGLang's "
                         "tree builder made for this batch")
    return mode


def ancestor_bits(custom_mask: torch.Tensor, seq_lens: torch.Tensor, n: int, mode: int) -> torch.Tensor:
    """int64 `[B * n]`: bit j of entry r*n + i is SGLang's mask cell (draft token i of request r sees draft
    token j). FULL_MASK: request r's block is `[n, seq_lens[r] + n]`, its tree columns the last n;
    QLEN_ONLY: `[n, n]`. Device ops only, no host sync."""
    B = seq_lens.numel()
    dev = custom_mask.device
    j = torch.arange(n, device=dev)
    if mode == FULL_MASK:
        lens = seq_lens.to(device=dev, dtype=torch.int64)
        row = lens + n  # [B]
        start = torch.cumsum(n * row, 0) - n * row
        idx = (start[:, None, None] + j[None, :, None] * row[:, None, None] + lens[:, None, None] + j[None, None, :])
    else:
        idx = torch.arange(B, device=dev)[:, None, None] * (n * n) + j[None, :, None] * n + j[None, None, :]
    cells = custom_mask.reshape(-1)[idx] != 0  # [B, n, n]
    return (cells.to(torch.int64) << j).sum(-1).reshape(-1)


def check_tree(bits: torch.Tensor, B: int, n: int) -> None:
    """Every draft token sees itself, and the mask is ancestor-closed (a token that sees token j sees every
    token j sees). Host step: one sync."""
    if n > tree_attn.MAX_NODES:
        raise ValueError(f"{FN}: {n} draft tokens per request, more than tree_attn's {tree_attn.MAX_NODES}; run with "
                         f"--speculative-num-draft-tokens at most {tree_attn.MAX_NODES}")
    if B == 0 or n == 0:
        return
    j = torch.arange(n, device=bits.device)
    m = ((bits.view(B, n)[:, :, None] >> j) & 1).bool()  # [B, i, j]: i sees j
    own = m.diagonal(dim1=1, dim2=2)
    reach = torch.bmm(m.float(), m.float()) > 0  # i sees some token that sees l
    bad = reach & ~m
    if bool((~own).any() | bad.any()):
        if (~own).any():
            r, i = (int(x) for x in (~own).nonzero()[0])
            raise ValueError(f"{FN}: the verify tree mask of request {r} does not let draft token {i} see itself; "
                             "every draft token must attend to itself (spec_info.custom_mask: set the diagonal of "
                             "each request's draft block)")
        r, i, l_ = (int(x) for x in bad.nonzero()[0])
        via = int((m[r, i] & m[r, :, l_]).nonzero()[0, 0])
        raise ValueError(f"{FN}: the verify tree mask of request {r} is not ancestor-closed: draft token {i} sees "
                         f"token {via}, which sees token {l_}, but {i} does not see {l_}; each draft token must see "
                         "all of its ancestors (build spec_info.custom_mask from the draft tree's parent links, as "
                         "SGLang's build_tree_kernel_efficient does)")


def prefix_slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens_cpu: list[int]):
    """(kv_indptr int32 [B+1], kv_indices int32): each request's prefix token slots from SGLang's req_to_token."""
    dev = req_to_token.device
    B = len(seq_lens_cpu)
    indptr = torch.zeros(B + 1, dtype=torch.int32)
    if B:
        indptr[1:] = torch.cumsum(torch.tensor(seq_lens_cpu, dtype=torch.int64), 0).to(torch.int32)
    width = max(seq_lens_cpu, default=0)
    if width == 0:
        return indptr.to(dev), torch.zeros(0, dtype=torch.int32, device=dev)
    rows = req_to_token[req_pool_indices.to(dev).long(), :width]  # [B, width]
    keep = torch.arange(width, device=dev)[None, :] < torch.tensor(seq_lens_cpu, device=dev)[:, None]
    return indptr.to(dev), rows[keep].to(torch.int32)


@dataclass
class TreeVerifyState:
    """One target-verify forward's tree: plans are built per layer shape from these tensors. A state of a captured
    batch size (`graph`) builds its plans with fixed buffers (`capacity`, `kv_capacity`, `max_nodes`), and each
    replay refills them (`refill`)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    tree_mask: torch.Tensor
    plans: dict = field(default_factory=dict)
    graph: bool = False
    kv_capacity: int | None = None
    max_nodes: int | None = None

    def capacity(self, group: int) -> int | None:
        """A captured plan's work items for `group` query heads per KV head: per request one prefix split and one
        tree item per 16-row tile of its n x group rows (tree_attn's schedule lengthens the splits until the
        step fits, so this holds any prefix length), plus GRAPH_ITEMS for the splits that fill the GPU at short
        prefixes. None (the step's own count) outside a graph."""
        if not self.graph:
            return None
        B = self.qo_indptr.numel() - 1
        return GRAPH_ITEMS + 2 * B * -(-self.max_nodes * group // 16)

    def refill(self, new: "TreeVerifyState") -> None:
        """The next replay's tree and prefix slots into this captured state's plans (same batch size and node
        count)."""
        if new.tree_mask.numel() != self.tree_mask.numel():
            raise ValueError(f"{FN}: a replay of {new.tree_mask.numel()} draft tokens on a graph captured for "
                             f"{self.tree_mask.numel()}; SGLang replays a graph with the batch size and draft token "
                             "count it was captured for")
        if new.kv_indices.numel() > (self.kv_capacity or 0):
            raise ValueError(f"{FN}: the replay's {new.kv_indices.numel()} prefix tokens exceed the captured plan's "
                             f"{self.kv_capacity} (batch size x context length)")
        self.qo_indptr, self.kv_indptr, self.kv_indices, self.tree_mask = (
            new.qo_indptr, new.kv_indptr, new.kv_indices, new.tree_mask)
        for p in self.plans.values():
            p.update(new.qo_indptr, new.kv_indptr, new.kv_indices, new.tree_mask, validate=False)


def _chain_bits(n: int, rows: int, device) -> torch.Tensor:
    """Ancestor bits of `rows` chains of n draft tokens (token i sees 0..i): the padded rows' trees."""
    one = (torch.ones(n, dtype=torch.int64, device=device) << torch.arange(1, n + 1, device=device)) - 1
    return one.repeat(rows)


def inner_backend_name(runner) -> str:
    """The backend SGLang would have used: `SPECPILOT_SGLANG_TREE_ATTN_INNER`, else, on CUDA and ROCm devices,
    SGLang's default choice for the model and GPU (`get_default_attn_backend`). Other devices (CPU, XPU, NPU,
    HPU) get theirs from SGLang's platform hooks, which this does not repeat: they must name it."""
    name = os.environ.get(INNER_ENV, "").strip()
    if name:
        return name
    device = str(getattr(runner, "device", "cuda"))
    if device != "cuda":
        raise RuntimeError(f"{FN}: on device {device!r} the inner backend is not resolved automatically; set "
                           f"{INNER_ENV} to the backend SGLang picks there (e.g. {INNER_ENV}=torch_native, or "
                           "intel_amx on x86 CPUs with AMX)")
    try:
        from sglang.srt.arg_groups.model_override_base import get_default_attn_backend

        name = get_default_attn_backend(runner.server_args, runner.use_mla_backend, runner.model_config)
    except Exception as e:
        raise RuntimeError(f"{FN}: SGLang's default attention backend could not be resolved ({type(e).__name__}: "
                           f"{e}); set {INNER_ENV} to the backend that serves every mode but target verify, e.g. "
                           f"{INNER_ENV}=flashinfer") from e
    if name == NAME:
        raise RuntimeError(f"{FN}: the inner backend resolved to {NAME} itself; set {INNER_ENV} to another backend")
    return name


class TreeVerifyMixin:
    """The methods and defaults `wrap` puts into a direct subclass of the inner backend's class (`_sp_base`):
    target verify runs tree_attn; everything else is the inner's. A direct subclass, not a mixin base ahead of
    the inner's class: `__class__` assignment refuses such a class as a different object layout."""

    _sp_base: type = None  # the inner backend's class: what `super()` would name in the subclass
    _sp_req_to_token_pool = None
    _sp_token_to_kv_pool = None
    _sp_verify: TreeVerifyState | None = None
    _sp_warned: frozenset = frozenset()
    _sp_graphs: dict | None = None  # captured batch size -> its TreeVerifyState (`wrap` gives each backend its own)
    _sp_eager: bool = False

    # -- metadata (host step) -------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch):
        # the eager entry; the graph runner calls init_forward_metadata_out_graph itself, at capture and replay
        self._sp_verify = None
        self._sp_eager = True
        try:
            self._sp_base.init_forward_metadata(self, forward_batch)
        finally:
            self._sp_eager = False
        if forward_batch.forward_mode.is_target_verify() and self._sp_verify is None:
            self._sp_verify = self._sp_plan_verify(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if not forward_batch.forward_mode.is_target_verify():
            self._sp_base.init_forward_metadata_out_graph(self, forward_batch, in_capture)
            return
        self._sp_base.init_forward_metadata_out_graph(self, forward_batch, in_capture)
        bs = int(forward_batch.req_pool_indices.numel())
        if in_capture:
            self._sp_verify = self._sp_graphs[bs] = self._sp_plan_verify(forward_batch, capture=True)
            return
        captured = None if self._sp_eager else self._sp_graphs.get(bs)
        if captured is None:
            self._sp_verify = self._sp_plan_verify(forward_batch)
            return
        captured.refill(self._sp_plan_verify(forward_batch))
        self._sp_verify = captured

    def glue_target_verify_metadata(self) -> str:
        # SGLang may capture a host-free verify prep into its metadata glue graph; this one reads the tree on the host
        return f"{NAME} plans target verify on the host (tree_attn.plan: mask checks, slot lists)"

    def _sp_plan_verify(self, fb, capture: bool = False) -> TreeVerifyState:
        """The forward's tree and prefix slots. A replay view (`num_padding` > 0) has padded rows after the real
        requests: they attend as chains over the slots SGLang gave them. At capture (`capture`) the draft tree is
        SGLang's placeholder, so every row is a chain, and the state gets the fixed buffer sizes of a graph."""
        spec = fb.spec_info
        if spec is None or getattr(spec, "custom_mask", None) is None:
            raise ValueError(f"{FN}: the target-verify forward has no spec_info.custom_mask (the draft tree); run "
                             "speculative decoding with a tree verify input (EAGLE, EAGLE3, STANDALONE, NGRAM)")
        if getattr(spec, "ragged_verify_layout", None) is not None:
            raise ValueError(f"{FN}: a ragged verify batch (per-request draft counts, SGLang's ragged verify mode) is "
                             f"not taken by {NAME}; serve with one draft-token count per request (the ragged verify "
                             "mode off), or choose another --attention-backend")
        n = int(getattr(spec, "num_tokens_per_req", -1))
        if n <= 0:
            n = int(spec.draft_token_num)
        B = int(fb.req_pool_indices.numel())
        pad = int(getattr(fb, "num_padding", 0) or 0)
        if not 0 <= pad <= B:
            raise ValueError(f"{FN}: num_padding={pad} for a batch of {B} rows; SGLang pads a replay up to the "
                             "captured batch size")
        real = B - pad
        lens = fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens
        seq_lens_cpu = [int(x) for x in lens[:B].tolist()]
        translator = getattr(self, "kv_index_translator", None)
        if translator is not None and getattr(translator, "is_translating", False):
            raise ValueError(f"{FN}: the KV pool translates req_to_token ids (a unified pool), which this backend "
                             "does not read; serve without the unified KV pool, or choose another --attention-backend")
        if capture:
            bits = _chain_bits(n, B, spec.custom_mask.device)
            check_tree(bits, B, n)  # the node budget
        else:
            vm = getattr(self, "verify_mask", None)
            mode = _mask_mode(spec.custom_mask, real, n, sum(seq_lens_cpu[:real]), None if vm is None else vm.mode)
            bits = ancestor_bits(spec.custom_mask, fb.seq_lens[:real], n, mode)
            check_tree(bits, real, n)
            if pad:
                bits = torch.cat([bits, _chain_bits(n, pad, bits.device)])
        dev = bits.device
        qo = torch.arange(0, (B + 1) * n, n, dtype=torch.int32, device=dev)
        kv_indptr, kv_indices = prefix_slots(self._sp_req_to_token_pool.req_to_token, fb.req_pool_indices,
                                             seq_lens_cpu)
        st = TreeVerifyState(qo, kv_indptr.to(dev), kv_indices.to(dev), bits)
        if capture:
            st.graph, st.max_nodes = True, n
            st.kv_capacity = max(1, B * int(self._sp_req_to_token_pool.req_to_token.shape[1]))
        return st

    # -- forward (per layer) --------------------------------------------------------------------

    def _sp_unsupported(self, q, k, v, layer, kwargs, k_buf) -> str | None:
        if any(val is not None for val in kwargs.values()):
            return f"extra attention inputs {sorted(k_ for k_, v_ in kwargs.items() if v_ is not None)}"
        if k is None or v is None:
            return "no K/V of the draft tokens (a layer that reuses another layer's KV)"
        if getattr(layer, "is_cross_attention", False):
            return "cross attention"
        if (getattr(layer, "logit_cap", 0) or 0) > 0:
            return "a logit cap"
        sw = getattr(layer, "sliding_window_size", None)
        if sw is not None and sw > -1:
            return "a sliding window"
        if layer.qk_head_dim != layer.v_head_dim or layer.qk_head_dim not in tree_attn.HEAD_DIMS:
            return f"head dims qk={layer.qk_head_dim}, v={layer.v_head_dim} (tree_attn takes {tree_attn.HEAD_DIMS})"
        if q.dtype not in (torch.bfloat16, torch.float16) or k_buf.dtype != q.dtype:
            return f"q dtype {q.dtype} with a KV cache of {k_buf.dtype} (tree_attn needs one bf16/fp16 dtype)"
        return None

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        # Target verify arrives here from AttentionBackend.forward and, directly, from SGLang's wrapper backends
        # (HybridLinearAttnBackend of the hybrid GDN models, HybridAttnBackend), which call forward_extend.
        if not forward_batch.forward_mode.is_target_verify():
            return self._sp_base.forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        st = self._sp_verify
        if st is None:
            raise RuntimeError(f"{FN}: forward of a target-verify batch before init_forward_metadata; SGLang's model "
                               "runner calls it first (a custom runner must too)")
        pool = self._sp_token_to_kv_pool
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        why = self._sp_unsupported(q, k, v, layer, kwargs, k_buf)
        if why is not None:
            if why not in self._sp_warned:
                self._sp_warned = self._sp_warned | {why}
                logger.warning("%s: layer %s has %s; its target verify runs the inner backend", FN, layer.layer_id, why)
            calls["inner"] += 1
            return self._sp_base.forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        H, Hkv, D = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        k = k.view(-1, Hkv, D)
        v = v.view(-1, Hkv, D)
        if save_kv_cache:
            from sglang.srt.mem_cache.memory_pool import KVWriteLoc

            pool.set_kv_buffer(layer, KVWriteLoc.for_batch(forward_batch), k, v)
            k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        if k_buf.dim() == 4 and getattr(pool, "use_hnd", False):  # [pages, Hkv, page_size, D] -> page-major rows
            k_buf, v_buf = k_buf.permute(0, 2, 1, 3), v_buf.permute(0, 2, 1, 3)
        slots = k_buf.shape[0] * (k_buf.shape[1] if k_buf.dim() == 4 else 1)
        key = (H, Hkv, D, q.dtype, slots)
        p = st.plans.get(key)
        if p is None:
            p = tree_attn.plan(st.qo_indptr, st.kv_indptr, st.kv_indices, st.tree_mask, num_qo_heads=H,
                               num_kv_heads=Hkv, head_dim=D, cache_slots=slots, dtype=q.dtype,
                               validate=not st.plans, capacity=st.capacity(H // Hkv),
                               kv_capacity=st.kv_capacity, max_nodes=st.max_nodes)
            st.plans[key] = p
        out = tree_attn.run(p, q.reshape(-1, H, D), k_buf, v_buf, k_new=k.to(q.dtype), v_new=v.to(q.dtype),
                            sm_scale=layer.scaling)
        calls["tree_attn"] += 1
        return out.reshape(-1, H * D)


_CLASSES: dict[type, type] = {}


def wrap(inner, *, req_to_token_pool, token_to_kv_pool):
    """Turn the inner backend into the tree backend in place (its class becomes a direct subclass of its own
    class holding `TreeVerifyMixin`'s methods) and return it."""
    cls = type(inner)
    if getattr(cls, "_sp_base", None) is not None:
        raise ValueError(f"{FN}: the inner backend is already {NAME}; set {INNER_ENV} to another backend")
    sub = _CLASSES.get(cls)
    if sub is None:
        ns = {k: v for k, v in vars(TreeVerifyMixin).items() if not k.startswith("__")}
        ns.update(_sp_base=cls, __module__=__name__, __qualname__=f"SpecPilotTree{cls.__name__}",
                  __doc__=f"{cls.__name__} with target verify on tree_attn (specpilot.sglang.tree_backend).")
        sub = _CLASSES[cls] = type(f"SpecPilotTree{cls.__name__}", (cls,), ns)
    inner.__class__ = sub
    inner._sp_req_to_token_pool = req_to_token_pool
    inner._sp_token_to_kv_pool = token_to_kv_pool
    inner._sp_verify = None
    inner._sp_warned = frozenset()
    inner._sp_graphs = {}
    return inner


def create_backend(runner):
    """SGLang's factory for `--attention-backend specpilot_tree` (ATTENTION_BACKENDS[NAME])."""
    if getattr(runner, "use_mla_backend", False):
        raise ValueError(f"{FN}: {NAME} serves MHA/GQA models; this model uses MLA, choose another --attention-backend")
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    name = inner_backend_name(runner)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"{FN}: {INNER_ENV}={name!r} is not an SGLang attention backend; choose one of "
                         f"{sorted(k for k in ATTENTION_BACKENDS if k != NAME)}")
    inner = ATTENTION_BACKENDS[name](runner)
    logger.warning("%s: target verify runs tree_attn; every other mode runs %s", FN, name)
    return wrap(inner, req_to_token_pool=runner.req_to_token_pool, token_to_kv_pool=runner.token_to_kv_pool)
