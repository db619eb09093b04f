"""Drafters (specpilot/drafters.py): prompt lookup's matches, scores and order, and its use as tree input."""

import math

import pytest
import torch

from specpilot.engine.spec.drafters import Drafter, NGramDrafter
from specpilot.engine.spec.tree import build_tree

NEG = float("-inf")


def _first_path(tree) -> list[int]:
    """Tokens along the path through each level's first selected node (the best-first spine)."""
    path, parent = [], -1
    for i in range(tree.n):
        if int(tree.parents[i]) == parent:
            path.append(int(tree.tokens[i]))
            parent = i
    return path


def test_protocol_and_shapes():
    d = NGramDrafter()
    assert isinstance(d, Drafter)  # structural: any class with `propose` fits
    tok, sc = d.propose([5, 6, 7, 5, 6], positions=3, k=4)
    assert tok.shape == (3, 4) and sc.shape == (3, 4)
    assert tok.dtype == torch.int64 and sc.dtype == torch.float32
    assert not torch.isnan(sc).any() and not (sc == math.inf).any()
    assert (sc <= 0).all()  # log-probabilities
    assert (tok[torch.isinf(sc)] == 0).all()  # empty slots: token 0, score -inf


def test_repeated_pattern_continuation_at_rank0():
    pattern = [11, 12, 13, 14, 15]
    ctx = pattern * 3 + [11, 12]
    tok, sc = NGramDrafter().propose(ctx, positions=8, k=2)
    # the continuation after "11 12", past one period: the periodic continuation keeps going
    expect = [13, 14, 15, 11, 12, 13, 14, 15]
    assert tok[:, 0].tolist() == expect
    assert torch.isfinite(sc[:, 0]).all()
    assert sc[0, 0] == 0.0  # every match agrees: probability 1


def test_no_match_all_neg_inf():
    tok, sc = NGramDrafter().propose([1, 2, 3, 4], positions=3, k=2)  # last token 4 never seen before
    assert torch.isneginf(sc).all() and (tok == 0).all()
    for ctx in ([], [7]):  # empty and single-token contexts are allowed and propose nothing
        tok, sc = NGramDrafter().propose(ctx, positions=2, k=3)
        assert tok.shape == (2, 3) and torch.isneginf(sc).all() and (tok == 0).all()


def test_min_ngram_filters_short_matches():
    ctx = [1, 9, 2, 3, 9]  # only a unigram match for the last token 9
    _, sc = NGramDrafter(max_ngram=3, min_ngram=2).propose(ctx, 2, 2)
    assert torch.isneginf(sc).all()
    tok, sc = NGramDrafter(max_ngram=3, min_ngram=1).propose(ctx, 2, 2)
    assert tok[:, 0].tolist() == [2, 3] and torch.isfinite(sc[:, 0]).all()


def test_scores_are_weighted_relative_frequencies():
    # "5" followed by 1, 1, 2 (unigram matches only): frequencies 2/3 and 1/3 at depth 0
    ctx = [5, 1, 5, 1, 5, 2, 5]
    d = NGramDrafter(max_ngram=1)
    tok, sc = d.propose(ctx, 1, 3)
    assert tok[0, :2].tolist() == [1, 2]
    assert sc[0, 0].item() == pytest.approx(math.log(2 / 3))
    assert sc[0, 1].item() == pytest.approx(math.log(1 / 3))
    assert math.isinf(sc[0, 2].item())


def test_longer_ngram_preferred_when_disagreeing():
    # the suffix "3 4" occurred once followed by 7; "4" alone occurred twice more, followed by 8
    ctx = [3, 4, 7, 0, 4, 8, 0, 4, 8, 0, 3, 4]
    d = NGramDrafter(max_ngram=2)
    assert d.matches(ctx)[0] == (2, 2)  # longest first
    tok, sc = d.propose(ctx, 1, 2)
    assert tok[0].tolist() == [7, 8]
    # weights 8 (bigram) vs 1 + 1 (two unigrams) out of 10
    assert sc[0].tolist() == pytest.approx([math.log(0.8), math.log(0.2)])
    # with equal weights, the two shorter matches win
    tok, _ = NGramDrafter(max_ngram=2, length_weight=1).propose(ctx, 1, 2)
    assert tok[0].tolist() == [8, 7]


def test_occurrence_counted_once_at_its_longest_length():
    ctx = [1, 2, 3, 1, 2]  # end 3 matches "1 2" (and "2"): one match, not two
    assert NGramDrafter().matches(ctx) == [(2, 2)]


def test_tie_rule_recent_then_smaller_id():
    # "5" followed by 9 (earlier) and 4 (later): equal counts, the more recent match first
    tok, sc = NGramDrafter(max_ngram=1).propose([5, 9, 5, 4, 5], 1, 2)
    assert tok[0].tolist() == [4, 9] and sc[0, 0] == sc[0, 1]
    # the smaller-id rule never decides: one match proposes one token per depth, so two
    # candidates never share their most recent match; the order is total without it
    tok, _ = NGramDrafter(max_ngram=1).propose([5, 9, 5, 4, 5, 4, 5, 9, 5], 1, 2)
    assert tok[0].tolist() == [9, 4]  # 2 each; 9's latest match (end 8) beats 4's (end 6)
    a = NGramDrafter().propose([5, 9, 5, 4, 5], 3, 4)
    b = NGramDrafter().propose([5, 9, 5, 4, 5], 3, 4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_frequency_beats_recency():
    # 5 -> 9 twice, 5 -> 4 once and most recently: frequency decides first
    tok, _ = NGramDrafter(max_ngram=1).propose([5, 9, 5, 9, 5, 4, 5], 1, 2)
    assert tok[0].tolist() == [9, 4]


def test_deterministic_on_random_contexts():
    g = torch.Generator().manual_seed(0)
    d = NGramDrafter(max_ngram=3)
    for _ in range(20):
        ctx = torch.randint(0, 6, (200,), generator=g)
        a, b = d.propose(ctx, 5, 4), d.propose(ctx.tolist(), 5, 4)  # tensor and list contexts agree
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert (a[1][:, 1:] <= a[1][:, :-1]).all()  # rows sorted by score
        for row_t, row_s in zip(a[0].tolist(), a[1].tolist()):
            finite = [t for t, s in zip(row_t, row_s) if s > NEG]
            assert len(set(finite)) == len(finite)  # no duplicate candidates


def test_tensor_context_accepted():
    ctx = torch.tensor([1, 2, 3, 1, 2, 3, 1], dtype=torch.int32)
    tok, sc = NGramDrafter().propose(ctx, 2, 1)
    assert tok[:, 0].tolist() == [2, 3] and torch.isfinite(sc).all()


def test_tree_builder_takes_proposals():
    pattern = [21, 22, 23, 24, 25, 26]
    ctx = pattern * 2 + [21, 22, 23]
    tok, sc = NGramDrafter().propose(ctx, positions=6, k=3)
    tree = build_tree(tok, sc, budget=16)
    assert tree.n >= 6
    assert _first_path(tree)[:6] == [24, 25, 26, 21, 22, 23]
    # competing continuations: "2 3 1 2" (a 4-gram, end 5) proposes 4, two bigram matches propose 3;
    # the tree's spine follows the 4-gram and 3 is the other child of the committed token
    ctx = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]
    tok, sc = NGramDrafter().propose(ctx, positions=4, k=2)
    tree = build_tree(tok, sc, budget=8)
    assert _first_path(tree)[0] == 4
    roots = [int(t) for t, p in zip(tree.tokens, tree.parents) if int(p) == -1]
    assert roots == [4, 3]


def test_long_context_caps_the_matches():
    """A 10k-token context over 50 token ids has thousands of short matches: at most max_matches vote,
    and the proposals are still finite at rank 0 (speed is for benchmarks, not tests)."""
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, 50, (10_000,), generator=g)
    d = NGramDrafter(max_matches=64)
    assert len(d.matches(ctx)) <= 64
    tok, sc = d.propose(ctx, 8, 8)
    assert torch.isfinite(sc[:, 0]).all()


@pytest.mark.parametrize("kwargs, what", [
    ({"positions": 0, "k": 1}, "positions=0"),
    ({"positions": 1, "k": 0}, "k=0"),
    ({"positions": True, "k": 1}, "positions=True"),
])
def test_bad_counts(kwargs, what):
    with pytest.raises(ValueError, match=r"specpilot\.engine\.spec\.drafters\.NGramDrafter\.propose: " + what):
        NGramDrafter().propose([1, 2], **kwargs)


def test_bad_construction_and_context():
    with pytest.raises(ValueError, match="min_ngram=3 > max_ngram=2"):
        NGramDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="max_ngram=0"):
        NGramDrafter(max_ngram=0)
    with pytest.raises(ValueError, match="length_weight"):
        NGramDrafter(length_weight=0.5)
    with pytest.raises(ValueError, match="vocab_size=10"):
        NGramDrafter(vocab_size=10).propose([1, 12], 1, 1)
    with pytest.raises(ValueError, match="token id -1"):
        NGramDrafter().propose([1, -1], 1, 1)
    with pytest.raises(TypeError, match="integer token ids"):
        NGramDrafter().propose(torch.tensor([1.0, 2.0]), 1, 1)
    with pytest.raises(ValueError, match="1-D"):
        NGramDrafter().propose(torch.zeros(2, 2, dtype=torch.int64), 1, 1)
    with pytest.raises(TypeError, match="as ints"):
        NGramDrafter().propose([1, "2"], 1, 1)
