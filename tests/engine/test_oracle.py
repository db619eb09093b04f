"""The engine's forward pass against `transformers`' own Qwen3.5 (the oracle): prefill logits (chunks of up to
64 tokens through the tree path) and decode logits (one-node steps through the autoregressive path), BF16 and
W12 weights, on tiny random checkpoints of several shapes."""

import pytest
import torch

from specpilot.engine import Engine
from specpilot.testing import assert_close

from engine_ckpt import SHAPES


def _oracle(model, ids):
    """(fp64 reference logits from an fp32 copy of the model, the BF16 model's own logits)."""
    import copy

    with torch.no_grad():
        ref = copy.deepcopy(model).float()(torch.tensor([ids])).logits[0].double()
        bf16 = model(torch.tensor([ids])).logits[0].float()
    return ref, bf16


def _ids(vocab, n, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("weights", ["bf16", "w12"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefill_logits_match_transformers(checkpoints, shape, weights):
    path, model = checkpoints[shape]
    ids = _ids(model.config.vocab_size, 150, seed=7)  # 150 tokens: three chunks, two chunk boundaries
    ref, bf16 = _oracle(model, ids)
    eng = Engine.from_pretrained(path, device="cpu", weights=weights, drafter=None)
    assert_close(eng.score(ids), ref, bf16, factor=2.0, msg=f"{shape}/{weights} prefill")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_logits_match_transformers(checkpoints, shape):
    path, model = checkpoints[shape]
    ids = _ids(model.config.vocab_size, 40, seed=8)
    ref, bf16 = _oracle(model, ids)
    eng = Engine.from_pretrained(path, device="cpu", drafter=None)
    assert_close(eng.score(ids, chunk=1), ref, bf16, factor=2.0, msg=f"{shape} decode")


def test_decode_and_prefill_paths_agree_on_the_argmax(checkpoints):
    path, model = checkpoints["gdn3-attn1-v97"]
    ids = _ids(97, 70, seed=9)
    eng = Engine.from_pretrained(path, device="cpu", drafter=None)
    a, b = eng.score(ids, chunk=1), eng.score(ids)
    top2 = a.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-2  # positions that are not near-ties
    assert int(clear.sum()) >= len(ids) // 2  # the comparison below covers most positions
    assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


def test_loader_rejects_what_it_cannot_run(tmp_path, checkpoints):
    from specpilot.testing import raises_helpful

    with raises_helpful("specpilot.engine", "config.json", exc=FileNotFoundError):
        Engine.from_pretrained(tmp_path, device="cpu")
    path, _ = checkpoints["gdn3-attn1-v97"]
    eng = Engine.from_pretrained(path, device="cpu", drafter=None)
    with raises_helpful("specpilot.engine", "drafter"):
        eng.generate([1, 2, 3], 4, speculative=True)
    with raises_helpful("specpilot.engine", r"\[0, 97\)"):
        eng.generate([1, 200], 4, speculative=False)
    with raises_helpful("specpilot.engine", "empty"):
        eng.generate([], 4, speculative=False)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bf16", "w12"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_logits_match_transformers(checkpoints, shape, weights):
    # the GPU kernels and the compiled glue: prefill (tree path) and decode (one-node steps) against the oracle
    path, model = checkpoints[shape]
    ids = _ids(model.config.vocab_size, 150, seed=7)
    ref, bf16 = _oracle(model, ids)
    eng = Engine.from_pretrained(path, device="cuda", weights=weights, drafter=None)
    assert_close(eng.score(ids).cpu(), ref, bf16, factor=2.0, msg=f"{shape}/{weights} prefill on the GPU")
    assert_close(eng.score(ids[:40], chunk=1).cpu(), ref[:40], bf16[:40], factor=2.0,
                 msg=f"{shape}/{weights} decode on the GPU")
