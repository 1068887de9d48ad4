// Probe kernel (not part of the library): MXFP4 decode GEMM on Hopper with mma.sync, the prepared
// 4-plane words (`padded_moe.mxfp4.HopperMxfp4`, folded scales) read straight into registers.
//
// out[slot, n] = sum_k x[row(slot), k] * W[e, n, k] for the slots of each expert group.
// One warp computes 16 weight rows (n) against up to 8 slots (the MMA's n8 side) with
// mma.m16n8k16 (A = weights from registers, B = activations from shared memory). Thread (g, t)
// (g = lane / 4, t = lane % 4) takes, per 128-column chunk, the four words of scale group 4i + t
// of rows g and g + 8 (one 16-byte load each); a word's four bf16x2 planes are the register pairs
// of two MMAs. The MMA sums over k in any order as long as A and B agree, so each thread's k
// columns are its own group's; the activations are staged in shared memory in the same order
// (one 16-byte load per word and slot column).
#include <cuda_runtime.h>
#include <stdint.h>

// The upcast and the MMA: the library's own (src/padded_moe/kernels/native).
#include "../../src/padded_moe/kernels/native/mx_words.cuh"

namespace {

// LD: 0 = read-only path without L1 allocation, 1 = plain global load, 2 = read-only path (__ldg).
template <int LD>
__device__ __forceinline__ uint4 ldg_w(const void* p) {
  uint4 v;
  if (LD == 0)
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else if (LD == 1)
    asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else
    v = __ldg(reinterpret_cast<const uint4*>(p));
  return v;
}

__host__ __device__ inline int col_stride(int ng) { return 4 * ng + ((ng & 1) ? 0 : 4); }  // uint4 units

// Stage a group's activation rows in the words' order: entry (col, c, G) holds elements
// 32G + 2c + 8p (+1) for p = 0..3, the B registers of word c of group G (columns past K: zero).
__device__ __forceinline__ void stage_activations(uint4* xs, const uint16_t* x, long long stride_x,
                                                  const int* row_ids, int ncols, int NG, int K, int cs, int tid,
                                                  int nthreads) {
  for (int idx = tid; idx < ncols * NG * 4; idx += nthreads) {
    const int col = idx / (NG * 4);
    const int rem = idx - col * NG * 4;
    const int G = rem >> 2, c = rem & 3;
    const uint16_t* xr = x + (long long)row_ids[col] * stride_x;
    uint32_t v[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int k = 32 * G + 2 * c + 8 * p;
      v[p] = k + 1 < K ? *reinterpret_cast<const uint32_t*>(xr + k) : (k < K ? (uint32_t)xr[k] : 0u);
    }
    xs[col * cs + c * NG + G] = make_uint4(v[0], v[1], v[2], v[3]);
  }
}

// One 128-column chunk of a 16-row block: rows g / g + 8's words `wa` / `wb` (scale group 4i + t)
// with their folded scale pairs, against the staged activations `xb` (zeros where !b_ok: groups
// past NG, whose shared memory was never written).
__device__ __forceinline__ void chunk_mma(float (&acc0)[4], float (&acc1)[4], uint4 wa, uint4 wb, uint32_t fa,
                                          uint32_t fb, const uint4* xb, int NG, int i, bool b_ok) {
  const uint32_t ua[4] = {wa.x, wa.y, wa.z, wa.w};
  const uint32_t ub[4] = {wb.x, wb.y, wb.z, wb.w};
  const uint4 zero4 = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    uint32_t pa[4], pb[4];
    upcast(ua[c], fa, pa);
    upcast(ub[c], fb, pb);
    const uint4 bx = b_ok ? xb[c * NG + 4 * i] : zero4;
    mma_bf16(acc0, pa[0], pb[0], pa[1], pb[1], bx.x, bx.y);
    mma_bf16(acc1, pa[2], pb[2], pa[3], pb[3], bx.z, bx.w);
  }
}

// Store the MMA's result columns that hold slots (c0..c3: rows r0 / r1 of columns 2t / 2t + 1).
__device__ __forceinline__ void store_slots(float* out, long long stride_o, const int* out_ids, int ncols, int N,
                                            int r0, int r1, int t, const float (&c)[4]) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if (2 * t + j < ncols) {
      float* o = out + (long long)out_ids[2 * t + j] * stride_o;
      if (r0 < N) o[r0] = c[j];
      if (r1 < N) o[r1] = c[2 + j];
    }
  }
}

template <int WN, int KS, int DEPTH, int TILED, int LD>
__global__ void __launch_bounds__(32 * WN * KS)
mx_decode_kernel(const uint16_t* __restrict__ x, long long stride_x, const int* __restrict__ group_expert,
                 const int* __restrict__ group_start, const int* __restrict__ row_ids,
                 const int* __restrict__ out_ids, const int32_t* __restrict__ w, long long stride_we,
                 long long stride_wn, const uint16_t* __restrict__ s, long long stride_se, long long stride_sg,
                 float* __restrict__ out, long long stride_o, int N, int K, int KP, int max_cols) {
  extern __shared__ uint4 smem[];
  const int gi = blockIdx.y;
  const int e = group_expert[gi];
  const int r_begin = group_start[gi];
  const int ncols = min(group_start[gi + 1] - r_begin, max_cols);
  const int NG = KP / 32;
  const int cs = col_stride(NG);
  const int tid = threadIdx.x;

  if (ncols <= 0) return;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wn = warp % WN, ks = warp / WN;
  const int n0 = (blockIdx.x * WN + wn) * 16;
  const int r0 = n0 + g, r1 = n0 + g + 8;
  // TILED 1: each 16-row block's 128-column chunk is one contiguous KB (rows g, then rows g + 8; lane
  // order within each half), so a warp's two loads per chunk read 512 contiguous bytes each.
  // TILED 2: the same KB tiles with the WN row blocks of a program side by side for each chunk, so
  // a program's step reads WN KB in one run.
  constexpr int CH = TILED == 2 ? 256 * WN : TILED ? 256 : 16;  // words from one chunk to the next, per thread
  const int nch_all = (NG + 3) / 4;
  const int32_t* w0 =
      TILED == 2 ? w + e * stride_we + (long long)blockIdx.x * nch_all * WN * 256 + wn * 256 + 4 * lane
      : TILED    ? w + e * stride_we + (long long)(blockIdx.x * WN + wn) * nch_all * 256 + 4 * lane
                 : w + e * stride_we + (long long)(r0 < N ? r0 : 0) * stride_wn + 4 * t;
  const int32_t* w1 = TILED ? w0 + 128 : w + e * stride_we + (long long)(r1 < N ? r1 : 0) * stride_wn + 4 * t;
  const uint16_t* s0 = s + e * stride_se + (long long)t * stride_sg + (r0 < N ? r0 : 0);
  const uint16_t* s1 = s + e * stride_se + (long long)t * stride_sg + (r1 < N ? r1 : 0);
  const long long s_step = 4 * stride_sg;  // one chunk: four groups
  // Slot columns past the group's last read the last one's values: a column of the MMA's result
  // depends only on its own B column, and those columns are never stored.
  const uint4* xb = smem + min(g, ncols - 1) * cs + t;

  float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
  const uint4 zero4 = make_uint4(0, 0, 0, 0);
  // Full chunks (four whole groups each) split over the KS warps of a row block; the partial
  // chunk (NG % 4 groups) after them, by the last split.
  const int nfull = NG / 4;
  const int per = (nfull + KS - 1) / KS;
  const int c_lo = min(nfull, ks * per), c_hi = min(nfull, c_lo + per);

  auto consume = [&](uint4 wa, uint4 wb, uint32_t sa, uint32_t sb, int i, bool b_ok) {
    chunk_mma(acc0, acc1, wa, wb, sa * 0x10001u, sb * 0x10001u, xb, NG, i, b_ok);
  };

  uint4 wa[DEPTH], wb[DEPTH];
  uint32_t sa[DEPTH], sb[DEPTH];
#pragma unroll
  for (int j = 0; j < DEPTH; ++j) {
    if (c_lo + j < c_hi) {
      wa[j] = ldg_w<LD>(w0 + (long long)CH * (c_lo + j));
      wb[j] = ldg_w<LD>(w1 + (long long)CH * (c_lo + j));
      sa[j] = __ldg(s0 + (c_lo + j) * s_step);
      sb[j] = __ldg(s1 + (c_lo + j) * s_step);
    }
  }
  // With the first weight loads in flight, stage the group's activation rows.
  stage_activations(smem, x, stride_x, row_ids + r_begin, ncols, NG, K, cs, tid, 32 * WN * KS);
  __syncthreads();

  int i = c_lo;
  {
    const int32_t* pw0 = w0 + (long long)CH * (c_lo + DEPTH);
    const int32_t* pw1 = w1 + (long long)CH * (c_lo + DEPTH);
    const uint16_t* ps0 = s0 + (c_lo + DEPTH) * s_step;
    const uint16_t* ps1 = s1 + (c_lo + DEPTH) * s_step;
    for (; i + 2 * DEPTH <= c_hi; i += DEPTH) {  // every prefetch in range: no checks
#pragma unroll
      for (int j = 0; j < DEPTH; ++j) {
        consume(wa[j], wb[j], sa[j], sb[j], i + j, true);
        wa[j] = ldg_w<LD>(pw0 + CH * j);
        wb[j] = ldg_w<LD>(pw1 + CH * j);
        sa[j] = __ldg(ps0 + j * s_step);
        sb[j] = __ldg(ps1 + j * s_step);
      }
      pw0 += CH * DEPTH;
      pw1 += CH * DEPTH;
      ps0 += DEPTH * s_step;
      ps1 += DEPTH * s_step;
    }
  }
#pragma unroll
  for (int j = 0; j < DEPTH; ++j) {
    if (i + j < c_hi) {
      consume(wa[j], wb[j], sa[j], sb[j], i + j, true);
      const int ip = i + j + DEPTH;
      if (ip < c_hi) {
        wa[j] = ldg_w<LD>(w0 + (long long)CH * ip);
        wb[j] = ldg_w<LD>(w1 + (long long)CH * ip);
        sa[j] = __ldg(s0 + ip * s_step);
        sb[j] = __ldg(s1 + ip * s_step);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < DEPTH; ++j)
    if (i + DEPTH + j < c_hi) consume(wa[j], wb[j], sa[j], sb[j], i + DEPTH + j, true);
  if (NG % 4 && ks == KS - 1) {  // the partial chunk: groups 4 * nfull + t exist for t < NG % 4
    const bool ok = t < NG % 4;
    consume(ok ? ldg_w<LD>(w0 + (long long)CH * nfull) : zero4, ok ? ldg_w<LD>(w1 + (long long)CH * nfull) : zero4,
            ok ? (uint32_t)__ldg(s0 + nfull * s_step) : 0u, ok ? (uint32_t)__ldg(s1 + nfull * s_step) : 0u, nfull, ok);
  }
  float acc[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) acc[q] = acc0[q] + acc1[q];
  if (KS > 1) {
    __syncthreads();  // the staged activations are no longer read: reuse the space
    float4* red = reinterpret_cast<float4*>(smem);
    if (ks > 0) red[((ks - 1) * WN + wn) * 32 + lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    __syncthreads();
    if (ks > 0) return;
#pragma unroll
    for (int q = 1; q < KS; ++q) {
      const float4 v = red[((q - 1) * WN + wn) * 32 + lane];
      acc[0] += v.x; acc[1] += v.y; acc[2] += v.z; acc[3] += v.w;
    }
  }
  store_slots(out, stride_o, out_ids + r_begin, ncols, N, r0, r1, t, acc);
}


// ---- Variant with a producer warp: bulk copies (TMA, 1-D) of each program's chunk into a ring of
// shared-memory stages, so the bytes in flight do not live in the consumers' registers.
// Arrangement (TILED 3): per program (WN row blocks) and 128-column chunk, one contiguous run of
// WN KB of words (as TILED 2) followed by WN x 128 bytes of scales ([wn][t][half][g] as uint16).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}" ::"r"(smem_addr(b)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(b))
               : "memory");
}

// The full and empty barriers of S stages, rounded up to 128 bytes (the stages start after them).
__host__ __device__ constexpr int bar_bytes(int stages) { return (2 * stages * 8 + 127) / 128 * 128; }

template <int WN, int S>
__global__ void __launch_bounds__(32 * (WN + 1))
mx_decode_tma_kernel(const uint16_t* __restrict__ x, long long stride_x, const int* __restrict__ group_expert,
                     const int* __restrict__ group_start, const int* __restrict__ row_ids,
                     const int* __restrict__ out_ids, const uint8_t* __restrict__ w, long long stride_we,
                     float* __restrict__ out, long long stride_o, int N, int K, int KP, int max_cols) {
  constexpr int STAGE = WN * 1152;  // bytes per chunk of a program: WN KB of words, WN x 128 of scales
  extern __shared__ __align__(128) uint8_t sm[];
  uint64_t* full = reinterpret_cast<uint64_t*>(sm);
  uint64_t* empty = full + S;
  uint8_t* stages = sm + bar_bytes(S);
  uint4* xs = reinterpret_cast<uint4*>(stages + S * STAGE);
  const int gi = blockIdx.y;
  const int e = group_expert[gi];
  const int r_begin = group_start[gi];
  const int ncols = min(group_start[gi + 1] - r_begin, max_cols);
  if (ncols <= 0) return;
  const int NG = KP / 32;
  const int nch = (NG + 3) / 4;
  const int cs = col_stride(NG);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const uint8_t* src = w + e * stride_we + (long long)blockIdx.x * nch * STAGE;
  if (tid == 0) {
    for (int q = 0; q < S; ++q) {
      mbar_init(&full[q], 1);
      mbar_init(&empty[q], WN);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // The producer fills the S stages before the activations are staged; the copies after those wait
  // for the consumers, which start only after the block barrier below.
  if (warp == WN && lane == 0) {
    for (int i = 0; i < min(S, nch); ++i) {
      mbar_expect_tx(&full[i], STAGE);
      bulk_copy(stages + i * STAGE, src + (long long)i * STAGE, STAGE, &full[i]);
    }
  }
  // Everyone stages the activations (the producer's copies are in flight meanwhile).
  stage_activations(xs, x, stride_x, row_ids + r_begin, ncols, NG, K, cs, tid, 32 * (WN + 1));
  __syncthreads();
  if (warp == WN) {  // producer: one lane refills each stage once every consumer warp has read it
    if (lane == 0) {
      for (int i = S; i < nch; ++i) {
        const int q = i % S;
        mbar_wait(&empty[q], ((i / S) - 1) & 1);
        mbar_expect_tx(&full[q], STAGE);
        bulk_copy(stages + q * STAGE, src + (long long)i * STAGE, STAGE, &full[q]);
      }
    }
    return;
  }

  const int g = lane >> 2, t = lane & 3, wn = warp;
  const uint4* xb = xs + min(g, ncols - 1) * cs + t;
  float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
  const int w_off = wn * 1024 + lane * 16;                                    // row g's 16 bytes; + 512: row g + 8
  const int s_off = WN * 1024 + wn * 128 + t * 32 + g * 2;                    // scale of (t, half 0, g); + 16: half 1
  for (int i = 0; i < nch; ++i) {
    const int q = i % S;
    mbar_wait(&full[q], (i / S) & 1);
    const uint8_t* st = stages + q * STAGE;
    const uint4 wa = *reinterpret_cast<const uint4*>(st + w_off);
    const uint4 wb = *reinterpret_cast<const uint4*>(st + w_off + 512);
    const uint32_t fa = *reinterpret_cast<const uint16_t*>(st + s_off) * 0x10001u;
    const uint32_t fb = *reinterpret_cast<const uint16_t*>(st + s_off + 16) * 0x10001u;
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[q]);  // this warp's reads of the stage are done
    chunk_mma(acc0, acc1, wa, wb, fa, fb, xb, NG, i, 4 * i + t < NG);
  }
  const int n0 = (blockIdx.x * WN + wn) * 16;
  const int r0 = n0 + g, r1 = n0 + g + 8;
  const float acc[4] = {acc0[0] + acc1[0], acc0[1] + acc1[1], acc0[2] + acc1[2], acc0[3] + acc1[3]};
  store_slots(out, stride_o, out_ids + r_begin, ncols, N, r0, r1, t, acc);
}

template <int WN, int S>
int launch_tma(const void* x, long long sx, const void* ge, const void* gs, const void* rid, const void* oid,
               int ngroups, const void* w, long long swe, void* out, long long so, int N, int K, int KP, int max_cols,
               cudaStream_t stream) {
  const int NG = KP / 32;
  size_t bytes = bar_bytes(S) + (size_t)S * WN * 1152 + (size_t)max_cols * col_stride(NG) * sizeof(uint4);
  auto kern = mx_decode_tma_kernel<WN, S>;
  if (bytes > 48 * 1024) cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
  dim3 grid(N / (16 * WN), ngroups);
  kern<<<grid, 32 * (WN + 1), bytes, stream>>>((const uint16_t*)x, sx, (const int*)ge, (const int*)gs,
                                               (const int*)rid, (const int*)oid, (const uint8_t*)w, swe,
                                               (float*)out, so, N, K, KP, max_cols);
  return (int)cudaGetLastError();
}

#define TMA_CONFIGS(X) X(4, 4) X(4, 8) X(2, 8)

#define CONFIGS(X)                                                                          \
  X(4, 2, 2, 1, 0) X(4, 1, 2, 2, 0) X(4, 2, 2, 2, 0) X(2, 4, 2, 2, 0)

#define NAME(WN, KS, D, T, LD) "wn" #WN "_ks" #KS "_d" #D "_ld" #LD "_t" #T,
#define TMA_NAME(WN, S) "wn" #WN "_ks1_d" #S "_ld0_t3",
const char* kNames[] = {CONFIGS(NAME) TMA_CONFIGS(TMA_NAME)};
#undef TMA_NAME
#undef NAME

template <int WN, int KS, int DEPTH, int TILED, int LD>
int launch(const void* x, long long sx, const void* ge, const void* gs, const void* rid, const void* oid, int ngroups,
           const void* w, long long swe, long long swn, const void* s, long long sse, long long ssg, void* out,
           long long so, int N, int K, int KP, int max_cols, cudaStream_t stream) {
  const int NG = KP / 32;
  size_t stage = (size_t)max_cols * col_stride(NG) * sizeof(uint4);
  size_t red = (size_t)(KS - 1) * WN * 32 * sizeof(float4);
  size_t bytes = stage > red ? stage : red;
  if (bytes == 0) bytes = 16;
  auto kern = mx_decode_kernel<WN, KS, DEPTH, TILED, LD>;
  if (bytes > 48 * 1024) cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
  dim3 grid((N + 16 * WN - 1) / (16 * WN), ngroups);
  kern<<<grid, 32 * WN * KS, bytes, stream>>>(
      (const uint16_t*)x, sx, (const int*)ge, (const int*)gs, (const int*)rid, (const int*)oid, (const int32_t*)w, swe,
      swn, (const uint16_t*)s, sse, ssg, (float*)out, so, N, K, KP, max_cols);
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" {

int mx_decode_num_configs() { return (int)(sizeof(kNames) / sizeof(kNames[0])); }

const char* mx_decode_config_name(int c) { return kNames[c]; }

int mx_decode_run(int c, const void* x, long long sx, const void* ge, const void* gs, const void* rid, const void* oid,
                  int ngroups, const void* w, long long swe, long long swn, const void* s, long long sse,
                  long long ssg, void* out, long long so, int N, int K, int KP, int max_cols, void* stream) {
  int i = 0;
#define RUN(WN, KS, D, T, LD)                                                                                   \
  if (c == i++)                                                                                             \
    return launch<WN, KS, D, T, LD>(x, sx, ge, gs, rid, oid, ngroups, w, swe, swn, s, sse, ssg, out, so, N, K, KP, \
                                max_cols, (cudaStream_t)stream);
  CONFIGS(RUN)
#undef RUN
#define RUN(WN, S)                                                                                          \
  if (c == i++)                                                                                             \
    return launch_tma<WN, S>(x, sx, ge, gs, rid, oid, ngroups, w, swe, out, so, N, K, KP, max_cols,         \
                             (cudaStream_t)stream);
  TMA_CONFIGS(RUN)
#undef RUN
  return -1;
}

}  // extern "C"
