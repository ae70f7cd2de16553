// ce/geometry_selftest.cpp — ce_rows_selftest(), the host check of the register path's index
// arithmetic (ce/geometry.cuh, reg_config and choose_reg_config of ce/policy.cpp): the ctest
// target CudaCeRowsSelftest compiles it with ce/policy.cpp and runs it, no GPU needed.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda/ce/geometry.cuh"
#include "cuda/ce/policy.h"

namespace fce {
namespace cuda {

namespace {
// An sm_90 device's limits (choose_reg_config's residency arithmetic)
DeviceProps sm90_props() {
  DeviceProps p;
  p.major = 9;
  p.sms = 132;
  p.smem_per_sm = 228 << 10;
  return p;
}
const DeviceProps kSm90 = sm90_props();
}  // namespace

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
  const int64_t vocabs[] = {1,      2,      3,      5,      7,      8,       9,      15,
                            16,     17,     31,     33,     100,    255,     1000,   4095,
                            4096,   4097,   8191,   16383,  16384,  16385,   32000,  32767,
                            32768,  32769,  50257,  65535,  65536,  65537,   100000, 128256,
                            131071, 131072, 131073, 151936, 200003, 256000,  262136, 262143,
                            262144, 262145, 300000, 400003, 600000, 1000003, 1310720};
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
            for (int force_k = 0; force_k <= kMaxCluster; ++force_k) {
              RegConfig rc{}, again{};
              const int64_t cta_max = kRegVecsPerCta + int64_t(smem_max) * kRegThreads;
              const bool any = nvec_max <= cta_max * max_k;
              const bool forced = force_k >= 1 && force_k <= max_k && nvec_max <= cta_max * force_k;
              if (!choose_reg_config(kSm90, V, eb, lead_max, max_k, force_k, 64, smem_max, &rc)) {
                if (any) fail_at("choose_reg_config refused a row that fits", V, eb, 0, max_k, 0);
                continue;
              }
              // registers alone would take this many CTAs (0: none fits)
              int kpow = 0;
              for (int k = 1; k <= max_k && !kpow; k *= 2)
                if (nvec_max <= int64_t(kRegVecsPerCta) * k) kpow = k;
              bool bad = rc.k < 1 || rc.k > max_k || (forced && rc.k != force_k) || rc.smem < 0 ||
                         rc.smem > smem_max ||
                         !reg_config(V, eb, lead_max, rc.k, rc.smem, &again) ||
                         again.threads != rc.threads || again.smem != rc.smem;
              if (!forced && rc.smem > 0)  // the smallest size, and fewer CTAs than registers alone
                bad = bad || rc.threads != kRegThreads || (kpow && kpow <= rc.k) ||
                      (rc.k > 1 && nvec_max <= cta_max * (rc.k - 1));
              if (!forced && rc.smem == 0)
                bad = bad || (eb != 2 && (rc.k & (rc.k - 1))) ||
                      ((rc.k & (rc.k - 1)) && rc.threads < kRegFullThreads);
              if (bad)
                fail_at("choose_reg_config returned a bad shape", V, eb, 0, rc.k, rc.threads);
            }
        for (int k = 1; k <= kMaxCluster; ++k)
          for (int smem_max : {0, kRegSmemVptMax}) {
            RegConfig rc{};
            const int64_t cta_max = kRegVecsPerCta + int64_t(smem_max) * kRegThreads;
            if (!reg_config(V, eb, lead_max, k, smem_max, &rc)) {
              // must only fail when k CTAs of 64 KB (+ the shared memory) cannot hold the row
              if (nvec_max <= cta_max * k)
                fail_at("reg_config refused a row that fits", V, eb, 0, k, 0);
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
                    if (j0 != v * E - lead)
                      fail_at("slot element index", V, eb, lead, rc.k, rc.threads);
                    const bool f =
                        E == 8 ? is_full<int, 8>(j0, int(V)) : is_full<int, 4>(j0, int(V));
                    if (f && ((row_addr + uintptr_t(int64_t(j0) * eb)) % 16 != 0 || j0 < 0 ||
                              j0 + E > V))
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

}  // namespace cuda
}  // namespace fce
