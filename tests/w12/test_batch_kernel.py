"""The batch kernel (w12/kernels/batch.py: the runtime layout's tensor-core GEMM for many rows of x) on the CPU,
under the Triton interpreter, against the fp64 oracle: its error at most 2x that of a same-precision F.linear on the
unpacked weight (specpilot.testing.assert_close), NaN and infinities where the oracle has them, and bit for bit
where every output is one product (x = I). The runtime layout's tiles and x sit inside guard bytes that would change
the results if a load strayed past them.
"""

import inspect

import pytest
import torch
import torch.nn.functional as F

import autotune
import w12
from specpilot.testing import assert_bitwise_equal, assert_close
from flow_emu import gaussian_x, hostile_weight
from w12.configs import BatchConfig, batch_heuristic
from w12.layout import TiledW12, untile

SMALL = BatchConfig(block_n=16, block_t=16, groups=1, split_k=1, num_stages=1)


def _weight(n: int, k: int, seed: int, huge: bool = True) -> torch.Tensor:
    """Gaussian rows with escapes salted in: zeros of both signs, tiny and (`huge`) huge values beside normal
    ones."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    flat = w.view(-1)
    idx = torch.randperm(n * k, generator=g)[: max(2, n * k // 40)]
    vals = torch.tensor([0.0, 1e-30, -3e-25, 2.0 ** 20 if huge else 3.0, -(2.0 ** -40), -0.0, 5e8 if huge else -2.5])
    flat[idx] = vals[torch.arange(idx.numel()) % vals.numel()]
    return w.to(torch.bfloat16)


def _x(m: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    return gaussian_x(m, k, seed, dtype, device="cpu")


def _guarded(t: TiledW12) -> TiledW12:
    """The same layout with its tiles inside 4 KB of 0xFF bytes on each side (a decoded 0xFF is a large negative
    weight): a read past either end changes the product."""
    guard = 4096
    buf = torch.full((t.tiles.numel() + 2 * guard,), 0xFF, dtype=torch.uint8, device=t.tiles.device)
    buf[guard:guard + t.tiles.numel()] = t.tiles
    return TiledW12(buf[guard:guard + t.tiles.numel()], t.e0, t.esc_rowptr, t.esc_col, t.esc_val, t.N, t.K)


def _guarded_x(x: torch.Tensor) -> torch.Tensor:
    """x as a strided view inside NaN columns and rows: a read outside it turns its outputs to NaN."""
    m, k = x.shape
    big = torch.full((m + 2, 2 * k + 6), float("nan"), dtype=x.dtype, device=x.device)
    big[1:m + 1, 3:2 * k + 3:2] = x
    return big[1:m + 1, 3:2 * k + 3:2]


def _run(x, t, bias=None, *, q8=False, cfg=SMALL):
    with autotune.force("w12.matmul_q8" if q8 else "w12.matmul", config=cfg):
        return (w12.matmul_q8 if q8 else w12.matmul)(x, t, bias)


def _check(out, x, w, t, bias=None, q8=False):
    packed = untile(t)
    ref = (w12.matmul_q8_reference if q8 else w12.matmul_reference)(x, packed, bias)
    wd = (w12.decode_q8(packed) if q8 else w).to(x.dtype)
    base = F.linear(x.float(), wd.float(), None if bias is None else bias.float()).to(x.dtype)
    assert out.dtype == x.dtype and out.shape == ref.shape
    return assert_close(out, ref, base)


# (N, K): a partial last row block (N % 16), the masked last group (K % 64, odd and even), K below one group, several
# groups a K step
SHAPES = [(40, 200), (33, 130), (16, 40), (48, 256), (20, 64)]
CONFIGS = [SMALL, BatchConfig(block_n=32, block_t=32, groups=2, split_k=2, num_stages=2),
           BatchConfig(block_n=16, block_t=64, groups=4, split_k=3, num_stages=1)]
# the k order with a thread's pairs adjacent in the tile (`kt`): its own column map for x and its own nibble moves
KT = BatchConfig(block_n=32, block_t=32, groups=2, split_k=2, num_stages=2, kt=True)


@pytest.mark.parametrize("cfg", CONFIGS + [KT], ids=lambda c: c.tag())
@pytest.mark.parametrize("N,K", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
def test_batch_kernel_matches_the_oracle(N, K, cfg):
    w = _weight(N, K, seed=N * K)
    t = _guarded(w12.pack(w))
    x = _x(37, K, seed=K)
    bias = _x(1, N, seed=N)[0]
    _check(_run(_guarded_x(x), t, bias, cfg=cfg), x, w, t, bias)
    _check(_run(x, t, cfg=cfg), x, w, t)


@pytest.mark.parametrize("N,K", [(40, 200), (33, 130)])
def test_batch_kernel_8_bit_view(N, K):
    w = _weight(N, K, seed=3 * N + K)
    t = _guarded(w12.pack(w))
    x = _x(20, K, seed=5)
    for cfg in CONFIGS[:2] + [KT]:
        _check(_run(x, t, q8=True, cfg=cfg), x, w, t, q8=True)


def test_batch_kernel_fp16_x():
    """fp16 x: the decoded weight and x in fp32 (tf32 MMAs, exact for both), one rounding to fp16 (escapes that fit
    fp16's range: larger ones overflow the fp16 output, as in F.linear)."""
    N, K = 40, 200
    w = _weight(N, K, seed=11, huge=False)
    t = w12.pack(w)
    x = _x(21, K, seed=12, dtype=torch.float16)
    bias = _x(1, N, seed=13, dtype=torch.float16)[0]
    for cfg in CONFIGS[:2] + [KT]:
        out = _run(x, t, bias, cfg=cfg)
        assert out.dtype == torch.float16
        _check(out, x, w, t, bias)


@pytest.mark.parametrize("cfg", [CONFIGS[1], KT], ids=lambda c: c.tag())
@pytest.mark.parametrize("q8", [False, True])
def test_batch_kernel_hostile_rows(q8, cfg):
    """NaN, +-Inf, +-0, subnormals, huge and tiny rows, escapes beside their window: the non-finite outputs where the
    oracle has them, the finite ones within its bound. x is scaled so that no output's finite products add up, in
    magnitude, past fp32's largest value: there any fp32 sum depends on its order (+Inf in one partial sum and -Inf
    in another give NaN where fp64 stays finite), and the test checks that none does."""
    N, K = 40, 136
    w = hostile_weight(N, K, seed=17)
    w[6, 3] = float("inf")  # one infinite weight in a row of finite ones: +-Inf by the sign of x
    t = _guarded(w12.pack(w))
    x = (_x(19, K, seed=18).float() * 2.0 ** -8).to(torch.bfloat16)
    packed = untile(t)
    wd = (w12.decode_q8(packed) if q8 else w).double()
    finite = torch.where(torch.isfinite(wd), wd, torch.zeros_like(wd))
    assert (x.double().abs() @ finite.abs().T).max() < torch.finfo(torch.float32).max
    out = _run(x, t, q8=q8, cfg=cfg)
    ref = (w12.matmul_q8_reference if q8 else w12.matmul_reference)(x, packed)
    assert torch.isnan(ref).any() and torch.isinf(ref).any()
    assert_close(out, ref, F.linear(x.float(), wd.float()).to(x.dtype))


@pytest.mark.parametrize("cfg", CONFIGS[:2] + [KT], ids=lambda c: c.tag())
def test_one_hot_rows_give_the_weight_bit_for_bit(cfg):
    """x = I: each output is one product w * 1 plus zeros, so the result is W^T bit for bit: escapes (code 0 reads
    as v0 = 2^(e0 - 127), which the epilogue takes back before it adds the value), the masked last group and the
    partial row block included."""
    N, K = 40, 70
    w = _weight(N, K, seed=23)
    w[3, 66] = 1e-30  # a tiny escape in the masked last group
    w[5, :] = 0.0
    t = w12.pack(w)
    assert t.num_escapes > 0
    x = torch.eye(K, dtype=torch.bfloat16)
    out = _run(x, t, cfg=cfg)
    assert_bitwise_equal(out + 0.0, w.t().contiguous() + 0.0, "one-hot")  # + 0.0: a sum of zeros is +0.0


@pytest.mark.parametrize("K,split", [(130, 8), (645, 7), (645, 8), (645, 4)])
def test_split_shares_cover_k_once(K, split):
    """Shares and steps that do not divide evenly (K = 645: ten full groups and a tail; 7 or 8 shares of 2 steps leave
    the last two or three shares no step, and the last one the tail alone), more shares asked than steps (K = 130):
    every column's product and escape correction once, in the share that multiplied it (x = I: the weight bit for
    bit)."""
    N = 24
    w = _weight(N, K, seed=K)
    w[5, K - 2] = 1e-30  # escapes in the masked last group and in the last full one
    w[7, 64 * (K // 64) - 3] = -3e-25
    t = w12.pack(w)
    x = _x(5, K, seed=30)
    cfg = BatchConfig(block_n=16, block_t=16, groups=1, split_k=split, num_stages=1)
    _check(_run(x, t, cfg=cfg), x, w, t)
    cols = torch.cat([torch.arange(8), torch.arange(64 * (K // 64) - 8, K)])  # one-hot rows: the first and last columns
    eye = torch.eye(K, dtype=torch.bfloat16)[cols]
    assert_bitwise_equal(_run(eye, t, cfg=cfg) + 0.0, w.t()[cols].contiguous() + 0.0, f"x = I, split {split}")


@pytest.mark.parametrize("split", [2, 3])
def test_last_share_adds_the_partials_with_the_reduce_kernels_bits(split):
    """fixup=True: the K share that counts last adds the partials in share order, with the bias, as the split-K
    reduce kernel does: the same bits, one launch, and every tile counter back at zero after the call (the next
    launch on the stream starts from zero)."""
    from w12 import ops

    N, K = 40, 330  # three row tiles at block_n 16, two of x, five full groups and a tail
    w = _weight(N, K, seed=47)
    t = w12.pack(w)
    x = _x(20, K, seed=48)
    bias = _x(1, N, seed=49)[0]
    cfg = BatchConfig(block_n=16, block_t=16, split_k=split, num_stages=1)
    plain = _run(x, t, bias, cfg=cfg)
    fixed = _run(x, t, bias, cfg=BatchConfig(block_n=16, block_t=16, split_k=split, num_stages=1, fixup=True))
    assert_bitwise_equal(fixed, plain, "fixup")
    _check(fixed, x, w, t, bias)
    (cnt,) = [c for k, c in ops._COUNTERS.items() if k[0] == "cpu"]
    assert cnt.numel() >= 6 and not cnt.any()
    assert_bitwise_equal(_run(x, t, bias, cfg=BatchConfig(block_n=16, block_t=16, split_k=split, num_stages=1,
                                                          fixup=True)), plain, "fixup, second launch")


def test_groups_not_dividing_the_full_groups_are_halved(monkeypatch):
    """The main loop reads whole K steps without a mask, so a config whose groups do not divide the layout's full
    column groups launches with fewer (KF = 3: 1; KF = 4: 4 kept)."""
    from w12 import ops

    real = ops.w12_batch_kernel
    kf = list(inspect.signature(real.fn).parameters).index("KF")
    seen = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((args[kf], kw["GROUPS"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(ops, "w12_batch_kernel", Spy())
    cfg = BatchConfig(block_n=16, block_t=16, groups=4, num_stages=1)
    for K in (192, 256):
        w = _weight(16, K, seed=K)
        t = w12.pack(w)
        x = _x(3, K, seed=K)
        _check(_run(x, t, cfg=cfg), x, w, t)
    assert seen == [(3, 1), (4, 4)]


def test_batch_config_checks_and_tag():
    assert BatchConfig().tag() == "batch-n64-t128-g1-k1-w4-s3"
    assert BatchConfig(asm=False).tag().endswith("-plain")
    for cfg in (BatchConfig(), BatchConfig(block_n=128, block_t=32, groups=2, split_k=3, num_warps=8, num_stages=4,
                                           asm=False, fixup=True), BatchConfig(split_k=2, fixup=True), KT,
                BatchConfig(split_k=2, fixup=True, kt=True)):
        assert BatchConfig.from_tag(cfg.tag()) == cfg
    for bad in (dict(block_n=8), dict(block_t=512), dict(block_t=48), dict(groups=3), dict(split_k=0),
                dict(num_warps=3), dict(num_stages=0)):
        with pytest.raises(ValueError, match="^BatchConfig needs "):
            BatchConfig(**bad)


@pytest.mark.parametrize("M,N,K", [(33, 5120, 6144), (72, 17408, 5120), (256, 5120, 17408), (200, 248320, 5120),
                                   (40, 100, 130), (64, 64, 40)])
def test_batch_heuristic_gives_a_launchable_config(M, N, K):
    cfg = batch_heuristic(M, N, K, torch.device("cpu"))
    assert cfg.block_t == min(128, max(16, 1 << (M - 1).bit_length()))
    assert (K // 64) % cfg.groups == 0 or K // 64 == 0
    assert 1 <= cfg.split_k <= max(1, K // 64 // cfg.groups)


def test_forced_batch_config_runs_at_any_row_count_and_dispatch_keeps_the_paths_without_it(monkeypatch):
    """A forced BatchConfig takes the call at 3 and at 40 rows; without it a CPU call keeps the decode path (the
    batch kernel runs by default only where a tuned entry of the GPU names it)."""
    from w12 import ops

    calls = []
    real = ops.launch_batch
    monkeypatch.setattr(ops, "launch_batch", lambda *a, **k: (calls.append(a[1].shape[0]), real(*a, **k))[1])
    w = _weight(20, 70, seed=31)
    t = w12.pack(w)
    for m in (3, 40):
        x = _x(m, 70, seed=m)
        _check(_run(x, t), x, w, t)
        _check(w12.matmul(x, t), x, w, t)
    assert calls == [3, 40]


def test_forced_batch_config_on_cpu_without_the_interpreter_says_how_to_fix(monkeypatch):
    monkeypatch.setattr(autotune, "is_interpreter", lambda: False)
    w = _weight(20, 70, seed=37)
    t = w12.pack(w)
    with pytest.raises(ValueError, match=r"^w12\.matmul_tiled: the forced BatchConfig is a Triton kernel's config, "
                                         r"and no kernel runs CPU tensors without the Triton interpreter; "):
        _run(_x(3, 70, seed=1), t)


def test_forced_batch_config_on_the_planes_is_refused():
    w = _weight(20, 70, seed=41)
    p = w12.pack(w, layout="planes")
    with pytest.raises(TypeError, match=r"^w12\.matmul: the forced BatchConfig runs on the runtime layout only"):
        _run(_x(3, 70, seed=1), p)


def test_a_tuned_entry_sends_a_gpu_call_to_the_batch_kernel(monkeypatch):
    """On a GPU the batch kernel runs by default only where this GPU's tuned file holds `<op>/batch/<key>` for the
    call's shape key (rows bucketed to a power of two); a forced FlowConfig still wins."""
    from types import SimpleNamespace

    from w12 import ops
    from w12.configs import FlowConfig

    t = w12.pack(_weight(20, 70, seed=43))
    key = autotune.shape_key(M=72, N=20, K=70)
    entry = {"block_n": 64, "block_t": 128, "groups": 1, "split_k": 2, "num_warps": 4, "num_stages": 3, "asm": True,
             "_": {"source": "a test"}}
    tuned = {f"w12.matmul/batch/{key}": entry}
    monkeypatch.setattr(autotune, "load_tuned", lambda device=None: tuned)
    monkeypatch.setattr(autotune.config, "load_tuned", lambda device=None: tuned)
    x = SimpleNamespace(is_cuda=True, shape=(72, 70), device=torch.device("cuda", 0))
    assert ops._batch_config(x, t, "w12.matmul") == BatchConfig(split_k=2)
    assert ops._batch_config(SimpleNamespace(is_cuda=True, shape=(33, 70), device=x.device), t, "w12.matmul") is None
    assert ops._batch_config(x, t, "w12.matmul_q8") is None  # the 8-bit view keeps its own entries
    with autotune.force("w12.matmul", config=FlowConfig()):
        assert ops._batch_config(x, t, "w12.matmul") is None


@pytest.mark.parametrize("seed", range(16))
def test_random_shapes_and_splits_give_each_column_once(seed):
    """Random weight shapes, tiles, splits (half the K steps to all of them: shares of two steps leave the last ones
    none) and groups: x's
    rows one-hot at random columns (the first, the last full group's and the last among them, every third row with an
    escape in the last), so each output is one weight, bit for bit, escapes included."""
    import random

    rng = random.Random(seed)
    N, K = rng.randint(1, 70), rng.randint(1, 1100)
    cfg = BatchConfig(block_n=rng.choice([16, 32, 64]), block_t=16, groups=rng.choice([1, 2, 4]),
                      split_k=rng.randint(max(1, K // 128), max(1, K // 64)), num_stages=1, fixup=rng.random() < 0.5,
                      kt=rng.random() < 0.5)
    w = _weight(N, K, seed=seed)
    w[::3, K - 1] = 1e-30
    t = w12.pack(w)
    cols = sorted({0, K - 1, max(0, 64 * (K // 64) - 1), *(rng.randrange(K) for _ in range(5))})
    x = torch.eye(K, dtype=torch.bfloat16)[cols]
    assert_bitwise_equal(_run(x, t, cfg=cfg) + 0.0, w.t()[cols].contiguous() + 0.0, f"{N}x{K} {cfg.tag()}")
