"""Where the TMA kernel's time goes, side by side in one process: per (shape, M, TmaConfig) the
kernel as built, the same kernel with W12_NULL=1 (consumers only wait for and release each stage:
the streaming rate of the ring and its TMA box geometry alone), with W12_NULL=1 W12_CM=1 (the same
bytes read as if the planes were stored chunk-major, [Kp / 64][N][64]: every box one contiguous
range), with W12_NULL=1 W12_WIDE=2 / 4 (boxes 2 / 4 times wider and shorter), the register-pipelined
kernel and cuBLAS, plus a plain streaming read of the same bytes (perf/w12_diag.py's read ceiling).
`--quick`: M = 1 and the null builds only (null, chunk-major, wide); otherwise M = 1, 8, 32 with the
kernel as built, null and chunk-major.

    python3 perf/w12_tma_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import w12  # noqa: E402
from w12 import cuda as wcuda  # noqa: E402
from w12.configs import MmaConfig, TmaConfig  # noqa: E402
from specpilot.bench.runner import time_fns  # noqa: E402
from specpilot.bench.registry import rotations  # noqa: E402

SHAPES = {"attn.o_proj": (5120, 6144), "gdn.in_proj": (16480, 5120), "mlp.gate_up_proj": (34816, 5120)}
CFGS = [TmaConfig(1, 8, 6), TmaConfig(1, 8, 6, split=3), TmaConfig(2, 4, 6), TmaConfig(1, 8, 10), TmaConfig(2, 8, 4)]
MMA = MmaConfig(2, 4, 2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf/results/local")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    tmap = wcuda._tensor_map

    def cm_map(t, box_cols, box_rows):  # planes as chunk-major rows of one chunk each
        return tmap(t.reshape(-1, box_cols), box_cols, box_rows)

    def wide_map(w):  # plane boxes w times wider, w times fewer rows (W12_WIDE=w)
        return lambda t, bc, br: tmap(t, bc * w, br // w)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = wcuda._flags
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    try:
        from w12_diag import read_ceiling
        ceil = read_ceiling({n: N * K * 3 // 2 for n, (N, K) in SHAPES.items()})
    except Exception as e:  # noqa: BLE001
        print("read ceiling failed:", e)
        ceil = {}
    for name, (N, K) in SHAPES.items():
        w = (torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        p = w12.pack(w)
        copies = rotations(p.nbytes, torch.device("cuda"))
        ps = [p] + [w12.W12Weight(**{k: v.clone() for k, v in p.planes().items()}, K=K) for _ in range(copies - 1)]
        ws = [w] + [w.clone() for _ in range(rotations(w.nbytes, torch.device("cuda")) - 1)]
        for M in ((1,) if a.quick else (1, 8, 32)):
            x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
            ref = x.double() @ w.double().T
            outs = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in ps]
            row = dict(shape=name, M=M, w12_bytes=p.nbytes, read_us=ceil.get(name, {}).get("us"))
            row["cublas_us"] = time_fns([lambda v=v: F.linear(x, v) for v in ws], reps=20) * 1e6

            def fns(cfg):
                return [lambda i=i: wcuda.launch(cfg, x, ps[i].hi, ps[i].lo, ps[i].e0, ps[i].esc_rowptr, ps[i].esc_col,
                                                 ps[i].esc_val, None, outs[i]) for i in range(len(ps))]
            for cfg in ([] if a.quick else [MMA]) + CFGS:
                modes = ("null", "cm", "w2", "w4") if a.quick else ("", "null", "cm")
                for mode in (modes if isinstance(cfg, TmaConfig) else ("",)):
                    null = mode != ""
                    extra = {"": [], "null": ["-DW12_NULL=1"], "cm": ["-DW12_NULL=1", "-DW12_CM=1"],
                             "w2": ["-DW12_NULL=1", "-DW12_WIDE=2"], "w4": ["-DW12_NULL=1", "-DW12_WIDE=4"]}[mode]
                    wcuda._flags = (lambda c, nt, q8, arch, _e=extra: flags(c, nt, q8, arch) + _e)
                    wcuda._tensor_map = {"cm": cm_map, "w2": wide_map(2), "w4": wide_map(4)}.get(mode, tmap)
                    wcuda._FUNCS.clear()
                    try:
                        f = fns(cfg)
                        outs[0].fill_(float("nan"))
                        f[0]()
                        torch.cuda.synchronize()
                        err = ((outs[0].double() - ref).norm() / ref.norm()).item()
                        if not null and not err < 1e-2:
                            row[cfg.tag()] = f"BAD err {err:.3g}"
                            continue
                        row[cfg.tag() + (f"-{mode}" if mode else "")] = time_fns(f, reps=20) * 1e6
                    except Exception as e:  # noqa: BLE001
                        row[cfg.tag() + (f"-{mode}" if mode else "")] = f"{type(e).__name__}: {str(e)[:100]}"
            wcuda._flags = flags
            wcuda._tensor_map = tmap
            wcuda._FUNCS.clear()
            rows.append(row)
            print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    (out / "w12_tma_probe.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), read=ceil, rows=rows),
                                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
