"""Grid sweep of the W12 CUDA-core GEMV kernel's launch configs (`GemvConfig`, variant gemv) on the current GPU;
stores winners as tuned JSON.

    python3 perf/tune_w12.py [--shapes hybrid-27b] [--ms 1 2 4 8 16 32] [--budget-s 240]
                             [--out DIR] [--ops w12.matmul w12.matmul_q8]

The tensor-core kernel (`TcConfig`, variant tc) is tuned by `specpilot tune --op w12.matmul` (w12/space.py,
docs/autotune.md). This script stays until the GEMV kernel declares a search space of its own: it is the only
tuning path of `GemvConfig` and of the `gemv.mma` entries.

Every candidate is checked against the heuristic config's output (bitwise-identical is not
required: split-K changes the summation order) before it is timed. Timing: median of CUDA
graph replays over rotated weight copies (cold L2). Winners are written through
`autotune.store_tuned` into autotune/configs/<gpu>.json (or SPECPILOT_CONFIG_DIR) and a log
of every timing is written as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, not an installed copy

import torch  # noqa: E402

import autotune  # noqa: E402
import w12  # noqa: E402
from specpilot.bench.shapes import get_shape_set  # noqa: E402
from specpilot.bench.timing import time_fns  # noqa: E402
from w12 import configs as wc  # noqa: E402


def _subset(kind: str, M: int, N: int, K: int, limit: int) -> list:
    """A spread of candidates: the heuristic's neighbourhood first, then the rest, capped."""
    cands = wc.candidates(kind, M, N, K)
    dev = torch.device("cuda")
    h = wc.tc_heuristic(M, N, K, dev) if kind == "tc" else wc.gemv_heuristic(M, N, K, dev)

    def dist(c):
        return sum(getattr(c, f) != getattr(h, f) for f in ("block_n", "block_k", "split_k", "num_warps", "num_stages"))

    cands.sort(key=dist)
    return [h] + [c for c in cands if c != h][: limit - 1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="hybrid-27b")
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--ops", nargs="+", default=["w12.matmul", "w12.matmul_q8"])
    ap.add_argument("--variants", nargs="+", default=["gemv"], choices=["gemv"],
                    help="gemv only: the tc variant is tuned by `specpilot tune --op w12.matmul`")
    ap.add_argument("--limit", type=int, default=24, help="candidates per (op, variant, shape, M)")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "perf/out"))
    ap.add_argument("--no-store", action="store_true")
    a = ap.parse_args(argv)
    t_end = time.time() + a.budget_s
    shapes = get_shape_set(a.shapes)
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    log = []
    names = list(shapes.linears) + ["lm_head"]
    gen = torch.Generator(device=dev).manual_seed(0)
    for name in names:
        N, K = shapes.linears.get(name, shapes.lm_head)
        w = (torch.randn(N, K, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
        p0 = w12.pack(w)
        del w
        n_rot = int(min(8, max(1, math.ceil(3 * l2 / p0.nbytes))))
        packs = [p0] + [w12.pack((torch.randn(N, K, device=dev, generator=gen) * 0.02).to(torch.bfloat16))
                        for _ in range(n_rot - 1)]
        for M in a.ms:
            x = torch.randn(M, K, device=dev, generator=gen).to(torch.bfloat16)
            for op in a.ops:
                fn = w12.matmul if op == "w12.matmul" else w12.matmul_q8
                for variant in a.variants:
                    kind = "tc" if (variant == "tc" or M > wc.GEMV_MAX_M) else "gemv"
                    tv = variant if kind == "tc" or variant == "tc" else "gemv"
                    if variant == "gemv" and kind == "tc":
                        tv = "gemv.mma"
                    autotune.clear_plans()
                    with autotune.force(op, variant=variant):
                        ref = fn(x, p0).float()
                    best = None
                    for cfg in _subset(kind, M, N, K, a.limit):
                        if time.time() > t_end:
                            break
                        try:
                            with autotune.force(op, variant=variant, config=cfg):
                                out = fn(x, p0).float()
                                err = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                                if not err < 1e-2:
                                    raise AssertionError(f"wrong result, rel max err {err:.2e}")
                                t = time_fns([lambda p=p: fn(x, p) for p in packs], reps=30).median
                        except Exception as e:  # noqa: BLE001 - a config that fails to compile is skipped
                            log.append(dict(op=op, variant=variant, shape=name, M=M, cfg=str(cfg), error=str(e)[:200]))
                            continue
                        log.append(dict(op=op, variant=variant, shape=name, M=M, N=N, K=K, cfg=str(cfg), us=t * 1e6))
                        if best is None or t < best[0]:
                            best = (t, cfg)
                    if best is None:
                        continue
                    tb = p0.nbytes / best[0] / 1e12
                    print(f"{op:14s} {variant:5s} {name:18s} M={M:<3d} {best[0]*1e6:8.1f} us {tb:5.2f} TB/s  {best[1]}",
                          flush=True)
                    if not a.no_store:
                        autotune.store_tuned(op, tv, autotune.shape_key(M=M, N=N, K=K), best[1],
                                             extra={"us": round(best[0] * 1e6, 2), "tbs": round(tb, 3)})
            if time.time() > t_end:
                break
        del packs, p0
        torch.cuda.empty_cache()
        if time.time() > t_end:
            print("budget reached", flush=True)
            break
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tune_w12.json"), "w") as f:
        json.dump({"meta": {"gpu": autotune.gpu_name(), **autotune.versions()}, "rows": log}, f, indent=0)
    if not a.no_store:
        print("tuned file:", autotune.config.tuned_file())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
