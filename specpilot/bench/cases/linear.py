"""Baselines: cuBLAS BF16 `F.linear` on every linear of a shape set, and the LM head + argmax.

Op "linear" (variant "cublas") at M in {1, 2, 4, 8, 16, 32} for each entry of
`shapes.linears`, and op "lm_head" (variant "cublas": `F.linear(x, W_head).argmax(-1)`).
Other operators put their variants in the same group (`<layer>-M<m>`, `lm_head-M<m>`) with
`baseline=baseline_variant(device)` to be timed side by side against these.
On a CPU only the "tiny" shape set yields cases (demo scale), and the variant is "torch": torch's CPU
matmul, not cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specpilot.testing import assert_close

from ..registry import Case, Prepared, register, rotations
from ..shapes import ModelShapes

M_VALUES = (1, 2, 4, 8, 16, 32)
_CHECK_COLS = 512  # output features compared against fp64 (strided over all of N)
_SEED = 1234


def baseline_variant(device) -> str:
    """The name of the F.linear baseline: "cublas" on a GPU, "torch" (the CPU matmul) elsewhere."""
    return "cublas" if torch.device(device).type == "cuda" else "torch"


def _weights(n: int, k: int, sets: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    # Scaled so outputs are O(1), like a trained layer's.
    return [(torch.randn(n, k, device=device, generator=g) * k**-0.5).to(torch.bfloat16) for _ in range(sets)]


def _inputs(m: int, k: int, sets: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(m, k, device=device, generator=g).to(torch.bfloat16) for _ in range(sets)]


def _linear_case(name: str, n: int, k: int, m: int, device: torch.device) -> Case:
    nbytes = 2 * (m * k + n * k + m * n)

    def setup() -> Prepared:
        sets = rotations(nbytes, device)
        ws = _weights(n, k, sets, device, _SEED + n + k)
        xs = _inputs(m, k, sets, device, _SEED + m)
        fns = [(lambda x=x, w=w: F.linear(x, w)) for x, w in zip(xs, ws)]

        def check() -> None:
            out = fns[0]()
            cols = torch.arange(0, n, max(1, n // _CHECK_COLS), device=device)[:_CHECK_COLS]
            x, w = xs[0], ws[0][cols]
            ref64 = (x.double() @ w.double().T).cpu()
            same = (x.float() @ w.float().T).to(torch.bfloat16)  # same-precision PyTorch result
            assert_close(out[:, cols], ref64, same, msg=f"linear {name} M{m}")

        def teardown() -> None:
            ws.clear()
            xs.clear()

        return Prepared(fns=fns, check=check, graph_safe=True, teardown=teardown)

    shape = f"{name}-M{m}"
    base = baseline_variant(device)
    return Case(op="linear", variant=base, shape=shape, dims={"M": m, "N": n, "K": k},
                flops=2.0 * m * n * k, bytes=float(nbytes), setup=setup, group=shape, baseline=base,
                extra={"layer": name})


def check_argmax(idx: torch.Tensor, x: torch.Tensor, w: torch.Tensor, *, chunk: int = 16384) -> None:
    """`idx[m]` must be an argmax of x[m] @ w.T recomputed in fp32, up to rounding: its logit may
    trail the fp32 maximum by at most the bf16 rounding of the logits plus the fp32 accumulation
    bound (K * 2^-24 * sum |x| |w|), so that ties within rounding are accepted."""
    m, k = x.shape
    if idx.shape != (m,) or idx.dtype != torch.int64:
        raise AssertionError(f"argmax: expected int64 of shape ({m},), got {idx.dtype} {tuple(idx.shape)}")
    if bool(((idx < 0) | (idx >= w.shape[0])).any()):
        raise AssertionError(f"argmax: index out of range [0, {w.shape[0]})")
    xf, xa = x.float(), x.float().abs()
    best = torch.full((m,), -float("inf"), device=x.device)
    for s in range(0, w.shape[0], chunk):
        best = torch.maximum(best, (xf @ w[s:s + chunk].float().T).amax(-1))
    wi = w[idx].float()  # [M, K]: the chosen rows
    got = (xf * wi).sum(-1)
    mag = (xa * wi.abs()).sum(-1)
    tol = 2.0**-7 * (best.abs() + got.abs()) + 2 * k * 2.0**-24 * mag
    gap = best - got
    bad = gap > tol
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(f"argmax row {i}: picked {int(idx[i])} with logit {float(got[i]):.6g}, "
                             f"max is {float(best[i]):.6g} (gap {float(gap[i]):.3g} > tolerance {float(tol[i]):.3g})")


def _lm_head_case(v: int, k: int, m: int, device: torch.device) -> Case:
    nbytes = 2 * (v * k + m * k) + 8 * m  # weights + hidden states read, indices written

    def setup() -> Prepared:
        sets = rotations(nbytes, device)
        ws = _weights(v, k, sets, device, _SEED + v)
        xs = _inputs(m, k, sets, device, _SEED + 7 * m)
        fns = [(lambda x=x, w=w: F.linear(x, w).argmax(-1)) for x, w in zip(xs, ws)]

        def check() -> None:
            check_argmax(fns[0](), xs[0], ws[0])

        def teardown() -> None:
            ws.clear()
            xs.clear()

        return Prepared(fns=fns, check=check, graph_safe=True, teardown=teardown)

    shape = f"lm_head-M{m}"
    base = baseline_variant(device)
    return Case(op="lm_head", variant=base, shape=shape, dims={"M": m, "V": v, "K": k},
                flops=2.0 * m * v * k, bytes=float(nbytes), setup=setup, group=shape, baseline=base)


@register("linear", ops=("linear", "lm_head"))
def cases(shapes: ModelShapes, device: torch.device) -> list[Case]:
    device = torch.device(device)
    if device.type != "cuda" and shapes.name != "tiny":
        return []
    out = [_linear_case(name, n, k, m, device) for name, (n, k) in shapes.linears.items() for m in M_VALUES]
    v, k = shapes.lm_head
    out += [_lm_head_case(v, k, m, device) for m in M_VALUES]
    return out
