// common/knobs.h — every environment variable that changes what the CUDA backend runs, in one
// place. None changes a result's promises, only which kernel or shape computes it: the tests use
// them to run a kernel on shapes the default policy gives to another, the benchmarks in dev/ to
// measure one choice against another. The default (unset) is the policy of ce/policy.h.
#pragma once

namespace fce {
namespace cuda {

// One field a variable, read once per process by knobs() (a getenv on the first call only).
struct Knobs {
  int path = 0;     // FCE_CUDA_CE_PATH=regs|twopass: the forward's rows in registers / two passes
  int cluster = 0;  // FCE_CUDA_CE_CLUSTER=1-16: the register path's cluster size where rows fit
  float prefetch_waves = -1.f;  // FCE_CUDA_CE_PREFETCH=0-16: the L2 prefetch distance in waves
  bool xmbar = true;   // FCE_CUDA_CE_XMBAR=0: clusters exchange through cluster barriers only
  bool pdl = true;     // FCE_CUDA_CE_PDL=0: no programmatic dependent launches (sm_90)
  int bulk = 1;        // FCE_CUDA_CE_BULK=0: no bulk-copy kernel; =2: on rows of any length
  int bulk_grad = -1;  // FCE_CUDA_CE_BULK_GRAD=0|1: bulk kernel with a gradient never / always
  int reg_smem = 12;   // FCE_CUDA_CE_SMEM=0-12: the most shared-memory slots per thread (0: none)
  bool smem_always = false;  // FCE_CUDA_CE_SMEM_ALWAYS=1: slots wherever they take fewer CTAs
  bool portable = false;  // FCE_CUDA_PORTABLE=1: a device of compute capability 9+ is treated as 8
                          // (no clusters, bulk copies or dependent launches): the path any GPU
                          // without them takes, testable on a Hopper
};
// (FCE_LINEAR_CE_PLAN=sliced: fce_linear_ce takes its vocabulary-sliced plan whenever it fits;
// read on every call by linear/plan.cu, force_sliced.)

// The knobs of this process, read from the environment on the first call (thread-safe).
const Knobs& knobs();

// The compute capability major the policy sees: the device's, or 8 under FCE_CUDA_PORTABLE=1.
inline int policy_major(int major) { return knobs().portable && major > 8 ? 8 : major; }

}  // namespace cuda
}  // namespace fce
