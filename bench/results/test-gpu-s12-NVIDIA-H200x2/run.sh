#!/usr/bin/env bash
# issue 12 on two GPUs: the build of this tree (sm_90), its NCCL suites, the torch.distributed
# NCCL tests, bench_vocab_parallel; plus the CE suites of session 11's kernels on GPU 0.
# .device/pkg.tar.xz (not committed): build-sm90/ (cmake, CUDA_ARCHS 90) libfusedce*.so, its test
# binaries, and the build machine's libopenblas.so.0, libgfortran.so.5, libquadmath.so.0.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=/tmp/fce; mkdir -p $R && tar -xJf .device/pkg.tar.xz -C $R
extra=$(python3 - <<'PY'
import glob, os, nvidia
dirs = set()
for root in list(nvidia.__path__) + ["/usr/local/cuda/lib64", "/usr/local/cuda/lib"]:
    for pat in ("libcublasLt.so.13", "libnccl.so.2"):
        for f in glob.glob(os.path.join(root, "**", pat), recursive=True):
            dirs.add(os.path.dirname(f))
print(":".join(sorted(dirs)))
PY
)
export LD_LIBRARY_PATH=$R/lib:$extra
export FUSEDCE_LIBRARY=$R/lib/libfusedce.so PYTHONPATH=$PWD/bindings/python
{ date -u; nvidia-smi -L; nvidia-smi topo -m; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; } > $OUT/machine.log 2>&1
cat $OUT/machine.log
t0=$SECONDS
run() { local name=$1 lim=$2; shift 2; echo "=== $name"; timeout $lim "$@" > $OUT/$name.log 2>&1; echo "--- $name rc=$? ($((SECONDS - t0)) s)"; tail -n 4 $OUT/$name.log; }
run test_nccl 90 $R/tests/test_nccl
run bench_vocab_parallel 240 python3 bench/bench_vocab_parallel.py --gpus 2 --iters 5 --out $OUT
run pytest_distributed_nccl 180 python3 -m pytest -q -rs -p no:cacheprovider bindings/python/tests/test_distributed.py -k nccl
CUDA_VISIBLE_DEVICES=0 run test_ce 60 env FCE_TEST_BACKEND=cuda $R/tests/test_ce
CUDA_VISIBLE_DEVICES=0 run test_adversarial 30 env FCE_TEST_BACKEND=cuda $R/tests/test_adversarial
ls -la $OUT
