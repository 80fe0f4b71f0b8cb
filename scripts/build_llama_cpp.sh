#!/usr/bin/env bash
# llama-cpp-python (llama.cpp's C++ engine) for the benchmarks, so `make bench` can put llama.cpp beside kvcli
# in one run. Never a kvcli dependency.
#   scripts/build_llama_cpp.sh native   # the CPU's own ISA: the conformance suite's build
#                                       # (scripts/build_llama_cpp_python.sh, outside the clone; on CPUs with AMX
#                                       # tiles built without AMX, whose path crashes on quantized models there)
#   scripts/build_llama_cpp.sh avx2     # AVX2/FMA/F16C only, to compare on an AVX-512 machine: .cache/bench/llama-avx2
# Exit 0 when built (seconds when it already is); non-zero with a message. kvcli/bench/llama_cpp_runner.py finds
# either venv; the feature line of every benchmark's raw output says which build ran.
set -euo pipefail
cd "$(dirname "$0")/.."
ISA=${1:-native}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
VENV=.cache/bench/llama-$ISA
case "$ISA" in
  native) exec bash scripts/build_llama_cpp_python.sh ;;
  avx2)   ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" ;;
  *) echo "build_llama_cpp: unknown ISA '$ISA' (native|avx2)" >&2; exit 2 ;;
esac
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
  echo "build_llama_cpp: $VENV already has llama-cpp-python $VERSION"; exit 0
fi
for tool in cmake c++; do
  command -v $tool >/dev/null || { echo "build_llama_cpp: needs $tool to build llama.cpp" >&2; exit 3; }
done
PY=${PYTHON:-python3}
rm -rf "$VENV"; "$PY" -m venv "$VENV"
echo "build_llama_cpp: building llama-cpp-python $VERSION for $ISA (several minutes; log in $VENV/build.log)"
# No BLAS, no OpenMP surprises: the CPU backend that llama.cpp ships by default.
if ! CMAKE_ARGS="$ARGS -DGGML_BLAS=OFF -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$VENV/bin/python" -m pip install -q --no-cache-dir "llama-cpp-python==$VERSION" >"$VENV/build.log" 2>&1; then
  echo "build_llama_cpp: build failed; see $VENV/build.log (tail below)" >&2; tail -5 "$VENV/build.log" >&2; exit 4
fi
"$VENV/bin/python" -c "import llama_cpp; print('build_llama_cpp: built', llama_cpp.__version__, 'into $VENV')"
