// Probe (not part of the library): the speed of CUTLASS's Hopper mixed-input GEMM on e2m1 weights.
//
// Question it answers (issue 12): is a warp-specialized kernel that streams tiles by TMA on a
// producer warp and converts e2m1 to bf16 on consumer warpgroups (CUTLASS >= 4.4's sm90 "RS"
// mixed-input collective, float_e2m1_t through a lookup table) much faster than our Triton
// prepared-MXFP4 kernel, whose upcast sits on the warps that issue the MMAs? That collective takes
// one scale per row per K tile of at least 64, so it cannot compute MXFP4 (32-element groups)
// exactly: the probe runs it with 64-element groups, for its speed only, and checks it against a
// reference of those same semantics. A kernel of ours for MXFP4 would be built on the same plan.
//
// Problem, per expert l of L (a batched GEMM: every expert has M rows, as GROUPED_MASKED slabs):
//   D[l] (bf16 [M, N], row-major) = A[l] (bf16 [M, K], row-major) x (W[l] * scales)^T
//   W[l]: e2m1 [N, K], two codes per byte along K, low nibble first (Mxfp4Tensor.blocks);
//   scales: bf16 [L, K/group, N] (N fastest: CUTLASS wants them MN-major).
// The narrow operand reaches the MMA through registers, so the weights are CUTLASS's "A" operand:
// the problem runs as (N, M, K, L) with D written transposed (= D[l] row-major).
//
// Built outside torch (no coupling to the device's torch build): a shared library with C entry
// points, loaded by scripts/cutlass_mx_probe.py through ctypes.
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -shared -Xcompiler -fPIC \
//        -I$CUTLASS/include -I$CUTLASS/tools/util/include -o libmx_gemm.so mx_gemm.cu

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

namespace {

using Act = cutlass::bfloat16_t;
using Quant = cutlass::float_e2m1_t;
using Scale = cutlass::bfloat16_t;
using Acc = float;

// Our operands in CUTLASS's tags: activations row-major [M, K]; weights [N, K] with K contiguous
// (CUTLASS's column-major B); output row-major [M, N].
using LayoutAct = cutlass::layout::RowMajor;
using LayoutW = cutlass::layout::ColumnMajor;
using LayoutOut = cutlass::layout::RowMajor;
constexpr int kAlignAct = 128 / cutlass::sizeof_bits<Act>::value;
constexpr int kAlignW = 128 / cutlass::sizeof_bits<Quant>::value;
constexpr int kAlignOut = 128 / cutlass::sizeof_bits<Act>::value;

template <class TileShape, class KernelSchedule, class EpilogueSchedule>
struct MxGemm {
  using ClusterShape = Shape<_1, _1, _1>;
  // Swapped: the weights are the builder's A (transposed tag), the activations its B.
  using LayoutA = typename cutlass::layout::LayoutTranspose<LayoutW>::type;
  using LayoutB = typename cutlass::layout::LayoutTranspose<LayoutAct>::type;
  using LayoutD = typename cutlass::layout::LayoutTranspose<LayoutOut>::type;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, Acc, Acc,
      void, LayoutD, kAlignOut,  // no C operand (beta = 0)
      Act, LayoutD, kAlignOut, EpilogueSchedule>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      cute::tuple<Quant, Scale>, LayoutA, kAlignW,
      Act, LayoutB, kAlignAct, Acc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = cutlass::detail::TagToStrideA_t<LayoutA>;
  using StrideB = cutlass::detail::TagToStrideB_t<LayoutB>;
  using StrideD = typename Kernel::StrideD;
  using StrideS = typename Mainloop::StrideScale;

  static typename Gemm::Arguments arguments(const void* act, const void* w, const void* scales, void* out,
                                            int M, int N, int K, int L, int group) {
    auto sA = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(N, K, L));
    auto sB = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(M, K, L));
    auto sD = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(N, M, L));
    int scale_k = (K + group - 1) / group;
    auto sS = cutlass::make_cute_packed_stride(StrideS{}, cute::make_shape(N, scale_k, L));
    return typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {N, M, K, L},
        {static_cast<const Quant*>(w), sA, static_cast<const Act*>(act), sB, static_cast<const Scale*>(scales), sS,
         group},
        {{1.0f, 0.0f}, nullptr, sD, static_cast<Act*>(out), sD}};
  }

  static size_t workspace(int M, int N, int K, int L, int group) {
    return Gemm::get_workspace_size(arguments(nullptr, nullptr, nullptr, nullptr, M, N, K, L, group));
  }

  static int run(const void* act, const void* w, const void* scales, void* out, int M, int N, int K, int L,
                 int group, void* ws, cudaStream_t stream) {
    auto args = arguments(act, w, scales, out, M, N, K, L, group);
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
    if (gemm.initialize(args, ws, stream) != cutlass::Status::kSuccess) return 2;
    if (gemm.run(stream) != cutlass::Status::kSuccess) return 3;
    return cudaGetLastError() == cudaSuccess ? 0 : 4;
  }
};

using Coop128x128 = MxGemm<Shape<_128, _128, _64>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                           cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Coop128x256 = MxGemm<Shape<_128, _256, _64>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                           cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Ping64x128 = MxGemm<Shape<_64, _128, _64>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                          cutlass::epilogue::TmaWarpSpecialized>;
using Ping64x256 = MxGemm<Shape<_64, _256, _64>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                          cutlass::epilogue::TmaWarpSpecialized>;

template <class F>
int dispatch(int config, F&& f) {
  switch (config) {
    case 0: return f(Coop128x128{});
    case 1: return f(Coop128x256{});
    case 2: return f(Ping64x128{});
    case 3: return f(Ping64x256{});
    default: return -1;
  }
}

}  // namespace

extern "C" {

// Tiles are (weight rows, token rows, K).
int mx_gemm_num_configs() { return 4; }

const char* mx_gemm_config_name(int config) {
  switch (config) {
    case 0: return "cooperative_128x128x64";
    case 1: return "cooperative_128x256x64";
    case 2: return "pingpong_64x128x64";
    case 3: return "pingpong_64x256x64";
    default: return "";
  }
}

// Bytes of workspace the configuration needs (-1: unknown configuration).
long long mx_gemm_workspace(int config, int M, int N, int K, int L, int group) {
  return dispatch(config, [&](auto g) { return static_cast<int>(decltype(g)::workspace(M, N, K, L, group)); });
}

// 0 on success; 1 can_implement refused, 2 initialize failed, 3 run failed, 4 a CUDA error, -1
// unknown configuration.
int mx_gemm_run(int config, const void* act, const void* w, const void* scales, void* out, int M, int N, int K,
                int L, int group, void* ws, cudaStream_t stream) {
  return dispatch(config, [&](auto g) { return decltype(g)::run(act, w, scales, out, M, N, K, L, group, ws, stream); });
}

}  // extern "C"
