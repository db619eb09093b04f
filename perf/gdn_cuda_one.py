"""One layer of the CUDA tree-verify kernel at hybrid-27b dims (B1, 32-node draft tree), launched 10 times:
the target of `ncu --kernel-name gdn_tree_cuda_kernel` in perf/gdn_cuda_session.sh (NCU=1)."""

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import gdn  # noqa: E402
from autotune import force  # noqa: E402
from gdn.configs import CudaConfig  # noqa: E402
from specpilot.bench.cases.gdn import _inputs  # noqa: E402

rng = random.Random(4321)
trees = [[-1] + [rng.randrange(max(0, i - 5), i) for i in range(1, 32)]]
plan = gdn.build_tree_plan(trees, device="cuda")
q, k, v, g, beta, pool = (t[0] for t in _inputs(1, 32, 16, 48, 128, 128, 1, "cuda", 7))
idx = torch.zeros(1, dtype=torch.int32, device="cuda")
cfg = CudaConfig(BV=int(os.environ.get("BV", "32")), pdl=False)
with force("gdn.tree_verify", config=cfg):
    for _ in range(10):
        gdn.tree_verify(q, k, v, g, beta, pool, idx, plan, use_qk_l2norm=True, variant="cuda")
torch.cuda.synchronize()
print("ok")
