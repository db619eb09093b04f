#!/usr/bin/env python3
"""Where the warpgroup build of the flow kernel (FlowConfig(wg=True)) spends its time, on one GPU in one process.

    python3 perf/w12_wg_probe.py          # on the GPU machine; $OUT/w12-wg-probe.json when $OUT is set

For gdn.in_proj, mlp.gate_up_proj, attn.o_proj and mlp.down_proj of hybrid-27b at M = 8, 16 and 32: cuBLAS, the
flow kernel at the mma.sync heuristic's config, and warpgroup builds as shipped (two wgmma groups in flight) and with
`-depth1` (each unit's wgmma waited for before the next); with --ablate also with one part taken out for timing only
(wrong results): `-nosync` without the proxy fence and the barrier per unit, `-noxcopy` with x staged for the first
unit only. The full builds are checked against fp64 first. Timing as
perf/w12_ladder.py: CUDA-graph medians over rotated weight copies.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VARIANTS = {"": {}, "-depth1": {"W12F_WG_DEPTH": 1}}
ABLATIONS = {"-nosync": {"W12F_WG_FENCE": 0, "W12F_WG_BAR": 0}, "-noxcopy": {"W12F_WG_XCOPY": 0}}


def main() -> int:
    import w12
    from specpilot.bench.registry import rotations
    from specpilot.bench.shapes import get_shape_set
    from specpilot.bench.timing import time_cuda
    from specpilot.testing import assert_close
    from w12 import flow, layout
    from w12.configs import FlowConfig, flow_heuristic

    dev = torch.device("cuda")
    lin = get_shape_set("hybrid-27b").linears
    variants = VARIANTS | (ABLATIONS if "--ablate" in sys.argv else {})
    wgs = [FlowConfig(warps=16, kw=2, cps=1, wg=True), FlowConfig(warps=8, kw=2, cps=2, wg=True),
           FlowConfig(warps=16, kw=4, cps=1, wg=True), FlowConfig(warps=4, kw=1, cps=4, kc=2, wg=True),
           FlowConfig(warps=4, kw=1, cps=4, kc=4, wg=True), FlowConfig(warps=8, kw=2, cps=2, kc=4, wg=True)]
    rows = []
    for name in ("gdn.in_proj", "mlp.gate_up_proj", "attn.o_proj", "mlp.down_proj"):
        n, k = lin[name]
        g = torch.Generator(device=dev).manual_seed(n + k)
        sets = rotations(1.5 * n * k, dev)
        ws = [(torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(torch.bfloat16) for _ in range(sets)]
        ps = [w12.pack(w) for w in ws]
        ts = [layout.tile(p) for p in ps]
        for m in (8, 16, 32):
            xs = [torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16) for _ in range(sets)]
            outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(sets)]

            def add(label, fns):
                tm = time_cuda(fns, reps=40)
                rows.append(dict(layer=name, M=m, row=label, us=round(tm.median * 1e6, 2)))
                print(f"{name:18s} M={m:2d} {label:36s} {tm.median * 1e6:8.1f} µs", flush=True)

            add("cublas", [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, ws)])
            base = flow_heuristic(m, n, k, dev, wgmma=False)
            cfgs = [(base.tag(), base, {})] + [(c.tag() + v, c, d) for c in wgs for v, d in variants.items()]
            for label, cfg, defs in cfgs:
                try:
                    if not set(defs) - {"W12F_WG_DEPTH"}:
                        flow.launch_tiled(cfg, xs[0], ts[0], None, outs[0])
                        assert_close(outs[0], w12.matmul_reference(xs[0], ps[0]), F.linear(xs[0], ws[0]))
                    add(label, [lambda x=x, t=t, o=o, cfg=cfg, defs=defs: flow.launch_tiled(cfg, x, t, None, o, defines=defs)
                                for x, t, o in zip(xs, ts, outs)])
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(layer=name, M=m, row=label, status=str(e).splitlines()[0][:200]))
                    print(f"{name} M={m} {label}: {rows[-1]['status']}", flush=True)
                    torch.cuda.synchronize()
        del ws, ps, ts
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "w12-wg-probe.json").write_text(json.dumps(
            dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
