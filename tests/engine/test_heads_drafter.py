"""The trained parallel drafter (specpilot.engine.spec.heads, drafter="heads") on the shipped tiny model: its
shapes and log-probabilities, the shipped weights, outputs identical to autoregressive decoding as a chain of 8, a
chain of 16 and a 32-node tree, the hidden state the engine hands it, the training script, and bad inputs."""

import json

import pytest
import torch

from specpilot.engine import Engine
from specpilot.engine.spec.heads import HeadsDims, HeadsDrafter, HeadsNet, embed_sha256
from specpilot.models import HEADS_FILE, HELDOUT_FILE, TRAIN_FILE, tiny_stdlib_heads_path, tiny_stdlib_path
from specpilot.testing import raises_helpful

CKPT = tiny_stdlib_path()
HEADS = tiny_stdlib_heads_path()
PROMPT = list((CKPT / HELDOUT_FILE).read_bytes()[1000:1300])  # held-out text: the heads never trained on it

MODES = {"chain8": dict(positions=8, topk=1, tree_nodes=9), "chain16": dict(positions=16, topk=1, tree_nodes=17),
         "tree32": dict(positions=16, topk=4, tree_nodes=32)}


@pytest.fixture(scope="module")
def drafter():
    return HeadsDrafter.load(HEADS / HEADS_FILE)


@pytest.fixture(scope="module")
def autoregressive():
    eng = Engine.from_pretrained(CKPT, device="cpu", weights="w12", drafter=None)
    return eng.generate(PROMPT, 96, speculative=False)


def test_shipped_weights_load(drafter):
    f = HEADS / HEADS_FILE
    assert f.stat().st_size < 2_000_000
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as g:
        assert {g.get_tensor(k).dtype for k in g.keys()} == {torch.bfloat16}
    assert drafter.dims.hidden == 128 and drafter.dims.vocab == 256 and drafter.dims.positions == 16
    rec = json.loads((HEADS / TRAIN_FILE).read_text())
    assert rec["weights"]["bytes"] == f.stat().st_size
    assert rec["wall_time_s"]["total"] <= 600  # trained on the CPU in at most 10 minutes
    # the heads were trained for the shipped model: its embedding digest is the one the file records
    eng = Engine.from_pretrained(CKPT, device="cpu", weights="w12", drafter="heads")
    assert isinstance(eng.drafter, HeadsDrafter)
    assert drafter.target_embed_sha256 == embed_sha256(eng.model.embed)


@pytest.mark.parametrize("positions,k", [(8, 1), (16, 4), (20, 3), (5, 300)])
def test_shapes_and_log_probabilities(drafter, positions, k):
    g = torch.Generator().manual_seed(positions)
    hidden = torch.randn(128, generator=g).bfloat16()
    tokens, scores = drafter.propose(PROMPT, positions, k, hidden=hidden)
    assert tokens.shape == scores.shape == (positions, k)
    assert tokens.dtype == torch.int64 and scores.dtype == torch.float32
    P, kk = min(positions, 16), min(k, 256)
    logp = torch.log_softmax(drafter.logits(hidden, PROMPT[-1]), -1)  # [16, 256]
    # each row: the top-k of its head's log-softmax, by threshold and set (ties are legal)
    assert torch.allclose(logp.exp().sum(-1), torch.ones(16), atol=1e-5)
    for d in range(P):
        kth = logp[d].topk(kk).values[-1]
        assert torch.equal(scores[d, :kk], logp[d, tokens[d, :kk]])
        assert (scores[d, :kk] >= kth).all() and len(set(tokens[d, :kk].tolist())) == kk
        assert (scores[d, :kk][:-1] >= scores[d, :kk][1:]).all()
    assert torch.isneginf(scores[P:]).all() and (tokens[P:] == 0).all()
    assert torch.isneginf(scores[:, kk:]).all()
    # no hidden state (a one-token prompt) or an empty context: nothing proposed
    for ctx, h in ((PROMPT, None), ([], hidden)):
        t, s = drafter.propose(ctx, positions, k, hidden=h)
        assert torch.isneginf(s).all() and (t == 0).all()


@pytest.mark.parametrize("mode", list(MODES))
def test_outputs_identical_to_autoregressive(autoregressive, mode):
    eng = Engine.from_pretrained(CKPT, device="cpu", weights="w12", drafter="heads", **MODES[mode])
    out = eng.generate(PROMPT, 96, speculative=True)
    assert out == autoregressive
    st = eng.stats()["verify"]
    assert st["tau"] > 1.5, st  # the heads' drafts were accepted: the speculative path was exercised
    assert st["mean_nodes"] <= MODES[mode]["tree_nodes"]


def test_engine_hands_the_hidden_state_of_the_token_before_the_pending_one(drafter):
    # the hidden state handed to propose is the target's final-normed state of context[-2]: its argmax (the
    # certified head) is context[-1] after every step (prefill: the prompt's last token is given, not chosen)
    seen = []

    class Spy(HeadsDrafter):
        def propose(self, context, positions, k, *, hidden=None):
            seen.append((list(context), None if hidden is None else hidden.clone()))
            return super().propose(context, positions, k, hidden=hidden)

    eng = Engine.from_pretrained(CKPT, device="cpu", weights="w12", drafter=Spy(drafter.net,
                                 drafter.target_embed_sha256), positions=8, topk=2, tree_nodes=12)
    eng.generate(PROMPT[:50], 40, speculative=True)
    assert len(seen) >= 3
    ref = Engine.from_pretrained(CKPT, device="cpu", weights="w12", drafter=None)
    for ctx, hidden in seen:
        ref.model.reset_rows([0])
        want = ref.model.consume(0, 0, ctx[:-1], hidden=True)[-1]
        assert hidden.shape == want.shape and hidden.dtype == torch.bfloat16
        if len(ctx) > 50:  # after a step: the pending token is the target's argmax of this state
            assert int(ref.model.argmax(hidden[None])[0]) == ctx[-1]
        # the same state as a teacher-forced pass over the context (other pass shapes: BF16 rounding apart)
        assert (hidden.float() - want.float()).abs().max() <= 0.1 * want.float().abs().max()
    # a one-token prompt: the target has processed nothing, the first proposal gets no state (and proposes nothing),
    # the next ones get the state of the step before
    seen.clear()
    one = eng.generate(PROMPT[:1], 24, speculative=True)
    assert seen[0] == (PROMPT[:1], None) and all(h is not None for _, h in seen[1:])
    assert one == ref.generate(PROMPT[:1], 24, speculative=False)


def test_graphed_step_hands_its_hidden_states(autoregressive):
    # GraphedStep's body run without a graph (as tests/engine/test_lossless.py does for the n-gram drafter): the
    # hidden states the drafter reads come from the step's own outputs, and the output is still greedy decoding's
    from specpilot.engine.graphs import GraphedStep

    class Replayed(GraphedStep):
        def capture(self):
            pass

        def replay(self):
            return self._body()

    eng = Engine.from_pretrained(CKPT, device="cpu", weights="w12", drafter="heads")
    eng.graphs = True
    eng._graphs = {n: Replayed(eng.model, n, eng.max_depth) for n in (1, eng.tree_nodes)}
    assert eng.generate(PROMPT, 96, speculative=True) == autoregressive
    assert eng.stats()["verify"]["tau"] > 1.5


def test_training_script_runs(tmp_path):
    from specpilot.models import train_heads

    lines = []
    rec = train_heads.train(tmp_path, steps=3, prompts=2, eval_prompts=2, seed=1, log=lines.append)
    d = HeadsDrafter.load(tmp_path / HEADS_FILE)
    assert d.dims == HeadsDims(hidden=128, vocab=256)
    assert rec["steps"] == 3 and rec["data"]["train_examples"] == 2 * (train_heads.GEN_LEN - 16 + 1)
    assert len(rec["metrics"]["eval"]["top1_per_position"]) == 16
    assert json.loads((tmp_path / TRAIN_FILE).read_text())["seed"] == 1
    assert any(line.startswith("step 3/3") for line in lines)
    # seeded: a second run with the same seed and threads writes the same weights, bit for bit
    again = train_heads.train(tmp_path / "again", steps=3, prompts=2, eval_prompts=2, seed=1, log=lines.append)
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / HEADS_FILE), load_file(tmp_path / "again" / HEADS_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)
    assert again["metrics"] == rec["metrics"]


def test_bad_inputs_raise(drafter):
    h = torch.zeros(128)
    with raises_helpful("specpilot.engine.spec.heads", "HeadsDrafter.propose: hidden"):
        drafter.propose(PROMPT, 8, 1, hidden=torch.zeros(64))
    with raises_helpful("specpilot.engine.spec.heads", "positions=0"):
        drafter.propose(PROMPT, 0, 1, hidden=h)
    with raises_helpful("specpilot.engine.spec.heads", "k=True"):
        drafter.propose(PROMPT, 8, True, hidden=h)
    with raises_helpful("specpilot.engine.spec.heads", "token id 300"):
        drafter.propose([1, 300], 8, 1, hidden=h)
    with raises_helpful("specpilot.engine.spec.heads", "HeadsDrafter.load", "train_heads", exc=FileNotFoundError):
        HeadsDrafter.load(CKPT / "missing.safetensors")
    with raises_helpful("specpilot.engine.spec.heads", "HeadsDrafter.load", "dims"):
        HeadsDrafter.load(CKPT / "model.w12.safetensors")
    with raises_helpful("specpilot.engine.spec.heads", "HeadsNet"):
        HeadsDrafter(torch.nn.Linear(2, 2))
    eng = Engine.from_pretrained(CKPT, device="cpu", weights="w12", drafter=None)
    with raises_helpful("specpilot.engine", "from_pretrained"):
        Engine(eng.model, "heads")
    with raises_helpful("specpilot.engine", "hidden size is 128"):
        Engine(eng.model, HeadsDrafter(HeadsNet(HeadsDims(hidden=64, vocab=256))))
    with raises_helpful("specpilot.engine", "two_level"):
        Engine(eng.model, drafter, two_level=True)
    with raises_helpful("specpilot.engine", "Engine.from_pretrained", "'heads'"):
        Engine.from_pretrained(CKPT, device="cpu", drafter="medusa")
    spec = Engine(eng.model, drafter)
    with raises_helpful("specpilot.engine", "generate_batch", "hidden states"):
        spec.generate_batch([PROMPT[:20]], 4)


def test_other_models_are_refused(checkpoints):
    path, _ = checkpoints["gdn3-attn1-v97"]
    with raises_helpful("specpilot.engine", "Engine.from_pretrained", "train_heads"):
        Engine.from_pretrained(path, device="cpu", drafter="heads")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_outputs_identical_to_autoregressive_gpu(mode):
    # the kernels, every step one CUDA graph: the hidden states come from the graphed step's outputs
    eng = Engine.from_pretrained(CKPT, device="cuda", weights="w12", drafter="heads", **MODES[mode])
    assert eng.graphs
    want = eng.generate(PROMPT, 128, speculative=False)
    eng.reset_stats()
    assert eng.generate(PROMPT, 128, speculative=True) == want
    assert eng.stats()["verify"]["tau"] > 1.5
