// Native (CUDA C++, sm_90) kernel of the decode path: MXFP4 GEMM2 with the router-weighted combine.
//
// out[t, r] = bf16( sum_j  w[t, j] * bf16( sum_n h[t*k + j, n] * W2[e_j, r, n] + b2[e_j, r] ) )
// over the token's kept slots j in slot order (a dropped slot adds nothing, whatever its weight),
// the same roundings as the Triton kernel `_decode_w2_combine_kernel`.
//
// Why by hand: Triton feeds the tensor cores from shared memory or through layout conversions, and
// its main loop spends ~31 instructions per 32-bit word of 8 weights. Here the prepared 4-plane
// words (`padded_moe.mxfp4.HopperMxfp4`, folded scales) go from global memory straight into the A
// registers of mma.sync m16n8k16, ~18 instructions per word.
//
// Mapping. A program is (16 output rows, one token). Warp (j, q) of its top_k x KS warps computes
// slot j's 16 rows over the q-th share of the 128-column chunks. Thread (g, c) = (lane / 4,
// lane % 4) takes, per chunk i, the four words of scale group 4i + c of rows g and g + 8 (one
// 16-byte load each): word c' of the group holds elements 32G + 2c' + 8p (+1) for planes p = 0..3,
// i.e. the bf16 pairs the MMA wants in its A registers. The MMA sums over k in any order as long as
// A and B agree, so the thread reads the same group of the slot's activation row as its B registers
// (four 16-byte loads, shared by the lanes of equal c and cached in L1; no shared-memory staging).
// The B operand's eight columns all hold slot j (only one is used; the weights, not the MMA, bound
// a decode GEMM). Partial sums of the KS warps of a slot meet in shared memory and are added in a
// fixed order, so results do not depend on timing.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "mx_words.cuh"

namespace {

constexpr int kMaxTopK = 16;
constexpr int kRows = 16;  // output rows per program (the MMA's M)
constexpr int kMaxWarps = 16;  // per program: top_k x KS (at most 128 registers per thread)

__device__ __forceinline__ float bf16_to_float(uint16_t v) { return __uint_as_float((uint32_t)v << 16); }

// Round to nearest even (inputs are finite or NaN; NaN stays NaN).
__device__ __forceinline__ uint16_t float_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// The invalid-expert-ID guard (the rule of `padded_moe.kernels.guard.slot_local_expert`): the routed id,
// range-checked in its own dtype before it indexes anything, then mapped through the expert table;
// `L` for a dropped slot (invalid id, not local).
__device__ __forceinline__ int slot_local_expert(const void* ids, int ids64, long long at, const int* map, int E,
                                                 int L) {
  const long long g = ids64 ? static_cast<const long long*>(ids)[at] : (long long)static_cast<const int*>(ids)[at];
  if (g < 0 || g >= E) return L;
  const int loc = map ? map[g] : (int)g;
  return (loc >= 0 && loc < L) ? loc : L;
}

// dtype codes shared with the host (`padded_moe.kernels.native.DTYPE_CODES`).
enum : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

__device__ __forceinline__ float load_float(const void* p, int kind, long long at) {
  if (kind == kF32) return static_cast<const float*>(p)[at];
  const uint16_t v = static_cast<const uint16_t*>(p)[at];
  return kind == kBF16 ? bf16_to_float(v) : __half2float(__ushort_as_half(v));
}

struct W2Args {
  const uint16_t* h;  // [M * top_k, N] bf16: GEMM1's activated rows (slot order)
  long long stride_h;
  const int32_t* w;  // prepared words [L, K, KP / 8]
  long long stride_we, stride_wr;  // in words
  const uint16_t* s;  // folded scales [L, KP / 32, K] (bf16 bits of 2^(s-1))
  long long stride_se, stride_sr, stride_sg;  // in elements
  const void* bias;  // [L, K] or null
  long long stride_be;
  int bias_kind;
  const void* tw;  // router weights [M, top_k]
  long long stride_twm, stride_twk;
  int tw_kind;
  const void* ids;  // routed ids [M, top_k], int32 or int64
  long long stride_im, stride_ik;
  int ids64;
  const int* map;  // int32 [E] or null
  const void* vt;  // valid_tokens [1] (int32 or int64) or null
  int vt64;
  uint16_t* out;  // [M, K] bf16
  long long stride_om;
  int K, N, KP, E, L, top_k;
};

// One chunk's weights for rows g and g + 8 of a warp: the 4-plane words of scale group 4i + c and
// their folded scales (what the prefetch keeps in flight).
struct Step {
  uint4 wa, wb;
  uint32_t sa, sb;
};

// Where warp (j, q)'s thread reads chunk i: rows g / g + 8 of expert e, scale group 4i + c, and the
// same group of the slot's activation row.
struct Reader {
  const int32_t* w0;
  const int32_t* w1;
  const uint16_t* s0;
  const uint16_t* s1;
  const uint4* x;  // the slot's activation row
  long long s_step;
  int n_groups;  // groups holding activations (N / 32): later ones read as zeros
  int c;

  // `ok`: the group exists in the padded row (false only in the partial last chunk).
  __device__ __forceinline__ void load(Step& st, int i, bool ok) const {
    const uint4 z = make_uint4(0, 0, 0, 0);
    st.wa = ok ? load_stream(w0 + 16LL * i) : z;
    st.wb = ok ? load_stream(w1 + 16LL * i) : z;
    st.sa = ok ? (uint32_t)__ldg(s0 + i * s_step) : 0u;
    st.sb = ok ? (uint32_t)__ldg(s1 + i * s_step) : 0u;
  }

  // Chunk i of rows g and g + 8 against the slot's activations: the thread's scale group of the row
  // as four 16-byte pieces (L1 hits after the first warp: every warp of the slot reads them), the
  // bf16 pair 2c' + 8p of the group being word c' of piece p, the B register of word c''s plane p.
  __device__ __forceinline__ void mma_chunk(float (&acc0)[4], float (&acc1)[4], const Step& st, int i,
                                            bool ok) const {
    const int G = 4 * i + c;
    const bool x_ok = ok && G < n_groups;  // past N: zeros, whatever the padded words hold
    uint4 xv[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) xv[p] = x_ok ? __ldg(x + 4 * G + p) : make_uint4(0, 0, 0, 0);
    const uint32_t ua[4] = {st.wa.x, st.wa.y, st.wa.z, st.wa.w};
    const uint32_t ub[4] = {st.wb.x, st.wb.y, st.wb.z, st.wb.w};
    const uint32_t x0[4] = {xv[0].x, xv[0].y, xv[0].z, xv[0].w};
    const uint32_t x1[4] = {xv[1].x, xv[1].y, xv[1].z, xv[1].w};
    const uint32_t x2[4] = {xv[2].x, xv[2].y, xv[2].z, xv[2].w};
    const uint32_t x3[4] = {xv[3].x, xv[3].y, xv[3].z, xv[3].w};
    const uint32_t fa = st.sa * 0x10001u, fb = st.sb * 0x10001u;
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
      uint32_t pa[4], pb[4];
      upcast(ua[cc], fa, pa);
      upcast(ub[cc], fb, pb);
      mma_bf16(acc0, pa[0], pb[0], pa[1], pb[1], x0[cc], x1[cc]);
      mma_bf16(acc1, pa[2], pb[2], pa[3], pb[3], x2[cc], x3[cc]);
    }
  }
};

// KS warps per slot take the full chunks round-robin (warp q: chunks q, q + KS, ...), so the warps of
// a slot read neighbouring pieces of each row at about the same time; DEPTH chunks of weights are in
// flight per warp.
template <int KS, int DEPTH>
__global__ void __launch_bounds__(32 * kMaxWarps) w2_combine_kernel(const W2Args a) {
  __shared__ float partial[kMaxWarps * kRows];
  __shared__ int slot_expert[kMaxWarps];  // each slot's guarded local expert, for the epilogue
  const int t = blockIdx.y;
  if (a.vt != nullptr) {  // rows at/after valid_tokens are not written
    const long long v = a.vt64 ? *static_cast<const long long*>(a.vt) : (long long)*static_cast<const int*>(a.vt);
    if (t >= v) return;
  }
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int j = warp % a.top_k, q = warp / a.top_k;
  const int e = slot_local_expert(a.ids, a.ids64, t * a.stride_im + j * a.stride_ik, a.map, a.E, a.L);
  const bool kept = e < a.L;
  if (q == 0 && lane == 0) slot_expert[j] = e;
  const int r0 = blockIdx.x * kRows + g, r1 = r0 + 8;
  const long long e64 = kept ? e : 0;
  const long long w_row0 = r0 < a.K ? r0 : 0, w_row1 = r1 < a.K ? r1 : 0;
  Reader rd;
  rd.w0 = a.w + e64 * a.stride_we + w_row0 * a.stride_wr + 4 * c;
  rd.w1 = a.w + e64 * a.stride_we + w_row1 * a.stride_wr + 4 * c;
  rd.s0 = a.s + e64 * a.stride_se + (long long)c * a.stride_sg + w_row0 * a.stride_sr;
  rd.s1 = a.s + e64 * a.stride_se + (long long)c * a.stride_sg + w_row1 * a.stride_sr;
  rd.x = reinterpret_cast<const uint4*>(a.h + ((long long)t * a.top_k + j) * a.stride_h);
  rd.s_step = 4 * a.stride_sg;  // one chunk: four groups
  rd.n_groups = a.N / 32;
  rd.c = c;
  const int groups = a.KP / 32;
  const int full = groups / 4;
  // This warp's chunks: q + m * KS for m < count. A dropped slot's warp reads nothing (its
  // activation row was never written).
  const int count = kept && full > q ? (full - 1 - q) / KS + 1 : 0;

  float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
  Step st[DEPTH];
#pragma unroll
  for (int d = 0; d < DEPTH; ++d)
    if (d < count) rd.load(st[d], q + d * KS, true);
  int m = 0;
  for (; m + 2 * DEPTH <= count; m += DEPTH) {  // every prefetch in range
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      rd.mma_chunk(acc0, acc1, st[d], q + (m + d) * KS, true);
      rd.load(st[d], q + (m + d + DEPTH) * KS, true);
    }
  }
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    if (m + d < count) {
      rd.mma_chunk(acc0, acc1, st[d], q + (m + d) * KS, true);
      if (m + d + DEPTH < count) rd.load(st[d], q + (m + d + DEPTH) * KS, true);
    }
  }
#pragma unroll
  for (int d = 0; d < DEPTH; ++d)
    if (m + DEPTH + d < count) rd.mma_chunk(acc0, acc1, st[d], q + (m + DEPTH + d) * KS, true);
  if (kept && (groups & 3) && q == full % KS) {  // the partial chunk: groups 4 * full + c exist for c < groups % 4
    const bool ok = c < (groups & 3);
    rd.load(st[0], full, ok);
    rd.mma_chunk(acc0, acc1, st[0], full, ok);
  }
  // Every B column holds slot j: column 0 (threads c == 0) has rows g and g + 8.
  if (kept && c == 0) {
    partial[warp * kRows + g] = acc0[0] + acc1[0];
    partial[warp * kRows + g + 8] = acc0[2] + acc1[2];
  }
  __syncthreads();
  if (tid < kRows) {
    const int r = blockIdx.x * kRows + tid;
    if (r < a.K) {
      float total = 0.f;
      for (int jj = 0; jj < a.top_k; ++jj) {
        const int ej = slot_expert[jj];
        if (ej >= a.L) continue;  // a dropped slot adds nothing, whatever its weight
        float v = 0.f;
        for (int qq = 0; qq < KS; ++qq) v = __fadd_rn(v, partial[(qq * a.top_k + jj) * kRows + tid]);
        if (a.bias != nullptr) v = __fadd_rn(v, load_float(a.bias, a.bias_kind, (long long)ej * a.stride_be + r));
        // GEMM2's output rounding, then the router weighting and the slot sum in fp32.
        const float weight = load_float(a.tw, a.tw_kind, t * a.stride_twm + jj * a.stride_twk);
        total = __fadd_rn(total, __fmul_rn(bf16_to_float(float_to_bf16(v)), weight));
      }
      a.out[(long long)t * a.stride_om + r] = float_to_bf16(total);
    }
  }
}

template <int KS, int DEPTH>
int launch_w2(const W2Args& a, int grid_x, int grid_y, cudaStream_t stream) {
  w2_combine_kernel<KS, DEPTH><<<dim3(grid_x, grid_y), 32 * a.top_k * KS, 0, stream>>>(a);
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" {

// Configurations, by index: (KS, DEPTH).
#define PMOE_W2_CONFIGS(X) X(1, 3) X(2, 3) X(1, 4) X(2, 4) X(4, 3) X(4, 4)

int pmoe_w2_num_configs() {
  int n = 0;
#define COUNT(KS, D) ++n;
  PMOE_W2_CONFIGS(COUNT)
#undef COUNT
  return n;
}

// Warps per token and row block of configuration `config` (0 for an unknown one).
int pmoe_w2_split(int config) {
  int i = 0;
#define SPLIT(KS, D) \
  if (config == i++) return KS;
  PMOE_W2_CONFIGS(SPLIT)
#undef SPLIT
  return 0;
}

int pmoe_mx_w2_combine(int config, int grid_x, int grid_y, void* stream, const void* h, long long stride_h,
                       const void* w, long long stride_we, long long stride_wr, const void* s, long long stride_se,
                       long long stride_sr, long long stride_sg, const void* bias, long long stride_be, int bias_kind, const void* tw,
                       long long stride_twm, long long stride_twk, int tw_kind, const void* ids, long long stride_im,
                       long long stride_ik, int ids64, const void* map, const void* vt, int vt64, void* out,
                       long long stride_om, int K, int N, int KP, int E, int L, int top_k) {
  if (top_k < 1 || top_k > kMaxTopK) return -2;
  const W2Args a{static_cast<const uint16_t*>(h), stride_h, static_cast<const int32_t*>(w), stride_we, stride_wr,
                 static_cast<const uint16_t*>(s), stride_se, stride_sr, stride_sg, bias, stride_be, bias_kind, tw, stride_twm, stride_twk, tw_kind, ids, stride_im, stride_ik, ids64,
                 static_cast<const int*>(map), vt, vt64, static_cast<uint16_t*>(out), stride_om, K, N, KP, E, L, top_k};
  int i = 0;
#define RUN(KS, D)                                                                      \
  if (config == i++) {                                                                  \
    if (top_k * (KS) > kMaxWarps) return -3;                                                  \
    return launch_w2<KS, D>(a, grid_x, grid_y, static_cast<cudaStream_t>(stream));      \
  }
  PMOE_W2_CONFIGS(RUN)
#undef RUN
  return -1;
}

const char* pmoe_error_string(int code) {
  if (code == -1) return "unknown configuration";
  if (code == -2) return "top_k outside 1..16";
  if (code == -3) return "top_k x split warps above 16";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"
