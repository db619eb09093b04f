"""GPU tests of tree_attn at serving shapes: a 32-node draft tree over prefixes up to 4096 keys (H=24, Hkv=4,
D=256), a ragged batch of 8, every GQA ratio and head dim, both cache layouts, both Triton variants and, on sm_90,
the warp-specialised CUDA C++ kernel ("ws"); CUDA-graph replay across new inputs and plan.update, and of the
one-call path across new metadata written in place; its device checks; torch.compile;
the tensor-core instructions of each variant on sm_90.

Bounds as in test_tree_attn.py (conftest.check_attn). Run on the GPU machine:
`python -m pytest tests/tree_attn/test_tree_attn_gpu.py -q`.
"""

import pytest
import torch

import autotune
import tree_attn
from tree_attn.configs import WSConfig
from specpilot.testing import assert_bitwise_equal, assert_replays_equal, capture_graph

pytestmark = pytest.mark.gpu

DEV = "cuda"
TRITON = ["wgmma", "mma"]
WS = pytest.param("ws", marks=pytest.mark.hopper, id="ws_kernel")  # the CUDA C++ kernel: sm_90 only
KERNELS = [*TRITON, WS]


def attend(b, variant=None):
    out = b.poisoned_out()
    got, lse = tree_attn.tree_attention(*b.args(), sm_scale=b.sm_scale, **b.new_kw(), out=out, return_lse=True,
                                        variant=variant)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr(), "the result is not the out= tensor"
    return got, lse


# ------------------------------------------------------------------------------------ serving shapes

RAGGED8 = [("draft64", 3001), ("single", 1), ("empty", 40), ("chain17", 0), ("star9", 129), ("draft24", 777),
           ("rand48", 2048), ("forest5", 64)]
CASES = {
    # B=1 draft tree at the dims of a 24-head, 4-KV-head, D=256 model, a prefix from one key to 4096
    "B1-draft32-L1": ([("draft32", 1)], 24, 4, 256),
    "B1-draft32-L517": ([("draft32", 517)], 24, 4, 256),
    "B1-draft32-L4096": ([("draft32", 4096)], 24, 4, 256),
    "B1-chain64-L2048": ([("chain64", 2048)], 24, 4, 256),
    # a ragged batch of 8: sizes 0..64, prefixes 0..3001
    "B8-ragged": (RAGGED8, 32, 8, 128),
}


# `make test-gpu` runs every variant and layout on the 517-key prefix and the ragged batch of 8 (requests of 0..64
# nodes); the other prefixes repeat those paths at other lengths and run in `make test-gpu-full` (slow)
_FAST_CASES = {"B1-draft32-L517", "B8-ragged"}


@pytest.mark.parametrize("variant", [*KERNELS, None])
@pytest.mark.parametrize("layout, nodes_in_cache", [("slot", False), ("slot", True), ("paged", False),
                                                    ("paged", True)],
                         ids=["slot-k_new", "slot-nodes-in-cache", "paged-k_new", "paged-nodes-in-cache"])
@pytest.mark.parametrize("case", [c if c in _FAST_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_serving_shapes(case, layout, nodes_in_cache, variant, make_batch, check):
    reqs, H, Hkv, D = CASES[case]
    b = make_batch(reqs, H=H, Hkv=Hkv, D=D, layout=layout, page_size=16, nodes_in_cache=nodes_in_cache,
                   seed=len(case), device=DEV)
    out, lse = attend(b, variant)
    check(b, out, lse, msg=f"{case}/{layout}/{variant}")


@pytest.mark.parametrize("variant", KERNELS)
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("G", [1, 6, 8])
def test_gqa_and_head_dims(G, D, variant, make_batch, check):
    """GQA ratios 1, 6, 8 over 4 KV heads (H = 4, 24, 32), every head dim, both variants."""
    b = make_batch([("draft32", 1000), ("draft7", 33), ("single", 0), ("chain64", 5)], H=4 * G, Hkv=4, D=D,
                   seed=G + D, device=DEV)
    out, lse = attend(b, variant)
    check(b, out, lse, msg=f"G={G} D={D} {variant}")


@pytest.mark.parametrize("layout, nodes_in_cache", [("slot", False), ("paged", True)])
@pytest.mark.parametrize("reqs", [[("single", 4096)], [("chain2", 3001), ("single", 0), ("single", 517)]],
                         ids=["one-token", "two-nodes-ragged"])
def test_small_trees_take_one_16_row_tile(reqs, layout, nodes_in_cache, make_batch, check):
    """Trees of at most 16 rows (nodes x G = 6 and 12 here) run 16-row tiles by default on sm_90 (mma.sync in place
    of a 64-row wgmma tile): the plan and the one call, checked against fp64; a one-node tree over 4k keys as the
    engine's autoregressive step calls it."""
    b = make_batch(reqs, H=24, Hkv=4, D=256, layout=layout, nodes_in_cache=nodes_in_cache, seed=len(reqs),
                   device=DEV)
    plan = tree_attn.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask, **b.plan_kw())
    if torch.cuda.get_device_capability()[0] == 9:
        assert plan.dispatch.config.block_m == 16
    out = b.poisoned_out()
    got, lse = tree_attn.run(plan, b.q, b.k_cache, b.v_cache, **b.new_kw(), out=out, return_lse=True)
    torch.cuda.synchronize()
    check(b, got, lse, msg=f"run {layout}")
    got, lse = attend(b)
    check(b, got, lse, msg=f"one call {layout}")


@pytest.mark.parametrize("variant", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dtypes_and_peaked_scores(dtype, variant, make_batch, check):
    """Both dtypes, scores with a spread of tens (q scaled by 6): the online softmax and the split merge
    rescale without overflow or 0/0."""
    b = make_batch(RAGGED8, H=32, Hkv=8, D=128, dtype=dtype, seed=3, q_scale=6.0, device=DEV)
    out, lse = attend(b, variant)
    check(b, out, lse, msg=f"{dtype}/{variant}")


@pytest.mark.parametrize("variant", KERNELS)
@pytest.mark.parametrize("layout, nodes_in_cache", [("slot", False), ("paged", True)])
def test_unnamed_slots_are_never_read(layout, nodes_in_cache, variant, make_batch, check):
    """Every cache slot that no request names holds NaN (a padded key block that loads slot 0 or a
    neighbour's slots would make outputs NaN)."""
    b = make_batch(RAGGED8, H=32, Hkv=8, D=128, layout=layout, nodes_in_cache=nodes_in_cache, seed=4,
                   unused=float("nan"), device=DEV)
    out, lse = attend(b, variant)
    check(b, out, lse, msg=f"{layout}/{variant}")


@pytest.mark.parametrize("layout", ["slot", "paged"])
def test_strided_caches(layout, make_batch, check):
    """K and V as views into one fused [.., 2, ..] buffer: any strides but a contiguous head dim."""
    b = make_batch(RAGGED8[:4], H=24, Hkv=4, D=256, layout=layout, fused_kv=True, nodes_in_cache=True, seed=5,
                   device=DEV)
    assert not b.k_cache.is_contiguous()
    out, lse = attend(b)
    check(b, out, lse, msg=layout)


def test_default_variant_by_arch():
    """sm_90 runs the wgmma variant by default, other GPUs the portable mma variant."""
    major = torch.cuda.get_device_capability()[0]
    want = "wgmma" if major == 9 else "mma" if major >= 8 else "reference"
    assert tree_attn.VARIANTS.default(torch.device(DEV)) == want


def test_wrong_device(make_batch, raises):
    """A CPU index tensor, a CPU cache or a CPU plan beside CUDA tensors is refused with the device named."""
    b = make_batch([("draft6", 9), ("single", 2)], H=4, Hkv=2, D=64, seed=6, device=DEV)
    with raises(r"cpu|device"):
        tree_attn.tree_attention(b.q, b.k_cache, b.v_cache, b.kv_indptr, b.kv_indices.cpu(), b.qo_indptr,
                                 b.tree_mask, **b.new_kw())
    with raises(r"cpu|device"):
        tree_attn.tree_attention(b.q, b.k_cache.cpu(), b.v_cache.cpu(), *b.args()[3:], **b.new_kw())
    with raises(r"cpu|device"):
        tree_attn.tree_attention(*b.args(), k_new=b.k_new.cpu(), v_new=b.v_new.cpu())
    cpu_plan = tree_attn.plan(b.qo_indptr.cpu(), b.kv_indptr.cpu(), b.kv_indices.cpu(), b.tree_mask.cpu(),
                              **b.plan_kw())
    with raises(r"cpu|device"):
        tree_attn.run(cpu_plan, b.q, b.k_cache, b.v_cache, **b.new_kw())


# ------------------------------------------------------------------------------------ graphs, compile

STEP1 = [("draft32", 700), ("draft12", 33), ("single", 0), ("chain5", 1500)]
STEP2 = [("rand32", 700), ("star12", 33), ("single", 0), ("draft5", 1500)]  # same sizes, other trees and slots


def _captured(b, call, check):
    """`call(out)` -> (out, lse) captured in a CUDA graph on batch b's buffers: its replays equal the eager call
    (`call(None)`) bit for bit, and its result passes the reference check. Returns (graph, out, lse)."""
    out = b.poisoned_out()
    held = {}

    def step():
        held["out"], held["lse"] = call(out)

    eager_out, eager_lse = call(None)
    graph = capture_graph(step)
    assert_replays_equal(graph, [out, held["lse"]], [eager_out, eager_lse], reps=5)
    check(b, out, held["lse"], msg="captured step")
    return graph, out, held["lse"]


def _replay(graph, out):
    """One replay into `out`, NaN-filled first so that an element the kernels leave unwritten fails the check."""
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()


def _load(dst, src):
    """Copy src's data (q, caches, k_new/v_new) into dst's tensors, the buffers a graph captured."""
    for name in ("q", "k_cache", "v_cache", "k_new", "v_new"):
        if getattr(dst, name) is not None:
            getattr(dst, name).copy_(getattr(src, name))


@pytest.mark.parametrize("variant", KERNELS)
@pytest.mark.parametrize("layout, nodes_in_cache", [("slot", False), ("paged", True)])
def test_cuda_graph_replays_new_inputs_and_updated_plan(layout, nodes_in_cache, variant, make_batch, check):
    """run() captured once replays (1) bit-identically to the eager call, (2) on new q/k/v copied into the
    captured buffers, (3) on the next step after plan.update of the same sizes (other trees, other slots)."""
    kw = dict(H=24, Hkv=4, D=128, layout=layout, nodes_in_cache=nodes_in_cache, device=DEV, cache_slots=4096)
    b = make_batch(STEP1, seed=7, **kw)
    plan = tree_attn.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask, **b.plan_kw(variant=variant,
                                                                                            capacity=1024))
    graph, out, lse = _captured(b, lambda out: tree_attn.run(plan, b.q, b.k_cache, b.v_cache, **b.new_kw(), out=out,
                                                             return_lse=True), check)

    b2 = b.refill(seed=8)  # (2) the next layer: same plan, new values in the same buffers
    _load(b, b2)
    _replay(graph, out)
    check(b2, out, lse, msg="new inputs")

    b3 = make_batch(STEP2, seed=9, **kw)  # (3) the next step
    _load(b, b3)
    plan.update(b3.qo_indptr, b3.kv_indptr, b3.kv_indices, b3.tree_mask)
    _replay(graph, out)
    check(b3, out, lse, msg="after update")

    b4 = b.refill(seed=11)  # (4) update from host tensors (no sync): the same result as from device tensors
    _load(b, b4)
    plan.update(b4.qo_indptr.cpu(), b4.kv_indptr.cpu(), b4.kv_indices.cpu(), b4.tree_mask.cpu())
    _replay(graph, out)
    check(b4, out, lse, msg="after an update from host tensors")


STEP3 = [("rand32", 1200), ("star12", 33), ("single", 700), ("draft5", 0)]  # STEP1's nodes, 300 keys fewer


@pytest.mark.parametrize("variant", TRITON)
@pytest.mark.parametrize("layout, nodes_in_cache", [("slot", False), ("paged", True)])
def test_one_call_graph_replays_new_metadata(layout, nodes_in_cache, variant, make_batch, check):
    """The one-call tree_attention (its schedule built on the device) captured once replays a new step whose
    metadata was written into the captured tensors in place: other trees, other prefix lengths, other slots, fewer
    keys in the same kv_indices buffer, no plan and no host step."""
    kw = dict(H=24, Hkv=4, D=128, layout=layout, nodes_in_cache=nodes_in_cache, device=DEV, cache_slots=4096)
    b = make_batch(STEP1, seed=7, **kw)
    graph, out, lse = _captured(b, lambda out: tree_attn.tree_attention(*b.args(), **b.new_kw(), out=out,
                                                                        return_lse=True, variant=variant), check)
    b3 = make_batch(STEP3, seed=9, **kw)
    assert b3.kv_indices.shape[0] == b.kv_indices.shape[0] - 300 and b3.q.shape == b.q.shape
    _load(b, b3)
    for name in ("qo_indptr", "kv_indptr", "tree_mask"):
        getattr(b, name).copy_(getattr(b3, name))
    b.kv_indices[:b3.kv_indices.shape[0]].copy_(b3.kv_indices)
    b.kv_indices[b3.kv_indices.shape[0]:] = -1  # past kv_indptr[-1]: never read
    _replay(graph, out)
    check(b3, out, lse, msg="new metadata in place")
    tree_attn.check_metadata(DEV)  # nothing recorded


@pytest.mark.parametrize("variant", TRITON)
@pytest.mark.parametrize("layout, nodes_in_cache", [("slot", False), ("paged", True)])
def test_device_plan_graph_replays_updates_without_a_host_schedule(layout, nodes_in_cache, variant, make_batch,
                                                                   check):
    """plan(schedule="device"): run() captured once replays the next step after update(validate=False) from device
    tensors (no sync, no host schedule), fewer keys in the kv_capacity buffer."""
    kw = dict(H=24, Hkv=4, D=128, layout=layout, nodes_in_cache=nodes_in_cache, device=DEV, cache_slots=4096)
    b = make_batch(STEP1, seed=7, **kw)
    plan = tree_attn.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask,
                          **b.plan_kw(variant=variant, schedule="device", kv_capacity=4096))
    graph, out, lse = _captured(b, lambda out: tree_attn.run(plan, b.q, b.k_cache, b.v_cache, **b.new_kw(), out=out,
                                                             return_lse=True), check)
    b3 = make_batch(STEP3, seed=9, **kw)
    _load(b, b3)
    plan.update(b3.qo_indptr, b3.kv_indptr, b3.kv_indices, b3.tree_mask, validate=False)
    _replay(graph, out)
    check(b3, out, lse, msg="after a device-side update")
    tree_attn.check_metadata(DEV)  # nothing recorded


@pytest.mark.parametrize("fault", ["slot", "indptr"])
def test_one_call_refuses_bad_metadata_on_the_device(fault, make_batch, raises):
    """A slot past the cache, or kv_indptr past kv_indices: the call reads nothing out of bounds, writes NaN, and
    check_metadata raises the problem."""
    b = make_batch(STEP1, H=24, Hkv=4, D=128, device=DEV, seed=12)
    tree_attn.check_metadata(DEV)
    if fault == "slot":
        b.kv_indices[100] = b.cache_slots + 10_000_000
    else:
        b.kv_indptr[-1] += 1_000_000
    got, _ = attend(b)
    assert torch.isnan(got.float()).any()
    with raises(r"kv_indices\[100\]" if fault == "slot" else r"kv_indptr"):
        tree_attn.check_metadata(DEV)


def test_torch_compile_fullgraph(make_batch, check):
    """run() through its registered op inside torch.compile(fullgraph=True): the same bits as eager."""
    b = make_batch(STEP1, H=24, Hkv=4, D=128, seed=10, device=DEV)
    plan = tree_attn.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask, **b.plan_kw())

    def f(q, k_cache, v_cache, k_new, v_new):
        out, lse = tree_attn.run(plan, q, k_cache, v_cache, k_new=k_new, v_new=v_new, return_lse=True)
        return out * 2, lse  # * 2: a traced op after the custom op (exact in bf16)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    got = cf(b.q, b.k_cache, b.v_cache, b.k_new, b.v_new)
    want = f(b.q, b.k_cache, b.v_cache, b.k_new, b.v_new)
    assert_bitwise_equal(got[0], want[0])
    assert_bitwise_equal(got[1], want[1])
    b2 = b.refill(seed=11)  # a second call of the compiled function on other tensors of the same shapes
    got = cf(b2.q, b2.k_cache, b2.v_cache, b2.k_new, b2.v_new)
    check(b2, got[0] / 2, got[1])


# ------------------------------------------------------------------------------------ sm_90 code


@pytest.mark.hopper
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("variant", TRITON)
def test_variant_instructions(variant, D, make_batch):
    """On sm_90 the "wgmma" variant's split kernel issues wgmma; the "mma" variant's issues mma.sync and no
    wgmma (it is the portable code that sm_80/89/120 run, so it is checked on Hopper too)."""
    b = make_batch([("draft32", 1000), ("single", 3)], H=4 * 6, Hkv=4, D=D, seed=12, device=DEV)
    plan = tree_attn.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask, **b.plan_kw(variant=variant))
    ptx = tree_attn.ops.compiled_ptx(plan, b.q, b.k_cache, b.v_cache, **b.new_kw())
    if variant == "wgmma":
        assert "wgmma" in ptx, f"D={D}: the wgmma variant's PTX has no wgmma"
    else:
        assert "mma.sync" in ptx and "wgmma" not in ptx, f"D={D}: the mma variant's PTX is not mma.sync-only"


@pytest.mark.hopper
@pytest.mark.parametrize("layout", ["slot", "paged"])
def test_ws_kernel_strided_caches_and_run_to_run_bits(layout, make_batch, check):
    """The "ws" kernel on K and V that are views of one fused buffer (16-byte aligned rows, non-unit outer strides):
    right against the reference, and the same bits on a second run (no atomics, a fixed merge order)."""
    b = make_batch([("draft32", 1500), ("rand13", 77)], H=24, Hkv=4, D=256, layout=layout, fused_kv=True, seed=5,
                   device=DEV)
    out, lse = attend(b, "ws")
    check(b, out, lse, msg=layout)
    again, lse2 = attend(b, "ws")
    assert_bitwise_equal(again, out)
    assert_bitwise_equal(lse2, lse)


@pytest.mark.hopper
@pytest.mark.parametrize("cfg", [
    WSConfig(consumers=1, block_n=64, num_stages=3, producers=2, consumer_regs=232),
    WSConfig(consumers=1, block_n=32, num_stages=6, producers=2, consumer_regs=232),
    WSConfig(consumers=2, block_n=32, num_stages=4, pair_halves=False),
    WSConfig(consumers=2, block_n=32, num_stages=4, producers=2, producer_regs=40),
    WSConfig(consumers=2, block_n=32, num_stages=4, producers=2, producer_regs=40, pair_halves=False),
], ids=["c1n64-two-producers", "c1n32-two-producers", "c2-one-split-halves", "c2-two-producers",
        "c2-two-producers-one-split-halves"])
@pytest.mark.parametrize("layout", ["slot", "paged"])
@pytest.mark.parametrize("D", [64, 256])
def test_ws_kernel_producer_options(cfg, D, layout, make_batch, check):
    """The "ws" kernel with two producer warpgroups and with halves items of one split (configs forced): right against
    the reference on a batch of a 32-node tree over several splits, ragged trees and a lone tree block, token-slot and
    paged caches."""
    b = make_batch([("draft32", 3001), ("rand13", 77), ("draft9", 0)], H=24, Hkv=4, D=D, layout=layout, seed=8,
                   device=DEV)
    with autotune.force("tree_attn.tree_attention", variant="ws", config=cfg):
        plan = tree_attn.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask, **b.plan_kw(variant="ws"))
    assert plan.dispatch.config == cfg
    out, lse = tree_attn.run(plan, b.q, b.k_cache, b.v_cache, **b.new_kw(), sm_scale=b.sm_scale, return_lse=True)
    torch.cuda.synchronize()
    check(b, out, lse, msg=str(cfg))


@pytest.mark.hopper
@pytest.mark.parametrize("layout", ["slot", "paged"])
@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("trees", [[("draft32", 3001), ("rand13", 77), ("draft9", 0)],
                                   [("rand43", 700), ("draft32", 0), ("draft32", 2500), ("rand13", 33)]],
                         ids=["paired-and-alone", "three-groups"])
def test_ws_kernel_cluster_pairs(trees, D, layout, make_batch, check):
    """The "ws" kernel in 2-CTA clusters whose paired CTAs share each block's K/V copies (config forced): right
    against the reference, with requests of one group (alone), two (paired) and three (a pair and one alone), a lone
    tree block and ragged blocks, and the same bits as the same config without clusters (the same arithmetic in the
    same order: only the copies moved)."""
    b = make_batch(trees, H=24, Hkv=4, D=D, layout=layout, seed=12, device=DEV)
    outs = []
    for cfg in (WSConfig(consumers=2, block_n=32, num_stages=4, pair_halves=False, cluster=True),
                WSConfig(consumers=2, block_n=32, num_stages=4, pair_halves=False)):
        with autotune.force("tree_attn.tree_attention", variant="ws", config=cfg):
            plan = tree_attn.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask, **b.plan_kw(variant="ws"))
        assert plan.dispatch.config == cfg
        outs.append(tree_attn.run(plan, b.q, b.k_cache, b.v_cache, **b.new_kw(), sm_scale=b.sm_scale,
                                  return_lse=True))
    torch.cuda.synchronize()
    check(b, *outs[0], msg="cluster")
    assert_bitwise_equal(outs[0][0], outs[1][0])
    assert_bitwise_equal(outs[0][1], outs[1][1])


@pytest.mark.hopper
def test_ws_kernel_refuses_misaligned_rows(make_batch, raises):
    """A q whose rows are not 16-byte aligned is refused by name, not read wrongly."""
    b = make_batch([("draft9", 100)], H=6, Hkv=1, D=64, seed=4, device=DEV)
    wide = torch.zeros(b.T, b.H, 65, dtype=b.q.dtype, device=DEV)
    wide[..., 1:].copy_(b.q)
    q = wide[..., 1:]
    with raises("16 bytes"):
        tree_attn.tree_attention(q, b.k_cache, b.v_cache, *b.args()[3:], **b.new_kw(), variant="ws")


@pytest.mark.hopper
@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("nodes, G", [(8, 6), (32, 6)], ids=["one-consumer", "two-consumers"])
def test_ws_kernel_layout_probes(nodes, G, D, make_batch):
    """The "ws" kernel's shared-memory layouts on their own (builds with TA_PROBE): block 0's S = Q K^T as the
    consumers hold it against torch's product of the gathered rows, and block 0's V through the transposed
    descriptor, multiplied by P = [key == row % BN], row for row against the V rows (exact)."""
    b = make_batch([(f"draft{nodes}", 300)], H=G, Hkv=1, D=D, nodes_in_cache=True, seed=21, device=DEV)
    plan = tree_attn.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask, **b.plan_kw(variant="ws"))
    cfg = plan.dispatch.config
    item = plan.items[0].tolist()
    assert item[:3] == [0, 0, 0], item
    rows, bn = cfg.block_m, cfg.block_n
    m = torch.arange(rows, device=DEV)
    valid = m // G < nodes
    q_rows = torch.zeros(rows, D, device=DEV)
    q_rows[valid] = b.q[(m // G)[valid], (m % G)[valid]].float()
    slots = b.kv_indices[:bn].long()
    k_rows, v_rows = b.k_cache[slots, 0].float(), b.v_cache[slots, 0].float()
    for probe in (1, 2):
        plan.po.fill_(float("nan"))
        tree_attn.cuda.run(cfg, b.q, b.k_cache, b.v_cache,
                           *tree_attn.ops.cache_args(b.q, b.k_cache, b.v_cache, None, None), False, plan.qo_indptr,
                           plan.kv_indptr, plan.kv_indices, plan.tree_mask, plan.items, plan.po, plan.plse, 1.0,
                           defines={"TA_PROBE": probe})
        torch.cuda.synchronize()
        got = plan.po[0, 0][valid]
        if probe == 1:
            torch.testing.assert_close(got[:, :bn], (q_rows @ k_rows.T)[valid], rtol=1e-5, atol=1e-4,
                                       msg=lambda e: f"S of block 0 (probe 1): {e}")
        else:
            assert torch.equal(got, v_rows[m[valid] % bn]), "V of block 0 through the transposed descriptor (probe 2)"
