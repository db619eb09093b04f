"""CPU tests of lmhead.CertifiedHead: the Triton kernels run under the interpreter at small, odd shapes.

The claim is exactness, so the checks are bitwise (conftest.py, fixture `lm`):
* head.argmax(h) == torch.argmax(head.logits(h)) (ties -> lowest id), lmhead.NAN_ID (-1) for a row holding a NaN;
* head.topk(h, k) == the first k of head.logits(h) sorted by (value desc, id asc), ids and value bits;
* the certified ids equal the fp64 argmax (lmhead.reference) on every row whose fp64 margin provably survives
  fp32 rounding;
* lmhead.screen_bounds(head, h) = (L, U) contains every exact logit and every fp64 logit, also on weights and
  hidden states built to attain the screen's quantisation error.
Screens: "int8" (BF16 weight), "w12" (the W12Weight of the same weight, its 8-bit view), "none" (plain exact).
"""

import importlib
import math

import pytest
import torch
from torch import nn

import lmhead
from specpilot.testing import assert_bitwise_equal

# The interpreter runs the kernels in numpy, which warns on the overflow / Inf / NaN / x / 0 arithmetic these
# tests plant on purpose (the results are checked, the warnings say nothing more).
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

SCREENS = ["int8", "int4", "w12", "none"]
BOUNDED = ["int8", "int4", "w12"]  # screens that have bounds


def bits_equal_rows(a, b):
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


# ------------------------------------------------------------------------------------ API surface


def test_public_names():
    for name in ("CertifiedHead", "screen_bounds", "exact_logits_reference", "argmax_reference"):
        assert hasattr(lmhead, name), f"lmhead.{name} is missing"
    importlib.import_module("lmhead.ops")  # registers the custom op

    assert hasattr(torch.ops.specpilot_lmhead, "argmax"), "torch.ops.specpilot_lmhead.argmax is not registered"


@pytest.mark.parametrize("kind", ["bf16", "w12"])
def test_auto_screen_on_cpu(kind, lm):
    """screen="auto" (the default) without a GPU: "int8" for a BF16 weight, "w12" for a W12Weight."""
    import w12

    w = lm.rand_weight(20, 40, seed=5)
    head = lmhead.CertifiedHead(w if kind == "bf16" else w12.pack(w, layout="planes"))
    h = lm.rand_hidden(2, 40, seed=6)
    lm.check_argmax(head, h)
    assert head.stats()["screen"] == ("int8" if kind == "bf16" else "w12")


# ------------------------------------------------------------------------------------ exactness on random heads

SLOW = pytest.mark.slow
# (V, H, M): V and H off multiples of 8 / 128, M = 1, 2, 5, 32; the screens whose run is quick enough for the
# fast suite (the interpreter's screen of 32 rows takes seconds), the rest marked slow
SHAPES = {
    (1, 40, 1): SCREENS,
    (7, 130, 2): SCREENS,
    (8, 1, 3): SCREENS,
    (7, 40, 32): ["int8", "none"],
    (300, 130, 1): ["int8", "int4", "none"],
    (129, 257, 5): ["int8"],
}
# the W12 view is the interpreter's slowest screen: it runs on the small shapes only (and on the GPU)
EXACT = [pytest.param(V, H, M, s, id=f"V{V}-H{H}-M{M}-{s}") for (V, H, M), run in SHAPES.items() for s in run]


@pytest.mark.parametrize("V, H, M, screen", EXACT)
def test_exact_on_random_heads(V, H, M, screen, lm):
    w = lm.rand_weight(V, H, seed=V * 1000 + H)
    h = lm.rand_hidden(M, H, seed=M)
    head = lm.make_head(w, screen)
    ids, logits = lm.check_argmax(head, h, msg=f"{screen} V={V} H={H} M={M}")
    assert ((0 <= ids) & (ids < V)).all()
    decided = lm.check_answers(head, h, w, ids, logits, min(V, 5), screen in BOUNDED, msg=screen)
    assert decided >= (M + 1) // 2, f"only {decided}/{M} rows are decided by the fp64 margin: a vacuous check"


def test_int4_codes_pack_two_to_a_byte():
    """lmhead.ops._pack4 / _unpack4: codes in [-7, 7] round-trip on an odd H; byte j of a group holds columns j
    (low nibble) and group / 2 + j (high nibble), two's complement; the padding past H is 0."""
    from lmhead.ops import _pack4, _unpack4

    g = torch.Generator().manual_seed(4)
    q = torch.randint(-7, 8, (5, 200), generator=g).double()
    p = _pack4(q, 64)
    assert p.dtype == torch.uint8 and tuple(p.shape) == (5, 4 * 32)
    assert torch.equal(_unpack4(p, 64, 200), q.to(torch.int8))
    assert int(p[2, 33]) == (int(q[2, 65]) & 0xF) | ((int(q[2, 97]) & 0xF) << 4)  # group 1, byte 1
    assert bool((p[:, 3 * 32 + 8:] == 0).all())  # group 3 holds columns 192..199 (bytes 0..7) and padding


def test_int4_screen_holds_at_its_worst_rounding(lm):
    """Weights half a step of the 4-bit grid from both neighbours (the largest rounding error), hidden rows lined
    up with the error's sign: the bound still holds for every logit and the answers are exact."""
    V, H, M, group = 9, 256, 3, 128  # whole groups: each group's planted maximum sets its scale
    g = torch.Generator().manual_seed(8)
    G = -(-H // group)
    w = torch.empty(V, G * group, dtype=torch.float64)
    step = torch.empty(V, G * group, dtype=torch.float64)
    for v in range(V):
        for k in range(G):
            r = int(torch.randint(-6, 7, (1,), generator=g))
            q = torch.randint(-7, 7, (group,), generator=g).double() + 0.5  # halfway: error 2^r / 2
            q[int(torch.randint(0, group, (1,), generator=g))] = 7.0  # the group max: the scale is exactly 2^r
            w[v, k * group:(k + 1) * group] = q * 2.0**r
            step[v, k * group:(k + 1) * group] = 2.0**r
    w, step = w[:, :H].to(torch.bfloat16), step[:, :H]
    assert torch.equal(w.double(), w.double().to(torch.bfloat16).double())
    sign = torch.sign(w.double() - torch.round(w.double() / step) * step)  # the side of each weight's rounding
    assert int((sign == 0).sum()) == V * G  # only the planted maxima sit on the grid
    h = (sign[:M] * lm.spread_magnitudes(H, seed=9)[None, :]).to(torch.bfloat16)
    head = lm.make_head(w, "int4")
    ids, logits = lm.check_argmax(head, h)
    lm.check_answers(head, h, w, ids, logits, 3, True, msg="int4 worst")


@pytest.mark.slow
@pytest.mark.parametrize("screen", BOUNDED)
def test_more_rows_than_one_launch(screen, lm):
    """M = 33: more hidden rows than one screen launch takes (config max_rows = 32)."""
    V, H, M = 7, 40, 33
    w = lm.rand_weight(V, H, seed=33)
    h = lm.rand_hidden(M, H, seed=34)
    head = lm.make_head(w, screen)
    ids, logits = lm.check_argmax(head, h)
    lm.check_reference(ids, h, w)
    lm.check_topk(head, h, 3, logits)


@pytest.mark.parametrize("V, k, screen", [(129, 129, "int8"), (300, 256, "w12"),
                                          pytest.param(129, 129, "w12", marks=SLOW),
                                          pytest.param(300, 256, "int8", marks=SLOW)])
def test_topk_up_to_capacity(V, k, screen, lm):
    """k = min(V, capacity): the whole sorted vocabulary, or the default capacity of 256."""
    H, M = 40, 2
    w = lm.rand_weight(V, H, seed=V + 7)
    h = lm.rand_hidden(M, H, seed=8)
    head = lm.make_head(w, screen)
    lm.check_topk(head, h, k)


def test_logits_do_not_depend_on_the_screen_or_the_batch(lm):
    """The exact logits come from one kernel in one fixed order: the same bits whichever screen the BF16 head
    uses, and a row's logits do not depend on the other rows of the batch."""
    V, H, M = 45, 130, 5
    w = lm.rand_weight(V, H, seed=11)
    h = lm.rand_hidden(M, H, seed=12)
    heads = {s: lm.make_head(w, s) for s in ("int8", "none")}
    base = heads["none"].logits(h)
    assert_bitwise_equal(heads["int8"].logits(h), base, "int8 vs none logits:")
    ids = heads["int8"].argmax(h)
    for m in (0, 3):
        assert_bitwise_equal(heads["int8"].logits(h[m:m + 1]), base[m:m + 1], f"row {m} alone:")
        assert_bitwise_equal(heads["int8"].argmax(h[m:m + 1]), ids[m:m + 1], f"row {m} alone:")
    assert_bitwise_equal(heads["int8"].argmax(h), ids, "second call:")


# ------------------------------------------------------------------------------------ the bound


# each family against its own screen (the cross pairs, and the W12 one at V=300, in the slow suite)
WORST = [pytest.param(V, H, M, f, s, id=f"V{V}-H{H}-M{M}-{f}/{s}",
                      marks=() if f.startswith(s) and (V, s) != (300, "w12") else SLOW)
         for V, H, M in [(7, 257, 4), (129, 130, 3), (300, 40, 2)] for f in ("int8-worst", "w12-worst")
         for s in BOUNDED]


@pytest.mark.parametrize("V, H, M, family, screen", WORST)
def test_bounds_hold_in_the_worst_case(V, H, M, family, screen, lm):
    """Weights at the largest quantisation error of a screen (group max + half steps for INT8; low nibble 0 or
    15 for the W12 view), hidden rows whose signs line up with one token's errors, on an integer grid per group
    (there the realised screen error reaches 70-99% of the radius (U - L) / 2) or with magnitudes 2^-20..2^20
    (the last row alternates signs): every exact and every fp64 logit lies in [L, U]."""
    build = lm.worst_case_int8 if family == "int8-worst" else lm.worst_case_w12
    w, h = build(V, H, M, seed=V + H)
    head = lm.make_head(w, screen)
    ids, logits = lm.check_argmax(head, h, msg=f"{family}/{screen}")
    lm.check_bounds(head, h, w, logits, msg=f"{family}/{screen}")
    lm.check_reference(ids, h, w, msg=f"{family}/{screen}")


@pytest.mark.parametrize("hexp, screen", [(20, "int8"), (-20, "w12"), pytest.param(-20, "int8", marks=SLOW),
                                          pytest.param(20, "w12", marks=SLOW)])
def test_bounds_hold_in_the_worst_case_scaled(hexp, screen, lm):
    """The worst case with the hidden rows scaled by 2^20 and 2^-20."""
    build = lm.worst_case_int8 if screen == "int8" else lm.worst_case_w12
    w, h = build(33, 130, 3, seed=4)
    h = (h.float() * 2.0**hexp).to(torch.bfloat16)
    head = lm.make_head(w, screen)
    ids, logits = lm.check_argmax(head, h)
    lm.check_bounds(head, h, w, logits)
    lm.check_reference(ids, h, w)


@pytest.mark.parametrize("screen", BOUNDED)
def test_survivors_follow_the_bounds(screen, lm):
    """stats()["survivors"][m] = #{v : U[m, v] >= max_u L[m, u]} (the contract's survivor rule), each in 1..V;
    a peaked row keeps only a handful."""
    V, H, M = 129, 130, 5
    w = lm.rand_weight(V, H, seed=21)
    h = lm.rand_hidden(M, H, seed=22)
    peaked = (w[[3, 77]].float() * 8).to(torch.bfloat16)  # rows 5, 6: h = 8 W_t, a clear winner
    h = torch.cat([h, peaked])
    head = lm.make_head(w, screen)
    head.reset_stats()
    ids = head.argmax(h)
    s = head.stats()
    L, U = lmhead.screen_bounds(head, h)
    assert s["survivors"] == lm.survivors_from_bounds(L.cpu(), U.cpu()), \
        f"survivors {s['survivors']} != the bound rule's {lm.survivors_from_bounds(L.cpu(), U.cpu())}"
    assert all(1 <= x <= V for x in s["survivors"]), s["survivors"]
    assert ids[-2:].tolist() == [3, 77]
    assert max(s["survivors"][-2:]) <= 4, f"peaked rows keep {s['survivors'][-2:]} survivors"


# ------------------------------------------------------------------------------------ planted near-ties


def _dominant(H, M, seed, lm):
    """A BF16 row `base` and hidden rows whose signs all agree with it: base . h_m is far above every random
    row's logit, for every m."""
    g = lm.gen(seed)
    sign = torch.where(torch.rand(H, generator=g) < 0.5, -1.0, 1.0)
    base = (sign * (torch.rand(H, generator=g) * 0.1 + 0.02)).to(torch.bfloat16)
    h = (sign * (torch.rand(M, H, generator=g) + 0.25)).to(torch.bfloat16)
    return base, h, sign


NEAR = [pytest.param(low, d, s, marks=() if (s, low, d) in {("int8", "plain", 1), ("int8", "bumped", -1),
                                                           ("w12", "bumped", 1), ("none", "plain", -1),
                                                           ("int4", "bumped", 1)} else SLOW,
                     id=f"{s}-{low}-{d:+d}")
        for s in SCREENS for low, d in (("plain", 1), ("bumped", -1), ("bumped", 1), ("plain", -1))
        if s != "int4" or (low, d) == ("bumped", 1)]  # INT4 shares INT8's bound code: one of the four suffices


@pytest.mark.parametrize("low, direction, screen", NEAR)
def test_near_tie_one_ulp(low, direction, screen, lm):
    """Two dominant rows equal but for one weight, one BF16 ulp apart; the hidden element that multiplies it
    runs from 2^4 down to 2^-10 over the rows, so the logits' difference goes from several fp32 ulps to far
    below one: some rows are decided by the ulp, some are exact fp32 ties (-> the lower id)."""
    V, H, M, j = 37, 130, 8, 5
    w = lm.rand_weight(V, H, seed=31)
    base, h, sign = _dominant(H, M, 32, lm)
    base[j] = float(sign[j]) * 2.0**-10 * 1.5
    for m in range(M):
        h[m, j] = float(sign[j]) * 2.0 ** (4 - 2 * m)
    bumped = base.clone()
    bumped[j] = lm.next_bf16(base[j:j + 1], direction)[0]
    a, b = 11, 29
    w[a], w[b] = (base, bumped) if low == "plain" else (bumped, base)
    head = lm.make_head(w, screen)
    ids, logits = lm.check_argmax(head, h, msg=f"{screen} low={low} dir={direction}")
    assert set(ids.tolist()) <= {a, b}, ids.tolist()
    ties = int((logits[:, a] == logits[:, b]).sum())
    assert 0 < ties < M, f"the planting does not reach the rounding limit: {ties}/{M} rows tie"
    assert (ids[logits[:, a] == logits[:, b]] == a).all(), "an exact tie must go to the lower id"
    lm.check_answers(head, h, w, ids, logits, 2, screen in BOUNDED)


@pytest.mark.parametrize("screen", SCREENS)
def test_duplicate_rows_tie_to_the_lowest_id(screen, lm):
    """Three copies of the dominant row at ids 41, 7, 23 (and a duplicate pair elsewhere): every row's argmax is
    7, their logits are the same bits, topk lists them 7, 23, 41."""
    V, H, M = 50, 130, 4
    w = lm.rand_weight(V, H, seed=41)
    base, h, _ = _dominant(H, M, 42, lm)
    for v in (41, 7, 23):
        w[v] = base
    w[30] = w[2]
    head = lm.make_head(w, screen)
    ids, logits = lm.check_argmax(head, h)
    assert ids.tolist() == [7] * M
    for v in (23, 41):
        assert bits_equal_rows(logits[:, v], logits[:, 7]), f"duplicate row {v} has other logits than row 7"
    assert bits_equal_rows(logits[:, 30], logits[:, 2])
    _, top = lm.check_topk(head, h, 5, logits)
    assert top[:, :3].tolist() == [[7, 23, 41]] * M


# ------------------------------------------------------------------------------------ magnitudes


@pytest.mark.parametrize("screen", SCREENS)
def test_huge_and_tiny_norms(screen, lm):
    """Hidden rows scaled by 2^20, 2^-20 and 1 (each row is certified on its own, so one batch holds them all);
    weight rows scaled by 2^r, r in [-20, 20] (exact in BF16)."""
    V, H = 67, 130
    g = lm.gen(51)
    r = torch.randint(-20, 21, (V, 1), generator=g).float()
    w = (lm.rand_weight(V, H, seed=52).float() * torch.exp2(r)).to(torch.bfloat16)
    scale = torch.tensor([[2.0**20], [2.0**-20], [1.0], [2.0**20], [2.0**-20]])
    x = (lm.rand_hidden(5, H, seed=53).float() * scale).to(torch.bfloat16)
    head = lm.make_head(w, screen)
    ids, logits = lm.check_argmax(head, x)
    assert torch.isfinite(logits).all()
    decided = lm.check_answers(head, x, w, ids, logits, 4, screen in BOUNDED)
    assert decided >= 4, f"{decided}/5 rows decided by the fp64 margin"


@pytest.mark.parametrize("screen", SCREENS)
def test_underflow(screen, lm):
    """Products below fp32's normal range (hidden 2^-60, weight rows 2^-70..2^-60, some hidden elements BF16
    subnormals): the exact logits are subnormal sums; argmax still equals their argmax, and the bounds still
    contain them (a purely relative rounding term would not cover subnormal arithmetic)."""
    V, H, M = 40, 130, 3
    g = lm.gen(61)
    r = torch.randint(-70, -59, (V, 1), generator=g).float()
    w = (lm.rand_weight(V, H, seed=62, std=1.0).float() * torch.exp2(r)).to(torch.bfloat16)
    h = (lm.rand_hidden(M, H, seed=63).float() * 2.0**-60).to(torch.bfloat16)
    h[2, ::3] = (h[2, ::3].float() * 2.0**-72).to(torch.bfloat16)  # BF16 subnormals (and some zeros)
    head = lm.make_head(w, screen)
    ids, logits = lm.check_argmax(head, h)
    assert (logits.abs() < 2.0**-126).any(), "the test does not reach fp32's subnormal range"
    lm.check_answers(head, h, w, ids, logits, 3, screen in BOUNDED)


@pytest.mark.parametrize("screen", SCREENS)
def test_overflow_to_inf(screen, lm):
    """Finite BF16 inputs whose fp32 logits overflow (hidden 2^60, weight rows 2^50..2^72): some logits are
    +-Inf or NaN; argmax still follows torch.argmax on the exact logits (-1 where they hold a NaN)."""
    V, H, M = 40, 130, 4
    g = lm.gen(71)
    r = torch.randint(50, 73, (V, 1), generator=g).float()
    w = (lm.rand_weight(V, H, seed=72, std=1.0).float() * torch.exp2(r)).to(torch.bfloat16)
    h = (lm.rand_hidden(M, H, seed=73).float() * 2.0**60).to(torch.bfloat16)
    assert torch.isfinite(w).all() and torch.isfinite(h).all()
    head = lm.make_head(w, screen)
    _, logits = lm.check_argmax(head, h)
    assert (~torch.isfinite(logits)).any() and torch.isfinite(logits).any(), "no mix of finite and overflowed"


# ------------------------------------------------------------------------------------ shapes and layouts


@pytest.mark.parametrize("lead, screen", [((2, 3), "int8"), ((1, 1, 4), "w12"), ((), "int8")], ids=str)
def test_leading_dims(lead, screen, lm):
    """hidden [..., H] -> ids [...]: the leading dims flattened, the result shaped like them."""
    V, H = 29, 130
    w = lm.rand_weight(V, H, seed=81)
    M = math.prod(lead)
    h = lm.rand_hidden(M, H, seed=82)
    head = lm.make_head(w, screen)
    ids, _ = lm.check_argmax(head, h.reshape(*lead, H))
    assert_bitwise_equal(ids, head.argmax(h), "leading dims vs flat:")


def _layout(w, layout):
    V, H = w.shape
    if layout == "transposed":  # strides (1, V): a transposed-contiguous copy
        return w.t().contiguous().t()
    if layout == "col-slice":  # row stride H + 37
        big = torch.zeros(V, H + 37, dtype=w.dtype)
        big[:, 5:5 + H] = w
        return big[:, 5:5 + H]
    if layout == "row-step":  # every other row of a larger buffer
        big = torch.zeros(2 * V, H, dtype=w.dtype)
        big[::2] = w
        return big[::2]
    if layout == "parameter":
        return nn.Parameter(w.clone(), requires_grad=False)
    if layout == "embedding":  # the tied head: the embedding table itself, a Parameter that requires grad
        emb = nn.Embedding(V, H).to(torch.bfloat16)
        with torch.no_grad():
            emb.weight.copy_(w)
        return emb.weight
    raise ValueError(layout)


@pytest.mark.parametrize("layout", ["transposed", "col-slice", "row-step", pytest.param("parameter", marks=SLOW),
                                    "embedding"])
def test_weight_layouts(layout, lm):
    """A view / non-contiguous / Parameter weight (a tied embedding): the same logits bits and ids as the
    contiguous weight."""
    V, H, M = 45, 130, 3
    w = lm.rand_weight(V, H, seed=91)
    h = lm.rand_hidden(M, H, seed=92)
    want_head = lmhead.CertifiedHead(w.contiguous(), screen="int8")
    head = lmhead.CertifiedHead(_layout(w, layout), screen="int8")
    ids, logits = lm.check_argmax(head, h, msg=layout)
    assert_bitwise_equal(logits, want_head.logits(h), f"{layout} logits:")
    assert_bitwise_equal(ids, want_head.argmax(h), f"{layout} ids:")


@pytest.mark.parametrize("layout, screen", [("col-slice", "int8"), ("transposed", "w12")])
def test_hidden_layouts(layout, screen, lm):
    V, H, M = 45, 130, 4
    w = lm.rand_weight(V, H, seed=93)
    h = lm.rand_hidden(M, H, seed=94)
    if layout == "col-slice":
        big = torch.zeros(M, H + 9, dtype=torch.bfloat16)
        big[:, 9:] = h
        x = big[:, 9:]
    else:
        x = h.t().contiguous().t()
    head = lm.make_head(w, screen)
    ids, logits = lm.check_argmax(head, x, msg=layout)
    assert_bitwise_equal(logits, head.logits(h), f"{layout} logits:")
    assert_bitwise_equal(ids, head.argmax(h), f"{layout} ids:")


# ------------------------------------------------------------------------------------ capacity


@pytest.mark.parametrize("flat, screen", [("equal-rows", "int8"), ("zero-hidden", "int8"), ("zero-hidden", "w12"),
                                          pytest.param("equal-rows", "w12", marks=SLOW)])
def test_capacity_overflow_falls_back_exactly(flat, screen, lm):
    """Flat logits (every row of W equal, or h = 0) tie the whole vocabulary: with capacity 8 < V every row
    overflows and takes the full exact path (argmax 0, the lowest id; topk 0..k-1), counted as fallbacks; with
    capacity >= V no row falls back and the answers are the same."""
    V, H, M = 40, 130, 3
    if flat == "equal-rows":
        w = lm.rand_weight(1, H, seed=101).expand(V, H).contiguous()
        h = lm.rand_hidden(M, H, seed=102)
    else:
        w = lm.rand_weight(V, H, seed=103)
        h = torch.zeros(M, H, dtype=torch.bfloat16)
        h[1] = -0.0
    results = {}
    for cap, want_fallbacks in ((8, M), (V, 0)):
        head = lm.make_head(w, screen, capacity=cap)
        head.reset_stats()
        ids, logits = lm.check_argmax(head, h, msg=f"capacity {cap}")
        assert ids.tolist() == [0] * M
        st = head.stats()
        assert st["fallbacks"] == want_fallbacks, f"capacity {cap}: fallbacks {st['fallbacks']} != {want_fallbacks}"
        results[cap] = logits
        head.reset_stats()
        vals, top = lm.check_topk(head, h, 5, logits)
        assert top.tolist() == [list(range(5))] * M
        assert head.stats()["fallbacks"] == want_fallbacks, f"topk, capacity {cap}"
    assert_bitwise_equal(results[8], results[V])


def test_only_the_overflowing_row_falls_back(lm):
    """One flat row (h = 0) among peaked ones, capacity 4: exactly that row falls back, the others keep their
    screened answers, all exact."""
    V, H = 40, 130
    w = lm.rand_weight(V, H, seed=111)
    h = torch.cat([(w[[5, 17]].float() * 8).to(torch.bfloat16), torch.zeros(1, H, dtype=torch.bfloat16)])
    head = lm.make_head(w, "int8", capacity=4)
    head.reset_stats()
    ids, _ = lm.check_argmax(head, h)
    assert ids.tolist() == [5, 17, 0]
    assert head.stats()["fallbacks"] == 1
    head.reset_stats()
    head.argmax(h)
    head.argmax(h[:2])
    assert head.stats()["fallbacks"] == 1, "fallbacks must count rows, cumulatively over calls"


# ------------------------------------------------------------------------------------ non-finite values


@pytest.mark.parametrize("screen", SCREENS)
def test_nonfinite_hidden_rows(screen, lm):
    """Rows of hidden with NaN / +Inf / -Inf take the full exact path: argmax = torch.argmax of the exact logits,
    -1 where they hold a NaN; the finite rows of the same batch get the same answer as alone; the non-finite
    rows are counted as fallbacks."""
    V, H = 37, 130
    w = lm.rand_weight(V, H, seed=121)
    w[4, 3] = 0.0  # inf * 0 = NaN for token 4 where hidden[3] is infinite
    w[9, 3] = 0.0
    h = lm.rand_hidden(6, H, seed=122)
    h[1, 7] = float("nan")
    h[2, 3] = float("inf")
    h[3, 3] = float("-inf")
    h[4, 10] = float("inf")  # +Inf against weights of both signs: +-Inf logits
    h[4, 11] = float("-inf")  # and Inf - Inf: NaN where the two columns' signs agree
    head = lm.make_head(w, screen)
    head.reset_stats()
    ids, logits = lm.check_argmax(head, h, msg=screen)
    assert torch.isnan(logits[1]).all() and torch.isnan(logits[2, 4])
    assert ids[1] == ids[2] == lmhead.NAN_ID == -1  # a NaN row answers no token (never a silent 0)
    finite = [0, 5]
    alone = torch.cat([head.argmax(h[m:m + 1]) for m in finite])
    assert_bitwise_equal(ids[finite], alone, "finite rows next to non-finite ones:")
    st = head.stats()
    if screen in BOUNDED:
        assert st["fallbacks"] == 4, f"fallbacks {st['fallbacks']}: want the 4 non-finite rows"


@pytest.mark.parametrize("kind, screen", [
    pytest.param(k, s, marks=SLOW if s == "w12" and k in ("-inf", "inf-and-nan") else (), id=f"{k}-{s}")
    for s in SCREENS for k in ("inf", "-inf", "nan", "inf-and-nan")])
def test_nonfinite_weights(kind, screen, lm):
    """A head row holding +-Inf or NaN: the answers still equal torch.argmax of the exact logits (-1 for a row
    holding a NaN logit), for hidden rows where that weight meets a positive, a negative and a zero element."""
    V, H = 37, 130
    w = lm.rand_weight(V, H, seed=131)
    if kind in ("inf", "inf-and-nan"):
        w[21, 2] = float("inf")
    if kind == "-inf":
        w[3, 2] = float("-inf")
    if kind in ("nan", "inf-and-nan"):
        w[30, 64] = float("nan")
    h = lm.rand_hidden(4, H, seed=132)
    h[0, 2], h[1, 2], h[2, 2] = 0.5, -0.5, 0.0
    head = lm.make_head(w, screen)
    ids, logits = lm.check_argmax(head, h, msg=kind)
    if kind == "inf":
        assert ids[0] == 21 and ids[1] != 21 and torch.isnan(logits[2, 21])
    if kind in ("nan", "inf-and-nan"):
        assert torch.isnan(logits[:, 30]).all() and (ids == lmhead.NAN_ID).all()
    # the finite tokens' logits and the other rows are untouched: the finite part still matches fp64
    fin = torch.isfinite(w).all(1)
    lm.check_reference(torch.argmax(logits[:, fin], 1), h, w[fin])


# ------------------------------------------------------------------------------------ stats


def test_stats_and_reset(lm):
    V, H, M = 60, 130, 3
    w = lm.rand_weight(V, H, seed=141)
    h = lm.rand_hidden(M, H, seed=142)
    head = lm.make_head(w, "int8")
    head.reset_stats()
    st = head.stats()
    assert st["calls"] == 0 and st["fallbacks"] == 0
    head.argmax(h)
    st = head.stats()
    for key in ("calls", "rows", "survivors", "survivors_mean", "fallbacks", "screen", "bound"):
        assert key in st, f"stats() has no {key!r}"
    assert st["calls"] == 1 and st["rows"] == M and st["fallbacks"] == 0
    assert st["screen"] == "int8"
    assert isinstance(st["survivors"], list) and len(st["survivors"]) == M
    assert all(isinstance(x, int) and 1 <= x <= V for x in st["survivors"]), st["survivors"]
    assert st["survivors_mean"] == pytest.approx(sum(st["survivors"]) / M)
    head.argmax(h[:2])
    st = head.stats()
    assert st["calls"] == 2 and len(st["survivors"]) == 2, "survivors are those of the last call"
    head.reset_stats()
    st = head.stats()
    assert st["calls"] == 0 and st["fallbacks"] == 0


# ------------------------------------------------------------------------------------ bad input


def _bad_calls(lm):
    V, H = 20, 40
    w = lm.rand_weight(V, H, seed=151)
    h = lm.rand_hidden(2, H, seed=152)
    head = lmhead.CertifiedHead(w, screen="int8", capacity=8)
    return {
        "hidden-fp32": (lambda: head.argmax(h.float()), TypeError, [r"bf16|bfloat16"]),
        "hidden-fp16": (lambda: head.argmax(h.half()), TypeError, [r"bf16|bfloat16"]),
        "topk-hidden-fp32": (lambda: head.topk(h.float(), 2), TypeError, [r"bf16|bfloat16"]),
        "logits-hidden-fp32": (lambda: head.logits(h.float()), TypeError, [r"bf16|bfloat16"]),
        "hidden-last-dim": (lambda: head.argmax(lm.rand_hidden(2, H + 1)), ValueError, [str(H)]),
        "topk-last-dim": (lambda: head.topk(lm.rand_hidden(2, H - 1), 2), ValueError, [str(H)]),
        "k=0": (lambda: head.topk(h, 0), ValueError, [r"\bk\b"]),
        "k>V": (lambda: lmhead.CertifiedHead(w, screen="int8").topk(h, V + 1), ValueError, [r"\bk\b"]),
        "k>capacity": (lambda: head.topk(h, 9), ValueError, [r"\bk\b|capacity"]),
        "w12-screen-bf16": (lambda: lmhead.CertifiedHead(w, screen="w12"), (TypeError, ValueError), [r"w12|W12"]),
        "unknown-screen": (lambda: lmhead.CertifiedHead(w, screen="fp8"), ValueError, [r"screen", r"fp8"]),
        "weight-fp32": (lambda: lmhead.CertifiedHead(w.float(), screen="int8"), TypeError, [r"bf16|bfloat16|W12"]),
        "weight-1d": (lambda: lmhead.CertifiedHead(w[0], screen="int8"), (TypeError, ValueError), [r"weight"]),
    }


BAD = ["hidden-fp32", "hidden-fp16", "topk-hidden-fp32", "logits-hidden-fp32", "hidden-last-dim", "topk-last-dim",
       "k=0", "k>V", "k>capacity", "w12-screen-bf16", "unknown-screen", "weight-fp32", "weight-1d"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_says_how_to_fix(case, lm):
    call, exc, patterns = _bad_calls(lm)[case]
    with lm.expect_error(*patterns, exc=exc):
        call()


def test_int8_tables_match_the_reference(lm):
    """The INT8 screen's codes and BF16 scales are lmhead.int8_screen_reference's (per 128-column group:
    scale = max|w| / 127 rounded up to BF16, codes rounded), and its stored error bound covers the
    reference's exact per-group error."""
    w = lm.rand_weight(37, 300, seed=181)
    head = lmhead.CertifiedHead(w, screen="int8")
    q, scale, err = lmhead.int8_screen_reference(w, 128)
    assert torch.equal(head.tables["q"], q)
    assert_bitwise_equal(head.tables["scale"], scale)
    assert (head.tables["err"].double() >= err).all()
