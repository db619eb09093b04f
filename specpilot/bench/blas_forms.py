"""The BF16 projections' call forms at one row: which cuBLAS kernels each form launches, and what a layer costs in a
CUDA graph of many layers, each GEMM after a small kernel as in the engine's step.

In the engine's BF16 AR step on the H200 each of the 64 down projections (5120 x 17408 at one row) runs cuBLAS's
split-K kernel after a memset, with a 4.2 µs gap between the two (0.27 ms of idle time a step; the H100 launches no
memset there: docs/engine.md, "The W12 AR step"). This benchmark asks which call form or cuBLAS setting avoids it, on
the hybrid-27b projections: per layer shape and form, the kernels one call launches (torch.profiler) and the time of a
(small kernel, GEMM) pair, medians of CUDA-graph replays over rotated weight copies, the small kernel alone beside them.

Forms (`FORMS`): `linear` F.linear(x, w); `mm_out` torch.mm(x, w.t(), out=) (what `specpilot.engine`'s BF16
`Linear` runs when it is given `out`); `mv_out` torch.mv(w, x[0], out=) (one row); `addmm_bias0` torch.addmm with a
zero bias; `mm_out_noreduce` mm_out with `allow_bf16_reduced_precision_reduction` off; `mm_out_cublaslt` mm_out with
`torch.backends.cuda.preferred_blas_library("cublaslt")`. Every form's output is compared with `mm_out`'s (the same
products; the forms may sum in another order, so within a bf16 rounding of the fp64 product).

GPU only. python -m specpilot.bench.blas_forms [--layers mlp.down_proj ...] [--m 1] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch
import torch.nn.functional as F

from specpilot.bench.shapes import get_shape_set
from specpilot.bench.timing import time_cuda

FORMS = ("linear", "mm_out", "mv_out", "addmm_bias0", "mm_out_noreduce", "mm_out_cublaslt")
ROT_BYTES = 150_000_000  # weight copies rotated through: more than L2 holds


@contextlib.contextmanager
def _setting(form: str):
    """The cuBLAS setting a form runs under, restored after it."""
    matmul = torch.backends.cuda.matmul
    before_reduce = matmul.allow_bf16_reduced_precision_reduction
    before_lib = torch.backends.cuda.preferred_blas_library()
    try:
        if form == "mm_out_noreduce":
            matmul.allow_bf16_reduced_precision_reduction = False
        if form == "mm_out_cublaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before_reduce
        torch.backends.cuda.preferred_blas_library(before_lib)


def call(form: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bias0: torch.Tensor):
    """One projection of x [M, K] by w [N, K] in `form` into out [M, N] (returns the result)."""
    if form == "linear":
        return out.copy_(F.linear(x, w))
    if form == "mv_out":
        if x.shape[0] != 1:
            raise ValueError(f"specpilot.bench.blas_forms: mv_out takes one row, got {x.shape[0]}")
        torch.mv(w, x[0], out=out[0])
        return out
    if form == "addmm_bias0":
        return torch.addmm(bias0, x, w.t(), out=out)
    if form in ("mm_out", "mm_out_noreduce", "mm_out_cublaslt"):
        return torch.mm(x, w.t(), out=out)
    raise ValueError(f"specpilot.bench.blas_forms: unknown form {form!r}; one of {FORMS}")


def forms_for(m: int) -> tuple[str, ...]:
    return tuple(f for f in FORMS if m == 1 or f != "mv_out")


def _kernels(fn) -> list[str]:
    """The CUDA kernels and memsets one call of `fn` launches, in order (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    return [e.name for e in events]


def run(layers: list[str], ms: list[int], reps: int) -> dict:
    shapes = get_shape_set("hybrid-27b").linears
    dev = torch.device("cuda")
    report = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "cuda": torch.version.cuda,
              "cells": []}
    for layer in layers:
        N, K = shapes[layer]
        torch.manual_seed(0)
        w0 = (torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16)
        ws = [w0] + [w0.clone() for _ in range(max(1, -(-ROT_BYTES // (N * K * 2))))]
        for m in ms:
            x = torch.randn(m, K, device=dev).to(torch.bfloat16)
            bias0 = torch.zeros(N, device=dev, dtype=torch.bfloat16)
            out = torch.empty(m, N, device=dev, dtype=torch.bfloat16)
            small = torch.empty(4096, device=dev)

            def before():  # the small kernel each GEMM follows (a glue kernel in the engine)
                small.mul_(0.5)

            ref = (x.double() @ w0.double().T).float()
            cell = {"layer": layer, "N": N, "K": K, "M": m, "forms": {}}
            cell["small_us"] = time_cuda([before], reps=reps).median * 1e6
            for form in forms_for(m):
                with _setting(form):
                    got = call(form, x, w0, out, bias0).float().clone()
                    err = (got - ref).abs().max().item()
                    kernels = _kernels(lambda: (before(), call(form, x, w0, out, bias0)))
                    fns = [lambda w=w: (before(), call(form, x, w, out, bias0)) for w in ws]
                    t = time_cuda(fns, reps=reps)
                us = t.median * 1e6
                cell["forms"][form] = {"us": us, "gemm_us": us - cell["small_us"], "max_abs_err": err,
                                       "kernels": kernels, "memset": any("memset" in k.lower() for k in kernels)}
                print(f"{layer} M={m} {form}: {us:.2f} us a pair ({us - cell['small_us']:.2f} beyond the small "
                      f"kernel), kernels {kernels}, max |err| {err:.3g}", flush=True)
            report["cells"].append(cell)
    return report


def table(report: dict) -> str:
    lines = ["| layer | M | form | µs a pair | beyond the small kernel | memset | kernels |",
             "|---|---|---|---|---|---|---|"]
    for c in report["cells"]:
        for form, r in c["forms"].items():
            names = ", ".join(k.split("(")[0].strip()[:48] for k in r["kernels"])
            lines.append(f"| {c['layer']} | {c['M']} | {form} | {r['us']:.2f} | {r['gemm_us']:.2f} | "
                         f"{'yes' if r['memset'] else 'no'} | {names} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shapes = get_shape_set("hybrid-27b").linears
    ap.add_argument("--layers", nargs="+", default=list(shapes), choices=list(shapes))
    ap.add_argument("--m", nargs="+", type=int, default=[1])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("specpilot.bench.blas_forms: needs a CUDA GPU", file=sys.stderr)
        return 2
    report = run(args.layers, args.m, args.reps)
    print(table(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
