"""Batched speculative decoding under one node budget: ragged trees, one TreePlan, one state pool, one KV
cache.

Every step, each live request drafts `AcceptanceHistory.positions()` positions (16, 12 or 8, from its own
recent acceptance), its candidates are ranked best-first (`build_tree` up to 63 nodes), and
`budget.allocate` hands the step's `budget` nodes to the highest marginal expected acceptance
(`AcceptanceHistory.gains`: history only, the drafter's scores calibrated by the request's past). Each
request's tree is the best-first prefix of its candidates (parent-closed: a node is taken after its
parent). One pass verifies all requests' pending tokens and trees; acceptance and commit run per
request on the device, as in the single-request step.

Requests run in at most `max_rows` cache rows at once (default: all the model's rows); the others wait, in
order. A request that finishes leaves the batch, and its row goes to the next waiting prompt: the row is reset
and the prompt prefilled into it (`Engine._prefill_row`), and it joins the next verify step. A request's
tokens depend only on its own row, so admission order and batch company never change its output.

`budget="auto"` (or a sequence of budgets) lets the engine pick each step's budget by measurement: before the first
prefill it times one step of each candidate budget on the free rows (`measure_budgets`: graphed steps replayed, or
eager ones), then every step takes the budget with the most expected tokens per second (`budget.best_budget`: the
running requests' calibrated gains against the measured step costs, plus the share of a step that does not
depend on its budget, drafting and tree building, measured on the steps so far). Where drafts rarely land, or a
wide step costs more than its nodes bring (W12 weights above 32 rows, docs/engine.md), it falls back to fewer nodes
or to the autoregressive step; outputs do not depend on the choice.

The pass has `rows + budget` rows at most. On a GPU each step can be one CUDA graph (`graphs.GraphedBatchStep`,
the default where the engine graphs its steps, `GRAPHS_BY_DEFAULT`): one per (rows R, budget), captured before
the first prefill, its pass always R + budget rows: request b of the pass is cache row b, each tree padded with
leaves that acceptance never reads, and a row without a running request (the queue has drained) runs its
pending-token slot alone, which writes only that free row (it is reset when a prompt takes it). The eager steps,
one pass of exactly the live requests' rows, are the reference and the CPU path; both give every request its own
greedy output.
"""

from __future__ import annotations

import math
import time

import torch

from . import inputs
from .graphs import GraphedBatchStep, batch_max_nodes, draft_rows, pass_tree, target_next
from .model import MAX_STEP_NODES
from .records import StepRecord, nan_logits_error
from .spec.accept import Acceptance, greedy_accept
from .spec.budget import DEPTHS, AcceptanceHistory, allocate, best_budget
from .spec.tree import DraftTree, build_tree

__all__ = ["generate_batch", "measure_budgets", "AUTO_NODES_PER_ROW", "AUTO_MAX_BUDGET"]

# generate_batch's default follows the engine's own choice of CUDA graphs (Engine.graphs); False keeps eager steps
GRAPHS_BY_DEFAULT = True
# budget="auto": the candidate budgets, in draft nodes per cache row (31: the most that keeps the GDN layers on their
# CUDA tree kernel, graphs.batch_max_nodes), at most AUTO_MAX_BUDGET nodes a step (each candidate is one captured
# graph, its buffers sized to its rows)
AUTO_NODES_PER_ROW = (0, 1, 2, 4, 8, 16, 31)
AUTO_MAX_BUDGET = 256
AUTO_REPS = 5  # timed steps per candidate (the median), after one untimed


def _prefix(tree, n: int) -> DraftTree:
    """The first n nodes of a best-first tree (a parent-closed subtree)."""
    return DraftTree(tokens=tree.tokens[:n], parents=tree.parents[:n], depths=tree.depths[:n], scores=tree.scores[:n],
                     anc=tree.anc[:n])


def eager_step(model, rows: list[int], ctx_lens: list[int], roots: list[int], trees: list, max_depth: int,
               pads: list[int] | None = None):
    """One batch verify step run eagerly: request b (cache row rows[b], pending token roots[b] after ctx_lens[b]
    cached tokens, draft tree trees[b], a `DraftTree` or None) in one pass; acceptance and commit on the device.
    `pads`: padding leaves under each request's root, which acceptance never reads (`GraphedBatchStep.pads`: the
    graphed step's pass, run eagerly); default none, a pass of exactly the requests' own rows.
    Returns (step, target [T], Acceptance), the step for its request offsets (`step.tree.cu_seqlens`)."""
    pads = [0] * len(rows) if pads is None else pads
    toks, pars = zip(*(pass_tree(root, tree, pad=p) for root, tree, p in zip(roots, trees, pads)))
    step = model.plan(rows, ctx_lens, list(toks), list(pars))
    target = model.argmax(model.forward(step))
    width = max([t.n for t in trees if t is not None] + [1])
    tok_b, par_b, dep_b, count = (x.to(model.device) for x in draft_rows(trees, width))
    acc = greedy_accept(tok_b, par_b, dep_b, count, target_next(step, target, width), max_depth=max_depth)
    model.commit_accepted(step, acc.accepted, acc.accepted_len)
    return step, target, acc


def _batch_graph(engine, rows: int, budget: int) -> GraphedBatchStep:
    """The engine's captured batch step of cache rows 0..rows-1 and `budget` draft nodes (captured on first use; its
    warm-up writes those rows, which are reset here)."""
    graphs = engine._batch_graphs
    g = graphs.get((rows, budget))
    if g is None:
        m = engine.model
        g = GraphedBatchStep(m, list(range(rows)), budget, max_depth=max(DEPTHS))
        g.capture()
        m.reset_rows(range(rows))
        graphs[(rows, budget)] = g
    return g


def _check_budget(fn: str, budget):
    """generate_batch's `budget`, checked before any work: None, an int >= 0, "auto", or a tuple of such ints."""
    if budget is None:
        return None
    if isinstance(budget, str):
        if budget == "auto":
            return budget
        raise ValueError(f"{fn}: budget={budget!r}; pass an int >= 0, 'auto', or a sequence of ints to choose from by "
                         "measurement")
    if isinstance(budget, (list, tuple)):
        if not budget:
            raise ValueError(f"{fn}: budget=[] holds no candidate; pass an int, 'auto', or budgets to choose from")
        return tuple(inputs.count(fn, "budget", b, 0) for b in budget)
    return inputs.count(fn, "budget", budget, 0)


def _budgets(budget, rows: int) -> tuple[int, ...]:
    """The candidate budgets of a checked `budget` (`_check_budget`) for `rows` cache rows, sorted, each at most
    MAX_STEP_NODES - 1 nodes a row."""
    limit = (MAX_STEP_NODES - 1) * rows
    if budget is None:
        return (min(8 * rows, limit),)
    if budget == "auto":
        return tuple(sorted({k * rows for k in AUTO_NODES_PER_ROW if k * rows <= min(AUTO_MAX_BUDGET, limit)}))
    return tuple(sorted({min(b, limit) for b in (budget if isinstance(budget, tuple) else (budget,))}))


def _dummy_trees(vocab: int, batch: int, budget: int) -> list:
    """`budget` draft nodes split evenly over `batch` requests (the first ones one more), as best-first trees of up to
    16 positions and top-4 on made-up tokens: the shape of a step, for timing it."""
    out = []
    for b in range(batch):
        n = budget // batch + (b < budget % batch)
        if not n:
            out.append(None)
            continue
        P = min(max(DEPTHS), n)
        tokens = torch.arange(P * 4, dtype=torch.int64).reshape(P, 4) % vocab
        scores = -(torch.arange(P, dtype=torch.float64)[:, None] + torch.arange(4, dtype=torch.float64)[None, :])
        out.append(build_tree(tokens, scores, budget=n))
    return out


def measure_budgets(engine, rows: int, budgets, graphs: bool, reps: int = AUTO_REPS) -> dict[int, float]:
    """Seconds of one batch step of `rows` cache rows (0..rows-1) at each budget: the median of `reps` steps after one
    untimed, each with made-up trees of the budget's nodes after a one-token context, timed as generate_batch runs
    them (a graphed step's load and replay, or the eager step, and the read of its results). The steps write those
    rows, so call it before any prompt is prefilled there (admission resets a row)."""
    m = engine.model
    cuda = m.device.type == "cuda"
    costs = {}
    for budget in budgets:
        trees = _dummy_trees(m.cfg.vocab, rows, budget)
        if graphs:
            g = _batch_graph(engine, rows, budget)

            def one():
                g.load([1] * rows, [0] * rows, trees)
                return g.replay()[1]
        else:
            def one():
                return eager_step(m, list(range(rows)), [1] * rows, [0] * rows, trees, max(DEPTHS))[2].accepted
        times = []
        for i in range(reps + 1):
            if cuda:
                torch.cuda.synchronize(m.device)
            t0 = time.perf_counter()
            one().tolist()
            if i:
                times.append(time.perf_counter() - t0)
        costs[budget] = sorted(times)[len(times) // 2]
    return costs


def generate_batch(engine, prompts, max_new_tokens: int, *, budget=None, topk: int | None = None,
                   max_rows: int | None = None, graphs: bool | None = None,
                   log_allocations: list | None = None, log_budgets: dict | None = None) -> list[list[int]]:
    """Greedy continuations of every prompt, verified together under `budget` tree nodes per step (default 8 per
    running request). `budget="auto"`, or a sequence of budgets, picks each step's budget among the candidates by
    measurement (module docstring; "auto": AUTO_NODES_PER_ROW nodes per row, at most AUTO_MAX_BUDGET). At most
    `max_rows` requests run at once, one cache row each (default: the model's rows); the other prompts wait and take
    the rows that finished requests free, in order. `graphs`: each step one CUDA graph (`GraphedBatchStep`); default:
    the engine's own choice (`Engine.graphs`: on a GPU unless a layer kind runs a reference path), or eager steps
    where `GRAPHS_BY_DEFAULT` is set False.
    `log_allocations`, when a list, receives each step's node counts (one per running request); `log_budgets`, when
    a dict, receives the candidates' measured step seconds (key "costs") and each step's budget (key "steps")."""
    fn = "specpilot.engine.Engine.generate_batch"
    m = engine.model
    if isinstance(prompts, (str, bytes, bytearray)) or (isinstance(prompts, torch.Tensor) and prompts.dim() != 2):
        raise TypeError(f"{fn}: prompts is one {type(prompts).__name__}; pass a list of prompts (each a list of token "
                        "ids, or a str for a model with a text codec), e.g. [prompt] for one")
    try:
        prompts = list(prompts)
    except TypeError:
        raise TypeError(f"{fn}: prompts is a {type(prompts).__name__}; pass a list of prompts (each a list of token "
                        "ids)") from None
    if prompts and all(isinstance(p, int) for p in prompts):
        raise TypeError(f"{fn}: prompts is one list of ints; pass a list of prompts, e.g. [prompt] for one")
    prompts = [engine._prompt(fn, p, what=f"prompt {r}") for r, p in enumerate(prompts)]
    max_new_tokens = inputs.count(fn, "max_new_tokens", max_new_tokens, 0)
    budget = _check_budget(fn, budget)
    if topk is not None:
        topk = inputs.count(fn, "topk", topk)
    graphs = inputs.flag(fn, "graphs", graphs, none_ok=True)
    if graphs is None:
        graphs = GRAPHS_BY_DEFAULT and bool(engine.graphs)
    elif graphs:
        if m.device.type != "cuda":
            raise ValueError(f"{fn}: graphs=True needs a CUDA device; pass graphs=None or False on the CPU")
        if m.paths.host_syncs is not None:
            raise ValueError(f"{fn}: graphs=True cannot capture this model's steps: {m.paths.host_syncs}; pass "
                             "graphs=None or False (eager steps)")
    if max_rows is not None:
        max_rows = inputs.count(fn, "max_rows", max_rows)
        if max_rows > m.rows:
            raise ValueError(f"{fn}: max_rows={max_rows} but the model has {m.rows} cache rows; pass max_rows <= "
                             f"{m.rows}, or load it with Engine.from_pretrained(..., rows={max_rows})")
    R = min(len(prompts), m.rows if max_rows is None else max_rows)  # requests running at once
    if R == 0 or max_new_tokens == 0:
        return [[] for _ in prompts]
    if getattr(engine.drafter, "needs_hidden", False):
        raise ValueError(f"{fn}: batched decoding does not hand a drafter the target's hidden states; the "
                         f"{type(engine.drafter).__name__} reads them: use Engine.generate per request, or "
                         "drafter='ngram'")
    if engine.drafter is None or engine.two_level or getattr(engine.drafter, "model", None) is m:
        raise ValueError(f"{fn}: batched decoding takes a stateless drafter (e.g. drafter='ngram'); the self-drafter "
                         "keeps cache rows of its own and two-level verification is per request")
    budgets = _budgets(budget, R)
    topk = engine.topk if topk is None else topk
    for r, p in enumerate(prompts):
        # a request's pass holds its pending token and up to MAX_STEP_NODES - 1 draft nodes
        need = len(p) + max_new_tokens - 1 + min(max(budgets), MAX_STEP_NODES - 1)
        if need > m.max_len:
            raise ValueError(f"{fn}: prompt {r} ({len(p)} tokens) plus {max_new_tokens} new tokens and its draft "
                             f"nodes needs {need} cache slots but max_len={m.max_len}; pass fewer tokens, or load "
                             f"with Engine.from_pretrained(..., max_len={need})")
    B = len(prompts)
    ctxs: list[list[int] | None] = [None] * B
    hist = [AcceptanceHistory() for _ in range(B)]
    outs: list[list[int]] = [[] for _ in range(B)]
    eos = m.cfg.eos_token_id
    row_of: dict[int, int] = {}  # running request -> its cache row
    waiting = list(range(B))
    free = list(range(R))
    live: list[int] = []

    def admit() -> None:
        while free and waiting:
            r, row = waiting.pop(0), free.pop(0)
            ctxs[r] = engine._prefill_row(row, prompts[r])
            row_of[r] = row
            live.append(r)

    # captured (and with several candidates, timed) before the first prefill: these steps write every row of the graph
    costs = measure_budgets(engine, R, budgets, graphs) if len(budgets) > 1 else None
    if log_budgets is not None:
        log_budgets.update(costs=dict(costs or {}), steps=[])
    step_graphs = {b: _batch_graph(engine, R, b) for b in budgets} if graphs else None
    graph_caps = {b: step_graphs[b].max_nodes - 1 for b in budgets} if graphs else None
    overhead = [0.0, 0]  # seconds a step takes beyond its candidate's measured cost: sum, steps
    admit()
    while live:
        t0 = time.perf_counter()
        cands, gains, depth = [], [], []
        for r in live:
            P = hist[r].positions()
            tokens, scores = engine.drafter.propose(ctxs[r], P, topk)
            tree = build_tree(tokens.cpu(), scores.cpu(), budget=MAX_STEP_NODES - 1)
            cands.append(tree)
            gains.append(hist[r].gains(tree.scores) if tree.n else [])
            depth.append(P)
        # the pass's per-request bound (graphs.batch_max_nodes: 32 nodes where the budget allows, so that the GDN
        # layers run their CUDA tree kernel): a graph's, fixed at its capture for all R rows; an eager pass's, for
        # the requests it runs
        caps = graph_caps or {b: batch_max_nodes(len(live), b) - 1 for b in budgets}
        if costs is None:
            budget = budgets[0]
            alloc = allocate(gains, budget, min_nodes=0, max_nodes=caps[budget])
        else:
            # the measured candidates time the pass; a step also drafts, builds trees and reads back its results,
            # whatever its budget: that share, measured on the steps so far, is added to every candidate
            extra = overhead[0] / overhead[1] if overhead[1] else 0.0
            budget, alloc = best_budget(gains, {b: c + extra for b, c in costs.items()}, caps)
        step_graph = step_graphs[budget] if graphs else None
        if log_budgets is not None:
            log_budgets["steps"].append(budget)
        if log_allocations is not None:
            log_allocations.append(list(alloc))
        trees = [_prefix(tree, n) for tree, n in zip(cands, alloc)]
        if step_graph is None:
            step, target, acc = eager_step(m, [row_of[r] for r in live], [len(ctxs[r]) - 1 for r in live],
                                           [ctxs[r][-1] for r in live], trees, max(depth))
            rows_run, order = step.total, list(range(len(live)))
        else:  # request b of the graph's pass is cache row b; rows without a running request run their root alone
            slot = {row_of[r]: b for b, r in enumerate(live)}
            at = [slot.get(row) for row in range(R)]
            step_graph.load([len(ctxs[live[b]]) - 1 if b is not None else 0 for b in at],
                            [ctxs[live[b]][-1] if b is not None else 0 for b in at],
                            [trees[b] if b is not None else None for b in at])
            target, accepted, accepted_len, bonus = step_graph.replay()
            acc = Acceptance(accepted, accepted_len, bonus)
            rows_run, order = step_graph.total, [row_of[r] for r in live]
        got_len, got_path, got_bonus = (acc.accepted_len.tolist(), acc.accepted.tolist(), acc.bonus.tolist())
        got_len, got_path, got_bonus = ([x[i] for i in order] for x in (got_len, got_path, got_bonus))
        nan_rows = [r for r, bonus in zip(live, got_bonus) if bonus < 0]
        if nan_rows:  # lmhead.NAN_ID: the head saw a NaN logit; it is not a token to emit or feed back
            r = nan_rows[0]
            raise nan_logits_error(fn, f"for prompt {r} at new token {len(outs[r]) + got_len[live.index(r)]}")
        done, emitted = [], 0
        for b, r in enumerate(live):
            t = trees[b].tokens.tolist()
            new = [t[i] for i in got_path[b][:got_len[b]]] + [int(got_bonus[b])]
            s = trees[b].scores
            hist[r].record(got_len[b], drafted=depth[b],
                           predicted=float(sum(math.exp(x) for x in s.tolist())) if len(s) else None)
            for tkn in new:
                outs[r].append(tkn)
                emitted += 1
                if tkn == eos or len(outs[r]) == max_new_tokens:
                    done.append(r)
                    break
            ctxs[r].extend(new)
        took = time.perf_counter() - t0
        engine._stats.steps.append(StepRecord("batch", rows_run, emitted, took))
        if costs is not None:
            overhead[0] += max(took - costs[budget], 0.0)
            overhead[1] += 1
        for r in done:  # its row goes to the next waiting prompt
            live.remove(r)
            free.append(row_of.pop(r))
        admit()
    return outs
