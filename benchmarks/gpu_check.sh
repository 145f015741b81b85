#!/usr/bin/env bash
# The one command for a lent GPU (docs/triton.md, "The GPU check"): installs the wheels carried
# in .whl/ (torchao, bitsandbytes, ... : the device machine reaches no package index) into
# /tmp/site when there are any, then runs benchmarks/gpu_check.py, which runs every check with
# its own time limit and writes gpu_check.{json,md,log} under $OUT. Without a GPU it runs the
# CPU-side checks only and exits 0. Arguments go to gpu_check.py (e.g. --only cuda_tests).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" benchmarks/gpu_check.py "$@"
