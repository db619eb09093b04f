"""Batched speculative decoding under one node budget (specpilot.engine.batch): every request's output is its
own autoregressive greedy output, also when more prompts than rows wait and join the batch as rows free up; the node
budget is never exceeded, and the allocation is deterministic."""

import pytest
import torch

import specpilot.engine.batch as batch_mod
from specpilot.engine import Engine
from specpilot.engine.batch import generate_batch
from specpilot.engine.spec.budget import best_budget
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


@pytest.mark.parametrize("rows,max_rows", [(2, None), (3, 2)], ids=["rows2", "rows3-max_rows2"])
def test_waiting_prompts_join_as_rows_free_up(checkpoints, rows, max_rows):
    # five prompts of different lengths through two rows: a finished request's row is reset and the next prompt
    # prefilled into it; every output is still that prompt's own greedy output
    path, model = checkpoints["gdn3-attn1-v97"]
    g = torch.Generator().manual_seed(3)
    prompts = []
    for n in (7, 45, 16, 60, 23):
        motif = torch.randint(0, 97, (4,), generator=g).tolist()
        prompts.append(torch.randint(0, 97, (n,), generator=g).tolist() + motif * 3)
    eng = Engine.from_pretrained(path, device="cpu", drafter="ngram", rows=rows)
    allocs = []
    outs = eng.generate_batch(prompts, 40, max_rows=max_rows, budget=12) if max_rows else \
        generate_batch(eng, prompts, 40, budget=12, log_allocations=allocs)
    ar = Engine.from_pretrained(path, device="cpu", drafter=None)
    for r, (p, o) in enumerate(zip(prompts, outs)):
        assert o == ar.generate(p, 40, speculative=False), f"prompt {r}"
    if not max_rows:
        assert all(sum(a) <= 12 for a in allocs)
        running = [len(a) for a in allocs]
        # two requests at once until the last prompt has joined, then one: a freed row never idles while one waits
        assert running[0] == 2 and running == sorted(running, reverse=True) and running[-1] == 1
    assert eng.stats()["prefill"]["tokens"] == sum(len(p) - 1 for p in prompts)  # each prompt prefilled once


def test_batch_errors(checkpoints):
    path, _ = checkpoints["gdn3-attn1-v97"]
    eng = Engine.from_pretrained(path, device="cpu", drafter="ngram", rows=2)
    with raises_helpful("specpilot.engine", "max_rows", "rows=3"):
        eng.generate_batch([[1, 2], [3], [4]], 4, max_rows=3)
    with raises_helpful("specpilot.engine", "max_rows"):
        eng.generate_batch([[1, 2], [3], [4]], 4, max_rows=0)
    with raises_helpful("specpilot.engine", "budget"):
        eng.generate_batch([[1, 2], [3]], 4, budget=-1)
    with raises_helpful("specpilot.engine", "vocabulary"):
        eng.generate_batch([[1, 2], [300]], 4)
    selfish = Engine.from_pretrained(path, device="cpu", drafter="self")
    with raises_helpful("specpilot.engine", "stateless drafter"):
        selfish.generate_batch([[1, 2]], 4)


# ---- budget="auto": each step's budget chosen by measured step costs ---------------------------------------------


def test_best_budget_takes_the_most_expected_tokens_per_second():
    gains = [[0.9, 0.8, 0.5], [0.7]]
    caps = {0: 0, 2: 31, 4: 31}
    # b = 0: 2 tokens / 1.0; b = 2: (2 + 0.9 + 0.8) / 1.2 = 3.08; b = 4: (2 + 2.9) / 2.0 = 2.45
    b, alloc = best_budget(gains, {0: 1.0, 2: 1.2, 4: 2.0}, caps)
    assert b == 2 and list(alloc) == [2, 0]
    b, alloc = best_budget(gains, {0: 1.0, 2: 1.2, 4: 1.2}, caps)
    assert b == 4 and list(alloc) == [3, 1]
    # nodes that are worth nothing, or a step too slow for what they add: the autoregressive step
    assert best_budget([[0.0, 0.0], []], {0: 1.0, 2: 1.0}, caps)[0] == 0
    assert best_budget(gains, {0: 1.0, 2: 2.0, 4: 3.0}, caps)[0] == 0
    # equal rates go to the smaller budget: a second node that does not exist adds nothing
    assert best_budget([[1.0]], {1: 1.0, 2: 1.0}, {1: 31, 2: 31})[0] == 1
    # the per-request bound of each step holds
    b, alloc = best_budget([[1.0, 1.0], [1.0, 1.0]], {4: 1.0}, {4: 1})
    assert b == 4 and list(alloc) == [1, 1] and alloc.unused == 2
    with raises_helpful("specpilot.engine.spec", "best_budget", "costs is empty"):
        best_budget(gains, {}, {})
    with raises_helpful("specpilot.engine.spec", "best_budget", r"costs\[2\]"):
        best_budget(gains, {2: 0.0}, caps)
    with raises_helpful("specpilot.engine.spec", "best_budget", r"costs\[2\]"):
        best_budget(gains, {2: float("nan")}, caps)
    with raises_helpful("specpilot.engine.spec", "best_budget", "max_nodes"):
        best_budget(gains, {3: 1.0}, caps)
    with raises_helpful("specpilot.engine.spec", "best_budget", "non-negative"):
        best_budget(gains, {-1: 1.0}, {-1: 1})


def test_auto_budget_is_lossless_and_follows_the_measured_costs(checkpoints, monkeypatch):
    path, _ = checkpoints["attn-first-kv1-v131"]
    prompts = _prompts(131, 0)
    eng = Engine.from_pretrained(path, device="cpu", drafter="ngram", rows=3)
    want = [eng.generate(p, 60, speculative=False) for p in prompts]
    log = {}
    assert generate_batch(eng, prompts, 60, budget="auto", log_budgets=log) == want
    cands = tuple(k * 3 for k in batch_mod.AUTO_NODES_PER_ROW)
    assert tuple(sorted(log["costs"])) == cands and all(c > 0 for c in log["costs"].values())
    assert log["steps"] and set(log["steps"]) <= set(cands)

    # worthless drafts at these costs: every step autoregressive, no node allocated
    def costly(engine, rows, budgets, graphs, reps=batch_mod.AUTO_REPS):
        return {b: 1.0 if b == 0 else 1e9 for b in budgets}

    monkeypatch.setattr(batch_mod, "measure_budgets", costly)
    allocs, log = [], {}
    assert generate_batch(eng, prompts, 60, budget=(0, 6, 24), log_allocations=allocs, log_budgets=log) == want
    assert set(log["steps"]) == {0} and all(sum(a) == 0 for a in allocs)

    # free nodes: a step that has candidates takes a budget that holds them
    def flat(engine, rows, budgets, graphs, reps=batch_mod.AUTO_REPS):
        return dict.fromkeys(budgets, 1.0)

    monkeypatch.setattr(batch_mod, "measure_budgets", flat)
    allocs, log = [], {}
    assert generate_batch(eng, prompts, 60, budget=[0, 6, 24], log_allocations=allocs, log_budgets=log) == want
    assert any(b > 0 for b in log["steps"]) and any(sum(a) > 0 for a in allocs)
    assert all(sum(a) <= b for a, b in zip(allocs, log["steps"]))
    # one candidate: no measurement, the fixed budget
    log = {}
    assert generate_batch(eng, prompts, 60, budget=[6], log_budgets=log) == want
    assert log["costs"] == {} and set(log["steps"]) == {6}


def test_auto_budget_errors(checkpoints):
    path, _ = checkpoints["gdn3-attn1-v97"]
    eng = Engine.from_pretrained(path, device="cpu", drafter="ngram", rows=2)
    with raises_helpful("specpilot.engine", "budget='fast'", "'auto'"):
        eng.generate_batch([[1, 2], [3]], 4, budget="fast")
    with raises_helpful("specpilot.engine", r"budget=\[\]"):
        eng.generate_batch([[1, 2], [3]], 4, budget=[])
    with raises_helpful("specpilot.engine", "budget"):
        eng.generate_batch([[1, 2], [3]], 4, budget=[4, -1])
