// W12 skinny GEMM, persistent and streamed per warp (mma.sync m16n8k16, cp.async: sm_80+).
//
//   out[M, N] = x[M, Kp] @ W[N, Kp]^T (+ bias), W read from the W12 planes (docs/w12-format.md),
//   fp32 accumulation, one rounding to bf16 at the end. M <= 8 * NT <= 32.
//
// Work split (docs/w12-kernels.md). A unit is R = 16 WARPS weight rows x 64 columns. The grid is
// persistent (CPS CTAs per SM) and CTA b takes the contiguous unit range [b U / P, (b + 1) U / P) of
// the U = ceil(N / R) * Kp / 64 units in row-group-major order, so every CTA streams the same number of
// bytes (+-1 unit) and no SM idles in a last wave. Each warp of the CTA owns 16 rows of every unit and
// streams them through its own cp.async ring of STAGES slots (hi 16 x 64 B, lo 16 x 32 B and the
// unit's 64 columns of x per token): no barrier between warps in the main loop. A row group split
// between CTAs (only a CTA's first and last) meets in a workspace: each CTA writes its share, and the
// last CTA to arrive adds the shares in CTA order (deterministic), applies the escapes and the bias,
// and stores; the arrival counters reset themselves (CUDA-graph replays need no memset).
//
// Decode (FIXED = 1). Per bf16 pair: y = prmt(hi, lo >> sh) puts `hi << 8 | lo byte` in each lane and
//   w' = (y & 0x800F800F) | ((y >> 4) & 0x07F007F0) | C,   C = 0x38003800 (exponent base 112)
// (1 PRMT + 1 SHF + 2 LOP3; the lo byte's other nibble falls outside both masks). For a row with
// e0 >= 1 every code, code 0 included, decodes to w' = 2^(112 - e0) w exactly, with w the exact-base
// decode of w12_mma.cu (code 0: 2^(e0 - 127), removed by the escape correction). The row's sum is then
// sum(x w) = 2^(e0 - 112) sum(x w'), applied once per partial sum before the fix-up and the escapes.
// A row with e0 = 0 (subnormal window, e.g. an all-zero row) decodes with C = 0, i.e. exactly, scale 1.
// Scale identity: fp32 products and sums commute with a power-of-two scale as long as every
// intermediate value is zero or normal and finite in both domains. With Kp <= 2^18, |w'| in [2^-15, 2)
// and x bounded by the exponents Emin (smallest non-zero |x|) and Emax (largest) of the x values this CTA
// reads, that holds when
//   Emin >= 64 - min(s, 0)   and   Emax + max(s, 0) <= 230,      s = e0 - 112
// (docs/w12-kernels.md gives the proof; 64 leaves 48 bits for the tensor core's internal alignment).
// A warp whose rows fail it recomputes its share with the exact-base decode from global memory (the
// result of the FIXED = 0 build, bit for bit); rows of real weights and activations never take it.
// The 8-bit view (Q8) decodes `hi << 8` the same way with C | 0x00080008 (the bin midpoint) for e0 >= 1 and C = 0
// for e0 = 0 (w12_common.cuh's q8_base).
//
// Fragments as in w12_mma.cu: thread (g = lane / 4, q = lane % 4) holds columns 16 q .. 16 q + 15 of a
// chunk for rows g and g + 8 and token g of each n-tile; A and B use the same permuted k slots.
// Shared-memory pitches (64 B hi, 32 B lo, 144 B x) make those LDS.128 conflict-free.
// PDL: the first STAGES - 1 units' planes are requested before griddepcontrol.wait; x, the workspace,
// the counters and out only after it.

#include "w12_common.cuh"

#ifndef W12_WARPS
#define W12_WARPS 8
#endif
#ifndef W12_STAGES
#define W12_STAGES 4
#endif
#ifndef W12_NT
#define W12_NT 1
#endif
#ifndef W12_Q8
#define W12_Q8 0
#endif
#ifndef W12_CPS
#define W12_CPS 1  // CTAs per SM the grid is sized for (the launch bound's minimum)
#endif
#ifndef W12_TILED
#define W12_TILED 0  // planes read from a tile-contiguous copy: per 16-row block and chunk, hi 16 x 64 then lo 16 x 32
#endif
#ifndef W12_TRACE
#define W12_TRACE 0  // diagnostic (defines=, launch(trace=)): per-CTA %globaltimer stamps after the shares in ws
#endif
#ifndef W12_FIXED
#define W12_FIXED 1  // fixed-base decode with the epilogue scale; 0: the exact base in the loop (reference build)
#endif

namespace {

constexpr int WARPS = W12_WARPS;
constexpr int STAGES = W12_STAGES;
constexpr int NT = W12_NT;
constexpr int TOKS = 8 * NT;
constexpr bool Q8 = W12_Q8 != 0;
constexpr bool FIXED = W12_FIXED != 0;
constexpr bool TILED = W12_TILED != 0;
constexpr int R = 16 * WARPS;                 // rows per unit
constexpr int HB = 16 * 64;                   // hi bytes of a warp's slot
constexpr int LB = Q8 ? 0 : 16 * 32;          // lo bytes
constexpr int XP = 144;                       // pitch of one token's 128 bytes of x
constexpr int SLOT = HB + LB + TOKS * XP;     // one stage of one warp
constexpr int SHARE = R * TOKS;               // floats of one CTA's share of a row group
constexpr uint32_t BASE112 = 0x38003800u;     // exponent 112 in both lanes
static_assert(STAGES >= 2, "a ring needs two slots");
static_assert(NT == 1 || NT == 2 || NT == 4, "n-tiles: 1, 2 or 4");

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  // 16 bytes, zero-filled when !valid (rows past N): no out-of-bounds read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// fixed-base pair decode (module doc): y lanes = hi << 8 | lo byte
__device__ __forceinline__ uint32_t dec_fixed(uint32_t y, uint32_t c) {
  return (y & 0x800F800Fu) | ((y >> 4) & 0x07F007F0u) | c;
}

// fixed-base 8-bit view: y lanes = hi << 8; the midpoint bit is in c (none for e0 = 0)
__device__ __forceinline__ uint32_t dec_fixed_q8(uint32_t y, uint32_t c) {
  return (y & 0x80008000u) | ((y >> 4) & 0x07F007F0u) | c;
}

// k-step s of rows g, g + 8 into the A registers: exact base (e0x, w12_common.cuh's decode_a) or fixed
// base (c: C per row, 0 or BASE112, with the midpoint bit for Q8)
template <bool FIX>
__device__ __forceinline__ void decode_step(uint32_t (&a)[4], const uint4 (&h)[2], const uint4 (&l)[2],
                                            const uint32_t (&k)[2], int s, int sh) {
  if constexpr (!FIX) {
    decode_a<Q8>(a, h, l, k, s, sh);
  } else {
    const uint32_t ha = word(h[0], s), hb = word(h[1], s);
    if constexpr (Q8) {
      a[0] = dec_fixed_q8(__byte_perm(ha, 0u, 0x1404), k[0]);
      a[2] = dec_fixed_q8(__byte_perm(ha, 0u, 0x3424), k[0]);
      a[1] = dec_fixed_q8(__byte_perm(hb, 0u, 0x1404), k[1]);
      a[3] = dec_fixed_q8(__byte_perm(hb, 0u, 0x3424), k[1]);
    } else {
      const uint32_t la = word(l[0], s) >> sh, lb = word(l[1], s) >> sh;
      a[0] = dec_fixed(__byte_perm(ha, la, 0x1504), k[0]);
      a[2] = dec_fixed(__byte_perm(ha, la, 0x3726), k[0]);
      a[1] = dec_fixed(__byte_perm(hb, lb, 0x1504), k[1]);
      a[3] = dec_fixed(__byte_perm(hb, lb, 0x3726), k[1]);
    }
  }
}

// one chunk: acc[j] += A(rows g, g + 8) B(n-tile j) over the 4 k-steps
template <bool FIX>
__device__ __forceinline__ void chunk_mma(float (&acc)[NT][4], const uint4 (&h)[2], const uint4 (&l)[2],
                                          const uint4 (&xf)[NT][2], const uint32_t (&k)[2], int sh) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    uint32_t a[4];
    decode_step<FIX>(a, h, l, k, s, sh);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const uint4& xv = xf[j][s >> 1];
      mma_bf16(acc[j], a[0], a[1], a[2], a[3], (s & 1) ? xv.z : xv.x, (s & 1) ? xv.w : xv.y);
    }
  }
}


// W12_TRACE: stamp k of this CTA in the trace area (cta_stamp: %globaltimer ns; slot 1: the SM id), by thread 0
__device__ __forceinline__ void stamp(unsigned long long* area, int k) {
  if constexpr (W12_TRACE != 0) {
    if (threadIdx.x == 0) cta_stamp(area, k);
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(32 * WARPS, W12_CPS) w12_matmul_stream_kernel(
    const __nv_bfloat16* __restrict__ x,  // [M, >= Kp], row stride ldx, 16-byte aligned rows, zero past K
    long long ldx,
    const uint8_t* __restrict__ hi,       // [N, Kp]
    const uint8_t* __restrict__ lo,       // [N, Kp / 2] (unused for Q8)
    const uint8_t* __restrict__ tiles,    // TILED: [ceil(N / 16), Kp / 64, 1536] tile-contiguous copy of hi and lo
    W12_TAIL_PARAMS) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_emin, s_emax, s_last[2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int sh = (q >> 1) * 4;  // columns 32..63 of a chunk sit in the high nibbles of lo
  const int KC = Kp / 64;
  const long long U = (long long)((N + R - 1) / R) * KC;
  const int P = gridDim.x;
  const int ub = (int)(blockIdx.x * U / P), ue = (int)((blockIdx.x + 1) * U / P);
  const uint32_t ring = (uint32_t)__cvta_generic_to_shared(smem) + warp * STAGES * SLOT;
  unsigned long long* const trace_area = reinterpret_cast<unsigned long long*>(ws + (size_t)gridDim.x * 2 * SHARE);
  stamp(trace_area, 0);  // entry
  stamp(trace_area, 1);
  if (threadIdx.x == 0) {
    s_emin = 255;
    s_emax = 0;
  }
  // The refill cursor: the next unit to request (f_u, its row group f_rg and chunk f_c) and its slot.
  // It advances by one chunk per unit, so no division runs in the loop; the lane's plane row pointers
  // change only with the row group.
  int f_u = ub, f_rg = ub / KC, f_c = ub - (ub / KC) * KC, f_slot = 0;
  const uint8_t* hp[2];
  const uint8_t* lp;
  bool hv[2], lv;
  auto plane_rows = [&]() {
#pragma unroll
    for (int p2 = 0; p2 < 2; ++p2) {
      const int p = lane + 32 * p2, row = f_rg * R + 16 * warp + (p >> 2);
      hv[p2] = row < N;
      hp[p2] = hi + (long long)min(row, N - 1) * Kp + 16 * (p & 3);
    }
    const int row = f_rg * R + 16 * warp + (lane >> 1);
    lv = row < N;
    lp = lo + (long long)min(row, N - 1) * (Kp / 2) + 16 * (lane & 1);
  };
  if constexpr (!TILED) plane_rows();
  // this unit's planes for the warp's 16 rows: hi 16 x 64 bytes at pitch 64, lo 16 x 32 at pitch 32
  auto issue_planes = [&]() {
    const uint32_t st = ring + f_slot * SLOT;
    if constexpr (TILED) {
      const int blk = f_rg * WARPS + warp;
      const bool ok = blk * 16 < N;
      const long long nb = (N + 15) / 16, b = min(blk, (N - 1) / 16);
      const uint8_t* t = tiles + (W12_TILED == 2 ? (long long)f_c * nb + b : b * KC + f_c) * 1536;
      cp_async16(st + 16 * lane, t + 16 * lane, ok);
      cp_async16(st + 512 + 16 * lane, t + 512 + 16 * lane, ok);
      if constexpr (!Q8) cp_async16(st + HB + 16 * lane, t + 1024 + 16 * lane, ok);
    } else {
#pragma unroll
      for (int p2 = 0; p2 < 2; ++p2) {
        const int p = lane + 32 * p2;
        cp_async16(st + (p >> 2) * 64 + 16 * (p & 3), hp[p2] + 64 * f_c, hv[p2]);
      }
      if constexpr (!Q8) cp_async16(st + HB + (lane >> 1) * 32 + 16 * (lane & 1), lp + 32 * f_c, lv);
    }
  };
  // this unit's x: lane l copies piece l & 7 (16 bytes) of tokens l / 8 + 4 i (< M)
  const __nv_bfloat16* const x_lane = x + (long long)(lane >> 3) * ldx + 8 * (lane & 7);
  const uint32_t xs_lane = HB + LB + (lane >> 3) * XP + 16 * (lane & 7);
  auto issue_x = [&]() {
    const uint32_t st = ring + f_slot * SLOT + xs_lane;
#pragma unroll
    for (int i2 = 0; i2 < 2 * NT; ++i2)
      if ((lane >> 3) + 4 * i2 < M) cp_async16(st + 4 * i2 * XP, x_lane + 4 * i2 * ldx + 64 * f_c, true);
  };
  auto advance = [&]() {
    ++f_u;
    f_slot = f_slot + 1 == STAGES ? 0 : f_slot + 1;
    if (++f_c == KC) {
      f_c = 0;
      ++f_rg;
      if constexpr (!TILED) plane_rows();
    }
  };
  // the first STAGES - 1 units' planes go out before the wait for the previous kernel (x may be its output)
  const int pre = min(STAGES - 1, ue - ub);
  for (int i = 0; i < pre; ++i) {
    issue_planes();
    advance();
  }
  grid_dep_wait();
  f_u = ub;
  f_rg = ub / KC;
  f_c = ub - f_rg * KC;
  f_slot = 0;
  if constexpr (!TILED) plane_rows();
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < pre) {
      issue_x();
      advance();
    }
    cp_commit();  // group i completes stage i (and, being in order, every earlier plane copy)
  }

  if constexpr (FIXED) {
    // the exponent range of the x values this CTA multiplies: the chunks of its unit range, tokens < M
    __syncthreads();  // s_emin / s_emax initialised
    const int span = (int)min((long long)KC, (long long)(ue - ub)), c_first = ub % KC;
    XRange xr;
    for (int idx = threadIdx.x; idx < M * span * 8; idx += blockDim.x) {
      const int t = idx / (span * 8), rem = idx - t * span * 8;
      const int c = (c_first + rem / 8) % KC;
      xr.add(__ldcg(reinterpret_cast<const uint4*>(x + (long long)t * ldx + 64 * c + 8 * (rem & 7))));
    }
    const int emax = __reduce_max_sync(0xFFFFFFFFu, (unsigned)xr.emax());
    const int emin = __reduce_min_sync(0xFFFFFFFFu, (unsigned)xr.emin());
    if (lane == 0) {
      atomicMax(&s_emax, emax);
      atomicMin(&s_emin, emin);
    }
  }
  __syncthreads();
  const int emin = s_emin, emax = s_emax;
  stamp(trace_area, 2);  // prologue done (first stages requested, x range known)

  float acc[NT][4];
  // this thread's rows: row h = rbase + 8 h + g (h = 0, 1)
  int ep0[2], ep1[2], ec[2], e0r[2];
  uint32_t ev[2], kk[2];
  auto row_meta = [&](int rg) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = rg * R + 16 * warp + 8 * h + g;
      ep0[h] = ep1[h] = ec[h] = 0;
      ev[h] = 0;
      e0r[h] = 0;
      if (row < N) {
        ep0[h] = rowptr[row];
        ep1[h] = rowptr[row + 1];
        e0r[h] = e0[row];
      }
      const uint32_t e = (uint32_t)e0r[h];
      if constexpr (FIXED)
        kk[h] = e == 0 ? 0u : BASE112 | (Q8 ? 0x00080008u : 0u);
      else
        kk[h] = (e << 7) | (e << 23);
    }
  };
  auto first_escapes = [&]() {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (ep1[h] > ep0[h]) {
        ec[h] = ecol[ep0[h]];
        ev[h] = eval[ep0[h]];
      }
  };
  auto zero_acc = [&]() {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;
  };
  // the exact-base share of row group rg over chunks [c0, c0 + len), planes and x read from global memory
  // in the main loop's order: what the FIXED = 0 build computes
  auto exact_share = [&](int rg, int c0, int len) {
    zero_acc();
    uint32_t e0x[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) e0x[h] = ((uint32_t)e0r[h] << 7) | ((uint32_t)e0r[h] << 23);
    for (int c = c0; c < c0 + len; ++c) {
      uint4 hf[2], lf[2], xf[NT][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = rg * R + 16 * warp + 8 * h + g;
        const bool ok = row < N;
        const long long rr = min(row, N - 1);
        hf[h] = ok ? __ldcg(reinterpret_cast<const uint4*>(hi + rr * Kp + 64 * c + 16 * q)) : make_uint4(0, 0, 0, 0);
        lf[h] = Q8 || !ok ? make_uint4(0, 0, 0, 0)
                          : __ldcg(reinterpret_cast<const uint4*>(lo + rr * (Kp / 2) + 32 * c + 16 * (q & 1)));
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int t = 8 * j + g;
#pragma unroll
        for (int v = 0; v < 2; ++v)
          xf[j][v] = t < M ? __ldcg(reinterpret_cast<const uint4*>(x + (long long)t * ldx + 64 * c + 16 * q + 8 * v))
                           : make_uint4(0, 0, 0, 0);
      }
      chunk_mma<false>(acc, hf, lf, xf, e0x, sh);
    }
  };
  // escapes (CSR order), bias, one rounding; acc[j][i] is row rbase + 8 (i / 2) + g, token 8 j + 2 q + i % 2
  auto epilogue = [&](int rg) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = rg * R + 16 * warp + 8 * h + g;
      if (row >= N) continue;
      finish_row<Q8, NT>([&](int j, int u) -> float& { return acc[j][2 * h + u]; }, row, (uint32_t)e0r[h], ep0[h],
                         ep1[h], ec[h], ev[h], ecol, eval, x, ldx, bias, bias_kind, out, M, N, q);
    }
  };

  int rg_first = -1, rg_last = -1;  // row groups shared with other CTAs (workspace slots 0 and 1)
  int r_slot = 0;                   // the slot of the unit being read
  for (int u = ub; u < ue;) {
    const int rg = u / KC, c0 = u - rg * KC, len = min(KC - c0, ue - u);
    row_meta(rg);
    zero_acc();
    for (int k = 0; k < len; ++k) {
      asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
      __syncwarp();
      const uint32_t st = ring + r_slot * SLOT;
      if (W12_TRACE && u == ub && k == 0) stamp(trace_area, 3);  // warp 0's first unit landed
      r_slot = r_slot + 1 == STAGES ? 0 : r_slot + 1;
      uint4 hf[2], lf[2], xf[NT][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rl = 8 * h + g;
        hf[h] = lds128(st + rl * 64 + 16 * q);
        lf[h] = Q8 ? make_uint4(0, 0, 0, 0) : lds128(st + HB + rl * 32 + 16 * (q & 1));
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int t = 8 * j + g;
        const uint32_t xa = st + HB + LB + t * XP + 32 * q;
        xf[j][0] = t < M ? lds128(xa) : make_uint4(0, 0, 0, 0);
        xf[j][1] = t < M ? lds128(xa + 16) : make_uint4(0, 0, 0, 0);
      }
      // refill the slot read one unit ago (its fragments were consumed by that unit's mma)
      if (f_u < ue) {
        issue_planes();
        issue_x();
        advance();
      }
      cp_commit();
      chunk_mma<FIXED>(acc, hf, lf, xf, kk, sh);
      if (k == 0) first_escapes();
    }
    if constexpr (FIXED) {
      if (!scale_rows<NT>(acc, e0r, emin, emax)) exact_share(rg, c0, len);
    }
    if (len == KC) {
      epilogue(rg);  // the whole row group is this CTA's
    } else {
      const int slot = u == ub ? 0 : 1;
      (slot == 0 ? rg_first : rg_last) = rg;
      float* mine = ws + ((size_t)blockIdx.x * 2 + slot) * SHARE;
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) __stcg(mine + ((warp * NT + j) * 4 + v) * 32 + lane, acc[j][v]);
    }
    u += len;
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  stamp(trace_area, 4);  // warp 0's units and own-row-group epilogues done
  grid_dep_launch();
  if (rg_first < 0 && rg_last < 0) {  // uniform across the CTA
    stamp(trace_area, 5);
    return;
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) sk_arrive(counters, {rg_first, rg_last}, KC, U, P, s_last);
  __syncthreads();
  // the last of a row group's CTAs to arrive adds every share in CTA order, then runs the epilogue
  auto fix_up = [&](int rg) {
    __threadfence();
    if (threadIdx.x == 0) counters[rg] = 0;  // ready for the next launch
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[j][v] = sk_sum(ws, rg, KC, U, P, SHARE, ((warp * NT + j) * 4 + v) * 32 + lane);
    row_meta(rg);
    first_escapes();
    epilogue(rg);
  };
  if (rg_first >= 0 && s_last[0]) fix_up(rg_first);
  if (rg_last >= 0 && s_last[1]) fix_up(rg_last);
}
