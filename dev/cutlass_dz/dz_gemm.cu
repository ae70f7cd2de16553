// dz_gemm.cu — the gradient half of a CE inside the GEMMs, as a measurement (not part of the
// library; dev/NOTES.md "∂Z made inside the ∂h GEMM"): ∂h = ∂Z·W with ∂Z made from the logits inside the GEMM's
// mainloop, A (the logits) going through registers, so that no separate CE pass reads the
// logits and writes ∂Z.
//
// The mainloop is CUTLASS's sm_90 register-A ("RS") warp-specialised collective with its
// consumer loop replaced by DzMma::mma below: after each A k-block is copied from shared memory
// to registers, DZ_MODE transforms it in place before its wgmma:
//   DZ_MODE 0: nothing (the RS GEMM itself);
//   DZ_MODE 1: ∂Z = exp2(z·log2e − lse·log2e) − [k = y], rounded to bf16 (the gradient's
//              per-row scale belongs to the epilogue's alpha and is left out);
//   DZ_MODE 2: the same data flow with the exponential replaced by an FMA (wrong values: the
//              transform's cost without the MUFU).
// A prototype's simplification: the rows' lse and targets are indexed by the row within the
// 128-row tile (m mod 128), not the global row (the kernel's mma() is not told its tile); the
// cost per element is the same, and the check below uses the same rule.
//
//   dz_gemm            check on a small shape, then time the benchmark's ∂h shapes
// DZ_AHEAD (1 or 2): how many k-blocks ahead of its wgmma each A k-block is copied and transformed.
// Built by build.sh (sm_90a); C = f(A)·B with A [M, K] row-major (logits, K = V), B [K, N]
// row-major (W [V, D]), D [M, N] bf16.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#ifndef DZ_MODE
#define DZ_MODE 1
#endif
#ifndef DZ_AHEAD
#define DZ_AHEAD 1
#endif
#ifndef DZ_STAGES
#define DZ_STAGES 4
#endif

using namespace cute;
using Elt = cutlass::bfloat16_t;

constexpr int kTileM = 128;
struct DzRows {
  const float* lse2;  // [kTileM]: lse · log2(e)
  const int* target;  // [kTileM]
};
__constant__ DzRows g_rows;

// tCrA holds the k-block either as bf16 or as its 16-bit pattern (the collective's internal type)
template <class T> __device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, Elt>) return float(x);
  else return float(Elt::bitcast(x));
}
template <class T> __device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, Elt>) return Elt(x);
  else return Elt(x).raw();
}

__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <class Base>
struct DzMma : Base {
  using MainloopPipeline = typename Base::MainloopPipeline;
  using PipelineState = typename Base::PipelineState;
  using TensorStorage = typename Base::TensorStorage;
  using Params = typename Base::Params;
  using TiledMma = typename Base::TiledMma;
  using SmemLayoutA = typename Base::SmemLayoutA;
  using GmmaSmemLayoutB = typename Base::GmmaSmemLayoutB;
  using CopyAtomA = typename Base::InternalSmemCopyAtomA;
  static_assert(!Base::TransposeB && !Base::SwapAB, "16-bit operands only");

  // The consumer: every A k-block is copied to registers and transformed DZ_AHEAD k-blocks
  // ahead of its wgmma (so the copy and the transform overlap the wgmmas in flight); at most two wgmma
  // batches in flight; a k-tile's stage is released once the first wgmma of the next tile has
  // been waited past (all of its own wgmmas are then done). The last stage is released by the
  // base's mma_tail, as for the base's own mma().
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors,
                          Params const&) {
    Tensor sA = as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{}));  // (M,K,PIPE)
    Tensor gmma_sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), GmmaSmemLayoutB{});

    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Layout wg_layout = make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    const int wg_idx = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);

    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    auto wg_mma = tiled_mma.get_slice(wg_layout(wg_idx));
    Tensor tCrA = thr_mma.partition_fragment_A(sA(_, _, Int<0>{}));  // (MMA,MMA_M,MMA_K)
    Tensor tCsB = wg_mma.partition_B(gmma_sB);                         // (MMA,MMA_N,MMA_K,PIPE)
    Tensor tCrB = wg_mma.make_fragment_B(tCsB);
    auto copy_A = make_tiled_copy_A(CopyAtomA{}, tiled_mma);
    auto thr_copy_A = copy_A.get_thread_slice(thread_idx);
    Tensor tCrA_copy = thr_copy_A.retile_D(tCrA);    // (CPY,CPY_M,CPY_K)
    Tensor tCsA_copy = thr_copy_A.partition_S(sA);   // (CPY,CPY_M,CPY_K,PIPE)
    // the (m, k) of every element of tCrA within the tile
    Tensor tCcA = thr_mma.partition_A(make_identity_tensor(make_shape(size<0>(sA), size<1>(sA))));
    constexpr int KB = size<2>(tCrA);
    constexpr int kBlkK = size<1>(SmemLayoutA{});
    constexpr int kAhead = DZ_AHEAD;  // k-blocks copied and transformed ahead of their wgmma
    static_assert(kAhead >= 1 && KB >= kAhead + 2, "two wgmmas in flight and kAhead slots ahead");

    // the rows' lse and targets, held in registers for the whole tile
    constexpr int kV = size<0>(tCrA), kM = size<1>(tCrA);
    float lse2[kV * kM];
    int tgt[kV * kM];
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kM; ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < kV; ++v) {
        const int m = get<0>(tCcA(v, mm, 0));
        lse2[mm * kV + v] = g_rows.lse2[m];
        tgt[mm * kV + v] = g_rows.target[m];
      }
    }
    auto transform = [&](int kb, int k_tile) {
#if DZ_MODE != 0
      Tensor f = tCrA(_, _, kb);
      using FA = typename decltype(tCrA)::value_type;
      CUTLASS_PRAGMA_UNROLL
      for (int mm = 0; mm < kM; ++mm) {
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < kV; ++v) {
          const int k = k_tile * kBlkK + get<1>(tCcA(v, mm, kb));
          const float z = to_float(f(v, mm));
#if DZ_MODE == 1
          const float p = ex2_approx(fmaf(z, 1.4426950408889634f, -lse2[mm * kV + v]));
#else
          const float p = fmaf(z, 1.4426950408889634f, -lse2[mm * kV + v]);
#endif
          f(v, mm) = from_float<FA>(k == tgt[mm * kV + v] ? p - 1.f : p);
        }
      }
#else
      (void)kb;
      (void)k_tile;
#endif
    };

    PipelineState smem_pipe_release = smem_pipe_read;
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(accum);
    {
      auto token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, token);
    }
    int stage = smem_pipe_read.index();
    CUTLASS_PRAGMA_UNROLL
    for (int a = 0; a < kAhead; ++a) {
      copy(copy_A, tCsA_copy(_, _, a, stage), tCrA_copy(_, _, a));
      transform(a, 0);
    }
    CUTLASS_PRAGMA_NO_UNROLL
    for (int t = 0; t < k_tile_count; ++t) {
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < KB; ++kb) {
        warpgroup_fence_operand(accum);
        warpgroup_arrive();
        cute::gemm(tiled_mma, tCrA(_, _, kb), tCrB(_, _, kb, stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        warpgroup_commit_batch();
        // the k-block kAhead ahead: this tile's, or the next tile's (whose stage is waited for
        // at its first k-block)
        if (kb + kAhead < KB) {
          copy(copy_A, tCsA_copy(_, _, kb + kAhead, stage), tCrA_copy(_, _, kb + kAhead));
          transform(kb + kAhead, t);
        } else if (t + 1 < k_tile_count) {
          if (kb + kAhead == KB) {
            ++smem_pipe_read;
            auto token = pipeline.consumer_try_wait(smem_pipe_read);
            pipeline.consumer_wait(smem_pipe_read, token);
          }
          copy(copy_A, tCsA_copy(_, _, kb + kAhead - KB, smem_pipe_read.index()),
               tCrA_copy(_, _, kb + kAhead - KB));
          transform(kb + kAhead - KB, t + 1);
        }
        warpgroup_wait<1>();  // at most kb in flight: the slot written next is none of kb − 1, kb
        if (kb == 0 && t > 0) {  // every wgmma of tile t − 1 is done
          pipeline.consumer_release(smem_pipe_release);
          ++smem_pipe_release;
        }
        warpgroup_fence_operand(accum);
      }
      stage = smem_pipe_read.index();
    }
    warpgroup_fence_operand(accum);
  }
};

// ---- the kernels: the RS GEMM with DzMma, and CUTLASS's own SS GEMM of the same tile shape ----
using TileShape = Shape<_128, _256, _64>;
using ClusterShape = Shape<_2, _1, _1>;
using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using RowMajor = cutlass::layout::RowMajor;
using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajor, 8, Elt, RowMajor, 8,
    cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
using StrideA = cutlass::detail::TagToStrideA_t<RowMajor>;
using StrideB = cutlass::detail::TagToStrideB_t<RowMajor>;
using RsTiledMma = decltype(make_tiled_mma(
    GMMA::rs_op_selector<Elt, Elt, float, TileShape, GMMA::Major::K, GMMA::Major::MN>(),
    Layout<Shape<_2, _1, _1>>{}));
using RsBase = cutlass::gemm::collective::CollectiveMma<
    cutlass::gemm::MainloopSm90TmaGmmaRmemAWarpSpecialized<DZ_STAGES, ClusterShape, Schedule>,
    TileShape, Elt, StrideA, Elt, StrideB, RsTiledMma, SM90_TMA_LOAD,
    decltype(cutlass::gemm::collective::detail::rs_smem_selector<GMMA::Major::K, Elt, _128, _64>()),
    Copy_Atom<SM75_U32x4_LDSM_N, Elt>, cute::identity, SM90_TMA_LOAD_MULTICAST,
    decltype(cutlass::gemm::collective::detail::rs_smem_selector<GMMA::Major::MN, Elt, _256, _64>()),
    void, cute::identity>;
using RsKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, DzMma<RsBase>, Epi>;
using SsMain = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elt, RowMajor, 8, Elt, RowMajor, 8, float,
    TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
    Schedule>::CollectiveOp;
using SsKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, SsMain, Epi>;

template <class Kernel>
float run_gemm(int M, int N, int K, const Elt* A, const Elt* B, Elt* D, int reps) {
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {M, N, K, 1};
  args.mainloop.ptr_A = A;
  typename Kernel::StrideA sa{};  // A [M, K] row-major
  get<0>(sa) = K;
  args.mainloop.dA = sa;
  args.mainloop.ptr_B = B;
  typename Kernel::StrideB sb{};  // B [K, N] row-major: (n, k) at k·N + n
  get<1>(sb) = N;
  args.mainloop.dB = sb;
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  args.epilogue.ptr_D = D;
  typename Kernel::StrideD sd{};  // D [M, N] row-major
  get<0>(sd) = N;
  args.epilogue.dD = sd;
  args.epilogue.dC = args.epilogue.dD;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  args.hw_info.sm_count = sms;
  Gemm g;
  if (g.can_implement(args) != cutlass::Status::kSuccess) {
    printf("can_implement failed (%dx%dx%d)\n", M, N, K);
    exit(1);
  }
  size_t ws = Gemm::get_workspace_size(args);
  void* w = nullptr;
  if (ws) cudaMalloc(&w, ws);
  if (g.initialize(args, w) != cutlass::Status::kSuccess) {
    printf("initialize failed\n");
    exit(1);
  }
  for (int i = 0; i < (reps ? 2 : 1); ++i) g.run();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a);
  for (int i = 0; i < reps; ++i) g.run();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("CUDA error %s\n", cudaGetErrorString(e));
    exit(1);
  }
  if (w) cudaFree(w);
  return reps ? ms / reps : 0.f;
}

__global__ void fill(Elt* p, size_t n, unsigned seed, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned x = (unsigned)(i * 2654435761u) ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995;
    x ^= x >> 15;
    p[i] = Elt(((x & 0xffffff) / 16777216.0f - 0.5f) * scale);
  }
}

// A [M, K] and B [K, N] uniform in ±scale/2 (seeds s, s + 1), D [M, N]; freed with the struct.
struct Operands {
  Elt *A = nullptr, *B = nullptr, *D = nullptr;
  Operands(int M, int N, int K, unsigned seed, float scale_a, float scale_b) {
    cudaMalloc(&A, (size_t)M * K * 2);
    cudaMalloc(&B, (size_t)K * N * 2);
    cudaMalloc(&D, (size_t)M * N * 2);
    fill<<<1024, 256>>>(A, (size_t)M * K, seed, scale_a);
    fill<<<1024, 256>>>(B, (size_t)K * N, seed + 1, scale_b);
  }
  ~Operands() {
    cudaFree(A);
    cudaFree(B);
    cudaFree(D);
  }
};

static float bf(float x) { return float(Elt(x)); }

int main() {
  // the rows' data: lse around the logits' spread, targets spread over the columns
  std::vector<float> lse2(kTileM);
  std::vector<int> tgt(kTileM);
  for (int m = 0; m < kTileM; ++m) {
    lse2[m] = (4.0f + 0.05f * m) * 1.4426950408889634f;
    tgt[m] = (m * 7919) % 1024;
  }
  float* d_lse2;
  int* d_tgt;
  cudaMalloc(&d_lse2, kTileM * 4);
  cudaMalloc(&d_tgt, kTileM * 4);
  cudaMemcpy(d_lse2, lse2.data(), kTileM * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(d_tgt, tgt.data(), kTileM * 4, cudaMemcpyHostToDevice);
  DzRows rows{d_lse2, d_tgt};
  cudaMemcpyToSymbol(g_rows, &rows, sizeof rows);

  // ---- check: 384 × 512 × 1024 (3 M tiles, 16 k-tiles) against the host's f(A)·B in double
  {
    const int M = 384, N = 512, K = 1024;
    Operands o(M, N, K, 1, 8.f, 1.f);
    Elt *A = o.A, *B = o.B, *D = o.D;
    cudaMemset(D, 0xff, (size_t)M * N * 2);  // poison
    run_gemm<RsKernel>(M, N, K, A, B, D, 0);
    std::vector<Elt> hA((size_t)M * K), hB((size_t)K * N), hD((size_t)M * N);
    cudaMemcpy(hA.data(), A, hA.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(hB.data(), B, hB.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(hD.data(), D, hD.size() * 2, cudaMemcpyDeviceToHost);
    std::vector<float> fA((size_t)M * K);
    for (int m = 0; m < M; ++m)
      for (int k = 0; k < K; ++k) {
        const float z = float(hA[(size_t)m * K + k]);
        const int r = m % kTileM;
        float p = z;
        if (DZ_MODE == 1) p = exp2f(z * 1.4426950408889634f - lse2[r]);
        if (DZ_MODE == 2) p = z * 1.4426950408889634f - lse2[r];
        if (DZ_MODE != 0 && k == tgt[r]) p -= 1.f;
        fA[(size_t)m * K + k] = bf(p);
      }
    double num = 0, den = 0;
    bool finite = true;
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) {
        double ref = 0;
        for (int k = 0; k < K; ++k) ref += (double)fA[(size_t)m * K + k] * (double)float(hB[(size_t)k * N + n]);
        const double got = float(hD[(size_t)m * N + n]);
        finite = finite && std::isfinite(got);
        num += (got - ref) * (got - ref);
        den += ref * ref;
      }
    const double rel = std::sqrt(num / den);
    printf("check DZ_MODE=%d %dx%dx%d: relative error %.3e (%s)\n", DZ_MODE, M, N, K, rel,
           finite && rel < 1e-2 ? "ok" : "FAILED");
    if (!(finite && rel < 1e-2)) return 1;
  }

  // ---- time: the ∂h GEMMs of the benchmark's linear CE shapes (M tokens, N = D, K = V)
  const int shapes[][3] = {{8192, 4096, 128256}, {8192, 2304, 256000}, {16384, 4096, 32000}};
  for (auto& s : shapes) {
    const int M = s[0], N = s[1], K = s[2];
    Operands o(M, N, K, 3, 8.f, 0.05f);
    Elt *A = o.A, *B = o.B, *D = o.D;
    const double flop = 2.0 * M * N * K;
    const float t_rs = run_gemm<RsKernel>(M, N, K, A, B, D, 5);
    const float t_ss = run_gemm<SsKernel>(M, N, K, A, B, D, 5);
    const float t_rs2 = run_gemm<RsKernel>(M, N, K, A, B, D, 5);
    printf("%dx%dx%d  RS DZ_MODE=%d %.3f / %.3f ms (%.0f / %.0f TFLOP/s)  CUTLASS SS %.3f ms (%.0f TFLOP/s)\n",
           M, N, K, DZ_MODE, t_rs, t_rs2, flop / (t_rs * 1e9), flop / (t_rs2 * 1e9), t_ss,
           flop / (t_ss * 1e9));
  }
  return 0;
}
