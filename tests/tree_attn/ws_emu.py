"""CPU emulation of the "ws" kernel (tree_attn/csrc/tree_attn_ws.cu): its schedule, its shared-memory layout read
through its wgmma descriptors, and its online softmax, in torch.

* `SmemTile`: a [D/64][rows][128 B] tile as the producer writes it (16-byte chunk c of row r at
  `tile_off(r, c, rows)`, the 128-byte swizzle), read back the way wgmma reads a descriptor's canonical layout
  (the PTX ISA's 128-byte-swizzle layouts: K-major ((8,m),(8,2)):((64,SBO),(1,8)) and MN-major
  ((8,8,m),(8,k)):((1,8,LBO),(64,SBO)) in elements, then the swizzle on the byte address). The descriptors are the
  kernel's (`Q_DESC`, `K_DESC`, `V_DESC` restate them; `test_tree_attn_ws.py` checks the source still says so).
* `emulate_ws(batch, cfg)`: every item of the real schedule (tree_attn.ops._schedule with the tree folded into the
  last split), every KV head, every consumer warpgroup's 64 rows (or, where the group's second tile has no row, the
  two consumers on the first tile's even and odd key blocks, merged at the end): S from the tiles read through the
  descriptors, the scale, the ragged and tree masks, the base-2 online softmax with the kernel's guards, P rounded to
  the operand dtype, O rescaled and accumulated in fp32; then the partials merged by log-sum-exp as the merge kernel
  does.
"""

from __future__ import annotations

import torch

from tree_attn import ops
from tree_attn.configs import WSConfig
from tree_attn.reference import slot_rows

LOG2E = 1.4426950408889634


def swizzle(addr: torch.Tensor) -> torch.Tensor:
    """The 128-byte swizzle on byte addresses of a 1024-byte aligned region: 16-byte chunk bits 4-6 ^= bits 7-9."""
    return addr ^ (((addr >> 7) & 7) << 4)


def tile_off(r: torch.Tensor, c: torch.Tensor, rows: int) -> torch.Tensor:
    """The producer's byte offset of 16-byte chunk c of row r (tree_attn_ws.cu's tile_off)."""
    return (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4)


class SmemTile:
    """A [D/64][rows][128 B] tile of shared memory holding 16-bit elements."""

    def __init__(self, rows: int, d: int):
        self.rows, self.d = rows, d
        self.mem = torch.zeros(rows * d, dtype=torch.int16)  # 2 bytes an element

    def write_rows(self, x: torch.Tensor) -> None:
        """The producer's copies: x [rows, d] (bf16/fp16), chunk by chunk."""
        r = torch.arange(self.rows)[:, None, None]
        c = torch.arange(self.d // 8)[None, :, None]
        e = torch.arange(8)[None, None, :]
        at = (tile_off(r, c, self.rows) // 2 + e).reshape(-1)
        self.mem[at] = x.reshape(self.rows, self.d // 8, 8).view(torch.int16).reshape(-1)

    def read_k_major(self, start: int, sbo: int, rows: int) -> torch.Tensor:
        """[rows, 16] elements of one k-step, K-major canonical layout from byte `start`."""
        i = torch.arange(rows)[:, None]
        j = torch.arange(16)[None, :]
        addr = start + (i // 8) * sbo + (i % 8) * 128 + (j // 8) * 16 + (j % 8) * 2
        return self.mem[swizzle(addr) // 2]

    def read_mn_major(self, start: int, lbo: int, sbo: int, n: int) -> torch.Tensor:
        """[16 (k), n] elements of one k-step, MN-major canonical layout from byte `start` (wgmma's transposed B)."""
        j = torch.arange(16)[:, None]
        i = torch.arange(n)[None, :]
        addr = start + (i // 64) * lbo + ((i // 8) % 8) * 16 + (i % 8) * 2 + (j % 8) * 128 + (j // 8) * sbo
        return self.mem[swizzle(addr) // 2]


# the kernel's descriptors: (start byte offset, leading byte offset, stride byte offset) of each k-step
def Q_DESC(w: int, k: int, rows: int):  # A of S: warpgroup w's 64 rows, k-step k (16 columns of D)
    return w * 64 * 128 + (k >> 2) * rows * 128 + (k & 3) * 32, 16, 1024


def K_DESC(k: int, bn: int):  # B of S, K-major
    return (k >> 2) * bn * 128 + (k & 3) * 32, 16, 1024


def V_DESC(kk: int, cb: int, bn: int):  # B of P V, MN-major: keys 16 kk.., columns 64 cb..
    return cb * bn * 128 + kk * 2048, bn * 128, 1024


def _as(x: torch.Tensor, dtype) -> torch.Tensor:
    return x.view(dtype).float()


def _rows_q(batch, req: int, group: int, hk: int, rows: int) -> torch.Tensor:
    """The q rows of a group as the producer gathers them: row m -> node m / G, head hk G + m % G; zero past n G."""
    G = batch.H // batch.Hkv
    q0 = int(batch.qo_indptr[req])
    n = int(batch.qo_indptr[req + 1]) - q0
    out = torch.zeros(rows, batch.D, dtype=batch.q.dtype)
    for r in range(rows):
        m = group * rows + r
        if m // G < n:
            out[r] = batch.q[q0 + m // G, hk * G + m % G]
    return out


def _keys(batch, req: int, lo: int, hi: int, hk: int):
    """(K rows, V rows [keys, D], prefix keys, tree) of an item: its prefix slots, then, when hi is the prefix's end
    (`tree`), its nodes."""
    q0 = int(batch.qo_indptr[req])
    n = int(batch.qo_indptr[req + 1]) - q0
    prefix_end = int(batch.kv_indptr[req + 1]) - (n if batch.nodes_in_cache else 0)
    tree = hi == prefix_end
    slots = batch.kv_indices[lo:prefix_end + n if tree and batch.nodes_in_cache else hi].long()
    ks, vs = slot_rows(batch.k_cache, slots)[:, hk], slot_rows(batch.v_cache, slots)[:, hk]
    if tree and not batch.nodes_in_cache:
        ks, vs = torch.cat([ks, batch.k_new[q0:q0 + n, hk]]), torch.cat([vs, batch.v_new[q0:q0 + n, hk]])
    return ks, vs, hi - lo, tree


def emulate_item(batch, cfg: WSConfig, req: int, group: int, lo: int, hi: int, hk: int, scale_log2: float):
    """(partial O [rows, D] fp32, base-2 LSE [rows]) of one CTA, as its consumers compute them."""
    D, bn, rows = batch.D, cfg.block_n, cfg.block_m
    G = batch.H // batch.Hkv
    q0 = int(batch.qo_indptr[req])
    n = int(batch.qo_indptr[req + 1]) - q0
    dt = batch.q.dtype
    qt = SmemTile(rows, D)
    qt.write_rows(_rows_q(batch, req, group, hk, rows))
    ks, vs, npre, tree = _keys(batch, req, lo, hi, hk)
    nbp = -(-npre // bn)
    nb = nbp + (-(-n // bn) if tree else 0)
    masks = batch.tree_mask[q0:q0 + n].tolist()
    po = torch.zeros(rows, D)
    plse = torch.zeros(rows)
    # the group's second tile has no row: the two consumers split the first tile's key blocks (even / odd)
    halves = cfg.consumers == 2 and group * rows + 64 >= n * G
    if halves:
        work = [(0, range(0, nb, 2)), (0, range(1, nb, 2))]
    else:
        work = [(w, range(nb)) for w in range(cfg.consumers) if group * rows + 64 * w < n * G]  # idle: nothing
    states = []
    for tile, blocks in work:
        m_run = torch.full((64,), float("-inf"))
        l_run = torch.zeros(64)
        o = torch.zeros(64, D)
        for b in blocks:
            # the stage: this block's keys, zero rows past the valid ones (cp.async's zero fill)
            first = b * bn if b < nbp else npre + (b - nbp) * bn
            count = (min(npre, first + bn) - first) if b < nbp else min(n, (b - nbp) * bn + bn) - (b - nbp) * bn
            kb = torch.zeros(bn, D, dtype=dt)
            vb = torch.zeros(bn, D, dtype=dt)
            if count > 0:
                kb[:count] = ks[first:first + count]
                vb[:count] = vs[first:first + count]
            kt, vt = SmemTile(bn, D), SmemTile(bn, D)
            kt.write_rows(kb)
            vt.write_rows(vb)
            s = torch.zeros(64, bn)
            for k in range(D // 16):
                a = _as(qt.read_k_major(*(Q_DESC(tile, k, rows)[i] for i in (0, 2)), 64), dt)
                bk = _as(kt.read_k_major(*(K_DESC(k, bn)[i] for i in (0, 2)), bn), dt)
                s = s + a @ bk.T
            x = s * scale_log2
            key = torch.arange(bn)
            if b < nbp:
                seen = (b * bn + key < npre)[None, :].expand(64, bn)
            else:
                local = (b - nbp) * bn + key
                node = (group * rows + 64 * tile + torch.arange(64)) // G
                word = torch.tensor([masks[int(v)] if v < n else 0 for v in node], dtype=torch.int64)
                bit = (word[:, None] >> local.clamp(max=63)[None, :]) & 1
                seen = (local[None, :] < n) & (bit != 0)
            x = torch.where(seen, x, torch.tensor(float("-inf")))
            mx = torch.maximum(m_run, x.max(dim=1).values)
            mu = torch.where(mx == float("-inf"), torch.zeros(()), mx)
            alpha = torch.exp2(m_run - mu)
            p = torch.exp2(x - mu[:, None])
            l_run = l_run * alpha + p.sum(dim=1)
            m_run = mx
            pr = p.to(dt).float()
            pv = torch.zeros(64, D)
            for kk in range(bn // 16):
                for cb in range(D // 64):
                    start, lbo, sbo = V_DESC(kk, cb, bn)
                    v16 = _as(vt.read_mn_major(start, lbo, sbo, 64), dt)  # [16 keys, 64 columns]
                    pv[:, 64 * cb:64 * cb + 64] += pr[:, 16 * kk:16 * kk + 16] @ v16
            o = o * alpha[:, None] + pv
        states.append((tile, m_run, l_run, o))
    if halves:  # consumer 1's state merged into consumer 0's by log-sum-exp
        (_, m0, l0, o0), (_, m1, l1, o1) = states
        mx = torch.maximum(m0, m1)
        mu = torch.where(mx == float("-inf"), torch.zeros(()), mx)
        a0, a1 = torch.exp2(m0 - mu), torch.exp2(m1 - mu)
        states = [(0, mx, l0 * a0 + l1 * a1, o0 * a0[:, None] + o1 * a1[:, None])]
    for tile, m_run, l_run, o in states:
        ok = l_run > 0
        po[64 * tile:64 * tile + 64] = o / torch.where(ok, l_run, torch.ones(()))[:, None]
        plse[64 * tile:64 * tile + 64] = torch.where(ok, m_run, torch.zeros(())) + torch.log2(
            torch.where(ok, l_run, torch.ones(())))
    return po, plse


def emulate_ws(batch, cfg: WSConfig, *, target: int = 4):
    """(out [T, H, D] in q's dtype, lse [T, H] natural log) of the "ws" variant: its schedule (`target` prefix items
    a wave, as tree_attn.plan computes from the SM count), its CTAs, then the merge kernel's log-sum-exp."""
    qo, kv = batch.qo_indptr.tolist(), batch.kv_indptr.tolist()
    G = batch.H // batch.Hkv
    items, table, _, _, used = ops._schedule("emulate", qo, kv, batch.nodes_in_cache, G, cfg, target, None)
    scale = (batch.sm_scale if batch.sm_scale is not None else batch.D ** -0.5) * LOG2E
    parts = {}
    for i in range(used):
        req, field, lo, hi = items[i].tolist()
        if req < 0:  # a slot whose split a halves item took: its LSE rows come from that item's CTA
            continue
        group, sibling = field & 0xFFFF, field >> 16
        for hk in range(batch.Hkv):
            parts[i, hk] = emulate_item(batch, cfg, req, group, lo, hi, hk, scale)
            if sibling:  # LSE -inf; the partial output is never written (NaN here: the merge must not read it)
                parts[i + sibling, hk] = (torch.full_like(parts[i, hk][0], float("nan")),
                                          torch.full_like(parts[i, hk][1], float("-inf")))
    out = torch.empty(batch.q.shape, dtype=batch.q.dtype)
    lse = torch.empty(batch.T, batch.H)
    rows = cfg.block_m
    for r in range(len(qo) - 1):
        first, nparts, groups = table[r].tolist()
        for t in range(qo[r], qo[r + 1]):
            for h in range(batch.H):
                m = (t - qo[r]) * G + h % G
                g, row = m // rows, m % rows
                ps = [parts[first + c * groups + g, h // G] for c in range(nparts)]
                lses = torch.stack([p[1][row] for p in ps])
                top = lses.max()
                wts = torch.exp2(lses - top)
                acc = sum(wt * p[0][row] for wt, p in zip(wts, ps) if p[1][row] > float("-inf"))
                out[t, h] = (acc / wts.sum()).to(batch.q.dtype)
                lse[t, h] = (top + torch.log2(wts.sum())) / LOG2E
    return out, lse, items[:used]
