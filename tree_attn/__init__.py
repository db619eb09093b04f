"""Attention for a batch of draft trees over a paged KV cache (ancestor masks).

Not implemented yet: this package only reserves the name. See the project's issue list.
"""

__all__: list[str] = []
