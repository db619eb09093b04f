"""A whole decoding step in one CUDA graph: forward pass, certified argmax, greedy acceptance, commit.

`capture_graph` is the capture every graph of the engine goes through (`GraphedStep` here, the self-drafter's
`self_draft.GraphedDraft`).

The graph is captured once per node count (1: the autoregressive step; `tree_nodes`: the verify step)
on a Step whose buffers are then refilled in place before every replay: the token and position
vectors, the `gdn.TreePlan` tensors (copied from a freshly built plan), and the attention schedule
(`TreeAttnPlan.update`). Trees smaller than the graph's node count are padded with leaves under the
root that the acceptance never reads (`n_nodes` excludes them), so the captured shapes never change.
"""

from __future__ import annotations

import torch

import gdn

from .spec.accept import greedy_accept
from .model import HybridModel, Step

__all__ = ["GraphedStep", "ATTN_CAPACITY", "capture_graph", "pass_tree"]

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
        # built on the host and copied: the plan's pointer jumping as device ops would be ~40 small launches
        # and the schedule would read the masks back with a sync
        plan = gdn.build_tree_plan([parents])
        for f in _PLAN_FIELDS:
            getattr(s.tree, f).copy_(getattr(plan, f))
        pos, kv_indptr, kv_indices, kv_next = m.layout([ctx_len], [parents], [self.row])
        s.attn.update(plan.cu_seqlens, torch.tensor(kv_indptr, dtype=torch.int32), kv_indices, plan.anc,
                      validate=False)
        s.ids.copy_(torch.tensor(toks, dtype=torch.int64))
        s.pos.copy_(torch.tensor(pos, dtype=torch.int64))
        s.kv_next.copy_(torch.tensor(kv_next, dtype=torch.int64))
        if self.nodes > 1:
            self.d_tokens.zero_()
            self.d_parents.fill_(-1)
            self.d_depths.zero_()
            if n:
                self.d_tokens[0, :n].copy_(tree.tokens)
                self.d_parents[0, :n].copy_(tree.parents)
                self.d_depths[0, :n].copy_(tree.depths)
            self.d_count.fill_(n)

    def replay(self):
        """(target [nodes], accepted [1, max_depth], accepted_len [1], bonus [1], hidden [nodes, hidden_size]: the
        final-normed hidden states, which a hidden-state drafter reads); accepted, accepted_len and bonus are None
        for the autoregressive step. The tensors are the graph's own outputs: read them before the next replay."""
        self.graph.replay()
        return self.out
