// Warp-specialised split-KV tree attention for sm_90a (wgmma, cp.async, mbarriers).
//
// One CTA per (work item, KV head). A work item is a group of C row tiles of one request (C consumer
// warpgroups, 64 rows each; rows are (tree node, query head of the GQA group) pairs packed node-major, as in the
// Triton kernel) and a range [lo, hi) of the request's prefix slots in kv_indices. The item whose range ends where
// the request's prefix ends also takes the tree block: the request's own nodes as keys under the ancestor mask,
// after its prefix keys. The row tiles of a group read the same K/V tiles from shared memory. Where the group's second
// tile has no row (rows 128..191 of a 192-row request: 32 nodes x 6 heads), the two consumers split the first tile's
// keys instead ("halves"): consumer w takes the key blocks b with b % 2 == w, each with its own softmax state, and
// consumer 1 hands its state to consumer 0 through shared memory at the end, which merges the two by log-sum-exp.
//
// Warpgroups 0 .. TA_PWG - 1 are the producer: their threads gather K/V rows (any slot order: a token-slot or paged
// cache; each block's slots loaded a block ahead) with 16-byte cp.async into a ring of TA_STAGES stages, K and V of a stage each completing on their own "full"
// mbarrier through cp.async.mbarrier.arrive.noinc, and the q rows of the group once, on the "q" mbarrier (a
// halves item's two splits: halves, above). The next C warpgroups consume:
// per key block of TA_BN keys, S = Q K^T by wgmma (both operands in shared memory), the online softmax in base 2
// on S's registers (scores scaled by sm_scale log2(e); masks on the ragged last prefix block and on the tree
// block only), P rounded to the operand dtype in registers as the A operand of O += P V (wgmma, V transposed by
// the descriptor); K is released on its "empty" mbarrier once S is computed, V once P V is. The partial output,
// normalised, and its base-2 log-sum-exp go to the workspace; tree_attn's merge kernel combines the splits. A
// halves item covers two splits of the schedule and sets the second one's LSE rows to -inf (the merge skips them).
//
// Shared memory: every tile is stored as D / 64 column blocks of [rows][128 bytes] with the 128-byte swizzle
// (16-byte chunk c of row r at chunk c ^ (r % 8); every block 1024-byte aligned): q [D/64][C 64][128 B], and per
// stage K and V [D/64][BN][128 B]. Q and K are K-major operands (descriptor: start + 32 bytes per k-step inside a
// column block, stride byte offset 1024 between 8-row groups); V is the B operand of P V in the MN-major form
// (leading byte offset BN 128 between 64-column blocks, stride byte offset 1024 between 8-key groups).
//
// Cluster pairs (TA_CLUSTER): the grid runs in 2-CTA thread-block clusters, and where the two items of a pair are the
// two groups of one request over one key range ("paired": the schedule places them at items 2i and 2i + 1), each
// CTA copies half of every block's K/V rows (CTA rank r: rows [r BN / 2, (r + 1) BN / 2)) and forwards them into its
// partner's ring at the same offsets (cp.async.bulk shared::cta -> shared::cluster, the swizzled bytes as they are),
// so that each K/V row leaves L2 once for the request's 192 rows instead of once per group. A stage's own half
// completes on a "half" mbarrier (the producer threads' cp.async arrivals); producer thread 0 forwards a half once
// it has landed (polling after each of its loads, and while a stage it would refill is not yet released, a release
// that may wait on those forwards; it waits for a half only after its last load) and arrives on its own "full"
// barrier expecting the partner's half in bytes (complete_tx).
// A stage is empty when the consumers of both CTAs released it: each consumer warp arrives on its own and on its
// partner's "empty" barrier. The pair meets at a cluster barrier after the mbarriers' init and before it exits
// (remote arrivals and copies in flight target a CTA that is still there). A CTA whose partner item is another
// range or unused runs alone, as without TA_CLUSTER.
//
// Registers: the O accumulator of a consumer thread is D / 2 fp32 values (128 at D = 256) and S's BN / 2; setmaxnreg
// moves registers from the producers to the consumers where the warpgroups are more than two (C = 2: 56 / 216 by
// default; ptxas's report: no spills). Three consumer
// warpgroups (192 rows, 160 registers each) do not fit at D = 256: ptxas then keeps S in the first 16 of O's
// registers, spilling and reloading them around every wgmma, and serialises the wgmma (its C7512 note).
//
// Trusts the plan: slot indices were range-checked by tree_attn.plan, items hold ranges inside the request's
// kv_indices, and every node sees itself.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#ifdef __CUDACC_RTC__
// NVRTC has no C library headers
typedef unsigned char uint8_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif

#include "mbarrier.cuh"  // autotune/csrc: smem_u32, mbar_init, mbar_arrive, mbar_wait

#ifndef TA_C
#define TA_C 2  // consumer warpgroups (row tiles of 64 per item): 1 or 2
#endif
#ifndef TA_BN
#define TA_BN 64  // keys per block: 32 or 64
#endif
#ifndef TA_STAGES
#define TA_STAGES 2  // K/V ring stages
#endif
#ifndef TA_D
#define TA_D 256  // head dim: 64, 128 or 256
#endif
#ifndef TA_G
#define TA_G 6  // query heads per KV head
#endif
#ifndef TA_F16
#define TA_F16 0  // q, k, v in fp16 (else bf16)
#endif
#ifndef TA_NEW
#define TA_NEW 0  // the nodes' keys and values in k_new / v_new (else in the cache, after the prefix slots)
#endif
#ifndef TA_PWG
#define TA_PWG 1  // producer warpgroups: 1 or 2 (the per-SM copy rate grows with the warps issuing cp.async)
#endif
// registers after setmaxnreg (more than two warpgroups): each producer warpgroup's and each consumer's,
// 128 (TA_PWG TA_PREGS + C TA_CREGS) <= 65536
#ifndef TA_PREGS
#define TA_PREGS 56
#endif
#ifndef TA_CREGS
#define TA_CREGS 216
#endif
// layout probes for the GPU tests (0: the kernel): 1 writes block 0's raw S (Q K^T) into po's first BN columns of
// each row; 2 multiplies block 0's V by P = [key == row % BN] (so row r of the output is V's key r % BN) and
// writes that; both then stop
#ifndef TA_PROBE
#define TA_PROBE 0
#endif
// phase probes for the per-phase breakdown (0: the kernel): 1, the producer alone (the consumers release every stage
// as it lands: no wgmma, no softmax); 2, the consumers alone (the producer arrives on the full barriers without
// copying, so that the consumers compute on whatever the ring holds); 3, the copies alone (no barrier waits, no
// consumers). All write meaningless partials.
#ifndef TA_PHASE
#define TA_PHASE 0
#endif
// two consumers take turns to issue their S products (named barriers 1 and 2): one's softmax runs while the other's
// wgmma run, instead of the two drifting into step
#ifndef TA_PINGPONG
#define TA_PINGPONG 0
#endif
// K and V of a block complete on their own mbarriers either way; with TA_KV_AHEAD the producer issues block b + 1's K
// before block b's V, so that the next S product can start while this block's V lands
#ifndef TA_KV_AHEAD
#define TA_KV_AHEAD 0
#endif
// q in registers: each consumer loads its 64 rows' A fragments once (ldmatrix from the swizzled tile; D / 4
// registers a thread), so the S product reads only K from shared memory (at 32 keys a block the q operand is
// two thirds of S's shared-memory reads)
#ifndef TA_QREG
#define TA_QREG 0
#endif
// S of block b issued before P V of the block before it: the softmax of b runs while that P V does (two
// consumers: 32 keys a block, so that the two blocks' registers fit)
#ifndef TA_OVERLAP
#define TA_OVERLAP 0
#endif
// 2: 2-CTA clusters whose paired CTAs share the K/V copies (header); 1: no cluster
#ifndef TA_CLUSTER
#define TA_CLUSTER 1
#endif
#ifndef TA_FENCE
#define TA_FENCE 1  // consumers order the producer's cp.async writes before their wgmma (fence.proxy.async)
#endif

#define TA_INF __int_as_float(0x7f800000)
#define TA_ROWS (64 * TA_C)
#define TA_DB (TA_D / 64)
#define TA_THREADS (128 * (TA_C + TA_PWG))
#define TA_PTHREADS (128 * TA_PWG)  // producer threads
#define TA_SETMAXNREG (TA_C + TA_PWG > 2)  // the default register split would not hold a consumer's O

static_assert(TA_C == 1 || TA_C == 2, "1 or 2 consumer warpgroups (3 do not fit: see the header)");
static_assert(TA_BN == 32 || TA_BN == 64, "32 or 64 keys per block");
static_assert(TA_D == 64 || TA_D == 128 || TA_D == 256, "head dim 64, 128 or 256");
static_assert(!TA_SETMAXNREG || 128 * (TA_PWG * TA_PREGS + TA_C * TA_CREGS) <= 65536, "setmaxnreg: the register file");
static_assert(TA_PWG == 1 || TA_PWG == 2, "1 or 2 producer warpgroups");
static_assert(TA_PREGS % 8 == 0 && TA_CREGS % 8 == 0 && TA_PREGS >= 24 && TA_CREGS <= 256, "setmaxnreg counts");
static_assert(!TA_PINGPONG || TA_C == 2, "the turns are between two consumers");
static_assert(!(TA_PINGPONG && TA_OVERLAP), "turns or the overlap, not both");
static_assert(TA_C == 1 || 2 * TA_STAGES * TA_BN * TA_D * 2 >= 4 * 128 * 4, "halves: m and l fit the ring");
static_assert(TA_STAGES >= 2 && TA_STAGES <= 8, "2 to 8 stages");
static_assert(TA_CLUSTER == 1 || TA_CLUSTER == 2, "clusters of 1 or 2 CTAs");
// a pair's two CTAs keep the same stage for a block: halves' stages equal the others' for an even count (stage_of)
static_assert(TA_CLUSTER == 1 || (TA_C == 2 && TA_STAGES % 2 == 0 && TA_PROBE == 0 && TA_PHASE == 0),
              "cluster pairs: two consumers, an even number of stages, no probe");
static_assert(TA_CLUSTER == 1 || TA_PTHREADS / (TA_D / 8) <= TA_BN / 2, "cluster pairs: a half block per pass");

#if TA_F16
typedef __half elem_t;
#define TA_TYPE "f16"
#else
typedef __nv_bfloat16 elem_t;
#define TA_TYPE "bf16"
#endif
#if TA_BN == 32
typedef uint32_t mword_t;  // a row's ancestor bits of one key block, from this thread's first column on
#else
typedef uint64_t mword_t;
#endif

namespace {

constexpr uint32_t Q_BYTES = TA_DB * TA_ROWS * 128;
constexpr uint32_t KV_BYTES = TA_DB * TA_BN * 128;  // one of K or V, one stage
constexpr uint32_t STAGE_BYTES = 2 * KV_BYTES;
// mbarriers: K full[S], V full[S], K empty[S], V empty[S], q, and (cluster pairs) K half[S], V half[S]
constexpr uint32_t BAR_OFF = Q_BYTES + TA_STAGES * STAGE_BYTES;
constexpr uint32_t FULL_K = 0, FULL_V = 8 * TA_STAGES, EMPTY_K = 16 * TA_STAGES, EMPTY_V = 24 * TA_STAGES,
                   Q_FULL = 32 * TA_STAGES, HALF_K = Q_FULL + 8, HALF_V = HALF_K + 8 * TA_STAGES;
constexpr uint32_t BAR_BYTES = TA_CLUSTER == 2 ? HALF_V + 8 * TA_STAGES : Q_FULL + 8;
constexpr uint32_t HALF_ROWS_BYTES = (TA_BN / 2) * 128;  // one column block's half of a K or V tile

// 16 bytes global -> shared; `bytes` 0 fills the chunk with zeros and reads nothing
__device__ __forceinline__ void cp16(uint32_t dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

// the stage's mbarrier counts one arrival of this thread when its earlier cp.async copies have landed
__device__ __forceinline__ void cp_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

#if TA_CLUSTER == 2
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// the address of the same shared-memory byte in CTA `rank` of the cluster
__device__ __forceinline__ uint32_t peer_addr(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ void peer_arrive(uint32_t bar) {  // an mbarrier of the partner (a peer_addr)
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_test(uint32_t bar, uint32_t parity) {  // without waiting
  uint32_t ok;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
      : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
  return ok != 0;
}
__device__ __forceinline__ void mbar_arrive_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// `bytes` of this CTA's shared memory at src into the partner's at dst, completing on its mbarrier `bar`
__device__ __forceinline__ void bulk_to_peer(uint32_t dst, uint32_t src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "r"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
#endif

// byte offset of 16-byte chunk c (0..D/8-1) of row r in a [D/64][rows][128 B] swizzled tile
__device__ __forceinline__ uint32_t tile_off(int r, int c, int rows) {
  return (uint32_t)((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// wgmma shared-memory descriptor, 128-byte swizzle
__device__ __forceinline__ uint64_t desc128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
         (1ull << 62);
}

// the "+f" operands of an m64nN wgmma's N / 2 accumulators x[0 .. N / 2 - 1]
#define TA_ACC8(x, i) "+f"(x[i]), "+f"(x[i + 1]), "+f"(x[i + 2]), "+f"(x[i + 3]), "+f"(x[i + 4]), "+f"(x[i + 5]), \
                      "+f"(x[i + 6]), "+f"(x[i + 7])
#define TA_ACC16(x) TA_ACC8(x, 0), TA_ACC8(x, 8)
#define TA_ACC32(x) TA_ACC16(x), TA_ACC8(x, 16), TA_ACC8(x, 24)

// S[64 x BN] (+)= A(desc) B(desc)^T, one k-step; both K-major. The k-step's descriptors are the bases plus
// immediates added inside the asm, so that only the two bases are live across the unrolled k-steps (descriptors
// computed ahead by the compiler would hold 4 registers a k-step).
template <uint32_t OA, uint32_t OB, int ACC>
__device__ __forceinline__ void wgmma_s(float (&s)[TA_BN / 2], uint64_t da, uint64_t db) {
#if TA_BN == 32
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 a, b;\nsetp.ne.b32 p, %18, 0;\nadd.s64 a, %16, %19;\nadd.s64 b, %17, %20;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TA_TYPE "." TA_TYPE
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, a, b, p, 1, 1, 0, 0;\n}"
      : TA_ACC16(s)
      : "l"(da), "l"(db), "n"(ACC), "n"(OA >> 4), "n"(OB >> 4));
#else
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 a, b;\nsetp.ne.b32 p, %34, 0;\nadd.s64 a, %32, %35;\nadd.s64 b, %33, %36;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TA_TYPE "." TA_TYPE
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, a, b, p, 1, 1, 0, 0;\n}"
      : TA_ACC32(s)
      : "l"(da), "l"(db), "n"(ACC), "n"(OA >> 4), "n"(OB >> 4));
#endif
}

// o[64 x 64] += P(registers, 16 keys) V(desc + OB, MN-major: 16 keys x 64 columns), one k-step of one column block
template <uint32_t OB>
__device__ __forceinline__ void wgmma_o(float* o, const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 b;\nsetp.ne.b32 p, 1, 0;\nadd.s64 b, %36, %37;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TA_TYPE "." TA_TYPE
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, b, p, 1, 1, 1;\n}"
      : TA_ACC32(o)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(OB >> 4));
}

// S[64 x BN] (+)= A(registers) B(desc + OB)^T, one k-step
template <uint32_t OB, int ACC>
__device__ __forceinline__ void wgmma_s_reg(float (&s)[TA_BN / 2], const uint32_t (&a)[4], uint64_t db) {
#if TA_BN == 32
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 b;\nsetp.ne.b32 p, %20, 0;\nadd.s64 b, %21, %22;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TA_TYPE "." TA_TYPE
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, b, p, 1, 1, 0;\n}"
      : TA_ACC16(s)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "n"(ACC), "l"(db), "n"(OB >> 4));
#else
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 b;\nsetp.ne.b32 p, %36, 0;\nadd.s64 b, %37, %38;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TA_TYPE "." TA_TYPE
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, b, p, 1, 1, 0;\n}"
      : TA_ACC32(s)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "n"(ACC), "l"(db), "n"(OB >> 4));
#endif
}

// the unrolled k-steps of S = Q K^T (k-step k: column block k / 4, 32 bytes a step inside it) and of O += P V
template <int K>
__device__ __forceinline__ void s_steps(float (&s)[TA_BN / 2], uint64_t dq, uint64_t dk) {
  if constexpr (K < TA_D / 16) {
    wgmma_s<(K >> 2) * TA_ROWS * 128 + (K & 3) * 32, (K >> 2) * TA_BN * 128 + (K & 3) * 32, (K > 0)>(s, dq, dk);
    s_steps<K + 1>(s, dq, dk);
  }
}
template <int K>
__device__ __forceinline__ void s_steps_reg(float (&s)[TA_BN / 2], const uint32_t (&qf)[TA_D / 16][4], uint64_t dk) {
  if constexpr (K < TA_D / 16) {
    wgmma_s_reg<(K >> 2) * TA_BN * 128 + (K & 3) * 32, (K > 0)>(s, qf[K], dk);
    s_steps_reg<K + 1>(s, qf, dk);
  }
}

// this thread's A fragments of q (its warp's 16 rows of the warpgroup's 64), k-step k: ldmatrix.x4 of rows
// 16 warp + lane % 16, 16-byte chunk 2 k + lane / 16 of the swizzled tile
__device__ __forceinline__ void load_q_frags(uint32_t (&qf)[TA_D / 16][4], uint32_t qs, int row0, int lane) {
#pragma unroll
  for (int k = 0; k < TA_D / 16; ++k) {
    const int r = row0 + (lane & 15), c = 2 * k + (lane >> 4);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(qf[k][0]), "=r"(qf[k][1]), "=r"(qf[k][2]), "=r"(qf[k][3])
                 : "r"(qs + tile_off(r, c, TA_ROWS)));
  }
}

template <int I>
__device__ __forceinline__ void o_steps(float (&o)[TA_D / 2], const uint32_t (&pa)[TA_BN / 16][4], uint64_t dv) {
  if constexpr (I < (TA_BN / 16) * TA_DB) {
    constexpr int kk = I / TA_DB, cb = I % TA_DB;  // 16 keys kk, 64 columns cb
    wgmma_o<cb * TA_BN * 128 + kk * 2048>(o + 32 * cb, pa[kk], dv);
    o_steps<I + 1>(o, pa, dv);
  }
}

// accumulators an asynchronous wgmma writes: kept in place and unread until it is waited for
template <int N>
__device__ __forceinline__ void keep(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void keep(uint32_t (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(d[i][j])::"memory");
}

// block b's stage s and its use u of that stage (the phase its barriers complete). A waiter on an mbarrier's parity
// must see every phase of it in order, so in halves, where consumer w takes the blocks b % 2 == w, each consumer
// has its own stages (w, w + 2, ...; one stage is left unused when their count is odd)
__device__ __forceinline__ void stage_of(int b, bool halves, int& s, int& u) {
  if (halves) {
    constexpr int h = TA_STAGES / 2;  // stages a consumer cycles through
    const int i = b >> 1;
    s = (b & 1) + 2 * (i % h);
    u = i / h;
  } else {
    s = b % TA_STAGES;
    u = b / TA_STAGES;
  }
}

// the consumers' turns (TA_PINGPONG): barrier 1 + w is consumer w's; the other consumer's 128 threads arrive on it
__device__ __forceinline__ void turn_wait(int w) {
  asm volatile("bar.sync %0, 256;" ::"r"(1 + w) : "memory");
}
__device__ __forceinline__ void turn_pass(int w) {
  asm volatile("bar.arrive %0, 256;" ::"r"(2 - w) : "memory");
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
#if TA_F16
  __half2 h = __floats2half2_rn(lo, hi);
#else
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
#endif
  return *reinterpret_cast<uint32_t*>(&h);
}

// a key row of the cache: token slot `slot`, KV head offset `head` (elements)
__device__ __forceinline__ const elem_t* cache_row(const elem_t* base, long long slot, int page, long long s_page,
                                                   long long s_off, long long head) {
  if (page == 1) return base + slot * s_page + head;
  return base + (slot / page) * s_page + (slot % page) * s_off + head;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(TA_THREADS, 1)
#if TA_CLUSTER == 2
__cluster_dims__(2, 1, 1)
#endif
    tree_attn_ws_kernel(
    const elem_t* __restrict__ q, const elem_t* __restrict__ k_cache, const elem_t* __restrict__ v_cache,
    const elem_t* __restrict__ k_new, const elem_t* __restrict__ v_new, const int* __restrict__ qo_indptr,
    const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices, const long long* __restrict__ tree_mask,
    const int* __restrict__ items, float* __restrict__ po, float* __restrict__ plse, float sm_scale_log2,
    long long s_qt, long long s_qh, long long s_kp, long long s_ko, long long s_kh, long long s_vp, long long s_vo,
    long long s_vh, long long s_knt, long long s_knh, long long s_vnt, long long s_vnh, int page) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int item = blockIdx.x, hk = blockIdx.y;
  const int req = items[4 * item];
  if (req < 0) return;  // an unused slot of a fixed-capacity schedule
  // the group, and (halves items taking two splits) the distance to the slot of the second split, whose LSE rows
  // this CTA sets to -inf so that the merge skips that slot
  const int group = items[4 * item + 1] & 0xFFFF, sibling = items[4 * item + 1] >> 16;
  const int lo = items[4 * item + 2], hi = items[4 * item + 3];
  const int q0 = qo_indptr[req], n = qo_indptr[req + 1] - q0;
  const int prefix_end = kv_indptr[req + 1] - (TA_NEW ? 0 : n);
  const bool tree = hi == prefix_end;  // this item also takes the tree block
  const int np = hi - lo;              // prefix keys
  const int nbp = (np + TA_BN - 1) / TA_BN;
  int nb = nbp + (tree ? (n + TA_BN - 1) / TA_BN : 0);  // key blocks: prefix, then tree
  if (TA_PROBE != 0 && nb > 1) nb = 1;                   // a probe reads block 0 only

  // the swizzled tiles need 1024-byte alignment (descriptor base offset 0): the first aligned byte of the window
  const uint32_t raw = smem_u32(smem), base = (raw + 1023u) & ~1023u;
  uint8_t* const sm = smem + (base - raw);
  const uint32_t qs = base, ring = base + Q_BYTES, bars = base + BAR_OFF;
  const int tid = threadIdx.x, wg = tid / 128, t = tid % 128;
  // two consumers on one tile's alternate key blocks: group g's second tile has no row
  auto in_halves = [&](int g) { return TA_C == 2 && g * TA_ROWS + 64 >= n * TA_G; };
  const bool halves = TA_PROBE == 0 && in_halves(group);  // (probes: tiles as they are)
#if TA_CLUSTER == 2
  // paired: the partner item (the other CTA of the cluster) is this request's other group over the same range
  const int* const pit = items + 4 * (item ^ 1);
  const int pgroup = pit[1] & 0xFFFF;
  const bool paired =
      pit[0] == req && pit[2] == lo && pit[3] == hi && pgroup != group && sibling == 0 && pit[1] >> 16 == 0;
  const bool phalves = in_halves(pgroup);  // the partner's consumers release as halves
  const uint32_t rank = cluster_rank(), peer = rank ^ 1u;
#else
  constexpr bool paired = false;
  constexpr bool phalves = false;
#endif
  if (tid == 0) {
    for (int s = 0; s < TA_STAGES; ++s) {
      // full: every producer thread's copies; paired, producer thread 0 once its own half has landed, and the
      // partner's half in bytes
      mbar_init(bars + FULL_K + 8 * s, paired ? 1 : TA_PTHREADS);
      mbar_init(bars + FULL_V + 8 * s, paired ? 1 : TA_PTHREADS);
      // empty: lane 0 of every consumer warp that reads the stage (one consumer's in halves), of both CTAs if paired
      const int releases = (halves ? 4 : 4 * TA_C) + (paired ? (phalves ? 4 : 4 * TA_C) : 0);
      mbar_init(bars + EMPTY_K + 8 * s, releases);
      mbar_init(bars + EMPTY_V + 8 * s, releases);
#if TA_CLUSTER == 2
      mbar_init(bars + HALF_K + 8 * s, TA_PTHREADS);  // this CTA's half of the stage
      mbar_init(bars + HALF_V + 8 * s, TA_PTHREADS);
#endif
    }
    mbar_init(bars + Q_FULL, TA_PTHREADS);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
#if TA_CLUSTER == 2
  if (paired) cluster_sync();  // the partner's mbarriers exist before any arrival or copy reaches them
#endif

  if (wg < TA_PWG) {
    // ---------------------------------------------------------------- producer
#if TA_SETMAXNREG
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(TA_PREGS));
#endif
    constexpr int CH = TA_D / 8, RP = TA_PTHREADS / CH;  // 16-byte chunks per row, rows per pass of the producers
    const int r0 = tid / CH, cc = tid % CH;               // this thread: chunk cc of rows r0, r0 + RP, ...
    // q rows of the group: row m -> node (group 64 C + m) / G, head hk G + (group 64 C + m) % G
    for (int r = r0; r < TA_ROWS; r += RP) {
      const int m = group * TA_ROWS + r, node = m / TA_G;
      const bool ok = node < n;
      const elem_t* src = q + (ok ? (long long)(q0 + node) * s_qt + (long long)(hk * TA_G + m % TA_G) * s_qh : 0) +
                          cc * 8;
      cp16(qs + tile_off(r, cc, TA_ROWS), src, ok ? 16u : 0u);
    }
#if TA_PHASE == 2
    mbar_arrive(bars + Q_FULL);
#else
    cp_arrive(bars + Q_FULL);
#endif
    // The slots of block b's rows are loaded a block ahead of their copies, one load a lane: lane cc % PER of a row
    // group (the CH threads of rows r0, r0 + RP, ...; PER <= CH) holds the slot of row r0 + RP (cc % PER), and the
    // group reads the others by shuffle. A slot loaded just before its copies would wait a load's latency per block:
    // the copies' asm orders memory, so nothing moves the load earlier.
    constexpr int PER = TA_BN / RP;
    static_assert(PER >= 1 && PER <= CH, "a row group holds one block's slots, one a lane");
    // paired: this CTA's half of each block, rows [rank BN / 2, (rank + 1) BN / 2)
    const int per = paired ? PER / 2 : PER;
#if TA_CLUSTER == 2
    const int jbase = paired ? (int)rank * (TA_BN / 2) : 0;
#else
    constexpr int jbase = 0;
#endif
    const int gbase = t % 32 - cc;  // the first lane of this thread's row group in its warp
    auto slot_of = [&](int b) {     // -1: no key (past the range, past the nodes, past the last block)
      const int j = jbase + r0 + (cc % per) * RP;
      int slot = -1;
      if (b < nbp) {
        const int at = lo + b * TA_BN + j;
        if (at < hi) slot = kv_indices[at];
      } else if (b < nb) {
        const int node = (b - nbp) * TA_BN + j;
#if TA_NEW
        if (node < n) slot = node;
#else
        if (node < n) slot = kv_indices[prefix_end + node];
#endif
      }
      return slot;
    };
#if TA_CLUSTER == 2
    // paired, producer thread 0: the halves whose copies were issued (issued[v] blocks of K, v = 0, and of V) and
    // the next one to forward to the partner (fwd[v]), in block order
    int issued[2] = {0, 0}, fwd[2] = {0, 0};
    auto forward = [&](int v) {  // block fwd[v]'s half, which has landed
      int s, u;
      stage_of(fwd[v]++, halves, s, u);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the cp.async writes, read by the bulk copy
      const uint32_t src = ring + s * STAGE_BYTES + (v ? KV_BYTES : 0) + rank * HALF_ROWS_BYTES;
      const uint32_t full = bars + (v ? FULL_V : FULL_K) + 8 * s, pfull = peer_addr(full, peer);
#pragma unroll
      for (int cb = 0; cb < TA_DB; ++cb)
        bulk_to_peer(peer_addr(src + cb * TA_BN * 128, peer), src + cb * TA_BN * 128, HALF_ROWS_BYTES, pfull);
      mbar_arrive_tx(full, TA_DB * HALF_ROWS_BYTES);  // this CTA's half is in; the partner's is owed in bytes
    };
    auto landed = [&](int v, bool wait) {  // block fwd[v]'s half has landed (wait: once it has)
      int s, u;
      stage_of(fwd[v], halves, s, u);
      const uint32_t half = bars + (v ? HALF_V : HALF_K) + 8 * s;
      if (wait) mbar_wait(half, u & 1);
      return wait || mbar_test(half, u & 1);
    };
    auto forward_landed = [&]() {  // every half that has landed, without waiting
      for (int v = 0; v < 2; ++v)
        while (fwd[v] < issued[v] && landed(v, false)) forward(v);
    };
    auto forward_all = [&]() {  // every half issued, waiting for each to land (after the last load)
      for (int v = 0; v < 2; ++v)
        while (fwd[v] < issued[v]) {
          landed(v, true);
          forward(v);
        }
    };
#endif
    // one load: K (v = 0) or V (v = 1) of block b, whose slots `mine` holds, into its stage, after the consumers
    // released that stage's last use
    auto load = [&](int b, int v, int mine) {
      int s, u;
      stage_of(b, halves, s, u);
#if TA_PHASE != 3  // (the copies alone wait for nothing)
      if (u > 0) {
        const uint32_t empty = bars + (v ? EMPTY_V : EMPTY_K) + 8 * s;
#if TA_CLUSTER == 2
        // the stage may wait on the partner's consumers, and they on this CTA's forwards: until it is released,
        // thread 0 forwards each half as it lands, never waiting for one (the stage may be released first)
        if (paired && tid == 0)
          while (!mbar_test(empty, (u + 1) & 1)) forward_landed();
#endif
        mbar_wait(empty, (u + 1) & 1);
      }
#endif
      const uint32_t full = bars + (v ? FULL_V : FULL_K) + 8 * s;
#if TA_PHASE == 2
      mbar_arrive(full);  // the consumers alone: nothing copied
      return;
#endif
      const uint32_t dst = ring + s * STAGE_BYTES + (v ? KV_BYTES : 0);
      const elem_t* cache = v ? v_cache : k_cache;
      const long long s_p = v ? s_vp : s_kp, s_o = v ? s_vo : s_ko, head = hk * (v ? s_vh : s_kh);
#pragma unroll 8  // (16 rows unrolled: their addresses spill at the producer's 56 registers)
      for (int i = 0; i < per; ++i) {
        const int j = jbase + r0 + i * RP, slot = __shfl_sync(0xffffffffu, mine, gbase + i);
        const bool ok = slot >= 0;
        const elem_t* row = cache;
#if TA_NEW
        if (ok && b >= nbp)
          row = v ? v_new + (long long)(q0 + slot) * s_vnt + hk * s_vnh
                  : k_new + (long long)(q0 + slot) * s_knt + hk * s_knh;
        else if (ok)
          row = cache_row(cache, slot, page, s_p, s_o, head);
#else
        if (ok) row = cache_row(cache, slot, page, s_p, s_o, head);
#endif
        cp16(dst + tile_off(j, cc, TA_BN), row + cc * 8, ok ? 16u : 0u);
      }
#if TA_CLUSTER == 2
      if (paired) {
        cp_arrive(bars + (v ? HALF_V : HALF_K) + 8 * s);
        if (tid == 0) {
          ++issued[v];
          forward_landed();
        }
        return;
      }
#endif
      cp_arrive(full);
    };
    int cur = slot_of(0), nxt = slot_of(1);  // block b's slots and block b + 1's
#if TA_KV_AHEAD
    if (nb > 0) load(0, 0, cur);
    for (int b = 0; b < nb; ++b) {
      if (b + 1 < nb) load(b + 1, 0, nxt);
      load(b, 1, cur);
      cur = nxt;
      nxt = slot_of(b + 2);
    }
#else
    for (int b = 0; b < nb; ++b) {
      load(b, 0, cur);
      load(b, 1, cur);
      cur = nxt;
      nxt = slot_of(b + 2);
    }
#endif
#if TA_CLUSTER == 2
    if (paired && tid == 0) forward_all();
#endif
    asm volatile("cp.async.wait_all;" ::: "memory");
#if TA_CLUSTER == 2
    if (paired) cluster_sync();  // (the consumers' meeting below)
#endif
    return;
  }

  // ------------------------------------------------------------------ consumers
#if TA_SETMAXNREG
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(TA_CREGS));
#endif
  if (TA_PHASE == 3) return;  // the copies alone
  const int w = wg - TA_PWG, warp = t / 32, lane = t % 32;
  const int tile = halves ? 0 : w;                       // the group's row tile this warpgroup computes
  const int row_a = 64 * tile + 16 * warp + lane / 4;  // this thread's rows: row_a and row_a + 8 of the group
  const int b0 = halves ? w : 0, bstep = halves ? 2 : 1;  // its key blocks: b0, b0 + bstep, ...
#if TA_PINGPONG
  // consumer 0 issues first; consumer 1 passes the turn after every block but its last, so that every wait of
  // either has exactly one pass of the other (nothing is left pending on a barrier at exit); not in halves, where
  // the consumers take turns by their blocks already
  if (w == 1 && !halves) turn_pass(1);
#endif
  float o[TA_D / 2];
#pragma unroll
  for (int i = 0; i < TA_D / 2; ++i) o[i] = 0.f;
  float m_run[2] = {-TA_INF, -TA_INF}, l_run[2] = {0.f, 0.f};

  mbar_wait(bars + Q_FULL, 0);
  const uint32_t qa = qs + tile * 64 * 128;  // this warpgroup's 64 rows in every column block
#if TA_QREG
  uint32_t qf[TA_D / 16][4];
  load_q_frags(qf, qs, 64 * tile + 16 * warp, lane);
#endif

  // block b's stage (s) and the parity of its use
  auto stage = [&](int b, int& st) {
    int u;
    stage_of(b, halves, st, u);
    return (uint32_t)(u & 1);
  };
  // block b's stage, once its K (full = FULL_K) or V (FULL_V) has landed; the cp.async writes then reach the wgmma
  auto await_full = [&](int b, uint32_t full) {
    int st;
    const uint32_t parity = stage(b, st);
    mbar_wait(bars + full + 8 * st, parity);
#if TA_FENCE
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
    return st;
  };
  // S = Q K^T of block b, issued (one wgmma group); waits for its K
  auto score = [&](int b, float (&sc)[TA_BN / 2]) {
    const int st = await_full(b, FULL_K);
    const uint32_t ks = ring + st * STAGE_BYTES;
#pragma unroll
    for (int i = 0; i < TA_BN / 2; ++i) sc[i] = 0.f;
#if TA_PINGPONG
    if (!halves) turn_wait(w);
#endif
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#if TA_QREG
    keep(qf);
    s_steps_reg<0>(sc, qf, desc128(ks, 16, 1024));
#else
    s_steps<0>(sc, desc128(qa, 16, 1024), desc128(ks, 16, 1024));
#endif
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#if TA_PINGPONG
    if (!halves && (w == 0 || b + 1 < nb)) turn_pass(w);
#endif
  };
  // the online softmax of block b in base 2 over S's registers: P into pa, each row's rescale factor into alpha;
  // returns whether some row of the warp has a new maximum
  auto softmax = [&](int b, float (&sc)[TA_BN / 2], uint32_t (&pa)[TA_BN / 16][4], float (&alpha)[2]) {
    // sc[4 j + i]: row row_a + 8 (i / 2), key 8 j + 2 (lane % 4) + i % 2 of the block
    const bool ragged = b == nbp - 1 && (np % TA_BN) != 0;
    const bool in_tree = b >= nbp;
    const int key0 = in_tree ? (b - nbp) * TA_BN : b * TA_BN;
    float mx[2] = {m_run[0], m_run[1]};
    if (ragged || in_tree) {
      // column 8 j + e (e = 0, 1) of this thread is key key0 + 2 (lane % 4) + 8 j + e: seen when below the limit
      // and, in the tree block, when its bit is set in the row's ancestor word (shifted so the test is by a constant)
      const int sh = key0 + 2 * (lane % 4), rem = (in_tree ? n : np) - sh;
      mword_t bits[2] = {~(mword_t)0, ~(mword_t)0};
      if (in_tree) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int node = (group * TA_ROWS + row_a + 8 * h) / TA_G;
          bits[h] = node < n ? (mword_t)((unsigned long long)tree_mask[q0 + node] >> sh) : 0;
        }
      }
#pragma unroll
      for (int j = 0; j < TA_BN / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int e = 8 * j + (i % 2);
          const bool seen = e < rem && ((bits[i / 2] >> e) & 1);
          const float x = seen ? sc[4 * j + i] * sm_scale_log2 : -TA_INF;
          sc[4 * j + i] = x;
          mx[i / 2] = fmaxf(mx[i / 2], x);
        }
    } else {
#pragma unroll
      for (int j = 0; j < TA_BN / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float x = sc[4 * j + i] * sm_scale_log2;
          sc[4 * j + i] = x;
          mx[i / 2] = fmaxf(mx[i / 2], x);
        }
    }
    float mu[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      mu[h] = mx[h] == -TA_INF ? 0.f : mx[h];  // a row that has seen nothing yet stays finite
      alpha[h] = mx[h] == m_run[h] ? 1.f : ex2(m_run[h] - mu[h]);  // exactly 1 where the row's max held
      m_run[h] = mx[h];
      l_run[h] *= alpha[h];
    }
#pragma unroll
    for (int j = 0; j < TA_BN / 8; ++j) {
      float p[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        p[i] = ex2(sc[4 * j + i] - mu[i / 2]);
        l_run[i / 2] += p[i];
      }
#if TA_PROBE == 2
#pragma unroll
      for (int i = 0; i < 4; ++i) p[i] = (8 * j + 2 * (lane % 4) + (i % 2)) == (row_a + 8 * (i / 2)) % TA_BN ? 1.f : 0.f;
#endif
      // A fragment of k-step j / 2: rows (g, g + 8) x keys (2 (lane % 4), + 8) of its 16
      pa[j / 2][2 * (j % 2) + 0] = pack2(p[0], p[1]);
      pa[j / 2][2 * (j % 2) + 1] = pack2(p[2], p[3]);
    }
    // O is rescaled only where some row of the warp has a new maximum (past the first blocks, seldom)
    return __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f);
  };
  auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < TA_D / 8; ++j) {
      o[4 * j + 0] *= alpha[0];
      o[4 * j + 1] *= alpha[0];
      o[4 * j + 2] *= alpha[1];
      o[4 * j + 3] *= alpha[1];
    }
  };
  // O += P V of block b, issued (one wgmma group); waits for its V
  auto pv = [&](int b, uint32_t (&pa)[TA_BN / 16][4]) {
    const int st = await_full(b, FULL_V);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    keep(o);
    keep(pa);
    o_steps<0>(o, pa, desc128(ring + st * STAGE_BYTES + KV_BYTES, TA_BN * 128, 1024));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  };
  auto release = [&](int b, uint32_t empty) {
    int st;
    stage(b, st);
    if (lane == 0) {
      mbar_arrive(bars + empty + 8 * st);
#if TA_CLUSTER == 2
      if (paired) peer_arrive(peer_addr(bars + empty + 8 * st, peer));  // the partner's copies fill it too
#endif
    }
  };

#if TA_PHASE == 1
  // the producer alone: every stage is released as it lands (no wgmma, no softmax)
  for (int b = b0; b < nb; b += bstep) {
    await_full(b, FULL_K);
    release(b, EMPTY_K);
    await_full(b, FULL_V);
    release(b, EMPTY_V);
  }
#elif TA_OVERLAP && !TA_PROBE
  // S of block b is issued before P V of the block before it, and the softmax of b runs while that P V does
  if (b0 < nb) {
    float sc[TA_BN / 2], alpha[2];
    uint32_t pa[TA_BN / 16][4], pn[TA_BN / 16][4];
    score(b0, sc);
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    keep(sc);
    release(b0, EMPTY_K);
    softmax(b0, sc, pa, alpha);  // O is zero: nothing to rescale
    int prev = b0;
    for (int b = b0 + bstep; b < nb; b += bstep) {
      score(b, sc);
      pv(prev, pa);
      asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");  // S of b (the older group) is done
      keep(sc);
      release(b, EMPTY_K);
      const bool re = softmax(b, sc, pn, alpha);
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");  // P V of prev is done
      keep(o);
      keep(pa);
      release(prev, EMPTY_V);
      if (re) rescale(alpha);
#pragma unroll
      for (int k = 0; k < TA_BN / 16; ++k)
#pragma unroll
        for (int i = 0; i < 4; ++i) pa[k][i] = pn[k][i];
      prev = b;
    }
    pv(prev, pa);
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    keep(o);
    keep(pa);
    release(prev, EMPTY_V);
  }
#else
  for (int b = b0; b < nb; b += bstep) {
    float sc[TA_BN / 2], alpha[2];
    uint32_t pa[TA_BN / 16][4];
    score(b, sc);
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    keep(sc);
    release(b, EMPTY_K);  // K is read: its slot may take the next K
#if TA_PROBE == 1
    {
      float* dst = po + (((long long)item * gridDim.y + hk) * TA_ROWS + row_a) * TA_D + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < TA_BN / 8; ++j) {
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(sc[4 * j], sc[4 * j + 1]);
        *reinterpret_cast<float2*>(dst + 8 * TA_D + 8 * j) = make_float2(sc[4 * j + 2], sc[4 * j + 3]);
      }
      return;
    }
#endif
    if (softmax(b, sc, pa, alpha)) rescale(alpha);
    pv(b, pa);
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    keep(o);
    keep(pa);
    release(b, EMPTY_V);
#if TA_PROBE == 2
    l_run[0] = l_run[1] = 0.25f;  // the 4 threads of a row sum to 1 below: po = O
    m_run[0] = m_run[1] = 0.f;
    break;
#endif
  }
#endif

#pragma unroll
  for (int h = 0; h < 2; ++h) {  // the row's sum over its 4 threads
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
#if TA_CLUSTER == 2
  // both CTAs' loops are done: every forward of this CTA was read (its partner waited for it), every arrival of the
  // partner's has reached this CTA, and the ring may take the halves' exchange below
  if (paired) cluster_sync();
#endif
#if TA_C == 2 && TA_PROBE == 0
  if (halves) {
    // consumer 1's O, m and l to consumer 0, thread for thread (same fragment positions): O in the q tile's bytes
    // (64 rows x D fp32 = 128 rows x D bf16), m and l in the ring's; both are free once both loops are done
    float* xo = reinterpret_cast<float*>(sm);
    float* xm = reinterpret_cast<float*>(sm + Q_BYTES);
    asm volatile("bar.sync 3, 256;" ::: "memory");
    if (w == 1) {
#pragma unroll
      for (int i = 0; i < TA_D / 2; ++i) xo[i * 128 + t] = o[i];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        xm[(2 * h) * 128 + t] = m_run[h];
        xm[(2 * h + 1) * 128 + t] = l_run[h];
      }
    }
    asm volatile("bar.sync 3, 256;" ::: "memory");
    if (w == 1) return;
    float a0[2], a1[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m1 = xm[(2 * h) * 128 + t], l1 = xm[(2 * h + 1) * 128 + t];
      const float mx = fmaxf(m_run[h], m1), mu = mx == -TA_INF ? 0.f : mx;
      a0[h] = ex2(m_run[h] - mu);
      a1[h] = ex2(m1 - mu);
      l_run[h] = l_run[h] * a0[h] + l1 * a1[h];
      m_run[h] = mx;
    }
#pragma unroll
    for (int j = 0; j < TA_D / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[4 * j + i] = o[4 * j + i] * a0[i / 2] + xo[(4 * j + i) * 128 + t] * a1[i / 2];
  }
#endif

  // ---- the partial: O / l and m + log2(l), rows of the group
  const float inv[2] = {l_run[0] > 0.f ? 1.f / l_run[0] : 0.f, l_run[1] > 0.f ? 1.f / l_run[1] : 0.f};
  const long long row0 = ((long long)item * gridDim.y + hk) * TA_ROWS;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const long long row = row0 + row_a + 8 * h;
    float* dst = po + row * TA_D + 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < TA_D / 8; ++j)
      *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[4 * j + 2 * h] * inv[h], o[4 * j + 2 * h + 1] * inv[h]);
    if (lane % 4 == 0) plse[row] = (l_run[h] > 0.f ? m_run[h] : 0.f) + log2f(l_run[h] > 0.f ? l_run[h] : 1.f);
    if (sibling != 0 && lane % 4 == 0) plse[row + (long long)sibling * gridDim.y * TA_ROWS] = -TA_INF;
  }
}

// shared memory bytes of this build (read by the launch layer)
extern "C" __device__ const uint32_t tree_attn_ws_smem_bytes = 1024 + BAR_OFF + BAR_BYTES;  // + the alignment
