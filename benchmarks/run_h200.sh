#!/usr/bin/env bash
# One call on the H200 machine: the real-geometry GGUF of MODEL (LAYERS layers) in RAM,
# the CUDA tests, bench_real.py (resident, and through a pack at emulated drive speeds),
# and llama.cpp's llama-bench on the same file, built meanwhile from .lcp (made by the
# llamacpp-peer script: a trimmed llama.cpp source tree) when that folder is present.
#   bash benchmarks/run_h200.sh deepseek-v4-flash 8 [bench_real.py options...]
# Wheels the machine lacks (gguf, platformdirs) travel in .whl; results go to $OUT.
# LLAMACPP_BUILD=0 / LLAMACPP_BENCH=0 skip starting the build / running llama-bench (a
# build started by an earlier call of this script is waited for, up to 8 minutes). A build
# this call starts runs beside the tests and is finished before the benchmarks start.
# REAL=0 skips the GGUF and bench_real.py (kernel benchmarks only). TESTS=0 skips the CUDA
# tests (TEST_FILES="tests/a.py ..." runs those instead of the kernel tests);
# GEMV_BENCH=1 adds bench_quant_gemv.py (GEMV_BENCH=sweep: with --sweep; GEMV_MODEL=kimi-k3: that
# model's matrices only), KERNEL_BENCH=1
# the expert kernels' benchmarks (MXFP4 decode and prefill, the K-quant decode with --sweep;
# KERNEL_BENCH=decode: the decode ones only; KERNEL_BENCH=quant: the K-quant decode one
# only), PREFILL_BENCH=1 the K-quant batched prefill's
# (bench_batched_prefill.py: batch budgets, rows read in place or gathered), PARITY=1 parity_cuda.py.
set -uo pipefail
MODEL=$1 LAYERS=$2; shift 2
OUT=${OUT:-/tmp/expertdesk-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
WORK=/dev/shm/expertdesk; mkdir -p "$WORK"; GGUF=$WORK/$MODEL-${LAYERS}l.gguf
if [ "${LLAMACPP_BUILD:-1}" = 1 ] && [ -d .lcp ] && [ ! -e /tmp/lcp/CMakeCache.txt ]; then
  (nice cmake -S .lcp -B /tmp/lcp -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
     -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_HTML=OFF \
     -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_IS_DEV=OFF -DCMAKE_BUILD_TYPE=Release && nice cmake --build /tmp/lcp -j12 --target llama-bench) > "$OUT/llamacpp-build.log" 2>&1 &
  BUILD_PID=$!
fi
[ "${REAL:-1}" = 0 ] || [ -f "$GGUF" ] || python3 -m benchmarks.real_geometry --model "$MODEL" --layers "$LAYERS" --out "$GGUF" --threads 4 | tail -3
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
TEST_FILES=${TEST_FILES:-tests/test_norm_rope.py tests/test_hyper_connection.py tests/test_routing.py
  tests/test_decode_attention.py tests/test_compressor_kernel.py tests/test_indexer_kernel.py tests/test_quant_gemv.py
  tests/test_dequant.py tests/test_moe_kernels.py tests/test_moe_mxfp4.py tests/test_moe_mxfp4_prefill.py
  tests/test_moe_prefill.py tests/test_runtime_cuda.py}
# shellcheck disable=SC2086
[ "${TESTS:-1}" = 1 ] && timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider $TEST_FILES 2>&1 | tail -8
[ -n "${GEMV_BENCH:-}" ] && timeout "${GEMV_TIMEOUT:-240}" python3 benchmarks/bench_quant_gemv.py \
  $([ "$GEMV_BENCH" = sweep ] && echo --sweep) ${GEMV_MODEL:+--model "$GEMV_MODEL"} --out "$OUT/quant-gemv.json" \
  2>&1 | grep -v '^  \|^wrote' | tail -40
if [ -n "${KERNEL_BENCH:-}" ]; then
  [ "$KERNEL_BENCH" = quant ] || python3 benchmarks/bench_moe_mxfp4.py --out "$OUT/moe-mxfp4.json" 2>&1 | tail -8
  timeout "${KERNEL_TIMEOUT:-300}" python3 benchmarks/bench_moe_quant.py --sweep --out "$OUT/moe-quant.json" 2>&1 | tail -24
  [ "$KERNEL_BENCH" = decode ] || [ "$KERNEL_BENCH" = quant ] || python3 benchmarks/bench_moe_prefill.py --out "$OUT/moe-prefill.json" 2>&1 | tail -8
fi
[ -n "${PREFILL_BENCH:-}" ] && python3 benchmarks/bench_batched_prefill.py --budgets 1024,auto \
  --out "$OUT/batched-prefill.json" 2>&1 | tail -10
[ -n "${PARITY:-}" ] && python3 benchmarks/parity_cuda.py --out "$OUT" 2>&1 | tail -16
# The tests share the CPU with the build; the measurements do not.
[ -n "${BUILD_PID:-}" ] && { wait "$BUILD_PID"; echo "llama.cpp built: $(tail -1 "$OUT/llamacpp-build.log")"; }
[ "${REAL:-1}" = 0 ] && exit 0
# TUNED=1: bench_real runs with the configurations this call's sweeps found best (--kernel-configs)
python3 benchmarks/bench_real.py --model "$MODEL" --layers "$LAYERS" --work "$WORK" --out "$OUT" \
  ${TUNED:+--kernel-configs "$OUT/quant-gemv.json" "$OUT/moe-quant.json"} "$@"
if [ "${LLAMACPP_BENCH:-1}" = 1 ] && [ -d .lcp ]; then
  for _ in $(seq 480); do [ -x /tmp/lcp/bin/llama-bench ] && break; sleep 1; done
  /tmp/lcp/bin/llama-bench -m "$GGUF" -p 512 -n 32 -ngl 99 -r 3 -o json > "$OUT/llamacpp-$MODEL-${LAYERS}l.json" 2> "$OUT/llamacpp-bench.err" \
    && cat "$OUT/llamacpp-$MODEL-${LAYERS}l.json" | python3 -c "import json,sys; [print(r['n_prompt'], r['n_gen'], r['avg_ts']) for r in json.load(sys.stdin)]"
  tail -3 "$OUT/llamacpp-bench.err"
fi
