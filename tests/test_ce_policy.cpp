// The cross-entropy row kernels' policy (lib/cuda/ce/policy.h), checked on the host against a
// frozen copy of the decision function it replaced: for H100, H200 (and A100) property sets, a
// model of their occupancy queries, and a grid of shapes (rows 1-65536, vocabularies 2-262144,
// every dtype pair and mode, forward, forward with a gradient, backward and rescale, aligned and
// unaligned rows) under the default knobs and the knobs the tests and benchmarks set, both must
// choose the same kernel, shape, wave, prefetch distance and exchange, and ask the device the
// same questions in the same order. No GPU needed (ctest CudaCePolicy).
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "cuda/ce/geometry.cuh"
#include "cuda/ce/policy.h"

using namespace fce::cuda;

namespace {

// ------------------------------------------------------------ a device model ----
// Registers per thread of ce_rows_regs_kernel on sm_90 (cuobjdump -res-usage of the 0.5.0
// library), [dtype pair][mode][persistent][slots]; pairs f32/f32, f16/f16, bf16/bf16, f32/f16,
// f32/bf16; modes plain, cap, general, unit.
const int kKernelRegs[5][4][2][2] = {
    {{{64, 64}, {64, 64}}, {{64, 64}, {64, 64}}, {{90, 96}, {94, 94}}, {{64, 64}, {64, 64}}},
    {{{64, 64}, {64, 64}}, {{64, 64}, {64, 64}}, {{94, 106}, {106, 120}}, {{64, 64}, {64, 64}}},
    {{{64, 64}, {64, 64}}, {{64, 64}, {64, 64}}, {{94, 106}, {109, 126}}, {{64, 64}, {64, 64}}},
    {{{64, 64}, {64, 64}}, {{64, 64}, {64, 64}}, {{94, 92}, {96, 96}}, {{64, 64}, {64, 64}}},
    {{{64, 64}, {64, 64}}, {{64, 64}, {64, 64}}, {{94, 92}, {96, 96}}, {{64, 64}, {64, 64}}},
};
constexpr int kSmemSlots = 20;  // the slot of a kernel with shared-memory slots: + 20

// A device: its properties, its GPCs (clusters must fit one), and what an occupancy query
// answers there, from the kernels' registers and shared memory. Every question is logged, so
// that the two functions can be held to asking the same ones.
struct Model {
  std::string name;
  DeviceProps props;
  std::vector<int> gpcs;  // SMs per GPC
  mutable std::vector<std::string> log;

  int regs(int slot, bool loop) const {
    const bool smem = slot >= kSmemSlots;
    const int s = slot % kSmemSlots;
    return kKernelRegs[s / 4][s % 4][loop][smem];
  }
  int64_t ctas_per_sm(int regs, int threads, int64_t dyn_smem) const {
    const int64_t r = (regs + 7) / 8 * 8;
    int64_t c = props.regs_per_sm / (r * threads);
    if (c > props.max_threads_per_sm / threads) c = props.max_threads_per_sm / threads;
    if (c > props.max_ctas_per_sm) c = props.max_ctas_per_sm;
    const int64_t smem = dyn_smem + 2048;  // + static and reserved shared memory
    if (c > props.smem_per_sm / smem) c = props.smem_per_sm / smem;
    return c;
  }
  int64_t clusters(int regs, int threads, int64_t dyn_smem, int k) const {
    const int64_t per_sm = ctas_per_sm(regs, threads, dyn_smem);
    if (k == 1) return per_sm * props.sms;
    if (props.major < 9) return 0;
    int64_t n = 0;
    for (int g : gpcs) n += g * per_sm / k;
    return n;
  }
  void note(const char* what, int slot, int a = 0, int b = 0, int c = 0) const {
    log.push_back(std::string(what) + " " + std::to_string(slot) + " " + std::to_string(a) + " " +
                  std::to_string(b) + " " + std::to_string(c));
  }
};

// The questions of the old function, in its own terms (kernel, slot).
enum OldKernel { kRegsK, kRegsLoopK, kSmemK, kSmemLoopK, kBulkK };
bool is_loop(OldKernel k) { return k == kRegsLoopK || k == kSmemLoopK; }

int m_kernel_regs(const Model& m, OldKernel k, int slot) {
  m.note("regs", slot, k);
  return m.regs(slot, is_loop(k));
}
bool m_smem_ready(const Model& m, OldKernel k, int slot, bool loop) {
  m.note("smem_ready", slot, k, loop);
  return m.props.major >= 9 && m.props.smem_per_sm >= kRegSmemBytesMax + 2048;
}
bool m_cluster(const Model& m, OldKernel k, int slot, int cluster, bool smem_ok) {
  m.note("cluster", slot, k, cluster, smem_ok);
  return m.clusters(m.regs(slot, is_loop(k)), kRegThreads, smem_ok ? kRegSmemBytesMax : 0,
                    cluster) > 0;
}
int64_t m_wave(const Model& m, OldKernel k, int slot, bool loop, const RegConfig& c) {
  m.note("wave", slot, k * 2 + loop, c.k, c.threads * 100 + c.smem);
  return m.clusters(m.regs(slot, loop), c.threads, reg_smem_bytes(c), c.k);
}
int m_bulk(const Model& m, int slot, bool grad) {
  m.note("bulk", slot, grad);
  if (m.props.major < 9) return 0;
  return m.props.smem_per_sm >= bulk_ring_bytes(grad) + 6144 ? m.props.sms : 0;
}

// The new policy's questions, answered by the same model.
struct ModelKernels final : RowsKernels {
  const Model& m;
  int slot;
  ModelKernels(const Model& model, int s) : m(model), slot(s) {}
  static OldKernel old(RowsKernel k) {
    switch (k) {
      case RowsKernel::kRegs: return kRegsK;
      case RowsKernel::kRegsLoop: return kRegsLoopK;
      case RowsKernel::kSlots: return kSmemK;
      case RowsKernel::kSlotsLoop: return kSmemLoopK;
    }
    return kRegsK;
  }
  static bool smem(RowsKernel k) { return k == RowsKernel::kSlots || k == RowsKernel::kSlotsLoop; }
  int kslot(RowsKernel k) const { return slot + (smem(k) ? kSmemSlots : 0); }
  int regs(RowsKernel k) const override { return m_kernel_regs(m, old(k), kslot(k)); }
  bool slots_ready(RowsKernel k) const override {
    return m_smem_ready(m, old(k), slot, is_loop(old(k)));
  }
  bool cluster_fits(RowsKernel k, int cluster, bool s) const override {
    return m_cluster(m, old(k), kslot(k), cluster, s);
  }
  int64_t wave_rows(RowsKernel k, const RegConfig& c) const override {
    return m_wave(m, old(k), kslot(k), is_loop(old(k)), c);
  }
  int bulk_ctas(bool grad) const override { return m_bulk(m, slot, grad); }
};

// ============================================================ the frozen copy ====
// choose_rows_path and its helpers as they were before the policy table (lib/cuda/ce_path.cu),
// the CUDA queries replaced by the model's answers, the thresholds frozen here.
namespace frozen {

constexpr int kRegFileRegs = 65536;
constexpr int kMaxThreadsPerSm = 2048;
constexpr int kMaxCtasPerSm = 32;
constexpr int kRegFullThreads = 448;
constexpr float kDefaultPrefetchWaves = 0.25f;
constexpr float kSlotPrefetchWaves = 0.125f;
constexpr int64_t kBulkMinRowBytes = 16 << 10;
constexpr int kBulkRowBytes = 104 << 10;

struct Overrides {
  int path = 0;
  int cluster = 0;
  float prefetch_waves = -1.f;
  int persist = 0;
  int xmbar = 1;
  int pdl = 1;
  int bulk = 1;
  int krule_pow2 = 0;
  int bulk_grad = -1;
  int reg_smem = kRegSmemVptMax;
  int smem_always = 0;
  int unit = 1;
};
Overrides g_overrides;
const Overrides& overrides() { return g_overrides; }

struct DeviceInfo {
  const Model* m;
  int major;
};
struct RowsQuery {
  bool backward, with_grad;
  int64_t rows, vocab;
  int elem_bytes;
  bool aligned_rows, rescale;
  int slot;
  OldKernel regs_kernel = kRegsK, regs_loop_kernel = kRegsLoopK, regs_smem_kernel = kSmemK,
            regs_smem_loop_kernel = kSmemLoopK, bulk_kernel = kBulkK;
};
struct RowsChoice {
  RowsPath path;
  RegConfig rc;
  bool persistent;
  int64_t wave_rows, prefetch_rows;
  bool xmbar;
};

int sm_count(const DeviceInfo& dev) { return dev.m->props.sms; }
bool regs_smem_ready(const DeviceInfo& dev, OldKernel kernel, int slot, bool loop) {
  return m_smem_ready(*dev.m, kernel, slot, loop);
}
int kernel_regs(const DeviceInfo& dev, OldKernel kernel, int slot) {
  return m_kernel_regs(*dev.m, kernel, slot);
}
int64_t wave_rows(const DeviceInfo& dev, OldKernel kernel, int slot, bool loop,
                  const RegConfig& rc) {
  return m_wave(*dev.m, kernel, slot, loop, rc);
}
int bulk_ctas(const DeviceInfo& dev, OldKernel, int slot, bool grad) {
  return m_bulk(*dev.m, slot, grad);
}
bool cluster_fits(const DeviceInfo& dev, OldKernel kernel, int slot, const RegConfig& rc,
                  bool smem_ok) {
  const int k = rc.k;
  if (k == 1) return true;
  if (dev.major < 9 || k < 1 || k > kMaxCluster) return false;
  return m_cluster(*dev.m, kernel, slot, k, smem_ok);
}

int64_t regs_ctas_per_sm(int regs, int threads) {
  const int64_t r = regs > 0 ? (regs + 7) / 8 * 8 : 64;
  int64_t ctas = kRegFileRegs / (r * threads);
  if (ctas > kMaxThreadsPerSm / threads) ctas = kMaxThreadsPerSm / threads;
  if (ctas > kMaxCtasPerSm) ctas = kMaxCtasPerSm;
  return ctas;
}
int64_t reg_resident_bytes(const RegConfig& c, int regs) {
  return c.per * 16 * regs_ctas_per_sm(regs, c.threads);
}
constexpr int64_t kRegResidentEnough = int64_t{115} << 10;
constexpr int64_t kSmemMinWaves = 16;
constexpr double kSmemMinSlotShare = 0.88;

double resident_ctas_per_sm(const DeviceInfo& dev, OldKernel kernel, int slot, const RegConfig& c) {
  const int sms = sm_count(dev);
  return sms > 0 ? static_cast<double>(wave_rows(dev, kernel, slot, false, c) * c.k) / sms : 0.0;
}

bool old_reg_config(int64_t vocab, int elem_bytes, int lead_max, int k, int smem_max,
                    RegConfig* c) {
  if (vocab < 1 || vocab > kRegMaxVocab || k < 1 || k > kMaxCluster) return false;
  if (smem_max < 0) smem_max = 0;
  if (smem_max > kRegSmemVptMax) smem_max = kRegSmemVptMax;
  const int64_t E = 16 / elem_bytes;
  const int64_t nvec_max = (lead_max + vocab + E - 1) / E;
  const int64_t per = (nvec_max + k - 1) / k;
  int64_t threads = 0, smem = 0;
  if (per <= kRegVecsPerCta) {
    threads = (per + kRegVpt - 1) / kRegVpt;
    threads = (threads + 31) / 32 * 32;
  } else {
    threads = kRegThreads;
    smem = (per - kRegVecsPerCta + kRegThreads - 1) / kRegThreads;
    if (smem > smem_max) return false;
  }
  if (threads > kRegThreads || threads * (kRegVpt + smem) < per ||
      threads * (kRegVpt + smem) * k < nvec_max)
    return false;
  c->k = k;
  c->threads = static_cast<int>(threads);
  c->per = per;
  c->smem = static_cast<int>(smem);
  return true;
}

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
    if (old_reg_config(q.vocab, q.elem_bytes, lead_max, k, smem_max, &c) && c.smem > 0 &&
        full_enough(c))
      return c;
  }
  return rc;
}

bool choose_reg_config(int64_t vocab, int elem_bytes, int lead_max, int max_k, int force_k,
                       int regs, bool pow2_only, int smem_max, RegConfig* c) {
  if (max_k > kMaxCluster) max_k = kMaxCluster;
  if (force_k >= 1 && force_k <= max_k &&
      (old_reg_config(vocab, elem_bytes, lead_max, force_k, 0, c) ||
       old_reg_config(vocab, elem_bytes, lead_max, force_k, smem_max, c)))
    return true;
  RegConfig base{};
  bool found = false;
  for (int k = 1; k <= max_k && !found; k *= 2)
    found = old_reg_config(vocab, elem_bytes, lead_max, k, 0, &base);
  RegConfig hyb{};
  bool hfound = false;
  for (int k = 1; smem_max > 0 && k <= max_k && !hfound && (!found || k < base.k); ++k)
    hfound = old_reg_config(vocab, elem_bytes, lead_max, k, smem_max, &hyb);
  if (hfound) {
    *c = hyb;
    return true;
  }
  if (!found) return false;
  *c = base;
  if (pow2_only || elem_bytes != 2) return true;
  const int64_t held0 = reg_resident_bytes(base, regs);
  int64_t best = held0 * 21 / 20;
  for (int k = 3; k <= max_k; ++k) {
    RegConfig r{};
    if (!(k & (k - 1)) || !old_reg_config(vocab, elem_bytes, lead_max, k, 0, &r) ||
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

bool choose_regs_shape(const DeviceInfo& dev, const RowsQuery& q, RegConfig* out) {
  const int lead_max = q.aligned_rows ? 0 : 16 / q.elem_bytes - 1;
  const int max_k = dev.major >= 9 ? kMaxCluster : 1;
  const int regs = kernel_regs(dev, q.regs_kernel, q.slot);
  const int smem_max = dev.major >= 9 && overrides().reg_smem > 0 &&
                               regs_smem_ready(dev, q.regs_smem_kernel, q.slot, false) &&
                               regs_smem_ready(dev, q.regs_smem_loop_kernel, q.slot, true)
                           ? overrides().reg_smem
                           : 0;
  RegConfig rc{1, kRegThreads, 0, 0};
  const bool found = choose_reg_config(q.vocab, q.elem_bytes, lead_max, max_k, overrides().cluster,
                                       regs, overrides().krule_pow2 != 0, smem_max, &rc);
  if (found && rc.smem > 0 && overrides().cluster == 0 && !overrides().smem_always) {
    RegConfig plain{};
    if (choose_reg_config(q.vocab, q.elem_bytes, lead_max, max_k, 0, regs,
                          overrides().krule_pow2 != 0, 0, &plain) &&
        cluster_fits(dev, q.regs_kernel, q.slot, plain, false) &&
        (resident_ctas_per_sm(dev, q.regs_kernel, q.slot, plain) * plain.per * 16 >=
             kRegResidentEnough ||
         q.rows <
             kSmemMinWaves * wave_rows(dev, q.regs_smem_kernel, q.slot + kSmemSlots, false, rc)))
      rc = plain;
  }
  if (found && rc.smem > 0 && overrides().cluster == 0)
    rc = fuller_cluster(dev, q, lead_max, max_k, smem_max, rc);
  *out = rc;
  const bool smem = rc.smem > 0;
  return found && cluster_fits(dev, smem ? q.regs_smem_kernel : q.regs_kernel,
                               q.slot + (smem ? kSmemSlots : 0), rc, smem);
}

void choose_rows_path(const DeviceInfo& dev, const RowsQuery& q, RowsChoice* out) {
  out->path = q.backward ? RowsPath::kBackward : RowsPath::kTwoPass;
  out->rc = RegConfig{1, kRegThreads, 0, 0};
  out->persistent = false;
  out->wave_rows = 0;
  out->prefetch_rows = 0;
  out->xmbar = overrides().xmbar != 0;
  const bool long_forward_only = !q.with_grad && q.vocab * q.elem_bytes >= (int64_t{128} << 10);
  const bool prefer_stream = overrides().path == 2 || (long_forward_only && overrides().path != 1);
  const bool regs_possible = !q.backward && !prefer_stream;
  const int64_t row_bytes = q.vocab * q.elem_bytes;
  const bool grad_fits = row_bytes + 16 <= kBulkRowBytes;
  RegConfig rc{1, kRegThreads, 0, 0};
  bool regs_ok = regs_possible && q.with_grad && choose_regs_shape(dev, q, &rc);
  // (since the fast register slots: 16-bit rows on a device of 4 TB/s or more, or of an unknown
  // rate, even over a shape with slots)
  const double dram = dev.m->props.dram_bytes_per_s;
  const bool fast_dram = !(dram > 0 && dram < 4.0e12);
  const bool grad_wins = overrides().bulk_grad == 1 ||
                         (overrides().bulk_grad < 0 && row_bytes > int64_t{kRegVecsPerCta} * 16 &&
                          (!q.aligned_rows || row_bytes > int64_t{88} << 10) &&
                          ((q.elem_bytes == 2 && fast_dram) || !(regs_ok && rc.smem > 0)));
  const bool bulk_grad = (grad_wins || overrides().bulk == 2) && grad_fits;
  if (!q.backward && (!q.with_grad || bulk_grad) && overrides().bulk && overrides().path == 0 &&
      q.vocab <= (int64_t{1} << 30) && (row_bytes >= kBulkMinRowBytes || overrides().bulk == 2)) {
    const int ctas = bulk_ctas(dev, q.bulk_kernel, q.slot, q.with_grad);
    if (ctas > 0) {
      out->path = RowsPath::kBulk;
      out->wave_rows = ctas;
      return;
    }
  }
  if (regs_possible && !q.with_grad) regs_ok = choose_regs_shape(dev, q, &rc);
  if (regs_ok) {
    const bool smem = rc.smem > 0;
    const int kslot = q.slot + (smem ? kSmemSlots : 0);
    out->path = RowsPath::kRegisters;
    out->rc = rc;
    out->persistent = q.rescale || overrides().persist;
    const OldKernel kernel = out->persistent ? (smem ? q.regs_smem_loop_kernel : q.regs_loop_kernel)
                                             : (smem ? q.regs_smem_kernel : q.regs_kernel);
    out->wave_rows = wave_rows(dev, kernel, kslot, out->persistent, rc);
    if (out->wave_rows < 1) {
      out->persistent = false;
      out->wave_rows = 0;
    }
    const float w = overrides().prefetch_waves >= 0.f ? overrides().prefetch_waves
                    : smem                            ? kSlotPrefetchWaves
                                                      : kDefaultPrefetchWaves;
    if (!q.rescale && q.with_grad && w > 0.f && out->wave_rows > 0) {
      const int64_t d = static_cast<int64_t>(w * static_cast<float>(out->wave_rows) + 0.5f);
      out->prefetch_rows = out->persistent ? 1 : (d > 0 ? d : 1);
    }
  }
}

}  // namespace frozen

// ------------------------------------------------------------------ the grid ----
// A device's model: name, compute capability, SMs, shared memory per SM (KiB), L2 (MiB), DRAM
// bandwidth (bytes/s), SMs per GPC.
Model model(const char* name, int major, int sms, int smem_kib, int l2_mib, double dram,
            std::vector<int> gpcs) {
  Model m;
  m.name = name;
  m.props.major = major;
  m.props.sms = sms;
  m.props.smem_per_sm = int64_t{smem_kib} << 10;
  m.props.l2_bytes = int64_t{l2_mib} << 20;
  m.props.dram_bytes_per_s = dram;
  m.gpcs = std::move(gpcs);
  return m;
}
Model h100() { return model("H100", 9, 132, 228, 50, 3.35e12, {18, 18, 18, 18, 16, 16, 14, 14}); }
Model h200() { return model("H200", 9, 132, 228, 60, 4.8e12, {18, 18, 18, 18, 16, 16, 14, 14}); }
Model a100() { return model("A100", 8, 108, 164, 40, 2.0e12, {14, 14, 14, 14, 14, 14, 12, 12}); }

// A knob setting, in both functions' terms.
struct Setting {
  const char* name;
  frozen::Overrides old;
  Knobs knobs;
};
std::vector<Setting> settings() {
  std::vector<Setting> s;
  auto add = [&](const char* name, auto set) {
    Setting x{name, {}, {}};
    set(x.old, x.knobs);
    s.push_back(x);
  };
  using O = frozen::Overrides;
  add("default", [](O&, Knobs&) {});
  add("FCE_CUDA_CE_PATH=bulk", [](O& o, Knobs& k) { o.bulk = k.bulk = 2; });
  add("FCE_CUDA_CE_PATH=nobulk", [](O& o, Knobs& k) { o.bulk = k.bulk = 0; });
  add("FCE_CUDA_CE_SMEM=always", [](O& o, Knobs& k) {
    o.smem_always = 1;
    k.smem_always = true;
    o.bulk_grad = 0;
    k.bulk_grad = false;
  });
  add("FCE_CUDA_CE_PATH=twopass", [](O& o, Knobs& k) { o.path = k.path = 2; });
  add("FCE_CUDA_CE_PATH=regs", [](O& o, Knobs& k) { o.path = k.path = 1; });
  for (int c : {1, 3, 5, 8, 16})
    s.push_back([c] {
      Setting x{"FCE_CUDA_CE_CLUSTER=k", {}, {}};
      x.old.cluster = x.knobs.cluster = c;
      return x;
    }());
  add("FCE_CUDA_CE_SMEM=0", [](O& o, Knobs& k) { o.reg_smem = k.reg_smem = 0; });
  add("FCE_CUDA_CE_SMEM=4", [](O& o, Knobs& k) { o.reg_smem = k.reg_smem = 4; });
  return s;
}

std::vector<int64_t> vocabularies() {
  std::vector<int64_t> v;
  for (int64_t x = 2; x <= 80; ++x) v.push_back(x);
  for (int64_t p = 128; p <= 262144; p *= 2)
    for (int64_t d : {-17, -9, -1, 0, 1, 7, 33}) v.push_back(p + d);
  for (double x = 100; x < 262144; x *= 1.037) v.push_back(static_cast<int64_t>(x));
  // the rules' row lengths (16, 64, 88, 104 and 128 KiB) in each element size, and the models
  for (int64_t kib : {16, 64, 88, 104, 128, 160, 256, 512, 1024})
    for (int e : {2, 4})
      for (int64_t d : {-9, -8, -4, -1, 0, 1, 4})
        if ((kib << 10) / e + d >= 2 && (kib << 10) / e + d <= 262144)
          v.push_back((kib << 10) / e + d);
  for (int64_t x :
       {25000, 32000, 36000, 49152, 50257, 100000, 128256, 151936, 200003, 256000, 262143, 262144})
    v.push_back(x);
  return v;
}

int failures = 0;
int64_t compared = 0;

RowsPath compare(const Model& m, const Setting& s, const RowsShape& shape, int slot) {
  frozen::g_overrides = s.old;
  frozen::RowsQuery oq{shape.backward,   shape.with_grad,    shape.rows,    shape.vocab,
                       shape.elem_bytes, shape.aligned_rows, shape.rescale, slot};
  frozen::RowsChoice a{};
  m.log.clear();
  frozen::choose_rows_path(frozen::DeviceInfo{&m, m.props.major}, oq, &a);
  const std::vector<std::string> old_log = m.log;
  m.log.clear();
  const RowsChoice b = choose_rows(m.props, s.knobs, shape, ModelKernels(m, slot));
  ++compared;
  const bool same = a.path == b.path && a.rc.k == b.rc.k && a.rc.threads == b.rc.threads &&
                    a.rc.per == b.rc.per && a.rc.smem == b.rc.smem &&
                    a.persistent == b.persistent && a.wave_rows == b.wave_rows &&
                    a.prefetch_rows == b.prefetch_rows && a.xmbar == b.xmbar;
  const bool same_log = old_log == m.log;
  if ((!same || !same_log) && failures++ < 20)
    std::fprintf(stderr,
                 "%s, %s: rows %lld V %lld e %d aligned %d backward %d grad %d rescale %d slot "
                 "%d: old path %d k %d threads %d smem %d wave %lld prefetch %lld, new path %d "
                 "k %d threads %d smem %d wave %lld prefetch %lld%s\n",
                 m.name.c_str(), s.name, static_cast<long long>(shape.rows),
                 static_cast<long long>(shape.vocab), shape.elem_bytes, shape.aligned_rows,
                 shape.backward, shape.with_grad, shape.rescale, slot, static_cast<int>(a.path),
                 a.rc.k, a.rc.threads, a.rc.smem, static_cast<long long>(a.wave_rows),
                 static_cast<long long>(a.prefetch_rows), static_cast<int>(b.path), b.rc.k,
                 b.rc.threads, b.rc.smem, static_cast<long long>(b.wave_rows),
                 static_cast<long long>(b.prefetch_rows), same_log ? "" : " (the queries differ)");
  return b.path;
}

// What a call of each kind is: (backward, with_grad, rescale)
struct Kind {
  bool backward, with_grad, rescale;
};
const Kind kKinds[] = {
    {false, false, false}, {false, true, false}, {true, true, false}, {false, true, true}};

}  // namespace

int main() {
  const std::vector<int64_t> vocabs = vocabularies();
  const std::vector<int64_t> all_rows = {1,    2,    3,    7,    31,    64,    100,   127,
                                         128,  255,  500,  1000, 1023,  1024,  2000,  2048,
                                         4095, 4096, 5000, 8192, 10000, 16384, 32768, 65536};
  const std::vector<int64_t> few_rows = {1, 1000, 16384};
  const int pair_bytes[5] = {4, 2, 2, 4, 4};  // of the logits: f32, f16, bf16, f32, f32
  const std::vector<Setting> knob_settings = settings();
  int path_seen[4] = {0, 0, 0, 0};
  // H100 and H200 with the GPC packings a 132-SM part may have, so that the occupancy answers
  // fall on both sides of the table's thresholds; and an A100
  std::vector<Model> models;
  for (const std::vector<int>& gpcs :
       std::vector<std::vector<int>>{{18, 18, 18, 18, 16, 16, 14, 14},
                                     {16, 16, 16, 16, 16, 16, 18, 18},
                                     {12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12},
                                     {22, 22, 22, 22, 22, 22},
                                     {17, 17, 17, 17, 16, 16, 16, 16}})
    for (Model m : {h100(), h200()}) {
      m.gpcs = gpcs;
      models.push_back(m);
    }
  models.push_back(a100());
  for (size_t mi = 0; mi < models.size(); ++mi)
    for (const Setting& s : knob_settings)
      for (int64_t rows : s.name == std::string("default") ? all_rows : few_rows)
        for (int64_t V : vocabs)
          for (int pair = 0; pair < 5; ++pair)
            for (int mode = 0; mode < 4; ++mode)
              for (const Kind& k : kKinds)
                for (bool aligned : {true, false}) {
                  if (!k.with_grad && pair > 2) continue;  // no gradient: the logits' own pair
                  // the knobs on the first H100 and H200 packings and the A100
                  if (s.name != std::string("default") && mi >= 2 && mi + 1 < models.size())
                    continue;
                  const Model& m = models[mi];
                  const RowsShape shape{k.backward,       k.with_grad, rows,     V,
                                        pair_bytes[pair], aligned,     k.rescale};
                  ++path_seen[static_cast<int>(compare(m, s, shape, pair * 4 + mode))];
                }
  // 16-bit rows of 64 KiB to 512 KiB, densely (the register path's cluster sizes): every
  // 61st vocabulary, one row count, on the first H100 and H200 models
  for (int i = 0; i < 2; ++i)
    for (int64_t V = 32768; V <= 262144; V += 61)
      for (int pair = 1; pair <= 2; ++pair)
        for (int mode = 0; mode < 4; ++mode)
          for (const Kind& k : kKinds)
            for (bool aligned : {true, false})
              compare(models[i], knob_settings[0],
                      RowsShape{k.backward, k.with_grad, 16384, V, 2, aligned, k.rescale},
                      pair * 4 + mode);
  // The model reaches every kernel.
  for (int p = 0; p < 4; ++p)
    if (path_seen[p] == 0) {
      std::fprintf(stderr, "no shape took path %d\n", p);
      ++failures;
    }
  // A few choices the table states outright (H100): a backward streams; forward-only rows of
  // 16 KiB and more take the bulk kernel; sm_80 streams long forward-only rows.
  const Model h = h100(), a = a100();
  auto path_of = [](const Model& m, RowsShape q) {
    return choose_rows(m.props, Knobs{}, q, ModelKernels(m, 2 * 4 + 3)).path;
  };
  const RowsShape bwd{true, true, 16384, 128256, 2, true, false};
  const RowsShape fwd{false, false, 16384, 128256, 2, true, false};
  const RowsShape fwd_short{false, false, 16384, 4096, 2, true, false};
  if (path_of(h, bwd) != RowsPath::kBackward || path_of(h, fwd) != RowsPath::kBulk ||
      path_of(h, fwd_short) != RowsPath::kRegisters || path_of(a, fwd) != RowsPath::kTwoPass) {
    std::fprintf(stderr, "a stated choice of the table does not hold\n");
    ++failures;
  }
  // Rule 18's terms: the kernels the rows take without them (the register and bulk kernels
  // have them), unless label smoothing keeps them on the stream kernels; long forward-only
  // rows of sm_80 stream as without them.
  auto terms = [](RowsShape q, bool fast) {
    q.row_terms = true;
    q.fast_terms = fast;
    return q;
  };
  const RowsShape fwd_bulk{false, false, 16384, 16384, 2, true, false};  // bulk without terms
  const RowsShape grad_short{false, true, 16384, 4096, 2, true, false};
  const RowsShape grad_bulk{false, true, 4096, 50257, 2, false, false};  // unaligned 100 KB rows
  const Model h2 = h200();
  if (path_of(h, fwd_bulk) != RowsPath::kBulk ||
      path_of(h, terms(fwd_bulk, true)) != RowsPath::kBulk ||
      path_of(h, terms(fwd, true)) != RowsPath::kBulk ||
      path_of(h2, grad_bulk) != RowsPath::kBulk ||
      path_of(h2, terms(grad_bulk, true)) != RowsPath::kBulk ||
      path_of(h, terms(grad_short, true)) != RowsPath::kRegisters ||
      path_of(h, terms(fwd_short, true)) != RowsPath::kRegisters ||
      path_of(a, terms(fwd, true)) != RowsPath::kTwoPass ||
      path_of(h, terms(fwd_bulk, false)) != RowsPath::kTwoPass ||
      path_of(h, terms(grad_short, false)) != RowsPath::kTwoPass ||
      path_of(h, terms(bwd, true)) != RowsPath::kBackward) {
    std::fprintf(stderr, "a stated choice of the table for rule 18's terms does not hold\n");
    ++failures;
  }
  std::printf("ce policy: %lld shapes compared with the frozen decision function, %d failure(s)\n",
              static_cast<long long>(compared), failures);
  return failures == 0 ? 0 : 1;
}
