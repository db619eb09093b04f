"""Property tests of lmhead.CertifiedHead on the CPU (hypothesis, fixed seed; the Triton interpreter).

Random heads V in [1, 300] x H in [1, 200], M in [1, 4] hidden rows, spread row scales (2^-20..2^20 on the
hidden rows, 2^-12..2^12 on the weight rows), planted exact duplicates and one-ulp near-duplicates of the
winning row, optional non-contiguous layouts; each screen ("int8", "w12" on the W12Weight, "none"):

* argmax == torch.argmax(head.logits) bit for bit (ties -> lowest id);
* L <= every exact logit <= U and L <= every fp64 logit <= U, (L, U) = lmhead.screen_bounds;
* topk == the stable descending sort of the logits (ids and value bits);
* the fp64 argmax wherever its margin provably survives fp32 rounding;
* non-finite hidden elements: the row follows torch.argmax (lmhead.NAN_ID where its logits hold a NaN), the
  other rows are unaffected.
Helpers: conftest.py (fixture `lm`).
"""

from __future__ import annotations

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specpilot.testing import assert_bitwise_equal  # noqa: E402

# The interpreter runs the kernels in numpy, which warns on the overflow / Inf / NaN / x / 0 arithmetic these
# tests plant on purpose (the results are checked, the warnings say nothing more).
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

# No shrinking: one example costs about a second under the interpreter, and a shrink of a failure would run
# hundreds; every assertion message carries the drawn case (V, H, M, planting, screen, layout, scales).
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=True,
                phases=[Phase.explicit, Phase.reuse, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


def fuzz(n: int) -> settings:
    """`n` cases, drawn from a fixed seed (derandomize): every run checks the same cases."""
    return settings(FUZZ, max_examples=n)


@st.composite
def heads(draw, max_v=300, max_h=200, max_m=4):
    """(weight BF16 [V, H], hidden BF16 [M, H], screen, description)."""
    V = draw(st.integers(1, max_v))
    H = draw(st.integers(1, max_h))
    M = draw(st.integers(1, max_m))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g) * 0.05
    if draw(st.booleans()):  # weight rows at spread scales
        w = w * torch.exp2(torch.randint(-12, 13, (V, 1), generator=g).float())
    h = torch.randn(M, H, generator=g)
    hexp = draw(st.lists(st.integers(-20, 20), min_size=M, max_size=M))
    h = h * torch.exp2(torch.tensor(hexp, dtype=torch.float32))[:, None]
    w, h = w.to(torch.bfloat16), h.to(torch.bfloat16)
    # planted: a winning row (aligned with hidden row 0), its exact duplicates and one-ulp neighbours
    plant = draw(st.sampled_from(["none", "dup", "ulp", "dup+ulp", "all-equal", "zero-row"]))
    if plant != "none" and V >= 2:
        ids = draw(st.lists(st.integers(0, V - 1), min_size=2, max_size=min(V, 4), unique=True))
        base = (torch.sign(h[0].float()) * (torch.rand(H, generator=g) * 0.1 + 0.01)).to(torch.bfloat16)
        if plant == "all-equal":
            w[:] = base
        elif plant == "zero-row":
            h[draw(st.integers(0, M - 1))] = 0.0
        else:
            for i, v in enumerate(ids):
                row = base.clone()
                if "ulp" in plant and (i > 0 or plant == "ulp"):
                    j = draw(st.integers(0, H - 1))
                    if row[j] != 0:
                        b = row[j:j + 1].view(torch.int16).int() + draw(st.sampled_from([1, -1]))
                        row[j] = b.to(torch.int16).view(torch.bfloat16)[0]
                w[v] = row
    screen = draw(st.sampled_from(["int8", "w12", "none"]))
    layout = draw(st.sampled_from(["contiguous", "contiguous", "transposed", "col-slice"]))
    if layout == "transposed":
        w = w.t().contiguous().t()
    elif layout == "col-slice":
        big = torch.zeros(V, H + 3, dtype=torch.bfloat16)
        big[:, 3:] = w
        w = big[:, 3:]
    return w, h, screen, f"V={V} H={H} M={M} plant={plant} screen={screen} layout={layout} hexp={hexp}"


@fuzz(25)
@given(case=heads())
def test_argmax_is_argmax_of_logits_and_inside_the_bounds(case, lm):
    w, h, screen, desc = case
    head = lm.make_head(w, screen)
    ids, logits = lm.check_argmax(head, h, msg=desc)
    lm.check_reference(ids, h, w.contiguous(), msg=desc)
    if screen != "none":
        lm.check_bounds(head, h, w.contiguous(), logits, msg=desc)


@fuzz(10)
@given(case=heads(max_v=120, max_h=130, max_m=3), k=st.integers(1, 300))
def test_topk_is_the_sorted_logits(case, k, lm):
    w, h, screen, desc = case
    k = min(k, w.shape[0])
    head = lm.make_head(w, screen)
    lm.check_topk(head, h, k, msg=f"{desc} k={k}")


@fuzz(10)
@given(case=heads(max_v=120, max_h=130, max_m=4),
       poison=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 199),
                                 st.sampled_from([float("nan"), float("inf"), -float("inf")])), min_size=1,
                       max_size=3))
def test_nonfinite_hidden_rows_follow_torch_argmax(case, poison, lm):
    w, h, screen, desc = case
    M, H = h.shape
    bad = set()
    for m, k, x in poison:
        h[m % M, k % H] = x
        bad.add(m % M)
    head = lm.make_head(w, screen)
    head.reset_stats()
    head.argmax(h)
    if screen != "none":  # V <= 120 < the default capacity: only the non-finite rows fall back
        assert head.stats()["fallbacks"] == len(bad), f"{desc}: fallbacks {head.stats()['fallbacks']} != {len(bad)}"
    ids, _ = lm.check_argmax(head, h, msg=f"{desc} poison={poison}")
    good = [m for m in range(M) if m not in bad]
    if good:
        assert_bitwise_equal(ids[good], head.argmax(h[good]), f"{desc}: finite rows beside non-finite ones")
