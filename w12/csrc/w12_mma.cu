// W12 skinny GEMM on tensor cores (mma.sync m16n8k16, sm_80+), weights decoded in registers.
//
//   out[M, N] = x[M, Kp] @ W[N, Kp]^T (+ bias), W read from the W12 planes (docs/w12-format.md),
//   fp32 accumulation, one rounding to bf16 at the end. M <= 8 * NT.
//
// Swap-AB: weight rows are the MMA's M (16 per m-tile), tokens its N (8 per n-tile). No shared
// memory on the weight path: a reduction is invariant to the order of k, so each thread reads
// 16 *contiguous* columns of its two fragment rows (one 16-byte load per row and plane) and
// the k slots of its A and B fragments are assigned the same columns:
//
//   thread (g = lane / 4, q = lane % 4), chunk c (64 columns), k-step s (0..3), slot p (0..3):
//   column = 64 c + 16 q + 4 s + p;  A regs {a0a1, a4a5} = slots {0,1}, {2,3} of rows g, g + 8;
//   B regs {b0b1, b2b3} = the same slots of token g.
//
// A pair of weights (one bf16x2 register) decodes in 5 integer ops: prmt interleaves two hi
// bytes with their nibbles into lanes `hi << 8 | nib`, then
//   bits = (y & 0x800F800F) + ((y >> 4) & 0x07F007F0) + (e0 << 7 | e0 << 23)
// (sign | low nibble, offset and 3 high mantissa bits moved down by 4, window base added; no
// carry crosses a lane because e0 + 15 <= 255). Code 0 decodes to 2^(e0 - 127), not +0.0; the
// epilogue adds x * (escape - 2^(e0 - 127)) for every escape, as the Triton kernels do.
//
// Optional split-K across CTAs (gridDim.y): fp32 partials in a workspace, the last CTA of a row
// block (atomic counter) adds them in split order and finishes; it spreads N = 5120 layers, which
// have too few row blocks to balance the SMs, over more CTAs.
// A CTA has WR x WK warps: warp (wr, wk) owns rows r0 + 16 MT wr + [0, 16 MT) and chunks wk, wk + WK,
// ...; warps with the same wk read the same x columns at about the same time (L1 hits). The WK
// partial sums of a row meet in shared memory, and the epilogue applies escapes and bias and
// stores bf16, coalesced along N. rowptr of the CTA's rows is loaded before the main loop.
// Configuration comes from -D defines (w12/cuda.py compiles one cubin per config).

#include "w12_common.cuh"

#ifndef W12_MT
#define W12_MT 1
#endif
#ifndef W12_NT
#define W12_NT 1
#endif
#ifndef W12_WK
#define W12_WK 4
#endif
#ifndef W12_WR
#define W12_WR 1
#endif
#ifndef W12_PIPE
#define W12_PIPE 2
#endif
#ifndef W12_Q8
#define W12_Q8 0
#endif
#ifndef W12_ASYNC
#define W12_ASYNC 0
#endif

namespace {

constexpr int MT = W12_MT;      // m-tiles (16 weight rows each) per warp
constexpr int NT = W12_NT;      // n-tiles (8 tokens each)
constexpr int WK = W12_WK;      // warp groups per CTA splitting K
constexpr int WR = W12_WR;      // warp groups per CTA splitting rows (they read the same x, via L1)
constexpr int WARPS = WK * WR;
constexpr int PIPE = W12_PIPE;  // chunks in registers per warp (PIPE - 1 loading while one computes)
constexpr bool Q8 = W12_Q8 != 0;
constexpr bool ASYNC = W12_ASYNC != 0;  // PIPE-stage cp.async ring in shared memory instead of registers
constexpr int ROWS = 16 * MT * WR;
constexpr int TOKS = 8 * NT;
constexpr int CHUNK = 64;
constexpr int ACC = MT * NT * 4;  // accumulators per thread
// M > 8: batch the escape loads of a thread's tokens (H200, perf/results/h200/20261130-w12-ab-batched-escapes.json: ~10% at M = 32).
// M <= 8 keeps the per-output loop: the batched form made ptxas schedule the main loop worse there
// (in_proj M=1 40 -> 48 us), and with one token per row it has nothing to batch.
constexpr bool BATCH_ESC = NT > 1;
static_assert(ROWS <= 32 * WARPS, "one thread per CTA row loads its escape range: need MT <= 2 * WK");

using Frag = Fragments<MT, NT>;

__device__ __forceinline__ uint4 ld_stream(const uint8_t* p) {
  // weights are read once: keep them out of L1
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
  // 16 bytes global -> shared, bypassing L1; src_bytes = 0 writes zeros
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

}  // namespace

extern "C" __global__ void __launch_bounds__(32 * WARPS) w12_matmul_mma_kernel(
    const __nv_bfloat16* __restrict__ x,  // [M, >= Kp], row stride ldx, 16-byte aligned rows
    long long ldx,
    const uint8_t* __restrict__ hi,       // [N, Kp]
    const uint8_t* __restrict__ lo,       // [N, Kp / 2]
    W12_TAIL_PARAMS) {
  extern __shared__ float red[];  // [WK][WR][ACC][32], then per row {p0, p1, first col, first val} (as int)
  int* rp_s = reinterpret_cast<int*>(red + WARPS * ACC * 32);
  const int lane = threadIdx.x & 31;
  const int w = (threadIdx.x >> 5) % WK;
  const int wr = (threadIdx.x >> 5) / WK;
  const int g = lane >> 2;
  const int q = lane & 3;
  const int r0 = blockIdx.x * ROWS;
  // split s = blockIdx.y of gridDim.y takes chunks [c_begin, c_begin + nch) of the Kp / 64
  const int splits = gridDim.y;
  const int per_split = (Kp / CHUNK + splits - 1) / splits;
  const int c_begin = blockIdx.y * per_split;
  const int nch = max(0, min(Kp / CHUNK - c_begin, per_split));
  // escape ranges of the CTA's rows: issued here, consumed after the main loop
  int rp0 = 0, rp1 = 0, ec0 = 0, ev0 = 0;
  if (threadIdx.x < ROWS && r0 + (int)threadIdx.x < N) {
    rp0 = rowptr[r0 + threadIdx.x];
    rp1 = rowptr[r0 + threadIdx.x + 1];
  }
  // most rows hold 0 or 1 escape: their first is fetched once the first weight loads are in flight
  // (waiting for rowptr here would delay the main loop by a memory latency)
  auto first_escape = [&]() {
    if (BATCH_ESC && rp1 > rp0) {
      ec0 = ecol[rp0];
      ev0 = eval[rp0];
    }
  };

  const uint8_t* hp[MT][2];
  const uint8_t* lp[MT][2];
  uint32_t e0x[MT][2];
#pragma unroll
  for (int t = 0; t < MT; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min(r0 + 16 * (MT * wr + t) + 8 * h + g, N - 1);  // rows past N compute garbage, never stored
      hp[t][h] = hi + (long long)row * Kp + 16 * q;
      lp[t][h] = lo + (long long)row * (Kp / 2) + 16 * (q & 1);
      const uint32_t e = e0[row];
      e0x[t][h] = (e << 7) | (e << 23);
    }
  }
  const int sh = (q >> 1) * 4;  // columns 32..63 of a chunk sit in the high nibbles
  const __nv_bfloat16* xp[NT];
  bool xok[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int tok = 8 * j + g;
    xok[j] = tok < M;
    xp[j] = x + (long long)(xok[j] ? tok : 0) * ldx + 16 * q;
  }

  float acc[MT][NT][4];
  for_acc<MT, NT>([&](int t, int j, int i) { acc[t][j][i] = 0.0f; });

  auto load = [&](Frag& f, int c) {
#pragma unroll
    for (int t = 0; t < MT; ++t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        f.h[t][h] = ld_stream(hp[t][h] + (long long)c * CHUNK);
        if (!Q8) f.l[t][h] = ld_stream(lp[t][h] + (long long)c * (CHUNK / 2));
      }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const uint4* p = reinterpret_cast<const uint4*>(xp[j] + (long long)c * CHUNK);
      f.x[j][0] = xok[j] ? __ldg(p) : make_uint4(0, 0, 0, 0);
      f.x[j][1] = xok[j] ? __ldg(p + 1) : make_uint4(0, 0, 0, 0);
    }
  };

  auto compute = [&](const Frag& f) { mma_chunk<Q8>(acc, f, e0x, sh); };

  // x, the workspace, the counters and out may be the previous kernel's (programmatic dependent
  // launch): wait for it before the first load of x
  grid_dep_wait();
  if constexpr (!ASYNC) {
    // register pipeline: PIPE chunks per warp, one computing while the others load
    Frag f[PIPE];
#pragma unroll
    for (int p = 0; p < PIPE - 1; ++p)
      if (w + p * WK < nch) load(f[p], c_begin + w + p * WK);
    first_escape();
    for (int c0 = w; c0 < nch; c0 += PIPE * WK) {
#pragma unroll
      for (int p = 0; p < PIPE; ++p) {
        const int c = c0 + p * WK;
        const int cn = c + (PIPE - 1) * WK;
        if (cn < nch) load(f[(p + PIPE - 1) % PIPE], c_begin + cn);
        if (c < nch) compute(f[p]);
      }
    }
  } else {
    // cp.async ring: each thread copies exactly the 16-byte pieces it reads back itself, so a
    // per-thread wait_group is all the synchronisation the main loop needs. Slot layout
    // [stage][piece][thread]: a warp's LDS.128 of one piece is 512 contiguous bytes.
    constexpr int VH = 2 * MT, VL = Q8 ? 0 : 2 * MT, VX = 2 * NT, V = VH + VL + VX;
    constexpr int NTHR = 32 * WARPS;
    uint4* ring = reinterpret_cast<uint4*>(red);
    const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring)) + 16u * threadIdx.x;
    auto issue = [&](int stage, int c) {
      const uint32_t base = ring_s + 16u * NTHR * V * stage;
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          cp_async16(base + 16u * NTHR * (2 * t + h), hp[t][h] + (long long)c * CHUNK, 16);
          if (!Q8) cp_async16(base + 16u * NTHR * (VH + 2 * t + h), lp[t][h] + (long long)c * (CHUNK / 2), 16);
        }
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < 2; ++i)
          cp_async16(base + 16u * NTHR * (VH + VL + 2 * j + i), xp[j] + (long long)c * CHUNK + 8 * i, xok[j] ? 16 : 0);
    };
    const int mine = nch > w ? (nch - w + WK - 1) / WK : 0;  // chunks of this warp: w, w + WK, ...
#pragma unroll
    for (int p = 0; p < PIPE - 1; ++p) {
      if (p < mine) issue(p, c_begin + w + p * WK);
      cp_async_commit();  // empty groups keep the count uniform
    }
    first_escape();
    for (int i = 0; i < mine; ++i) {
      cp_async_wait<PIPE - 2>();  // chunk i has landed
      if (i + PIPE - 1 < mine) issue((i + PIPE - 1) % PIPE, c_begin + w + (i + PIPE - 1) * WK);
      cp_async_commit();
      const uint4* slot = ring + (size_t)NTHR * V * (i % PIPE) + threadIdx.x;
      Frag f;
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          f.h[t][h] = slot[NTHR * (2 * t + h)];
          if (!Q8) f.l[t][h] = slot[NTHR * (VH + 2 * t + h)];
        }
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int k = 0; k < 2; ++k) f.x[j][k] = slot[NTHR * (VH + VL + 2 * j + k)];
      compute(f);
    }
    cp_async_wait<0>();
    __syncthreads();  // the partial sums below reuse the ring's memory
  }

  grid_dep_launch();  // the main loop is done: the next kernel's CTAs may start
  // K-split partials meet in shared memory
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[((w * WR + wr) * ACC + (t * NT + j) * 4 + i) * 32 + lane] = acc[t][j][i];
  if (threadIdx.x < ROWS) {
    rp_s[4 * threadIdx.x] = rp0;
    rp_s[4 * threadIdx.x + 1] = rp1;
    rp_s[4 * threadIdx.x + 2] = ec0;
    rp_s[4 * threadIdx.x + 3] = ev0;
  }
  __syncthreads();

  auto cta_sum = [&](int o) {
    const int rl = o % ROWS, tok = o / ROWS;
    const int tw = rl >> 4, gg = rl & 7, hh = (rl >> 3) & 1;  // 16-row tile tw = MT * wr + t
    const int j = tok >> 3, tt = tok & 7;
    const int idx = (((tw / MT) * ACC) + ((tw % MT) * NT + j) * 4 + hh * 2 + (tt & 1)) * 32 + gg * 4 + (tt >> 1);
    float sum = 0.0f;
#pragma unroll
    for (int w2 = 0; w2 < WK; ++w2) sum += red[w2 * WR * ACC * 32 + idx];
    return sum;
  };
  if (splits > 1) {
    // publish this split's partials; the last CTA of the row block to arrive adds all of them in
    // split order (deterministic) and runs the epilogue
    float* mine = ws + ((size_t)blockIdx.x * splits + blockIdx.y) * (ROWS * TOKS);
    for (int o = threadIdx.x; o < ROWS * TOKS; o += 32 * WARPS) __stcg(mine + o, cta_sum(o));
    if (!last_to_arrive(counters + blockIdx.x, splits)) return;
    __threadfence();
  }

  // epilogue (M <= 8): one output per thread and step, consecutive threads on consecutive rows
  if constexpr (!BATCH_ESC) {
    for (int o = threadIdx.x; o < ROWS * TOKS; o += 32 * WARPS) {
      const int rl = o % ROWS, tok = o / ROWS;
      const int row = r0 + rl;
      if (row >= N || tok >= M) continue;
      float sum;
      if (splits > 1) {
        const float* all = ws + (size_t)blockIdx.x * splits * (ROWS * TOKS) + o;
        sum = 0.0f;
        for (int s2 = 0; s2 < splits; ++s2) sum += __ldcg(all + (size_t)s2 * (ROWS * TOKS));
      } else {
        sum = cta_sum(o);
      }
      const int p0 = rp_s[4 * rl], p1 = rp_s[4 * rl + 1];
      if (p1 > p0) {
        const float v0 = escape_dense<Q8>(e0[row]);  // what the dense decode gave where an escape sits
        const __nv_bfloat16* xr = x + (long long)tok * ldx;
        for (int p = p0; p < p1; ++p) {
          const float xv = __bfloat162float(xr[ecol[p]]);
          const float ev = __uint_as_float((uint32_t)eval[p] << 16);
          sum += xv * ev - xv * v0;
        }
      }
      if (bias_kind != 0) sum += bias_at(bias, bias_kind, row);  // no +0.0: it would turn -0.0 into +0.0
      out[(long long)tok * N + row] = __float2bfloat16_rn(sum);
    }
  }
  // epilogue (M > 8): thread t owns row rl = t % ROWS and tokens t / ROWS + k * TSTEP (consecutive threads on
  // consecutive rows: coalesced stores). Escapes are the outer loop, so the x loads of all the
  // thread's tokens for one escape are independent and in flight together.
  if constexpr (BATCH_ESC) {
    constexpr int NTHR = 32 * WARPS;
    constexpr int TSTEP = NTHR / ROWS;  // exact: ROWS divides NTHR (MT <= 2 WK)
    constexpr int KO = (ROWS * TOKS + NTHR - 1) / NTHR;
    const int rl = threadIdx.x % ROWS, tok0 = threadIdx.x / ROWS;
    const int row = r0 + rl;
    float sum[KO];
#pragma unroll
    for (int k = 0; k < KO; ++k) {
      const int tok = tok0 + k * TSTEP, o = tok * ROWS + rl;
      sum[k] = 0.0f;
      if (tok >= TOKS) continue;
      if (splits > 1) {
        const float* all = ws + (size_t)blockIdx.x * splits * (ROWS * TOKS) + o;
        for (int s2 = 0; s2 < splits; ++s2) sum[k] += __ldcg(all + (size_t)s2 * (ROWS * TOKS));
      } else {
        sum[k] = cta_sum(o);
      }
    }
    if (row < N) {
      const int p0 = rp_s[4 * rl], p1 = rp_s[4 * rl + 1];
      if (p1 > p0) {
        const float v0 = escape_dense<Q8>(e0[row]);  // what the dense decode gave where an escape sits
        for (int p = p0; p < p1; ++p) {
          const int col = p == p0 ? rp_s[4 * rl + 2] : ecol[p];  // the first escape was fetched up front
          const float ev = __uint_as_float((uint32_t)(p == p0 ? rp_s[4 * rl + 3] : eval[p]) << 16);
#pragma unroll
          for (int k = 0; k < KO; ++k) {
            const int tok = tok0 + k * TSTEP;
            if (tok < M) {
              const float xv = __bfloat162float(x[(long long)tok * ldx + col]);
              sum[k] += xv * ev - xv * v0;
            }
          }
        }
      }
      const float b = bias_kind != 0 ? bias_at(bias, bias_kind, row) : 0.0f;
#pragma unroll
      for (int k = 0; k < KO; ++k) {
        const int tok = tok0 + k * TSTEP;
        // no +0.0 without a bias: it would turn -0.0 into +0.0
        if (tok < M) out[(long long)tok * N + row] = __float2bfloat16_rn(bias_kind != 0 ? sum[k] + b : sum[k]);
      }
    }
  }
  if (splits > 1 && threadIdx.x == 0) counters[blockIdx.x] = 0;  // ready for the next launch (graph replays)
}
