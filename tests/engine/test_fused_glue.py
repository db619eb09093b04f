"""The fused glue kernels (specpilot.engine.fused, Triton; the interpreter on the CPU) against the torch glue
functions they replace (specpilot.engine.model): BF16 results equal but for rare last-bit differences from the
order of the norms' fp32 sums."""

import pytest
import torch

from specpilot.engine import model as M
from specpilot.engine.fused import FusedGlue

F = FusedGlue()


def _close(a, b, what):
    a, b = a.float(), b.float()
    assert a.shape == b.shape, what
    diff = (a - b).abs()
    ulp = b.abs().clamp(min=2.0**-126) * 2.0**-7  # one BF16 ulp (or less) of the torch value
    assert bool((diff <= ulp).all()), f"{what}: {int((diff > ulp).sum())} entries beyond one BF16 ulp"
    assert float((diff > 0).float().mean()) < 0.02, f"{what}: {float((diff > 0).float().mean()):.3f} differ"


def _bf(*shape, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("T,N", [(1, 64), (5, 96), (3, 200)])
def test_add_norm_and_norm(T, N):
    g = torch.Generator().manual_seed(T * N)
    h, y = _bf(T, N, g=g), _bf(T, N, g=g)
    w1 = 1.0 + torch.randn(N, generator=g) * 0.1
    hn, x = F.add_norm(h, y, w1, 1e-6)
    rh, rx = M.add_norm(h, y, w1, 1e-6)
    assert torch.equal(hn, rh)  # the BF16 add rounds once in both
    _close(x, rx, "add_norm")
    _close(F.rms_norm(h, w1, 1e-6), M.rms_norm(h, w1, 1e-6), "rms_norm")


def test_swiglu_and_gate():
    g = torch.Generator().manual_seed(1)
    gu = _bf(4, 2 * 1500, g=g, scale=3)
    _close(F.swiglu(gu), M.swiglu(gu), "swiglu")
    qkv = _bf(3, 2 * 2 * 64 + 2 * 64, g=g)
    gate3 = qkv[:, :256].reshape(3, 2, 128)[..., 64:]  # attn_prep's gate: a [T, H, D] view of the projection
    o = _bf(3, 2, 64, g=g)
    want = M.attn_gate(o, gate3.reshape(3, 128))
    assert want.shape == (3, 128)
    first = F.attn_gate(o, gate3)
    _close(first, want, "attn_gate")
    # the same gate as a [T, N] copy and as a view whose rows are not the outer stride: the same bits
    for gate in (gate3.reshape(3, 128), gate3.transpose(0, 1).contiguous().transpose(0, 1)):
        assert torch.equal(F.attn_gate(o, gate), first)
        assert torch.equal(M.attn_gate(o, gate), want)


def test_gdn_gates_and_gated_norm():
    g = torch.Generator().manual_seed(2)
    conv, vd, hv = 48, 64, 4
    proj = _bf(5, conv + vd + 2 * hv, g=g, scale=8)  # wide a: both sides of softplus's threshold
    neg_a = -torch.rand(hv, generator=g) * 4
    dtb = _bf(hv, g=g)
    outs = []
    for fn in (F.gdn_gates, M.gdn_gates):
        gg, b = torch.empty(5, hv), torch.empty(5, hv, dtype=torch.bfloat16)
        z = fn(proj, neg_a, dtb, [conv, vd, hv, hv], gg, b)
        outs.append((z, gg, b))
    (z, gg, b), (rz, rg, rb) = outs
    assert torch.equal(z, rz) and torch.equal(b, rb) and torch.equal(z, proj[:, conv:conv + vd])
    torch.testing.assert_close(gg, rg, rtol=1e-6, atol=1e-7)
    o = _bf(5, hv, vd // hv, g=g)
    w = _bf(vd // hv, g=g)
    _close(F.gated_rms_norm(o, z, w, 1e-6), M.gated_rms_norm(o, z, w, 1e-6), "gated_rms_norm")


@pytest.mark.parametrize("D,r", [(64, 16), (128, 32)])
def test_attn_prep(D, r):
    g = torch.Generator().manual_seed(D)
    T, H, Hkv = 3, 4, 2
    qkv = _bf(T, 2 * H * D + 2 * Hkv * D, g=g)
    pos = torch.tensor([5, 17, 300])
    inv = 1.0 / (10000.0 ** (torch.arange(0, r, 2, dtype=torch.float) / r))
    emb = torch.cat([pos[:, None].float() * inv] * 2, -1)
    cos, sin = emb.cos().to(torch.bfloat16)[:, None], emb.sin().to(torch.bfloat16)[:, None]
    qw, kw = 1.0 + torch.randn(D, generator=g) * 0.1, 1.0 + torch.randn(D, generator=g) * 0.1
    res = []
    for fn in (F.attn_prep, M.attn_prep):
        k, v = torch.empty(T, Hkv, D, dtype=torch.bfloat16), torch.empty(T, Hkv, D, dtype=torch.bfloat16)
        q, gate = fn(qkv, cos, sin, qw, kw, (H, Hkv, D, r), 1e-6, k, v)
        res.append((q, gate, k, v))
    (q, gate, k, v), (rq, rgate, rk, rv) = res
    _close(q, rq, "q")
    _close(k, rk, "k")
    assert torch.equal(v, rv) and torch.equal(gate.reshape(rgate.shape), rgate)
    assert gate.data_ptr() == qkv.data_ptr() + D * qkv.element_size()  # a view of the projection: no copy


def _engine_case(checkpoints, device, n, gen, record_property):
    from specpilot.check import transformers_logits
    from specpilot.engine import Engine, check_lossless
    from specpilot.testing import assert_close

    path, model = checkpoints["gdn3-attn1-v97"]
    ids = torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(11)).tolist()
    o = transformers_logits(model, ids)  # on the CPU, transformers' torch path with or without fla installed
    print(o.path)
    record_property("reference_path", str(o.path))
    eng = Engine.from_pretrained(path, device=device, drafter="ngram", fused_glue=True)
    assert_close(eng.score(ids).cpu(), o.reference, o.baseline, factor=2.0, msg=f"fused glue prefill; {o.path}")
    if gen:
        rep = check_lossless(eng, ids[:30] + ids[:10] * 3, gen)
        assert rep.ok and rep.tau > 1.0


def test_engine_with_fused_glue_cpu(checkpoints, record_property):
    # the interpreter runs every glue kernel program by program: one 24-token pass against the oracle
    _engine_case(checkpoints, "cpu", 24, 0, record_property)


@pytest.mark.gpu
def test_engine_with_fused_glue_gpu(checkpoints, record_property):
    _engine_case(checkpoints, "cuda", 150, 256, record_property)


def _glue_chain(glue, t):
    # the glue kernels, each reading the one before (one torch copy makes gated_rms_norm's x contiguous): a PDL
    # launch that read before its wait would see the previous replay's zeroed outputs
    h, w1, neg_a, dtb, gdn_w, cos, sin, qw, kw = t
    T = h.shape[0]
    x = glue.rms_norm(h, w1, 1e-6)
    h2, x2 = glue.add_norm(h, x, w1, 1e-6)
    s = glue.swiglu(x2)  # [T, 328] = [conv 64 | z 256 | b 4 | a 4]
    g = torch.empty(T, 4, device=h.device)
    b = torch.empty(T, 4, dtype=torch.bfloat16, device=h.device)
    z = glue.gdn_gates(s, neg_a, dtb, [64, 256, 4, 4], g, b)
    o = glue.gated_rms_norm(z.reshape(T, 4, 64), z, gdn_w, 1e-6)  # [T, 256] = one q head with its gate, k, v
    kv = torch.empty(2, T, 1, 64, dtype=torch.bfloat16, device=h.device)
    q, gate = glue.attn_prep(o, cos, sin, qw, kw, (1, 1, 64, 32), 1e-6, kv[0], kv[1])
    return [x, h2, s, g, b, o, q, kv, glue.attn_gate(q, gate)]


@pytest.mark.gpu
def test_glue_pdl_launches_equal_plain_ones_in_a_graph():
    """The glue kernels launched with programmatic dependent launch, captured in a CUDA graph as the engine runs
    them, give the same bits as plain launches, replay after replay."""
    from autotune.hardware import has_pdl

    if not has_pdl(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    g = torch.Generator().manual_seed(5)
    T = 7
    pos = torch.arange(T) + 40
    inv = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float) / 32))
    emb = torch.cat([pos[:, None].float() * inv] * 2, -1)
    t = [_bf(T, 656, g=g, scale=3), 1.0 + torch.randn(656, generator=g) * 0.1, -torch.rand(4, generator=g) * 4,
         _bf(4, g=g), _bf(64, g=g), emb.cos().to(torch.bfloat16)[:, None], emb.sin().to(torch.bfloat16)[:, None],
         1.0 + torch.randn(64, generator=g) * 0.1, 1.0 + torch.randn(64, generator=g) * 0.1]
    t = [v.cuda() for v in t]
    want = _glue_chain(FusedGlue(pdl=False), t)
    for mode in ("after", "early"):
        pdl = FusedGlue(pdl=mode)
        _glue_chain(pdl, t)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = _glue_chain(pdl, t)
        for _ in range(20):
            for v in got:
                v.zero_()
            graph.replay()
            torch.cuda.synchronize()
            for i, (a, b) in enumerate(zip(got, want)):
                assert torch.equal(a, b), f"output {i} differs with PDL launches ({mode})"


def test_glue_chain_runs_on_the_cpu():
    # the chain above, under the interpreter with PDL off (the instructions exist only on a GPU): shapes line up
    g = torch.Generator().manual_seed(5)
    T = 3
    emb = torch.cat([torch.arange(T)[:, None].float() * torch.ones(16)] * 2, -1)
    t = [_bf(T, 656, g=g), 1.0 + torch.randn(656, generator=g) * 0.1, -torch.rand(4, generator=g), _bf(4, g=g),
         _bf(64, g=g), emb.cos().to(torch.bfloat16)[:, None], emb.sin().to(torch.bfloat16)[:, None],
         torch.ones(64), torch.ones(64)]
    out = _glue_chain(FusedGlue(pdl=False), t)
    with pytest.raises(ValueError, match="pdl must be"):
        FusedGlue(pdl="sometimes")
    assert out[-1].shape == (T, 64) and all(bool(torch.isfinite(v.float()).all()) for v in out)
