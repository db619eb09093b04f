"""Batch node budget (specpilot/budget.py): greedy == brute-force optimum, the tie rule, limits, the
acceptance model, and allocate -> build_tree giving exactly the allocated node counts."""

import itertools
import math
import random
import re

import pytest
import torch

from specpilot.engine.spec.budget import DEPTHS, AcceptanceHistory, Allocation, allocate
from specpilot.engine.spec.tree import build_tree


def _history(rng: random.Random, accept_p: float, steps: int, drafted: int | None = None) -> AcceptanceHistory:
    """Simulated request: each depth accepted with prob accept_p given the previous one was."""
    h = AcceptanceHistory()
    for _ in range(steps):
        d = drafted or h.positions()
        a = 0
        while a < d and rng.random() < accept_p:
            a += 1
        h.record(a, drafted=d, predicted=rng.uniform(0.5, 6.0))
    return h


def _path_scores(rng: random.Random, n: int, quantised: bool) -> list[float]:
    steps = [-0.25 * rng.randint(0, 3) if quantised else -rng.expovariate(2.0) for _ in range(n)]
    return list(itertools.accumulate(steps))


def _brute(gains, budget, min_nodes, max_nodes):
    """Best total over every integer allocation; returns (value, set of optimal allocations)."""
    ranges = [range(min(min_nodes, min(len(g), max_nodes)), min(len(g), max_nodes) + 1) for g in gains]
    best, arg = -1.0, set()
    for n in itertools.product(*ranges):
        if sum(n) > budget:
            continue
        v = sum(sum(g[:k]) for g, k in zip(gains, n))
        if v > best + 1e-12:
            best, arg = v, {n}
        elif abs(v - best) <= 1e-12:
            arg.add(n)
    return best, arg


def _value(gains, n):
    return sum(sum(g[:k]) for g, k in zip(gains, n))


@pytest.mark.parametrize("quantised", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_greedy_matches_brute_force(seed, quantised):
    rng = random.Random(seed * 2 + quantised)
    B = rng.randint(1, 4)
    hists = [_history(rng, rng.uniform(0.1, 0.95), rng.randint(0, 20)) for _ in range(B)]
    gains = [h.gains(_path_scores(rng, rng.randint(0, 6), quantised)) for h in hists]
    min_nodes = rng.randint(0, 2)
    max_nodes = rng.randint(max(min_nodes, 1), 6)
    budget = rng.randint(min_nodes * B, 12)
    got = allocate(gains, budget, min_nodes=min_nodes, max_nodes=max_nodes)
    best, arg = _brute(gains, budget, min_nodes, max_nodes)
    assert math.isclose(_value(gains, got), best, rel_tol=0, abs_tol=1e-12)
    assert tuple(got) in arg
    avail = sum(min(len(g), max_nodes) for g in gains)
    assert sum(got) == min(budget, avail) and got.unused == budget - sum(got)
    if not quantised:  # continuous gains: the optimum is unique up to zero-gain ties
        assert len(arg) == 1 or all(g == 0 for row in gains for g in row)


@pytest.mark.parametrize("seed", range(8))
def test_limits_and_determinism(seed):
    rng = random.Random(100 + seed)
    B = rng.randint(2, 24)
    gains = [[min(1.0, math.exp(s)) for s in _path_scores(rng, rng.randint(0, 64), seed % 2 == 1)] for _ in range(B)]
    min_nodes, max_nodes = rng.randint(0, 3), rng.randint(8, 64)
    budget = rng.randint(min_nodes * B, 8 * B)
    a = allocate(gains, budget, min_nodes, max_nodes)
    assert a == allocate(gains, budget, min_nodes, max_nodes)
    assert sum(a) <= budget and a.unused == budget - sum(a) >= 0
    for g, n in zip(gains, a):
        assert min(min_nodes, len(g), max_nodes) <= n <= min(len(g), max_nodes)
    if a.unused:  # only when every request is exhausted: nothing is padded
        assert all(n == min(len(g), max_nodes) for g, n in zip(gains, a))
    if len({len(g) for g in gains}) == 1:  # equal lengths: the tensor form gives the same answer
        assert allocate(torch.tensor(gains, dtype=torch.float64), budget, min_nodes, max_nodes) == a


@pytest.mark.parametrize("seed", range(6))
def test_permutation_permutes_without_ties(seed):
    rng = random.Random(200 + seed)
    B = 6
    gains = [sorted((rng.random() for _ in range(rng.randint(1, 20))), reverse=True) for _ in range(B)]
    perm = list(range(B))
    rng.shuffle(perm)
    budget = rng.randint(B, 40)
    a = allocate(gains, budget)
    b = allocate([gains[p] for p in perm], budget)
    assert b == [a[p] for p in perm]


def test_tie_rule_lower_index_first():
    # equal gains everywhere: the budget past the floors goes to request 0 first, then 1, ...
    assert allocate([[0.5] * 4, [0.5] * 4, [0.5] * 4], budget=5) == [3, 1, 1]
    # higher gain beats lower index
    assert allocate([[0.5, 0.3], [0.5, 0.4]], budget=3) == [1, 2]
    # a tie at the margin follows the request order, so a permutation does not simply permute it
    assert allocate([[1.0, 0.5], [1.0, 0.5]], budget=3) == [2, 1]
    assert allocate([[1.0, 0.5], [1.0, 0.5]][::-1], budget=3) == [2, 1]


def test_unused_and_min_nodes_larger_than_candidates():
    a = allocate([[0.9, 0.1], [], [0.5]], budget=10, min_nodes=1)
    assert a == [2, 0, 1] and a.unused == 7 and isinstance(a, Allocation)
    assert allocate([[0.9, 0.8, 0.7], [0.1]], budget=3, min_nodes=0) == [3, 0]
    assert allocate([[0.9, 0.8, 0.7], [0.1]], budget=3, min_nodes=1) == [2, 1]
    assert allocate([[0.9] * 10], budget=10, max_nodes=4) == [4]
    assert allocate([], budget=0) == [] and allocate([], budget=5).unused == 5


def test_rejects_bad_input():
    def err(match, *args, **kw):
        with pytest.raises(ValueError, match=match) as e:
            allocate(*args, **kw)
        assert str(e.value).startswith("specpilot.engine.spec.budget.allocate: ")
        assert ";" in str(e.value)

    err("NaN|nan", [[0.5, float("nan")]], 2)
    err("inf", [[float("inf")]], 1)
    err("< 0", [[0.5, -0.1]], 2)
    err("increases", [[0.2, 0.5]], 2)
    err(re.escape("budget 3 < min_nodes 2 x 2"), [[1.0] * 4, [1.0] * 4], 3, min_nodes=2)
    err("max_nodes", [[1.0]], 1, max_nodes=65)
    err("min_nodes <= max_nodes", [[1.0]], 4, min_nodes=3, max_nodes=2)
    err("budget", [[1.0]], -1)
    err("gains tensor", torch.ones(3), 1)
    with pytest.raises(ValueError, match="NaN|nan"):
        allocate(torch.tensor([[0.5, float("nan")]]), 2)
    with pytest.raises(TypeError, match="specpilot.engine.spec.budget.allocate"):
        allocate([1.0, 2.0], 1)


def test_positions_thresholds():
    h = AcceptanceHistory(window=4, thresholds=(5.0, 2.5), initial=12)
    assert h.positions() == 12 and h.mean_accepted() is None
    for acc, want in [(8, 16), (2, 16), (0, 12), (0, 12), (0, 8)]:
        h.record(acc, drafted=16)
        assert h.positions() == want, (acc, h.mean_accepted())
    # means exactly on a threshold take the deeper draft
    for steps, want in [([5, 5, 5, 5], 16), ([4, 5, 5, 5], 12), ([2, 2, 3, 3], 12), ([2, 2, 2, 3], 8)]:
        h = AcceptanceHistory(window=4)
        for acc in steps:
            h.record(acc, drafted=16)
        assert h.positions() == want, (steps, h.mean_accepted())
    assert all(AcceptanceHistory(initial=d).positions() == d for d in DEPTHS)
    # window: only the last `window` steps count
    h = AcceptanceHistory(window=2)
    for acc in (0, 0, 0, 9, 9):
        h.record(acc, drafted=16)
    assert h.positions() == 16


def test_rates_calibration_and_gains():
    h = AcceptanceHistory(prior=(1.0, 1.0), p_clip=(0.02, 0.98))
    assert h.rates() == [0.5] * 16 and h.calibration() == 1.0
    h.record(2, drafted=8, predicted=1.0)  # trials at d = 1, 2, 3; wins at 1, 2
    h.record(8, drafted=8, predicted=1.0)  # trials and wins at d = 1..8
    r = h.rates()
    assert r[0] == r[1] == 3 / 4 and r[2] == 2 / 4 and r[3] == 2 / 3 and r[8] == 0.5
    surv = list(itertools.accumulate(r[:h.positions()], lambda a, b: a * b))
    assert math.isclose(h.expected_length(), sum(surv))
    assert math.isclose(h.calibration(), sum(surv) / 1.0)
    g = h.gains([0.0, -0.5, -0.5, -3.0, float("-inf")])
    assert g[0] == 1.0 and g[-1] == 0.0 and all(x >= y for x, y in zip(g, g[1:]))
    assert math.isclose(g[3], h.calibration() * math.exp(-3.0))
    with pytest.raises(ValueError, match="^specpilot.engine.spec.budget.gains: .*increase"):
        h.gains([-1.0, -0.5])
    with pytest.raises(ValueError, match="^specpilot.engine.spec.budget.gains: .*nan"):
        h.gains(torch.tensor([0.0, float("nan")]))
    with pytest.raises(ValueError, match="^specpilot.engine.spec.budget.record: "):
        h.record(9, drafted=8)
    with pytest.raises(ValueError, match="^specpilot.engine.spec.budget.AcceptanceHistory: "):
        AcceptanceHistory(initial=10)
    # clipping: a long perfect streak never makes a depth certain
    h = AcceptanceHistory(window=64)
    for _ in range(64):
        h.record(16, drafted=16)
    assert max(h.rates()) == 0.98 and h.positions() == 16


@pytest.mark.parametrize("seed", range(4))
def test_allocate_then_build_trees(seed):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(300 + seed)
    B, K, budget = 24, 4, 192
    hists = [_history(rng, rng.uniform(0.2, 0.95), 16) for _ in range(B)]
    drafts, gains = [], []
    for h in hists:
        P = h.positions()
        tokens = torch.stack([torch.randperm(1000, generator=g)[:K] for _ in range(P)])  # distinct per row
        scores = torch.log_softmax(torch.randn(P, K, generator=g) * 2, dim=-1)
        full = build_tree(tokens, scores, budget=64)  # every candidate node, best-first
        drafts.append((tokens, scores, full))
        gains.append(h.gains(full.scores))
    alloc = allocate(gains, budget, min_nodes=1, max_nodes=64)
    assert sum(alloc) == budget and alloc.unused == 0
    trees = [build_tree(t, s, budget=n) for (t, s, _), n in zip(drafts, alloc)]
    assert sum(t.n for t in trees) == sum(alloc) == budget
    # each built tree is the best-first prefix its gains were priced on
    for tr, (_, _, full), n in zip(trees, drafts, alloc):
        assert tr.n == n and torch.equal(tr.scores, full.scores[:n]) and torch.equal(tr.tokens, full.tokens[:n])
