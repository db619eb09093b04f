"""W12 GEMM cases: every linear of a shape set plus the LM-head projection, M in {1..32}, and a
whole decode step.

Per `<layer>-M<m>` group (baseline "cublas"; "torch" on a CPU):
  * "cublas"  F.linear on the BF16 weight (2 B/weight); "torch" on a CPU (the CPU matmul)
  * "w12.tc"   w12.matmul with the sm_90 variant forced (wgmma; the CUDA-core GEMV at M = 1, see w12/ops.py)
  * "w12.gemv" w12.matmul with the no-wgmma variant forced (CUDA cores for M <= 4, mma above)
  * "w12.mma"  w12.matmul with the CUDA C++ kernel forced (w12/cuda.py; the planes' default on sm_80+ GPUs)
  * "w12.flow" w12.matmul on the runtime layout (`w12.pack`'s default form, a TiledW12): the flow kernel at
               w12.configs.flow_config's FlowConfig (a tuned entry, else the heuristic; csrc/w12_flow.cu,
               docs/w12-kernels.md, "The flow kernel"); bytes: the tiles and the metadata
  * "w12.q8"   w12.matmul_q8 on the planes (hi plane + escapes, 1 B/weight), their default variant
  * "w12.q8.flow" w12.matmul_q8 on the runtime layout: the flow kernel's 8-bit view build (hi bytes of each tile only;
               FlowConfig from w12.configs.flow_config)
  * "w12.torch", "w12.q8.torch"  (a CPU without the interpreter) the torch paths of w12.matmul and matmul_q8,
               the only ones such a CPU runs
  * "nwc"      (M = 1, CUDA, when the `nwc` package imports) the peer neural-weight-compression: lossless BF16,
               the sign/exponent byte prefix-coded and the mantissa byte raw, decoded in registers inside its fused
               matvec. `nwc.NWCWeight(w)` encodes on the host; `nwc.NWCLinear(w=...)` on a one-token BF16 x is
               its token path (x to fp32, partial sums per 512-column block in a scratch buffer, then BF16 out).
               The rotated sets are copies of one encoded weight (`NWCWeight.from_tensors` on clones of its
               tensors: other addresses, so each call reads HBM), which keeps the host encoding to one per layer.
               Not in "decode-step": encoding every linear of hybrid-27b on the host would take minutes.
The LM head appears as layer "lm_head.linear" (a plain projection; `lm_head-M<m>` is the
argmax group of the linear/lm_head providers).

Group "decode-step" (M=1): every linear of every layer (`shapes.linear_counts`), one callable
for the whole step, timed as a CUDA graph; variants "cublas", "w12" (w12.matmul on the planes) and, where the
flow kernel builds, "w12.tiled" (w12.matmul_tiled on the runtime layout alone, as the engine holds it). For
hybrid-27b that is
~50 GB of BF16 weights: W12 copies are packed on the GPU layer by layer from the BF16 set kept
for the baseline.

Each check compares against fp64 on a strided subset of output columns, with the tolerance
derived from the cuBLAS result (specpilot.testing.assert_close); "nwc" also against the BF16 weight
itself (its dequantized rows bitwise, the lossless claim). Bytes: the W12 planes as stored (`packed.nbytes`,
escapes included, updated after packing), NWC's tensors as stored (`NWCWeight.tensors()`, updated after
encoding; its bits per weight go to the row's extra["nwc"]; the scratch partial sums, 8 B per row and 512
columns written and read, ~1 % of the stored bytes, are not counted) or 2NK, plus x and out.
On a CPU only the "tiny" shape set yields cases, at M = 1 and 4: the Triton variants under the interpreter when
TRITON_INTERPRET=1 (seconds a call), else the torch paths; "decode-step" runs on CUDA only.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

import autotune
from specpilot.testing import assert_bitwise_equal, assert_close

from ..registry import Case, Prepared, register, rotations
from ..shapes import ModelShapes
from .linear import baseline_variant

M_VALUES = (1, 2, 4, 8, 16, 32)
_CHECK_COLS = 512
_SEED = 4321
# NWC's stored bits per weight on this file's Gaussian weights (10.98 at 5120 x 17408): the estimate that sizes the
# rotations before encoding; setup replaces it with the bytes as stored.
_NWC_BITS = 11.0


def _kp(k: int) -> int:
    return -(-k // 64) * 64


def _w12_bytes(n: int, k: int, q8: bool) -> float:
    """Planes read by one call, escapes not counted (updated from the packed weight in setup)."""
    return n * _kp(k) * (1.0 if q8 else 1.5) + 5 * n + 4


def _tiled_read_bytes(tiled, q8: bool) -> float:
    """What the flow kernel reads of a TiledW12: its tiles (the 8-bit view: their hi bytes, two thirds of a tile and
    of a row's tail) and the metadata."""
    meta = sum(t.nbytes for t in (tiled.e0, tiled.esc_rowptr, tiled.esc_col, tiled.esc_val))
    geo = tiled.geometry
    hi = tiled.N * (64 * geo.KF + geo.kr)
    return float(meta + (hi if q8 else tiled.tiles.nbytes))


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
                v["w12"].append(w12.pack(v["bf16"][len(v["w12"])], layout="planes"))  # the variants read planes
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

        return ["w12.tc", "w12.gemv", *(["w12.mma", "w12.flow"] if wcuda.available(device) else []), "w12.q8",
                *(["w12.q8.flow"] if wcuda.available(device) else [])]
    if autotune.is_interpreter():
        return ["w12.tc", "w12.gemv", "w12.q8"]
    return ["w12.torch", "w12.q8.torch"]  # CPU without the interpreter: the torch paths only


@functools.cache
def _nwc():
    """The `nwc` package for the "nwc" peer, or None after one line on stderr saying why. Imported on first use
    (CUDA only): its import loads its CUDA library and sets kernel attributes on the device."""
    try:
        import nwc

        if not (hasattr(nwc, "NWCLinear") and hasattr(getattr(nwc, "NWCWeight", None), "from_tensors")):
            raise ImportError(f"nwc {getattr(nwc, '__version__', '?')} has no NWCLinear / NWCWeight.from_tensors")
    except Exception as e:  # ImportError, or OSError when its CUDA library does not load
        why = (str(e).splitlines() or [""])[0][:160]
        print(f"bench w12: peer nwc skipped: {type(e).__name__}: {why}", file=sys.stderr)
        return None
    return nwc


def _peer_variants(device: torch.device, m: int) -> list[str]:
    """Peers beside cuBLAS and W12 in a `<layer>-M<m>` group: "nwc" (its fused path is for one token)."""
    return ["nwc"] if m == 1 and device.type == "cuda" and _nwc() is not None else []


def _nwc_linears(w: torch.Tensor, sets: int, device: torch.device) -> list:
    """`sets` NWCLinear modules on one encoding of `w`: the first as encoded, the others on clones of its tensors."""
    nwc = _nwc()
    first = nwc.NWCWeight(w, device=device)
    copies = [nwc.NWCWeight.from_tensors(first.out_features, first.in_features, first.block,
                                         **{name: t.clone() for name, t in first.tensors().items()},
                                         device=device, layout=first.layout) for _ in range(sets - 1)]
    return [nwc.NWCLinear(w=c, device=device) for c in [first, *copies]]


def _case(name: str, n: int, k: int, m: int, variant: str, device: torch.device) -> Case:
    xo = 2 * (m * k + m * n)
    q8 = variant.startswith("w12.q8")
    extra: dict = {"layer": name}
    if variant in ("cublas", "torch"):
        nbytes, op = 2.0 * n * k + xo, "linear"
    elif variant == "nwc":
        nbytes, op = n * k * _NWC_BITS / 8 + xo, "nwc.linear"
        extra["nwc"] = {}  # filled in setup (the row holds this dict)
    else:
        nbytes, op = _w12_bytes(n, k, q8) + xo, "w12.matmul_q8" if q8 else "w12.matmul"
    group = f"{name}-M{m}"

    def setup() -> Prepared:
        import w12

        sets = rotations(nbytes, device)
        ws = _Weights.get(n, k, 1 if variant == "nwc" else sets, device, packed=variant.startswith("w12."))
        xs = _inputs(m, k, sets, device)
        cols = _cols(n, device)
        held: list = []  # the peer's modules, dropped in teardown
        tiles: list = []  # the runtime layout of the packs ("w12.flow", "w12.q8.flow"), dropped in teardown
        if variant in ("cublas", "torch"):
            fns = [(lambda x=x, w=w: F.linear(x, w)) for x, w in zip(xs, ws["bf16"][:sets])]
        elif variant == "nwc":
            held += _nwc_linears(ws["bf16"][0], sets, device)
            stored = sum(t.nbytes for t in held[0].w.tensors().values())
            case.bytes = float(stored + xo)
            case.extra["nwc"].update(version=getattr(_nwc(), "__version__", None), stored_bytes=stored,
                                     bits_per_weight=8.0 * stored / (n * k))
            fns = [(lambda x=x, lin=lin: lin(x)) for x, lin in zip(xs, held)]
        else:
            packs = ws["w12"][:sets]
            case.bytes = _read_bytes(packs[0], q8) + xo
            fn = w12.matmul_q8 if q8 else w12.matmul
            if variant in ("w12.flow", "w12.q8.flow"):  # the default form: w12.matmul on the runtime layout
                tiles += [w12.layout.tile(p) for p in packs]
                case.bytes = _tiled_read_bytes(tiles[0], q8) + xo
                packs = tiles
            forced = {"w12.tc": "tc", "w12.gemv": "gemv", "w12.mma": "mma", "w12.torch": "torch",
                      "w12.q8.torch": "torch"}.get(variant)

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
            if held:
                assert_bitwise_equal(held[0].w.dequant()[cols], w[cols], msg=f"{variant} {group} dequantized rows")

        def teardown() -> None:
            xs.clear()
            fns.clear()
            held.clear()
            tiles.clear()

        return Prepared(fns=fns, check=check, graph_safe=True, teardown=teardown)

    case = Case(op=op, variant=variant, shape=group, dims={"M": m, "N": n, "K": k}, flops=2.0 * m * n * k,
                bytes=float(nbytes), setup=setup, group=group, baseline=baseline_variant(device), extra=extra)
    return case


def _step_picks(count: int) -> list[int]:
    """The decode step's layers whose outputs `check` compares with fp64: the first, a third, the middle, the last."""
    return sorted({0, count // 3, count // 2, count - 1})


class _StepWeights:
    """The decode step's weights, drawn layer by layer from one seeded generator: the BF16 set (the baseline), or
    the W12 packs with the BF16 weight of the checked layers only (`_step_picks`). Both sets of hybrid-27b together
    (about 90 GB) do not fit an 80 GB GPU, and the packs alone take three quarters of the BF16 set."""

    _key = None
    _val: dict = {}

    @classmethod
    def get(cls, shapes: ModelShapes, device: torch.device, packed: bool) -> dict:
        key = (shapes.name, str(device), packed)
        if cls._key != key:
            cls.release()
            cls._key, cls._val = key, {"layers": [], "w12": []}
        v = cls._val
        if not v["layers"]:
            import w12

            dims = [(name, n, k) for name, (n, k) in shapes.linears.items()
                    for _ in range(shapes.linear_counts.get(name, shapes.layers))]
            keep = set(_step_picks(len(dims)))
            g = torch.Generator(device=device).manual_seed(_SEED)
            for i, (name, n, k) in enumerate(dims):
                w = (torch.randn(n, k, device=device, generator=g) * k**-0.5).to(torch.bfloat16)
                x = torch.randn(1, k, device=device, generator=g).to(torch.bfloat16)
                if packed:  # the planes (w12.matmul's variants; "w12.tiled" tiles them)
                    v["w12"].append(w12.pack(w, layout="planes"))
                v["layers"].append((name, w if not packed or i in keep else None, x))
                del w
        return v

    @classmethod
    def release(cls) -> None:
        cls._key, cls._val = None, {}


def _step_case(shapes: ModelShapes, variant: str, device: torch.device) -> Case:
    linears = [(n, k) for name, (n, k) in shapes.linears.items()
               for _ in range(shapes.linear_counts.get(name, shapes.layers))]
    flops = sum(2.0 * n * k for n, k in linears)
    xo = sum(2.0 * (k + n) for n, k in linears)
    wb = sum((_w12_bytes(n, k, False) if variant.startswith("w12") else 2.0 * n * k) for n, k in linears)

    def setup() -> Prepared:
        import w12

        _Weights.release()  # the per-layer sets (up to the LM head's) are not needed any more
        v = _StepWeights.get(shapes, device, packed=variant.startswith("w12"))
        layers = v["layers"]
        if variant == "w12.tiled":  # the runtime layout alone, each pack dropped once tiled (memory)
            from w12 import layout

            tiles = []
            for i, p in enumerate(v["w12"]):
                tiles.append(layout.tile(p))
                v["w12"][i] = None
            case.bytes = sum(t.nbytes for t in tiles) + xo
            pairs = [(x, t) for (_, _, x), t in zip(layers, tiles)]

            def step():
                return [w12.matmul_tiled(x, t) for x, t in pairs]
        elif variant == "w12":
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
            for i in _step_picks(len(layers)):
                name, w, x = layers[i]
                cols = _cols(w.shape[0], device)
                ref64 = (x.double() @ w[cols].double().T).cpu()
                assert_close(outs[i][:, cols], ref64, F.linear(x, w)[:, cols], msg=f"decode-step {variant} layer {i}")

        def teardown() -> None:
            pairs.clear()
            _StepWeights.release()  # tens of GB on hybrid-27b: do not hold them into later groups

        return Prepared(fns=[step], check=check, graph_safe=True, teardown=teardown)

    case = Case(op="decode_step", variant=variant, shape="decode-step", dims={"M": 1, "linears": len(linears)},
                flops=flops, bytes=wb + xo, setup=setup, group="decode-step", baseline="cublas",
                extra={"shapes": shapes.name}, alone=True)
    return case


@register("w12", ops=("w12.matmul", "w12.matmul_q8", "decode_step", "nwc.linear"))
def cases(shapes: ModelShapes, device: torch.device) -> list[Case]:
    device = torch.device(device)
    if device.type != "cuda" and shapes.name != "tiny":
        return []
    ms = M_VALUES if device.type == "cuda" else (1, 4)
    layers = dict(shapes.linears)
    layers["lm_head.linear"] = shapes.lm_head
    kv = _kernel_variants(device)
    out = [_case(name, n, k, m, v, device) for name, (n, k) in layers.items() for m in ms
           for v in [baseline_variant(device), *kv, *_peer_variants(device, m)]]
    if device.type == "cuda":  # every linear of the model in one call: a GPU figure (CUDA graph); the CPU has the rows
        out += [_step_case(shapes, v, device) for v in ("cublas", "w12", *(["w12.tiled"] if "w12.flow" in kv else []))]
    return out
