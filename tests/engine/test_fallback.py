"""Shapes the fast kernels do not take run on the operators' references, never refused: the model decides the path of
each layer kind when it is built (`specpilot.engine.Paths`), one `KernelFallbackWarning` names the reason, and the
engine's greedy output equals transformers' greedy output token for token (the oracle: transformers' torch path with
an fp32 head, as the engine's).

Attention head dims outside tree_attn.HEAD_DIMS: 32 (a power of two), 96 and 160 (not: the fused glue's attention
prologue does not take them either). Gated DeltaNet head dims have no such limit: gdn's Triton kernels mask K and V
to any size, and its automatic choice moves what the CUDA kernel cannot take to them; the K=24, V=40 cases show it."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import autotune
import tree_attn
from specpilot.check import torch_reference_path, transformers_logits
from specpilot.engine import (NEAR_TIE, Engine, HybridModel, KernelFallbackWarning, Kernels, load_config,
                              load_tensors)
from specpilot.testing import raises_helpful

from engine_ckpt import write_checkpoint

# name -> (seed, overrides) of the tiny random checkpoints
CASES = {
    "attn-d32": (3, dict(head_dim=32)),
    "attn-d96": (4, dict(head_dim=96)),
    "attn-d160": (5, dict(head_dim=160)),
    # one GDN layer: the interpreter runs its kernels in about a second a call
    "gdn-k24-v40": (6, dict(linear_key_head_dim=24, linear_value_head_dim=40, num_hidden_layers=2,
                            layer_types=["linear_attention", "full_attention"])),
}
NEW = 40  # new tokens per generation


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """name -> (directory, the transformers model in BF16), written on first use."""
    root, made = tmp_path_factory.mktemp("fallback-ckpt"), {}

    def get(name):
        if name not in made:
            seed, kw = CASES[name]
            made[name] = (root / name, write_checkpoint(root / name, seed, vocab_size=97, **kw))
        return made[name]

    return get


def _prompt(vocab, n, seed):
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, vocab, (7,), generator=g).tolist()
    noise = torch.randint(0, vocab, (n,), generator=g).tolist()
    return noise[: n // 2] + motif * 3 + noise[n // 2:]  # the repeated motif gives the n-gram drafter trees to verify


class _Fp32Head(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return F.linear(x.float(), self.weight.float())


def _transformers_greedy(model, prompt, n):
    """transformers' greedy continuation on its torch path, its head in fp32 as the engine's (a BF16 head rounds the
    logits to 8 bits: among 97 tokens ties are common, and its argmax breaks them by index)."""
    head = model.lm_head
    model.lm_head = _Fp32Head(head.weight)
    try:
        with torch_reference_path(model) as how, torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    finally:
        model.lm_head = head
    return out[0, len(prompt):].tolist(), how


def _same_greedy(got, want, model, prompt, what, near_tie: bool):
    """Equal token for token; with `near_tie`, a first parting where the reference's top-2 margin is below NEAR_TIE
    passes too (another reduction order may swap a near-tie), reported."""
    div = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if div is None and len(got) == len(want):
        return
    div = min(len(got), len(want)) if div is None else div
    assert near_tie, f"{what}: parts from transformers' greedy output at token {div}: {got} != {want}"
    top = transformers_logits(model, prompt + want[:div]).reference[-1].topk(2).values
    margin = float(top[0] - top[1])
    print(f"{what}: near-tie parting from transformers' greedy output at token {div}: margin {margin:.4g}")
    assert margin < NEAR_TIE, (f"{what}: parts from transformers' greedy output at token {div} where the reference's "
                               f"margin is {margin:.4g} >= {NEAR_TIE}: not a near-tie")


def _fallback_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, KernelFallbackWarning)]


def _model(path, kernels, **kw):
    cfg, _ = load_config(path)
    tensors, _ = load_tensors(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = HybridModel(cfg, tensors, device="cpu", kernels=kernels, **kw)
    return model, _fallback_warnings(caught)


@pytest.mark.parametrize("D,fused_glue", [(32, False), (32, True), (64, True), (96, False), (96, True)])
def test_paths_decided_for_a_gpu(D, fused_glue):
    # the decision as a GPU makes it (the automatic attention variant is a kernel there, and under the interpreter)
    from engine_ckpt import make_config

    from specpilot.engine import HybridConfig, Paths

    if tree_attn.VARIANTS.pick(None, "cuda") == tree_attn.VARIANTS.fallback:
        pytest.skip("no tree_attn kernel is chosen for a CUDA device here")
    paths = Paths.decide(HybridConfig.from_hf(make_config(head_dim=D)), Kernels(), "cuda", fused_glue)
    assert paths.kernels.attn == (None if D == 64 else "reference")
    assert paths.fused_attn_prep == (fused_glue and D != 96)
    assert len(paths.fallbacks) == (D != 64) + (fused_glue and D == 96)
    assert (paths.host_syncs is None) == (D == 64)
    text = paths.warning("cuda")
    if D == 64:
        assert text is None
    else:
        assert text.startswith("specpilot.engine: ") and f"head_dim {D} is not supported" in text
        assert "no CUDA graphs" in text and "no CUDA graphs" not in paths.warning("cpu")
        assert ("not a power of two" in text) == (fused_glue and D == 96)


@pytest.mark.parametrize("name", ["attn-d32", "attn-d96", "attn-d160"])
def test_attention_head_dims_run_the_reference(ckpt, name, record_property):
    path, model = ckpt(name)
    D = CASES[name][1]["head_dim"]
    prompt = _prompt(97, 20, 1)
    want, how = _transformers_greedy(model, prompt, NEW)
    record_property("reference_path", str(how))
    # the engine as users build it: on the CPU every operator runs its reference already (no warning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = Engine.from_pretrained(path, device="cpu", drafter="ngram")
    assert _fallback_warnings(caught) == []
    _same_greedy(plain.generate(prompt, NEW, speculative=False), want, model, prompt, f"{name} default", False)
    # attention asks for its kernels (a Triton kernel under the interpreter, as on a GPU), the rest its references
    m, said = _model(path, Kernels("torch", "reference", "reference", "reference", None, "reference"))
    assert m.kernels.attn == "reference"
    if tree_attn.VARIANTS.pick(None, "cpu") == tree_attn.VARIANTS.fallback:
        assert said == []  # CPU tensors without the interpreter: the automatic choice is the reference itself
    else:
        assert len(said) == 1 and f"head_dim {D} is not supported" in said[0] and "tree_attn" in said[0], said
    eng = Engine(m, "ngram")
    _same_greedy(eng.generate(prompt, NEW, speculative=False), want, model, prompt, f"{name} autoregressive", False)
    eng.reset_stats()
    _same_greedy(eng.generate(prompt, NEW), want, model, prompt, f"{name} speculative", False)
    assert eng.stats()["verify"]["tau"] > 1.0  # draft trees went through the reference's tree masks


def test_fused_glue_falls_back_with_one_warning(ckpt):
    # the glue's fused Triton kernels (the interpreter) and attention's kernels: neither takes head_dim 96, one
    # warning names both; the other glue kernels keep running
    if not autotune.is_interpreter():
        pytest.skip("needs the Triton interpreter (CPU-only machine) for Triton kernels on CPU tensors")
    path, model = ckpt("attn-d96")
    prompt = _prompt(97, 20, 1)[:12]
    want, how = _transformers_greedy(model, prompt, 8)
    m, said = _model(path, Kernels("torch", "reference", "reference", "reference", None, "reference"), fused_glue=True)
    assert len(said) == 1 and "head_dim 96 is not supported" in said[0] and "not a power of two" in said[0], said
    assert type(m.glue).__name__ == "FusedGlue" and m.glue.attn_prep is not type(m.glue).attn_prep
    eng = Engine(m, "ngram")
    _same_greedy(eng.generate(prompt, 8, speculative=False), want, model, prompt, f"fused glue; {how}", False)


@pytest.mark.slow
def test_gdn_head_dims_run_the_kernels(ckpt):
    # K=24, V=40 (neither a power of two nor a multiple of 32): the Triton GDN kernels take them, no warning
    if not autotune.is_interpreter():
        pytest.skip("needs the Triton interpreter (CPU-only machine) for Triton kernels on CPU tensors")
    path, model = ckpt("gdn-k24-v40")
    prompt = _prompt(97, 20, 1)[:8]
    want, how = _transformers_greedy(model, prompt, 4)
    m, said = _model(path, Kernels("torch", None, None, None, "reference", "reference"))
    assert said == [] and (m.kernels.gdn, m.kernels.conv, m.kernels.commit) == (None, None, None)
    eng = Engine(m, "ngram")
    _same_greedy(eng.generate(prompt, 4, speculative=False), want, model, prompt, f"gdn kernels; {how}", False)


@pytest.mark.gpu
@pytest.mark.parametrize("name,fused_glue", [("attn-d32", False), ("attn-d96", False), ("attn-d96", True),
                                             ("attn-d160", True), ("gdn-k24-v40", False)])
def test_gpu_falls_back_and_matches_transformers(ckpt, name, fused_glue, record_property):
    path, model = ckpt(name)
    prompt = _prompt(97, 20, 1)
    want, how = _transformers_greedy(model, prompt, NEW)
    record_property("reference_path", str(how))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = Engine.from_pretrained(path, device="cuda", drafter="ngram", fused_glue=fused_glue)
    said = _fallback_warnings(caught)
    if name.startswith("attn"):
        D = CASES[name][1]["head_dim"]
        assert len(said) == 1 and f"head_dim {D} is not supported" in said[0], said
        assert ("not a power of two" in said[0]) == (fused_glue and D & (D - 1) != 0), said
        assert "no CUDA graphs" in said[0] and eng.model.kernels.attn == "reference" and not eng.graphs
        with raises_helpful("specpilot.engine", "graphs"):
            Engine(eng.model, None, graphs=True)
    else:
        assert said == [] and eng.graphs  # the GDN kernels take K=24, V=40: nothing falls back
    what = f"{name}{' fused glue' if fused_glue else ''} on the GPU; {how}"
    _same_greedy(eng.generate(prompt, NEW, speculative=False), want, model, prompt, f"{what}, autoregressive", True)
    eng.reset_stats()
    _same_greedy(eng.generate(prompt, NEW), want, model, prompt, f"{what}, speculative", True)
    assert eng.stats()["verify"]["tau"] > 1.0
