"""Tree attention: tree_attn's split-KV kernel beside torch SDPA and FlexAttention.

Dims: the shape set's attention heads (H = attn_q_heads, Hkv = attn_kv_heads, D = attn_head_dim; hybrid-27b:
24, 4, 256), bf16. The KV cache is the token-slot layout [slots, Hkv, D] with the tree nodes' keys in the cache
(`nodes_in_cache`: the last n_r entries of request r's kv_indices, as SGLang writes the draft tokens before
verify); kv_indices is a random permutation of the slots, so the gather is real. Trees are draft-tree-like: one
root, each node hangs off one of the 5 nodes before it (seeded).

Groups (baseline variant in brackets):
* `B1-N32-L{1k,4k,32k,128k}` [flex]: batch 1, one 32-node tree over a prefix of L tokens.
  "wgmma" / "mma" / "ws": tree_attn.run on a plan made in setup (tree_attn.plan is the host step, not timed;
  run is CUDA-graph timed); "wgmma" and "ws" (the warp-specialised CUDA C++ kernel) only on sm_90; "wgmma-device"
  (sm_90) / "mma-device": the same kernel on a plan with schedule="device" (the schedule built by the kernels at
  each run), so its cost beside the host schedule shows. "tree_attention" (L = 32k only): the one-call API (its
  schedule built on the device: no host plan, eager CUDA events); "tree_attention-kept": with `keep_plan=True`, as
  the layers of one decoding step call it (the step's same metadata tensors in every call: the first call plans on
  the host, the others run on its kept plan); "run-eager": `run` on a host plan timed as those two are (eager
  CUDA events over back-to-back calls), their baseline where the host's launch work is part of a call.
  "sdpa-mask": F.scaled_dot_product_attention with the tree's mask as an additive bf16 mask built once in setup (no
  per-call bool->float conversion), the GQA group folded into the query rows ([1, Hkv, G*n, D] against
  [1, Hkv, L+n, D], mask [G*n, L+n]) so K/V are not expanded to H heads. "flex": flex_attention under
  torch.compile with a block mask made in setup; the mask_mod reads the prefix length and a precomputed ancestor
  bool tensor [B, n, n].
* `B24-N8-L1k-32k` [flex]: batch 24, 8-node trees, prefix lengths uniform in [1k, 32k] (seeded); tree_attn
  variants and "flex". FlexAttention runs the batch as one padded call ([24, Hkv, Lmax+8, D], each request's
  prefix and nodes at the start of its row) with per-request lengths in the mask_mod: with 8 queries a request
  this takes its split-KV decoding kernel in one launch and the block mask skips the padding blocks (a packed
  document mask would put 192 queries in a few 128-row blocks with no KV split; a loop of 24 calls recompiles
  per length).
* `chain-B1-N32-L{4k,32k}` [sdpa]: a 32-node chain (a path); tree_attn variants beside "sdpa": the chain's mask
  (the whole prefix plus the earlier chain nodes) is exactly SDPA's bottom-right causal mask, expressed with
  torch.nn.attention.bias.causal_lower_right(n, L+n) and enable_gqa (flash attention where it takes the call).
  Same function, no mask tensor.

Peers are given K/V already gathered contiguous ([B, Hkv, L+n, D]); tree_attn gathers from the permuted cache.
This favours the peers.

flops = 4 H D sum_r n_r (L_r + n_r) (QK^T and PV over every key a request's rows could see).
Byte floor: every K and V row a request reads once plus q read and out written:
  bytes = 2 * Hkv * D * 2 * sum_r (L_r + n_r) + 2 * T * H * D * 2      (T = sum_r n_r, bf16).

Checks (each in the same run as its timing): tree_attn against tree_attn.tree_attention_reference in fp64 (oracle)
and fp32 rounded to bf16 (baseline), factor 3 (the kernel rounds P to bf16 before P.V: one more rounding the
size of the output's own). Peers against the same references with factor 8 (they form P.V from bf16 P too and
accumulate in their own order). The references run on the GPU; where they would take more than _FULL_CHECK
elements at once the check covers the first and last request only (B24) and the GQA groups of kv heads 0 and
Hkv - 1 only (L = 128k).
On a CPU only the "tiny" shape set yields (small) cases: B1 with a 5-node tree over L = 40 (with
"tree_attention", "tree_attention-kept" and "run-eager"), a ragged B3, a 4-node chain; D rounds up to 64 there
(tiny's 32 is not a supported head dim); "flex" (torch.compile) only runs on CUDA. There the kernel variants run
under the interpreter when TRITON_INTERPRET=1; without it a CPU runs the one torch path, "reference", in place of
"wgmma" / "mma" and "tree_attention".
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import autotune
from specpilot.testing import assert_close

from ..registry import Case, Prepared, register, rotations
from ..shapes import ModelShapes
from . import chain, draft_tree

_SEED = 2718
_OP = "tree_attn.tree_attention"
_HEAD_DIMS = (64, 128, 256)
_FULL_CHECK = 1 << 28  # elements (keys x query heads x D) the fp64 reference takes at once, see Problem.check


def _anc(parents: list[int]) -> list[int]:
    """tree_mask bits: bit j of anc[i] set <=> node j is an ancestor of i or i itself."""
    anc = []
    for i, p in enumerate(parents):
        anc.append((anc[p] if p >= 0 else 0) | (1 << i))
    return anc


def _klabel(L: int) -> str:
    return f"{L // 1024}k" if L % 1024 == 0 else str(L)


def head_dims(shapes: ModelShapes) -> tuple[int, int, int]:
    """(query heads, KV heads, the kernels' head dim for the model's: the smallest they take at or above it)."""
    D = next((d for d in _HEAD_DIMS if d >= shapes.attn_head_dim), _HEAD_DIMS[-1])
    return shapes.attn_q_heads, shapes.attn_kv_heads, D


@dataclass
class Spec:
    """One benchmark step: a draft tree (parent lists) and a prefix length per request, and the attention's heads."""

    trees: list[list[int]]
    lens: list[int]  # prefix length of each request
    H: int
    Hkv: int
    D: int

    @property
    def ns(self) -> list[int]:
        return [len(t) for t in self.trees]

    @property
    def T(self) -> int:
        return sum(self.ns)

    @property
    def slots(self) -> int:
        return sum(L + n for L, n in zip(self.lens, self.ns))

    def flops(self) -> float:
        return 4.0 * self.H * self.D * sum(n * (L + n) for L, n in zip(self.lens, self.ns))

    def bytes(self) -> float:
        return float(2 * self.Hkv * self.D * 2 * self.slots + 2 * self.T * self.H * self.D * 2)


class Problem:
    """Index tensors (shared by every rotated set) and `sets` input sets (q, k_cache, v_cache)."""

    def __init__(self, spec: Spec, device: torch.device, sets: int, seed: int):
        self.spec = spec
        ns, lens = spec.ns, spec.lens
        qo = [0]
        kv = [0]
        for L, n in zip(lens, ns):
            qo.append(qo[-1] + n)
            kv.append(kv[-1] + L + n)
        perm = torch.randperm(spec.slots, generator=torch.Generator().manual_seed(seed))
        i32 = dict(dtype=torch.int32, device=device)
        self.qo_indptr = torch.tensor(qo, **i32)
        self.kv_indptr = torch.tensor(kv, **i32)
        self.kv_indices = perm.to(**i32)
        self.tree_mask = torch.tensor([a for t in spec.trees for a in _anc(t)], dtype=torch.int64, device=device)
        gen = torch.Generator(device=device).manual_seed(seed)
        bf = torch.bfloat16
        self.sets = []
        for _ in range(sets):
            q = torch.randn(spec.T, spec.H, spec.D, device=device, generator=gen).to(bf)
            k = torch.randn(spec.slots, spec.Hkv, spec.D, device=device, generator=gen).to(bf)
            v = torch.randn(spec.slots, spec.Hkv, spec.D, device=device, generator=gen).to(bf)
            self.sets.append((q, k, v))

    def gathered(self, s: int, cache: torch.Tensor) -> torch.Tensor:
        """Set s's cache as the peers take it: [B, Hkv, Lmax + nmax, D], request r's prefix then its nodes at the
        start of row r (zeros after)."""
        sp = self.spec
        width = max(L + n for L, n in zip(sp.lens, sp.ns))
        out = torch.zeros(len(sp.lens), sp.Hkv, width, sp.D, dtype=cache.dtype, device=cache.device)
        kv = self.kv_indptr.tolist()
        for r in range(len(sp.lens)):
            rows = cache[self.kv_indices[kv[r]:kv[r + 1]].long()]  # [L + n, Hkv, D]
            out[r, :, :rows.shape[0]] = rows.transpose(0, 1)
        return out

    def check(self, s: int, out: torch.Tensor, factor: float, msg: str) -> None:
        """out [T, H, D] of set s against the fp64 and fp32 references (on out's device): every request when all
        requests' keys x H x D stay under _FULL_CHECK, else the first and last; every head when a checked request's
        do, else the GQA groups of kv heads 0 and Hkv - 1 (the fp64 reference expands the keys to H heads)."""
        from tree_attn.reference import tree_attention_reference

        sp = self.spec
        q, k, v = self.sets[s]
        qo, kv = self.qo_indptr.tolist(), self.kv_indptr.tolist()
        B, G = len(sp.lens), sp.H // sp.Hkv
        elems = [(L + n) * sp.H * sp.D for L, n in zip(sp.lens, sp.ns)]
        reqs = range(B) if sum(elems) <= _FULL_CHECK else sorted({0, B - 1})
        kvh = list(range(sp.Hkv)) if max(elems[r] for r in reqs) <= _FULL_CHECK else sorted({0, sp.Hkv - 1})
        heads = [h for j in kvh for h in range(j * G, (j + 1) * G)]
        dev = q.device
        for r in reqs:
            n, length = qo[r + 1] - qo[r], kv[r + 1] - kv[r]
            slots = self.kv_indices[kv[r]:kv[r + 1]].long()
            args = (q[qo[r]:qo[r + 1]][:, heads], k[slots][:, kvh], v[slots][:, kvh],
                    torch.tensor([0, length], dtype=torch.int32, device=dev),
                    torch.arange(length, dtype=torch.int32, device=dev),
                    torch.tensor([0, n], dtype=torch.int32, device=dev), self.tree_mask[qo[r]:qo[r + 1]])
            r64, _ = tree_attention_reference(*args, sm_scale=sp.D ** -0.5, dtype=torch.float64)
            r32, _ = tree_attention_reference(*args, sm_scale=sp.D ** -0.5)
            got = out[qo[r]:qo[r + 1]][:, heads]
            assert_close(got, r64, r32.to(out.dtype), factor=factor, msg=f"{msg} request {r}")


def _case(variant: str, spec: Spec, device: torch.device, shape: str, baseline: str, setup) -> Case:
    dims = {"B": len(spec.lens), "T": spec.T, "H": spec.H, "Hkv": spec.Hkv, "D": spec.D, "L": sum(spec.lens)}
    return Case(op=_OP, variant=variant, shape=shape, dims=dims, flops=spec.flops(), bytes=spec.bytes(),
                setup=setup, group=shape, baseline=baseline,
                extra={"nodes": spec.ns[:4], "prefix": spec.lens[:4], "nodes_in_cache": True})


def _kernel_case(variant: str, spec: Spec, device, shape: str, baseline: str, seed: int) -> Case:
    """tree_attn.run on a plan made in setup ("wgmma", "mma", "ws"; "run-eager": the default variant, timed eagerly), or
    the one-call tree_attention ("tree_attention": the schedule built on the device, no host plan;
    "tree_attention-kept": keep_plan=True, a host plan kept per step)."""

    def setup() -> Prepared:
        import tree_attn

        prob = Problem(spec, device, rotations(spec.bytes(), device), seed)
        out = torch.empty(spec.T, spec.H, spec.D, dtype=torch.bfloat16, device=device)
        idx = (prob.kv_indptr, prob.kv_indices, prob.qo_indptr, prob.tree_mask)
        if variant in ("tree_attention", "tree_attention-kept"):  # the user's one call: the device schedule, or a kept plan
            keep = variant == "tree_attention-kept"
            fns = [lambda q=q, k=k, v=v: tree_attn.tree_attention(q, k, v, *idx, out=out, keep_plan=keep)
                   for q, k, v in prob.sets]
        else:  # run on a plan: "<variant>", "<variant>-device" (schedule="device": the schedule built by the
            # kernels at each run), "run-eager" (the one call's eager baseline: the default variant's host plan)
            name, _, where = variant.partition("-")
            plan = tree_attn.plan(prob.qo_indptr, prob.kv_indptr, prob.kv_indices, prob.tree_mask,
                                  num_qo_heads=spec.H, num_kv_heads=spec.Hkv, head_dim=spec.D,
                                  cache_slots=spec.slots, nodes_in_cache=True, dtype=torch.bfloat16,
                                  variant=None if variant == "run-eager" else name,
                                  schedule="device" if where == "device" else "host")
            fns = [lambda q=q, k=k, v=v: tree_attn.run(plan, q, k, v, out=out) for q, k, v in prob.sets]

        def check():
            fns[0]()
            prob.check(0, out, 3.0, f"{variant} {shape}")

        return Prepared(fns=fns, check=check, graph_safe=not variant.startswith(("tree_attention", "run-eager")),
                        teardown=prob.sets.clear)

    return _case(variant, spec, device, shape, baseline, setup)


def _sdpa_mask_case(spec: Spec, device, shape: str, baseline: str, seed: int) -> Case:
    """B1 only: SDPA with an additive mask, the GQA group folded into the query rows."""
    assert len(spec.lens) == 1

    def setup() -> Prepared:
        prob = Problem(spec, device, rotations(spec.bytes(), device), seed)
        (L,), (n,), G = spec.lens, spec.ns, spec.H // spec.Hkv
        seen = torch.ones(n, L + n, dtype=torch.bool, device=device)
        bits = torch.arange(n, device=device)
        seen[:, L:] = ((prob.tree_mask[:, None] >> bits) & 1).bool()
        width = -(-(L + n) // 16) * 16  # aligned row stride (the memory-efficient kernel's requirement)
        bias = torch.zeros(G * n, width, dtype=torch.bfloat16, device=device)[:, :L + n]
        bias.masked_fill_(~seen.repeat(G, 1), float("-inf"))  # row g * n + i: node i, head g of the group
        bias = bias[None, None]
        args = []
        for s, (q, k, v) in enumerate(prob.sets):
            qf = q.view(n, spec.Hkv, G, spec.D).permute(1, 2, 0, 3).reshape(1, spec.Hkv, G * n, spec.D)
            args.append((qf, prob.gathered(s, k), prob.gathered(s, v)))
        prob.sets[1:] = []  # the peers' copies hold the rotated sets; set 0 stays for the check
        outs = [None]

        def call(qf, kf, vf):
            outs[0] = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=bias, scale=spec.D ** -0.5)

        fns = [lambda a=a: call(*a) for a in args]

        def check():
            fns[0]()
            o = outs[0].view(spec.Hkv, G, n, spec.D).permute(2, 0, 1, 3).reshape(n, spec.H, spec.D)
            # SDPA forms P.V from bf16 P in its own order: checked to be the same function within 8x the
            # bf16-output rounding of the fp32 reference, not to tree_attn's precision.
            prob.check(0, o, 8.0, f"sdpa-mask {shape}")

        return Prepared(fns=fns, check=check, graph_safe=True, teardown=args.clear)

    return _case("sdpa-mask", spec, device, shape, baseline, setup)


def _sdpa_chain_case(spec: Spec, device, shape: str, baseline: str, seed: int) -> Case:
    """A chain's mask is SDPA's bottom-right causal mask: causal_lower_right(n, L + n), GQA in the kernel."""
    assert len(spec.lens) == 1

    def setup() -> Prepared:
        from torch.nn.attention.bias import causal_lower_right

        prob = Problem(spec, device, rotations(spec.bytes(), device), seed)
        (L,), (n,) = spec.lens, spec.ns
        assert prob.tree_mask.tolist() == [(1 << (i + 1)) - 1 for i in range(n)], "not a chain"
        mask = causal_lower_right(n, L + n)
        args = [(q.transpose(0, 1)[None].contiguous(), prob.gathered(s, k), prob.gathered(s, v))
                for s, (q, k, v) in enumerate(prob.sets)]
        prob.sets[1:] = []
        outs = [None]

        def call(qh, kf, vf):
            outs[0] = F.scaled_dot_product_attention(qh, kf, vf, attn_mask=mask, scale=spec.D ** -0.5,
                                                     enable_gqa=True)

        fns = [lambda a=a: call(*a) for a in args]

        def check():
            fns[0]()
            # as for sdpa-mask: bf16 P.V in SDPA's order, factor 8
            prob.check(0, outs[0][0].transpose(0, 1), 8.0, f"sdpa {shape}")

        return Prepared(fns=fns, check=check, graph_safe=True, teardown=args.clear)

    return _case("sdpa", spec, device, shape, baseline, setup)


def _flex_case(spec: Spec, device, shape: str, baseline: str, seed: int, compile: bool = True) -> Case:
    """One padded FlexAttention call over the batch; equal node counts per request (`compile=False`: eager, for
    trying the mask on a CPU)."""
    n = spec.ns[0]
    assert all(m == n for m in spec.ns), "the flex case takes equal node counts"

    def setup() -> Prepared:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        prob = Problem(spec, device, rotations(spec.bytes(), device), seed)
        B, width = len(spec.lens), max(spec.lens) + n
        lens = torch.tensor(spec.lens, dtype=torch.int64, device=device)
        bits = torch.arange(n, device=device)
        anc = ((prob.tree_mask.view(B, n)[..., None] >> bits) & 1).bool()  # [B, n, n]: (b, i, j) node i sees j

        def mask_mod(b, h, qi, ki):
            j = ki - lens[b]
            node = (j >= 0) & (j < n) & anc[b, qi, j.clamp(0, n - 1)]
            return (ki < lens[b]) | node

        bm = create_block_mask(mask_mod, B, None, n, width, device=device)
        fa = torch.compile(flex_attention, dynamic=False) if compile else flex_attention
        args = [(q.view(B, n, spec.H, spec.D).transpose(1, 2).contiguous(), prob.gathered(s, k), prob.gathered(s, v))
                for s, (q, k, v) in enumerate(prob.sets)]
        prob.sets[1:] = []
        outs = [None]

        def call(qh, kf, vf):
            outs[0] = fa(qh, kf, vf, block_mask=bm, scale=spec.D ** -0.5, enable_gqa=True)

        fns = [lambda a=a: call(*a) for a in args]

        def check():
            fns[0]()
            # flex forms P.V from bf16 P in its own order: the same function within 8x the bf16 rounding
            prob.check(0, outs[0].transpose(1, 2).reshape(spec.T, spec.H, spec.D), 8.0, f"flex {shape}")

        return Prepared(fns=fns, check=check, graph_safe=True, teardown=args.clear)

    return _case("flex", spec, device, shape, baseline, setup)


@register(_OP)
def cases(shapes: ModelShapes, device: torch.device) -> list[Case]:
    device = torch.device(device)
    if not shapes.attn_layers or (device.type != "cuda" and shapes.name != "tiny"):
        return []
    H, Hkv, D = head_dims(shapes)
    cuda = device.type == "cuda"
    wgmma = not cuda or torch.cuda.get_device_capability(device)[0] == 9
    kernels = ("wgmma", "mma") if wgmma else ("mma",)
    kernels += (f"{kernels[0]}-device",)  # the default kernel with its schedule built on the device
    if cuda and wgmma:  # the warp-specialised CUDA C++ kernel (sm_90)
        kernels += ("ws",)
    host = device.type == "cpu" and not autotune.is_interpreter()  # a CPU without the interpreter: the torch reference
    if host:
        kernels = ("reference",)
    rng = random.Random(_SEED)
    out: list[Case] = []
    seed = _SEED

    def group(spec, shape, peers, baseline, one_call=False):
        nonlocal seed
        seed += 1
        vs = [_kernel_case(v, spec, device, shape, baseline, seed) for v in kernels]
        if one_call and not host:
            vs += [_kernel_case(v, spec, device, shape, baseline, seed)
                   for v in ("tree_attention", "tree_attention-kept", "run-eager")]
        for p in peers:
            if p == "sdpa-mask":
                vs.append(_sdpa_mask_case(spec, device, shape, baseline, seed))
            elif p == "sdpa":
                vs.append(_sdpa_chain_case(spec, device, shape, baseline, seed))
            elif p == "flex" and cuda:  # torch.compile'd flex: CUDA only
                vs.append(_flex_case(spec, device, shape, baseline, seed))
        out.extend(vs)

    # 1. batch 1, one 32-node draft tree
    b1 = [(32, L) for L in (1024, 4096, 32768, 131072)] if cuda else [(5, 40)]
    for n, L in b1:
        spec = Spec([draft_tree(n, rng)], [L], H, Hkv, D)
        group(spec, f"B1-N{n}-L{_klabel(L)}", ("sdpa-mask", "flex"), "flex", one_call=(L == 32768 or not cuda))
    # 2. a batch of small trees over mixed prefix lengths
    B, n, lo, hi = (24, 8, 1024, 32768) if cuda else (3, 4, 5, 40)
    lens = [rng.randint(lo, hi) for _ in range(B)] if cuda else [37, 5, 20]
    spec = Spec([draft_tree(n, rng) for _ in range(B)], lens, H, Hkv, D)
    group(spec, f"B{B}-N{n}-L{_klabel(lo)}-{_klabel(hi)}", ("flex",), "flex")
    # 3. chains
    for n, L in ([(32, 4096), (32, 32768)] if cuda else [(4, 24)]):
        spec = Spec([chain(n)], [L], H, Hkv, D)
        group(spec, f"chain-B1-N{n}-L{_klabel(L)}", ("sdpa",), "sdpa")
    return out
