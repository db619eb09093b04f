"""Greedy tree acceptance on tensors (specpilot.engine.spec.accept) against a plain-Python walk."""

import random

import pytest
import torch

import gdn
from specpilot.engine.spec.accept import accepted_slots, greedy_accept, greedy_accept_reference


def _tree(rng: random.Random, n: int, vocab: int, depth_cap: int):
    """Parents before children, siblings with distinct tokens, depth below depth_cap."""
    parents, tokens, depths = [], [], []
    used: dict[int, set] = {}
    for i in range(n):
        cands = [-1] + [j for j in range(i) if depths[j] + 1 < depth_cap]
        p = rng.choice(cands)
        free = [t for t in range(vocab) if t not in used.setdefault(p, set())]
        if not free:
            p, free = -1, [t for t in range(vocab) if t not in used.setdefault(-1, set())]
            if not free:
                break
        t = rng.choice(free)
        used[p].add(t)
        parents.append(p)
        tokens.append(t)
        depths.append(0 if p < 0 else depths[p] + 1)
    return parents, tokens, depths


def _batch(seed: int, B: int, N: int, vocab: int, depth_cap: int, hit: float):
    rng = random.Random(seed)
    trees = [_tree(rng, rng.randint(0, N), vocab, depth_cap) for _ in range(B)]
    P = torch.full((B, N), -1, dtype=torch.int32)
    T = torch.zeros(B, N, dtype=torch.int64)
    D = torch.zeros(B, N, dtype=torch.int32)
    nxt = torch.zeros(B, N + 1, dtype=torch.int64)
    for b, (par, tok, dep) in enumerate(trees):
        n = len(par)
        P[b, :n] = torch.tensor(par, dtype=torch.int32)
        T[b, :n] = torch.tensor(tok)
        D[b, :n] = torch.tensor(dep, dtype=torch.int32)
        # the target's choices: often one of the children's tokens (so paths get accepted), else random
        for at in range(-1, n):
            kids = [tok[i] for i in range(n) if par[i] == at]
            nxt[b, at + 1] = rng.choice(kids) if kids and rng.random() < hit else rng.randrange(vocab)
    n_nodes = torch.tensor([len(t[0]) for t in trees], dtype=torch.int32)
    return trees, T, P, D, n_nodes, nxt


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("hit", [0.0, 0.6, 1.0])
def test_matches_the_walk(seed, hit):
    """The accepted path, its length and the bonus token equal a plain walk from the root, for random
    ragged trees (empty ones too), target choices that match nothing, some children or always one."""
    depth_cap = 6
    trees, T, P, D, n_nodes, nxt = _batch(seed, 5, 24, 7, depth_cap, hit)
    got = greedy_accept(T, P, D, n_nodes, nxt, max_depth=depth_cap)
    paths, bonus = greedy_accept_reference([t[0] for t in trees], [t[1] for t in trees],
                                           [nxt[b, :len(t[0]) + 1].tolist() for b, t in enumerate(trees)])
    for b, path in enumerate(paths):
        n = int(got.accepted_len[b])
        assert got.accepted[b, :n].tolist() == path, f"request {b}"
        assert (got.accepted[b, n:] == -1).all()
        assert int(got.bonus[b]) == bonus[b]


def test_commit_format_is_a_root_path():
    """The output is what gdn.commit takes: gdn.validate_accepted agrees on a plan of the same trees."""
    trees, T, P, D, n_nodes, nxt = _batch(99, 4, 16, 5, 5, 0.9)
    trees = [t for t in trees]
    got = greedy_accept(T, P, D, n_nodes, nxt, max_depth=5)
    keep = [b for b, t in enumerate(trees) if t[0]]
    plan = gdn.build_tree_plan([trees[b][0] for b in keep])
    gdn.validate_accepted(plan, got.accepted[keep], got.accepted_len[keep])


def test_padding_is_ignored():
    """Entries past n_nodes never count, whatever they hold."""
    trees, T, P, D, n_nodes, nxt = _batch(5, 3, 10, 4, 4, 1.0)
    ref = greedy_accept(T, P, D, n_nodes, nxt, max_depth=4)
    T2, P2 = T.clone(), P.clone()
    for b in range(3):
        n = int(n_nodes[b])
        T2[b, n:] = nxt[b, 0]  # tokens that would match the root's choice
        P2[b, n:] = -1
    got = greedy_accept(T2, P2, D, n_nodes, nxt, max_depth=4)
    assert torch.equal(got.accepted, ref.accepted) and torch.equal(got.accepted_len, ref.accepted_len)
    assert torch.equal(got.bonus, ref.bonus)


def test_bad_shapes_say_how_to_fix():
    T = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError,
                       match=r"specpilot\.engine\.spec\.accept\.greedy_accept: target_next .*; pass \[B, N \+ 1\]"):
        greedy_accept(T, T.int(), T.int(), torch.zeros(2, dtype=torch.int32), T, max_depth=2)
    with pytest.raises(TypeError, match="integer"):
        greedy_accept(T.float(), T.int(), T.int(), torch.zeros(2, dtype=torch.int32),
                      torch.zeros(2, 5, dtype=torch.int64), max_depth=2)


def test_accepted_slots_remap_the_path():
    """The accepted nodes' KV slots in path order; every other node's slot is freed, none twice."""
    trees, T, P, D, n_nodes, nxt = _batch(7, 4, 12, 5, 5, 1.0)
    acc = greedy_accept(T, P, D, n_nodes, nxt, max_depth=5)
    slots = torch.arange(4 * 12, dtype=torch.int32).view(4, 12) * 3 + 100
    kept, freed = accepted_slots(slots, acc)
    for b in range(4):
        n = int(acc.accepted_len[b])
        path = acc.accepted[b, :n].tolist()
        assert kept[b, :n].tolist() == [int(slots[b, i]) for i in path]
        assert (kept[b, n:] == -1).all()
        assert freed[b].tolist() == [i not in path for i in range(12)]
