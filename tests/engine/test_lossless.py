"""Speculative greedy output equals autoregressive greedy output, token for token, over long generations:
several prompts and seeds, both shipped drafters, on the CPU (torch references) and on the GPU (the kernels,
every step one CUDA graph). A divergence passes only at a near-tie (autoregressive top-2 margin below
specpilot.engine.NEAR_TIE); every such case is reported."""

import pytest
import torch

from specpilot.engine import NEAR_TIE, Engine, check_lossless


def _prompt(vocab, n, seed):
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, vocab, (7,), generator=g).tolist()
    noise = torch.randint(0, vocab, (n,), generator=g).tolist()
    return noise[: n // 2] + motif * 3 + noise[n // 2:]  # a repeated motif gives the n-gram drafter matches


def _check(eng, prompt, n):
    rep = check_lossless(eng, prompt, n)
    assert len(rep.autoregressive) == n and len(rep.speculative) == n
    if rep.divergence is not None:
        print(f"near-tie divergence at token {rep.divergence}: margin {rep.margin:.4g} < {NEAR_TIE}")
    assert rep.ok, (f"speculative output parts from greedy at token {rep.divergence} where the autoregressive "
                    f"margin is {rep.margin:.4g} >= {NEAR_TIE}: not a near-tie")
    assert rep.tau > 1.0  # the drafter was used and accepted tokens
    return rep


@pytest.mark.parametrize("shape,seed,plen", [("gdn3-attn1-v97", 0, 20), ("attn-first-kv1-v131", 1, 75),
                                             ("gdn-k1v4-d128-v64", 2, 40)])
def test_ngram_drafter_is_lossless_cpu(checkpoints, shape, seed, plen):
    path, model = checkpoints[shape]
    eng = Engine.from_pretrained(path, device="cpu", drafter="ngram")
    _check(eng, _prompt(model.config.vocab_size, plen, seed), 256)


@pytest.mark.slow
def test_self_drafter_is_lossless_cpu(checkpoints):
    path, model = checkpoints["gdn3-attn1-v97"]
    eng = Engine.from_pretrained(path, device="cpu", drafter="self", positions=4, tree_nodes=8)
    _check(eng, _prompt(97, 30, 3), 256)


# Every model, weight format and drafter runs in `make test-gpu`, and every pair of them (model and format, model and
# drafter, format and drafter): six of the twelve combinations. The other six repeat those pairs in a third
# combination and run in `make test-gpu-full` (slow).
_LOSSLESS_MODELS = [("gdn3-attn1-v97", 0, 20), ("attn-first-kv1-v131", 1, 75), ("gdn-k1v4-d128-v64", 2, 40)]
_LOSSLESS_FAST = {("gdn3-attn1-v97", "w12", "ngram"), ("gdn3-attn1-v97", "bf16", "self"),
                  ("attn-first-kv1-v131", "bf16", "ngram"), ("attn-first-kv1-v131", "w12", "self"),
                  ("gdn-k1v4-d128-v64", "bf16", "ngram"), ("gdn-k1v4-d128-v64", "w12", "self")}


@pytest.mark.gpu
@pytest.mark.parametrize("shape,seed,plen,weights,drafter", [
    pytest.param(*m, w, d, id=f"{m[0]}-{m[1]}-{m[2]}-{w}-{d}",
                 marks=() if (m[0], w, d) in _LOSSLESS_FAST else pytest.mark.slow)
    for m in _LOSSLESS_MODELS for w in ("bf16", "w12") for d in ("ngram", "self")])
def test_lossless_gpu(checkpoints, shape, seed, plen, weights, drafter):
    path, model = checkpoints[shape]
    eng = Engine.from_pretrained(path, device="cuda", weights=weights, drafter=drafter)
    assert eng.graphs
    _check(eng, _prompt(model.config.vocab_size, plen, seed), 300)


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["ngram", "self"])
@pytest.mark.parametrize("paired", [True, False], ids=["swiglu-with-product", "glue-swiglu"])
def test_lossless_gpu_swiglu_paths(checkpoints, monkeypatch, drafter, paired):
    """SPECPILOT_W12_SWIGLU=1 (the default): each MLP's gate and up rows paired and SwiGLU with the product
    (w12.matmul_swiglu: the flow kernel's epilogue), at the autoregressive step's one row and the verify step's many;
    =0: unpaired rows, the product, then the glue's SwiGLU kernel."""
    monkeypatch.setenv("SPECPILOT_W12_SWIGLU", "1" if paired else "0")
    path, model = checkpoints["gdn-k1v4-d128-v64"]
    eng = Engine.from_pretrained(path, device="cuda", weights="w12", drafter=drafter)
    assert eng.graphs
    assert all(L["gate_up"].paired is paired for L in eng.model.layers)
    _check(eng, _prompt(model.config.vocab_size, 40, 2), 300)


def test_swiglu_in_the_flow_epilogue_is_lossless_cpu(checkpoints, monkeypatch):
    """The engine's paired gate-and-up path on the CPU (the runtime layout taken there too; w12.matmul_swiglu's
    reference path): speculative output equals autoregressive, from a W12 model built so and from a BF16 model
    converted in place (`to_w12`)."""
    from specpilot.engine.model import HybridModel

    monkeypatch.setenv("SPECPILOT_W12_SWIGLU", "1")
    monkeypatch.setattr(HybridModel, "_wants_tiled", lambda self, fmt: fmt == "w12")
    path, model = checkpoints["gdn-k1v4-d128-v64"]
    eng = Engine.from_pretrained(path, device="cpu", weights="w12", drafter="ngram")
    assert all(L["gate_up"].paired for L in eng.model.layers)
    _check(eng, _prompt(model.config.vocab_size, 40, 2), 24)
    bf = Engine.from_pretrained(path, device="cpu", drafter="ngram")
    bf.model.to_w12()
    assert all(L["gate_up"].paired for L in bf.model.layers)
    _check(bf, _prompt(model.config.vocab_size, 40, 2), 32)


@pytest.mark.gpu
def test_graphs_replay_the_eager_steps(checkpoints):
    path, model = checkpoints["gdn3-attn1-v97"]
    prompt = _prompt(97, 50, 4)
    outs = []
    for graphs in (False, True):
        eng = Engine.from_pretrained(path, device="cuda", drafter="ngram", graphs=graphs)
        outs.append((eng.generate(prompt, 64, speculative=True), eng.generate(prompt, 64, speculative=False)))
    assert outs[0] == outs[1]


def test_commit_leaves_the_caches_of_the_accepted_tokens(checkpoints):
    # after speculative steps the GDN states, conv states and KV slots are those of autoregressive decoding over
    # the same tokens: rejected nodes leave no trace (the torch references give the same K/V bits here, the fp32
    # states agree to rounding)
    path, model = checkpoints["gdn3-attn1-v97"]
    prompt = _prompt(97, 30, 5)
    spec = Engine.from_pretrained(path, device="cpu", drafter="ngram")
    ctx = spec._start(prompt)
    while len(ctx) < len(prompt) + 60:
        ctx.extend(spec._step(ctx, True))
    assert spec.stats()["verify"]["tau"] > 1.5  # several nodes accepted per step: the tree path was exercised
    ar = Engine.from_pretrained(path, device="cpu", drafter=None)
    actx = ar._start(prompt)
    while len(actx) < len(ctx):
        actx.extend(ar._step(actx, False))
    assert actx == ctx
    n = len(ctx) - 1  # tokens in the caches
    a, b = spec.model, ar.model
    # one token more or less moves the states by their own size (measured: 3e-3 on states of 3e-3)
    torch.testing.assert_close(a.state[:, 0], b.state[:, 0], rtol=1e-5, atol=1e-8)
    assert torch.equal(a.conv_state[:, 0], b.conv_state[:, 0])
    assert torch.equal(a.k_cache[:, :n], b.k_cache[:, :n]) and torch.equal(a.v_cache[:, :n], b.v_cache[:, :n])


@pytest.mark.parametrize("shape,seed,plen", [("gdn3-attn1-v97", 6, 40)])
def test_two_level_verification_is_lossless_cpu(checkpoints, shape, seed, plen):
    # the Q pass (W12 8-bit view) only shapes the tree; the exact pass decides every token
    path, model = checkpoints[shape]
    eng = Engine.from_pretrained(path, device="cpu", drafter="ngram", two_level=True)
    _check(eng, _prompt(model.config.vocab_size, plen, seed), 256)
    q = eng.stats()["q_pass"]
    assert q["compared"] > 0 and 0.5 < q["agreement"] <= 1.0


def test_graphed_step_buffers_replay_the_eager_steps_cpu(checkpoints):
    # GraphedStep's per-step refill (padded trees, host-built plan copied in, attention schedule updated from
    # host tensors) run without a graph: replay = the captured body, so every buffer the graph would read is
    # the one load() wrote
    from specpilot.engine.graphs import GraphedStep

    class Replayed(GraphedStep):
        def capture(self):
            pass

        def replay(self):
            return self._body()

    path, _ = checkpoints["gdn3-attn1-v97"]
    prompt = _prompt(97, 30, 7)
    eager = Engine.from_pretrained(path, device="cpu", drafter="ngram")
    want = (eager.generate(prompt, 48, speculative=True), eager.generate(prompt, 24, speculative=False))
    eng = Engine.from_pretrained(path, device="cpu", drafter="ngram")
    eng.graphs = True
    eng._graphs = {n: Replayed(eng.model, n, eng.max_depth) for n in (1, eng.tree_nodes)}
    got = (eng.generate(prompt, 48, speculative=True), eng.generate(prompt, 24, speculative=False))
    assert got == want
    assert eng.stats()["verify"]["mean_nodes"] == eng.tree_nodes  # every verify pass ran the padded 32 rows


def test_fast_gpu_tier_covers_every_pair():
    """The six combinations in `make test-gpu` meet every value pair of any two of model, format and drafter."""
    import itertools

    models = [m[0] for m in _LOSSLESS_MODELS]
    axes = [models, ["bf16", "w12"], ["ngram", "self"]]
    for a, b in itertools.combinations(range(3), 2):
        assert {(c[a], c[b]) for c in _LOSSLESS_FAST} == set(itertools.product(axes[a], axes[b]))
