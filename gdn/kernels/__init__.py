"""Triton kernels of the gdn op, one file per variant (wy, recurrent) plus conv and commit."""
