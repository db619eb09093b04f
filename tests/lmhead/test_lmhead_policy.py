"""CPU tests of the certified head's early fallback (docs/lmhead.md): after a call whose rows overflowed the
capacity, the next calls with as many rows skip the screen for a run of calls (1, 2, 4, ..., lmhead.MAX_SKIP), and
a retried screen that keeps every row within capacity resets the run. The Triton kernels run under the interpreter.

Oracles: lmhead.early_fallback_reference (the rule in plain Python) for the decisions; head.argmax / head.topk
against head.logits bit for bit (conftest.py, fixture `lm`) on every call.
"""

import pytest
import torch

import lmhead
from lmhead import ops

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

V, H, CAP = 40, 130, 8


def runs(skips):
    """Lengths of the runs of skipped calls in a list of decisions."""
    out, n = [], 0
    for s in skips + [False]:
        if s:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out


def test_reference_doubles_caps_and_resets():
    """Every screen fails: runs of 1, 2, 4, ..., 64, then 64 again; a screen that succeeds restarts at 1."""
    skips = lmhead.early_fallback_reference([True] * 300)
    assert runs(skips)[:9] == [1, 2, 4, 8, 16, 32, 64, 64, 64] and max(runs(skips)) == lmhead.MAX_SKIP == 64
    # fail, skip, fail, skip 2, succeed (run reset), fail, skip 1 (not 4), ...
    script = [True, True, True, True, True, False, True, True, True]
    assert lmhead.early_fallback_reference(script) == [False, True, False, True, True, False, False, True, False]
    # a skipped call's own logits are never looked at
    assert lmhead.early_fallback_reference([True, False, True]) == [False, True, False]


def _tiny_head(capacity=4):
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    return lmhead.CertifiedHead(w, screen="int8", capacity=capacity)


@pytest.mark.parametrize("M", [3, 130], ids=["M3", "M130"])
def test_policy_kernel_follows_the_reference(M):
    """lmhead_policy_kernel alone, on scripted survivor counts (the selection's output) over 205 calls: fail
    until the run reaches the cap twice, then succeed, then fail again (the run restarts at 1). Its skip flag
    and state after every call are the reference's. A count of exactly the capacity is no overflow; the
    overflowing row is the last (M = 130: past the kernel's first block of 128 rows). A skipped call's counts
    change nothing, even over capacity."""
    hd = _tiny_head(capacity=4)
    state = hd._start_policy(M, "argmax")
    within = torch.zeros(M, dtype=torch.int32)
    within[0] = 4  # == capacity: no overflow
    over = within.clone()
    over[-1] = 5
    script = [True] * 199 + [False] + [True] * 5
    want = lmhead.early_fallback_reference(script)
    left, run = 0, 1
    for i, fail in enumerate(script):
        ops._launch_policy(hd, state, None, M)
        assert bool(state[ops._SKIP]) == want[i], f"call {i}: skip {bool(state[ops._SKIP])} != {want[i]}"
        ops._launch_policy(hd, state, over if fail else within, M)
        if want[i]:
            left -= 1
        elif fail:
            left, run = run, min(2 * run, 64)
        else:
            run = 1
        got = state.tolist()
        assert (got[ops._LEFT], got[ops._RUN]) == (left, run), f"call {i}: state {got}, want left {left} run {run}"
        assert got[ops._CALLS] == i + 1 and got[ops._SKIPPED] == sum(want[:i + 1]), f"call {i}: state {got}"
    assert runs(want[:199]) == [1, 2, 4, 8, 16, 32, 64, 64] and not want[199] and runs(want[199:]) == [1, 2]


@pytest.mark.slow
def test_head_reaches_the_cap_with_exact_answers(lm):
    """A whole head (V = 9, capacity 1, one row) over 205 calls: a zero hidden row (every token ties) until
    the skipped runs reach 64 twice, one peaked call (screened: the run restarts), then zero rows again. The
    decisions follow the reference, and every answer is the exact logits' argmax."""
    w = lm.rand_weight(9, 16, seed=202)
    head = lmhead.CertifiedHead(w, screen="int8", capacity=1)
    flat = torch.zeros(1, 16, dtype=torch.bfloat16)
    peaked = (w[6:7].float() * 8).to(torch.bfloat16)
    exact = {True: lm.argmax_of(head.logits(flat)), False: lm.argmax_of(head.logits(peaked))}
    assert exact[True].tolist() == [0] and exact[False].tolist() == [6]
    script = [True] * 199 + [False] + [True] * 5
    want = lmhead.early_fallback_reference(script)
    for i, fail in enumerate(script):
        ids = head.argmax(flat if fail else peaked)
        assert torch.equal(ids, exact[fail]), f"call {i}: {ids.tolist()} != {exact[fail].tolist()}"
        assert bool(head._policies[1][ops._SKIP]) == want[i], f"call {i}"
    assert runs(want[:199]) == [1, 2, 4, 8, 16, 32, 64, 64] and runs(want[199:]) == [1, 2]
    st = head.stats()
    assert st["policy"][1] == {"calls": 205, "skipped": sum(want), "last_skipped": True, "left": 0, "run": 4}
    assert st["fallbacks"] == sum(f and not s for f, s in zip(script, want))


def _inputs(lm):
    w = lm.rand_weight(V, H, seed=201)
    peaked = (w[[5, 17, 30]].float() * 8).to(torch.bfloat16)  # a clear winner each: a few survivors
    flat = peaked.clone()
    flat[1] = 0.0  # every token ties in row 1: V > capacity survivors, the row overflows
    return w, peaked, flat


def test_decisions_and_answers_per_row_count(lm):
    """Two row counts called in turn, each with its own script of flat (a row overflows) and peaked calls:
    each count's skip decisions follow the reference on its own calls only; every answer (argmax; topk on some
    M = 3 calls, which share the state) equals the exact logits' bit for bit; a skipped call reports every
    token as computed exactly and adds no fallback; a screened flat call adds its one overflowing row."""
    w, peaked, flat = _inputs(lm)
    head = lmhead.CertifiedHead(w, screen="int8", capacity=CAP)
    head.reset_stats()
    scripts = {2: [True] * 2 + [False] * 2 + [True] * 4 + [False] * 2, 3: [True] * 3 + [False] * 3 + [True] * 3}
    want = {M: lmhead.early_fallback_reference(s) for M, s in scripts.items()}
    done = {2: 0, 3: 0}
    fallbacks = 0
    order = [2, 3, 2, 2, 3, 3, 2, 3, 2, 2, 3, 2, 3, 3, 2, 3, 2, 3, 2]
    assert sorted(order) == [2] * 10 + [3] * 9
    for step, M in enumerate(order):
        i = done[M]
        h = (flat if scripts[M][i] else peaked)[:M]
        if M == 3 and i % 3 == 2:
            lm.check_topk(head, h, 4, msg=f"step {step} M={M}")
        else:
            ids, _ = lm.check_argmax(head, h, msg=f"step {step} M={M}")
            if not scripts[M][i]:
                assert ids.tolist() == [5, 17, 30][:M]
        done[M] += 1
        st = head.stats()
        pol = st["policy"]
        assert sorted(pol) == sorted(m for m in done if done[m]), pol
        for m in pol:  # this call moved its own row count only
            assert pol[m]["calls"] == done[m], (step, pol)
            assert pol[m]["skipped"] == sum(want[m][:done[m]]), (step, m, pol[m], want[m][:done[m]])
        assert pol[M]["last_skipped"] == want[M][i], (step, M, pol[M])
        if want[M][i]:
            assert st["survivors"] == [V] * M
        else:
            assert scripts[M][i] or max(st["survivors"]) <= CAP, st["survivors"]
            fallbacks += int(scripts[M][i])  # the one flat row of a screened flat call
        assert st["fallbacks"] == fallbacks, (step, st["fallbacks"], fallbacks)
    assert runs(want[2]) == [1, 1, 2] and runs(want[3]) == [1, 2, 1]
    assert not want[2][-1] and not want[3][5], "the scripts reach a screen that succeeds"


def test_reset_stats_restarts_the_policy(lm):
    """reset_stats() restarts every row count's policy in place (the same tensor: a captured CUDA graph reads
    it): the next call screens again, and the run starts at 1."""
    w, peaked, flat = _inputs(lm)
    head = lmhead.CertifiedHead(w, screen="int8", capacity=CAP)
    for _ in range(3):  # screen fails, skip, screen fails: 2 calls left to skip, next run 4
        lm.check_argmax(head, flat)
    state = head._policies[3]
    assert head.stats()["policy"][3] == {"calls": 3, "skipped": 1, "last_skipped": False, "left": 2, "run": 4}
    head.reset_stats()
    assert head._policies[3] is state
    assert head.stats()["policy"][3] == {"calls": 0, "skipped": 0, "last_skipped": False, "left": 0, "run": 1}
    assert head.stats()["fallbacks"] == 0
    lm.check_argmax(head, flat)
    assert head.stats()["policy"][3] == {"calls": 1, "skipped": 0, "last_skipped": False, "left": 1, "run": 2}
    assert head.stats()["fallbacks"] == 1


def test_skip_flag_stops_the_screen_and_selection(lm):
    """With the flag set, the screen writes no bound (U stays as allocated: NaN under the tests' poisoned
    torch.empty) and raises no best lower bound, and the selection lists nothing (counts 0); without it, both run."""
    w, peaked, _ = _inputs(lm)
    head = lmhead.CertifiedHead(w, screen="int8", capacity=CAP)
    for skip in (1, 0):
        state = torch.tensor([skip, 0, 1, 0, 0], dtype=torch.int32)
        p, _, _ = ops._survivors(head, peaked, None, state)
        if skip:
            assert torch.isnan(p["up"]).all() and (p["best"] == float("-inf")).all() and (p["count"] == 0).all()
        else:
            assert torch.isfinite(p["up"]).all() and torch.isfinite(p["best"]).all() and (p["count"] >= 1).all()


def test_rows_over_capacity_skip_the_survivor_pass(lm):
    """The survivors pass leaves a row over capacity alone (the full pass recomputes it) and writes the others:
    their exact logits, -inf past the count; with the skip flag set it writes nothing."""
    w, _, flat = _inputs(lm)
    head = lmhead.CertifiedHead(w, screen="int8", capacity=CAP)
    p, _, surv = ops._survivors(head, flat, None)
    count = p["count"].tolist()
    assert count[1] > CAP and count[0] <= CAP and count[2] <= CAP, count
    logits = head.logits(flat)
    for skip in (None, torch.tensor([1, 0, 1, 0, 0], dtype=torch.int32)):
        sv = torch.full((3, CAP), float("nan"))
        ops._launch_exact(head, flat, p, surv, sv, None, full=False, skip=skip)
        assert torch.isnan(sv[1]).all(), "the overflowing row was recomputed"
        if skip is not None:
            assert torch.isnan(sv).all(), "a skipped call recomputed survivors"
            continue
        for m in (0, 2):
            n = count[m]
            ids = surv[m, :n].long()
            assert torch.equal(sv[m, :n].view(torch.int32), logits[m, ids].view(torch.int32)), f"row {m}"
            assert (sv[m, n:] == float("-inf")).all(), f"row {m} past its count"


def test_no_policy_without_a_screen(lm):
    """screen="none" runs the exact head on every call: no policy state is made."""
    w, _, flat = _inputs(lm)
    head = lmhead.CertifiedHead(w, screen="none")
    lm.check_argmax(head, flat)
    assert head.stats()["policy"] == {}


def test_first_call_of_a_row_count_inside_capture_says_how_to_fix(lm, monkeypatch):
    """The state of a row count is made by an eager call: made inside a CUDA-graph capture, its
    initialisation would be captured and replayed. Such a call is refused with the fix (warm up first)."""
    w, _, _ = _inputs(lm)
    head = lmhead.CertifiedHead(w, screen="int8", capacity=CAP)
    monkeypatch.setattr(head, "device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with lm.expect_error(r"CUDA graph", r"warm-up", r"5 rows", exc=RuntimeError):
        head._start_policy(5, "argmax")
