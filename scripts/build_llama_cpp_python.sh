#!/usr/bin/env bash
# Build llama-cpp-python (which vendors llama.cpp) into its own venv OUTSIDE the clone, for the
# conformance suite (tests/conformance/): kvcli against llama.cpp on the same GGUF. Never a kvcli
# dependency; kvcli's venv never imports llama_cpp (the tests run a worker with this venv's python).
#   scripts/build_llama_cpp_python.sh          # build if missing, print the build; seconds when built
#   scripts/build_llama_cpp_python.sh --where  # print the venv's python path (built or not), build nothing
#   scripts/build_llama_cpp_python.sh --isa    # print "<isa> <cmake args>" (build_llama_server.sh builds the same)
# Where: ${KVCLI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcli}/llama-cpp/<version>-<isa>/
#   <isa>: native (GGML_NATIVE=ON), or native-noamx on CPUs with AMX tiles: llama.cpp's AMX path
#   segfaults on quantized models there, so AMX is turned off. GGML_AMX_*=OFF alone does not do it: with
#   GGML_NATIVE, -march=native defines __AMX_INT8__ and ggml compiles its AMX path in (seen 2026-12-05: such a
#   build printed AMX_INT8 = 1 and crashed on a Q4_0 file); -mno-amx-* in CFLAGS/CXXFLAGS undefine it.
#   LLAMA_CPP_ISA overrides the name check.
#   scripts/build_llama_cpp_python.sh --cflags # print the extra C/C++ flags (build_llama_server.sh uses them)
# Env: LLAMA_CPP_PYTHON_VERSION (0.3.36), PYTHON (interpreter for the venv), JOBS (nproc).
# Exit 0 and print "build_llama_cpp_python: <version>-<isa> ready: <python>"; non-zero with one line why.
# Measured: 1578 s (26 min) on 2 cores shared with other jobs (load average ~6, build niced), 2026-12-02;
# 296 s on an idle 2-core AMD EPYC, 2026-12-03. When built: under a second.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${KVCLI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcli}
ARGS="-DGGML_NATIVE=ON"
ISA=native
NOAMX=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  ISA=native-noamx
  ARGS="$ARGS -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
ISA=${LLAMA_CPP_ISA:-$ISA}
DEST="$CACHE/llama-cpp/$VERSION-$ISA"
PYBIN="$DEST/bin/python"
STAMP="$DEST/.kvcli-built"
if [ "${1:-}" = "--where" ]; then echo "$PYBIN"; exit 0; fi
if [ "${1:-}" = "--isa" ]; then echo "$ISA $ARGS"; exit 0; fi
if [ "${1:-}" = "--cflags" ]; then echo "$NOAMX"; exit 0; fi

ready() {
  [ -f "$STAMP" ] && grep -qF "CFLAGS=$NOAMX;" "$STAMP" && [ -x "$PYBIN" ] && \
    "$PYBIN" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null
}
if ready; then
  echo "build_llama_cpp_python: $VERSION-$ISA ready: $PYBIN ($(cat "$STAMP"))"; exit 0
fi
for tool in cmake c++; do
  command -v $tool >/dev/null || { echo "build_llama_cpp_python: needs $tool to build llama.cpp" >&2; exit 3; }
done
mkdir -p "$CACHE/llama-cpp"
# One build at a time (make test and a test run may both ask); the second waits, then finds it built.
exec 9>"$CACHE/llama-cpp/.lock-$VERSION-$ISA"
if command -v flock >/dev/null; then flock 9; fi
if ready; then
  echo "build_llama_cpp_python: $VERSION-$ISA ready: $PYBIN ($(cat "$STAMP"))"; exit 0
fi
PY=${PYTHON:-python3}
rm -rf "$DEST"; "$PY" -m venv "$DEST"
echo "build_llama_cpp_python: building llama-cpp-python $VERSION ($ISA: $ARGS) into $DEST; several minutes, log in $DEST/build.log"
start=$(date +%s)
# CPU backend only: no BLAS, no curl, no OpenMP surprises beyond llama.cpp's defaults.
if ! CMAKE_ARGS="$ARGS -DGGML_BLAS=OFF -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)} \
    CFLAGS="${CFLAGS:-} $NOAMX" CXXFLAGS="${CXXFLAGS:-} $NOAMX" \
    nice -n 10 "$DEST/bin/python" -m pip install --no-cache-dir "llama-cpp-python==$VERSION" numpy >"$DEST/build.log" 2>&1; then
  echo "build_llama_cpp_python: build failed; see $DEST/build.log (tail below)" >&2; tail -5 "$DEST/build.log" >&2; exit 4
fi
secs=$(( $(date +%s) - start ))
echo "built $(date -u +%Y-%m-%dT%H:%MZ) in ${secs}s on $(nproc) cores, CMAKE_ARGS=$ARGS; CFLAGS=$NOAMX;" >"$STAMP"
ready || { echo "build_llama_cpp_python: built but llama_cpp $VERSION does not import; see $DEST/build.log" >&2; exit 5; }
echo "build_llama_cpp_python: $VERSION-$ISA ready: $PYBIN (built in ${secs}s)"
