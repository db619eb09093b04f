"""Tree attention for speculative verification: every draft-tree node of every request attends to its
request's whole KV-cache prefix and to its own ancestors and itself within the tree.

* `plan` / `TreeAttnPlan`: the host step, once per decoding step: checks the masks, indptr arrays and
  slot indices, and writes the split-KV schedule into fixed-size device buffers.
* `run`: the device step (never syncs the host; CUDA graphs capture it; a torch custom op).
* `tree_attention`: one call. Its Triton kernels build the schedule and check the metadata on the device
  (no host read, no sync; `check_metadata` raises what they found); `keep_plan=True`, the CUDA C++ kernel and
  the torch reference plan on the host.
* `tree_attention_reference`: the plain PyTorch oracle (explicit masks, fp32 or fp64).

Masks are gdn.TreePlan's format: int64 per node, bit j set when local node j is an ancestor of the node
or the node itself; qo_indptr is TreePlan.cu_seqlens. The cache is token-slot [slots, Hkv, D] or paged
[pages, page_size, Hkv, D]; kv_indices lists token slots in both.
"""

from .ops import HEAD_DIMS, MAX_NODES, VARIANTS, TreeAttnPlan, check_metadata, plan, run, tree_attention, unsupported
from .reference import tree_attention_reference

__all__ = ["tree_attention", "plan", "run", "check_metadata", "TreeAttnPlan", "MAX_NODES", "HEAD_DIMS", "VARIANTS", "unsupported",
           "tree_attention_reference"]

_SUBMODULES = ("configs", "kernels", "ops", "reference", "space")


def __getattr__(name):
    # submodules that `import tree_attn` does not load, on first attribute access (`tree_attn.space.WGMMA_SPACE`)
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
