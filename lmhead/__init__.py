"""Certified LM head: INT8 screen with a rigorous error bound, exact recompute of survivors.

Not implemented yet: this package only reserves the name. See the project's issue list.
"""

__all__: list[str] = []
