"""The stream-K unit split and deterministic fix-up of the W12 CUDA kernels (w12_common.cuh's sk_ctas / sk_slot /
sk_arrive, used by w12_tma.cu's TmaConfig.sk path and w12_flow.cu's W12F_SK build), and the flow kernel's dynamic
tasks (W12F_DYN: tickets, the row sets' counters and the piece-order sum), ported line by line for the CPU tests."""

from __future__ import annotations

import operator
from typing import Any, Callable

import numpy as np


def run_stream_k(groups: int, per: int, ctas: int, share: Callable[[int, int, int], Any],
                 finish: Callable[[int, Any], None], seed: int = 0, *, add: Callable[[Any, Any], Any] = operator.add,
                 from_zero: bool = True) -> None:
    """Run the split of U = groups x per units over P = ctas CTAs (P <= U, as the launchers guarantee).

    CTA b takes units [b U / P, (b + 1) U / P); `share(rg, c0, n)` is what its units c0 .. c0 + n - 1 of row
    group rg add up to. A row group the CTA covers whole is finished at once (`finish(rg, total)`); one it covers
    in part goes to workspace slot 0 (its first row group) or 1 as it finishes. After its last unit the CTA
    arrives once per such row group, and the arrival that brings the counter to the group's CTA count adds the
    slots of CTAs b0 .. b1 in CTA order and finishes the group. CTAs run one after another in a random order
    (`seed`), so any of them can be the last to arrive; checks that no slot is written twice and that every
    counter ends at zero. The slots are added by `add`, from +0.0 (`from_zero`: the TMA kernel's sk_sum) or from the
    first CTA's slot (the flow kernel)."""
    U, P = groups * per, ctas
    assert 0 < P <= U, "the launchers never make more CTAs than units"

    def sk_ctas(rg):
        u0 = rg * per
        return ((u0 + 1) * P - 1) // U, ((u0 + per) * P - 1) // U

    def sk_slot(b, rg):
        return 0 if (b * U // P) // per == rg else 1

    ws, counters = {}, np.zeros(groups, dtype=np.int64)
    for b in np.random.default_rng(seed).permutation(P):
        ub, ue = b * U // P, (b + 1) * U // P
        assert ue > ub, "every CTA has a unit"
        shared = [-1, -1]  # the row groups this CTA covers only in part (first, last)
        u = ub
        while u < ue:
            rg, c0 = u // per, u % per
            n = min(per - c0, ue - u)
            acc = share(rg, c0, n)
            if n == per:
                finish(rg, acc)
            else:
                slot = 0 if u == ub else 1
                assert shared[slot] < 0 and (b, slot) not in ws, f"workspace slot {(b, slot)} written twice"
                shared[slot] = rg
                ws[(b, slot)] = acc
            u += n
        for rg in shared:
            if rg < 0:
                continue
            b0, b1 = sk_ctas(rg)
            last = counters[rg] == b1 - b0
            counters[rg] += 1
            if last:
                counters[rg] = 0
                total = 0.0 if from_zero else None  # in CTA order
                for bb in range(b0, b1 + 1):
                    slot = ws[(bb, sk_slot(bb, rg))]
                    total = slot if total is None else add(total, slot)
                finish(rg, total)
    assert not counters.any(), "a row group's counter was left non-zero"


def run_dynamic(sets: int, pieces: int, ctas: int, task: Callable[[int, int], Any], finish: Callable[[int, Any], None],
                seed: int = 0, *, add: Callable[[Any, Any], Any] = operator.add) -> list[int]:
    """Run the dynamic tasks of w12_flow.cu's W12F_DYN build: T = sets x pieces tasks, task t = set pieces + q, on a
    grid of P = ctas CTAs. CTA b takes task b first; at each task's start (after its wait for the previous kernel)
    thread 0 draws a ticket, P + the ticket counter's value before its increment, which is the CTA's next task, read
    at this task's end; the CTA stops at a ticket >= T. `task(set, q)` is what its units add up to. With pieces > 1
    each task's sum goes to workspace slot t and the CTA that counts last in its row set's counter adds the set's
    slots in piece order (from slot 0) and finishes the set; with 1 the task finishes its set at once. Each CTA's
    two steps (a task's start, its end) are interleaved with the other CTAs' in a random order (`seed`), so that any
    CTA may draw any ticket and count last anywhere. Checks that every task runs once, no slot is written twice,
    and that every counter, the ticket counter and the count of CTAs done are zero at the end (the last CTA to
    leave resets the latter two). Returns the tasks each CTA ran, in order (for the tests)."""
    T, P = sets * pieces, ctas
    assert P >= 1
    rng = np.random.default_rng(seed)
    ws, counters = {}, np.zeros(sets, dtype=np.int64)
    tickets = done = 0
    cur = list(range(P))          # each CTA's task (>= T: none)
    drawn: list[int | None] = [None] * P  # its ticket drawn at that task's start
    ran: list[list[int]] = [[] for _ in range(P)]
    left = set(range(P))
    for b in range(P):
        if cur[b] >= T:  # a CTA without a task leaves at once
            left.discard(b)
            done += 1
    seen = set()
    while left:
        b = int(rng.choice(sorted(left)))
        if drawn[b] is None:  # the task's start: the ticket
            drawn[b] = P + tickets
            tickets += 1
            continue
        t = cur[b]
        assert t not in seen, f"task {t} ran twice"
        seen.add(t)
        ran[b].append(t)
        rs, q = divmod(t, pieces)
        acc = task(rs, q)
        if pieces == 1:
            finish(rs, acc)
        else:
            assert t not in ws, f"workspace slot {t} written twice"
            ws[t] = acc
            last = counters[rs] == pieces - 1
            counters[rs] += 1
            if last:
                counters[rs] = 0
                total = ws[rs * pieces]
                for r in range(1, pieces):
                    total = add(total, ws[rs * pieces + r])
                finish(rs, total)
        cur[b], drawn[b] = drawn[b], None
        if cur[b] >= T:
            left.discard(b)
            done += 1
            if done == P:  # the last CTA to leave
                tickets = done = 0
    assert seen == set(range(T)), f"tasks {sorted(set(range(T)) - seen)} never ran"
    assert not counters.any() and tickets == 0 and done == 0, "a counter was left non-zero"
    return ran
