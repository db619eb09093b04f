"""Where a one-wave W12 TMA launch spends its time: per-CTA %globaltimer stamps (W12_TRACE=1 build).

Per CTA: entry, first stage in (consumer warp 0 has its fragments of chunk 0), last stage in, main
loop done, epilogue done, producer's last copy issued. Summarised per (shape, config) over the CTAs
of one warm launch, relative to the earliest entry: launch skew (last entry), first-data latency,
streaming time and per-CTA rate, epilogue, and the span, beside the event-timed launch (the plain
streaming read of the same bytes is in perf/w12_tma_probe.py). Session 5's question: why a one-wave
layer pays ~6-9 us more than its bytes at the LM head's 4.2 TB/s.

    python3 perf/w12_trace_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import w12  # noqa: E402
from w12 import cuda as wcuda  # noqa: E402
from w12.configs import TmaConfig  # noqa: E402

SHAPES = {"attn.o_proj": (5120, 6144), "gdn.in_proj": (16480, 5120), "mlp.gate_up_proj": (34816, 5120),
          "mlp.down_proj": (5120, 17408)}
CFGS = [TmaConfig(1, 8, 6), TmaConfig(1, 4, 8), TmaConfig(1, 8, 10)]


@contextlib.contextmanager
def traced_builds():
    """Inside: every W12 cubin is built with -DW12_TRACE=1 (and loaded afresh); restored on exit."""
    flags = wcuda._flags
    wcuda._flags = lambda c, nt, q8, arch: flags(c, nt, q8, arch) + ["-DW12_TRACE=1"]
    wcuda._FUNCS.clear()
    try:
        yield
    finally:
        wcuda._flags = flags
        wcuda._FUNCS.clear()


def q(v, f):
    v = sorted(v)
    return v[min(len(v) - 1, int(f * len(v)))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf/results/local")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with traced_builds():
        rows = run()
    (out / "trace_probe.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))
    return 0


def run() -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for name, (N, K) in SHAPES.items():
        w = (torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        p = w12.pack(w)
        x = torch.randn(1, K, device="cuda", generator=gen).to(torch.bfloat16)
        o = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w.float().T
        for cfg in CFGS:
            grid = -(-N // cfg.rows)
            tr = torch.zeros(8 * grid, device="cuda", dtype=torch.int64)
            times = []
            for it in range(12):
                torch.cuda._sleep(20000)  # the GPU busy: the launch is queued, as in a decode step
                ev[0].record()
                wcuda.launch(cfg, x, p.hi, p.lo, p.e0, p.esc_rowptr, p.esc_col, p.esc_val, None, o, trace=tr)
                ev[1].record()
                torch.cuda.synchronize()
                times.append(ev[0].elapsed_time(ev[1]) * 1e3)
            err = float(((o.float() - ref).abs().max() / ref.abs().max()))
            t = tr.view(grid, 8).cpu()
            t0 = int(t[:, 0].min())
            rel = lambda k: [(int(v) - t0) / 1e3 for v in t[:, k]]  # noqa: E731
            entry, first, last, loop, epi, issued = rel(0), rel(2), rel(3), rel(4), rel(5), rel(6)
            stream = [b - a_ for a_, b in zip(first, last)]
            per_cta = p.hi.numel() * 1.5 / grid
            r = dict(shape=name, cfg=cfg.tag(), grid=grid, sms=len(set(t[:, 1].tolist())), err=err,
                     event_us=round(statistics.median(times), 2), span_us=round(max(epi), 2),
                     entry_p50=round(q(entry, .5), 2), entry_max=round(max(entry), 2),
                     first_p50=round(q(first, .5), 2), first_max=round(max(first), 2),
                     last_p10=round(q(last, .1), 2), last_p50=round(q(last, .5), 2), last_max=round(max(last), 2),
                     stream_p50_us=round(q(stream, .5), 2), stream_gbs_per_cta=round(per_cta / q(stream, .5) / 1e3, 1),
                     loop_max=round(max(loop), 2), epi_p50=round(q([e - lp for e, lp in zip(epi, loop)], .5), 2),
                     epi_max=round(max(epi), 2), issued_p50=round(q(issued, .5), 2))
            rows.append(r)
            print(json.dumps(r), flush=True)
        del w, p
    return rows


if __name__ == "__main__":
    sys.exit(main())
