"""Triton kernels of lmhead: the screen, the survivor selection and the exact recompute (screen.py)."""
