"""Hunting wrong results of the TMA kernel. Per config and variant,
`--launches` launches that alternate between two x tensors, each checked against an fp32
reference; prints how many launches and output rows were wrong.

Variants: "base" (as built); "1cta" (one CTA per SM, dynamic smem inflated); "gap" (a ~3 us sleep
kernel queued before each launch); "gap-wswap" (the weights alternate too, so the plane tensor
maps change between launches); "gap-nofence" (W12_RELFENCE=0: without the consumers' proxy fence
before each stage release, the race found in session 5). `--focus`: M = 16, the stream-K
configs and the x-box configs (session 5, not yet run), the gap variants only. `--small`: session
5's race (see small()), plus the x box.
History: session 4 (H200, no fence), x as one swizzled 2-D TMA box per stage: "gap" wrong in 45 and
16 of 400 launches (M = 16, tma-mt1-cw4-st8), none with x by per-token bulk copies, so the box was
withdrawn; session 5 found the missing proxy fence (most likely the box's failure too).

    python3 perf/w12_race_probe.py --out $OUT
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
from w12.configs import TmaConfig  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf/results/local")
    ap.add_argument("--launches", type=int, default=40)
    ap.add_argument("--small", action="store_true", help="the sweep's failures of session 5: LM head and gate_up "
                    "at M = 16 with small CTAs (cw1 / cw2, st4) and cw4-st8-xcp; variants gap, poison, nofence")
    ap.add_argument("--focus", action="store_true", help="M = 16, the stream-K configs, the gap variants only")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    smem, flags = wcuda.smem_bytes, wcuda._flags
    gen = torch.Generator(device="cuda").manual_seed(0)
    if a.small:
        return small(a, out, flags, gen)
    N, K = 16384, 5120
    ws = [(torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16) for _ in range(2)]
    ps = [w12.pack(w) for w in ws]
    res = []
    for M in ((16,) if a.focus else (8, 16, 32)):
        xs = [torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2)]
        refs = [[x.float() @ w.float().T for w in ws] for x in xs]
        focus = (TmaConfig(1, 4, 8, xbox=True), TmaConfig(1, 8, 6, split=3, xbox=True), TmaConfig(1, 4, 8, sk=2),
                 TmaConfig(1, 8, 6, sk=2, xcp=True))
        for cfg in (focus if a.focus else focus + (TmaConfig(1, 8, 6), TmaConfig(2, 4, 6))):
            # "wswap": the weights alternate too (launch i uses x i % 2 and weight (i // 2) % 2), so the
            # plane tensor maps change between launches as in a decode step
            # "nofence": W12_RELFENCE=0 (no proxy fence before each stage release: the session-5 race)
            for var in (("gap", "gap-wswap", "gap-nofence") if a.focus else ("base", "1cta", "gap", "gap-wswap")):
                wcuda.smem_bytes = (lambda c, nt, q8, _v=var: max(smem(c, nt, q8), 120 << 10) if _v == "1cta"
                                    else smem(c, nt, q8))
                wcuda._flags = (lambda c, nt, q8, arch, _v=var: flags(c, nt, q8, arch) +
                                (["-DW12_RELFENCE=0"] if _v.endswith("nofence") else []))
                wcuda._FUNCS.clear()
                bad_launch, bad_rows, worst = 0, 0, 0.0
                o = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                for i in range(a.launches):
                    x = xs[i % 2]
                    wi = (i // 2) % 2 if var.endswith("wswap") else 0
                    p, ref = ps[wi], refs[i % 2][wi]
                    o.fill_(float("nan"))
                    if var.startswith("gap"):
                        torch.cuda._sleep(5000)
                    wcuda.launch(cfg, x, p.hi, p.lo, p.e0, p.esc_rowptr, p.esc_col, p.esc_val, None, o)
                    d = (o.float() - ref).abs()
                    tol = 1e-2 * ref.abs().amax() + 1e-3
                    rows = int(((d > tol) | d.isnan()).any(0).sum())
                    if rows:
                        bad_launch += 1
                        bad_rows += rows
                    worst = max(worst, float(d.nan_to_num(1e9).max()))
                r = dict(M=M, cfg=cfg.tag(), var=var, bad_launches=bad_launch, bad_rows=bad_rows, worst=worst)
                res.append(r)
                print(json.dumps(r), flush=True)
    wcuda.smem_bytes, wcuda._flags = smem, flags
    (out / "w12_race_probe.json").write_text(json.dumps(res, indent=1))
    return 0


def small(a, out, flags, gen) -> int:
    """Session 5's wrong results: launches alternating two x behind a sleep kernel, every output
    checked; `poison` fills each stage with 0xFF first, so a consumer that read a stage before its
    copies landed would produce NaN; `nofence` drops the consumers' proxy fence before each stage
    release. Before the fix (fence off in the build): 150 of 150 launches wrong for cw1 / cw2 st4
    and cw4-st8-xcp on the LM head, none NaN under poison, none with the fence
    (perf/results/h200/20261130-s5-race_probe-small-before-fix.json): the refill overtook the reads."""
    res = []
    for name, N in (("lm_head", 248320), ("gate_up", 34816)):
        K, M = 5120, 16
        w = (torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        p = w12.pack(w)
        xs = [torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2)]
        refs = [x.float() @ w.float().T for x in xs]
        for cfg in (TmaConfig(1, 1, 4), TmaConfig(1, 2, 4), TmaConfig(1, 4, 8, xcp=True), TmaConfig(1, 8, 6),
                    TmaConfig(1, 2, 4, xbox=True), TmaConfig(1, 4, 8, xbox=True)):
            for var in ("gap", "poison", "nofence"):
                extra = {"poison": ["-DW12_POISON=1"], "nofence": ["-DW12_RELFENCE=0"]}.get(var, [])
                wcuda._flags = (lambda c, nt, q8, arch, _e=extra: flags(c, nt, q8, arch) + _e)
                wcuda._FUNCS.clear()
                o = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                bad, nan_l, worst = 0, 0, 0.0
                for i in range(a.launches):
                    x, ref = xs[i % 2], refs[i % 2]
                    o.fill_(0.0)
                    torch.cuda._sleep(5000)
                    wcuda.launch(cfg, x, p.hi, p.lo, p.e0, p.esc_rowptr, p.esc_col, p.esc_val, None, o)
                    d = (o.float() - ref).abs()
                    tol = 1e-2 * ref.abs().amax() + 1e-3
                    if bool(((d > tol) | d.isnan()).any()):
                        bad += 1
                    nan_l += int(bool(o.isnan().any()))
                    worst = max(worst, float(d.nan_to_num(1e9).max()))
                r = dict(shape=name, M=M, cfg=cfg.tag(), var=var, launches=a.launches, bad_launches=bad,
                         nan_launches=nan_l, worst=worst)
                res.append(r)
                print(json.dumps(r), flush=True)
        del w, p
    wcuda._flags = flags
    wcuda._FUNCS.clear()
    (out / "race_probe_small.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
