"""The "ws" tree-attention kernel's time by phase, beside the Triton `wgmma` kernel, on the benchmark's hybrid-27b
attention (24 query / 4 KV heads, D = 256, bf16, draft-like trees, slots in random order).

Per case and `WSConfig`: `run` (split + merge, the config forced through autotune.force, checked against `wgmma`'s
output) and the split kernel alone built three more ways (tree_attn_ws.cu's `TA_PHASE`): the producer alone (the
consumers release every stage as it lands), the copies alone (no barrier waits, no consumers) and, for one producer
warpgroup, the consumers alone (the producer arrives without copying); cluster-pair configs (`WSConfig.cluster`) have
no phase builds, only `run` and the split kernel alone. Medians of CUDA-graph replays.
GPU only (sm_90).

    python -m specpilot.bench.ws_phases [--out FILE.json] [--cases N32]
"""

from __future__ import annotations

import argparse
import json
import random

import torch

import autotune
import tree_attn
from specpilot.bench.cases import draft_tree
from specpilot.bench.cases.tree_attn import Problem, Spec
from specpilot.bench.timing import time_cuda
from tree_attn import cuda as tcuda
from tree_attn import ops
from tree_attn.configs import WSConfig

OP = "tree_attn.tree_attention"
ONE = [WSConfig(consumers=1, block_n=64, num_stages=3),
       WSConfig(consumers=1, block_n=64, num_stages=3, producers=2, consumer_regs=232),
       WSConfig(consumers=1, block_n=32, num_stages=6, producers=2, consumer_regs=232)]
# the heuristic's two-consumer config, its one-producer twin, and each of those as cluster pairs
TWO = [WSConfig(consumers=2, block_n=32, num_stages=4, pair_halves=False),
       WSConfig(consumers=2, block_n=32, num_stages=4, producers=2, producer_regs=40, pair_halves=False),
       WSConfig(consumers=2, block_n=32, num_stages=4, pair_halves=False, cluster=True),
       WSConfig(consumers=2, block_n=32, num_stages=4, producers=2, producer_regs=56, consumer_regs=200,
                pair_halves=False, cluster=True)]
PHASES = (("split", 0), ("producer alone", 1), ("copies alone", 3), ("consumers alone", 2))


def graph_us(fn) -> float:
    """Median µs of `fn` under CUDA-graph replays (specpilot.bench.timing)."""
    return round(time_cuda(fn, reps=15, warmup=2).median * 1e6, 2)


def tag(cfg: WSConfig) -> str:
    return (f"c{cfg.consumers}n{cfg.block_n}s{cfg.num_stages}p{cfg.producers}"
            f"{'' if cfg.pair_halves or cfg.consumers == 1 else '-one-split'}{'-cluster' if cfg.cluster else ''}")


def case(spec: Spec, cfgs: list[WSConfig], dev) -> dict:
    prob = Problem(spec, dev, 1, 11)
    q, k, v = prob.sets[0]
    meta = (prob.qo_indptr, prob.kv_indptr, prob.kv_indices, prob.tree_mask)
    kw = dict(num_qo_heads=spec.H, num_kv_heads=spec.Hkv, head_dim=spec.D, cache_slots=spec.slots,
              nodes_in_cache=True, dtype=torch.bfloat16)
    base = tree_attn.plan(*meta, variant="wgmma", **kw)
    ref = tree_attn.run(base, q, k, v).float()
    out = torch.empty_like(q)
    row = {"wgmma run": graph_us(lambda: tree_attn.run(base, q, k, v, out=out))}
    for cfg in cfgs:
        t = tag(cfg)
        with autotune.force(OP, variant="ws", config=cfg):
            p = tree_attn.plan(*meta, variant="ws", **kw)
        row[f"{t} max |ws - wgmma|"] = float((tree_attn.run(p, q, k, v).float() - ref).abs().max())
        row[f"{t} run"] = graph_us(lambda p=p: tree_attn.run(p, q, k, v, out=out))
        live = p.items[p.items[:, 0] >= 0].cpu()
        row[f"{t} longest item (keys)"] = int((live[:, 3] - live[:, 2]).max())
        args = (*ops.cache_args(q, k, v, None, None), False, p.qo_indptr, p.kv_indptr, p.kv_indices, p.tree_mask,
                p.items, p.po, p.plse, spec.D ** -0.5 * 1.4426950408889634)
        for label, phase in PHASES:
            if (phase == 2 and cfg.producers != 1) or (phase and cfg.cluster):  # (cluster pairs: no phase builds)
                continue
            defines = {"TA_PHASE": phase} if phase else {}
            row[f"{t} {label}"] = graph_us(lambda c=cfg, d=defines: tcuda.run(c, q, k, v, *args, defines=d))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the table as JSON here")
    ap.add_argument("--cases", default="", help="only the cases whose name contains this (e.g. N32)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    rng = random.Random(7)
    cases = {
        "B1-N32-L32k": (Spec([draft_tree(32, rng)], [32768], 24, 4, 256), TWO),
        "B1-N8-L32k": (Spec([draft_tree(8, rng)], [32768], 24, 4, 256), ONE),
        "B1-N32-L1k": (Spec([draft_tree(32, rng)], [1024], 24, 4, 256), TWO),
        "B1-N32-L4k": (Spec([draft_tree(32, rng)], [4096], 24, 4, 256), TWO),
        "B1-N32-L16k": (Spec([draft_tree(32, rng)], [16384], 24, 4, 256), TWO),
        "B1-N32-L128k": (Spec([draft_tree(32, rng)], [131072], 24, 4, 256), TWO),
        "B24-N8-L1k-32k": (Spec([draft_tree(8, rng) for _ in range(24)], [rng.randint(1024, 32768) for _ in range(24)],
                                 24, 4, 256), ONE),
    }
    res = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "cases": {}}
    for name, (spec, cfgs) in cases.items():
        if a.cases not in name:
            continue
        try:
            row = case(spec, cfgs, dev)
        except Exception as e:  # the table keeps the other cases; the error names what failed
            row = {"error": f"{type(e).__name__}: {e}"}
        res["cases"][name] = row
        print(name, json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
