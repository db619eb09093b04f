"""Benchmark case providers, one module per operator; each registers itself on import."""

from __future__ import annotations

import random


def draft_tree(n: int, rng: random.Random) -> list[int]:
    """Draft-tree-like parent list: one root, each node hangs off one of the 5 nodes before it (the tree_attn and gdn
    cases' trees, and the tuner's); no node at n = 0."""
    return [-1] + [rng.randrange(max(0, i - 5), i) for i in range(1, n)] if n else []


def chain(n: int) -> list[int]:
    """A chain of `n` nodes (node i's parent is i - 1): the tree of a drafter that proposes one path."""
    return list(range(-1, n - 1))


def star(n: int) -> list[int]:
    """A root and `n - 1` children of it: the tree of a drafter's top-(n - 1) choices at one position."""
    return [-1] + [0] * (n - 1)
