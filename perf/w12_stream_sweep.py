"""The stream kernel (w12/csrc/w12_stream.cu) beside cuBLAS and today's default W12 kernel, per layer and M,
and the 64-layer decode step, in one run (GPU). Every timed config is first checked against fp64.

    python3 perf/w12_stream_sweep.py --out DIR [--ms 1 4 8 16 32] [--layers NAME ...] [--cands W,S,C[,t][,x] ...]
                                         [--no-step]
(a candidate W,S,C is StreamConfig(warps=W, stages=S, cps=C); ",t" tiled planes, ",x" the exact-base build)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

import autotune
import w12
from specpilot.bench.registry import rotations
from specpilot.bench.shapes import get_shape_set
from specpilot.bench.timing import time_fns
from specpilot.testing import assert_close
from w12 import cuda as wcuda
from w12.configs import StreamConfig

CANDIDATES = [StreamConfig(8, 4, 2), StreamConfig(8, 3, 2), StreamConfig(8, 6, 1), StreamConfig(16, 3, 1),
              StreamConfig(16, 4, 1), StreamConfig(4, 4, 4), StreamConfig(4, 6, 3), StreamConfig(8, 4, 2, fixed=False)]


def _bits(p) -> float:
    return 8.0 * p.nbytes / (p.N * p.K)


def _prebuild(cfgs, arch):
    jobs = [(c, nt, q8) for c in cfgs for nt in (1, 2, 4) for q8 in (False, True)]
    t0 = time.time()
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda j: wcuda.build(j[0], j[1], j[2], arch), jobs))
    print(f"built {len(jobs)} cubins in {time.time() - t0:.0f} s", flush=True)


def _time(fns, dev) -> float:
    return time_fns(fns, dev, reps=30).median


def _cand(spec: str) -> StreamConfig:
    f = spec.split(",")
    ks = [int(v[1:]) for v in f[3:] if v.startswith("k")]
    return StreamConfig(int(f[0]), int(f[1]), int(f[2]), fixed="x" not in f[3:], tiled=2 if "t2" in f[3:] else int("t" in f[3:]),
                        split=ks[0] if ks else 0)


def sweep(ms, dev, rows: list, names=None) -> None:
    shapes = get_shape_set("hybrid-27b")
    layers = dict(shapes.linears)
    layers["lm_head"] = shapes.lm_head
    if names:
        layers = {k: v for k, v in layers.items() if k in names}
    seen = set()
    for name, (n, k) in layers.items():
        if (n, k) in seen:
            continue
        seen.add((n, k))
        sets = rotations(2.0 * n * k, dev)
        g = torch.Generator(device=dev).manual_seed(n + k)
        ws = [(torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(torch.bfloat16) for _ in range(sets)]
        ps = [w12.pack(w) for w in ws]
        for m in ms:
            xs = [torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16) for _ in range(sets)]
            ref64 = (xs[0].double() @ ws[0].double().T)
            base = F.linear(xs[0], ws[0])
            row = {"layer": name, "N": n, "K": k, "M": m, "bits": _bits(ps[0])}
            row["cublas_us"] = _time([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, ws)], dev) * 1e6
            row["default_us"] = _time([lambda x=x, p=p: w12.matmul(x, p) for x, p in zip(xs, ps)], dev) * 1e6
            assert_close(w12.matmul(xs[0], ps[0]), ref64, base, msg=f"default {name} M{m}")
            best = None
            for cfg in CANDIDATES:
                try:
                    with autotune.force("w12.matmul", config=cfg):
                        assert_close(w12.matmul(xs[0], ps[0]), ref64, base, msg=f"{cfg.tag()} {name} M{m}")
                        t = _time([lambda x=x, p=p: w12.matmul(x, p) for x, p in zip(xs, ps)], dev) * 1e6
                except Exception as e:  # noqa: BLE001 - a config that cannot run here is reported, not fatal
                    print(f"  {cfg.tag()} {name} M{m}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                row[cfg.tag()] = t
                if cfg.fixed and (best is None or t < best[1]):
                    best = (cfg, t)
            if best is not None:
                row["best"] = best[0].tag()
                row["best_us"] = best[1]
                # the 8-bit view: today's default and the best stream config
                if m <= 8:
                    wq = w12.decode_q8(ps[0])
                    refq = xs[0].double() @ wq.double().T
                    baseq = F.linear(xs[0], wq)
                    row["q8_default_us"] = _time([lambda x=x, p=p: w12.matmul_q8(x, p) for x, p in zip(xs, ps)], dev) * 1e6
                    with autotune.force("w12.matmul_q8", config=best[0]):
                        assert_close(w12.matmul_q8(xs[0], ps[0]), refq, baseq, msg=f"q8 {name} M{m}")
                        row["q8_stream_us"] = _time([lambda x=x, p=p: w12.matmul_q8(x, p) for x, p in zip(xs, ps)],
                                                    dev) * 1e6
            gb = (ps[0].nbytes) / 1e9
            print(f"{name:18s} M{m:<2d} cublas {row['cublas_us']:7.1f}  default {row['default_us']:7.1f} "
                  f"({row['cublas_us'] / row['default_us']:.2f}x)  stream {row.get('best_us', math.nan):7.1f} "
                  f"({row['cublas_us'] / row.get('best_us', math.nan):.2f}x, {gb / row.get('best_us', math.nan) * 1e3:.2f} TB/s) "
                  f"{row.get('best', '-')}  q8 {row.get('q8_default_us', math.nan):.1f} -> {row.get('q8_stream_us', math.nan):.1f}",
                  flush=True)
            rows.append(row)
        del ws, ps
        torch.cuda.empty_cache()


def trace(dev, names, cands, out: list) -> None:
    """Per-CTA %globaltimer phases of one warm launch (a W12_TRACE build): entry skew, prologue, first data,
    the unit loop, the fix-up tail and the kernel's span, at M = 1."""
    shapes = get_shape_set("hybrid-27b")
    layers = {k: v for k, v in dict(shapes.linears).items() if k in names}
    for name, (n, k) in layers.items():
        g = torch.Generator(device=dev).manual_seed(n + k)
        w = (torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(torch.bfloat16)
        p = w12.pack(w)
        x = torch.randn(1, k, device=dev, generator=g).to(torch.bfloat16)
        outb = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        for cfg in cands:
            grid = wcuda.stream_grid(cfg, n, p.Kp, dev)
            tr = torch.zeros(8 * grid, dtype=torch.int64, device=dev)
            args = (x, p.hi, p.lo, p.e0, p.esc_rowptr, p.esc_col, p.esc_val, None, outb)
            for _ in range(3):
                wcuda.launch(cfg, *args, trace=tr, defines={"W12_TRACE": 1})
            torch.cuda.synchronize()
            t = tr.view(grid, 8).cpu().double()
            e0 = t[:, 0].min()
            ph = {"span_us": float((t[:, 5].max() - e0) / 1e3), "entry_skew_us": float((t[:, 0].max() - e0) / 1e3)}
            for nm, (a, b) in {"prologue": (0, 2), "first_data": (2, 3), "loop": (3, 4), "tail": (4, 5)}.items():
                d = (t[:, b] - t[:, a]) / 1e3
                ph[nm + "_med_us"], ph[nm + "_max_us"] = float(d.median()), float(d.max())
            ph["exit_spread_us"] = float((t[:, 5].max() - t[:, 5].min()) / 1e3)
            ph.update(layer=name, cfg=cfg.tag(), ctas=grid)
            print("trace " + "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in ph.items()),
                  flush=True)
            out.append(ph)


def step(dev, cfgs, out: dict) -> None:
    """The 64-layer decode step (M = 1, every linear of hybrid-27b), one CUDA graph per variant."""
    shapes = get_shape_set("hybrid-27b")
    g = torch.Generator(device=dev).manual_seed(1)
    layers = []
    for name, (n, k) in shapes.linears.items():
        for _ in range(shapes.linear_counts.get(name, shapes.layers)):
            w = (torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(torch.bfloat16)
            layers.append((w, w12.pack(w), torch.randn(1, k, device=dev, generator=g).to(torch.bfloat16)))
    print(f"step: {len(layers)} linears packed", flush=True)
    out["cublas_ms"] = time_fns([lambda: [F.linear(x, w) for w, _, x in layers]], dev, reps=20).median * 1e3
    out["default_ms"] = time_fns([lambda: [w12.matmul(x, p) for _, p, x in layers]], dev, reps=20).median * 1e3
    for cfg in cfgs:
        with autotune.force("w12.matmul", config=cfg):
            out[cfg.tag() + "_ms"] = time_fns([lambda: [w12.matmul(x, p) for _, p, x in layers]], dev, reps=20).median * 1e3
    print("step: " + "  ".join(f"{k} {v:.3f}" for k, v in out.items()), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--no-step", action="store_true")
    ap.add_argument("--layers", nargs="*")
    ap.add_argument("--cands", nargs="*")
    ap.add_argument("--trace", action="store_true", help="only the per-CTA phase trace of --cands on --layers")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    if a.cands:
        CANDIDATES[:] = [_cand(c) for c in a.cands]
    if not a.trace:
        _prebuild(CANDIDATES, torch.cuda.get_device_capability())
    rows: list = []
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "step": {}, "trace": []}
    if a.trace:
        trace(dev, a.layers or ["gdn.in_proj"], CANDIDATES, res["trace"])
        with open(f"{a.out}/w12_stream_trace.json", "w") as f:
            json.dump(res, f, indent=1)
        return 0
    try:
        sweep(a.ms, dev, rows, a.layers)
        if not a.no_step:
            step(dev, [c for c in CANDIDATES[:3]], res["step"])
    finally:
        with open(f"{a.out}/w12_stream_sweep.json", "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
