#!/usr/bin/env bash
# make test-gpu's suites that session 11 did not run on its final build, on this tree's sm_90 build
# .device/pkg.tar.xz (not committed): the same package as test-gpu-s12-NVIDIA-H200x2/run.sh names.
set -uo pipefail
R=/tmp/fce; mkdir -p $R && tar -xJf .device/pkg.tar.xz -C $R
extra=$(python3 - <<'PY'
import glob, os, nvidia
dirs = set()
for root in list(nvidia.__path__) + ["/usr/local/cuda/lib64"]:
    for pat in ("libcublasLt.so.13", "libnccl.so.2"):
        for f in glob.glob(os.path.join(root, "**", pat), recursive=True):
            dirs.add(os.path.dirname(f))
print(":".join(sorted(dirs)))
PY
)
export LD_LIBRARY_PATH=$R/lib:$extra FUSEDCE_LIBRARY=$R/lib/libfusedce.so PYTHONPATH=$PWD/bindings/python
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 FCE_TEST_BACKEND=cuda
nvidia-smi -L
t0=$SECONDS; pass=0; fail=0
run() { local name=$1 lim=$2; shift 2; timeout $lim "$@" > $OUT/$name.log 2>&1; local rc=$?
  [ $rc = 0 ] && pass=$((pass+1)) || fail=$((fail+1))
  echo "--- $name rc=$rc ($((SECONDS - t0)) s): $(grep -E '^\[  (PASSED|FAILED) |passed|failed' $OUT/$name.log | tail -n 2 | tr '\n' ' ')"; }
run c-small 120 bash -c "$R/tests/test_api && $R/tests/test_scale && $R/tests/test_threads && $R/tests/test_nccl"
run test_vocab_parallel 150 $R/tests/test_vocab_parallel
run test_linear_ce-sliced 150 env FCE_LINEAR_CE_PLAN=sliced $R/tests/test_linear_ce
run test_ce-large 90 env FCE_TEST_LARGE=1 $R/tests/test_ce --gtest_filter=Ce.CudaLargeOffsets
run pytest-gpu 150 python3 -m pytest -q -p no:cacheprovider tests/gpu bindings/python/tests/test_torch.py
echo "suites: $pass passed, $fail failed"
