"""Where the decode step loses: a slice of the hybrid-27b decode step (M = 1) replayed as one CUDA
graph, cuBLAS beside W12 dispatch variants, every layer's output checked in every variant.

A block is the model's 4-layer pattern: 3 GDN layers (in_proj, out_proj), 1 attention layer
(qkv_proj, o_proj) and 4 MLPs (gate_up_proj, down_proj): 16 linears, ~3.0 GB of BF16 weights.
`--blocks 4` is a quarter of the step (x 4 = the full 64-layer step, as the bench's decode-step
case times it). Variants:
  cublas            F.linear on the BF16 weights
  w12               w12.matmul as dispatched (tuned table)
  w12-pdl           the same with programmatic dependent launch (SPECPILOT_PDL=1 at capture)
  w12-pdl-1cta      PDL, and TMA configs padded to > 114 KB of shared memory (one CTA per SM, so an
                    early-launched CTA of the next layer cannot share an SM with one of this layer)
  tma               every layer on the TMA kernel (TmaConfig(1, 8, 6), split 3 for the N = 5120 layers)
  tma-pdl, tma-pdl-1cta
  sk                every layer on the stream-K TMA kernel, TmaConfig(1, 8, 6, sk=2)
Rounds interleave the variants (one replay of each per round) so that drift hits all alike.

    python3 perf/w12_step_probe.py --out $OUT [--blocks 4] [--rounds 15]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import autotune  # noqa: E402
import w12  # noqa: E402
from w12 import cuda as wcuda  # noqa: E402
from w12.configs import TmaConfig  # noqa: E402

H, FFN = 5120, 17408
LAYERS = {"gdn.in_proj": (16480, H), "gdn.out_proj": (H, 6144), "attn.qkv_proj": (14336, H),
          "attn.o_proj": (H, 6144), "mlp.gate_up_proj": (2 * FFN, H), "mlp.down_proj": (H, FFN)}
BLOCK = ["gdn.in_proj", "gdn.out_proj"] * 3 + ["attn.qkv_proj", "attn.o_proj"] + \
    ["mlp.gate_up_proj", "mlp.down_proj"] * 4


def tma_cfg(n: int, k: int, sk: bool = False) -> TmaConfig:
    if sk:
        return TmaConfig(1, 8, 6, sk=2)
    return TmaConfig(1, 8, 6, split=3 if n <= 8192 else 1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf/results/local")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--variants", default="cublas,w12,tma,sk,w12-pdl-1cta")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(7)
    names = BLOCK * a.blocks
    ws, ps, xs, refs = [], [], [], []
    for name in names:
        n, k = LAYERS[name]
        w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
        x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
        ws.append(w)
        ps.append(w12.pack(w))
        xs.append(x)
        refs.append(x.float() @ w.float().T)
    smem = wcuda.smem_bytes

    def step_fn(kind: str):
        if kind == "cublas":
            return lambda: [F.linear(x, w) for x, w in zip(xs, ws)]
        if kind == "w12":
            return lambda: [w12.matmul(x, p) for x, p in zip(xs, ps)]

        def tma_step():
            outs = []
            for name, x, p in zip(names, xs, ps):
                with autotune.force("w12.matmul", config=tma_cfg(*LAYERS[name], sk=kind == "sk")):
                    outs.append(w12.matmul(x, p))
            return outs
        return tma_step

    graphs, outs, res = {}, {}, []
    for var in a.variants.split(","):
        base = var.split("-")[0]
        os.environ["SPECPILOT_PDL"] = "1" if "-pdl" in var else "0"
        wcuda.smem_bytes = ((lambda c, nt, q8: max(smem(c, nt, q8), 120 << 10) if isinstance(c, TmaConfig)
                             else smem(c, nt, q8)) if var.endswith("1cta") else smem)
        wcuda._FUNCS.clear()
        fn = step_fn(base)
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                o = fn()
            g.replay()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            r = dict(variant=var, error=f"{type(e).__name__}: {e}"[:400])
            res.append(r)
            print(json.dumps(r), flush=True)
            continue
        graphs[var], outs[var] = g, o
    os.environ["SPECPILOT_PDL"] = "0"
    wcuda.smem_bytes = smem
    wcuda._FUNCS.clear()

    def check(var: str) -> tuple[int, float]:
        bad, worst = 0, 0.0
        for o, ref in zip(outs[var], refs):
            d = (o.float() - ref).abs()
            tol = 2e-2 * ref.abs().amax() + 1e-3
            if bool(((d > tol) | d.isnan()).any()):
                bad += 1
            worst = max(worst, float(d.nan_to_num(1e9).max()))
        return bad, worst

    times = {v: [] for v in graphs}
    bad = {v: 0 for v in graphs}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for r in range(a.rounds + 2):
        for v, g in graphs.items():
            for o in outs[v]:
                o.fill_(float("nan"))  # poison: every layer must be written by this replay
            ev[0].record()
            g.replay()
            ev[1].record()
            torch.cuda.synchronize()
            if r >= 2:
                times[v].append(ev[0].elapsed_time(ev[1]) * 1e3)
            b, _ = check(v)
            bad[v] += int(b > 0)
    base_us = statistics.median(times["cublas"]) if "cublas" in times else None
    for v in graphs:
        med = statistics.median(times[v])
        b, worst = check(v)
        r = dict(variant=v, blocks=a.blocks, linears=len(names), median_us=round(med, 1),
                 min_us=round(min(times[v]), 1), max_us=round(max(times[v]), 1),
                 full_step_ms=round(med * 64 / (4 * a.blocks) / 1e3, 3),
                 speedup_vs_cublas=round(base_us / med, 4) if base_us else None,
                 bad_replays=bad[v], worst_abs_err=worst)
        res.append(r)
        print(json.dumps(r), flush=True)
    (out / "step_probe.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                         rows=res), indent=1))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
