// Native (CUDA C++, sm_90a) grouped expert GEMM for bf16 and MXFP4 weights:
//
//   out[slab, row, n] = bf16( sum_k a[slab, row, k] * w[e, n, k] + bias[e, n] )
//
// (or, in GEMM1's epilogue, an activation of the silu family over gate and up columns).
// for the rows of each local expert e (GROUPED_CONTIGUOUS: rows offsets[e] .. offsets[e+1] of one
// flat buffer; GROUPED_MASKED: rows 0 .. counts[e] of slab e). Rows past an expert's count are
// never stored; padded output rows keep what they held.
//
// Why by hand. At prefill sizes (DeepSeek-V4: ~192 rows per expert at 8192 tokens) a Triton tile of
// 128 rows computes 256 rows for 192 and reads the expert's weight tile once per m-tile, and a
// 64-row tile doubles the weight reads. Triton cannot give one program several tensor-core
// consumers that skip their share of the rows. Here a CTA owns a tile of (expert, chunk of C x 64
// rows, BN weight rows): a producer thread streams the weight tile by TMA together with only the
// 64-row boxes of A that hold valid rows, and C consumer warpgroups each own 64 rows (wgmma
// m64nBNk16); a warpgroup whose rows lie past the count issues no MMA, so the tensor core's work
// follows the rows in steps of 64. The configurations (PMOE_GG_CONFIGS) take C = 4 with BN = 128
// (or 64, for few rows per expert) and C = 2 with BN = 256. Tiles are numbered expert by expert,
// then by column tile, then by chunk (`locate_tile`), so CTAs running together share their weight
// tiles through L2.
//
// MXFP4 weights (the MX kernels, BN = 128): the producer warpgroup, one weight row per thread, reads
// the canonical e2m1 bytes four k tiles ahead (cp.async into a ring in shared memory) and the E8M0
// scales two ahead, and writes the bf16 values (exact: a code's value times a power of two) into
// the stage in the layout TMA gives bf16 weights, so the consumers are the same code.
//
// Layout of a pipeline stage in shared memory (1024-byte aligned, 128-byte TMA swizzle, which the
// wgmma descriptors below name): C A boxes of [64 rows][64 k] bf16, then the B tile [BN n][64 k]
// (two TMA boxes of BN / 2 rows). Each row is 128 bytes, the swizzle's span, so a descriptor for
// k-step j of the 64-wide k tile starts 32 * j bytes into the box.
//
// Synchronisation: full[s] completes when the producer's TMA bytes for stage s have landed
// (expect_tx); empty[s] completes when each of the C consumer warpgroups has released stage s
// (an active one after its MMAs on it retired, one step later, so one wgmma group stays in
// flight; an idle one at once). Both sides walk the same k tiles, so stage and parity follow from
// the k tile's index.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>
#include <string.h>

#include "mx_words.cuh"

namespace {

constexpr int kRowsPerGroup = 64;          // wgmma M: the rows of one consumer warpgroup
constexpr int kBN = 128;                   // weight rows of an MXFP4 tile: a row per producer thread
constexpr int kBK = 64;                    // k per stage: 128 bytes of bf16, the swizzle span
constexpr int kABox = kRowsPerGroup * kBK * 2;  // bytes
// C consumer warpgroups (a configuration's): a tile's chunk holds C x 64 rows, the CTA (C + 1) x 128
// threads.
template <int C>
__host__ __device__ constexpr int pass_rows() {
  return C * kRowsPerGroup;
}
template <int C>
__host__ __device__ constexpr int threads() {
  return (C + 1) * 128;
}
// A stage: C A boxes, then the weight tile of BN rows (two boxes of BN / 2 rows).
template <int C, int BN>
__host__ __device__ constexpr int stage_bytes() {
  return C * kABox + BN * kBK * 2;
}
// Registers per thread after setmaxnreg, by consumer warpgroups: what the launch allocates per
// thread (65536 over the CTA's threads, in steps of 8) is shared out as producer x 128 + consumer x
// 128 C. Four consumers of m64n128 (64 accumulators) need about 100; two of m64n256 (128
// accumulators) about 200. The TMA producer spilled at 40 (its tile walk), the MXFP4 producer below
// 64 when it held its k tiles in registers. ptxas reports no spills at these values but in the
// gathering producer (`gather_producer`) of the two-consumer configuration: 16 bytes, stored and
// loaded once per tile (its setup), none per k tile (SASS).
template <int C>
struct Regs {
  static constexpr int launch = (65536 / threads<C>()) / 8 * 8;
  static constexpr int producer = 48;
  static constexpr int mx_producer = 64;
  static constexpr int consumer = C == 4 ? 104 : 224;
  static_assert(producer <= mx_producer, "register budget");
  // Within what the launch allocated, with the MXFP4 producer's or the TMA producer's share.
  __host__ __device__ static constexpr bool fits(bool mx) {
    return 128 * (mx ? mx_producer : producer) + C * 128 * consumer <= threads<C>() * launch;
  }
};

// The local experts whose chunk prefix fits the shared memory left beside the stages.
constexpr int kMaxExperts = 1024;

// Stages, their barriers, the dynamic walk's tile id per stage, the experts' chunk prefix
// (`chunk_prefix`, kMaxExperts + 1 ints), the MXFP4 staging ring (with 16 bytes to align it) and the
// slack for aligning the stages to 1024 bytes.
template <int STAGES, int C, int BN>
__host__ __device__ constexpr int smem_bytes();

// ---- PTX wrappers ---------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// `count` arrivals at once.
__device__ __forceinline__ void mbar_arrive_count(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// `policy`: an L2 cache policy (`l2_policy`), carried when `hinted`. The rows of A are read by every
// CTA of the expert's column tiles (evict last); a weight tile by the CTAs of the expert's row
// chunks, which run side by side (evict normal: evict-first could drop it before the last of them
// reads it). A load without a policy operand is open to the L2 request coalescer, which merges reads
// of the same sectors by SMs at about the same time; loads that carry one were hardly ever merged
// (Nsight Compute's lrc metrics), so the host chooses per configuration (`Args::load_policies`).
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            uint64_t policy, bool hinted) {
  if (hinted)
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%3, "
        "%4, %5}], [%2], %6;" ::"r"(smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "l"(policy)
        : "memory");
  else
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
        "[%2];" ::"r"(smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}

template <bool EVICT_LAST>
__device__ __forceinline__ uint64_t l2_policy() {
  uint64_t policy;
  if (EVICT_LAST)
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  else
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// ---- MXFP4 weights: the producer warpgroup turns each k tile of the weight tile into bf16 in the
// wgmma B layout (what TMA would have written for bf16 weights), one weight row per thread ----

// k tiles of raw codes in flight per producer thread: a ring of kMxDepth slots of 32 bytes per row in
// shared memory, filled by cp.async (no registers held while the bytes travel); the scales (one
// byte per 32 codes) are read two k tiles ahead through the L1 cache, where a row's next 16 k tiles
// of scales arrive with the first.
constexpr int kMxDepth = 4;
constexpr int kMxSlotBytes = 128 * 32;

// Copy 16 bytes global -> shared, or write 16 zero bytes when `valid` is false (src-size 0: nothing
// is read, `src` only has to be a valid address).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Codes of k tile `kt` of a row into its 32-byte slot (`codes` null: a row past the weight's, zeros;
// K is a multiple of 32, so a k tile holds one or two whole groups, and a missing one is zeros);
// always one commit group, so the thread's groups count k tiles. Past the last k tile the group is
// empty: the slot may take the next weight tile's codes, and a late zero fill must not land on them.
__device__ __forceinline__ void mx_fetch(uint32_t slot, const uint8_t* codes, const uint8_t* any, int kt, int K) {
  const int k0 = kt * kBK;
  if (k0 < K) {
    const bool row = codes != nullptr;
    cp_async16(slot, row ? codes + k0 / 2 : any, row);
    cp_async16(slot + 16, row && k0 + 32 < K ? codes + k0 / 2 + 16 : any, row && k0 + 32 < K);
  }
  cp_async_commit();
}

// The two scale bytes of k tile `kt` (low byte: k 0..31); 127 (a factor of 1) where there is no group.
__device__ __forceinline__ uint32_t mx_scales(const uint8_t* scales, int kt, int K) {
  const int k0 = kt * kBK;
  if (scales == nullptr || k0 >= K) return 0x7f7fu;
  const uint32_t lo = __ldg(scales + k0 / 32);
  return lo | ((k0 + 32 < K ? uint32_t(__ldg(scales + k0 / 32 + 1)) : 0x7fu) << 8);
}

// bf16 bits of 2^(s - 127) for an E8M0 byte s, twice (a bf16x2 factor): s = 0 is the subnormal
// 2^-127, s = 255 NaN.
__device__ __forceinline__ uint32_t scale_pair(uint32_t s) {
  const uint32_t b = s == 255u ? 0x7fc0u : (s == 0u ? 0x0040u : s << 7);
  return b | (b << 16);
}

// Shared memory through 32-bit shared addresses (a generic pointer would cost 64-bit address
// arithmetic and generic loads and stores).
__device__ __forceinline__ void sts128(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

// The e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as bf16 (0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000,
// 0x4040, 0x4080, 0x40c0), split into their high and low bytes: byte tables of 8 entries, which a
// prmt indexes with a 3-bit magnitude per selector nibble (bytes 0..3 in the first word).
constexpr uint32_t kMxHi0 = 0x3f3f3f00u, kMxHi1 = 0x40404040u;
constexpr uint32_t kMxLo0 = 0xc0800000u, kMxLo1 = 0xc0804000u;

// Eight codes (one 32-bit word: byte j holds codes 2j, low nibble, and 2j + 1) to eight bf16
// (16 bytes, codes in order) times the group's factor (exact: a power of two, short of
// underflow). All in registers, 15 integer operations and 4 multiplies: per group of four codes a
// prmt looks up their four high bytes and another their four low bytes (selector: the magnitude
// nibbles), the sign bits are moved onto the high bytes' top bits (a prmt of the word and the word
// shifted by 4 puts code i's sign at the top of byte i), and two prmts interleave low and high
// bytes into bf16 pairs. Code 8 (-0) gives -0.
__device__ __forceinline__ uint4 mx_upcast8(uint32_t word, uint32_t factor) {
  const uint32_t mag = word & 0x77777777u, mag_hi = mag >> 16, shifted = word << 4;
  const uint32_t hi_a = prmt(kMxHi0, kMxHi1, mag) | (prmt(shifted, word, 0x5140u) & 0x80808080u);
  const uint32_t hi_b = prmt(kMxHi0, kMxHi1, mag_hi) | (prmt(shifted, word, 0x7362u) & 0x80808080u);
  const uint32_t lo_a = prmt(kMxLo0, kMxLo1, mag), lo_b = prmt(kMxLo0, kMxLo1, mag_hi);
  uint4 v;
  v.x = mul_bf16x2(prmt(lo_a, hi_a, 0x5140u), factor);
  v.y = mul_bf16x2(prmt(lo_a, hi_a, 0x7362u), factor);
  v.z = mul_bf16x2(prmt(lo_b, hi_b, 0x5140u), factor);
  v.w = mul_bf16x2(prmt(lo_b, hi_b, 0x7362u), factor);
  return v;
}

// Row r (0..127) of the stage's B tile at shared address `b_tile`, from the row's 32 bytes of codes
// at `slot` and its two scale bytes: 8 chunks of 16 bytes, chunk j at 16 (j ^ (r % 8)) of the row's
// 128 bytes, the 128-byte swizzle TMA applies (the tile is 1024-byte aligned).
__device__ __forceinline__ void mx_store_row(uint32_t b_tile, int r, uint32_t slot, uint32_t scales) {
  const uint32_t row = b_tile + r * 128;
  const uint32_t f0 = scale_pair(scales & 0xffu), f1 = scale_pair(scales >> 8);
  uint4 lo, hi;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(lo.x), "=r"(lo.y), "=r"(lo.z), "=r"(lo.w) : "r"(slot));
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(hi.x), "=r"(hi.y), "=r"(hi.z), "=r"(hi.w)
               : "r"(slot + 16));
  const uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
  for (int j = 0; j < 8; ++j) sts128(row + ((j ^ (r & 7)) << 4), mx_upcast8(words[j], j < 4 ? f0 : f1));
}

__device__ __forceinline__ void prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Shared-memory matrix descriptor of a K-major operand under the 128-byte swizzle at the 32-bit
// shared address `addr`: start address, leading offset (unused by this swizzle, 16 bytes by
// convention), stride 1024 bytes between groups of 8 rows, swizzle mode 1 (128B) in bits 62-63.
__device__ __forceinline__ uint64_t smem_desc_at(uint32_t addr) {
  return ((uint64_t(addr) & 0x3FFFF) >> 4) | (uint64_t(16 >> 4) << 16) | (uint64_t(1024 >> 4) << 32) | (1ull << 62);
}

// The same at a generic pointer into shared memory.
__device__ __forceinline__ uint64_t smem_desc(const void* p) { return smem_desc_at(smem_addr(p)); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Pins the accumulators at this point of the program: the compiler may not move their other uses
// across it (the epilogue's reads above the wait that makes them valid).
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// One wgmma per tile width, by the accumulator array it fills (BN / 2 floats per thread).
// D[64 x 128] (+)= A[64 x 16] * B[16 x 128], both K-major in shared memory; `accumulate` = 0
// overwrites D.
__device__ __forceinline__ void wgmma_tile(float (&d)[64], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(accumulate));
}

// D[64 x 64] (+)= A[64 x 16] * B[16 x 64]: the 64-row weight tiles of decode-sized calls.
__device__ __forceinline__ void wgmma_tile(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(accumulate));
}

// D[64 x 256] (+)= A[64 x 16] * B[16 x 256]: the 256-row weight tiles of two consumer warpgroups.
__device__ __forceinline__ void wgmma_tile(float (&d)[128], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(accumulate));
}


// Two floats to a bf16 pair, round to nearest even (cvt.rn.bf16x2.f32). A float op, not bit
// arithmetic on the accumulators: integer uses would make the compiler carry them as integers
// through the main loop and copy them between the MMAs, which serializes the wgmma pipeline.
__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float bf16_float(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }

// dtype codes shared with the host (`padded_moe.kernels.native.DTYPE_CODES`).
enum : int { kF32 = 0, kBF16 = 1 };

// What the epilogue does with the tile's BN weight rows (`pmoe_grouped_gemm`'s `mode`; the
// kernel's EPI template parameter).
enum : int {
  kPlain = 0,        // out[:, n] = acc (+ bias): BN output columns per tile
  kGatedSplit = 1,   // gate rows n, up rows n + up_row0 (gate half first): BN / 2 activation columns
  kGatedPairs = 2,   // gate rows 2n, up rows 2n + 1 (swigluoai's interleave): BN / 2 activation columns
};

// Activation ids of the silu family: `padded_moe.kernels.activation.KERNEL_IDS`.
enum : int { kSilu = 0, kSwigluoai = 3, kSwigluoaiUninterleave = 4 };

struct Args {
  const int64_t* offsets;  // GROUPED_CONTIGUOUS: [L + 1] row offsets, else null
  const int32_t* counts;   // GROUPED_MASKED: [L] rows per slab, else null
  int L;                   // local experts
  int rows;                // rows of a slab of `a` / `out` (the flat buffer's rows when contiguous)
  int K, N;                // N: output columns (the activation's width when gated)
  int act, has_limit, up_row0;
  float limit, alpha, beta;
  const void* bias;  // [L, N] or null
  long long stride_be;
  int bias_kind;
  uint16_t* out;  // bf16
  long long stride_os, stride_or;  // slab, row (elements); columns contiguous
  // MXFP4 weights (the MX kernels): canonical e2m1 bytes [L][w_rows][K / 2] (even k in the low
  // nibble) and E8M0 scales [L][w_rows][K / 32], strides in bytes; rows past w_rows read as zero.
  const uint8_t* q_blocks;
  const uint8_t* q_scales;
  long long stride_qe, stride_qn, stride_se, stride_sn;
  int w_rows;
  // Persistent bf16 kernels: null, tiles walked statically (CTA b takes b, b + grid, ...); else a
  // zeroed counter from which the producer takes each next tile id (`next_tile`).
  int* tile_counter;
  // The L2 policy of A's rows: evict last (1) or normal (0); see `rows_l2_policy`.
  int rows_evict_last;
  // Which TMA loads carry their L2 policy operand (`tma_load_3d`): a mask of kPolicyWeights (the
  // weight tile's) and kPolicyRows (A's rows); the others load without one.
  int load_policies;
  // The RS kernels' walk within an expert (`rs_locate_tile`): column tiles first (1) or chunks first (0).
  int rs_columns_first;
  // The RS kernels' MMA of a chunk's last, partial box: in 16-row pieces (1) or whole (0); `rs_consume_boxes`.
  int rs_tail_pieces;
  // GEMM1 gathering its rows (GROUPED_CONTIGUOUS, bf16 or RS): null, the rows come from A's tensor map;
  // else row r of the flat buffer is token row gather_src[r] / gather_div of `gather_a` (rows of
  // gather_stride elements, gather_k of them read, zeros past), a slot outside [0, gather_slots)
  // zeros (`gather_producer`).
  const int32_t* gather_src;
  const uint16_t* gather_a;
  long long gather_stride;
  int gather_div, gather_slots, gather_k;
};

constexpr int kPolicyWeights = 1, kPolicyRows = 2;

// A's rows evict last when an expert's rows are what the CTAs of its other column tiles read next
// (they fit L2 many times over); rows of an expert larger than L2 would, kept last, push out the
// weight tiles that the CTAs running together share, so the host can ask for normal.
__device__ __forceinline__ uint64_t rows_l2_policy(const Args& args) {
  return args.rows_evict_last ? l2_policy<true>() : l2_policy<false>();
}

// ---- the activation epilogue: the silu family of `MoEActivation` (silu, swigluoai, swigluoai_uninterleave),
// as `padded_moe.kernels.activation` computes it for 16-bit outputs (sigmoid through tanh.approx).
// The other activations run as GEMM1 then the activation op (`grouped.EPILOGUE_ACTIVATIONS`): each
// one compiled into the fully unrolled epilogue would multiply the kernel's code. ----

__device__ __forceinline__ float sigmoid_fast(float z) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(0.5f * z));
  return 0.5f * y + 0.5f;
}

__device__ __forceinline__ float silu_family(const Args& a, float g, float u) {
  if (a.has_limit) {
    g = fminf(g, a.limit);
    u = fminf(fmaxf(u, -a.limit), a.limit);
  }
  if (a.act == kSilu) return g * sigmoid_fast(g) * u;
  return g * sigmoid_fast(a.alpha * g) * (u + a.beta);
}

// GEMM1's value as the activation op would read it from a bf16 buffer: bias added, rounded.
__device__ __forceinline__ float as_stored(const Args& a, int e, int w_row, float v) {
  if (a.bias != nullptr) {
    const long long at = e * a.stride_be + w_row;
    v += a.bias_kind == kF32 ? static_cast<const float*>(a.bias)[at]
                             : bf16_float(static_cast<const uint16_t*>(a.bias)[at]);
  }
  return __bfloat162float(__float2bfloat16_rn(v));
}

// Rows [start, start + count) of expert e within its slab; `slab` is the expert for
// GROUPED_MASKED and 0 for GROUPED_CONTIGUOUS. The count is clamped to the slab.
__device__ __forceinline__ void expert_rows(const Args& a, int e, int& slab, int& start, int& count) {
  if (a.offsets != nullptr) {
    const long long lo = a.offsets[e], hi = a.offsets[e + 1];
    slab = 0;
    start = static_cast<int>(lo < 0 ? 0 : (lo > a.rows ? a.rows : lo));
    const long long end = hi > a.rows ? a.rows : hi;
    count = end > start ? static_cast<int>(end - start) : 0;
  } else {
    const int c = a.counts[e];
    slab = e;
    start = 0;
    count = c < 0 ? 0 : (c > a.rows ? a.rows : c);
  }
}

template <int C>
__device__ __forceinline__ int expert_chunks(const Args& a, int e) {
  int slab, start, count;
  expert_rows(a, e, slab, start, count);
  return (count + pass_rows<C>() - 1) / pass_rows<C>();
}

// The experts' chunk counts as a prefix in shared memory (one warp, all lanes): prefix[e] is the
// first chunk of expert e, prefix[L] the number of chunks. Lane l sums the chunks of experts
// [l * per, (l + 1) * per); a warp scan gives each lane its first chunk.
template <int C>
__device__ __forceinline__ void chunk_prefix(const Args& a, int* prefix) {
  const int lane = threadIdx.x % 32;
  const int per = (a.L + 31) / 32;
  const int lo = min(lane * per, a.L), hi = min(lo + per, a.L);
  int sum = 0;
  for (int i = lo; i < hi; ++i) sum += expert_chunks<C>(a, i);
  int incl = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  int at = incl - sum;
  for (int i = lo; i < hi; ++i) {
    prefix[i] = at;
    at += expert_chunks<C>(a, i);
  }
  if (lane == 31) prefix[a.L] = incl;
}

struct Tile {
  int e, chunk, col_tile;
};

// Tile `id`: tiles run expert by expert, within an expert column tile by column tile, and within a
// column tile over the expert's chunks (C x 64 rows), so the CTAs running together share a weight tile
// (read from memory once, the others hit L2) and the rows of a few experts. Expert -1 past the
// last tile.
__device__ __forceinline__ Tile locate_tile(const int* prefix, int L, int id, int n_tiles) {
  if (id >= prefix[L] * n_tiles) return Tile{-1, 0, 0};
  int lo = 0, hi = L - 1;  // the last expert whose first tile is <= id
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (prefix[mid] * n_tiles <= id) lo = mid; else hi = mid - 1;
  }
  const int chunks = prefix[lo + 1] - prefix[lo];  // > 0: an empty expert's first tile is the next one's
  const int local = id - prefix[lo] * n_tiles;
  return Tile{lo, local % chunks, local / chunks};
}

// Where a tile's work lies: its expert's rows (`expert_rows`), the tile's first row and output
// column, the w rows of its two weight boxes of BN / 2 rows (gate, then up), and how many 64-row
// boxes of A hold rows.
struct TileGeom {
  int e, slab, start, count, m0, n0, w_row0, w_row1, boxes;
};

template <int EPI, int C, int BN>
__device__ __forceinline__ TileGeom tile_geometry(const Args& args, const Tile& tile) {
  TileGeom g;
  g.e = tile.e;
  expert_rows(args, tile.e, g.slab, g.start, g.count);
  g.m0 = tile.chunk * pass_rows<C>();
  g.n0 = tile.col_tile * (EPI == kPlain ? BN : BN / 2);
  g.w_row0 = EPI == kGatedPairs ? 2 * g.n0 : g.n0;
  g.w_row1 = EPI == kGatedSplit ? args.up_row0 + g.n0 : g.w_row0 + BN / 2;
  g.boxes = min(C, (g.count - g.m0 + kRowsPerGroup - 1) / kRowsPerGroup);
  return g;
}

// A step past every tile id (the grid's bound is below 2^30: the host checks).
constexpr int kNoStep = 1 << 30;

// The tile walk. Static: CTA b takes tiles b, b + grid, ... (one CTA per tile: b only). Once tile
// times differ (partial chunks, idle warpgroups) the static walk lets CTAs drift apart, so the
// chunks that share a weight tile stop running together and read it from memory again; the
// dynamic walk hands the tiles out in order from a counter (the producer takes them; the
// consumers read each tile's id from its first stage), so the CTAs running together hold
// neighbouring tiles.
template <bool PERSISTENT, bool MX>
__device__ __forceinline__ bool dynamic_walk(const Args& args) {
  return !MX && PERSISTENT && args.tile_counter != nullptr;
}
template <bool PERSISTENT>
__device__ __forceinline__ int static_next(int id) {
  return id + (PERSISTENT ? static_cast<int>(gridDim.x) : kNoStep);
}
__device__ __forceinline__ int first_tile(const Args& args, bool dynamic) {
  return dynamic ? atomicAdd(args.tile_counter, 1) : static_cast<int>(blockIdx.x);
}
template <bool PERSISTENT>
__device__ __forceinline__ int next_tile(const Args& args, bool dynamic, int id) {
  return dynamic ? atomicAdd(args.tile_counter, 1) : static_next<PERSISTENT>(id);
}
// The dynamic walk's end, from the producer: the id past the last tile, in the next stage, for the
// consumers (`stage_tile_id`) to stop on.
// `arrivals`: what the full barrier counts per stage (1, or a gathering producer's kGatherArrivals).
template <int STAGES>
__device__ __forceinline__ void publish_walk_end(uint64_t* full, uint64_t* empty, int* tile_ids, int it, int id,
                                                 uint32_t arrivals = 1) {
  const int s = it % STAGES;
  mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
  tile_ids[s] = id;
  mbar_arrive_count(&full[s], arrivals);
}
// A consumer's next tile in the dynamic walk: the id its first stage carries (or, past the last tile,
// the end).
template <int STAGES>
__device__ __forceinline__ int stage_tile_id(uint64_t* full, const int* tile_ids, int it) {
  const int s = it % STAGES;
  mbar_wait(&full[s], (it / STAGES) & 1);
  return tile_ids[s];
}

// The MXFP4 producer warpgroup: thread r owns row r of every weight tile (rows 0..63 the first box,
// 64..127 the second), keeps kMxDepth k tiles of its codes in flight (`mx_fetch`) and the scales
// two ahead, and per k tile waits for the stage, upcasts its row into the B tile, and (thread 0)
// loads the A boxes by TMA. Its warps arrive on the stage's full barrier once their rows are
// stored, after a proxy fence that makes the stores visible to wgmma. A thread reads back only
// the bytes it copied, so its own cp.async.wait_group orders them.
template <int STAGES, bool PERSISTENT, int EPI, int C>
__device__ __forceinline__ void mx_producer(const Args& args, const CUtensorMap& map_a, uint8_t* smem,
                                            uint64_t* full, uint64_t* empty, const int* prefix,
                                            const uint8_t* staging, int n_tiles,
                                            int k_tiles) {
  const int r = threadIdx.x, lane = r % 32;
  const uint64_t rows_policy = rows_l2_policy(args);
  const bool hint_rows = args.load_policies & kPolicyRows;  // the weights arrive by cp.async here
  const uint32_t ring = smem_addr(staging) + r * 32;
  int it = 0;
  for (int id = blockIdx.x;; id = static_next<PERSISTENT>(id)) {  // MXFP4: the static walk only
    const Tile tile = locate_tile(prefix, args.L, id, n_tiles);
    if (tile.e < 0) break;
    const TileGeom g = tile_geometry<EPI, C, kBN>(args, tile);
    const int w_row = r < 64 ? g.w_row0 + r : g.w_row1 + (r - 64);
    const uint8_t* codes = nullptr;
    const uint8_t* scales = nullptr;
    if (w_row < args.w_rows) {
      codes = args.q_blocks + g.e * args.stride_qe + w_row * args.stride_qn;
      scales = args.q_scales + g.e * args.stride_se + w_row * args.stride_sn;
    }
#pragma unroll
    for (int d = 0; d < kMxDepth; ++d) mx_fetch(ring + d * kMxSlotBytes, codes, args.q_blocks, d, args.K);
    uint32_t sc = mx_scales(scales, 0, args.K), sc_next = mx_scales(scales, 1, args.K);
    for (int kt = 0; kt < k_tiles; ++kt, ++it) {
      const uint32_t sc_far = mx_scales(scales, kt + 2, args.K);
      const int s = it % STAGES;
      if (lane == 0) mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
      __syncwarp();
      uint8_t* stage = smem + s * stage_bytes<C, kBN>();
      if (r == 0) {
        mbar_expect_tx(&full[s], g.boxes * kABox);
        for (int b = 0; b < g.boxes; ++b)
          tma_load_3d(stage + b * kABox, &map_a, &full[s], kt * kBK, g.start + g.m0 + b * kRowsPerGroup, g.slab,
                      rows_policy, hint_rows);
      }
      const uint32_t slot = ring + (kt % kMxDepth) * kMxSlotBytes;
      cp_async_wait<kMxDepth - 1>();  // k tile kt's group (of the kMxDepth in flight) has landed
      mx_store_row(smem_addr(stage + C * kABox), r, slot, sc);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncwarp();
      if (lane == 0) mbar_arrive(&full[s]);
      // The slot's bytes were read into registers above (the upcast's stores consumed them), so it
      // takes k tile kt + kMxDepth now.
      mx_fetch(slot, codes, args.q_blocks, kt + kMxDepth, args.K);
      sc = sc_next;
      sc_next = sc_far;
    }
  }
  cp_async_wait<0>();  // nothing in flight when the thread exits
}

// A stage's bf16 weight tile (after the C boxes of rows): its two boxes of BN / 2 weight rows (gate
// and up halves, or the tile's two halves), by TMA onto the stage's full barrier.
template <int BN, int C>
__device__ __forceinline__ void load_weight_tile(uint8_t* stage, const CUtensorMap& map_w, uint64_t* full,
                                                 const TileGeom& g, int kt, uint64_t policy, bool hinted) {
  tma_load_3d(stage + C * kABox, &map_w, full, kt * kBK, g.w_row0, g.e, policy, hinted);
  tma_load_3d(stage + C * kABox + BN * kBK, &map_w, full, kt * kBK, g.w_row1, g.e, policy, hinted);
}

// ---- GEMM1 gathering its rows from the tokens (`Args::gather_src`: GROUPED_CONTIGUOUS without the
// permuted copy), in either kernel ----

// A gathering producer's full barrier: thread 0's arrival (with the weight tile's bytes) and one per
// warp of the warpgroup once its copies have landed.
constexpr uint32_t kGatherArrivals = 1 + 4;
// The producer warpgroup alone (named barrier 2; the RS consumers use 1).
__device__ __forceinline__ void producers_sync() { asm volatile("bar.sync 2, 128;" ::: "memory"); }

// A warp's copies of k tile `done` have landed (its threads waited for their groups): made visible
// to wgmma (the async proxy), then the warp's arrival on that stage's full barrier.
template <int STAGES>
__device__ __forceinline__ void gather_landed(uint64_t* full, int done) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncwarp();
  if (threadIdx.x % 32 == 0) mbar_arrive(&full[done % STAGES]);
}

// The producer warpgroup of a kernel that gathers its rows: a stage's rows come by cp.async from
// the token rows, thread t copying 16-byte piece t % 8 of rows t / 8, + 16, ... into the 128-byte
// swizzle a TMA box would have (piece j of row r at j ^ (r % 8) within the row's 128 bytes), one
// commit group per k tile; STAGES - 1 k tiles stay in flight per thread, and once a k tile's group
// has landed the warp fences and arrives on its stage (`gather_landed`). Thread 0 takes the tiles
// (the static walk or the counter) and loads the weight tile by TMA. Per tile the threads share its
// id (`walk`) and the chunk's token rows (`table`: a row's token, -1 for zeros) through shared
// memory between two barriers of the warpgroup. A chunk's rows past the expert's are not loaded:
// their output columns are never stored. The kernel's own parts: `locate(id)`, the tile's geometry
// (e < 0 past the last tile); `load_weights(stage, bar, g, kt)`, the weight tile's TMA loads of
// `weight_bytes`; stages of STAGE_BYTES, their 64-row boxes first, CHUNK_ROWS rows. Not one-row TMA
// boxes of a map over the token rows: they land bit-equal (the swizzle follows the shared address)
// but the copy engine takes about 40 ns per box per SM, several times these copies' time.
template <int STAGES, bool PERSISTENT, int STAGE_BYTES, int CHUNK_ROWS, class Locate, class LoadWeights>
__device__ __forceinline__ void gather_producer(const Args& args, uint8_t* smem, uint64_t* full, uint64_t* empty,
                                                int* tile_ids, int* walk, int* table, int k_tiles, bool dynamic,
                                                uint32_t weight_bytes, Locate locate, LoadWeights load_weights) {
  // In flight: at most STAGES - 1 k tiles, so the stage a thread waits to refill (k tile it - STAGES)
  // has had its arrivals (k tiles up to it - STAGES + 1 have).
  constexpr int kInFlight = STAGES - 1;
  const int t = threadIdx.x, lane = t % 32, piece = t % 8;
  int it = 0;  // k tiles loaded so far: stage and parity
  int id = 0;
  for (bool first = true;; first = false) {
    if (t == 0) {
      id = first ? first_tile(args, dynamic) : next_tile<PERSISTENT>(args, dynamic, id);
      *walk = id;
    }
    producers_sync();
    id = *walk;
    const TileGeom g = locate(id);
    if (g.e < 0) break;
    const int rows = min(CHUNK_ROWS, g.count - g.m0);
    for (int r = t; r < rows; r += 128) {
      const int slot = args.gather_src[g.start + g.m0 + r];
      table[r] = slot >= 0 && slot < args.gather_slots ? slot / args.gather_div : -1;
    }
    producers_sync();
    for (int kt = 0; kt < k_tiles; ++kt, ++it) {
      const int s = it % STAGES;
      if (lane == 0) mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
      __syncwarp();
      uint8_t* stage = smem + s * STAGE_BYTES;
      if (t == 0) {
        if (dynamic && kt == 0) tile_ids[s] = id;  // published by the arrivals
        mbar_expect_tx(&full[s], weight_bytes);
        load_weights(stage, &full[s], g, kt);
      }
      const int k = kt * kBK + piece * 8;  // the rows' K is a multiple of 8: a piece is all in or all out
      const uint32_t rows_at = smem_addr(stage);
      for (int r = t / 8; r < rows; r += 16) {
        const int token = table[r];
        const bool in = token >= 0 && k < args.gather_k;
        cp_async16(rows_at + (r / kRowsPerGroup) * kABox + (r % kRowsPerGroup) * 128 + ((piece ^ (r % 8)) * 16),
                   in ? args.gather_a + token * args.gather_stride + k : args.gather_a, in);
      }
      cp_async_commit();
      if (it >= kInFlight - 1) {
        cp_async_wait<kInFlight - 1>();  // k tile it - kInFlight + 1's group has landed
        gather_landed<STAGES>(full, it - kInFlight + 1);
      }
    }
  }
  cp_async_wait<0>();  // the last k tiles' groups
  for (int done = max(it - kInFlight + 1, 0); done < it; ++done) gather_landed<STAGES>(full, done);
  if (dynamic && t == 0) publish_walk_end<STAGES>(full, empty, tile_ids, it, id, kGatherArrivals);
}

// PERSISTENT: one CTA per SM walks tiles blockIdx.x, + gridDim.x, ...; the producer runs ahead
// into the next tile while the consumers store the last one. Otherwise one CTA per tile (the grid
// bounds the tiles; CTAs past the last exit).
template <int STAGES, bool PERSISTENT, int EPI, bool MX, int BN, int C>
__global__ void __launch_bounds__(threads<C>(), 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_w,
                        const Args args) {
  extern __shared__ uint8_t raw_smem[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw_smem) + 1023) & ~uintptr_t(1023));
  static_assert(!MX || BN == kBN, "the MXFP4 producer fills 128-row weight tiles (a row per thread)");
  static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma N of a tile: 64, 128 or 256");
  static_assert(Regs<C>::fits(MX), "register budget");
  constexpr int kStageBytes = stage_bytes<C, BN>();
  constexpr int kBBox = BN * kBK * 2;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * kStageBytes);
  uint64_t* empty = full + STAGES;
  int* tile_ids = reinterpret_cast<int*>(empty + STAGES);  // dynamic walk: the tile a stage starts
  int* prefix = tile_ids + STAGES;  // [L + 1]
  uint8_t* staging =  // MX: kMxDepth slots of raw codes, 16-byte aligned for cp.async
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(prefix + kMaxExperts + 1) + 15) & ~uintptr_t(15));
  // Gathering (bf16 weights only, so never with the MX staging): the producer's tile id and token rows.
  static_assert(4 * (1 + C * kRowsPerGroup) <= kMxDepth * kMxSlotBytes, "the gather table fits the MX staging");
  int* walk = reinterpret_cast<int*>(staging);
  int* table = walk + 1;

  constexpr int tile_cols = EPI == kPlain ? BN : BN / 2;  // output columns of a tile
  const int n_tiles = (args.N + tile_cols - 1) / tile_cols;
  const int k_tiles = (args.K + kBK - 1) / kBK;
  if (threadIdx.x < 32) chunk_prefix<C>(args, prefix);
  if (threadIdx.x == 32) {
    for (int s = 0; s < STAGES; ++s) {
      // MX: the TMA bytes of A with their expect_tx arrival, and one arrival per producer warp
      // once its rows of B are stored; gathering: `gather_producer`'s.
      mbar_init(&full[s], MX ? 5 : (args.gather_src != nullptr ? kGatherArrivals : 1));
      mbar_init(&empty[s], C);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    prefetch_map(&map_a);
    if (!MX) prefetch_map(&map_w);
  }
  __syncthreads();

  // Warp-uniform by construction (a shuffle from lane 0), so ptxas sees the consumers' wgmma
  // branches as non-divergent and keeps the MMAs asynchronous.
  const int group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);  // 0: producer
  if (group == 0) {
    // The CTA's registers were allocated at launch (Regs<C>::launch per thread); the producer gives
    // back what the consumers take, and the total stays within that allocation.
    if constexpr (MX) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Regs<C>::mx_producer));
      mx_producer<STAGES, PERSISTENT, EPI, C>(args, map_a, smem, full, empty, prefix, staging, n_tiles, k_tiles);
    } else {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Regs<C>::producer));
      const bool dynamic = dynamic_walk<PERSISTENT, MX>(args);
      const uint64_t weights_policy = l2_policy<false>();
      const bool hint_weights = args.load_policies & kPolicyWeights;
      if (args.gather_src != nullptr) {
        gather_producer<STAGES, PERSISTENT, kStageBytes, C * kRowsPerGroup>(
            args, smem, full, empty, tile_ids, walk, table, k_tiles, dynamic, kBBox,
            [&](int id) {
              const Tile tile = locate_tile(prefix, args.L, id, n_tiles);
              return tile.e < 0 ? TileGeom{-1} : tile_geometry<EPI, C, BN>(args, tile);
            },
            [&](uint8_t* stage, uint64_t* bar, const TileGeom& g, int kt) {
              load_weight_tile<BN, C>(stage, map_w, bar, g, kt, weights_policy, hint_weights);
            });
        return;
      }
      if (threadIdx.x != 0) return;
      const uint64_t rows_policy = rows_l2_policy(args);
      const bool hint_rows = args.load_policies & kPolicyRows;
      int it = 0;  // k tiles loaded so far: stage and parity
      for (int id = first_tile(args, dynamic);; id = next_tile<PERSISTENT>(args, dynamic, id)) {
        const Tile tile = locate_tile(prefix, args.L, id, n_tiles);
        if (tile.e < 0) {
          if (dynamic) publish_walk_end<STAGES>(full, empty, tile_ids, it, id);
          break;
        }
        const TileGeom g = tile_geometry<EPI, C, BN>(args, tile);
        for (int kt = 0; kt < k_tiles; ++kt, ++it) {
          const int s = it % STAGES;
          mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
          if (dynamic && kt == 0) tile_ids[s] = id;  // published by the expect_tx arrival below
          uint8_t* stage = smem + s * kStageBytes;
          mbar_expect_tx(&full[s], kBBox + g.boxes * kABox);
          load_weight_tile<BN, C>(stage, map_w, &full[s], g, kt, weights_policy, hint_weights);
          for (int b = 0; b < g.boxes; ++b)
            tma_load_3d(stage + b * kABox, &map_a, &full[s], kt * kBK, g.start + g.m0 + b * kRowsPerGroup, g.slab,
                        rows_policy, hint_rows);
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Regs<C>::consumer));
  const int c = group - 1;
  const int t = threadIdx.x % 128;
  const int warp = t / 32, lane = t % 32;
  float acc[BN / 2];
  const bool dynamic = dynamic_walk<PERSISTENT, MX>(args);
  int it = 0;  // k tiles consumed so far: stage and parity
  for (int id = blockIdx.x;; id = static_next<PERSISTENT>(id)) {
    if (dynamic) id = stage_tile_id<STAGES>(full, tile_ids, it);
    const Tile tile = locate_tile(prefix, args.L, id, n_tiles);
    if (tile.e < 0) break;
    const TileGeom g = tile_geometry<EPI, C, BN>(args, tile);
    const int e = g.e, slab = g.slab, start = g.start, count = g.count, m0 = g.m0, n0 = g.n0;
    if (m0 + c * kRowsPerGroup >= count) {  // no rows of this warpgroup: release each stage at once
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int s = it % STAGES;
        mbar_wait(&full[s], (it / STAGES) & 1);
        if (t == 0) mbar_arrive(&empty[s]);
      }
      continue;
    }
    for (int kt = 0; kt < k_tiles; ++kt, ++it) {
      const int s = it % STAGES;
      mbar_wait(&full[s], (it / STAGES) & 1);
      const uint8_t* stage = smem + s * kStageBytes;
      const uint64_t da = smem_desc(stage + c * kABox);
      const uint64_t db = smem_desc(stage + C * kABox);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < kBK / 16; ++j)
        wgmma_tile(acc, da + 2 * j, db + 2 * j, (kt > 0 || j > 0) ? 1 : 0);  // +32 bytes per k16
      wgmma_commit();
      // One group stays in flight: the previous stage's MMAs have retired, so release it.
      wgmma_wait<1>();
      if (kt > 0 && t == 0) mbar_arrive(&empty[(it + STAGES - 1) % STAGES]);
    }
    wgmma_wait<0>();
    fence_accumulators(acc);
    if (t == 0) mbar_arrive(&empty[(it + STAGES - 1) % STAGES]);
    const int w_row0 = g.w_row0, w_row1 = g.w_row1;

    // Accumulator fragment of m64nNk16: thread (warp, lane) holds, for i = 4b + 2h + p, row
    // 16 warp + lane/4 + 8h and column 8b + 2 (lane%4) + p of the tile's BN weight rows.
    const int row0 = m0 + c * kRowsPerGroup + warp * 16 + lane / 4;
    uint16_t* out_slab = args.out + slab * args.stride_os;
    const int q = 2 * (lane % 4);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + 8 * h;
      if (r >= count) continue;
      uint16_t* orow = out_slab + (long long)(start + r) * args.stride_or;
      if (EPI == kGatedSplit) {  // columns j < BN / 2 gate, j + BN / 2 up: activation column n0 + j
#pragma unroll
        for (int b = 0; b < BN / 16; ++b) {
          const int col = n0 + 8 * b + q;
          if (col >= args.N) continue;  // N is even: col + 1 < N as well
          float y[2];
#pragma unroll
          for (int p = 0; p < 2; ++p) {
            const float g = as_stored(args, e, w_row0 + 8 * b + q + p, acc[4 * b + 2 * h + p]);
            const float u = as_stored(args, e, w_row1 + 8 * b + q + p, acc[4 * (b + BN / 16) + 2 * h + p]);
            y[p] = silu_family(args, g, u);
          }
          *reinterpret_cast<uint32_t*>(orow + col) = bf16_pair(y[0], y[1]);
        }
      } else if (EPI == kGatedPairs) {  // columns 2j gate, 2j + 1 up: activation column n0 + j
#pragma unroll
        for (int b = 0; b < BN / 8; ++b) {
          const int col = n0 + 4 * b + q / 2;
          if (col >= args.N) continue;
          const int w_row = w_row0 + 8 * b + q;
          const float g = as_stored(args, e, w_row, acc[4 * b + 2 * h]);
          const float u = as_stored(args, e, w_row + 1, acc[4 * b + 2 * h + 1]);
          orow[col] = static_cast<uint16_t>(bf16_pair(silu_family(args, g, u), 0.0f) & 0xffffu);
        }
      } else {
#pragma unroll
        for (int b = 0; b < BN / 8; ++b) {
          const int col = n0 + 8 * b + q;
          if (col >= args.N) continue;  // N is even: col + 1 < N as well
          float v0 = acc[4 * b + 2 * h], v1 = acc[4 * b + 2 * h + 1];
          if (args.bias != nullptr) {
            const long long at = e * args.stride_be + col;
            if (args.bias_kind == kF32) {
              v0 += static_cast<const float*>(args.bias)[at];
              v1 += static_cast<const float*>(args.bias)[at + 1];
            } else {
              v0 += bf16_float(static_cast<const uint16_t*>(args.bias)[at]);
              v1 += bf16_float(static_cast<const uint16_t*>(args.bias)[at + 1]);
            }
          }
          *reinterpret_cast<uint32_t*>(orow + col) = bf16_pair(v0, v1);
        }
      }
    }
  }
}

// ---- MXFP4 weights prepared for Hopper (`padded_moe.mxfp4.HopperMxfp4`: 4-plane words, folded
// scales), upcast by the consumers into wgmma's register operand ("RS" kernels) ----
//
// The weights sit on the MMA's M side and the tokens on its N side. A tile is (expert, 128 weight
// rows, a chunk of up to 256 of the expert's rows), so each weight element is upcast once per 256
// rows (the Triton kernel's tiles take 128); persistent CTAs walk the tiles. One producer thread
// brings a 64-wide k tile of the chunk's rows (bf16 boxes, 128-byte swizzle: wgmma's B operand),
// the tile's words ([128 rows][8] int32) and folded scales ([2 groups][128 rows] int16) by TMA into
// a ring of stages; two consumer warpgroups of 64 weight rows each read their words from shared
// memory, upcast them (`mx_words.cuh`) into the A registers of m64nNk16, N = the chunk's full
// 64-row boxes (a body compiled per count, chosen per tile), plus an m64n16 per 16-row piece of the
// rest (`rs_consume`), and retire their MMAs before the next
// upcast: ptxas serializes wgmma when other instructions write a wgmma's input registers inside a
// pipeline stage (C7513), so the overlap is between the two warpgroups (one upcasts while the
// other's MMAs run). Word 4g + c of a weight row holds the bf16 pairs (elements 32g + 2c + 8p, +1),
// p = 0..3: thread (lane % 4 = c)'s share of the A fragments of group g's two k16 steps (planes 0
// and 1, then 2 and 3), so the upcast lands in k order and B is the rows' natural order. The
// epilogue (bias added, one rounding) goes through shared memory of its own to store 16-byte
// pieces of output rows, or, gated, the activation of each staged gate / up pair: rows 2j and
// 2j + 1 of a 128-row weight tile (kGatedPairs), or gate rows j and up rows N + j, a tile's 64 of
// each loaded as two 64-row boxes that the two consumers take (kGatedSplit).
// Measured against the Triton kernel on the same bytes: notes.md, scripts/mx_rs_probe.py.
constexpr int kRsWRows = 128;                             // weight rows of a tile (64 per consumer)
constexpr int kRsWordsBytes = kRsWRows * (kBK / 8) * 4;   // [128 rows][8 words] int32: 4096
constexpr int kRsScalesBytes = (kBK / 32) * kRsWRows * 2;  // [2 groups][128 rows] int16: 512
constexpr int kRsOutRow = (kRsWRows + 8) * 2;  // epilogue staging row (bytes): 8 columns of padding spread the banks
constexpr int kRsThreads = 384;                // a producer warpgroup and two consumers
// The producer's registers: the gathering producer (`gather_producer`) of the plain and pairs
// kernels spills 20 bytes, stored and loaded in each tile's setup, none per k tile (SASS); the other
// paths do not spill.
constexpr int kRsProducerRegs = 40, kRsConsumerRegs = 232;

// A chunk of B boxes of 64 rows (4: 256 rows; 5: 320, the fifth box an m64n64 MMA of its own, as
// wgmma's N stops at 256): where a stage's rows, words and scales lie, a stage's bytes, and the
// epilogue's staging of a tile's output (row-major).
template <int B>
struct RsChunk {
  static_assert(B == 4 || B == 5, "RS chunks hold 4 or 5 boxes");
  static constexpr int kWordsOff = B * kABox;
  static constexpr int kScalesOff = kWordsOff + kRsWordsBytes;
  static constexpr int kStage = (kScalesOff + kRsScalesBytes + 1023) / 1024 * 1024;
  static constexpr int kStaging = B * kRowsPerGroup * kRsOutRow;
};

// Stages, the epilogue's staging (its own: the producer fills the next tile's stages meanwhile),
// the barriers, the tile ids of the dynamic walk, the experts' chunk prefix, the gathering
// producer's tile id and token rows (`gather_producer`), and the slack for aligning the stages
// to 1024 bytes.
template <int STAGES, int B>
__host__ __device__ constexpr int rs_smem_bytes() {
  return STAGES * RsChunk<B>::kStage + RsChunk<B>::kStaging + 2 * STAGES * 8 + 4 * STAGES + 4 * (kMaxExperts + 1) +
         4 * (1 + B * kRowsPerGroup) + 1024;
}

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint32_t lds16(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts16(uint32_t addr, uint16_t v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
// The two consumer warpgroups (named barrier 1; the producer has left).
__device__ __forceinline__ void rs_consumers_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

// D[64 x 16] += A[64 x 16] (registers a0..a3) * B[16 x 16] (shared memory, K-major): a 16-row
// piece of a chunk's last, partial box.
__device__ __forceinline__ void wgmma_rs(float (&d)[8], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, 1, 1, 1, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db));
}

// D[64 x 64] += A[64 x 16] (registers a0..a3) * B[16 x 64] (shared memory, K-major).
__device__ __forceinline__ void wgmma_rs(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db));
}

// D[64 x 128] += A[64 x 16] (registers a0..a3) * B[16 x 128] (shared memory, K-major).
__device__ __forceinline__ void wgmma_rs(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, 1, 1, 1, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db));
}

// D[64 x 192] += A[64 x 16] (registers a0..a3) * B[16 x 192] (shared memory, K-major).
__device__ __forceinline__ void wgmma_rs(float (&d)[96], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
      "{%96, %97, %98, %99}, %100, 1, 1, 1, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db));
}

// D[64 x 256] += A[64 x 16] (registers a0..a3) * B[16 x 256] (shared memory, K-major).
__device__ __forceinline__ void wgmma_rs(float (&d)[128], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "{%128, %129, %130, %131}, %132, 1, 1, 1, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db));
}

// Thread (warp, lane)'s A fragments of one k tile, f[4 j + i] for k16 step j, from the stage's
// words and scales of weight rows r0 and r0 + 8. The scales of a stage: [2 groups][128 rows], or
// with split gate / up halves (kGatedSplit: two loads of 64 rows) [2 halves][2 groups][64 rows].
template <int EPI>
__device__ __forceinline__ int rs_scale_at(int g, int r) {
  return EPI == kGatedSplit ? (r / 64) * (kRsWRows) + g * 64 + r % 64 : g * kRsWRows + r;
}
template <int EPI>
__device__ __forceinline__ void rs_upcast(uint32_t words, uint32_t scales, int r0, int q, uint32_t (&f)[16]) {
  uint32_t p[2][2][4];  // [row r0, r0 + 8][group][plane]
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      const int r = r0 + 8 * h;
      const uint32_t s = lds16(scales + rs_scale_at<EPI>(g, r) * 2);
      upcast(lds32(words + r * 32 + (4 * g + q) * 4), s | (s << 16), p[h][g]);
    }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int g = j / 2, P = 2 * (j % 2);
    f[4 * j + 0] = p[0][g][P];
    f[4 * j + 1] = p[1][g][P];
    f[4 * j + 2] = p[0][g][P + 1];
    f[4 * j + 3] = p[1][g][P + 1];
  }
}

constexpr int kRsPieceRows = 16, kRsPieces = kRowsPerGroup / kRsPieceRows;
constexpr int kRsPieceBytes = kRsPieceRows * kBK * 2;  // two 8-row swizzle atoms: a piece starts on one

// One k tile's MMAs of a consumer: the NF full boxes of the stage at `stage` in one m64n(64 NF),
// then T 16-row pieces of the next box, retired before it returns.
template <int NF, int T>
__device__ __forceinline__ void rs_mma(float (&acc)[NF > 0 ? NF * 32 : 1], float (&acc_t)[kRsPieces][kRsPieceRows / 2],
                                       const uint32_t (&f)[16], uint32_t stage) {
  const uint64_t db = smem_desc_at(stage);
  wgmma_fence();
#pragma unroll
  for (int j = 0; j < kBK / 16; ++j) {
    if constexpr (NF > 0) wgmma_rs(acc, f[4 * j], f[4 * j + 1], f[4 * j + 2], f[4 * j + 3], db + 2 * j);
#pragma unroll
    for (int i = 0; i < T; ++i)
      wgmma_rs(acc_t[i], f[4 * j], f[4 * j + 1], f[4 * j + 2], f[4 * j + 3],
               smem_desc_at(stage + NF * kABox + i * kRsPieceBytes) + 2 * j);
  }
  wgmma_commit();
  wgmma_wait<0>();
}

// A consumer warpgroup's tile: the k loop over the chunk's rows, then the epilogue. NF full 64-row
// boxes go through one m64n(64 NF) MMA, and the next box's first `tails` 16-row pieces (0..4, the
// chunk's last rows; `rs_consume_boxes`) through an m64n16 MMA each, so a partial box costs the
// MMA work of its rows rounded up to 16, not to 64. `it`: the k tiles this warpgroup consumed before
// (stage and parity of the ring). EPI kPlain stores the 128 weight rows' sums (plus bias) as output
// columns; kGatedPairs (swigluoai's interleave: weight rows 2j gate, 2j + 1 up) and kGatedSplit
// (consumer 0 the gate rows, consumer 1 the up rows) store 64 activation columns, computed from the
// staged bf16 sums, the values the activation op would read from GEMM1's buffer.
template <int STAGES, int NF, int EPI, int B>
__device__ __forceinline__ void rs_consume(const Args& args, uint8_t* smem, uint64_t* full, uint64_t* empty,
                                           const TileGeom& g, int k_tiles, int c, int it, int tails) {
  static_assert(NF >= 0 && NF <= 4, "wgmma's N stops at 256: four full boxes in one MMA");
  using Chunk = RsChunk<B>;
  constexpr int kPieces = kRsPieces;
  const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32, q = lane % 4;
  const int r0 = c * 64 + warp * 16 + lane / 4;
  const uint32_t base = smem_addr(smem);
  float acc[NF > 0 ? NF * 32 : 1];
  float acc_t[kPieces][kRsPieceRows / 2];
#pragma unroll
  for (int i = 0; i < (NF > 0 ? NF * 32 : 1); ++i) acc[i] = 0.f;
#pragma unroll
  for (int i = 0; i < kPieces; ++i)
#pragma unroll
    for (int j = 0; j < kRsPieceRows / 2; ++j) acc_t[i][j] = 0.f;
  for (int kt = 0; kt < k_tiles; ++kt, ++it) {
    const int s = it % STAGES;
    mbar_wait(&full[s], (it / STAGES) & 1);
    const uint32_t stage = base + s * Chunk::kStage;
    uint32_t f[16];
    rs_upcast<EPI>(stage + Chunk::kWordsOff, stage + Chunk::kScalesOff, r0, q, f);
    // A group (fence to wait) compiled per piece count: a wgmma under a branch inside one group
    // would make ptxas inject warpgroup.arrive before it (C7519).
    if (tails == 0) rs_mma<NF, 0>(acc, acc_t, f, stage);
    else if (tails == 1) rs_mma<NF, 1>(acc, acc_t, f, stage);
    else if (tails == 2) rs_mma<NF, 2>(acc, acc_t, f, stage);
    else if (tails == 3) rs_mma<NF, 3>(acc, acc_t, f, stage);
    else rs_mma<NF, 4>(acc, acc_t, f, stage);
    if (t == 0) mbar_arrive(&empty[s]);
  }
  fence_accumulators(acc);
#pragma unroll
  for (int i = 0; i < kPieces; ++i) fence_accumulators(acc_t[i]);
  // The staging is free once both warpgroups have stored the previous tile from it.
  const uint32_t staging = base + STAGES * Chunk::kStage;
  rs_consumers_sync();
  // Accumulator fragment: i = 4b + 2h + p is weight row w_row0 + r0 + 8h of the chunk's row
  // 8b + 2q + p (acc: b < 8 NF; piece i's acc_t: b = 8 NF + 2i + b', b' = 0, 1); staged at that
  // row's column r0 + 8h.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // Split halves: consumer 0 holds gate rows w_row0.., consumer 1 up rows w_row1.. (`rs_tile_geometry`).
    const int w_row = (EPI == kGatedSplit && c == 1 ? g.w_row1 - 64 : g.w_row0) + r0 + 8 * h;
    // Past the weight's rows (or its gate half): not stored, no bias to read.
    const bool live = w_row < (EPI == kGatedSplit && c == 0 ? args.up_row0 : args.w_rows);
#pragma unroll
    for (int b = 0; b < (NF + 1) * 8; ++b) {
      const int piece = (b - 8 * NF) / 2;
      if (b >= 8 * NF && piece >= tails) continue;
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const float a = b < 8 * NF ? acc[(4 * b + 2 * h + p) % (NF > 0 ? NF * 32 : 1)]
                                   : acc_t[piece % kPieces][4 * (b % 2) + 2 * h + p];
        const float v = live ? as_stored(args, g.e, w_row, a) : 0.0f;
        sts16(staging + (8 * b + 2 * q + p) * kRsOutRow + (r0 + 8 * h) * 2,
              __bfloat16_as_ushort(__float2bfloat16_rn(v)));
      }
    }
  }
  rs_consumers_sync();
  const int rows = min(B * kRowsPerGroup, g.count - g.m0);
  uint16_t* out = args.out + g.slab * args.stride_os + (long long)(g.start + g.m0) * args.stride_or + g.n0;
  if constexpr (EPI == kPlain) {
    const int pieces = min(kRsWRows, args.N - g.n0) / 8;  // 16-byte pieces of a row (N is a multiple of 8)
    for (int idx = threadIdx.x - 128; idx < rows * 16; idx += 256) {
      const int row = idx / 16, piece = idx % 16;
      if (piece < pieces)
        *reinterpret_cast<uint4*>(out + row * args.stride_or + piece * 8) = lds128(staging + row * kRsOutRow + piece * 16);
    }
  } else if constexpr (EPI == kGatedSplit) {
    // A piece: 8 activation columns from the staged gate sums (columns 0..63) and up sums (64..127).
    const int pieces = min(kRsWRows / 2, args.N - g.n0) / 8;
    for (int idx = threadIdx.x - 128; idx < rows * 8; idx += 256) {
      const int row = idx / 8, piece = idx % 8;
      if (piece >= pieces) continue;
      const uint4 gate = lds128(staging + row * kRsOutRow + piece * 16);
      const uint4 up = lds128(staging + row * kRsOutRow + kRsWRows + piece * 16);
      const uint32_t gw[4] = {gate.x, gate.y, gate.z, gate.w}, uw[4] = {up.x, up.y, up.z, up.w};
      uint32_t y[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float y0 = silu_family(args, bf16_float(gw[j] & 0xffffu), bf16_float(uw[j] & 0xffffu));
        const float y1 = silu_family(args, bf16_float(gw[j] >> 16), bf16_float(uw[j] >> 16));
        y[j] = bf16_pair(y0, y1);
      }
      *reinterpret_cast<uint4*>(out + row * args.stride_or + piece * 8) = make_uint4(y[0], y[1], y[2], y[3]);
    }
  } else {
    // A piece: 8 activation columns from 16 staged sums (each 32-bit word a gate / up pair).
    const int pieces = min(kRsWRows / 2, args.N - g.n0) / 8;
    for (int idx = threadIdx.x - 128; idx < rows * 8; idx += 256) {
      const int row = idx / 8, piece = idx % 8;
      if (piece >= pieces) continue;
      const uint4 lo = lds128(staging + row * kRsOutRow + piece * 32);
      const uint4 hi = lds128(staging + row * kRsOutRow + piece * 32 + 16);
      const uint32_t pair[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      uint32_t y[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float y0 = silu_family(args, bf16_float(pair[2 * j] & 0xffffu), bf16_float(pair[2 * j] >> 16));
        const float y1 = silu_family(args, bf16_float(pair[2 * j + 1] & 0xffffu), bf16_float(pair[2 * j + 1] >> 16));
        y[j] = bf16_pair(y0, y1);
      }
      *reinterpret_cast<uint4*>(out + row * args.stride_or + piece * 8) = make_uint4(y[0], y[1], y[2], y[3]);
    }
  }
}

// `rs_consume` compiled for each count of full boxes (0..4), chosen by the tile's rows: with
// `args.rs_tail_pieces` 1, its full boxes and 16-row pieces of the rest; with 0, every box that holds
// rows in the main MMA (a partial one whole) and a fifth box as four pieces.
template <int STAGES, int EPI, int B>
__device__ __forceinline__ void rs_consume_boxes(const Args& args, uint8_t* smem, uint64_t* full, uint64_t* empty,
                                                 const TileGeom& g, int k_tiles, int c, int it) {
  const int rows = min(B * kRowsPerGroup, g.count - g.m0);
  int nf, tails;
  if (args.rs_tail_pieces) {
    nf = min(rows / kRowsPerGroup, 4);
    tails = (rows - nf * kRowsPerGroup + 15) / 16;
  } else {
    nf = min(g.boxes, 4);
    tails = g.boxes > 4 ? 4 : 0;
  }
  // Warp-uniform by construction (from lane 0), so ptxas takes the pieces' branches as non-divergent.
  nf = __shfl_sync(0xffffffffu, nf, 0);
  tails = __shfl_sync(0xffffffffu, tails, 0);
  if (nf == 0) rs_consume<STAGES, 0, EPI, B>(args, smem, full, empty, g, k_tiles, c, it, tails);
  else if (nf == 1) rs_consume<STAGES, 1, EPI, B>(args, smem, full, empty, g, k_tiles, c, it, tails);
  else if (nf == 2) rs_consume<STAGES, 2, EPI, B>(args, smem, full, empty, g, k_tiles, c, it, tails);
  else if (nf == 3) rs_consume<STAGES, 3, EPI, B>(args, smem, full, empty, g, k_tiles, c, it, tails);
  else rs_consume<STAGES, 4, EPI, B>(args, smem, full, empty, g, k_tiles, c, it, tails);
}

// RS tile `id`: experts in order; within an expert (`args.rs_columns_first`), column tiles fastest
// (1: the CTAs running together share a chunk's rows, which are 7x the bytes of a weight tile per k
// step) or chunks fastest (0, `locate_tile`'s order). Expert -1 past the last tile.
__device__ __forceinline__ Tile rs_locate_tile(const Args& args, const int* prefix, int id, int n_tiles) {
  const Tile t = locate_tile(prefix, args.L, id, n_tiles);
  if (t.e < 0 || args.rs_columns_first == 0) return t;
  const int chunks = prefix[t.e + 1] - prefix[t.e];
  const int local = t.col_tile * chunks + t.chunk;  // the tile's place within its expert
  return Tile{t.e, local / n_tiles, local % n_tiles};
}

// Output columns of an RS tile: its 128 weight rows, or the 64 activation columns of their pairs.
template <int EPI>
__host__ __device__ constexpr int rs_tile_cols() {
  return EPI == kPlain ? kRsWRows : kRsWRows / 2;
}

// Where an RS tile's work lies: its expert's rows, the chunk's first row, its first output column,
// its first weight row and the 64-row boxes that hold rows.
template <int EPI, int B>
__device__ __forceinline__ TileGeom rs_tile_geometry(const Args& args, const Tile& tile) {
  TileGeom g;
  g.e = tile.e;
  expert_rows(args, tile.e, g.slab, g.start, g.count);
  g.m0 = tile.chunk * pass_rows<B>();
  g.n0 = tile.col_tile * rs_tile_cols<EPI>();
  g.w_row0 = EPI == kGatedPairs ? 2 * g.n0 : g.n0;
  // Split halves: the gate rows' 64 from w_row0, the up rows' from w_row1 (two loads per stage).
  g.w_row1 = EPI == kGatedSplit ? args.up_row0 + g.n0 : g.w_row0;
  g.boxes = min(B, (g.count - g.m0 + kRowsPerGroup - 1) / kRowsPerGroup);
  return g;
}

// A stage's weight tile: its words and folded scales, by TMA onto the stage's full barrier (split
// halves: maps of 64-row boxes, the gate rows' then the up rows').
template <int EPI, int B>
__device__ __forceinline__ void rs_load_weights(uint8_t* stage, const CUtensorMap& map_w, const CUtensorMap& map_s,
                                                uint64_t* full, const TileGeom& g, int kt) {
  using Chunk = RsChunk<B>;
  tma_load_3d(stage + Chunk::kWordsOff, &map_w, full, kt * (kBK / 8), g.w_row0, g.e, 0, false);
  tma_load_3d(stage + Chunk::kScalesOff, &map_s, full, g.w_row0, kt * (kBK / 32), g.e, 0, false);
  if constexpr (EPI == kGatedSplit) {
    tma_load_3d(stage + Chunk::kWordsOff + kRsWordsBytes / 2, &map_w, full, kt * (kBK / 8), g.w_row1, g.e, 0, false);
    tma_load_3d(stage + Chunk::kScalesOff + kRsScalesBytes / 2, &map_s, full, g.w_row1, kt * (kBK / 32), g.e, 0,
                false);
  }
}

// CTA b walks tiles b, b + gridDim.x, ... (`rs_locate_tile` over chunks of B x 64 rows and tiles of
// 128 weight rows). Persistent (one CTA per SM, `rs_launch`), the experts' chunk prefix is computed once
// per CTA and the producer fills the next tile's first stages while the consumers store the last
// one; with one CTA per tile, the grid's step ends the walk after one tile. With `args.tile_counter`
// (persistent only) the producer takes each next tile id from that zeroed counter instead and
// passes it to the consumers in the tile's first stage, so a CTA whose tiles ran short (partial
// chunks) takes more of them, and the CTAs running together still hold neighbouring tiles.
// `args.K` here is the weights' padded K (the k tiles); the rows' own K is in their tensor map,
// which reads zeros past it.
template <int STAGES, int EPI, int B>
__global__ void __launch_bounds__(kRsThreads, 1)
    mx_rs_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_w,
                 const __grid_constant__ CUtensorMap map_s, const Args args) {
  using Chunk = RsChunk<B>;
  extern __shared__ uint8_t raw_smem[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw_smem) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * Chunk::kStage + Chunk::kStaging);
  uint64_t* empty = full + STAGES;
  int* tile_ids = reinterpret_cast<int*>(empty + STAGES);  // dynamic walk: the tile a stage starts
  int* prefix = tile_ids + STAGES;  // [L + 1]
  int* walk = prefix + kMaxExperts + 1;  // the gathering producer's tile id and token rows
  int* table = walk + 1;
  const int n_tiles = (args.N + rs_tile_cols<EPI>() - 1) / rs_tile_cols<EPI>();
  const bool dynamic = args.tile_counter != nullptr;
  const bool gather = args.gather_src != nullptr;
  const int k_tiles = args.K / kBK;
  if (threadIdx.x < 32) chunk_prefix<B>(args, prefix);
  if (threadIdx.x == 32) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], gather ? kGatherArrivals : 1);
      mbar_init(&empty[s], 2);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    prefetch_map(&map_a);
    prefetch_map(&map_w);
    prefetch_map(&map_s);
  }
  __syncthreads();
  const int group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  if (group == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRsProducerRegs));
    if (gather) {
      gather_producer<STAGES, true, Chunk::kStage, B * kRowsPerGroup>(
          args, smem, full, empty, tile_ids, walk, table, k_tiles, dynamic, kRsWordsBytes + kRsScalesBytes,
          [&](int id) {
            const Tile tile = rs_locate_tile(args, prefix, id, n_tiles);
            return tile.e < 0 ? TileGeom{-1} : rs_tile_geometry<EPI, B>(args, tile);
          },
          [&](uint8_t* stage, uint64_t* bar, const TileGeom& g, int kt) {
            rs_load_weights<EPI, B>(stage, map_w, map_s, bar, g, kt);
          });
      return;
    }
    if (threadIdx.x != 0) return;
    int it = 0;  // k tiles loaded so far: stage and parity
    // The static step is the grid's in both launches (one CTA per tile: past the bound after one).
    for (int id = first_tile(args, dynamic);; id = next_tile<true>(args, dynamic, id)) {
      const Tile tile = rs_locate_tile(args, prefix, id, n_tiles);
      if (tile.e < 0) {
        if (dynamic) publish_walk_end<STAGES>(full, empty, tile_ids, it, id);
        break;
      }
      const TileGeom g = rs_tile_geometry<EPI, B>(args, tile);
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int s = it % STAGES;
        mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
        if (dynamic && kt == 0) tile_ids[s] = id;  // published by the expect_tx arrival below
        uint8_t* stage = smem + s * Chunk::kStage;
        mbar_expect_tx(&full[s], g.boxes * kABox + kRsWordsBytes + kRsScalesBytes);
        for (int b = 0; b < g.boxes; ++b)
          tma_load_3d(stage + b * kABox, &map_a, &full[s], kt * kBK, g.start + g.m0 + b * kRowsPerGroup, g.slab, 0,
                      false);
        rs_load_weights<EPI, B>(stage, map_w, map_s, &full[s], g, kt);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRsConsumerRegs));
  const int c = group - 1;
  int it = 0;  // k tiles consumed so far
  for (int id = blockIdx.x;; id += gridDim.x, it += k_tiles) {
    if (dynamic) id = stage_tile_id<STAGES>(full, tile_ids, it);
    const Tile tile = rs_locate_tile(args, prefix, id, n_tiles);
    if (tile.e < 0) break;
    TileGeom g = rs_tile_geometry<EPI, B>(args, tile);
    // Warp-uniform by construction (from lane 0: the tile came from shared memory), so ptxas takes
    // the body's branch as non-divergent and keeps the wgmma descriptors on the uniform datapath.
    g.boxes = __shfl_sync(0xffffffffu, g.boxes, 0);
    rs_consume_boxes<STAGES, EPI, B>(args, smem, full, empty, g, k_tiles, c, it);
  }
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (fn == nullptr) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }
  return fn;
}

// A 3-d bf16 tensor map [d2][d1][d0] (d0 contiguous), box [1][box1][64], 128-byte swizzle;
// out-of-range elements read as zero.
int encode_3d(CUtensorMap* map, const void* base, long long d0, long long d1, long long d2, long long s1_bytes,
              long long s2_bytes, int box1) {
  auto fn = encode_fn();
  if (fn == nullptr) return -10;
  const cuuint64_t dims[3] = {cuuint64_t(d0), cuuint64_t(d1), cuuint64_t(d2)};
  const cuuint64_t strides[2] = {cuuint64_t(s1_bytes), cuuint64_t(s2_bytes)};
  const cuuint32_t box[3] = {cuuint32_t(kBK), cuuint32_t(box1), 1};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides, box, elem,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : -11;
}



// A 3-d tensor map of plain elements (no swizzle) [d2][d1][d0], strides in bytes, box
// [1][box1][box0]: the RS kernels' words and scales.
int encode_plain_3d(CUtensorMap* map, CUtensorMapDataType type, const void* base, long long d0, long long d1,
                    long long d2, long long s1_bytes, long long s2_bytes, int box0, int box1) {
  auto fn = encode_fn();
  if (fn == nullptr) return -10;
  const cuuint64_t dims[3] = {cuuint64_t(d0), cuuint64_t(d1), cuuint64_t(d2)};
  const cuuint64_t strides[2] = {cuuint64_t(s1_bytes), cuuint64_t(s2_bytes)};
  const cuuint32_t box[3] = {cuuint32_t(box0), cuuint32_t(box1), 1};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = fn(map, type, 3, const_cast<void*>(base), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : -11;
}

template <int STAGES, int EPI, int B>
int rs_launch(const CUtensorMap& ma, const CUtensorMap& mw, const CUtensorMap& ms, const Args& args, int grid_x,
              bool persistent, cudaStream_t stream) {
  static unsigned long long configured = 0;  // the shared-memory opt-in, per device
  constexpr int bytes = rs_smem_bytes<STAGES, B>();
  static_assert(bytes <= 227 * 1024, "the RS kernel's shared memory exceeds the opt-in limit");
  const auto kernel = mx_rs_kernel<STAGES, EPI, B>;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return static_cast<int>(err);
  const unsigned long long bit = device < 64 ? (1ull << device) : 0;
  if (bit == 0 || !(configured & bit)) {
    cudaFuncAttributes attr;
    err = cudaFuncGetAttributes(&attr, kernel);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (attr.numRegs * kRsThreads < kRsProducerRegs * 128 + kRsConsumerRegs * 256) return -20;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured |= bit;
  }
  // Persistent: one CTA per SM (its shared memory leaves room for one), at most one per tile. Else one
  // CTA per tile of the bound: the block scheduler hands tiles to SMs in order as they free up, so
  // CTAs whose tiles take different times do not drift apart (each computes the chunk prefix).
  int sms = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return static_cast<int>(err);
  kernel<<<persistent && sms < grid_x ? sms : grid_x, kRsThreads, bytes, stream>>>(ma, mw, ms, args);
  return static_cast<int>(cudaGetLastError());
}

// `rs_launch` by chunk boxes and stages: chunks of 5 boxes leave shared memory for 3 stages only.
template <int EPI>
int rs_launch_chunks(int stages, int boxes, const CUtensorMap& ma, const CUtensorMap& mw, const CUtensorMap& ms,
                     const Args& args, int grid_x, bool persistent, cudaStream_t stream) {
  if (boxes == 4 && stages == 3) return rs_launch<3, EPI, 4>(ma, mw, ms, args, grid_x, persistent, stream);
  if (boxes == 4 && stages == 4) return rs_launch<4, EPI, 4>(ma, mw, ms, args, grid_x, persistent, stream);
  if (boxes == 5 && stages == 3) return rs_launch<3, EPI, 5>(ma, mw, ms, args, grid_x, persistent, stream);
  return -25;
}

template <int STAGES, int C, int BN>
__host__ __device__ constexpr int smem_bytes() {
  return STAGES * stage_bytes<C, BN>() + 2 * STAGES * 8 + 4 * STAGES + 4 * (kMaxExperts + 1) +
         kMxDepth * kMxSlotBytes + 16 + 1024;
}
template <int STAGES, bool PERSISTENT, int EPI, bool MX, int BN, int C>
int launch(const CUtensorMap& ma, const CUtensorMap& mw, const Args& args, int grid_x, cudaStream_t stream) {
  // The shared-memory opt-in is a per-device function attribute: set once per device.
  static unsigned long long configured = 0;
  constexpr int bytes = smem_bytes<STAGES, C, BN>();
  static_assert(bytes <= 227 * 1024, "a configuration's shared memory exceeds the opt-in limit");
  const auto kernel = grouped_gemm_kernel<STAGES, PERSISTENT, EPI, MX, BN, C>;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return static_cast<int>(err);
  const unsigned long long bit = device < 64 ? (1ull << device) : 0;
  if (bit == 0 || !(configured & bit)) {
    // setmaxnreg shares out the registers the launch allocated (Regs<C>::launch per thread): with
    // fewer, the consumers' request would wait forever, so refuse instead of hanging.
    cudaFuncAttributes attr;
    err = cudaFuncGetAttributes(&attr, kernel);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (attr.numRegs < Regs<C>::launch) return -20;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    configured |= bit;
  }
  int grid = grid_x;
  if (PERSISTENT) {  // one CTA per SM (the stages leave room for one), at most one per tile
    int sms = 0;
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return static_cast<int>(err);
    grid = grid_x < sms ? grid_x : sms;
  }
  kernel<<<grid, threads<C>(), bytes, stream>>>(ma, mw, args);
  return static_cast<int>(cudaGetLastError());
}

template <int STAGES, bool PERSISTENT, bool MX, int BN, int C>
int launch_mode(int mode, const CUtensorMap& ma, const CUtensorMap& mw, const Args& args, int grid_x,
                cudaStream_t stream) {
  if (mode == kGatedSplit) return launch<STAGES, PERSISTENT, kGatedSplit, MX, BN, C>(ma, mw, args, grid_x, stream);
  if (mode == kGatedPairs) return launch<STAGES, PERSISTENT, kGatedPairs, MX, BN, C>(ma, mw, args, grid_x, stream);
  return launch<STAGES, PERSISTENT, kPlain, MX, BN, C>(ma, mw, args, grid_x, stream);
}

// One configuration: the weight's tensor map (boxes of BN / 2 rows; none for MXFP4, whose
// producer reads the codes itself and fills 128-row tiles only), then the kernel of `mode`.
template <int STAGES, bool PERSISTENT, int BN, int C>
int launch_config(int w_kind, int mode, const CUtensorMap& ma, const void* w, long long stride_we,
                  long long stride_wn, const Args& args, int grid_x, cudaStream_t stream) {
  if (args.tile_counter != nullptr && (!PERSISTENT || w_kind != 0)) return -21;
  CUtensorMap mw;
  if (w_kind == 1) {
    if constexpr (BN != kBN) {
      return -19;
    } else {
      memset(&mw, 0, sizeof(mw));  // not read by the MXFP4 kernels
      return launch_mode<STAGES, PERSISTENT, true, BN, C>(mode, ma, mw, args, grid_x, stream);
    }
  }
  const int err = encode_3d(&mw, w, args.K, args.w_rows, args.L, stride_wn * 2, stride_we * 2, BN / 2);
  if (err != 0) return err;
  return launch_mode<STAGES, PERSISTENT, false, BN, C>(mode, ma, mw, args, grid_x, stream);
}

// What gathered rows need of an entry's arguments (error -27): a flat layout (offsets, one slab),
// slots per token and token rows, K and the rows' stride in 16-byte pieces, slots that 32 bits count.
bool gather_fits(const void* offsets, int slabs, int gather_div, int gather_tokens, int K, long long stride_ar) {
  return offsets != nullptr && slabs == 1 && gather_div >= 1 && gather_tokens >= 1 && K % 8 == 0 &&
         stride_ar % 8 == 0 && static_cast<long long>(gather_tokens) * gather_div <= 0x7fffffffLL;
}

}  // namespace

extern "C" {

// Configurations, by index: (stages, persistent, weight rows per tile, consumer warpgroups). The
// 64-row tiles are for calls with few rows per expert, where the weights are the work: twice the
// tiles to spread over the SMs, and a fifth stage in the room the smaller tiles leave (bf16 weights
// only). The 256-row tiles with two consumers (chunks of 128 rows, wgmma m64n256k16; bf16 weights
// only: the MXFP4 producer fills 128 rows) are for full tiles: walking from the tile counter they
// measured 0.90-0.95x the time of the first configuration at 512 and 2048 rows per expert
// (grouped.py's WIDE_TILE_ROWS).
#define PMOE_GG_CONFIGS(X) X(4, true, 128, 4) X(4, false, 128, 4) X(5, true, 64, 4) X(4, true, 256, 2)

int pmoe_gg_num_configs() {
  int n = 0;
#define COUNT(S, P, B, C) ++n;
  PMOE_GG_CONFIGS(COUNT)
#undef COUNT
  return n;
}

// A tile: this many weight rows (output columns; half as many gated) of one expert's chunk of
// pmoe_gg_pass_rows(config) rows, by configuration (0 for an unknown one).
int pmoe_gg_block_n(int config) {
  int i = 0;
#define BLOCK(S, P, B, C) \
  if (config == i++) return B;
  PMOE_GG_CONFIGS(BLOCK)
#undef BLOCK
  return 0;
}
// The rows of a tile's chunk (64 per consumer warpgroup), by configuration (0 for an unknown one).
int pmoe_gg_pass_rows(int config) {
  int i = 0;
#define ROWS(S, P, B, C) \
  if (config == i++) return pass_rows<C>();
  PMOE_GG_CONFIGS(ROWS)
#undef ROWS
  return 0;
}
int pmoe_gg_max_experts() { return kMaxExperts; }

// a: bf16 [slabs][rows][K] with row / slab strides in elements (K contiguous); the weight, by
// `w_kind`: 0, bf16 `w` [L][w_rows][K] with strides in elements; 1, MXFP4 `q_blocks` (e2m1 bytes
// [L][w_rows][K / 2]) and `q_scales` (E8M0 [L][w_rows][K / 32]) with strides in bytes (K a multiple
// of 32). Exactly one of offsets (int64 [L + 1]) and counts (int32 [L]) is set. N: output columns
// (`mode` kGatedSplit / kGatedPairs: the activation's, w_rows / 2; else w_rows). `act` (with
// has_limit, limit, alpha, beta): the gated modes' activation, one of the silu family. The grid is
// one dimension, at least the number of tiles: cdiv(N, BN) (gated: cdiv(N, BN / 2)) x (the experts'
// chunks of pmoe_gg_pass_rows(config) rows), which the host bounds from shapes (CTAs past the last tile exit). Strides of a
// and w must be multiples of 8 elements and the bases 16-byte aligned (TMA), the MXFP4 row strides
// multiples of 16 bytes. `tile_counter`: null (the static walk), or a zeroed int32 for the
// dynamic one (persistent configurations, bf16 weights); the kernel leaves it past the tile count.
// `rows_evict_last`: A's rows with the L2 policy evict-last (1) or normal (0). `load_policies`: a
// mask of which TMA loads carry their policy, 1 the weight tile's and 2 A's rows' (0-3). gather_src
// (bf16 weights), gather_div, gather_tokens: as pmoe_mx_rs_gemm's.
int pmoe_grouped_gemm(int config, int grid_x, int grid_y, void* stream, const void* a, long long stride_as,
                      long long stride_ar, int slabs, int rows, const void* w, long long stride_we,
                      long long stride_wn, int L, int w_rows, const void* offsets, const void* counts,
                      const void* bias, long long stride_be, int bias_kind, void* out, long long stride_os,
                      long long stride_or, int K, int N, int mode, int act, int has_limit, float limit,
                      float alpha, float beta, int w_kind, const void* q_blocks, const void* q_scales,
                      long long stride_qe, long long stride_qn, long long stride_se, long long stride_sn,
                      int* tile_counter, int rows_evict_last, int load_policies, const void* gather_src,
                      int gather_div, int gather_tokens) {
  if ((offsets == nullptr) == (counts == nullptr)) return -12;
  const bool gather = gather_src != nullptr;
  if (gather && (w_kind != 0 || !gather_fits(offsets, slabs, gather_div, gather_tokens, K, stride_ar))) return -27;
  if (grid_y != 1 || grid_x < 1 || N % 2 != 0 || L < 1) return -13;
  if (L > kMaxExperts) return -16;
  if (mode < kPlain || mode > kGatedPairs) return -14;
  if (mode != kPlain && act != kSilu && act != kSwigluoai && act != kSwigluoaiUninterleave) return -17;
  const bool gated_mode = mode == kGatedSplit || mode == kGatedPairs;
  if ((gated_mode && w_rows != 2 * N) || (!gated_mode && w_rows != N)) return -15;
  if (w_kind != 0 && (w_kind != 1 || q_blocks == nullptr || q_scales == nullptr || K % 32 != 0)) return -18;
  if (rows_evict_last < 0 || rows_evict_last > 1) return -22;
  if (load_policies < 0 || load_policies > (kPolicyWeights | kPolicyRows)) return -23;
  CUtensorMap ma;
  // Gathering: the map (prefetched, never loaded from) covers the token rows.
  const int err = encode_3d(&ma, a, K, gather ? gather_tokens : rows, slabs, stride_ar * 2, stride_as * 2,
                            kRowsPerGroup);
  if (err != 0) return err;
  const Args args{static_cast<const int64_t*>(offsets), static_cast<const int32_t*>(counts), L, rows, K, N, act,
                  has_limit, N, limit, alpha, beta, bias, stride_be, bias_kind, static_cast<uint16_t*>(out),
                  stride_os, stride_or, static_cast<const uint8_t*>(q_blocks), static_cast<const uint8_t*>(q_scales),
                  stride_qe, stride_qn, stride_se, stride_sn, w_rows, tile_counter,
                  rows_evict_last, load_policies, 0, 0, static_cast<const int32_t*>(gather_src),
                  static_cast<const uint16_t*>(a), stride_ar, gather_div, gather_tokens * gather_div, K};
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  int i = 0;
#define RUN(S, P, B, C) \
  if (config == i++) return launch_config<S, P, B, C>(w_kind, mode, ma, w, stride_we, stride_wn, args, grid_x, st);
  PMOE_GG_CONFIGS(RUN)
#undef RUN
  return -1;
}

// MXFP4 weights prepared for Hopper, upcast by the consumers (the RS kernel above): `stages` 3 or 4.
// a: bf16 [slabs][rows][K] as for pmoe_grouped_gemm; words: int32 [L][w_rows][KP / 8] (4-plane
// words), scales: int16 [L][KP / 32][w_rows] (folded), strides in elements; KP a multiple of 64 at
// least K (words past K hold code 0). Exactly one of offsets (int64 [L + 1]) and counts (int32 [L]).
// bias [L][w_rows] (float32 or bf16) or null. `mode` kPlain: out has w_rows columns; gated (act one
// of the silu family, with has_limit, limit, alpha, beta): gate rows 2j and up rows 2j + 1
// (kGatedPairs), or gate row j and up row w_rows / 2 + j (kGatedSplit), give activation column j,
// out has w_rows / 2 columns. `boxes`: 64-row boxes of a chunk, 4 (3 or 4 stages) or 5 (3 stages).
// The grid is one dimension, at least (the experts' chunks of 64 x boxes rows) x cdiv(out's
// columns, 128 plain or 64 gated), bounded by the host from shapes. Strides of a in multiples of 8
// elements and its data 16-byte aligned, the words' and scales' strides multiples of 16 bytes,
// out's columns a multiple of 8, its row stride a multiple of 8 elements and its data 16-byte
// aligned (16-byte stores). columns_first: the walk order (`rs_locate_tile`); persistent: one CTA
// per SM (1) or per tile of the grid (0); tail_pieces: a chunk's last, partial box in 16-row MMAs
// (1) or whole (0) (`rs_consume_boxes`); tile_counter: null (the static walk), or a zeroed int32
// from which a persistent launch takes its tiles (the dynamic walk). gather_src: null, or (GEMM1 on
// GROUPED_CONTIGUOUS, one slab) int32 [rows]: a holds gather_tokens token rows [gather_tokens][K] (K a
// multiple of 8) and row r of the flat buffer is a's row gather_src[r] / gather_div (a slot outside
// [0, gather_tokens x gather_div) reads zeros); `rows` is then out's.
int pmoe_mx_rs_gemm(int stages, int grid_x, int grid_y, void* stream, const void* a, long long stride_as,
                    long long stride_ar, int slabs, int rows, int K, const void* words, long long stride_we,
                    long long stride_wn, const void* scales, long long stride_se, long long stride_sg, int L,
                    int w_rows, int KP, const void* offsets, const void* counts, const void* bias,
                    long long stride_be, int bias_kind, void* out, long long stride_os, long long stride_or,
                    int columns_first, int persistent, int boxes, int mode, int act, int has_limit, float limit,
                    float alpha, float beta, int tail_pieces, void* tile_counter, const void* gather_src,
                    int gather_div, int gather_tokens) {
  if ((offsets == nullptr) == (counts == nullptr)) return -12;
  const bool gather = gather_src != nullptr;
  if (gather && !gather_fits(offsets, slabs, gather_div, gather_tokens, K, stride_ar)) return -27;
  if (grid_y != 1 || grid_x < 1 || L < 1) return -13;
  if (L > kMaxExperts) return -16;
  if (KP % kBK != 0 || K > KP || K < 1) return -24;
  if (mode != kPlain && mode != kGatedPairs && mode != kGatedSplit) return -14;
  // Split halves load a tile's gate and up rows as two boxes of 64 rows.
  const int w_box = mode == kGatedSplit ? kRsWRows / 2 : kRsWRows;
  CUtensorMap ma, mw, ms;
  // Gathering: the map (prefetched, never loaded from) covers the token rows.
  int err = encode_3d(&ma, a, K, gather ? gather_tokens : rows, slabs, stride_ar * 2, stride_as * 2, kRowsPerGroup);
  if (err == 0)
    err = encode_plain_3d(&mw, CU_TENSOR_MAP_DATA_TYPE_INT32, words, KP / 8, w_rows, L, stride_wn * 4, stride_we * 4,
                          kBK / 8, w_box);
  if (err == 0)
    err = encode_plain_3d(&ms, CU_TENSOR_MAP_DATA_TYPE_UINT16, scales, w_rows, KP / 32, L, stride_sg * 2,
                          stride_se * 2, w_box, kBK / 32);
  if (err != 0) return err;
  if (columns_first < 0 || columns_first > 1 || persistent < 0 || persistent > 1 || tail_pieces < 0 ||
      tail_pieces > 1)
    return -26;
  if (tile_counter != nullptr && persistent != 1) return -21;
  if (mode != kPlain && act != kSilu && act != kSwigluoai && act != kSwigluoaiUninterleave) return -17;
  if (mode != kPlain && w_rows % 2 != 0) return -15;
  const int N = mode == kPlain ? w_rows : w_rows / 2;  // output columns
  if (N % 8 != 0) return -24;
  // K carries the weights' padded K (the k tiles).
  const Args args{static_cast<const int64_t*>(offsets), static_cast<const int32_t*>(counts), L, rows, KP, N,
                  act, has_limit, mode == kGatedSplit ? N : 0, limit, alpha, beta, bias, stride_be, bias_kind,
                  static_cast<uint16_t*>(out), stride_os, stride_or, nullptr, nullptr, 0, 0, 0, 0, w_rows,
                  static_cast<int*>(tile_counter), 0, 0, columns_first, tail_pieces,
                  static_cast<const int32_t*>(gather_src), static_cast<const uint16_t*>(a), stride_ar, gather_div,
                  gather_tokens * gather_div, K};
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const bool p = persistent == 1;
  if (mode == kPlain) return rs_launch_chunks<kPlain>(stages, boxes, ma, mw, ms, args, grid_x, p, st);
  if (mode == kGatedPairs) return rs_launch_chunks<kGatedPairs>(stages, boxes, ma, mw, ms, args, grid_x, p, st);
  return rs_launch_chunks<kGatedSplit>(stages, boxes, ma, mw, ms, args, grid_x, p, st);
}

const char* pmoe_error_string(int code) {
  if (code == -1) return "unknown configuration";
  if (code == -10) return "cuTensorMapEncodeTiled is not available from the driver";
  if (code == -11) return "cuTensorMapEncodeTiled rejected a tensor (alignment, strides or sizes)";
  if (code == -12) return "exactly one of offsets and counts must be given";
  if (code == -13) return "the grid must be one-dimensional, N even and L positive";
  if (code == -14) return "unknown epilogue mode";
  if (code == -15) return "w's rows must be 2 N for a gated epilogue, N otherwise";
  if (code == -16) return "more than 1024 local experts";
  if (code == -17) return "the epilogue's activation is not of the silu family";
  if (code == -18) return "MXFP4 weights need their codes and scales and K a multiple of 32";
  if (code == -19) return "MXFP4 weights run in the 128-row configurations only";
  if (code == -21)
    return "a tile counter (the dynamic walk) needs a persistent launch: a persistent configuration and bf16 weights, "
           "or the RS kernel launched persistent";
  if (code == -22) return "the L2 policy of A's rows must be 0 (normal) or 1 (evict last)";
  if (code == -23) return "the load-policy mask must be 0-3 (1: the weight tile's loads carry their L2 policy, 2: A's rows')";
  if (code == -24) return "the RS kernel needs KP a multiple of 64, 1 <= K <= KP and its output columns a multiple of 8";
  if (code == -25) return "the RS kernel runs chunks of 4 boxes in 3 or 4 stages, of 5 boxes in 3";
  if (code == -27)
    return "gathered rows need bf16 or RS weights, offsets (one slab), gather_div and gather_tokens positive, K and "
           "a's row stride multiples of 8, and gather_tokens x gather_div below 2^31";
  if (code == -26)
    return "the RS kernel's walk order must be 0 (chunks first) or 1 (columns first), its persistence and tail "
           "pieces 0 or 1";
  if (code == -20) return "the kernel was compiled with fewer registers than its warpgroups share out (setmaxnreg)";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"
