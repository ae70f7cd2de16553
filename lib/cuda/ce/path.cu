// ce/path.cu — the host side of the cross-entropy row kernels (ce/kernels.cu): which kernel
// runs a launch_ce_rows call, and in what shape (ce/geometry.cuh declares it all). Why a path
// is chosen is ce/kernels.cu's header; this file is the how:
//   * the register path's shape: for each cluster size k (reg_config) the CTAs that hold a row's
//     slices, whole warps, every vector covered; the smallest power of two that fits, or for
//     16-bit rows a size whose nearly full CTAs keep more of the rows resident per SM
//     (choose_reg_config, from the kernel's registers per thread, asked once per device and
//     kernel);
//   * whether that cluster can be resident on the current device (cluster_fits): a host-side
//     occupancy query, once per (device, kernel, cluster size), remembered in a lock-free table;
//   * the measurement overrides FCE_CUDA_CE_PATH and FCE_CUDA_CE_CLUSTER, read once.
// No device memory, no synchronisation, nothing enqueued: a graph capture around a call only
// ever sees the kernels. With -DFCE_CE_SELFTEST the file also holds ce_rows_selftest(), the
// host check of the register path's index arithmetic (the ctest target CudaCeRowsSelftest
// compiles this file alone with it and runs it, no GPU needed).
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/ce/geometry.cuh"

namespace fce {
namespace cuda {
namespace {

// Tuning and measurement overrides, read once: FCE_CUDA_CE_PATH = auto | regs | twopass
// (forward only), FCE_CUDA_CE_CLUSTER = the register path's cluster size (1 to 16) wherever a
// row's slices fit it, FCE_CUDA_CE_KRULE = pow2: the register path's cluster the smallest power
// of two that holds the row (the rule before choose_reg_config, for measurement),
// FCE_CUDA_CE_PREFETCH = the register path's L2 prefetch distance in waves of resident rows
// for every shape (0 = none; unset: kDefaultPrefetchWaves, kSlotPrefetchWaves with shared-memory
// slots), FCE_CUDA_CE_PERSIST = 1: the forward's register path runs persistent too,
// FCE_CUDA_CE_XMBAR = 0: cluster barriers for the exchange, FCE_CUDA_CE_PDL = 0: no programmatic
// dependent launches, FCE_CUDA_CE_BULK = 0: no bulk-copy kernel (ce/bulk_kernel.cuh), 2: it for rows of
// any length (and with a gradient wherever a row fits a stage), FCE_CUDA_CE_BULK_GRAD = 0 / 1:
// with a gradient never / for every row that fits, FCE_CUDA_CE_SMEM = the most vectors per
// thread a register-path CTA may hold in shared memory (0 = registers only, the rule before
// the slots; at most kRegSmemVptMax), FCE_CUDA_CE_SMEM_ALWAYS=1: that shape wherever it takes
// fewer CTAs than registers alone, whatever the residency and the waves (tests),
// FCE_CUDA_CE_UNIT = 0: no kUnit kernels (s = 1 runs the kPlain ones; for measurement).
struct Overrides {
  int path = 0;  // 0 auto, 1 regs (same as auto when the row fits), 2 twopass
  int cluster = 0;  // FCE_CUDA_CE_CLUSTER: this size where a row's slices fit it (0: chosen)
  float prefetch_waves = -1.f;  // FCE_CUDA_CE_PREFETCH; −1 (unset): by shape
  int persist = 0;
  int xmbar = 1;  // FCE_CUDA_CE_XMBAR=0: clusters exchange through cluster barriers only
  int pdl = 1;    // FCE_CUDA_CE_PDL=0: no programmatic dependent launches
  int bulk = 1;   // FCE_CUDA_CE_BULK=0: forward-only rows keep the register / two-pass kernels;
                  // 2: the bulk kernel for rows of any length, with a gradient too where the
                  // row fits a stage (tests: every shape runs it)
  int krule_pow2 = 0;  // FCE_CUDA_CE_KRULE=pow2
  int bulk_grad = -1;  // FCE_CUDA_CE_BULK_GRAD: −1 (unset) the measured choice, 0 never, 1 always
                       // (with a gradient, rows that fit a stage)
  int reg_smem = kRegSmemVptMax;  // FCE_CUDA_CE_SMEM
  int smem_always = 0;            // FCE_CUDA_CE_SMEM_ALWAYS=1
  int unit = 1;                   // FCE_CUDA_CE_UNIT=0
};
const Overrides& overrides() {
  static const Overrides o = [] {
    Overrides r;
    if (const char* s = getenv("FCE_CUDA_CE_PATH")) {
      if (!strcmp(s, "regs")) r.path = 1;
      else if (!strcmp(s, "twopass")) r.path = 2;
    }
    if (const char* s = getenv("FCE_CUDA_CE_CLUSTER")) {
      const int k = atoi(s);
      if (k >= 1 && k <= kMaxCluster) r.cluster = k;
    }
    if (const char* s = getenv("FCE_CUDA_CE_PREFETCH")) {
      const float w = static_cast<float>(atof(s));
      if (w >= 0.f && w <= 16.f) r.prefetch_waves = w;
    }
    if (const char* s = getenv("FCE_CUDA_CE_PERSIST")) r.persist = atoi(s) == 1;
    if (const char* s = getenv("FCE_CUDA_CE_XMBAR")) r.xmbar = atoi(s) != 0;
    if (const char* s = getenv("FCE_CUDA_CE_PDL")) r.pdl = atoi(s) != 0;
    if (const char* s = getenv("FCE_CUDA_CE_BULK")) r.bulk = atoi(s);
    if (const char* s = getenv("FCE_CUDA_CE_KRULE")) r.krule_pow2 = !strcmp(s, "pow2");
    if (const char* s = getenv("FCE_CUDA_CE_BULK_GRAD")) r.bulk_grad = atoi(s) != 0 ? 1 : 0;
    if (const char* s = getenv("FCE_CUDA_CE_SMEM")) {
      const int v = atoi(s);
      if (v >= 0 && v <= kRegSmemVptMax) r.reg_smem = v;
    }
    if (const char* s = getenv("FCE_CUDA_CE_SMEM_ALWAYS")) r.smem_always = atoi(s) == 1;
    if (const char* s = getenv("FCE_CUDA_CE_UNIT")) r.unit = atoi(s) != 0;
    return r;
  }();
  return o;
}

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
  return FCE_SUCCESS;
}

// Whether clusters of k CTAs of 512 threads (the largest block) and the most shared memory
// (kRegSmemBytesMax when smem_ok, i.e. regs_smem_ready: so that the answer holds for every
// shape) of `kernel` can be resident; asked once per (device, kernel, k) and remembered. Also
// false when the kernel's code was not compiled for sm_90+ (e.g. compute_80 PTX JIT-compiled on
// a Hopper): that code has no cluster exchange, and k > 1 would give each CTA its slice's lse
// only.
constexpr int kMaxDevices = 64;
constexpr int kKernelSlots = 40;  // 5 dtype pairs × 4 modes, + kSmemSlots with shared-memory slots
constexpr int kSmemSlots = 20;
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

bool cluster_fits(const DeviceInfo& dev, const void* kernel, int slot, const RegConfig& rc,
                  bool smem_ok) {
  const int k = rc.k;
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

// Row bytes a streaming multiprocessor holds at once in that shape: the slice times the CTAs of
// `threads` threads of `regs` registers each that fit its register file and thread slots. The
// register path reads at the copy rate when this is near the register file's half that holds
// data (128 KB on sm_80/sm_90), and measurably slower below (dev/NOTES.md, H100,
// 2026-11-24: 100 KB resident ran at 87-89 % of copy, 111 KB at 83 %, 125-128 KB at 92-98 %).
// (The CTAs of `threads` threads of `regs` registers an SM's register file and thread slots
// hold: regs_ctas_per_sm.)
int64_t regs_ctas_per_sm(int regs, int threads) {
  const int64_t r = regs > 0 ? (regs + 7) / 8 * 8 : 64;  // allocated per thread in units of 8
  int64_t ctas = kRegFileRegs / (r * threads);
  if (ctas > kMaxThreadsPerSm / threads) ctas = kMaxThreadsPerSm / threads;
  if (ctas > kMaxCtasPerSm) ctas = kMaxCtasPerSm;
  return ctas;
}
int64_t reg_resident_bytes(const RegConfig& c, int regs) {
  return c.per * 16 * regs_ctas_per_sm(regs, c.threads);
}

// Thresholds of choose_rows_path's choice of the shape with shared-memory slots. The
// registers-only shape keeps enough of the rows resident from 115 KiB per SM: on an H100 128256
// bf16 in 4 CTAs keeps 117.7 KiB (96 % of copy, 90 % with slots in 2 CTAs), 256000 bf16 in 8
// keeps 113.6 KiB (92 %, 96 % with slots in 4). The slots need 16 waves of their CTAs:
// 1024×151936 bf16 (7.8 waves) lost 3 points of copy with them, 1024×256000 (16.5) gained 0.5.
// Their clusters should fill 88 % of the CTA slots (clusters of 7 fill 84.8 % on an H100).
constexpr int64_t kRegResidentEnough = int64_t{115} << 10;
constexpr int64_t kSmemMinWaves = 16;
constexpr double kSmemMinSlotShare = 0.88;

// CTAs of the shape a launch of `kernel` really keeps resident per SM: the clusters resident at
// once (wave_rows: the occupancy query, GPC packing included) × k, over the SMs. 0 when unknown.
double resident_ctas_per_sm(const DeviceInfo& dev, const void* kernel, int slot,
                            const RegConfig& c) {
  const int sms = sm_count(dev);
  return sms > 0 ? static_cast<double>(wave_rows(dev, kernel, slot, false, c) * c.k) / sms : 0.0;
}

// The shape with shared-memory slots: rc (the smallest cluster that holds the row), or the first
// of the next three sizes whose clusters fill at least 88 % of the CTA slots when rc's do not.
// The share of the CTA slots is the resident CTAs over those an SM holds by registers and
// threads.
RegConfig fuller_cluster(const DeviceInfo& dev, const RowsQuery& q, int lead_max, int max_k,
                         int smem_max, const RegConfig& rc) {
  const int kslot = q.slot + kSmemSlots;
  const int64_t slots = regs_ctas_per_sm(kernel_regs(dev, q.regs_smem_kernel, kslot), kRegThreads);
  auto full_enough = [&](const RegConfig& c) {
    return resident_ctas_per_sm(dev, q.regs_smem_kernel, kslot, c) >= kSmemMinSlotShare * slots;
  };
  if (full_enough(rc)) return rc;
  for (int k = rc.k + 1; k <= rc.k + 3 && k <= max_k; ++k) {
    RegConfig c{};
    if (reg_config(q.vocab, q.elem_bytes, lead_max, k, smem_max, &c) && c.smem > 0 &&
        full_enough(c))
      return c;
  }
  return rc;
}

}  // namespace

bool unit_mode_enabled() { return overrides().unit != 0; }

bool pdl_supported() {
  if (!overrides().pdl) return false;
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
  if (cached) g_pdl[device].store(major >= 9 ? 1 : -1, std::memory_order_relaxed);
  return major >= 9;
}

bool reg_config(int64_t vocab, int elem_bytes, int lead_max, int k, int smem_max, RegConfig* c) {
  if (vocab < 1 || vocab > kRegMaxVocab || k < 1 || k > kMaxCluster) return false;
  if (smem_max < 0) smem_max = 0;
  if (smem_max > kRegSmemVptMax) smem_max = kRegSmemVptMax;
  const int64_t E = 16 / elem_bytes;
  const int64_t nvec_max = (lead_max + vocab + E - 1) / E;
  const int64_t per = (nvec_max + k - 1) / k;
  int64_t threads = 0, smem = 0;
  if (per <= kRegVecsPerCta) {  // registers alone: a CTA cut to the slice
    threads = (per + kRegVpt - 1) / kRegVpt;
    threads = (threads + 31) / 32 * 32;
  } else {  // every register of a full CTA, the rest of the slice in shared memory
    threads = kRegThreads;
    smem = (per - kRegVecsPerCta + kRegThreads - 1) / kRegThreads;
    if (smem > smem_max) return false;
  }
  if (threads > kRegThreads || threads * (kRegVpt + smem) < per ||
      threads * (kRegVpt + smem) * k < nvec_max)
    return false;  // cannot happen: the invariant the kernel relies on
  c->k = k;
  c->threads = static_cast<int>(threads);
  c->per = per;
  c->smem = static_cast<int>(smem);
  return true;
}

bool choose_reg_config(int64_t vocab, int elem_bytes, int lead_max, int max_k, int force_k,
                       int regs, bool pow2_only, int smem_max, RegConfig* c) {
  if (max_k > kMaxCluster) max_k = kMaxCluster;
  if (force_k >= 1 && force_k <= max_k &&
      (reg_config(vocab, elem_bytes, lead_max, force_k, 0, c) ||
       reg_config(vocab, elem_bytes, lead_max, force_k, smem_max, c)))
    return true;
  RegConfig base{};
  bool found = false;
  for (int k = 1; k <= max_k && !found; k *= 2)
    found = reg_config(vocab, elem_bytes, lead_max, k, 0, &base);
  // with shared memory: the smallest cluster that holds the row, where it has fewer CTAs
  RegConfig hyb{};
  bool hfound = false;
  for (int k = 1; smem_max > 0 && k <= max_k && !hfound && (!found || k < base.k); ++k)
    hfound = reg_config(vocab, elem_bytes, lead_max, k, smem_max, &hyb);
  if (hfound) {
    *c = hyb;
    return true;
  }
  if (!found) return false;
  *c = base;
  if (pow2_only || elem_bytes != 2) return true;
  // 16-bit rows: a cluster of another size whose CTAs are nearly full and keep over 5 % more of
  // the rows resident per SM
  const int64_t held0 = reg_resident_bytes(base, regs);
  int64_t best = held0 * 21 / 20;
  for (int k = 3; k <= max_k; ++k) {
    RegConfig r{};
    if (!(k & (k - 1)) || !reg_config(vocab, elem_bytes, lead_max, k, 0, &r) ||
        r.threads < kRegFullThreads)
      continue;
    const int64_t held = reg_resident_bytes(r, regs);
    if (held > best) {
      best = held;
      *c = r;
    }
  }
  return true;
}

int64_t stream_threads(int64_t vocab, int E, int cap) {
  const int64_t nvec_max = (E - 1 + vocab + E - 1) / E;
  const int64_t t = (nvec_max + kStreamUnroll - 1) / kStreamUnroll;
  return t < cap ? (t + 31) / 32 * 32 : cap;
}

// The register path's shape for these rows (cluster size, threads, shared-memory slots), and
// whether one fits this device (the cluster query): false when none does.
bool choose_regs_shape(const DeviceInfo& dev, const RowsQuery& q, RegConfig* out) {
  const int lead_max = q.aligned_rows ? 0 : 16 / q.elem_bytes - 1;
  const int max_k = dev.major >= 9 ? kMaxCluster : 1;
  const int regs = kernel_regs(dev, q.regs_kernel, q.slot);
  // shared-memory slots only on sm_90+ (where they were measured) and when both kernels with
  // them take their shared memory (the forward and fce_backward_rescale's persistent kernel
  // must choose the same shape: the same bits)
  const int smem_max =
      dev.major >= 9 && overrides().reg_smem > 0 &&
              regs_smem_ready(dev, q.regs_smem_kernel, q.slot, false) &&
              regs_smem_ready(dev, q.regs_smem_loop_kernel, q.slot, true)
          ? overrides().reg_smem : 0;
  RegConfig rc{1, kRegThreads, 0, 0};
  const bool found = choose_reg_config(q.vocab, q.elem_bytes, lead_max, max_k, overrides().cluster,
                                       regs, overrides().krule_pow2 != 0, smem_max, &rc);
  // The shape with shared-memory slots (fewer CTAs per row) only where the registers-only one
  // keeps less than kRegResidentEnough of the rows really resident per SM (its occupancy
  // query: the idle CTA slots of clusters that do not pack the GPCs count): measured on an
  // H100, 128256 bf16 in 4 CTAs (117.7 KiB) ran at 96 % of copy and in 2 with slots at 90 %,
  // while 256000 bf16 (8 CTAs, 113.6 KiB: 92 % → 4 with slots: 96 %), 151936 bf16 (5 CTAs:
  // 89 → 93 %) and float32 rows (80-90 → 92-95 %) gained (dev/NOTES.md, "shared-memory
  // slots"). Nor for launches of fewer than kSmemMinWaves waves of its (longer-lived) CTAs: the
  // last wave's idle slots cost more (1024×151936 bf16, 7.8 waves: 80 → 77 %). A forced
  // cluster size, or FCE_CUDA_CE_SMEM_ALWAYS=1, keeps the choice above.
  if (found && rc.smem > 0 && overrides().cluster == 0 && !overrides().smem_always) {
    RegConfig plain{};
    if (choose_reg_config(q.vocab, q.elem_bytes, lead_max, max_k, 0, regs,
                          overrides().krule_pow2 != 0, 0, &plain) &&
        cluster_fits(dev, q.regs_kernel, q.slot, plain, false) &&
        (resident_ctas_per_sm(dev, q.regs_kernel, q.slot, plain) * plain.per * 16 >=
             kRegResidentEnough ||
         q.rows < kSmemMinWaves * wave_rows(dev, q.regs_smem_kernel, q.slot + kSmemSlots, false, rc)))
      rc = plain;
  }
  // With slots, a cluster size whose clusters leave over 12 % of the CTA slots idle (they must
  // fit a GPC: on an H100 clusters of 7 fill 84.8 %) gives way to the next larger one that
  // fills more (float32 256000: 7 CTAs 89 % of copy, 8 CTAs 93 %).
  if (found && rc.smem > 0 && overrides().cluster == 0)
    rc = fuller_cluster(dev, q, lead_max, max_k, smem_max, rc);
  *out = rc;
  const bool smem = rc.smem > 0;
  return found && cluster_fits(dev, smem ? q.regs_smem_kernel : q.regs_kernel,
                               q.slot + (smem ? kSmemSlots : 0), rc, smem);
}

fce_status choose_rows_path(const char* fn, const RowsQuery& q, RowsChoice* out) {
  DeviceInfo dev;
  FCE_TRY(device_info(fn, &dev));
  out->path = q.backward ? RowsPath::kBackward : RowsPath::kTwoPass;
  out->rc = RegConfig{1, kRegThreads, 0, 0};
  out->persistent = false;
  out->wave_rows = 0;
  out->prefetch_rows = 0;
  out->xmbar = overrides().xmbar != 0;
  // Forward without a gradient elsewhere (sm_80, short rows, FCE_CUDA_CE_BULK=0) reads each row
  // once whatever the path; on rows of 128 KB or more the streaming kernel (many loads in
  // flight, no register-resident slice to drain) measured faster on an H100 (dev/NOTES.md:
  // 16384×128256 bf16 1.50 ms against 1.76 ms), on shorter rows the register path
  // (32768×32000 bf16 0.76 ms against 1.02 ms).
  const bool long_forward_only = !q.with_grad && q.vocab * q.elem_bytes >= (int64_t{128} << 10);
  const bool prefer_stream = overrides().path == 2 || (long_forward_only && overrides().path != 1);
  const bool regs_possible = !q.backward && !prefer_stream;
  // Forward only on sm_90, rows of 16 KB or more: the bulk-copy kernel (ce/bulk_kernel.cuh), which keeps
  // a ring of chunks in flight on every SM. With a gradient (and then for fce_backward_rescale
  // too, so that it recomputes the very bits the forward wrote) for rows whose whole vectors
  // fit one stage, that the register path would split over a cluster (over 64 KB), and that
  // are either not 16-byte aligned or over 88 KB: measured faster there (V = 50257 bf16, rows
  // unaligned: 79 → 88 % of copy; float32 rows of 98 KB: 85 → 88 %), not on aligned rows of
  // 70-78 KB (−2 to +1 point) or on rows one register-path CTA holds (32000 bf16: 97 → 94 %;
  // dev/NOTES.md). Nor where the register path takes one CTA with shared-memory slots for
  // them (its rule below: rows of 16 waves or more): measured faster there from 8192 rows
  // (16384×50257 bf16 89.7 → 92.5 %, 16384×49152 90.3 → 95.2, float32 16384×25000 90.8 →
  // 94.2; dev/NOTES.md, 2026-11-24). FCE_CUDA_CE_BULK_GRAD=0 / 1: never / for every row that
  // fits (16 KB+).
  const int64_t row_bytes = q.vocab * q.elem_bytes;
  const bool grad_fits = row_bytes + 16 <= kBulkRowBytes;
  // (with a gradient the register shape decides the bulk kernel's use, or is the path taken)
  RegConfig rc{1, kRegThreads, 0, 0};
  bool regs_ok = regs_possible && q.with_grad && choose_regs_shape(dev, q, &rc);
  const bool grad_wins =
      overrides().bulk_grad == 1 ||
      (overrides().bulk_grad < 0 && row_bytes > int64_t{kRegVecsPerCta} * 16 &&
       (!q.aligned_rows || row_bytes > int64_t{88} << 10) && !(regs_ok && rc.smem > 0));
  const bool bulk_grad = (grad_wins || overrides().bulk == 2) && grad_fits;
  // (V ≤ 2^30: the kernel indexes a row's elements with int, j0 + E past the row's end)
  if (!q.backward && (!q.with_grad || bulk_grad) && overrides().bulk && overrides().path == 0 &&
      q.vocab <= (int64_t{1} << 30) &&
      (row_bytes >= kBulkMinRowBytes || overrides().bulk == 2)) {
    const int ctas = bulk_ctas(dev, q.bulk_kernel, q.slot, q.with_grad);
    if (ctas > 0) {
      out->path = RowsPath::kBulk;
      out->wave_rows = ctas;
      return FCE_SUCCESS;
    }
  }
  if (regs_possible && !q.with_grad) regs_ok = choose_regs_shape(dev, q, &rc);
  if (regs_ok) {
    const bool smem = rc.smem > 0;
    const int kslot = q.slot + (smem ? kSmemSlots : 0);
    out->path = RowsPath::kRegisters;
    out->rc = rc;
    // fce_backward_rescale runs persistent: its CTAs usually only read the upstream 1 and
    // exit, and a grid of one CTA cluster per row costs more in launches than the call is
    // worth (dev/NOTES.md, H100, 2026-11-24)
    out->persistent = q.rescale || overrides().persist;
    const void* kernel = out->persistent ? (smem ? q.regs_smem_loop_kernel : q.regs_loop_kernel)
                                         : (smem ? q.regs_smem_kernel : q.regs_kernel);
    out->wave_rows = wave_rows(dev, kernel, kslot, out->persistent, rc);
    if (out->wave_rows < 1) {
      out->persistent = false;  // no wave known: one cluster per row, no prefetch
      out->wave_rows = 0;
    }
    // (only with a gradient: forward-only CTAs hold their slice for less time, and measured
    // 2-6 % slower with the prefetch on short rows: measured on an H100, 2026-11-24)
    const float w = overrides().prefetch_waves >= 0.f ? overrides().prefetch_waves
                    : smem                            ? kSlotPrefetchWaves
                                                      : kDefaultPrefetchWaves;
    if (!q.rescale && q.with_grad && w > 0.f && out->wave_rows > 0) {
      const int64_t d = static_cast<int64_t>(w * static_cast<float>(out->wave_rows) + 0.5f);
      out->prefetch_rows = out->persistent ? 1 : (d > 0 ? d : 1);  // LOOP: its own next row
    }
  }
  return FCE_SUCCESS;
}

#if defined(FCE_CE_SELFTEST)
// Host self-test of the register path's geometry, on the very functions the kernel uses
// (reg_config, reg_slice, is_full, grad_vec_ok): for many V, element sizes, row alignments and
// cluster sizes, every element of a row is owned by exactly one (rank, thread, slot); every full
// vector is 16-byte aligned and inside the row; partial vectors are the row's first or last; the
// gradient's vector stores are aligned whenever grad_vec_ok allows them, and allowed in place.
// Returns the number of failures (each printed). No GPU needed.
int ce_rows_selftest() {
  int failures = 0;
  auto fail_at = [&](const char* what, int64_t V, int eb, int lead, int k, int nt) {
    if (failures++ < 20)
      fprintf(stderr, "ce_rows_selftest: %s (V %lld, e %d, lead %d, k %d, threads %d)\n", what,
              static_cast<long long>(V), eb, lead, k, nt);
  };
  const int64_t vocabs[] = {1,     2,     3,     5,     7,     8,      9,      15,     16,
                            17,    31,    33,    100,   255,   1000,   4095,   4096,   4097,
                            8191,  16383, 16384, 16385, 32000, 32767,  32768,  32769,  50257,
                            65535, 65536, 65537, 100000, 128256, 131071, 131072, 131073,
                            151936, 200003, 256000, 262136, 262143, 262144, 262145, 300000,
                            400003, 600000, 1000003, 1310720};
  std::vector<unsigned char> seen;
  for (int eb : {2, 4}) {
    const int E = 16 / eb;
    for (int64_t V : vocabs) {
      for (int aligned = 0; aligned < 2; ++aligned) {
        const int lead_max = aligned ? 0 : E - 1;
        const int64_t nvec_max = (lead_max + V + E - 1) / E;
        // the choice: a size ≤ max_k whose shape fits (the forced one where it fits, else a
        // power of two unless a nearly full 16-bit shape holds more, or with shared memory the
        // smallest size that holds the row where that is fewer CTAs), refused only when none does
        for (int smem_max : {0, 4, kRegSmemVptMax})
          for (int max_k : {1, 8, kMaxCluster})
            for (int force_k = 0; force_k <= kMaxCluster; ++force_k)
              for (bool pow2 : {false, true}) {
                RegConfig rc{}, again{};
                const int64_t cta_max = kRegVecsPerCta + int64_t(smem_max) * kRegThreads;
                const bool any = nvec_max <= cta_max * max_k;
                const bool forced = force_k >= 1 && force_k <= max_k && nvec_max <= cta_max * force_k;
                if (!choose_reg_config(V, eb, lead_max, max_k, force_k, 64, pow2, smem_max, &rc)) {
                  if (any) fail_at("choose_reg_config refused a row that fits", V, eb, 0, max_k, 0);
                  continue;
                }
                // registers alone would take this many CTAs (0: none fits)
                int kpow = 0;
                for (int k = 1; k <= max_k && !kpow; k *= 2)
                  if (nvec_max <= int64_t(kRegVecsPerCta) * k) kpow = k;
                bool bad = rc.k < 1 || rc.k > max_k || (forced && rc.k != force_k) ||
                           rc.smem < 0 || rc.smem > smem_max ||
                           !reg_config(V, eb, lead_max, rc.k, rc.smem, &again) ||
                           again.threads != rc.threads || again.smem != rc.smem;
                if (!forced && rc.smem > 0)  // the smallest size, and fewer CTAs than registers alone
                  bad = bad || rc.threads != kRegThreads || (kpow && kpow <= rc.k) ||
                        (rc.k > 1 && nvec_max <= cta_max * (rc.k - 1));
                if (!forced && rc.smem == 0)
                  bad = bad || ((pow2 || eb != 2) && (rc.k & (rc.k - 1))) ||
                        ((rc.k & (rc.k - 1)) && rc.threads < kRegFullThreads);
                if (bad) fail_at("choose_reg_config returned a bad shape", V, eb, 0, rc.k, rc.threads);
              }
        for (int k = 1; k <= kMaxCluster; ++k)
          for (int smem_max : {0, kRegSmemVptMax}) {
          RegConfig rc{};
          const int64_t cta_max = kRegVecsPerCta + int64_t(smem_max) * kRegThreads;
          if (!reg_config(V, eb, lead_max, k, smem_max, &rc)) {
            // must only fail when k CTAs of 64 KB (+ the shared memory) cannot hold the row
            if (nvec_max <= cta_max * k) fail_at("reg_config refused a row that fits", V, eb, 0, k, 0);
            continue;
          }
          if (smem_max > 0 && rc.smem == 0) continue;  // the registers-only shape, checked above
          if (rc.k != k || rc.threads % 32 || rc.threads < 32 || rc.threads > kRegThreads ||
              rc.per != (nvec_max + k - 1) / k || rc.smem < 0 || rc.smem > smem_max ||
              (rc.smem > 0 && rc.threads != kRegThreads))
            fail_at("reg_config returned a bad shape", V, eb, 0, rc.k, rc.threads);
          const int slots = kRegVpt + rc.smem;
          for (int lead = 0; lead < (aligned ? 1 : E); ++lead) {
            const uintptr_t row_addr = uintptr_t(0x10000) + uintptr_t(lead) * eb;
            seen.assign(size_t(V), 0);
            for (int rank = 0; rank < rc.k; ++rank) {
              for (int tid = 0; tid < rc.threads; ++tid) {
                const RegSlice g = reg_slice(row_addr, eb, int(V), rc.k, rank, tid, rc.threads);
                if (g.lead != lead) fail_at("lead", V, eb, lead, rc.k, rc.threads);
                for (int i = 0; i < slots; ++i) {
                  const int v = g.v0 + i * rc.threads;
                  if (v >= g.vend) continue;
                  const int j0 = g.j00 + i * g.jstep;
                  if (j0 != v * E - lead) fail_at("slot element index", V, eb, lead, rc.k, rc.threads);
                  const bool f = E == 8 ? is_full<int, 8>(j0, int(V)) : is_full<int, 4>(j0, int(V));
                  if (f && ((row_addr + uintptr_t(int64_t(j0) * eb)) % 16 != 0 || j0 < 0 || j0 + E > V))
                    fail_at("full vector misplaced", V, eb, lead, rc.k, rc.threads);
                  if (!f && v != 0 && v != g.nvec - 1)
                    fail_at("partial vector inside the row", V, eb, lead, rc.k, rc.threads);
                  for (int q = 0; q < E; ++q) {
                    const int64_t j = int64_t(j0) + q;
                    if (j >= 0 && j < V) seen[size_t(j)]++;
                  }
                }
              }
            }
            for (int64_t j = 0; j < V; ++j)
              if (seen[size_t(j)] != 1) {
                fail_at(seen[size_t(j)] ? "element owned twice" : "element not owned", V, eb,
                        lead, rc.k, rc.threads);
                break;
              }
          }
        }
      }
    }
  }
  // Gradient stores: (logits E, gradient element bytes) pairs of the supported dtype pairs.
  const int pairs[][2] = {{4, 4}, {8, 2}, {4, 2}};
  for (const auto& pr : pairs) {
    const int E = pr[0], gb = pr[1], zb = 16 / E;
    for (int lead = 0; lead < E; ++lead) {
      const uintptr_t zrow = uintptr_t(0x20000) + uintptr_t(lead) * zb;
      if (zb == gb && !grad_vec_ok(zrow, lead, E, gb))
        fail_at("in-place gradient refused vector stores", 0, gb, lead, 0, 0);
      for (uintptr_t off = 0; off < 32; off += uintptr_t(gb)) {
        const uintptr_t grow = uintptr_t(0x40000) + off;
        if (!grad_vec_ok(grow, lead, E, gb)) continue;
        for (int v = 1; v < 6; ++v) {
          const int64_t j0 = int64_t(v) * E - lead;
          if ((grow + uintptr_t(j0 * gb)) % uintptr_t(E * gb) != 0)
            fail_at("misaligned gradient vector store", 0, gb, lead, 0, int(off));
        }
      }
    }
  }
  return failures;
}
#endif
}  // namespace cuda
}  // namespace fce
