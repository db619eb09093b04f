"""The Markov variant of the trained heads (`HeadsDims.markov`: each row also reads the draft token above it) and
the tree builder for candidates that depend on their parent (`tree.build_tree_conditional`)."""

from __future__ import annotations

import json

import pytest
import torch

from specpilot.engine import Engine
from specpilot.engine.spec.heads import HeadsDims, HeadsDrafter, HeadsNet, embed_sha256
from specpilot.engine.spec.tree import build_tree, build_tree_conditional
from specpilot.models import HEADS_FILE, HELDOUT_FILE, TRAIN_FILE, tiny_stdlib_heads_path, tiny_stdlib_path
from specpilot.testing import raises_helpful

CKPT = tiny_stdlib_path()
MARKOV = tiny_stdlib_heads_path(markov=True)
PROMPT = list((CKPT / HELDOUT_FILE).read_bytes()[1000:1300])
MODES = {"chain8": dict(positions=8, topk=1, tree_nodes=9), "tree32": dict(positions=16, topk=4, tree_nodes=32)}


@pytest.mark.parametrize("P,K,budget", [(4, 3, 10), (6, 4, 32), (3, 2, 64), (5, 5, 1)])
def test_conditional_builder_equals_the_marginal_one_on_marginal_rows(P, K, budget):
    # rows that ignore the parent: the same nodes in the same order as build_tree, ties included
    g = torch.Generator().manual_seed(P * K + budget)
    tokens = torch.randint(0, 6, (P, K), generator=g)
    scores = -torch.randint(0, 4, (P, K), generator=g).double() / 2  # many equal scores: the tie rule decides
    scores[0, -1] = float("-inf")
    want = build_tree(tokens, scores, budget)
    got = build_tree_conditional(lambda d, t: (tokens[d].tolist(), scores[d].tolist()), budget, P)
    for f in ("tokens", "parents", "depths", "scores", "anc"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f


def test_conditional_builder_takes_the_best_paths_given_their_parents():
    # parent-dependent log-probabilities, no ties: the tree is the `budget` best paths of the full tree, every
    # node's score its parent's plus its own conditional score, expand called once per node that may have children
    P, K, budget = 4, 3, 20

    def expand(depth, token):
        calls.append((depth, token))
        g = torch.Generator().manual_seed(1000 * depth + token + 7)
        logp = torch.log_softmax(torch.randn(8, generator=g, dtype=torch.float64), 0)
        v, i = torch.topk(logp, K)
        return i.tolist(), v.tolist()

    calls = []
    tree = build_tree_conditional(expand, budget, P)
    assert tree.n == budget and len(calls) <= budget + 1
    full = {}  # every path of the full tree: its score
    frontier = [((), 0.0, -1)]
    for depth in range(P):
        nxt = []
        for path, s, tok in frontier:
            t, v = expand(depth, tok)
            for a, b in zip(t, v):
                full[path + (a,)] = s + b
                nxt.append((path + (a,), s + b, a))
        frontier = nxt
    best = sorted(full, key=lambda p: -full[p])[:budget]
    paths = []
    for i in range(tree.n):
        p, j = [], i
        while j >= 0:
            p.append(int(tree.tokens[j]))
            j = int(tree.parents[j])
        paths.append(tuple(reversed(p)))
        assert abs(float(tree.scores[i]) - full[paths[-1]]) < 1e-12
    assert set(paths) == set(best)
    with raises_helpful("specpilot.engine.spec.tree", "build_tree_conditional", "log-probabilities"):
        build_tree_conditional(lambda d, t: ([1], [float("nan")]), 4, 2)
    with raises_helpful("specpilot.engine.spec.tree", "build_tree_conditional", "budget"):
        build_tree_conditional(expand, 65, 2)


@pytest.mark.parametrize("batch", [2, 5, 64])
def test_batched_expansions_build_the_same_tree(batch):
    # expand_many computes the needed (depth, token) with the best frontier candidates' ones: the same nodes in the
    # same order as node by node, every pair computed at most once, at most `batch` a call, the needed one first
    P, K, budget = 6, 3, 40

    def expand(depth, token):
        g = torch.Generator().manual_seed(1000 * depth + token + 11)
        logp = torch.log_softmax(torch.randint(0, 5, (9,), generator=g).double(), 0)  # ties: the rule decides
        v, i = torch.topk(logp, K)
        return i.tolist(), v.tolist()

    calls = []

    def expand_many(pairs):
        calls.append(list(pairs))
        return [expand(d, t) for d, t in pairs]

    want = build_tree_conditional(expand, budget, P)
    got = build_tree_conditional(lambda d, t: pytest.fail("expand_many covers every call"), budget, P,
                                 expand_many=expand_many, batch=batch)
    for f in ("tokens", "parents", "depths", "scores", "anc"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    flat = [p for c in calls for p in c]
    assert len(flat) == len(set(flat)) and all(1 <= len(c) <= batch for c in calls)
    assert calls[0][0] == (0, -1)
    if batch > 1:
        node_by_node = []
        build_tree_conditional(lambda d, t: node_by_node.append(1) or expand(d, t), budget, P)
        assert len(calls) < len(node_by_node)  # fewer round trips
    with raises_helpful("specpilot.engine.spec.tree", "build_tree_conditional", "batch"):
        build_tree_conditional(expand, 4, 2, expand_many=expand_many, batch=0)


def test_markov_rows_read_the_token_above():
    torch.manual_seed(0)
    net = HeadsNet(HeadsDims(hidden=16, vocab=32, width=24, ffn=48, positions=5, embed=8, markov=True)).eval()
    hidden, pending = torch.randn(3, 16), torch.tensor([1, 2, 3])
    prev = torch.randint(0, 32, (3, 5))
    with torch.no_grad():
        full = net(hidden, pending, prev)
        z = net.start(hidden, pending)
        for b in range(3):
            rows = net.rows(z[b], torch.arange(5), prev[b])
            assert torch.allclose(rows, full[b], atol=1e-6)
        other = prev.clone()
        other[:, 2] = (other[:, 2] + 1) % 32
        moved = net(hidden, pending, other)
    assert torch.equal(moved[:, :2], full[:, :2]) and torch.equal(moved[:, 3:], full[:, 3:])
    assert not torch.allclose(moved[:, 2], full[:, 2])  # row 2 reads its own prev token only
    with pytest.raises(ValueError, match="pass prev"):
        net(hidden, pending)


@pytest.fixture(scope="module")
def markov():
    return HeadsDrafter.load(MARKOV / HEADS_FILE)


def test_shipped_markov_weights(markov):
    f = MARKOV / HEADS_FILE
    assert f.stat().st_size < 2_000_000 and markov.dims.markov and markov.conditional
    rec = json.loads((MARKOV / TRAIN_FILE).read_text())
    assert rec["heads"]["markov"] and rec["weights"]["bytes"] == f.stat().st_size
    assert rec["wall_time_s"]["total"] <= 600  # trained on the CPU in at most 10 minutes
    eng = Engine.from_pretrained(CKPT, device="cpu", weights="w12", drafter="heads-markov")
    assert eng.drafter.conditional and markov.target_embed_sha256 == embed_sha256(eng.model.embed)


def test_markov_tree_scores_are_log_probabilities_given_the_parent(markov):
    hidden = torch.randn(128, generator=torch.Generator().manual_seed(3)).bfloat16()
    tree = markov.propose_tree(PROMPT, 16, 4, 31, hidden=hidden)
    assert tree.n == 31 and int(tree.depths.max()) < 16
    z = markov._start(hidden, PROMPT[-1])
    for i in range(tree.n):
        par = int(tree.parents[i])
        above = PROMPT[-1] if par < 0 else int(tree.tokens[par])
        d = int(tree.depths[i])
        logp = torch.log_softmax(markov.net.rows(z, torch.tensor([d]), torch.tensor([above]))[0].detach(), -1)
        edge = float(tree.scores[i]) - (float(tree.scores[par]) if par >= 0 else 0.0)
        assert abs(edge - float(logp[int(tree.tokens[i])])) < 1e-5
    # no hidden state, or an empty context: an empty tree
    assert markov.propose_tree(PROMPT, 16, 4, 31).n == 0 and markov.propose_tree([], 16, 4, 31, hidden=hidden).n == 0
    # propose: the rows along the top-1 chain, each given the one above
    tokens, scores = markov.propose(PROMPT, 16, 2, hidden=hidden)
    chain = markov.propose_tree(PROMPT, 16, 1, 16, hidden=hidden)
    assert chain.tokens.tolist() == tokens[:, 0].tolist()
    # the chain (k = 1, built on the device and read once) is the tree best-first selection builds node by node
    def expand(depth, token):
        above = PROMPT[-1] if depth == 0 else token
        logp = torch.log_softmax(markov.net.rows(z, torch.tensor([depth]), torch.tensor([above]))[0].detach(), -1)
        v, i = torch.topk(logp, 1)
        return i.tolist(), v.tolist()

    ref = build_tree_conditional(expand, 12, 16)
    got = markov.propose_tree(PROMPT, 16, 1, 12, hidden=hidden)
    assert got.tokens.tolist() == ref.tokens.tolist() and got.parents.tolist() == ref.parents.tolist()
    assert torch.allclose(got.scores, ref.scores, atol=1e-6)


def test_markov_tree_rows_in_batches_give_the_same_tree(markov, monkeypatch):
    # the GPU's path (EXPAND_BATCH rows per host read) on the CPU: the same tree as one row at a time (scores within
    # the rounding of a batched row against a single one)
    from specpilot.engine.spec import heads

    hidden = torch.randn(128, generator=torch.Generator().manual_seed(5)).bfloat16()
    one = markov.propose_tree(PROMPT, 16, 4, 31, hidden=hidden)
    monkeypatch.setattr(heads, "_expand_batch", lambda device: heads.EXPAND_BATCH)
    many = markov.propose_tree(PROMPT, 16, 4, 31, hidden=hidden)
    assert many.tokens.tolist() == one.tokens.tolist() and many.parents.tolist() == one.parents.tolist()
    assert torch.allclose(many.scores, one.scores, atol=1e-5)


@pytest.fixture(scope="module")
def autoregressive():
    eng = Engine.from_pretrained(CKPT, device="cpu", weights="w12", drafter=None)
    return eng.generate(PROMPT, 96, speculative=False)


@pytest.mark.parametrize("mode", list(MODES))
def test_markov_outputs_identical_to_autoregressive(autoregressive, mode):
    eng = Engine.from_pretrained(CKPT, device="cpu", weights="w12", drafter="heads-markov", **MODES[mode])
    assert eng.generate(PROMPT, 96, speculative=True) == autoregressive
    st = eng.stats()["verify"]
    assert st["tau"] > 1.5 and st["mean_nodes"] <= MODES[mode]["tree_nodes"], st


def test_markov_training_script_runs(tmp_path):
    from specpilot.models import train_heads

    rec = train_heads.train(tmp_path, steps=2, prompts=2, eval_prompts=2, seed=1, log=lambda line: None, markov=True)
    d = HeadsDrafter.load(tmp_path / HEADS_FILE)
    assert d.dims == HeadsDims(hidden=128, vocab=256, markov=True) and rec["heads"]["markov"]


@pytest.mark.gpu
def test_markov_outputs_identical_to_autoregressive_gpu():
    # the shipped model on the GPU (kernels, CUDA graphs), the Markov heads' 32-node trees
    ar = Engine.from_pretrained(CKPT, device="cuda", weights="w12", drafter=None).generate(PROMPT, 96,
                                                                                         speculative=False)
    eng = Engine.from_pretrained(CKPT, device="cuda", weights="w12", drafter="heads-markov", **MODES["tree32"])
    assert eng.generate(PROMPT, 96, speculative=True) == ar
    assert eng.stats()["verify"]["tau"] > 1.5
