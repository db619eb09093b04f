"""Drafters: what proposes the candidates that the draft-tree builder (specpilot/tree.py) arranges.

The tree builder's input format, and so every drafter's output: `tokens` int64 [P, K] and `scores`
float32 [P, K], row d holding K candidates for the token at depth d below the committed token (the
last token of the context), scored by log-probabilities. -inf marks an unusable slot (its token is
0, a valid id, so the tensors need no separate mask); NaN and +inf are never produced, because the
builder rejects them. Duplicate tokens in a row are allowed (the builder keeps the best one).

Marginal drafters only. The builder sums `scores[d, j]` along a path, i.e. it treats the score of a
candidate at depth d as independent of which candidates were chosen above it. That is exact for a
marginal drafter (DFlash style: one forward pass predicts every position independently of the
others) and an approximation for anything else. A trained parallel drafter plugs in as a class
with a `propose` method that runs the drafter model on the context and returns, per predicted
position, the top-k token ids and their log-probabilities (`torch.topk(logits.log_softmax(-1), k)`
per position). A drafter conditioned on the parent (EAGLE / Medusa-with-tree style, where the
distribution at depth d depends on the token chosen at depth d-1) does not fit this format: its
candidates differ per parent, so it needs a different tree builder that expands per node.

A drafter that reads the target's hidden state declares `needs_hidden = True`; the engine then calls
`propose(context, positions, k, hidden=h)` with h the target's final-normed hidden state [hidden_size] of
context[-2], the token before the pending one: the state whose argmax the pending token is (after a prefill, the
prompt's second-to-last token; None for a one-token prompt, where the target has processed nothing). The engine
keeps it from the pass that chose the pending token, so it costs no extra pass. `heads.HeadsDrafter` is one.

`NGramDrafter` is prompt lookup: no model, it copies what followed earlier occurrences of the
context's last few tokens, which is cheap and accurate on repetitive text (code edits, quoting,
summaries of the prompt).
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence, runtime_checkable

import torch

__all__ = ["Drafter", "NGramDrafter"]

_WHERE = "specpilot.engine.spec.drafters"  # the module as error messages name it


@runtime_checkable
class Drafter(Protocol):
    """Anything that proposes draft candidates in the tree builder's format.

    `propose(context, positions, k)` returns (tokens int64 [positions, k], scores float32
    [positions, k]): row d holds k candidates for the token at depth d after the context's last
    token, with marginal log-probabilities (each position scored independently of the others,
    since the tree builder adds the scores along a path); -inf with token 0 marks an empty slot.
    An empty context is allowed and proposes nothing (all -inf), so callers need no special case.
    A drafter with `needs_hidden = True` also takes the keyword `hidden` (module docstring).

    A drafter whose candidates depend on their parent (`conditional = True`, e.g. the Markov heads) gives the tree
    itself instead: `propose_tree(context, positions, k, budget, [hidden=])` -> `tree.DraftTree` of at most
    `budget` nodes, each node's score its path's sum of log-probabilities given the parent
    (`tree.build_tree_conditional` builds one from a function of (depth, parent token)). The engine calls it in
    place of `propose` and the builder; `propose` stays for callers that want rows.
    """

    def propose(self, context: Sequence[int] | torch.Tensor, positions: int, k: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        ...


def _check_count(fn: str, name: str, value, where: str = _WHERE) -> int:
    # bool is an int subclass: reject it so a flag passed by mistake is not read as 0 or 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}.{fn}: {name}={value!r}; pass an int >= 1")
    return value


def _as_context(fn: str, context, vocab_size: int | None, where: str = _WHERE) -> torch.Tensor:
    """The context as a 1-D int64 CPU tensor, token ids checked (>= 0, and < vocab_size when known); errors name
    `where`.`fn`."""
    if isinstance(context, torch.Tensor):
        if context.dtype.is_floating_point or context.dtype.is_complex or context.dtype == torch.bool:
            raise TypeError(f"{where}.{fn}: context must hold integer token ids, got {context.dtype}; "
                            "pass an int64 tensor or a sequence of ints")
        if context.dim() != 1:
            raise ValueError(f"{where}.{fn}: context has shape {tuple(context.shape)}; "
                             "pass one request's tokens as a 1-D tensor")
        ctx = context.detach().to(device="cpu", dtype=torch.int64)
    else:
        items = list(context)
        for x in items:
            if isinstance(x, bool) or not isinstance(x, int):
                raise TypeError(f"{where}.{fn}: context holds {x!r} ({type(x).__name__}); "
                                "pass token ids as ints")
        ctx = torch.tensor(items, dtype=torch.int64)
    if ctx.numel():
        lo, hi = int(ctx.min()), int(ctx.max())
        if lo < 0:
            raise ValueError(f"{where}.{fn}: context holds token id {lo}; token ids must be >= 0")
        if vocab_size is not None and hi >= vocab_size:
            raise ValueError(f"{where}.{fn}: context holds token id {hi} >= vocab_size={vocab_size}; "
                             "pass ids from the drafter's vocabulary or a larger vocab_size")
    return ctx


class NGramDrafter:
    """Prompt lookup: propose what followed earlier occurrences of the context's last n tokens.

    Matching. An earlier occurrence is an end position e < L (L = len(context)) such that the
    n tokens before e equal the context's last n tokens, for some n in [min_ngram, max_ngram]; it
    proposes the tokens context[e], context[e+1], ... for depths 0, 1, .... Each end position is
    counted once, at its longest matching n (an occurrence of a 4-gram is also one of its 3-gram
    suffix; counting it twice would let one occurrence vote twice). When a proposal runs into the
    end of the context, the match continues with its own proposals, i.e. with period L - e: a
    match at e says "the text repeats with period L - e", and that is what such a repeat predicts
    beyond the known tokens (so a pattern seen twice is proposed for any number of positions).

    Scoring. A match of length n has weight `length_weight ** (n - min_ngram)` (8 by default: a
    longer match is stronger evidence that the text is repeating, so one bigram match outvotes up
    to 7 unigram matches that disagree with it, yet many agreeing shorter matches still count). At
    depth d a candidate token's score is log(sum of the weights of the matches proposing it /
    sum of the weights of all matches): the log of its weighted relative frequency, a marginal
    log-probability as the tree builder expects. With an integer length_weight the weighted
    counts are exact integers in float64, so equal evidence gives bit-equal scores and the order
    below, not rounding, decides.

    Order within a row (a total order, so the output is deterministic): higher weighted count
    first, then the candidate whose most recent proposing match is later in the context (recent
    text is the better predictor), then the smaller token id (kept for a total order by
    construction; it cannot decide here, since one match proposes one token per depth and end
    positions are distinct). Slots past the candidates get
    token 0 and score -inf; positions with no match are all -inf.

    Cost. One vectorised comparison pass over the context per matched length (O(L * max_ngram)
    element compares, no Python loop over the context), then at most `max_matches` matches are
    kept: the longest first, the most recent first among equal lengths. The cap bounds the
    per-position vote loop (O(max_matches * positions) Python steps) on long, repetitive contexts,
    where old, short matches add little. Measured on 2 CPU cores, 10k-token context, 8 positions,
    k=8: about 0.3 ms (32k-token vocabulary, few matches) to 2 ms (50 distinct tokens, the cap
    reached); a 10k-element Python list adds about 3 ms to convert. No index is kept between
    calls, trading that per-call scan for a drafter that is stateless: it can be shared across
    requests and the context may change arbitrarily (rollbacks after rejection) between calls.
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, vocab_size: int | None = None, *,
                 length_weight: float = 8.0, max_matches: int = 64) -> None:
        _check_count("NGramDrafter", "max_ngram", max_ngram)
        _check_count("NGramDrafter", "min_ngram", min_ngram)
        if min_ngram > max_ngram:
            raise ValueError(f"{_WHERE}.NGramDrafter: min_ngram={min_ngram} > max_ngram={max_ngram}; "
                             "pass min_ngram <= max_ngram")
        if vocab_size is not None:
            _check_count("NGramDrafter", "vocab_size", vocab_size)
        if isinstance(length_weight, bool) or not isinstance(length_weight, (int, float)) \
                or not math.isfinite(length_weight) or length_weight < 1:
            raise ValueError(f"{_WHERE}.NGramDrafter: length_weight={length_weight!r}; pass a finite "
                             "number >= 1 (1 weighs all matches alike; larger prefers longer matches)")
        _check_count("NGramDrafter", "max_matches", max_matches)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.vocab_size = vocab_size
        self.length_weight = float(length_weight)
        self.max_matches = max_matches

    def __repr__(self) -> str:
        return (f"NGramDrafter(max_ngram={self.max_ngram}, min_ngram={self.min_ngram}, "
                f"vocab_size={self.vocab_size}, length_weight={self.length_weight}, "
                f"max_matches={self.max_matches})")

    def matches(self, context: Sequence[int] | torch.Tensor) -> list[tuple[int, int]]:
        """The kept matches as (end position e, matched length n), longest first, then most recent.

        Public so callers can inspect why a candidate was proposed.
        """
        ctx = _as_context("NGramDrafter.matches", context, self.vocab_size)
        return self._matches(ctx)

    def _matches(self, ctx: torch.Tensor) -> list[tuple[int, int]]:
        L = int(ctx.numel())
        if L < 2:  # an end position e must satisfy 1 <= e <= L - 1
            return []
        ends = torch.arange(1, L, dtype=torch.int64)  # candidate end positions, e = L excluded (the suffix itself)
        alive = torch.ones(L - 1, dtype=torch.bool)
        length = torch.zeros(L - 1, dtype=torch.int64)
        for j in range(1, min(self.max_ngram, L) + 1):
            before = ends - j  # the j-th token before e must equal the j-th token before L
            ok = (before >= 0) & (ctx[before.clamp(min=0)] == ctx[L - j])
            alive &= ok
            if not bool(alive.any()):
                break
            length += alive.to(torch.int64)
        keep = length >= self.min_ngram
        if not bool(keep.any()):
            return []
        e, n = ends[keep], length[keep]
        key = n * (L + 1) + e  # unique per match: longer first, then more recent
        top = torch.topk(key, min(self.max_matches, int(key.numel())), sorted=True).indices
        return list(zip(e[top].tolist(), n[top].tolist()))

    def propose(self, context: Sequence[int] | torch.Tensor, positions: int, k: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens int64 [positions, k], scores float32 [positions, k]) for the tree builder.

        See the class docstring for the matching, scoring and ordering rules. Outputs are on the
        CPU; move them to the tree's device if it differs.
        """
        _check_count("NGramDrafter.propose", "positions", positions)
        _check_count("NGramDrafter.propose", "k", k)
        ctx = _as_context("NGramDrafter.propose", context, self.vocab_size)
        tokens = torch.zeros(positions, k, dtype=torch.int64)
        scores = torch.full((positions, k), float("-inf"), dtype=torch.float32)
        found = self._matches(ctx)
        if not found:
            return tokens, scores
        L = int(ctx.numel())
        e = torch.tensor([m[0] for m in found], dtype=torch.int64)
        n = [m[1] for m in found]
        d = torch.arange(positions, dtype=torch.int64)
        idx = e[:, None] + d[None, :] % (L - e)[:, None]  # periodic continuation past the context's end
        prop = ctx[idx].tolist()  # [M, positions]
        weights = [self.length_weight ** (m - self.min_ngram) for m in n]
        total = math.fsum(weights)
        ends = e.tolist()
        for p in range(positions):
            count: dict[int, float] = {}
            recent: dict[int, int] = {}
            for row, w, end in zip(prop, weights, ends):
                t = row[p]
                count[t] = count.get(t, 0.0) + w
                if end > recent.get(t, -1):
                    recent[t] = end
            order = sorted(count, key=lambda t: (-count[t], -recent[t], t))[:k]
            tokens[p, :len(order)] = torch.tensor(order, dtype=torch.int64)
            scores[p, :len(order)] = torch.tensor([math.log(count[t] / total) for t in order], dtype=torch.float64)
        return tokens, scores
