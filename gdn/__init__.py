"""Gated DeltaNet tree verification for speculative decoding.

* `build_tree_plan` / `TreePlan`: topology of a batch of token trees, built once per step.
* `tree_verify`: outputs of every tree node from the committed fp32 state (WY form on tensor cores: the CUDA C++
  kernel `csrc/gdn_tree.cu` where it runs, the Triton kernel otherwise).
* `tree_conv1d`: causal depthwise conv along each node's root path.
* `commit`: advance recurrent and conv states along the accepted path, all layers in one launch.
* `check_errors(plan)`: raise `GuardError` if a kernel skipped a request for a bad index (gdn/guard.py).
* `recurrent_reference` and friends: pure PyTorch oracles.
"""

from .guard import GuardError, check_errors
from .ops import commit, tree_conv1d, tree_verify, validate_accepted
from .plan import MAX_NODES, TreePlan, build_tree_plan
from .reference import chunk_reference, commit_reference, conv_reference, recurrent_reference, tree_reference

__all__ = [
    "TreePlan", "build_tree_plan", "MAX_NODES", "tree_verify", "tree_conv1d", "commit", "validate_accepted",
    "check_errors", "GuardError",
    "recurrent_reference", "chunk_reference", "tree_reference", "conv_reference", "commit_reference",
]

_SUBMODULES = ("configs", "cuda", "guard", "kernels", "ops", "plan", "reference", "space")


def __getattr__(name):
    # submodules that `import gdn` does not load, on first attribute access (`gdn.space.CUDA_SPACE`)
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
