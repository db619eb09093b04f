"""Batch node budget: how many draft-tree nodes each request of a batch gets.

A batch verifies a fixed number of tree rows (one CUDA graph per batch shape), so the requests share
ONE node budget, e.g. 192 nodes for 24 requests. This module splits it where it buys the most
expected accepted tokens. Two layers:

* `allocate(gains, budget, min_nodes, max_nodes)`: the exact integer allocation for given per-node
  marginal gains. Pure arithmetic; it knows nothing about drafters.
* `AcceptanceHistory`: one request's acceptance model, estimated from its own past steps only. It
  picks the request's draft depth (`positions()`: 16, 12 or 8) and turns the drafter's path scores
  into the marginal gains that `allocate` takes (`gains(path_scores)`).

The objective. Let the tree builder (specpilot.engine.spec.tree) take request r's nodes best-first, and let v_r[i]
be the probability that the i-th node taken lies on the target's greedy path. The accepted length is
the number of tree nodes on that path, so by linearity of expectation a tree of the first n nodes
accepts E_r(n) = v_r[0] + ... + v_r[n-1] tokens on average. The marginal gain of the n-th node is
v_r[n-1]. The allocation maximises sum_r E_r(n_r) over integers with min_nodes <= n_r <= max_nodes and
sum_r n_r <= budget.

Why the greedy is exact. When every gain list is non-increasing, every E_r is concave, and the
objective is a sum of separable concave functions under one sum constraint. Taking, one node at a time,
the largest next marginal gain over all requests picks the `budget - sum(floors)` largest gains of the
union of the lists; since each list is sorted, that set is always a prefix of every list (a feasible
allocation), and no allocation of the same size can have a larger sum. With an increasing step this
fails (a later node could be worth more than the one taken before it), so `allocate` validates that the
gains are non-increasing and raises otherwise, rather than silently returning a non-optimal split.

Tie rule (deterministic; the only freedom the optimum leaves): among equal next gains the lower request
index gets the node. So permuting the requests permutes the allocation, except where equal gains
compete at the margin, which then follow the request order.

Unused budget: a request cannot get more nodes than it has candidates (or `max_nodes`). If all requests
together have fewer than `budget` nodes, every node is allocated, nothing is padded, and the result's
`unused` attribute says how many rows of the fixed verify shape stay empty.

The acceptance model (AcceptanceHistory), estimated from the last `window` steps:

* Per-depth rates p(d), d = 1..16: the probability that depth d is accepted given depth d-1 was. A step
  that drafted D positions and accepted a tokens is a trial at every depth d <= min(D, a + 1) and a
  success at every d <= a. p(d) = (successes + prior_a) / (trials + prior_a + prior_b), a Beta prior
  (Laplace by default: 1, 1) so unseen depths get a neutral estimate instead of 0/0, clipped to
  [p_min, p_max] so a streak never makes a depth certain or impossible.
* Survival A(d) = p(1) * ... * p(d): the probability that at least d tokens are accepted. The history's
  expected accepted length at depth P is L_hist = A(1) + ... + A(P).
* Drafter value: for a calibrated drafter, exp(path_score) of a node IS the probability that the node
  lies on the target's path, so the tree's expected accepted length is the sum of exp(path_score) over
  its nodes. Each recorded step may carry that prediction (`predicted`); its window mean is L_pred.
* Calibration factor c = L_hist / L_pred (clipped to [c_min, c_max]; 1 when no step recorded a
  prediction): how far the drafter's own belief is off for this request. A node's value is
  v = min(1, c * exp(path_score)). One scalar per request keeps the order of the values equal to the
  order of the path scores, so the values stay non-increasing along the best-first order (a
  per-depth factor would not, and would break the concavity the greedy needs).

Draft depth (`positions()`): the mean accepted length over the window against two thresholds
(defaults 5.0 and 2.5): mean >= hi -> 16 positions, mean >= lo -> 12, else 8. Drafting far beyond what
is accepted costs drafter work for nothing, and a request accepting 5+ tokens per step is within reach
of the 8-position cap, where a deeper draft pays. With no history yet: `initial` (12, no evidence
either way).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Sequence

import torch

from .tree import MAX_NODES

__all__ = ["Allocation", "AcceptanceHistory", "allocate", "best_budget", "DEPTHS"]

_WHERE = "specpilot.engine.spec.budget"  # the module as error messages name it

DEPTHS = (16, 12, 8)  # the draft depths a request may use, deepest first


class Allocation(list):
    """Per-request node counts (a plain list of ints, so it compares equal to one) plus `unused`.

    A list subclass rather than a tuple return so callers that only want the counts use it as is,
    while the fixed-shape caller can still read how many budget rows stay empty.
    """

    def __init__(self, counts: Sequence[int], unused: int):
        super().__init__(counts)
        self.unused = unused

    def __repr__(self) -> str:
        return f"Allocation({list(self)!r}, unused={self.unused})"


def _err(fn: str, what: str) -> str:
    return f"{_WHERE}.{fn}: {what}"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _gain_lists(gains) -> list[list[float]]:
    """Gains as Python float lists (float64), validated: finite, >= 0, non-increasing per request."""
    if isinstance(gains, torch.Tensor):
        if gains.dim() != 2 or not gains.dtype.is_floating_point:
            raise ValueError(_err("allocate", f"gains tensor must be floating [B, N], got {gains.dtype} "
                                  f"{tuple(gains.shape)}; pass one row of per-node gains per request"))
        rows = gains.detach().to("cpu", torch.float64).tolist()
    else:
        try:
            rows = [[float(g) for g in row] for row in gains]
        except TypeError as e:
            raise TypeError(_err("allocate", f"gains must be a list of per-request lists of floats ({e}); "
                                 "pass gains[r][i] = value of request r's i-th best-first node")) from None
    for r, row in enumerate(rows):
        for i, g in enumerate(row):
            if not math.isfinite(g):
                raise ValueError(_err("allocate", f"gains[{r}][{i}] is {g}; gains must be finite expected "
                                      "acceptances: fix the history model or drop the node"))
            if g < 0:
                raise ValueError(_err("allocate", f"gains[{r}][{i}] = {g} < 0; gains are expected accepted "
                                      "tokens (probabilities), so clip them at 0"))
            if i and g > row[i - 1]:
                raise ValueError(_err("allocate", f"gains[{r}] increases at node {i} ({row[i - 1]} -> {g}); "
                                      "the greedy is optimal only for non-increasing gains (concave E_r): "
                                      "list the nodes best-first or apply a running minimum"))
    return rows


def allocate(gains, budget: int, min_nodes: int = 1, max_nodes: int = MAX_NODES) -> Allocation:
    """Split `budget` tree nodes over a batch, maximising the total expected accepted tokens.

    gains: per request r, the marginal expected acceptance of its 1st, 2nd, ... best-first node
    (a list of lists, ragged allowed, or a float tensor [B, N]); must be finite, >= 0, non-increasing.
    Returns n_r per request with min(min_nodes, available_r) <= n_r <= available_r, where
    available_r = min(len(gains[r]), max_nodes): a request with fewer candidates than `min_nodes`
    gets all it has (a tree cannot hold nodes that do not exist). sum n_r <= budget, with equality
    unless every request is exhausted; then `.unused` says how many rows stay empty.

    Greedy on marginal gains, exact for non-increasing gains (module docstring); ties go to the
    lower request index. O((B + budget) log B).
    """
    fn = "allocate"
    for name, v in (("budget", budget), ("min_nodes", min_nodes), ("max_nodes", max_nodes)):
        if not _is_int(v) or v < 0:
            raise ValueError(_err(fn, f"{name}={v!r}; pass a non-negative int"))
    if not min_nodes <= max_nodes <= MAX_NODES:
        raise ValueError(_err(fn, f"need min_nodes <= max_nodes <= {MAX_NODES}, got {min_nodes}, {max_nodes}; "
                              f"a tree holds at most {MAX_NODES} nodes (one int64 ancestor bitmask each)"))
    rows = _gain_lists(gains)
    B = len(rows)
    if budget < min_nodes * B:
        raise ValueError(_err(fn, f"budget {budget} < min_nodes {min_nodes} x {B} requests; raise the budget "
                              f"to at least {min_nodes * B}, lower min_nodes, or verify fewer requests at once"))
    avail = [min(len(row), max_nodes) for row in rows]
    n = [min(min_nodes, a) for a in avail]
    left = budget - sum(n)
    # heap key (-gain, r): the larger next gain first, equal gains to the lower request index
    heap = [(-rows[r][n[r]], r) for r in range(B) if n[r] < avail[r]]
    heapq.heapify(heap)
    while left > 0 and heap:
        _, r = heapq.heappop(heap)
        n[r] += 1
        left -= 1
        if n[r] < avail[r]:
            heapq.heappush(heap, (-rows[r][n[r]], r))
    return Allocation(n, unused=left)


def best_budget(gains, costs: dict, max_nodes: dict) -> tuple[int, Allocation]:
    """The node budget, of those whose step cost was measured, that gives the most expected tokens per second.

    gains: as `allocate` takes them, one list per running request. costs: budget -> seconds of one step of that
    budget (a positive number); max_nodes: budget -> the per-request node bound of that step. A step emits, per
    running request, its accepted draft nodes and one more token (the target's own next token), so a budget b is
    worth (B + sum of the gains `allocate` takes at b) / costs[b]. Returns (b, its allocation); equal rates go to
    the smaller budget. With no draft candidates, or a step too slow for the tokens its nodes add, the answer is the
    cheapest budget (0 where it was measured: one autoregressive token per request).
    """
    fn = "best_budget"
    if not costs:
        raise ValueError(_err(fn, "costs is empty; pass at least one budget's measured step cost"))
    for b, c in costs.items():
        if not _is_int(b) or b < 0:
            raise ValueError(_err(fn, f"budget {b!r} in costs; pass non-negative ints"))
        if not isinstance(c, (int, float)) or isinstance(c, bool) or not math.isfinite(c) or c <= 0:
            raise ValueError(_err(fn, f"costs[{b}]={c!r}; pass a positive, finite step cost"))
        if b not in max_nodes:
            raise ValueError(_err(fn, f"no max_nodes for budget {b}; pass one per budget in costs"))
    rows = _gain_lists(gains)
    best = None
    for b in sorted(costs):
        alloc = allocate(rows, b, min_nodes=0, max_nodes=max_nodes[b])
        rate = (len(rows) + sum(sum(row[:n]) for row, n in zip(rows, alloc))) / costs[b]
        if best is None or rate > best[0]:
            best = (rate, b, alloc)
    return best[1], best[2]


class AcceptanceHistory:
    """One request's acceptance record and the model built from it (module docstring).

    Deterministic: every estimate is a function of the last `window` recorded steps and the
    constructor's parameters only.
    """

    def __init__(self, window: int = 16, thresholds: tuple[float, float] = (5.0, 2.5), initial: int = 12,
                 prior: tuple[float, float] = (1.0, 1.0), p_clip: tuple[float, float] = (0.02, 0.98),
                 c_clip: tuple[float, float] = (0.05, 20.0)):
        fn = "AcceptanceHistory"
        if not _is_int(window) or window < 1:
            raise ValueError(_err(fn, f"window={window!r}; pass an int >= 1 (steps the estimates look back)"))
        hi, lo = thresholds
        if not (math.isfinite(hi) and math.isfinite(lo) and hi >= lo >= 0):
            raise ValueError(_err(fn, f"thresholds={thresholds!r}; pass (hi, lo) with hi >= lo >= 0: mean "
                                  "accepted >= hi drafts 16, >= lo drafts 12, else 8"))
        if initial not in DEPTHS:
            raise ValueError(_err(fn, f"initial={initial!r}; pass one of {DEPTHS}"))
        a, b = prior
        if not (a > 0 and b > 0):
            raise ValueError(_err(fn, f"prior={prior!r}; pass Beta pseudo-counts (a, b) > 0, e.g. (1, 1)"))
        if not 0 < p_clip[0] <= p_clip[1] < 1:
            raise ValueError(_err(fn, f"p_clip={p_clip!r}; pass 0 < lo <= hi < 1 so no depth is certain or "
                                  "impossible"))
        if not 0 < c_clip[0] <= 1 <= c_clip[1]:
            raise ValueError(_err(fn, f"c_clip={c_clip!r}; pass 0 < lo <= 1 <= hi"))
        self.window, self.thresholds, self.initial = window, (float(hi), float(lo)), initial
        self.prior, self.p_clip, self.c_clip = (float(a), float(b)), p_clip, c_clip
        self._steps: deque[tuple[int, int, float | None]] = deque(maxlen=window)

    def record(self, accepted: int, drafted: int | None = None, predicted: float | None = None) -> None:
        """Record one verify step: `accepted` tokens out of a tree `drafted` positions deep.

        drafted defaults to `positions()` before this step (what the request would have drafted).
        predicted: the drafter's own expected accepted length for that tree, sum(exp(path_score))
        over its nodes; optional, it feeds the calibration factor.
        """
        fn = "record"
        if drafted is None:
            drafted = self.positions()
        if not _is_int(drafted) or not 1 <= drafted <= max(DEPTHS):
            raise ValueError(_err(fn, f"drafted={drafted!r}; pass the tree's depth, an int in [1, {max(DEPTHS)}]"))
        if not _is_int(accepted) or not 0 <= accepted <= drafted:
            raise ValueError(_err(fn, f"accepted={accepted!r}; pass an int in [0, drafted={drafted}] (bonus "
                                  "token not counted)"))
        if predicted is not None:
            predicted = float(predicted)
            if not (math.isfinite(predicted) and predicted >= 0):
                raise ValueError(_err(fn, f"predicted={predicted!r}; pass sum(exp(path_score)) over the tree's "
                                      "nodes (finite, >= 0) or None"))
        self._steps.append((accepted, drafted, predicted))

    def __len__(self) -> int:
        return len(self._steps)

    def mean_accepted(self) -> float | None:
        """Mean accepted length over the window; None without history."""
        if not self._steps:
            return None
        return sum(s[0] for s in self._steps) / len(self._steps)

    def positions(self) -> int:
        """Draft depth for the next step: 16, 12 or 8 (thresholds in the module docstring)."""
        m = self.mean_accepted()
        if m is None:
            return self.initial
        hi, lo = self.thresholds
        return 16 if m >= hi else 12 if m >= lo else 8

    def rates(self) -> list[float]:
        """p(d) for d = 1..16 (index d-1): P(depth d accepted | depth d-1 accepted), Beta prior, clipped."""
        a, b = self.prior
        lo, hi = self.p_clip
        out = []
        for d in range(1, max(DEPTHS) + 1):
            trials = sum(1 for acc, dr, _ in self._steps if dr >= d and acc >= d - 1)
            wins = sum(1 for acc, dr, _ in self._steps if dr >= d and acc >= d)
            out.append(min(hi, max(lo, (wins + a) / (trials + a + b))))
        return out

    def expected_length(self, depth: int | None = None) -> float:
        """L_hist = A(1) + ... + A(depth), A(d) = p(1)...p(d); depth defaults to `positions()`."""
        depth = self.positions() if depth is None else depth
        total, surv = 0.0, 1.0
        for p in self.rates()[:depth]:
            surv *= p
            total += surv
        return total

    def calibration(self) -> float:
        """c = L_hist / L_pred over the steps that recorded a prediction, clipped; 1 without any."""
        preds = [p for _, _, p in self._steps if p is not None]
        if not preds:
            return 1.0
        l_pred = sum(preds) / len(preds)
        lo, hi = self.c_clip
        if l_pred <= 0:
            return hi
        return min(hi, max(lo, self.expected_length() / l_pred))

    def gains(self, path_scores) -> list[float]:
        """Marginal expected acceptance of each candidate node: min(1, c * exp(path_score)).

        path_scores: the request's candidate nodes in best-first order, e.g.
        `build_tree(tokens, scores, budget=64).scores`; must be non-increasing (they are for
        log-probability scores), so the returned gains are non-increasing and `allocate` is exact.
        """
        fn = "gains"
        if isinstance(path_scores, torch.Tensor):
            path_scores = path_scores.detach().to("cpu", torch.float64).reshape(-1).tolist()
        s = [float(x) for x in path_scores]
        for i, x in enumerate(s):
            if math.isnan(x) or x == math.inf:
                raise ValueError(_err(fn, f"path_scores[{i}] is {x}; pass log-probability path scores "
                                      "(finite, or -inf for a node never taken)"))
            if i and x > s[i - 1]:
                raise ValueError(_err(fn, f"path_scores increase at {i} ({s[i - 1]} -> {x}); pass the nodes "
                                      "best-first, as build_tree returns them"))
        c = self.calibration()
        return [min(1.0, c * math.exp(x)) for x in s]
