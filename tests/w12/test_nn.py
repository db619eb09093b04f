"""W12Linear and convert(): in-place conversion of plain and HF transformers models (built offline)."""

import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import w12
from specpilot.testing import assert_bitwise_equal


@pytest.fixture
def exact_ops(monkeypatch):
    """Stand-in `w12.ops` whose matmul is F.linear on the exact unpacked weight, so a converted
    model must reproduce the original bit for bit (this tests conversion, not the kernels)."""
    fake = types.ModuleType("w12.ops")
    fake.matmul = lambda x, w, bias=None: F.linear(x, w.unpack(), bias)
    monkeypatch.setitem(sys.modules, "w12.ops", fake)
    return fake


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(75, 63), nn.GELU(), nn.Linear(63, 33, bias=False)).to(torch.bfloat16)


def test_from_linear_and_forward(exact_ops):
    torch.manual_seed(0)
    lin = nn.Linear(75, 63).to(torch.bfloat16)
    wl = w12.W12Linear.from_linear(lin)
    assert (wl.in_features, wl.out_features) == (75, 63)
    assert_bitwise_equal(wl.weight.unpack(), lin.weight.detach())
    x = torch.randn(4, 75).bfloat16()
    assert_bitwise_equal(wl(x), lin(x).detach())
    assert "bits_per_weight" in repr(wl)


def test_from_linear_rejects_non_bf16():
    with pytest.raises(TypeError, match=r"\.to\(torch\.bfloat16\)"):
        w12.W12Linear.from_linear(nn.Linear(4, 4))


@pytest.mark.parametrize("layout", ["runtime", "planes"])
def test_buffers_follow_module(exact_ops, layout):
    wl = w12.W12Linear.from_linear(nn.Linear(64, 8).to(torch.bfloat16), layout=layout)
    assert wl.is_tiled == (layout == "runtime")
    names = {n for n, _ in wl.named_buffers()}
    held = w12.layout.TENSORS if layout == "runtime" else w12.format.PLANES
    assert names == {f"w_{p}" for p in held}
    before = wl.weight
    dtypes = {n: b.dtype for n, b in wl.named_buffers()}
    wl.to(torch.float16)  # casts leave the integer buffers alone; bias follows
    assert {n: b.dtype for n, b in wl.named_buffers()} == dtypes and wl.bias.dtype == torch.float16
    assert wl.weight.tensors()[0].dtype == torch.uint8 if layout == "runtime" else wl.w_hi.dtype == torch.uint8
    sd = wl.state_dict()
    assert set(sd) == {f"w_{p}" for p in w12.format.PLANES} | {"bias"}  # the version-1 planes either way
    wl2 = w12.W12Linear.from_linear(nn.Linear(64, 8).to(torch.bfloat16), layout=layout).to(torch.float16)
    wl2.load_state_dict(sd)
    assert_bitwise_equal(wl2.weight.unpack(), before.unpack())


def _escape_heavy_mlp(seed, n_escapes, layout="runtime"):
    """A converted MLP whose first layer has `n_escapes` escapes (so two of them differ in escape count)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(75, 63), nn.GELU(), nn.Linear(63, 33, bias=False)).to(torch.bfloat16)
    special = torch.tensor([1e30, -1e-30, float("inf"), float("nan"), -3e20, 0.0, -0.0], dtype=torch.bfloat16)
    with torch.no_grad():
        model[0].weight.view(-1)[: n_escapes] = special.repeat(n_escapes // len(special) + 1)[:n_escapes] * 1
    w12.convert(model, layout=layout)
    return model


@pytest.mark.parametrize("n_src, n_dst", [(40, 0), (0, 40), (7, 300)], ids=["more-escapes", "fewer", "many"])
def test_state_dict_round_trip_between_converted_models(exact_ops, n_src, n_dst):
    src, dst = _escape_heavy_mlp(0, n_src), _escape_heavy_mlp(1, n_dst)
    assert src[0].weight.num_escapes != dst[0].weight.num_escapes
    x = torch.randn(3, 75).bfloat16()
    want = src(x)
    result = dst.load_state_dict(src.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    for a, b in ((src[0], dst[0]), (src[2], dst[2])):
        assert_bitwise_equal(b.weight.unpack(), a.weight.unpack())
        assert b.weight.num_escapes == a.weight.num_escapes
    assert_bitwise_equal(dst(x), want)
    # torch.save / torch.load(weights_only=True) of the state dict goes the same way
    import io

    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst2 = _escape_heavy_mlp(2, n_dst)
    dst2.load_state_dict(torch.load(buf, weights_only=True))
    assert_bitwise_equal(dst2(x), want)


@pytest.mark.parametrize("layout", ["runtime", "planes"])
def test_load_state_dict_rejects_bad_planes(exact_ops, layout):
    src, dst = _escape_heavy_mlp(0, 10), _escape_heavy_mlp(1, 0, layout)
    sd = src.state_dict()
    bad = dict(sd)
    bad["0.w_esc_col"] = sd["0.w_esc_col"][:-1].clone()  # no longer matches esc_val / esc_rowptr
    with pytest.raises(RuntimeError, match="esc_col .* and esc_val .* must be 1-D of equal length"):
        dst.load_state_dict(bad)
    bad = dict(sd)
    bad["0.w_esc_col"] = sd["0.w_esc_col"].flip(0).contiguous()  # columns out of order
    bad["0.w_esc_col"][0] = 1000
    with pytest.raises(RuntimeError, match=r"0 is invalid after loading: w12.W12Weight: esc_col\[0\] = 1000 is outside"):
        dst.load_state_dict(bad)
    bad = dict(sd)
    bad["0.w_hi"] = torch.zeros(63, 64, dtype=torch.uint8)  # K padded to 64, not 128
    # a planes layer has a w_hi buffer of the right shape; a runtime-layout layer checks the planes it tiles
    with pytest.raises(RuntimeError, match="size mismatch for 0.w_hi" if layout == "planes" else
                       r"0 is invalid after loading: w12.W12Weight: hi has 64 columns but K=75 pads to 128"):
        dst.load_state_dict(bad)
    partial = {k: v for k, v in sd.items() if k != "0.w_esc_val"}
    with pytest.raises(RuntimeError, match=r"planes \['0.w_esc_val'\] are missing"):
        dst.load_state_dict(partial, strict=False)


def test_empty_shell_loads_on_meta(exact_ops):
    src = _escape_heavy_mlp(0, 9)
    with torch.device("meta"):
        shell = nn.Sequential(w12.W12Linear.empty(75, 63), nn.GELU(), w12.W12Linear.empty(63, 33, bias=False))
    assert shell[0].w_hi.is_meta and shell[0].w_esc_col.shape == (0,)
    shell.load_state_dict(src.state_dict(), assign=True)
    x = torch.randn(2, 75).bfloat16()
    assert_bitwise_equal(shell(x), src(x))


def test_convert_mlp(exact_ops):
    model = _mlp()
    x = torch.randn(3, 75).bfloat16()
    want = model(x).detach()
    report = w12.convert(model)
    assert isinstance(model[0], w12.W12Linear) and isinstance(model[2], w12.W12Linear)
    assert report.num_converted == 2 and not report.skipped
    assert report.bytes_before == 2 * (63 * 75 + 33 * 63)
    assert report.bytes_after == model[0].weight.nbytes + model[2].weight.nbytes
    assert report.bits_per_weight == pytest.approx(8 * report.bytes_after / (63 * 75 + 33 * 63))
    assert_bitwise_equal(model(x), want)
    s = str(report)
    assert "2 linear layers converted" in s and "bits per weight" in s


def test_convert_skips_and_patterns():
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "a": nn.Linear(8, 8).to(torch.bfloat16),
        "b": nn.Linear(8, 8),  # fp32: skipped
        "c": nn.Linear(8, 8).to(torch.bfloat16),
        "d": nn.Linear(8, 8).to(torch.bfloat16),
    })
    model["d"].weight = model["a"].weight  # tied
    with pytest.raises(TypeError, match=r"^w12\.convert: nothing to convert: 1 matching linear layers hold "
                                        r"torch\.float32 weights \(e\.g\. 'b'\).*; cast the model first"):
        w12.convert(model, include=["a", "b", "c*", "d"], exclude="c")  # only b could be, and it is fp32
    report = w12.convert(model, include=["a", "c*", "d"], exclude="c")
    assert [r.name for r in report.converted] == []
    reasons = dict(report.skipped)
    assert "tied to" in reasons["a"] and "tied to" in reasons["d"]
    assert "c" not in reasons  # excluded silently
    with pytest.raises(ValueError, match=r"^w12\.convert: include='mlp' matches none of the model's 4 linear layers"):
        w12.convert(model, include="mlp")
    model["d"].weight = nn.Parameter(model["a"].weight.detach().clone())
    report = w12.convert(model, exclude="c")
    assert sorted(r.name for r in report.converted) == ["a", "d"]
    assert isinstance(model["c"], nn.Linear) and isinstance(model["b"], nn.Linear)
    assert "skipped b: weight is torch.float32" in str(report)
    with pytest.raises(TypeError, match="nn.Module"):
        w12.convert(object())


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


@pytest.mark.slow
def test_convert_hf_llama(exact_ops):
    model = _tiny_llama()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    report = w12.convert(model, exclude="lm_head")
    assert report.num_converted == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert all(r.name.startswith("model.layers.") for r in report.converted)
    assert isinstance(model.model.layers[1].mlp.down_proj, w12.W12Linear)
    assert isinstance(model.lm_head, nn.Linear)
    with torch.no_grad():
        got = model(ids).logits
    assert_bitwise_equal(got, want)
    # the runtime layout: no padding (the planes pad down_proj's K = 96 to 128), 40 bits of row metadata per row
    assert 12.0 < report.bits_per_weight < 12.7


def test_convert_hf_tied_lm_head():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    report = w12.convert(model, include="lm_head")
    assert report.num_converted == 0 and "tied to" in dict(report.skipped)["lm_head"]


def test_w12linear_real_ops_small():
    from specpilot.testing import assert_close

    torch.manual_seed(0)
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    wl = w12.W12Linear.from_linear(lin)
    x = torch.randn(2, 64).bfloat16()
    ref = w12.matmul_reference(x, wl.weight, wl.bias)
    assert_close(wl(x), ref, lin(x).detach())


# --- Hugging Face save_pretrained / from_pretrained through the registered "w12" quantizer -----------


def _llama_with_escapes(seed=0):
    model = _tiny_llama()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
        model.model.layers[0].mlp.down_proj.weight[0, :4] = torch.tensor([1e30, float("nan"), -1e-30, float("inf")])
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))


def test_hf_save_and_load_pretrained_bitwise(exact_ops, tmp_path):
    transformers = pytest.importorskip("transformers")
    import w12.hf

    model = _llama_with_escapes()
    report = w12.hf.quantize(model, exclude="lm_head")
    assert report.num_converted == 14 and model.model.layers[0].mlp.down_proj.weight.num_escapes >= 4
    want = _logits(model, IDS)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "w12" and len(cfg["modules"]) == 14 and "lm_head" not in cfg["modules"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded.model.layers[1].self_attn.q_proj, w12.W12Linear)
    assert isinstance(loaded.lm_head, nn.Linear)
    # the runtime layout on both sides: quantize converts to it, loading tiles the planes of the checkpoint
    w12_layers = [m for mod in (model, loaded) for m in mod.modules() if isinstance(m, w12.W12Linear)]
    assert len(w12_layers) == 28 and all(m.is_tiled for m in w12_layers)
    down = loaded.model.layers[0].mlp.down_proj.weight
    assert down.num_escapes == model.model.layers[0].mlp.down_proj.weight.num_escapes
    assert_bitwise_equal(_logits(loaded, IDS), want)
    # saved again from the loaded model, loaded again: still the same
    loaded.save_pretrained(tmp_path / "again")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert_bitwise_equal(_logits(again, IDS), want)


def test_hf_round_trip_qwen2_biases_and_tied_head(exact_ops, tmp_path):
    """q/k/v carry biases; lm_head is tied to the embedding (skipped by convert, restored by tying)."""
    transformers = pytest.importorskip("transformers")
    import w12.hf

    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    # built in BF16 (not cast afterwards: a cast also rounds the rotary inv_freq buffer, which loading does not)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    report = w12.hf.quantize(model)
    assert report.num_converted == 14 and "tied to" in dict(report.skipped)["lm_head"]
    want = _logits(model, IDS)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    q = loaded.model.layers[1].self_attn.q_proj
    assert isinstance(q, w12.W12Linear) and q.bias is not None
    assert_bitwise_equal(q.bias, model.model.layers[1].self_attn.q_proj.bias)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert_bitwise_equal(_logits(loaded, IDS), want)


def test_hf_convert_while_loading_bf16_checkpoint(exact_ops, tmp_path):
    transformers = pytest.importorskip("transformers")
    import w12.hf

    model = _llama_with_escapes(1)
    want = _logits(model, IDS)
    model.save_pretrained(tmp_path / "bf16")
    q = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", dtype=torch.bfloat16, quantization_config=w12.hf.W12Config(exclude=["lm_head"]))
    assert isinstance(q.model.layers[0].mlp.up_proj, w12.W12Linear) and isinstance(q.lm_head, nn.Linear)
    assert q.model.layers[0].mlp.up_proj.is_tiled
    assert_bitwise_equal(_logits(q, IDS), want)  # exact_ops: the lossless weights give the BF16 model's logits
    q.save_pretrained(tmp_path / "w12")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "w12")
    assert_bitwise_equal(_logits(back, IDS), want)


def _edit_checkpoint(path, fn):
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    sd = load_file(str(f))
    fn(sd)
    save_file(sd, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("edit, match", [
    (lambda sd: sd.pop("model.layers.0.mlp.down_proj.w_esc_val"), r"not loaded .*down_proj\.w_esc_val"),
    (lambda sd: sd.pop("model.layers.1.self_attn.q_proj.w_hi"), r"not loaded .*q_proj\.w_hi"),
    (lambda sd: sd.pop("model.norm.weight"), r"not loaded .*model\.norm\.weight"),
    (lambda sd: sd.update({"model.layers.0.mlp.up_proj.w_lo": torch.zeros(96, 16, dtype=torch.uint8)}),
     r"ignore_mismatched_sizes"),  # transformers' own size check raises (RuntimeError)
    (lambda sd: sd.update({"model.layers.0.mlp.down_proj.w_esc_col":
                           sd["model.layers.0.mlp.down_proj.w_esc_col"][:-1].clone()}),
     "down_proj' is invalid"),
    (lambda sd: sd["model.layers.0.mlp.down_proj.w_esc_col"].fill_(500), "down_proj' is invalid: w12.W12Weight: esc_col"),
], ids=["missing-escapes", "missing-hi", "missing-norm", "wrong-shape-lo", "short-escape-list", "bad-escape-col"])
def test_hf_load_refuses_missing_or_bad_weights(exact_ops, tmp_path, edit, match):
    transformers = pytest.importorskip("transformers")
    import w12.hf

    model = _llama_with_escapes()
    w12.hf.quantize(model, exclude="lm_head")
    model.save_pretrained(tmp_path)
    _edit_checkpoint(tmp_path, edit)
    with pytest.raises((w12.W12CheckpointError, RuntimeError), match=match):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_hf_config_checks(tmp_path):
    pytest.importorskip("transformers")
    import w12.hf

    assert w12.hf.W12Config.from_dict(w12.hf.W12Config(exclude="x", modules=["b", "a"]).to_dict()).modules == ["a", "b"]
    with pytest.raises(w12.W12CheckpointError, match="format version 9"):
        w12.hf.W12Config(format_version=9)
    with pytest.raises(ValueError, match="unknown fields"):
        w12.hf.W12Config(bits=4)
    with pytest.raises(w12.W12CheckpointError, match="no 'modules' list"):
        w12.hf.W12HfQuantizer(w12.hf.W12Config(), pre_quantized=True)


# --- a `specpilot pack` output loads into a runnable model -------------------------------------------


def test_pack_output_loads_into_model(exact_ops, tmp_path):
    transformers = pytest.importorskip("transformers")
    from specpilot import cli

    model = _llama_with_escapes(2)
    want = _logits(model, IDS)
    model.save_pretrained(tmp_path / "bf16")
    src, dst = tmp_path / "bf16" / "model.safetensors", tmp_path / "packed.safetensors"
    assert cli.main(["pack", str(src), str(dst)]) == 0
    fresh = transformers.LlamaForCausalLM(model.config).to(torch.bfloat16).eval()  # other random weights
    report = w12.load_model_weights(fresh, dst)
    # 7 per layer and lm_head; the embedding is decoded to BF16; down_proj (K = 96) packed too: 12.4 bits per weight
    # in the runtime layout (16.4 as version-1 planes padded to 128 columns, which the pack report warns about)
    assert report.num_converted == 15
    assert isinstance(fresh.model.layers[0].mlp.up_proj, w12.W12Linear) and isinstance(fresh.lm_head, w12.W12Linear)
    assert fresh.model.layers[0].mlp.up_proj.is_tiled and fresh.lm_head.is_tiled
    assert fresh.model.layers[0].mlp.down_proj.is_tiled
    assert_bitwise_equal(fresh.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert_bitwise_equal(_logits(fresh, IDS), want)


def test_load_model_weights_is_strict(exact_ops, tmp_path):
    model = _mlp()
    w12.save_file(tmp_path / "ok.safetensors", {"0.weight": w12.pack(model[0].weight.detach()),
                                               "0.bias": model[0].bias.detach(),
                                               "2.weight": w12.pack(model[2].weight.detach())})
    x = torch.randn(3, 75).bfloat16()
    want = model(x).detach()
    fresh = nn.Sequential(nn.Linear(75, 63), nn.GELU(), nn.Linear(63, 33, bias=False)).to(torch.bfloat16)
    w12.load_model_weights(fresh, tmp_path / "ok.safetensors")
    assert_bitwise_equal(fresh(x), want)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(75, 63), nn.GELU(), nn.Linear(63, 33, bias=False)).to(torch.bfloat16)
    w12.load_model_weights(meta, tmp_path / "ok.safetensors")
    assert_bitwise_equal(meta(x), want)
    cases = {
        "missing": ({"0.weight": w12.pack(model[0].weight.detach()), "2.weight": w12.pack(model[2].weight.detach())},
                    r"not in the file: \['0.bias'\]"),
        "unexpected": ({"0.weight": model[0].weight.detach(), "0.bias": model[0].bias.detach(),
                        "2.weight": model[2].weight.detach(), "9.weight": torch.zeros(2)}, "'9.weight'|9.weight: in the file"),
        "shape": ({"0.weight": w12.pack(model[0].weight.detach()[:, :70].contiguous()), "0.bias": model[0].bias.detach(),
                   "2.weight": w12.pack(model[2].weight.detach())}, r"0.weight: W12 weight is \[63, 70\]"),
        "dtype": ({"0.weight": model[0].weight.detach().float(), "0.bias": model[0].bias.detach(),
                   "2.weight": model[2].weight.detach()}, "file has dtype torch.float32"),
    }
    for name, (tensors, match) in cases.items():
        w12.save_file(tmp_path / f"{name}.safetensors", tensors)
        fresh = nn.Sequential(nn.Linear(75, 63), nn.GELU(), nn.Linear(63, 33, bias=False)).to(torch.bfloat16)
        before = {k: v.clone() for k, v in fresh.state_dict().items()}
        with pytest.raises(w12.W12CheckpointError, match=match):
            w12.load_model_weights(fresh, tmp_path / f"{name}.safetensors")
        for k, v in fresh.state_dict().items():  # nothing changed
            assert_bitwise_equal(v, before[k])


# --- torch.compile (inductor) on the CPU --------------------------------------------------------------
# On the "torch" variant, w12.ops computes F.linear in fp32 and casts to the activation dtype. Traced
# inside the decomposed triton_op, inductor fused that cast with the next pointwise op (GELU) and the
# next layer's upcast and skipped the BF16 rounding in between (emulate_precision_casts is False by
# default), 1 ulp off eager. The variant therefore runs as the opaque op specpilot_w12::matmul_torch.


def _compile_case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160), nn.GELU(), nn.Linear(160, 64)).to(torch.bfloat16).eval()
    x = torch.randn(8, 96).bfloat16()
    return model, x


def _eager_and_compiled(model, x):
    import autotune

    torch._dynamo.reset()
    with torch.no_grad(), autotune.force("w12.matmul", variant="torch"):
        return model(x), torch.compile(model)(x)


@pytest.mark.slow
@pytest.mark.parametrize("converted", [False, True], ids=["nn-linear", "w12-converted"])
def test_compile_bitwise_equals_eager(converted):
    model, x = _compile_case()
    if converted:
        w12.convert(model)
    eager, compiled = _eager_and_compiled(model, x)
    assert_bitwise_equal(compiled, eager)


def test_importing_w12_after_transformers_registers_the_method():
    import subprocess
    import sys as _sys

    code = ("import transformers, w12; from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as m; "
            "print('w12' in m)")
    root = __file__.rsplit("/tests/", 1)[0]
    r = subprocess.run([_sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=240)
    assert r.stdout.strip() == "True", r.stderr[-2000:]
