"""Gated DeltaNet tree verification: tree_verify (wy, recurrent), tree_conv1d, commit; fla beside
them on chains.

Every case runs all `gdn_layers` layers in one call (so one CUDA graph holds the whole model's
GDN verify for a step), with per-layer inputs and per-layer state pools.
* `tree_verify-B1-N32-L48`: batch 1, one 32-node tree; variants "cuda" (the default on sm_80+ GPUs:
  the CUDA C++ kernel gdn/csrc/gdn_tree.cu), "wy" (the Triton kernel's default config),
  "wy-wgmma" (configs.WY_WGMMA: transposed, M = BV = 64, wgmma on sm_90), "wy-levels"
  (level-by-level inverse) and "recurrent" (baseline).
  `tree_conv1d-B1-N32-L48` and `commit-B1-N32-L48` report the other two ops of the step.
* `tree_verify-B24-N8-L48`: batch 24, 8-node trees (compare with the floor).
* `chain-B1-T{8,16,32}-L48`: chain-shaped trees beside fla's chunk_gated_delta_rule and
  fused_recurrent_gated_delta_rule (when fla imports), baseline "recurrent".
Byte floor: q, k, v, g, beta and each request's fp32 state read once, o written once (per layer).
On a CPU only the "tiny" shape set yields (small) cases: the Triton variants under the interpreter when
TRITON_INTERPRET=1, else the one path a CPU runs, "reference" (torch), for all three ops.
"""

from __future__ import annotations

import contextlib
import random

import torch

import autotune
import gdn
from autotune import force
from gdn.configs import WY_WGMMA, WYConfig
from gdn.reference import chunk_reference, conv_reference, recurrent_reference, root_path, tree_reference
from specpilot.testing import assert_close

from ..registry import Case, Prepared, register
from ..shapes import ModelShapes
from . import chain, draft_tree

_SEED = 4321


def _dims(shapes: ModelShapes) -> dict:
    H, HV, D = shapes.gdn_k_heads, shapes.gdn_v_heads, shapes.gdn_head_dim
    return dict(H=H, HV=HV, K=D, V=D, L=shapes.gdn_layers, W=shapes.conv_width, C=2 * H * D + HV * D)


def _inputs(L, T, H, HV, K, V, B, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    bf = torch.bfloat16
    q = torch.randn(L, T, H, K, device=device, generator=gen).to(bf)
    k = torch.randn(L, T, H, K, device=device, generator=gen).to(bf)
    v = torch.randn(L, T, HV, V, device=device, generator=gen).to(bf)
    g = -torch.rand(L, T, HV, device=device, generator=gen) * 0.5
    beta = torch.rand(L, T, HV, device=device, generator=gen).to(bf)
    pool = torch.randn(L, B, HV, K, V, device=device, generator=gen) * 0.05
    return q, k, v, g, beta, pool


def hostile(k, g, beta, seed):
    """The doubling inverse's hostile inputs from stacked [L, T, ...] k, g, beta: keys nearly parallel
    within each layer and key head (correlation 0.95), beta in [0.9, 1], gates near 0. A's entries
    approach 1, its powers grow and the WY kernel's guard takes the substitution fallback."""
    L, T, H, K = k.shape
    gen = torch.Generator(device=k.device).manual_seed(seed)
    shared = torch.randn(L, 1, H, K, device=k.device, generator=gen)
    k = (0.95 * shared + 0.31 * torch.randn(L, T, H, K, device=k.device, generator=gen)).to(k.dtype)
    g = -0.02 * torch.rand(g.shape, device=g.device, generator=gen)
    beta = (0.9 + 0.1 * torch.rand(beta.shape, device=beta.device, generator=gen)).to(beta.dtype)
    return k, g, beta


def _verify_bytes(T, B, H, HV, K, V):
    return 2 * T * H * K * 2 + T * HV * V * 2 + T * HV * (4 + 2) + B * HV * K * V * 4 + T * HV * V * 2


def _verify_flops(ns, HV, K, V):
    # WY form per (request, value head): k k^T, q k^T, k S0, q S0, T rhs, (q k^T) U
    return float(sum(HV * (4 * n * n * K + 4 * n * K * V + 4 * n * n * V) for n in ns))


def _check_verify(o, q, k, v, g, beta, pool, trees, variant, layers, msg):
    fn = recurrent_reference if variant == "recurrent" else chunk_reference
    idx = list(range(len(trees)))
    for li in layers:
        args = (q[li], k[li], v[li], g[li], beta[li])
        r64 = tree_reference(*args, pool[li].double(), idx, trees, use_qk_l2norm=True, dtype=torch.float64)
        r32 = tree_reference(*args, pool[li], idx, trees, use_qk_l2norm=True, fn=fn)
        assert_close(o[li], r64, r32.to(o.dtype), msg=f"{msg} layer {li}")


# pinned WY configs beside the default (node tile from the plan, 'square' inverse, bf16-split products)
_PINNED = {
    "wy-wgmma": WY_WGMMA,  # transposed, wgmma on sm_90 (slower than the mma.sync default on the H200)
    "wy-levels": WYConfig(inverse="levels"),  # level-by-level inverse (the first version's)
}


def _verify_case(variant, trees, d, device, group, tag, baseline="recurrent"):
    B, ns = len(trees), [len(t) for t in trees]
    T, L = sum(ns), d["L"]

    def setup() -> Prepared:
        plan = gdn.build_tree_plan(trees, device=device)
        q, k, v, g, beta, pool = _inputs(L, T, d["H"], d["HV"], d["K"], d["V"], B, device, _SEED + T)
        idx = torch.arange(B, device=device, dtype=torch.int32)
        o = torch.empty(L, T, d["HV"], d["V"], device=device, dtype=torch.bfloat16)

        kernel = "wy" if variant.startswith("wy") else variant
        pinned = _PINNED.get(variant)

        def run():
            with force("gdn.tree_verify", config=pinned) if pinned else contextlib.nullcontext():
                for li in range(L):
                    gdn.tree_verify(q[li], k[li], v[li], g[li], beta[li], pool[li], idx, plan, use_qk_l2norm=True,
                                    variant=kernel, out=o[li])

        def check():
            run()
            _check_verify(o, q, k, v, g, beta, pool, trees, variant, (0, L - 1), f"tree_verify/{variant} {tag}")
            gdn.check_errors(plan)  # the kernels' index guards (a sync point already)

        return Prepared(fns=[run], check=check, graph_safe=True)

    return Case(op="gdn.tree_verify", variant=variant, shape=tag, dims={"B": B, "T": T, "L": L, **d},
                flops=L * _verify_flops(ns, d["HV"], d["K"], d["V"]),
                bytes=float(L * _verify_bytes(T, B, d["H"], d["HV"], d["K"], d["V"])), setup=setup, group=group,
                baseline=baseline, extra={"layers": L, "nodes": ns[:4]})


def _fla_case(variant, n, d, device, group, tag):
    L = d["L"]

    def setup() -> Prepared:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        f = chunk_gated_delta_rule if variant == "fla.chunk" else fused_recurrent_gated_delta_rule
        q, k, v, g, beta, pool = _inputs(L, n, d["H"], d["HV"], d["K"], d["V"], 1, device, _SEED + n)
        outs = [None] * L
        qe, ke = (t.repeat_interleave(d["HV"] // d["H"], 2) for t in (q, k))

        def run():
            with torch.inference_mode():
                for li in range(L):
                    # keyword arguments (fused_recurrent's positional order differs from chunk's);
                    # q/k expanded to the value heads
                    outs[li] = f(q=qe[li, None], k=ke[li, None], v=v[li, None], g=g[li, None], beta=beta[li, None],
                                 scale=d["K"] ** -0.5, initial_state=pool[li], output_final_state=False,
                                 use_qk_l2norm_in_kernel=True)[0]

        def check():
            run()
            o = torch.stack([x[0] for x in outs])
            # fla forms its WY products from bf16 operands: checked to be the same function within
            # 8x the bf16-output rounding of the fp32 recurrence, not to our precision.
            for li in (0, L - 1):
                r64 = recurrent_reference(q[li], k[li], v[li], g[li], beta[li], pool[li, 0].double(),
                                          use_qk_l2norm=True, dtype=torch.float64)
                r32 = recurrent_reference(q[li], k[li], v[li], g[li], beta[li], pool[li, 0], use_qk_l2norm=True)
                assert_close(o[li], r64, r32.to(o.dtype), factor=8.0, msg=f"{variant} {tag} layer {li}")

        return Prepared(fns=[run], check=check, graph_safe=True)

    return Case(op="gdn.tree_verify", variant=variant, shape=tag, dims={"B": 1, "T": n, "L": L, **d},
                flops=L * _verify_flops([n], d["HV"], d["K"], d["V"]),
                bytes=float(L * _verify_bytes(n, 1, d["H"], d["HV"], d["K"], d["V"])), setup=setup, group=group,
                baseline="recurrent", extra={"layers": L})


def _conv_case(trees, d, device, tag, variant="triton"):
    B, T, L, C, W = len(trees), sum(len(t) for t in trees), d["L"], d["C"], d["W"]
    nbytes = L * (2 * T * C * 2 + B * C * (W - 1) * 2 + C * W * 2)

    def setup() -> Prepared:
        plan = gdn.build_tree_plan(trees, device=device)
        gen = torch.Generator(device=device).manual_seed(_SEED)
        x = torch.randn(L, T, C, device=device, generator=gen).to(torch.bfloat16)
        cs = torch.randn(L, B, C, W - 1, device=device, generator=gen).to(torch.bfloat16)
        w = (torch.randn(L, C, W, device=device, generator=gen) * 0.5).to(torch.bfloat16)
        y = torch.empty_like(x)

        def run():
            for li in range(L):
                gdn.tree_conv1d(x[li], cs[li], w[li], plan, out=y[li], variant=variant)

        def check():
            run()
            for li in (0, L - 1):
                r64 = conv_reference(x[li], cs[li], w[li], trees, dtype=torch.float64)
                r32 = conv_reference(x[li], cs[li], w[li], trees)
                assert_close(y[li], r64, r32.to(y.dtype), msg=f"tree_conv1d {tag} layer {li}")
            gdn.check_errors(plan)

        return Prepared(fns=[run], check=check, graph_safe=True)

    return Case(op="gdn.tree_conv1d", variant=variant, shape=tag, dims={"B": B, "T": T, "L": L, "D": C, "W": W},
                flops=float(L * T * C * 2 * W), bytes=float(nbytes), setup=setup, group=tag)


def _commit_case(trees, d, device, tag, variant="triton"):
    B, T, L = len(trees), sum(len(t) for t in trees), d["L"]
    H, HV, K, V, C, W = d["H"], d["HV"], d["K"], d["V"], d["C"], d["W"]
    paths = [root_path(t, max(range(len(t)), key=lambda i: len(root_path(t, i)))) for t in trees]  # deepest
    na = sum(len(p) for p in paths)
    nbytes = L * (2 * B * HV * K * V * 4 + na * (H * K * 2 + HV * V * 2 + HV * 6 + C * 2) + 2 * B * C * (W - 1) * 2)

    def setup() -> Prepared:
        plan = gdn.build_tree_plan(trees, device=device)
        q, k, v, g, beta, pool = _inputs(L, T, H, HV, K, V, B, device, _SEED + 1)
        gen = torch.Generator(device=device).manual_seed(_SEED + 2)
        x = torch.randn(L, T, C, device=device, generator=gen).to(torch.bfloat16)
        cs = torch.randn(L, B, C, W - 1, device=device, generator=gen).to(torch.bfloat16)
        ml = max(len(p) for p in paths)
        acc = torch.tensor([p + [0] * (ml - len(p)) for p in paths], dtype=torch.int32, device=device)
        acc_len = torch.tensor([len(p) for p in paths], dtype=torch.int32, device=device)
        idx = torch.arange(B, device=device, dtype=torch.int32)

        def run():
            gdn.commit(pool, cs, idx, plan, acc, acc_len, k, v, g, beta, x, use_qk_l2norm=True, variant=variant)

        def check():
            p0, c0 = pool.clone(), cs.clone()
            gdn.commit(pool, cs, idx, plan, acc, acc_len, k, v, g, beta, x, use_qk_l2norm=True, validate=True,
                       variant=variant)
            cu = plan.cu_seqlens.tolist()
            for li in (0, L - 1):
                for r in (0, B - 1):
                    toks = [cu[r] + j for j in paths[r]]
                    a = (k[li], v[li], g[li], beta[li], x[li], toks)
                    S64, C64 = gdn.commit_reference(p0[li, r].double(), c0[li, r], *a, use_qk_l2norm=True,
                                                    dtype=torch.float64)
                    S32, _ = gdn.commit_reference(p0[li, r], c0[li, r], *a, use_qk_l2norm=True)
                    assert_close(pool[li, r], S64, S32, msg=f"commit {tag} layer {li} request {r}")
                    assert torch.equal(cs[li, r], C64.to(cs.dtype)), "conv state commit must be an exact copy"

        return Prepared(fns=[run], check=check, graph_safe=True)

    return Case(op="gdn.commit", variant=variant, shape=tag, dims={"B": B, "T": T, "L": L, "accepted": na},
                flops=float(L * na * HV * 6 * K * V), bytes=float(nbytes), setup=setup, group=tag,
                extra={"accepted_per_request": [len(p) for p in paths][:4]})


@register("gdn", ops=("gdn.tree_verify", "gdn.tree_conv1d", "gdn.commit"))
def cases(shapes: ModelShapes, device: torch.device) -> list[Case]:
    device = torch.device(device)
    if not shapes.gdn_layers or (device.type != "cuda" and shapes.name != "tiny"):
        return []
    d = _dims(shapes)
    rng = random.Random(_SEED)
    big = [draft_tree(32, rng)]
    small = [draft_tree(8, rng) for _ in range(24)]
    if device.type != "cuda":  # tiny demo scale on the interpreter
        big, small = [draft_tree(6, rng)], [draft_tree(3, rng) for _ in range(2)]
    variants = ("wy", "wy-wgmma", "wy-levels", "recurrent") if device.type == "cuda" else ("wy", "recurrent")
    host = device.type == "cpu" and not autotune.is_interpreter()  # a CPU without the interpreter: torch references
    if host:
        variants = ("reference",)
    base, other = ("reference", "reference") if host else ("recurrent", "triton")
    from gdn import cuda as gdn_cuda

    if device.type == "cuda" and gdn_cuda.available(device):
        variants = ("cuda",) + variants  # the default where it runs (gdn/csrc/gdn_tree.cu)
    out = []
    for trees in (big, small):
        tag = f"B{len(trees)}-N{len(trees[0])}-L{d['L']}"
        out += [_verify_case(v, trees, d, device, f"tree_verify-{tag}", f"tree_verify-{tag}", base) for v in variants]
    tag = f"B1-N{len(big[0])}-L{d['L']}"
    out += [_conv_case(big, d, device, f"tree_conv1d-{tag}", other),
            _commit_case(big, d, device, f"commit-{tag}", other)]
    try:
        import fla.ops.gated_delta_rule  # noqa: F401

        fla_ok = device.type == "cuda"
    except Exception:
        fla_ok = False
    for n in ((8, 16, 32) if device.type == "cuda" else (4,)):
        tag = f"chain-B1-T{n}-L{d['L']}"
        out += [_verify_case(v, [chain(n)], d, device, tag, tag, base) for v in variants]
        if fla_ok:
            out += [_fla_case(v, n, d, device, tag, tag) for v in ("fla.chunk", "fla.fused_recurrent")]
    return out
