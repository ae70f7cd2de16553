#!/usr/bin/env bash
# make test-gpu: the C ABI suites on the CUDA backend, a subset under compute-sanitizer
# (memcheck, racecheck), the torch parity tests and the Python binding's GPU tests.
set -uo pipefail
BUILD=$(cd "${1:-build}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export FUSEDCE_LIBRARY="$BUILD/libfusedce.so"
export LD_LIBRARY_PATH="$BUILD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# libfusedce_nccl's tests need libnccl.so.2: the system's, else the one pip's torch brings
if ! ldconfig -p 2>/dev/null | grep -q libnccl.so.2; then
  nccl_dir=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
  [ -n "$nccl_dir" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$nccl_dir"
fi
# FCE_GPU_PART picks what runs (so that each part fits a 10-minute job): all (the
# default), c (the C suites and the sanitizers), c-suites, c-sanitizers, or python (the rest).
case ${FCE_GPU_PART:-all} in
  all) c_suites=1; c_sanitizers=1; python_suites=1 ;;
  c) c_suites=1; c_sanitizers=1; python_suites=0 ;;
  c-suites) c_suites=1; c_sanitizers=0; python_suites=0 ;;
  c-sanitizers) c_suites=0; c_sanitizers=1; python_suites=0 ;;
  python) c_suites=0; c_sanitizers=0; python_suites=1 ;;
  *) echo "FCE_GPU_PART=$FCE_GPU_PART: expected all, c, c-suites, c-sanitizers or python" >&2
     exit 2 ;;
esac
export NCCL_NVLS_ENABLE=0  # NVLink multicast (NVLS) stays off: the tests do not use it
export PYTHONPATH="$ROOT/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 - <<'PY'
import ctypes, os, sys
lib = ctypes.CDLL(os.environ["FUSEDCE_LIBRARY"])
sys.exit(0 if lib.fce_cuda_available() else 1)
PY
then
  echo "SKIPPED: make test-gpu needs a CUDA device and a CUDA build; none here"
  exit 0
fi
passed=0; failed=0; failed_names=()
suite() {
  local name=$1; shift
  echo "=== $name"
  if "$@"; then passed=$((passed + 1)); echo "--- $name: ok"
  else failed=$((failed + 1)); failed_names+=("$name"); echo "--- $name: FAILED"; fi
}
# The GoogleTest binaries run directly (not through ctest, whose test lists point into the
# build machine's CMake installation, so a build carried to another machine cannot use them).
if [ $c_suites = 1 ]; then
for path in "$BUILD"/tests/test_*; do
  t=$(basename "$path")
  [ -f "$path" ] && [ -x "$path" ] && suite "C ABI $t on CUDA" env FCE_TEST_BACKEND=cuda "$path"
done
suite "linear CE, vocab-sliced plan forced (CUDA)" env FCE_TEST_BACKEND=cuda FCE_LINEAR_CE_PLAN=sliced \
  "$BUILD/tests/test_linear_ce"
suite "tensors past 2^31 elements (CUDA)" env FCE_TEST_BACKEND=cuda FCE_TEST_LARGE=1 \
  "$BUILD/tests/test_ce" --gtest_filter=Ce.CudaLargeOffsets
# the bulk-copy kernel (sm_90) on rows of every length, not only those of 16 KB+, and with the
# gradient (fce_backward_rescale included) wherever a row fits its stage
for t in test_ce test_linear_ce test_adversarial test_rescale; do
  suite "$t, bulk kernel on every row (CUDA)" env FCE_TEST_BACKEND=cuda \
    FCE_CUDA_CE_PATH=bulk "$BUILD/tests/$t"
done
# the path of a GPU without clusters, bulk copies or dependent launches (FCE_CUDA_PORTABLE=1: the
# device is treated as compute capability 8.x), on this one
for t in test_ce test_linear_ce test_adversarial test_rescale; do
  suite "$t, portable path (CUDA)" env FCE_TEST_BACKEND=cuda FCE_CUDA_PORTABLE=1 "$BUILD/tests/$t"
done
# the register path's shared-memory slots (sm_90) wherever they take fewer CTAs than registers
# alone, also on the tests' few rows (the default takes them only on launches of many waves)
for t in test_ce test_adversarial test_rescale; do
  suite "$t, register path with shared-memory slots (CUDA)" env FCE_TEST_BACKEND=cuda \
    FCE_CUDA_CE_SMEM=always "$BUILD/tests/$t"
done
fi
if [ $c_sanitizers = 1 ] && ! command -v compute-sanitizer >/dev/null; then
  echo "SKIPPED: compute-sanitizer not on PATH"
elif [ $c_sanitizers = 1 ]; then
  # A subset that reaches every kernel path: one CTA, clusters (V = 50257, odd and unaligned;
  # float32 rows of 512 KB-1 MB: clusters of 16), strided, in place, shift, every option,
  # out-of-range targets; and the linear plan.
  ce_filter='Ce.SingleRow:Ce.OddVocabularies:Ce.BiggerShapes:Ce.LongRows:Ce.OutOfRangeTargets*:*bf16_mean_everything*:*f32_none_strided*:*f16_sum_inplace_strided*'
  lin_filter='Linear.OddShapes:Linear.OutOfRangeTargets:*bf16_mean_plain*:*f32_sum_accumulate*:*bf16_none_everything*'
  for tool in memcheck racecheck; do
    suite "$tool test_ce" env FCE_TEST_BACKEND=cuda compute-sanitizer --tool $tool \
      --error-exitcode 1 "$BUILD/tests/test_ce" --gtest_filter="$ce_filter"
    suite "$tool test_ce (bulk kernel on every row)" env FCE_TEST_BACKEND=cuda \
      FCE_CUDA_CE_PATH=bulk compute-sanitizer --tool $tool --error-exitcode 1 \
      "$BUILD/tests/test_ce" --gtest_filter="$ce_filter"
    suite "$tool test_ce (shared-memory slots)" env FCE_TEST_BACKEND=cuda \
      FCE_CUDA_CE_SMEM=always compute-sanitizer --tool $tool \
      --error-exitcode 1 "$BUILD/tests/test_ce" --gtest_filter="$ce_filter"
    suite "$tool test_linear_ce" env FCE_TEST_BACKEND=cuda compute-sanitizer --tool $tool \
      --error-exitcode 1 "$BUILD/tests/test_linear_ce" --gtest_filter="$lin_filter"
    suite "$tool test_linear_ce (vocab-sliced)" env FCE_TEST_BACKEND=cuda FCE_LINEAR_CE_PLAN=sliced \
      compute-sanitizer --tool $tool --error-exitcode 1 "$BUILD/tests/test_linear_ce" \
      --gtest_filter="$lin_filter"
    suite "$tool scale" env FCE_TEST_BACKEND=cuda compute-sanitizer --tool $tool \
      --error-exitcode 1 "$BUILD/tests/test_scale"
    suite "$tool empty (zero rows)" env FCE_TEST_BACKEND=cuda compute-sanitizer --tool $tool \
      --error-exitcode 1 "$BUILD/tests/test_empty"
    # (racecheck: the vocabulary-parallel CE kernels only; the linear cases run cuBLASLt's
    # GEMM kernels, in which racecheck reports shared-memory hazards of NVIDIA's own code)
    vp_filter='Vp.*:VpLinear.*:*bf16_mean_everything*:*f16_none*'
    [ $tool = racecheck ] && vp_filter='Vp.*:*VpMatrix*bf16_mean_everything*:*VpMatrix*f16_none*'
    suite "$tool test_vocab_parallel" env FCE_TEST_BACKEND=cuda compute-sanitizer --tool $tool \
      --error-exitcode 1 "$BUILD/tests/test_vocab_parallel" --gtest_filter="$vp_filter"
    # (NCCL's initialisation probes kernels with CUDA API calls that fail by design: not
    # reported as errors)
    [ $tool = memcheck ] && [ -x "$BUILD/tests/test_nccl" ] && suite "$tool test_nccl" \
      compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 1 \
      "$BUILD/tests/test_nccl" --gtest_filter='Nccl.*MatchesUnsharded'
    true
  done
fi
if [ $python_suites = 1 ]; then
suite "torch parity (tests/gpu)" python3 -m pytest -q "$ROOT/tests/gpu"
suite "Python binding on CUDA (torch, CuPy; lse, entropy, probability targets, distillation)" \
  python3 -m pytest -q "$ROOT/bindings/python/tests/test_torch.py" \
  "$ROOT/bindings/python/tests/test_torch_extras.py" "$ROOT/bindings/python/tests/test_torch_lse.py" \
  "$ROOT/bindings/python/tests/test_torch_prob_targets.py" \
  "$ROOT/bindings/python/tests/test_torch_distill.py"
suite "vocabulary-parallel: fusedce.torch.distributed (gloo processes, NCCL, CUDA phases)" \
  python3 -m pytest -q -rs -p no:cacheprovider "$ROOT/bindings/python/tests/test_distributed.py" \
  "$ROOT/bindings/python/tests/test_distributed_entropy.py" \
  "$ROOT/bindings/python/tests/test_vp_phases.py"
suite "Hugging Face transformers (fusedce.transformers)" \
  python3 -m pytest -q -rs -p no:cacheprovider "$ROOT/bindings/python/tests/test_transformers.py"
suite "JAX (fusedce.jax, CUDA custom calls)" env XLA_PYTHON_CLIENT_PREALLOCATE=false \
  FUSEDCE_JAX_CACHE_DIR="$BUILD/jax-shim" \
  python3 -m pytest -q -rs -p no:cacheprovider "$ROOT/bindings/python/tests/test_jax.py" \
  "$ROOT/bindings/python/tests/test_jax_lse.py" "$ROOT/bindings/python/tests/test_jax_distill.py"
suite "recipes (GRPO, DPO) on CPU and CUDA: their parity with plain torch" \
  python3 -m pytest -q -rs -p no:cacheprovider "$ROOT/bindings/python/tests/test_recipes.py"
suite "demo (CUDA)" "$BUILD/examples/demo" --small
fi
echo
[ $failed -gt 0 ] && echo "failed suites: ${failed_names[*]}"
echo "gpu suites: $passed passed, $failed failed"
[ $failed -eq 0 ]
