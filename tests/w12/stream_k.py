"""The stream-K unit split and deterministic fix-up of the W12 TMA kernel (w12_common.cuh's sk_ctas / sk_slot /
sk_arrive, used by w12_tma.cu's TmaConfig.sk path), ported line by line for the CPU tests."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


def run_stream_k(groups: int, per: int, ctas: int, share: Callable[[int, int, int], Any],
                 finish: Callable[[int, Any], None], seed: int = 0) -> None:
    """Run the split of U = groups x per units over P = ctas CTAs (P <= U, as the launchers guarantee).

    CTA b takes units [b U / P, (b + 1) U / P); `share(rg, c0, n)` is what its units c0 .. c0 + n - 1 of row
    group rg add up to. A row group the CTA covers whole is finished at once (`finish(rg, total)`); one it covers
    in part goes to workspace slot 0 (its first row group) or 1 as it finishes. After its last unit the CTA
    arrives once per such row group, and the arrival that brings the counter to the group's CTA count adds the
    slots of CTAs b0 .. b1 in CTA order and finishes the group. CTAs run one after another in a random order
    (`seed`), so any of them can be the last to arrive; checks that no slot is written twice and that every
    counter ends at zero. The slots are added from +0.0 (the kernel's sk_sum)."""
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
                total = 0.0  # in CTA order
                for bb in range(b0, b1 + 1):
                    total = total + ws[(bb, sk_slot(bb, rg))]
                finish(rg, total)
    assert not counters.any(), "a row group's counter was left non-zero"
