// vp_common.h — what the vocabulary-parallel suites (test_vp_*.cpp) share: the shards of a
// vocabulary, the order the ranks' stats are gathered in, targets at every shard's edges, the
// sharded argmax against the unsharded one, the loss outputs kept for comparison, and the cases
// of the rule 18 tests; a shard's columns of a matrix, and a strided matrix in the backend.
#pragma once

#include <algorithm>
#include <functional>
#include <numeric>

#include "check_ce.h"

using namespace fcet;

namespace {

// ------------------------------------------------------------------ shards ------------------
struct Shard {
  int64_t start, local;
};

// P shards of [0, V): uneven ones grow with the rank (weights 1, 2, ..., P), even ones differ
// by at most one class.
inline std::vector<Shard> make_shards(int64_t V, int P, bool uneven) {
  std::vector<Shard> s;
  const int64_t wsum = uneven ? int64_t(P) * (P + 1) / 2 : P;
  int64_t acc = 0, start = 0;
  for (int i = 0; i < P; ++i) {
    acc += uneven ? i + 1 : 1;
    int64_t end = i + 1 == P ? V : V * acc / wsum;
    end = std::min(std::max(end, start + 1), V - (P - 1 - i));  // every shard non-empty
    s.push_back({start, end - start});
    start = end;
  }
  return s;
}

// The gathered order of the ranks: 0..P-1, or a permutation of it (rotated and swapped).
inline std::vector<int> rank_order(int P, bool permuted) {
  std::vector<int> o(static_cast<size_t>(P));
  std::iota(o.begin(), o.end(), 0);
  if (permuted && P > 1) {
    std::rotate(o.begin(), o.begin() + 1, o.end());
    std::swap(o[0], o[static_cast<size_t>(P - 1)]);
  }
  return o;
}

// gathered_stats [ranks, rows, FCE_VP_STATS] from the stats buffers (pulled) in the given order.
inline Buf gather(const std::vector<const Buf*>& stats, int64_t rows) {
  const size_t one = static_cast<size_t>(rows) * FCE_VP_STATS * 4;
  Buf g(stats.size() * one);
  for (size_t q = 0; q < stats.size(); ++q) std::memcpy(g.h() + q * one, stats[q]->h(), one);
  g.push();
  return g;
}

// The ranks' statistics gathered in rank order and, with more than one rank, in a permuted
// order, check(gathered) called on each (the loss of both must be right); returns the last
// gathering made (the permuted one), for the backward.
template <class Check>
Buf gather_both_orders(const std::vector<Buf>& stats, int64_t rows, Check check) {
  const int P = static_cast<int>(stats.size());
  Buf last;
  for (bool permuted : {false, true}) {
    if (permuted && P == 1) continue;
    SCOPED_TRACE(permuted ? "gathered in a permuted rank order" : "gathered in rank order");
    std::vector<const Buf*> order;
    for (int q : rank_order(P, permuted)) order.push_back(&stats[static_cast<size_t>(q)]);
    Buf gathered = gather(order, rows);
    check(gathered);
    if (permuted || P == 1) last = std::move(gathered);
  }
  return last;
}

// Targets at read positions set to the first and the last class of every shard of every P
// (uneven and even), so that every shard holds targets (checked by the runner).
inline void spread_targets(int64_t N, int64_t V, int64_t T, int64_t k, std::vector<int64_t>& y) {
  std::vector<int64_t> read;  // positions of y that some row is scored against
  for (int64_t p = 0; p < N; ++p)
    if (T == 0 || p % T >= (k > 0 ? k : 1)) read.push_back(p);
  size_t next = 0;
  for (bool uneven : {true, false})
    for (int P = 1; P <= 4; ++P)
      for (const Shard& s : make_shards(V, P, uneven))
        for (int64_t cls : {s.start, s.start + s.local - 1}) {
          y[static_cast<size_t>(read[next % read.size()])] = cls;
          next += read.size() >= 40 ? 2 : 1;  // distinct positions while there are enough
        }
}

// The sharded argmax against the unsharded call's: equal, except in rows whose maximum is a near
// tie (check_ce.h), where either may pick another entry within the tie; and against the
// reference (argmax_matches).
inline ::testing::AssertionResult argmax_agrees(const std::vector<int64_t>& vp,
                                         const std::vector<int64_t>& whole,
                                         const fceref::CeResult& ref, int64_t V, double tie) {
  const std::vector<bool> amb = ambiguous_argmax_rows(ref, V, tie);
  int64_t bad = 0;
  std::ostringstream msg;
  for (size_t r = 0; r < vp.size(); ++r)
    if (vp[r] != whole[r] && !amb[r]) {
      if (bad < 5) msg << "\n  row " << r << ": sharded " << vp[r] << ", unsharded " << whole[r];
      ++bad;
    }
  if (bad)
    return ::testing::AssertionFailure() << "argmax vs the unsharded call: " << bad
                                         << " rows differ" << msg.str();
  return argmax_matches(vp, ref, V, tie, nullptr);
}

// What the unsharded call and the sharded one produce for the loss (kept as doubles).
struct LossOut {
  std::vector<double> loss, lse, zl, acc;
  std::vector<int64_t> am;
  uint32_t flags = 0;
};

// The cases of the rule 18 tests (entropy, grad_lse, grad_entropy on shards): each option set
// (a name and an edit of the default case) × {float32, bfloat16} × {mean, none}, N × V.
template <class Case>
using CaseEdits = std::vector<std::pair<const char*, std::function<void(Case&)>>>;
template <class Case>
void for_row_terms_cases(const CaseEdits<Case>& sets, int64_t N, int64_t V, uint64_t seed,
                         const std::function<void(const Case&)>& run) {
  for (const auto& [name, edit] : sets)
    for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
      for (int reduction : {FCE_REDUCTION_MEAN, FCE_REDUCTION_NONE}) {
        Case c;
        c.name = name;
        c.dtype = dtype;
        c.reduction = reduction;
        c.N = N;
        c.V = V;
        c.seed = seed;
        edit(c);
        run(c);
      }
}

// ------------------------------------------------------------------ shard data -------------
// The columns [start, start + local) of a dense [rows, cols] matrix.
inline std::vector<double> columns(const std::vector<double>& m, int64_t rows, int64_t cols,
                                   int64_t start, int64_t local) {
  std::vector<double> out(static_cast<size_t>(rows * local));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < local; ++j)
      out[static_cast<size_t>(r * local + j)] = m[static_cast<size_t>(r * cols + start + j)];
  return out;
}

// A [rows, cols] matrix of dtype with the given row stride, its row gaps poisoned (NaN: never
// to be read), pushed.
inline Buf matrix_buf(int dtype, int64_t rows, int64_t cols, int64_t stride,
                      const std::vector<double>& dense) {
  const Mat m = mat(dtype, rows, cols, stride);
  Buf b(m);
  poison_all(b, dtype);
  write_mat(b, m, dense);
  b.push();
  return b;
}

}  // namespace
