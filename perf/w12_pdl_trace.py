"""What programmatic dependent launch does to a chain of W12 TMA launches: per-CTA %globaltimer
stamps (W12_TRACE build) of every launch in a chain of L launches, with and without PDL, eager
and as a CUDA graph. Per launch: first CTA entry and last CTA end relative to the previous
launch's last end (negative = overlap), first-data latency, span; plus the chain's event time.
Session 3 and 5 measured PDL making the decode step slower; this shows where.

    python3 perf/w12_pdl_trace.py --out $OUT [--chain 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import w12  # noqa: E402
from w12 import cuda as wcuda  # noqa: E402
from w12.configs import TmaConfig  # noqa: E402
from w12_trace_probe import traced_builds  # noqa: E402

SHAPES = {"gdn.in_proj": (16480, 5120), "attn.o_proj": (5120, 6144)}
CFGS = {"gdn.in_proj": TmaConfig(1, 8, 6), "attn.o_proj": TmaConfig(1, 4, 8)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf/results/local")
    ap.add_argument("--chain", type=int, default=8)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with traced_builds():
        rows = run(a.chain)
    os.environ["SPECPILOT_PDL"] = "0"
    (out / "pdl_trace.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))
    return 0


def run(chain_len: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for name, (N, K) in SHAPES.items():
        cfg = CFGS[name]
        grid = -(-N // cfg.rows)
        ws = [(torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16) for _ in range(2)]
        ps = [w12.pack(w) for w in ws]
        xs = [torch.randn(1, K, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(chain_len)]
        os_ = [torch.empty(1, N, device="cuda", dtype=torch.bfloat16) for _ in range(chain_len)]
        trs = [torch.zeros(8 * grid, device="cuda", dtype=torch.int64) for _ in range(chain_len)]
        refs = [xs[i].float() @ ws[i % 2].float().T for i in range(chain_len)]

        def chain():
            for i in range(chain_len):
                p = ps[i % 2]
                wcuda.launch(cfg, xs[i], p.hi, p.lo, p.e0, p.esc_rowptr, p.esc_col, p.esc_val, None, os_[i],
                             trace=trs[i])

        for mode in ("eager", "graph"):
            for pdl in ("0", "1"):
                os.environ["SPECPILOT_PDL"] = pdl
                chain()
                torch.cuda.synchronize()
                g = None
                if mode == "graph":
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        chain()
                times = []
                for _ in range(5):
                    torch.cuda._sleep(200000)  # queue the chain behind ~100 us of work: no host gaps
                    ev[0].record()
                    g.replay() if g is not None else chain()
                    ev[1].record()
                    torch.cuda.synchronize()
                    times.append(ev[0].elapsed_time(ev[1]) * 1e3)
                bad = sum(int(((o.float() - r).abs().max() > 2e-2 * r.abs().max()).item()) for o, r in zip(os_, refs))
                t = torch.stack([tr.view(grid, 8) for tr in trs]).cpu()  # [chain, grid, 8]
                base = int(t[0, :, 0].min())
                per = []
                prev_end = None
                for i in range(chain_len):
                    entry, first, end = t[i, :, 0] - base, t[i, :, 2] - base, t[i, :, 5] - base
                    e0, e1, f50, end1 = int(entry.min()), int(entry.max()), int(first.median()), int(end.max())
                    per.append(dict(entry_min=e0 / 1e3, entry_max=e1 / 1e3, first_p50=f50 / 1e3, end_max=end1 / 1e3,
                                    gap_after_prev=None if prev_end is None else (e0 - prev_end) / 1e3,
                                    first_after_prev=None if prev_end is None else (f50 - prev_end) / 1e3))
                    prev_end = end1
                mid = per[1:]
                r = dict(shape=name, cfg=cfg.tag(), mode=mode, pdl=pdl == "1", bad_outputs=bad,
                         chain_us=round(statistics.median(times), 1),
                         per_launch_us=round(statistics.median(times) / chain_len, 2),
                         traced_span_us=round(per[-1]["end_max"], 1),
                         gap_after_prev_p50=round(statistics.median(p["gap_after_prev"] for p in mid), 2),
                         first_after_prev_p50=round(statistics.median(p["first_after_prev"] for p in mid), 2),
                         launch_span_p50=round(statistics.median(p["end_max"] - p["entry_min"] for p in per), 2),
                         per_launch=per)
                rows.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "per_launch"}), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
