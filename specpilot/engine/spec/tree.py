"""Draft-tree builder: best-first selection of the highest-scoring paths under a node budget.

The drafter proposes K candidates for each of P positions below the committed token:
`tokens` int64 [P, K] and `scores` [P, K] (log-probabilities, marginal per position). Row d
holds the candidates for depth d, so every node at depth d picks one column of row d, and its
path score is its parent's path score plus `scores[d, j]` (roots: the committed token's score 0).

Selection is best-first, as DDTree's lazy heap does: start with the children of the committed
token, repeatedly take the best frontier node, and open its children. Children of one parent
are kept sorted, so the frontier only needs, per selected node, its best not-yet-taken child:
popping a node pushes its next sibling and its own best child, and the heap stays small.

Sibling order (the "rank" of a candidate in its row): row d sorted by (score desc, column j asc)
after deduplication. Since a child's path score is `parent + scores[d, j]`, and float addition
is monotone, rank order never disagrees with path-score order among siblings.

Tie rule (a total order; the node taken first is the smallest key):

    key = (-path_score, depth, rank, parent)

with `parent` the selection index of the parent and -1 for the committed token, i.e. equal
path scores go to the shallower node, then to the lower sibling rank (for equal raw scores:
the lower column j), then to the parent selected earlier. Keys never repeat (a parent, a depth
and a rank name one candidate), so both forms below take the same nodes in the same order.

Other rules:
* Scores are taken as float64 and path scores are summed in float64 in both forms, so the
  host heap (Python floats) and the tensor form add bit-identically.
* NaN and +inf scores raise ValueError: they are not log-probabilities and break the order.
* -inf marks a candidate that must never be chosen; the tree is then smaller than the budget
  when not enough finite candidates remain (callers read `n` / `n_nodes`).
* Two candidates of one row with the same token would give two siblings with the same token
  under every parent: the higher-scoring one is kept (the lower column on equal scores), the
  other dropped.
* With log-probabilities (scores <= 0) a child never outscores its parent, so the selected
  nodes are exactly the `budget` best nodes of the full tree under the key above. With positive
  scores the result is still the best-first expansion, identical in both forms.

Forms: `build_tree` (one request, host heap, the reference), `build_trees` (a batch of host
heaps), `build_trees_batched` (torch ops only, one loop over the budget; no host sync after
input validation). The batch forms return `DraftTrees` with fixed [B, N] buffers.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

__all__ = ["DraftTree", "DraftTrees", "build_tree", "build_tree_conditional", "build_trees", "build_trees_batched",
           "MAX_NODES"]

_WHERE = "specpilot.engine.spec.tree"  # the module as error messages name it

MAX_NODES = 64  # one int64 ancestor bitmask per node (the limit of gdn.build_tree_plan)

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class DraftTree:
    """One request's tree; nodes in selection order, which is topological (parent < child)."""

    tokens: torch.Tensor  # int64 [n] token of each node
    parents: torch.Tensor  # int32 [n] local parent index, -1 for a child of the committed token
    depths: torch.Tensor  # int32 [n] 0 for roots
    scores: torch.Tensor  # float64 [n] path score (sum of the scores along the path)
    anc: torch.Tensor  # int64 [n] bit j set <=> local node j is an ancestor-or-self

    @property
    def n(self) -> int:
        return int(self.tokens.numel())

    def to_parents(self) -> list[int]:
        """Local parent list, as `gdn.build_tree_plan` takes it (one entry of its list)."""
        return [int(p) for p in self.parents.tolist()]


@dataclass(frozen=True)
class DraftTrees:
    """A batch of trees in fixed buffers [B, N] (N = budget); entries past `n_nodes[b]` are padding.

    Padding: tokens 0 (a valid id, so fixed-shape embedding gathers need no mask), parents -1,
    depths 0, scores -inf, anc 0.
    """

    tokens: torch.Tensor  # int64 [B, N]
    parents: torch.Tensor  # int32 [B, N]
    depths: torch.Tensor  # int32 [B, N]
    scores: torch.Tensor  # float64 [B, N]
    anc: torch.Tensor  # int64 [B, N]
    n_nodes: torch.Tensor  # int32 [B]

    def tree(self, b: int) -> DraftTree:
        n = int(self.n_nodes[b])
        return DraftTree(tokens=self.tokens[b, :n], parents=self.parents[b, :n], depths=self.depths[b, :n],
                         scores=self.scores[b, :n], anc=self.anc[b, :n])

    def to_parents(self) -> list[list[int]]:
        """Per-request local parent lists (padding cut off), for `gdn.build_tree_plan(parents)`."""
        ns = self.n_nodes.tolist()
        rows = self.parents.tolist()
        return [[int(p) for p in row[:n]] for row, n in zip(rows, ns)]


def _bit(i: int) -> int:
    # bit i of an int64 word as a signed value: bit 63 is the sign bit, as torch's shifts give it
    return (1 << i) - (1 << 64) if i == 63 else 1 << i


def _check_budget(fn: str, budget) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= MAX_NODES:
        raise ValueError(f"{_WHERE}.{fn}: budget={budget!r}; pass an int in [0, {MAX_NODES}] "
                         "(one int64 ancestor bitmask per node)")


def _check(fn: str, tokens, scores, budget: int, dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes, dtypes, budget and score values; returns (tokens int64, scores float64)."""
    shape = "[P, K]" if dims == 2 else "[B, P, K]"
    if not isinstance(tokens, torch.Tensor) or not isinstance(scores, torch.Tensor):
        raise TypeError(f"{_WHERE}.{fn}: tokens and scores must be torch tensors; "
                        f"pass tokens int64 {shape} and scores float {shape}")
    if tokens.dim() != dims or tokens.shape != scores.shape:
        raise ValueError(f"{_WHERE}.{fn}: tokens {tuple(tokens.shape)} and scores {tuple(scores.shape)} "
                         f"must both be {shape}; pass one row of K candidates per position")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"{_WHERE}.{fn}: tokens must be an integer tensor, got {tokens.dtype}; "
                        "pass token ids (int64)")
    if not scores.dtype.is_floating_point:
        raise TypeError(f"{_WHERE}.{fn}: scores must be a floating tensor, got {scores.dtype}; "
                        "pass log-probabilities")
    if tokens.device != scores.device:
        raise ValueError(f"{_WHERE}.{fn}: tokens on {tokens.device} but scores on {scores.device}; "
                         "put both on one device")
    _check_budget(fn, budget)
    s = scores.to(torch.float64)
    bad = torch.isnan(s) | (s == math.inf)
    if bool(bad.any()):  # validation is the one host sync of the batched form
        where = tuple(int(x) for x in torch.nonzero(bad)[0].tolist())
        what = "NaN" if bool(torch.isnan(s[where])) else "+inf"
        raise ValueError(f"{_WHERE}.{fn}: scores{list(where)} is {what}; scores must be log-probabilities "
                         "(finite, or -inf for a candidate never to choose): fix the drafter's output or mask "
                         "the entry with -inf")
    return tokens.to(torch.int64), s


def _rows(tok: list[list[int]], sc: list[list[float]]) -> list[list[int]]:
    """Per row: kept columns in sibling order (score desc, column asc), duplicates and -inf dropped."""
    rows = []
    for t_row, s_row in zip(tok, sc):
        best: dict[int, int] = {}
        for j, (t, v) in enumerate(zip(t_row, s_row)):
            if t not in best or v > s_row[best[t]]:  # strict: the first column wins equal scores
                best[t] = j
        kept = [j for j in best.values() if s_row[j] > _NEG_INF]
        kept.sort(key=lambda j: (-s_row[j], j))
        rows.append(kept)
    return rows


def _best_first(children, budget: int, max_depth: int, ahead=None):
    """Lazy-heap best-first selection under the tie rule (module docstring) on host lists; returns per-node lists
    (tokens, parents, depths, scores, anc) in selection order. `children(depth, token)` gives the candidates of the
    children at `depth` of a node holding `token` (-1 for the committed token) as (tokens, scores, order): order
    the kept columns in sibling order (`_rows`). It is called for the committed token and for each selected node
    that may have children, when it is selected. `ahead(pairs)`, where given, is called just before each of those
    calls with the (depth, token) it needs first, then the pairs the best frontier candidates would need if they
    were selected next, best first: a caller can compute them together (it changes nothing the selection sees)."""
    tokens, parents, depths, scores, anc = [], [], [], [], []
    heap: list = []

    def frontier():  # (depth, token) of the children of the frontier's candidates, best candidate first
        return [(e[1] + 1, e[5][0][e[4]]) for e in heapq.nsmallest(len(heap), heap) if e[1] + 1 < max_depth]

    def push(parent: int, parent_score: float, depth: int, rank: int, cand) -> None:
        # heap entries are the keys of the tie rule, then the column and the candidates; keys are unique
        tok, sc, order = cand
        if depth < max_depth and rank < len(order):
            j = order[rank]
            v = parent_score + sc[j]
            if v > _NEG_INF:  # a finite sum can still overflow to -inf: never chosen either
                heapq.heappush(heap, (-v, depth, rank, parent, j, cand))

    if budget and max_depth:
        push(-1, 0.0, 0, 0, children(0, -1))
    while heap and len(tokens) < budget:
        neg, d, r, par, j, cand = heapq.heappop(heap)
        i = len(tokens)
        tok = cand[0][j]
        tokens.append(tok)
        parents.append(par)
        depths.append(d)
        scores.append(-neg)
        anc.append(_bit(i) | (anc[par] if par >= 0 else 0))
        push(par, scores[par] if par >= 0 else 0.0, d, r + 1, cand)  # next sibling
        if d + 1 < max_depth and len(tokens) < budget:
            if ahead is not None:
                ahead([(d + 1, tok)] + frontier())
            push(i, -neg, d + 1, 0, children(d + 1, tok))  # own best child
    return tokens, parents, depths, scores, anc


def _heap_tree(tok: list[list[int]], sc: list[list[float]], budget: int):
    """`_best_first` on marginal rows: every node at depth d picks from row d."""
    rows = _rows(tok, sc)
    cands = list(zip(tok, sc, rows))
    return _best_first(lambda depth, _token: cands[depth], budget, len(rows))


def build_tree(tokens: torch.Tensor, scores: torch.Tensor, budget: int = 32) -> DraftTree:
    """One request's tree from tokens int64 [P, K] and scores [P, K]; at most `budget` nodes.

    The reference form: a host heap over Python lists. Outputs live on the inputs' device.
    """
    tok, s = _check("build_tree", tokens, scores, budget, 2)
    t, p, d, sc, a = _heap_tree(tok.tolist(), s.tolist(), budget)
    dev = tokens.device
    return DraftTree(tokens=torch.tensor(t, dtype=torch.int64, device=dev),
                     parents=torch.tensor(p, dtype=torch.int32, device=dev),
                     depths=torch.tensor(d, dtype=torch.int32, device=dev),
                     scores=torch.tensor(sc, dtype=torch.float64, device=dev),
                     anc=torch.tensor(a, dtype=torch.int64, device=dev))


def build_tree_conditional(expand, budget: int, max_depth: int, *, expand_many=None, batch: int = 1) -> DraftTree:
    """One request's tree from a drafter whose candidates depend on the parent: `expand(depth, token)` gives the
    candidates for the child at `depth` of a node holding `token` (depth 0: the children of the committed token,
    which the caller knows; `token` is then -1), as (tokens [K] ints, scores [K] log-probabilities given that
    parent): a function of (depth, token) alone. Best-first under the marginal builder's tie rule (module
    docstring), the path score a parent's plus the child's conditional score; `expand` is called once per
    (depth, token) that a selected node with children (depth + 1 < max_depth), or the committed token, needs, when
    that node is selected: at most budget + 1 times. Host lists, CPU tensors out.

    `expand_many(pairs)` (a list of (depth, token) -> a list of (tokens, scores), one per pair) with `batch` > 1
    computes up to `batch` expansions at once: the one needed now and those the best frontier candidates would
    need if selected next, so that a drafter on a GPU reads back to the host once per batch instead of once per
    node. The tree is the same node for node as with `expand` alone, where `expand_many` gives what `expand`
    would."""
    fn = "build_tree_conditional"
    _check_budget(fn, budget)
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
        raise ValueError(f"{_WHERE}.{fn}: max_depth={max_depth!r}; pass an int >= 0")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"{_WHERE}.{fn}: batch={batch!r}; pass an int >= 1")
    known: dict = {}

    def ahead(pairs):
        want = []
        for pair in pairs:
            if pair not in known and pair not in want:
                want.append(pair)
            if len(want) == batch:
                break
        if want:
            got = list(expand_many(want))
            if len(got) != len(want):
                raise ValueError(f"{_WHERE}.{fn}: expand_many gave {len(got)} expansions for {len(want)} pairs; "
                                 "return one (tokens, scores) per pair")
            known.update(zip(want, got))

    def children(depth: int, token: int):
        key = (depth, token)
        if key not in known:
            known[key] = expand(depth, token)
        t, sc = known[key]
        t = [int(x) for x in t]
        sc = [float(x) for x in sc]
        if len(t) != len(sc):
            raise ValueError(f"{_WHERE}.{fn}: expand({depth}, {token}) gave {len(t)} tokens and {len(sc)} scores; "
                             "return one score per candidate")
        for j, v in enumerate(sc):
            if math.isnan(v) or v == math.inf:
                raise ValueError(f"{_WHERE}.{fn}: expand({depth}, {token}) scored candidate {j} {v}; scores must "
                                 "be log-probabilities (finite, or -inf for a candidate never to choose)")
        return t, sc, _rows([t], [sc])[0]

    many = expand_many is not None and batch > 1
    if many:
        ahead([(0, -1)])
    tokens, parents, depths, scores, anc = _best_first(children, budget, max_depth, ahead if many else None)
    return DraftTree(tokens=torch.tensor(tokens, dtype=torch.int64), parents=torch.tensor(parents, dtype=torch.int32),
                     depths=torch.tensor(depths, dtype=torch.int32), scores=torch.tensor(scores, dtype=torch.float64),
                     anc=torch.tensor(anc, dtype=torch.int64))


def _empty(B: int, N: int, dev) -> DraftTrees:
    return DraftTrees(tokens=torch.zeros(B, N, dtype=torch.int64, device=dev),
                      parents=torch.full((B, N), -1, dtype=torch.int32, device=dev),
                      depths=torch.zeros(B, N, dtype=torch.int32, device=dev),
                      scores=torch.full((B, N), _NEG_INF, dtype=torch.float64, device=dev),
                      anc=torch.zeros(B, N, dtype=torch.int64, device=dev),
                      n_nodes=torch.zeros(B, dtype=torch.int32, device=dev))


def build_trees(tokens: torch.Tensor, scores: torch.Tensor, budget: int = 32) -> DraftTrees:
    """A batch of trees from tokens [B, P, K] and scores [B, P, K], one host heap per request."""
    tok, s = _check("build_trees", tokens, scores, budget, 3)
    B = tok.shape[0]
    out = _empty(B, budget, torch.device("cpu"))
    for b, (t_b, s_b) in enumerate(zip(tok.tolist(), s.tolist())):
        t, p, d, sc, a = _heap_tree(t_b, s_b, budget)
        n = len(t)
        out.tokens[b, :n] = torch.tensor(t, dtype=torch.int64)
        out.parents[b, :n] = torch.tensor(p, dtype=torch.int32)
        out.depths[b, :n] = torch.tensor(d, dtype=torch.int32)
        out.scores[b, :n] = torch.tensor(sc, dtype=torch.float64)
        out.anc[b, :n] = torch.tensor(a, dtype=torch.int64)
        out.n_nodes[b] = n
    dev = tokens.device
    return DraftTrees(**{k: getattr(out, k).to(dev) for k in out.__dataclass_fields__})


def build_trees_batched(tokens: torch.Tensor, scores: torch.Tensor, budget: int = 32) -> DraftTrees:
    """The same trees as `build_trees`, with torch ops only: one loop over the budget.

    The frontier is kept as one head per "slot": slot 0 is the committed token, slot i+1 is
    selected node i, and a slot's head is its best not-yet-taken child (rank `ptr`). Each
    iteration scores every head of every request at once and takes, per request, the smallest
    key (-path_score, depth, rank, slot) -- the tie rule, since slot order is parent selection
    order with the committed token first. A request whose frontier is empty stops growing and
    stays empty, so every request that grows at iteration i adds exactly node i.
    """
    tok, s = _check("build_trees_batched", tokens, scores, budget, 3)
    B, P, K = s.shape
    dev = s.device
    out = _empty(B, budget, dev)
    if P == 0 or K == 0 or budget == 0 or B == 0:
        return out

    # dedup: column j is dropped when another column of the row holds its token and a higher
    # score, or the same score at a lower column
    same = tok.unsqueeze(-1) == tok.unsqueeze(-2)  # [B, P, K(i), K(j)]
    si, sj = s.unsqueeze(-1), s.unsqueeze(-2)
    col = torch.arange(K, device=dev)
    earlier = (col.view(K, 1) < col.view(1, K))
    dominated = (same & ((si > sj) | ((si == sj) & earlier))).any(-2)  # [B, P, K] over i
    s = torch.where(dominated, torch.full_like(s, _NEG_INF), s)
    # sibling order: score desc, column asc (a stable descending sort keeps equal scores in column order)
    ss, order = torch.sort(s, dim=-1, descending=True, stable=True)
    stok = tok.gather(-1, order).view(B, P * K)
    ss = ss.view(B, P * K)
    nvalid = (s > _NEG_INF).sum(-1)  # [B, P] finite candidates per row, all at the front of ss

    S = budget + 1
    slot = torch.arange(S, device=dev).expand(B, S)
    slot_score = torch.zeros(B, S, dtype=torch.float64, device=dev)
    slot_depth = torch.full((B, S), -1, dtype=torch.int64, device=dev)
    ptr = torch.zeros(B, S, dtype=torch.int64, device=dev)
    active = torch.zeros(B, S, dtype=torch.bool, device=dev)
    active[:, 0] = True
    rows = torch.arange(B, device=dev)
    big = torch.tensor(S + P + K, device=dev)  # larger than any depth, rank or slot
    anc = out.anc
    n_nodes = torch.zeros(B, dtype=torch.int64, device=dev)

    for i in range(budget):
        cd = slot_depth + 1  # depth of each slot's head
        cdc = cd.clamp(max=P - 1)
        flat = cdc * K + ptr.clamp(max=K - 1)
        cs = slot_score + ss.gather(1, flat)  # path score of each head
        ok = active & (cd < P) & (ptr < nvalid.gather(1, cdc)) & (cs > _NEG_INF)
        # lexicographic argmin of (-cs, cd, ptr, slot) among ok heads
        best = torch.where(ok, cs, torch.full_like(cs, _NEG_INF)).amax(1, keepdim=True)
        m = ok & (cs == best)
        m = m & (cd == torch.where(m, cd, big).amin(1, keepdim=True))
        m = m & (ptr == torch.where(m, ptr, big).amin(1, keepdim=True))
        pick = torch.where(m, slot, big).amin(1).clamp(max=S - 1)  # [B]
        found = m.any(1)

        par = pick - 1
        depth = cd[rows, pick]
        score = cs[rows, pick]
        token = stok[rows, flat[rows, pick]]
        up = torch.where(par >= 0, anc[rows, par.clamp(min=0)], torch.zeros_like(par))
        node_anc = up | _bit(i)

        out.tokens[:, i] = torch.where(found, token, out.tokens[:, i])
        out.parents[:, i] = torch.where(found, par, -1).to(torch.int32)
        out.depths[:, i] = torch.where(found, depth, 0).to(torch.int32)
        out.scores[:, i] = torch.where(found, score, out.scores[:, i])
        anc[:, i] = torch.where(found, node_anc, torch.zeros_like(node_anc))

        ptr[rows, pick] += found.to(torch.int64)  # the picked slot's next sibling becomes its head
        active[:, i + 1] = found
        slot_score[:, i + 1] = score
        slot_depth[:, i + 1] = depth
        n_nodes += found.to(torch.int64)

    return DraftTrees(tokens=out.tokens, parents=out.parents, depths=out.depths, scores=out.scores, anc=anc,
                      n_nodes=n_nodes.to(torch.int32))
