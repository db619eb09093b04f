"""GPU tests of lmhead.CertifiedHead at the width of a hybrid 27B model's head (H = 5120) with a 32000-token
vocabulary and a 248320-token one; M in {1, 8, 32} hidden rows; INT8 and W12 screens; CUDA-graph capture and
replay with new hidden states, and the early fallback inside a replayed graph; torch.compile(fullgraph=True)
through torch.ops.specpilot_lmhead.argmax; survivor counts of peaked and flat logits.

Oracles as in test_lmhead.py (conftest.py, fixture `lm`): argmax == torch.argmax(head.logits) bit for bit,
topk == the stable descending sort of the logits, the fp64 argmax on every provably decided row.
Run on the GPU machine: `python -m pytest tests/lmhead/test_lmhead_gpu.py -q`.
"""

import pytest
import torch

import lmhead
from specpilot.testing import assert_bitwise_equal, capture_graph

pytestmark = pytest.mark.gpu

DEV = "cuda"
H27 = 5120


def cuda_gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def weight(V, H=H27, seed=0, std=0.02):
    return (torch.randn(V, H, generator=cuda_gen(seed), device=DEV) * std).to(torch.bfloat16)


def hidden(M, H=H27, seed=1, std=1.0):
    return (torch.randn(M, H, generator=cuda_gen(seed), device=DEV) * std).to(torch.bfloat16)


def head_of(w, screen, **kw):
    import w12

    if screen == "w12":
        return lmhead.CertifiedHead(w12.pack(w, layout="planes"), screen="w12", **kw)
    return lmhead.CertifiedHead(w, screen=screen, **kw)


def check_fallbacks(head, h):
    """One argmax after reset_stats: the rows whose survivors exceed the head's capacity and the
    non-finite ones are exactly the fallbacks."""
    capacity = head.capacity
    head.reset_stats()
    head.argmax(h)
    st = head.stats()
    bad = int((~torch.isfinite(h.float())).any(-1).sum())
    want = sum(1 for m, x in enumerate(st["survivors"]) if x > capacity and torch.isfinite(h[m].float()).all())
    assert st["fallbacks"] == want + bad, \
        f"fallbacks {st['fallbacks']} != {want} rows over capacity {capacity} + {bad} non-finite ({st['survivors']})"
    return st


@pytest.fixture(scope="module")
def w32k():
    return weight(32000, seed=10)


# ------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("screen", ["int8", "int4", "none"])
@pytest.mark.parametrize("M", [1, 8, 32])
def test_argmax_32k(M, screen, w32k, lm):
    head = lmhead.CertifiedHead(w32k, screen=screen)
    h = hidden(M, seed=M)
    head.reset_stats()
    ids, logits = lm.check_argmax(head, h, msg=f"{screen} M={M}")
    for k in (1, 8, 64):
        lm.check_topk(head, h, k, logits, msg=f"{screen} M={M}")
    decided = lm.check_reference(ids, h, w32k)
    assert decided >= (M + 1) // 2, f"{decided}/{M} rows decided by the fp64 margin"
    if screen != "none":
        lm.check_bounds(head, h, w32k, logits)
        st = check_fallbacks(head, h)
        print(f"\n{screen} V=32000 M={M}: survivors {st['survivors']} fallbacks {st['fallbacks']}")


@pytest.mark.parametrize("M", [1, 32])
def test_w12_head_32k(M, w32k, lm):
    """The W12Weight of a random BF16 head, screened by its 8-bit view."""
    head = head_of(w32k, "w12")
    assert head.stats()["screen"] == "w12"
    h = hidden(M, seed=100 + M)
    ids, logits = lm.check_argmax(head, h, msg=f"w12 M={M}")
    lm.check_topk(head, h, 16, logits)
    lm.check_reference(ids, h, w32k)
    lm.check_bounds(head, h, w32k, logits)


def test_argmax_248k(lm):
    """A 248320-token vocabulary (2.5 GB BF16 head), 8 rows: exact, and the survivors are reported."""
    w = weight(248320, seed=20)
    head = lmhead.CertifiedHead(w, screen="int8")
    h = hidden(8, seed=21)
    head.reset_stats()
    ids, logits = lm.check_argmax(head, h, msg="V=248320")
    lm.check_topk(head, h, 32, logits)
    lm.check_reference(ids, h, w)
    st = head.stats()
    print(f"\nint8 V=248320 M=8: survivors {st['survivors']} fallbacks {st['fallbacks']}")
    assert len(st["survivors"]) == 8 and all(1 <= x <= 248320 for x in st["survivors"])


@pytest.mark.parametrize("screen", ["int8", "int4", "w12"])
def test_peaked_vs_flat_survivors(screen, w32k, lm):
    """Peaked logits (hidden = noise + 50 W_t) keep few survivors (< 64); flat ones (hidden = 0.05 x noise) keep
    many, and the rows over the capacity (256) fall back and are counted. Both exact; the counts are printed."""
    head = head_of(w32k, screen)
    targets = torch.tensor([3, 999, 12345, 31999, 7, 20000, 15, 1], device=DEV)
    peaked = (hidden(8, seed=31, std=0.5).float() + 50 * w32k[targets].float()).to(torch.bfloat16)
    flat = hidden(8, seed=32, std=0.05)
    got = {}
    for name, h in (("peaked", peaked), ("flat", flat)):
        ids, _ = lm.check_argmax(head, h, msg=name)
        head.reset_stats()
        head.argmax(h)
        st = got[name] = head.stats()
        print(f"\n{screen} {name}: survivors {st['survivors']} (mean {st['survivors_mean']:.1f}), "
              f"fallbacks {st['fallbacks']}")
        if name == "peaked":
            assert ids.tolist() == targets.tolist()
    assert max(got["peaked"]["survivors"]) < 64, got["peaked"]["survivors"]
    assert got["flat"]["survivors_mean"] >= got["peaked"]["survivors_mean"]
    for name, h in (("peaked", peaked), ("flat", flat)):
        check_fallbacks(head, h)


@pytest.mark.parametrize("screen", ["int8", "int4"])
@pytest.mark.parametrize("M", [1, 4, 8])
def test_hidden_in_two_parts(M, screen, w32k, lm):
    """Calls of up to 8 rows read the hidden states in two int8 parts (lmhead/configs.py split_rows): exact answers
    and bounds that hold, also on a row near BF16's least normal (its subnormals included), a narrower interval
    than one part gives (INT8: the median radius at most 0.65 of it) and no more survivors."""
    import dataclasses

    import autotune
    from lmhead.configs import head_config

    base = head_config("triton", 32000, H27, False, torch.device(DEV))
    heads = {}
    for rows in (8, 0):
        with autotune.force("lmhead.argmax", config=dataclasses.replace(base, split_rows=rows)):
            heads[rows] = lmhead.CertifiedHead(w32k, screen=screen)
    h = hidden(M, seed=60 + M)
    if M > 1:
        h[-1] = (h[-1].float() * 2.0**-124).to(torch.bfloat16)
    radius, surv = {}, {}
    for rows, head in heads.items():
        ids, logits = lm.check_argmax(head, h, msg=f"split_rows={rows}")
        L, U = lm.check_bounds(head, h, w32k, logits, msg=f"split_rows={rows}")
        radius[rows] = (U - L)[:1]
        head.reset_stats()
        head.argmax(h)
        surv[rows] = head.stats()["survivors"]
    ratio = float((radius[8] / radius[0]).median())
    print(f"\n{screen} M={M}: radius ratio {ratio:.3f}, survivors {surv[8]} (one part {surv[0]})")
    assert ratio < (0.65 if screen == "int8" else 0.99), ratio
    # the intervals need not nest token by token (the parts change the screen's value too): rows are allowed 5%
    assert sum(surv[8]) <= sum(surv[0]) and all(a <= b + b // 20 + 1 for a, b in zip(surv[8], surv[0])), \
        (surv[8], surv[0])


def test_capacity_fallback_on_gpu(w32k, lm):
    """A zero row (the whole vocabulary ties) and a NaN row among peaked ones (random hidden states keep thousands
    of survivors at this width and would overflow too): exact, 2 fallbacks."""
    head = lmhead.CertifiedHead(w32k, screen="int8", capacity=64)
    targets = torch.arange(8, device=DEV) * 3000 + 11
    h = (hidden(8, seed=41, std=0.5).float() + 50 * w32k[targets].float()).to(torch.bfloat16)
    h[2] = 0.0
    h[5, 17] = float("nan")
    head.reset_stats()
    ids, _ = lm.check_argmax(head, h)
    assert ids[2] == 0 and ids[5] == lmhead.NAN_ID and head.stats()["fallbacks"] == 2


# ------------------------------------------------------------------------------------ graphs and compile


@pytest.mark.parametrize("screen", ["int8", "w12"])
def test_cuda_graph_replay(screen, w32k, lm):
    """head.argmax captured once into a CUDA graph; new hidden states copied into the captured input (one with a
    flat row and a NaN row, which fall back inside the graph) replay to the eager answers."""
    head = head_of(w32k, screen, capacity=128)
    h_static = hidden(8, seed=50)
    held = {}

    def step():
        held["ids"] = head.argmax(h_static)

    graph = capture_graph(step)
    for rep, seed in enumerate((51, 52, 53)):
        new = hidden(8, seed=seed)
        if rep == 1:
            new[3] = 0.0
            new[6, 100] = float("nan")
        if rep == 2:
            new[0] = (60 * w32k[4242].float()).to(torch.bfloat16)
        h_static.copy_(new)
        held["ids"].fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        eager = head.argmax(new)
        assert_bitwise_equal(held["ids"], eager, f"replay {rep}:")
        want = lm.argmax_of(head.logits(new))
        assert_bitwise_equal(held["ids"], want, f"replay {rep} vs argmax(logits):")
        if rep == 2:
            assert int(held["ids"][0]) == 4242


def test_early_fallback_in_a_cuda_graph(w32k, lm):
    """head.argmax (M = 8, capacity 128) captured once, then replayed over flat hidden states (zeros: every token
    ties, every row overflows) and then peaked ones (fewer than 64 survivors a row). After each replay: the ids
    equal argmax(head.logits), and the policy state (read through stats()) and the fallback counter follow
    lmhead.early_fallback_reference: the graph reads and updates the same state, reset in place by reset_stats."""
    head = lmhead.CertifiedHead(w32k, screen="int8", capacity=128)
    targets = torch.tensor([3, 999, 12345, 31999, 7, 20000, 15, 1], device=DEV)
    peaked = (hidden(8, seed=31, std=0.5).float() + 50 * w32k[targets].float()).to(torch.bfloat16)
    flat = torch.zeros(8, H27, dtype=torch.bfloat16, device=DEV)
    h_static = flat.clone()
    held = {}

    def step():
        held["ids"] = head.argmax(h_static)

    graph = capture_graph(step)  # one eager warm-up call (it makes the state of M = 8), then the capture
    head.reset_stats()
    script = [flat] * 7 + [peaked] * 6
    want = lmhead.early_fallback_reference([x is flat for x in script])
    assert want == [False, True, False, True, True, False, True, True, True, True, False, False, False]
    for i, x in enumerate(script):
        h_static.copy_(x)
        held["ids"].fill_(-2)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(held["ids"], lm.argmax_of(head.logits(x)), f"replay {i}:")
        if x is peaked:
            assert held["ids"].tolist() == targets.tolist()
        st = head.stats()
        pol = st["policy"][8]
        assert pol["calls"] == i + 1 and pol["skipped"] == sum(want[:i + 1]), f"replay {i}: {pol}"
        assert pol["last_skipped"] == want[i], f"replay {i}: {pol}"
        screened_flat = sum(1 for j in range(i + 1) if script[j] is flat and not want[j])
        assert st["fallbacks"] == 8 * screened_flat, f"replay {i}: fallbacks {st['fallbacks']}"


def test_torch_compile_fullgraph(w32k, lm):
    """A function calling head.argmax inside torch.compile(fullgraph=True) (through the registered custom op):
    the same ids as eager, also on a second call with other hidden states."""
    assert hasattr(torch.ops.specpilot_lmhead, "argmax")
    head = lmhead.CertifiedHead(w32k, screen="int8")

    def f(h):
        return head.argmax(h * 1) + 0  # traced ops around the custom op

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    for seed in (60, 61):
        h = hidden(8, seed=seed)
        got = cf(h)
        assert_bitwise_equal(got, f(h), f"seed {seed}:")
        assert_bitwise_equal(got, torch.argmax(head.logits(h), dim=-1), f"seed {seed} vs argmax(logits):")


def test_hidden_on_the_wrong_device(w32k, lm):
    head = lmhead.CertifiedHead(w32k[:1000], screen="int8")
    with lm.expect_error(r"cuda|device"):
        head.argmax(torch.zeros(2, H27, dtype=torch.bfloat16))


def hostile_head(V, H=H27, seed=7):
    """A head whose W12 codes cover the decode's corners: Gaussian rows, an all-zero row (e0 = 0), rows of +-0.0,
    subnormals, huge and tiny values, and rows salted with values outside their window (escapes)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g) * 0.02
    w[1] = 0.0
    w[2] = -0.0
    w[3] = torch.randn(H, generator=g) * 2.0**-130  # subnormal BF16
    w[4] = torch.randn(H, generator=g) * 2.0**100
    w[5] = torch.randn(H, generator=g) * 2.0**-100
    w[6, ::3] = -0.0
    for r in range(7, V, 5):
        cols = torch.randperm(H, generator=g)[:H // 20]
        w[r, cols] = torch.randn(cols.numel(), generator=g) * 2.0 ** torch.randint(-60, 60, (cols.numel(),),
                                                                                     generator=g).float()
    return w.to(torch.bfloat16).to(DEV)


@pytest.mark.parametrize("screen", ["none", "w12"])
@pytest.mark.parametrize("M", [1, 32])
def test_w12_exact_logits_packed_decode_equal_the_plain_decode(screen, M, monkeypatch):
    """A W12 head's exact logits on the GPU come from the packed PTX decode (lmhead.ops._packed_decode); the same
    kernel with the plain Triton decode gives the same bits: the full pass (logits, and argmax with no screen) and
    the survivors' pass (topk values and ids behind the 8-bit view's screen), on hostile codes."""
    import w12

    import lmhead.ops as ops

    assert ops._packed_decode(torch.device(DEV))[0] is not None
    w = hostile_head(4096)
    head = lmhead.CertifiedHead(w12.pack(w, layout="planes"), screen=screen)
    h = hidden(M, seed=200 + M)
    got = head.logits(h), head.argmax(h), *head.topk(h, 8)
    monkeypatch.setattr(ops, "_packed_decode", lambda device: (None, None))
    want = head.logits(h), head.argmax(h), *head.topk(h, 8)
    for name, a, b in zip(("logits", "argmax", "topk values", "topk ids"), got, want):
        assert_bitwise_equal(a, b, f"{name} (screen={screen}, M={M}), packed against plain decode:")
    assert torch.isfinite(got[0]).all() and (got[0] != 0).any()
