"""tree_attn exploration on one GPU: the split kernel's configs, and where the time of one call goes.

    python3 perf/tree_attn_explore.py --out $OUT       # H200, hybrid-27b attention dims, ~1 min
    python3 perf/tree_attn_explore.py --smoke          # CPU, interpreter, tiny dims (no timing value)

`sweep`: SplitConfig grid (block_m, block_n, num_warps, num_stages, programs_per_sm) on batch 1, one
32-node tree over a 32k prefix, then the best three at 1k, 4k and 128k and on 24 requests of 8-node
trees (prefixes 1k-32k). Each config's output is checked against tree_attn.tree_attention_reference
(fp32) before it is timed (CUDA-graph replays, three rotated input sets where they fit in L2).
`breakdown` (32k): the whole run, the split kernel alone, the merge alone, the same two products on
cuBLAS (K/V contiguous, no softmax, S written), and a copy of K's bytes, plus the plan's host time.
Writes tree_attn_explore.md (and .json) to --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder for tree_attn_explore.md / .json")
    ap.add_argument("--smoke", action="store_true", help="tiny dims on CPU (interpreter)")
    ap.add_argument("--parts", nargs="*", default=["sweep", "breakdown"], choices=["sweep", "breakdown"])
    return ap.parse_args()


ARGS = parse()
if ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import autotune  # noqa: E402
import tree_attn  # noqa: E402
from specpilot.bench.timing import time_fns  # noqa: E402
from tree_attn.configs import SplitConfig  # noqa: E402
from tree_attn.kernels.split import tree_attn_merge_kernel, tree_attn_split_kernel  # noqa: E402

DEV = torch.device("cpu" if ARGS.smoke else "cuda")
H, HKV, D = (4, 2, 64) if ARGS.smoke else (24, 4, 256)
OP = "tree_attn.tree_attention"
ROWS: list[dict] = []


def masks_of(parents: list[int]) -> list[int]:
    anc = []
    for i, p in enumerate(parents):
        anc.append((1 << i) | (anc[p] if p >= 0 else 0))
    return [a - (1 << 64) if a >= 1 << 63 else a for a in anc]


def make_step(ns: list[int], lens: list[int], sets: int, seed: int):
    rng = random.Random(seed)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    masks = []
    for n in ns:
        masks += masks_of([-1] + [rng.randrange(max(0, i - 5), i) for i in range(1, n)])
    T, slots = sum(ns), sum(lens) + 64
    kvp = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=DEV)
    kvi = torch.randperm(slots, device=DEV, generator=gen)[:sum(lens)].int()
    qo = torch.tensor([0] + list(itertools.accumulate(ns)), dtype=torch.int32, device=DEV)
    mask = torch.tensor(masks, dtype=torch.int64, device=DEV)

    def rnd(*shape):
        return torch.randn(*shape, device=DEV, generator=gen).to(torch.bfloat16)

    data = [(rnd(T, H, D), rnd(slots, HKV, D), rnd(slots, HKV, D), rnd(T, HKV, D), rnd(T, HKV, D)) for _ in range(sets)]
    return dict(qo=qo, kvp=kvp, kvi=kvi, mask=mask, slots=slots, data=data, ns=ns, lens=lens)


def nbytes(ns, lens) -> int:
    return sum(2 * HKV * D * 2 * (L + n) for n, L in zip(ns, lens)) + 2 * sum(ns) * H * D * 2


def plan_of(step, cfg=None, variant=None):
    autotune.clear_plans()
    with autotune.force(OP, variant=variant or ("wgmma" if not ARGS.smoke else "mma"), config=cfg):
        return tree_attn.plan(step["qo"], step["kvp"], step["kvi"], step["mask"], num_qo_heads=H, num_kv_heads=HKV,
                              head_dim=D, cache_slots=step["slots"])


def check(step, p) -> float:
    q, kc, vc, kn, vn = step["data"][0]
    o = tree_attn.run(p, q, kc, vc, k_new=kn, v_new=vn)
    r, _ = tree_attn.tree_attention_reference(q, kc, vc, step["kvp"], step["kvi"], step["qo"], step["mask"],
                                              k_new=kn, v_new=vn)
    err = float((o.float() - r).abs().max())
    own = float((r.to(o.dtype).float() - r).abs().max())  # the output's own rounding
    if not err <= 3 * own + 1e-6:
        raise AssertionError(f"max error {err:.3e} over 3x the output rounding {own:.3e}")
    return err


def time_plan(tag, step, cfg, variant=None):
    try:
        p = plan_of(step, cfg, variant)
        err = check(step, p)
        outs = [torch.empty_like(d[0]) for d in step["data"]]
        fns = [lambda d=d, o=o: tree_attn.run(p, d[0], d[1], d[2], k_new=d[3], v_new=d[4], out=o)
               for d, o in zip(step["data"], outs)]
        us = time_fns(fns, DEV, reps=3 if ARGS.smoke else 30).median * 1e6
        tbs = nbytes(step["ns"], step["lens"]) / us / 1e6
        row = dict(case=tag, variant=p.variant, config=str(p.dispatch.config), items=p.num_items,
                   split=p.split_len, us=round(us, 2), tbs=round(tbs, 3), max_err=err)
        print(f"{tag} {p.variant} {p.dispatch.config} items={p.num_items} split={p.split_len}: {us:.1f} us "
              f"{tbs:.2f} TB/s", flush=True)
    except Exception as e:  # a config that fails to compile or to check is reported, not fatal
        row = dict(case=tag, variant=variant, config=str(cfg), error=f"{type(e).__name__}: {str(e)[:200]}")
        print(f"{tag} {cfg}: FAILED {row['error']}", flush=True)
    ROWS.append(row)
    return row


def sweep():
    big = [32], [128 if ARGS.smoke else 32768]
    step = make_step(*big, 1, 1)
    grid = [SplitConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st, programs_per_sm=pps)
            for bm, bn, w, st, pps in itertools.product((64, 128), (32, 64), (4, 8), (2, 3), (1.0, 2.0))]
    if ARGS.smoke:
        grid = [SplitConfig(block_m=16, block_n=16, num_stages=1), SplitConfig(block_m=32, block_n=16, num_stages=1)]
    done = [time_plan("B1-N32-L32k", step, cfg) for cfg in grid]
    best = sorted((r for r in done if "us" in r), key=lambda r: r["us"])[:3]
    keep = [eval(r["config"], {"SplitConfig": SplitConfig}) for r in best]  # noqa: S307 (our own repr)
    time_plan("B1-N32-L32k", step, None, variant="mma")
    for L in ((40, 300) if ARGS.smoke else (1024, 4096, 131072)):
        s = make_step([32], [L], 3 if L <= 4096 else 1, 2)
        for cfg in keep:
            time_plan(f"B1-N32-L{L}", s, cfg)
    rng = random.Random(3)
    ns = [8] * (3 if ARGS.smoke else 24)
    lens = [rng.randrange(10, 60) if ARGS.smoke else rng.randrange(1024, 32768) for _ in ns]
    s = make_step(ns, lens, 1, 4)
    for cfg in keep:
        time_plan("B24-N8-L1k-32k", s, cfg)


def breakdown():
    L = 128 if ARGS.smoke else 32768
    step = make_step([32], [L], 1, 5)
    q, kc, vc, kn, vn = step["data"][0]
    p = plan_of(step, None, None)
    cfg = p.dispatch.config
    out = torch.empty_like(q)
    ks = kc.stride()
    scale = D ** -0.5 * 1.4426950408889634

    def split_only():
        tree_attn_split_kernel[(p.capacity, HKV)](
            q, kc, vc, kn, vn, p.qo_indptr, p.kv_indices, p.tree_mask, p.items, p.po, p.plse, scale, q.stride(0),
            q.stride(1), ks[0], 0, ks[1], ks[0], 0, ks[1], kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
            HKV=HKV, G=H // HKV, D=D, BM=cfg.block_m, BN=cfg.block_n, TN=p.tree_block, PAGE=1, NEW=True,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def merge_only():
        tree_attn_merge_kernel[(q.shape[0], H)](
            p.po, p.plse, out, p.plse, p.node_req, p.qo_indptr, p.req_table, out.stride(0), out.stride(1), HKV=HKV,
            G=H // HKV, D=D, BM=cfg.block_m, BP=cfg.merge_parts, WRITE_LSE=False, num_warps=cfg.merge_warps)

    rows = q.shape[0] * (H // HKV)
    Qc = torch.randn(HKV, rows, D, device=DEV).to(torch.bfloat16)
    Kc = torch.randn(HKV, L, D, device=DEV).to(torch.bfloat16)
    Vc = torch.randn(HKV, L, D, device=DEV).to(torch.bfloat16)
    S = torch.empty(HKV, rows, L, device=DEV, dtype=torch.bfloat16)
    O = torch.empty(HKV, rows, D, device=DEV, dtype=torch.bfloat16)
    K2 = torch.empty_like(Kc)
    parts = {
        "run (split + merge)": lambda: tree_attn.run(p, q, kc, vc, k_new=kn, v_new=vn, out=out),
        "split kernel": split_only,
        "merge kernel": merge_only,
        "cuBLAS Q.K^T [4 x 192 x 256] x [256 x L]": lambda: torch.bmm(Qc, Kc.transpose(1, 2), out=S),
        "cuBLAS P.V [4 x 192 x L] x [L x 256]": lambda: torch.bmm(S, Vc, out=O),
        "copy of K's bytes (read + write)": lambda: K2.copy_(Kc),
    }
    for name, f in parts.items():
        us = time_fns([f], DEV, reps=3 if ARGS.smoke else 30).median * 1e6
        print(f"breakdown {name}: {us:.1f} us", flush=True)
        ROWS.append(dict(case=f"breakdown-L{L}", part=name, us=round(us, 2)))
    for validate in (True, False):
        t0 = time.perf_counter()
        for _ in range(3 if ARGS.smoke else 20):
            tree_attn.plan(step["qo"], step["kvp"], step["kvi"], step["mask"], num_qo_heads=H, num_kv_heads=HKV,
                           head_dim=D, cache_slots=step["slots"], validate=validate)
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        us = (time.perf_counter() - t0) / (3 if ARGS.smoke else 20) * 1e6
        print(f"breakdown plan host time (validate={validate}): {us:.0f} us", flush=True)
        ROWS.append(dict(case=f"breakdown-L{L}", part=f"tree_attn.plan, validate={validate} (host)", us=round(us)))


def write(out: str):
    os.makedirs(out, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", versions=autotune.versions())
    with open(os.path.join(out, "tree_attn_explore.json"), "w") as f:
        json.dump(dict(meta=meta, rows=ROWS), f, indent=1)
    lines = [f"# tree_attn exploration ({meta['gpu']})", "", "| case | variant / part | config | items | split | "
             "µs | TB/s |", "|---|---|---|---:|---:|---:|---:|"]
    for r in ROWS:
        if "part" in r:
            lines.append(f"| {r['case']} | {r['part']} | | | | {r['us']} | |")
        elif "error" in r:
            lines.append(f"| {r['case']} | {r['variant']} | {r['config']} | | | failed: {r['error']} | |")
        else:
            lines.append(f"| {r['case']} | {r['variant']} | {r['config']} | {r['items']} | {r['split']} | "
                         f"{r['us']} | {r['tbs']} |")
    with open(os.path.join(out, "tree_attn_explore.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    if "sweep" in ARGS.parts:
        sweep()
    if "breakdown" in ARGS.parts:
        breakdown()
    if ARGS.out:
        write(ARGS.out)
