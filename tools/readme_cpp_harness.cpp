// readme_cpp_harness.cpp: the translation unit tools/check_readme.py pastes the documentation's
// ```cpp snippets into, to compile them (c++ -fsyntax-only: they are type-checked against the
// public headers, never linked or run, since they need NCCL and several GPUs).
//
// It declares what the snippets use and do not declare themselves: the sizes (N, D, V; a rank's
// shard v0, Vl), the device buffers, the stream, a communicator (tp_comm: an ncclComm_t, which
// fusedce_nccl.h spells struct ncclComm*), the loop count of the micro-batches, and cudaMalloc's
// prototype (the snippets need no CUDA header for it).
#include <cstddef>
#include <cstdint>
#include <cstdio>

#include <fusedce.h>
#include <fusedce_nccl.h>

extern "C" int cudaMalloc(void** ptr, size_t bytes);

void readme_snippets(struct ncclComm* tp_comm, int64_t N, int64_t D, int64_t V, int64_t v0,
                     int64_t Vl, int micro_batches, const void* hidden, const void* weight_shard,
                     const void* targets, float* loss, void* grad_hidden, void* grad_weight_shard,
                     void* ws, void* stream) {
  (void)tp_comm, (void)N, (void)D, (void)V, (void)v0, (void)Vl, (void)micro_batches;
  (void)hidden, (void)weight_shard, (void)targets, (void)loss, (void)grad_hidden;
  (void)grad_weight_shard, (void)ws, (void)stream;
  {
    // @SNIPPETS@
  }
}
