// ce/path.cu — the run-time side of the row kernels' policy (ce/policy.h): the device's
// properties and the occupancy queries about the kernels (cluster residency, rows per wave,
// registers, shared-memory and non-portable cluster opt-ins), each asked once per (device,
// kernel, shape) and remembered in lock-free tables, then choose_rows. No device memory, no
// synchronisation, nothing enqueued: a graph capture around a call only ever sees the kernels.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>

#include "cuda/ce/geometry.cuh"
#include "cuda/ce/policy.h"
#include "cuda/common/knobs.h"

namespace fce {
namespace cuda {
namespace {

struct DeviceInfo {
  int device = 0;
  int major = 0;
};
fce_status device_info(const char* fn, DeviceInfo* d) {
  cudaError_t e = cudaGetDevice(&d->device);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&d->major, cudaDevAttrComputeCapabilityMajor, d->device);
  if (e != cudaSuccess)
    return fail(FCE_ERROR_CUDA, "%s: no usable CUDA device: %s", fn, cudaGetErrorString(e));
  d->major = policy_major(d->major);
  return FCE_SUCCESS;
}

// Whether clusters of k CTAs of 512 threads (the largest block) and the most shared memory
// (kRegSmemBytesMax when smem_ok, i.e. regs_smem_ready: so that the answer holds for every
// shape) of `kernel` can be resident; asked once per (device, kernel, k) and remembered. Also
// false when the kernel's code was not compiled for sm_90+ (e.g. compute_80 PTX JIT-compiled on
// a Hopper): that code has no cluster exchange, and k > 1 would give each CTA its slice's lse
// only.
constexpr int kMaxDevices = 64;
// 5 dtype pairs × 4 modes, + kSmemSlots with shared-memory slots; the same again from
// kRowTermsSlots (ce/policy.h) for the ROWT register kernels
constexpr int kSmemSlots = 20;
constexpr int kKernelSlots = 2 * kRowTermsSlots;
static_assert(kRowTermsSlots == 2 * kSmemSlots, "the ROWT cells follow the plain ones");
// 0 unknown, 1 yes, −1 no; indexed by the cluster size
std::atomic<signed char> g_cluster_fits[kMaxDevices][kKernelSlots][kMaxCluster + 1];

// Clusters of more than 8 CTAs are non-portable: the kernel opts in (a function attribute, set
// for the process) before any query or launch with one. False when the device refuses.
bool allow_cluster(const void* kernel, int k) {
  if (k <= 8) return true;
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (e == cudaSuccess) return true;
  (void)cudaGetLastError();
  return false;
}

// A register-path kernel's shared memory: it may take kRegSmemBytesMax of dynamic shared memory,
// with the carve-out at its largest (two CTAs per SM need 2 × 96 KB). Set once per (device,
// kernel) before any query or launch of it with smem > 0; false when the device refuses.
std::atomic<signed char> g_regs_smem[kMaxDevices][kKernelSlots][2];  // 0 unknown, 1 yes, −1 no

bool regs_smem_ready(const DeviceInfo& dev, const void* kernel, int slot, bool loop) {
  std::atomic<signed char>* cell = nullptr;
  if (dev.device >= 0 && dev.device < kMaxDevices && slot >= 0 && slot < kKernelSlots) {
    cell = &g_regs_smem[dev.device][slot][loop ? 1 : 0];
    const signed char v = cell->load(std::memory_order_relaxed);
    if (v != 0) return v > 0;
  }
  const bool ok =
      kernel &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           kRegSmemBytesMax) == cudaSuccess &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxShared) == cudaSuccess;
  if (!ok) (void)cudaGetLastError();
  if (cell) cell->store(ok ? 1 : -1, std::memory_order_relaxed);
  return ok;
}

// The SMs of the device, asked once per device and remembered; 0 when the query fails.
std::atomic<int> g_sms[kMaxDevices];  // 0 unknown, −1 failed, else the count

int sm_count(const DeviceInfo& dev) {
  std::atomic<int>* cell =
      dev.device >= 0 && dev.device < kMaxDevices ? &g_sms[dev.device] : nullptr;
  if (cell) {
    const int v = cell->load(std::memory_order_relaxed);
    if (v != 0) return v > 0 ? v : 0;
  }
  int sms = 0;
  const bool ok = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev.device) ==
                      cudaSuccess && sms > 0;
  if (!ok) (void)cudaGetLastError();
  if (cell) cell->store(ok ? sms : -1, std::memory_order_relaxed);
  return ok ? sms : 0;
}

bool cluster_query(const DeviceInfo& dev, const void* kernel, int slot, int k, bool smem_ok) {
  if (k == 1) return true;
  if (dev.major < 9 || k < 1 || k > kMaxCluster) return false;
  std::atomic<signed char>* cell = nullptr;
  if (dev.device >= 0 && dev.device < kMaxDevices && slot >= 0 && slot < kKernelSlots) {
    cell = &g_cluster_fits[dev.device][slot][k];
    const signed char v = cell->load(std::memory_order_relaxed);
    if (v != 0) return v > 0;
  }
  cudaFuncAttributes fa{};
  if (cudaFuncGetAttributes(&fa, kernel) != cudaSuccess || fa.ptxVersion < 90 ||
      !allow_cluster(kernel, k)) {
    (void)cudaGetLastError();
    if (cell) cell->store(-1, std::memory_order_relaxed);
    return false;
  }
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attr;
  make_cluster_launch(static_cast<unsigned>(k) * 16u, kRegThreads, k, nullptr, &cfg, &attr);
  cfg.dynamicSmemBytes = smem_ok ? kRegSmemBytesMax : 0;  // the largest a CTA may take
  int clusters = 0;
  const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg);
  if (e != cudaSuccess) (void)cudaGetLastError();  // a failed query only means "don't use it"
  const bool ok = e == cudaSuccess && clusters > 0;
  if (cell) cell->store(ok ? 1 : -1, std::memory_order_relaxed);
  return ok;
}

// Rows (clusters of k CTAs of `threads` with `smem` bytes of dynamic shared memory) of `kernel`
// resident at once on the device: asked once per (device, kernel, k, threads, smem) and
// remembered (the last shape asked per cell). 0 when the query fails.
// (shape << 32) | rows, shape = threads · (kRegSmemVptMax + 1) + smem / (threads · 16); 0
// unknown; indexed by persistence and the cluster size
std::atomic<int64_t> g_wave[kMaxDevices][kKernelSlots][2][kMaxCluster + 1];

int64_t wave_rows(const DeviceInfo& dev, const void* kernel, int slot, bool loop,
                  const RegConfig& rc) {
  const int k = rc.k, threads = rc.threads, smem = reg_smem_bytes(rc);
  const int64_t shape = int64_t(threads) * (kRegSmemVptMax + 1) + rc.smem;
  std::atomic<int64_t>* cell = nullptr;
  if (dev.device >= 0 && dev.device < kMaxDevices && slot >= 0 && slot < kKernelSlots && k >= 1 &&
      k <= kMaxCluster) {
    cell = &g_wave[dev.device][slot][loop ? 1 : 0][k];
    const int64_t v = cell->load(std::memory_order_relaxed);
    if (v != 0 && (v >> 32) == shape) return v & 0xffffffff;
  }
  int64_t rows = 0;
  if (k == 1) {
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) ==
        cudaSuccess)
      rows = int64_t(per_sm) * sm_count(dev);
  } else {
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr;
    make_cluster_launch(static_cast<unsigned>(k) * 16u, static_cast<unsigned>(threads), k, nullptr,
                        &cfg, &attr);
    cfg.dynamicSmemBytes = static_cast<size_t>(smem);
    int clusters = 0;
    if (allow_cluster(kernel, k) &&
        cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess)
      rows = clusters;
  }
  (void)cudaGetLastError();  // a failed query only means "no wave known"
  if (rows < 0 || rows > 0xffffffff) rows = 0;
  if (cell && rows > 0) cell->store((shape << 32) | rows, std::memory_order_relaxed);
  return rows;
}

// Registers per thread of a register-path kernel (its resident CTAs per SM), asked once per
// (device, kernel) and remembered; 0 when the query fails (then 64, the launch bound, is assumed).
std::atomic<int> g_regs[kMaxDevices][kKernelSlots];  // 0 unknown, −1 failed, else the count

int kernel_regs(const DeviceInfo& dev, const void* kernel, int slot) {
  std::atomic<int>* cell = nullptr;
  if (dev.device >= 0 && dev.device < kMaxDevices && slot >= 0 && slot < kKernelSlots) {
    cell = &g_regs[dev.device][slot];
    const int v = cell->load(std::memory_order_relaxed);
    if (v != 0) return v > 0 ? v : 0;
  }
  cudaFuncAttributes fa{};
  const bool ok = kernel && cudaFuncGetAttributes(&fa, kernel) == cudaSuccess && fa.numRegs > 0;
  if (!ok) (void)cudaGetLastError();
  if (cell) cell->store(ok ? fa.numRegs : -1, std::memory_order_relaxed);
  return ok ? fa.numRegs : 0;
}

std::atomic<signed char> g_pdl[kMaxDevices];  // 0 unknown, 1 yes, −1 no

// The CTAs of a bulk-kernel grid on this device (one per SM), or 0 when the kernel cannot run
// here: not compiled for sm_90 (compute_80 PTX JIT-compiled on a Hopper has an empty body), or
// its shared memory (the ring, opted in here once per device and kernel) does not fit. Asked
// once per (device, kernel) and remembered.
std::atomic<int> g_bulk[kMaxDevices][kKernelSlots][2];  // 0 unknown, −1 no, else the SM count

int bulk_ctas(const DeviceInfo& dev, const void* kernel, int slot, bool grad) {
  if (dev.major < 9 || !kernel) return 0;
  std::atomic<int>* cell = nullptr;
  if (dev.device >= 0 && dev.device < kMaxDevices && slot >= 0 && slot < kKernelSlots) {
    cell = &g_bulk[dev.device][slot][grad ? 1 : 0];
    const int v = cell->load(std::memory_order_relaxed);
    if (v != 0) return v > 0 ? v : 0;
  }
  int per_sm = 0;
  cudaFuncAttributes fa{};
  const int ring = bulk_ring_bytes(grad);
  bool ok = cudaFuncGetAttributes(&fa, kernel) == cudaSuccess && fa.ptxVersion >= 90 &&
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, ring) ==
                cudaSuccess &&
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBulkThreads, ring) ==
                cudaSuccess &&
            per_sm >= 1;
  (void)cudaGetLastError();  // a failed query only means "not here"
  const int sms = ok ? sm_count(dev) : 0;
  ok = ok && sms > 0;
  if (cell) cell->store(ok ? sms : -1, std::memory_order_relaxed);
  return ok ? sms : 0;
}

// The device's properties, asked once per device (a failed query leaves the field 0, or the
// sm_80/sm_90 value for the per-SM limits).
std::once_flag g_props_once[kMaxDevices];
DeviceProps g_props[kMaxDevices];

DeviceProps query_props(int device) {
  DeviceProps p;
  auto attr = [device](cudaDeviceAttr a, int fallback) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, a, device) != cudaSuccess || v <= 0) {
      (void)cudaGetLastError();
      return fallback;
    }
    return v;
  };
  p.major = policy_major(attr(cudaDevAttrComputeCapabilityMajor, 0));
  p.sms = attr(cudaDevAttrMultiProcessorCount, 0);
  p.regs_per_sm = attr(cudaDevAttrMaxRegistersPerMultiprocessor, p.regs_per_sm);
  p.max_threads_per_sm = attr(cudaDevAttrMaxThreadsPerMultiProcessor, p.max_threads_per_sm);
  p.max_ctas_per_sm = attr(cudaDevAttrMaxBlocksPerMultiprocessor, p.max_ctas_per_sm);
  p.smem_per_sm = attr(cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0);
  p.l2_bytes = attr(cudaDevAttrL2CacheSize, 0);
  p.dram_bytes_per_s = 2.0 * 1e3 * attr(cudaDevAttrMemoryClockRate, 0) *
                       (attr(cudaDevAttrGlobalMemoryBusWidth, 0) / 8);
  return p;
}

DeviceProps device_props(const DeviceInfo& dev) {
  if (dev.device < 0 || dev.device >= kMaxDevices) {
    DeviceProps p = query_props(dev.device);
    p.major = dev.major;
    return p;
  }
  std::call_once(g_props_once[dev.device], [&] { g_props[dev.device] = query_props(dev.device); });
  DeviceProps p = g_props[dev.device];
  p.major = dev.major;
  return p;
}

// The kernels of one launch_ce_rows call (RowsQuery), answered by the queries above.
class CudaRowsKernels final : public RowsKernels {
 public:
  CudaRowsKernels(const DeviceInfo& dev, const RowsQuery& q) : dev_(dev), q_(q) {}
  int regs(RowsKernel k) const override { return kernel_regs(dev_, kernel(k), slot(k)); }
  bool slots_ready(RowsKernel k) const override {
    return regs_smem_ready(dev_, kernel(k), q_.slot, loop(k));
  }
  bool cluster_fits(RowsKernel k, int cluster, bool smem) const override {
    return cluster_query(dev_, kernel(k), slot(k), cluster, smem);
  }
  int64_t wave_rows(RowsKernel k, const RegConfig& c) const override {
    return cuda::wave_rows(dev_, kernel(k), slot(k), loop(k), c);
  }
  int bulk_ctas(bool grad) const override {
    return cuda::bulk_ctas(dev_, q_.bulk_kernel, q_.slot, grad);
  }

 private:
  static bool loop(RowsKernel k) { return k == RowsKernel::kRegsLoop || k == RowsKernel::kSlotsLoop; }
  static bool slots(RowsKernel k) { return k == RowsKernel::kSlots || k == RowsKernel::kSlotsLoop; }
  int slot(RowsKernel k) const { return q_.slot + (slots(k) ? kSmemSlots : 0); }
  const void* kernel(RowsKernel k) const {
    switch (k) {
      case RowsKernel::kRegs: return q_.regs_kernel;
      case RowsKernel::kRegsLoop: return q_.regs_loop_kernel;
      case RowsKernel::kSlots: return q_.regs_smem_kernel;
      case RowsKernel::kSlotsLoop: return q_.regs_smem_loop_kernel;
    }
    return nullptr;
  }
  const DeviceInfo& dev_;
  const RowsQuery& q_;
};

}  // namespace

bool pdl_supported() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached) {
    const signed char v = g_pdl[device].load(std::memory_order_relaxed);
    if (v != 0) return v > 0;
  }
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  major = policy_major(major);
  if (cached) g_pdl[device].store(major >= 9 ? 1 : -1, std::memory_order_relaxed);
  return major >= 9;
}

int64_t stream_threads(int64_t vocab, int E, int cap) {
  const int64_t nvec_max = (E - 1 + vocab + E - 1) / E;
  const int64_t t = (nvec_max + kStreamUnroll - 1) / kStreamUnroll;
  return t < cap ? (t + 31) / 32 * 32 : cap;
}


fce_status choose_rows_path(const char* fn, const RowsQuery& q, RowsChoice* out) {
  DeviceInfo dev;
  FCE_TRY(device_info(fn, &dev));
  *out = choose_rows(device_props(dev), knobs(), q.shape, CudaRowsKernels(dev, q));
  return FCE_SUCCESS;
}

}  // namespace cuda
}  // namespace fce
