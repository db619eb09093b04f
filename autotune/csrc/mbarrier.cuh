// mbarrier helpers shared by the operators' CUDA C++ kernels (sm_90 and later: try_wait with a parity). On the
// include path of every autotune.jit build and part of its cache key.
#pragma once

// (unsigned int for 32-bit words: NVRTC has no C library headers, so this header needs no <stdint.h>)
namespace {

// the 32-bit shared-memory address of a generic pointer into shared memory
__device__ __forceinline__ unsigned int smem_u32(const void* p) {
  return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(unsigned int bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void mbar_arrive(unsigned int bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// spins until the phase of parity `parity` has completed (the label is local to the braces' scope)
__device__ __forceinline__ void mbar_wait(unsigned int bar, unsigned int parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "MBAR_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra MBAR_WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

}  // namespace
