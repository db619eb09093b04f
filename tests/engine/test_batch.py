"""Batched speculative decoding under one node budget (specpilot.engine.batch): every request's output is its
own autoregressive greedy output, the node budget is never exceeded, and the allocation is deterministic."""

import torch

from specpilot.engine import Engine
from specpilot.engine.batch import generate_batch
from specpilot.testing import raises_helpful


def _prompts(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (12, 40, 70):
        motif = torch.randint(0, vocab, (5,), generator=g).tolist()
        out.append(torch.randint(0, vocab, (n,), generator=g).tolist() + motif * 3)
    return out


def test_batch_outputs_are_each_requests_greedy_output(checkpoints):
    path, model = checkpoints["attn-first-kv1-v131"]
    prompts = _prompts(131, 0)
    eng = Engine.from_pretrained(path, device="cpu", drafter="ngram", rows=3)
    runs = []
    for _ in range(2):
        allocs = []
        outs = generate_batch(eng, prompts, 80, budget=20, log_allocations=allocs)
        runs.append((outs, allocs))
        assert all(sum(a) <= 20 for a in allocs)
        assert any(sum(a) > 0 for a in allocs)  # trees were drafted and verified
    assert runs[0] == runs[1]  # deterministic, allocation included
    for p, o in zip(prompts, runs[0][0]):
        assert o == eng.generate(p, 80, speculative=False)
    assert eng.stats()["batch"]["tau"] > 3  # tokens per batch step over three requests


def test_batch_errors(checkpoints):
    path, _ = checkpoints["gdn3-attn1-v97"]
    eng = Engine.from_pretrained(path, device="cpu", drafter="ngram", rows=2)
    with raises_helpful("specpilot.engine", "rows"):
        eng.generate_batch([[1, 2], [3], [4]], 4)
    with raises_helpful("specpilot.engine", "budget"):
        eng.generate_batch([[1, 2], [3]], 4, budget=-1)
    with raises_helpful("specpilot.engine", "vocabulary"):
        eng.generate_batch([[1, 2], [300]], 4)
    selfish = Engine.from_pretrained(path, device="cpu", drafter="self")
    with raises_helpful("specpilot.engine", "stateless drafter"):
        selfish.generate_batch([[1, 2]], 4)
