// Device helpers shared by the W12 CUDA kernels (w12_mma.cu, w12_tma.cu): the in-register decode
// of a bf16 pair from its hi byte and lo nibble, the mma.sync wrapper and the bias read.
// Included into each kernel's translation unit; w12/cuda.py keys its cubin cache on this file too.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#ifdef __CUDACC_RTC__
// NVRTC has no C library headers: the fixed-width types the kernels use (LP64 / LLP64 agree on these)
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif

namespace {

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ uint32_t dec_pair(uint32_t y, uint32_t e0x) {
  // y lanes: hi << 8 | nib -> bf16 bits
  return (y & 0x800F800Fu) + ((y >> 4) & 0x07F007F0u) + e0x;
}

__device__ __forceinline__ uint32_t prmt_sign(uint32_t a, uint32_t sel) {
  // PTX prmt with the selector's sign-replicate bit (__byte_perm drops that bit)
  uint32_t r;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(a), "r"(sel));
  return r;
}

__device__ __forceinline__ uint32_t dec_pair_q8(uint32_t y, uint32_t e0x) {
  // y lanes: hi << 8 -> bf16 bits of the bin midpoint; hi == 0 reads as +0.0
  uint32_t bits = (y & 0x80008000u) + ((y >> 4) & 0x07F007F0u) + e0x + 0x00080008u;
  uint32_t nz = ((y & 0x7F007F00u) + 0x7F007F00u) | y;  // bit 15 of a lane set iff hi != 0
  return bits & prmt_sign(nz, 0xBB99);                   // bytes 1 and 3 sign-replicated: lane masks
}

__device__ __forceinline__ void mma_bf16(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Programmatic dependent launch (sm_90; w12/cuda.py launches with the attribute there). Before
// grid_dep_wait() a kernel may read only what no earlier kernel in the stream writes (the weight
// planes and their metadata); grid_dep_launch() lets the next kernel's CTAs start early. Both are
// no-ops on a launch without the attribute, and compiled out below sm_90.
__device__ __forceinline__ void grid_dep_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dep_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float bias_at(const void* bias, int kind, int row) {
  if (kind == 1) return __bfloat162float(static_cast<const __nv_bfloat16*>(bias)[row]);
  if (kind == 2) return __half2float(static_cast<const __half*>(bias)[row]);
  if (kind == 3) return static_cast<const float*>(bias)[row];
  return 0.0f;
}

}  // namespace
