"""The engine's forward pass against `transformers`' own Qwen3.5 (the oracle): prefill logits (chunks of up to
64 tokens through the tree path) and decode logits (one-node steps through the autoregressive path), BF16 and
W12 weights, on tiny random checkpoints of several shapes. The oracle runs transformers' torch code on the CPU
whether or not fla and causal-conv1d are installed (`specpilot.check.transformers_logits`); every comparison
names the path its reference took."""

import pytest
import torch

from specpilot.engine import Engine
from specpilot.testing import assert_close

from engine_ckpt import SHAPES


def _oracle(model, ids):
    """(fp64 reference logits from an fp32 copy of the model, the BF16 model's own logits, the reference's path)."""
    from specpilot.check import transformers_logits

    o = transformers_logits(model, ids)
    print(o.path)
    return o.reference, o.baseline, o.path


def _ids(vocab, n, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("weights", ["bf16", "w12"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefill_logits_match_transformers(checkpoints, shape, weights, record_property):
    path, model = checkpoints[shape]
    ids = _ids(model.config.vocab_size, 150, seed=7)  # 150 tokens: three chunks, two chunk boundaries
    ref, bf16, how = _oracle(model, ids)
    record_property("reference_path", str(how))
    eng = Engine.from_pretrained(path, device="cpu", weights=weights, drafter=None)
    assert_close(eng.score(ids), ref, bf16, factor=2.0, msg=f"{shape}/{weights} prefill; {how}")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_logits_match_transformers(checkpoints, shape, record_property):
    path, model = checkpoints[shape]
    ids = _ids(model.config.vocab_size, 40, seed=8)
    ref, bf16, how = _oracle(model, ids)
    record_property("reference_path", str(how))
    eng = Engine.from_pretrained(path, device="cpu", drafter=None)
    assert_close(eng.score(ids, chunk=1), ref, bf16, factor=2.0, msg=f"{shape} decode; {how}")


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


class _FusedRMSNormGated(torch.nn.Module):
    """Stands in for fla's FusedRMSNormGated (a Triton kernel): fails as that kernel does on CPU tensors."""

    def __init__(self, weight, eps):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x, gate):
        raise RuntimeError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")


_FusedRMSNormGated.__module__ = "fla.modules.fused_norm_gate"


def test_oracle_bypasses_kernels_bound_in_the_layers(checkpoints):
    # transformers versions that choose in each layer's constructor keep fla's functions and its FusedRMSNormGated on
    # the layer; stand-ins that fail as those kernels do on CPU tensors show that the oracle runs the torch code
    import copy

    from specpilot.check import transformers_logits

    _, model = checkpoints["gdn3-attn1-v97"]
    ids = _ids(97, 24, seed=3)
    want = transformers_logits(model, ids)
    patched = copy.deepcopy(model)
    layer = patched.model.layers[0].linear_attn

    def chunk_gated_delta_rule(*args, **kwargs):
        raise RuntimeError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")

    chunk_gated_delta_rule.__module__ = "fla.ops.gated_delta_rule.chunk"
    layer.chunk_gated_delta_rule = chunk_gated_delta_rule
    norm = _FusedRMSNormGated(layer.norm.weight, layer.norm.variance_epsilon)
    layer.norm = norm
    with pytest.raises((RuntimeError, ValueError)), torch.no_grad():
        patched(torch.tensor([ids]))  # as transformers built it: the stand-ins (or fla itself, where installed) fail
    got = transformers_logits(patched, ids)
    kind = type(layer).__name__
    layer_level = {f"{kind}.chunk_gated_delta_rule": "fla", f"{kind}.norm": "fla"}
    assert layer_level.items() <= got.path.bypassed.items(), str(got.path)
    assert torch.equal(got.reference, want.reference) and torch.equal(got.baseline, want.baseline), str(got.path)
    assert layer.chunk_gated_delta_rule is chunk_gated_delta_rule and layer.norm is norm  # restored on exit


_FLA_SCRIPT = """
import sys
import torch
import transformers
from specpilot.check import transformers_logits

torch.set_num_threads(1)
model = transformers.Qwen3_5ForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).eval()
o = transformers_logits(model, [int(t) for t in sys.argv[3].split(",")])
if "fla" not in o.path.bypassed.values():
    print("transformers did not bind fla: " + str(o.path))
    sys.exit(77)
print(o.path)
torch.save({"reference": o.reference, "baseline": o.baseline}, sys.argv[2])
"""


@pytest.mark.slow
def test_oracle_runs_with_fla_importable(checkpoints, tmp_path):
    # where fla imports, transformers binds its Triton kernels at import time; the oracle still runs its torch code,
    # on the CPU, with the logits it gives without fla. fla comes from the environment or from the wheels in .whl/
    import os
    import subprocess
    import sys
    from pathlib import Path

    from specpilot.check import transformers_logits

    path, model = checkpoints["gdn3-attn1-v97"]
    ids = _ids(97, 40, seed=4)
    wheels = sorted(str(w) for pat in ("fla_core-*.whl", "flash_linear_attention-*.whl")
                    for w in (Path(__file__).resolve().parents[2] / ".whl").glob(pat))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([p for p in [os.environ.get("PYTHONPATH")] if p] + wheels))
    out = tmp_path / "logits.pt"
    r = subprocess.run([sys.executable, "-c", _FLA_SCRIPT, str(path), str(out), ",".join(map(str, ids))], env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode == 77:
        pytest.skip(f"fla cannot be imported here: {r.stdout.strip()}")
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout.strip())
    got = torch.load(out)
    want = transformers_logits(model, ids)
    assert torch.equal(got["reference"], want.reference) and torch.equal(got["baseline"], want.baseline), \
        f"with fla importable ({r.stdout.strip()}) the oracle's logits differ from those without it ({want.path})"


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bf16", "w12"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_logits_match_transformers(checkpoints, shape, weights, record_property):
    # the GPU kernels: prefill (tree path) and decode (one-node steps) against the oracle, whose model stays on the
    # CPU on transformers' torch path (with fla installed, transformers would send it to fla's CUDA-only kernels)
    path, model = checkpoints[shape]
    ids = _ids(model.config.vocab_size, 150, seed=7)
    ref, bf16, how = _oracle(model, ids)
    record_property("reference_path", str(how))
    eng = Engine.from_pretrained(path, device="cuda", weights=weights, drafter=None)
    assert_close(eng.score(ids).cpu(), ref, bf16, factor=2.0, msg=f"{shape}/{weights} prefill on the GPU; {how}")
    assert_close(eng.score(ids[:40], chunk=1).cpu(), ref[:40], bf16[:40], factor=2.0,
                 msg=f"{shape}/{weights} decode on the GPU; {how}")
