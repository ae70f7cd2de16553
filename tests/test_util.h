// test_util.h — the harness every fusedce suite includes (tests/harness/):
//   backend.h   the backend under test (FCE_TEST_BACKEND), its stream, finish(), BackendTest
//   numbers.h   dtypes, float16 / bfloat16 on the host, put() / get() of one element
//   buffers.h   Buf (backend memory with guards and a host mirror), Mat layouts, poison, and
//               the checks: all_written, only_elements_changed, unchanged, guards_intact
//   problem.h   random data, CeSpec / LinearSpec, their library and reference options,
//               the option matrix (OptionVariant, option_matrix, MatrixTest)
//   compare.h   tolerances by dtype, close_normwise, close_scalar, bitwise_equal,
//               error_mentions
// The float64 reference is ref.h; the checks that need it beyond a norm-wise bound (argmax,
// accuracy, fce_backward against fce_forward) are check_ce.h.
#pragma once

#include "harness/backend.h"
#include "harness/buffers.h"
#include "harness/compare.h"
#include "harness/numbers.h"
#include "harness/problem.h"
