"""The self-drafter: the target drafting for itself on its W12 8-bit view, eagerly (`SelfDrafter`: the reference,
and the path on the CPU) or with each drafting step as CUDA graphs (`GraphedDraft`: the engine's path on a GPU).

Both keep the same cache rows in the target's model, and leave them the same:

- row COMMITTED (1) holds the context the drafter has caught up with: every token but the pending one, its GDN and
  conv states, and its keys and values in row 1's KV slots [0, len(context) - 1). Catching up runs the tokens it
  has not seen as one chain pass into row 1 (`HybridModel.consume`, chains of up to 64), or resets row 1 and runs
  the whole context when the context does not extend what it saw;
- row SCRATCH (2) takes a copy of row 1's states and drafts on it: drafted position d is a one-node pass on row 2
  at context length base + d (base = len(context) - 1), reading its prefix from row 1's KV slots and writing its
  key and value to row 1's slot base + d, past the context (overwritten as the context grows). Its top-1 token is
  the next position's input.

After a draft, row 1's states are those of the context, row 2's those of the context and the greedy draft path, and
row 1's KV slots [base, base + positions) hold the drafted tokens. Row 2's KV slots are never used.
"""

from __future__ import annotations

import dataclasses

import torch

from . import inputs
from .graphs import attn_items_per_row_block, capture_graph
from .model import MAX_STEP_NODES, HybridModel, Step

__all__ = ["SelfDrafter", "GraphedDraft"]


class SelfDrafter:
    """The target drafting for itself on its W12 8-bit view (`w12.matmul_q8`): `positions` greedy
    autoregressive steps, each proposing its top-k tokens with their log-probabilities (module docstring: the cache
    rows). The scores are conditioned on the greedy draft path above them: the tree builder treats them as marginal,
    an approximation that only affects which nodes are drafted, never what is accepted."""

    COMMITTED, SCRATCH = 1, 2

    def __init__(self, model: HybridModel):
        if not isinstance(model, HybridModel):
            raise TypeError(f"specpilot.engine.SelfDrafter: model is a {type(model).__name__}; pass the target's "
                            "HybridModel (engine.model), or build the engine with drafter='self'")
        if model.rows < 3:
            raise ValueError("specpilot.engine.SelfDrafter: the model needs 3 cache rows (target, drafter, "
                             "scratch); build it with rows=3")
        self.model = model
        self.seen: list[int] = []

    def _catch_up(self, ctx: list[int], consume=None) -> None:
        """Bring row COMMITTED to ctx[:-1]. `consume(done, tokens)` runs tokens into the row after `done` of them
        (default: `HybridModel.consume` on the 8-bit view)."""
        m = self.model
        body = ctx[:-1]
        if body[:len(self.seen)] != self.seen:
            m.reset_rows([self.COMMITTED])
            self.seen = []
        new = body[len(self.seen):]
        if consume is None:
            m.consume(self.COMMITTED, len(self.seen), new, q8=True)
        elif new:
            consume(len(self.seen), new)
        self.seen = list(body)

    def propose(self, context, positions: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        fn = "specpilot.engine.SelfDrafter.propose"
        ctx = inputs.token_ids(fn, context, self.model.cfg.vocab, what="context", empty_ok=True)
        positions, k = inputs.count(fn, "positions", positions), inputs.count(fn, "k", k)
        tokens = torch.zeros(positions, k, dtype=torch.int64)
        scores = torch.full((positions, k), float("-inf"), dtype=torch.float32)
        if not ctx:
            return tokens, scores
        m = self.model
        self._catch_up(ctx)
        m.copy_row(self.COMMITTED, self.SCRATCH)
        dev, base = m.device, len(ctx) - 1
        tok = ctx[-1]
        k = min(k, m.cfg.vocab)
        for d in range(positions):
            if base + d + 1 > m.max_len:
                break
            step = m.plan([self.SCRATCH], [base + d], [[tok]], [[-1]], kv_rows=[self.COMMITTED])
            logp = torch.log_softmax(m.logits(m.forward(step, q8=True))[0], -1)
            m.commit(step, torch.zeros(1, 1, dtype=torch.int32, device=dev),
                     torch.ones(1, dtype=torch.int32, device=dev))
            v, i = torch.topk(logp, k)
            tokens[d, :k], scores[d, :k] = i.cpu(), v.float().cpu()
            tok = int(i[0])
        return tokens, scores


def _attn_schedule(plan, nodes: int, ctx_len: int):
    """tree_attn's split-KV schedule of one chain of `nodes` after `ctx_len` prefix keys: (items [used, 4],
    req_table [1, 3]), int32 CPU tensors, as `tree_attn.plan` computes them for the plan's kernel config and device
    without a capacity (the eager passes' schedule). Taken from tree_attn's own scheduler so that the graphed passes
    run the eager passes' splits; `TreeAttnPlan.update` would also copy seven small host tensors per pass, the cost
    the staged buffers remove."""
    from tree_attn.ops import _schedule, _target_items

    cfg = plan.dispatch.config
    items, table, _, _, _ = _schedule("specpilot.engine.GraphedDraft", [0, nodes], [0, ctx_len], False,
                                      plan.num_qo_heads // plan.num_kv_heads, cfg,
                                      _target_items(plan.device, plan.num_kv_heads, cfg), None)
    return items, table


class _StagedChains:
    """`count` Steps of one chain of `nodes` each, on cache row `row` with the prefix read from `kv_row`'s KV slots,
    whose per-pass inputs are views into two device tensors, refilled by one host-to-device copy each:

    - int64 [count, 2 * nodes + 1]: the tokens, the positions (context length + depth), the first free KV slot;
    - int32 [count, 8 + 4 * capacity]: the attention's kv_indptr (at 0), its request table (at 4) and its work
      items (at 8; every part 16-byte aligned).

    Everything else of a Step is fixed for a chain of `nodes`: the GDN tree plan, the attention's query offsets,
    masks and node table, and its prefix slots (row `kv_row`'s slots in order: a context of L tokens reads the first
    L of them). The work items are sized for a prefix of max_len (every split the scheduler can choose), and the
    Steps share one buffer of the attention's partial outputs."""

    def __init__(self, model: HybridModel, row: int, kv_row: int, nodes: int, count: int):
        self.model, self.row, self.kv_row, self.nodes, self.count = model, row, kv_row, nodes, count
        dev = model.device
        chain = [list(range(-1, nodes - 1))]
        probe = model.plan([row], [0], [[0] * nodes], chain, kv_rows=[kv_row]).attn
        # the most work items tree_attn schedules for this chain: per row block, one split per key block of the
        # longest prefix (max_len) and the tree block
        tiles, per_block = attn_items_per_row_block(probe, nodes, model.max_len)
        self.capacity = tiles * per_block
        width = 8 + 4 * self.capacity
        pin = dev.type == "cuda"
        self.host64 = torch.zeros(count, 2 * nodes + 1, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(count, width, dtype=torch.int32, pin_memory=pin)
        self.dev64 = torch.zeros(count, 2 * nodes + 1, dtype=torch.int64, device=dev)
        self.dev32 = torch.zeros(count, width, dtype=torch.int32, device=dev)
        self.steps: list[Step] = []
        for j in range(count):
            # planned at the longest context, so the prefix slot buffer holds every slot a pass can read
            s = model.plan([row], [model.max_len - nodes], [[0] * nodes], chain, kv_rows=[kv_row],
                           capacity=self.capacity)
            a, b = self.dev64[j], self.dev32[j]
            # the passes run one after another: one buffer of partial outputs serves them all
            po, plse = (s.attn.po, s.attn.plse) if j == 0 else (self.steps[0].attn.po, self.steps[0].attn.plse)
            attn = dataclasses.replace(s.attn, kv_indptr=b[0:2], req_table=b[4:7].view(1, 3),
                                       items=b[8:].view(self.capacity, 4), po=po, plse=plse)
            self.steps.append(dataclasses.replace(s, ids=a[:nodes], pos=a[nodes:2 * nodes],
                                                  kv_next=a[2 * nodes:], attn=attn))
        self.plan = self.steps[0].attn
        self._rows: dict[int, torch.Tensor] = {}  # context length -> the int32 row (one-node chains only)
        self._pad = torch.tensor([-1, 0, 0, 0], dtype=torch.int32).repeat(self.capacity)  # unused work items

    def _row(self, ctx_len: int) -> torch.Tensor:
        row = self._rows.get(ctx_len) if self.nodes == 1 else None
        if row is None:
            items, table = _attn_schedule(self.plan, self.nodes, ctx_len)
            if items.shape[0] > self.capacity:  # the capacity bounds every schedule up to max_len
                raise RuntimeError(f"specpilot.engine.GraphedDraft: tree_attn scheduled {items.shape[0]} work items "
                                   f"for {self.nodes} nodes after {ctx_len} keys, more than the bound "
                                   f"{self.capacity}; the bound no longer matches tree_attn's scheduler")
            head = torch.tensor([0, ctx_len, 0, 0, *table[0].tolist(), 0], dtype=torch.int32)
            row = torch.cat([head, items.view(-1), self._pad[items.numel():]])
            if self.nodes == 1:  # a one-node chain's schedule is drafted again at the same length a few steps on
                self._rows[ctx_len] = row
        return row

    def fill(self, j: int, ctx_len: int, tokens: list[int] | None = None) -> None:
        """Host side of pass j: the chain `tokens` (None: left as they are) after `ctx_len` cached tokens."""
        n, h = self.nodes, self.host64[j]
        if tokens is not None:
            h[:n] = torch.tensor(tokens, dtype=torch.int64)
        h[n:2 * n] = torch.arange(ctx_len, ctx_len + n, dtype=torch.int64)
        h[2 * n] = self.kv_row * self.model.max_len + ctx_len
        self.host32[j].copy_(self._row(ctx_len))

    def upload(self) -> None:
        """Copy the filled host tensors into the device buffers the Steps read (before a replay)."""
        self.dev64.copy_(self.host64)
        self.dev32.copy_(self.host32)


class GraphedDraft:
    """`SelfDrafter.propose(context, positions, topk)` with its passes captured as CUDA graphs, leaving the cache rows
    as the eager drafter leaves them (module docstring):

    - the catch-up: the tokens the drafter has not seen, one chain pass into row COMMITTED, one graph per chain
      length 1..`catch_up` (a verify step adds at most its deepest accepted path and the bonus token);
    - the drafting step: row COMMITTED's states copied to row SCRATCH, then `positions` one-node passes, each with the
      log-softmax of its logits and their top-k on the device and its top-1 token the next pass's input: one graph,
      no host read between positions.

    Before a replay, the passes' inputs (tokens, positions, KV slots, attention schedules) are written into pinned
    host tensors and copied into the graphs' buffers, one copy per dtype. The graphs replay the eager drafter's
    launches on the same shapes, so the proposals and the cache rows are the eager drafter's. The eager drafter runs
    instead where a graph does not fit: an empty context, a draft that would pass max_len, and a catch-up of more
    than `catch_up` tokens (after the prefill, or when the context does not extend what the drafter saw), which the
    eager catch-up runs in chains of 64.

    `capture()` (once, before a request's prefill: its warm-up writes rows COMMITTED and SCRATCH, which it resets)
    must precede `propose`."""

    def __init__(self, drafter: SelfDrafter, positions: int, topk: int, catch_up: int | None = None):
        fn = "specpilot.engine.GraphedDraft"
        if not isinstance(drafter, SelfDrafter):
            raise TypeError(f"{fn}: drafter is a {type(drafter).__name__}; pass the engine's SelfDrafter "
                            "(Engine(model, drafter='self').drafter)")
        self.drafter, self.model = drafter, drafter.model
        self.positions = inputs.count(fn, "positions", positions)
        self.topk = inputs.count(fn, "topk", topk)
        self.catch_up = inputs.count(fn, "catch_up", positions + 1 if catch_up is None else catch_up, 1,
                                     MAX_STEP_NODES)
        m, dev = self.model, self.model.device
        self.k = min(self.topk, m.cfg.vocab)
        C, S = drafter.COMMITTED, drafter.SCRATCH
        self.draft = _StagedChains(m, S, C, 1, self.positions)
        self.tokens = torch.zeros(self.positions, self.k, dtype=torch.int64, device=dev)
        self.scores = torch.zeros(self.positions, self.k, dtype=torch.float32, device=dev)
        for d in range(1, self.positions):  # position d reads the top-1 token of position d - 1
            self.draft.steps[d] = dataclasses.replace(self.draft.steps[d], ids=self.tokens[d - 1, :1])
        self.chains = {n: _StagedChains(m, C, C, n, 1) for n in range(1, min(self.catch_up, m.max_len) + 1)}
        self.zero = torch.zeros(1, 1, dtype=torch.int32, device=dev)
        self.one = torch.ones(1, dtype=torch.int32, device=dev)
        self.chain_accept = {n: (torch.arange(n, dtype=torch.int32, device=dev)[None],
                                 torch.tensor([n], dtype=torch.int32, device=dev)) for n in self.chains}
        self._replay_draft = None
        self._replay_chain: dict[int, object] = {}

    # ---- the captured bodies -----------------------------------------------------------------
    def _draft_body(self):
        m, d = self.model, self.drafter
        m.copy_row(d.COMMITTED, d.SCRATCH)
        for j, s in enumerate(self.draft.steps):
            logp = torch.log_softmax(m.logits(m.forward(s, q8=True))[0], -1)
            m.commit(s, self.zero, self.one)
            torch.topk(logp, self.k, out=(self.scores[j], self.tokens[j]))
        return self.tokens, self.scores

    def _chain_body(self, n: int):
        m, s = self.model, self.chains[n].steps[0]
        m.forward(s, q8=True)
        m.commit(s, *self.chain_accept[n])

    def _capture(self, body):
        """A function that replays `body` as captured (`capture_graph`) and returns the capture's outputs."""
        graph, out = capture_graph(body, self.model.device)

        def replay():
            graph.replay()
            return out

        return replay

    def capture(self) -> None:
        """Warm up and capture every graph, then reset the drafter's rows (and what it has seen)."""
        for n, st in self.chains.items():
            st.fill(0, 0, [0] * n)
            st.upload()
            self._replay_chain[n] = self._capture(lambda n=n: self._chain_body(n))
        self.tokens.zero_()
        for j in range(self.positions):
            self.draft.fill(j, j, [0] if j == 0 else None)
        self.draft.upload()
        self._replay_draft = self._capture(self._draft_body)
        d = self.drafter
        self.model.reset_rows([d.COMMITTED, d.SCRATCH])
        d.seen = []

    # ---- per step ----------------------------------------------------------------------------
    def _consume(self, done: int, tokens: list[int]) -> None:
        n, m = len(tokens), self.model
        replay = self._replay_chain.get(n)
        if replay is None or done + n > m.max_len:
            m.consume(self.drafter.COMMITTED, done, tokens, q8=True)
            return
        st = self.chains[n]
        st.fill(0, done, tokens)
        st.upload()
        replay()

    def propose(self, context) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens int64 [positions, topk], scores float32 [positions, topk]) on the CPU: what
        `SelfDrafter.propose(context, positions, topk)` returns."""
        fn = "specpilot.engine.GraphedDraft.propose"
        if self._replay_draft is None:
            raise RuntimeError(f"{fn}: the graphs are not captured; call capture() first (Engine.capture does)")
        m, d = self.model, self.drafter
        ctx = inputs.token_ids(fn, context, m.cfg.vocab, what="context", empty_ok=True)
        base = len(ctx) - 1
        if not ctx or base + self.positions > m.max_len:
            return d.propose(ctx, self.positions, self.topk)
        d._catch_up(ctx, consume=self._consume)
        for j in range(self.positions):
            self.draft.fill(j, base + j, [ctx[-1]] if j == 0 else None)
        self.draft.upload()
        got_tokens, got_scores = self._replay_draft()
        tokens = torch.zeros(self.positions, self.topk, dtype=torch.int64)
        scores = torch.full((self.positions, self.topk), float("-inf"), dtype=torch.float32)
        tokens[:, :self.k], scores[:, :self.k] = got_tokens.cpu(), got_scores.cpu()
        return tokens, scores
