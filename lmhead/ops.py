"""The certified greedy head in three layers: launch-only functions (`_plan` decides the kernels of a head,
`_launch_*` run them without a host sync), the torch custom-op registration, and `CertifiedHead`.

A call screens every token with the cheap copy and its rigorous interval [L, U] (docs/lmhead.md),
keeps the tokens whose U reaches the row's best L (or the k-th best L for top-k), recomputes those
exactly, and takes the answer from the exact logits. A row whose survivors overflow the capacity, or
whose hidden state is not finite, is redone over the whole vocabulary by the same exact code in the
same launch sequence. After a call whose rows overflowed, the next calls with as many rows skip the
screen (the early fallback, a device-side policy per row count: `lmhead_policy_kernel`). Nothing syncs
the host; CUDA graphs capture `argmax` and `topk`.
"""

from __future__ import annotations

import functools
import weakref

import torch
import triton

import autotune
from autotune.hardware import gpu_slug, host_only, is_interpreter

from .configs import AUTO_SCREEN, HeadConfig, head_config
from .kernels.screen import (lmhead_exact_kernel, lmhead_policy_kernel, lmhead_prep_kernel, lmhead_screen_kernel,
                             lmhead_select_kernel)
from .reference import dense_weight, round_up_bf16

__all__ = ["CertifiedHead", "screen_bounds", "VARIANTS", "SCREENS", "DEFAULT_CAPACITY", "GROUP", "NAN_ID", "MAX_SKIP"]

OP = "lmhead.argmax"
# "triton": the kernels of lmhead/kernels/screen.py (tl.dot: wgmma or mma.sync by tile shape); "reference":
# the same steps in torch (CPU tensors without the interpreter).
VARIANTS = autotune.Variants(OP, by_arch={8: "triton"}, known=("triton", "reference"), fallback="reference")
SCREENS = ("int8", "int4", "w12", "none")
QUANTISED = ("int8", "int4")  # screens of integer codes with group scales, against int8 hidden states
DEFAULT_CAPACITY = 2048
GROUP = 128  # columns per scale / error group of the screen
_PLANS = autotune.PlanCache()
_U = 2.0**-22  # unit roundoff allowed per fp32 addition (twice fp32's: covers tensor cores' truncating accumulation)
_MIN_KEY = -(2**63)
_NAN_HIGH = 0x7FFFFFFF  # the high word of a NaN logit's order key: larger than every number's
NAN_ID = -1  # argmax of a row whose exact logits hold a NaN: no token wins, and -1 indexes no embedding row
MAX_SKIP = 64  # the longest run of calls the early fallback sends straight to the exact head
# the early-fallback state of one row count (int32, lmhead_policy_kernel): this call skips the screen, calls
# left to skip, the run a failed screen starts, calls, calls skipped
_SKIP, _LEFT, _RUN, _CALLS, _SKIPPED = range(5)
_POLICY_START = (0, 0, 1, 0, 0)


def gamma(n: int) -> float:
    """n u / (1 - n u): the relative bound on any order of n fp32 additions of exact products."""
    return n * _U / (1 - n * _U)


def _plan(variant: str | None, device: torch.device, V: int, H: int) -> autotune.Plan:
    chosen, _ = VARIANTS.choose(variant, device, where="lmhead.CertifiedHead")
    key = (chosen, str(device), V, H, autotune.forced(OP), is_interpreter())

    def make() -> autotune.Plan:
        if chosen == "reference" or host_only(device):
            return autotune.Plan(chosen, "reference")
        return autotune.Plan(chosen, "triton", head_config(chosen, V, H, is_interpreter(), device))

    return _PLANS.get(key, make)


# --------------------------------------------------------------------------------------------
# Build: the screen's tables, once per head.
# --------------------------------------------------------------------------------------------


def _round_up_f32(x: torch.Tensor) -> torch.Tensor:
    """The least fp32 >= x (x fp64, finite or +inf)."""
    y = x.float()
    return torch.where(y.double() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    """[R, H] -> [R, G, group] (zero-padded)."""
    R, H = w.shape
    G = -(-H // group)
    pad = torch.zeros(R, G * group, dtype=w.dtype, device=w.device)
    pad[:, :H] = w
    return pad.view(R, G, group)


def _w12_view_rows(packed, r0: int, r1: int) -> torch.Tensor:
    """The W12 8-bit view of rows r0:r1 as fp64 `[r1 - r0, K]` (docs/w12-format.md), escapes reading as their
    stored code 0 (the view of hi byte 0)."""
    from w12.reference import q8_view_bits  # a W12 head: the one allowed sibling import (docs/architecture.md)

    bits = q8_view_bits(packed.hi[r0:r1, :packed.K].int(), packed.e0[r0:r1].int()[:, None])
    return (bits << 16).view(torch.float32).double()


def _build_tables(weight, screen: str, group: int, chunk: int = 8192) -> dict:
    """The screen copy and its bound tables, built row chunk by row chunk in fp64 (exact here), each bound
    rounded up: err[v, g] = max_k |W - screen weight| (BF16), dw[v] = ||W_v - screen row||_2,
    rq[v] = ||screen row||_2 and rw[v] =
    ||W_v||_2 (fp32; rw = +inf for a row with a non-finite weight: it always survives). INT8 adds the codes
    q, the BF16 scales and n1[v, g] = ||screen row's group||_1 (BF16), for the hidden states' own rounding; INT4
    the same with codes in [-7, 7], packed two to a byte (`_pack4`) as q4."""
    w12 = not isinstance(weight, torch.Tensor)
    V, H = (weight.N, weight.K) if w12 else weight.shape
    dev = weight.hi.device if w12 else weight.device
    G = -(-H // group)
    t = {"err": torch.empty(V, G, dtype=torch.bfloat16, device=dev),
         "rq": torch.empty(V, dtype=torch.float32, device=dev), "rw": torch.empty(V, dtype=torch.float32, device=dev),
         "dw": torch.empty(V, dtype=torch.float32, device=dev)}
    if screen == "int8":
        t["q"] = torch.empty(V, H, dtype=torch.int8, device=dev)
    if screen == "int4":
        t["q4"] = torch.empty(V, G * group // 2, dtype=torch.uint8, device=dev)
    if screen in QUANTISED:
        t["scale"] = torch.empty(V, G, dtype=torch.bfloat16, device=dev)
        t["n1"] = torch.empty(V, G, dtype=torch.bfloat16, device=dev)
    for r0 in range(0, V, chunk):
        r1 = min(V, r0 + chunk)
        wd = (dense_weight(weight)[r0:r1] if not w12 else _decode_rows(weight, r0, r1)).double()
        finite = torch.isfinite(wd).all(-1)
        wd = torch.where(torch.isfinite(wd), wd, torch.zeros_like(wd))
        if screen in QUANTISED:
            q, scale = _quantize(wd, group, qmax=127 if screen == "int8" else 7)
            approx = _dequantize(q, scale, group)
            if screen == "int8":
                t["q"][r0:r1] = q.to(torch.int8)
            else:
                t["q4"][r0:r1] = _pack4(q, group)
            t["scale"][r0:r1] = scale
            t["n1"][r0:r1] = round_up_bf16(_groups(approx.abs(), group).sum(-1) * (1 + 2.0**-40))
        else:
            approx = _w12_view_rows(weight, r0, r1)
        t["err"][r0:r1] = round_up_bf16(_groups(wd - approx, group).abs().amax(-1))
        t["dw"][r0:r1] = _round_up_f32((wd - approx).norm(dim=-1) * (1 + 2.0**-40))
        t["rq"][r0:r1] = _round_up_f32(approx.norm(dim=-1) * (1 + 2.0**-40))
        rw = _round_up_f32(wd.norm(dim=-1) * (1 + 2.0**-40))
        t["rw"][r0:r1] = torch.where(finite, rw, torch.full_like(rw, float("inf")))
    return t


def _dequantize(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """Codes [R, H] times their group scales [R, G] (`_quantize`'s outputs), in fp64: exact for integer codes of up
    to 8 bits and fp32 or BF16 scales."""
    R, H = q.shape
    return (_groups(q.double(), group) * scale.double()[..., None]).view(R, -1)[:, :H]


def _quantize(x: torch.Tensor, group: int, scale_dtype=torch.bfloat16, qmax: int = 127):
    """(codes fp64 [R, H] in [-qmax, qmax], scales [R, G] in `scale_dtype`): per group of `group` columns,
    scale = max|x| / qmax rounded up (1 for an all-zero group), codes = round(x / scale)."""
    R, H = x.shape
    g = _groups(x, group)
    amax = g.abs().amax(-1)
    if scale_dtype == torch.bfloat16:
        scale = round_up_bf16(amax / qmax)
    else:
        scale = _round_up_f32(amax / qmax)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    q = torch.round(g / scale.double()[..., None]).clamp(-qmax, qmax)
    return q.view(R, -1)[:, :H], scale


def _pack4(q: torch.Tensor, group: int) -> torch.Tensor:
    """INT4 codes [R, H] (in [-7, 7]) -> uint8 [R, G group / 2]: in group g, byte j holds the code of column
    g group + j in its low nibble and of column g group + group / 2 + j in its high one (two's complement; columns
    past H are 0), so a kernel reads a group as two halves of group / 2 columns, each one int8 product."""
    R, H = q.shape
    g = _groups(q.to(torch.int16), group)  # [R, G, group], zero-padded
    lo, hi = g[..., : group // 2] & 0xF, g[..., group // 2:] & 0xF
    return (lo | (hi << 4)).to(torch.uint8).reshape(R, -1)


def _unpack4(packed: torch.Tensor, group: int, H: int) -> torch.Tensor:
    """`_pack4`'s inverse: int8 codes [R, H]."""
    R = packed.shape[0]
    b = packed.to(torch.int16).view(R, -1, group // 2)
    lo, hi = ((b & 0xF) ^ 8) - 8, (((b >> 4) & 0xF) ^ 8) - 8
    return torch.cat([lo, hi], -1).reshape(R, -1)[:, :H].to(torch.int8)


def _decode_rows(packed, r0: int, r1: int) -> torch.Tensor:
    """The exact BF16 rows r0:r1 of a W12 head (the record sliced, then w12.unpack)."""
    import w12  # a W12 head: `lmhead -> w12` is the one allowed sibling import (docs/architecture.md)

    e0, e1 = int(packed.esc_rowptr[r0]), int(packed.esc_rowptr[r1])
    sub = w12.W12Weight(packed.hi[r0:r1], packed.lo[r0:r1], packed.e0[r0:r1], packed.esc_rowptr[r0:r1 + 1] - e0,
                        packed.esc_col[e0:e1], packed.esc_val[e0:e1], packed.K)
    return w12.unpack(sub)


# --------------------------------------------------------------------------------------------
# 1. Launch-only functions.
# --------------------------------------------------------------------------------------------


def _prep(h: torch.Tensor, group: int, int8: bool, split: bool = False) -> dict:
    """Per hidden row, in fp64 then rounded up to fp32 (sums of at most 2^16 terms, 2^-53 relative error
    each): a [M, G] = ||h_g||_1, hn [M] = ||h||_2, bad [M] (not finite: the full exact path). INT8 adds
    the quantised hidden states hq (int8 [M, H]), their scales sh [M, G] (fp32), errors eh [M, G] =
    max |h - sh hq| and hqn [M] = ||sh hq||_2. split: two parts, hq and sh [2 M, ...], rows M.. the first part's
    rounding h - sh hq quantised the same way; eh, dh the rounding left after both, hqn the sum of the parts'
    norms."""
    hd = h.double()
    fin = torch.isfinite(hd)
    bad = (~fin.all(-1)).to(torch.int32)
    hd = torch.where(fin, hd, torch.zeros_like(hd))
    up = 1 + 2.0**-36
    p = {"a": _round_up_f32(_groups(hd.abs(), group).sum(-1) * up).contiguous(),
         "hn": _round_up_f32(hd.norm(dim=-1) * up), "bad": bad}
    if int8:
        qs, shs, norm, rest = [], [], 0, hd
        for _ in range(2 if split else 1):  # each part quantises what the parts before it left (exact in fp64)
            q, sh = _quantize(rest, group, torch.float32)
            approx = _dequantize(q, sh, group)
            qs.append(q)
            shs.append(sh)
            norm = norm + approx.norm(dim=-1)
            rest = rest - approx
        p["hq"] = torch.cat(qs).to(torch.int8).contiguous()
        p["sh"] = torch.cat(shs).contiguous()
        p["eh"] = _round_up_f32(_groups(rest, group).abs().amax(-1)).contiguous()
        p["dh"] = _round_up_f32(rest.norm(dim=-1) * up)
        p["hqn"] = _round_up_f32(norm * up)
    return p


def _prep_triton(h: torch.Tensor, group: int, int8: bool, split: bool = False) -> dict:
    """`_prep` in one launch (lmhead_prep_kernel), bounded the same way; also the call's per-row state:
    best (-inf), count (0) and key (the least key)."""
    M, H = h.shape
    G = -(-H // group)
    dev = h.device
    f32 = dict(dtype=torch.float32, device=dev)
    p = {"a": torch.empty(M, G, **f32), "hn": torch.empty(M, **f32), "bad": torch.empty(M, dtype=torch.int32, device=dev),
         "best": torch.empty(M, **f32), "count": torch.empty(M, dtype=torch.int32, device=dev),
         "key": torch.empty(M, dtype=torch.int64, device=dev)}
    if int8:
        parts = 2 if split else 1
        p.update(hq=torch.empty(parts * M, H, dtype=torch.int8, device=dev), sh=torch.empty(parts * M, G, **f32),
                 eh=torch.empty(M, G, **f32), dh=torch.empty(M, **f32), hqn=torch.empty(M, **f32))
    a = p["a"]
    lmhead_prep_kernel[(M,)](h, a, p["hn"], p["bad"], p.get("hq", a), p.get("sh", a), p.get("eh", a), p.get("dh", a),
                             p.get("hqn", a),
                             p["best"], p["count"], p["key"], M, H, G, h.stride(0), 1 + (H + 8) * 2.0**-23,
                             GP=triton.next_power_of_2(G), GROUP=group, INT8=int8, SPLIT=int8 and split, num_warps=4)
    return p


def _key_torch(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The kernels' int64 order key (lmhead/kernels/screen.py) in torch."""
    x = torch.where(x == 0, torch.zeros_like(x), x)
    b = x.view(torch.int32).long()
    o = torch.where(b >= 0, b, b ^ 0x7FFFFFFF)
    o = torch.where(torch.isnan(x), torch.full_like(o, 0x7FFFFFFF), o)
    return (o << 32) | (0xFFFFFFFF - ids.long())


def _ids_of(key: torch.Tensor) -> torch.Tensor:
    return 0xFFFFFFFF - (key & 0xFFFFFFFF)


def _argmax_of(key: torch.Tensor) -> torch.Tensor:
    """Token ids of a row's best keys; NAN_ID where the best is a NaN (every NaN logit survives the screen: a
    non-finite hidden row takes the full pass, a head row with a non-finite weight has an infinite bound)."""
    return torch.where((key >> 32) == _NAN_HIGH, torch.full_like(key, NAN_ID), _ids_of(key))


def _weight_args(hd: "CertifiedHead"):
    """(w_ptr, lo, e0, rowptr, esc_col, esc_val, stride_w, stride_lo, W12) for the exact kernel."""
    if hd.packed is not None:
        p = hd.packed
        return (p.hi, p.lo, p.e0, p.esc_rowptr, p.esc_col, p.esc_val, p.hi.stride(0), p.lo.stride(0), True)
    w = hd.weight
    return (w, w, w, w, w, w, w.stride(0), 0, False)


def _split(hd: "CertifiedHead", M: int) -> bool:
    """Whether a call with M hidden rows reads them in two int8 parts (quantised screens, one launch of at most
    `split_rows` rows: 2 M rows still fit the 16-row tile of the screen's dot)."""
    cfg = hd.cfg if hd.cfg is not None else HeadConfig()
    return hd.screen in QUANTISED and M <= min(cfg.split_rows, cfg.max_rows)


def _launch_screen(hd: "CertifiedHead", h, p, lo, up, best, skip=None):
    cfg, t = hd.cfg, hd.tables
    M = h.shape[0]
    quant = hd.screen in QUANTISED
    split = _split(hd, M)
    if quant:
        w, sc, n1, hq, sh, eh, dh, hqn = (t["q"] if hd.screen == "int8" else t["q4"], t["scale"], t["n1"], p["hq"],
                                          p["sh"], p["eh"], p["dh"], p["hqn"])
    else:  # W12 view: the INT8-only arguments are unused (any tensor)
        w, sc, n1, hq, sh, eh, dh, hqn = hd.packed.hi, hd.packed.e0, t["err"], h, p["a"], p["a"], p["hn"], p["hn"]
    G = t["err"].shape[1]
    for m0 in range(0, M, cfg.max_rows):
        m1 = min(M, m0 + cfg.max_rows)
        mp = max(16, triton.next_power_of_2((2 if split else 1) * (m1 - m0)))
        rows = slice(None) if split else slice(m0, m1)  # split: one launch, both parts' rows
        lmhead_screen_kernel[(triton.cdiv(hd.V, cfg.screen_bv),)](
            h[m0:m1], hq[rows], w, sc, t["err"], n1, t["rq"], t["rw"], t["dw"], p["a"][m0:m1], sh[rows], eh[m0:m1],
            dh[m0:m1], hqn[m0:m1], p["hn"][m0:m1], p["bad"][m0:m1], None if lo is None else lo[m0:m1], up[m0:m1],
            best[m0:m1], skip, m1 - m0, hd.V, hd.H, G,
            h.stride(0), w.stride(0), G, hd.gamma_q, hd.gamma, hd.eta, MP=mp, BV=cfg.screen_bv, GROUP=hd.group,
            W12=not quant, INT4=hd.screen == "int4", SPLIT=split, num_warps=cfg.screen_warps,
            num_stages=cfg.screen_stages)


def _packed_decode(device: torch.device) -> tuple[str | None, str | None]:
    """The exact kernel's W12 decode on a GPU: the PTX of w12's packed decode with code 0 -> +0.0, the same bits as
    the plain decode (tests/w12/test_matmul.py runs the text instruction by instruction); (None, None) under the
    interpreter, which runs no PTX."""
    if device.type != "cuda" or is_interpreter():
        return None, None
    return _packed_decode_text()


@functools.cache
def _packed_decode_text() -> tuple[str, str]:
    from w12.kernels.pk_decode import asm_text  # a W12 head: `lmhead -> w12` is the one allowed sibling import

    return asm_text("lo0", "bf16"), asm_text("hi0", "bf16")


def _launch_exact(hd: "CertifiedHead", h, p, surv, out, key, full: bool, every: bool = False, fb=None, skip=None):
    """Survivors (full=False) or the full pass over the rows flagged by p's count and bad (every: all rows;
    skip: the policy state, whose flag sends every row to the full pass and none to the survivors pass)."""
    cfg = hd.cfg
    M = h.shape[0]
    w, lo, e0, rp, ec, ev, sw, sl, w12 = _weight_args(hd)
    asm = _packed_decode(h.device) if w12 else (None, None)
    count = bad = None
    if p is not None:
        count, bad = p["count"], p["bad"]
    for m0 in range(0, M, cfg.max_rows):  # hidden rows in tiles of at most max_rows (MMA rows: 16 or 32)
        m1 = min(M, m0 + cfg.max_rows)
        mp = 16 if m1 - m0 <= 16 else 32
        rows = slice(m0, m1)
        if full:
            grid = (triton.cdiv(hd.V, cfg.exact_bs),)
            cnt = None if every else count[rows]
            bd = None if every else bad[rows]
        else:  # the same tile of hidden rows as the full pass, one program row per hidden row
            grid = (triton.cdiv(hd.capacity, cfg.exact_bs), m1 - m0)
            cnt, bd = count[rows], bad[rows]
        lmhead_exact_kernel[grid](
            h[rows], w, lo, e0, rp, ec, ev, None if surv is None else surv[rows], cnt, bd, fb if full else None,
            skip, None if out is None else out[rows], None if key is None else key[rows], m1 - m0, hd.V, hd.H,
            hd.capacity, h.stride(0), sw, sl, MP=mp, BS=cfg.exact_bs, BK=cfg.exact_bk, W12=w12, FULL=full,
            KEYS=key is not None, ALL=every, ASM_LO=asm[0], ASM_HI=asm[1], num_warps=cfg.exact_warps)


def _restart_policy(state: torch.Tensor) -> None:
    """The early-fallback state of a row count back to `_POLICY_START`, in place on its device (no host sync:
    zeros, then the run)."""
    state.zero_()
    state[_RUN] = _POLICY_START[_RUN]


def _launch_policy(hd: "CertifiedHead", state, count, M: int) -> None:
    """The early fallback's step at the start of a call (count None) or after its selection."""
    lmhead_policy_kernel[(1,)](state, state if count is None else count, M, hd.capacity, MAX_SKIP=MAX_SKIP, BM=128,
                               END=count is not None)


def _survivors(hd: "CertifiedHead", h, thr_from_lo, skip=None):
    """Prep, screen, threshold, select. Returns (p, lo, surv): p holds count, bad, key for the exact passes.
    skip: the policy state; where its flag is set the screen and the selection return at once (counts 0)."""
    M, dev = h.shape[0], h.device
    p = _prep_triton(h, hd.group, hd.screen in QUANTISED, _split(hd, M))
    lo = torch.empty(M, hd.V, dtype=torch.float32, device=dev) if thr_from_lo is not None else None
    up = torch.empty(M, hd.V, dtype=torch.float32, device=dev)
    _launch_screen(hd, h, p, lo, up, p["best"], skip)
    thr = p["best"] if thr_from_lo is None else thr_from_lo(lo, p["bad"])
    surv = torch.empty(M, hd.capacity, dtype=torch.int32, device=dev)
    lmhead_select_kernel[(triton.cdiv(hd.V, hd.cfg.select_bv), M)](up, thr, p["bad"], p["count"], surv, skip, hd.V,
                                                                   hd.capacity, BV=hd.cfg.select_bv)
    p["up"] = up
    return p, lo, surv


def _argmax_triton(hd: "CertifiedHead", h, stats) -> torch.Tensor:
    M, dev = h.shape[0], h.device
    if hd.screen == "none":
        key = torch.full((M,), _MIN_KEY, dtype=torch.int64, device=dev)
        _launch_exact(hd, h, None, None, None, key, full=True, every=True)
        stats.record(None, M, hd)
        return _argmax_of(key)
    state = hd._start_policy(M, "argmax")
    _launch_policy(hd, state, None, M)
    p, _, surv = _survivors(hd, h, None, state)
    _launch_policy(hd, state, p["count"], M)
    _launch_exact(hd, h, p, surv, None, p["key"], full=False, skip=state)
    _launch_exact(hd, h, p, surv, None, p["key"], full=True, fb=stats.counter(dev), skip=state)
    stats.record(p["count"], M, hd, state)
    return _argmax_of(p["key"])


def _topk_triton(hd: "CertifiedHead", h, k: int, stats):
    """Values come from the exact logits themselves (gathered by position), so -0.0 and NaN payloads are kept."""
    M, dev = h.shape[0], h.device
    full = torch.empty(M, hd.V, dtype=torch.float32, device=dev)
    every = torch.arange(hd.V, device=dev).expand(M, -1)
    if hd.screen == "none":
        _launch_exact(hd, h, None, None, full, None, full=True, every=True)
        ids = _key_torch(full, every).topk(k, dim=-1).indices
        stats.record(None, M, hd)
        return full.gather(1, ids), ids

    def kth(lo, bad):
        lo = torch.where(bad[:, None] != 0, torch.full_like(lo, float("-inf")), lo)
        return lo.topk(k, dim=-1).values[:, -1].contiguous()

    state = hd._start_policy(M, "topk")
    _launch_policy(hd, state, None, M)
    p, _, surv = _survivors(hd, h, kth, state)
    _launch_policy(hd, state, p["count"], M)
    sv = torch.empty(M, hd.capacity, dtype=torch.float32, device=dev)
    _launch_exact(hd, h, p, surv, sv, None, full=False, skip=state)
    _launch_exact(hd, h, p, surv, full, None, full=True, fb=stats.counter(dev), skip=state)
    count = p["count"]
    flag = (count > hd.capacity) | (p["bad"] != 0) | (state[_SKIP] != 0)
    live = torch.arange(hd.capacity, device=dev)[None, :] < count.clamp(max=hd.capacity)[:, None]
    sid = torch.where(live, surv.long(), torch.zeros_like(surv, dtype=torch.int64))
    skeys = torch.where(live, _key_torch(sv, sid), torch.full_like(sid, _MIN_KEY))
    spos = skeys.topk(k, dim=-1).indices
    fpos = _key_torch(full, every).topk(k, dim=-1).indices
    ids = torch.where(flag[:, None], fpos, sid.gather(1, spos))
    vals = torch.where(flag[:, None], full.gather(1, fpos), sv.gather(1, spos))
    stats.record(count, M, hd, state)
    return vals, ids


# --------------------------------------------------------------------------------------------
# The torch path ("reference" variant): the same steps in torch, for CPU tensors without Triton.
# --------------------------------------------------------------------------------------------


def _screen_torch(hd: "CertifiedHead", h):
    M = h.shape[0]
    p = _prep(h, hd.group, hd.screen in QUANTISED, _split(hd, M))
    t = hd.tables
    if hd.screen == "w12":
        s = h.float() @ _w12_view_rows(hd.packed, 0, hd.V).float().T
        e = torch.minimum(p["a"] @ t["err"].float().T, p["hn"][:, None] * t["dw"][None, :])
        r = e + hd.gamma * (p["hn"][:, None] * t["rq"][None, :] + p["hn"][:, None] * t["rw"][None, :])
    else:
        q = t["q"] if hd.screen == "int8" else _unpack4(t["q4"], hd.group, hd.H)
        # in fp64 (codes times scales exact, H-term sums within H 2^-53), one rounding to fp32 (covered by the
        # outward widening below): the kernels' order of roundings is theirs, this path's is this one
        wq = _dequantize(q, t["scale"], hd.group)
        hq = _dequantize(p["hq"], p["sh"], hd.group)
        s = (hq[:M] @ wq.T + (hq[M:] @ wq.T if hq.shape[0] > M else 0)).float()  # both parts' screens
        e = (torch.minimum(p["a"] @ t["err"].float().T, p["hn"][:, None] * t["dw"][None, :])
             + torch.minimum(p["eh"] @ t["n1"].float().T, p["dh"][:, None] * t["rq"][None, :]))
        r = e + hd.gamma_q * p["hqn"][:, None] * t["rq"][None, :] + hd.gamma * p["hn"][:, None] * t["rw"][None, :]
    r = (r + hd.eta) * (1 + 2.0**-14)
    r = r + (s.abs() + r) * 2.0**-22
    lim = 2.0**126
    safe = ((p["hn"][:, None] * t["rw"][None, :] < lim) & (p.get("hqn", p["hn"])[:, None] * t["rq"][None, :] < lim)
            & (r < float("inf")) & (s.abs() < float("inf")))
    return (torch.where(safe, s - r, torch.full_like(r, float("-inf"))),
            torch.where(safe, s + r, torch.full_like(r, float("inf"))), p["bad"])


def _exact_torch(hd: "CertifiedHead", h) -> torch.Tensor:
    w = dense_weight(hd.packed if hd.packed is not None else hd.weight).float()
    return h.float() @ w.T


# --------------------------------------------------------------------------------------------
# 2. Torch registration.
# --------------------------------------------------------------------------------------------

_HEADS: "weakref.WeakValueDictionary[int, CertifiedHead]" = weakref.WeakValueDictionary()  # for the custom op


@torch.library.custom_op("specpilot_lmhead::argmax", mutates_args=())
def _argmax_op(hidden: torch.Tensor, head_id: int) -> torch.Tensor:
    return _HEADS[head_id]._argmax_eager(hidden)


@_argmax_op.register_fake
def _(hidden: torch.Tensor, head_id: int) -> torch.Tensor:
    return hidden.new_empty(hidden.shape[0], dtype=torch.int64)


# --------------------------------------------------------------------------------------------
# 3. The public class.
# --------------------------------------------------------------------------------------------


class _Stats:
    """Device-side counters of a head: the last call's survivors per row (the count tensor itself) and the
    rows that took the full exact path (added by the fallback kernel). Nothing here syncs."""

    def __init__(self):
        self.calls = 0
        self.rows = 0
        self.last = None  # int32 [M]: survivors found per row in the last call (may exceed capacity)
        self.last_policy = None  # the last call's early-fallback state (its flag: that call skipped the screen)
        self.last_rows = 0
        self.fallbacks = None  # int64 [1] on the head's device

    def counter(self, device) -> torch.Tensor:
        if self.fallbacks is None:
            self.fallbacks = torch.zeros(1, dtype=torch.int64, device=device)
        return self.fallbacks

    def record(self, count, rows: int, hd, policy=None) -> None:
        self.calls += 1
        self.rows += rows
        self.last, self.last_rows, self.last_policy = count, rows, policy

    def reset(self) -> None:
        """Zero everything; the fallback counter in place, so that captured CUDA graphs keep adding to the
        counter that `stats()` reads."""
        fallbacks = self.fallbacks
        self.__init__()
        if fallbacks is not None:
            self.fallbacks = fallbacks.zero_()


class CertifiedHead:
    """A greedy LM head whose answers are exact: `argmax`, `topk`, `logits` (docs/lmhead.md).

    `weight`: BF16 `[V, H]`, or a `w12.W12Weight` (the version-1 planes, `w12.pack(W, layout="planes")`; stored
    once; exact rows decoded from it). `screen`:
    "int8", "int4" (half the screen's bytes, a looser bound), "w12" (W12 heads), "none" (the plain exact head) or
    "auto" (measured per GPU,
    lmhead/configs.py). `capacity`: survivors per row before that row takes the full exact path."""

    def __init__(self, weight, *, screen: str = "auto", capacity: int | None = None, group: int = GROUP,
                 variant: str | None = None):
        fn = "lmhead.CertifiedHead"
        w12 = not isinstance(weight, torch.Tensor)
        if w12 and not all(hasattr(weight, p) for p in ("hi", "lo", "e0", "esc_rowptr", "K")):
            raise TypeError(f"{fn}: weight is a {type(weight).__name__}; pass a BF16 tensor [V, H] or a "
                            "w12.W12Weight (the version-1 planes, whose rows the head slices: "
                            "w12.pack(weight, layout=\"planes\"), or w12.layout.untile(tiled) for a TiledW12)")
        if not w12:
            if weight.dim() != 2 or weight.dtype != torch.bfloat16:
                raise TypeError(f"{fn}: weight is {weight.dtype} of shape {tuple(weight.shape)}; pass a BF16 "
                                "[V, H] head (weight.to(torch.bfloat16))")
        if screen not in (*SCREENS, "auto"):
            raise ValueError(f"{fn}: unknown screen {screen!r}; choose one of {SCREENS + ('auto',)}")
        if screen == "w12" and not w12:
            raise ValueError(f"{fn}: screen='w12' reads the 8-bit view of a W12 head but weight is a BF16 tensor; "
                             "pass w12.pack(weight, layout=\"planes\"), or use screen='int8'")
        for name, val in (("group", group), ("capacity", capacity)):
            if (val is not None or name == "group") and (isinstance(val, bool) or not isinstance(val, int)):
                raise TypeError(f"{fn}: {name} must be an int, got {type(val).__name__} {val!r}; pass an int"
                                + (f" (the default is {GROUP})" if name == "group" else ", or None for the default"))
        if group <= 0 or group & (group - 1):
            raise ValueError(f"{fn}: group={group} must be a power of two; use the default {GROUP}")
        if screen == "int4" and group < 32:
            raise ValueError(f"{fn}: screen='int4' reads each group as two int8 products of group / 2 columns, at "
                             f"least 16; group={group} is too small: pass group >= 32 (the default is {GROUP})")
        self.packed = weight if w12 else None
        # the kernels read rows with unit column stride: any other layout (a transposed view) is copied once
        self.weight = None if w12 else (weight if weight.stride(-1) == 1 else weight.contiguous())
        self.V, self.H = (weight.N, weight.K) if w12 else tuple(weight.shape)
        if self.V == 0 or self.H == 0:
            raise ValueError(f"{fn}: the head is [{self.V}, {self.H}]; it needs at least one token and one column")
        device = weight.hi.device if w12 else weight.device
        self.device = device
        self.screen = self._auto(screen, w12, device) if screen == "auto" else screen
        self.capacity = DEFAULT_CAPACITY if capacity is None else int(capacity)
        if self.capacity < 1:
            raise ValueError(f"{fn}: capacity={capacity} must be >= 1; pass a positive int, or None for the default "
                             f"{DEFAULT_CAPACITY}")
        self.capacity = min(self.capacity, self.V)
        self.group = group
        G = -(-self.H // group)
        # fp32 rounding: of the exact dot (H terms; and the W12 screen's own dot), and of the INT8 screen's
        # sum over groups (a product of two scales and the exact integer dot per group: 3 roundings each; with
        # the hidden states in two parts, one more addition joins the parts' sums: at most G + 3 roundings a term)
        self.gamma = gamma(self.H + 2)
        self.gamma_q = gamma(3 * G + 2)
        # products and sums that fall below fp32's normal range lose up to 2^-149 each, absolutely (the screen's
        # 3 per group counted for two hidden parts); a product of two scales that does loses up to 2^-150, which
        # the group's integer dot (|D| <= 127^2 group < 2^14 group) multiplies, in each part's terms
        self.eta = max((3 * self.H + 6 * G + 9) * 2.0**-149 + 2 * G * group * 2.0**-136, 2.0**-126)
        if G > 512:
            raise ValueError(f"{fn}: H={self.H} has {G} groups of {group}; the bound's fp32 sums are covered for up "
                             f"to 512 groups (H <= {512 * group}): pass a larger group")
        self.plan = _plan(variant, device, self.V, self.H)
        self.cfg = self.plan.config
        self.tables = _build_tables(weight, self.screen, group) if self.screen != "none" else {}
        self._stats = _Stats()
        self._policies: dict[int, torch.Tensor] = {}  # row count M -> its early-fallback state (int32 [5])
        _HEADS[id(self)] = self

    @staticmethod
    def _auto(screen, w12, device) -> str:
        if device.type != "cuda":
            return "w12" if w12 else "int8"
        table = AUTO_SCREEN.get(gpu_slug(device))
        return table["w12" if w12 else "bf16"] if table else "none"

    # ---- checks -------------------------------------------------------------------------
    def _hidden(self, fn, hidden) -> torch.Tensor:
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"lmhead.{fn}: hidden must be a torch.Tensor, got {type(hidden).__name__}; pass [M, H]")
        if hidden.dtype != torch.bfloat16:
            raise TypeError(f"lmhead.{fn}: hidden has dtype {hidden.dtype}; pass BF16 hidden states "
                            "(hidden.to(torch.bfloat16))")
        if hidden.dim() < 1 or hidden.shape[-1] != self.H:
            raise ValueError(f"lmhead.{fn}: hidden has shape {tuple(hidden.shape)} but the head has H={self.H}; "
                             f"its last dim must be {self.H}")
        if hidden.device != self.device:
            raise ValueError(f"lmhead.{fn}: hidden is on {hidden.device} but the head is on {self.device}; move "
                             f"it to {self.device}")
        return hidden.reshape(-1, self.H).contiguous()

    # ---- public ops ---------------------------------------------------------------------
    def argmax(self, hidden: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids `[...]` of the largest exact logit per row (ties: the lowest id). A row whose exact logits
        hold a NaN has no largest one: its answer is `lmhead.NAN_ID` (-1), never a token id. Never syncs."""
        h = self._hidden("argmax", hidden)
        self._check_out("argmax", out, tuple(hidden.shape[:-1]), torch.int64)
        if torch.compiler.is_compiling():
            ids = torch.ops.specpilot_lmhead.argmax(h, id(self))
        else:
            ids = self._argmax_eager(h)
        ids = ids.view(hidden.shape[:-1])
        if out is None:
            return ids
        out.copy_(ids)
        return out

    def _start_policy(self, M: int, fn: str) -> torch.Tensor:
        """The early-fallback state of calls with M rows (argmax and topk share it), made on the first such call:
        screen, no calls left to skip, run 1. Its tensor lives as long as the head: CUDA graphs keep
        reading and updating it, and `reset_stats` resets it in place."""
        state = self._policies.get(M)
        if state is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"lmhead.{fn}: the head's first call with {M} rows is being captured into a CUDA "
                                   f"graph, but its per-row-count state must be made outside capture; call "
                                   f"head.{fn} once eagerly with {M} rows (a warm-up) before capturing")
            state = torch.empty(len(_POLICY_START), dtype=torch.int32, device=self.device)
            _restart_policy(state)
            self._policies[M] = state
        return state

    def _check_out(self, fn, out, shape, dtype):
        if out is None:
            return
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != dtype:
            got = (tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"lmhead.{fn}: out is {got}; pass a {dtype} tensor of shape {list(shape)}")
        if out.device != self.device:
            raise ValueError(f"lmhead.{fn}: out is on {out.device}; allocate it on {self.device}")

    def _argmax_eager(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[0] == 0:
            return torch.empty(0, dtype=torch.int64, device=h.device)
        if self.plan.kernel == "reference":
            return self._argmax_torch(h)
        return _argmax_triton(self, h, self._stats)

    def _argmax_torch(self, h):
        M = h.shape[0]
        exact = _exact_torch(self, h)
        keys = _key_torch(exact, torch.arange(self.V, device=h.device).expand(M, -1))
        count = None
        if self.screen != "none":
            lo, up, bad = _screen_torch(self, h)
            best = torch.where(bad[:, None] != 0, torch.full_like(lo, float("-inf")), lo).amax(-1)
            keep = (up >= best[:, None]) & (bad[:, None] == 0)
            count = keep.sum(-1).int()
            flag = (count > self.capacity) | (bad != 0)
            keys = torch.where(keep | flag[:, None], keys, torch.full_like(keys, _MIN_KEY))
            self._stats.counter(h.device).add_(flag.sum())
        self._stats.record(count, M, self)
        return _argmax_of(keys.amax(-1))

    def topk(self, hidden: torch.Tensor, k: int):
        """(values fp32 `[..., k]`, ids int64 `[..., k]`): the k largest exact logits, ordered by value
        (descending), then id (ascending); a NaN logit ranks above every number, and its value says so.
        Never syncs."""
        h = self._hidden("topk", hidden)
        if isinstance(k, bool) or not isinstance(k, int):
            if isinstance(k, torch.Tensor) and k.numel() == 1 and not k.is_floating_point():
                k = int(k)
            else:
                raise TypeError(f"lmhead.topk: k must be an int, got {type(k).__name__} {k!r}; pass an int, e.g. "
                                f"k={int(k) if isinstance(k, float) and k.is_integer() else 2}")
        if not 1 <= k <= min(self.V, self.capacity):
            raise ValueError(f"lmhead.topk: k={k} is out of range; pass 1 <= k <= min(V, capacity) = "
                             f"{min(self.V, self.capacity)}")
        if self.plan.kernel == "reference":
            M = h.shape[0]
            exact = _exact_torch(self, h)
            top = _key_torch(exact, torch.arange(self.V, device=h.device).expand(M, -1)).topk(k, dim=-1).values
            self._stats.record(None, M, self)
            ids = _ids_of(top)
            vals = exact.gather(1, ids)
        else:
            vals, ids = _topk_triton(self, h, k, self._stats)
        shape = (*hidden.shape[:-1], k)
        return vals.view(shape), ids.view(shape)

    def logits(self, hidden: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The exact logits `[..., V]` fp32: the values every certified answer is taken from."""
        h = self._hidden("logits", hidden)
        self._check_out("logits", out, (*hidden.shape[:-1], self.V), torch.float32)
        given = out
        if self.plan.kernel == "reference":
            out = _exact_torch(self, h)
        else:
            M = h.shape[0]
            out = torch.empty(M, self.V, dtype=torch.float32, device=h.device)
            if M:
                _launch_exact(self, h, None, None, out, None, full=True, every=True)
        res = out.view(*hidden.shape[:-1], self.V)
        if given is None:
            return res
        given.copy_(res)
        return given

    def stats(self) -> dict:
        """Survivors per row of the last call, cumulative fallbacks, calls, and the early fallback's state per
        row count (reads the device: syncs). "policy": {M: {"calls", "skipped", "last_skipped", "left",
        "run"}}: calls with M rows and those that skipped the screen (CUDA-graph replays included), whether
        the last one did, the calls still to skip, the run the next failed screen starts."""
        s = self._stats
        skipped = s.last_policy is not None and int(s.last_policy[_SKIP]) != 0
        if s.last is None or skipped:  # no screen (or the torch path, or skipped): every token computed exactly
            last = [self.V] * s.last_rows
        else:
            last = [min(int(x), self.V) for x in s.last.tolist()]
        policy = {}
        for M, state in sorted(self._policies.items()):
            st = state.tolist()
            policy[M] = {"calls": st[_CALLS], "skipped": st[_SKIPPED], "last_skipped": st[_SKIP] != 0,
                         "left": st[_LEFT], "run": st[_RUN]}
        return {"calls": s.calls, "rows": s.rows, "survivors": last,
                "survivors_mean": (sum(last) / len(last)) if last else 0.0,
                "fallbacks": 0 if s.fallbacks is None else int(s.fallbacks.sum()), "screen": self.screen,
                "capacity": self.capacity, "policy": policy,
                "bound": {"u": _U, "gamma": self.gamma, "gamma_q": self.gamma_q, "eta": self.eta, "group": self.group}}

    def reset_stats(self) -> None:
        """Zero the counters and restart the early fallback of every row count (in place: captured CUDA graphs
        see it; no host sync)."""
        self._stats.reset()
        for state in self._policies.values():
            _restart_policy(state)


def screen_bounds(head: CertifiedHead, hidden: torch.Tensor):
    """(L, U) fp32 `[M, V]`: the screen's interval of every exact logit (for tests and diagnostics), as a call with
    these M rows forms it (up to `split_rows` rows the hidden states in two parts: narrower intervals)."""
    if not isinstance(head, CertifiedHead):
        raise TypeError(f"lmhead.screen_bounds: head must be an lmhead.CertifiedHead, got {type(head).__name__}; build "
                        "it with lmhead.CertifiedHead(weight)")
    h = head._hidden("screen_bounds", hidden)
    if head.screen == "none":
        raise ValueError("lmhead.screen_bounds: the head has no screen (screen='none'); build it with a screen")
    if head.plan.kernel == "reference":
        lo, up, _ = _screen_torch(head, h)
        return lo, up
    p, lo, _ = _survivors(head, h, lambda lo, bad: lo.amax(-1).contiguous())
    return lo, p["up"]
