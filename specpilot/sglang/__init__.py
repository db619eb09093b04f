"""SpecPilot inside SGLang (docs/sglang.md): the `w12` quantization method, W12 checkpoints through
SGLang's loaders, the certified greedy head, tensor-parallel helpers, the `specpilot_tree` attention
backend (tree_attn on target-verify forwards; off by default), and gdn tree verify and commit in SGLang's hybrid
GDN backend (`gdn_verify`; off by default).

`plugin.register` is the entry point SGLang loads (`sglang.srt.plugins`, name `specpilot`). The
modules `quant`, `greedy_head`, `checkpoint`, `plugin`, `tree_backend` and `gdn_verify` import SGLang
(`tree_backend` only where it builds a backend or writes the cache, `gdn_verify` only inside its hooks);
`sharding` and `head` need only torch and this package (the two-GPU test runs them without SGLang). Nothing
else in specpilot imports this package.
"""
