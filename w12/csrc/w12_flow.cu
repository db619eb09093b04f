// W12 weight-streaming GEMM for M = 1..32 tokens on the runtime layout (w12/layout.py; mma.sync m16n8k16 and
// cp.async: sm_80+).
//
//   out[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 accumulation, one rounding to bf16 at the end (W12F_OUT32 = 1:
//   out is fp32 and takes the sums unrounded, for w12.matmul_tiled's fp16-x path, w12/ops.py).
//
// Work split (docs/w12-kernels.md, "The flow kernel"). A row block is 16 weight rows (the last may have fewer); a
// row group is RB consecutive row blocks (W12F_RB, 1 or 2), which one warp multiplies by the same x fragments, so
// that at 2 one x read feeds 32 weight rows. A CTA of WARPS warps owns RW = WARPS / KW consecutive row groups; the
// KW warps of a row group split its K: warp ks takes the full 64-column groups [ks KF / KW, (ks + 1) KF / KW) and,
// for ks = KW - 1, the masked last group. Every warp streams its tiles, contiguous in the layout (one stream per
// row block), through its own cp.async ring of STAGES slots of RB tiles (16-byte copies, evict-first L2 policy): no
// barrier between warps in the main loop. The KW partial sums of a row block meet in shared memory and are added in
// warp order (deterministic), then one warp per row group applies the escapes, the bias and the rounding. Each row
// block's sum is the same sequence of operations whatever RB is, so RB = 2 gives RB = 1's result bit for bit.
//
// K split across CTAs (W12F_KC > 1; sm_90 thread-block clusters, exact base only). The KC CTAs of a cluster own the
// same row groups and split their K into KC x KW ranges: piece q = kc KW + ks of CTA rank kc and warp ks. Each CTA
// adds its KW shares as above; the CTAs of ranks 1 .. KC - 1 then store their sums into rank 0's shared memory
// (distributed shared memory), and after one cluster barrier rank 0 adds them in rank order (deterministic) and
// finishes the rows. This is for layers whose row blocks do not spread evenly over the SMs (5120 rows: 320 row
// blocks on 132 SMs), where smaller CTAs of equal work balance the bytes each SM streams.
// With W12F_KG = 1 (any sm_80+ GPU) the KC CTAs are not a cluster: each stores its sums into a global workspace
// (`ws`: one slot per CTA), counts itself in its row groups' counter (`cnt`: one int per KC CTAs, zero between
// launches) and the CTA that counts last adds the KC slots in rank order, its own from registers (the cluster
// build's operations in its order: the same bits whichever CTA is last), finishes the rows and sets the counter back
// to zero. The hardware places these CTAs freely, where the cluster scheduler leaves SMs empty
// (docs/w12-kernels.md). The next kernel is let launch only when every CTA has left (its epilogue then cannot race
// the next launch's use of the workspace).
//
// Decode (FIXED = 1; the probe's V1). A lane (g = lane / 4, p = lane % 4) holds, per tile, rows g and g + 8:
// hi bytes of columns 16 p .. 16 p + 15 (one LDS.128 per row) and their lo nibbles (one LDS.64 per row, byte j =
// column j | column j + 8). Per bf16 pair of k-step s: y = prmt(hi word s, lo word, 0x1504 or 0x3726) puts
// `hi << 8 | lo byte` in each lane and
//   w' = (y & 0x800F800F) | ((y >> 4) & 0x07F007F0) | C,   C = 0x38003800 (exponent base 112)
// (1 PRMT + 1 SHF + 2 LOP3; the lo byte's other nibble falls outside both masks). For e0 >= 1 every code decodes
// to w' = 2^(112 - e0) w exactly (code 0 to 2^-15, i.e. w = 2^(e0 - 127), which the escape correction removes), so
// a row's partial sum is scaled once by 2^(e0 - 112) in the epilogue; rows with e0 = 0 decode with C = 0 (exact,
// scale 1). The scale is exact when every intermediate is zero or normal in both domains; with Kp <= 2^18,
// |w'| in [2^-15, 2) and Emin, Emax the exponent fields of the smallest non-zero and the largest |x| the CTA
// reads, that holds when Emin >= 64 - min(s, 0) and Emax + max(s, 0) <= 230, s = e0 - 112 (docs/w12-kernels.md).
// The active warps that read the same K range fold that range while they load x, each every RA-th unit (RA: the
// CTA's active row blocks; no warp of the CTA carries more of it than the others, and the CTA ends with its slowest
// warp); a warp whose rows fail the condition recomputes its share with the exact base from global memory, which is
// the FIXED = 0 build's result bit for bit.
//
// The 8-bit view (W12F_Q8 = 1, exact base only): the product with w12.decode_q8's weight, the midpoint of each hi
// byte's 16-value bin. Each tile's hi bytes alone are copied (two of the three 16-byte pieces: 1024 of its 1536
// bytes) and decoded by dec_pair_q8 (w12_common.cuh) with the row's q8_base constant; an escape's hi byte is 0,
// which reads as escape_dense<true>(e0), so its correction adds x * escape less x times that, as for the full format.
//
// The warpgroup build (W12F_WG = 1; wgmma, sm_90a, exact base, one row block per warp). Four consecutive warps form
// a warpgroup that owns 64 consecutive rows (4 row blocks, one per warp) and one K piece: warp (group gi, member wi)
// takes row block rw = (gi / KW) 4 + wi and K piece ks = gi % KW. Each warp streams and decodes its own tiles as
// above (its registers are wgmma's A fragments of rows 16 wi .. 16 wi + 15, the layout mma.sync's A has), and the
// warpgroup multiplies all 64 rows by x with one wgmma.m64n(8 NT)k16 per k-step, x being the B operand in shared
// memory (5-8 n-tiles, 33-64 tokens, this build only: two, n32 on token groups 0-3 and n(8 NT - 32) on groups
// 4..). So one x read feeds 64 weight rows instead of 16. x comes in per warpgroup and unit into one of
// W12F_WG_DEPTH + 1 slots, taken in turn: each thread loads its share of the unit's x into registers a unit ahead
// (16 contiguous bytes or so) and stores it as 4-byte words that put each k-step's x in the A fragments' k order
// (k-step s, mma k = 2 p + 8 h + e is column 16 p + 4 s + 2 h + e of the unit) as core matrices of 8 tokens x 8 k
// (16 bytes per token), no swizzle, K-major: byte 256 NT s + 128 NT h + 128 (n / 8) + 16 (n % 8) + 4 p of a slot.
// The descriptor's leading byte offset (between the two k halves) is 128 NT and its stride byte offset (between
// token groups of 8) is 128 (checked on the H200; W12F_WG_SWAP = 1 swaps the two). Per unit: the stores, the weight
// copies landed (cp.async.wait_group), a proxy fence, a barrier of the warpgroup's 128 threads, the refill of the
// weight slot the previous unit used, then the decode and four wgmma; with W12F_WG_DEPTH = 2 (the default) they
// are waited for after the next unit's are issued (the decode of unit c + 1 overlaps the wgmma of unit c; A
// registers alternate between two sets; 3 x slots), with 1 before the next unit (2 slots; the launcher sizes shared
// memory for 3). The masked tail is a unit of the loop (its x staged like the others, its weight fragments
// assembled from global memory). W12F_WG_STM = 1 stages x through stmatrix instead (warp w of the warpgroup stores
// n-tile w's 8 core matrices with two stmatrix.x4, the same bytes; store_xs below). Timing-only ablations (wrong
// results, perf/w12_ladder.py --wg-probe --ablate): W12F_WG_FENCE=0, W12F_WG_BAR=0, W12F_WG_XCOPY=0 (x staged for
// the first unit only).
//
// Features, each behind a define so that one device call can time the ladder (perf/w12_ladder.py):
//   W12F_X    (b) x as mma.sync's B operand (0: the probe's constant B; no x is read)
//   W12F_EPI  (c) the per-row epilogue: the scale (and its guard), bias, one rounding, the store
//   W12F_ESC  (d) the escapes (CSR order, as w12_common.cuh's finish_row: + x * escape - x * 2^(e0 - 127))
//   W12F_RED  (e) the K-split reduction across the KW warps of a row block (0: warp ks = 0 stores its own share,
//                 which is the whole product only for KW = 1)
// Steps without W12F_EPI write nothing but a never-taken store to `sink`, which keeps the work alive.
// W12F_TRACE = 1 (diagnostic, perf/w12_ladder.py --trace): `sink` is 8 u64 per CTA, zeroed before the launch, that
// thread 0 and the warps fill: 0 entry, 1 the SM id, 2 after griddepcontrol.wait, 3 warp 0's first tile landed,
// 4 the last warp's main loop done (atomicMax), 5 the last warp's exit (atomicMax); %globaltimer nanoseconds.
// One ablation exists for timing only (perf/w12_ladder.py --ablate), with wrong results:
//   W12F_XSTEP=0  every unit reads the first unit's x (x always in L1), to price the x traffic

#include "w12_common.cuh"

#ifndef W12F_WARPS
#define W12F_WARPS 8
#endif
#ifndef W12F_KW
#define W12F_KW 2  // warps splitting K per row block
#endif
#ifndef W12F_STAGES
#define W12F_STAGES 4
#endif
#ifndef W12F_CPS
#define W12F_CPS 2  // CTAs per SM the launch bound is set for
#endif
#ifndef W12F_NT
#define W12F_NT 1  // n-tiles of 8 tokens: 1..4
#endif
#ifndef W12F_FIXED
#define W12F_FIXED 1
#endif
#ifndef W12F_EVICT
#define W12F_EVICT 1  // evict-first L2 policy on the weight copies
#endif
#ifndef W12F_X
#define W12F_X 1
#endif
#ifndef W12F_EPI
#define W12F_EPI 1
#endif
#ifndef W12F_ESC
#define W12F_ESC 1
#endif
#ifndef W12F_RED
#define W12F_RED 1
#endif
#ifndef W12F_XSTEP
#define W12F_XSTEP 1
#endif
#ifndef W12F_XD
#define W12F_XD 0  // the mma.sync build's x: 0 one set copied each unit, 1 or 2 sets loaded that many units ahead
#endif
#ifndef W12F_XH
#define W12F_XH 0  // the mma.sync build's x in one set, each half reloaded for the next unit after its k-steps
#endif
#ifndef W12F_XRING
#define W12F_XRING 0  // the mma.sync build's x through a shared ring per K piece, copied by the warps that read it
#endif
#ifndef W12F_RB
#define W12F_RB 1  // row blocks per warp (one x fragment feeds RB weight tiles)
#endif
#ifndef W12F_KC
#define W12F_KC 1  // CTAs of a cluster splitting K (sm_90)
#endif
#ifndef W12F_KG
#define W12F_KG 0  // the KC CTAs splitting K meet in a global workspace instead of a cluster's shared memory
#endif
#ifndef W12F_Q8
#define W12F_Q8 0  // the 8-bit view: hi bytes only
#endif
#ifndef W12F_OUT32
#define W12F_OUT32 0  // out as fp32, the sums unrounded (w12.matmul_tiled's fp16-x path adds two such products)
#endif
#if W12F_OUT32
typedef float w12f_out_t;
#else
typedef __nv_bfloat16 w12f_out_t;
#endif
#ifndef W12F_SWIGLU
// the output is SwiGLU's (N / 2 columns): rows 16 b + r and 16 b + 8 + r hold gate and up row 8 b + r
// (w12.pair_rows), both finished (escapes, bias, one rounding to bf16), then out[t, 8 b + r] = bf16(s u) with
// s = bf16(g sigmoid(g)), as the engine's fused glue computes it from bf16 gate and up; N % 16 == 0, bf16 out
#define W12F_SWIGLU 0
#endif
#if W12F_SWIGLU && W12F_OUT32
#error "W12F_SWIGLU writes bf16: it does not build with W12F_OUT32"
#endif
#ifndef W12F_WG
#define W12F_WG 0  // the warpgroup build: wgmma over 64 rows, x from shared memory (sm_90a)
#endif
#ifndef W12F_WG_FENCE
#define W12F_WG_FENCE 1  // timing only at 0 (wrong results): the warpgroup build without its proxy fence
#endif
#ifndef W12F_WG_BAR
#define W12F_WG_BAR 1  // timing only at 0 (wrong results): without its barrier per unit
#endif
#ifndef W12F_WG_XCOPY
#define W12F_WG_XCOPY 1  // timing only at 0 (wrong results): x copied for the first units only
#endif
#ifndef W12F_WG_DEPTH
#define W12F_WG_DEPTH 2  // wgmma groups in flight per warpgroup: 1 (each unit waited for) or 2 (one unit's decode
                         // overlaps the previous unit's wgmma)
#endif
#ifndef W12F_WG_STM
#define W12F_WG_STM 0  // the warpgroup build's x through stmatrix: warp w of a warpgroup stages n-tile w
#endif
#ifndef W12F_LATE
#define W12F_LATE 0  // the decode constants and the escapes' dependent loads after the first tile copies
#endif
#ifndef W12F_WG_SWAP
#define W12F_WG_SWAP 0  // the warpgroup build's descriptor with its two byte offsets swapped
#endif
#ifndef W12F_FULL
#define W12F_FULL 0  // N % 16 == 0 (the launcher's choice): every row block holds 16 rows, the copies' offsets fixed
#endif
#ifndef W12F_ESCX
#define W12F_ESCX 0  // x at each finished row's first escape column copied into shared memory before the main loop
#endif
#ifndef W12F_TRACE
#define W12F_TRACE 0  // diagnostic (w12.flow.launch_tiled(trace=)): per-CTA %globaltimer stamps into `sink`
#endif

namespace {

constexpr int WARPS = W12F_WARPS;
constexpr int KW = W12F_KW;
constexpr int RW = WARPS / KW;  // row groups per CTA
constexpr int RB = W12F_RB;     // row blocks per row group
constexpr int KC = W12F_KC;     // CTAs splitting K (one cluster, or with KG through global memory)
constexpr bool KG = W12F_KG != 0 && KC > 1;
constexpr bool CLUSTER = KC > 1 && !KG;
constexpr int STAGES = W12F_STAGES;
constexpr int NT = W12F_NT;
constexpr bool FIXED = W12F_FIXED != 0;
constexpr bool Q8 = W12F_Q8 != 0;
constexpr bool FULL = W12F_FULL != 0;
constexpr bool XB = W12F_X != 0;
constexpr bool EPI = W12F_EPI != 0;
constexpr bool ESC = W12F_ESC != 0;
constexpr bool RED = W12F_RED != 0 && KW > 1;
constexpr bool GUARD = EPI && FIXED;  // the x range and the exact-base recomputation
constexpr bool WG = W12F_WG != 0;
constexpr int XD = WG ? 0 : W12F_XD;  // x sets loaded ahead in the mma.sync build (0: one, copied each unit)
// one x set whose halves (k-steps 0-1, 2-3) are reloaded with the next unit's as soon as this unit's mma on them are
// issued: half the registers of two sets, each load with about half a unit to land
constexpr bool XH = !WG && W12F_X != 0 && W12F_XH != 0;  // (ladder step a reads no x: nothing to reload)
// x through a shared ring: the warps of one K piece copy each unit's x (cp.async, in the commit group of their
// weight tiles, STAGES - 1 units ahead) into that piece's ring of STAGES slots, meet at a named barrier per unit and
// read their fragments from the slot (docs/w12-kernels.md, "x through a shared ring")
constexpr bool XS = !WG && W12F_X != 0 && W12F_XRING != 0;
constexpr int XSSLOT = XS ? NT * 1024 : 0;  // one unit of x: 8 NT tokens x 64 columns, in the lanes' read order
constexpr int KSTEP = WG ? 4 : 1;     // warp distance between the K pieces of one row block
constexpr int XSLOT = WG ? NT * 1024 : 0;  // one unit of x in the warpgroup's ring: 8 NT tokens x 64 columns
constexpr int XSLOTS = W12F_WG_DEPTH + 1;   // x slots per warpgroup: a unit's stays read until DEPTH units later
constexpr bool STM = WG && W12F_WG_STM != 0;
// the escape metadata is read before the main loop: kept in registers for 1-2 n-tiles, parked in shared memory
// (the stash after the ring and the reduction slots) for 3-4, where registers through the loop would spill
constexpr bool ESC_STASH = ESC && NT > 2;
// x at the first escape column of each row a lane finishes, for the lane's 2 NT tokens: copied into shared memory
// (4-byte cp.async of the column pair) right after the wait for the previous kernel, so that the epilogue's first
// escape reads shared memory instead of waiting for a global load at the end of the warp
constexpr bool ESCX = ESC && W12F_ESCX != 0;
constexpr int TILE = 1536;            // one 16 x 64 tile image in the ring
constexpr uint32_t BASE112 = 0x38003800u;
static_assert(WARPS >= 1 && WARPS <= 16 && KW >= 1 && WARPS % KW == 0, "KW must divide WARPS (<= 16)");
static_assert(STAGES >= 2, "a ring needs two slots");
static_assert(NT >= 1 && NT <= (WG ? 8 : 4), "n-tiles: 1..4, 5..8 in the warpgroup build");
static_assert(NT <= 4 || (!STM && W12F_WG_SWAP == 0),
              "5..8 n-tiles: x staged by store_xw, the descriptor's offsets as checked on the H200");
static_assert(RB == 1 || RB == 2, "row blocks per warp: 1 or 2");
static_assert(RB == 1 || !FIXED, "two row blocks per warp: exact base only (the guard's recomputation is per block)");
static_assert((!EPI || XB) && (!ESC || EPI) && (W12F_RED == 0 || EPI), "features build on each other: X, EPI, ESC, RED");
static_assert(KC >= 1 && KC <= (W12F_KG ? 8 : 4), "CTAs splitting K: 1 to 4 in a cluster, 1 to 8 through memory");
static_assert(!Q8 || !FIXED, "the 8-bit view: exact base only");
static_assert(KC == 1 || (!FIXED && EPI && W12F_RED != 0),
              "a K split across CTAs: exact base, with the epilogue and the reduction");
static_assert(W12F_XD >= 0 && W12F_XD <= 2, "x loaded 0 to 2 units ahead");
static_assert(!XH || XD == 0, "x reloaded by halves: the mma.sync build with one x set");
static_assert(!XS || KW <= 15, "x through a shared ring: one named barrier (1 + K piece) per K piece");
static_assert(!XS || (XD == 0 && !XH && !FIXED && W12F_XSTEP != 0),
              "x through a shared ring: the mma.sync build's one x set, exact base");
static_assert(W12F_WG_DEPTH == 1 || W12F_WG_DEPTH == 2, "wgmma groups in flight: 1 or 2");
static_assert(!STM || W12F_WG_XCOPY != 0, "x through stmatrix: the timing-only x-copy ablation is not built for it");
static_assert(!WG || (!FIXED && RB == 1 && XB && WARPS % (4 * KW) == 0),
              "the warpgroup build: exact base, one row block per warp, x, and warpgroups of 4 warps per K piece");
#if W12F_KC > 1 && !W12F_KG && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 900)
#error "W12F_KC > 1 needs thread-block clusters (sm_90)"
#endif
#if W12F_WG && defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "W12F_WG needs wgmma (sm_90a)"
#endif

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t p = 0;
  if constexpr (W12F_EVICT != 0) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}

// 16 bytes global -> shared; src_bytes = 0 fills zeros (rows past the block) and reads nothing
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes, uint64_t pol) {
  if constexpr (W12F_EVICT != 0)
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(dst), "l"(src),
                 "r"(src_bytes), "l"(pol) : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ uint2 lds64(uint32_t a) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a));
  return v;
}

__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) {  // (a & b) | c
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// One tile's fragments of a lane: hi bytes of rows g, g + 8 (16 columns each) and their lo bytes
struct Frag {
  uint4 h[2];
  uint2 l[2];
};

// k-step s (0..3) of the tile into the A registers: fixed base (k: C per row) or exact base (k: e0 in both lanes)
template <bool FIX>
__device__ __forceinline__ void decode_step(uint32_t (&a)[4], const Frag& f, const uint32_t (&k)[2], int s) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint32_t hw = word(f.h[r], s);
    if constexpr (Q8) {  // the hi byte in bits 0..7 of each lane, no nibble
      a[r] = dec_pair_q8(__byte_perm(hw, 0u, 0x4140), k[r]);
      a[r + 2] = dec_pair_q8(__byte_perm(hw, 0u, 0x4342), k[r]);
      continue;
    }
    // k-steps 2 and 3 read the high nibbles of the lo bytes, in place on the exact base (dec_pair_hi)
    const uint32_t lw = ((s & 1) ? f.l[r].y : f.l[r].x) >> (s >= 2 && FIX ? 4 : 0);
    const uint32_t y0 = __byte_perm(hw, lw, 0x1504), y1 = __byte_perm(hw, lw, 0x3726);
    if constexpr (FIX) {
      a[r] = lop3_and_or(y0, 0x800F800Fu, lop3_and_or(y0 >> 4, 0x07F007F0u, k[r]));
      a[r + 2] = lop3_and_or(y1, 0x800F800Fu, lop3_and_or(y1 >> 4, 0x07F007F0u, k[r]));
    } else if (s >= 2) {
      a[r] = dec_pair_hi(y0, k[r]);
      a[r + 2] = dec_pair_hi(y1, k[r]);
    } else {
      a[r] = dec_pair(y0, k[r]);
      a[r + 2] = dec_pair(y1, k[r]);
    }
  }
}

// acc[j] += A(tile) B(n-tile j) over the 4 k-steps; x[j][v]: token 8 j + g, columns 16 p + 8 v .. + 7 of the tile.
// `done(v)` runs once the mma of both k-steps that read x[.][v] are issued (v = 0 after k-step 1, 1 after k-step 3)
struct NoHook {
  __device__ __forceinline__ void operator()(int) const {}
};
template <bool FIX, class Done = NoHook>
__device__ __forceinline__ void tile_mma(float (&acc)[NT][4], const Frag& f, const uint4 (&x)[NT][2],
                                         const uint32_t (&k)[2], Done done = Done()) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    uint32_t a[4];
    decode_step<FIX>(a, f, k, s);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const uint4& xv = x[j][s >> 1];
      mma_bf16(acc[j], a[0], a[1], a[2], a[3], (s & 1) ? xv.z : xv.x, (s & 1) ? xv.w : xv.y);
    }
    if (s & 1) done(s >> 1);
  }
}



// d[64 rows x 8 NT tokens] += A(registers, this warp's 16 rows) B(descriptor), one k-step
#if W12F_WG
template <int NT_>
__device__ __forceinline__ void wgmma_step(float (&d)[NT_][4], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (NT_ == 1) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, "
                 "0;\n}"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  } else if constexpr (NT_ == 2) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, "
                 "{%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
                   "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  } else if constexpr (NT_ == 3) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, "
                 "%10, %11}, {%12, %13, %14, %15}, %16, p, 1, 1, 0;\n}"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
                   "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
                   "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, "
                 "%10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
                   "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
                   "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
                   "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  }
}

// registers an asynchronous wgmma reads (A) or writes (the accumulators): an empty asm that reads and writes them,
// so that the compiler keeps them in place, unread and unreused, up to the point where the wgmma is waited for
__device__ __forceinline__ void keep(uint32_t (&a)[4][4]) {
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[s][i])::"memory");
}
__device__ __forceinline__ void keep(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[j][i])::"memory");
}

// the tile's 4 k-steps through wgmma into `a` (this unit's A registers): k-step s reads B at `xs` + 256 NT s. With
// W12F_WG_DEPTH = 2 the previous unit's wgmma may still run when this one is issued; after this one's issue that one
// is waited for, so `prev` (its A registers) is free again; at 1 each unit's wgmma is waited for before returning
__device__ __forceinline__ void tile_wgmma(float (&acc)[NT][4], const Frag& f, uint32_t xs, const uint32_t (&k)[2],
                                          uint32_t (&a)[4][4], uint32_t (&prev)[4][4]) {
  constexpr uint32_t LBO = W12F_WG_SWAP ? 128u : 128u * NT, SBO = W12F_WG_SWAP ? 128u * NT : 128u;
#pragma unroll
  for (int s = 0; s < 4; ++s) decode_step<false>(a[s], f, k, s);
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  keep(acc);
  keep(a);
  // the descriptor's low word once per unit, each k-step's a constant above it (its address field, bits 0-13, stays
  // below 2^14: shared addresses < 256 KB), the high word a constant: 3-4 instructions a k-step fewer than building
  // each descriptor from its address
  const uint32_t lo = ((xs & 0x3FFFFu) >> 4) | ((LBO >> 4) << 16);
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint64_t desc = ((uint64_t)(SBO >> 4) << 32) | (uint64_t)(lo + 16u * NT * s);
    if constexpr (NT <= 4) {
      wgmma_step<NT>(acc, a[s], desc);
    } else {
      // 5..8 n-tiles: tokens 0..31, then tokens 32.. from their token groups 512 bytes further in the slot (the
      // address field counts 16 bytes), at the same byte offsets; one wgmma each, the same A registers
      constexpr int NT2 = NT > 4 ? NT - 4 : 1;  // (a discarded branch of a non-template is still compiled)
      wgmma_step<4>(*reinterpret_cast<float(*)[4][4]>(&acc[0][0]), a[s], desc);
      wgmma_step<NT2>(*reinterpret_cast<float(*)[NT2][4]>(&acc[NT > 4 ? 4 : 0][0]), a[s], desc + (512u >> 4));
    }
  }
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(W12F_WG_DEPTH - 1) : "memory");
  keep(acc);
  keep(prev);
  if constexpr (W12F_WG_DEPTH == 1) keep(a);
}
#endif

}  // namespace

extern "C" __global__ void __launch_bounds__(32 * WARPS, W12F_CPS)
#if W12F_KC > 1 && !W12F_KG
__cluster_dims__(W12F_KC, 1, 1)
#endif
w12_matmul_flow_kernel(
    const __nv_bfloat16* __restrict__ x,  // [M, >= 64 ceil(K / 64)], row stride ldx, 16-byte aligned rows, zero past K
    long long ldx,
    const uint8_t* __restrict__ tiles,    // the runtime layout (w12/layout.py)
    const uint8_t* __restrict__ e0, const int* __restrict__ rowptr, const int* __restrict__ ecol,
    const uint16_t* __restrict__ eval, const void* __restrict__ bias, int bias_kind,  // bias: 0 none, 1 bf16, 2 fp16, 3 fp32
    w12f_out_t* __restrict__ out,         // [M, N], bf16 (fp32 with W12F_OUT32)
    int M, int N, int K,
    float* __restrict__ sink,             // [blockDim.x]: steps without the epilogue, a never-taken store
    float* __restrict__ ws, int* __restrict__ cnt) {  // KG: 128 RW RB NT floats per CTA, one counter per KC CTAs
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_emin[WARPS], s_emax[WARPS];
  __shared__ int s_last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, p = lane & 3;
  // the warp's row block (row group, for RB = 2) in the CTA and its K piece; the warpgroup build groups 4 warps
  const int rw = WG ? (warp >> 2) / KW * 4 + (warp & 3) : warp / KW;
  const int ks = WG ? (warp >> 2) % KW : warp - rw * KW;
  const int KF = K >> 6, kr = K & 63, NF = N >> 4, nr = N & 15;
  const int NB = NF + (nr > 0);
  const int TB = kr + ((kr + 1) >> 1);
  const long long SB = 1536LL * KF + 16LL * TB;
  const int cta = (int)blockIdx.x / KC, kc = (int)blockIdx.x - cta * KC;  // a cluster's CTAs: consecutive ids
  unsigned long long* const trace = reinterpret_cast<unsigned long long*>(sink);
  // W12F_TRACE: stamp k by thread 0, or (last) the latest of every warp's lane 0
  auto stamp = [&](int k) {
    if constexpr (W12F_TRACE != 0) {
      if (threadIdx.x == 0) cta_stamp(trace, k);
    }
  };
  auto stamp_last = [&](int k) {
    if constexpr (W12F_TRACE != 0) {
      if (lane == 0) atomicMax(trace + 8 * blockIdx.x + k, global_ns());
    }
  };
  stamp(0);
  stamp(1);

  // whether the warp's row group of row set `set` streams (WG: the range follows the warpgroup's first row block,
  // all 4 warps run every wgmma together)
  auto warp_active = [&](int set) { return WG ? (set * RW + (rw & ~3)) < NB : (set * RW + rw) * RB < NB; };
  // the warp's units [a, b) of the row set's units [s0, s1): piece kc KW + ks of KC x KW
  auto piece = [&](bool on, int s0, int s1, int& a, int& b) {
    const int n = s1 - s0, q = kc * KW + ks;
    a = on ? s0 + q * n / (KC * KW) : 0;
    b = on ? s0 + (q + 1) * n / (KC * KW) : 0;
  };
  {  // the CTA's work: one row set (RW row groups) over the whole K
    const int set = cta;
    const int s0 = 0, s1 = KF;
    const int rb0 = (set * RW + rw) * RB;           // the first row block of this warp's row group
    const bool active = rb0 < NB;                    // a row group is active when its first block is
    const bool lactive = warp_active(set);
    int R[RB], TS[RB];                               // rows of each row block (0 past the last), bytes per tile
    const uint8_t* blk[RB];
#pragma unroll
    for (int i = 0; i < RB; ++i) {
      const int rb = rb0 + i;
      R[i] = rb < NF ? 16 : (rb < NB ? nr : 0);
      TS[i] = FULL ? TILE : 96 * R[i];  // FULL: every block holds 16 rows (nr = 0) or none (past the last)
      blk[i] = tiles + (long long)min(rb, NB - 1) * SB;
    }
    const int q = kc * KW + ks;                      // the warp's piece of the row group's K, of KC x KW
    int c0, c1;                                      // its units [c0, c1) of [s0, s1)
    piece(lactive, s0, s1, c0, c1);
    const bool has_tail = lactive && q == KC * KW - 1 && kr > 0;
    const int cend = c1 + (has_tail ? 1 : 0);        // units c0 .. cend - 1; unit KF is the masked tail
    constexpr int SLOT = RB * TILE;                  // the warp's ring: one slot, the unit's tile of each row block
    const uint32_t ring = (uint32_t)__cvta_generic_to_shared(smem) + warp * STAGES * SLOT;
    const uint64_t pol = evict_first_policy();       // the copies' L2 policy

    // The refill cursor: the lane's source of the next tiles to request (three 16-byte pieces per row block: hi rows
    // g, g + 8, then lo rows lane / 2; absent rows of a partial block read nothing and are zero-filled) and its slot.
    uint32_t v[RB][3];
    int o[RB][3];
    const uint8_t* src[RB];
#pragma unroll
    for (int i = 0; i < RB; ++i) {
      v[i][0] = g < R[i] ? 16u : 0u, v[i][1] = g + 8 < R[i] ? 16u : 0u, v[i][2] = (lane >> 1) < R[i] ? 16u : 0u;
      o[i][0] = v[i][0] ? 16 * lane : 0, o[i][1] = v[i][1] ? 512 + 16 * lane : 0;
      o[i][2] = v[i][2] ? 64 * R[i] + 16 * lane : 0;
      src[i] = blk[i] + (long long)c0 * TS[i];
    }
    const uint32_t ring_end = ring + STAGES * SLOT;
    uint32_t wst = ring + 16 * lane;
    // FULL: the lane's three pieces at fixed distances from one pointer (immediate offsets), 16 bytes each where the
    // block exists (RB = 1: always, a warp with units has its block); a block past the last reads nothing at the
    // clamped block's addresses
    const uint8_t* srcl[RB];
    uint32_t vf[RB];
#pragma unroll
    for (int i = 0; i < RB; ++i) {
      srcl[i] = src[i] + 16 * lane;
      vf[i] = (RB == 1 || R[i] > 0) ? 16u : 0u;
    }
    auto issue = [&]() {
#pragma unroll
      for (int i = 0; i < RB; ++i) {
        if constexpr (FULL) {
          cp_async16(wst + i * TILE, srcl[i], vf[i], pol);
          cp_async16(wst + i * TILE + 512, srcl[i] + 512, vf[i], pol);
          if constexpr (!Q8) cp_async16(wst + i * TILE + 1024, srcl[i] + 1024, vf[i], pol);
          srcl[i] += TILE;
          continue;
        }
        cp_async16(wst + i * TILE, src[i] + o[i][0], v[i][0], pol);
        cp_async16(wst + i * TILE + 512, src[i] + o[i][1], v[i][1], pol);
        if constexpr (!Q8) cp_async16(wst + i * TILE + 1024, src[i] + o[i][2], v[i][2], pol);
        src[i] += TS[i];
      }
    };
    auto next_slot = [&](uint32_t a) { return a + SLOT >= ring_end ? a + SLOT - STAGES * SLOT : a + SLOT; };

    // rows g, g + 8 of each block: window base and decode constant (W12F_LATE: the constants after the first copies)
    int e0r[RB][2];
    uint32_t kk[RB][2];
    auto decode_constant = [](uint32_t e) -> uint32_t {
      return FIXED ? (e == 0 ? 0u : BASE112) : (Q8 ? q8_base((e << 7) | (e << 23)) : (e << 7) | (e << 23));
    };
#pragma unroll
    for (int i = 0; i < RB; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = (rb0 + i) * 16 + 8 * h + g;
        e0r[i][h] = active && row < N ? (int)e0[row] : 0;
        if constexpr (W12F_LATE == 0) kk[i][h] = decode_constant((uint32_t)e0r[i][h]);
      }

    // the escape metadata of the rows this warp finishes (CSR range and first entry), read now so that the loads'
    // latency hides under the stream instead of lengthening the epilogue (ESC_STASH: where it waits)
    int ep[RB][2][2] = {}, ec[RB][2] = {};
    uint32_t ev[RB][2] = {};
    // shared memory: the weight rings, the x rings (XS: one of STAGES slots per K piece), the KW shares (RED), the
    // other CTAs' sums (KC > 1, rank 0's; XS_CRED: over the rings, free once the main loop is done), the escape stash
    constexpr int XS_OFF = WARPS * STAGES * SLOT;                                     // after the weight rings
    constexpr int RED_OFF = XS_OFF + (XS ? KW * STAGES * XSSLOT : 0);                 // after the rings
    constexpr int CRED_BYTES = CLUSTER ? (KC - 1) * RW * RB * NT * 512 : 0;
    constexpr bool XS_CRED = XS && CLUSTER && CRED_BYTES <= RED_OFF;
    constexpr int AFTER_RED = RED_OFF + (RED ? WARPS * RB * NT * 512 : 0);           // after the KW shares
    constexpr int CRED_OFF = XS_CRED ? 0 : AFTER_RED;
    constexpr int STASH_OFF = AFTER_RED + (XS_CRED ? 0 : CRED_BYTES);                  // after the CTAs' sums
    constexpr int X_OFF = STASH_OFF + (ESC_STASH ? RW * RB * 1024 : 0);                 // after the stash (WG)
    int4* const stash = reinterpret_cast<int4*>(smem + STASH_OFF) + rw * RB * 64;
    // after the warpgroup build's x rings (sized for 3 slots whatever W12F_WG_DEPTH): word
    // 32 ((2 i + h) 2 NT + 2 j + u) + lane of the row group's part holds the column pair of x at row (i, h)'s first
    // escape, token 8 j + 2 p + u
    constexpr int ESCX_OFF = X_OFF + (WG ? WARPS / 4 * 3 * XSLOT : 0);
    const uint32_t* const escx = reinterpret_cast<const uint32_t*>(smem + ESCX_OFF) + rw * RB * 4 * NT * 32 + lane;
#ifdef W12F_SMEM
    // the launch gives W12F_SMEM bytes (w12.flow.smem_bytes, from the same defines): the layout must end there
    static_assert(ESCX_OFF + (ESCX ? RW * RB * NT * 512 : 0) == W12F_SMEM,
                  "w12.flow.smem_bytes and the kernel's shared-memory layout disagree");
#endif
    // the first entry of each row's CSR range (W12F_LATE: after the first copies, so that this dependent load and
    // the stash store that waits for it do not hold them back)
    auto escape_entries = [&]() {
#pragma unroll
      for (int i = 0; i < RB; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (ep[i][h][1] > ep[i][h][0]) {
            ec[i][h] = __ldg(ecol + ep[i][h][0]);
            ev[i][h] = __ldg(eval + ep[i][h][0]);
          }
          // the lane reads back its own entries in the epilogue: no barrier
          if constexpr (ESC_STASH)
            stash[64 * i + 32 * h + lane] = make_int4(ep[i][h][0], ep[i][h][1], ec[i][h], (int)ev[i][h]);
        }
    };
    const bool esc_rows = ESC && ks == 0 && active && (KG || kc == 0);  // KG: any of the KC CTAs may finish the rows
    if (esc_rows) {
#pragma unroll
      for (int i = 0; i < RB; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = (rb0 + i) * 16 + 8 * h + g;
          if (row < N) {
            ep[i][h][0] = __ldg(rowptr + row);
            ep[i][h][1] = __ldg(rowptr + row + 1);
          }
        }
      if constexpr (W12F_LATE == 0) escape_entries();
    }

    // the first STAGES - 1 tiles go out before the wait for the previous kernel (x may be its output)
    auto first_tiles = [&](int a, int b) {
#pragma unroll
      for (int i = 0; i < STAGES - 1; ++i) {
        if (a + i < b) issue();
        cp_commit();
        wst += SLOT;
      }
    };
    first_tiles(c0, c1);
    if constexpr (W12F_LATE != 0) {
#pragma unroll
      for (int i = 0; i < RB; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) kk[i][h] = decode_constant((uint32_t)e0r[i][h]);
      if (esc_rows) escape_entries();
    }
    grid_dep_wait();
    stamp(2);

    // XS: the x ring of the warp's K piece, shared by its RW warps (a warp whose row group is past the last block
    // still copies its part and meets the barriers, below). Thread xt of them copies chunks xt + 32 RW r of a unit's
    // 64 NT 16-byte chunks: chunk q is half q % 2 of lane l = q / 2 % 32's x in n-tile j = q / 64 (token 8 j + l / 4,
    // columns 16 (l % 4) + 8 (q % 2) of the unit), stored at 16 (64 j + 32 (q % 2) + l), where lane l reads it as
    // load_x would have loaded it (conflict-free); tokens past M are zero-filled
    constexpr int XCH = (64 * NT + 32 * RW - 1) / (32 * RW);  // chunks a thread copies per unit
    int cx0 = c0, cx1 = c1;  // the units of the warp's K piece, also where its rows are past the last block
    if constexpr (XS) piece(true, s0, s1, cx0, cx1);
    const uint32_t xsring = (uint32_t)__cvta_generic_to_shared(smem + XS_OFF) + ks * STAGES * XSSLOT;
    auto next_xslot = [&](uint32_t a) {
      return a + XSSLOT >= xsring + STAGES * XSSLOT ? a + XSSLOT - STAGES * XSSLOT : a + XSSLOT;
    };
    const __nv_bfloat16* xcs[XS ? XCH : 1];  // chunk r's source in the next unit to copy
    uint32_t xcd[XS ? XCH : 1], xcb[XS ? XCH : 1];  // its offset in a slot, and its bytes (16, 0 past M)
    if constexpr (XS) {
#pragma unroll
      for (int r = 0; r < XCH; ++r) {
        const int q = rw * 32 + lane + 32 * RW * r, j = q >> 6, l = (q >> 1) & 31, v = q & 1, tok = 8 * j + (l >> 2);
        const bool real = tok < M;  // (a chunk past the unit has j >= NT: its token is past M too)
        xcs[r] = x + (long long)(real ? tok : 0) * ldx + 64LL * cx0 + 16 * (l & 3) + 8 * v;
        xcd[r] = 16u * (64 * j + 32 * v + l);
        xcb[r] = real ? 16u : 0u;
      }
    }
    auto issue_x = [&](uint32_t slot) {  // the next unit's chunks of this thread into `slot`
#pragma unroll
      for (int r = 0; r < XCH; ++r) {
        if (64 * NT % (32 * RW) != 0 && rw * 32 + lane + 32 * RW * r >= 64 * NT) continue;
        asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(slot + xcd[r]), "l"(xcs[r]), "r"(xcb[r])
                     : "memory");
        xcs[r] += 64;
      }
    };
    // the piece's meeting at each unit: every copy of the unit's x landed, and the slot refilled next read by all
    auto xs_barrier = [&]() { asm volatile("bar.sync %0, %1;" ::"r"(1 + ks), "n"(32 * RW) : "memory"); };
    uint32_t xsw = xsring, xsr = xsring;  // the slots written and read next
    if constexpr (XS) {
      // the first STAGES - 1 units' x, a commit group each after the weights' (x may be the previous kernel's
      // output): at unit c0 + i the wait for all but STAGES - 2 groups then covers its weight tile and its x
#pragma unroll
      for (int i = 0; i < STAGES - 1; ++i) {
        if (cx0 + i < cx1) issue_x(xsw);
        cp_commit();
        xsw = next_xslot(xsw);
      }
    }
    if constexpr (ESCX) {
      if (esc_rows) {
        const uint32_t dst = (uint32_t)__cvta_generic_to_shared(escx);
#pragma unroll
        for (int i = 0; i < RB; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if (ep[i][h][1] <= ep[i][h][0]) continue;
            const __nv_bfloat16* col = x + (ec[i][h] & ~1);  // the aligned pair holding the column
            for_tokens<NT>(p, M, [&](int j, int u, int tok) {
              asm volatile("cp.async.ca.shared.global [%0], [%1], 4;"
                           ::"r"(dst + 128u * ((2 * i + h) * 2 * NT + 2 * j + u)),
                           "l"(col + (long long)tok * ldx) : "memory");
            });
          }
      }
    }

    // The warpgroup build's x: thread t (of 128) stages token n = t / TPT (a row of the slot when n < 8 NT; zeros past
    // M), columns 4 NTP q .. 4 NTP q + 4 NTP - 1 of each unit, q = t % TPT (NTP = NT rounded up to a power of two,
    // TPT = 16 / NTP threads per token): one 8-, 16-, 2 x or 4 x 16-byte load into registers a unit ahead, then one
    // 4-byte store per column pair into the slot at the header's byte (the slots taken in turn)
    constexpr int NTP = NT <= 2 ? NT : NT <= 4 ? 4 : 8, TPT = 16 / NTP, XW = 2 * NTP;
    const int wt = threadIdx.x & 127, xtok = wt / TPT, xq = wt % TPT;
    const bool xrow = WG && xtok < 8 * NT, xreal = xtok < M;
    const uint32_t xring = (uint32_t)__cvta_generic_to_shared(smem + X_OFF) + (warp >> 2) * XSLOTS * XSLOT;
    const uint32_t xbase = 128u * (xtok >> 3) + 16u * (xtok & 7);
    const __nv_bfloat16* xsrc = x + (long long)(xreal ? xtok : 0) * ldx + 64LL * c0 + 4 * NTP * xq;
    uint32_t xreg[XW];  // zeros, kept by the threads without a token (never loaded)
#pragma unroll
    for (int u = 0; u < XW; ++u) xreg[u] = 0u;
    auto load_xw = [&]() {
      if (xrow && xreal) {
        if constexpr (XW == 2) {
          const uint2 v = __ldg(reinterpret_cast<const uint2*>(xsrc));
          xreg[0] = v.x, xreg[1] = v.y;
        } else {
#pragma unroll
          for (int u = 0; u < XW / 4; ++u) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(xsrc) + u);
            xreg[4 * u] = v.x, xreg[4 * u + 1] = v.y, xreg[4 * u + 2] = v.z, xreg[4 * u + 3] = v.w;
          }
        }
      }
      xsrc += 64;
    };
    auto store_xw = [&](uint32_t slot) {
      if (!xrow) return;
#pragma unroll
      for (int u = 0; u < XW; ++u) {
        const int col = 4 * NTP * xq + 2 * u;  // p = col / 16, s = col / 4 % 4, h = col / 2 % 2
        const uint32_t a = slot + xbase + 256u * NT * ((col >> 2) & 3) + 128u * NT * ((col >> 1) & 1) + 4u * (col >> 4);
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(a), "r"(xreg[u]) : "memory");
      }
    };
    // W12F_WG_STM: warp w of a warpgroup stages n-tile w (w < NT). Lane (g, p) loads token 8 w + g, columns
    // 16 p .. 16 p + 15 of the unit (two 16-byte loads a unit ahead): word q is the pair of k slots 2 p, 2 p + 1 of
    // k-step q / 2, k half q % 2, which is row g, columns 2 p, 2 p + 1 of that core matrix as stmatrix takes it. Two
    // stmatrix.x4 store the n-tile's 8 core matrices (words 0-3: k-steps 0-1, words 4-7: k-steps 2-3), lane 8 i + r
    // giving the address of row r of matrix i: the same bytes as store_xw's (tests/w12/flow_emu.py, wg_slot_stm).
    const int sj = warp & 3, stok = 8 * sj + g;
    const bool srow = STM && sj < NT, sreal = stok < M;
    const __nv_bfloat16* ssrc = x + (long long)(sreal ? stok : 0) * ldx + 64LL * c0 + 16 * p;
    const uint32_t srow_off = 128u * sj + 16u * (lane & 7);  // row (lane & 7) of a core matrix of n-tile sj
    uint32_t sreg[8];
    auto load_xs = [&]() {
      if (srow && sreal) {
        const uint4 v0 = __ldg(reinterpret_cast<const uint4*>(ssrc));
        const uint4 v1 = __ldg(reinterpret_cast<const uint4*>(ssrc) + 1);
        sreg[0] = v0.x, sreg[1] = v0.y, sreg[2] = v0.z, sreg[3] = v0.w;
        sreg[4] = v1.x, sreg[5] = v1.y, sreg[6] = v1.z, sreg[7] = v1.w;
      } else {
#pragma unroll
        for (int u = 0; u < 8; ++u) sreg[u] = 0u;
      }
      ssrc += 64;
    };
    auto store_xs = [&](uint32_t slot) {
      if (!srow) return;
      const int i = lane >> 3;  // the matrix this lane addresses: k-step 2 call + i / 2, k half i % 2
#pragma unroll
      for (int call = 0; call < 2; ++call) {
        const uint32_t a = slot + 256u * NT * (2 * call + (i >> 1)) + 128u * NT * (i & 1) + srow_off;
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(sreg[4 * call]),
                     "r"(sreg[4 * call + 1]), "r"(sreg[4 * call + 2]), "r"(sreg[4 * call + 3]) : "memory");
      }
    };

    XRange xr;
    // the unit's turn among the CTA's RA active row blocks (the last CTA may have fewer than RW): warp rw folds the
    // units of its K range with fu == rw, so that every unit a warp reads is folded by one warp
    const int RA = min(RW, NB - cta * RW);
    int fu = 0;
    // the lane's x: token 8 j + g of n-tile j, columns 16 p .. 16 p + 15 of a unit; `xu` at unit c0, one unit a step
    const __nv_bfloat16* xu = x + (long long)g * ldx + 64 * c0 + 16 * p;
    const long long x8 = 8 * ldx;
    auto load_x = [&](uint4 (&xv)[NT][2]) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (8 * j + g < M) {
          const uint4* q = reinterpret_cast<const uint4*>(xu + j * x8);
          xv[j][0] = __ldg(q);
          xv[j][1] = __ldg(q + 1);
        } else {
          xv[j][0] = xv[j][1] = make_uint4(0u, 0u, 0u, 0u);
        }
        if (GUARD && fu == rw) {
          xr.add(xv[j][0]);
          xr.add(xv[j][1]);
        }
      }
      fu = fu + 1 == RA ? 0 : fu + 1;
      if constexpr (W12F_XSTEP != 0) xu += 64;
    };
    // XH: half v of the unit at xu into xv[.][v] (the fold takes each half; the cursor moves on after half 1). The
    // registers of tokens past M keep the zeros of the first load_x (no store reads them, and zeros leave the fold's
    // range as it is), so that no unit spends instructions on them
    auto load_x_half = [&](uint4 (&xv)[NT][2], int v) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (8 * j + g < M) {
          xv[j][v] = __ldg(reinterpret_cast<const uint4*>(xu + j * x8) + v);
          if (GUARD && fu == rw) xr.add(xv[j][v]);
        }
      }
      if (v == 1) {
        fu = fu + 1 == RA ? 0 : fu + 1;
        if constexpr (W12F_XSTEP != 0) xu += 64;
      }
    };
    // the masked tail's fragments, byte by byte from global memory (columns past K and rows past the block zero)
    // a tile's fragments of this lane from its ring slot at shared address t (the 8-bit view: the hi bytes only)
    auto ring_frag = [&](Frag& f, uint32_t t) {
      f.h[0] = lds128(t + 16 * lane);
      f.h[1] = lds128(t + 512 + 16 * lane);
      if constexpr (!Q8) {
        f.l[0] = lds64(t + 1024 + 8 * lane);
        f.l[1] = lds64(t + 1280 + 8 * lane);
      } else {
        f.l[0] = f.l[1] = make_uint2(0u, 0u);
      }
    };
    auto tail_frag = [&](Frag& f, int i) {
      const int Ri = R[i];
      const uint8_t* th = blk[i] + (long long)KF * TS[i];
      const uint8_t* tl = th + Ri * kr;
      const int lb = (kr + 1) >> 1;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 8 * h + g;
        unsigned long long h0 = 0ull, h1 = 0ull, lw = 0ull;  // hi bytes 0..7, 8..15; lo byte j = column j | j + 8
#pragma unroll 1
        for (int jj = 0; jj < 16; ++jj) {
          const int col = 16 * p + jj;
          if (r < Ri && col < kr) {
            const unsigned long long b = th[r * kr + col];
            if (jj < 8)
              h0 |= b << (8 * jj);
            else
              h1 |= b << (8 * (jj - 8));
            const unsigned long long nib = (tl[r * lb + (col >> 1)] >> (4 * (col & 1))) & 0xFu;
            lw |= nib << (8 * (jj & 7) + 4 * (jj >> 3));
          }
        }
        f.h[h] = make_uint4((uint32_t)h0, (uint32_t)(h0 >> 32), (uint32_t)h1, (uint32_t)(h1 >> 32));
        f.l[h] = make_uint2((uint32_t)lw, (uint32_t)(lw >> 32));
      }
    };

    float acc[RB][NT][4];
    for_acc<RB, NT>([&](int i, int j, int u) { acc[i][j][u] = 0.0f; });
    uint4 xn[NT][2];  // XD = 0: the next unit's x (prefetched one unit ahead); XD > 0: the masked tail's
    uint4 xs[XD + 1][NT][2];  // XD > 0: the x sets (below)
    if constexpr (WG) {
    } else if constexpr (XS) {
    } else if constexpr (XB) {
      if constexpr (XD == 0) {
        if (c0 < cend) load_x(xn);
      } else {
#pragma unroll
        for (int r = 0; r < XD; ++r)
          if (c0 + r < cend) load_x(xs[r]);
      }
    } else {
      const uint32_t b = 0x3F800000u ^ (uint32_t)lane;  // the probe's constant B operand
#pragma unroll
      for (int j = 0; j < NT; ++j) xn[j][0] = xn[j][1] = make_uint4(b, b ^ 1u, b ^ 2u, b ^ 3u);
#pragma unroll
      for (int r = 0; r <= XD; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j) xs[r][j][0] = xs[r][j][1] = xn[j][0];
    }

    uint32_t rst = ring;  // the slot of tile c
#if W12F_WG
    uint32_t xslot = xring;  // unit c's x slot
    uint32_t areg[2][4][4] = {};  // A registers of even and odd units (one may be read by a wgmma in flight)
    if (c0 < cend) {
      if constexpr (STM)
        load_xs();
      else
        load_xw();
    }
    auto wg_unit = [&](int c, uint32_t (&a)[4][4], uint32_t (&prev)[4][4]) {
      // unit c's x into its slot (it held unit c - XSLOTS: every warp of the warpgroup waited for that wgmma before
      // the barrier of unit c - 1), then unit c + 1's loads
      if constexpr (STM) {
        store_xs(xslot);
        if (c + 1 < cend) load_xs();
      } else {
        if (W12F_WG_XCOPY != 0 || c == c0) store_xw(xslot);
        if (W12F_WG_XCOPY != 0 && c + 1 < cend) load_xw();
      }
      asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
      if (c == c0) stamp(3);
      if constexpr (W12F_WG_FENCE != 0) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // seen by wgmma
      if constexpr (W12F_WG_BAR != 0)  // the warpgroup's x and weight tiles landed
        asm volatile("bar.sync %0, 128;" ::"r"(1 + (warp >> 2)) : "memory");
      Frag f;
      if (c < c1)
        ring_frag(f, rst);
      else
        tail_frag(f, 0);
      // refill the weight slot read one unit ago with unit c + STAGES - 1
      if (c + STAGES - 1 < c1) issue();
      cp_commit();
      wst = next_slot(wst);
      rst = next_slot(rst);
      tile_wgmma(acc[0], f, xslot, kk[0], a, prev);
      xslot = xslot + XSLOT == xring + XSLOTS * XSLOT ? xring : xslot + XSLOT;
    };
    int c = c0;
    for (; c + 1 < cend; c += 2) {
      wg_unit(c, areg[0], areg[1]);
      wg_unit(c + 1, areg[1], areg[0]);
    }
    if (c < cend) wg_unit(c, areg[0], areg[1]);
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    keep(acc[0]);
    keep(areg[0]);
    keep(areg[1]);
    asm volatile("cp.async.wait_all;" ::: "memory");
#else
    if constexpr (XS) {
      if (!lactive) {  // no rows: this warp's part of the piece's x copies, and its barriers
        for (int c = cx0; c < cx1; ++c) {
          asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
          xs_barrier();
          if (c + STAGES - 1 < cx1) issue_x(xsw);
          cp_commit();
          xsw = next_xslot(xsw);
        }
      }
    }
    if constexpr (XD == 0) {
      for (int c = c0; c < c1; ++c) {
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
        if constexpr (XS)  // every copy of unit c's x landed, and unit c - 1's slot read by every warp of the piece
          xs_barrier();
        else
          __syncwarp();
        if (c == c0) stamp(3);
        Frag f[RB];
#pragma unroll
        for (int i = 0; i < RB; ++i) ring_frag(f[i], rst + i * TILE);
        if constexpr (XS) {
          uint4 xc[NT][2];
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int v = 0; v < 2; ++v) xc[j][v] = lds128(xsr + 16u * ((2 * j + v) * 32 + lane));
          xsr = next_xslot(xsr);
          // refill the weight slot and the x slot read one unit ago with unit c + STAGES - 1
          if (c + STAGES - 1 < c1) {
            issue();
            issue_x(xsw);
          }
          cp_commit();
          wst = next_slot(wst);
          rst = next_slot(rst);
          xsw = next_xslot(xsw);
#pragma unroll
          for (int i = 0; i < RB; ++i) tile_mma<FIXED>(acc[i], f[i], xc, kk[i]);
          continue;
        }
        // refill the slot read one unit ago with unit c + STAGES - 1
        if (c + STAGES - 1 < c1) issue();
        cp_commit();
        wst = next_slot(wst);
        rst = next_slot(rst);
        if constexpr (XH) {
          // xn holds unit c's x; each half takes unit c + 1's once the last mma reading it is issued
          const bool more = c + 1 < cend;
#pragma unroll
          for (int i = 0; i < RB; ++i)
            tile_mma<FIXED>(acc[i], f[i], xn, kk[i], [&](int v) {
              if (i == RB - 1 && more) load_x_half(xn, v);
            });
          continue;
        }
        uint4 xc[NT][2];
#pragma unroll
        for (int j = 0; j < NT; ++j) xc[j][0] = xn[j][0], xc[j][1] = xn[j][1];
        if constexpr (XB) {
          if (c + 1 < cend) load_x(xn);
        }
#pragma unroll
        for (int i = 0; i < RB; ++i) tile_mma<FIXED>(acc[i], f[i], xc, kk[i]);
      }
    } else {
      // XD + 1 sets of x registers, unit c's in set (c - c0) % (XD + 1), each loaded XD units ahead: the loop is
      // unrolled by XD + 1 so that every set keeps its registers (a copy from the loaded set to the used one makes the
      // compiler wait for the load within the unit that issued it)
      auto unit = [&](int c, const uint4 (&xc)[NT][2], uint4 (&xl)[NT][2]) {
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
        __syncwarp();
        if (c == c0) stamp(3);
        Frag f[RB];
#pragma unroll
        for (int i = 0; i < RB; ++i) ring_frag(f[i], rst + i * TILE);
        if (c + STAGES - 1 < c1) issue();
        cp_commit();
        wst = next_slot(wst);
        rst = next_slot(rst);
        if constexpr (XB) {
          if (c + XD < cend) load_x(xl);
        }
#pragma unroll
        for (int i = 0; i < RB; ++i) tile_mma<FIXED>(acc[i], f[i], xc, kk[i]);
      };
      // explicit set indices (an unrolled loop over them put the sets in local memory)
      int c = c0;
      if constexpr (XD == 1) {
        for (; c + 1 < c1; c += 2) {
          unit(c, xs[0], xs[1]);
          unit(c + 1, xs[1], xs[0]);
        }
        if (c < c1) {
          unit(c, xs[0], xs[1]);
          ++c;
        }
        // the masked tail's x (unit c1) was loaded into the set after the last unit's
        const bool odd = ((c - c0) & 1) != 0;
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int v = 0; v < 2; ++v) xn[j][v] = odd ? xs[1][j][v] : xs[0][j][v];
      } else {
        for (; c + 2 < c1; c += 3) {
          unit(c, xs[0], xs[2]);
          unit(c + 1, xs[1], xs[0]);
          unit(c + 2, xs[2], xs[1]);
        }
        int t = 0;  // the set of unit c
        if (c < c1) {
          unit(c, xs[0], xs[2]);
          ++c, t = 1;
        }
        if (c < c1) {
          unit(c, xs[1], xs[0]);
          ++c, t = 2;
        }
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int v = 0; v < 2; ++v) xn[j][v] = t == 0 ? xs[0][j][v] : (t == 1 ? xs[1][j][v] : xs[2][j][v]);
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    if constexpr (XS) {
      if (has_tail) {  // the masked tail's x from global memory, as the other builds load it
        xu = x + (long long)g * ldx + 64LL * c1 + 16 * p;
        load_x(xn);
      }
    }
    if (has_tail) {
#pragma unroll
      for (int i = 0; i < RB; ++i) {
        Frag f;
        tail_frag(f, i);
        tile_mma<FIXED>(acc[i], f, xn, kk[i]);
      }
    }
#endif
    // the next kernel's CTAs may launch (programmatic dependent launch) once every CTA's main loop is done; at the
    // kernel's start instead, the 64-layer decode step on the H200 took 9,935 µs against 9,816 (docs/w12-kernels.md)
    stamp_last(4);
    // KG: each CTA counts as letting it launch when it exits (the workspace and counters are then free)
    if constexpr (!KG) grid_dep_launch();

    if constexpr (!EPI) {
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < RB; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) s += acc[i][j][0] + acc[i][j][1] + acc[i][j][2] + acc[i][j][3];
      if (W12F_TRACE == 0 && __float_as_uint(s) == 0x7FBADA55u) sink[threadIdx.x] = s;
      stamp_last(5);
      return;
    } else {
      if constexpr (GUARD) {
        const int wmax = (int)__reduce_max_sync(0xFFFFFFFFu, (unsigned)xr.emax());
        const int wmin = (int)__reduce_min_sync(0xFFFFFFFFu, (unsigned)xr.emin());
        if (lane == 0) {
          s_emax[warp] = wmax;
          s_emin[warp] = wmin;
        }
        __syncthreads();  // the x range of the whole CTA
        int emin = 255, emax = 0;
#pragma unroll
        for (int i = 0; i < WARPS; ++i) emin = min(emin, s_emin[i]), emax = max(emax, s_emax[i]);
        if (!scale_rows<NT>(acc[0], e0r[0], emin, emax)) {  // RB = 1 (static_assert above)
          // this warp's share again with the exact base, tiles read from global memory in the loop's order
          uint32_t e0x[2];
#pragma unroll
          for (int h = 0; h < 2; ++h) e0x[h] = ((uint32_t)e0r[0][h] << 7) | ((uint32_t)e0r[0][h] << 23);
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[0][j][i] = 0.0f;
          for (int c = c0; c < cend; ++c) {
            Frag f;
            if (c < c1) {
              const uint8_t* t = blk[0] + (long long)c * TS[0];
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int r = 8 * h + g;
                const bool in = r < R[0];
                f.h[h] = in ? __ldcg(reinterpret_cast<const uint4*>(t + 64 * r + 16 * p)) : make_uint4(0u, 0u, 0u, 0u);
                f.l[h] = in ? __ldcg(reinterpret_cast<const uint2*>(t + 64 * R[0] + 32 * r + 8 * p))
                            : make_uint2(0u, 0u);
              }
            } else {
              tail_frag(f, 0);
            }
            uint4 xv[NT][2];
#pragma unroll
            for (int j = 0; j < NT; ++j) {
              const int t = 8 * j + g;
              const __nv_bfloat16* src = x + (long long)t * ldx + 64 * c + 16 * p;
              xv[j][0] = t < M ? __ldg(reinterpret_cast<const uint4*>(src)) : make_uint4(0u, 0u, 0u, 0u);
              xv[j][1] = t < M ? __ldg(reinterpret_cast<const uint4*>(src + 8)) : make_uint4(0u, 0u, 0u, 0u);
            }
            tile_mma<false>(acc[0], f, xv, e0x);
          }
        }
      }
      // the lane's word of accumulator (i, j, u) in a buffer of per-block sums, block `b` of it (a warp's share, a
      // CTA's row group, ...): the layout every reduction below stores and reads
      const auto at = [&](int b, int i, int j, int u) { return (((b * RB + i) * NT + j) * 4 + u) * 32 + lane; };
      if constexpr (RED) {
        // the shares of the KW warps of a row group, added in warp order by warp ks = 0
        float* red = reinterpret_cast<float*>(smem + RED_OFF);
        if (ks != 0) for_acc<RB, NT>([&](int i, int j, int u) { red[at(warp, i, j, u)] = acc[i][j][u]; });
        __syncthreads();
        if (ks == 0) {
#pragma unroll
          for (int w = 1; w < KW; ++w)
            for_acc<RB, NT>([&](int i, int j, int u) { acc[i][j][u] += red[at(warp + KSTEP * w, i, j, u)]; });
        }
      }
      // KG: this CTA's sums into its workspace slot `mine`, then its count in `counter`, of `count` CTAs: whether
      // it counted last (it then adds the others' sums and finishes the rows; the counter goes back to zero for the
      // next launch)
      constexpr int SHARE = RW * RB * NT * 128;  // floats of a workspace slot
      auto publish = [&](float* mine, int* counter, int count) -> bool {
        if (ks == 0) for_acc<RB, NT>([&](int i, int j, int u) { __stcg(mine + at(rw, i, j, u), acc[i][j][u]); });
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
          const int last = atomicAdd(counter, 1) == count - 1;
          if (last) *counter = 0;
          s_last = last;
        }
        __syncthreads();
        return s_last != 0;
      };
      if constexpr (KG) {
        // the last of the KC CTAs adds the slots in rank order (its own from registers)
        if (!publish(ws + (size_t)blockIdx.x * SHARE, cnt + cta, KC)) {
          stamp_last(5);
          return;
        }
        __threadfence();
        if (ks == 0) {
          float sum[RB][NT][4];
#pragma unroll
          for (int r = 0; r < KC; ++r) {
            const float* slot = ws + (size_t)(cta * KC + r) * SHARE;
            for_acc<RB, NT>([&](int i, int j, int u) {
              const float v = r == kc ? acc[i][j][u] : __ldcg(slot + at(rw, i, j, u));
              sum[i][j][u] = r == 0 ? v : sum[i][j][u] + v;
            });
          }
          for_acc<RB, NT>([&](int i, int j, int u) { acc[i][j][u] = sum[i][j][u]; });
        }
      }
      if constexpr (CLUSTER) {
        // the other CTAs' sums into rank 0's shared memory, one cluster barrier, then rank 0 adds them in rank order
        const uint32_t cred = (uint32_t)__cvta_generic_to_shared(smem + CRED_OFF);
        // XS_CRED: rank 0's rings take the sums once every warp of the cluster is done reading its own (their
        // copies all landed at the main loop's end, cp.async.wait_all)
        if constexpr (XS_CRED)
          asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
        if (ks == 0 && kc > 0) {
          uint32_t dst;
          asm volatile("mapa.shared::cluster.u32 %0, %1, 0;" : "=r"(dst) : "r"(cred));
          for_acc<RB, NT>([&](int i, int j, int u) {
            asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(dst + 4u * (uint32_t)at((kc - 1) * RW + rw, i, j, u)),
                         "f"(acc[i][j][u]) : "memory");
          });
        }
        asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
        if (kc > 0) {
          stamp_last(5);
          return;
        }
        if (ks == 0) {
          const float* cr = reinterpret_cast<const float*>(smem + CRED_OFF);
#pragma unroll
          for (int r = 0; r < KC - 1; ++r)
            for_acc<RB, NT>([&](int i, int j, int u) { acc[i][j][u] += cr[at(r * RW + rw, i, j, u)]; });
        }
      }
      if (ks != 0 || !active) {
        stamp_last(5);
        return;
      }
      if constexpr (ESC_STASH) {
#pragma unroll
        for (int i = 0; i < RB; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int4 e = stash[64 * i + 32 * h + lane];
            ep[i][h][0] = e.x, ep[i][h][1] = e.y, ec[i][h] = e.z, ev[i][h] = (uint32_t)e.w;
          }
      }
      // escapes (CSR order), bias, one rounding; acc[i][j][2 h + u]: row (rb0 + i) 16 + 8 h + g, token 8 j + 2 p + u
#pragma unroll
      for (int i = 0; i < RB; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = (rb0 + i) * 16 + 8 * h + g;
          if (row >= N) continue;
          int p0 = ep[i][h][0], c0 = ec[i][h];
          uint32_t v0 = ev[i][h];
          if constexpr (ESCX) {
            // the first escape from the x copied before the main loop, then the row's others as finish_row takes them
            if (ep[i][h][1] > p0) {
              const float val = __uint_as_float(v0 << 16), dense = escape_dense<Q8>((uint32_t)e0r[i][h]);
              for_tokens<NT>(p, M, [&](int j, int u, int) {
                const uint32_t w = escx[32 * ((2 * i + h) * 2 * NT + 2 * j + u)];
                const float xv = __uint_as_float((c0 & 1) ? w & 0xFFFF0000u : w << 16);
                acc[i][j][2 * h + u] += xv * val - xv * dense;
              });
              if (++p0 < ep[i][h][1]) c0 = __ldg(ecol + p0), v0 = __ldg(eval + p0);
            }
          }
          if constexpr (W12F_SWIGLU != 0) {
            finish_sum<Q8, NT>([&](int j, int u) -> float& { return acc[i][j][2 * h + u]; }, row,
                               (uint32_t)e0r[i][h], p0, ep[i][h][1], c0, v0, ecol, eval, x, ldx, bias, bias_kind, M,
                               p);
            if (h == 1)  // the row block's gate (h = 0) and up (h = 1) rows of this lane are both finished
              for_tokens<NT>(p, M, [&](int j, int u, int tok) {
                store_swiglu(out + (long long)tok * (N / 2) + (rb0 + i) * 8 + g, acc[i][j][u], acc[i][j][2 + u]);
              });
          } else {
            finish_row<Q8, NT>([&](int j, int u) -> float& { return acc[i][j][2 * h + u]; }, row,
                                  (uint32_t)e0r[i][h], p0, ep[i][h][1], c0, v0, ecol, eval, x, ldx,
                                  bias, bias_kind, out, M, N, p);
          }
        }
      stamp_last(5);
    }
  }
}
