// common/knobs.h — every environment variable that changes what the CUDA backend runs, in one
// place. None changes a result's promises, only which kernel, shape or plan computes it: the
// tests use them to run a kernel on shapes the default policy gives to another, the benchmarks
// in dev/ to measure one choice against another. The default (unset) is the policy of
// ce/policy.h and linear/plan.cu. docs/performance.md, "Knobs", lists them.
#pragma once

namespace fce {
namespace cuda {

// Read once per process by knobs() (a getenv on the first call only). Five variables:
//   FCE_CUDA_CE_PATH=regs|twopass|bulk|nobulk  the row kernel: path, bulk
//   FCE_CUDA_CE_SMEM=0-12|always               the register path's slots: reg_smem,
//                                              smem_always (and bulk_grad)
//   FCE_CUDA_CE_CLUSTER=1-16                   the register path's cluster size: cluster
//   FCE_CUDA_PORTABLE=1                        a GPU without clusters: portable
//   FCE_LINEAR_CE_PLAN=sliced                  fce_linear_ce's plan: linear_sliced
// A value out of its range leaves the default.
struct Knobs {
  int path = 0;       // PATH=regs (1): the forward's rows in registers; =twopass (2): two passes
  int bulk = 1;       // PATH=nobulk (0): no bulk-copy kernel; =bulk (2): on rows of any length,
                      // with the gradient wherever a row fits a stage
  int cluster = 0;    // CLUSTER=k: the register path's cluster size wherever rows fit it
  int reg_smem = 12;  // SMEM=n: the most shared-memory slots per thread (0: none)
  bool smem_always = false;    // SMEM=always: slots wherever they take fewer CTAs, and
  bool bulk_grad = true;       // (false) the bulk kernel only without a gradient, so that the
                               // slot shapes run where it would have taken the rows
  bool portable = false;       // PORTABLE=1: a device of compute capability 9+ is treated as 8 (no
                               // clusters, bulk copies or dependent launches): the path any GPU
                               // without them takes, testable on a Hopper
  bool linear_sliced = false;  // LINEAR_CE_PLAN=sliced: fce_linear_ce takes its
                               // vocabulary-sliced plan whenever it fits (linear/plan.cu)
};

// The knobs of this process, read from the environment on the first call (thread-safe).
const Knobs& knobs();

// The compute capability major the policy sees: the device's, or 8 under FCE_CUDA_PORTABLE=1.
inline int policy_major(int major) { return knobs().portable && major > 8 ? 8 : major; }

}  // namespace cuda
}  // namespace fce
