// test_adversarial.cpp — rows built to break a float32 cross-entropy, on the backend
// FCE_TEST_BACKEND selects, against the float64 reference (ref.h: (m, log s) kept apart in long
// double, exact on these rows). The families:
//   constant_huge      constant rows at ±1e30 and ±3e38 (float32, bfloat16) or ±6e4 and ±65504
//                      (float16): lse = m + log s rounds to m in float32, so a p_j computed as
//                      exp(a_j − float(lse)) is V times too large (docs/semantics.md rules 9, 12)
//   masked_vocabulary  −inf entries (masked classes), a row of −inf but the target
//   spread_1e4         logits spread over ±1e4, and 1e4 plus small noise (|lse| >= 1024:
//                      fce_backward reduces those rows again)
//   outlier_80         one logit 80 above the rest (the others' p about e^-80), target on it or not
//   nan_rows           a NaN in a row: that row's loss, lse and gradient NaN, the other rows
//                      untouched, the reduced loss NaN
//   target_neg_inf     the target's logit is −inf: loss +inf (as torch), the gradient finite
//   pos_inf_rows       a +inf in a row (elsewhere, at the target, twice, among −inf entries,
//                      everywhere): loss, lse and gradient NaN as torch's log_softmax makes them
//                      (exp(+inf − +inf)), the argmax the first +inf; a +inf in an ignored row
//                      leaves it at loss 0 and gradient +0
// each in float32, float16 and bfloat16 (the values rounded to the dtype), plain, with label
// smoothing, with z-loss, and with both and class weights; every reduction; through fce_forward
// with and without the gradient, fce_backward from the saved lse, fce_backward_rescale
// (g = 1, 0.5, 0.3), and fce_linear_ce on hidden states and a weight whose product is a row of
// one huge constant. Every row set also holds ordinary random rows and an ignored row.
//
// Errors are measured against the magnitudes a float32 computation has to carry, so that a
// cancelled-away answer is an error of order 1 and the rounding of a huge offset that the result
// does not depend on is none:
//   loss of a row   |out − ref| / max(1, T_r), T_r = t ((1−ε) ω_y (|m − a_y| + |log s|) +
//                   (ε/V) Σ_j ω_j (|m − a_j| + |log s|)) + |λ lse²| (its terms' magnitudes; the
//                   floor 1 measures a loss below one nat absolutely). Reduced: the same with the
//                   rows' T summed as the loss is (mean: ce parts / D, z-loss parts / n).
//   lse             |out − ref| / max(1, |m| + |log s|); z_loss total like the reduced loss.
//   gradient row    max_j |out_j − ref_j| / max_j A_j, A_j the sum of the magnitudes of element
//                   j's terms (check_ce.h gradient_term_magnitude).
//   fce_linear_ce   grad_hidden (r, d): |err| / Σ_j A_rj |W_jd|; grad_weight (j, d): / Σ_r A_rj
//                   |h_rd|; grad_bias j: / Σ_r A_rj (the error scale of each product).
// Non-finite references must be matched exactly (NaN by NaN, ±inf by the same inf), after
// rounding the reference to the output's type (λ lse² of a 1e30 row is finite in double but
// +inf in float32). Ignored rows: loss 0 and gradient +0 exactly.
// Bounds (see kBound and friends below) and the measured maxima are printed per family and
// dtype ("ADVERSARIAL ..." lines).
#include <map>

#include "check_ce.h"

using namespace fcet;

namespace {

constexpr int64_t kN = 12, kV = 97;
const double kU24 = std::ldexp(1.0, -24);

// float32 outputs (loss, lse, z_loss, a float32 gradient): the CPU backend rounds a double
// result once (2^-24); the CUDA backend works in float32, a handful of roundings per term
// (a − m, the exp2 and log2 approximations of at most 2 ulp, products) and a tree sum over the
// row (log2 V ≈ 7 levels): 32 units of 2^-24 (1.9e-6, a fifth of docs/semantics.md's 1e-5).
const double kBound = 32 * kU24;
// A 16-bit gradient is also rounded once to its dtype: its unit roundoff on top, and one
// subnormal step (absolute) for the elements that underflow.
double grad_bound(int dtype) { return dtype == FCE_FLOAT32 ? kBound : kBound + unit_roundoff(dtype); }
// fce_backward reads the float32 lse: each p_j then carries its rounding, |lse| 2^-24 relative
// (docs/semantics.md rule 12), twice for safety, except on rows with |lse| >= 1024, which it reduces again.
double lse_rounding(double lse) { return std::fabs(lse) < 1024 ? 2 * std::fabs(lse) * kU24 : 0.0; }

// ------------------------------------------------------------------ the families ------------
using Maker = void (*)(int dtype, std::mt19937_64& rng, std::vector<double>& z,
                       std::vector<int64_t>& y);

double& at(std::vector<double>& z, int64_t r, int64_t j) {
  return z[static_cast<size_t>(r * kV + j)];
}

void constant_huge(int dtype, std::mt19937_64&, std::vector<double>& z, std::vector<int64_t>& y) {
  const double big = dtype == FCE_FLOAT16 ? 6e4 : 1e30;
  const double top = dtype == FCE_FLOAT16 ? 65504 : 3e38;  // near the dtype's largest
  const double rows[] = {big, -big, top, -top, top};
  for (int64_t r = 0; r < 5; ++r)
    for (int64_t j = 0; j < kV; ++j) at(z, r, j) = round_to(dtype, rows[r]);
  y[4] = 0;  // the argmax of a constant row (the lowest index): a correct prediction
}

void masked_vocabulary(int, std::mt19937_64& rng, std::vector<double>& z,
                       std::vector<int64_t>& y) {
  for (int64_t j = 0; j < kV; ++j)  // row 0: every third class masked
    if (j % 3 == 1) at(z, 0, j) = -HUGE_VAL;
  y[0] = 3 * (y[0] / 3 % (kV / 3));
  for (int64_t j = 0; j < kV; ++j)  // row 1: three classes left
    if (j != 5 && j != 40 && j != 90) at(z, 1, j) = -HUGE_VAL;
  y[1] = 40;
  for (int64_t j = 0; j < kV; ++j)  // row 2: only the target left (p_y = 1, loss 0)
    if (j != y[2]) at(z, 2, j) = -HUGE_VAL;
  std::uniform_int_distribution<int64_t> odd(0, kV / 2 - 1);
  for (int64_t j = 0; j < kV; j += 2) at(z, 3, j) = -HUGE_VAL;  // row 3: even classes masked,
  for (int64_t j = 1; j < kV; j += 2) at(z, 3, j) *= 10;        // a wide spread on the others
  y[3] = 2 * odd(rng) + 1;
}

void spread_1e4(int dtype, std::mt19937_64& rng, std::vector<double>& z, std::vector<int64_t>& y) {
  std::normal_distribution<double> nd(0.0, 1.0);
  for (int64_t j = 0; j < kV; ++j) {  // row 0: a permutation of −1e4 .. 1e4
    const int64_t k = (j * 37) % kV;
    at(z, 0, j) = round_to(dtype, -1e4 + 2e4 * static_cast<double>(k) / (kV - 1));
  }
  for (int64_t j = 0; j < kV; ++j) at(z, 1, j) = j == 5 ? 1e4 : -1e4;  // row 1: loss 2e4
  y[1] = 6;
  for (int64_t j = 0; j < kV; ++j) at(z, 2, j) = j % 2 == 0 ? 1e4 : -1e4;  // row 2: 49 tied maxima
  y[2] = 2 * (y[2] / 2);
  for (int64_t j = 0; j < kV; ++j) at(z, 3, j) = round_to(dtype, 3000 * nd(rng));  // row 3
  for (int64_t j = 0; j < kV; ++j)  // row 4: 1e4 + N(0, 1): many ties in 16 bits
    at(z, 4, j) = round_to(dtype, 1e4 + nd(rng));
}

void outlier_80(int dtype, std::mt19937_64& rng, std::vector<double>& z, std::vector<int64_t>& y) {
  std::uniform_int_distribution<int64_t> cls(0, kV - 1);
  for (int64_t r = 0; r < 4; ++r) {
    if (r == 2)
      for (int64_t j = 0; j < kV; ++j) at(z, r, j) = 0.5;  // a constant row but one
    double m = -HUGE_VAL;
    for (int64_t j = 0; j < kV; ++j) m = std::max(m, at(z, r, j));
    const int64_t o = cls(rng);
    at(z, r, o) = round_to(dtype, m + 80);
    y[static_cast<size_t>(r)] = (r % 2 == 0) ? o : (o + 1) % kV;  // on the outlier or not
  }
}

void nan_rows(int, std::mt19937_64&, std::vector<double>& z, std::vector<int64_t>& y) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  at(z, 0, 7) = nan;  // row 0: one NaN, the target elsewhere
  y[0] = 3;
  at(z, 1, y[1]) = nan;  // row 1: the NaN at the target
  for (int64_t j = 0; j < kV; ++j) at(z, 2, j) = nan;  // row 2: all NaN
  at(z, 3, 0) = nan;  // row 3: NaN at both ends
  at(z, 3, kV - 1) = nan;
}

void target_neg_inf(int, std::mt19937_64&, std::vector<double>& z, std::vector<int64_t>& y) {
  at(z, 0, y[0]) = -HUGE_VAL;  // row 0: the target masked
  for (int64_t j = 0; j < kV; j += 2) at(z, 1, j) = -HUGE_VAL;  // row 1: the target among many
  y[1] = 2 * (y[1] / 2);
  for (int64_t j = 0; j < kV; ++j)  // row 2: one class left, the target another
    if (j != 3) at(z, 2, j) = -HUGE_VAL;
  y[2] = 10;
}

void pos_inf_rows(int, std::mt19937_64&, std::vector<double>& z, std::vector<int64_t>& y) {
  at(z, 0, 7) = HUGE_VAL;  // row 0: one +inf, the target elsewhere
  y[0] = 3;
  at(z, 1, y[1]) = HUGE_VAL;  // row 1: the +inf at the target
  at(z, 2, 10) = at(z, 2, 50) = HUGE_VAL;  // row 2: two +inf, the target on the second
  y[2] = 50;
  for (int64_t j = 0; j < kV; j += 3) at(z, 3, j) = -HUGE_VAL;  // row 3: −inf entries (the
  at(z, 3, 4) = HUGE_VAL;                                       // target's too) and a +inf
  y[3] = 6;
  for (int64_t j = 0; j < kV; ++j) at(z, 4, j) = HUGE_VAL;  // row 4: all +inf
  at(z, kN - 1, 2) = HUGE_VAL;  // the ignored row: still loss 0, gradient +0
}

struct Family {
  const char* name;
  Maker make;
};

const Family kFamilies[] = {
    {"constant_huge", constant_huge}, {"masked_vocabulary", masked_vocabulary},
    {"spread_1e4", spread_1e4},       {"outlier_80", outlier_80},
    {"nan_rows", nan_rows},           {"target_neg_inf", target_neg_inf},
    {"pos_inf_rows", pos_inf_rows},
};

struct OptionSet {
  const char* name;
  double eps, lambda;
  bool weights;
};

const OptionSet kOptionSets[] = {
    {"plain", 0, 0, false},
    {"smoothing", 0.1, 0, false},
    {"zloss", 0, 1e-4, false},
    {"smoothing_zloss_weights", 0.1, 1e-4, true},
};


// ------------------------------------------------------------------ measuring ---------------
// The worst normalised error per quantity, per (family, dtype), printed at the end of a test.
class Report {
 public:
  void add(int dtype, const std::string& what, double err) {
    double& w = worst_[dtype][what];
    if (!(err <= w)) w = err;  // NaN sticks (it is also a failure)
  }
  void print(const char* family) const {
    for (const auto& d : worst_) {
      std::printf("ADVERSARIAL %-17s %-4s [%s]:", family, dtype_name(d.first), backend_name());
      for (const auto& q : d.second) std::printf(" %s %.3g", q.first.c_str(), q.second);
      std::printf("  (bounds: %.3g, %s gradients %.3g, + 2|lse| 2^-24 from the saved lse)\n",
                  kBound, dtype_name(d.first), grad_bound(d.first));
    }
  }

 private:
  std::map<int, std::map<std::string, double>> worst_;
};

// The value a reference rounds to in the output type (float32 or the gradient's dtype).
double rounded(int dtype, double x) { return std::isfinite(x) ? round_to(dtype, x) : x; }

// One value: non-finite references exactly (after rounding to `dtype`), finite ones within
// `bound` of |out − ref| / scale. Records the error under `what`.
void check_value(Report& rep, int dtype, const std::string& what, const std::string& where,
                 double out, double ref, double scale, double bound, int out_dtype = FCE_FLOAT32) {
  const double r = rounded(out_dtype, ref);
  if (!std::isfinite(r)) {
    const bool same = std::isnan(r) ? std::isnan(out) : out == r;
    if (!same) ADD_FAILURE() << where << ": " << what << " = " << out << ", expected " << r;
    return;
  }
  if (!std::isfinite(out)) {
    ADD_FAILURE() << where << ": " << what << " = " << out << ", expected " << ref << " (finite)";
    rep.add(dtype, what, HUGE_VAL);
    return;
  }
  const double err = scale > 0 ? std::fabs(out - ref) / scale : std::fabs(out - ref);
  rep.add(dtype, what, err);
  if (!(err <= bound))
    ADD_FAILURE() << where << ": " << what << " = " << out << ", expected " << ref
                  << ": normalised error " << err << " > " << bound << " (scale " << scale << ")";
}

// The magnitudes of row r's loss terms (T_r above), the cross-entropy and z-loss parts apart.
struct LossScale {
  double ce = 0, zl = 0;
};
LossScale loss_scale(const fceref::CeResult& ref, const fceref::Options& o, size_t r) {
  LossScale s;
  if (ref.kind[r] == fceref::kIgnored) return s;
  s.zl = std::fabs(ref.row_zl[r]);
  if (ref.kind[r] != fceref::kValid) return s;
  const bool weighted = !o.class_weights.empty();
  auto omega = [&](int64_t j) { return weighted ? o.class_weights[static_cast<size_t>(j)] : 1.0; };
  const int64_t V = static_cast<int64_t>(ref.a.size() / ref.kind.size());
  const double* a = &ref.a[r * static_cast<size_t>(V)];
  const double m = ref.m[r], ls = std::fabs(ref.log_s[r]), eps = o.label_smoothing;
  const int64_t y = ref.target[r];
  double ce = (1 - eps) * omega(y) * (std::fabs(m - a[y]) + ls);
  if (eps != 0) {
    double sm = 0;
    for (int64_t j = 0; j < V; ++j) sm += omega(j) * (std::fabs(m - a[j]) + ls);
    ce += eps / static_cast<double>(V) * sm;
  }
  s.ce = std::fabs(ref.t[r]) * ce;
  return s;
}

// The upstream scales (k, k_z) of row r (docs/semantics.md rule 6).
std::pair<double, double> upstream(const fceref::CeResult& ref, const fceref::Options& o,
                                   const std::vector<double>& g, size_t r) {
  const double gv = o.reduction == fceref::kNone ? g[r] : g[0];
  if (o.reduction != fceref::kMean) return {gv, gv};
  return {ref.denominator == 0 ? 0.0 : gv / ref.denominator, ref.count == 0 ? 0.0 : gv / ref.count};
}

// The gradient of the logits row by row against the reference (scale: max_j A_j).
void check_gradient(Report& rep, int dtype, const std::string& what, const std::string& where,
                    const std::vector<double>& out, const fceref::CeResult& ref,
                    const fceref::Options& o, const std::vector<double>& g, bool from_saved_lse) {
  const size_t N = ref.kind.size();
  for (size_t r = 0; r < N; ++r) {
    const double* got = &out[r * kV];
    const double* want = &ref.grad[r * kV];
    const std::string row = where + " row " + std::to_string(r);
    if (ref.kind[r] == fceref::kIgnored) {
      for (int64_t j = 0; j < kV; ++j)
        if (got[j] != 0.0 || std::signbit(got[j])) {
          ADD_FAILURE() << row << " (ignored): " << what << " " << got[j] << " at " << j;
          break;
        }
      continue;
    }
    const auto k = upstream(ref, o, g, r);
    double scale = 0;
    for (int64_t j = 0; j < kV; ++j)
      scale = std::max(scale, gradient_term_magnitude(ref, o, kV, k.first, k.second, r, j));
    const double q = subnormal_step(dtype);
    double bound = grad_bound(dtype) + (scale > 0 ? q / scale : 0.0);
    if (from_saved_lse) bound += lse_rounding(ref.lse[r]);
    double worst = 0;
    int64_t worst_j = 0;
    bool fail = false;
    for (int64_t j = 0; j < kV && !fail; ++j) {
      const double w = rounded(dtype, want[j]);
      if (!std::isfinite(w) || !std::isfinite(got[j])) {
        const bool same = std::isnan(w) ? std::isnan(got[j]) : got[j] == w;
        if (!same) {
          ADD_FAILURE() << row << ": " << what << "[" << j << "] = " << got[j] << ", expected "
                        << want[j];
          fail = true;
        }
        continue;
      }
      const double e = std::fabs(got[j] - want[j]) / (scale > 0 ? scale : 1.0);
      if (e > worst) worst = e, worst_j = j;
    }
    if (fail || std::isnan(want[0]) || std::isnan(got[0])) continue;
    rep.add(dtype, what, worst);
    if (!(worst <= bound))
      ADD_FAILURE() << row << ": " << what << " normalised error " << worst << " > " << bound
                    << " at [" << worst_j << "]: got " << got[worst_j] << ", expected "
                    << want[worst_j] << " (scale " << scale << ", lse " << ref.lse[r] << ")";
  }
}

// loss (per row or reduced), lse, z_loss against the reference.
void check_losses(Report& rep, int dtype, const std::string& where, const fceref::CeResult& ref,
                  const fceref::Options& o, const std::vector<double>& loss,
                  const std::vector<double>* lse, const std::vector<double>* z_loss) {
  const size_t N = ref.kind.size();
  double ce_scale = 0, zl_scale = 0;
  for (size_t r = 0; r < N; ++r) {
    const LossScale s = loss_scale(ref, o, r);
    ce_scale += s.ce;
    zl_scale += s.zl;
    if (o.reduction == fceref::kNone) {
      if (ref.kind[r] == fceref::kIgnored) {
        if (loss[r] != 0.0) ADD_FAILURE() << where << ": ignored row " << r << " loss " << loss[r];
      } else {
        check_value(rep, dtype, "loss", where + " row " + std::to_string(r), loss[r],
                    ref.row_loss[r], std::max(1.0, s.ce + s.zl), kBound);
      }
    }
    if (lse)
      check_value(rep, dtype, "lse", where + " row " + std::to_string(r), (*lse)[r], ref.lse[r],
                  std::max(1.0, std::fabs(ref.m[r]) + std::fabs(ref.log_s[r])), kBound);
  }
  const bool mean = o.reduction == fceref::kMean;
  if (mean) {
    ce_scale = ref.denominator == 0 ? 0.0 : ce_scale / ref.denominator;
    zl_scale = ref.count == 0 ? 0.0 : zl_scale / ref.count;
  }
  if (o.reduction != fceref::kNone)
    check_value(rep, dtype, "loss", where + " (reduced)", loss[0], ref.loss,
                std::max(1.0, ce_scale + zl_scale), kBound);
  if (z_loss)
    check_value(rep, dtype, "z_loss", where, (*z_loss)[0], ref.z_loss, std::max(1.0, zl_scale),
                kBound);
}

// ------------------------------------------------------------------ one problem -------------
class Adversarial : public BackendTest {};

struct Problem {
  int dtype, reduction;
  const OptionSet* set;
  std::vector<double> z, w, g;
  std::vector<int64_t> y;
  fceref::Options ro;
  TestOptions o;
  Buf targets, weights;

  Problem(const Family& f, int dt, int red, const OptionSet& s, uint64_t seed)
      : dtype(dt), reduction(red), set(&s) {
    std::mt19937_64 rng(seed);
    z = random_logits(rng, dt, kN, kV, 1.0, 5.0, 3.0);
    y = random_targets(rng, kN, kV);
    y[kN - 1] = -100;  // an ignored row
    f.make(dt, rng, z, y);
    for (double& v : z) v = rounded(dt, v);
    if (s.weights) w = random_uniform(rng, static_cast<size_t>(kV), 0.5, 2.0);
    g = red == FCE_REDUCTION_NONE ? random_uniform(rng, static_cast<size_t>(kN), -1.5, 1.5)
                                  : std::vector<double>{0.7};
    ro.reduction = red;
    ro.label_smoothing = static_cast<float>(s.eps);
    ro.z_loss_scale = static_cast<float>(s.lambda);
    ro.class_weights = w;
    o = test_options();
    o.dtype = dt;
    o.reduction = red;
    o.label_smoothing = static_cast<float>(s.eps);
    o.z_loss_scale = static_cast<float>(s.lambda);
    targets = targets_buf(y, FCE_INT64);
    if (s.weights) weights = f32_buf(w);
    o.class_weights = weights.p<float>();
  }
  std::string label(const char* family, const char* call) const {
    return std::string(family) + " " + dtype_name(dtype) + " " + reduction_name(reduction) + " " +
           set->name + " [" + backend_name() + "] " + call;
  }
  fceref::CeResult ref(const std::vector<double>* gv) const {
    return fceref::cross_entropy(ro, kN, kV, z, y, gv, true);
  }
  Buf logits() const {
    Buf b(mat(dtype, kN, kV));
    write_mat(b, mat(dtype, kN, kV), z);
    b.push();
    return b;
  }
};

struct Outputs {
  std::vector<double> loss, lse, z_loss, grad, accuracy;
  std::vector<int64_t> argmax;
  Buf lse_buf;  // kept: fce_backward's input
};

// fce_forward; grad_output NULL (= 1) when gout is null; no gradient when with_grad is false.
Outputs forward(Problem& p, const Buf& logits, const Buf* gout, bool with_grad) {
  Outputs out;
  const bool none = p.reduction == FCE_REDUCTION_NONE;
  const Mat loss_m = vec(FCE_FLOAT32, none ? kN : 1), lse_m = vec(FCE_FLOAT32, kN),
            one = vec(FCE_FLOAT32, 1), gm = mat(p.dtype, kN, kV), am_m = vec(FCE_INT64, kN);
  Buf loss = poisoned(loss_m), zl = poisoned(one), acc = poisoned(loss_m), am = poisoned(am_m);
  out.lse_buf = poisoned(lse_m);
  Buf grad = with_grad ? poisoned(gm) : Buf();
  TestOptions o = p.o;
  o.argmax = am.p<int64_t>();
  o.accuracy = acc.p<float>();
  size_t wsb = 0;
  EXPECT_EQ(fce_forward_workspace_size(&o, kN, kV, &wsb), FCE_SUCCESS) << fce_last_error();
  Buf ws = workspace_buf(wsb);
  const fce_status st = flat::forward(&o, kN, kV, logits.ptr(), p.targets.ptr(), loss.p<float>(),
                                    out.lse_buf.p<float>(), zl.p<float>(), grad.ptr(),
                                    gout ? gout->p<float>() : nullptr, nullptr, ws.ptr(), wsb,
                                    test_stream());
  EXPECT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
  EXPECT_TRUE(finish());
  for (Buf* b : {&loss, &zl, &acc, &am, &out.lse_buf, &grad}) b->pull();
  EXPECT_TRUE(all_written(loss, loss_m, "loss"));
  EXPECT_TRUE(all_written(out.lse_buf, lse_m, "lse"));
  EXPECT_TRUE(all_written(am, am_m, "outputs->argmax"));
  out.loss = read_mat(loss, loss_m);
  out.lse = read_mat(out.lse_buf, lse_m);
  out.z_loss = read_mat(zl, one);
  out.accuracy = read_mat(acc, loss_m);
  out.argmax = read_i64(am, kN);
  if (with_grad) {
    EXPECT_TRUE(all_written(grad, gm, "grad_logits"));
    out.grad = read_mat(grad, gm);
  }
  return out;
}

// The raw bytes of a dense gradient of dtype (for the bit-for-bit comparisons of rule 14).
std::vector<uint8_t> grad_bytes(int dtype, const std::vector<double>& v) {
  std::vector<uint8_t> b(v.size() * dtype_size(dtype));
  for (size_t i = 0; i < v.size(); ++i) put(dtype, b.data() + i * dtype_size(dtype), v[i]);
  return b;
}

// Everything on one problem: forward (with and without the gradient), argmax and accuracy,
// fce_backward from the saved lse, and (mean, sum) fce_backward_rescale.
void run_problem(Report& rep, const Family& f, Problem& p) {
  const Buf logits = p.logits();
  const Buf gout = f32_buf(p.g);
  const fceref::CeResult ref = p.ref(&p.g);
  const double tie = 16 * kU24;

  // fce_forward with the gradient for g.
  const std::string fw = p.label(f.name, "fce_forward");
  Outputs fo = forward(p, logits, &gout, true);
  check_losses(rep, p.dtype, fw, ref, p.ro, fo.loss, &fo.lse, &fo.z_loss);
  check_gradient(rep, p.dtype, "grad(forward)", fw, fo.grad, ref, p.ro, p.g, false);
  {
    SCOPED_TRACE(fw);
    EXPECT_TRUE(argmax_matches(fo.argmax, ref, kV, tie, nullptr));
    EXPECT_TRUE(accuracy_matches(fo.accuracy, p.reduction, ref, &fo.argmax, kV, tie));
  }

  // Without the gradient: the same losses.
  const std::string fl = p.label(f.name, "fce_forward (loss only)");
  Outputs lo = forward(p, logits, &gout, false);
  check_losses(rep, p.dtype, fl, ref, p.ro, lo.loss, &lo.lse, &lo.z_loss);
  {
    SCOPED_TRACE(fl);
    EXPECT_TRUE(argmax_matches(lo.argmax, ref, kV, tie, nullptr));
  }

  // fce_backward from the lse the forward saved.
  {
    const std::string bw = p.label(f.name, "fce_backward");
    const Mat gm = mat(p.dtype, kN, kV);
    Buf grad = poisoned(gm);
    size_t wsb = 0;
    EXPECT_EQ(fce_backward_workspace_size(&p.o, kN, kV, &wsb), FCE_SUCCESS) << fce_last_error();
    Buf ws = workspace_buf(wsb);
    const fce_status st =
        flat::backward(&p.o, kN, kV, logits.ptr(), p.targets.ptr(), fo.lse_buf.p<float>(),
                     gout.p<float>(), grad.ptr(), nullptr, ws.ptr(), wsb, test_stream());
    EXPECT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    EXPECT_TRUE(finish());
    grad.pull();
    EXPECT_TRUE(all_written(grad, gm, "grad_logits (fce_backward)"));
    const std::vector<double> bg = read_mat(grad, gm);
    check_gradient(rep, p.dtype, "grad(backward)", bw, bg, ref, p.ro, p.g, true);
    SCOPED_TRACE(bw);
    EXPECT_TRUE(backward_matches_forward(bg, fo.grad, ref, p.ro, kV, &p.g, p.dtype));
  }

  if (p.reduction == FCE_REDUCTION_NONE) return;
  // fce_backward_rescale: the forward's gradient for g = 1 made the one for g.
  const Outputs one = forward(p, logits, nullptr, true);
  for (double g : {1.0, 0.5, 0.3}) {
    const std::string rs = p.label(f.name, "fce_backward_rescale") + " g=" + std::to_string(g);
    const std::vector<double> gv = {g};
    const Buf gb = f32_buf(gv);
    const Mat gm = mat(p.dtype, kN, kV);
    Buf grad(gm);
    write_mat(grad, gm, one.grad);
    grad.push();
    size_t wsb = 0;
    EXPECT_EQ(fce_backward_workspace_size(&p.o, kN, kV, &wsb), FCE_SUCCESS) << fce_last_error();
    Buf ws = workspace_buf(wsb);
    const fce_status st =
        flat::backward_rescale(&p.o, kN, kV, logits.ptr(), p.targets.ptr(), one.lse_buf.p<float>(),
                             gb.p<float>(), grad.ptr(), nullptr, ws.ptr(), wsb, test_stream());
    EXPECT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    EXPECT_TRUE(finish());
    grad.pull();
    const std::vector<double> rg = read_mat(grad, gm);
    check_gradient(rep, p.dtype, "grad(rescale)", rs, rg, p.ref(&gv), p.ro, gv, false);
    if (g != 0.5) {  // 1: untouched; 0.3: computed again by fce_forward's computation (rule 14)
      const Outputs direct = forward(p, logits, &gb, true);
      const std::vector<uint8_t> a = grad_bytes(p.dtype, rg), b = grad_bytes(p.dtype, direct.grad);
      size_t differ = 0;
      for (size_t i = 0; i < rg.size(); ++i)
        if (!(std::isnan(rg[i]) && std::isnan(direct.grad[i])) &&
            std::memcmp(&a[i * dtype_size(p.dtype)], &b[i * dtype_size(p.dtype)],
                        dtype_size(p.dtype)) != 0)
          ++differ;
      EXPECT_EQ(differ, 0u) << rs << ": elements not bit for bit fce_forward's with that g";
    }
  }
}

void run_family(const Family& f) {
  Report rep;
  uint64_t seed = 1;
  for (int dtype : kDtypes)
    for (int red : kReductions)
      for (const OptionSet& s : kOptionSets) {
        Problem p(f, dtype, red, s, 7919 * seed++ + std::hash<std::string>()(f.name) % 1000);
        run_problem(rep, f, p);
      }
  rep.print(f.name);
}

TEST_F(Adversarial, ConstantHugeRows) { run_family(kFamilies[0]); }
TEST_F(Adversarial, MaskedVocabulary) { run_family(kFamilies[1]); }
TEST_F(Adversarial, Spread1e4) { run_family(kFamilies[2]); }
TEST_F(Adversarial, OutlierAbove80) { run_family(kFamilies[3]); }
TEST_F(Adversarial, NaNPropagation) { run_family(kFamilies[4]); }
TEST_F(Adversarial, TargetLogitNegativeInfinity) { run_family(kFamilies[5]); }
TEST_F(Adversarial, PositiveInfinity) { run_family(kFamilies[6]); }

// The families' defining outcomes, spelled out (the reference agrees; these pin it down).
TEST_F(Adversarial, DefiningOutcomes) {
  for (int dtype : kDtypes) {
    // NaN: only the NaN rows are NaN, the mean is NaN.
    Problem p(kFamilies[4], dtype, FCE_REDUCTION_NONE, kOptionSets[0], 11);
    const Buf logits = p.logits();
    Outputs o = forward(p, logits, nullptr, true);
    for (int64_t r = 0; r < kN; ++r) {
      const bool nan_row = r < 4;
      EXPECT_EQ(std::isnan(o.loss[r]), nan_row) << dtype_name(dtype) << " row " << r;
      EXPECT_EQ(std::isnan(o.lse[r]), nan_row) << dtype_name(dtype) << " row " << r;
      for (int64_t j = 0; j < kV; ++j)
        if (std::isnan(o.grad[static_cast<size_t>(r * kV + j)]) != nan_row) {
          ADD_FAILURE() << dtype_name(dtype) << " row " << r << " gradient at " << j;
          break;
        }
    }
    EXPECT_EQ(o.argmax[0], 7);
    EXPECT_EQ(o.argmax[2], 0);
    Problem pm(kFamilies[4], dtype, FCE_REDUCTION_MEAN, kOptionSets[0], 11);
    EXPECT_TRUE(std::isnan(forward(pm, pm.logits(), nullptr, false).loss[0]));
    // A target logit of −inf: loss +inf (as torch), the gradient finite.
    Problem q(kFamilies[5], dtype, FCE_REDUCTION_NONE, kOptionSets[0], 12);
    o = forward(q, q.logits(), nullptr, true);
    for (int64_t r = 0; r < 3; ++r) {
      EXPECT_EQ(o.loss[r], HUGE_VAL) << dtype_name(dtype) << " row " << r;
      for (int64_t j = 0; j < kV; ++j)
        if (!std::isfinite(o.grad[static_cast<size_t>(r * kV + j)])) {
          ADD_FAILURE() << dtype_name(dtype) << " row " << r << " gradient at " << j;
          break;
        }
    }
    // +inf in a row: its loss, lse and gradient NaN (torch's log_softmax, docs/semantics.md
    // rule 10), the argmax its first +inf; the other rows untouched, the ignored one 0.
    Problem pi(kFamilies[6], dtype, FCE_REDUCTION_NONE, kOptionSets[0], 14);
    o = forward(pi, pi.logits(), nullptr, true);
    for (int64_t r = 0; r < kN; ++r) {
      const bool inf_row = r < 5;  // (and the ignored row's lse, written for every row)
      EXPECT_EQ(std::isnan(o.loss[r]), inf_row) << dtype_name(dtype) << " row " << r;
      EXPECT_EQ(std::isnan(o.lse[r]), inf_row || r == kN - 1) << dtype_name(dtype) << " row " << r;
      for (int64_t j = 0; j < kV; ++j)
        if (std::isnan(o.grad[static_cast<size_t>(r * kV + j)]) != inf_row) {
          ADD_FAILURE() << dtype_name(dtype) << " row " << r << " gradient at " << j;
          break;
        }
    }
    EXPECT_EQ(o.loss[kN - 1], 0.0);
    EXPECT_EQ(o.argmax[0], 7);
    EXPECT_EQ(o.argmax[1], pi.y[1]);
    EXPECT_EQ(o.argmax[2], 10);
    EXPECT_EQ(o.argmax[3], 4);
    EXPECT_EQ(o.argmax[4], 0);
    Problem ps(kFamilies[6], dtype, FCE_REDUCTION_SUM, kOptionSets[0], 14);
    EXPECT_TRUE(std::isnan(forward(ps, ps.logits(), nullptr, false).loss[0]));
    // Constant rows: p = 1/V exactly where the dtype allows, loss log V.
    Problem c(kFamilies[0], dtype, FCE_REDUCTION_NONE, kOptionSets[0], 13);
    o = forward(c, c.logits(), nullptr, true);
    for (int64_t r = 0; r < 5; ++r) {
      EXPECT_NEAR(o.loss[r], std::log(static_cast<double>(kV)), 8 * kU24 * std::log(97.0))
          << dtype_name(dtype) << " row " << r;
      const int64_t y = c.y[static_cast<size_t>(r)];
      const double off = o.grad[static_cast<size_t>(r * kV + (y == 0 ? 1 : 0))];
      EXPECT_NEAR(off, 1.0 / kV, (kBound + unit_roundoff(dtype)) / kV) << dtype_name(dtype);
      EXPECT_EQ(o.argmax[r], 0);
    }
  }
}

// ------------------------------------------------------------------ fce_linear_ce -----------
// z = h W^T with every row of W the same (w, w) and h_r = ±(H, H) or small: each row of logits
// one constant, ±2 H w: 2^99 (float32), 2^127 (bfloat16), about 5.9e4 (float16), exact in every
// GEMM (two products of powers of two or short mantissas, one sum). Checked against ref.h's
// naive double matmul, with the errors scaled as at the top of the file.
TEST_F(Adversarial, LinearHugeConstantRows) {
  const int64_t N = 8, D = 2, V = 33;
  Report rep;
  for (int dtype : kDtypes)
    for (int red : kReductions)
      for (double eps : {0.0, 0.1}) {
        const double H = dtype == FCE_FLOAT32 ? std::ldexp(1.0, 50)
                         : dtype == FCE_BFLOAT16 ? std::ldexp(1.0, 63) : 128.0;
        const double w = dtype == FCE_FLOAT32 ? std::ldexp(1.0, 48)
                         : dtype == FCE_BFLOAT16 ? std::ldexp(1.0, 63) : 230.0;
        const double hs[] = {H, -H, H, -H, 0.5, -0.25, H, 1.0};
        std::vector<double> h(static_cast<size_t>(N * D)), W(static_cast<size_t>(V * D), w);
        for (int64_t r = 0; r < N; ++r) h[static_cast<size_t>(r * D)] = h[static_cast<size_t>(r * D + 1)] = hs[r];
        std::mt19937_64 rng(static_cast<uint64_t>(dtype * 10 + red));
        std::vector<int64_t> y = random_targets(rng, N, V);
        y[6] = -100;
        std::vector<double> g = red == FCE_REDUCTION_NONE
                                    ? random_uniform(rng, static_cast<size_t>(N), -1.5, 1.5)
                                    : std::vector<double>{0.7};
        fceref::Options ro;
        ro.reduction = red;
        ro.label_smoothing = static_cast<float>(eps);
        const fceref::LinearResult ref =
            fceref::linear_cross_entropy(ro, N, D, V, h, W, {}, y, &g, true);
        const std::string where = std::string("fce_linear_ce huge constant rows ") +
                                  dtype_name(dtype) + " " + reduction_name(red) +
                                  (eps > 0 ? " smoothing" : "") + " [" + backend_name() + "]";
        SCOPED_TRACE(where);
        TestOptions o = test_options();
        o.dtype = dtype;
        o.reduction = red;
        o.label_smoothing = static_cast<float>(eps);
        const Mat hm = mat(dtype, N, D), wm = mat(dtype, V, D);
        Buf hb(hm), wb(wm);
        write_mat(hb, hm, h);
        write_mat(wb, wm, W);
        hb.push();
        wb.push();
        Buf yb = targets_buf(y, FCE_INT64), gb = f32_buf(g);
        const bool none = red == FCE_REDUCTION_NONE;
        const Mat loss_m = vec(FCE_FLOAT32, none ? N : 1), lse_m = vec(FCE_FLOAT32, N);
        const Mat ghm = mat(dtype, N, D), gwm = mat(dtype, V, D);
        for (bool with_grad : {true, false}) {
          Buf loss = poisoned(loss_m), lse = poisoned(lse_m);
          Buf gh = with_grad ? poisoned(ghm) : Buf(), gw = with_grad ? poisoned(gwm) : Buf();
          size_t mn = 0, op = 0;
          ASSERT_EQ(fce_linear_ce_workspace_size(&o, N, D, V, with_grad, &mn, &op), FCE_SUCCESS)
              << fce_last_error();
          Buf ws = workspace_buf(op);
          const fce_status st = flat::linear_ce(&o, N, D, V, hb.ptr(), wb.ptr(), nullptr, yb.ptr(),
                                              loss.p<float>(), lse.p<float>(), nullptr, gh.ptr(),
                                              gw.ptr(), nullptr, gb.p<float>(), nullptr, ws.ptr(),
                                              op, test_stream());
          ASSERT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
          ASSERT_TRUE(finish());
          for (Buf* b : {&loss, &lse, &gh, &gw}) b->pull();
          const std::vector<double> lv = read_mat(loss, loss_m), sv = read_mat(lse, lse_m);
          check_losses(rep, dtype, where, ref.ce, ro, lv, &sv, nullptr);
          if (!with_grad) continue;
          // The error scales of the two products, from the logits gradient's term magnitudes.
          std::vector<double> A(static_cast<size_t>(N * V));
          for (int64_t r = 0; r < N; ++r) {
            const auto k = upstream(ref.ce, ro, g, static_cast<size_t>(r));
            for (int64_t j = 0; j < V; ++j)
              A[static_cast<size_t>(r * V + j)] =
                  gradient_term_magnitude(ref.ce, ro, V, k.first, k.second, static_cast<size_t>(r), j);
          }
          const double bound = grad_bound(dtype);
          const std::vector<double> ghv = read_mat(gh, ghm), gwv = read_mat(gw, gwm);
          for (int64_t r = 0; r < N; ++r)
            for (int64_t d = 0; d < D; ++d) {
              double scale = 0;
              for (int64_t j = 0; j < V; ++j)
                scale += A[static_cast<size_t>(r * V + j)] * std::fabs(W[static_cast<size_t>(j * D + d)]);
              check_value(rep, dtype, "grad_hidden", where, ghv[static_cast<size_t>(r * D + d)],
                          ref.grad_hidden[static_cast<size_t>(r * D + d)], scale,
                          bound + (scale > 0 ? subnormal_step(dtype) / scale : 0.0), dtype);
            }
          for (int64_t j = 0; j < V; ++j)
            for (int64_t d = 0; d < D; ++d) {
              double scale = 0;
              for (int64_t r = 0; r < N; ++r)
                scale += A[static_cast<size_t>(r * V + j)] * std::fabs(h[static_cast<size_t>(r * D + d)]);
              check_value(rep, dtype, "grad_weight", where, gwv[static_cast<size_t>(j * D + d)],
                          ref.grad_weight[static_cast<size_t>(j * D + d)], scale,
                          bound + (scale > 0 ? subnormal_step(dtype) / scale : 0.0), dtype);
            }
        }
      }
  rep.print("linear_huge_const");
}

// A +inf logit made by the GEMM: hidden row 1 is (+inf, 0) and weight column 0 has no zero, so
// z row 1 holds +inf and −inf and no NaN: its loss and lse NaN (rule 10), its argmax the first
// +inf, and its NaN gradient row reaches grad_hidden's row 1 and every element of grad_weight
// and grad_bias; the other rows match the reference.
TEST_F(Adversarial, LinearPositiveInfinityRow) {
  const int64_t N = 4, D = 2, V = 5;
  const std::vector<double> h = {0.5, -1.0, HUGE_VAL, 0.0, -0.25, 2.0, 1.5, 0.75};
  const std::vector<double> W = {1.0, 0.5, -1.0, 0.25, 2.0, -0.5, 0.5, 1.0, -3.0, 0.125};
  const std::vector<double> b = {0.1, -0.2, 0.3, 0.0, -0.1};
  const std::vector<int64_t> y = {1, 4, 0, 2};  // row 1: its target −inf (+inf elsewhere)
  for (int dtype : kDtypes) {
    fceref::Options ro;
    ro.reduction = fceref::kNone;
    const fceref::LinearResult ref = fceref::linear_cross_entropy(ro, N, D, V, h, W, b, y,
                                                                  nullptr, true);
    const std::string where = std::string("fce_linear_ce +inf row ") + dtype_name(dtype) + " [" +
                              backend_name() + "]";
    SCOPED_TRACE(where);
    ASSERT_TRUE(std::isnan(ref.ce.row_loss[1]));
    TestOptions o = test_options();
    o.dtype = dtype;
    o.reduction = FCE_REDUCTION_NONE;
    const Mat hm = mat(dtype, N, D), wm = mat(dtype, V, D), bm = vec(dtype, V);
    const Mat rows_m = vec(FCE_FLOAT32, N), am_m = vec(FCE_INT64, N);
    Buf hb(hm), wb(wm), bb(bm);
    write_mat(hb, hm, h);
    write_mat(wb, wm, W);
    write_mat(bb, bm, b);
    for (Buf* x : {&hb, &wb, &bb}) x->push();
    Buf yb = targets_buf(y, FCE_INT64);
    Buf loss = poisoned(rows_m), lse = poisoned(rows_m), am = poisoned(am_m);
    Buf gh = poisoned(hm), gw = poisoned(wm), gb = poisoned(bm);
    o.argmax = am.p<int64_t>();
    size_t mn = 0, op = 0;
    ASSERT_EQ(fce_linear_ce_workspace_size(&o, N, D, V, 1, &mn, &op), FCE_SUCCESS)
        << fce_last_error();
    Buf ws = workspace_buf(op);
    const fce_status st = flat::linear_ce(&o, N, D, V, hb.ptr(), wb.ptr(), bb.ptr(), yb.ptr(),
                                        loss.p<float>(), lse.p<float>(), nullptr, gh.ptr(),
                                        gw.ptr(), gb.ptr(), nullptr, nullptr, ws.ptr(), op,
                                        test_stream());
    ASSERT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    ASSERT_TRUE(finish());
    for (Buf* x : {&loss, &lse, &am, &gh, &gw, &gb}) x->pull();
    const std::vector<double> lv = read_mat(loss, rows_m), sv = read_mat(lse, rows_m);
    const std::vector<double> ghv = read_mat(gh, hm), gwv = read_mat(gw, wm), gbv = read_mat(gb, bm);
    const std::vector<int64_t> av = read_i64(am, N);
    const double tol = dtype == FCE_FLOAT32 ? 1e-5 : 8 * unit_roundoff(dtype);
    for (int64_t r = 0; r < N; ++r) {
      const size_t ri = static_cast<size_t>(r);
      if (r == 1) {
        EXPECT_TRUE(std::isnan(lv[ri]) && std::isnan(sv[ri])) << "row 1: " << lv[ri] << " " << sv[ri];
        EXPECT_EQ(av[ri], 0);
        for (int64_t d = 0; d < D; ++d) EXPECT_TRUE(std::isnan(ghv[static_cast<size_t>(r * D + d)]));
        continue;
      }
      EXPECT_NEAR(lv[ri], ref.ce.row_loss[ri], tol * std::max(1.0, std::fabs(ref.ce.row_loss[ri])))
          << "row " << r;
      EXPECT_NEAR(sv[ri], ref.ce.lse[ri], tol * std::max(1.0, std::fabs(ref.ce.lse[ri])))
          << "row " << r;
      EXPECT_EQ(av[ri], ref.ce.argmax[ri]) << "row " << r;
      for (int64_t d = 0; d < D; ++d) {
        const size_t i = static_cast<size_t>(r * D + d);
        EXPECT_NEAR(ghv[i], ref.grad_hidden[i], tol * 4) << "grad_hidden row " << r;
      }
    }
    for (double v : gwv) EXPECT_TRUE(std::isnan(v)) << "grad_weight " << v;
    for (double v : gbv) EXPECT_TRUE(std::isnan(v)) << "grad_bias " << v;
  }
}

}  // namespace
