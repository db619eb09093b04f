"""The speculation pieces the engine verifies with: the drafters (`drafters`: the `Drafter` protocol and the
n-gram drafter; `heads`: the trained parallel drafter on the target's hidden state), the draft tree builder (`tree`), greedy tree acceptance (`accept`) and the batch node
budget (`budget`). They import torch and each other only, never the engine's modules: a drafter, the tree
builder or the acceptance can be used and tested without a model."""

from .accept import accepted_slots, greedy_accept, greedy_accept_reference
from .budget import AcceptanceHistory, Allocation, allocate
from .drafters import Drafter, NGramDrafter
from .heads import HeadsDims, HeadsDrafter, HeadsNet
from .tree import MAX_NODES, DraftTree, build_tree, build_trees, build_trees_batched

__all__ = ["AcceptanceHistory", "Allocation", "DraftTree", "Drafter", "HeadsDims", "HeadsDrafter", "HeadsNet", "MAX_NODES", "NGramDrafter", "accepted_slots",
           "allocate", "build_tree", "build_trees", "build_trees_batched", "greedy_accept", "greedy_accept_reference"]
