"""Hunting an intermittent wrong result of the TMA kernel (session 4: LM head / 16384-row weights at
M = 16, 32, after x moved to one swizzled 2-D TMA box per stage). Per config and variant,
`--launches` launches that alternate between two x tensors, each checked against an fp32
reference; prints how many launches and output rows were wrong.

Variants: "base" (as built); "1cta" (one CTA per SM, dynamic smem inflated); "gap" (a ~3 us sleep
kernel queued before each launch); "gap-wswap" (the weights alternate too, so the plane tensor
maps change between launches); "gap-relfence" (W12_RELFENCE=1). `--focus`: M = 16, the stream-K
configs (session 5; session 5's first run had the bulk-x and xcp configs: 0 of 400 wrong), the gap variants only. Session 4 (H200), kernel with x as one swizzled 2-D TMA box per stage: "gap" wrong in
45 and 16 of 400 launches (M = 16, tma-mt1-cw4-st8), also with the box unswizzled (29 / 26), none
with x by per-token bulk copies (0 / 0): the bulk copies are the kernel's x path again.

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
    ap.add_argument("--focus", action="store_true", help="M = 16, the stream-K configs, the gap variants only")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    smem, flags = wcuda.smem_bytes, wcuda._flags
    gen = torch.Generator(device="cuda").manual_seed(0)
    N, K = 16384, 5120
    ws = [(torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16) for _ in range(2)]
    ps = [w12.pack(w) for w in ws]
    res = []
    for M in ((16,) if a.focus else (8, 16, 32)):
        xs = [torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2)]
        refs = [[x.float() @ w.float().T for w in ws] for x in xs]
        focus = (TmaConfig(1, 4, 8, sk=2), TmaConfig(1, 8, 6, sk=2, xcp=True), TmaConfig(1, 8, 6, sk=1))
        for cfg in (focus if a.focus else focus + (TmaConfig(1, 8, 6), TmaConfig(2, 4, 6))):
            # "wswap": the weights alternate too (launch i uses x i % 2 and weight (i // 2) % 2), so the
            # plane tensor maps change between launches as in a decode step
            # "relfence": W12_RELFENCE=1 (a proxy fence before each stage release)
            for var in (("gap", "gap-wswap", "gap-relfence") if a.focus else ("base", "1cta", "gap", "gap-wswap")):
                wcuda.smem_bytes = (lambda c, nt, q8, _v=var: max(smem(c, nt, q8), 120 << 10) if _v == "1cta"
                                    else smem(c, nt, q8))
                wcuda._flags = (lambda c, nt, q8, arch, _v=var: flags(c, nt, q8, arch) +
                                (["-DW12_RELFENCE=1"] if _v.endswith("relfence") else []))
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


if __name__ == "__main__":
    sys.exit(main())
