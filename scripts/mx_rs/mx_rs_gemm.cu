// Probe (issue 12): the stand-alone form of the library's RS kernel (`mx_rs_kernel` in
// src/padded_moe/kernels/native/grouped_gemm.cu, whose helpers this file includes): an MXFP4 grouped
// GEMM for sm_90a whose consumer warpgroups upcast the weights straight into wgmma's register operand,
// with the weights on the MMA's M side and the tokens on its N side. It runs the library's tile body
// (`rs_consume`) and differs in its walk only: one CTA per tile of GROUPED_MASKED slabs, the tile
// decoded from blockIdx (expert, chunk, weight tile) without the experts' chunk prefix. Timed
// against the library's kernel by scripts/mx_rs_probe.py.
//
//   out[e, t, n] = bf16( sum_k a[e, t, k] * W[e, n, k] )   for t < counts[e] (GROUPED_MASKED slabs)
//
// Why. The library's Triton kernel also upcasts into the register operand, but its tiles take
// 128 token rows, so an expert with 256 rows upcasts its weights twice, and its warpgroups upcast
// and multiply in lockstep. Here a CTA owns (expert, 128 weight rows, up to 256 tokens): one
// producer thread brings the token rows (bf16, 128-byte swizzle), the prepared 4-plane words and
// the folded scales of a 64-wide k tile by TMA into a ring of stages; two consumer warpgroups of 64
// weight rows each read their words from shared memory and upcast them (the bits of
// `mx_words.cuh`) into the A registers of m64nNk16, N = the tile's tokens rounded up to 64 (four
// compiled bodies, chosen at run time). While one warpgroup upcasts, the other's MMAs run. The
// epilogue goes through shared memory to store 16-byte pieces of output rows.
//
// Word layout (`padded_moe.mxfp4.HopperMxfp4`, 4 planes): word 4g + c of a weight row holds the
// bf16 pairs (elements 32g + 2c + 8p, +1), p = 0..3, which is thread (lane % 4 = c)'s share of
// the A fragment of the two k16 steps of group g: planes 0 and 1 for k 0..15, 2 and 3 for 16..31.
#include "grouped_gemm.cu"

namespace probe {

template <int STAGES>
__global__ void __launch_bounds__(kRsThreads, 1)
    probe_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_w,
                 const __grid_constant__ CUtensorMap map_s, const Args args, int n_tiles, int chunks) {
  extern __shared__ uint8_t raw_smem[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw_smem) + 1023) & ~uintptr_t(1023));
  using Chunk = RsChunk<4>;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * Chunk::kStage + Chunk::kStaging);
  uint64_t* empty = full + STAGES;
  // Tiles expert by expert, chunk by chunk, then weight tile (the library's columns-first order).
  const int id = blockIdx.x;
  const int n_tile = id % n_tiles, rest = id / n_tiles;
  TileGeom g;
  g.e = rest / chunks;
  if (g.e >= args.L) return;
  expert_rows(args, g.e, g.slab, g.start, g.count);
  g.m0 = (rest % chunks) * pass_rows<4>();
  if (g.m0 >= g.count) return;
  g.n0 = g.w_row0 = g.w_row1 = n_tile * kRsWRows;
  g.boxes = min(4, (g.count - g.m0 + kRowsPerGroup - 1) / kRowsPerGroup);
  const int k_tiles = args.K / kBK;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 2);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  if (group == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRsProducerRegs));
    if (threadIdx.x != 0) return;
    for (int kt = 0; kt < k_tiles; ++kt) {
      const int s = kt % STAGES;
      mbar_wait(&empty[s], ((kt / STAGES) & 1) ^ 1);
      uint8_t* stage = smem + s * Chunk::kStage;
      mbar_expect_tx(&full[s], g.boxes * kABox + kRsWordsBytes + kRsScalesBytes);
      for (int b = 0; b < g.boxes; ++b)
        tma_load_3d(stage + b * kABox, &map_a, &full[s], kt * kBK, g.m0 + b * kRowsPerGroup, g.e, 0, false);
      tma_load_3d(stage + Chunk::kWordsOff, &map_w, &full[s], kt * (kBK / 8), g.n0, g.e, 0, false);
      tma_load_3d(stage + Chunk::kScalesOff, &map_s, &full[s], g.n0, kt * (kBK / 32), g.e, 0, false);
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRsConsumerRegs));
  const int c = group - 1;
  rs_consume_boxes<STAGES, kPlain, 4>(args, smem, full, empty, g, k_tiles, c, 0);
}

template <int STAGES>
int probe_launch(const CUtensorMap& ma, const CUtensorMap& mw, const CUtensorMap& ms, const Args& args, int n_tiles,
                 int chunks, cudaStream_t st) {
  const auto kernel = probe_kernel<STAGES>;
  constexpr int bytes = rs_smem_bytes<STAGES, 4>();
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) return static_cast<int>(err);
  // setmaxnreg shares out what the launch allocated: with fewer registers the consumers would wait forever.
  if (attr.numRegs * kRsThreads < kRsProducerRegs * 128 + kRsConsumerRegs * 256) return -20;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return static_cast<int>(err);
  const long long grid = (long long)args.L * chunks * n_tiles;
  kernel<<<static_cast<unsigned>(grid), kRsThreads, bytes, st>>>(ma, mw, ms, args, n_tiles, chunks);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace probe

extern "C" {

// a: bf16 [L][T][K]; words: int32 [L][Nw][K / 8] (4-plane words); scales: int16 [L][K / 32][Nw]
// (folded: the bf16 bits of 2^(s - 1)); counts: int32 [L]; out: bf16 [L][T][Nw]. All contiguous,
// K a multiple of 64, Nw of 8. Rows t >= counts[e] of out are not written.
int mx_rs_gemm(int stages, void* stream, const void* a, int L, int T, int K, const void* words, const void* scales,
               int Nw, const void* counts, void* out) {
  if (K % kBK != 0 || Nw % 8 != 0 || L < 1 || T < 1) return -13;
  CUtensorMap ma, mw, ms;
  int err = encode_3d(&ma, a, K, T, L, (long long)K * 2, (long long)T * K * 2, kRowsPerGroup);
  if (err == 0)
    err = encode_plain_3d(&mw, CU_TENSOR_MAP_DATA_TYPE_INT32, words, K / 8, Nw, L, (long long)K / 8 * 4,
                          (long long)Nw * (K / 8) * 4, kBK / 8, kRsWRows);
  if (err == 0)
    err = encode_plain_3d(&ms, CU_TENSOR_MAP_DATA_TYPE_UINT16, scales, Nw, K / 32, L, (long long)Nw * 2,
                          (long long)(K / 32) * Nw * 2, kRsWRows, kBK / 32);
  if (err != 0) return err;
  // The library's Args as pmoe_mx_rs_gemm fills them for GROUPED_MASKED slabs without a bias.
  const Args args{nullptr, static_cast<const int32_t*>(counts), L, T, K, Nw, 0, 0, 0, 0.0f, 1.0f, 0.0f, nullptr, 0, 0,
                  static_cast<uint16_t*>(out), (long long)T * Nw, Nw, nullptr, nullptr, 0, 0, 0, 0, Nw, nullptr, 0, 0};
  const int n_tiles = (Nw + kRsWRows - 1) / kRsWRows, chunks = (T + pass_rows<4>() - 1) / pass_rows<4>();
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (stages == 3) return probe::probe_launch<3>(ma, mw, ms, args, n_tiles, chunks, st);
  if (stages == 4) return probe::probe_launch<4>(ma, mw, ms, args, n_tiles, chunks, st);
  return -1;
}

const char* mx_rs_error(int code) {
  if (code == -1) return "stages must be 3 or 4";
  if (code == -13) return "K must be a multiple of 64, Nw of 8, L and T positive";
  return pmoe_error_string(code);
}

}  // extern "C"
