"""The shipped tiny_stdlib checkpoint: W12 file -> exact BF16 weights -> Qwen3_5ForCausalLM, and
its held-out loss recomputed with the recipe that recorded it (specpilot.models.train_tiny.heldout_loss)."""

import copy
import hashlib
import json
import math

import pytest
import torch

import w12
from specpilot.models import CONFIG_FILE, HELDOUT_FILE, TRAIN_FILE, WEIGHTS_FILE, tiny_stdlib_path
from specpilot.models import train_tiny
from specpilot.testing import raises_helpful

transformers = pytest.importorskip("transformers")

CKPT = tiny_stdlib_path()


@pytest.fixture(scope="module")
def record():
    return json.loads((CKPT / TRAIN_FILE).read_text())


@pytest.fixture(scope="module")
def state():
    """The W12 file decoded through w12's public API, as the engine reads it."""
    entries = w12.load_file(CKPT / WEIGHTS_FILE, layout="planes")
    return entries, {k: (w12.unpack(v) if isinstance(v, w12.W12Weight) else v) for k, v in entries.items()}


@pytest.fixture(scope="module")
def model(state):
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig.from_pretrained(CKPT)
    cfg._attn_implementation = train_tiny.ATTN_IMPLEMENTATION
    m = transformers.Qwen3_5ForCausalLM(cfg).float()
    missing, unexpected = m.load_state_dict(state[1], strict=False)
    assert (missing, unexpected) == ([], []), f"missing {missing}, unexpected {unexpected}"
    return m.eval()


def test_shipped_files_and_config():
    for name in (CONFIG_FILE, WEIGHTS_FILE, HELDOUT_FILE, TRAIN_FILE):
        assert (CKPT / name).is_file(), name
    assert not (CKPT / "model.safetensors").exists(), "only the W12 file ships, not the BF16 one"
    cfg = json.loads((CKPT / CONFIG_FILE).read_text())
    assert cfg["model_type"] == "qwen3_5_text"
    assert cfg["vocab_size"] == 256 and cfg["head_dim"] == 64 and cfg["tie_word_embeddings"] is False
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["bos_token_id"] is None and cfg["eos_token_id"] is None and cfg["pad_token_id"] is None
    assert (CKPT / WEIGHTS_FILE).stat().st_size < 2_000_000


def test_record_describes_the_shipped_files(record):
    held = (CKPT / HELDOUT_FILE).read_bytes()
    assert hashlib.sha256(held).hexdigest() == record["heldout"]["sha256"]
    assert len(held) == record["heldout"]["bytes"] <= record["heldout"]["cap_bytes"]
    assert record["seed"] == train_tiny.DEFAULT_SEED
    assert not set(record["heldout"]["files"]) & set(record["corpus"]["files"])
    assert record["corpus"]["files"] == sorted(record["corpus"]["files"])
    assert (record["eval"]["ctx"], record["eval"]["max_bytes"]) == (train_tiny.EVAL_CTX, train_tiny.EVAL_MAX_BYTES)
    assert record["weights"]["bytes"] == (CKPT / WEIGHTS_FILE).stat().st_size


def test_w12_decodes_bit_exactly_to_the_recorded_bf16_weights(state, record):
    entries, sd = state
    want = record["weights"]["bf16_sha256"]
    assert sorted(sd) == sorted(want)
    for name, t in sd.items():
        assert t.dtype == torch.bfloat16, name
        assert torch.isfinite(t).all(), name
        assert train_tiny.tensor_sha256(t) == want[name], f"{name} does not decode to the BF16 weights it was packed from"
    packed = [k for k, v in entries.items() if isinstance(v, w12.W12Weight)]
    assert len(packed) == record["weights"]["tensors_packed"]
    assert "lm_head.weight" in packed and "model.layers.0.linear_attn.in_proj_qkv.weight" in packed


def test_model_parameter_count_and_dtype(model, record):
    assert sum(p.numel() for p in model.parameters()) == record["parameters"]
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_heldout_loss_matches_record(model, record):
    loss = train_tiny.heldout_loss(model, (CKPT / HELDOUT_FILE).read_bytes())
    m = record["metrics"]
    assert loss == pytest.approx(m["heldout_loss_nats_per_byte"], rel=1e-4)
    assert math.exp(loss) == pytest.approx(m["heldout_perplexity"], rel=1e-3)
    assert loss < 0.75 * m["unigram_loss_nats_per_byte"], "the model must beat the unigram baseline clearly"


def test_build_model_loads_the_same_weights(model):
    built = train_tiny.build_model()
    ref = model.state_dict()
    got = built.state_dict()
    assert sorted(got) == sorted(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_unigram_baseline_is_recomputable(record):
    """The baseline counts the training corpus; it is recomputed only where that corpus is the recorded one."""
    _, train_paths, _ = train_tiny.corpus_files()
    data = b"".join(p.read_bytes() for p in train_paths)
    if hashlib.sha256(data).hexdigest() != record["corpus"]["sha256"]:
        pytest.skip(f"this Python's standard library differs from the recorded one ({record['corpus']['python']})")
    uni = train_tiny.unigram_loss(data, (CKPT / HELDOUT_FILE).read_bytes())
    assert uni == pytest.approx(record["metrics"]["unigram_loss_nats_per_byte"], rel=1e-9)


def test_heldout_loss_rejects_a_bf16_model_and_short_text(model):
    with raises_helpful("specpilot.models.train_tiny", "float32"):
        train_tiny.heldout_loss(copy.deepcopy(model).to(torch.bfloat16), b"x" * 1024)
    with raises_helpful("specpilot.models.train_tiny", "ctx=512"):
        train_tiny.heldout_loss(model, b"x" * 100)
