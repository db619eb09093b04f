"""SpecPilot inside SGLang (docs/sglang.md): the `w12` quantization method, W12 checkpoints through
SGLang's loaders, the certified greedy head, and tensor-parallel helpers.

`plugin.register` is the entry point SGLang loads (`sglang.srt.plugins`, name `specpilot`). The
modules `quant`, `greedy_head`, `checkpoint` and `plugin` import SGLang; `sharding` and `head` need
only torch and this package (the two-GPU test runs them without SGLang). Nothing else in specpilot
imports this package.
"""
