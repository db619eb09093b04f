"""The self-drafter's passes as CUDA graphs (specpilot.engine.self_draft.GraphedDraft) and the capture helper they
share with the graphed steps (specpilot.engine.graphs.capture_graph).

On the CPU the graphs' bodies run without a graph ("replayed": capture is a no-op and a replay calls the body), so
every buffer a graph would read is the one the host refill wrote: the proposals and the drafter's cache rows must be
the eager drafter's, bit for bit. On the GPU the same comparisons run on the captured graphs."""

import statistics
import time

import pytest
import torch

import specpilot.engine.engine as engine_mod
from specpilot.engine import Engine
from specpilot.engine.graphs import GraphedStep, capture_graph
from specpilot.engine.self_draft import GraphedDraft, SelfDrafter
from specpilot.models import HELDOUT_FILE, tiny_stdlib_path
from specpilot.testing import raises_helpful

TINY = tiny_stdlib_path()
TINY_PROMPT = list((TINY / HELDOUT_FILE).read_bytes()[2000:2200])


class ReplayedStep(GraphedStep):
    def capture(self):
        pass

    def replay(self):
        return self._body()


class ReplayedDraft(GraphedDraft):
    def _capture(self, body):
        return body


def _prompt(vocab, n, seed):
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, vocab, (6,), generator=g).tolist()
    return torch.randint(0, vocab, (n,), generator=g).tolist() + motif * 4


def _rows(model, base: int, positions: int):
    """What the drafter leaves in the model: rows 1 and 2's GDN and conv states, and row 1's KV slots up to the last
    drafted position."""
    lo, hi = model.max_len, model.max_len + min(base + positions, model.max_len)
    return (model.state[:, 1:3].clone(), model.conv_state[:, 1:3].clone(), model.k_cache[:, lo:hi].clone(),
            model.v_cache[:, lo:hi].clone())


def _trace(eng):
    """Record (context, tokens, scores, drafter rows) of every draft the engine makes."""
    rec = []
    drafter = eng._draft_graph if eng._draft_graph is not None else eng.drafter
    propose = drafter.propose

    def spy(ctx, *args):
        tokens, scores = propose(ctx, *args)
        rec.append((list(ctx), tokens, scores, _rows(eng.model, len(ctx) - 1, eng.positions)))
        return tokens, scores

    drafter.propose = spy
    return rec


def _assert_same_drafts(want, got):
    assert len(want) == len(got) > 2
    for i, (w, g) in enumerate(zip(want, got)):
        assert w[0] == g[0], f"draft {i}: the contexts differ"
        assert torch.equal(w[1], g[1]), f"draft {i}: tokens {w[1].tolist()} != {g[1].tolist()}"
        assert torch.equal(w[2], g[2]), f"draft {i}: scores differ"
        for name, a, b in zip(("GDN states", "conv states", "keys", "values"), w[3], g[3]):
            assert torch.equal(a, b), f"draft {i}: the drafter's {name} differ"


# ---- capture_graph ------------------------------------------------------------------------------


def test_capture_graph_warms_up_on_a_side_stream_then_captures_one_call(monkeypatch):
    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait", self.name, other.name))

    side, main = Stream("side"), Stream("main")
    state = {"stream": main, "capturing": None}

    class StreamCtx:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            self.prev, state["stream"] = state["stream"], self.s

        def __exit__(self, *exc):
            state["stream"] = self.prev

    class Graph:
        def replay(self):
            log.append(("replay",))

    class GraphCtx:
        def __init__(self, g):
            self.g = g

        def __enter__(self):
            state["capturing"] = self.g

        def __exit__(self, *exc):
            state["capturing"] = None

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", StreamCtx)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(("sync", str(device))))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", GraphCtx)

    calls = []

    def fn():
        calls.append((state["stream"].name, state["capturing"]))
        log.append(("call",))
        return len(calls)

    graph, out = capture_graph(fn, "cuda:0", warmup=3)
    assert isinstance(graph, Graph)
    assert out == 4  # what the captured call returned, not a warm-up's
    assert calls[:3] == [("side", None)] * 3  # warm-ups on the side stream, outside the capture
    assert calls[3] == ("main", graph)  # then one call, captured
    assert log == [("wait", "side", "main")] + [("call",)] * 3 + [("wait", "main", "side"), ("sync", "cuda:0"),
                                                                  ("call",)]
    graph.replay()
    assert len(calls) == 4  # a replay does not call fn


def test_capture_graph_argument_errors():
    with raises_helpful("specpilot.engine", "device", "CUDA"):
        capture_graph(lambda: None, "cpu")
    with raises_helpful("specpilot.engine", "device"):
        capture_graph(lambda: None, 0)
    with raises_helpful("specpilot.engine", "warmup"):
        capture_graph(lambda: None, "cuda", warmup=0)
    with raises_helpful("specpilot.engine", "warmup"):
        capture_graph(lambda: None, "cuda", warmup=True)
    with raises_helpful("specpilot.engine", "callable"):
        capture_graph(None, "cuda")


# ---- GraphedDraft on the CPU (bodies replayed without a graph) -----------------------------------


def test_engine_drafts_through_the_graphs_only_with_graphs_and_the_self_drafter(checkpoints, monkeypatch):
    path, _ = checkpoints["gdn3-attn1-v97"]
    prompt = _prompt(97, 20, 0)
    eager = Engine.from_pretrained(path, device="cpu", drafter="self", positions=4, tree_nodes=8)
    assert not eager.graphs
    eager.generate(prompt, 8)
    assert eager._draft_graph is None  # the CPU: the eager drafter

    monkeypatch.setattr(engine_mod, "GraphedStep", ReplayedStep)
    monkeypatch.setattr(engine_mod, "GraphedDraft", ReplayedDraft)
    ngram = Engine.from_pretrained(path, device="cpu", drafter="ngram")
    ngram.graphs = True
    ngram.capture()
    assert ngram._draft_graph is None  # graphed steps, but no self-drafter to graph
    selfish = Engine.from_pretrained(path, device="cpu", drafter="self", positions=4, tree_nodes=8)
    selfish.graphs = True
    selfish.capture()
    g = selfish._draft_graph
    assert isinstance(g, GraphedDraft) and g.drafter is selfish.drafter
    assert (g.positions, g.topk, g.catch_up) == (4, 4, 5)  # a verify step adds at most 4 accepted + the bonus
    two = Engine.from_pretrained(path, device="cpu", drafter="self", positions=4, tree_nodes=8, two_level=True)
    two.graphs = True
    two.capture()
    assert two._draft_graph.catch_up == 8  # the Q path and the second tree: up to tree_nodes - 1 deep


@pytest.mark.parametrize("shape,weights", [("gdn3-attn1-v97", "w12"), ("attn-first-kv1-v131", "bf16")])
def test_graphed_draft_buffers_replay_the_eager_drafter_cpu(checkpoints, monkeypatch, shape, weights):
    # a real generation: every draft's proposals and the drafter's cache rows equal the eager drafter's, bit for bit,
    # and the output is the autoregressive one
    path, model = checkpoints[shape]
    prompt = _prompt(model.config.vocab_size, 30, 1)
    kw = dict(device="cpu", weights=weights, drafter="self", positions=6, tree_nodes=12)
    eager = Engine.from_pretrained(path, **kw)
    want_trace = _trace(eager)
    want = eager.generate(prompt, 60)

    monkeypatch.setattr(engine_mod, "GraphedStep", ReplayedStep)
    monkeypatch.setattr(engine_mod, "GraphedDraft", ReplayedDraft)
    eng = Engine.from_pretrained(path, **kw)
    eng.graphs = True
    eng.capture()
    chains = []
    consume = eng._draft_graph._consume
    eng._draft_graph._consume = lambda done, toks: (chains.append(len(toks)), consume(done, toks))
    got_trace = _trace(eng)
    got = eng.generate(prompt, 60)
    assert got == want == eager.generate(prompt, 60, speculative=False)
    _assert_same_drafts(want_trace, got_trace)
    assert chains[0] == len(prompt) - 1  # the first catch-up: the prompt, eager (longer than catch_up)
    assert len(chains) > 2 and all(1 <= n <= eng._draft_graph.catch_up for n in chains[1:])  # then chain graphs


def test_graphed_draft_edge_contexts_cpu(checkpoints):
    # an empty context, a catch-up longer than the graphs, a context that does not extend the last one, topk above
    # the vocabulary, and drafts that would pass max_len (the eager drafter runs them): proposals and rows as eager
    path, _ = checkpoints["gdn-k1v4-d128-v64"]
    kw = dict(device="cpu", drafter="self", max_len=48)
    ref = Engine.from_pretrained(path, **kw).drafter
    drafter = Engine.from_pretrained(path, **kw).drafter
    g = ReplayedDraft(drafter, 5, 70, catch_up=4)
    g.capture()
    base = _prompt(64, 20, 2)  # 44 tokens
    contexts = [[], base[:9], base[:12], base[:14], base[:30], base[:5] + [3, 4], base[:4], base[:43], base[:44],
                base + [1]]  # the last two: 43 + 5 positions reach max_len exactly, 44 + 5 would pass it
    for ctx in contexts:
        want = ref.propose(ctx, 5, 70)
        rows_want = _rows(ref.model, len(ctx) - 1, 5)
        got = g.propose(ctx)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), f"context of {len(ctx)}"
        assert want[0].shape == (5, 70) and torch.isinf(want[1][:, 64:]).all()
        for a, b in zip(rows_want, _rows(drafter.model, len(ctx) - 1, 5)):
            assert torch.equal(a, b), f"context of {len(ctx)}"
        assert drafter.seen == ref.seen


def test_graphed_draft_argument_errors(checkpoints):
    path, _ = checkpoints["gdn3-attn1-v97"]
    eng = Engine.from_pretrained(path, device="cpu", drafter="self")
    with raises_helpful("specpilot.engine", "GraphedDraft", "SelfDrafter"):
        GraphedDraft(object(), 4, 4)
    with raises_helpful("specpilot.engine", "positions"):
        GraphedDraft(eng.drafter, 0, 4)
    with raises_helpful("specpilot.engine", "topk"):
        GraphedDraft(eng.drafter, 4, True)
    with raises_helpful("specpilot.engine", "catch_up"):
        GraphedDraft(eng.drafter, 4, 4, catch_up=65)
    g = GraphedDraft(eng.drafter, 4, 4)
    with raises_helpful("specpilot.engine", "capture", exc=RuntimeError):
        g.propose([1, 2, 3])
    with raises_helpful("specpilot.engine", "CUDA"):
        g.capture()  # a CPU model
    assert isinstance(eng.drafter, SelfDrafter)


# ---- on the GPU: the captured graphs -------------------------------------------------------------


@pytest.mark.gpu
def test_graphed_draft_proposes_the_eager_drafts_gpu():
    # the shipped tiny model: the graphed drafter's proposals equal the eager drafter's token for token (and its
    # scores and cache rows bit for bit) over every draft of a generation
    runs = []
    for graphs in (False, True):
        eng = Engine.from_pretrained(TINY, device="cuda", weights="w12", drafter="self", graphs=graphs)
        if graphs:
            eng.capture()
            assert isinstance(eng._draft_graph, GraphedDraft)
        trace = _trace(eng)
        runs.append((eng.generate(TINY_PROMPT, 96), trace))
    assert runs[0][0] == runs[1][0]
    _assert_same_drafts(runs[0][1], runs[1][1])


@pytest.mark.gpu
def test_graphed_draft_engine_equals_autoregressive_gpu():
    eng = Engine.from_pretrained(TINY, device="cuda", weights="w12", drafter="self")
    assert eng.graphs
    want = eng.generate(TINY_PROMPT, 256, speculative=False)
    ar_ms = eng.stats()["ar"]["median_step_ms"]
    assert isinstance(eng._draft_graph, GraphedDraft)
    draft_ms = []
    propose = eng._draft_graph.propose

    def timed(ctx):
        t0 = time.perf_counter()
        out = propose(ctx)  # returns CPU tensors: the draft has finished on the device
        draft_ms.append(1e3 * (time.perf_counter() - t0))
        return out

    eng._draft_graph.propose = timed
    eng.reset_stats()
    assert eng.generate(TINY_PROMPT, 256, speculative=True) == want
    assert eng.stats()["verify"]["tau"] > 4
    print(f"self-drafter step (16 positions, top-4, catch-up included): median {statistics.median(draft_ms):.2f} ms; "
          f"autoregressive step (graphed): median {ar_ms:.2f} ms; ratio "
          f"{statistics.median(draft_ms) / ar_ms:.2f} (goal <= 1.5)")
