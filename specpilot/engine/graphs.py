"""A whole decoding step in one CUDA graph: forward pass, certified argmax, greedy acceptance, commit.

`capture_graph` is the capture every graph of the engine goes through (`GraphedStep` and `GraphedBatchStep` here,
the self-drafter's `self_draft.GraphedDraft`).

The graph is captured once per node count (1: the autoregressive step; `tree_nodes`: the verify step)
on a Step whose buffers are then refilled in place before every replay: the token and position
vectors, the `gdn.TreePlan` tensors (copied from a freshly built plan), and the attention schedule
(`TreeAttnPlan.update`). Trees smaller than the graph's node count are padded with leaves under the
root that the acceptance never reads (`n_nodes` excludes them), so the captured shapes never change.

`GraphedBatchStep` is the same step over B cache rows (`specpilot.engine.batch`): one graph per (B, budget), B + budget
rows in all, each request's tree padded the same way until the rows are full; the refill is `GraphedStep`'s, for B
requests at once.
"""

from __future__ import annotations

import torch

import gdn

from .spec.accept import greedy_accept
from .model import MAX_STEP_NODES, HybridModel, Step

__all__ = ["GraphedStep", "GraphedBatchStep", "ATTN_CAPACITY", "batch_max_nodes", "capture_graph", "pass_tree"]

ATTN_CAPACITY = 512  # attention work items of a graphed step: enough splits for any context up to max_len

_PLAN_FIELDS = ("cu_seqlens", "parent", "parent_local", "anc", "depth", "node_req", "max_depth")


def capture_graph(fn, device, *, warmup: int = 2):
    """Capture one call of `fn()` as a CUDA graph on `device`; returns (graph, out), out being what the captured
    call returned: `graph.replay()` runs the call again and rewrites out's tensors in place.

    First `warmup` calls run on a side stream (they compile every kernel and settle the allocator, and they run
    fn's side effects: a caller whose fn writes state resets it afterwards), then the device is synchronized and
    the next call is captured. Every tensor fn reads must stay where it is (refill it in place between replays)."""
    fname = "specpilot.engine.graphs.capture_graph"
    if not callable(fn):
        raise TypeError(f"{fname}: fn={fn!r} is not callable; pass the function whose launches to capture")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"{fname}: warmup={warmup!r}; pass an int >= 1 (a first call compiles the kernels, which "
                         "capture cannot)")
    if not isinstance(device, (str, torch.device)) or torch.device(device).type != "cuda":
        raise ValueError(f"{fname}: device={device!r}; CUDA graphs need a CUDA device ('cuda' or 'cuda:N')")
    device = torch.device(device)
    current = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    current.wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def pass_tree(root_token: int, tree=None, pad: int = 0) -> tuple[list[int], list[int]]:
    """(tokens, local parents) of a pass: the pending token as node 0, the draft tree's nodes after it (their
    parents shifted by one, the draft roots under node 0), then `pad` leaves under node 0."""
    n = tree.n if tree is not None else 0
    toks = [root_token] + (tree.tokens.tolist() if n else []) + [0] * pad
    parents = [-1] + ([p + 1 for p in tree.parents.tolist()] if n else []) + [0] * pad
    return toks, parents


def refill(model: HybridModel, s: Step, ctx_lens: list[int], toks: list[list[int]], parents: list[list[int]],
           kv_rows: list[int]) -> None:
    """Refill Step `s` in place for the pass trees (toks[b], parents[b]) after ctx_lens[b] cached tokens of KV row
    kv_rows[b]: the same requests and node counts per pass as `s` was planned with in all (the graph's shapes), the
    tree plan, the attention schedule, tokens, positions and the first free KV slots copied in."""
    # built on the host and copied: the plan's pointer jumping as device ops would be ~40 small launches
    # and the schedule would read the masks back with a sync
    plan = gdn.build_tree_plan(parents)
    for f in _PLAN_FIELDS:
        getattr(s.tree, f).copy_(getattr(plan, f))
    pos, kv_indptr, kv_indices, kv_next = model.layout(ctx_lens, parents, kv_rows)
    s.attn.update(plan.cu_seqlens, torch.tensor(kv_indptr, dtype=torch.int32), kv_indices, plan.anc,
                  validate=False)
    s.ids.copy_(torch.tensor([t for ts in toks for t in ts], dtype=torch.int64))
    s.pos.copy_(torch.tensor(pos, dtype=torch.int64))
    s.kv_next.copy_(torch.tensor(kv_next, dtype=torch.int64))


def draft_rows(trees, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`greedy_accept`'s inputs of the draft trees (`DraftTree` or None for no tree), one row each, as CPU tensors:
    tokens int64, parents int32 (-1 past the tree), depths int32 [len(trees), width], and the node counts int32."""
    B = len(trees)
    tokens = torch.zeros(B, width, dtype=torch.int64)
    parents = torch.full((B, width), -1, dtype=torch.int32)
    depths = torch.zeros(B, width, dtype=torch.int32)
    count = torch.zeros(B, dtype=torch.int32)
    for b, tree in enumerate(trees):
        n = tree.n if tree is not None else 0
        if n:
            tokens[b, :n], parents[b, :n], depths[b, :n] = tree.tokens, tree.parents, tree.depths
            count[b] = n
    return tokens, parents, depths, count


def target_next(s: Step, target: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width + 1] of the pass's argmax `target` [T]: per request, its root's then its nodes' (0 past the request's
    own nodes), as `greedy_accept` reads them. Device ops only."""
    cu = s.tree.cu_seqlens.long()
    col = torch.arange(width + 1, device=target.device)
    idx = (cu[:-1, None] + col[None, :]).clamp(max=s.total - 1)
    return torch.where(col[None, :] < (cu[1:] - cu[:-1])[:, None], target[idx], torch.zeros_like(idx))


class GraphedStep:
    """One captured step of `nodes` rows (root included) for cache row `row`; `max_depth` bounds the
    draft trees' depth (the drafter's positions)."""

    def __init__(self, model: HybridModel, nodes: int, max_depth: int, row: int = 0):
        self.model, self.nodes, self.max_depth, self.row = model, int(nodes), int(max_depth), int(row)
        dev = model.device
        n = self.nodes - 1
        self.step: Step = model.plan([row], [0], [[0] * self.nodes], [[-1] + [0] * n], capacity=ATTN_CAPACITY)
        self.d_tokens = torch.zeros(1, max(n, 1), dtype=torch.int64, device=dev)
        self.d_parents = torch.full((1, max(n, 1)), -1, dtype=torch.int32, device=dev)
        self.d_depths = torch.zeros(1, max(n, 1), dtype=torch.int32, device=dev)
        self.d_count = torch.zeros(1, dtype=torch.int32, device=dev)
        self.one = torch.ones(1, dtype=torch.int32, device=dev)
        self.root = torch.zeros(1, 1, dtype=torch.int32, device=dev)
        self.graph = None
        self.out = None

    def _body(self):
        m, s = self.model, self.step
        hidden = m.forward(s)
        target = m.argmax(hidden)
        if self.nodes == 1:
            m.commit(s, self.root, self.one)
            return target, None, None, None, hidden
        acc = greedy_accept(self.d_tokens, self.d_parents, self.d_depths, self.d_count, target[None],
                            max_depth=self.max_depth)
        m.commit_accepted(s, acc.accepted, acc.accepted_len)
        return target, acc.accepted, acc.accepted_len, acc.bonus, hidden

    def capture(self) -> None:
        """Warm up (compiles every kernel) and capture. The warm-up writes the caches of `row`: reset them
        afterwards (the engine captures before a request's prefill)."""
        self.graph, self.out = capture_graph(self._body, self.model.device)

    def load(self, ctx_len: int, root_token: int, tree=None) -> None:
        """Refill the buffers for the pending token `root_token` after `ctx_len` cached tokens, with the draft
        tree `tree` (`specpilot.engine.spec.tree.DraftTree`, at most nodes - 1 nodes) below it."""
        m, s = self.model, self.step
        n = tree.n if tree is not None else 0
        if n > self.nodes - 1:
            raise ValueError(f"specpilot.engine.GraphedStep: a tree of {n} nodes does not fit a step of "
                             f"{self.nodes} rows")
        toks, parents = pass_tree(root_token, tree, pad=self.nodes - 1 - n)
        refill(m, s, [ctx_len], [toks], [parents], [self.row])
        if self.nodes > 1:
            for dst, src in zip((self.d_tokens, self.d_parents, self.d_depths, self.d_count),
                                draft_rows([tree], self.d_tokens.shape[1])):
                dst.copy_(src)

    def replay(self):
        """(target [nodes], accepted [1, max_depth], accepted_len [1], bonus [1], hidden [nodes, hidden_size]: the
        final-normed hidden states, which a hidden-state drafter reads); accepted, accepted_len and bonus are None
        for the autoregressive step. The tensors are the graph's own outputs: read them before the next replay."""
        self.graph.replay()
        return self.out


def attn_items_per_row_block(probe, nodes: int, max_len: int) -> tuple[int, int]:
    """(row blocks of `nodes` query nodes, the most work items tree_attn schedules per row block after up to
    `max_len` keys: one split per key block and the tree block), for the kernel config of `probe`, a plan's
    attention."""
    cfg = probe.dispatch.config
    bm, bn = (cfg.block_m, cfg.block_n) if cfg is not None else (64, 64)
    return -(-nodes * (probe.num_qo_heads // probe.num_kv_heads) // bm), -(-max_len // bn) + 1


def _attn_capacity(probe, batch: int, total: int, max_len: int) -> int:
    """Attention work items of a graphed batch step: a bound on what tree_attn's scheduler chooses for `batch`
    requests of `total` nodes in all, each after up to `max_len` keys (`probe`: a plan of the step, for its kernel
    config). The scheduler fills at most 8 waves of its target items with prefix splits, plus one tree item per row
    block; past the bound it takes longer splits (the same output), never fewer than one per request."""
    from tree_attn.ops import _target_items

    blocks, per_block = attn_items_per_row_block(probe, total, max_len)
    tiles = blocks + batch  # >= the row blocks of any split of `total` nodes into `batch` trees
    every_split = tiles * per_block
    return max(1, min(every_split, 8 * _target_items(probe.device, probe.num_kv_heads, probe.dispatch.config)
                      + 2 * tiles))


def batch_max_nodes(batch: int, budget: int) -> int:
    """The per-request node bound of a batch pass of `batch` requests and `budget` draft nodes: at most
    `gdn.cuda.MAX_CUDA_NODES` (32) where the budget fits in it, so that the GDN layers run the CUDA tree kernel,
    else MAX_STEP_NODES. Above 32 nodes they run the WY kernel, whose node tile follows this bound, not the trees: on
    the H200 (hybrid-27b, B = 8, budget 64, bound 64) it took 28.5 ms of the 47.8 ms step for trees of 9 nodes."""
    from gdn.cuda import MAX_CUDA_NODES

    if budget <= (MAX_CUDA_NODES - 1) * batch:
        return min(MAX_CUDA_NODES, budget + 1)
    return min(MAX_STEP_NODES, budget + 1)


class GraphedBatchStep:
    """One captured batch verify step: request b on cache row rows[b], `budget` draft nodes in all, so B + budget
    rows per pass (`total`); `max_depth` bounds the trees' depth (the deepest drafted position).

    Each request holds at most `max_nodes` rows (`batch_max_nodes`: 32 where the budget allows, else 64), its own
    tree and then padding leaves under its root (`pads`: the rows left over go to the first requests with room). A
    row with no request to run (`load` with tree None: token 0 after no context, and any padding it is given)
    commits into that free row alone."""

    def __init__(self, model: HybridModel, rows: list[int], budget: int, max_depth: int):
        fn = "specpilot.engine.GraphedBatchStep"
        self.model, self.rows = model, [int(r) for r in rows]
        self.batch, self.budget, self.max_depth = len(self.rows), int(budget), int(max_depth)
        B = self.batch
        if not B or len(set(self.rows)) != B or not all(0 <= r < model.rows for r in self.rows):
            raise ValueError(f"{fn}: rows={rows!r}; pass distinct cache rows of the model's {model.rows}")
        if not 0 <= self.budget <= (MAX_STEP_NODES - 1) * B:
            raise ValueError(f"{fn}: budget={budget} draft nodes over {B} requests; pass 0..{(MAX_STEP_NODES - 1) * B} "
                             f"(at most {MAX_STEP_NODES - 1} per request)")
        self.max_nodes = batch_max_nodes(B, self.budget)
        self.total = B + self.budget
        self.width = max(self.max_nodes - 1, 1)  # draft nodes per request in the acceptance's buffers
        # planned with the first requests full: the tree plan's and the attention's tile sizes hold max_nodes
        sizes = [1 + p for p in self.pads([0] * B)]
        toks, parents = [[0] * n for n in sizes], [[-1] + [0] * (n - 1) for n in sizes]
        probe = model.plan(self.rows, [0] * B, toks, parents).attn
        self.step: Step = model.plan(self.rows, [0] * B, toks, parents,
                                     capacity=_attn_capacity(probe, B, self.total, model.max_len))
        dev = model.device
        self.d_tokens = torch.zeros(B, self.width, dtype=torch.int64, device=dev)
        self.d_parents = torch.full((B, self.width), -1, dtype=torch.int32, device=dev)
        self.d_depths = torch.zeros(B, self.width, dtype=torch.int32, device=dev)
        self.d_count = torch.zeros(B, dtype=torch.int32, device=dev)
        self.graph = None
        self.out = None

    def pads(self, ns: list[int]) -> list[int]:
        """Padding leaves per request for trees of ns[b] draft nodes: the rows the budget leaves, given to the first
        requests with room (each up to max_nodes)."""
        left = self.budget - sum(ns)
        if len(ns) != self.batch or left < 0 or any(not 0 <= n < self.max_nodes for n in ns):
            raise ValueError(f"specpilot.engine.GraphedBatchStep: trees of {ns} draft nodes do not fit a step of "
                             f"{self.batch} requests, {self.budget} draft nodes in all and at most "
                             f"{self.max_nodes - 1} per request; keep the trees within the budget (as "
                             "budget.allocate does), or capture a step with a larger budget")
        out = []
        for n in ns:
            p = min(left, self.max_nodes - 1 - n)
            out.append(p)
            left -= p
        return out

    def _body(self):
        m, s = self.model, self.step
        target = m.argmax(m.forward(s))
        acc = greedy_accept(self.d_tokens, self.d_parents, self.d_depths, self.d_count,
                            target_next(s, target, self.width), max_depth=self.max_depth)
        m.commit_accepted(s, acc.accepted, acc.accepted_len)
        return target, acc.accepted, acc.accepted_len, acc.bonus

    def capture(self) -> None:
        """Warm up (compiles every kernel) and capture. The warm-up writes the caches of `rows`: reset them afterwards
        (`generate_batch` captures before the first prefill)."""
        self.graph, self.out = capture_graph(self._body, self.model.device)

    def load(self, ctx_lens: list[int], roots: list[int], trees: list) -> None:
        """Refill the buffers: request b's pending token roots[b] after ctx_lens[b] cached tokens, with the draft tree
        trees[b] (`DraftTree`, or None) below it."""
        fn = "specpilot.engine.GraphedBatchStep"
        ns = [t.n if t is not None else 0 for t in trees]
        if not len(ctx_lens) == len(roots) == self.batch:
            raise ValueError(f"{fn}: {len(ctx_lens)} contexts and {len(roots)} pending tokens for a step of "
                             f"{self.batch} requests; pass one of each per request")
        for b, (c, n) in enumerate(zip(ctx_lens, ns)):
            if not 0 <= c <= self.model.max_len - 1 - n:
                raise ValueError(f"{fn}: request {b} would reach {c + 1 + n} tokens after {c} cached ones, beyond "
                                 f"max_len={self.model.max_len}; build the model with a larger max_len")
        toks, parents = zip(*(pass_tree(r, t, pad=p) for r, t, p in zip(roots, trees, self.pads(ns))))
        refill(self.model, self.step, list(ctx_lens), list(toks), list(parents), self.rows)
        for dst, src in zip((self.d_tokens, self.d_parents, self.d_depths, self.d_count),
                            draft_rows(trees, self.width)):
            dst.copy_(src)

    def replay(self):
        """(target [total], accepted [B, max_depth], accepted_len [B], bonus [B]), requests in the order of `rows`.
        The tensors are the graph's own outputs: read them before the next replay."""
        self.graph.replay()
        return self.out
