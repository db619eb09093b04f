"""CPU tests of the hidden states in two int8 parts (lmhead/configs.py `split_rows`; docs/lmhead.md, "Hidden states
in two parts"): calls of at most 8 rows quantise each hidden row, then the first part's rounding again, and the
quantised screens multiply both parts.

* The prep's claims, checked in fp64 from the int8 codes and scales it stored (what the screen multiplies), for the
  torch prep and the Triton prep kernel (interpreter): codes in [-127, 127], eh[m, g] >= max |h - both parts| per
  group, dh >= its 2-norm, hqn >= the sum of the parts' 2-norms, on Gaussian rows, magnitudes 2^-20..2^20, rows
  near BF16's least normal and its subnormals, huge rows, zero groups and one-entry groups.
* The bound still holds where the hidden side is all the screen's error (weights on the INT8 grid) and on the
  INT8 worst case, and the answers stay the exact logits'.
* The split pays: on Gaussian rows the radius falls to about half (the hidden states' term to about nothing), and
  no row keeps more survivors than without it.
"""

import dataclasses

import pytest
import torch

import autotune
import lmhead
from lmhead.configs import _heuristic
from lmhead.ops import _groups, _prep, _prep_triton

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

GROUP = 128


def _rows(kind, M, H, seed):
    """[M, H] BF16 hidden rows of one hostile family."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        x = torch.randn(M, H, generator=g)
    elif kind == "spread":  # magnitudes 2^-20..2^20, random signs: most entries far below their group's max
        x = torch.exp2(torch.randint(-20, 21, (M, H), generator=g).float()) * torch.randn(M, H, generator=g).sign()
    elif kind == "least-normal":  # around BF16's least normal 2^-126, and its subnormals
        x = torch.randn(M, H, generator=g) * 2.0**-124
        x[:, ::3] = torch.randint(-127, 128, (M, len(range(0, H, 3))), generator=g).float() * 2.0**-133
    elif kind == "huge":
        x = torch.randn(M, H, generator=g) * 2.0**100
    elif kind == "sparse":  # zero groups, groups of one entry, one entry much larger than the rest
        x = torch.zeros(M, H)
        x[:, 0] = 3.0
        x[:, 1:GROUP:7] = torch.randn(M, len(range(1, GROUP, 7)), generator=g) * 2.0**-12
        if H > GROUP:
            x[:, GROUP + 5] = -2.0**-30
    else:
        raise KeyError(kind)
    return x.to(torch.bfloat16)


KINDS = ["gauss", "spread", "least-normal", "huge", "sparse"]


def _check_prep(p, h, M, H, split):
    hd = h.double()
    parts = 2 if split else 1
    G = -(-H // GROUP)
    q = p["hq"].double()
    assert tuple(q.shape) == (parts * M, H) and p["hq"].dtype == torch.int8
    assert bool((q.abs() <= 127).all())
    sh = p["sh"].double()
    approx = [(_groups(q[i * M:(i + 1) * M], GROUP) * sh[i * M:(i + 1) * M, :, None]).view(M, -1)[:, :H]
              for i in range(parts)]
    rest = hd - sum(approx)  # exact in fp64: 8-bit BF16 values minus fp32 scales times 7-bit integers
    emax = _groups(rest.abs(), GROUP).amax(-1)
    assert bool((p["eh"].double() >= emax).all()), \
        f"eh below the rounding left: {(emax - p['eh'].double()).max().item()!r}"
    assert bool((p["dh"].double() >= rest.norm(dim=-1)).all()), "dh below ||h - parts||"
    norms = sum(a.norm(dim=-1) for a in approx)
    assert bool((p["hqn"].double() >= norms).all()), "hqn below the sum of the parts' norms"
    assert tuple(p["eh"].shape) == (M, G)
    return emax, rest


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("kind", KINDS)
def test_parts_bound_what_they_leave(kind, kernel):
    M, H = 3, 2 * GROUP + 40
    h = _rows(kind, M, H, seed=len(kind))
    prep = _prep if kernel == "torch" else _prep_triton
    one = prep(h, GROUP, True)
    two = prep(h, GROUP, True, True)
    e1, _ = _check_prep(one, h, M, H, False)
    e2, rest = _check_prep(two, h, M, H, True)
    assert bool((e2 <= e1).all()), "the second part left more than the first"
    if kind in ("gauss", "huge"):  # a dense row: the second part takes off about 250-fold (>= 100 asked)
        assert float(e2.max()) * 100 <= float(e1.max()), (float(e1.max()), float(e2.max()))
        # the stored bound is tight: eh within 2^-18 of the rounding it bounds, where that is a normal number
        eh = two["eh"].double()
        assert bool((eh <= e2 * (1 + 2.0**-18) + 2.0**-146).all())


def _grid_weight(V, H, seed):
    """BF16 weights on the INT8 screen's grid (each group holds +-127 2^(r-7), so its scale is 2^(r-7) exactly):
    the screen's weights are exact and the hidden states' rounding is all its error."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-126, 127, (V, H), generator=g).double()
    q[:, ::GROUP] = 127.0
    r = torch.randint(-8, 9, (V, 1), generator=g).double()
    w64 = q * torch.exp2(r - 7)
    w = w64.to(torch.bfloat16)
    assert torch.equal(w.double(), w64)
    return w


@pytest.mark.parametrize("kind", KINDS)
def test_bounds_hold_when_the_hidden_side_is_all_the_error(kind, lm):
    V, H, M = 40, 2 * GROUP + 40, 4
    w = _grid_weight(V, H, seed=7)
    h = _rows(kind, M, H, seed=11)
    # hidden signs lined up with token m's weights: every product's rounding adds in the same direction
    h = (h.float().abs() * torch.where(w[:M].float() < 0, -1.0, 1.0)).to(torch.bfloat16)
    for screen in ("int8", "int4"):
        head = lm.make_head(w, screen)
        ids, logits = lm.check_argmax(head, h, msg=f"{kind}/{screen}")
        lm.check_bounds(head, h, w, logits, msg=f"{kind}/{screen}")
        lm.check_reference(ids, h, w, msg=f"{kind}/{screen}")


@pytest.mark.parametrize("screen", ["int8", "int4"])
def test_bounds_hold_in_the_int8_worst_case(screen, lm):
    w, h = lm.worst_case_int8(65, 257, 6, seed=3)
    head = lm.make_head(w, screen)
    ids, logits = lm.check_argmax(head, h)
    lm.check_bounds(head, h, w, logits)
    lm.check_topk(head, h, 4, logits)


def _head(w, screen, split_rows):
    with autotune.force("lmhead.argmax", config=dataclasses.replace(_heuristic(True), split_rows=split_rows)):
        return lmhead.CertifiedHead(w, screen=screen)


@pytest.mark.parametrize("screen", ["int8", "int4"])
def test_split_narrows_the_interval(screen, lm):
    V, H, M = 96, 3 * GROUP, 4
    w = lm.rand_weight(V, H, seed=5)
    h = lm.rand_hidden(M, H, seed=6)
    peaked = (w[[9, 50]].float() * 4 + h[:2].float() * 0.5).to(torch.bfloat16)  # two rows with a clear winner
    h = torch.cat([h, peaked])
    split, whole = _head(w, screen, 8), _head(w, screen, 0)
    Ls, Us = lmhead.screen_bounds(split, h)
    Lw, Uw = lmhead.screen_bounds(whole, h)
    ratio = ((Us - Ls) / (Uw - Lw)).median().item()
    # INT8: the radius is the weights' and the hidden states' terms in about equal parts, and the split takes
    # the second away; INT4's weight term is about 16 times larger, so its radius falls by a few percent
    assert ratio < (0.65 if screen == "int8" else 0.99), f"median radius ratio {ratio:.3f}"
    for head in (split, whole):
        lm.check_argmax(head, h)
    split.reset_stats()
    whole.reset_stats()
    split.argmax(h)
    whole.argmax(h)
    s, u = split.stats()["survivors"], whole.stats()["survivors"]
    assert all(a <= b for a, b in zip(s, u)), f"survivors with the split {s}, without {u}"


def test_more_rows_than_split_rows_read_one_part(lm):
    """Above split_rows the screen reads one part; both give the exact answers (the policy is by row count)."""
    V, H = 50, 130
    w = lm.rand_weight(V, H, seed=8)
    h = lm.rand_hidden(9, H, seed=9)
    head = lm.make_head(w, "int8")
    ids9, logits9 = lm.check_argmax(head, h)
    ids8, _ = lm.check_argmax(head, h[:8])
    assert torch.equal(ids9[:8], ids8)
    lm.check_bounds(head, h, w, logits9)
