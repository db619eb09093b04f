"""Where a layer's time goes in the CUDA tree-verify kernel: 48 layers (B1, 32-node tree, hybrid-27b dims) in one
CUDA graph with CudaConfig(trace=True); thread 0 of every CTA stamps %globaltimer at its start, after
griddepcontrol.wait and at its end, and clock64 at each phase boundary. Prints per layer (median over layers):
when its CTAs start / pass the wait / end relative to the previous layer's last end, and the cycles of each phase.

    python3 perf/gdn_cuda_trace.py [--bv 64] [--nopdl] [--out DIR]
"""

import argparse
import json
import os
import random
import statistics as st
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import gdn  # noqa: E402
from autotune import force  # noqa: E402
from gdn import cuda as gcuda  # noqa: E402
from gdn.configs import CudaConfig  # noqa: E402
from specpilot.bench.cases.gdn import _inputs  # noqa: E402
from specpilot.testing import capture_graph  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--bv", type=int, default=64)
ap.add_argument("--pieces", type=int, default=3)
ap.add_argument("--nopdl", action="store_true")
ap.add_argument("--uo", type=int, default=4, help="CudaConfig.unroll_out")
ap.add_argument("--sw", action="store_true", help="CudaConfig.split_warps")
ap.add_argument("--uk", type=int, default=8, help="CudaConfig.unroll_ks")
ap.add_argument("--nodes", type=int, default=32)
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--out", default=None)
a = ap.parse_args()

L, H, HV, K, V = 48, 16, 48, 128, 128
rng = random.Random(4321)
trees = [[-1] + [rng.randrange(max(0, i - 5), i) for i in range(1, a.nodes)] for _ in range(a.batch)]
plan = gdn.build_tree_plan(trees, device="cuda")
T = plan.total_nodes
q, k, v, g, beta, pool = _inputs(L, T, H, HV, K, V, a.batch, "cuda", 7)
idx = torch.arange(a.batch, dtype=torch.int32, device="cuda")
o = torch.empty(L, T, HV, V, device="cuda", dtype=torch.bfloat16)
cfg = CudaConfig(BV=a.bv, pieces=a.pieces, pdl=not a.nopdl, unroll_out=a.uo, unroll_ks=a.uk, split_warps=a.sw,
                 trace=True)
ctas = (V // a.bv) * HV * a.batch
gcuda.TRACE.pool = torch.zeros(L * ctas, 10, dtype=torch.int64, device="cuda")


def run():
    gcuda.TRACE.pos = 0
    with force("gdn.tree_verify", config=cfg):
        for li in range(L):
            gdn.tree_verify(q[li], k[li], v[li], g[li], beta[li], pool[li], idx, plan, use_qk_l2norm=True,
                            variant="cuda", out=o[li])


graph = capture_graph(run)
for _ in range(5):
    graph.replay()
torch.cuda.synchronize()
start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
graph.replay()
stop.record()
torch.cuda.synchronize()
total_us = start.elapsed_time(stop) * 1e3
tr = gcuda.TRACE.pool.view(L, ctas, 10).cpu()
rows = []
for li in range(1, L):
    prev_end = int(tr[li - 1, :, 7].max())
    t = tr[li]
    rows.append(dict(
        start_first=(int(t[:, 0].min()) - prev_end) / 1e3, start_last=(int(t[:, 0].max()) - prev_end) / 1e3,
        wait_first=(int(t[:, 1].min()) - prev_end) / 1e3, wait_last=(int(t[:, 1].max()) - prev_end) / 1e3,
        end_first=(int(t[:, 7].min()) - prev_end) / 1e3, end_last=(int(t[:, 7].max()) - prev_end) / 1e3,
        **{f"cyc_{n}": st.median((t[:, s1] - t[:, s0]).tolist()) for n, s0, s1 in
           (("loads", 2, 3), ("norms_gram", 3, 4), ("build", 4, 5), ("solve_products", 5, 6), ("output", 6, 8))},
        cyc_output_ns=st.median(((t[:, 7] - t[:, 1]).tolist())),
    ))
med = {key: st.median(r[key] for r in rows) for key in rows[0]}
print(f"graph of {L} layers: {total_us:.1f} us ({total_us / L:.2f} us per layer); cfg {cfg}")
print("per layer, medians over layers (us from the previous layer's last CTA end):")
for key in ("start_first", "start_last", "wait_first", "wait_last", "end_first", "end_last"):
    print(f"  {key:<12} {med[key]:8.2f} us")
print("cycles per CTA phase (median over CTAs, then layers):")
for key in ("cyc_loads", "cyc_norms_gram", "cyc_build", "cyc_solve_products", "cyc_output"):
    print(f"  {key:<20} {med[key]:8.0f}")
print(f"  wait->end (ns)       {med['cyc_output_ns']:8.0f}")
if a.out:
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"gdn_cuda_trace-{cfg.tag()}{'-nopdl' if a.nopdl else ''}-b{a.batch}n{a.nodes}.json"), "w") as f:
        json.dump(dict(total_us=total_us, median=med, rows=rows, cfg=str(cfg)), f, indent=1)
