"""Batch verify steps as CUDA graphs (specpilot.engine.graphs.GraphedBatchStep) in generate_batch.

On the CPU the graph's body runs without a graph ("replayed": capture is a no-op and a replay calls the body), so every
buffer the graph would read is the one `load` wrote. Each replayed step is checked against the eager batch step of the
same pass (`batch.eager_step` with the graph's padding) on the same caches: the argmax of every row, the accepted
paths, the bonus tokens and every cache after the commit, bit for bit. Every request's output is its own
autoregressive output and the eager generation's. (The eager generation's own passes hold only the live rows: the
fp32 decay g of the torch glue rounds in the last bit differently in torch's vectorised body and its scalar tail, so
its GDN states match the padded pass's to rounding, not bit for bit.) On the GPU the captured graphs run the shipped
tiny model."""

import pytest
import torch

import specpilot.engine.batch as batch_mod
from specpilot.engine import Engine
from specpilot.engine.batch import eager_step, generate_batch
from specpilot.engine.graphs import GraphedBatchStep, batch_max_nodes
from specpilot.models import HELDOUT_FILE, tiny_stdlib_path
from specpilot.testing import raises_helpful

TINY = tiny_stdlib_path()


def _prompts(vocab: int, lens, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lens:
        motif = torch.randint(0, vocab, (4,), generator=g).tolist()
        out.append(torch.randint(0, vocab, (n,), generator=g).tolist() + motif * 3)
    return out


def _caches(model):
    return [t.clone() for t in (model.state, model.conv_state, model.k_cache, model.v_cache)]


def _restore(model, caches):
    for t, c in zip((model.state, model.conv_state, model.k_cache, model.v_cache), caches):
        t.copy_(c)


class ReplayedBatchStep(GraphedBatchStep):
    """The body run in place of a replay, after the eager step of the same pass has run on the same caches (which
    are then put back): its outputs and caches are kept in `checked` for the comparison."""

    checked: list = []

    def capture(self):
        pass

    def load(self, ctx_lens, roots, trees):
        super().load(ctx_lens, roots, trees)
        self._loaded = (list(ctx_lens), list(roots), list(trees))

    def replay(self):
        ctx_lens, roots, trees = self._loaded
        m = self.model
        before = _caches(m)
        _, target, acc = eager_step(m, self.rows, ctx_lens, roots, trees, self.max_depth,
                                    pads=self.pads([t.n if t is not None else 0 for t in trees]))
        want = (target.clone(), acc.accepted.clone(), acc.accepted_len.clone(), acc.bonus.clone(), _caches(m))
        _restore(m, before)
        out = self._body()
        self.checked.append((want, tuple(x.clone() for x in out) + (_caches(m),), [t is not None for t in trees]))
        return out


@pytest.mark.parametrize("shape,weights,rows,budget,N", [("gdn3-attn1-v97", "bf16", 2, 12, 24),
                                                         ("attn-first-kv1-v131", "w12", 3, 70, 16)],
                         ids=["gdn3-attn1-bf16-rows2-budget12", "attn-first-w12-rows3-budget70"])
def test_graphed_batch_steps_replay_the_eager_steps_cpu(checkpoints, monkeypatch, shape, weights, rows, budget, N):
    # five prompts through fewer rows: requests join as rows free up, and the last ones run beside free rows
    path, model = checkpoints[shape]
    prompts = _prompts(model.config.vocab_size, (5, 21, 9, 30, 12), seed=5)
    kw = dict(device="cpu", weights=weights, drafter="ngram", rows=rows)
    eager = Engine.from_pretrained(path, **kw)
    want = generate_batch(eager, prompts, N, budget=budget)
    assert not getattr(eager, "_batch_graphs", None)  # the CPU: eager steps

    monkeypatch.setattr(batch_mod, "GraphedBatchStep", ReplayedBatchStep)
    monkeypatch.setattr(ReplayedBatchStep, "checked", [])
    eng = Engine.from_pretrained(path, **kw)
    eng.graphs = True  # as on a GPU: the graph's path, its body replayed
    monkeypatch.setattr(batch_mod, "GRAPHS_BY_DEFAULT", True)
    allocs = []
    got = generate_batch(eng, prompts, N, budget=budget, log_allocations=allocs)
    g = eng._batch_graphs[(rows, min(budget, 63 * rows))]
    assert g.max_nodes == batch_max_nodes(rows, min(budget, 63 * rows)) == min(32, budget + 1)
    assert max(n for a in allocs for n in a) <= g.max_nodes - 1  # the allocation keeps within the pass's bound
    assert isinstance(g, ReplayedBatchStep) and g.rows == list(range(rows))
    ar = Engine.from_pretrained(path, device="cpu", weights=weights, drafter=None)
    for r, (p, o) in enumerate(zip(prompts, got)):
        assert o == want[r] == ar.generate(p, N, speculative=False), f"prompt {r}"

    steps = ReplayedBatchStep.checked
    assert len(steps) > 3 and any(not all(live) for _, _, live in steps)  # steps ran beside a free row
    names = ("argmax", "accepted paths", "accepted lengths", "bonus tokens")
    for i, (w, o, live) in enumerate(steps):
        for name, a, b in zip(names, w[:4], o[:4]):
            assert torch.equal(a, b), f"step {i}: the {name} differ"
        for name, a, b in zip(("GDN states", "conv states", "keys", "values"), w[4], o[4]):
            assert torch.equal(a, b), f"step {i}: the {name} differ"
    assert sum(int(o[2].sum()) for _, o, _ in steps) > 0  # draft nodes were accepted
    assert eng.stats()["batch"]["mean_nodes"] == g.total == rows + min(budget, 63 * rows)  # every pass padded


def test_graphed_batch_step_layout_and_errors(checkpoints):
    path, _ = checkpoints["gdn3-attn1-v97"]
    eng = Engine.from_pretrained(path, device="cpu", drafter="ngram", rows=3)
    m = eng.model
    g = GraphedBatchStep(m, [0, 1, 2], 10, max_depth=16)
    assert (g.total, g.max_nodes, g.width) == (13, 11, 10)
    assert g.step.total == 13 and g.step.tree.max_nodes == 11  # planned with the first request full
    assert g.pads([3, 0, 2]) == [5, 0, 0] and g.pads([10, 0, 0]) == [0, 0, 0] and g.pads([0, 0, 0]) == [10, 0, 0]
    wide = GraphedBatchStep(m, [2, 0], 100, max_depth=16)
    assert wide.max_nodes == 64 and wide.pads([0, 0]) == [63, 37] and wide.pads([40, 10]) == [23, 27]
    # 32 nodes per request where the budget fits (the GDN layers' CUDA tree kernel), else 64
    assert GraphedBatchStep(m, [0, 1, 2], 70, max_depth=16).max_nodes == 32
    assert [batch_max_nodes(8, b) for b in (0, 20, 64, 248, 249, 256, 600)] == [1, 21, 32, 32, 64, 64, 64]
    ar = GraphedBatchStep(m, [0, 1], 0, max_depth=16)
    assert (ar.total, ar.max_nodes, ar.width) == (2, 1, 1) and ar.pads([0, 0]) == [0, 0]
    with raises_helpful("specpilot.engine", "GraphedBatchStep", "budget"):
        GraphedBatchStep(m, [0, 1], 127, max_depth=16)
    with raises_helpful("specpilot.engine", "GraphedBatchStep", "rows"):
        GraphedBatchStep(m, [0, 0], 4, max_depth=16)
    with raises_helpful("specpilot.engine", "GraphedBatchStep", "rows"):
        GraphedBatchStep(m, [0, 3], 4, max_depth=16)
    with raises_helpful("specpilot.engine", "GraphedBatchStep", "do not fit"):
        g.pads([6, 5, 0])
    with raises_helpful("specpilot.engine", "GraphedBatchStep", "do not fit"):
        g.pads([11, 0, 0])
    with raises_helpful("specpilot.engine", "GraphedBatchStep", "one of each"):
        g.load([0, 0], [1, 2], [None, None])
    with raises_helpful("specpilot.engine", "GraphedBatchStep", "max_len"):
        g.load([m.max_len, 0, 0], [1, 2, 3], [None, None, None])
    with raises_helpful("specpilot.engine", "graphs=True", "CUDA"):
        generate_batch(eng, [[1, 2]], 4, graphs=True)
    with raises_helpful("specpilot.engine", "graphs"):
        generate_batch(eng, [[1, 2]], 4, graphs="yes")


# ---- on the GPU: the captured graphs -------------------------------------------------------------


@pytest.mark.gpu
def test_graphed_batch_equals_autoregressive_gpu():
    # the shipped tiny model: five held-out prompts through two rows, every step one CUDA graph; each output is the
    # prompt's own autoregressive output
    text = (TINY / HELDOUT_FILE).read_bytes()
    prompts = [list(text[a:a + n]) for a, n in ((1000, 120), (3000, 40), (5000, 200), (7000, 80), (9000, 150))]
    eng = Engine.from_pretrained(TINY, device="cuda", weights="w12", drafter="ngram", rows=2)
    assert eng.graphs
    outs = eng.generate_batch(prompts, 96, budget=24, graphs=True)
    assert isinstance(eng._batch_graphs[(2, 24)], GraphedBatchStep)
    assert eng.stats()["batch"]["mean_nodes"] == 26
    ar = Engine.from_pretrained(TINY, device="cuda", weights="w12", drafter=None)
    for r, (p, o) in enumerate(zip(prompts, outs)):
        assert o == ar.generate(p, 96, speculative=False), f"prompt {r}"
    eager = Engine.from_pretrained(TINY, device="cuda", weights="w12", drafter="ngram", rows=2)
    assert generate_batch(eager, prompts, 96, budget=24, graphs=False) == outs
    dflt = Engine.from_pretrained(TINY, device="cuda", weights="w12", drafter="ngram", rows=2)
    assert dflt.generate_batch(prompts, 96, budget=24) == outs  # the default on a GPU: graphed steps
    assert isinstance(dflt._batch_graphs[(2, 24)], GraphedBatchStep)


@pytest.mark.gpu
def test_auto_budget_graphed_equals_autoregressive_gpu():
    # budget="auto" on the shipped tiny model: every candidate budget captured and timed before the first prefill,
    # each step one of those graphs; every output is the prompt's own autoregressive output
    text = (TINY / HELDOUT_FILE).read_bytes()
    prompts = [list(text[a:a + n]) for a, n in ((1000, 120), (3000, 40), (5000, 200), (7000, 80))]
    eng = Engine.from_pretrained(TINY, device="cuda", weights="w12", drafter="ngram", rows=2)
    log = {}
    outs = generate_batch(eng, prompts, 64, budget="auto", log_budgets=log)
    cands = [k * 2 for k in batch_mod.AUTO_NODES_PER_ROW]
    assert sorted(log["costs"]) == cands and all(isinstance(eng._batch_graphs[(2, b)], GraphedBatchStep) for b in cands)
    assert set(log["steps"]) <= set(cands) and any(b > 0 for b in log["steps"])  # drafts land on the trained model
    ar = Engine.from_pretrained(TINY, device="cuda", weights="w12", drafter=None)
    for r, (p, o) in enumerate(zip(prompts, outs)):
        assert o == ar.generate(p, 64, speculative=False), f"prompt {r}"
