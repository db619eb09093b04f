"""Helpers of the tree_attn suites, as fixtures (the test dirs have no __init__ files, so a test module cannot
import this one by name).

Fixtures `make_batch`, `check` and `raises` hand out the functions below.

* `make_batch(requests, ...)`: a ragged batch (`Batch`: the call's tensors, `reference()`, `plan_kw()`,
  `poisoned_out()` filled with NaN, `refill(seed)` for new values in the same slots). Each request is (tree, prefix length); a tree is a spec string
  ("rand13", "draft32", "chain7", "star9", "single", "empty", "forest6", "dag4", "child-first3") or a local
  parent list (-1 = root). Its ancestor masks are int64 in the format of gdn.TreePlan.anc. The prefix and
  (with nodes_in_cache) node slots are drawn shuffled from a larger token-slot or paged cache.
* `check_attn(batch, out, lse)`: the derived-tolerance comparison with the reference (see its docstring).
* `expect_error(*patterns)`: a ValueError/TypeError in the "tree_attn.<fn>: what; how to fix" style.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass, field

import pytest
import torch

from specpilot.bench.cases import chain, draft_tree, star
from specpilot.testing import assert_close, raises_helpful

MAX_NODES = 64


# --------------------------------------------------------------------------------------- trees


def rand_tree(n, rng):
    """One root, every other node hangs under a uniformly drawn earlier node (bushy and deep mixed)."""
    return [-1] + [rng.randrange(i) for i in range(1, n)] if n else []


def forest(n, rng):
    """Several roots (-1 may be drawn for any node)."""
    return [rng.randrange(-1, i) for i in range(n)]


def masks_of(parents):
    """Unsigned ancestor-or-self bitmasks of a parent list; parents may come after their children."""
    out = []
    for i in range(len(parents)):
        m, j, seen = 0, i, 0
        while j >= 0:
            m |= 1 << j
            j = parents[j]
            seen += 1
            if seen > len(parents):
                raise ValueError(f"parent list {parents} has a cycle")
        out.append(m)
    return out


def tree_masks(spec, rng):
    """Unsigned masks of one request: a spec string or a parent list."""
    if not isinstance(spec, str):
        return masks_of(list(spec))
    if spec == "single":
        return masks_of([-1])
    if spec == "empty":
        return []
    if spec == "dag4":  # node 2 sees the two roots 0 and 1, node 3 sees all: ancestor-closed, not a tree
        return [0b0001, 0b0010, 0b0111, 0b1111]
    kind, n = re.fullmatch(r"([a-z-]+?)(\d+)", spec).groups()
    n = int(n)
    if kind == "child-first":  # node 0's parent is node 1, node 1 is the root, the rest hang under 0
        return masks_of([1, -1] + [0] * (n - 2))
    make = {"rand": rand_tree, "draft": draft_tree, "forest": forest, "chain": lambda n, _: chain(n),
            "star": lambda n, _: star(n)}[kind]
    return masks_of(make(n, rng))


def signed64(m):
    return m - (1 << 64) if m >= 1 << 63 else m


def mask_tensor(masks, device="cpu"):
    """int64 [n] from unsigned python ints (bit 63 becomes the sign bit)."""
    return torch.tensor([signed64(m) for m in masks], dtype=torch.int64, device=device)


# --------------------------------------------------------------------------------------- batch


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    qo_indptr: torch.Tensor
    tree_mask: torch.Tensor
    k_new: torch.Tensor | None
    v_new: torch.Tensor | None
    nodes: list
    prefix: list
    cache_slots: int
    sm_scale: float | None = None
    _refs: dict = field(default_factory=dict, repr=False)

    @property
    def T(self):
        return self.q.shape[0]

    @property
    def H(self):
        return self.q.shape[1]

    @property
    def D(self):
        return self.q.shape[2]

    @property
    def Hkv(self):
        return self.k_cache.shape[-2]

    @property
    def nodes_in_cache(self):
        return self.k_new is None

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.kv_indptr, self.kv_indices, self.qo_indptr, self.tree_mask)

    def new_kw(self):
        return {"k_new": self.k_new, "v_new": self.v_new}

    def plan_kw(self, **kw):
        """Keywords of tree_attn.plan for this batch."""
        return dict(num_qo_heads=self.H, num_kv_heads=self.Hkv, head_dim=self.D, cache_slots=self.cache_slots,
                    nodes_in_cache=self.nodes_in_cache, dtype=self.q.dtype, **kw)

    def refill(self, seed):
        """The same requests, slots and masks with new q, cache and k_new/v_new values (a new layer or step)."""
        gen = torch.Generator().manual_seed(seed)

        def new(t):
            if t is None:
                return None
            # through a contiguous copy: the caches may be strided views of a fused buffer
            return t.clone().copy_(torch.randn(t.shape, generator=gen).to(t.dtype))

        k_cache, v_cache = new(self.k_cache), new(self.v_cache)
        return Batch(q=new(self.q), k_cache=k_cache, v_cache=v_cache, kv_indptr=self.kv_indptr,
                     kv_indices=self.kv_indices, qo_indptr=self.qo_indptr, tree_mask=self.tree_mask,
                     k_new=new(self.k_new), v_new=new(self.v_new), nodes=self.nodes, prefix=self.prefix,
                     cache_slots=self.cache_slots, sm_scale=self.sm_scale)

    def poisoned_out(self):
        return torch.full(self.q.shape, float("nan"), dtype=self.q.dtype, device=self.q.device)

    def reference(self, dtype=torch.float32):
        """(out, lse) of tree_attn.tree_attention_reference in `dtype` on the batch's device, cached (the
        inputs may be changed in place later: a captured graph's buffers)."""
        if dtype not in self._refs:
            from tree_attn.reference import tree_attention_reference

            self._refs[dtype] = tree_attention_reference(*self.args(), sm_scale=self.sm_scale, k_new=self.k_new,
                                                         v_new=self.v_new, dtype=dtype)
        return self._refs[dtype]


def make_batch(requests, *, H=2, Hkv=1, D=64, dtype=torch.bfloat16, layout="slot", page_size=16,
               nodes_in_cache=False, spare=7, seed=0, device="cpu", unused=None, fused_kv=False, sm_scale=None,
               q_scale=1.0, cache_slots=None):
    """A ragged batch: `requests` is a list of (tree spec, prefix length).

    layout "slot": caches [slots, Hkv, D]; "paged": [pages, page_size, Hkv, D], kv_indices still token slots.
    The slots of every prefix (and, with nodes_in_cache, every node) are distinct, drawn in shuffled order
    from a cache with `spare` more slots than needed, or `cache_slots` (a paged cache rounds up to whole pages
    plus one).
    `unused`: a value (e.g. NaN) written into every slot no request names. `fused_kv`: K and V are views
    into one [.., 2, ..] buffer (non-unit strides outside the last dim). `q_scale` sharpens the scores."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    masks = [tree_masks(spec, rng) for spec, _ in requests]
    nodes = [len(m) for m in masks]
    prefix = [L for _, L in requests]
    T = sum(nodes)
    need = sum(prefix) + (T if nodes_in_cache else 0)
    slots = need + spare if cache_slots is None else cache_slots
    assert slots >= need, f"a cache of {slots} slots cannot hold {need}"
    if layout == "paged":
        slots = (-(-slots // page_size) + 1) * page_size
    elif layout != "slot":
        raise ValueError(layout)
    perm = torch.randperm(slots, generator=gen)[:need].tolist()
    kv_indices, kv_indptr = [], [0]
    it = iter(perm)
    for n, L in zip(nodes, prefix):
        pre = [next(it) for _ in range(L)]
        own = [next(it) for _ in range(n)] if nodes_in_cache else []
        kv_indices += pre + own
        kv_indptr.append(len(kv_indices))
    # the caches: random everywhere, `unused` outside the named slots
    if layout == "slot":
        shape, fused = (slots, Hkv, D), (slots, 2, Hkv, D)
    else:
        shape, fused = (slots // page_size, page_size, Hkv, D), (slots // page_size, page_size, 2, Hkv, D)
    buf = None
    if fused_kv:
        buf = torch.randn(fused, generator=gen).to(dtype)
        k_cache, v_cache = buf.select(-3, 0), buf.select(-3, 1)
    else:
        k_cache = torch.randn(shape, generator=gen).to(dtype)
        v_cache = torch.randn(shape, generator=gen).to(dtype)
    if unused is not None:
        free = sorted(set(range(slots)) - set(kv_indices))
        idx = torch.tensor(free, dtype=torch.long)
        for c in (k_cache, v_cache):
            if layout == "slot":
                c[idx] = unused
            else:
                c[idx // page_size, idx % page_size] = unused
    q = (torch.randn(T, H, D, generator=gen) * q_scale).to(dtype)
    k_new = v_new = None
    if not nodes_in_cache:
        k_new = torch.randn(T, Hkv, D, generator=gen).to(dtype)
        v_new = torch.randn(T, Hkv, D, generator=gen).to(dtype)
    qo = [0]
    for n in nodes:
        qo.append(qo[-1] + n)
    dev = torch.device(device)
    mv = lambda t: t.to(dev) if t is not None else None  # noqa: E731
    if buf is not None:  # move the fused buffer, then take the views (moving a view makes it contiguous)
        buf = buf.to(dev)
        k_cache, v_cache = buf.select(-3, 0), buf.select(-3, 1)
    return Batch(q=mv(q), k_cache=mv(k_cache), v_cache=mv(v_cache),
                 kv_indptr=torch.tensor(kv_indptr, dtype=torch.int32, device=dev),
                 kv_indices=torch.tensor(kv_indices, dtype=torch.int32, device=dev),
                 qo_indptr=torch.tensor(qo, dtype=torch.int32, device=dev),
                 tree_mask=mask_tensor([m for ms in masks for m in ms], dev), k_new=mv(k_new), v_new=mv(v_new),
                 nodes=nodes, prefix=prefix, cache_slots=slots, sm_scale=sm_scale)


# --------------------------------------------------------------------------------------- checks


def check_attn(batch, out, lse=None, *, msg=""):
    """`out` (and `lse`) against the fp64 reference, with derived bounds.

    out: the fp32 reference rounded to q's dtype is the baseline. Factor 3, not 2: the kernel also rounds
    the probabilities P to the operand dtype before the P.V product (every flash kernel does), one more
    rounding of the same relative size as the output's own, so its error may reach about twice the
    baseline's plus the accumulation-order difference.
    lse: the baseline is the fp32 reference's lse. q and k are the same bf16/fp16 values for every
    computation, so the only differences are fp32 accumulation of q.k, the base-2 exp/log and the
    log-sum-exp merge of splits: a few fp32 roundings per term. Factor 4 with a floor of 64 fp32 unit
    roundoffs (~4e-6 relative to the largest |lse|) covers that and is still ~500x tighter than a bf16
    rounding of the scores would be."""
    ref64, lse64 = batch.reference(torch.float64)
    ref32, lse32 = batch.reference(torch.float32)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype, f"{msg} out {tuple(out.shape)} {out.dtype}"
    assert out.device == batch.q.device, f"{msg} out on {out.device}"
    assert_close(out, ref64, ref32.to(out.dtype), factor=3.0, msg=f"{msg} out")
    if lse is not None:
        assert lse.shape == (batch.T, batch.H) and lse.dtype == torch.float32, \
            f"{msg} lse {tuple(lse.shape)} {lse.dtype}"
        assert_close(lse, lse64, lse32, factor=4.0, ulps=64, msg=f"{msg} lse")


expect_error = functools.partial(raises_helpful, "tree_attn")  # "tree_attn.<fn>: what; how to fix"


@pytest.fixture(name="make_batch")
def _make_batch_fixture():
    """`make_batch`: a ragged batch of trees over a token-slot or paged cache."""
    return make_batch


@pytest.fixture(name="check")
def _check_fixture():
    """`check_attn`: out and lse against the fp64 reference, derived bounds."""
    return check_attn


@pytest.fixture(name="raises")
def _raises_fixture():
    """`expect_error`: a helpful tree_attn error."""
    return expect_error
