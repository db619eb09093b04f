"""The certified greedy head over a vocabulary shard, and the exact combine of the shards' winners.

Under tensor parallelism each rank holds rows `[start, start + n)` of the LM head. Each rank answers
its own shard with `lmhead.CertifiedHead.topk(hidden, 1)`: the largest exact logit of the shard and
its id (ties: the lowest id), certified. The ranks' winners are combined exactly in one all-reduce:
each (value, global id) pair becomes one int64 key, ordered as torch.argmax orders (larger value
first; NaN above every number, as torch.argmax returns the first NaN; -0 equal to +0; ties to the
lowest id), and the key of the maximum is the global answer. The result equals
`torch.argmax(exact_logits_of_the_whole_head, -1)` over the concatenated shards, bit for bit.
"""

from __future__ import annotations

import torch

import lmhead

__all__ = ["order_key", "id_of_key", "combine_argmax", "ShardedCertifiedHead"]

_ID_MASK = 0xFFFFFFFF


def order_key(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys whose maximum is torch.argmax's choice: fp32 value in the high 32 bits as a
    monotone integer, `2^32 - 1 - id` in the low 32 bits (so the lowest id wins a tie)."""
    v = values.float()
    v = torch.where(v == 0, torch.zeros_like(v), v)  # -0 == +0
    b = v.view(torch.int32).long()
    o = torch.where(b >= 0, b, b ^ 0x7FFFFFFF)
    o = torch.where(torch.isnan(v), torch.full_like(o, 0x7FFFFFFF), o)
    return (o << 32) | (_ID_MASK - ids.long())


def id_of_key(key: torch.Tensor) -> torch.Tensor:
    return _ID_MASK - (key & _ID_MASK)


def combine_argmax(values: torch.Tensor, global_ids: torch.Tensor, group=None) -> torch.Tensor:
    """The global argmax from each rank's best (value, global id) per row: one all-reduce (MAX) of
    int64 keys over `group` (a torch.distributed process group; None: the default group). Works
    with NCCL and gloo. No host sync."""
    key = order_key(values, global_ids)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(key, op=torch.distributed.ReduceOp.MAX, group=group)
    return id_of_key(key)


class ShardedCertifiedHead:
    """`lmhead.CertifiedHead` over this rank's rows of the head, answering global token ids.

    `weight`: this rank's BF16 rows `[n, H]` (or a `w12.W12Weight`), holding global ids
    `[vocab_start, vocab_start + n)`; rows past the real vocabulary (padding) must be cut before.
    `group`: the tensor-parallel process group (None: the default group; a single process needs none).
    """

    def __init__(self, weight, vocab_start: int = 0, *, group=None, screen: str = "auto"):
        if vocab_start < 0:
            raise ValueError(f"specpilot.sglang.ShardedCertifiedHead: vocab_start={vocab_start} must be >= 0")
        self.head = lmhead.CertifiedHead(weight, screen=screen)
        self.vocab_start = int(vocab_start)
        self.group = group

    def local_best(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(value fp32 [M], global id int64 [M]): the shard's certified winner per row."""
        vals, ids = self.head.topk(hidden.reshape(-1, self.head.H), 1)
        return vals[:, 0], ids[:, 0] + self.vocab_start

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """Global token ids [M] of the largest exact logit over all ranks' shards."""
        vals, ids = self.local_best(hidden)
        return combine_argmax(vals, ids, self.group)
