"""Sweep the CUDA W12 kernel (w12/csrc/w12_mma.cu) against cuBLAS on one GPU, in one bounded run.

    python3 perf/w12_mma_explore.py --out $OUT [--budget-s 240]

For every hybrid-27b linear shape and the LM head, at M in {1, 2, 4, 8, 16, 32}: real packed
weights (Gaussian, so with escapes, plus a few hostile values), every config of the grid (MmaConfig,
and TmaConfig on sm_90; `--grid final` is the tuning grid) for
`matmul` and `matmul_q8`, each checked against the fp64 product before it is timed (a wrong one
is printed and skipped), and cuBLAS `F.linear` on the unpacked weight in the same process.
Timing: median of CUDA-graph replays over rotated weight copies (>= 3x L2). Also dumps the
SASS instruction histogram of one cubin (cuobjdump, when present). Writes <out>/w12_mma_explore.json;
with --emit, each cell's winner goes into autotune/configs/<gpu>.json (the shipped tuned CUDA configs).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import autotune  # noqa: E402
import w12  # noqa: E402
from w12 import cuda as wcuda  # noqa: E402
from w12.configs import MmaConfig, TmaConfig  # noqa: E402
from specpilot.bench.timing import time_fns  # noqa: E402
from specpilot.bench.registry import rotations  # noqa: E402
from specpilot.bench.shapes import get_shape_set  # noqa: E402

MS = (1, 2, 4, 8, 16, 32)
# The register-pipelined kernel: mt row tiles x wk warps along K x pipe depth. 8 warps along K suit N = 5120,
# mt=2/wk=4 large N; 16 warps along K change little (the register pipeline cannot keep enough bytes in flight:
# Little's law), hence the cp.async shared-memory ring (async_copy).
_REG = [MmaConfig(1, 8, 2), MmaConfig(2, 4, 2), MmaConfig(2, 4, 3), MmaConfig(2, 8, 2), MmaConfig(1, 16, 2),
        MmaConfig(4, 8, 2), MmaConfig(2, 4, 4)]
_ASYNC = [MmaConfig(mt, wk, p, wr, async_copy=True) for mt in (1, 2, 4) for wk, wr in
          ((4, 1), (8, 1), (16, 1), (4, 2), (2, 4), (8, 2)) for p in (3, 4, 6) if mt <= 2 * wk]
# The small-N layers have too few row blocks to balance 132 SMs: split K across CTAs.
_SPLIT = [MmaConfig(mt, wk, p, wr, async_copy=a, split=s) for mt, wk, p, wr, a in
          ((1, 8, 2, 1, False), (2, 4, 2, 1, False), (1, 4, 2, 1, False), (2, 4, 3, 1, False), (1, 4, 4, 1, True),
           (2, 4, 4, 1, True), (1, 8, 3, 1, True), (4, 8, 2, 1, False), (2, 8, 2, 1, False))
          for s in (2, 3, 4, 6, 8)]
_ASYNC_TOP = [c for c in _ASYNC if c.tag() in ("mt4-wk4-p3-wr2-a", "mt2-wk8-p4-a", "mt1-wk16-p3-a", "mt4-wk4-p3-a",
                                               "mt1-wk8-p3-a")]
GRID_MM = _REG + _ASYNC_TOP + _SPLIT
GRID_Q8 = _REG + _ASYNC_TOP + _SPLIT
# The TMA kernel (csrc/w12_tma.cu, sm_90) beside the best split register-pipelined configs.
_TMA_BASE = [(1, 4, 8), (2, 4, 4), (2, 4, 6), (2, 4, 8), (1, 8, 6), (2, 8, 4), (4, 4, 4), (1, 8, 10)]
GRID_TMA = [TmaConfig(mt, cw, st, s) for mt, cw, st in _TMA_BASE for s in (1, 2, 3, 4, 6, 8)] + \
    [MmaConfig(2, 4, 2), MmaConfig(1, 8, 2), MmaConfig(2, 4, 2, split=3), MmaConfig(2, 4, 2, split=4)]


# The tuning grid (--grid final --emit): the candidates of both kernels per cell. The wgmma TMA path
# (TmaConfig(wg=True)) is left out: it was slower than mma.sync on every cell it ran.
GRID_FINAL = [MmaConfig(2, 4, 2), MmaConfig(2, 4, 3), MmaConfig(1, 8, 2), MmaConfig(2, 8, 2), MmaConfig(2, 4, 4),
              MmaConfig(4, 8, 2)] + \
    [MmaConfig(2, 4, 2, split=s) for s in (2, 3, 4, 6)] + [MmaConfig(1, 8, 2, split=s) for s in (2, 3, 4)] + \
    [MmaConfig(2, 8, 2, split=s) for s in (3, 4)] + [MmaConfig(2, 4, 3, split=2)] + \
    [TmaConfig(mt, cw, st) for mt, cw, st in ((1, 8, 6), (1, 4, 8), (2, 8, 4), (1, 8, 10), (2, 4, 6), (2, 4, 4),
                                              (1, 16, 4))] + \
    [TmaConfig(mt, cw, st, s) for mt, cw, st in ((1, 8, 6), (1, 4, 8), (1, 16, 4)) for s in (2, 3, 4, 6)] + \
    [TmaConfig(mt, cw, st, s, ahead=True) for mt, cw, st in ((1, 8, 6), (1, 4, 8), (2, 4, 6)) for s in (1, 3, 6)] + \
    [TmaConfig(mt, cw, st, s, xcp=True) for mt, cw, st in ((1, 8, 6), (1, 4, 8), (2, 4, 6), (1, 16, 4))
     for s in (1, 2, 3, 6)]
# Stream-K: a persistent grid of sk CTAs per SM, equal shares of the row-block x chunk units.
GRID_FINAL += [TmaConfig(mt, cw, st, sk=k, xcp=x) for mt, cw, st in ((1, 8, 6), (1, 4, 8), (2, 4, 6), (1, 16, 4))
               for k in (1, 2) for x in (False, True)]
# Small CTAs (16-64 rows), several resident per SM: one CTA per SM ingests at most ~33 GB/s, an SM with two
# CTAs ~40 GB/s (per-CTA %globaltimer trace).
GRID_FINAL += [TmaConfig(mt, cw, st) for mt, cw in ((1, 1), (1, 2), (2, 1), (2, 2), (4, 1)) for st in (4, 8, 12)] + \
    [TmaConfig(mt, cw, st, xcp=True) for mt, cw in ((1, 2), (2, 2), (2, 1)) for st in (6, 10)]
# x as one 128-byte-swizzled 2-D TMA box per stage (TmaConfig(xbox=True)).
GRID_FINAL += [TmaConfig(mt, cw, st, s, xbox=True) for mt, cw, st in ((1, 8, 6), (1, 4, 8), (2, 4, 6), (1, 16, 4),
                                                                       (1, 2, 4)) for s in (1, 2, 3, 6)]


def useful(cfg, N: int, K: int) -> bool:
    """Skip splits that leave a CTA fewer than 6 chunks or make more than 8 CTAs per SM."""
    if cfg.split == 1:
        return True
    rows = cfg.rows if isinstance(cfg, TmaConfig) else 16 * cfg.mt * cfg.wr
    return K // 64 // cfg.split >= 6 and -(-N // rows) * cfg.split <= 8 * 132


def shapes() -> dict[str, tuple[int, int]]:
    s = get_shape_set("hybrid-27b")
    out = dict(s.linears)
    out["lm_head"] = s.lm_head
    return out


def weight(N: int, K: int, gen) -> torch.Tensor:
    w = (torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    flat = w.view(torch.int16).view(-1)
    idx = torch.randint(0, flat.numel(), (64,), device="cuda", generator=gen)
    flat[idx[:16]] = 0
    flat[idx[16:24]] = 1  # subnormal
    flat[idx[24:32]] = 0x4700  # out of window
    return w


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def launch_fn(cfg, x, p, out, q8):
    def f():
        wcuda.launch(cfg, x, p.hi, p.lo, p.e0, p.esc_rowptr, p.esc_col, p.esc_val, None, out, q8=q8)
    return f


def sass_histogram(path: Path) -> dict[str, int]:
    tool = shutil.which("cuobjdump")
    if tool is None:
        return {}
    txt = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True).stdout
    ops = collections.Counter()
    for line in txt.splitlines():
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?", line)
        if m:
            ops[m.group(1)] += 1
    return dict(ops.most_common())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf/results/local")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--grid", choices=("mma", "tma", "final"), default="final")
    ap.add_argument("--only", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--emit", action="store_true", help="store each cell's best config as a tuned entry "
                    "(autotune/configs/<gpu>.json, variant 'mma' or 'tma'; the other variant's entry is dropped)")
    a = ap.parse_args()
    t0 = time.time()
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    arch = torch.cuda.get_device_capability()
    global GRID_MM, GRID_Q8
    if a.grid in ("tma", "final"):
        GRID_MM = GRID_Q8 = dict(tma=GRID_TMA, final=GRID_FINAL)[a.grid]
    # build every cubin up front, in parallel
    jobs = [(c, nt, False) for c in GRID_MM for nt in (1, 2, 4)] + [(c, nt, True) for c in GRID_Q8 for nt in (1, 2, 4)]
    limit = torch.cuda.get_device_properties(dev).shared_memory_per_block_optin
    jobs = [j for j in jobs if wcuda.smem_bytes(*j) <= limit]
    fits = {(j[0], j[1], j[2]) for j in jobs}
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda j: wcuda.build(j[0], j[1], j[2], arch), jobs))
    print(f"built {len(jobs)} cubins in {time.time() - t0:.1f}s", flush=True)
    sass = sass_histogram(wcuda.build(MmaConfig(1, 4, 2), 1, False, arch))
    print("SASS mt1-wk4-p2 nt1 mm:", json.dumps(sass), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, bad = [], []
    stopped = False
    for name, (N, K) in shapes().items():
        if a.only and name not in a.only.split(","):
            continue
        w = weight(N, K, gen)
        p = w12.pack(w)
        wb = p.nbytes
        copies = rotations(wb, dev)
        ps = [p] + [w12.W12Weight(**{k: v.clone() for k, v in p.planes().items()}, K=K) for _ in range(copies - 1)]
        ws = [w] + [w.clone() for _ in range(rotations(w.nbytes, dev) - 1)]
        for M in MS:
            if time.time() - t0 > a.budget_s:
                stopped = True
                break
            x = torch.randn(M, K, device=dev, generator=gen).to(torch.bfloat16)
            ref = x.double() @ w.double().T
            refq = x.double() @ w12.decode_q8(p).double().T
            e_cublas = rel_err(F.linear(x, w), ref)
            e_cublas_q8 = rel_err(F.linear(x, w12.decode_q8(p)), refq)
            outs_b = [torch.empty(M, N, device=dev, dtype=torch.bfloat16) for _ in ws]
            t_cub = time_fns([lambda i=i: torch.mm(x, ws[i].T, out=outs_b[i]) for i in range(len(ws))], reps=a.reps).median
            row = dict(shape=name, N=N, K=K, M=M, cublas_us=t_cub * 1e6, cublas_err=e_cublas, cublas_err_q8=e_cublas_q8, w12_bytes=wb,
                       bf16_bytes=w.nbytes, mm={}, q8={})
            for q8, grid in ((False, GRID_MM), (True, GRID_Q8)):
                r, e_ok = (refq, e_cublas_q8) if q8 else (ref, e_cublas)
                for cfg in grid:
                    if (cfg, wcuda.n_tiles(M), q8) not in fits or not useful(cfg, N, K):
                        continue
                    o = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
                    try:
                        launch_fn(cfg, x, p, o, q8)()
                        torch.cuda.synchronize()
                    except Exception as e:  # a config that cannot launch here is reported, not fatal
                        bad.append(f"{name} M{M} {cfg.tag()} q8={q8}: {type(e).__name__}: {str(e)[:120]}")
                        continue
                    err = rel_err(o, r)
                    if not (err <= 2 * e_ok + 1e-6):  # same-precision F.linear on the same weights
                        bad.append(f"{name} M{M} {cfg.tag()} q8={q8}: rel err {err:.3g} (cuBLAS {e_ok:.3g})")
                        if len(bad) <= 10:
                            print("BAD", bad[-1], flush=True)
                        continue
                    outs = [torch.empty(M, N, device=dev, dtype=torch.bfloat16) for _ in ps]
                    t = time_fns([launch_fn(cfg, x, ps[i], outs[i], q8) for i in range(len(ps))], reps=a.reps).median
                    row["q8" if q8 else "mm"][cfg.tag()] = dict(us=t * 1e6, err=err)
            for k in ("mm", "q8"):
                best = min(row[k].items(), key=lambda kv: kv[1]["us"]) if row[k] else None
                row[f"best_{k}"] = best[0] if best else None
                row[f"speedup_{k}"] = (t_cub / (best[1]["us"] * 1e-6)) if best else None
                row[f"tbps_{k}"] = ((wb * (2 / 3 if k == "q8" else 1)) / (best[1]["us"] * 1e-6) / 1e12) if best else None
            rows.append(row)
            print(f"{name:18s} M{M:<3d} cuBLAS {t_cub * 1e6:7.1f}us {w.nbytes / t_cub / 1e12:4.2f}TB/s | "
                  f"mm {row['best_mm']} {row['speedup_mm'] or 0:.2f}x {row['tbps_mm'] or 0:.2f}TB/s | "
                  f"q8 {row['best_q8']} {row['speedup_q8'] or 0:.2f}x", flush=True)
        del ps, ws, p, w
        torch.cuda.empty_cache()
        if stopped:
            break
    if a.emit:
        # one entry per cell and op: the winner's kernel ("tma" or "mma"); the other kernel's stale entry goes
        for r in rows:
            key = autotune.shape_key(M=r["M"], N=r["N"], K=r["K"])
            for k, op in (("mm", "w12.matmul"), ("q8", "w12.matmul_q8")):
                if r[f"best_{k}"]:
                    cfg = next(c for c in (GRID_Q8 if k == "q8" else GRID_MM) if c.tag() == r[f"best_{k}"])
                    variant = "tma" if isinstance(cfg, TmaConfig) else "mma"
                    autotune.drop_tuned(op, "mma" if variant == "tma" else "tma", key)
                    path = autotune.store_tuned(op, variant, key, cfg, extra={
                        "us": round(r[k][cfg.tag()]["us"], 2), "cublas_us": round(r["cublas_us"], 2),
                        "src": "w12_mma_explore"})
        print(f"tuned entries stored in {path}")
    meta = dict(gpu=torch.cuda.get_device_name(), versions=autotune.versions(),
                wall_s=time.time() - t0, stopped_by_budget=stopped, bad=bad, sass_mt1_wk4_p2_nt1=sass)
    (out_dir / "w12_mma_explore.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    for k in ("mm", "q8"):
        sp = [r[f"speedup_{k}"] for r in rows if r[f"speedup_{k}"]]
        if sp:
            print(f"{k}: best-per-cell geomean {math.exp(sum(map(math.log, sp)) / len(sp)):.3f}x, min {min(sp):.3f}x "
                  f"over {len(sp)} cells")
        tags = collections.defaultdict(list)
        for r in rows:
            for tag, v in r[k].items():
                tags[tag].append(r["cublas_us"] / v["us"])
        full = {t: math.exp(sum(map(math.log, v)) / len(v)) for t, v in tags.items() if len(v) == len(rows)}
        top = sorted(full.items(), key=lambda kv: -kv[1])[:5]
        print(f"{k}: best single configs (geomean):", ", ".join(f"{t} {g:.3f}x" for t, g in top))
    print(f"bad: {len(bad)}; wall {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
