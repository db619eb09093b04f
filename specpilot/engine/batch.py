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

The pass has `rows + budget` rows at most. The steps run eagerly: the CUDA graph of a fixed row count (pad every
step to `rows + budget` rows) is not built here.
"""

from __future__ import annotations

import math
import time

import torch

from . import inputs
from .model import MAX_STEP_NODES
from .records import StepRecord, nan_logits_error
from .spec.accept import greedy_accept
from .spec.budget import AcceptanceHistory, allocate
from .spec.tree import build_tree

__all__ = ["generate_batch"]


def _prefix(tree, n: int):
    """The first n nodes of a best-first tree (a parent-closed subtree)."""
    return tree.tokens[:n], tree.parents[:n], tree.depths[:n], tree.scores[:n]


def generate_batch(engine, prompts, max_new_tokens: int, *, budget: int | None = None, topk: int | None = None,
                   max_rows: int | None = None, log_allocations: list | None = None) -> list[list[int]]:
    """Greedy continuations of every prompt, verified together under `budget` tree nodes per step (default 8 per
    running request). At most `max_rows` requests run at once, one cache row each (default: the model's rows); the
    other prompts wait and take the rows that finished requests free, in order. `log_allocations`, when a list,
    receives each step's node counts (one per running request)."""
    fn = "specpilot.engine.Engine.generate_batch"
    m, dev = engine.model, engine.model.device
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
    if budget is not None:
        budget = inputs.count(fn, "budget", budget, 0)
    if topk is not None:
        topk = inputs.count(fn, "topk", topk)
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
    budget = 8 * R if budget is None else budget
    topk = engine.topk if topk is None else topk
    for r, p in enumerate(prompts):
        # a request's pass holds its pending token and up to MAX_STEP_NODES - 1 draft nodes
        need = len(p) + max_new_tokens - 1 + min(budget, MAX_STEP_NODES - 1)
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
        alloc = allocate(gains, budget, min_nodes=0, max_nodes=MAX_STEP_NODES - 1)
        if log_allocations is not None:
            log_allocations.append(list(alloc))
        toks, pars, trees = [], [], []
        for r, tree, n in zip(live, cands, alloc):
            t, p, d, s = _prefix(tree, n)
            trees.append((t, p, d, s))
            toks.append([ctxs[r][-1]] + t.tolist())
            pars.append([-1] + [x + 1 for x in p.tolist()])
        step = m.plan([row_of[r] for r in live], [len(ctxs[r]) - 1 for r in live], toks, pars)
        target = m.argmax(m.forward(step))
        nb, N = len(live), max(max(alloc, default=0), 1)
        tok_b = torch.zeros(nb, N, dtype=torch.int64)
        par_b = torch.full((nb, N), -1, dtype=torch.int32)
        dep_b = torch.zeros(nb, N, dtype=torch.int32)
        for b, (t, p, d, _) in enumerate(trees):
            tok_b[b, :len(t)], par_b[b, :len(t)], dep_b[b, :len(t)] = t, p, d
        cu = step.tree.cu_seqlens.long()
        col = torch.arange(N + 1, device=dev)
        idx = (cu[:-1, None] + col[None, :]).clamp(max=step.total - 1)
        target_next = torch.where(col[None, :] < (cu[1:] - cu[:-1])[:, None], target[idx], torch.zeros_like(idx))
        acc = greedy_accept(tok_b.to(dev), par_b.to(dev), dep_b.to(dev),
                            torch.tensor(list(alloc), dtype=torch.int32, device=dev), target_next,
                            max_depth=max(depth))
        got_len, got_path, got_bonus = acc.accepted_len.tolist(), acc.accepted.tolist(), acc.bonus.tolist()
        nan_rows = [r for r, bonus in zip(live, got_bonus) if bonus < 0]
        if nan_rows:  # lmhead.NAN_ID: the head saw a NaN logit; it is not a token to emit or feed back
            r = nan_rows[0]
            raise nan_logits_error(fn, f"for prompt {r} at new token {len(outs[r]) + got_len[live.index(r)]}")
        m.commit_accepted(step, acc.accepted, acc.accepted_len)
        done, emitted = [], 0
        for b, r in enumerate(live):
            t = trees[b][0].tolist()
            new = [t[i] for i in got_path[b][:got_len[b]]] + [int(got_bonus[b])]
            s = trees[b][3]
            hist[r].record(got_len[b], drafted=depth[b],
                           predicted=float(sum(math.exp(x) for x in s.tolist())) if len(s) else None)
            for tkn in new:
                outs[r].append(tkn)
                emitted += 1
                if tkn == eos or len(outs[r]) == max_new_tokens:
                    done.append(r)
                    break
            ctxs[r].extend(new)
        engine._stats.steps.append(StepRecord("batch", step.total, emitted, time.perf_counter() - t0))
        for r in done:  # its row goes to the next waiting prompt
            live.remove(r)
            free.append(row_of.pop(r))
        admit()
    return outs
