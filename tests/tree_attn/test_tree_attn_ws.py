"""CPU checks of the warp-specialised CUDA C++ kernel (variant "ws", tree_attn/csrc/tree_attn_ws.cu) without a GPU.

1. The layout: every tile the producer writes (16-byte chunks, 128-byte swizzle) reads back through the kernel's
   wgmma descriptors, as the PTX ISA's canonical layouts define them, as the very matrix written: q and K as K-major
   operands, V as the transposed (MN-major) B operand, element for element. A wrong stride or a missing swizzle is
   caught (the check can fail).
2. The algorithm (ws_emu.emulate_ws): the real schedule with the tree folded into each request's last split, every
   CTA's consumers on tiles read through the descriptors, the masks, the online softmax, then the merge; against the
   fp64 reference with the suite's derived bounds, over ragged batches, empty prefixes and trees, consumers that
   split one tile's key blocks,
   both cache layouts, nodes in the cache or in k_new, one or two consumers and 32 or 64 keys a block.
3. NVRTC (no GPU needed) compiles the shipped specialisations for sm_90a: wgmma, setmaxnreg with two consumers,
   cp.async completing on mbarriers, no local memory; three consumers are refused.
4. Dispatch: "ws" runs on sm_90 only and says why elsewhere; configs are checked.
5. Synchronisation (ws_protocol): the kernel's barrier operations, restated, end under random interleavings for
   every shipped mode and never let a stage be refilled before it is released; the checks fail on a wrong turn,
   a producer that does not wait, and halves consumers that share stages (a consumer that skips a phase reads a
   barrier's parity wrongly, which the stage mapping stage_of prevents).
"""

import dataclasses
from pathlib import Path

import pytest
import torch

import tree_attn
from autotune import jit
from tree_attn import cuda as tcuda
from tree_attn import ops
from tree_attn.configs import WSConfig, _ws_heuristic
from ws_emu import K_DESC, Q_DESC, V_DESC, SmemTile, emulate_ws

C1 = WSConfig(consumers=1, block_n=64, num_stages=3)
C2 = WSConfig(consumers=2, block_n=64, num_stages=2)
C2N32 = WSConfig(consumers=2, block_n=32, num_stages=4)
# cluster pairs sharing the K/V copies (one producer warpgroup a CTA copies half of every block)
CL = WSConfig(consumers=2, block_n=32, num_stages=4, pair_halves=False, cluster=True)


# ------------------------------------------------------------------------------------------ 1. layout


def _distinct(rows, d):
    """A [rows, d] bf16 matrix of distinct bit patterns (row-major index as the 16-bit value)."""
    return torch.arange(rows * d, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(rows, d)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("cfg", [C1, C2, C2N32], ids=["c1n64", "c2n64", "c2n32"])
def test_tiles_read_back_through_the_descriptors(cfg, d):
    rows, bn = cfg.block_m, cfg.block_n
    x = _distinct(rows, d)
    q = SmemTile(rows, d)
    q.write_rows(x)
    bits = x.view(torch.int16)
    for w in range(cfg.consumers):
        for k in range(d // 16):
            start, _, sbo = Q_DESC(w, k, rows)
            assert torch.equal(q.read_k_major(start, sbo, 64), bits[64 * w:64 * w + 64, 16 * k:16 * k + 16]), (w, k)
    kv = _distinct(bn, d)
    t = SmemTile(bn, d)
    t.write_rows(kv)
    kbits = kv.view(torch.int16)
    for k in range(d // 16):
        start, _, sbo = K_DESC(k, bn)
        assert torch.equal(t.read_k_major(start, sbo, bn), kbits[:, 16 * k:16 * k + 16]), k
    for kk in range(bn // 16):
        for cb in range(d // 64):
            start, lbo, sbo = V_DESC(kk, cb, bn)
            assert torch.equal(t.read_mn_major(start, lbo, sbo, 64), kbits[16 * kk:16 * kk + 16, 64 * cb:64 * cb + 64])
        # one descriptor for all D columns (an n = D wgmma) reads the same through the leading byte offset
        start, lbo, sbo = V_DESC(kk, 0, bn)
        assert torch.equal(t.read_mn_major(start, lbo, sbo, d), kbits[16 * kk:16 * kk + 16, :])


def ldmatrix_a(tile: SmemTile, row0: int, k: int) -> torch.Tensor:
    """The [16, 16] A tile one warp holds after the kernel's ldmatrix.x4 (load_q_frags) for k-step k, assembled from
    its lanes' four registers by mma's A layout (a0 rows 0-7 / cols 0-7, a1 rows 8-15, a2 cols 8-15, a3 both)."""
    out = torch.empty(16, 16, dtype=torch.int16)
    addr = []  # the row address each lane gives: matrix l // 8, row l % 8 of it
    for lane in range(32):
        r, c = row0 + (lane & 15), 2 * k + (lane >> 4)
        addr.append((c >> 3) * tile.rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
            row = tile.mem[addr[8 * i + g] // 2:addr[8 * i + g] // 2 + 8]  # matrix i, its row g
            out[g + dr, dc + 2 * t:dc + 2 * t + 2] = row[2 * t:2 * t + 2]
    return out


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("cfg", [C1, C2N32], ids=["c1", "c2"])
def test_q_fragments_through_ldmatrix(cfg, d):
    """q in registers (WSConfig.q_in_regs): every warp's ldmatrix.x4 of every k-step gives the A fragments of its
    16 rows and 16 columns of q, element for element."""
    rows = cfg.block_m
    x = _distinct(rows, d)
    q = SmemTile(rows, d)
    q.write_rows(x)
    bits = x.view(torch.int16)
    for row0 in range(0, rows, 16):
        for k in range(d // 16):
            assert torch.equal(ldmatrix_a(q, row0, k), bits[row0:row0 + 16, 16 * k:16 * k + 16]), (row0, k)


def test_layout_check_can_fail():
    """A wrong stride byte offset, or a tile written without the swizzle, does not read back."""
    x = _distinct(64, 128)
    t = SmemTile(64, 128)
    t.write_rows(x)
    bits = x.view(torch.int16)
    start, _, _ = K_DESC(1, 64)
    assert not torch.equal(t.read_k_major(start, 512, 64), bits[:, 16:32])
    plain = SmemTile(64, 128)
    plain.mem = x.view(torch.int16).reshape(64, 2, 64).transpose(0, 1).reshape(-1).clone()  # [D/64][rows][128 B]
    start, _, sbo = K_DESC(1, 64)
    assert not torch.equal(plain.read_k_major(start, sbo, 64), bits[:, 16:32])


def test_source_states_the_emulated_layout():
    """The emulation restates the kernel's tile offsets and descriptors; the source must still say the same."""
    src = tcuda.SOURCE.read_text()
    for text in ("(c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4)",
                 "(K >> 2) * TA_ROWS * 128 + (K & 3) * 32, (K >> 2) * TA_BN * 128 + (K & 3) * 32",
                 "desc128(qa, 16, 1024), desc128(ks, 16, 1024)",
                 "const uint32_t qa = qs + tile * 64 * 128;",
                 "auto in_halves = [&](int g) { return TA_C == 2 && g * TA_ROWS + 64 >= n * TA_G; };",
                 "const bool halves = TA_PROBE == 0 && in_halves(group);",
                 "const int b0 = halves ? w : 0, bstep = halves ? 2 : 1;",
                 "wgmma_o<cb * TA_BN * 128 + kk * 2048>",
                 "desc128(ring + st * STAGE_BYTES + KV_BYTES, TA_BN * 128, 1024)",
                 "(1ull << 62)",
                 "const int r = row0 + (lane & 15), c = 2 * k + (lane >> 4);",
                 '"r"(qs + tile_off(r, c, TA_ROWS))',  # the producer's tile_off, checked above
                 "load_q_frags(qf, qs, 64 * tile + 16 * warp, lane);",
                 "wgmma_s_reg<(K >> 2) * TA_BN * 128 + (K & 3) * 32, (K > 0)>(s, qf[K], dk);"):
        assert text in src, f"tree_attn_ws.cu no longer says {text!r}: update tests/tree_attn/ws_emu.py with it"


# --------------------------------------------------------------------------------------- 2. algorithm

_CASES = {
    # a 32-node draft tree at G = 6: 192 rows, two groups of 128; in the second the two consumers split the keys
    "draft32-g6": dict(requests=[("draft32", 45)], H=6, Hkv=1),
    # ragged batch: empty prefix, empty tree, a chain, a forest; several splits per request (target 8)
    "ragged": dict(requests=[("rand13", 0), ("empty", 5), ("chain7", 70), ("forest6", 33), ("single", 1)], H=4,
                   Hkv=2),
    # 64 nodes at G = 2: 128 rows, one full group (two consumers) or two (one)
    "nodes64": dict(requests=[("rand64", 20)], H=2, Hkv=1),
    # a child listed before its parent and an ancestor-closed DAG
    "child-first": dict(requests=[("child-first9", 17), ("dag4", 3)], H=2, Hkv=1),
}


@pytest.mark.parametrize("nodes_in_cache", [False, True], ids=["k_new", "in-cache"])
@pytest.mark.parametrize("layout", ["slot", "paged"])
@pytest.mark.parametrize("cfg", [C1, C2, C2N32], ids=["c1n64", "c2n64", "c2n32"])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_emulation_matches_reference(case, cfg, layout, nodes_in_cache, make_batch, check):
    kw = _CASES[case]
    b = make_batch(kw["requests"], H=kw["H"], Hkv=kw["Hkv"], D=64, layout=layout, nodes_in_cache=nodes_in_cache,
                   seed=len(case))
    out, lse, items = emulate_ws(b, cfg, target=8)
    check(b, out, lse, msg=f"{case}/{cfg.consumers}x{cfg.block_n}/{layout}")
    assert (items[:, 2] >= 0).all(), "the ws schedule has no tree items of its own"


@pytest.mark.parametrize("prefix, target", [(300, 1), (300, 8), (0, 1), (64, 1)],
                         ids=["long-one-split", "long-splits", "tree-only", "one-block-and-tree"])
@pytest.mark.parametrize("pair", [True, False], ids=["paired", "one-split"])
@pytest.mark.parametrize("cfg", [C2, C2N32], ids=["c2n64", "c2n32"])
def test_emulation_halves(cfg, pair, prefix, target, make_batch, check):
    """32 nodes x 6 heads: the second group's two consumers split its one tile's key blocks (even / odd) and merge at
    the end, including the one where consumer 1 gets no block (a lone tree block) and splits of one block; its items
    take two splits (pair_halves) or one."""
    cfg = dataclasses.replace(cfg, pair_halves=pair)
    b = make_batch([("draft32", prefix)], H=6, Hkv=1, D=64, seed=prefix + target)
    out, lse, items = emulate_ws(b, cfg, target=target)
    check(b, out, lse, msg=f"{prefix}/{target}")
    assert ((items[:, 1] & 0xFFFF) == 1).any(), "the second group (halves) is in the schedule"
    paired = ((items[:, 1] >> 16) > 0).any() and (items[:, 0] < 0).any()
    if not pair:
        assert not paired, "one split an item"
    elif prefix == 300 and target > 1:  # several splits: the halves group's items take two each
        assert paired


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_emulation_head_dim_256_peaked(dtype, make_batch, check):
    """D = 256 (the hybrid-27b head), peaked scores, fp16 and bf16."""
    b = make_batch([("draft9", 40)], H=6, Hkv=1, D=256, dtype=dtype, q_scale=4.0, seed=3)
    out, lse, _ = emulate_ws(b, C2, target=2)
    check(b, out, lse, msg=str(dtype))


@pytest.mark.parametrize("pair", [True, False], ids=["paired", "one-split"])
def test_schedule_folds_the_tree_into_the_last_split(pair):
    """Per request and group: the items' ranges cover [prefix start, prefix end) in order, the last ends at the
    prefix's end (it takes the tree), a request without prefix keys has one item with lo = hi; the table counts the
    splits. A halves group (its second tile has no row) takes two splits an item and leaves the second's slot
    unused, its distance in the group field's upper bits."""
    qo = [0, 5, 5, 37, 38]
    kv = [0, 100, 107, 107, 300]  # request 2 has no prefix keys
    items, table, _, split_len, used = ops._schedule("t", qo, kv, False, 6, dataclasses.replace(C2, pair_halves=pair),
                                                     16, None)
    items = items[:used].tolist()
    for r in range(4):
        n = qo[r + 1] - qo[r]
        if n == 0:
            assert not [it for it in items if it[0] == r] and table[r].tolist() == [0, 0, 0]
            continue
        groups = -(-n * 6 // 128)
        first, parts, g = table[r].tolist()
        assert g == groups and items[first][0] == r
        slots = items[first:first + parts * groups]  # split-major, group minor
        for grp in range(groups):
            halves = pair and 128 * grp + 64 >= n * 6  # (items of two splits)
            mine = [slots[c * groups + grp] for c in range(parts)]
            ranges = [(lo, hi) for rr, f, lo, hi in mine if rr == r]
            assert all(rr == r or (rr == -1 and halves and c % 2) for c, (rr, _, _, _) in enumerate(mine))
            assert ranges[0][0] == kv[r] and ranges[-1][1] == kv[r + 1]
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert all(hi - lo <= (2 if halves else 1) * split_len for lo, hi in ranges)
            for c, (rr, f, lo, hi) in enumerate(mine):
                if rr == r:
                    assert f & 0xFFFF == grp
                    assert f >> 16 == (groups if halves and c + 1 < parts else 0)
    assert [it for it in items if it[0] == 2] == [[2, 0, 107, 107], [2, 1, 107, 107]]


def test_schedule_pairs_the_groups_of_a_request_for_clusters():
    """With cluster pairs, the two groups of a request over each key range are the items 2i and 2i + 1 (an unused item
    before a two-group request where needed), one-group requests run alone, the items are an even number, and a
    fixed capacity counts the unused items."""
    qo = [0, 5, 37, 37, 38, 70]  # one group, two (192 rows), none, one, two
    kv = [0, 100, 3100, 3107, 3300, 9000]
    for capacity in (None, 64):
        items, table, _, split_len, used = ops._schedule("t", qo, kv, False, 6, CL, 16, capacity)
        assert items.shape[0] % 2 == 0 and (capacity is None or items.shape[0] == capacity)
        rows = items.tolist()
        for r in (1, 4):
            first, parts, groups = table[r].tolist()
            assert groups == 2 and first % 2 == 0 and parts > 1
            for c in range(parts):
                a, b = rows[first + 2 * c], rows[first + 2 * c + 1]
                assert a[0] == b[0] == r and a[2:] == b[2:] and (a[1], b[1]) == (0, 1)
        assert sum(it[0] == -1 for it in rows[:used]) >= 1  # request 1 starts after request 0's odd count
    one_split = [[0, 0], [-1, 0], [1, 0], [1, 1], [3, 0], [-1, 0], [4, 0], [4, 1]]  # 8 items with their unused ones
    items, *_ = ops._schedule("t", qo, kv, False, 6, CL, 16, 8)
    assert items[:, :2].tolist() == one_split
    with pytest.raises(ValueError, match="capacity=6"):
        ops._schedule("t", qo, kv, False, 6, CL, 16, 6)


def test_schedule_capacity_counts_folded_items():
    """A fixed capacity counts one item per split and group (no tree items): exactly enough fits."""
    qo, kv = [0, 8], [0, 512]
    _, _, _, _, used = ops._schedule("t", qo, kv, False, 6, C1, 4, None)
    items, _, _, _, used2 = ops._schedule("t", qo, kv, False, 6, C1, 4, used)
    assert used2 == used and items.shape[0] == used


# --------------------------------------------------------------------------------------------- 3. NVRTC


def _clean_ptx(cfg: WSConfig, d: int = 256, **kw) -> str:
    """The PTX of a build that ptxas compiled without stack, spills or serialised wgmma (its note C7512)."""
    b = tcuda.spec(cfg, d, 6, **kw).compile()
    res = b.resources()
    assert res["stack"] == 0 and res["spill_stores"] == 0 and res["spill_loads"] == 0, res
    assert "C7512" not in b.log.read_text(), "ptxas serialised the wgmma (not enough registers)"
    return b.ptx.read_text()


@pytest.mark.parametrize("new", [False, True], ids=["in-cache", "k_new"])
@pytest.mark.parametrize("f16", [False, True], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("rows", [48, 192], ids=["one-consumer", "two-consumers"])
def test_shipped_builds_compile_for_sm90a(rows, d, f16, new):
    cfg = _ws_heuristic(rows)
    ptx = _clean_ptx(cfg, d, f16=f16, new=new)
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx
    assert ("setmaxnreg" in ptx) == (cfg.consumers + cfg.producers > 2)
    assert (".f16.f16" in ptx) == f16


@pytest.mark.parametrize("kv_ahead", [False, True], ids=["kv-together", "k-ahead"])
def test_pingpong_builds(kv_ahead):
    """The consumers' turns: two named barriers, no spills (the turns cost no registers); with K issued ahead too."""
    ptx = _clean_ptx(WSConfig(pingpong=True, kv_ahead=kv_ahead))
    assert "bar.sync" in ptx and "bar.arrive" in ptx
    assert "bar.arrive" not in tcuda.spec(WSConfig(), 256, 6).ptx().read_text()


@pytest.mark.parametrize("cfg", [WSConfig(consumers=1, block_n=64, num_stages=3, q_in_regs=True),
                                 WSConfig(consumers=1, block_n=32, num_stages=4, q_in_regs=True)],
                         ids=["c1n64", "c1n32"])
def test_q_in_registers_builds_without_spills(cfg):
    """One consumer holds q's fragments (64 registers at D = 256) beside O within its 255 registers."""
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in _clean_ptx(cfg)


@pytest.mark.parametrize("cfg", [WSConfig(consumers=2, block_n=32, num_stages=4, overlap=True),
                                 WSConfig(consumers=2, block_n=64, num_stages=2, overlap=True),
                                 WSConfig(consumers=1, block_n=64, num_stages=3, overlap=True)],
                         ids=["c2n32", "c2n64", "c1n64"])
def test_overlap_builds_without_spills(cfg):
    """The overlap holds two blocks' P and one S beside O: no spills, no serialised wgmma, and the S of the next
    block is waited for with one group (P V) still in flight."""
    assert "wgmma.wait_group.sync.aligned 1;" in _clean_ptx(cfg)


@pytest.mark.parametrize("cfg", [WSConfig(consumers=1, block_n=64, num_stages=3, producers=2, consumer_regs=232),
                                 WSConfig(consumers=1, block_n=32, num_stages=6, producers=2, consumer_regs=232),
                                 WSConfig(consumers=2, block_n=32, num_stages=4, producers=2, producer_regs=40)],
                         ids=["c1n64", "c1n32", "c2n32"])
@pytest.mark.parametrize("d", [64, 256])
def test_two_producers_build_without_spills(cfg, d):
    """Two producer warpgroups: 256 threads issue the copies (each a chunk of every other row), the full barriers
    count them all, and setmaxnreg moves their registers to the consumers (one consumer too, at 384 threads)."""
    ptx = _clean_ptx(cfg, d)
    assert "setmaxnreg.inc.sync.aligned.u32 " + str(cfg.consumer_regs) in ptx
    assert "mbarrier.init.shared::cta.b64" in ptx


def test_cluster_pairs_build_without_spills(d=256):
    """The cluster pair build: 2-CTA clusters, halves forwarded into the partner's shared memory by bulk copies that
    complete on its full barriers, remote releases, a cluster barrier; no spills with one producer warpgroup."""
    ptx = _clean_ptx(CL, d)
    for text in (".reqnctapercluster 2, 1, 1", "mapa.shared::cluster.u32",
                 "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes",
                 "mbarrier.arrive.release.cluster.shared::cluster.b64", "mbarrier.arrive.expect_tx.shared::cta.b64",
                 "mbarrier.test_wait.parity.shared::cta.b64", "barrier.cluster.wait.acquire"):
        assert text in ptx, text
    assert ".reqnctapercluster" not in _clean_ptx(dataclasses.replace(CL, cluster=False), d)
    # two producer warpgroups copy 32 rows a pass at D = 64: more than half a block of 32 keys
    assert "half a block" in tcuda.config_problem(dataclasses.replace(CL, producers=2, producer_regs=40), 64)


@pytest.mark.parametrize("rows", [48, 192], ids=["one-consumer", "two-consumers"])
def test_phase_probes_build_what_they_time(rows):
    """The builds specpilot.bench.ws_phases times (TA_PHASE): the producer alone issues no wgmma; the consumers alone
    get no K/V copy (the producer arrives on plain mbarrier arrivals); the copies alone wait on no barrier."""
    cfg = _ws_heuristic(rows)
    ptx = {p: tcuda.spec(cfg, 256, 6, defines={"TA_PHASE": p}).ptx().read_text() for p in (0, 1, 2, 3)}
    assert "wgmma.mma_async" in ptx[0] and "wgmma.mma_async" not in ptx[1]
    assert "cp.async.mbarrier.arrive" in ptx[0] and "cp.async.mbarrier.arrive" not in ptx[2]
    assert "mbarrier.try_wait" in ptx[0] and "mbarrier.try_wait" not in ptx[3]


def test_three_consumers_do_not_build():
    with pytest.raises(jit.BuildError, match="1 or 2 consumer warpgroups"):
        tcuda.spec(WSConfig(consumers=3, block_n=32, num_stages=4, producer_regs=32, consumer_regs=160), 256,
                   6).compile()


@pytest.mark.parametrize("cfg, why", [
    (WSConfig(consumers=3), "consumers=3"),
    (WSConfig(producers=3), "producers=3"),
    (WSConfig(consumers=2, producers=2), "registers"),
    (WSConfig(block_n=128), "block_n=128"),
    (WSConfig(num_stages=1), "num_stages=1"),
    (WSConfig(producer_regs=64, consumer_regs=232), "registers"),
    (WSConfig(consumers=2, num_stages=3), "shared memory"),
    (WSConfig(consumers=1, num_stages=3, pingpong=True), "pingpong"),
    (WSConfig(consumers=2, block_n=32, num_stages=4, q_in_regs=True), "registers"),
    (WSConfig(pingpong=True, overlap=True), "overlap"),
    (WSConfig(consumers=1, block_n=64, num_stages=3, overlap=True, q_in_regs=True), "registers"),
    (WSConfig(block_n=64, overlap=True, producer_regs=56, consumer_regs=200), "registers"),
    (dataclasses.replace(CL, pair_halves=True), "cluster pairs need"),
    (dataclasses.replace(CL, num_stages=3), "cluster pairs need"),
    (dataclasses.replace(CL, consumers=1), "cluster pairs need"),
])
def test_config_problems(cfg, why):
    assert why in tcuda.config_problem(cfg, 256)
    assert tcuda.config_problem(C2, 256) is None and tcuda.config_problem(C1, 256) is None


def test_heuristic_smem_fits():
    for rows in (8, 64, 65, 384):
        for d in (64, 128, 256):
            assert _ws_heuristic(rows).smem_bytes(d) <= 227 << 10


def test_smem_bytes_match_the_kernel():
    """WSConfig.smem_bytes is the kernel's own count (the global it exports, read from the CUBIN's source)."""
    src = Path(tcuda.SOURCE).read_text()
    assert "tree_attn_ws_smem_bytes = 1024 + BAR_OFF + BAR_BYTES" in src and "Q_FULL = 32 * TA_STAGES" in src
    assert "BAR_BYTES = TA_CLUSTER == 2 ? HALF_V + 8 * TA_STAGES : Q_FULL + 8" in src
    assert "HALF_K = Q_FULL + 8, HALF_V = HALF_K + 8 * TA_STAGES" in src
    assert C2.smem_bytes(256) == 1024 + 256 * 2 * (128 + 2 * 2 * 64) + 32 * 2 + 8
    assert CL.smem_bytes(256) == 1024 + 256 * 2 * (128 + 2 * 4 * 32) + 48 * 4 + 8


# ------------------------------------------------------------------------------------------ 4. dispatch


def test_ws_on_the_cpu_says_why(make_batch, raises):
    b = make_batch([("draft9", 12)], H=2, Hkv=1, D=64)
    with raises("variant 'ws'"):
        tree_attn.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.tree_mask, **b.plan_kw(variant="ws"))


def test_merge_skips_empty_slots():
    """The merge kernel (Triton, interpreter) gives a slot of LSE -inf weight 0 and never reads its partial output
    (NaN here): the slots the halves items leave empty."""
    from tree_attn.kernels.split import tree_attn_merge_kernel

    gen = torch.Generator().manual_seed(5)
    T, G, D, BM, parts = 3, 2, 16, 16, 3
    po = torch.randn(parts, 1, BM, D, generator=gen)
    plse = torch.randn(parts, 1, BM, generator=gen)
    po[1] = float("nan")
    plse[1] = float("-inf")
    out = torch.empty(T, G, D)
    lse = torch.empty(T, G)
    qo = torch.tensor([0, T], dtype=torch.int32)
    node_req = torch.zeros(T, dtype=torch.int32)
    table = torch.tensor([[0, parts, 1]], dtype=torch.int32)
    tree_attn_merge_kernel[(T, G)](po, plse, out, lse, node_req, qo, table, out.stride(0), out.stride(1),
                                   qo, qo, table, 0, 0, 0,  # a plan's merge: the device schedule's arguments unused
                                   HKV=1, G=G, D=D, BM=BM, BP=4, WRITE_LSE=True, num_warps=1)
    live = plse[[0, 2], 0, :T * G]  # [2, rows]
    w = torch.exp2(live - live.max(0).values)
    want = (w[..., None] * po[[0, 2], 0, :T * G]).sum(0) / w.sum(0)[:, None]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.reshape(T * G, D), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.reshape(-1), (live.max(0).values + torch.log2(w.sum(0))) * 0.6931471805599453,
                               rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------ 5. synchronisation


@pytest.mark.parametrize("kv_ahead", [False, True], ids=["kv-together", "k-ahead"])
@pytest.mark.parametrize("mode", ["free", "turns", "overlap"])
@pytest.mark.parametrize("consumers, halves", [(1, False), (2, False), (2, True)], ids=["one", "two", "halves"])
@pytest.mark.parametrize("stages", [2, 3, 5])
def test_barrier_protocol_ends_under_random_interleavings(stages, consumers, halves, mode, kv_ahead):
    """ws_protocol.run: the kernel's barrier operations (producer loads, consumer loops, turns, the halves hand-over)
    end under 40 random interleavings for every block count up to 9, no stage is overwritten before its consumers
    released it, and no named-barrier generation completes without a waiter."""
    from ws_protocol import run

    pingpong = mode == "turns"
    if pingpong and consumers == 1:
        pytest.skip("the turns are between two consumers")
    for nb in range(0, 10):
        for seed in range(40):
            run(nb, stages, consumers, halves, pingpong, kv_ahead, seed, overlap=mode == "overlap")


def test_source_states_the_protocol():
    """ws_protocol restates the kernel's barrier operations (the paired producer's forwards included); the source
    must still say them."""
    src = tcuda.SOURCE.read_text()
    for text in ("s = (b & 1) + 2 * (i % h);", "u = i / h;", "s = b % TA_STAGES;", "u = b / TA_STAGES;",
                 "const uint32_t empty = bars + (v ? EMPTY_V : EMPTY_K) + 8 * s;", "mbar_wait(empty, (u + 1) & 1);",
                 "return (uint32_t)(u & 1);", "halves ? 4 : 4 * TA_C", "if (w == 1 && !halves) turn_pass(1);",
                 "if (!halves && (w == 0 || b + 1 < nb)) turn_pass(w);", "if (b + 1 < nb) load(b + 1, 0, nxt);",
                 'asm volatile("bar.sync 3, 256;" ::: "memory");',
                 "while (!mbar_test(empty, (u + 1) & 1)) forward_landed();",
                 "while (fwd[v] < issued[v] && landed(v, false)) forward(v);",
                 "landed(v, true);", "mbar_arrive_tx(full, TA_DB * HALF_ROWS_BYTES);",
                 "cp_arrive(bars + (v ? HALF_V : HALF_K) + 8 * s);", "if (paired && tid == 0) forward_all();",
                 "const int releases = (halves ? 4 : 4 * TA_C) + (paired ? (phalves ? 4 : 4 * TA_C) : 0);"):
        assert text in src, f"tree_attn_ws.cu no longer says {text!r}: update tests/tree_attn/ws_protocol.py with it"


@pytest.mark.parametrize("second_halves", [True, False], ids=["192-rows", "256-rows"])
@pytest.mark.parametrize("stages", [2, 4, 6])
def test_cluster_pair_protocol_ends_under_random_interleavings(stages, second_halves):
    """ws_protocol.run_pair: the cluster pair's barrier operations (each CTA's half copies, thread 0's forwards into
    the partner's stage with its bytes on the partner's full barrier, releases on both CTAs' empty barriers, the
    cluster barrier before the exit) end under 30 random interleavings for every block count up to 9, and every read
    sees its block in both halves of the stage."""
    from ws_protocol import run_pair

    for nb in range(0, 10):
        for seed in range(30):
            run_pair(nb, stages, second_halves, seed)


def test_cluster_pair_protocol_check_can_fail(monkeypatch):
    """A producer that does not forward the landed halves while it waits for a stage to be released hangs under
    some interleaving, and so does a pair whose consumers release only their own CTA's stage."""
    import ws_protocol as wp

    def trips(**patch):
        with monkeypatch.context() as m:
            for name, fake in patch.items():
                m.setattr(wp, name, fake)
            with pytest.raises(AssertionError):
                for nb in (3, 6, 9):
                    for seed in range(60):
                        wp.run_pair(nb, 2, True, seed)

    producer, consumer = wp.pair_producer, wp.pair_consumer

    def no_poll(nb, S, halves):  # the "test" of a stage's empty barrier answered as passed: no forwards there
        gen = producer(nb, S, halves)
        value = None
        while True:
            try:
                op = gen.send(value)
            except StopIteration:
                return
            if op[0] == "test" and op[1].startswith("empty"):
                value = True
                continue
            value = yield op

    def own_only(w, nb, S, halves):
        for op in consumer(w, nb, S, halves):
            yield ("arrive", *op[1:]) if op[0] == "release" else op

    trips(pair_producer=no_poll)
    trips(pair_consumer=own_only)


def test_barrier_protocol_check_can_fail(monkeypatch):
    """A turn passed after a consumer's last block, a producer that does not wait for released stages, or halves
    consumers sharing stages (a consumer that skips a phase of a barrier reads its parity wrongly: the stage mapping
    before stage_of) trip the checks."""
    import ws_protocol as wp

    def trips(name, fake, *run_args):  # ws_protocol with `name` replaced by `fake` fails under some interleaving
        with monkeypatch.context() as m:
            m.setattr(wp, name, fake)
            with pytest.raises(AssertionError):
                for seed in range(40):
                    wp.run(*run_args, seed)

    trips("stage_of", lambda b, S, halves: (b % S, b // S), 6, 3, 2, True, False, False)
    consumer, producer = wp.consumer, wp.producer

    def last_pass(w, nb, S, halves, pingpong, overlap=False):  # consumer 1 also passes the turn after its last block
        for op in consumer(w, nb, S, halves, pingpong, overlap):
            yield op
            if op == ("arrive", f"empty_v{(nb - 1) % S}", 4) and w == 1 and pingpong:
                yield ("bar_arrive", 1)

    def no_wait(nb, S, kv_ahead, halves):  # the producer refills a stage without waiting for it to be released
        yield from (op for op in producer(nb, S, kv_ahead, halves) if op[0] != "wait")

    trips("consumer", last_pass, 4, 2, 2, False, True, False)
    trips("producer", no_wait, 6, 2, 2, False, False, False)


@pytest.mark.parametrize("cfg", [C1, C2N32, CL, WSConfig(pingpong=True, kv_ahead=True),
                                 WSConfig(consumers=1, q_in_regs=True, num_stages=3, merge_parts=8, merge_warps=4),
                                 WSConfig(consumers=1, num_stages=3, producers=2, consumer_regs=232)])
def test_config_crosses_the_custom_op(cfg):
    """The torch custom op takes the launch config as ints (ops._cfg_ints); every field the launch reads comes back."""
    back = ops._cfg_of("ws", ops._cfg_ints(cfg))
    launch = ("consumers", "block_n", "num_stages", "producer_regs", "consumer_regs", "pingpong", "kv_ahead",
              "q_in_regs", "merge_warps", "merge_parts", "producers", "pair_halves", "cluster")
    assert all(getattr(back, f) == getattr(cfg, f) for f in launch) and back.block_m == cfg.block_m
