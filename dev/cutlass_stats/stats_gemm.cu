// stats_gemm.cu — a measured prototype, not part of the library (dev/NOTES.md, "What bounds the remaining cells, and linear CE measured in turns":
// correct, but 15-22 % slower at K = 4096 than the same CUTLASS GEMM storing its
// logits, so the library keeps cuBLASLt + its CE pass). The logits GEMM of sm_90 that keeps no
// logits: z = h·Wᵀ computed by a CUTLASS warp-specialised TMA GEMM whose epilogue rounds each accumulator to the dtype (as the
// cuBLASLt path stores it) and folds it into its row's online (max, Σexp relative to the max),
// one pair per (row, 256-column tile), written to a [round(N, 128), ⌈V / 256⌉] float2 buffer;
// nothing of size N×V is ever written. A row's tiles are then folded in tile order (fixed order:
// deterministic) by the caller (stats_test.cu folds them on the host). Meant as the forward half of a
// CE inside the GEMMs: fce_linear_ce without gradients (evaluation) on sm_90, no logits workspace.
// Built for sm_90a only (wgmma) by build.sh, which fetches the CUTLASS headers (PyPI
// nvidia-cutlass 4.2.0.0). Measurement knobs: FCE_STATS_PINGPONG (128×128 tiles, ping-pong
// schedule), FCE_STATS_NOEXP (the merge without its exponential: the machinery's own cost),
// FCE_STATS_OOB=false (no bounds checks: wrong on partial tiles), FCE_STATS_EPI=64 (epilogue
// subtiles of 128×64), FCE_STATS_BRANCHFREE (the merge with selects and ex2.approx: no branch),
// FCE_STATS_LEAN (that, and the element path without the identity guards the pairs need),
// FCE_STATS_NODE (with LEAN: the node's element loop written out, no bounds test inside
// interior tiles), FCE_STATS_FRAG (with NODE: each fragment's row slots folded at once against
// their new maximum).
//
// The reduction is CUTLASS's Sm90ColReduction (a per-row reduction over the tile's columns,
// FinalReduction = false: one partial per tile) with an element type of its own, RowMS = (m, s),
// and its merge as the reduction: the converter turns each accumulator a into (round(a), 1), the
// merge of (m1, s1) and (m2, s2) is (max, s1·2^((m1−max)·log2e) + s2·2^((m2−max)·log2e)) with one
// exponential (the larger side's factor is 1). A NaN logit makes s NaN, a +inf one the max +inf
// (a library version would flag both as the other kernels do; this prototype only measures).
#include "stats_gemm.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_store_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/numeric_conversion.h>

namespace fce {
namespace cuda {
namespace linear {

// A row's partial statistics over some columns: max m and Σ 2^((a − m)·log2e). T16 tags the
// dtype the accumulator is rounded to (a distinct type per dtype, for the converter below).
template <class T16>
struct alignas(8) RowMS {
  float m, s;
  RowMS() = default;
  // (CUTLASS writes ElementCompute(0) for a default identity: here the empty set)
  CUTLASS_HOST_DEVICE constexpr explicit RowMS(int) : m(-__builtin_huge_valf()), s(0.f) {}
  CUTLASS_HOST_DEVICE constexpr RowMS(float m_, float s_) : m(m_), s(s_) {}
};

constexpr float kLog2e = 1.4426950408889634f;

// Two partial pairs (the shuffle and shared-memory steps): either may be the identity.
template <class T16>
CUTLASS_HOST_DEVICE RowMS<T16> merge_pairs(RowMS<T16> a, RowMS<T16> b) {
#if defined(__CUDA_ARCH__)
  if (b.s == 0.f) return a;
  if (a.s == 0.f) return b;
  const float d = b.m - a.m;
  const float e = exp2f(-fabsf(d) * kLog2e);
  return RowMS<T16>(fmaxf(a.m, b.m), d <= 0.f ? fmaf(b.s, e, a.s) : fmaf(a.s, e, b.s));
#else
  return a;
#endif
}

// The accumulator rounded to the dtype and back (the logit the cuBLASLt path stores).
template <class T16>
__device__ __forceinline__ float round_to(float a) {
  if constexpr (std::is_same_v<T16, __nv_bfloat16>)
    return __bfloat162float(__float2bfloat16_rn(a));
  else
    return __half2float(__float2half_rn(a));
}

// 2^x, MUFU.EX2 (flushes denormals; −inf gives 0).
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <class T>
struct MsMerge;

template <class T16>
struct MsMerge<RowMS<T16>> {
  CUTLASS_HOST_DEVICE RowMS<T16> operator()(RowMS<T16> a, RowMS<T16> b) const {
#if defined(__CUDA_ARCH__)
#if defined(FCE_STATS_NOEXP)
    a.m = fmaxf(a.m, b.m); a.s += b.s; return a;
#endif
#if defined(FCE_STATS_LEAN)
    // the element path (b = (a logit, 1), from the converter; a a running pair or the identity
    // (−inf, 0), which this arithmetic takes as it is): selects only, one exponential
    const float d = b.m - a.m;
    const float e = ex2_approx(-fabsf(d) * kLog2e);
    return RowMS<T16>(fmaxf(a.m, b.m), d <= 0.f ? a.s + e : fmaf(a.s, e, 1.f));
#elif defined(FCE_STATS_BRANCHFREE)
    // selects only: one exponential of −|Δ|, the smaller side scaled by it (NaN on either side:
    // s NaN); an empty side (s = 0: the identity) leaves the other
    const float d = b.m - a.m;
    const float e = ex2_approx(-fabsf(d) * kLog2e);
    const float s = d <= 0.f ? fmaf(b.s, e, a.s) : fmaf(a.s, e, b.s);
    RowMS<T16> r(fmaxf(a.m, b.m), s);
    r = a.s == 0.f ? b : r;
    return b.s == 0.f ? a : r;
#else
    if (b.s == 0.f) return a;  // the identity (and rows past the problem)
    if (a.s == 0.f) return b;
    if (b.m <= a.m) {
      a.s += b.s * exp2f((b.m - a.m) * kLog2e);
    } else {  // (also a NaN on either side: s becomes NaN)
      a.s = a.s * exp2f((a.m - b.m) * kLog2e) + b.s;
      a.m = b.m;
    }
#endif
#endif
    return a;
  }
};

template <class T16, int N>
struct MsMerge<cutlass::Array<RowMS<T16>, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<RowMS<T16>, N> operator()(
      cutlass::Array<RowMS<T16>, N> const& a, cutlass::Array<RowMS<T16>, N> const& b) const {
    cutlass::Array<RowMS<T16>, N> r;
    CUTLASS_PRAGMA_UNROLL
#if defined(FCE_STATS_LEAN)
    for (int i = 0; i < N; ++i) r[i] = merge_pairs(a[i], b[i]);
#else
    MsMerge<RowMS<T16>> merge;
    for (int i = 0; i < N; ++i) r[i] = merge(a[i], b[i]);
#endif
    return r;
  }
};

}  // namespace linear
}  // namespace cuda
}  // namespace fce

namespace cutlass {
// The accumulator a (float32) → (round(a) to the dtype, 1): the logit as the cuBLASLt path stores
// it, as one element of its row's statistics.
template <class T16, int N, FloatRoundStyle Round>
struct NumericArrayConverter<fce::cuda::linear::RowMS<T16>, float, N, Round> {
  using result_type = Array<fce::cuda::linear::RowMS<T16>, N>;
  using source_type = Array<float, N>;
  CUTLASS_HOST_DEVICE static result_type convert(source_type const& s) {
    result_type r;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) {
#if defined(__CUDA_ARCH__)
      r[i] = fce::cuda::linear::RowMS<T16>(fce::cuda::linear::round_to<T16>(s[i]), 1.f);
#else
      r[i] = fce::cuda::linear::RowMS<T16>(s[i], 1.f);
#endif
    }
    return r;
  }
  CUTLASS_HOST_DEVICE result_type operator()(source_type const& s) const { return convert(s); }
};
}  // namespace cutlass

#ifndef FCE_STATS_OOB
#define FCE_STATS_OOB true
#endif
#if defined(FCE_STATS_EPI)
#define FCE_STATS_EPI_TILE Shape<_128, cute::Int<FCE_STATS_EPI>>
#else
#define FCE_STATS_EPI_TILE cutlass::epilogue::collective::EpilogueTileAuto
#endif

namespace fce {
namespace cuda {
namespace linear {
namespace {

using namespace cute;

#if defined(FCE_STATS_NODE)
// Sm90ColReduction with an element loop of its own (FCE_STATS_NODE): no bounds test inside
// interior tiles, the rounding and the merge written out (ex2.approx of −|Δ|, selects), the
// identity (−inf, 0) taken by the arithmetic; the shuffle, shared-memory and store steps are
// the base's (reduce(), end()).
template <class Base, class T16>
struct LeanColStats : Base {
  using Base::Base;

  template <class CB>
  struct Callbacks : CB {
    CUTLASS_DEVICE explicit Callbacks(CB&& cb) : CB(cute::move(cb)) {}

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const& frg_acc,
                              int epi_v, int epi_m, int epi_n,
                              cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      auto& [ref_src, tCrCol, tCcCol, gCol_l, cCol, gBuf_nl, sBuf_layout, lane_layout_MN,
             lane_mn, warp_layout_MN, warp_mn, tile_coord_mnkl, residue_cCol, residue_tCcCol,
             epi_tile, tiled_copy, thread_idx] = this->args_tuple;
      Tensor tCrCol_mn = tCrCol(_, _, _, epi_m, epi_n);
      Tensor tCcCol_mn = tCcCol(_, _, _, epi_m, epi_n);
      const bool interior =
          elem_less(cCol(size<0>(cCol) - 1, size<1>(cCol) - 1), residue_cCol);
  #if defined(FCE_STATS_FRAG)
      // Fragment first: each row slot's elements of this fragment are folded at once against the
      // slot's new maximum (one exponential and one add per element, one rescale per slot). The
      // slots are told apart by their register offsets (compile-time once unrolled).
      float x[FragmentSize];
      bool ok[FragmentSize];
      int off[FragmentSize];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        x[i] = round_to<T16>(frg_input[i]);
        ok[i] = interior || elem_less(tCcCol_mn(epi_v * FragmentSize + i), residue_tCcCol);
        off[i] = static_cast<int>(tCrCol_mn.layout()(epi_v * FragmentSize + i));
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        bool first = true;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < i; ++j) first = first && off[j] != off[i];
        if (first) {
          auto& r = tCrCol_mn(epi_v * FragmentSize + i);
          float m = r.m;
          CUTLASS_PRAGMA_UNROLL
          for (int j = i; j < FragmentSize; ++j)
            if (off[j] == off[i] && ok[j]) m = fmaxf(m, x[j]);
          const float mL = m * kLog2e;
          const float e0 = ex2_approx(fmaf(r.m, kLog2e, -mL));
          float s = r.s == 0.f ? 0.f : r.s * e0;
          CUTLASS_PRAGMA_UNROLL
          for (int j = i; j < FragmentSize; ++j) {
            if (off[j] == off[i] && ok[j]) {
              const float e = ex2_approx(fmaf(x[j], kLog2e, -mL));
              s += e;
            }
          }
          r.m = m;
          r.s = s;
        }
      }
      return frg_input;
#endif
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        const float x = round_to<T16>(frg_input[i]);
        if (interior || elem_less(tCcCol_mn(epi_v * FragmentSize + i), residue_tCcCol)) {
          auto& r = tCrCol_mn(epi_v * FragmentSize + i);
          const float d = x - r.m;
          const float e = ex2_approx(-fabsf(d) * kLog2e);
          r.s = d <= 0.f ? r.s + e : fmaf(r.s, e, 1.f);
          r.m = fmaxf(r.m, x);
        }
      }
      return frg_input;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    auto cb = Base::template get_consumer_store_callbacks<ReferenceSrc>(args);
    return Callbacks<decltype(cb)>(cute::move(cb));
  }
};
#endif

template <class T16>
struct Cutlass16;
template <>
struct Cutlass16<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct Cutlass16<__half> {
  using type = cutlass::half_t;
};

template <class T16>
struct StatsGemm {
  using Element = typename Cutlass16<T16>::type;
  using MS = RowMS<T16>;
#if defined(FCE_STATS_PINGPONG)
  using TileShape = Shape<_128, _128, _64>;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
#else
  using TileShape = Shape<_128, _256, _64>;
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
#endif
  using ClusterShape = Shape<_2, _1, _1>;
  using Reduce = cutlass::epilogue::fusion::Sm90ColReduction<
      MsMerge, MsMerge, MsMerge, 0, TileShape, MS, MS, cutlass::FloatRoundStyle::round_to_nearest,
      Stride<_1, _0, int64_t>, 128 / cutlass::sizeof_bits<MS>::value, false,
      /*FinalReduction=*/false, /*VisitCheckOOB=*/FCE_STATS_OOB>;
#if defined(FCE_STATS_NODE)
  using Node = LeanColStats<Reduce, T16>;
#else
  using Node = Reduce;
#endif
  using Tree = cutlass::epilogue::fusion::Sm90EVT<Node, cutlass::epilogue::fusion::Sm90AccFetch>;
  // (void D: no destination is stored; the builder still sizes a D layout from the fusion's
  // ElementAux, which a tree without an auxiliary store lacks: named here)
  struct Fusion : Tree {
    using Tree::Tree;
    using ElementAux = Element;
  };
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      FCE_STATS_EPI_TILE, float, float, void,
      cutlass::layout::RowMajor, 8, void, cutlass::layout::RowMajor, 8,
      EpilogueSchedule, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8,
      Element, cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments arguments(const Sm90StatsArgs& a) {
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    StrideA sa{};
    StrideB sb{};
    get<0>(sa) = a.lda;
    get<0>(sb) = a.ldb;
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {static_cast<int>(a.rows), static_cast<int>(a.cols),
                          static_cast<int>(a.depth), 1};
    args.mainloop.ptr_A = static_cast<const Element*>(a.hidden);
    args.mainloop.dA = sa;
    args.mainloop.ptr_B = static_cast<const Element*>(a.weight);
    args.mainloop.dB = sb;
    // the reduction node's arguments: the partials [round(rows, 128), tiles], its identity
    typename Reduce::Arguments red{};
    red.ptr_col = a.partials;
    red.reduction_identity = MS(0);
    args.epilogue.thread = {{}, red};
    args.hw_info.device_id = a.device;
    args.hw_info.sm_count = a.sm_count;
    return args;
  }

  static fce_status run(const Sm90StatsArgs& a, cudaStream_t stream) {
    Gemm gemm;
    typename Gemm::Arguments args = arguments(a);
    if (gemm.can_implement(args) != cutlass::Status::kSuccess)
      return fail(FCE_ERROR_INTERNAL, "%s: the sm_90 statistics GEMM cannot take %lld x %lld x %lld",
                  a.fn, static_cast<long long>(a.rows), static_cast<long long>(a.cols),
                  static_cast<long long>(a.depth));
    if (Gemm::get_workspace_size(args) > a.gemm_workspace_bytes)
      return fail(FCE_ERROR_INTERNAL, "%s: the sm_90 statistics GEMM needs %zu bytes of workspace",
                  a.fn, static_cast<size_t>(Gemm::get_workspace_size(args)));
    if (gemm.initialize(args, a.gemm_workspace, stream) != cutlass::Status::kSuccess ||
        gemm.run(stream) != cutlass::Status::kSuccess) {
      const cudaError_t e = cudaGetLastError();
      return fail(FCE_ERROR_CUDA, "%s: the sm_90 statistics GEMM failed to launch (%s)", a.fn,
                  cudaGetErrorString(e));
    }
    return FCE_SUCCESS;
  }

  static size_t workspace_bytes(const Sm90StatsArgs& a) {
    return Gemm::get_workspace_size(arguments(a));
  }
};

}  // namespace

size_t sm90_stats_gemm_workspace(const Sm90StatsArgs& a) {
  return a.dtype == FCE_BFLOAT16 ? StatsGemm<__nv_bfloat16>::workspace_bytes(a)
                                 : StatsGemm<__half>::workspace_bytes(a);
}

fce_status sm90_stats_gemm(const Sm90StatsArgs& a, cudaStream_t stream) {
  if (a.dtype == FCE_BFLOAT16) return StatsGemm<__nv_bfloat16>::run(a, stream);
  if (a.dtype == FCE_FLOAT16) return StatsGemm<__half>::run(a, stream);
  return fail(FCE_ERROR_INTERNAL, "%s: the sm_90 statistics GEMM takes f16/bf16 only", a.fn);
}

}  // namespace linear
}  // namespace cuda
}  // namespace fce
