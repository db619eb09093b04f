// W12 skinny GEMM for sm_90: TMA streams the weight planes into a shared-memory ring, mma.sync
// decodes them in registers. Warp-specialised: one producer warp, CW consumer warps.
//
//   out[M, N] = x[M, Kp] @ W[N, Kp]^T (+ bias), W read from the W12 planes (docs/w12-format.md),
//   fp32 accumulation, one rounding to bf16 at the end. M <= 8 * NT <= 32.
//
// Why: the register-pipelined kernel (w12_mma.cu) keeps its loads in flight in registers, which
// caps it at ~16 warps and ~50% of DRAM bandwidth on an H200 (ncu: 0.5 eligible warps per
// scheduler). Here the bytes in flight live in shared memory: a CTA owns R = 16 * MT * CW weight
// rows and a range of 64-column chunks; per chunk the producer issues one 2-D TMA copy of the hi
// plane (R x 64 bytes), one of the lo plane (R x 32 bytes; none for the 8-bit view) and one 1-D
// bulk copy of 128 bytes per token of x, all completing on the stage's "full" mbarrier. STAGES
// chunks are in flight per CTA; the consumers release a stage through its "empty" mbarrier as
// soon as they have read their fragments, after a generic -> async proxy fence: the LDS must be
// performed before the producer's next copy rewrites the stage. The LDS / arrive order alone does
// not order them: without the fence the H200 let the refill overtake the reads whenever x, hot in
// L2, landed fast and many small CTAs queued their LDS.
//
// The M bulk copies of x per stage make M = 32 ~2.5x slower than M = 1. Two alternatives:
// TmaConfig(xcp=True) copies x with cp.async from the whole producer warp, TmaConfig(xbox=True) as
// one swizzled 2-D TMA box per stage. Without the release fence above the x box gave wrong results
// in 16-45 of 400 launches queued behind another kernel on the H200 (the same race); with it, both
// are in the GPU tests (tests/w12/test_matmul_gpu.py) and in tuned configs.
//
// Fragments (same k-slot assignment as w12_mma.cu): thread (g = lane / 4, q = lane % 4) reads
// columns 16q .. 16q + 15 of a chunk for rows g and g + 8 of each of its m-tiles (one 16-byte LDS
// per row and plane) and of token g of each n-tile; A and B use the same permuted k slots, so the
// dot products are exact reorderings. Shared-memory pitches (64 B hi, 32 B lo, 144 B x) make every
// quarter-warp phase of those LDS.128 conflict-free.
//
// Consumers split the CTA's rows, not K, so there is no cross-warp reduction. Optional split-K
// across CTAs (gridDim.y) as in w12_mma.cu: fp32 partials in a workspace, the last CTA of a row
// block adds them in split order (deterministic), applies escapes and bias and stores; counters
// reset themselves for the next launch (CUDA-graph replays need no memset).
//
// Escapes: the dense decode gives 2^(e0 - 127) (8-bit view: its value of hi byte 0; w12_common.cuh's escape_dense) at an escape; the
// epilogue adds x * escape less x times that for each, in CSR order. Each thread fetches its rows' escape range
// and first escape before the main loop, so most rows (0 or 1 escape) pay one dependent load.

#include "mbarrier.cuh"  // autotune/csrc: smem_u32, mbar_init, mbar_arrive, mbar_wait
#include "w12_common.cuh"

#ifndef W12_MT
#define W12_MT 2
#endif
#ifndef W12_NT
#define W12_NT 1
#endif
#ifndef W12_CW
#define W12_CW 4
#endif
#ifndef W12_STAGES
#define W12_STAGES 6
#endif
#ifndef W12_Q8
#define W12_Q8 0
#endif
#ifndef W12_AHEAD
#define W12_AHEAD 0
#endif
#ifndef W12_WG
#define W12_WG 0
#endif
#ifndef W12_XCP
#define W12_XCP 0  // x by cp.async from the producer warp (TmaConfig.xcp)
#endif
#ifndef W12_XBOX
#define W12_XBOX 0  // x by one 2-D TMA box per stage, 128-byte swizzle (TmaConfig.xbox)
#endif
#ifndef W12_SK
#define W12_SK 0  // stream-K: a persistent grid of equal contiguous ranges of (row block, chunk) units (TmaConfig.sk)
#endif
#ifndef W12_RELFENCE
#define W12_RELFENCE 1  // the generic -> async proxy fence before each stage release; 0 only to reproduce the race
#endif
#ifndef W12_CM
#define W12_CM 0  // diagnostic (defines=): plane boxes addressed as chunk-major [Kp / 64][N][64]
#endif
#ifndef W12_WIDE
#define W12_WIDE 1  // diagnostic (with W12_NULL): boxes of 64 W columns x R / W rows, same bytes per stage
#endif
#ifndef W12_TRACE
#define W12_TRACE 0  // diagnostic (defines=, launch(trace=)): per-CTA %globaltimer stamps (split = 1 only)
#endif
#ifndef W12_POISON
#define W12_POISON 0  // diagnostic (defines=): every stage's bytes set to 0xFF (x: NaN) before the first copy
#endif
#ifndef W12_NULL
#define W12_NULL 0  // diagnostic (defines=): consumers only wait for and release each stage
#endif

namespace {

// CUtensorMap's size and alignment (cuda.h, which NVRTC cannot include): 128 opaque bytes that
// cuTensorMapEncodeTiled fills on the host (autotune.jit.tensor_map_2d)
struct alignas(128) TensorMap {
  unsigned long long opaque[16];
};

constexpr int MT = W12_MT;          // m-tiles (16 weight rows) per consumer warp
constexpr int NT = W12_NT;          // n-tiles (8 tokens)
constexpr int CW = W12_CW;          // consumer warps
constexpr int STAGES = W12_STAGES;  // chunks in flight per CTA
constexpr bool Q8 = W12_Q8 != 0;
constexpr bool AHEAD = W12_AHEAD != 0;  // consumers read stage i + 1 before computing stage i
constexpr bool WG = W12_WG != 0;        // wgmma (sm_90a) with A from registers instead of mma.sync
constexpr bool NULL_CONSUMER = W12_NULL != 0;
// x by 16-byte cp.async from all 32 producer lanes, completing on the stage's full barrier through
// cp.async.mbarrier.arrive.noinc (counted in its init): M / 4 instructions per stage, not M bulk copies
constexpr bool XCP = W12_XCP != 0;
// stream-K: gridDim.x CTAs each take an equal contiguous range of the N / R x Kp / 64 units (row block,
// chunk), crossing row blocks; a row block split between CTAs meets in the workspace (fixed order)
constexpr bool SK = W12_SK != 0;
constexpr int R = 16 * MT * CW;     // weight rows per CTA (TMA box height)
constexpr int TOKS = 8 * NT;
constexpr int HB = R * 64;          // hi bytes per stage
constexpr int LB = Q8 ? 0 : R * 32; // lo bytes per stage
#if W12_XBOX
// x by one 2-D TMA box of TOKS tokens x 128 bytes per stage (128-byte swizzle: 16-byte unit u of token
// t lands at unit u ^ (t % 8); tokens past M zero-filled by TMA) instead of per-token copies. Stage
// layout hi | x | lo, so x sits 1024-aligned (the swizzle's period). It needs the consumers' proxy
// fence like the other paths.
constexpr int XP = 128;
constexpr int XB = TOKS * XP;
constexpr int X_OFF = HB, LO_OFF = HB + XB;
__device__ __forceinline__ uint32_t x_at(int t, int b) { return X_OFF + t * 128 + ((((b >> 4) ^ t) & 7) << 4) + (b & 15); }
#else
constexpr int XP = 144;             // shared pitch of one token's 128 bytes of x (+16: no bank conflicts)
constexpr int XB = TOKS * XP;
#endif
constexpr int SB = (HB + LB + XB + 1023) / 1024 * 1024;  // stage stride (TMA destinations 1024-aligned)
static_assert(R <= 256, "a TMA box is at most 256 rows");

using Frag = Fragments<MT, NT>;  // one consumer warp's registers for one chunk
constexpr int ESC = 2 * MT;         // rows per consumer thread
// wgmma path: per warpgroup two buffers (alternating by chunk) of x in the permuted k order the A
// registers use, laid out as the canonical no-swizzle K-major B operand: per k-step s, core
// matrices of 8 tokens x 8 k (128 bytes) at s * TOKS * 32 + (token / 8) * 256 + (k / 8) * 128.
constexpr int BB = TOKS * 128;      // bytes of one chunk's permuted x
static_assert(!WG || (MT == 1 && (CW == 4 || CW == 8)), "the wgmma path takes MT = 1 and one or two warpgroups");
static_assert(!WG || !AHEAD, "the wgmma path has no look-ahead variant");
static_assert(NT == 1 || NT == 2 || NT == 4, "n-tiles: 1, 2 or 4");
static_assert(!SK || (!WG && !AHEAD && !NULL_CONSUMER), "stream-K runs the plain mma.sync consumers");
static_assert(!W12_XBOX || (!XCP && !WG), "the x box replaces the per-token and cp.async copies; no wgmma path");
static_assert(!W12_TRACE || (!SK && !WG && !AHEAD), "the trace stamps the plain path");

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void tma_2d(uint32_t dst, const TensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void bulk_1d(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

__device__ __forceinline__ uint32_t lds32(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}

__device__ __forceinline__ void sts128(uint32_t a, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// named barrier of one warpgroup (ids 1, 2; 0 is __syncthreads): immediate ids keep ptxas from
// reserving all 16 barriers
__device__ __forceinline__ void wg_bar_sync(int wg) {
  if (wg == 0)
    asm volatile("bar.sync 1, 128;" ::: "memory");
  else
    asm volatile("bar.sync 2, 128;" ::: "memory");
}

// canonical no-swizzle K-major operand descriptor: start, LBO = 128 B (next 8 k), SBO = 256 B (next 8 rows)
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(128 >> 4) << 16) | ((uint64_t)(256 >> 4) << 32);
}

// d[64 x 8 NT] += A[64 x 16] (registers: this warp's 16 rows, laid out as for mma.m16n8k16) * B[16 x 8 NT]
// (shared memory, descriptor); d holds this thread's 4 NT accumulators in mma.m16n8 order per n-tile
__device__ __forceinline__ void wgmma_rs(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t desc) {
  if constexpr (NT == 1) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  } else if constexpr (NT == 2) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, "
        "%12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
}

// W12_TRACE: slot k of this CTA's 8 stamps in ws (cta_stamp: %globaltimer ns; slot 1: the SM id)
__device__ __forceinline__ void trace(float* ws, int k) {
  if constexpr (W12_TRACE != 0) cta_stamp(reinterpret_cast<unsigned long long*>(ws), k);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(32 * (CW + 1), 1) w12_matmul_tma_kernel(
    const __grid_constant__ TensorMap tm_hi,  // uint8 [N, Kp], box 64 x R
    const __grid_constant__ TensorMap tm_lo,  // uint8 [N, Kp / 2], box 32 x R (unused for Q8)
#if W12_XBOX
    const __grid_constant__ TensorMap tm_x,   // 16-bit [M, Kp] (row stride ldx), box 64 x 8 NT, 128 B swizzle
#endif
    const __nv_bfloat16* __restrict__ x,        // [M, >= Kp], row stride ldx, 16-byte aligned rows
    long long ldx,
    W12_TAIL_PARAMS) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const uint32_t bars = base + STAGES * SB;  // full[STAGES], empty[STAGES], 8 bytes each
  uint8_t* const base_g = smem_raw + (base - raw);
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (STAGES + s); };

  const int lane = threadIdx.x & 31;
  // wgmma path: a warp index read through shfl is provably warp-uniform, so ptxas does not serialise
  // the wgmma instructions behind the producer / consumer branch
  const int warp = WG ? __shfl_sync(0xffffffffu, threadIdx.x >> 5, 0) : threadIdx.x >> 5;
  const int g = lane >> 2;
  const int q = lane & 3;
  const int r0 = blockIdx.x * R;
  const int splits = gridDim.y;
  const int per_split = (Kp / 64 + splits - 1) / splits;
  const int c_begin = blockIdx.y * per_split;
  const int nch = max(0, min(Kp / 64 - c_begin, per_split));

  if constexpr (W12_TRACE != 0) {
    if (threadIdx.x == 0) {
      trace(ws, 0);  // entry
      trace(ws, 1);
    }
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), XCP ? 1 + 32 : 1);
      mbar_init(empty(s), CW);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (W12_POISON != 0) {  // a read of a stage before its copies land shows up as NaN
    for (int i = threadIdx.x; i < STAGES * SB / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(base_g)[i] = make_uint4(~0u, ~0u, ~0u, ~0u);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic stores before the async writes
  }
#if !W12_XBOX
  // tokens past M read zeros: their x rows are never written by the copies
  for (int i = threadIdx.x; i < STAGES * (TOKS - M) * 8; i += blockDim.x) {
    const int s = i / ((TOKS - M) * 8), r = i % ((TOKS - M) * 8);
    *reinterpret_cast<uint4*>(base_g + s * SB + HB + LB + (M + r / 8) * XP + 16 * (r % 8)) = make_uint4(0, 0, 0, 0);
  }
#endif
  __syncthreads();

  float acc[MT][NT][4];
  for_acc<MT, NT>([&](int t, int j, int i) { acc[t][j][i] = 0.0f; });

  // escape ranges (and the first escape) of this thread's rows: row(e) = 16 (MT warp + e / 2) + 8 (e % 2) + g
  int ep0[ESC], ep1[ESC], ec[ESC];
  uint32_t ev[ESC];
  // the escape lists are needed only at the end: the first escape of each row is fetched early
  auto first_escapes = [&]() {
#pragma unroll
    for (int e = 0; e < ESC; ++e)
      if (ep1[e] > ep0[e]) {
        ec[e] = ecol[ep0[e]];
        ev[e] = eval[ep0[e]];
      }
  };
  // escape ranges of this thread's rows (and their window bases) for the row block at rbase
  auto row_meta = [&](int rbase, uint32_t(&e0x)[MT][2]) {
#pragma unroll
    for (int e = 0; e < ESC; ++e) {
      const int row = rbase + 16 * (MT * warp + e / 2) + 8 * (e % 2) + g;
      ep0[e] = ep1[e] = 0;
      ec[e] = 0;
      ev[e] = 0;
      if (row < N) {
        ep0[e] = rowptr[row];
        ep1[e] = rowptr[row + 1];
      }
    }
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t e = e0[min(rbase + 16 * (MT * warp + t) + 8 * h + g, N - 1)];
        e0x[t][h] = (e << 7) | (e << 23);
      }
  };
  // epilogue of the row block at rbase: escapes (CSR order), bias, one rounding. acc[t][j][i] is row
  // rbase + 16 (MT warp + t) + 8 (i / 2) + g and token 8 j + 2 q + i % 2.
  // copy this warp's fragments of stage i out of shared memory, then release the stage
  auto fetch = [&](Frag& f, int i) {
    const int s = i % STAGES;
    mbar_wait(full(s), (i / STAGES) & 1);
    const uint32_t st = base + s * SB;
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int rl = 16 * (MT * warp + t) + 8 * h + g;
        f.h[t][h] = lds128(st + rl * 64 + 16 * q);
#if W12_XBOX
        if (!Q8) f.l[t][h] = lds128(st + LO_OFF + rl * 32 + 16 * (q & 1));
#else
        if (!Q8) f.l[t][h] = lds128(st + HB + rl * 32 + 16 * (q & 1));
#endif
      }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#if W12_XBOX
      f.x[j][0] = lds128(st + x_at(8 * j + g, 32 * q));
      f.x[j][1] = lds128(st + x_at(8 * j + g, 32 * q + 16));
#else
      f.x[j][0] = lds128(st + HB + LB + (8 * j + g) * XP + 32 * q);
      f.x[j][1] = lds128(st + HB + LB + (8 * j + g) * XP + 32 * q + 16);
#endif
    }
    // the LDS above (generic proxy) must be performed before the producer's next TMA / bulk copy
    // (async proxy) rewrites this stage: without this fence the H200 let the refill overtake the reads
    // (wrong in 150 of 150 launches at M = 16 with 16- and 32-row CTAs)
    if constexpr (W12_RELFENCE != 0) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane == 0) mbar_arrive(empty(s));
  };
  // a barrier of the consumer warps only (stream-K: the producer runs ahead into the next row block)
  auto consumer_sync = [&]() { asm volatile("bar.sync 1, %0;" ::"n"(32 * CW) : "memory"); };
  auto epilogue = [&](int rbase) {
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int e = 2 * t + h;
        const int row = rbase + 16 * (MT * warp + t) + 8 * h + g;
        if (row >= N) continue;
        finish_row<Q8, NT>([&](int j, int u) -> float& { return acc[t][j][2 * h + u]; }, row,
                           ep1[e] > ep0[e] ? (uint32_t)e0[row] : 0u, ep0[e], ep1[e], ec[e], ev[e], ecol, eval, x, ldx,
                           bias, bias_kind, out, M, N, q);
      }
  };

  if (warp == CW) {
    // producer: lane 0 arms the stage and copies the planes, lanes < M copy their token's x. The
    // planes of the first STAGES chunks go out before waiting for the previous kernel (x may be its
    // output; the weights are not), so under programmatic dependent launch they stream in while it
    // finishes.
    auto plane_copies = [&](uint32_t st, int c, uint32_t bar) {
      constexpr int W = W12_WIDE;
      const int cx = W12_CM ? 0 : 64 * W * (c / W), cy = W12_CM ? c * N + r0 : r0 + (c % W) * (R / W);
      tma_2d(st, &tm_hi, cx, cy, bar);
#if W12_XBOX
      if (!Q8) tma_2d(st + LO_OFF, &tm_lo, cx / 2, cy, bar);
#else
      if (!Q8) tma_2d(st + HB, &tm_lo, cx / 2, cy, bar);
#endif
    };
    // x's share of ring stage s, which holds chunk c: one 2-D box (xbox), cp.async from every lane (xcp),
    // or one bulk copy per token from lanes < M; each completes on the stage's full barrier
    auto x_copies = [&](uint32_t st, int c, int s) {
#if W12_XBOX
      if (lane == 0) tma_2d(st + X_OFF, &tm_x, 64 * c, 0, full(s));
#else
      if constexpr (XCP) {
        for (int p = lane; p < 8 * M; p += 32) {
          const int t = p >> 3, u = p & 7;
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(st + HB + LB + t * XP + 16 * u),
                       "l"(x + (long long)t * ldx + 64 * c + 8 * u) : "memory");
        }
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full(s)) : "memory");
      } else if (lane < M) {
        bulk_1d(st + HB + LB + lane * XP, x + (long long)lane * ldx + 64 * c, 128, full(s));
      }
#endif
    };
    if constexpr (SK) {
      // the CTA's units u in [ub, ue): row block u / nch_all, chunk u % nch_all; the ring index runs on
      // across row blocks, so the next block's planes stream in while the consumers finish this one
      const int nch_all = Kp / 64;
      const long long U = (long long)((N + R - 1) / R) * nch_all;
      const int ub = (int)(blockIdx.x * U / gridDim.x), ue = (int)((blockIdx.x + 1) * U / gridDim.x);
      const int n = ue - ub;
      auto issue = [&](int i) {
        const int s = i % STAGES, u = ub + i, rb = u / nch_all, c = u - rb * nch_all;
        const uint32_t st = base + s * SB;
        if (lane == 0) {
          mbar_expect_tx(full(s), HB + LB + (W12_XBOX ? XB : XCP ? 0u : 128u * M));
          tma_2d(st, &tm_hi, 64 * c, rb * R, full(s));
#if W12_XBOX
          if (!Q8) tma_2d(st + LO_OFF, &tm_lo, 32 * c, rb * R, full(s));
#else
          if (!Q8) tma_2d(st + HB, &tm_lo, 32 * c, rb * R, full(s));
#endif
        }
        return c;
      };
      const int pre = min(n, STAGES);
      for (int i = 0; i < pre; ++i) issue(i);
      grid_dep_wait();
      __syncwarp();
      for (int i = 0; i < n; ++i) {
        const int s = i % STAGES;
        const uint32_t st = base + s * SB;
        int c = (ub + i) % nch_all;
        if (i >= pre) {
          mbar_wait(empty(s), ((i / STAGES) & 1) ^ 1);
          c = issue(i);
          __syncwarp();
        }
        x_copies(st, c, s);
      }
      grid_dep_launch();
      return;
    }
    const int pre = min(nch, STAGES);
    if (lane == 0) {
      for (int i = 0; i < pre; ++i) {
        mbar_expect_tx(full(i), HB + LB + (W12_XBOX ? XB : XCP ? 0u : 128u * M));
        plane_copies(base + i * SB, c_begin + i, full(i));
      }
    }
    grid_dep_wait();
    __syncwarp();
    for (int i = 0; i < nch; ++i) {
      const int s = i % STAGES;
      const int c = c_begin + i;
      const uint32_t st = base + s * SB;
      if (i >= pre) {
        mbar_wait(empty(s), ((i / STAGES) & 1) ^ 1);
        if (lane == 0) {
          mbar_expect_tx(full(s), HB + LB + (W12_XBOX ? XB : XCP ? 0u : 128u * M));
          plane_copies(st, c, full(s));
        }
        __syncwarp();
      }
      x_copies(st, c, s);  // x may be the previous kernel's: after the wait
    }
    if constexpr (W12_TRACE != 0) {
      if (lane == 0) trace(ws, 6);  // every copy issued
    }
    grid_dep_launch();  // every copy is issued: the next kernel's CTAs may start
  } else if constexpr (SK) {
    const int nch_all = Kp / 64;
    const long long U = (long long)((N + R - 1) / R) * nch_all;
    const int P = gridDim.x;
    const int ub = (int)(blockIdx.x * U / P), ue = (int)((blockIdx.x + 1) * U / P);
    const int sh = (q >> 1) * 4;
    __shared__ int sk_last[2];
    grid_dep_wait();  // the workspace, the counters, x and out may be the previous kernel's
    // Only the first and the last row block of a CTA's range can be shared with other CTAs. Their
    // sums go to workspace slots 0 / 1 as they finish, without waiting; the fences, the arrival
    // counters and the fix-ups run once, after the last unit, so the ring never stalls mid-range.
    int rb_first = -1, rb_last = -1;  // the shared row blocks (workspace slots 0 and 1), -1: none
    int i = 0;  // ring index, continuous across row blocks
    for (int u = ub; u < ue;) {
      const int rb = u / nch_all, c0 = u - rb * nch_all, len = min(nch_all - c0, ue - u);
      uint32_t e0x[MT][2];
      row_meta(rb * R, e0x);
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int k = 0; k < 4; ++k) acc[t][j][k] = 0.0f;
      for (int k = 0; k < len; ++k, ++i) {
        Frag f;
        fetch(f, i);
        mma_chunk<Q8>(acc, f, e0x, sh);
        if (k == 0) first_escapes();
      }
      if (len == nch_all) {
        epilogue(rb * R);  // the whole row block is this CTA's
      } else {
        const int slot = u == ub ? 0 : 1;
        (slot == 0 ? rb_first : rb_last) = rb;
        float* mine = ws + ((size_t)blockIdx.x * 2 + slot) * (R * TOKS);
#pragma unroll
        for (int t = 0; t < MT; ++t)
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int k = 0; k < 4; ++k) __stcg(mine + (((warp * MT + t) * NT + j) * 4 + k) * 32 + lane, acc[t][j][k]);
      }
      u += len;
    }
    if (rb_first < 0 && rb_last < 0) return;  // uniform across the consumer warps
    __threadfence();
    consumer_sync();
    if (threadIdx.x == 0) sk_arrive(counters, {rb_first, rb_last}, nch_all, U, P, sk_last);
    consumer_sync();
    // the last of a row block's CTAs to arrive adds every share in CTA order, then runs the epilogue
    auto fix_up = [&](int rb) {
      __threadfence();
      if (threadIdx.x == 0) counters[rb] = 0;  // ready for the next launch (graph replays)
      for_acc<MT, NT>([&](int t, int j, int k) {
        acc[t][j][k] = sk_sum(ws, rb, nch_all, U, P, R * TOKS, (((warp * MT + t) * NT + j) * 4 + k) * 32 + lane);
      });
      uint32_t e0x[MT][2];
      row_meta(rb * R, e0x);
      first_escapes();
      epilogue(rb * R);
    };
    if (rb_first >= 0 && sk_last[0]) fix_up(rb_first);
    if (rb_last >= 0 && sk_last[1]) fix_up(rb_last);
    return;
  } else {
    uint32_t e0x[MT][2];
    row_meta(r0, e0x);
    const int sh = (q >> 1) * 4;  // columns 32..63 of a chunk sit in the high nibbles
    auto compute = [&](const Frag& f) { mma_chunk<Q8>(acc, f, e0x, sh); };
    if constexpr (NULL_CONSUMER) {  // the ring's streaming rate alone: outputs are garbage
      for (int i = 0; i < nch; ++i) {
        mbar_wait(full(i % STAGES), (i / STAGES) & 1);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(i % STAGES));
      }
    } else if constexpr (WG) {
      // wgmma: the warpgroup's 128 threads copy x into the permuted K-major layout, then each
      // k-step is one m64 x n(8 NT) x k16 wgmma with this warp's decoded rows as A
      const int wg = warp >> 2;
      const int wt = threadIdx.x - 128 * wg;
      const uint32_t wbase = base + STAGES * SB + 1024;
      for (int i = 0; i < nch; ++i) {
        const int s = i % STAGES;
        mbar_wait(full(s), (i / STAGES) & 1);
        const uint32_t st = base + s * SB;
        uint4 fh[2], fl[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int rl = 16 * warp + 8 * h + g;
          fh[h] = lds128(st + rl * 64 + 16 * q);
          if (!Q8) fl[h] = lds128(st + HB + rl * 32 + 16 * (q & 1));
        }
        const uint32_t bbuf = wbase + (2 * wg + (i & 1)) * BB;
        for (int pc = wt; pc < TOKS * 8; pc += 128) {
          const int off = 16 * pc;
          const int ks = off / (TOKS * 32), rem = off % (TOKS * 32);
          const int tok = (rem / 256) * 8 + (rem % 128) / 16, ph = (rem % 256) / 128;
          const uint32_t src = st + HB + LB + tok * XP + 8 * ks + 4 * ph;  // k slots 8 ph .. 8 ph + 7 of step ks
          sts128(bbuf + off, make_uint4(lds32(src), lds32(src + 32), lds32(src + 64), lds32(src + 96)));
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic stores -> wgmma's reads
        wg_bar_sync(wg);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(s));
        // the accumulators stay in place while wgmma owns them (no compiler copies across the async span)
        auto pin_acc = [&]() {
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[0][j][e])::"memory");
        };
        // decode all four k-steps first, so one fence covers the A registers of the four wgmmas
        uint32_t a[4][4];
#pragma unroll
        for (int k = 0; k < 4; ++k) decode_a<Q8>(a[k], fh, fl, e0x[0], k, sh);
        pin_acc();
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int k = 0; k < 4; ++k)
          wgmma_rs(&acc[0][0][0], a[k][0], a[k][1], a[k][2], a[k][3], wg_desc(bbuf + k * TOKS * 32));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        pin_acc();
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        pin_acc();
        if (i == 0) first_escapes();
      }
    } else if constexpr (!AHEAD) {
      for (int i = 0; i < nch; ++i) {
        Frag f;
        fetch(f, i);
        if constexpr (W12_TRACE != 0) {
          if (threadIdx.x == 0 && (i == 0 || i == nch - 1)) trace(ws, i == 0 ? 2 : 3);  // first / last stage in
        }
        compute(f);
        if (i == 0) first_escapes();
      }
      if constexpr (W12_TRACE != 0) {
        if (threadIdx.x == 0) trace(ws, 4);  // main loop done
      }
    } else {
      // look-ahead: stage i + 1's fragments are read (and its wait paid) before stage i is computed
      Frag f[2];
      if (nch > 0) fetch(f[0], 0);
      first_escapes();
      for (int i = 0; i < nch; i += 2) {
        if (i + 1 < nch) fetch(f[1], i + 1);
        compute(f[0]);
        if (i + 1 < nch) {
          if (i + 2 < nch) fetch(f[0], i + 2);
          compute(f[1]);
        }
      }
    }
  }

  // the workspace, the counters, x (escapes) and out may be the previous kernel's: wait for it
  grid_dep_wait();
  if (splits > 1) {
    // publish this split's partials (fragment order, coalesced); the last CTA of the row block
    // adds all of them in split order and runs the epilogue
    float* mine = ws + ((size_t)blockIdx.x * splits + blockIdx.y) * (R * TOKS);
    if (warp < CW) {
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) __stcg(mine + (((warp * MT + t) * NT + j) * 4 + i) * 32 + lane, acc[t][j][i]);
    }
    // last_to_arrive (w12_common.cuh) written out: through the helper ptxas schedules this kernel
    // differently (16 fewer SASS instructions at TmaConfig(1, 8, 6)), a build not yet measured on a GPU
    __threadfence();
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) last = atomicAdd(counters + blockIdx.x, 1) == splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // ready for the next launch (graph replays)
    if (warp < CW) {
      const float* all = ws + (size_t)blockIdx.x * splits * (R * TOKS);
      for_acc<MT, NT>([&](int t, int j, int i) {
        const int o = (((warp * MT + t) * NT + j) * 4 + i) * 32 + lane;
        float sum = 0.0f;
        for (int s2 = 0; s2 < splits; ++s2) sum += __ldcg(all + (size_t)s2 * (R * TOKS) + o);
        acc[t][j][i] = sum;
      });
    }
  }
  if (warp == CW) return;
  if (splits > 1 && nch == 0) first_escapes();  // this CTA computed nothing: nothing was prefetched

  epilogue(r0);
  if constexpr (W12_TRACE != 0) {
    __syncwarp();
    if (threadIdx.x == 0) trace(ws, 5);  // warp 0's epilogue done
  }
}
