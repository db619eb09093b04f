"""Which W12 kernel design / launch config wins on this GPU? One bounded run, compact output.

    python3 perf/w12_explore.py --out $OUT [--budget-s 150]      # on the GPU (<= ~3 min)
    python3 perf/w12_explore.py --smoke                           # CPU, interpreter, tiny: no Python errors

For representative hybrid-27b projections x M in {1,2,4,8,16,32} it times cuBLAS `F.linear`
(bf16) against w12 `matmul` and `matmul_q8` under several tile shapes of the tensor-core kernel
("T", wgmma on sm_90) and the CUDA-core GEMV ("G", the no-wgmma small-M path), each at a few
split-K values, plus the current heuristic ("H"). Each candidate is first checked against cuBLAS
on the unpacked weight (wrong ones are skipped and printed). Timing: median of CUDA-graph replays
over rotated weight copies (>= 3x L2, cold weights). The compiled kernels' n_regs / n_spills /
shared memory are printed once per tile shape.

Weights are synthetic W12 planes (random codes, no escapes): the escape epilogue is not timed.
Writes <out>/w12_explore.json; prints one line per (shape, M, op) with the best T and G and their
speedup vs cuBLAS, then a geomean-by-config summary (the default heuristic should follow it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import autotune  # noqa: E402
import w12  # noqa: E402
from w12 import configs as wc  # noqa: E402
from w12 import ops as wops  # noqa: E402
from w12.format import W12Weight  # noqa: E402
from specpilot.bench.runner import time_fns  # noqa: E402

SHAPES = {  # name: (N, K)
    "down_proj": (5120, 17408),
    "gate_up": (34816, 5120),
    "gdn.in_proj": (16480, 5120),
    "o_proj": (5120, 6144),
    "lm_head": (248320, 5120),
}
GEMV_MAX_M_TRY = 8


def _tag(cfg) -> str:
    """T/G + BNxBK + warps + stages, then the design switches: A = packed PTX decode, D = 2-D
    per-token GEMV accumulators (round 2), F = one joined [BN, BK] operand and one tl.dot per K
    iteration (round 3; earlier tags have none)."""
    k = "T" if isinstance(cfg, wc.TcConfig) else "G"
    sw = ("A" if cfg.asm else "") + ("D" if getattr(cfg, "tok2d", False) else "") + \
        ("F" if getattr(cfg, "fuse", False) else "")
    return f"{k}{cfg.block_n}x{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}{sw}"


_TAG_RE = re.compile(r"^([TG])(\d+)x(\d+)w(\d+)s(\d+)(A?)(D?)(F?)k(\d+)$")


def parse_tag(tag: str, block_t: int):
    """Inverse of _tag_full (plus the row's block_t): the config a row was timed with."""
    m = _TAG_RE.match(tag)
    if not m:
        raise ValueError(f"not an explore config tag: {tag!r}")
    kind, bn, bk, w, st, a, d, f, sp = m.groups()
    common = dict(block_n=int(bn), block_t=int(block_t), block_k=int(bk), split_k=int(sp), num_warps=int(w),
                  num_stages=int(st), asm=bool(a))
    if kind == "T":
        return wc.TcConfig(**common, fuse=bool(f))
    return wc.GemvConfig(**common, tok2d=bool(d))


def _tag_full(cfg) -> str:
    return f"{_tag(cfg)}k{cfg.split_k}"


def synthetic(N: int, K: int, dev, gen) -> W12Weight:
    """Random W12 planes: sign, exponent offset 1..8 (never code 0), random mantissa; e0 = 112."""
    Kp = -(-K // 64) * 64
    s = torch.randint(0, 2, (N, Kp), device=dev, generator=gen, dtype=torch.uint8)
    off = torch.randint(1, 9, (N, Kp), device=dev, generator=gen, dtype=torch.uint8)
    m = torch.randint(0, 8, (N, Kp), device=dev, generator=gen, dtype=torch.uint8)
    hi = (s << 7) | (off << 3) | m
    del s, off, m
    if Kp > K:
        hi[:, K:] = 0
    lo = torch.randint(0, 256, (N, Kp // 2), device=dev, generator=gen, dtype=torch.uint8)
    if Kp > K:  # padding columns must carry code 0
        loi = lo.view(N, Kp // 64, 32).clone()
        cols = torch.arange(Kp, device=dev).view(Kp // 64, 64)
        pad = cols >= K
        loi &= torch.where(pad[:, :32], 0xF0, 0xFF).to(torch.uint8)
        loi &= torch.where(pad[:, 32:], 0x0F, 0xFF).to(torch.uint8)
        lo = loi.view(N, Kp // 2)
    e0 = torch.full((N,), 112, device=dev, dtype=torch.uint8)
    rowptr = torch.zeros(N + 1, device=dev, dtype=torch.int32)
    col = torch.zeros(0, device=dev, dtype=torch.int32)
    val = torch.zeros(0, device=dev, dtype=torch.int16)
    return W12Weight(hi.contiguous(), lo.contiguous(), e0, rowptr, col, val, K)


def _time(fns, reps: int) -> float:
    """Median seconds per call over the rotated fns: the benchmark runner's timing (CUDA-graph
    replays on the GPU; one pass of perf_counter on the CPU)."""
    return time_fns(fns, reps=reps if torch.cuda.is_available() else 1, warmup=1)


def _run(x, p, cfg, op):
    """One forced launch through the real launcher; returns (out, compiled-kernel handle)."""
    out = torch.empty((x.shape[0], p.N), device=x.device, dtype=x.dtype)
    with autotune.force(op, config=cfg):
        ck = wops._launch(x, p.hi, p.lo, p.e0, p.esc_rowptr, p.esc_col, p.esc_val, None, out, op=op, variant="tc")
    return out, ck


def _splits(cfg, M: int, N: int, K: int, sms: int) -> list[int]:
    """Split-K values to time for a tile shape: 1, the wave model's pick at 2 and 8 CTAs/SM."""
    n_it = -(-(-(-K // 64) * 64) // cfg.block_k)
    tiles = -(-N // cfg.block_n) * -(-M // cfg.block_t)
    out = {1}
    for per_sm in (2, 8):
        out.add(wc.pick_split_k(tiles, n_it, sms * per_sm))
    return sorted(s for s in out if s == 1 or n_it // s >= 2)


def _candidates(opn: str, M: int, N: int, K: int, dev, sms: int, smoke: bool) -> list:
    """[(source, config)]: the heuristic ("H") and explored tile shapes x split-K ("X")."""
    q8 = opn == "q8"
    cands = [("H", wc.tc_heuristic(M, N, K, dev, q8=q8))]
    if M <= wc.GEMV_MAX_M:
        cands.append(("H", wc.gemv_heuristic(M, N, K, dev, q8=q8)))
    for kind in ["tc"] + (["gemv"] if M <= GEMV_MAX_M_TRY else []):
        tiles = wc.explore_candidates(kind, M)
        for c in tiles[:1] if smoke else tiles:
            for sp in _splits(c, M, N, K, sms):
                cands.append(("X", c.__class__(**{**c.__dict__, "split_k": sp})))
    # round 2's designs (A = packed PTX decode, D = per-token 2-D GEMV): now the baseline ("X")
    for c in _r2_designs(M)[::3] if smoke else _r2_designs(M):  # smoke: a T and a G design
        for sp in _splits(c, M, N, K, sms):
            cands.append(("X", c.__class__(**{**c.__dict__, "split_k": sp})))
    # round 3: F = one joined [BN, BK] operand, one tl.dot per K iteration ("N", compared with all above)
    for c in _new_designs(M)[:1] if smoke else _new_designs(M):
        for sp in _splits(c, M, N, K, sms):
            cands.append(("N", c.__class__(**{**c.__dict__, "split_k": sp})))
    return cands


def _new_designs(M: int) -> list:
    """Round 3: the fused-operand tensor-core kernel on round 2's best tiles (64x128/s4, 64x256/s3),
    with and without the PTX decode, plus deeper pipelines for the winner's tile."""
    bt = min(64, max(16, wc._pow2(M)))
    return [wc.TcConfig(64, bt, 128, 1, 4, 4, asm=True, fuse=True), wc.TcConfig(64, bt, 256, 1, 4, 3, asm=True, fuse=True),
            wc.TcConfig(64, bt, 128, 1, 4, 4, fuse=True), wc.TcConfig(64, bt, 128, 1, 4, 6, asm=True, fuse=True),
            wc.TcConfig(128, bt, 128, 1, 8, 4, asm=True, fuse=True)]


def _r2_designs(M: int) -> list:
    bt_tc = min(64, max(16, wc._pow2(M)))
    out = [wc.TcConfig(64, bt_tc, 128, 1, 4, 4, asm=True), wc.TcConfig(64, bt_tc, 256, 1, 4, 3, asm=True)]
    if M <= GEMV_MAX_M_TRY:
        bt = min(16, wc._pow2(M))
        for bn, bk in ((8, 256), (16, 256), (16, 128)):
            if bn * bk // 2 * bt // 128 > 64:
                continue
            out.append(wc.GemvConfig(bn, bt, bk, 1, 4, 2, asm=True))
            if bt <= 4:
                out.append(wc.GemvConfig(bn, bt, bk, 1, 4, 2, tok2d=True))
                out.append(wc.GemvConfig(bn, bt, bk, 1, 4, 2, asm=True, tok2d=True))
    return out


def _warm_one(job) -> str:
    """Worker: compile one (config, op) on a small shape with the same specialisations as the real
    ones (N, K multiples of 16), so the main process finds it in Triton's on-disk cache."""
    cfg, op, M = job
    try:
        dev = torch.device("cuda")
        gen = torch.Generator(device=dev).manual_seed(0)
        p = synthetic(256, 8192, dev, gen)
        x = torch.randn(M, 8192, device=dev, generator=gen).to(torch.bfloat16)
        _run(x, p, cfg, op)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - the main loop reports failures again
        return f"{_tag_full(cfg)} {op}: {type(e).__name__}: {str(e)[:120]}"


def precompile(jobs, workers: int, deadline: float) -> None:
    """Compile every distinct kernel in parallel processes (ptxas is single-threaded)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    fails = 0
    ex = cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
    try:
        futs = [ex.submit(_warm_one, j) for j in jobs]
        for f in cf.as_completed(futs, timeout=max(1.0, deadline - time.time())):
            if f.result():
                fails += 1
    except Exception as e:  # noqa: BLE001 - fall back to compiling lazily in the main loop
        print(f"precompile stopped: {type(e).__name__}: {str(e)[:120]}", flush=True)
    finally:
        ex.shutdown(wait=False, cancel_futures=True)  # never wait past the deadline
    print(f"precompiled {len(jobs)} kernels in {time.time() - t0:.0f}s with {workers} workers ({fails} failed)",
          flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "perf/out"))
    ap.add_argument("--budget-s", type=float, default=150.0, help="hard wall budget (stops timing, still reports)")
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1), help="parallel compile processes")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, one config per kind")
    ap.add_argument("--emit-tuned", metavar="EXPLORE_JSON",
                    help="no timing: turn an explore JSON into tuned entries (autotune/configs/<gpu>.json)")
    ap.add_argument("--tuned-out", help="with --emit-tuned: write here instead of autotune/configs/<gpu>.json")
    a = ap.parse_args(argv)
    if a.emit_tuned:
        return emit_tuned(a.emit_tuned, a.tuned_out)
    t_start = time.time()
    t_end = t_start + a.budget_s
    if a.smoke:
        from autotune import interpreter

        interpreter.apply()
        dev = torch.device("cpu")
        shapes = {"tiny": (70, 200), "tiny2": (33, 130)}
        ms = [1, 3, 20]
        l2, sms = 1 << 16, 4
    else:
        dev = torch.device("cuda")
        shapes = {k: SHAPES[k] for k in a.shapes}
        ms = a.ms
        props = torch.cuda.get_device_properties(dev)
        l2, sms = props.L2_cache_size, props.multi_processor_count
        print(f"gpu {props.name} sms={sms} L2={l2 >> 20}MB torch {torch.__version__}", flush=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, kstats, bad = [], {}, []
    if not a.smoke and a.workers > 0:
        jobs, keys = [], set()
        for N, K in shapes.values():
            for M in ms:
                for opn, op in (("mm", wops.OP), ("q8", wops.OP_Q8)):
                    for _, c in _candidates(opn, M, N, K, dev, sms, False):
                        key = (_tag(c), c.block_t, c.split_k > 1, op, type(c).__name__)
                        if key not in keys:
                            keys.add(key)
                            jobs.append((c.__class__(**{**c.__dict__, "split_k": 2 if c.split_k > 1 else 1}), op, M))
        precompile(jobs, a.workers, t_start + 0.45 * a.budget_s)
    ops = (("mm", wops.OP), ("q8", wops.OP_Q8))
    stopped = False
    for name, (N, K) in shapes.items():
        if stopped:
            break
        p0 = synthetic(N, K, dev, gen)
        w_bf = w12.unpack(p0)
        w_q8 = w12.decode_q8(p0)
        n_rot = 1 if a.smoke else int(min(8, max(1, math.ceil(3 * l2 / p0.nbytes))))
        packs = [p0] + [synthetic(N, K, dev, gen) for _ in range(n_rot - 1)]
        n_rot_bf = 1 if a.smoke else int(min(8, max(1, math.ceil(3 * l2 / (N * K * 2)))))
        wbs = [w_bf] + [torch.randn(N, K, device=dev, generator=gen).to(torch.bfloat16) for _ in range(n_rot_bf - 1)]
        for M in ms:
            if time.time() > t_end:
                stopped = True
                break
            x = (torch.randn(M, K, device=dev, generator=gen)).to(torch.bfloat16)
            t_cub = _time([lambda w=w: F.linear(x, w) for w in wbs], a.reps)
            refs = {"mm": F.linear(x, w_bf).float(), "q8": F.linear(x, w_q8).float()}
            for opn, op in ops:
                cands = _candidates(opn, M, N, K, dev, sms, a.smoke)
                seen = set()
                for src, cfg in cands:
                    if cfg in seen:
                        continue
                    seen.add(cfg)
                    if time.time() > t_end:
                        stopped = True
                        break
                    kind = "tc" if isinstance(cfg, wc.TcConfig) else "gemv"
                    try:
                        out, ck = _run(x, p0, cfg, op)
                        ref = refs[opn]
                        err = float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                        if not err < 2e-2:
                            raise AssertionError(f"WRONG rel max err {err:.2e}")
                        key = (_tag(cfg), opn, cfg.block_t, cfg.split_k > 1)
                        if key not in kstats and ck is not None:
                            st = {}
                            for f in ("n_regs", "n_spills"):
                                try:
                                    st[f] = int(getattr(ck, f))
                                except Exception:  # noqa: BLE001 - interpreter handles have none
                                    pass
                            try:
                                st["smem"] = int(ck.metadata.shared)
                            except Exception:  # noqa: BLE001
                                pass
                            kstats[key] = st
                        t = _time([lambda q=q: _run(x, q, cfg, op) for q in packs], a.reps)
                    except Exception as e:  # noqa: BLE001 - a config that fails is reported and skipped
                        msg = f"{name} M={M} {opn} {_tag_full(cfg)}: {type(e).__name__}: {str(e)[:160]}"
                        bad.append(msg)
                        if len(bad) <= 8:
                            print("SKIP", msg, flush=True)
                        continue
                    rows.append(dict(shape=name, N=N, K=K, M=M, op=opn, kind=kind, src=src, cfg=_tag_full(cfg),
                                     tile=_tag(cfg), split=cfg.split_k, bt=cfg.block_t, us=t * 1e6,
                                     cublas_us=t_cub * 1e6, tbs=p0.nbytes / t / 1e12,
                                     cublas_tbs=N * K * 2 / t_cub / 1e12))
        del packs, p0, wbs, w_bf, w_q8
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    _report(rows, kstats, bad, a, time.time() - t_start, stopped)
    return 0


_SLUGS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("l40s", "l40s"), ("4090", "rtx4090"))


def emit_tuned(src: str, dst: str | None = None) -> int:
    """Best measured config per (op, shape, M bucket) as tuned entries in `autotune.store_tuned`'s
    format: variant "tc" = best tensor-core row, variant "gemv" = best CUDA-core row for
    M <= GEMV_MAX_M (the "tc" variant also reads it at M <= ops.TC_GEMV_MAX_M), and "tc.gemv" = that
    GEMV row again for TC_GEMV_MAX_M < M <= GEMV_MAX_M where it beat the best tensor-core row (the
    "tc" variant then runs the GEMV at that shape). Meta (GPU, torch,
    Triton, CUDA) comes from the explore JSON, so the lookup accepts the file only on that GPU
    and Triton major.minor. Entries carry the measurement under "_"."""
    import dataclasses

    data = json.loads(Path(src).read_text())
    meta = {k: v for k, v in data["meta"].items() if k in ("gpu", "torch", "triton", "cuda", "specpilot")}
    if not meta.get("gpu"):
        raise SystemExit(f"{src}: meta has no 'gpu'; cannot say which GPU the configs are for")
    if dst is None:
        name = meta["gpu"].lower()
        slug = next((sl for needle, sl in _SLUGS if needle in name),
                    "".join(c if c.isalnum() else "-" for c in name).strip("-"))
        dst = str(Path(__file__).resolve().parents[1] / "autotune" / "configs" / f"{slug}.json")
    best: dict[str, dict] = {}
    for r in data["rows"]:
        op = wops.OP if r["op"] == "mm" else wops.OP_Q8
        variants = ["tc"] if r["kind"] == "tc" else (["gemv"] if r["M"] <= wc.GEMV_MAX_M else [])
        for v in variants:
            k = f"{op}/{v}/{autotune.shape_key(M=r['M'], N=r['N'], K=r['K'])}"
            if k not in best or r["us"] < best[k]["us"]:
                best[k] = r
    # "tc.gemv": the sm_90 variant runs the GEMV at TC_GEMV_MAX_M < M <= GEMV_MAX_M only where it won
    for k, r in list(best.items()):
        op, v, key = k.split("/")
        if v == "gemv" and wops.TC_GEMV_MAX_M < r["M"] <= wc.GEMV_MAX_M:
            t = best.get(f"{op}/tc/{key}")
            if t is not None and r["us"] < t["us"]:
                best[f"{op}/tc.gemv/{key}"] = r
    entries = {}
    for k, r in sorted(best.items()):
        e = dataclasses.asdict(parse_tag(r["cfg"], r["bt"]))
        e["_"] = {"us": round(r["us"], 2), "cublas_us": round(r["cublas_us"], 2), "src": Path(src).name}
        entries[k] = e
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    Path(dst).write_text(json.dumps({"meta": meta, "entries": entries}, indent=1, sort_keys=True) + "\n")
    print(f"{len(entries)} tuned entries -> {dst}")
    return 0


def _report(rows, kstats, bad, a, wall, stopped) -> None:
    # compact: one entry per (tile, op), regs range over BT/split variants; all details in the JSON
    agg = {}
    for (tile, opn, bt, sp), st in kstats.items():
        e = agg.setdefault((tile, opn), [1 << 30, 0, 0, 0])
        e[0] = min(e[0], st.get("n_regs", 0))
        e[1] = max(e[1], st.get("n_regs", 0))
        e[2] = max(e[2], st.get("n_spills", 0))
        e[3] = max(e[3], st.get("smem", 0) >> 10)
    print(f"\n# compiled kernels: tile/op regs(min-max) spills(max) smemKB(max) [{len(kstats)} kernels]")
    line = [f"{t}/{o}:{e[0]}-{e[1]}r{e[2]}sp{e[3]}K" for (t, o), e in sorted(agg.items())]
    for i in range(0, len(line), 5):
        print("  " + " ".join(line[i:i + 5]))
    print("\n# best per cell: us (x vs cuBLAS) cfg; TB/s on W12 bytes. T=tensor-core kernel, G=CUDA-core gemv")
    print(f"{'shape':11s} {'M':>2s} op {'cuBLAS':>7s} {'TB/s':>4s}|{'best T':>7s} {'x':>5s} {'cfg':17s}|"
          f"{'best G':>7s} {'x':>5s} {'cfg':16s}|{'H(def)':>6s} {'TB/s':>4s} bestTB/s")
    cells = {}
    for r in rows:
        cells.setdefault((r["shape"], r["M"], r["op"]), []).append(r)
    speed = {"mm": [], "q8": []}
    for (shape, M, opn), rs in cells.items():
        cub = rs[0]["cublas_us"]
        bt = min((r for r in rs if r["kind"] == "tc"), key=lambda r: r["us"], default=None)
        bg = min((r for r in rs if r["kind"] == "gemv"), key=lambda r: r["us"], default=None)
        h = min((r for r in rs if r["src"] == "H"), key=lambda r: r["us"], default=None)
        best = min(rs, key=lambda r: r["us"])
        speed[opn].append(cub / best["us"])

        def f(r, w):
            return f"{r['us']:7.1f} {cub / r['us']:5.2f} {r['cfg']:{w}s}" if r else f"{'-':>7s} {'-':>5s} {'':{w}s}"

        hs = f"{h['us']:6.1f} {h['tbs']:4.2f}" if h else f"{'-':>6s} {'-':>4s}"
        print(f"{shape:11s} {M:2d} {opn} {cub:7.1f} {rs[0]['cublas_tbs']:4.2f}|{f(bt, 17)}|{f(bg, 16)}|{hs}"
              f" {best['tbs']:.2f}")
    for opn, v in speed.items():
        if v:
            g = math.exp(sum(map(math.log, v)) / len(v))
            print(f"geomean best-of-all speedup {opn}: {g:.3f}x over {len(v)} cells (min {min(v):.2f}x)")
    # per tile shape: geomean over cells of (cell best us / this tile's best us) -> 1.0 = always the winner
    print("\n# tile shapes: geomean of (cell best / tile best) over cells where it ran [n], per op and M range")
    for opn in ("mm", "q8"):
        for lo_m, hi_m in ((1, 1), (2, 4), (8, 8), (16, 32)):
            agg = {}
            for (shape, M, o), rs in cells.items():
                if o != opn or not lo_m <= M <= hi_m:
                    continue
                best = min(r["us"] for r in rs)
                per_tile = {}
                for r in rs:
                    per_tile[r["tile"]] = min(per_tile.get(r["tile"], 1e30), r["us"])
                for tile, us in per_tile.items():
                    agg.setdefault(tile, []).append(best / us)
            top = sorted(((math.exp(sum(map(math.log, v)) / len(v)), t, len(v)) for t, v in agg.items()),
                         reverse=True)[:4]
            if top:
                print(f"  {opn} M{lo_m}-{hi_m}: " + "  ".join(f"{t} {g:.2f}[{n}]" for g, t, n in top))
    # round 2: each new design vs the best round-1 design of its kind, same cell
    print("\n# new designs (round 3): geomean over cells of (best earlier same-kind us / best design us) [n]; >1 = faster")
    for opn in ("mm", "q8"):
        for lo_m, hi_m in ((1, 1), (2, 4), (8, 8), (16, 32)):
            agg = {}
            for (shape, M, o), rs in cells.items():
                if o != opn or not lo_m <= M <= hi_m:
                    continue
                for kind, letter in (("tc", "T"), ("gemv", "G")):
                    old_best = min((r["us"] for r in rs if r["kind"] == kind and r["src"] != "N"), default=None)
                    if old_best is None:
                        continue
                    by = {}
                    for r in rs:
                        if r["kind"] == kind and r["src"] == "N":
                            d = letter + (re.sub(r"[^ADF]", "", r["tile"].split("s", 1)[1]) or "-")
                            by[d] = min(by.get(d, 1e30), r["us"])
                    for d, us in by.items():
                        agg.setdefault(d, []).append(old_best / us)
            if agg:
                print(f"  {opn} M{lo_m}-{hi_m}: " + "  ".join(
                    f"{d} {math.exp(sum(map(math.log, v)) / len(v)):.2f}[{len(v)}]" for d, v in sorted(agg.items())))
    if bad:
        print(f"\n# {len(bad)} candidates skipped (first 6):")
        for b in bad[:6]:
            print("  " + b)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "w12_explore.json")
    meta = {"wall_s": round(wall, 1), "stopped_by_budget": stopped, "torch": torch.__version__}
    try:
        meta.update({"gpu": autotune.gpu_name(), **autotune.versions()})
    except Exception:  # noqa: BLE001 - metadata is best effort
        pass
    with open(path, "w") as fh:
        json.dump({"meta": meta, "rows": rows, "kernels": {"|".join(map(str, k)): v for k, v in kstats.items()},
                   "skipped": bad}, fh, indent=0)
    print(f"\nwall {wall:.0f}s{' (BUDGET STOP: later cells missing)' if stopped else ''}; json: {path}")


if __name__ == "__main__":
    raise SystemExit(main())
