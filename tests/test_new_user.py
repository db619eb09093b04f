"""A new user's first hour with the operators, replayed: each step a user takes from the README, and what it
does. Every mistake raises one line "<pkg>.<fn>: what is wrong; how to fix", and every fix it names works.

Order: a converted model saved and loaded back (every path round-trips bit for bit or raises), the documented
submodules after `import <pkg>`, a fix message followed to the letter, variants on a CPU without the Triton
interpreter (a named kernel variant raises, only variant=None picks, `autotune.which_variant` and `specpilot info`
say what runs), raw-error mistakes of the public API, and `specpilot pack` on a tensor whose W12 form is larger
in memory than BF16.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import autotune
import gdn
import lmhead
import tree_attn
import w12
from specpilot.testing import assert_bitwise_equal

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _qwen3_5(seed: int = 0):
    """A tiny random BF16 Qwen3.5 hybrid (one GDN and one attention layer); K = 64 or 128 everywhere."""
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()


def _assert_same_state(got: nn.Module, want: nn.Module) -> None:
    a, b = got.state_dict(), want.state_dict()
    assert sorted(a) == sorted(b)
    for k in a:
        assert_bitwise_equal(a[k], b[k], k)


def _w12_layers(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, w12.W12Linear)]


# --------------------------------------------------------------------------------------------------------------
# A converted model, saved and loaded back: every path round-trips bit for bit or raises.


def test_converted_model_round_trips_through_save_pretrained(tmp_path):
    model = _qwen3_5()
    report = w12.convert(model)  # the README's Quickstart: "any nn.Module"
    assert report.num_converted == len(_w12_layers(model)) == 16
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert _w12_layers(loaded) == _w12_layers(model)  # W12 layers again, not random plain linears
    _assert_same_state(loaded, model)


def test_converted_submodule_refuses_save_pretrained_until_attached(tmp_path):
    model = _qwen3_5()
    w12.convert(model.model.layers[0])  # a part of the model: its config does not know
    with pytest.raises(w12.W12CheckpointError, match=r"^w12\.hf\.save_pretrained: the model holds 8 W12 layers but its "
                                                      r"config has no W12 quantization_config .*; call "
                                                      r"w12\.hf\.attach\(model\) before saving"):
        model.save_pretrained(tmp_path / "refused")
    assert not (tmp_path / "refused" / "model.safetensors").exists()
    w12.hf.attach(model)  # the fix the message names
    model.save_pretrained(tmp_path / "ok")
    _assert_same_state(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ok"), model)


def test_other_save_paths_round_trip_or_raise(tmp_path):
    model = _qwen3_5()
    w12.convert(model)
    sd = model.state_dict()

    # torch.save of the state dict: into a converted model, bitwise; into a plain BF16 model, an error
    torch.save(sd, tmp_path / "sd.pt")
    other = _qwen3_5(seed=1)
    w12.convert(other)
    other.load_state_dict(torch.load(tmp_path / "sd.pt"))
    _assert_same_state(other, model)
    with pytest.raises(RuntimeError, match="Missing key|Unexpected key"):
        _qwen3_5(seed=1).load_state_dict(torch.load(tmp_path / "sd.pt"))

    # the whole module pickled: back bitwise where pickles are allowed; refused by weights_only loading
    torch.save(model, tmp_path / "model.pt")
    _assert_same_state(torch.load(tmp_path / "model.pt", weights_only=False), model)
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        torch.load(tmp_path / "model.pt")

    # w12.save_file of the state dict (plain tensors, planes among them): bitwise into a converted model;
    # w12.load_model_weights into a fresh model refuses it (it wants W12 entries, not plane buffers)
    w12.save_file(tmp_path / "sd.safetensors", sd)
    third = _qwen3_5(seed=2)
    w12.convert(third)
    third.load_state_dict(w12.load_file(tmp_path / "sd.safetensors"))
    _assert_same_state(third, model)
    with pytest.raises(w12.W12CheckpointError, match=r"^w12\.load_model_weights: .* does not match the model"):
        w12.load_model_weights(_qwen3_5(seed=2), tmp_path / "sd.safetensors")

    # w12.save_file of the layers' weights (TiledW12s, written as the planes specpilot pack writes): bitwise into a
    # fresh model
    entries = {n: t for n, t in sd.items() if ".w_" not in n}
    entries.update({f"{n}.weight": model.get_submodule(n).weight for n in _w12_layers(model)})
    w12.save_file(tmp_path / "w12.safetensors", entries)
    fresh = _qwen3_5(seed=3)
    assert w12.load_model_weights(fresh, tmp_path / "w12.safetensors").num_converted == 16
    _assert_same_state(fresh, model)
    fresh.save_pretrained(tmp_path / "fresh")  # load_model_weights attached the W12 config too
    _assert_same_state(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fresh"), model)


# --------------------------------------------------------------------------------------------------------------
# Submodules a README or doc snippet names are there after `import <pkg>`.

DOCUMENTED = [("w12", "configs"), ("w12", "space"), ("w12", "cuda"), ("w12", "checkpoint"), ("w12", "hf"),
              ("w12", "ops"), ("gdn", "configs"), ("gdn", "space"), ("gdn", "cuda"), ("gdn", "ops"),
              ("tree_attn", "space"), ("tree_attn", "configs"), ("lmhead", "space"), ("lmhead", "configs"),
              ("autotune", "tuner"), ("autotune", "promotion")]


@pytest.mark.parametrize("pkg, sub", DOCUMENTED, ids=[f"{p}.{s}" for p, s in DOCUMENTED])
def test_documented_submodules_resolve_after_import(pkg, sub, monkeypatch):
    mod = __import__(pkg)
    if sub in vars(mod):
        monkeypatch.delattr(mod, sub)  # as in a fresh session, where nothing imported it yet
    assert getattr(mod, sub).__name__ == f"{pkg}.{sub}"
    with pytest.raises(AttributeError, match=f"module '{pkg}' has no attribute 'nope'"):
        getattr(mod, "nope")


def test_autotune_force_snippet_as_written():
    with autotune.force("w12.matmul", config=w12.configs.MmaConfig(mt=2, wk=4, pipe=3)):
        assert autotune.forced("w12.matmul")[1] == w12.configs.MmaConfig(mt=2, wk=4, pipe=3)


# --------------------------------------------------------------------------------------------------------------
# A fix message followed to the letter works.


def test_tree_attn_run_dtype_fix_works():
    H, Hkv, D = 2, 1, 64
    g = torch.Generator().manual_seed(0)
    qo, kv = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    idx, mask = torch.arange(5, dtype=torch.int32), torch.tensor([1, 3])
    kc, vc = (torch.randn(8, Hkv, D, generator=g).bfloat16() for _ in range(2))
    kn, vn = (torch.randn(2, Hkv, D, generator=g).bfloat16() for _ in range(2))
    p = tree_attn.plan(qo, kv, idx, mask, num_qo_heads=H, num_kv_heads=Hkv, head_dim=D, cache_slots=8,
                       variant="reference")
    q = torch.randn(2, H, D, generator=g)  # fp32
    with pytest.raises(TypeError, match=r"^tree_attn\.run: q has dtype torch\.float32 but the plan was built for "
                                        r"torch\.bfloat16; tree_attn runs bfloat16 or float16: pass "
                                        r"q\.to\(torch\.bfloat16\)"):
        tree_attn.run(p, q, kc, vc, k_new=kn, v_new=vn)
    with pytest.raises(TypeError, match=r"^tree_attn\.plan: dtype torch\.float32 is not supported"):
        tree_attn.plan(qo, kv, idx, mask, num_qo_heads=H, num_kv_heads=Hkv, head_dim=D, cache_slots=8,
                       dtype=torch.float32)  # what the message used to suggest
    out = tree_attn.run(p, q.to(torch.bfloat16), kc, vc, k_new=kn, v_new=vn)  # the fix it names now
    assert out.shape == (2, H, D) and torch.isfinite(out.float()).all()
    with pytest.raises(TypeError, match=r"^tree_attn\.run: .*; plan with dtype=torch\.float16, or pass "
                                        r"q\.to\(torch\.bfloat16\)"):
        tree_attn.run(p, q.half(), kc, vc, k_new=kn, v_new=vn)


# --------------------------------------------------------------------------------------------------------------
# Variants on a CPU without the Triton interpreter: a named kernel variant raises, only variant=None picks.

NO_KERNEL = r"cannot run on CPU tensors without the Triton interpreter; start Python with TRITON_INTERPRET=1 set"


@pytest.fixture
def no_interpreter(monkeypatch):
    """A Python session started without TRITON_INTERPRET (autotune reads the variable at each decision)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    autotune.clear_plans()
    yield
    autotune.clear_plans()


def _gdn_chain(gate0=None):
    torch.manual_seed(0)
    T, H, HV, K, V = 4, 1, 2, 16, 16
    plan = gdn.build_tree_plan([[-1, 0, 1, 2]])
    q, k, v = torch.randn(T, H, K), torch.randn(T, H, K), torch.randn(T, HV, V)
    g, beta, pool = -torch.rand(T, HV), torch.rand(T, HV), torch.randn(2, HV, K, V)
    if gate0 is not None:
        g[0, 0] = gate0
    return (q, k, v, g, beta, pool, [1], plan)


def test_named_gdn_variant_raises_without_the_interpreter(no_interpreter):
    args = _gdn_chain()
    for variant in ("recurrent", "wy", "cuda"):
        with pytest.raises(ValueError, match=rf"^gdn\.tree_verify: variant '{variant}' {NO_KERNEL} .*, or pass "
                                             r"variant=None or 'reference' for the torch path"):
            gdn.tree_verify(*args, variant=variant)
    assert autotune.which_variant("gdn.tree_verify", "cpu") == "reference"  # what variant=None runs here
    want = gdn.tree_verify(*args, variant="reference")
    assert_bitwise_equal(gdn.tree_verify(*args), want)
    with autotune.force("gdn.tree_verify", variant="wy"):  # a forced variant is a named one
        with pytest.raises(ValueError, match=NO_KERNEL):
            gdn.tree_verify(*args)
        with pytest.raises(ValueError, match=NO_KERNEL):
            autotune.which_variant("gdn.tree_verify", "cpu")


def test_named_kernel_variants_of_every_operator_raise_without_the_interpreter(no_interpreter):
    w = (torch.randn(8, 64) * 0.05).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    p = w12.pack(w, layout="planes")
    with pytest.raises(ValueError, match=rf"^w12\.matmul: variant 'gemv' {NO_KERNEL}.*variant=None or 'torch'"):
        w12.matmul(x, p, variant="gemv")
    assert_bitwise_equal(w12.matmul(x, p), w12.matmul(x, p, variant="torch"))
    with pytest.raises(ValueError, match=rf"^lmhead\.CertifiedHead: variant 'triton' {NO_KERNEL}"):
        lmhead.CertifiedHead(w, variant="triton")
    assert lmhead.CertifiedHead(w).plan.kernel == "reference"
    qo, kv = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"^tree_attn\.plan: variant 'mma' {NO_KERNEL}"):
        tree_attn.plan(qo, kv, torch.zeros(1, dtype=torch.int32), torch.tensor([1]), num_qo_heads=1, num_kv_heads=1,
                       head_dim=64, cache_slots=1, variant="mma")
    picks = {op: autotune.which_variant(op, "cpu") for op in ("w12.matmul", "gdn.tree_conv1d", "gdn.commit",
                                                             "tree_attn.tree_attention", "lmhead.argmax")}
    assert picks == {"w12.matmul": "torch", "gdn.tree_conv1d": "reference", "gdn.commit": "reference",
                     "tree_attn.tree_attention": "reference", "lmhead.argmax": "reference"}


def test_which_variant_under_the_interpreter():
    """The test session runs under the interpreter: the variants that run there are the Triton ones. A table is
    known once its ops module is loaded (w12 loads w12.ops on first use; the error says so)."""
    w12.ops  # the package loads it on first attribute access

    assert autotune.is_interpreter()
    assert autotune.which_variant("gdn.tree_verify", "cpu") == "wy"
    assert autotune.which_variant("w12.matmul", "cpu") == "gemv"
    assert autotune.which_variant("gdn.tree_verify", "cpu", variant="recurrent") == "recurrent"
    with pytest.raises(ValueError, match=r"^autotune\.which_variant: no variant table for 'nope\.op'"):
        autotune.which_variant("nope.op")


def test_minus_inf_gate_as_the_readme_says():
    """README: a gate of -inf gives NaN in the WY form (`wy`, `cuda`, the torch `reference`); the `recurrent`
    kernel (a GPU, or TRITON_INTERPRET=1 on the CPU) and gdn.recurrent_reference compute it."""
    q, k, v, g, beta, pool, rows, plan = _gdn_chain(gate0=float("-inf"))
    want = gdn.recurrent_reference(q, k, v, g, beta, pool[1], parents=[-1, 0, 1, 2])
    assert torch.isfinite(want).all()
    got = gdn.tree_verify(q, k, v, g, beta, pool, rows, plan, variant="recurrent")
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-4, atol=1e-4)
    for variant in ("wy", "reference"):  # the closed gate is value head 0's: every node's head 0 is NaN there
        o = gdn.tree_verify(q, k, v, g, beta, pool, rows, plan, variant=variant)
        assert torch.isnan(o[:, 0]).all() and torch.isfinite(o[:, 1]).all()


def test_specpilot_info_reports_the_callers_set_up(no_interpreter, tmp_path, monkeypatch, capsys):
    from specpilot import cli

    monkeypatch.setenv("SPECPILOT_CACHE_DIR", str(tmp_path))
    assert cli.cmd_info(argparse.Namespace(device="cpu", refresh=False)) == 0
    out = capsys.readouterr().out
    assert "TRITON_INTERPRET" not in os.environ  # nothing set behind the caller's back
    assert "interpreter : TRITON_INTERPRET unset: CPU tensors run the torch paths only" in out
    assert "  w12.matmul: torch\n" in out and "  gdn.tree_verify: reference\n" in out


# --------------------------------------------------------------------------------------------------------------
# Common mistakes get the "<pkg>.<fn>: what; how to fix" line, and a NaN row a defined answer.


def test_flat_parent_list():
    with pytest.raises(TypeError, match=r"^gdn\.build_tree_plan: parents\[0\] is -1, not a list of parent indices; "
                                        r".*wrap it in a list for one request: \[\[-1, 0, 0, 1\]\]"):
        gdn.build_tree_plan([-1, 0, 0, 1])
    assert gdn.build_tree_plan([[-1, 0, 0, 1]]).total_nodes == 4


def test_topk_float_k():
    head = lmhead.CertifiedHead((torch.randn(16, 64) * 0.05).bfloat16(), variant="reference")
    h = torch.randn(2, 64).bfloat16()
    with pytest.raises(TypeError, match=r"^lmhead\.topk: k must be an int, got float 2\.0; pass an int, e\.g\. k=2$"):
        head.topk(h, 2.0)
    assert head.topk(h, 2)[1].shape == (2, 2)


def test_convert_fp32_model():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    with pytest.raises(TypeError, match=r"^w12\.convert: nothing to convert: 2 matching linear layers hold "
                                        r"torch\.float32 weights \(e\.g\. '0'\) and W12 packs bfloat16; cast the model "
                                        r"first: model\.to\(torch\.bfloat16\)$"):
        w12.convert(model)
    assert w12.convert(model.to(torch.bfloat16)).num_converted == 2


@pytest.mark.parametrize("screen", ["int8", "none"])
def test_argmax_of_a_nan_row_is_nan_id(screen):
    head = lmhead.CertifiedHead((torch.randn(16, 64) * 0.05).bfloat16(), screen=screen, variant="reference")
    h = torch.randn(3, 64).bfloat16()
    h[1, 5] = float("nan")
    ids = head.argmax(h)
    assert lmhead.NAN_ID == -1 and ids[1] == lmhead.NAN_ID  # never a silent token 0
    assert_bitwise_equal(ids[[0, 2]], torch.argmax(head.logits(h)[[0, 2]], dim=-1))


def test_pack_output_named_model_safetensors_loads_as_w12(tmp_path):
    """A `specpilot pack` output saved as model.safetensors: the engine reads it as W12 by its header."""
    from specpilot.engine import Engine

    src = ROOT / "specpilot" / "models" / "tiny_stdlib"
    shutil.copy(src / "config.json", tmp_path / "config.json")
    shutil.copy(src / "model.w12.safetensors", tmp_path / "model.safetensors")
    eng = Engine.from_pretrained(tmp_path, device="cpu", weights="w12")
    assert eng is not None


# --------------------------------------------------------------------------------------------------------------
# specpilot pack keeps BF16 where W12 would take more memory than BF16.


def test_pack_packs_what_the_runtime_layout_holds_in_fewer_bits_and_warns_about_the_planes(tmp_path, capsys):
    from safetensors.torch import save_file

    from specpilot import cli

    g = torch.Generator().manual_seed(0)
    t = {"wide.weight": (torch.randn(1000, 130, generator=g) * 0.02).bfloat16(),
         "ok.weight": (torch.randn(64, 256, generator=g) * 0.02).bfloat16()}
    save_file(t, str(tmp_path / "in.safetensors"))
    assert cli.main(["pack", str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")]) == 0
    cap = capsys.readouterr()
    assert "kept in BF16" not in cap.out
    assert ("wide.weight [1000 x 130]: 18.03 bits per weight in memory as version-1 planes (load_file(..., "
            "layout=\"planes\"): rows padded to a multiple of 64 columns, K=130 -> Kp=192), more than BF16's 16; "
            "the default runtime layout takes 12.3") in cap.err
    got = w12.load_file(tmp_path / "out.safetensors")
    assert isinstance(got["wide.weight"], w12.TiledW12) and isinstance(got["ok.weight"], w12.TiledW12)
    assert_bitwise_equal(w12.unpack(got["wide.weight"]), t["wide.weight"])


# --------------------------------------------------------------------------------------------------------------
# Common mistakes across the public API: each one line "<pkg>.<fn>: what; how to fix".


def _mistakes():
    torch.manual_seed(0)
    w = (torch.randn(8, 64) * 0.05).bfloat16()
    p, x = w12.pack(w, layout="planes"), torch.randn(3, 64).bfloat16()
    plan = gdn.build_tree_plan([[-1, 0, 1, 2]])
    q, k, v = torch.randn(4, 1, 16), torch.randn(4, 1, 16), torch.randn(4, 2, 16)
    g, beta, pool = -torch.rand(4, 2), torch.rand(4, 2), torch.randn(2, 2, 16, 16)
    qo, kv = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    idx, mask = torch.arange(5, dtype=torch.int32), torch.tensor([1, 3])
    ta = dict(num_qo_heads=2, num_kv_heads=1, head_dim=64, cache_slots=8, variant="reference")
    head = lmhead.CertifiedHead(w, variant="reference")
    return [
        ("w12", lambda: w12.unpack(w), "expected a W12Weight"),
        ("w12", lambda: w12.pack(w, verify="yes"), "verify must be a bool"),
        ("w12", lambda: p.validate(deep="no"), "deep must be a bool"),  # "no" would read as true
        ("w12", lambda: p.to("cpu", non_blocking="false"), "non_blocking must be a bool"),
        ("w12", lambda: w12.decode_q8(w), "expected a W12Weight"),
        ("w12", lambda: w12.matmul(p, x), "packed must be a W12Weight"),
        ("w12", lambda: w12.matmul(x.float(), p), "x must be bfloat16 or float16"),
        ("w12", lambda: w12.save_file("m.w12.safetensors", [p]), "tensors must be a mapping"),
        ("w12", lambda: w12.load_file(3), "path must be a str or os.PathLike"),
        ("w12", lambda: w12.W12Linear(w), "needs a W12Weight"),
        ("w12", lambda: w12.W12Linear.empty(2.5, 3), "must be ints"),
        ("w12", lambda: w12.convert(nn.Linear(2, 2), include=5), "include must be a pattern string"),
        ("gdn", lambda: gdn.build_tree_plan([[-1]], max_nodes="4"), "max_nodes must be an int"),
        ("gdn", lambda: gdn.build_tree_plan([[-1]], device="gpu0"), "is not a torch device"),
        ("gdn", lambda: gdn.build_tree_plan(torch.tensor([-1, 0]), "02"), "cu_seqlens must"),
        ("gdn", lambda: gdn.tree_verify(q, k, v, g, beta, pool, [1], plan, scale="x"), "scale must be a number"),
        ("gdn", lambda: gdn.check_errors([1]), "expected a gdn.TreePlan"),
        ("gdn", lambda: gdn.validate_accepted([1], torch.tensor([[0]]), torch.tensor([1])), "must be a gdn.TreePlan"),
        ("tree_attn", lambda: tree_attn.plan(qo, kv, idx, mask, **{**ta, "num_qo_heads": 2.0}), "must be an int"),
        ("tree_attn", lambda: tree_attn.plan(qo, kv, idx, mask, **{**ta, "cache_slots": "8"}), "must be an int"),
        ("tree_attn", lambda: tree_attn.plan(qo, kv, idx, mask, **{**ta, "max_nodes": 2.5}), "must be an int"),
        ("tree_attn", lambda: tree_attn.run(tree_attn.plan(qo, kv, idx, mask, **ta), torch.randn(2, 2, 64).bfloat16(),
                                            *(torch.randn(8, 1, 64).bfloat16(),) * 2,
                                            k_new=torch.randn(2, 1, 64).bfloat16(),
                                            v_new=torch.randn(2, 1, 64).bfloat16(), sm_scale="x"),
         "sm_scale must be a number"),
        ("lmhead", lambda: lmhead.CertifiedHead(w, capacity=8.5), "capacity must be an int"),
        ("lmhead", lambda: lmhead.CertifiedHead(w, group="128"), "group must be an int"),
        ("lmhead", lambda: lmhead.screen_bounds([1], x), "head must be an lmhead.CertifiedHead"),
        ("lmhead", lambda: head.topk(x, "2"), "k must be an int"),
    ]


def test_common_mistakes_say_how_to_fix():
    from specpilot.testing import raises_helpful

    for pkg, call, what in _mistakes():
        with raises_helpful(pkg, what):
            call()
