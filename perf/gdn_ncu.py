"""One layer of the default B1-N32 tree_verify launched a few times, for Nsight Compute:

    ncu --clock-control none --kernel-name regex:gdn_tree_wy --launch-skip 2 --launch-count 1 \
        --set full --import-source yes --export $OUT/wy_b1 python3 perf/gdn_ncu.py

(the per-instruction stall samples then come out of `ncu --import ... --page source --csv`).
"""

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import gdn  # noqa: E402
from specpilot.bench.cases.gdn import _inputs, _tree  # noqa: E402
from specpilot.bench.shapes import get_shape_set  # noqa: E402


def main():
    trees = [_tree(32, random.Random(int(os.environ.get("SEED", "4321"))))]
    plan = gdn.build_tree_plan(trees, device="cuda")
    S = get_shape_set("hybrid-27b")
    q, k, v, g, beta, pool = _inputs(1, 32, S.gdn_k_heads, S.gdn_v_heads, S.gdn_head_dim, S.gdn_head_dim, 1, "cuda", 7)
    idx = torch.zeros(1, dtype=torch.int32, device="cuda")
    for _ in range(4):
        gdn.tree_verify(q[0], k[0], v[0], g[0], beta[0], pool[0], idx, plan, use_qk_l2norm=True)
    torch.cuda.synchronize()
    print("ok")


if __name__ == "__main__":
    main()
