// ce/policy.cpp — the cross-entropy row kernels' policy (ce/policy.h): the table's rules in its
// order, and the register path's shape. Host code only, no CUDA call: whatever it needs of the
// device comes in DeviceProps and through RowsKernels.
#include "cuda/ce/policy.h"

#include <cstdint>

namespace fce {
namespace cuda {

static_assert(Knobs{}.reg_smem == kRegSmemVptMax, "FCE_CUDA_CE_SMEM's default: every slot");

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

namespace {

// CTAs of `threads` threads of `regs` registers each that an SM's register file and thread
// slots hold (registers are allocated per thread in units of 8; 0 unknown: 64, the launch bound).
int64_t regs_ctas_per_sm(const DeviceProps& dev, int regs, int threads) {
  const int64_t r = regs > 0 ? (regs + 7) / 8 * 8 : 64;
  int64_t ctas = dev.regs_per_sm / (r * threads);
  if (ctas > dev.max_threads_per_sm / threads) ctas = dev.max_threads_per_sm / threads;
  if (ctas > dev.max_ctas_per_sm) ctas = dev.max_ctas_per_sm;
  return ctas;
}

// Row bytes an SM holds at once in that shape, registers only.
int64_t reg_resident_bytes(const DeviceProps& dev, const RegConfig& c, int regs) {
  return c.per * 16 * regs_ctas_per_sm(dev, regs, c.threads);
}

// CTAs of the shape a launch really keeps resident per SM (the occupancy query's clusters, GPC
// packing included, × k over the SMs); 0 when unknown.
double resident_ctas_per_sm(const DeviceProps& dev, const RowsKernels& kernels, RowsKernel kernel,
                            const RegConfig& c) {
  return dev.sms > 0 ? static_cast<double>(kernels.wave_rows(kernel, c) * c.k) / dev.sms : 0.0;
}

bool cluster_fits(const DeviceProps& dev, const RowsKernels& kernels, RowsKernel kernel,
                  const RegConfig& c, bool smem_ok) {
  if (c.k == 1) return true;
  if (dev.major < 9 || c.k < 1 || c.k > kMaxCluster) return false;
  return kernels.cluster_fits(kernel, c.k, smem_ok);
}

// The shape with slots: rc, or the first of the next three sizes whose clusters fill
// slot_share of the CTA slots when rc's do not.
RegConfig fuller_cluster(const DeviceProps& dev, const RowsShape& q, const RowsKernels& kernels,
                         int lead_max, int max_k, int smem_max, const RegConfig& rc) {
  const int64_t slots = regs_ctas_per_sm(dev, kernels.regs(RowsKernel::kSlots), kRegThreads);
  auto full_enough = [&](const RegConfig& c) {
    return resident_ctas_per_sm(dev, kernels, RowsKernel::kSlots, c) >=
           kRowsTable.slot_share * slots;
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

// The register path's shape for these rows, and whether its cluster fits the device.
bool choose_regs_shape(const DeviceProps& dev, const Knobs& knobs, const RowsShape& q,
                       const RowsKernels& kernels, RegConfig* out) {
  const int lead_max = q.aligned_rows ? 0 : 16 / q.elem_bytes - 1;
  const int max_k = dev.major >= 9 ? kMaxCluster : 1;
  const int regs = kernels.regs(RowsKernel::kRegs);
  // slots only on sm_90+ and when both kernels with them take their shared memory (the forward
  // and fce_backward_rescale's persistent kernel must choose the same shape: the same bits)
  const int smem_max = dev.major >= 9 && knobs.reg_smem > 0 &&
                               kernels.slots_ready(RowsKernel::kSlots) &&
                               kernels.slots_ready(RowsKernel::kSlotsLoop)
                           ? knobs.reg_smem
                           : 0;
  RegConfig rc{1, kRegThreads, 0, 0};
  const bool found = choose_reg_config(dev, q.vocab, q.elem_bytes, lead_max, max_k, knobs.cluster,
                                       regs, smem_max, &rc);
  // Slots only where registers alone hold too little per SM and the launch is long enough
  // (a forced cluster size or FCE_CUDA_CE_SMEM=always keeps them).
  if (found && rc.smem > 0 && knobs.cluster == 0 && !knobs.smem_always) {
    RegConfig plain{};
    const double enough = kRowsTable.resident_enough * (int64_t{dev.regs_per_sm} * 4 / 2);
    if (choose_reg_config(dev, q.vocab, q.elem_bytes, lead_max, max_k, 0, regs, 0, &plain) &&
        cluster_fits(dev, kernels, RowsKernel::kRegs, plain, false) &&
        (resident_ctas_per_sm(dev, kernels, RowsKernel::kRegs, plain) * plain.per * 16 >= enough ||
         q.rows < kRowsTable.smem_min_waves * kernels.wave_rows(RowsKernel::kSlots, rc)))
      rc = plain;
  }
  if (found && rc.smem > 0 && knobs.cluster == 0)
    rc = fuller_cluster(dev, q, kernels, lead_max, max_k, smem_max, rc);
  *out = rc;
  const bool smem = rc.smem > 0;
  return found &&
         cluster_fits(dev, kernels, smem ? RowsKernel::kSlots : RowsKernel::kRegs, rc, smem);
}

}  // namespace

bool choose_reg_config(const DeviceProps& dev, int64_t vocab, int elem_bytes, int lead_max,
                       int max_k, int force_k, int regs, int smem_max, RegConfig* c) {
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
  if (elem_bytes != 2) return true;
  // 16-bit rows: a cluster of another size whose CTAs are nearly full and keep held_gain_pct
  // more of the rows resident per SM
  const int64_t held0 = reg_resident_bytes(dev, base, regs);
  int64_t best = held0 * (100 + kRowsTable.held_gain_pct) / 100;
  for (int k = 3; k <= max_k; ++k) {
    RegConfig r{};
    if (!(k & (k - 1)) || !reg_config(vocab, elem_bytes, lead_max, k, 0, &r) ||
        r.threads < kRegFullThreads)
      continue;
    const int64_t held = reg_resident_bytes(dev, r, regs);
    if (held > best) {
      best = held;
      *c = r;
    }
  }
  return true;
}

RowsChoice choose_rows(const DeviceProps& dev, const Knobs& knobs, const RowsShape& q,
                       const RowsKernels& kernels) {
  const RowsTable& t = kRowsTable;
  RowsChoice out{};
  out.path = q.backward ? RowsPath::kBackward : RowsPath::kTwoPass;
  out.rc = RegConfig{1, kRegThreads, 0, 0};
  out.xmbar = true;
  if (q.row_terms && !q.fast_terms) return out;  // the stream kernels: kBackward or kTwoPass
  const int64_t row = q.vocab * q.elem_bytes;
  // the two-pass rule (stream_min_row) or FCE_CUDA_CE_PATH keep the register path out
  const bool long_forward_only = !q.with_grad && row >= t.stream_min_row;
  const bool stream = knobs.path == 2 || (long_forward_only && knobs.path != 1);
  const bool regs_possible = !q.backward && !stream;
  // With a gradient the register shape decides the bulk rule, or is the path taken.
  RegConfig rc{1, kRegThreads, 0, 0};
  bool regs_ok = regs_possible && q.with_grad && choose_regs_shape(dev, knobs, q, kernels, &rc);
  // (16-bit rows take it even where the register shape has slots on a device of
  // bulk_grad_slots_dram or more, or of an unknown rate: policy.h's table)
  const bool fast_dram =
      !(dev.dram_bytes_per_s > 0 && dev.dram_bytes_per_s < t.bulk_grad_slots_dram);
  const bool bulk_grad_rule = row > t.bulk_grad_min_row &&
                              (!q.aligned_rows || row > t.bulk_grad_aligned_row) &&
                              ((q.elem_bytes == 2 && fast_dram) || !(regs_ok && rc.smem > 0));
  const bool bulk_grad =
      ((knobs.bulk_grad && bulk_grad_rule) || knobs.bulk == 2) && row + 16 <= kBulkRowBytes;
  // (V ≤ 2^30: the bulk kernel indexes a row's elements with int)
  // (rule 18's terms take it as the other rows: its ROWT instantiations have them)
  if (!q.backward && (!q.with_grad || bulk_grad) && knobs.bulk && knobs.path == 0 &&
      q.vocab <= (int64_t{1} << 30) && (row >= t.bulk_min_row || knobs.bulk == 2)) {
    const int ctas = kernels.bulk_ctas(q.with_grad);
    if (ctas > 0) {
      out.path = RowsPath::kBulk;
      out.wave_rows = ctas;
      return out;
    }
  }
  if (regs_possible && !q.with_grad) regs_ok = choose_regs_shape(dev, knobs, q, kernels, &rc);
  if (!regs_ok) return out;
  const bool smem = rc.smem > 0;
  out.path = RowsPath::kRegisters;
  out.rc = rc;
  // fce_backward_rescale runs persistent: its CTAs usually only read the upstream 1 and exit
  out.persistent = q.rescale;
  const RowsKernel kernel = out.persistent ? (smem ? RowsKernel::kSlotsLoop : RowsKernel::kRegsLoop)
                                           : (smem ? RowsKernel::kSlots : RowsKernel::kRegs);
  out.wave_rows = kernels.wave_rows(kernel, rc);
  if (out.wave_rows < 1) {
    out.persistent = false;  // no wave known: one cluster per row, no prefetch
    out.wave_rows = 0;
  }
  // the L2 prefetch only with a gradient (forward-only CTAs hold their slice for less time)
  const float w = smem ? t.slot_prefetch_waves : t.prefetch_waves;
  if (!q.rescale && q.with_grad && w > 0.f && out.wave_rows > 0) {
    const int64_t d = static_cast<int64_t>(w * static_cast<float>(out.wave_rows) + 0.5f);
    out.prefetch_rows = out.persistent ? 1 : (d > 0 ? d : 1);  // LOOP: its own next row
  }
  return out;
}

}  // namespace cuda
}  // namespace fce
