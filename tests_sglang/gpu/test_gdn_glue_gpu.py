"""The SPECPILOT_SGLANG_GDN path's tensor functions (specpilot.sglang.gdn_verify: verify_layer, commit_step) on a GPU,
where gdn runs its CUDA/Triton kernels, at a Qwen3-Next GDN layer's shape (16 key heads, 32 value heads, head dim
128, conv width 4) in SGLang's state layout. No SGLang: the hooks around them are tested on the CPU with SGLang's
classes (tests_sglang/test_tree_gdn.py). Run as
`python3 -m pytest --confcutdir=tests_sglang/gpu tests_sglang/gpu/test_gdn_glue_gpu.py -m gpu`."""

from __future__ import annotations

import pytest
import torch

import gdn
from specpilot.testing import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H, HV, K, W, L = 16, 32, 128, 4, 2
D = 2 * H * K + HV * K
ACT = torch.bfloat16
TREES = [[-1, 0, 0, 1, 1, 2, 3, 3], [-1, 0, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 0, 1, 2, 3, 6]]
ROWS, LAST = [5, 1, 3], [6, 7, 4]
TRACK, TRACK_STEPS = [0, 7, 2], [3, -1, 1]


def _recurrence(xc, a, b, A_log, dt, state0, parents, dtype):
    from specpilot.sglang.gdn_verify import gates

    n = xc.shape[0]
    q, k, v = torch.split(xc, [H * K, H * K, HV * K], -1)
    g, beta = gates(A_log, dt, a, b)
    return gdn.recurrent_reference(q.reshape(n, H, K), k.reshape(n, H, K), v.reshape(n, HV, K), g, beta,
                                   state0.transpose(-1, -2), parents=parents, use_qk_l2norm=True, return_states=True,
                                   dtype=dtype)


def test_verify_and_commit_on_gdn_kernels():
    from specpilot.sglang.gdn_verify import GDNStep, commit_step, verify_layer

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    temporal = (torch.randn(L, 8, HV, K, K, generator=g) * 0.05).to(dev)
    conv = torch.randn(L, 8, D, W - 1, generator=g).to(ACT).to(dev)
    t0, c0 = temporal.cpu().clone(), conv.cpu().clone()
    plan = gdn.build_tree_plan(TREES, device=dev)
    step = GDNStep(meta=None, plan=plan, parents=TREES, rows=torch.tensor(ROWS, device=dev))
    T = sum(len(t) for t in TREES)
    feeds, outs, convs = [], [], []
    for i in range(L):
        x = torch.randn(T, D, generator=g).to(ACT)
        a, b = (torch.randn(T, HV, generator=g).to(ACT) for _ in range(2))
        w = (torch.randn(D, W, generator=g) * 0.3).to(ACT)
        A_log, dt = torch.randn(HV, generator=g) * 0.5, torch.randn(HV, generator=g) * 0.5
        feeds.append((x, a, b, w, A_log, dt))
        cuda = [t.to(dev) for t in (x, a, b, w, A_log, dt)]
        # the conv output verify_layer computes (the same call, so the same bits), for the references below
        convs.append(gdn.tree_conv1d(cuda[0], conv[i], cuda[3], plan, conv_state_indices=step.rows).cpu())
        outs.append(verify_layer(step, i, cuda[0], cuda[1], cuda[2], cuda[3], None, "silu", cuda[4], cuda[5],
                                 conv[i], temporal[i], (H, H, HV, K, K)).cpu())
    torch.cuda.synchronize()
    assert torch.equal(temporal.cpu(), t0) and torch.equal(conv.cpu(), c0), "verify wrote a committed state"
    commit_step(step, torch.tensor(LAST), temporal, conv, torch.tensor(TRACK), torch.tensor(TRACK_STEPS))
    got_t, got_c = temporal.cpu(), conv.cpu()
    for i, ((x, a, b, w, A_log, dt), out, xc) in enumerate(zip(feeds, outs, convs)):
        c64 = gdn.conv_reference(x, c0[i], w, TREES, None, "silu", ROWS, dtype=torch.float64)
        c32 = gdn.conv_reference(x, c0[i], w, TREES, None, "silu", ROWS, dtype=torch.float32)
        assert_close(xc, c64, c32.to(ACT), msg=f"conv layer {i}")
        t = 0
        for r, (parents, row, last) in enumerate(zip(TREES, ROWS, LAST)):
            sl = slice(t, t + len(parents))
            t += len(parents)
            args = (xc[sl], a[sl], b[sl], A_log, dt, t0[i, row], parents)
            o64, s64 = _recurrence(*args, torch.float64)
            o32, s32 = _recurrence(*args, torch.float32)
            assert_close(out[0, sl], o64, o32.to(ACT), msg=f"verify layer {i} request {r}")
            assert_close(got_t[i, row].transpose(-1, -2), s64[last], s32[last], msg=f"commit layer {i} request {r}")
            path = gdn.reference.root_path(parents, last)
            assert torch.equal(got_c[i, row], torch.cat([c0[i, row], x[sl][path].T], 1)[:, -(W - 1):])
            if TRACK_STEPS[r] >= 0:
                j, tr = TRACK_STEPS[r], TRACK[r]
                assert_close(got_t[i, tr].transpose(-1, -2), s64[j], s32[j], msg=f"track layer {i} request {r}")
                path = gdn.reference.root_path(parents, j)
                assert torch.equal(got_c[i, tr], torch.cat([c0[i, row], x[sl][path].T], 1)[:, -(W - 1):])
        untouched = [6, 7]  # neither a request's row nor a track slot that was written
        assert torch.equal(got_t[i, untouched], t0[i, untouched]) and torch.equal(got_c[i, untouched], c0[i, untouched])
