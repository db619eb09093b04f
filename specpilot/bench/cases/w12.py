"""W12 GEMM cases: every linear of a shape set plus the LM-head projection, M in {1..32}, and a
whole decode step.

Per `<layer>-M<m>` group (baseline "cublas"):
  * "cublas"  F.linear on the BF16 weight (2 B/weight)
  * "w12.tc"   w12.matmul with the sm_90 variant forced (wgmma; the CUDA-core GEMV at M = 1, see w12/ops.py)
  * "w12.gemv" w12.matmul with the no-wgmma variant forced (CUDA cores for M <= 4, mma above)
  * "w12.mma"  w12.matmul with the CUDA C++ kernel forced (w12/cuda.py; the default on sm_80+ GPUs)
  * "w12.q8"   w12.matmul_q8 (hi plane + escapes, 1 B/weight), default variant
The LM head appears as layer "lm_head.linear" (a plain projection; `lm_head-M<m>` is the
argmax group of the linear/lm_head providers).

Group "decode-step" (M=1): every linear of every layer (`shapes.linear_counts`), one callable
for the whole step, timed as a CUDA graph; variants "cublas" and "w12". For hybrid-27b that is
~50 GB of BF16 weights: W12 copies are packed on the GPU layer by layer from the BF16 set kept
for the baseline.

Each check compares against fp64 on a strided subset of output columns, with the tolerance
derived from the cuBLAS result (specpilot.testing.assert_close). Bytes: the W12 planes as
stored (`packed.nbytes`, escapes included, updated after packing) or 2NK, plus x and out.
On a CPU only the "tiny" shape set yields cases.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import autotune
from specpilot.testing import assert_close

from ..registry import Case, Prepared, register, rotations
from ..shapes import ModelShapes

M_VALUES = (1, 2, 4, 8, 16, 32)
_CHECK_COLS = 512
_SEED = 4321


def _kp(k: int) -> int:
    return -(-k // 64) * 64


def _w12_bytes(n: int, k: int, q8: bool) -> float:
    """Planes read by one call, escapes not counted (updated from the packed weight in setup)."""
    return n * _kp(k) * (1.0 if q8 else 1.5) + 5 * n + 4


def _read_bytes(packed, q8: bool) -> float:
    planes = (packed.hi, packed.e0, packed.esc_rowptr, packed.esc_col, packed.esc_val)
    return float(sum(t.nbytes for t in planes) + (0 if q8 else packed.lo.nbytes))


class _Weights:
    """BF16 sets and their W12 packs for one (N, K), shared by the cases of consecutive groups.

    Only the most recent shape is kept, so memory holds one layer's sets at a time."""

    _key = None
    _val: dict = {}

    @classmethod
    def get(cls, n: int, k: int, sets: int, device: torch.device, packed: bool) -> dict:
        key = (n, k, str(device))
        if cls._key != key:
            cls._key, cls._val = key, {"bf16": [], "w12": []}
            torch.cuda.empty_cache() if device.type == "cuda" else None
        v = cls._val
        g = torch.Generator(device=device).manual_seed(_SEED + n + k + len(v["bf16"]))
        while len(v["bf16"]) < sets:
            v["bf16"].append((torch.randn(n, k, device=device, generator=g) * k**-0.5).to(torch.bfloat16))
        if packed:
            import w12

            while len(v["w12"]) < sets:
                v["w12"].append(w12.pack(v["bf16"][len(v["w12"])]))
        return v

    @classmethod
    def release(cls) -> None:
        cls._key, cls._val = None, {}


def _inputs(m: int, k: int, sets: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(_SEED + m + k)
    return [torch.randn(m, k, device=device, generator=g).to(torch.bfloat16) for _ in range(sets)]


def _cols(n: int, device) -> torch.Tensor:
    return torch.arange(0, n, max(1, n // _CHECK_COLS), device=device)[:_CHECK_COLS]


def _kernel_variants(device: torch.device) -> list[str]:
    if device.type == "cuda":
        from w12 import cuda as wcuda

        return ["w12.tc", "w12.gemv", *(["w12.mma"] if wcuda.available(device) else []), "w12.q8"]
    if autotune.is_interpreter():
        return ["w12.tc", "w12.gemv", "w12.q8"]
    return ["w12.q8"]  # CPU without the interpreter: the torch fallback only


def _case(name: str, n: int, k: int, m: int, variant: str, device: torch.device) -> Case:
    xo = 2 * (m * k + m * n)
    q8 = variant == "w12.q8"
    if variant == "cublas":
        nbytes, op = 2.0 * n * k + xo, "linear"
    else:
        nbytes, op = _w12_bytes(n, k, q8) + xo, "w12.matmul_q8" if q8 else "w12.matmul"
    group = f"{name}-M{m}"

    def setup() -> Prepared:
        import w12

        sets = rotations(nbytes, device)
        ws = _Weights.get(n, k, sets, device, packed=variant != "cublas")
        xs = _inputs(m, k, sets, device)
        cols = _cols(n, device)
        if variant == "cublas":
            fns = [(lambda x=x, w=w: F.linear(x, w)) for x, w in zip(xs, ws["bf16"][:sets])]
        else:
            packs = ws["w12"][:sets]
            case.bytes = _read_bytes(packs[0], q8) + xo
            fn = w12.matmul_q8 if q8 else w12.matmul
            forced = {"w12.tc": "tc", "w12.gemv": "gemv", "w12.mma": "mma"}.get(variant)

            def call(x, p, fn=fn, forced=forced):
                if forced is None:
                    return fn(x, p)
                with autotune.force("w12.matmul", variant=forced):
                    return fn(x, p)

            fns = [(lambda x=x, p=p: call(x, p)) for x, p in zip(xs, packs)]

        def check() -> None:
            x, w = xs[0], ws["bf16"][0]
            out = fns[0]()
            if q8:
                wq = w12.decode_q8(ws["w12"][0])[cols]
                ref64 = (x.double() @ wq.double().T).cpu()
                base = F.linear(x, wq)
            else:
                wc = w[cols]
                ref64 = (x.double() @ wc.double().T).cpu()
                base = F.linear(x, w)[:, cols]  # the cuBLAS output itself
            assert_close(out[:, cols], ref64, base, msg=f"{variant} {group}")

        def teardown() -> None:
            xs.clear()
            fns.clear()

        return Prepared(fns=fns, check=check, graph_safe=True, teardown=teardown)

    case = Case(op=op, variant=variant, shape=group, dims={"M": m, "N": n, "K": k}, flops=2.0 * m * n * k,
                bytes=float(nbytes), setup=setup, group=group, baseline="cublas", extra={"layer": name})
    return case


class _StepWeights:
    """The decode step's weights: one BF16 set (baseline) and its W12 packs, built once."""

    _key = None
    _val: dict = {}

    @classmethod
    def get(cls, shapes: ModelShapes, device: torch.device, packed: bool) -> dict:
        key = (shapes.name, str(device))
        if cls._key != key:
            cls._key, cls._val = key, {"layers": [], "w12": []}
        v = cls._val
        if not v["layers"]:
            g = torch.Generator(device=device).manual_seed(_SEED)
            for name, (n, k) in shapes.linears.items():
                for _ in range(shapes.linear_counts.get(name, shapes.layers)):
                    w = (torch.randn(n, k, device=device, generator=g) * k**-0.5).to(torch.bfloat16)
                    v["layers"].append((name, w, torch.randn(1, k, device=device, generator=g).to(torch.bfloat16)))
        if packed and not v["w12"]:
            import w12

            v["w12"] = [w12.pack(w) for _, w, _ in v["layers"]]  # one layer at a time on the device
        return v

    @classmethod
    def release(cls) -> None:
        cls._key, cls._val = None, {}


def _step_case(shapes: ModelShapes, variant: str, device: torch.device) -> Case:
    linears = [(n, k) for name, (n, k) in shapes.linears.items()
               for _ in range(shapes.linear_counts.get(name, shapes.layers))]
    flops = sum(2.0 * n * k for n, k in linears)
    xo = sum(2.0 * (k + n) for n, k in linears)
    wb = sum((_w12_bytes(n, k, False) if variant == "w12" else 2.0 * n * k) for n, k in linears)

    def setup() -> Prepared:
        import w12

        _Weights.release()  # the per-layer sets (up to the LM head's) are not needed any more
        v = _StepWeights.get(shapes, device, packed=variant == "w12")
        layers = v["layers"]
        if variant == "w12":
            case.bytes = sum(_read_bytes(p, False) for p in v["w12"]) + xo
            pairs = [(x, p) for (_, _, x), p in zip(layers, v["w12"])]

            def step():
                return [w12.matmul(x, p) for x, p in pairs]
        else:
            pairs = [(x, w) for _, w, x in layers]

            def step():
                return [F.linear(x, w) for x, w in pairs]

        def check() -> None:
            outs = step()
            picks = sorted({0, len(layers) // 3, len(layers) // 2, len(layers) - 1})
            for i in picks:
                name, w, x = layers[i]
                cols = _cols(w.shape[0], device)
                ref64 = (x.double() @ w[cols].double().T).cpu()
                assert_close(outs[i][:, cols], ref64, F.linear(x, w)[:, cols], msg=f"decode-step {variant} layer {i}")

        def teardown() -> None:
            pairs.clear()
            _StepWeights.release()  # ~90 GB on hybrid-27b: do not hold it into later groups

        return Prepared(fns=[step], check=check, graph_safe=True, teardown=teardown)

    case = Case(op="decode_step", variant=variant, shape="decode-step", dims={"M": 1, "linears": len(linears)},
                flops=flops, bytes=wb + xo, setup=setup, group="decode-step", baseline="cublas",
                extra={"shapes": shapes.name})
    return case


@register("w12")
def cases(shapes: ModelShapes, device: torch.device) -> list[Case]:
    device = torch.device(device)
    if device.type != "cuda" and shapes.name != "tiny":
        return []
    ms = M_VALUES if device.type == "cuda" else (1, 4)
    layers = dict(shapes.linears)
    layers["lm_head.linear"] = shapes.lm_head
    kv = _kernel_variants(device)
    out = [_case(name, n, k, m, v, device)
           for name, (n, k) in layers.items() for m in ms for v in ["cublas", *kv]]
    out += [_step_case(shapes, v, device) for v in ("cublas", "w12")]
    return out
