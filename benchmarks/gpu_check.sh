#!/usr/bin/env bash
# GPU check for the Triton kernels (issue 7), a few minutes on one GPU:
#   1. the CUDA-marked tests (hardware bf16 cast, no host-to-device copy, no re-JIT, ...);
#   2. the ~1B-parameter optimizer-step benchmark (JSON under $OUT when OUT is set);
#   3. the main benchmark's gpu-114m preset, shortened to GPU_BENCH_STEPS steps (default 300)
#      so that all three checks fit ~10 minutes (results under $OUT/bench_gpu114m);
#   4. CPU offload (CPUOffloadOptimizer): GPU memory saved, step time, copy/compute overlap.
# Works from a plain checkout (no install needed) with torch + triton; torchao and
# bitsandbytes are benchmarked only when installed. Extra arguments go to the benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; fi

"$PYTHON" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" || exit 1

# Modules whose optional dependencies are missing here fail to collect; the CUDA tests of the
# others must still run.
"$PYTHON" -m pytest -q -m cuda --continue-on-collection-errors -p no:cacheprovider tests \
    2>&1 | tee "${OUT:-/tmp}/gpu_check_pytest.txt"
tests_status=${PIPESTATUS[0]}

"$PYTHON" benchmarks/bench_gpu_step.py "$@"
bench_status=$?

"$PYTHON" -m lowbit_optim.bench --model-size gpu-114m --device cuda \
    --steps "${GPU_BENCH_STEPS:-300}" --out "${OUT:-/tmp}/bench_gpu114m"
train_status=$?

"$PYTHON" benchmarks/gpu_offload_check.py --out "${OUT:-/tmp}/offload"
offload_status=$?

echo "pytest -m cuda exit status: $tests_status; step benchmark: $bench_status;" \
     "gpu-114m training benchmark: $train_status; CPU offload check: $offload_status"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ] && [ "$train_status" -eq 0 ] \
    && [ "$offload_status" -eq 0 ]
