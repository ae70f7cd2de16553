// test_rescale.cpp — fce_backward_rescale on the backend FCE_TEST_BACKEND selects (cpu by
// default, cuda): the gradient fce_forward wrote for an upstream 1 (grad_output NULL), made the
// gradient for the upstream scalar g, as if fce_forward had been called with g.
//
// Every case of the matrix (f32/f16/bf16 × mean/sum × plain/rich options × V × N): one
// fce_forward with grad_output NULL writes G and lse; then, for each g, G is restored, rescaled
// with g, and compared with a fresh fce_forward given g directly:
//   g ∈ {1, 0.75, 0.3, 3, -1.7}  (nothing done, or the gradient computed again): bitwise;
//   g ∈ {2, 0.5, -0.25, 0}       (scaled in place, exactly): bitwise, except that where a
//     subnormal of the dtype is involved (the forward's value, the rescaled one or the upstream-1
//     one is below the smallest normal) the two may differ by one subnormal quantum — rounding
//     once to the dtype and scaling an already rounded subnormal are not the same there. Such
//     elements occur with realistic data in every dtype (float16: most of a 32003-class row), so
//     they are allowed, counted, and printed as a NOTE. Nothing else: ignored rows stay +0 for a
//     negative g (docs/semantics.md rule 14), bit for bit what fce_forward given that g writes;
//   NaN rows compare as NaN whatever the payload.
// And: g == 1 leaves G bitwise as it was (not even rewritten); the values within test_ce.cpp's
// bounds of the float64 reference (ref.h) for g = 2 and g = 3 (one of each kind); ignored rows
// +0, the out-of-range target's row NaN; row gaps, guards and every input untouched, and
// outputs->argmax / ->accuracy (outputs of fce_forward only) never written.
// Then which of the three things is done (a pattern in G that is no gradient shows it), bad
// input (status, a message naming fce_backward_rescale and the argument, nothing written), and
// on CUDA graph capture with the scalar changed between replays.
#include "ref.h"
#include "test_util.h"

using namespace fcet;

namespace {

// The upstream scalars: those whose gradient is bitwise what fce_forward writes for them (1:
// untouched; the others: computed again), and those the call scales G by in place.
const float kRecomputed[] = {1.0f, 0.75f, 0.3f, 3.0f, -1.7f};
const float kScaled[] = {2.0f, 0.5f, -0.25f, 0.0f};
// Compared with the float64 reference as well (one of each kind).
bool check_reference(float g) { return g == 2.0f || g == 3.0f; }

constexpr uint32_t kPresetFlags = 0x100u;  // a bit the calls must leave set

// ------------------------------------------------------------------ the cases ---------------
struct RsCase {
  std::string name;
  int dtype = FCE_FLOAT32;
  int reduction = FCE_REDUCTION_MEAN;
  int64_t N = 37, V = 1001;
  // rich: class weights, label smoothing, z-loss, softcap, logit_scale, ignore_index 5 (15% of
  // the rows), int32 targets, a causal shift (T = N for N = 37, T = 20 for N = 300; none for
  // N = 1), one target out of range (N > 1), strided logits and gradient (row gaps).
  bool rich = false;
  // v03 (with rich): the options of 0.3 too: shift k = 2, token scaling, and outputs->argmax
  // and ->accuracy set (fce_forward writes them, fce_backward_rescale must not).
  bool v03 = false;
};

void PrintTo(const RsCase& c, std::ostream* os) { *os << c.name << " [" << backend_name() << "]"; }

constexpr uint8_t kUnwrittenByte = 0x3C;  // outputs->argmax / ->accuracy of the v03 cases

// One problem: its data, the buffers of its inputs, the float64 reference for an upstream 1.
class Problem {
 public:
  explicit Problem(const RsCase& c) : c_(c) {
    std::mt19937_64 rng(static_cast<uint64_t>(c.N * 7919 + c.V * 31 + c.dtype * 3 + c.reduction) +
                        (c.rich ? 1000003u : 0u) + (c.v03 ? 77u : 0u));
    o_ = test_options();
    o_.dtype = c.dtype;
    o_.reduction = c.reduction;
    int64_t row_pad = 0, grad_pad = 0;
    double ignore_frac = 0;
    if (c.rich) {
      o_.target_dtype = FCE_INT32;
      o_.label_smoothing = 0.1f;
      o_.z_loss_scale = 1e-3f;
      o_.softcap = 20.0f;
      o_.logit_scale = 1.3f;
      o_.ignore_index = 5;
      o_.shift_seq_len = c.N == 300 ? 20 : c.N == 37 ? 37 : 0;
      row_pad = 3;
      grad_pad = 5;
      ignore_frac = 0.15;
    }
    if (c.v03) {
      o_.shift = o_.shift_seq_len > 0 ? 2 : 0;
      o_.token_scaling = 1;
      argmax_ = Buf(static_cast<size_t>(c.N) * 8, kUnwrittenByte);
      accuracy_ = Buf(4, kUnwrittenByte);
      o_.argmax = argmax_.p<int64_t>();
      o_.accuracy = accuracy_.p<float>();
    }
    // v03: token scaling multiplies each row by its p_y, which random targets make tiny (a
    // float16 gradient of subnormals, outside the reference bound): spread at most 5, and every
    // other row's target its argmax.
    z_ = random_logits(rng, c.dtype, c.N, c.V, 1.0, c.v03 ? 5.0 : 30.0);
    y_ = random_targets(rng, c.N, c.V, ignore_frac, o_.ignore_index);
    if (c.v03) {
      const int64_t k = o_.shift_seq_len > 0 ? o_.shift : 0;
      for (int64_t r = 0; r + k < c.N; r += 2) {
        const double* row = &z_[static_cast<size_t>(r * c.V)];
        if (y_[static_cast<size_t>(r + k)] != o_.ignore_index)
          y_[static_cast<size_t>(r + k)] = std::max_element(row, row + c.V) - row;
      }
    }
    if (c.rich && c.N > 1) y_[2] = c.V + 3;  // scored by row 2, or by row 1 (0 for k = 2)
    if (c.rich) w_ = random_uniform(rng, static_cast<size_t>(c.V), 0.1, 2.0);
    lm_ = mat(c.dtype, c.N, c.V, c.V + row_pad);
    gm_ = mat(c.dtype, c.N, c.V, c.V + grad_pad);
    if (row_pad) o_.row_stride = lm_.stride;
    if (grad_pad) o_.grad_row_stride = gm_.stride;
    logits_ = Buf(lm_);
    poison_all(logits_, c.dtype);  // NaN in the row gaps: never to be read
    write_mat(logits_, lm_, z_);
    logits_.push();
    targets_ = targets_buf(y_, o_.target_dtype);
    if (c.rich) weights_ = f32_buf(w_);
    o_.class_weights = weights_.p<float>();
    lse_ = poisoned(vec(FCE_FLOAT32, c.N));
    flags_ = Buf(4, 0);
    std::memcpy(flags_.h(), &kPresetFlags, 4);
    flags_.push();
    fceref::Options ro;
    ro.reduction = c.reduction;
    ro.label_smoothing = o_.label_smoothing;
    ro.z_loss_scale = o_.z_loss_scale;
    ro.softcap = o_.softcap;
    ro.logit_scale = o_.logit_scale;
    ro.class_weights = w_;
    ro.ignore_index = o_.ignore_index;
    ro.shift_seq_len = o_.shift_seq_len;
    ro.shift = o_.shift;
    ro.token_scaling = o_.token_scaling != 0;
    ref_ = fceref::cross_entropy(ro, c.N, c.V, z_, y_, nullptr, true);
    size_t wsb = 0;
    EXPECT_EQ(fce_backward_workspace_size(&o_, c.N, c.V, &wsb), FCE_SUCCESS) << fce_last_error();
    ws_ = workspace_buf(wsb);
    wsb_ = wsb;
  }

  const RsCase& c() const { return c_; }
  const Mat& gm() const { return gm_; }
  const fceref::CeResult& ref() const { return ref_; }
  TestOptions& options() { return o_; }
  Buf& logits() { return logits_; }
  Buf& targets() { return targets_; }
  Buf& lse() { return lse_; }
  Buf& argmax() { return argmax_; }
  Buf& accuracy() { return accuracy_; }
  Buf& workspace() { return ws_; }
  size_t workspace_bytes() const { return wsb_; }
  bool any_invalid() const {
    return std::find(ref_.kind.begin(), ref_.kind.end(), fceref::kInvalid) != ref_.kind.end();
  }

  // fce_forward writing the gradient for upstream *gout (nullptr: grad_output NULL) into grad.
  // The first call (first = true) also writes lse and the error flags, and checks them.
  void forward(Buf& grad, const Buf* gout, bool first) {
    Buf loss = poisoned(vec(FCE_FLOAT32, 1));
    size_t wsb = 0;
    ASSERT_EQ(fce_forward_workspace_size(&o_, c_.N, c_.V, &wsb), FCE_SUCCESS) << fce_last_error();
    Buf ws = workspace_buf(wsb);
    const fce_status st =
        flat::forward(&o_, c_.N, c_.V, logits_.ptr(), targets_.ptr(), loss.p<float>(),
                    first ? lse_.p<float>() : nullptr, nullptr, grad.ptr(),
                    gout ? gout->p<float>() : nullptr, first ? flags_.p<uint32_t>() : nullptr,
                    ws.ptr(), wsb, test_stream());
    ASSERT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    ASSERT_TRUE(finish());
    grad.pull();
    ASSERT_TRUE(all_written(grad, gm_, "grad_logits (fce_forward)"));
    if (!first) return;
    lse_.pull();
    flags_.pull();
    ASSERT_TRUE(all_written(lse_, vec(FCE_FLOAT32, c_.N), "lse (fce_forward)"));
    uint32_t f;
    std::memcpy(&f, flags_.h(), 4);
    EXPECT_EQ(f, kPresetFlags | (any_invalid() ? FCE_FLAG_TARGET_OUT_OF_RANGE : 0u))
        << "error_flags of fce_forward";
  }

  // fce_backward_rescale of grad with upstream *gout (error flags into *flags).
  fce_status rescale(Buf& grad, const Buf& gout, Buf* flags) {
    return flat::backward_rescale(&o_, c_.N, c_.V, logits_.ptr(), targets_.ptr(), lse_.p<float>(),
                                gout.p<float>(), grad.ptr(),
                                flags ? flags->p<uint32_t>() : nullptr, ws_.ptr(), wsb_,
                                test_stream());
  }

 private:
  RsCase c_;
  TestOptions o_;
  std::vector<double> z_, w_;
  std::vector<int64_t> y_;
  Mat lm_, gm_;
  Buf logits_, targets_, weights_, lse_, flags_, ws_, argmax_, accuracy_;
  size_t wsb_ = 0;
  fceref::CeResult ref_;
};

// Puts the whole mirror (guards included) back to `bytes` and pushes it.
void restore(Buf& b, const std::vector<uint8_t>& bytes) {
  std::memcpy(b.h() - kGuard, bytes.data(), bytes.size());
  b.push();
}

double smallest_normal(int dtype) { return std::ldexp(1.0, dtype == FCE_FLOAT16 ? -14 : -126); }
double subnormal_quantum(int dtype) {
  switch (dtype) {
    case FCE_FLOAT16: return std::ldexp(1.0, -24);
    case FCE_BFLOAT16: return std::ldexp(1.0, -133);
    default: return std::ldexp(1.0, -149);
  }
}

// What same_gradient let through on the in-place path (see the top of the file).
struct Allowed {
  int64_t subnormal = 0;  // one subnormal quantum apart
};

// The elements of m in `got` against those in `want`: bitwise, NaN == NaN (any payload). With
// `allowed` (the in-place path), also, counted there: a difference of one subnormal quantum
// where the value in `want`, in `got` or in `upstream1` (the gradient for g = 1) is below the
// smallest normal. Zeros compare by their bits: an ignored row's +0 must stay +0.
::testing::AssertionResult same_gradient(const Buf& got, const Buf& want, const Buf& upstream1,
                                         const Mat& m, const std::vector<fceref::RowKind>& kind,
                                         Allowed* allowed) {
  const size_t es = m.esize();
  const double tiny = smallest_normal(m.dtype), q = subnormal_quantum(m.dtype);
  int64_t bad = 0;
  std::ostringstream first;
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) {
      const size_t off = m.offset(r, c);
      if (std::memcmp(got.h() + off, want.h() + off, es) == 0) continue;
      const double a = get(m.dtype, got.h() + off), b = get(m.dtype, want.h() + off),
                   one = get(m.dtype, upstream1.h() + off);
      if (std::isnan(a) && std::isnan(b)) continue;
      (void)kind;
      if (allowed && a != b && std::fabs(a - b) <= q &&
          std::min({std::fabs(a), std::fabs(b), std::fabs(one)}) <= tiny) {
        ++allowed->subnormal;
        continue;
      }
      if (bad < 5)
        first << "\n  (" << r << "," << c << "): got " << a << ", fce_forward wrote " << b
              << " (upstream 1: " << one << ")";
      ++bad;
    }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << m.rows * m.cols
                                       << " elements differ from fce_forward's:" << first.str();
}

// Ignored rows all +0, invalid rows all NaN (after pull()).
::testing::AssertionResult rows_of_kind(const Buf& grad, const Mat& m,
                                        const std::vector<fceref::RowKind>& kind) {
  for (int64_t r = 0; r < m.rows; ++r) {
    const fceref::RowKind k = kind[static_cast<size_t>(r)];
    if (k == fceref::kValid) continue;
    for (int64_t c = 0; c < m.cols; ++c) {
      const double v = get(m.dtype, grad.h() + m.offset(r, c));
      if (k == fceref::kIgnored && (v != 0.0 || std::signbit(v)))
        return ::testing::AssertionFailure() << "ignored row " << r << " has " << v << " at " << c;
      if (k == fceref::kInvalid && !std::isnan(v))
        return ::testing::AssertionFailure()
               << "row " << r << " (target out of range) has " << v << " at " << c << ", not NaN";
    }
  }
  return ::testing::AssertionSuccess();
}

std::string case_name(int dtype, int reduction, bool rich, int64_t N, int64_t V,
                      bool v03 = false) {
  std::ostringstream s;
  s << dtype_name(dtype) << "_" << reduction_name(reduction)
    << (v03 ? "_rich03" : rich ? "_rich" : "_plain") << "_N" << N << "_V" << V;
  return s.str();
}

std::vector<RsCase> matrix_cases() {
  std::vector<RsCase> cases;
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM})
      for (bool rich : {false, true})
        for (int64_t V : {int64_t{1}, int64_t{7}, int64_t{1001}, int64_t{32003}})
          for (int64_t N : {int64_t{1}, int64_t{37}, int64_t{300}}) {
            RsCase c;
            c.dtype = dtype;
            c.reduction = red;
            c.rich = rich;
            c.V = V;
            c.N = N;
            c.name = case_name(dtype, red, rich, N, V);
            cases.push_back(c);
          }
  // The 0.3 options (fewer sizes: they change the rows, not the way through them).
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16})
    for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM})
      for (int64_t V : {int64_t{7}, int64_t{1001}})
        for (int64_t N : {int64_t{37}, int64_t{300}}) {
          RsCase c;
          c.dtype = dtype;
          c.reduction = red;
          c.rich = c.v03 = true;
          c.V = V;
          c.N = N;
          c.name = case_name(dtype, red, true, N, V, true);
          cases.push_back(c);
        }
  return cases;
}

class RescaleMatrix : public ::testing::TestWithParam<RsCase> {
 protected:
  void SetUp() override { FCE_REQUIRE_BACKEND(); }
};

TEST_P(RescaleMatrix, MatchesForwardGivenThatUpstream) {
  Problem pb(GetParam());
  const RsCase& c = pb.c();
  const Mat& gm = pb.gm();
  Buf grad = poisoned(gm);
  ASSERT_NO_FATAL_FAILURE(pb.forward(grad, nullptr, true));
  const std::vector<uint8_t> upstream1 = grad.mirror();
  Buf one(gm);  // the upstream-1 gradient, kept for same_gradient
  restore(one, upstream1);
  Allowed allowed;

  std::vector<std::pair<float, bool>> scalars;  // (g, scaled in place)
  for (float g : kRecomputed) scalars.emplace_back(g, false);
  for (float g : kScaled) scalars.emplace_back(g, true);
  for (const auto& s : scalars) {
    const float g = s.first;
    SCOPED_TRACE(c.name + " [" + backend_name() + "] grad_output = " + std::to_string(g));
    Buf gout = f32_buf({static_cast<double>(g)});
    Buf direct = poisoned(gm);
    ASSERT_NO_FATAL_FAILURE(pb.forward(direct, &gout, false));

    restore(grad, upstream1);
    Buf flags(4, 0);
    std::memcpy(flags.h(), &kPresetFlags, 4);
    flags.push();
    const auto b_logits = pb.logits().mirror(), b_targets = pb.targets().mirror(),
               b_lse = pb.lse().mirror(), b_gout = gout.mirror();
    // fce_forward wrote argmax / accuracy (v03); put back what no call writes, to see that
    // fce_backward_rescale leaves them alone.
    for (Buf* b : {&pb.argmax(), &pb.accuracy()})
      if (!b->empty()) std::memset(b->h(), kUnwrittenByte, b->size()), b->push();
    const auto b_argmax = pb.argmax().mirror(), b_accuracy = pb.accuracy().mirror();
    const fce_status st = pb.rescale(grad, gout, &flags);
    ASSERT_EQ(st, FCE_SUCCESS) << fce_status_string(st) << ": " << fce_last_error();
    EXPECT_STREQ(fce_last_error(), "");
    ASSERT_TRUE(finish());
    for (Buf* b : {&grad, &flags, &gout, &pb.logits(), &pb.targets(), &pb.lse(), &pb.argmax(),
                   &pb.accuracy()})
      b->pull();
    EXPECT_TRUE(unchanged(pb.argmax(), b_argmax, "outputs->argmax"));
    EXPECT_TRUE(unchanged(pb.accuracy(), b_accuracy, "outputs->accuracy"));
    EXPECT_TRUE(unchanged(pb.logits(), b_logits, "logits"));
    EXPECT_TRUE(unchanged(pb.targets(), b_targets, "targets"));
    EXPECT_TRUE(unchanged(pb.lse(), b_lse, "lse"));
    EXPECT_TRUE(unchanged(gout, b_gout, "grad_output"));

    // Nothing outside the elements (row gaps, guards); g = 1: not one bit anywhere.
    EXPECT_TRUE(only_elements_changed(grad, upstream1, &gm, "grad_logits"));
    if (g == 1.0f) {
      EXPECT_TRUE(bitwise_equal(grad.mirror(), upstream1, "grad_logits, g = 1"));
    }
    EXPECT_TRUE(
        same_gradient(grad, direct, one, gm, pb.ref().kind, s.second ? &allowed : nullptr));
    EXPECT_TRUE(rows_of_kind(grad, gm, pb.ref().kind));
    if (check_reference(g)) {
      std::vector<double> want = pb.ref().grad;
      for (double& x : want) x *= g;
      EXPECT_TRUE(close_normwise(read_mat(grad, gm), want, tolerance(c.dtype),
                                 "grad_logits vs the float64 reference"));
    }
    // The flags word: the preset bit kept; only the out-of-range bit may be added, and is
    // when the gradient was computed again over an out-of-range target.
    uint32_t f;
    std::memcpy(&f, flags.h(), 4);
    EXPECT_EQ(f & ~FCE_FLAG_TARGET_OUT_OF_RANGE, kPresetFlags) << "error_flags";
    if (!s.second && g != 1.0f && pb.any_invalid()) {
      EXPECT_EQ(f, kPresetFlags | FCE_FLAG_TARGET_OUT_OF_RANGE) << "error_flags (recomputed)";
    }
  }
  if (allowed.subnormal > 0)
    std::printf("NOTE: %s [%s], scaled in place: %lld element(s) one subnormal quantum from "
                "fce_forward's\n",
                c.name.c_str(), backend_name(), static_cast<long long>(allowed.subnormal));
}

INSTANTIATE_TEST_SUITE_P(Cases, RescaleMatrix, ::testing::ValuesIn(matrix_cases()),
                         [](const ::testing::TestParamInfo<RsCase>& i) { return i.param.name; });

// ------------------------------------------------------------------ which path --------------
class Rescale : public BackendTest {};

// G holding something that is no gradient shows what the call does: g = 1 leaves a signalling
// NaN poison as it is (nothing is written, not even the same bits); g = 2 doubles a pattern
// exactly in the scored rows (scaled in place, not computed again; an ignored row is left as it
// is or written +0, an invalid one left or NaN: rows whose gradient does not depend on g);
// g = 0.75 replaces it with fce_forward's gradient for 0.75 (computed again).
TEST_F(Rescale, TheScalarDecidesWhatIsDone) {
  for (int dtype : {FCE_FLOAT32, FCE_FLOAT16, FCE_BFLOAT16}) {
    RsCase c;
    c.dtype = dtype;
    c.rich = true;
    c.name = case_name(dtype, c.reduction, c.rich, c.N, c.V);
    SCOPED_TRACE(c.name + " [" + backend_name() + "]");
    Problem pb(c);
    const Mat& gm = pb.gm();
    Buf fwd = poisoned(gm);
    ASSERT_NO_FATAL_FAILURE(pb.forward(fwd, nullptr, true));  // lse

    Buf grad = poisoned(gm);
    const std::vector<uint8_t> poison = grad.mirror();
    Buf g1 = f32_buf({1.0}), g2 = f32_buf({2.0}), g075 = f32_buf({0.75});
    ASSERT_EQ(pb.rescale(grad, g1, nullptr), FCE_SUCCESS) << fce_last_error();
    ASSERT_TRUE(finish());
    grad.pull();
    EXPECT_TRUE(bitwise_equal(grad.mirror(), poison, "poisoned grad_logits, g = 1"));

    std::vector<double> pattern(static_cast<size_t>(gm.rows * gm.cols));
    for (size_t i = 0; i < pattern.size(); ++i)
      pattern[i] = 0.125 * static_cast<double>(i % 13) - 0.75;
    write_mat(grad, gm, pattern);
    grad.push();
    ASSERT_EQ(pb.rescale(grad, g2, nullptr), FCE_SUCCESS) << fce_last_error();
    ASSERT_TRUE(finish());
    grad.pull();
    const std::vector<double> doubled = read_mat(grad, gm);
    int64_t bad = 0;
    for (size_t i = 0; i < pattern.size(); ++i) {
      const fceref::RowKind kind = pb.ref().kind[i / static_cast<size_t>(gm.cols)];
      const double v = doubled[i];
      if (kind == fceref::kValid) bad += v != 2.0 * pattern[i];
      if (kind == fceref::kIgnored) bad += !(v == pattern[i] || (v == 0.0 && !std::signbit(v)));
      if (kind == fceref::kInvalid) bad += !(v == pattern[i] || std::isnan(v));
    }
    EXPECT_EQ(bad, 0) << "g = 2: elements of the pattern not doubled exactly (scored rows), or "
                         "other rows changed otherwise than to +0 / NaN";
    EXPECT_TRUE(only_elements_changed(grad, poison, &gm, "grad_logits, g = 2"));

    Buf direct = poisoned(gm);
    ASSERT_NO_FATAL_FAILURE(pb.forward(direct, &g075, false));
    ASSERT_EQ(pb.rescale(grad, g075, nullptr), FCE_SUCCESS) << fce_last_error();
    ASSERT_TRUE(finish());
    grad.pull();
    EXPECT_TRUE(same_gradient(grad, direct, fwd, gm, pb.ref().kind, nullptr));
  }
}

// ------------------------------------------------------------------ bad input ---------------
struct RsArgs {
  TestOptions o;
  const void* logits;
  const void* targets;
  const float* lse;
  const float* gout;
  void* grad;
  uint32_t* flags;
  void* ws;
  size_t wsb;
};

class RescaleBadInput : public BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    RsCase c;
    c.name = "bad_input";
    c.N = 8;
    c.V = 33;
    pb_.reset(new Problem(c));
    grad_ = poisoned(pb_->gm());
    ASSERT_NO_FATAL_FAILURE(pb_->forward(grad_, nullptr, true));
    gout_ = f32_buf({0.75});
    flags_ = Buf(4, 0);
    a_ = {pb_->options(),  pb_->logits().ptr(), pb_->targets().ptr(),
          pb_->lse().p<float>(), gout_.p<float>(), grad_.ptr(),
          flags_.p<uint32_t>(), pb_->workspace().ptr(), pb_->workspace_bytes()};
  }
  static fce_status call(const RsArgs& x) {
    return flat::backward_rescale(&x.o, 8, 33, x.logits, x.targets, x.lse, x.gout, x.grad, x.flags,
                                x.ws, x.wsb, test_stream());
  }
  void expect_rejected(const char* what, fce_status expected, const char* names,
                       const std::function<void(RsArgs&)>& mutate) {
    SCOPED_TRACE(std::string("fce_backward_rescale bad input: ") + what);
    RsArgs x = a_;
    mutate(x);
    Buf& logits = pb_->logits();
    Buf& lse = pb_->lse();
    const std::vector<uint8_t> g0 = grad_.mirror(), l0 = logits.mirror(), s0 = lse.mirror(),
                               f0 = flags_.mirror();
    const fce_status st = call(x);
    EXPECT_EQ(st, expected) << "got " << fce_status_string(st) << " (\"" << fce_last_error()
                            << "\")";
    EXPECT_TRUE(error_mentions("fce_backward_rescale"));
    EXPECT_TRUE(error_mentions(names));
    EXPECT_TRUE(finish());
    for (Buf* b : {&grad_, &logits, &lse, &flags_}) b->pull();
    EXPECT_TRUE(unchanged(grad_, g0, "grad_logits of the rejected call"));
    EXPECT_TRUE(unchanged(logits, l0, "logits of the rejected call"));
    EXPECT_TRUE(unchanged(lse, s0, "lse of the rejected call"));
    EXPECT_TRUE(unchanged(flags_, f0, "error_flags of the rejected call"));
  }
  std::unique_ptr<Problem> pb_;
  Buf grad_, gout_, flags_;
  RsArgs a_{};
};

TEST_F(RescaleBadInput, ValidBaselineSucceeds) {
  ASSERT_EQ(call(a_), FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
}

TEST_F(RescaleBadInput, ReductionNone) {
  expect_rejected("reduction none", FCE_ERROR_INVALID_ARGUMENT, "reduction",
                  [](RsArgs& x) { x.o.reduction = FCE_REDUCTION_NONE; });
}

TEST_F(RescaleBadInput, NullPointers) {
  expect_rejected("grad_output NULL", FCE_ERROR_NULL_POINTER, "grad_output",
                  [](RsArgs& x) { x.gout = nullptr; });
  expect_rejected("lse NULL", FCE_ERROR_NULL_POINTER, "lse", [](RsArgs& x) { x.lse = nullptr; });
  expect_rejected("grad_logits NULL", FCE_ERROR_NULL_POINTER, "grad_logits",
                  [](RsArgs& x) { x.grad = nullptr; });
  expect_rejected("logits NULL", FCE_ERROR_NULL_POINTER, "logits",
                  [](RsArgs& x) { x.logits = nullptr; });
  expect_rejected("targets NULL", FCE_ERROR_NULL_POINTER, "targets",
                  [](RsArgs& x) { x.targets = nullptr; });
}

TEST_F(RescaleBadInput, GradientOverTheLogits) {
  // What fce_backward allows (in place) cannot be rescaled: the logits are gone.
  expect_rejected("grad_logits == logits", FCE_ERROR_INVALID_ARGUMENT, "grad_logits",
                  [](RsArgs& x) { x.grad = const_cast<void*>(x.logits); });
  expect_rejected("grad_output inside grad_logits", FCE_ERROR_INVALID_ARGUMENT, "grad_output",
                  [](RsArgs& x) { x.gout = static_cast<const float*>(x.grad) + 3; });
}

TEST_F(RescaleBadInput, WorkspaceTooSmall) {
  if (pb_->workspace_bytes() == 0) {
    std::printf("SKIPPED: fce_backward_workspace_size is 0 bytes on this backend\n");
    GTEST_SKIP() << "no workspace to make too small";
  }
  expect_rejected("workspace_bytes one short", FCE_ERROR_WORKSPACE_TOO_SMALL, "workspace",
                  [](RsArgs& x) { --x.wsb; });
  expect_rejected("workspace_bytes 0", FCE_ERROR_WORKSPACE_TOO_SMALL, "workspace",
                  [](RsArgs& x) { x.wsb = 0; });
}

// ------------------------------------------------------------------ CUDA only ---------------
#if FCE_TEST_HAVE_CUDA
// Captured into a CUDA graph, the scalar in device memory: nothing runs during capture, and
// each replay reads it as it is then: 1 leaves G as it is, 0.75 computes it again (fce_forward's
// bits for 0.75), 2 scales it.
TEST_F(Rescale, CudaGraphCapture) {
  if (!on_cuda()) {
    std::printf("SKIPPED: graph capture is a CUDA backend test (FCE_TEST_BACKEND=cuda)\n");
    GTEST_SKIP() << "CUDA backend only";
  }
  RsCase c;
  c.dtype = FCE_BFLOAT16;
  c.rich = true;
  c.N = 300;
  c.V = 1001;
  c.name = case_name(c.dtype, c.reduction, c.rich, c.N, c.V);
  Problem pb(c);
  const Mat& gm = pb.gm();
  Buf grad = poisoned(gm);
  ASSERT_NO_FATAL_FAILURE(pb.forward(grad, nullptr, true));
  const std::vector<uint8_t> upstream1 = grad.mirror();
  Buf one(gm);
  restore(one, upstream1);
  Buf gout = f32_buf({1.0});
  auto call = [&] { return pb.rescale(grad, gout, nullptr); };
  // One eager call first (the header: the first call per device does host-side set-up).
  ASSERT_EQ(call(), FCE_SUCCESS) << fce_last_error();
  ASSERT_TRUE(finish());
  grad.pull();
  ASSERT_TRUE(bitwise_equal(grad.mirror(), upstream1, "eager call with g = 1"));

  put(FCE_FLOAT32, gout.h(), 0.75);  // set before capture: the capture must not run it
  gout.push();
  CapturedGraph graph;
  ASSERT_TRUE(graph.capture(call));
  grad.pull();
  EXPECT_TRUE(bitwise_equal(grad.mirror(), upstream1, "after capture"))
      << "the call ran during capture";

  for (float g : {1.0f, 0.75f, 2.0f}) {
    SCOPED_TRACE("graph replay with grad_output = " + std::to_string(g));
    Buf direct = poisoned(gm);
    Buf gd = f32_buf({static_cast<double>(g)});
    ASSERT_NO_FATAL_FAILURE(pb.forward(direct, &gd, false));
    restore(grad, upstream1);
    put(FCE_FLOAT32, gout.h(), g);
    gout.push();
    ASSERT_TRUE(graph.launch());
    ASSERT_TRUE(finish());
    grad.pull();
    if (g == 1.0f) {
      EXPECT_TRUE(bitwise_equal(grad.mirror(), upstream1, "replay with g = 1"));
    }
    EXPECT_TRUE(only_elements_changed(grad, upstream1, &gm, "grad_logits"));
    Allowed allowed;
    EXPECT_TRUE(
        same_gradient(grad, direct, one, gm, pb.ref().kind, g == 2.0f ? &allowed : nullptr));
  }
}
#endif  // FCE_TEST_HAVE_CUDA

}  // namespace
