"""Triton kernels of tree_attn: the split-KV kernel and the log-sum-exp merge (split.py), shared by the "wgmma" and "mma" variants, which differ in tile shape only."""
