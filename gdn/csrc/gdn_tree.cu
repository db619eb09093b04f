// Tree verification for Gated DeltaNet layers in WY form, one CTA per (V block, value head, request).
//
// Per value head, nodes topologically ordered, D_ij = exp(G_i - G_j) over ancestors (docs/gdn.md):
//   M = scale (q k^T o D) on ancestors-or-self, A = beta (k k^T o D) on proper ancestors,
//   N = M (I + A)^-1,  rhs = beta (V - exp(G) (K S0)),  O = exp(G) scale (Q S0) + N rhs.
// Warps 0..NWM-1 do the tensor-core products (mma.sync m16n8k16, bf16 q/k exact, the fp32 state
// split into PIECES bf16 pieces); warp NWM (the solver) builds N by substitution, one row per lane:
//   N[i][j] = M[i][j] - sum_{l > j} N[i][l] A[l][j]   (columns right to left; rows independent).
// Substitution is as accurate as a triangular solve for any keys (no growing powers), and the
// solve runs beside the state products. With GDN_PDL the CTA prefetches its rows into L2 before
// griddepcontrol.wait: only the prefetches' addresses (cu, state_indices, clamped into the tensors)
// are read before the wait, and every value the kernel computes with is loaded after it.
#include <cuda_bf16.h>
#ifdef __CUDACC_RTC__
typedef unsigned int uint32_t;  // NVRTC has no C library headers
#else
#include <stdint.h>
#endif

#ifndef GDN_NT
#define GDN_NT 32  // node tile (16 or 32): nodes per request <= NT
#endif
#ifndef GDN_K
#define GDN_K 128
#endif
#ifndef GDN_BV
#define GDN_BV 32  // state columns per CTA: one 8-column n-tile per mma warp
#endif
#ifndef GDN_PIECES
#define GDN_PIECES 3  // bf16 pieces of the fp32 state (3: all 24 mantissa bits)
#endif
#ifndef GDN_L2
#define GDN_L2 1
#endif
#ifndef GDN_VK
#define GDN_VK 0  // state layout: 0 [K, V] (fla), 1 [V, K] (SGLang)
#endif
#ifndef GDN_GDT
#define GDN_GDT 0  // g dtype: 0 fp32, 1 bf16, 2 fp16
#endif
#ifndef GDN_BDT
#define GDN_BDT 1  // beta dtype, same codes
#endif
#ifndef GDN_ODT
#define GDN_ODT 1  // output dtype: 0 fp32, 1 bf16
#endif
#ifndef GDN_IDX64
#define GDN_IDX64 0
#endif
#ifndef GDN_PDL
#define GDN_PDL 0
#endif
#ifndef GDN_SKIP
#define GDN_SKIP 0  // diagnostic, WRONG outputs: 1 exit after the wait, 8 exit after the loads, 2 no solve, 4 no state products
#endif
#ifndef GDN_UNROLL_OUT
#define GDN_UNROLL_OUT 4  // unroll of the N.rhs loop (code size: each CTA runs its code once, so fetching it counts)
#endif
#ifndef GDN_UNROLL_KS
#define GDN_UNROLL_KS 8  // unroll of the state products' k-steps
#endif
#ifndef GDN_SPLITW
#define GDN_SPLITW 0  // 1: half the mma warps do norms/gram/M,A while the other half do the state products
#endif
#ifndef GDN_TRACE
#define GDN_TRACE 0  // diagnostic: thread 0 stamps %globaltimer / clock64 at the phase boundaries into `trace`
#endif
#ifndef GDN_MINB
#define GDN_MINB 2
#endif

namespace {

constexpr int NT = GDN_NT, K = GDN_K, BV = GDN_BV, PIECES = GDN_PIECES;
constexpr int UNROLL_OUT = GDN_UNROLL_OUT, UNROLL_KS = GDN_UNROLL_KS;
constexpr bool VK = GDN_VK != 0;
constexpr int NWM = BV / 8;           // mma warps
constexpr int NTHR = 32 * (NWM + 1);  // + the solver warp
constexpr int MMA_THR = 32 * NWM;
constexpr bool SW = GDN_SPLITW != 0;
constexpr int NWG = SW ? NWM / 2 : NWM;  // warps doing norms, gram and the M/A build
constexpr int G_THR = 32 * NWG;
constexpr int NTPW = SW ? 2 : 1;         // 8-column state tiles per product warp
static_assert(!SW || (NWM >= 2 && NWM % 2 == 0), "split warps need an even number of mma warps");
constexpr int MT = 2 * NT / 16;  // m-tiles of the stacked [Q; K] rows
constexpr int KS = K / 16;       // k-steps
constexpr int QK_LD = K + 8;     // bf16; 16-byte pad: conflict-free ldmatrix
constexpr int S_ROWS = VK ? BV : K;
constexpr int S_LD = VK ? K + 8 : BV + 4;  // fp32; conflict-free fragment loads
constexpr int G_LD = NT + 1;               // gram, M/N (scalar accesses)
constexpr int A_LD = NT + 4;               // A rows read as float4 broadcasts by the solver
constexpr int R_LD = BV + 8;               // rhs and the scaled Q S0
constexpr int V_LD = BV + 8;               // bf16

static_assert(NT == 16 || NT == 32, "node tile 16 or 32");
static_assert(K % 32 == 0 && K <= 256, "K: a multiple of 32, at most 256");
static_assert(BV % 8 == 0 && NWM >= 1 && NWM <= 8, "BV: 8 to 64, a multiple of 8");
static_assert(PIECES == 2 || PIECES == 3, "2 or 3 bf16 pieces");

__host__ __device__ constexpr int al16(int x) { return (x + 15) & ~15; }
constexpr int OFF_QK = 0;
constexpr int OFF_S = al16(OFF_QK + 2 * NT * QK_LD * 2);
constexpr int OFF_GRAM = al16(OFF_S + S_ROWS * S_LD * 4);
constexpr int OFF_MN = al16(OFF_GRAM + 2 * NT * G_LD * 4);
constexpr int OFF_AT = al16(OFF_MN + NT * G_LD * 4);
constexpr int OFF_R = al16(OFF_AT + NT * A_LD * 4);
constexpr int OFF_QS = al16(OFF_R + NT * R_LD * 4);
constexpr int OFF_V = al16(OFF_QS + NT * R_LD * 4);
constexpr int OFF_ANC = al16(OFF_V + NT * V_LD * 2);
constexpr int OFF_VEC = al16(OFF_ANC + NT * 4);  // G, exp(G), beta, rq (scale folded in), rk
constexpr int SMEM_BYTES = al16(OFF_VEC + 5 * NT * 4);

__device__ __forceinline__ float ld_real(const void* p, long long off, int dt) {
  if (dt == 0) return static_cast<const float*>(p)[off];
  if (dt == 1) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[off]);
  return __half2float(static_cast<const __half*>(p)[off]);
}

__device__ __forceinline__ long long ld_index(const void* p, int b) {
#if GDN_IDX64
  return static_cast<const long long*>(p)[b];
#else
  return static_cast<const int*>(p)[b];
#endif
}

// The shared-memory helpers take 32-bit shared addresses (a base from one cvta plus int offsets): a generic
// pointer converted at each call left NVRTC 13.0 with 64-bit address arithmetic per ldmatrix/cp.async
// (+77 SASS instructions in the state products, +85 in norms/gram of the default build, vs nvcc 13.0).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool full) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(full ? 16 : 0));
}

#if GDN_PDL  // used only before griddepcontrol.wait
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
#endif

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], unsigned s) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], unsigned s) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(s));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 t = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<uint32_t*>(&t);
}

// x = hi + mid + lo exactly for |x| in [2^-110, 3.39e38] (bf16's largest finite; tests/gdn/test_gdn_cuda.py): each
// residual is exact in fp32, each piece holds 8 significant bits; two pieces keep 16 (relative error <= 2^-16)
__device__ __forceinline__ void split_pair(float x0, float x1, uint32_t (&p)[3]) {
  const float h0 = __bfloat162float(__float2bfloat16_rn(x0)), h1 = __bfloat162float(__float2bfloat16_rn(x1));
  const float r0 = x0 - h0, r1 = x1 - h1;
  const float m0 = __bfloat162float(__float2bfloat16_rn(r0)), m1 = __bfloat162float(__float2bfloat16_rn(r1));
  p[0] = pack_bf16(h0, h1);
  p[1] = pack_bf16(m0, m1);
  p[2] = pack_bf16(r0 - m0, r1 - m1);
}

__device__ __forceinline__ void store_out4(void* o, long long off, float4 a) {
#if GDN_ODT == 1
  *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(o) + off) = make_uint2(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w));
#else
  *reinterpret_cast<float4*>(static_cast<float*>(o) + off) = a;
#endif
}

__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

#if GDN_TRACE
__device__ __forceinline__ long long gtimer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif

__device__ __forceinline__ float bf_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// Bit 15 / bit 31 set where the low / high bf16 of `w` is Inf or NaN (exponent all ones: adding 1 to the
// masked exponent carries into the bit above it, and never across halves).
__device__ __forceinline__ uint32_t nonfinite_bf16x2(uint32_t w) {
  return ((w & 0x7f807f80u) + 0x00800080u) & 0x80008000u;
}


// One row of N (a lane): columns right to left. Once column L is final, every column j < L takes its term
// N[L] A[L][j] (row L of A); the updates of one step are independent, so the FMA pipeline stays full while the
// chain N[L] -> N[L-1] is one FMA per column. Same summation order as N[j] = M[j] - sum_{l > j} N[l] A[l][j].
// Compile-time recursion keeps nr[] in registers (a run-time index would move it to local memory).
template <int L>
__device__ __forceinline__ void solve_columns(float (&nr)[NT], const float* __restrict__ a) {
  if constexpr (L >= 1) {
    const float4* row = reinterpret_cast<const float4*>(a + L * A_LD);
    const float nl = -nr[L];
#pragma unroll
    for (int c4 = (L - 1) / 4; c4 >= 0; --c4) {
      const float4 t = row[c4];
      const float av[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
      for (int e = 3; e >= 0; --e)
        if (4 * c4 + e < L) nr[4 * c4 + e] = fmaf(nl, av[e], nr[4 * c4 + e]);
    }
    solve_columns<L - 1>(nr, a);
  }
}

}  // namespace

extern "C" __device__ unsigned int gdn_tree_smem_bytes = SMEM_BYTES;  // read by the launcher

extern "C" __global__ void __launch_bounds__(NTHR, GDN_MINB) gdn_tree_cuda_kernel(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
    const void* __restrict__ g, const void* __restrict__ beta, void* __restrict__ o,
    const float* __restrict__ pool, const void* __restrict__ state_idx, const int* __restrict__ cu,
    const long long* __restrict__ anc, float scale, int hv_per_h, int total_nodes, int pool_rows, long long s_qt,
    long long s_qh, long long s_kt, long long s_kh, long long s_vt, long long s_vh, long long s_gt, long long s_gh,
    long long s_bt, long long s_bh, long long s_ot, long long s_oh, long long s_sp, long long s_sh, long long s_sk,
    long long s_sv, int* __restrict__ err, long long* __restrict__ trace) {
  extern __shared__ __align__(16) unsigned char smem[];
  // Guards (gdn/guard.py): a state index outside [0, pool_rows) skips the CTA (outputs not written) and ORs 1
  // into err, more nodes than NT ORs 128 (skipped too); a gate g > 0 ORs 64. A non-finite q, k, v, g or beta
  // must not reach another node through the dense products (0 x NaN is NaN), and the nodes it reaches get NaN
  // outputs. g, beta and v entries become 0 where they are read (registers); a q row's NaN stays in its own rows
  // of the products (M, N, Q S0: row-independent), and a k row's is cut where rows meet: its entries of A and
  // its rhs row become 0. Found on the way: the norms' sum of squares (non-finite for such a row; an exact test
  // only then), v in the rhs epilogue, g and beta in the gate pass. Nothing on the path of finite inputs but
  // those reads, no extra pass or barrier.
  // sBad[0] bit i: q row i held one (that node alone), sBad[1] bit i: k, v, g or beta of node i (its subtree),
  // sBad[2] bit i: k row i held one.
  __shared__ unsigned sBad[3];
  __nv_bfloat16* sQK = reinterpret_cast<__nv_bfloat16*>(smem + OFF_QK);  // [2NT, QK_LD]: q rows, then k rows
  float* sS = reinterpret_cast<float*>(smem + OFF_S);                     // [K, S_LD] or [BV, S_LD] (VK)
  float* sGram = reinterpret_cast<float*>(smem + OFF_GRAM);               // [2NT, G_LD]: q.k^T, then k.k^T
  float* sMN = reinterpret_cast<float*>(smem + OFF_MN);                   // [NT, G_LD]: M, then N in place
  float* sA = reinterpret_cast<float*>(smem + OFF_AT);                    // [NT, A_LD]: A (rows read as float4)
  float* sR = reinterpret_cast<float*>(smem + OFF_R);                     // [NT, R_LD]: rhs
  float* sQS = reinterpret_cast<float*>(smem + OFF_QS);                   // [NT, R_LD]: exp(G) rq (Q S0)
  __nv_bfloat16* sV = reinterpret_cast<__nv_bfloat16*>(smem + OFF_V);    // [NT, V_LD]
  unsigned* sAnc = reinterpret_cast<unsigned*>(smem + OFF_ANC);          // [NT] ancestor-or-self bits
  const unsigned aSmem = static_cast<unsigned>(__cvta_generic_to_shared(smem));  // 32-bit shared addresses
  const unsigned aQK = aSmem + OFF_QK, aS = aSmem + OFF_S, aV = aSmem + OFF_V;
  float* sG = reinterpret_cast<float*>(smem + OFF_VEC);                   // [NT] root-path gate sums
  float* sEG = sG + NT;                                                   // [NT] exp(G)
  float* sBeta = sEG + NT;                                                // [NT]
  float* sRq = sBeta + NT;                                                // [NT] scale / |q|
  float* sRk = sRq + NT;                                                  // [NT] 1 / |k|

  const int vb = blockIdx.x, hv = blockIdx.y, b = blockIdx.z;
  const int h = hv / hv_per_h;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
#if GDN_TRACE
  long long* tr = trace + ((static_cast<long long>(b) * gridDim.y + hv) * gridDim.x + vb) * 10;
#define GDN_STAMP(slot, expr) \
  if (tid == 0) tr[slot] = (expr)
#else
#define GDN_STAMP(slot, expr)
#endif
  GDN_STAMP(0, gtimer());

  {
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < SMEM_BYTES) __trap();  // launched with less shared memory than the layout needs
  }

#if GDN_PDL
  {
    // L2 prefetch of the state rows (and q/k/v rows) while the previous kernel finishes. Values read
    // here may be stale; they only pick addresses, clamped to stay inside the tensors.
    long long si = ld_index(state_idx, b);
    si = si < 0 ? 0 : (si >= pool_rows ? pool_rows - 1 : si);
    const float* s0 = pool + si * s_sp + hv * s_sh + static_cast<long long>(vb) * BV * s_sv;
    constexpr int ROW_BYTES = (VK ? K : BV) * 4, LINES = (ROW_BYTES + 127) / 128;
#pragma unroll 1
    for (int t = tid; t < S_ROWS * LINES; t += NTHR) {
      const int r = t / LINES, c = (t % LINES) * 32;
      prefetch_l2(VK ? s0 + r * s_sv + c : s0 + r * s_sk + c);
    }
    int bos = cu[b], n = cu[b + 1] - bos;
    bos = bos < 0 ? 0 : (bos >= total_nodes ? total_nodes - 1 : bos);
    n = n < 0 ? 0 : (n > NT ? NT : n);
    n = bos + n > total_nodes ? total_nodes - bos : n;
#pragma unroll 1
    for (int t = tid; t < n * 4; t += NTHR) {
      const int i = t / 4, w = t % 4;
      if (w == 0) prefetch_l2(q + (bos + i) * s_qt + h * s_qh);
      else if (w == 1) prefetch_l2(k + (bos + i) * s_kt + h * s_kh);
      else if (w == 2) prefetch_l2(v + (bos + i) * s_vt + hv * s_vh + vb * BV);
      else {
        prefetch_l2(static_cast<const char*>(g) + ((bos + i) * s_gt + hv * s_gh) * (GDN_GDT ? 2 : 4));
        prefetch_l2(static_cast<const char*>(beta) + ((bos + i) * s_bt + hv * s_bh) * (GDN_BDT ? 2 : 4));
      }
    }
    if (tid == 0) prefetch_l2(anc + bos);
  }
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  GDN_STAMP(1, gtimer());
  GDN_STAMP(2, clock64());

  if (GDN_SKIP & 1) return;
  const int bos = cu[b], n = cu[b + 1] - bos;  // the launcher sizes NT from the plan's max_nodes (n > NT: skipped)
  if (n <= 0) return;
  const long long si = ld_index(state_idx, b);
  if (si < 0 || si >= pool_rows || n > NT) {  // n > NT: a plan built with too small a max_nodes
    if (tid == 0 && vb == 0 && hv == 0) atomicOr(err, (si < 0 || si >= pool_rows ? 1 : 0) | (n > NT ? 128 : 0));
    return;
  }

  // ---- loads (the mma threads): q, k rows [2NT, K]; the state tile; v [NT, BV] (rows past n zero-filled)
  if (tid < MMA_THR) {
    constexpr int CH = K / 8, RPQ = MMA_THR / CH;  // 16-byte chunks per q/k row, rows per pass
    static_assert(MMA_THR % CH == 0 && NT % RPQ == 0, "q/k load split");
    const int c = (tid % CH) * 8, r0 = tid / CH;
#pragma unroll
    for (int r = r0; r < NT; r += RPQ) {
      const bool ok = r < n;
      const long long node = bos + (ok ? r : 0);
      cp_async16(aQK + (r * QK_LD + c) * 2, q + node * s_qt + h * s_qh + c, ok);
      cp_async16(aQK + ((NT + r) * QK_LD + c) * 2, k + node * s_kt + h * s_kh + c, ok);
    }
    constexpr int SCH = (VK ? K : BV) / 4, RPS = MMA_THR / SCH;
    static_assert(MMA_THR % SCH == 0 && S_ROWS % RPS == 0, "state load split");
    const int sc = (tid % SCH) * 4, sr = tid / SCH;
    const long long rstride = VK ? s_sv : s_sk;
    const float* src = pool + si * s_sp + hv * s_sh + static_cast<long long>(vb) * BV * (VK ? s_sv : 1) + sr * rstride + sc;
#pragma unroll
    for (int r = sr; r < S_ROWS; r += RPS, src += RPS * rstride) cp_async16(aS + (r * S_LD + sc) * 4, src, true);
    constexpr int VCH = BV / 8, RPV = MMA_THR / VCH;
    static_assert(MMA_THR % VCH == 0, "v load split");
    const int vc = (tid % VCH) * 8;
#pragma unroll
    for (int i = tid / VCH; i < NT; i += RPV) {
      const bool ok = i < n;
      cp_async16(aV + (i * V_LD + vc) * 2, v + (bos + (ok ? i : 0)) * s_vt + hv * s_vh + vb * BV + vc, ok);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  }

  if (warp == NWM) {
    // gates along root paths: G_i = sum of g_j over ancestors-or-self j (lane i = node i)
    float gi = 0.f, bi = 0.f;
    unsigned ai = 0;
    if (lane < n) {
      gi = ld_real(g, (bos + lane) * s_gt + hv * s_gh, GDN_GDT);
      bi = ld_real(beta, (bos + lane) * s_bt + hv * s_bh, GDN_BDT);
      ai = static_cast<unsigned>(anc[bos + lane]);  // NT <= 32: the low word holds every bit
    }
    const bool gpos = gi > 0.f;
    const unsigned bad_gb = __ballot_sync(0xffffffffu, !(isfinite(gi) && isfinite(bi)));
    if (__any_sync(0xffffffffu, gpos) && lane == 0 && vb == 0) atomicOr(err, 64);
    gi = isfinite(gi) ? gi : 0.f;
    bi = isfinite(bi) ? bi : 0.f;
    if (lane == 0) {
      sBad[0] = 0u;
      sBad[1] = bad_gb;
      sBad[2] = 0u;
    }
    if (lane < NT) sG[lane] = gi;
    __syncwarp();
    float G = 0.f;
#pragma unroll
    for (int j = 0; j < NT; ++j) G += (ai >> j) & 1u ? sG[j] : 0.f;
    __syncwarp();
    if (lane < NT) {
      sAnc[lane] = ai;
      sG[lane] = G;
      sEG[lane] = expf(G);
      sBeta[lane] = bi;
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();
  GDN_STAMP(3, clock64());
  if (GDN_SKIP & 8) return;

  if (warp < NWG) {
    // ---- row norms (TPR threads per row of [Q; K]), scale folded into rq; rows holding a non-finite entry
    // noted in sBad (the exact test runs where the sum of squares is not finite, or everywhere without norms)
    {
      constexpr int TPR0 = G_THR / (2 * NT) > 0 ? G_THR / (2 * NT) : 1;
      constexpr int TPR = TPR0 < K / 8 ? TPR0 : K / 8;  // threads per row, each K / TPR columns
      constexpr int RSTEP = G_THR / TPR, CPT = K / TPR / 8;
      for (int r = tid / TPR; r < 2 * NT; r += RSTEP) {
        const uint4* row = reinterpret_cast<const uint4*>(sQK + r * QK_LD) + (tid % TPR) * CPT;
        bool exact = !GDN_L2;
        float ss = 0.f;
        if (GDN_L2) {
          float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int c = 0; c < CPT; ++c) {
            const uint4 u = row[c];
            const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              acc[e] = fmaf(bf_lo(w[e]), bf_lo(w[e]), acc[e]);
              acc[e] = fmaf(bf_hi(w[e]), bf_hi(w[e]), acc[e]);
            }
          }
          ss = (acc[0] + acc[1]) + (acc[2] + acc[3]);
#pragma unroll
          for (int m = 1; m < TPR; m <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
          exact = !isfinite(ss);  // Inf/NaN entries, or finite ones whose squares overflow
        }
        if (exact) {
          uint32_t bad = 0u;
#pragma unroll
          for (int c = 0; c < CPT; ++c) {
            const uint4 u = row[c];
            bad |= nonfinite_bf16x2(u.x) | nonfinite_bf16x2(u.y) | nonfinite_bf16x2(u.z) | nonfinite_bf16x2(u.w);
          }
          if (bad) {
            atomicOr(&sBad[r < NT ? 0 : 2], 1u << (r % NT));
            if (r >= NT) atomicOr(&sBad[1], 1u << (r - NT));
          }
        }
        if (GDN_L2 && tid % TPR == 0) {
          if (r < NT) sRq[r] = scale / sqrtf(ss + 1e-6f);
          else sRk[r - NT] = 1.f / sqrtf(ss + 1e-6f);
        }
      }
      if (!GDN_L2 && tid < NT) {
        sRq[tid] = scale;
        sRk[tid] = 1.f;
      }
    }
    if (SW) bar_arrive(3, G_THR + 32 * (NWM - NWG));  // norms ready for the product warps' epilogue
    // ---- gram: [Q; K] K^T, lower-triangular tiles only (q rows: j <= i; k rows: j < i); each warp one
    // m-tile and NTW n-tiles, all in flight together
    constexpr int NTN = NT / 8;
    constexpr int NGRP0 = NWG >= MT ? NWG / MT : 1;
    constexpr int NGRP = NGRP0 < NTN ? NGRP0 : NTN;  // warps sharing an m-tile
    constexpr int NTW = NTN / NGRP;                  // n-tiles per warp
    const int grp = NWG >= MT ? warp / MT : 0;
    if (grp < NGRP) {
      for (int mt = NWG >= MT ? warp % MT : warp; mt < MT; mt += NWG >= MT ? MT : NWG) {
        const int row0 = mt * 16;
        float c[NTW][4];
        bool need[NTW];
#pragma unroll
        for (int j = 0; j < NTW; ++j) {
          const int nt = grp + NGRP * j;
          need[j] = row0 < NT ? nt * 8 <= row0 + 15 : nt * 8 <= row0 - NT + 14;
          c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f;
        }
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          uint32_t a[4];
          ldsm_x4(a, aQK + ((row0 + (lane & 15)) * QK_LD + ks * 16 + (lane >> 4) * 8) * 2);
#pragma unroll
          for (int j = 0; j < NTW; ++j) {
            if (!need[j]) continue;
            uint32_t bb[2];
            ldsm_x2(bb, aQK + ((NT + (grp + NGRP * j) * 8 + (lane & 7)) * QK_LD + ks * 16 + ((lane >> 3) & 1) * 8) * 2);
            mma_bf16(c[j], a, bb[0], bb[1]);
          }
        }
        const int r = row0 + (lane >> 2);
#pragma unroll
        for (int j = 0; j < NTW; ++j) {
          if (!need[j]) continue;
          const int col = (grp + NGRP * j) * 8 + 2 * (lane & 3);
          sGram[r * G_LD + col] = c[j][0];
          sGram[r * G_LD + col + 1] = c[j][1];
          sGram[(r + 8) * G_LD + col] = c[j][2];
          sGram[(r + 8) * G_LD + col + 1] = c[j][3];
        }
      }
    }
  }
  if (SW) {
    if (warp < NWG) bar_sync(1, G_THR);  // the gram warps' tiles
  } else {
    __syncthreads();
  }
  GDN_STAMP(4, clock64());

  // ---- M (ancestors-or-self) and A (proper ancestors), masked before exp; thread: row i, JPT columns
  static_assert(G_THR % NT == 0 && (NT * NT) % G_THR == 0, "build split");
  if (tid < G_THR) {
    constexpr int JPT = NT * NT / G_THR;
    const int i = tid % NT, j0 = (tid / NT) * JPT;
    const unsigned ai = sAnc[i], kbad = sBad[2];
    // A's entries: proper ancestors whose k rows and this row's k are finite (a k row's NaN stops here)
    const unsigned ai_a = (kbad >> i) & 1u ? 0u : ai & ~kbad & ~(1u << i);
    const float gi = sG[i], rqi = sRq[i], brk = sBeta[i] * sRk[i];
#pragma unroll
    for (int u = 0; u < JPT; ++u) {
      const int j = j0 + u;
      const bool on = (ai >> j) & 1u;
      const float rkj = sRk[j] * expf(on ? gi - sG[j] : 0.f);
      const float mv = rqi * rkj * sGram[i * G_LD + j];
      const float av = brk * rkj * sGram[(NT + i) * G_LD + j];
      sMN[i * G_LD + j] = on ? mv : 0.f;
      sA[i * A_LD + j] = (ai_a >> j) & 1u ? av : 0.f;
    }
  }
  if (SW) {  // M and A to the solver warp; the product warps never wait here
    if (warp < NWG) bar_arrive(2, G_THR + 32);
    else if (warp == NWM) bar_sync(2, G_THR + 32);
  } else {
    __syncthreads();
  }
  GDN_STAMP(5, clock64());

  if (warp == NWM) {
    // ---- N = M (I + A)^-1, lane i = row i, columns right to left
    const int i = lane < NT ? lane : NT - 1;
    float nr[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) nr[j] = sMN[i * G_LD + j];
    if (!(GDN_SKIP & 2)) solve_columns<NT - 1>(nr, sA);
    __syncwarp();
    if (lane < NT) {
#pragma unroll
      for (int j = 0; j < NT; ++j) sMN[i * G_LD + j] = nr[j];
    }
  } else if (warp >= NWM - NWM / NTPW) {
    // ---- state products [Q; K] S0 for NTPW 8-column tiles of the state, fp32 state in PIECES bf16 pieces
    const int pw = warp - (NWM - NWM / NTPW);
#pragma unroll 1
    for (int u = 0; u < NTPW; ++u) {
      const int nt = pw + (NWM / NTPW) * u;
      float hi[MT][4], lo[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) hi[mt][e] = lo[mt][e] = 0.f;
      const int bn = nt * 8 + (lane >> 2), bk = 2 * (lane & 3);
#pragma unroll UNROLL_KS
      for (int ks = 0; ks < ((GDN_SKIP & 4) ? 0 : KS); ++ks) {
        const int k0 = ks * 16 + bk;
        float x[4];
        if (VK) {
          const float2 p = *reinterpret_cast<const float2*>(sS + bn * S_LD + k0);
          const float2 w = *reinterpret_cast<const float2*>(sS + bn * S_LD + k0 + 8);
          x[0] = p.x, x[1] = p.y, x[2] = w.x, x[3] = w.y;
        } else {
          x[0] = sS[k0 * S_LD + bn], x[1] = sS[(k0 + 1) * S_LD + bn];
          x[2] = sS[(k0 + 8) * S_LD + bn], x[3] = sS[(k0 + 9) * S_LD + bn];
        }
        uint32_t p0[3], p1[3];
        split_pair(x[0], x[1], p0);
        split_pair(x[2], x[3], p1);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          uint32_t a[4];
          ldsm_x4(a, aQK + ((mt * 16 + (lane & 15)) * QK_LD + ks * 16 + (lane >> 4) * 8) * 2);
          mma_bf16(hi[mt], a, p0[0], p1[0]);
          mma_bf16(lo[mt], a, p0[1], p1[1]);
          if (PIECES == 3) mma_bf16(lo[mt], a, p0[2], p1[2]);
        }
      }
      if (SW && u == 0) bar_sync(3, G_THR + 32 * (NWM - NWG));  // the norms (rq, rk) and sBad
      const int col = nt * 8 + 2 * (lane & 3);
      const unsigned kbad = sBad[2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = mt * 16 + (lane >> 2) + 8 * half;
          const float p0 = hi[mt][2 * half] + lo[mt][2 * half], p1 = hi[mt][2 * half + 1] + lo[mt][2 * half + 1];
          if (mt * 16 < NT) {
            const float f = sEG[r] * sRq[r];
            *reinterpret_cast<float2*>(sQS + r * R_LD + col) = make_float2(f * p0, f * p1);
          } else {
            const int i = r - NT;
            const float f = sEG[i] * sRk[i], bt = sBeta[i];
            uint32_t vw = *reinterpret_cast<const uint32_t*>(sV + i * V_LD + col);
            const uint32_t vbad = nonfinite_bf16x2(vw);
            if (vbad) {  // a non-finite v entry reads as 0; node i's subtree is poisoned
              vw &= ~((vbad >> 15) * 0xffffu);
              atomicOr(&sBad[1], 1u << i);
            }
            float2 rv = make_float2(bt * (bf_lo(vw) - f * p0), bt * (bf_hi(vw) - f * p1));
            if ((kbad >> i) & 1u) rv = make_float2(0.f, 0.f);  // k row i non-finite: its rhs row reaches no one
            *reinterpret_cast<float2*>(sR + i * R_LD + col) = rv;
          }
        }
      }
    }
  }
  __syncthreads();
  GDN_STAMP(6, clock64());

  // ---- O = exp(G) rq (Q S0) + N rhs; thread: rows i and i + NT/2, columns 4c..4c+3 and BV/2+4c..+3 (each rhs
  // float4 serves two rows; a quarter warp's float4 reads of a rhs row are 128 contiguous bytes: no bank conflicts)
  constexpr int CG = BV / 8, HB = BV / 2, HN = NT / 2;
  const unsigned bad_q = sBad[0], bad_s = sBad[1];
  const float qnan = __uint_as_float(0x7fffffffu);
  if (tid < MMA_THR) {
#pragma unroll 1
    for (int t = tid; t < HN * CG; t += MMA_THR) {
      const int i0 = t / CG, i1 = i0 + HN, c = (t % CG) * 4;
      if (i0 >= n) continue;
      float4 a0 = *reinterpret_cast<const float4*>(sQS + i0 * R_LD + c);
      float4 a1 = *reinterpret_cast<const float4*>(sQS + i0 * R_LD + HB + c);
      float4 b0 = *reinterpret_cast<const float4*>(sQS + i1 * R_LD + c);
      float4 b1 = *reinterpret_cast<const float4*>(sQS + i1 * R_LD + HB + c);
#pragma unroll UNROLL_OUT
      for (int l = 0; l < NT; ++l) {  // N[i][l] = 0 for l > i
        const float n0 = sMN[i0 * G_LD + l], n1 = sMN[i1 * G_LD + l];
        const float4 u = *reinterpret_cast<const float4*>(sR + l * R_LD + c);
        const float4 w = *reinterpret_cast<const float4*>(sR + l * R_LD + HB + c);
        a0.x = fmaf(n0, u.x, a0.x), a0.y = fmaf(n0, u.y, a0.y), a0.z = fmaf(n0, u.z, a0.z), a0.w = fmaf(n0, u.w, a0.w);
        a1.x = fmaf(n0, w.x, a1.x), a1.y = fmaf(n0, w.y, a1.y), a1.z = fmaf(n0, w.z, a1.z), a1.w = fmaf(n0, w.w, a1.w);
        b0.x = fmaf(n1, u.x, b0.x), b0.y = fmaf(n1, u.y, b0.y), b0.z = fmaf(n1, u.z, b0.z), b0.w = fmaf(n1, u.w, b0.w);
        b1.x = fmaf(n1, w.x, b1.x), b1.y = fmaf(n1, w.y, b1.y), b1.z = fmaf(n1, w.z, b1.z), b1.w = fmaf(n1, w.w, b1.w);
      }
      if (bad_q | bad_s) {  // uniform: only a CTA that read a non-finite input looks at its rows
        if (((bad_q >> i0) & 1u) || (sAnc[i0] & bad_s)) a0 = a1 = make_float4(qnan, qnan, qnan, qnan);
        if (((bad_q >> i1) & 1u) || (sAnc[i1] & bad_s)) b0 = b1 = make_float4(qnan, qnan, qnan, qnan);
      }
      store_out4(o, (bos + i0) * s_ot + hv * s_oh + vb * BV + c, a0);
      store_out4(o, (bos + i0) * s_ot + hv * s_oh + vb * BV + HB + c, a1);
      if (i1 < n) {
        store_out4(o, (bos + i1) * s_ot + hv * s_oh + vb * BV + c, b0);
        store_out4(o, (bos + i1) * s_ot + hv * s_oh + vb * BV + HB + c, b1);
      }
    }
  }
  GDN_STAMP(8, clock64());

  GDN_STAMP(7, gtimer());
}
