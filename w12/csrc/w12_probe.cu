// A measurement probe of the W12 stream at 32 tokens (perf/w12_ladder.py --even-split). No library call launches it.
// It streams the runtime layout's 1536-byte tiles (w12/layout.py: tile (r, c) of row block r and unit c at
// (r U + c) 1536 when K % 64 == 0 and N % 16 == 0), decodes them with the flow kernel's exact-base decode
// (w12_common.cuh) and runs the 16 mma.sync a tile that the flow kernel runs at 4 n-tiles. Its probe builds apply no
// window base, escapes or bias and store no output, only partial sums where an assignment asks for them; its
// W12P_FULL build is the whole product (below). The question it answers is the one docs/w12-kernels.md leaves open
// for the 5120-row layers at M = 32 on the H200: whether a grid whose warps all get the same work streams near the
// copy rate with x, where the flow kernel's row-block-affine grid leaves a tail of up to 5 us and a main loop slower
// than its bytes.
//
// Assignments (W12P_ASSIGN):
//   0  round robin: tile t goes to warp t mod (warps of the grid), the order of the W12 harness's stream probe; every
//      warp sums into one accumulator (no partial sums): the upper bound of an even split.
//   1  even runs: the tiles in row-block-major order, each warp one contiguous run of equal length (+-1); at each row
//      block boundary a warp stores its 16 x 32 partial sums (2 KB) to `ws` and starts again: the traffic a
//      stream-K split at warp granularity writes (its reads by a fix-up are not modelled).
//   2  even runs of group-units: a group is the CTA's WARPS consecutive row blocks, a group-unit the WARPS tiles of one
//      unit; each CTA takes one contiguous run of group-units (equal length +-1) and its warp i multiplies row block
//      i of the group, so all warps of a CTA are on the same unit and can share its x (W12P_X = 2); partial sums are
//      stored at each group boundary as in 1.
// x (W12P_X):
//   0  unit 0's x, loaded once and held in registers for every tile: no x traffic, the stream, decode and mma alone.
//   1  each warp loads its fragments of the unit's x from global memory (two 16-byte loads per n-tile), one unit
//      ahead into a second register set, as the flow kernel's mma.sync build does at xd = 1.
//   2  (assignment 2 only) x copied once per CTA and unit into a shared ring beside the weight tiles (16-byte
//      cp.async, rows padded to 144 bytes: conflict-free 16-byte reads), one CTA barrier per group-unit, each lane
//      reading its fragments there: Marlin's way of keeping the activations off each warp's own load path.

// W12P_FULL = 1 (assignments 1 and 2) makes it a whole product for M = 32, K % 64 == 0, N % 16 == 0, bf16 out, no
// bias, where no worker's run is longer than U items (so that it holds at most two keys): each row's window base
// e0 in its decode, and each row block's pieces met as a K split through global memory meets them. The pieces of a
// row block (from workers p0 <= ... <= p1: warps of the grid in assignment 1, CTAs in assignment 2, each with warp i
// on row block i of the group) are stored into the workspace, slot 0 of a worker for the first key (row block or
// group) of its run, slot 1 for its last; at the end of its run each warp counts itself in its pieces' row blocks
// (`counters`, one int a row block, zero between launches) and the warp that counts last adds the pieces in worker
// order from the workspace (its own among them: the same bits whichever warp is last), then the escapes in CSR
// order, rounds once, stores, and sets the counter back to zero. The ladder checks it against fp64 before it times
// it; no GPU test holds it (no library call launches it).

#include "w12_common.cuh"


#ifndef W12P_WARPS
#define W12P_WARPS 16
#endif
#ifndef W12P_STAGES
#define W12P_STAGES 4
#endif
#ifndef W12P_CPS
#define W12P_CPS 1  // CTAs per SM the launch bound is set for
#endif
#ifndef W12P_ASSIGN
#define W12P_ASSIGN 1
#endif
#ifndef W12P_X
#define W12P_X 1
#endif
#ifndef W12P_FULL
#define W12P_FULL 0
#endif

namespace {

constexpr int WARPS = W12P_WARPS;
constexpr int STAGES = W12P_STAGES;
constexpr int NT = 4;
constexpr int TILE = 1536;
constexpr int XROW = 144;            // one token's 64 columns (128 bytes) and 16 bytes of padding
constexpr int XSLOT = 8 * NT * XROW;  // one unit of x for 32 tokens
constexpr int PIECE = 128 * NT;      // floats of one row block's partial sums (16 rows x 8 NT tokens)
constexpr bool SHARED_X = W12P_X == 2;
constexpr bool FULL = W12P_FULL != 0;
// a worker: a warp of the grid (assignment 1) or a CTA, whose warp i takes row block i of each group (assignment 2)
constexpr int WPW = W12P_ASSIGN == 2 ? WARPS : 1;
static_assert(W12P_ASSIGN >= 0 && W12P_ASSIGN <= 2, "assignments 0, 1, 2");
static_assert(W12P_X >= 0 && W12P_X <= 2, "x: 0 held, 1 per warp from global memory, 2 a shared ring");
static_assert(!SHARED_X || W12P_ASSIGN == 2, "x in a shared ring needs every warp of a CTA on the same unit");
static_assert(!FULL || (W12P_ASSIGN != 0 && W12P_X != 0), "the whole product: assignments 1 and 2, with x");
static_assert(STAGES >= 2, "a ring needs two slots");

__device__ __forceinline__ void cp16(uint32_t dst, const void* src, uint64_t pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "l"(pol)
               : "memory");
}
__device__ __forceinline__ void cp16_ca(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ uint2 lds64(uint32_t a) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a));
  return v;
}
__device__ __forceinline__ uint4 ldg128(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// one tile of a lane (rows g and g + 8, columns 16 p .. 16 p + 15), decoded with the rows' e0x (e0 << 7 | e0 << 23),
// each k-step into the 4 n-tiles
__device__ __forceinline__ void tile_mma(float (&acc)[NT][4], uint32_t slot, int g, int p, const uint32_t (&e0x)[2],
                                         const uint4 (&x)[NT][2]) {
  uint4 h[2];
  uint2 l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    h[r] = lds128(slot + (8 * r + g) * 64 + 16 * p);
    l[r] = lds64(slot + 1024 + (8 * r + g) * 32 + 8 * p);
  }
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    uint32_t a[4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t hw = word(h[r], s), lw = (s & 1) ? l[r].y : l[r].x;
      const uint32_t y0 = __byte_perm(hw, lw, 0x1504), y1 = __byte_perm(hw, lw, 0x3726);
      a[r] = s >= 2 ? dec_pair_hi(y0, e0x[r]) : dec_pair(y0, e0x[r]);
      a[r + 2] = s >= 2 ? dec_pair_hi(y1, e0x[r]) : dec_pair(y1, e0x[r]);
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const uint4& xv = x[j][s >> 1];
      mma_bf16(acc[j], a[0], a[1], a[2], a[3], (s & 1) ? xv.z : xv.x, (s & 1) ? xv.w : xv.y);
    }
  }
}

// a lane's fragments of unit c's x from global memory: token 8 j + g, columns 64 c + 16 p .. + 15
__device__ __forceinline__ void load_x(uint4 (&x)[NT][2], const __nv_bfloat16* xg, long long K, long long c, int g,
                                       int p) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const __nv_bfloat16* row = xg + (long long)(8 * j + g) * K + 64 * c + 16 * p;
    x[j][0] = ldg128(row);
    x[j][1] = ldg128(row + 8);
  }
}

// a piece of partial sums (each lane's NT x 4 floats, 64 bytes a lane) at slot `slot` of the workspace
__device__ __forceinline__ void store_piece(float* ws, long long slot, const float (&acc)[NT][4], int lane) {
  float4* d = reinterpret_cast<float4*>(ws + slot * PIECE) + lane * NT;
#pragma unroll
  for (int j = 0; j < NT; ++j) d[j] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
}
__device__ __forceinline__ void load_piece(float (&acc)[NT][4], const float* ws, long long slot, int lane) {
  const float4* s = reinterpret_cast<const float4*>(ws + slot * PIECE) + lane * NT;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const float4 v = __ldcg(s + j);  // another SM's stores: past L1
    acc[j][0] = v.x, acc[j][1] = v.y, acc[j][2] = v.z, acc[j][3] = v.w;
  }
}
__device__ __forceinline__ void add_piece(float (&acc)[NT][4], const float* ws, long long slot, int lane) {
  const float4* s = reinterpret_cast<const float4*>(ws + slot * PIECE) + lane * NT;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const float4 v = __ldcg(s + j);  // another SM's stores: past L1
    acc[j][0] += v.x, acc[j][1] += v.y, acc[j][2] += v.z, acc[j][3] += v.w;
  }
}

// the worker whose run holds item t of T items split over P workers (worker p: items [T p / P, T (p + 1) / P))
__device__ __forceinline__ int worker_of(long long t, long long T, int P) { return (int)((P * (t + 1) - 1) / T); }
__device__ __forceinline__ long long first_item(int p, long long T, int P) { return T * p / P; }

}  // namespace

// w: R x U tiles; x: [32, K = 64 U] bf16; ws: partial sums (PIECE floats a slot; the probe builds: 3 slots a warp,
// the whole product: 2 slots a warp); sink: one float per thread, never written in practice (keeps the work alive).
// The whole product's operands (W12P_FULL; the probe builds do not read them): the rows' window bases e0 [N], the
// escapes (rowptr [N + 1], ecol, eval), out [32, N] bf16, counters [R] (zero between launches).
extern "C" __global__ void __launch_bounds__(32 * WARPS, W12P_CPS)
    w12_probe_kernel(const uint8_t* __restrict__ w, const __nv_bfloat16* __restrict__ x, float* __restrict__ ws,
                     float* __restrict__ sink, int R, int U, const uint8_t* __restrict__ e0,
                     const int* __restrict__ rowptr, const int* __restrict__ ecol, const uint16_t* __restrict__ eval,
                     __nv_bfloat16* __restrict__ out, int* __restrict__ counters) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, p = lane & 3;
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
  const uint32_t ring = base + warp * STAGES * TILE;  // this warp's weight slots
  const uint32_t xring = base + WARPS * STAGES * TILE;  // assignment 2, x = 2: the CTA's x slots
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  const long long K = 64LL * U;
  const int N = 16 * R;
  float acc[NT][4] = {};
  uint4 xa[NT][2], xb[NT][2];
  if constexpr (W12P_X == 0) {  // unit 0's x, read once and held for every tile (two sets, as x = 1 holds)
    load_x(xa, x, K, 0, g, p);
    load_x(xb, x, K, 0, g, p);
  }
  uint32_t e0x[2] = {0x3F803F80u, 0x3F803F80u};  // the probe builds' base (127)

  // the sequence of (row block, unit) this warp multiplies, n items, walked by two cursors (the copies run
  // STAGES - 1 items ahead of the math) that step without a division
  const int gw = blockIdx.x * WARPS + warp, nw = gridDim.x * WARPS, total = R * U;
  // the workers and their items (assignment 1: tiles, row-block-major; 2: group-units, group-major)
  const int P = W12P_ASSIGN == 2 ? (int)gridDim.x : nw, me = W12P_ASSIGN == 2 ? (int)blockIdx.x : gw;
  const int wi = W12P_ASSIGN == 2 ? warp : 0;  // this warp's place in its worker
  const long long T = W12P_ASSIGN == 2 ? (long long)(R + WARPS - 1) / WARPS * U : (long long)total;
  int first, n, rstep = 0, cstep = 1;  // item i + 1 is (row block + rstep, unit + cstep), the unit wrapping at U
  if constexpr (W12P_ASSIGN == 0) {
    first = gw, n = gw < total ? (total - 1 - gw) / nw + 1 : 0, rstep = nw / U, cstep = nw % U;
  } else {
    first = (int)first_item(me, T, P), n = (int)first_item(me + 1, T, P) - first;
  }
  struct Cursor {
    int rb, c;
  };
  auto start = [&]() -> Cursor {
    if constexpr (W12P_ASSIGN == 2) return Cursor{first / U * WARPS + warp, first % U};
    else return Cursor{first / U, first % U};
  };
  const int wrap = W12P_ASSIGN == 2 ? WARPS : 1;  // row blocks from one group (or row block) to the next
  auto advance = [&](Cursor& q) {
    q.rb += rstep, q.c += cstep;
    if (q.c >= U) q.c -= U, q.rb += wrap;
  };
  Cursor ic = start(), mc = start();
  auto issue = [&](int i) {  // item i's copies (cursor ic) into slot i % STAGES, one commit group
    if (i < n) {
      const uint32_t d = ring + (uint32_t)(i % STAGES) * TILE + 16 * lane;
      if (ic.rb < R) {
        const uint8_t* s = w + ((long long)ic.rb * U + ic.c) * TILE + 16 * lane;
        cp16(d, s, pol);
        cp16(d + 512, s + 512, pol);
        cp16(d + 1024, s + 1024, pol);
      }
      if constexpr (SHARED_X) {
        for (int k = threadIdx.x; k < 8 * NT * 8; k += 32 * WARPS) {  // 32 tokens x 8 pieces of 16 bytes
          const int tok = k >> 3, piece = k & 7;
          cp16_ca(xring + (uint32_t)(i % STAGES) * XSLOT + tok * XROW + 16 * piece,
                  x + tok * K + 64 * ic.c + 8 * piece);
        }
      }
      advance(ic);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };

  // the whole product's end of a row block: escapes in CSR order, one rounding, the store (rows g and g + 8)
  auto finish = [&](int rb) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * rb + 8 * r + g;
      const int p0 = rowptr[row], p1 = rowptr[row + 1];
      const int c0 = p1 > p0 ? ecol[p0] : 0;
      const uint32_t v0 = p1 > p0 ? (uint32_t)eval[p0] : 0u;
      finish_row<false, NT>([&](int j, int u) -> float& { return acc[j][2 * r + u]; }, row, (uint32_t)e0[row], p0,
                            p1, c0, v0, ecol, eval, x, K, nullptr, 0, out, 8 * NT, N, p);
    }
  };
  // the key (row block, or group) of row block rb; the workers p0..p1 whose runs hold its units
  auto key_of = [&](int rb) { return W12P_ASSIGN == 2 ? rb / WARPS : rb; };
  auto span = [&](int key, int& p0, int& p1) {
    p0 = worker_of((long long)key * U, T, P), p1 = worker_of((long long)key * U + U - 1, T, P);
  };
  auto side = [&](int worker, int key) { return key == (int)(first_item(worker, T, P) / U) ? 0 : 1; };
  auto slot_of = [&](int worker, int key) -> long long {  // slot 0: the worker's first key; 1: its last
    return ((long long)worker * 2 + side(worker, key)) * WPW + wi;
  };

  int flush = 0, cur = -1;  // the probe builds' pieces stored so far; the row block being summed
  int pend0 = -1, pend1 = -1;  // the whole product: the row blocks of the pieces this warp stored (slots 0, 1)
  auto close = [&](int rb) {  // the end of this warp's share of row block rb
    if constexpr (FULL) {  // every piece through the workspace (a run of at most U items holds two keys at most)
      store_piece(ws, slot_of(me, key_of(rb)), acc, lane);
      (side(me, key_of(rb)) == 0 ? pend0 : pend1) = rb;
    } else if constexpr (W12P_ASSIGN != 0) {
      store_piece(ws, (long long)gw * 3 + min(flush, 2), acc, lane);
      ++flush;
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  };
  auto boundary = [&]() {
    if constexpr (W12P_ASSIGN != 0) {
      if (mc.rb != cur) {
        if (cur >= 0 && cur < R) close(cur);
        cur = mc.rb;
        if constexpr (FULL) {
          if (cur < R) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const uint32_t e = e0[16 * cur + 8 * r + g];
              e0x[r] = e << 7 | e << 23;
            }
          }
        }
      }
    }
  };

  for (int s = 0; s < STAGES - 1; ++s) issue(s);
  if constexpr (W12P_X == 1) {
    if (n > 0) load_x(xa, x, K, mc.c, g, p);
  }
  for (int i = 0; i < n; i += 2) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // two items a pass: x's register sets alternate without a copy
      const int it = i + half;
      if (it >= n) break;
      uint4 (&xc)[NT][2] = half ? xb : xa;
      uint4 (&xn)[NT][2] = half ? xa : xb;
      asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
      if constexpr (SHARED_X) __syncthreads();  // every thread's copies of item it landed; slot it - 1 read by all
      else __syncwarp();
      issue(it + STAGES - 1);
      boundary();
      const Cursor now = mc;
      advance(mc);
      if constexpr (W12P_X == 1) {
        if (it + 1 < n) load_x(xn, x, K, mc.c, g, p);
      }
      if constexpr (SHARED_X) {
        const uint32_t xs = xring + (uint32_t)(it % STAGES) * XSLOT;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          xc[j][0] = lds128(xs + (8 * j + g) * XROW + 32 * p);
          xc[j][1] = lds128(xs + (8 * j + g) * XROW + 32 * p + 16);
        }
      }
      if (now.rb < R) tile_mma(acc, ring + (uint32_t)(it % STAGES) * TILE, g, p, e0x, xc);
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  if constexpr (W12P_ASSIGN != 0) {
    if (cur >= 0 && cur < R) close(cur);
  }
  if constexpr (FULL) {  // count this warp's pieces in; the last of a row block's pieces adds them and finishes it
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int rb = s == 0 ? pend0 : pend1;
      if (rb < 0) continue;
      int p0, p1;
      span(key_of(rb), p0, p1);
      __threadfence();
      __syncwarp();
      int last = 0;
      if (lane == 0) last = atomicAdd(counters + rb, 1) == p1 - p0;
      if (!__shfl_sync(0xFFFFFFFFu, last, 0)) continue;
      __threadfence();
      load_piece(acc, ws, slot_of(p0, key_of(rb)), lane);
      for (int q = p0 + 1; q <= p1; ++q) add_piece(acc, ws, slot_of(q, key_of(rb)), lane);
      finish(rb);
      if (lane == 0) counters[rb] = 0;
    }
  }
  float t = 0.f;
#pragma unroll
  for (int j = 0; j < NT; ++j) t += acc[j][0] + acc[j][3];
  if (t == 1.2345e-30f) sink[blockIdx.x * blockDim.x + threadIdx.x] = t;  // never taken in practice
}
