"""Tensor parallelism on two GPUs over NCCL, with this package's sharding and head code directly (no SGLang):
perf/sglang_tp2.sh runs it on a two-GPU machine as
`python3 -m pytest --confcutdir=tests_sglang/gpu tests_sglang/gpu -m gpu` (the confcutdir keeps tests_sglang's
conftest, which requires SGLang, out of it)."""

from __future__ import annotations

import pytest
import torch

from tests_sglang.tp_workers import run_two_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2
                       or not torch.distributed.is_nccl_available(), reason="needs two CUDA GPUs and NCCL"),
]


def test_tp2_w12_sharded_linears_nccl():
    """N-sharded W12 gathered over NCCL equals the single-GPU output bit for bit (one kernel configuration);
    K-sharded W12 all-reduced equals the same shards summed on one GPU, and the unsplit output within the
    rounding of the BF16 partials."""
    res = run_two_ranks("linears", backend="nccl")
    print(res)
    assert res["n_equal"], res
    assert res["k_equal_split"], res
    assert res["k_close"], res


def test_tp2_certified_argmax_nccl():
    """Each GPU's certified head over its vocabulary shard, combined in one all-reduce: equals torch.argmax over
    the exact logits of the whole head, ties to the lowest id."""
    res = run_two_ranks("argmax", backend="nccl")
    print(res)
    assert res["equal"], res
    assert res["ties_to_lowest"], res
