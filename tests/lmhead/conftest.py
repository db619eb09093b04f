"""Helpers of the lmhead suites, as one fixture `lm` (the test dirs have no __init__ files, so a test module
cannot import this one by name).

The oracles are the contract of docs/lmhead.md (and /work/plan/lmhead_api.md):

* `check_argmax(head, h)`: head.argmax(h) equals `argmax_of(head.logits(h))` BIT FOR BIT: torch.argmax (ties ->
  the lowest id, +0 == -0), and lmhead.NAN_ID (-1) for a row whose logits hold a NaN; the result is shaped like
  h's leading dims.
* `check_topk(head, h, k)`: ids equal the first k of a stable descending sort of head.logits(h) (value desc,
  id asc) and values are those logits' bits.
* `check_bounds(head, h)`: lmhead.screen_bounds(head, h) -> (L, U) contains every exact logit and every fp64
  logit (lmhead.reference.exact_logits_reference).
* `check_reference(head, h, ids)`: the certified argmax equals the fp64 argmax on every row where the fp64
  margin provably survives fp32 rounding of the exact logits: for the fp64 best b and every other v,
  l_b - l_v > 2 * gamma_n * (a_b + a_v), a_v = sum_k |W_vk h_k|, gamma_n = n u / (1 - n u), u = 2^-23,
  n = H + 2 (any fixed fp32 summation order of n exact products; the factor 2 is slack for the fp64
  reference's own rounding), plus 2^-149 per operation for underflow; rows where a partial sum could overflow
  fp32 are left out. Returns how many rows were decided that way.
* `expect_error(*patterns)`: a TypeError/ValueError "lmhead.<fn>: what; how to fix".
* Weight builders: `rand_weight`, `rand_hidden`, `worst_case_int8` / `worst_case_w12` (weights whose every
  element sits at the largest quantisation error of its screen, and hidden rows whose signs line up with the
  errors of one token: on an integer grid per group, or with magnitudes spread from 2^-20 to 2^20).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from specpilot.testing import assert_bitwise_equal, raises_helpful

U32 = 2.0**-23


# --------------------------------------------------------------------------------------- building blocks


def bf16_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """int32 0..65535 -> BF16 with those bits."""
    return (bits - ((bits & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)


def next_bf16(x: torch.Tensor, direction: int) -> torch.Tensor:
    """The BF16 neighbour of finite nonzero `x` one ulp away from zero (direction +1) or towards it (-1)."""
    b = x.view(torch.int16).int()
    return (b + direction).to(torch.int16).view(torch.bfloat16)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand_weight(V, H, seed=0, std=0.05, device="cpu"):
    return (torch.randn(V, H, generator=gen(seed)) * std).to(torch.bfloat16).to(device)


def rand_hidden(M, H, seed=1, std=1.0, device="cpu"):
    return (torch.randn(M, H, generator=gen(seed)) * std).to(torch.bfloat16).to(device)


def make_head(weight, screen, **kw):
    """A CertifiedHead over `weight` (BF16); screen "w12" packs it first (the W12Weight head)."""
    import lmhead
    import w12

    if screen == "w12":
        return lmhead.CertifiedHead(w12.pack(weight, layout="planes"), screen="w12", **kw)
    return lmhead.CertifiedHead(weight, screen=screen, **kw)


def dense(weight):
    from lmhead.reference import dense_weight

    return dense_weight(weight)


# --------------------------------------------------------------------------------------- oracles


def topk_oracle(logits: torch.Tensor, k: int):
    """(values, ids) of the k largest logits per row in (value desc, id asc) order."""
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    return logits.gather(-1, order), order


def argmax_of(logits: torch.Tensor) -> torch.Tensor:
    """The head's contract on exact logits [M, V]: torch.argmax per row, -1 for a row holding a NaN."""
    return torch.where(torch.isnan(logits).any(-1), -1, torch.argmax(logits, dim=-1))


def check_argmax(head, h, msg=""):
    """head.argmax(h) against torch.argmax(head.logits(h)), bitwise. Returns (ids [M], logits [M, V])."""
    H = h.shape[-1]
    lead = tuple(h.shape[:-1])
    logits = head.logits(h)
    M = math.prod(lead)
    assert logits.dtype == torch.float32, f"{msg} logits dtype {logits.dtype}"
    logits = logits.reshape(M, -1)
    assert logits.device == h.device, f"{msg} logits on {logits.device}"
    ids = head.argmax(h)
    assert ids.dtype == torch.int64, f"{msg} ids dtype {ids.dtype}"
    assert tuple(ids.shape) == lead, f"{msg} ids shape {tuple(ids.shape)} != {lead} (hidden {tuple(h.shape)})"
    assert ids.device == h.device, f"{msg} ids on {ids.device}"
    want = argmax_of(logits)
    assert_bitwise_equal(ids.reshape(M).cpu(), want.cpu(), f"{msg} argmax vs argmax(logits) (H={H}):")
    return ids.reshape(M), logits


def check_topk(head, h, k, logits=None, msg=""):
    """head.topk(h, k) against a stable descending sort of head.logits(h): ids exactly, values bitwise."""
    if logits is None:
        logits = head.logits(h)
        logits = logits.reshape(math.prod(h.shape[:-1]), logits.shape[-1])
    vals, ids = head.topk(h, k)
    M = logits.shape[0]
    assert tuple(vals.shape) == (M, k) and tuple(ids.shape) == (M, k), \
        f"{msg} topk shapes {tuple(vals.shape)} {tuple(ids.shape)}, want ({M}, {k})"
    assert vals.dtype == torch.float32 and ids.dtype == torch.int64, f"{msg} topk dtypes {vals.dtype} {ids.dtype}"
    wv, wi = topk_oracle(logits, k)
    assert_bitwise_equal(ids.cpu(), wi.cpu(), f"{msg} topk(k={k}) ids:")
    assert_bitwise_equal(vals.cpu(), wv.cpu(), f"{msg} topk(k={k}) values:")
    return vals, ids


def check_bounds(head, h, weight, logits=None, msg=""):
    """(L, U) of lmhead.screen_bounds contain every exact logit and every fp64 logit."""
    import lmhead
    from lmhead.reference import exact_logits_reference

    L, U = lmhead.screen_bounds(head, h)
    h2 = h.reshape(-1, h.shape[-1])
    if logits is None:
        logits = head.logits(h2)
    M, V = logits.shape
    assert tuple(L.shape) == (M, V) and tuple(U.shape) == (M, V), f"{msg} bounds shape {tuple(L.shape)}"
    assert L.dtype == torch.float32 and U.dtype == torch.float32, f"{msg} bounds dtype {L.dtype} {U.dtype}"
    L, U, ex = L.double(), U.double(), logits.double()
    ref = exact_logits_reference(h2, dense(weight))  # on the head's device
    for name, x in (("exact logit", ex), ("fp64 logit", ref)):
        bad = ~((L <= x) & (x <= U))
        if bad.any():
            m, v = bad.nonzero()[0].tolist()
            raise AssertionError(
                f"{msg} {int(bad.sum())}/{bad.numel()} {name}s outside [L, U]; first (m={m}, v={v}): "
                f"{float(x[m, v])!r} not in [{float(L[m, v])!r}, {float(U[m, v])!r}] (fp64 {float(ref[m, v])!r}, "
                f"exact {float(ex[m, v])!r})")
    return L, U


def provable_rows(h, weight):
    """(rows where the fp64 argmax provably equals the fp32 exact argmax, the fp64 argmax)."""
    from lmhead.reference import argmax_reference, exact_logits_reference

    wd = dense(weight)
    h2 = h.reshape(-1, h.shape[-1]).to(wd.device)
    ref = exact_logits_reference(h2, wd)
    best = argmax_reference(h2, wd)
    a = h2.double().abs() @ wd.double().abs().T  # [M, V] sum_k |W_vk h_k|
    n = h2.shape[-1] + 2
    gamma = n * U32 / (1 - n * U32)
    bi = best.clamp(min=0)[:, None]  # -1 (a NaN row) is not an index; such rows are not finite, so never decided
    lb = ref.gather(1, bi)
    ab = a.gather(1, bi)
    # relative rounding of n operations, plus 2^-149 per operation where a partial sum or product underflows
    margin = (lb - ref) - 2 * (gamma * (ab + a) + n * 2.0**-149)
    margin.scatter_(1, bi, float("inf"))
    # no fp32 overflow: every partial sum is at most a_v in magnitude
    ok = torch.isfinite(ref).all(1) & (margin > 0).all(1) & (a.amax(1) < 2.0**127)
    return ok, best


def check_reference(ids, h, weight, msg=""):
    """The certified ids equal the fp64 argmax on every provably decided row; returns that row count."""
    ok, best = provable_rows(h, weight)
    ok, best = ok.cpu(), best.cpu()
    got = ids.reshape(-1).cpu()
    bad = ok & (got != best)
    assert not bad.any(), (f"{msg} rows {bad.nonzero().flatten().tolist()[:8]}: certified {got[bad][:8].tolist()} "
                           f"!= fp64 argmax {best[bad][:8].tolist()} although the fp64 margin exceeds fp32 rounding")
    return int(ok.sum())


def check_answers(head, h, weight, ids, logits, k, bounded, msg=""):
    """The checks every certified answer gets: `ids` (head.argmax) against the fp64 argmax on the provably decided
    rows, the screen's bounds (`bounded`: the head has a screen), the top-k. Returns the decided row count."""
    decided = check_reference(ids, h, weight, msg=msg)
    if bounded:
        check_bounds(head, h, weight, logits, msg=msg)
    check_topk(head, h, k, logits, msg=msg)
    return decided


def survivors_from_bounds(L, U):
    """The contract's survivor count per row: #{v : U_v >= max_u L_u}."""
    return (U >= L.max(dim=1, keepdim=True).values).sum(1).tolist()


# --------------------------------------------------------------------------------------- worst cases


def spread_magnitudes(H, seed, lo=-20, hi=20):
    """|h_k| = 2^e, e uniform in [lo, hi] (exact in BF16), as fp32."""
    e = torch.randint(lo, hi + 1, (H,), generator=gen(seed)).float()
    return torch.exp2(e)


def worst_case_int8(V, H, M, seed=0, group=128):
    """BF16 weight and hidden where the INT8 screen's error term is attained.

    Per row and group of `group` columns: one element is +-127 * 2^-7 * 2^r (the group max, so that the scale
    max/127 rounds up to exactly 2^(r-7)), every other is (q + 1/2) * 2^(r-7) for q in [-127, 126]: exactly
    half a step from both neighbours (8 significant bits, so exact in BF16), the largest error a rounding to the
    INT8 grid can make. The row exponents r are spread over [-8, 8]. Hidden row m lines up, element by element,
    with the sign of the quantisation error of token m % V (found with lmhead.reference.int8_screen_reference)
    and its magnitudes are 2^e, e in [-20, 20]: the screen's error for that token is the bound's E term
    exactly. The last hidden row alternates signs instead."""
    from lmhead.reference import int8_screen_reference

    g = gen(seed)
    q = torch.randint(-127, 127, (V, H), generator=g).double()
    w = (q + 0.5) * 2.0**-7
    G = -(-H // group)
    for gi in range(G):  # the group max, at a random column of the group, with a random sign
        c0, c1 = gi * group, min(H, (gi + 1) * group)
        col = torch.randint(c0, c1, (V,), generator=g)
        sign = torch.where(torch.rand(V, generator=g) < 0.5, -1.0, 1.0).double()
        w[torch.arange(V), col] = sign * 127 * 2.0**-7
    w64 = w * torch.exp2(torch.randint(-8, 9, (V, 1), generator=g).double())
    w = w64.to(torch.bfloat16)
    assert torch.equal(w.double(), w64), "worst-case weights are not exact in BF16"
    qq, scale, _ = int8_screen_reference(w, group)
    deq = qq.double() * scale.double().repeat_interleave(group, dim=1)[:, :H]
    err = w.double() - deq
    return w, _aligned_hidden(err, M, H, seed)


def worst_case_w12(V, H, M, seed=0):
    """BF16 weight and hidden where the W12 8-bit view's error is largest: random weights whose 4 low mantissa
    bits are 0 or 15 (the view keeps the midpoint 8 of the 16 values sharing its byte: error 8 or 7 low ulps),
    row scales spread by 2^[-8, 8]; hidden rows aligned with the view's error signs of one token each."""
    import w12

    g = gen(seed)
    w = torch.randn(V, H, generator=g) * torch.exp2(torch.randint(-8, 9, (V, 1), generator=g).float()) * 0.05
    bits = w.to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
    low = torch.where(torch.rand(V, H, generator=g) < 0.5, 0x0, 0xF)
    bits = (bits & ~0xF) | low
    w = bf16_of_bits(bits)
    w = torch.where(w.isfinite(), w, torch.zeros_like(w))
    deq = w12.decode_q8(w12.pack(w)).double()
    err = w.double() - deq
    return w, _aligned_hidden(err, M, H, seed)


def grid_magnitudes(H, seed, group=128):
    """|h_k| = n_k 2^e_g: integers n in [1, 127] (127 once per group of `group` columns, so an INT8 quantiser of
    the hidden state with scale max/127 represents the row (nearly) exactly), e_g in [-20, 20] per group."""
    g = gen(seed)
    n = torch.randint(1, 127, (H,), generator=g).float()
    G = -(-H // group)
    for gi in range(G):
        n[gi * group + int(torch.randint(0, min(group, H - gi * group), (1,), generator=g))] = 127.0
    e = torch.randint(-20, 21, (G,), generator=g).float().repeat_interleave(group)[:H]
    return n * torch.exp2(e)


def _aligned_hidden(err, M, H, seed):
    """Hidden rows aligned with the error signs of token m % V: even rows on an integer grid per group (the
    screen's own rounding of the hidden state, if it has one, is then ~0 and the weight error dominates),
    odd rows with magnitudes 2^-20..2^20; the last row (M > 1) alternates signs."""
    V = err.shape[0]
    rows = []
    for m in range(M):
        mag = grid_magnitudes(H, seed * 1000 + m) if m % 2 == 0 else spread_magnitudes(H, seed * 1000 + m)
        if m == M - 1 and M > 1:
            sign = torch.tensor([1.0 if k % 2 == 0 else -1.0 for k in range(H)])
        else:
            sign = torch.where(err[m % V] < 0, -1.0, 1.0).float()
        rows.append(sign * mag)
    return torch.stack(rows).to(torch.bfloat16)


# --------------------------------------------------------------------------------------- errors


expect_error = functools.partial(raises_helpful, "lmhead")  # "lmhead.<fn>: what; how to fix"


class _Helpers:
    bf16_of_bits = staticmethod(bf16_of_bits)
    next_bf16 = staticmethod(next_bf16)
    gen = staticmethod(gen)
    rand_weight = staticmethod(rand_weight)
    rand_hidden = staticmethod(rand_hidden)
    make_head = staticmethod(make_head)
    dense = staticmethod(dense)
    topk_oracle = staticmethod(topk_oracle)
    argmax_of = staticmethod(argmax_of)
    check_argmax = staticmethod(check_argmax)
    check_topk = staticmethod(check_topk)
    check_bounds = staticmethod(check_bounds)
    check_reference = staticmethod(check_reference)
    check_answers = staticmethod(check_answers)
    provable_rows = staticmethod(provable_rows)
    survivors_from_bounds = staticmethod(survivors_from_bounds)
    spread_magnitudes = staticmethod(spread_magnitudes)
    worst_case_int8 = staticmethod(worst_case_int8)
    worst_case_w12 = staticmethod(worst_case_w12)
    expect_error = staticmethod(expect_error)


@pytest.fixture(name="lm")
def _lm_fixture():
    """The lmhead test helpers (module docstring)."""
    return _Helpers
