import pytest
import torch


@pytest.fixture
def no_two_launch_split(monkeypatch):
    """Fails the test if inverse='split' launches its two-launch first kernel: a test of the one-launch
    form (handoff='flag') must not pass through the launcher's fallback."""
    import gdn.kernels.wy as wy

    def launch(*args, **kwargs):
        raise AssertionError("handoff='flag' fell back to the two-launch form")

    monkeypatch.setattr(wy, "gdn_tree_split_kernel", type("NoSplit", (), {"__getitem__": lambda self, grid: launch})())


def _corrupt_commit(case, idx, cidx, acc, n):
    """Make request 1 of the three-request commit case ([[-1, 0, 1], [-1, 0, 0], [-1, 0]], accepted [0, 2])
    bad in one way, in place: a pool row or conv row out of range, an accepted node outside its tree, a list
    that is not a root path, or a length outside [0, max_len = 3]."""
    if case == "index":
        idx[1] = 4
    elif case == "huge-index":
        idx[1] = 10**12
    elif case == "conv-index":
        cidx[1] = -1
    elif case == "node":
        acc[1, 1] = 3
    elif case == "huge-node":
        acc[1, 1] = 100000
    elif case == "path":
        acc[1, 1] = 0
    elif case == "non-root":
        acc[1, 0] = 1
    elif case == "len-over":
        n[1] = 4
    elif case == "len-negative":
        n[1] = -1
    else:
        raise ValueError(f"unknown commit fault {case!r}")


@pytest.fixture
def corrupt_commit():
    """`_corrupt_commit`: the faults the commit guard tests (CPU and GPU) inject."""
    return _corrupt_commit


def _verify_kernel(plan, q, k, v, g, beta, pool, idx, vk=False) -> str:
    from gdn import ops as gops

    return gops._plan_verify(None, q, k, v, g, beta, torch.empty_like(v), pool, idx, vk, plan.max_nodes).kernel


@pytest.fixture
def verify_kernel():
    """`_verify_kernel`: the kernel a call's plan runs ("one", "wy", "cuda", ...), for the CPU and GPU tests of the
    dispatch."""
    return _verify_kernel
