"""Where the time of one tree_attn call goes, on one GPU.

    python3 perf/tree_attn_explore.py --out $OUT       # H200, hybrid-27b attention dims, ~1 min
    python3 perf/tree_attn_explore.py --smoke          # CPU, interpreter, tiny dims (no timing value)

`breakdown` (one 32-node tree over 32k keys): the whole run, the split kernel alone, the merge alone, the
same two products on cuBLAS (K/V contiguous, no softmax, S written), and a copy of K's bytes, plus the
plan's host time. The split kernel's configs (`SplitConfig`) are searched by `specpilot tune --op
tree_attn.tree_attention` (tree_attn/space.py, docs/autotune.md). Writes tree_attn_explore.md (and .json)
to --out.
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
    return ap.parse_args()


ARGS = parse()
if ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import autotune  # noqa: E402
import tree_attn  # noqa: E402
from specpilot.bench.timing import time_fns  # noqa: E402
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


def plan_of(step, cfg=None, variant=None):
    autotune.clear_plans()
    with autotune.force(OP, variant=variant or ("wgmma" if not ARGS.smoke else "mma"), config=cfg):
        return tree_attn.plan(step["qo"], step["kvp"], step["kvi"], step["mask"], num_qo_heads=H, num_kv_heads=HKV,
                              head_dim=D, cache_slots=step["slots"])


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
    breakdown()
    if ARGS.out:
        write(ARGS.out)
