// test_ce.cpp — fce_forward and fce_backward against the float64 reference (ref.h), on the
// backend FCE_TEST_BACKEND selects (cpu by default, cuda).
//
// Every case: realistic random logits (row std 1-30), every output poisoned before the call,
// then: every output element written, nothing outside the output elements touched (guards,
// row gaps, inputs, workspace guards), values within the dtype's bound (test_util.h,
// tolerance()), exact zeros for ignored rows, error flags, argmax and accuracy (check_ce.h),
// and fce_backward from the saved lse agreeing with the gradient fce_forward wrote: to the
// rounding of the saved lse on every backend (check_ce.h), bit for bit on the CPU backend; the
// backward leaves outputs->argmax and ->accuracy alone.
//
// test_ce.cpp: the option matrix and the corner cases; test_ce_by_hand.cpp: values worked out
// by hand, argmax ties, shifts by k, threads, and the CUDA-only tests. The case and its runner
// are ce_runner.h.
#include "ce_runner.h"

namespace {

// ------------------------------------------------------------------ the option matrix -------
const std::vector<OptionVariant<CeCase>>& option_sets() {
  static const std::vector<OptionVariant<CeCase>> sets = {
      {"plain", [](CeCase&) {}},
      {"ignored_int32_gradoutput_null",
       [](CeCase& c) { c.tdtype = FCE_INT32; c.ignore_frac = 0.3; c.gout = false; }},
      {"custom_ignore_index", [](CeCase& c) { c.ignore_index = 3; c.ignore_frac = 0.25; }},
      {"weights_label_smoothing",
       [](CeCase& c) { c.weights = true; c.eps = 0.1f; c.ignore_frac = 0.1; }},
      {"label_smoothing", [](CeCase& c) { c.eps = 0.2f; }},
      {"weights", [](CeCase& c) { c.weights = true; c.tdtype = FCE_INT32; }},
      {"zloss", [](CeCase& c) { c.lambda = 1e-3f; c.ignore_frac = 0.1; }},
      {"softcap", [](CeCase& c) { c.softcap = 30.0f; }},
      {"softcap_scale", [](CeCase& c) { c.softcap = 15.0f; c.scale = 0.6f; }},
      {"logit_scale", [](CeCase& c) { c.scale = 2.5f; c.std_hi = 10; }},
      {"negative_logit_scale", [](CeCase& c) { c.scale = -0.75f; }},
      {"shift", [](CeCase& c) { c.shift = 8; c.N = 32; c.ignore_frac = 0.1; }},
      {"shift_k1_explicit", [](CeCase& c) { c.shift = 8; c.shift_k = 1; c.N = 32; }},
      {"shift_k2", [](CeCase& c) { c.shift = 8; c.shift_k = 2; c.N = 32; c.ignore_frac = 0.1; }},
      {"shift_k3", [](CeCase& c) { c.shift = 11; c.shift_k = 3; c.N = 33; c.argmax = true; }},
      // Token scaling multiplies each row by its p_y: with random targets most rows' p_y are
      // tiny and their gradients float16 subnormals (the bound is for normal numbers); every
      // other row's target is its argmax here (p_y large), and the spread is at most 5.
      {"token_scaling",
       [](CeCase& c) {
         c.token_scaling = true; c.ignore_frac = 0.1; c.std_hi = 5; c.edit = confident_targets;
       }},
      {"token_scaling_zloss_smoothing",
       [](CeCase& c) {
         c.token_scaling = true; c.lambda = 1e-3f; c.eps = 0.1f; c.ignore_frac = 0.1;
         c.std_hi = 5;  // t = p_y: keep some rows with p_y not vanishing
       }},
      {"argmax_accuracy", [](CeCase& c) { c.argmax = c.accuracy = true; c.ignore_frac = 0.2; }},
      {"accuracy_only", [](CeCase& c) { c.accuracy = true; c.ignore_frac = 0.2; }},
      {"argmax_accuracy_confident",  // many rows predicted right: accuracy well above 0
       [](CeCase& c) { c.argmax = c.accuracy = true; c.ignore_frac = 0.1; c.edit = confident_targets; }},
      {"weights_zloss",  // the z-loss's mean divides by n, the ce's by sum of weights
       [](CeCase& c) { c.weights = true; c.lambda = 1e-3f; c.ignore_frac = 0.15; }},
      {"strided", [](CeCase& c) { c.row_pad = 13; c.grad_pad = 5; }},
      {"explicit_dense_strides", [](CeCase& c) { c.explicit_stride = true; }},
      {"inplace", [](CeCase& c) { c.inplace = true; }},
      {"inplace_strided", [](CeCase& c) { c.inplace = true; c.row_pad = 3; }},
      {"loss_only", [](CeCase& c) { c.grad = false; c.zloss = false; }},
      {"no_lse_no_flags", [](CeCase& c) { c.lse = false; c.flags = false; }},
      {"everything",
       [](CeCase& c) {
         c.tdtype = FCE_INT32; c.weights = true; c.eps = 0.05f; c.lambda = 1e-4f;
         c.softcap = 20.0f; c.scale = 1.3f; c.shift = 4; c.N = 36; c.ignore_frac = 0.15;
         c.row_pad = 7; c.grad_pad = 2; c.deterministic = true;
       }},
      {"everything_03",
       [](CeCase& c) {
         c.tdtype = FCE_INT32; c.weights = true; c.eps = 0.05f; c.lambda = 1e-4f;
         c.softcap = 20.0f; c.scale = 1.3f; c.shift = 6; c.shift_k = 2; c.N = 36;
         c.ignore_frac = 0.15; c.token_scaling = true; c.argmax = c.accuracy = true;
         c.row_pad = 7; c.grad_pad = 2; c.deterministic = true; c.std_hi = 8;
       }},
      {"everything_03_inplace",
       [](CeCase& c) {
         c.weights = true; c.eps = 0.1f; c.lambda = 2e-4f; c.softcap = 30.0f; c.scale = 0.8f;
         c.shift = 11; c.shift_k = 3; c.N = 33; c.ignore_frac = 0.1; c.row_pad = 5;
         c.inplace = true; c.token_scaling = true; c.argmax = c.accuracy = true; c.std_hi = 8;
       }},
      {"everything_inplace",
       [](CeCase& c) {
         c.weights = true; c.eps = 0.1f; c.lambda = 2e-4f; c.softcap = 30.0f; c.scale = 0.8f;
         c.shift = 11; c.N = 33; c.ignore_frac = 0.1; c.row_pad = 5; c.inplace = true;
       }},
  };
  return sets;
}

class CeMatrix : public MatrixTest<CeCase> {};

TEST_P(CeMatrix, ForwardAndBackwardMatchReference) { run_case(GetParam()); }

FCE_OPTION_MATRIX(CeMatrix, option_matrix(option_sets()));

// ------------------------------------------------------------------ corner cases ------------
// Every row ignored: loss 0 (mean -> 0, not NaN), z_loss 0, zero gradient, lse still written.
TEST_F(Ce, AllRowsIgnored) {
  for (int dtype : kDtypes)
    for (int red : kReductions) {
      CeCase c;
      c.name = "all_ignored";
      c.dtype = dtype;
      c.reduction = red;
      c.weights = true;
      c.eps = 0.1f;
      c.lambda = 1e-3f;
      c.N = 9;
      c.V = 70;
      c.ignore_frac = 1.0;
      run_case(c);
      // Shift with T = 1: every row is the last of its sequence.
      c.name = "all_ignored_by_shift_T1";
      c.ignore_frac = 0;
      c.shift = 1;
      run_case(c);
      // All ignored with a custom ignore_index.
      c.name = "all_ignored_custom_index";
      c.shift = 0;
      c.ignore_index = 12345;
      c.ignore_frac = 1.0;
      run_case(c);
    }
}

TEST_F(Ce, SingleRow) {
  for (int dtype : kDtypes)
    for (int red : kReductions)
      for (int64_t V : {1, 7, 517}) {
        CeCase c;
        c.name = "N1";
        c.dtype = dtype;
        c.reduction = red;
        c.N = 1;
        c.V = V;
        c.eps = 0.1f;
        c.lambda = 1e-4f;
        run_case(c);
        c.name = "N1_shift";  // one row, T = 1: ignored
        c.shift = 1;
        run_case(c);
      }
}

TEST_F(Ce, OddVocabularies) {
  for (int dtype : kDtypes)
    for (int64_t V : {1, 2, 3, 7, 50257}) {
      CeCase c;
      c.name = "odd_vocab";
      c.dtype = dtype;
      c.reduction = FCE_REDUCTION_NONE;
      c.N = 3;
      c.V = V;
      c.weights = true;
      c.eps = 0.1f;
      c.lambda = 1e-4f;
      run_case(c);
      c.reduction = FCE_REDUCTION_MEAN;
      c.row_pad = 1;
      c.grad_pad = 3;
      c.softcap = 30.0f;
      run_case(c);
    }
}

TEST_F(Ce, BiggerShapes) {
  for (int dtype : kDtypes) {
    CeCase c;
    c.name = "bigger";
    c.dtype = dtype;
    c.N = 131;
    c.V = 4099;
    c.eps = 0.1f;
    c.lambda = 1e-4f;
    c.ignore_frac = 0.05;
    run_case(c);
  }
}

// Long rows: float32 rows of 512 KB to 1 MB (on sm_90 a cluster of 16 CTAs holds each; the
// other backends and devices take their usual paths) and 16-bit rows past 512 KB, aligned and
// not, with and without every option the register path treats apart (smoothing and weights:
// its general mode; the argmax: the barrier exchange; in place; a padded stride).
TEST_F(Ce, LongRows) {
  struct Shape {
    int dtype;
    int64_t V;
  };
  for (Shape sh : {Shape{FCE_FLOAT32, 151936}, Shape{FCE_FLOAT32, 200003},
                   Shape{FCE_FLOAT32, 262144}, Shape{FCE_FLOAT32, 262145},
                   Shape{FCE_BFLOAT16, 300001}}) {
    CeCase c;
    c.name = "long_rows";
    c.dtype = sh.dtype;
    c.N = 5;
    c.V = sh.V;
    c.ignore_frac = 0.2;
    c.std_hi = 8;
    run_case(c);
    c.name = "long_rows_options";
    c.weights = true;
    c.eps = 0.1f;
    c.lambda = 1e-4f;
    c.argmax = c.accuracy = true;
    c.row_pad = 3;
    c.reduction = FCE_REDUCTION_NONE;
    run_case(c);
    c.name = "long_rows_inplace";
    c.weights = false;
    c.eps = 0;
    c.argmax = c.accuracy = false;
    c.row_pad = 0;
    c.inplace = true;
    c.reduction = FCE_REDUCTION_SUM;
    run_case(c);
  }
}

// Rows built to be hard: +-1e4 (well separated), -inf entries, constant rows, one huge
// outlier; targets never on a -inf entry (its loss would be +inf).
void extreme_edit(const CeCase& c, std::vector<double>& z, std::vector<int64_t>& y) {
  const int64_t V = c.V;
  auto at = [&](int64_t r, int64_t j) -> double& { return z[static_cast<size_t>(r * V + j)]; };
  for (int64_t j = 0; j < V; ++j) {  // row 0: a permutation of -1e4 .. 1e4, 2e4/V apart
    int64_t k = (j * 37) % V;
    at(0, j) = round_to(c.dtype, -1e4 + 2e4 * static_cast<double>(k) / static_cast<double>(V - 1));
  }
  for (int64_t j = 0; j < V; ++j)  // row 1: every 3rd entry -inf
    if (j % 3 == 1) at(1, j) = -HUGE_VAL;
  y[1] = 3 * (y[1] / 3 % (V / 3));  // j % 3 == 0: finite
  // Constant rows stay moderate here (the huge ones, ±1e30 and ±3e38, are
  // test_adversarial.cpp's, with error measures made for them).
  for (int64_t j = 0; j < V; ++j) at(2, j) = 2.5;    // row 2: constant
  for (int64_t j = 0; j < V; ++j) at(3, j) = -60.0;  // row 3: constant, negative
  at(4, V / 2) = 1e4;                                 // row 4: one huge outlier
  y[5] = V / 2;
  at(5, V / 2) = 1e4;                                 // row 5: outlier at the target
  for (int64_t j = 0; j < V; ++j)                     // row 6: all -inf but the target
    if (j != y[6]) at(6, j) = -HUGE_VAL;
  for (int64_t j = 0; j < V; ++j)                     // row 7: -1e4 but one entry 1e4
    at(7, j) = (j == 5) ? 1e4 : -1e4;
  y[7] = 6;                                           // loss 2e4
}

TEST_F(Ce, ExtremeLogits) {
  for (int dtype : kDtypes)
    for (int red : kReductions) {
      CeCase c;
      c.name = "extreme";
      c.dtype = dtype;
      c.reduction = red;
      c.N = 12;
      c.V = 97;
      c.lambda = 1e-4f;
      c.edit = extreme_edit;
      run_case(c);
      // With a softcap every entry becomes finite (-inf -> -c), so smoothing is fine too.
      c.name = "extreme_softcap_smoothing";
      c.softcap = 30.0f;
      c.eps = 0.1f;
      c.weights = true;
      run_case(c);
      c.name = "extreme_strided";
      c.softcap = 0;
      c.eps = 0;
      c.row_pad = 4;
      c.grad_pad = 9;
      run_case(c);
    }
}

// A row of all -inf: lse = -inf and its loss NaN (docs/semantics.md rule 10); other rows intact.
TEST_F(Ce, AllNegativeInfinityRow) {
  for (int dtype : kDtypes) {
    CeCase c;
    c.name = "all_neg_inf_row";
    c.dtype = dtype;
    c.reduction = FCE_REDUCTION_NONE;
    c.N = 5;
    c.V = 40;
    c.grad = false;
    c.edit = [](const CeCase& cc, std::vector<double>& z, std::vector<int64_t>&) {
      for (int64_t j = 0; j < cc.V; ++j) z[static_cast<size_t>(2 * cc.V + j)] = -HUGE_VAL;
    };
    CeRunner run(c);
    ASSERT_TRUE(std::isinf(run.ref().lse[2]) && run.ref().lse[2] < 0);
    ASSERT_TRUE(std::isnan(run.ref().row_loss[2]));
    run.forward();
  }
}

// Targets outside [0, V): NaN row loss and gradient row, NaN reduced loss, the flag, the row
// counted 1 in the mean's denominator, every other row intact.
TEST_F(Ce, OutOfRangeTargets) {
  for (int dtype : {FCE_FLOAT32, FCE_BFLOAT16})
    for (int tdtype : {FCE_INT32, FCE_INT64})
      for (int red : kReductions)
        for (bool flags : {true, false}) {
          CeCase c;
          c.name = "out_of_range";
          c.dtype = dtype;
          c.tdtype = tdtype;
          c.reduction = red;
          c.flags = flags;
          c.N = 24;
          c.V = 301;
          c.weights = true;
          c.eps = 0.1f;
          c.lambda = 1e-3f;
          c.ignore_frac = 0.2;
          c.edit = [](const CeCase& cc, std::vector<double>&, std::vector<int64_t>& y) {
            y[1] = cc.V;
            y[4] = -1;
            y[7] = -101;
            y[9] = cc.V + 1000;
            if (cc.tdtype == FCE_INT64) {
              y[12] = (int64_t{1} << 32) + 1;  // a valid class if truncated to 32 bits
              y[15] = INT64_MAX;
              y[18] = INT64_MIN;
            } else {
              y[12] = INT32_MAX;
              y[15] = INT32_MIN;
            }
          };
          run_case(c);
        }
}

TEST_F(Ce, OutOfRangeTargetsWithShift) {
  CeCase c;
  c.name = "out_of_range_shift";
  c.reduction = FCE_REDUCTION_MEAN;
  c.N = 24;
  c.V = 100;
  c.shift = 6;
  c.edit = [](const CeCase& cc, std::vector<double>&, std::vector<int64_t>& y) {
    y[3] = cc.V;   // read by row 2
    y[6] = 100000; // would be read by row 5 = the last of its sequence: ignored, no flag
  };
  CeRunner run(c);
  ASSERT_EQ(run.ref().kind[2], fceref::kInvalid);
  ASSERT_EQ(run.ref().kind[5], fceref::kIgnored);
  run.forward();
  // Only y[6] out of range (never read): no NaN, no flag.
  CeCase d = c;
  d.edit = [](const CeCase&, std::vector<double>&, std::vector<int64_t>& y) { y[6] = 100000; };
  CeRunner run2(d);
  ASSERT_FALSE(run2.any_invalid());
  CeOut out;
  run2.forward(&out);
  run2.backward(false, &out.grad);
}

// grad_output = 0: a zero gradient (exactly). Also per-row for none with zeros mixed in.
TEST_F(Ce, ZeroUpstreamGradient) {
  for (int red : kReductions) {
    CeCase c;
    c.name = "zero_upstream";
    c.reduction = red;
    c.gout_zero_every = 1;
    c.eps = 0.1f;
    c.lambda = 1e-3f;
    run_case(c);
  }
  CeCase c;
  c.name = "per_row_upstream_with_zeros";
  c.reduction = FCE_REDUCTION_NONE;
  c.gout_zero_every = 3;
  run_case(c);
}

// fce_backward writing over the logits it reads.
TEST_F(Ce, BackwardInPlace) {
  for (int dtype : kDtypes)
    for (int red : kReductions) {
      CeCase c;
      c.name = "backward_inplace";
      c.dtype = dtype;
      c.reduction = red;
      c.weights = true;
      c.eps = 0.1f;
      c.lambda = 1e-4f;
      c.softcap = 30.0f;
      c.row_pad = 6;
      c.ignore_frac = 0.1;
      CeRunner run(c);
      CeOut out;
      ASSERT_NO_FATAL_FAILURE(run.forward(&out));
      ASSERT_NO_FATAL_FAILURE(run.backward(true, &out.grad));
    }
}

// Two identical calls give bitwise-identical outputs, whatever garbage the workspace holds.
TEST_F(Ce, Deterministic) {
  for (int dtype : kDtypes)
    for (int red : kReductions) {
      CeCase c;
      c.name = "deterministic";
      c.dtype = dtype;
      c.reduction = red;
      c.N = 131;
      c.V = 2053;
      c.weights = true;
      c.eps = 0.1f;
      c.lambda = 1e-4f;
      c.ignore_frac = 0.1;
      c.deterministic = true;
      c.argmax = c.accuracy = true;
      CeRunner run(c);
      CeOut a, b;
      ASSERT_NO_FATAL_FAILURE(run.forward(&a, 0xFF));
      ASSERT_NO_FATAL_FAILURE(run.forward(&b, 0x00));
      EXPECT_TRUE(bitwise_equal(a.loss, b.loss, "loss"));
      EXPECT_TRUE(bitwise_equal(a.lse, b.lse, "lse"));
      EXPECT_TRUE(bitwise_equal(a.zloss, b.zloss, "z_loss"));
      EXPECT_TRUE(bitwise_equal(a.grad, b.grad, "grad_logits"));
      EXPECT_TRUE(bitwise_equal(a.argmax, b.argmax, "outputs->argmax"));
      EXPECT_TRUE(bitwise_equal(a.accuracy, b.accuracy, "outputs->accuracy"));
      std::vector<uint8_t> g1, g2;
      ASSERT_NO_FATAL_FAILURE(run.backward(false, &a.grad, &g1, 0xFF));
      ASSERT_NO_FATAL_FAILURE(run.backward(false, &a.grad, &g2, 0x5A));
      EXPECT_TRUE(bitwise_equal(g1, g2, "grad_logits (fce_backward)"));
    }
}

}  // namespace
