// base_gemm.cu — the baseline of the prototype (build.sh): the same CUTLASS sm_90 GEMM configuration
// storing the bf16 logits (no reduction), and two others, on the same random data as stats_test.cu
#include <cstdio>
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
using namespace cute;
using Elt = cutlass::bfloat16_t;
template <class TileShape, class ClusterShape, class KS, class ES>
struct G {
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, 8, Elt, cutlass::layout::RowMajor, 8, ES>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elt, cutlass::layout::RowMajor, 8,
      Elt, cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>, KS>::CollectiveOp;
  using K = cutlass::gemm::kernel::GemmUniversal<Shape<int,int,int,int>, Main, Epi>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<K>;
  static float time(int M, int N, int Kd, Elt* A, Elt* B, Elt* D, int reps) {
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {M, N, Kd, 1};
    typename K::StrideA sa{}; get<0>(sa) = Kd; typename K::StrideB sb{}; get<0>(sb) = Kd;
    typename K::StrideD sd{}; get<0>(sd) = N;
    args.mainloop.ptr_A = A; args.mainloop.dA = sa; args.mainloop.ptr_B = B; args.mainloop.dB = sb;
    args.epilogue.thread.alpha = 1.f; args.epilogue.thread.beta = 0.f;
    args.epilogue.ptr_D = D; args.epilogue.dD = sd; args.epilogue.dC = sd;
    int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    args.hw_info.sm_count = sms;
    Gemm g; size_t ws = Gemm::get_workspace_size(args); void* w = nullptr; if (ws) cudaMalloc(&w, ws);
    if (g.can_implement(args) != cutlass::Status::kSuccess) { printf("cannot\n"); return 0; }
    g.initialize(args, w); for (int i = 0; i < 3; ++i) g.run();
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b); cudaEventRecord(a);
    for (int i = 0; i < reps; ++i) g.run();
    cudaEventRecord(b); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b);
    cudaError_t e = cudaGetLastError(); if (e) printf("err %s\n", cudaGetErrorString(e));
    return ms / reps;
  }
};
__global__ void fillr(Elt* p, size_t n, unsigned seed, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned x = (unsigned)(i * 2654435761u) ^ seed; x ^= x >> 13; x *= 0x5bd1e995; x ^= x >> 15;
    p[i] = Elt(((x & 0xffffff) / 16777216.0f - 0.5f) * scale);
  }
}
int main() {
  int shapes[][3] = {{8192, 128256, 4096}, {4096, 128256, 4096}, {8192, 256000, 2304}};
  for (auto& s : shapes) {
    int M = s[0], N = s[1], Kd = s[2];
    Elt *A, *B, *D; cudaMalloc(&A, (size_t)M*Kd*2); cudaMalloc(&B, (size_t)N*Kd*2); cudaMalloc(&D, (size_t)M*N*2);
    fillr<<<1024,256>>>(A, (size_t)M*Kd, 1, 4.f); fillr<<<1024,256>>>(B, (size_t)N*Kd, 2, 12.f / sqrtf((float)Kd));
    double fl = 2.0 * M * N * Kd;
    float t1 = G<Shape<_128,_256,_64>, Shape<_2,_1,_1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative>::time(M, N, Kd, A, B, D, 10);
    float t2 = G<Shape<_128,_128,_64>, Shape<_2,_1,_1>, cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized>::time(M, N, Kd, A, B, D, 10);
    float t3 = G<Shape<_128,_256,_64>, Shape<_1,_2,_1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative>::time(M, N, Kd, A, B, D, 10);
    printf("%dx%dx%d store bf16: coop 128x256 c2x1 %.3f ms %.0f TF | pingpong 128x128 c2x1 %.3f ms %.0f TF | coop 128x256 c1x2 %.3f ms %.0f TF\n", M, N, Kd,
           t1, fl / (t1 * 1e-3) / 1e12, t2, fl / (t2 * 1e-3) / 1e12, t3, fl / (t3 * 1e-3) / 1e12);
    cudaFree(A); cudaFree(B); cudaFree(D);
  }
}
