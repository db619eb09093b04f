"""A/B of CUDA W12 kernel sources, side by side in one process (same weights, same inputs).

    python3 perf/w12_ab.py --out $OUT

Sources: the committed w12/csrc/w12_mma.cu and the files under perf/ab/ (not tracked: earlier or
edited copies, e.g. `git show b25d610:w12/csrc/w12_mma.cu > perf/ab/w12_mma_s2.cu`; pass
`carry=["perf/ab"]` to the GPU machine). A copy that includes "w12_common.cuh" finds it through
-I w12/csrc. Each (source, config, shape, M) is checked against fp64 before it is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import w12  # noqa: E402
from w12 import cuda as wcuda  # noqa: E402
from w12.configs import MmaConfig  # noqa: E402
from specpilot.bench.runner import time_fns  # noqa: E402
from specpilot.bench.registry import rotations  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"current": ROOT / "w12/csrc/w12_mma.cu", **{p.stem: p for p in sorted((ROOT / "perf/ab").glob("*.cu"))}}
CFGS = [MmaConfig(2, 4, 2), MmaConfig(2, 4, 2, split=3), MmaConfig(1, 8, 2), MmaConfig(2, 4, 3)]
SHAPES = {"attn.o_proj": (5120, 6144), "gdn.in_proj": (16480, 5120), "mlp.gate_up_proj": (34816, 5120)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf/results/local")
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (N, K) in SHAPES.items():
        w = (torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        p = w12.pack(w)
        copies = rotations(p.nbytes, torch.device("cuda"))
        ps = [p] + [w12.W12Weight(**{k: v.clone() for k, v in p.planes().items()}, K=K) for _ in range(copies - 1)]
        for M in (1, 8, 32):
            x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
            ref = x.double() @ w.double().T
            line = f"{name:17s} M{M:<3d}"
            for cfg in CFGS:
                for src_name, src in SOURCES.items():
                    wcuda.SOURCE = src
                    wcuda._FUNCS.clear()
                    outs = [torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in ps]

                    def f(i, cfg=cfg):
                        q = ps[i]
                        wcuda.launch(cfg, x, q.hi, q.lo, q.e0, q.esc_rowptr, q.esc_col, q.esc_val, None, outs[i])
                    f(0)
                    torch.cuda.synchronize()
                    err = ((outs[0].double() - ref).norm() / ref.norm()).item()
                    us = float("nan")
                    if err < 1e-2:  # a wrong kernel is reported, not timed
                        us = time_fns([lambda i=i: f(i) for i in range(len(ps))], reps=20) * 1e6
                    rows.append(dict(shape=name, M=M, cfg=cfg.tag(), src=src_name, us=us, err=err))
                    line += f" | {cfg.tag()}:{src_name[:8]} {us:5.1f}"
            print(line, flush=True)
        del ps, p, w
        torch.cuda.empty_cache()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "w12_ab.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
