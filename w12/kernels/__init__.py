"""Triton kernels of the W12 GEMMs, one file per variant (see each module's docstring).

* `tc.py`: tensor cores, swap-AB (wgmma on sm_90, mma.sync on sm_80/89); also the split-K reduce.
* `gemv.py`: CUDA-core fp32 GEMV for tiny M (no tensor cores).
* `batch.py`: tensor cores, swap-AB, on the runtime layout: many rows of x (33-256) with one read of the weight.
* `untile.py`: the runtime layout decoded to BF16 (`w12.matmul_tiled` where the flow kernel does not run).
* `swiglu.py`: SwiGLU of a product with a paired gate-and-up weight (`w12.matmul_swiglu` outside the flow kernel).
"""

from .batch import w12_batch_kernel
from .gemv import w12_matmul_gemv_kernel
from .swiglu import w12_swiglu_pairs_kernel
from .tc import w12_matmul_tc_kernel, w12_splitk_reduce_kernel
from .untile import w12_untile_kernel

__all__ = ["w12_batch_kernel", "w12_matmul_tc_kernel", "w12_matmul_gemv_kernel", "w12_splitk_reduce_kernel",
           "w12_swiglu_pairs_kernel", "w12_untile_kernel"]
