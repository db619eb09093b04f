// Device code shared by the W12 CUDA kernels (w12_mma.cu, w12_tma.cu): the in-register decode of a
// bf16 pair from its hi byte and lo nibble, a chunk's fragments, their decode into mma.m16n8k16 A
// registers and the mma.sync step, programmatic-dependent-launch helpers and the bias read.
// Included into each kernel's translation unit (autotune.jit keys its cache on the headers beside it).
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


// Both kernels' parameters after their weight and x operands: the escape list (CSR), bias (bias_kind 0 none,
// 1 bf16, 2 fp16, 3 fp32), out [M, N], the sizes, and split-K's fp32 partials ws [gridDim.x, splits,
// rows * tokens] with per-row-block arrival counters [gridDim.x] (zero between launches, self-resetting)
#define W12_TAIL_PARAMS                                                                             \
    const uint8_t* __restrict__ e0, const int* __restrict__ rowptr, const int* __restrict__ ecol,   \
    const uint16_t* __restrict__ eval, const void* __restrict__ bias, int bias_kind,                \
    __nv_bfloat16* __restrict__ out, int M, int N, int Kp, float* __restrict__ ws,                  \
    int* __restrict__ counters

namespace {

// f(j, u, tok) for the tokens tok = 8 j + 2 q + u < M (n-tile j, u = 0, 1) whose outputs a thread's
// accumulators acc[.][j][2 h + u] hold (the mma.sync C fragment of lane 4 g + q)
template <int NT_, class F>
__device__ __forceinline__ void for_tokens(int q, int M, F&& f) {
#pragma unroll
  for (int j = 0; j < NT_; ++j)
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int tok = 8 * j + 2 * q + u;
      if (tok < M) f(j, u, tok);
    }
}

// Split-K arrival, called by every thread of the CTA after it published its partials: true in the CTA that
// arrived last of `count` on `counter` (it then adds all the partials); a fence orders the partials first
__device__ __forceinline__ bool last_to_arrive(int* counter, int count) {
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counter, 1) == count - 1;
  __syncthreads();
  return last;
}

// Stream-K over U units, `per` units (one row block's chunks) per row block, on P CTAs: CTA b takes the units
// [b U / P, (b + 1) U / P) (w12_tma.cu's TmaConfig.sk path). A row block shared by several CTAs
// meets in a workspace of two slots per CTA: slot 0 holds the share of the CTA's first row block, slot 1 of its
// last. tests/w12/stream_k.py ports these three line by line.
// The CTAs b0..b1 whose ranges hold row block rb's first and last units
__device__ __forceinline__ void sk_ctas(int rb, int per, long long U, int P, int& b0, int& b1) {
  const long long u0 = (long long)rb * per;
  b0 = (int)(((u0 + 1) * P - 1) / U);
  b1 = (int)(((u0 + per) * P - 1) / U);
}

// The workspace slot in which CTA b left its share of row block rb: 0 when rb is b's first row block
__device__ __forceinline__ int sk_slot(int b, int rb, int per, long long U, int P) {
  return (int)((b * U / P) / per) == rb ? 0 : 1;
}

// In the CTA that finishes row block rb: the sum, in CTA order from +0.0, of every CTA's share at offset o of its
// slot (slots of `share` floats, two per CTA)
__device__ __forceinline__ float sk_sum(const float* ws, int rb, int per, long long U, int P, int share, int o) {
  int b0, b1;
  sk_ctas(rb, per, U, P, b0, b1);
  float sum = 0.0f;
  for (int b = b0; b <= b1; ++b) sum += __ldcg(ws + ((size_t)b * 2 + sk_slot(b, rb, per, U, P)) * share + o);
  return sum;
}

// One thread's arrivals, after the CTA published and fenced its shares of its first / last row blocks
// (-1: none): last[i] says whether this CTA was the last of that row block's CTAs to arrive (it then adds
// every share and finishes the row block). The counters return to zero in the finishing CTA.
__device__ __forceinline__ void sk_arrive(int* counters, const int (&rbs)[2], int per, long long U, int P,
                                          int (&last)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    last[i] = 0;
    if (rbs[i] >= 0) {
      int b0, b1;
      sk_ctas(rbs[i], per, U, P, b0, b1);
      last[i] = atomicAdd(counters + rbs[i], 1) == b1 - b0;
    }
  }
}

// f(t, j, i) for every element of a warp's accumulators acc[MT_][NT_][4], unrolled: one place for the nest
template <int MT_, int NT_, class F>
__device__ __forceinline__ void for_acc(F&& f) {
#pragma unroll
  for (int t = 0; t < MT_; ++t)
#pragma unroll
    for (int j = 0; j < NT_; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) f(t, j, i);
}

// 16 bytes from shared memory (a 32-bit shared address)
__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// y lanes: hi << 8 | lo byte (the code's nibble in its low half), e0x: e0 << 7 | e0 << 23 -> bf16 bits: sign, exponent
// e0 + offset, 7 mantissa bits; the same as (y & 0x800F800F) + ((y >> 4) & 0x07F007F0) + e0x. The shifted part and
// the rest occupy disjoint bits (e0x's too), so one shift-and-add (LEA.HI) joins them after two masks: 4 instructions
// a pair with the byte permute where the three-term form takes 5 (on the H200, 2-6% faster flow kernels at M = 16-32
// and on gate_up at M <= 8; docs/w12-kernels.md, "The decode in four instructions")
__device__ __forceinline__ uint32_t dec_pair(uint32_t y, uint32_t e0x) {
  return ((y & 0x7F007F00u) >> 4) + ((y & 0x800F800Fu) | e0x);
}

// dec_pair with each lane's nibble in the high half of its lo byte (bits 4-7 and 20-23): the mask keeps it beside the
// offset and mantissa bits, so the one shift brings both down and the lo word needs no shift of its own
__device__ __forceinline__ uint32_t dec_pair_hi(uint32_t y, uint32_t e0x) {
  return ((y & 0x7FF07FF0u) >> 4) + ((y & 0x80008000u) | e0x);
}

// The 8-bit view's per-row constant from the exact base's e0x (e0 in both lanes, e0 << 7 | e0 << 23): the bin
// midpoint bit added for e0 >= 1; 0 for e0 = 0, whose bins read their lowest value (so hi 0 reads +0.0 there)
__device__ __forceinline__ uint32_t q8_base(uint32_t e0x) { return e0x == 0u ? 0u : e0x + 0x00080008u; }

// what the dense decode gave where an escape sits (its stored code is 0), in fp32, for a row of base e0: 2^(e0 - 127);
// the 8-bit view's value of hi byte 0 with Q8. The escape epilogues add x * escape less x times this.
template <bool Q8>
__device__ __forceinline__ float escape_dense(uint32_t e0) {
  if constexpr (Q8) return e0 == 0u ? 0.0f : __uint_as_float(e0 << 23 | 0x80000u);
  return __uint_as_float(e0 << 23);
}

// t lanes: hi (the byte in bits 0..7 of each 16-bit lane), c = q8_base(e0x) -> bf16 bits of the bin midpoint
// (docs/w12-format.md, "The 8-bit view"). hi * 16 puts the 7 low bits in place and the sign at bit 11, and
// (hi & 0x80) * 240 moves it to bit 15 (0x800 + 0x7800 = 0x8000); no lane carries into the next (at most
// 0xFF0 + 0x7800 + 0x7808 < 0x10000). Two multiply-adds instead of a shift, two masks and an add: they issue on the
// FMA pipe, beside the integer pipe that the masks and the byte permutes load, and the view's kernels are bound by
// their decode (on the H200 the flow kernel's view took 25.7 µs on in_proj at M = 1 this way, 29.0 with the shift
// and masks; docs/w12-kernels.md, "The 8-bit view").
__device__ __forceinline__ uint32_t dec_pair_q8(uint32_t t, uint32_t c) {
  uint32_t r;
  asm("{\n.reg .b32 u;\nand.b32 u, %1, 0x00800080;\nmad.lo.u32 %0, %1, 16, %2;\nmad.lo.u32 %0, u, 240, %0;\n}"
      : "=r"(r) : "r"(t), "r"(c));
  return r;
}

__device__ __forceinline__ void mma_bf16(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One chunk (64 columns) of a warp's fragments: thread (g = lane / 4, q = lane % 4) holds 16 columns of
// rows g and g + 8 of each m-tile and of token g of each n-tile; A and B use the same permuted k slots
// (w12_mma.cu's header), so the dot products are exact reorderings.
template <int MT, int NT>
struct Fragments {
  uint4 h[MT][2];  // hi bytes: rows g, g + 8 of each m-tile, 16 columns
  uint4 l[MT][2];  // lo bytes holding those columns' nibbles (low or high nibble, by q; unused for Q8)
  uint4 x[NT][2];  // x[token g of each n-tile, same 16 columns] as bf16
};

// k-step s (0..3) of one m-tile decoded into the A registers {a0, a1, a2, a3} of mma.m16n8k16: h / l the
// hi and lo words of rows g and g + 8, e0x their window bases, sh the nibble shift (columns 32..63 of a
// chunk sit in the high nibbles)
template <bool Q8>
__device__ __forceinline__ void decode_a(uint32_t (&a)[4], const uint4 (&h)[2], const uint4 (&l)[2],
                                         const uint32_t (&e0x)[2], int s, int sh) {
  const uint32_t ha = word(h[0], s), hb = word(h[1], s);
  if (Q8) {
    const uint32_t ca = q8_base(e0x[0]), cb = q8_base(e0x[1]);  // loop-invariant where e0x is
    a[0] = dec_pair_q8(__byte_perm(ha, 0u, 0x4140), ca);  // lanes: hi of cols p = 0, 1 of row g
    a[2] = dec_pair_q8(__byte_perm(ha, 0u, 0x4342), ca);  // p = 2, 3
    a[1] = dec_pair_q8(__byte_perm(hb, 0u, 0x4140), cb);  // row g + 8
    a[3] = dec_pair_q8(__byte_perm(hb, 0u, 0x4342), cb);
  } else {
    const uint32_t la = (word(l[0], s) >> sh) & 0x0F0F0F0Fu;
    const uint32_t lb = (word(l[1], s) >> sh) & 0x0F0F0F0Fu;
    a[0] = dec_pair(__byte_perm(ha, la, 0x1504), e0x[0]);  // lanes: cols p = 0, 1 of row g
    a[2] = dec_pair(__byte_perm(ha, la, 0x3726), e0x[0]);  // p = 2, 3
    a[1] = dec_pair(__byte_perm(hb, lb, 0x1504), e0x[1]);  // row g + 8
    a[3] = dec_pair(__byte_perm(hb, lb, 0x3726), e0x[1]);
  }
}

// one chunk's decode and mma.sync work of a warp: acc[t][j] += A(m-tile t) B(n-tile j) over the 4 k-steps
template <bool Q8, int MT, int NT>
__device__ __forceinline__ void mma_chunk(float (&acc)[MT][NT][4], const Fragments<MT, NT>& f,
                                          const uint32_t (&e0x)[MT][2], int sh) {
#pragma unroll
  for (int t = 0; t < MT; ++t) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      uint32_t a[4];
      decode_a<Q8>(a, f.h[t], f.l[t], e0x[t], s, sh);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint4& xv = f.x[j][s >> 1];
        mma_bf16(acc[t][j], a[0], a[1], a[2], a[3], (s & 1) ? xv.z : xv.x, (s & 1) ? xv.w : xv.y);
      }
    }
  }
}

// Diagnostic traces: the %globaltimer, in nanoseconds
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long v;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
  return v;
}

// Diagnostic traces (W12_TRACE builds): slot k of this CTA's 8 u64 stamps in `area`, the %globaltimer in
// nanoseconds, or the SM id for k = 1
__device__ __forceinline__ void cta_stamp(unsigned long long* area, int k) {
  unsigned long long v;
  if (k == 1) {
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    v = sm;
  } else {
    v = global_ns();
  }
  area[8 * blockIdx.x + k] = v;
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

// The end of one output row `row` < N for this thread's tokens (lane q): the row's escapes in CSR order, each
// adding x * escape less what the dense decode gave there (escape_dense), the bias, one rounding to bf16 (a float
// `out` takes the fp32 sum as it is). acc(j, u) is the accumulator of n-tile j, token 8 j + 2 q + u. The first
// escape, [p0] = (c0, v0), was fetched early by the caller (its dependent loads overlap the main loop).
__device__ __forceinline__ void store_out(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }

// A row's escapes in CSR order into acc(j, u): each adds x * escape less what the dense decode gave there
template <bool Q8, int NT, class Acc>
__device__ __forceinline__ void add_escapes(Acc& acc, uint32_t e0, int p0, int p1, int c0, uint32_t v0,
                                            const int* __restrict__ ecol, const uint16_t* __restrict__ eval,
                                            const __nv_bfloat16* __restrict__ x, long long ldx, int M, int q) {
  if (p1 > p0) {
    const float dense = escape_dense<Q8>(e0);
    for (int p = p0; p < p1; ++p) {
      const int col = p == p0 ? c0 : ecol[p];
      const float val = __uint_as_float((p == p0 ? v0 : (uint32_t)eval[p]) << 16);
      for_tokens<NT>(q, M, [&](int j, int u, int tok) {
        const float xv = __bfloat162float(x[(long long)tok * ldx + col]);
        acc(j, u) += xv * val - xv * dense;
      });
    }
  }
}

// finish_row's sums without the store: the escapes and the bias added into acc(j, u) (the SwiGLU epilogue stores
// two rows at once, store_swiglu)
template <bool Q8, int NT, class Acc>
__device__ __forceinline__ void finish_sum(Acc&& acc, int row, uint32_t e0, int p0, int p1, int c0, uint32_t v0,
                                           const int* __restrict__ ecol, const uint16_t* __restrict__ eval,
                                           const __nv_bfloat16* __restrict__ x, long long ldx, const void* bias,
                                           int bias_kind, int M, int q) {
  add_escapes<Q8, NT>(acc, e0, p0, p1, c0, v0, ecol, eval, x, ldx, M, q);
  if (bias_kind != 0) {
    const float b = bias_at(bias, bias_kind, row);
    for_tokens<NT>(q, M, [&](int j, int u, int) { acc(j, u) += b; });
  }
}

// SwiGLU of one token's finished gate and up sums: each rounded to bf16 once, s = bf16(g sigmoid(g)) with
// sigmoid(g) = 1 / (1 + e^-g) in IEEE fp32 division, the product s u rounded to bf16
__device__ __forceinline__ void store_swiglu(__nv_bfloat16* p, float gate, float up) {
  const float g = __bfloat162float(__float2bfloat16_rn(gate)), u = __bfloat162float(__float2bfloat16_rn(up));
  const float s = __bfloat162float(__float2bfloat16_rn(g * __fdiv_rn(1.0f, 1.0f + expf(-g))));
  *p = __float2bfloat16_rn(s * u);
}
__device__ __forceinline__ void store_swiglu(float*, float, float) {}  // not built: W12F_SWIGLU needs a bf16 out

template <bool Q8, int NT, class Acc, class OutT>
__device__ __forceinline__ void finish_row(Acc&& acc, int row, uint32_t e0, int p0, int p1, int c0, uint32_t v0,
                                           const int* __restrict__ ecol, const uint16_t* __restrict__ eval,
                                           const __nv_bfloat16* __restrict__ x, long long ldx, const void* bias,
                                           int bias_kind, OutT* __restrict__ out, int M, int N, int q) {
  add_escapes<Q8, NT>(acc, e0, p0, p1, c0, v0, ecol, eval, x, ldx, M, q);
  const float b = bias_kind != 0 ? bias_at(bias, bias_kind, row) : 0.0f;
  for_tokens<NT>(q, M, [&](int j, int u, int tok) {
    float sum = acc(j, u);
    if (bias_kind != 0) sum += b;  // no +0.0: it would turn -0.0 into +0.0
    store_out(out + (long long)tok * N + row, sum);
  });
}

// The fixed-base decode's row scale (the flow kernel): the x range it needs, its condition, the scale.
// exponent field of the largest |x| and of the smallest non-zero |x| over the bf16 pairs folded in
struct XRange {
  uint32_t mx = 0u;           // per-lane max of |bits|
  uint32_t mn = 0xFFFFFFFFu;  // per-lane min of |bits| - 1 (0 wraps to 0xFFFF: "no non-zero")
  __device__ __forceinline__ void add(uint32_t v) {
    mx = __vmaxu2(mx, v & 0x7FFF7FFFu);
    mn = __vminu2(mn, ((v | 0x80008000u) - 0x00010001u) ^ 0x80008000u);
  }
  __device__ __forceinline__ void add(const uint4& v) {
    add(v.x);
    add(v.y);
    add(v.z);
    add(v.w);
  }
  __device__ __forceinline__ int emax() const { return (int)(max(mx & 0xFFFFu, mx >> 16) >> 7); }
  __device__ __forceinline__ int emin() const {
    const uint32_t m = min(mn & 0xFFFFu, mn >> 16);
    return m == 0xFFFFu ? 255 : (int)((m + 1u) >> 7);
  }
};

// the scale identity's condition for a row with window base e (docs/w12-kernels.md)
__device__ __forceinline__ bool scale_exact(int e, int emin, int emax) {
  if (e == 0) return true;  // decoded with the exact base: scale 1
  const int s = e - 112;
  return emin >= 64 - min(s, 0) && emax + max(s, 0) <= 230;
}

// v * 2^(e - 112) for 1 <= e <= 240, rounded once (2^128 is applied as two exact factors)
__device__ __forceinline__ float scale_row(float v, int e) {
  if (e == 0) return v;
  const int s = e - 112;
  if (s > 127) return (v * 0x1p64f) * __uint_as_float((uint32_t)(s - 64 + 127) << 23);
  return v * __uint_as_float((uint32_t)(s + 127) << 23);
}

// the fixed-base accumulators (rows e0r[0] and e0r[1] of the lane) scaled once by 2^(e0 - 112) when the identity holds
// for every row of the warp; false, with acc untouched, where it does not (the caller recomputes with the exact base)
template <int NT>
__device__ __forceinline__ bool scale_rows(float (&acc)[NT][4], const int (&e0r)[2], int emin, int emax) {
  const bool ok = scale_exact(e0r[0], emin, emax) && scale_exact(e0r[1], emin, emax);
  if (!__all_sync(0xFFFFFFFFu, ok)) return false;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int v = 0; v < 4; ++v) acc[j][v] = scale_row(acc[j][v], e0r[v >> 1]);
  return true;
}

}  // namespace
