"""Draft-tree builder (specpilot/tree.py): structure, optimality, the tie rule, and host == batched."""

import itertools
import math
import re

import pytest
import torch

from specpilot.engine.spec.tree import MAX_NODES, build_tree, build_trees, build_trees_batched

NEG = float("-inf")


def _random_case(g: torch.Generator, B: int, P: int, K: int, *, vocab: int, levels: int, p_inf: float):
    """Scores quantised to a few values (ties), small vocab (duplicates), some -inf entries."""
    tokens = torch.randint(0, vocab, (B, P, K), generator=g)
    q = torch.randint(0, levels, (B, P, K), generator=g).to(torch.float32)
    scores = -0.25 * q  # multiples of 1/4: sums are exact, so ties stay ties
    mask = torch.rand(B, P, K, generator=g) < p_inf
    return tokens, scores.masked_fill(mask, NEG)


def _assert_same(a, b):
    for k in ("tokens", "parents", "depths", "scores", "anc", "n_nodes"):
        x, y = getattr(a, k), getattr(b, k)
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x, y), (k, x, y)


def _check_structure(tree, tokens, scores):
    """Parents precede children, anc/depth follow the parents, scores sum along the path, tokens
    come from the node's row, siblings hold distinct tokens and no -inf node is chosen."""
    par, dep, anc = tree.parents.tolist(), tree.depths.tolist(), tree.anc.tolist()
    sc, tok = tree.scores.tolist(), tree.tokens.tolist()
    seen = set()
    for i in range(tree.n):
        p = par[i]
        assert -1 <= p < i
        mask = (1 << i) | (anc[p] & ((1 << 64) - 1) if p >= 0 else 0)
        assert anc[i] & ((1 << 64) - 1) == mask
        assert dep[i] == (dep[p] + 1 if p >= 0 else 0)
        d = dep[i]
        cols = [j for j in range(tokens.shape[1]) if int(tokens[d, j]) == tok[i]]
        assert cols, "token not proposed at its depth"
        raw = max(float(scores[d, j]) for j in cols)  # dedup keeps the best duplicate
        assert sc[i] == (sc[p] if p >= 0 else 0.0) + raw
        assert sc[i] > NEG
        assert (p, tok[i]) not in seen, "duplicate sibling token"
        seen.add((p, tok[i]))


def _all_nodes(tokens, scores):
    """Every node of the full tree (after dedup, without -inf): list of path scores."""
    P, K = tokens.shape
    rows = []
    for d in range(P):
        best = {}
        for j in range(K):
            t, v = int(tokens[d, j]), float(scores[d, j])
            if t not in best or v > best[t]:
                best[t] = v
        rows.append([v for v in best.values() if v > NEG])
    out, level = [], [0.0]
    for d in range(P):
        level = [s + v for s in level for v in rows[d]]
        out += level
    return out


# ---- host == batched on many random inputs -------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_batched_equals_host_random(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, 1, 1), (3, 1, 4), (3, 5, 1), (4, 16, 8), (5, 3, 3), (2, 6, 5), (6, 2, 7)]
    for B, P, K in shapes:
        for budget in (0, 1, 5, 32, 64):
            for levels, vocab, p_inf in ((2, 3, 0.0), (3, 5, 0.2), (8, 50, 0.05), (1, 2, 0.5)):
                tokens, scores = _random_case(g, B, P, K, vocab=vocab, levels=levels, p_inf=p_inf)
                host = build_trees(tokens, scores, budget)
                _assert_same(host, build_trees_batched(tokens, scores, budget))
                for b in range(B):
                    _assert_same_tree(host.tree(b), build_tree(tokens[b], scores[b], budget))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_batched_on_the_gpu_equals_host(seed):
    # the batched form's torch ops on CUDA tensors: the same trees as the host heaps, bit for bit
    g = torch.Generator().manual_seed(100 + seed)
    for B, P, K in ((1, 16, 4), (8, 16, 8), (24, 12, 4), (5, 3, 3)):
        for budget in (1, 31, 64):
            for levels, vocab, p_inf in ((2, 3, 0.0), (8, 50, 0.05)):
                tokens, scores = _random_case(g, B, P, K, vocab=vocab, levels=levels, p_inf=p_inf)
                host = build_trees(tokens, scores, budget)
                gpu = build_trees_batched(tokens.cuda(), scores.cuda(), budget)
                assert gpu.tokens.is_cuda
                _assert_same(host, type(gpu)(**{k: getattr(gpu, k).cpu() for k in gpu.__dataclass_fields__}))


def _assert_same_tree(a, b):
    for k in ("tokens", "parents", "depths", "scores", "anc"):
        assert torch.equal(getattr(a, k), getattr(b, k)), k


def test_batched_equals_host_continuous_scores():
    # log-softmax scores without quantisation, real-looking vocab; float32 and bfloat16 inputs
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(8, 16, 8, generator=g) * 3
        scores = torch.log_softmax(logits, -1).to(dtype)
        tokens = torch.randint(0, 1000, (8, 16, 8), generator=g)
        _assert_same(build_trees(tokens, scores, 32), build_trees_batched(tokens, scores, 32))


def test_padding_and_small_trees():
    # P=1, K=1: one node at most, whatever the budget
    t = build_trees_batched(torch.tensor([[[5]]]), torch.tensor([[[-0.1]]]), 8)
    assert t.n_nodes.tolist() == [1]
    assert t.tokens[0].tolist() == [5] + [0] * 7
    assert t.parents[0].tolist() == [-1] * 8
    assert t.anc[0].tolist() == [1] + [0] * 7
    assert t.depths[0].tolist() == [0] * 8
    assert t.scores[0, 0].item() == pytest.approx(-0.1) and math.isinf(t.scores[0, 1].item())
    # budget larger than the full tree (2 + 4 = 6 nodes)
    tokens = torch.tensor([[1, 2], [3, 4]])
    scores = torch.tensor([[-1.0, -2.0], [-0.5, -0.75]])
    tree = build_tree(tokens, scores, 32)
    assert tree.n == 6
    _check_structure(tree, tokens, scores)


# ---- structure and optimality ---------------------------------------------------------------


def test_structure_random():
    g = torch.Generator().manual_seed(11)
    for _ in range(60):
        P, K = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        tokens, scores = _random_case(g, 1, P, K, vocab=4, levels=4, p_inf=0.15)
        tree = build_tree(tokens[0], scores[0], 20)
        _check_structure(tree, tokens[0], scores[0])


def test_selected_set_is_optimal():
    # With scores <= 0 the best-first tree holds the `budget` best nodes of the full tree:
    # its sorted path scores equal the top of all path scores (enumerated here by brute force).
    g = torch.Generator().manual_seed(3)
    for _ in range(80):
        P, K = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        budget = int(torch.randint(0, 40, (1,), generator=g))
        tokens, scores = _random_case(g, 1, P, K, vocab=4, levels=5, p_inf=0.1)
        tree = build_tree(tokens[0], scores[0], budget)
        every = sorted(_all_nodes(tokens[0], scores[0]), reverse=True)
        assert tree.n == min(budget, len(every))
        assert sorted(tree.scores.tolist(), reverse=True) == every[:tree.n]


def test_optimal_against_parent_closed_subsets():
    # brute force over all parent-closed subsets of a tiny full tree (P=2, K=3: 12 nodes)
    g = torch.Generator().manual_seed(5)
    for _ in range(15):
        tokens = torch.arange(6).view(2, 3)  # distinct tokens: the full tree has 3 + 9 nodes
        scores = -0.5 * torch.randint(0, 4, (2, 3), generator=g).float()
        nodes = [(-1, float(scores[0, j])) for j in range(3)]
        nodes += [(a, nodes[a][1] + float(scores[1, j])) for a in range(3) for j in range(3)]
        for budget in (1, 3, 5, 8):
            best = max(sum(nodes[i][1] for i in sub) for sub in itertools.combinations(range(12), budget)
                       if all(nodes[i][0] in sub or nodes[i][0] == -1 for i in sub))
            assert sum(build_tree(tokens, scores, budget).scores.tolist()) == best


def test_exchange_property_with_tie_rule():
    # every frontier node left out is after the last selected node under the tie rule
    g = torch.Generator().manual_seed(9)
    for _ in range(40):
        P, K = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        tokens, scores = _random_case(g, 1, P, K, vocab=3, levels=3, p_inf=0.1)
        tok, sc = tokens[0], scores[0]
        tree = build_tree(tok, sc, 10)
        if tree.n == 0:
            continue
        rank = {}  # (depth, token) -> sibling rank after dedup
        for d in range(P):
            best = {}
            for j in range(K):
                t, v = int(tok[d, j]), float(sc[d, j])
                if t not in best or v > best[t][0]:
                    best[t] = (v, j)
            kept = sorted((v, j, t) for t, (v, j) in best.items() if v > NEG)
            kept.sort(key=lambda x: (-x[0], x[1]))
            for r, (v, j, t) in enumerate(kept):
                rank[d, t] = (r, v)
        par, dep, tks, scs = tree.parents.tolist(), tree.depths.tolist(), tree.tokens.tolist(), tree.scores.tolist()
        keys = [(-scs[i], dep[i], rank[dep[i], tks[i]][0], par[i]) for i in range(tree.n)]
        assert keys == sorted(keys), "nodes must come out in key order"
        chosen = {(par[i], tks[i]) for i in range(tree.n)}
        for p in [-1] + list(range(tree.n)):
            d = 0 if p < 0 else dep[p] + 1
            if d >= P:
                continue
            base = 0.0 if p < 0 else scs[p]
            for (dd, t), (r, v) in rank.items():
                if dd == d and (p, t) not in chosen and tree.n == 10:
                    assert (-(base + v), d, r, p) > keys[-1]


# ---- the tie rule ---------------------------------------------------------------------------


def test_tie_rule_depth_then_column_then_parent():
    # all roots score -1, all depth-1 candidates -0.5: depth first, then the column, then the parent
    tokens = torch.tensor([[10, 11], [20, 21]])
    scores = torch.tensor([[-1.0, -1.0], [-0.5, -0.5]])
    for tree in (build_tree(tokens, scores, 6), build_trees_batched(tokens[None], scores[None], 6).tree(0)):
        assert tree.tokens.tolist() == [10, 11, 20, 20, 21, 21]
        assert tree.parents.tolist() == [-1, -1, 0, 1, 0, 1]
        assert tree.depths.tolist() == [0, 0, 1, 1, 1, 1]
        assert tree.anc.tolist() == [1, 2, 5, 10, 17, 34]


def test_tie_rule_equal_path_score_prefers_shallower():
    # root b (-2) ties with child a->x (-1 + -1): the root comes first
    tokens = torch.tensor([[1, 2], [3, 4]])
    scores = torch.tensor([[-1.0, -2.0], [-1.0, NEG]])
    tree = build_tree(tokens, scores, 3)
    assert tree.tokens.tolist() == [1, 2, 3]
    assert tree.parents.tolist() == [-1, -1, 0]


# ---- -inf, dedup, errors --------------------------------------------------------------------


def test_neg_inf_never_chosen():
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    scores = torch.tensor([[-1.0, NEG, -3.0], [NEG, NEG, NEG]])
    for tree in (build_tree(tokens, scores, 8), build_trees_batched(tokens[None], scores[None], 8).tree(0)):
        assert tree.tokens.tolist() == [1, 3]
        assert tree.n == 2  # smaller than the budget: nothing finite is left
    assert build_tree(tokens, torch.full((2, 3), NEG), 8).n == 0


def test_dedup_keeps_higher_then_first():
    tokens = torch.tensor([[7, 7, 8, 8]])
    scores = torch.tensor([[-2.0, -1.0, -0.5, -0.5]])
    for tree in (build_tree(tokens, scores, 8), build_trees_batched(tokens[None], scores[None], 8).tree(0)):
        assert tree.tokens.tolist() == [8, 7]
        assert tree.scores.tolist() == [-0.5, -1.0]
    # the kept duplicate is the first column on equal scores: visible through the rank of a third
    # candidate at equal score (column 1 kept for token 9 would come after column 0's token 5)
    tokens = torch.tensor([[9, 5, 9]])
    scores = torch.tensor([[-1.0, -1.0, -1.0]])
    assert build_tree(tokens, scores, 8).tokens.tolist() == [9, 5]


@pytest.mark.parametrize("bad,word", [(math.nan, "NaN"), (math.inf, "+inf")])
def test_bad_scores_rejected(bad, word):
    tokens = torch.tensor([[1, 2], [3, 4]])
    scores = torch.tensor([[-1.0, -2.0], [-1.0, bad]])
    with pytest.raises(ValueError, match=re.escape(f"specpilot.engine.spec.tree.build_tree: scores[1, 1] is {word};")):
        build_tree(tokens, scores)
    for fn in (build_trees, build_trees_batched):
        with pytest.raises(ValueError, match=rf"specpilot.engine.spec.tree.{fn.__name__}: .*log-probabilities"):
            fn(tokens[None], scores[None])


def test_input_errors():
    t, s = torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="must both be"):
        build_tree(t, s[:, :2])
    with pytest.raises(ValueError, match=r"\[B, P, K\]"):
        build_trees_batched(t, s)
    with pytest.raises(TypeError, match="integer tensor"):
        build_tree(s, s)
    with pytest.raises(TypeError, match="floating tensor"):
        build_tree(t, t)
    with pytest.raises(ValueError, match=f"in \\[0, {MAX_NODES}\\]"):
        build_tree(t, s, MAX_NODES + 1)


# ---- the tree feeds gdn.build_tree_plan -----------------------------------------------------


def test_gdn_plan_matches_anc():
    import gdn

    g = torch.Generator().manual_seed(13)
    for budget in (32, 64):  # 64 uses bit 63, the sign bit of int64
        tokens, scores = _random_case(g, 4, 16, 8, vocab=1000, levels=6, p_inf=0.05)
        trees = build_trees_batched(tokens, scores, budget)
        parents = trees.to_parents()
        plan = gdn.build_tree_plan(parents, max_nodes=budget)
        ours = torch.cat([trees.tree(b).anc for b in range(4)])
        assert torch.equal(plan.anc, ours)
        assert torch.equal(plan.depth, torch.cat([trees.tree(b).depths for b in range(4)]))
        assert max(len(p) for p in parents) == budget
