"""The batch kernel (w12/kernels/batch.py) on a GPU: against fp64 at the batch verify step's row counts and at odd
shapes, the same bits on every run and in a CUDA graph, hostile rows, fp16 x and the 8-bit view, x = I bit for bit,
a tuned entry taking matmul_tiled's call, and on sm_90 the heuristic's builds on wgmma without spills."""

import pytest
import torch
import torch.nn.functional as F

import autotune
import w12
from specpilot.testing import assert_bitwise_equal, assert_close, assert_replays_equal, capture_graph
from flow_emu import escaped_weight, gaussian_x, hostile_weight
from w12.configs import BatchConfig, batch_heuristic
from w12.layout import untile
from w12.ops import launch_batch

pytestmark = pytest.mark.gpu

FORCED = [BatchConfig(block_n=64, block_t=64, split_k=1), BatchConfig(block_n=128, block_t=128, split_k=3,
                                                                        num_warps=8, num_stages=2),
          BatchConfig(block_n=64, block_t=128, split_k=2, asm=False),
          BatchConfig(block_n=128, block_t=128, split_k=3, num_warps=8, kt=True),
          BatchConfig(block_n=256, block_t=64, split_k=2, num_warps=16, kt=True)]


def _batch(cfg, x, t, bias=None, q8=False):
    out = torch.empty(x.shape[0], t.N, device=x.device, dtype=x.dtype)
    launch_batch(cfg, x, t, bias, out, q8=q8)
    return out


@pytest.mark.parametrize("M,N,K", [(33, 5120, 6144), (72, 1000, 4100), (136, 130, 200), (256, 2048, 1024),
                                   (200, 17, 64), (40, 5120, 130)], ids=lambda v: str(v))
def test_batch_kernel_matches_fp64_and_repeats_its_bits(M, N, K):
    w = escaped_weight(N, K, seed=N + K)
    t = w12.pack(w)
    x = gaussian_x(M, K, seed=M)
    bias = gaussian_x(1, N, seed=N)[0] * 0.1 if N % 2 == 0 else None
    ref = w12.matmul_reference(x, untile(t), bias)
    base = F.linear(x, w, bias)
    for cfg in [batch_heuristic(M, N, K, x.device), *FORCED]:
        out = _batch(cfg, x, t, bias)
        assert_close(out, ref, base, msg=cfg.tag())
        for _ in range(3):
            assert torch.equal(_batch(cfg, x, t, bias).view(torch.int16), out.view(torch.int16)), cfg.tag()


def test_batch_kernel_strided_x():
    N, K = 1000, 4100
    w = escaped_weight(N, K, seed=3)
    t = w12.pack(w)
    big = gaussian_x(100, 2 * K, seed=4)
    x = big[:, ::2]
    for cfg in FORCED[:2]:
        assert_close(_batch(cfg, x, t), w12.matmul_reference(x, untile(t)), F.linear(x, w), msg=cfg.tag())


@pytest.mark.parametrize("q8", [False, True])
def test_batch_kernel_hostile_rows(q8):
    """NaN, +-Inf, +-0, subnormals, huge and tiny rows, escapes beside their window; x scaled so that no output's
    finite products pass fp32's range in magnitude (there every fp32 sum depends on its order)."""
    N, K = 200, 1000
    w = hostile_weight(N, K, seed=5).cuda()
    w[6, 3] = float("inf")
    t = w12.pack(w)
    x = (gaussian_x(96, K, seed=6).float() * 2.0 ** -10).to(torch.bfloat16)
    packed = untile(t)
    wd = (w12.decode_q8(packed) if q8 else w).double()
    assert (x.double().abs() @ torch.where(torch.isfinite(wd), wd, 0).abs().T).max() < torch.finfo(torch.float32).max
    ref = (w12.matmul_q8_reference if q8 else w12.matmul_reference)(x, packed)
    for cfg in FORCED:
        assert_close(_batch(cfg, x, t, q8=q8), ref, F.linear(x.float(), wd.float()).to(x.dtype), msg=cfg.tag())


def test_batch_kernel_fp16_x():
    N, K = 1000, 4100
    w = escaped_weight(N, K, seed=7)
    t = w12.pack(w)
    x = gaussian_x(130, K, seed=8, dtype=torch.float16)
    bias = gaussian_x(1, N, seed=9, dtype=torch.float16)[0]
    ref = w12.matmul_reference(x, untile(t), bias)
    base = F.linear(x, w.to(torch.float16), bias)
    for cfg in FORCED:
        out = _batch(cfg, x, t, bias)
        assert out.dtype == torch.float16
        assert_close(out, ref, base, msg=cfg.tag())


def test_one_hot_rows_give_the_weight_bit_for_bit():
    N, K = 300, 200
    w = escaped_weight(N, K, seed=11)
    w[3, 197] = 1e-30  # an escape in the masked last group
    t = w12.pack(w)
    x = torch.eye(K, dtype=torch.bfloat16, device="cuda")
    for cfg in FORCED:
        assert_bitwise_equal(_batch(cfg, x, t) + 0.0, w.t().contiguous() + 0.0, cfg.tag())


@pytest.mark.parametrize("split", [7, 8])
@pytest.mark.parametrize("fixup", [False, True])
def test_uneven_splits_give_each_column_once(split, fixup):
    """Ten full groups and a tail in 7 or 8 shares of two steps (the last shares get none): x = I rows at the first,
    last-full-group and tail columns give the weight bit for bit, escapes included."""
    N, K = 300, 645
    w = escaped_weight(N, K, seed=12)
    w[::3, K - 1] = 1e-30
    t = w12.pack(w)
    cols = torch.tensor([0, 1, 2, 637, 638, 639, 640, 641, 642, 643, 644], device="cuda")
    x = torch.eye(K, dtype=torch.bfloat16, device="cuda")[cols]
    cfg = BatchConfig(block_n=64, block_t=16, split_k=split, fixup=fixup)
    assert_bitwise_equal(_batch(cfg, x, t) + 0.0, w.t()[cols].contiguous() + 0.0, cfg.tag())


def test_batch_kernel_in_a_cuda_graph():
    N, K, M = 5120, 6144, 72
    t = w12.pack(escaped_weight(N, K, seed=13))
    x = gaussian_x(M, K, seed=14)
    cfg = batch_heuristic(M, N, K, x.device)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    graph = capture_graph(lambda: launch_batch(cfg, x, t, None, out))
    assert_replays_equal(graph, [out], [_batch(cfg, x, t)])


@pytest.mark.parametrize("M,N,K,split", [(32, 5120, 6144, 6), (72, 1000, 4100, 3), (200, 130, 1000, 5)],
                         ids=lambda v: str(v))
def test_last_share_adds_the_partials_with_the_reduce_kernels_bits(M, N, K, split):
    """fixup=True (one launch: the K share that finishes last adds the partials) gives the two-launch split's bits
    on every run and in a CUDA graph, whichever share finishes last, and leaves every tile counter at zero."""
    from w12 import ops

    w = escaped_weight(N, K, seed=21)
    t = w12.pack(w)
    x = gaussian_x(M, K, seed=22)
    bias = gaussian_x(1, N, seed=23)[0]
    want = _batch(BatchConfig(block_n=64, block_t=32 if M <= 32 else 64, split_k=split), x, t, bias)
    cfg = BatchConfig(block_n=64, block_t=32 if M <= 32 else 64, split_k=split, fixup=True)
    for _ in range(5):
        assert torch.equal(_batch(cfg, x, t, bias).view(torch.int16), want.view(torch.int16))
    out = torch.empty_like(want)
    assert_replays_equal(capture_graph(lambda: launch_batch(cfg, x, t, bias, out)), [out], [want])
    torch.cuda.synchronize()
    assert not any(c.any() for k, c in ops._COUNTERS.items() if k[0] == "cuda")


@pytest.mark.hopper
def test_programmatic_dependent_launch_gives_the_same_bits():
    """With pdl=True after a kernel that writes x, the batch kernel waits for it before its first load: the same
    bits as without, in a CUDA graph too (the engine's steps)."""
    N, K, M = 5120, 6144, 72
    t = w12.pack(escaped_weight(N, K, seed=15))
    x0 = gaussian_x(M, K, seed=16)
    x = torch.empty_like(x0)
    cfg = batch_heuristic(M, N, K, x.device)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

    def step():
        x.copy_(x0 * 2.0)  # the kernel before, writing x
        launch_batch(cfg, x, t, None, out, pdl=True)

    want = _batch(cfg, x0 * 2.0, t)
    step()
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert_replays_equal(capture_graph(step), [out], [want])


def test_a_tuned_entry_runs_the_batch_kernel_through_matmul_tiled(monkeypatch):
    from w12 import ops

    N, K, M = 1000, 4100, 72
    w = escaped_weight(N, K, seed=17)
    t = w12.pack(w)
    x = gaussian_x(M, K, seed=18)
    tuned = dict(autotune.load_tuned(x.device))
    key = autotune.shape_key(M=M, N=N, K=K)
    tuned[f"w12.matmul/batch/{key}"] = {"block_n": 64, "block_t": 128, "split_k": 2}
    monkeypatch.setattr(autotune, "load_tuned", lambda device=None: tuned)
    monkeypatch.setattr(autotune.config, "load_tuned", lambda device=None: tuned)
    calls = []
    real = ops.launch_batch
    monkeypatch.setattr(ops, "launch_batch", lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1])
    out = w12.matmul(x, t)
    assert calls == [BatchConfig(block_n=64, block_t=128, split_k=2)]
    assert_close(out, w12.matmul_reference(x, untile(t)), F.linear(x, w))
    assert torch.equal(out.view(torch.int16), _batch(calls[0], x, t).view(torch.int16))


@pytest.mark.hopper
@pytest.mark.parametrize("M", [32, 40, 128])
@pytest.mark.parametrize("q8", [False, True])
def test_heuristic_builds_run_wgmma_without_spills(M, q8):
    N, K = 5120, 6144
    t = w12.pack(escaped_weight(N, K, seed=19))
    x = gaussian_x(M, K, seed=20)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    ck = launch_batch(batch_heuristic(M, N, K, x.device), x, t, None, out, q8=q8)
    assert "wgmma.mma_async" in ck.asm["ptx"]
    assert ck.n_spills == 0, ck.n_spills
