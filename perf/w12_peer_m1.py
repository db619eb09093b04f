"""The W12 benchmark's M = 1 groups only (every hybrid-27b linear and the LM head): cuBLAS, the default W12
kernel, its 8-bit view and the lossless peer NWC (when its wheel is installed), through specpilot.bench's runner
(checks against fp64, rotated CUDA-graph timing). A short run for the peer row; the full table is
`specpilot bench --ops linear w12`.

    python3 perf/w12_peer_m1.py --out DIR
"""

from __future__ import annotations

import argparse
import sys

import torch

from specpilot.bench import runner
from specpilot.bench.cases import w12 as w12_cases
from specpilot.bench.shapes import get_shape_set

VARIANTS = ("cublas", "w12.mma", "w12.q8", "nwc")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    cases = [c for c in w12_cases.cases(get_shape_set("hybrid-27b"), dev)
             if c.group.endswith("-M1") and c.variant in VARIANTS]
    runner.run(cases, dev, out_dir=a.out, reps=a.reps, shapes="hybrid-27b", tag="linear-w12-m1-peer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
