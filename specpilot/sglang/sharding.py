"""Tensor-parallel slices of a packed `w12.W12Weight`, without changing a single weight.

W12 stores one exponent window `e0` per output row, the escapes of a row in CSR order, and K in
groups of 64 columns (`lo` interleaves the two halves of a group). So:

* along N (column-parallel layers, the merged parts of QKV and gate/up): a row slice is exact: rows
  are independent, and the slice is the planes' rows with the escape list cut and rebased;
* along K (row-parallel layers): a column slice that starts on a 64-column group keeps each row's
  window (every value inside the window still codes the same, every escape stays an escape); the
  codes past the slice's end inside its last group are zeroed, as the format's padding must be.
  A slice that starts inside a group is decoded, cut and packed again (`w12.pack` checks it bit for
  bit).

Every function returns a `W12Weight` whose `w12.unpack` equals the same slice of `w12.unpack(p)`,
bit for bit (tests_sglang/test_sharding.py). These run once at load time and may sync the host.
"""

from __future__ import annotations

import torch

import w12
from w12.format import GROUP, padded_k

__all__ = ["slice_n", "slice_k", "split_n", "tp_range", "shard_n", "shard_k", "shard_merged_n", "concat_n"]


def _check_range(fn: str, start: int, end: int, size: int, dim: str) -> None:
    if not (0 <= start < end <= size):
        raise ValueError(f"specpilot.sglang.{fn}: [{start}, {end}) is not a non-empty range inside {dim}={size}; "
                         f"pass 0 <= start < end <= {size}")


def slice_n(p: w12.W12Weight, start: int, end: int) -> w12.W12Weight:
    """Rows `[start, end)` of `p` (output channels), exact: no decode, no re-pack."""
    _check_range("slice_n", start, end, p.N, "N")
    return p.rows(start, end)


def slice_k(p: w12.W12Weight, start: int, end: int) -> w12.W12Weight:
    """Columns `[start, end)` of `p` (input features). Exact plane slicing when `start` is a multiple
    of 64; otherwise decode, cut and pack again (verified bit for bit by `w12.pack`)."""
    _check_range("slice_k", start, end, p.K, "K")
    if start % GROUP:
        return w12.pack(w12.unpack(p)[:, start:end].contiguous(), layout="planes")
    K = end - start
    Kp = padded_k(K)
    hi = p.hi[:, start : start + Kp].clone()
    lo = p.lo[:, start // 2 : (start + Kp) // 2].clone()
    if start + Kp > p.Kp:  # cannot happen: start and Kp are multiples of 64 and end <= K <= p.Kp
        raise AssertionError("specpilot.sglang.slice_k: slice runs past the padded planes")
    if K < Kp:  # the slice's last group: codes at [K, Kp) must be 0 (format padding)
        hi[:, K:] = 0
        g0 = (K // GROUP) * GROUP  # first column of the last group
        g = lo[:, g0 // 2 :].view(p.N, 32)  # byte j: column g0+j (low nibble), g0+32+j (high nibble)
        j = torch.arange(32, device=p.device)
        low_keep = (g0 + j) < K
        high_keep = (g0 + 32 + j) < K
        mask = (low_keep.to(torch.uint8) * 0x0F) | (high_keep.to(torch.uint8) * 0xF0)
        g &= mask
    # escapes: keep those inside [start, end), rebase their columns, recount the rows
    col = p.esc_col.long()
    keep = (col >= start) & (col < end)
    counts = torch.zeros(p.N, dtype=torch.int64, device=p.device)
    if p.num_escapes:
        rows = torch.repeat_interleave(torch.arange(p.N, device=p.device), (p.esc_rowptr[1:] - p.esc_rowptr[:-1]).long())
        counts.index_add_(0, rows[keep], torch.ones_like(rows[keep]))
    rowptr = torch.zeros(p.N + 1, dtype=torch.int32, device=p.device)
    rowptr[1:] = counts.cumsum(0).to(torch.int32)
    esc_col = (col[keep] - start).to(torch.int32).contiguous()
    esc_val = p.esc_val[keep].contiguous()
    return w12.W12Weight(hi.contiguous(), lo.contiguous(), p.e0.clone(), rowptr, esc_col, esc_val, K=K)


def split_n(p: w12.W12Weight, sizes) -> list[w12.W12Weight]:
    """The logical parts of a merged weight (QKV: `[q, k, v]`; gate/up: `[gate, up]`), by their row
    counts, as SGLang's `output_partition_sizes` gives them."""
    sizes = [int(s) for s in sizes]
    if sum(sizes) != p.N or any(s <= 0 for s in sizes):
        raise ValueError(f"specpilot.sglang.split_n: sizes {sizes} must be positive and add up to N={p.N}; pass the "
                         "layer's output_partition_sizes")
    out, r = [], 0
    for s in sizes:
        out.append(slice_n(p, r, r + s))
        r += s
    return out


def concat_n(parts) -> w12.W12Weight:
    """Stack W12 weights of equal K along N (the inverse of `split_n`), exact."""
    parts = list(parts)
    if not parts or len({q.K for q in parts}) != 1:
        raise ValueError("specpilot.sglang.concat_n: pass one or more W12 weights with the same K")
    rowptrs, off = [torch.zeros(1, dtype=torch.int32, device=parts[0].device)], 0
    for q in parts:
        rowptrs.append(q.esc_rowptr[1:] + off)
        off += q.num_escapes
    return w12.W12Weight(torch.cat([q.hi for q in parts]), torch.cat([q.lo for q in parts]),
                         torch.cat([q.e0 for q in parts]), torch.cat(rowptrs).to(torch.int32),
                         torch.cat([q.esc_col for q in parts]), torch.cat([q.esc_val for q in parts]), K=parts[0].K)


def tp_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """`[start, end)` of rank `rank` when `size` is split evenly over `world` ranks, as SGLang's
    parallel linears split (`divide(size, tp_size)`: the size must divide)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"specpilot.sglang.tp_range: rank {rank} is outside a world of {world}")
    if size % world:
        raise ValueError(f"specpilot.sglang.tp_range: {size} is not divisible by the tensor-parallel size {world}; "
                         "SGLang's parallel linears need equal shards")
    step = size // world
    return rank * step, (rank + 1) * step


def shard_n(p: w12.W12Weight, rank: int, world: int) -> w12.W12Weight:
    """This rank's rows of a column-parallel weight."""
    return slice_n(p, *tp_range(p.N, rank, world))


def shard_k(p: w12.W12Weight, rank: int, world: int) -> w12.W12Weight:
    """This rank's columns of a row-parallel weight."""
    return slice_k(p, *tp_range(p.K, rank, world))


def shard_merged_n(p: w12.W12Weight, sizes, rank: int, world: int) -> w12.W12Weight:
    """This rank's rows of a merged column-parallel weight: every logical part (sizes over all ranks)
    is split over the ranks and the rank's pieces are stacked, as MergedColumnParallelLinear and
    QKVParallelLinear (without KV-head replication) lay them out."""
    return concat_n([shard_n(q, rank, world) for q in split_n(p, sizes)])
