"""How many tokens a certified screen keeps, by its code width, on the benchmark's heads and hidden states: the
trade-off between the screen's bytes and its survivors (docs/lmhead.md, "Screen width against survivors").

    python -m specpilot.bench.screens [--shapes hybrid-27b] [--rows 8] [--bits 4 5 6 7 8] [--json FILE]

For every code width b (codes in [-(2^(b-1) - 1), 2^(b-1) - 1] with a BF16 scale per row and `--group` columns, as
lmhead's INT8 and INT4 screens store them) and each hidden-state form ("one part": int8 per 128 columns, as the
screen reads rows above `split_rows`; "two parts": the first part's rounding quantised again, as it reads up to 8
rows), the screen's interval of every logit is formed from docs/lmhead.md's bound,

    R = min(Hölder, Cauchy-Schwarz) of the weights' rounding + the same of the hidden states' rounding,

in fp64 (exact here; the kernels add fp32 rounding terms below 10^-3 of R), and a token survives where its upper
end reaches the row's best lower end. Heads and hidden states are the `lmhead.argmax` benchmark's: random BF16
weights N(0, 1/H) and the peaked (8 sigma), moderate (1.5 sigma) and flat regimes
(specpilot/bench/cases/lmhead.py). Every interval is checked to hold the fp64 logit. Counting needs no GPU: the
survivors are a property of the bound, not of the kernel's speed; the bytes column is what a screen of that width
reads (codes plus its three BF16 tables per group), at the copy rate the time it cannot beat.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

__all__ = ["screen_survivors", "main"]

_CHUNK = 8192  # head rows per fp64 block


def _quantize(x: torch.Tensor, group: int, qmax: int, scale_dtype) -> torch.Tensor:
    """The screen's values of x [R, H] (fp64), as lmhead builds them: per group, scale = max|x| / qmax rounded up in
    `scale_dtype` (1 for a zero group), codes round(x / scale) in [-qmax, qmax]; returns scale * codes."""
    from lmhead.ops import _dequantize
    from lmhead.ops import _quantize as quantize

    q, s = quantize(x, group, scale_dtype, qmax)
    return _dequantize(q, s, group)


def _per_group(x: torch.Tensor, group: int, how: str) -> torch.Tensor:
    """[R, G]: the 1-norm ("sum") or the largest magnitude ("max") of each group of x's rows."""
    from lmhead.ops import _groups

    g = _groups(x.abs(), group)
    return g.sum(-1) if how == "sum" else g.amax(-1)


def _count(w: torch.Tensor, h: torch.Tensor, widths, forms, group: int) -> dict:
    """`screen_survivors` for every code width in `widths` and hidden-state form (parts) in `forms`, keyed (bits,
    parts), in one pass over the head: its fp64 logits once, each width's codes once for every form."""
    hd = h.double()
    M, H = hd.shape
    hidden, hq, rest = {}, torch.zeros_like(hd), hd
    for parts in range(1, max(forms) + 1):  # each part quantises what the parts before it left
        part = _quantize(rest, 128, 127, torch.float32)  # the hidden states' parts: int8 per 128 columns
        hq, rest = hq + part, rest - part
        hidden[parts] = (hq, _per_group(rest, group, "max"), rest.norm(dim=-1))
    a1, hn = _per_group(hd, group, "sum"), hd.norm(dim=-1)
    V = w.shape[0]
    keys = [(b, p) for b in widths for p in forms]
    lo = {k: torch.empty(M, V, dtype=torch.float64) for k in keys}
    up = {k: torch.empty(M, V, dtype=torch.float64) for k in keys}
    exact = torch.empty(M, V, dtype=torch.float64)
    for r0 in range(0, V, _CHUNK):
        cols = slice(r0, r0 + _CHUNK)
        wd = w[cols].double()
        exact[:, cols] = hd @ wd.T
        for b in widths:
            ap = _quantize(wd, group, 2 ** (b - 1) - 1, torch.bfloat16)
            dw = wd - ap
            ew = torch.minimum(a1 @ _per_group(dw, group, "max").T, hn[:, None] * dw.norm(dim=-1)[None])
            n1, apn = _per_group(ap, group, "sum"), ap.norm(dim=-1)
            for p in forms:
                hq, dmax, dn = hidden[p]
                eh = torch.minimum(dmax @ n1.T, dn[:, None] * apn[None])
                y = hq @ ap.T
                lo[(b, p)][:, cols], up[(b, p)][:, cols] = y - ew - eh, y + ew + eh
    out = {}
    for b, p in keys:
        L, U = lo[(b, p)], up[(b, p)]
        if not bool(((L <= exact) & (exact <= U)).all()):
            raise AssertionError(f"screens: an interval misses its fp64 logit ({b}-bit codes, {p} part(s))")
        surv = (U >= L.amax(-1, keepdim=True)).sum(-1)
        radius = ((U - L) / 2).median(-1).values / exact.std(-1)
        out[(b, p)] = {"survivors": surv.tolist(), "radius_over_sigma": round(float(radius.median()), 3)}
    return out


def screen_survivors(w: torch.Tensor, h: torch.Tensor, bits: int, parts: int, group: int = 128) -> dict:
    """Survivors per hidden row of a screen with `bits`-bit codes (per `group` columns) and the hidden states in
    `parts` int8 parts (1 or 2), on head w [V, H] (BF16) and rows h [M, H] (BF16); and the median radius over the
    spread of the row's logits (std). Raises if an interval misses the fp64 logit."""
    return _count(w, h, (bits,), (parts,), group)[(bits, parts)]


def _bytes(V: int, H: int, bits: int, group: int) -> float:
    return V * H * bits / 8 + 3 * V * (-(-H // group)) * 2  # codes + scale, error and 1-norm tables (BF16)


def measure(shapes: str, rows: int, bits: list[int], group: int) -> dict:
    from .cases import lmhead as cases
    from .cases import linear
    from .shapes import SHAPE_SETS

    V, H = SHAPE_SETS[shapes].lm_head
    w = linear._weights(V, H, 1, torch.device("cpu"), linear._SEED + V)[0]
    out = {"shapes": shapes, "V": V, "H": H, "rows": rows, "group": group, "screens": []}
    for regime in cases.REGIMES:
        h, gap = cases._hidden(w, rows, regime, cases._SEED + 17 * rows + sum(map(ord, regime)))
        t0 = time.time()
        counts = _count(w, h, bits, (1, 2), group)
        for (b, parts), r in counts.items():
            r.update(regime=regime, gap_sigma=gap, bits=b, hidden_parts=parts, screen_GB=_bytes(V, H, b, group) / 1e9)
            out["screens"].append(r)
            print(f"{regime:8s} {b}-bit codes, hidden in {parts} part(s): {r['screen_GB']:.3f} GB, radius "
                  f"{r['radius_over_sigma']:.2f} sigma, survivors {r['survivors']}", flush=True)
        print(f"{regime}: {time.time() - t0:.0f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from .shapes import SHAPE_SETS

    ap = argparse.ArgumentParser(prog="python -m specpilot.bench.screens", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="hybrid-27b", choices=sorted(SHAPE_SETS))
    ap.add_argument("--rows", type=int, default=8, help="hidden rows per regime")
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 5, 6, 7, 8], help="code widths (2..8)")
    ap.add_argument("--group", type=int, default=128, help="columns per weight scale")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if any(not 2 <= b <= 8 for b in args.bits):
        ap.error(f"--bits must lie in 2..8, got {args.bits}")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = measure(args.shapes, args.rows, args.bits, args.group)
    out["machine"] = f"{platform.processor() or platform.machine()}, torch {torch.__version__}, Python " \
                     f"{platform.python_version()}; command: python -m specpilot.bench.screens " + " ".join(sys.argv[1:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
