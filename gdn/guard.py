"""Index guards of the gdn kernels: the error word, its bits, and the check that raises from it.

Every kernel checks the pool, slot and node indices it is given on the device. A request with a bad
index is skipped: its outputs and states are left untouched (not written), and the kernel ORs a bit
into `TreePlan.err`, an int32 [1] tensor allocated once with the plan. The fast path never syncs the
host for this: `check_errors(plan)` reads the word (one sync), clears it, and raises `GuardError`
naming every bit that was raised. It runs where a sync already happens: `gdn.validate_accepted`,
`gdn.commit(..., validate=True)`, every call on CPU tensors (synchronous anyway), and a caller's own
sync point (e.g. after reading the accepted tokens back to the host).

Indices already on the host (lists, CPU tensors) are checked there, before the launch, and raise at once.
"""

from __future__ import annotations

import torch

__all__ = ["GuardError", "check_errors", "ERR_BITS", "VERIFY_STATE_INDEX", "CONV_STATE_INDEX",
           "COMMIT_STATE_INDEX", "ACCEPTED_NODE", "ACCEPTED_PATH", "ACCEPTED_LEN", "POSITIVE_GATE", "PLAN_NODES"]

VERIFY_STATE_INDEX = 1
CONV_STATE_INDEX = 2
COMMIT_STATE_INDEX = 4
ACCEPTED_NODE = 8
ACCEPTED_PATH = 16
ACCEPTED_LEN = 32
POSITIVE_GATE = 64
PLAN_NODES = 128

ERR_BITS = {
    VERIFY_STATE_INDEX: ("gdn.tree_verify: a state index is outside [0, pool rows); that request's outputs were "
                         "not written; pass one pool row per request"),
    CONV_STATE_INDEX: ("gdn.tree_conv1d: a conv state index is outside [0, conv_state rows); that request's "
                       "outputs were not written; pass one conv_state row per request"),
    COMMIT_STATE_INDEX: ("gdn.commit: a state or conv state index is outside the pool; that request's states were "
                         "not written; pass one pool row per request"),
    ACCEPTED_NODE: ("gdn.commit: an accepted node is outside its request's tree; that request's states were not "
                    "written; accepted holds local node indices in [0, nodes of the request)"),
    ACCEPTED_PATH: ("gdn.commit: an accepted list is not a root path; that request's states were not written; "
                    "list the root first, then each node's child along the path"),
    ACCEPTED_LEN: ("gdn.commit: an accepted_len is outside [0, accepted.shape[1]]; that request's states were not "
                   "written; accepted_len[r] counts the accepted nodes of request r"),
    POSITIVE_GATE: ("gdn.tree_verify: some gate g > 0 (g is a log-decay, <= 0; exp(g) > 1 overflows the WY "
                    "form); the outputs were computed but are not reliable; pass g = -exp(A_log) * softplus(...)"),
    PLAN_NODES: ("gdn.tree_verify: a request has more nodes than the plan's max_nodes; its outputs were not written; "
                 "build the plan with max_nodes >= the largest request (build_tree_plan(..., max_nodes=...))"),
}


class GuardError(ValueError):
    """A gdn kernel skipped a request (or saw invalid gates); `bits` is the raised error word."""

    def __init__(self, bits: int):
        self.bits = bits
        lines = [msg for bit, msg in ERR_BITS.items() if bits & bit]
        super().__init__("\n".join(lines) if lines else f"gdn: unknown error bits {bits:#x}")


def new_error_word(device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def check_errors(plan) -> None:
    """Raise GuardError if a kernel that used `plan` (or its error word) flagged a bad call since the last
    check, and clear the word. Syncs the host with the plan's device: call it where a sync happens anyway."""
    err = plan.err if hasattr(plan, "err") else plan
    if not isinstance(err, torch.Tensor) or err.dtype != torch.int32 or err.numel() != 1:
        raise TypeError(f"gdn.check_errors: expected a gdn.TreePlan (or its error word), got {type(plan).__name__}; "
                        "pass the plan the step's calls used")
    bits = int(err[0].item())
    if bits:
        err.zero_()
        raise GuardError(bits)
