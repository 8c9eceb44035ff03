#!/usr/bin/env bash
# The GPU check: Quire's Triton kernels tested compiled on the GPU, kernel microbenchmarks, and Quire
# against transformers end to end. About 5 minutes on an H200; needs no network.
#
#   benchmarks/gpu_check.sh [OUT_DIR]      (default: $OUT, else ./gpu-check-out)
#
# Python packages the machine lacks (fastapi, uvicorn, msgspec, pyzmq, ...) are installed from wheels in
# .whl/ when that folder exists. The packages of this repository run from their sources (PYTHONPATH).
# Writes OUT_DIR/summary.md (quoted in the issue's closing note), summary.json, tests.log and bench.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$out"
python=${PYTHON:-python3}

if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/quire-site .whl/*.whl \
    || { echo "installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/quire-site${PYTHONPATH:+:$PYTHONPATH}"
fi
src=""
for package in packages/*/src; do src="$src:$PWD/$package"; done
export PYTHONPATH="$PWD${src}${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
"$python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"

echo "== kernel and CUDA-path tests, compiled on the GPU"
timeout 180 "$python" -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/triton_ops tests/core/test_cuda.py \
  2>&1 | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== benchmarks"
timeout 240 "$python" benchmarks/gpu_benchmarks.py --out "$out" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}

{
  echo
  echo "GPU tests: $(tail -n 1 "$out/tests.log") (exit $tests_rc)"
  cat "$out/gpu.txt"
} >> "$out/summary.md"
cat "$out/summary.md"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
