#!/usr/bin/env bash
# Build llama.cpp's llama-server once, into the same cache outside the clone as the conformance suite's
# llama-cpp-python (scripts/build_llama_cpp_python.sh), from the llama.cpp sources vendored in the same
# llama-cpp-python sdist (0.3.36): the server and the in-process llama.cpp are one llama.cpp. Used by
# tests/test_llama_server.py (watch and profile --endpoint against a real engine; `make test` builds it
# first) and python -m kvcli.bench serve-vs-llama-server, which skip with a message while it is missing.
#   scripts/build_llama_server.sh          # build if missing; seconds when built
#   scripts/build_llama_server.sh --where  # print the binary's path (built or not), build nothing
# Where: ${KVCLI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcli}/llama-server/<version>-<isa>/bin/llama-server
#   <isa> and the cmake flags: build_llama_cpp_python.sh's (--isa), the one place that decides them: native
#   (GGML_NATIVE=ON), or native-noamx on CPUs with AMX tiles (llama.cpp's AMX path segfaults on quantized
#   models there). LLAMA_CPP_ISA overrides the name check.
# Env: LLAMA_CPP_PYTHON_VERSION (0.3.36), LLAMA_SDIST (a local llama_cpp_python-<version>.tar.gz, else pip
# downloads it), PYTHON (the interpreter that runs pip), JOBS (nproc). No network at build time beyond the
# sdist (the web UI's prebuilt assets are not fetched; the API needs none). Niced.
# Exit 0 and print "build_llama_server: <version>-<isa> ready: <binary>"; non-zero with one line why.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${KVCLI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcli}
read -r ISA ARGS < <(bash "$(dirname "$0")/build_llama_cpp_python.sh" --isa)
NOAMX=$(bash "$(dirname "$0")/build_llama_cpp_python.sh" --cflags)
DEST="$CACHE/llama-server/$VERSION-$ISA"
BIN="$DEST/bin/llama-server"
STAMP="$DEST/.kvcli-built"
if [ "${1:-}" = "--where" ]; then echo "$BIN"; exit 0; fi

ready() { [ -f "$STAMP" ] && grep -qF "CFLAGS=$NOAMX;" "$STAMP" && [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; }
if ready; then echo "build_llama_server: $VERSION-$ISA ready: $BIN ($(cat "$STAMP"))"; exit 0; fi
for tool in cmake c++ tar; do
  command -v $tool >/dev/null || { echo "build_llama_server: needs $tool to build llama.cpp's server" >&2; exit 3; }
done
mkdir -p "$CACHE/llama-server"
# One build at a time (make test and a benchmark may both ask); the second waits, then finds it built.
exec 9>"$CACHE/llama-server/.lock-$VERSION-$ISA"
if command -v flock >/dev/null; then flock 9; fi
if ready; then echo "build_llama_server: $VERSION-$ISA ready: $BIN ($(cat "$STAMP"))"; exit 0; fi
rm -rf "$DEST"; mkdir -p "$DEST/src" "$DEST/bin"
echo "build_llama_server: building llama-server (llama.cpp of llama-cpp-python $VERSION, $ISA: $ARGS) into $DEST;" \
     "several minutes, log in $DEST/build.log"
start=$(date +%s)
SDIST=${LLAMA_SDIST:-}
if [ -z "$SDIST" ]; then
  "${PYTHON:-python3}" -m pip download -q --no-deps --no-binary :all: --dest "$DEST/src" "llama-cpp-python==$VERSION" \
      >"$DEST/build.log" 2>&1 || { echo "build_llama_server: could not fetch the llama-cpp-python $VERSION sdist; see $DEST/build.log" >&2; exit 4; }
  SDIST="$DEST/src/llama_cpp_python-$VERSION.tar.gz"
fi
nice -n 10 tar xzf "$SDIST" -C "$DEST/src" "llama_cpp_python-$VERSION/vendor/llama.cpp"
SRC="$DEST/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$SRC/tools/server/server.cpp" ] || { echo "build_llama_server: no tools/server in $SDIST" >&2; exit 4; }
# CPU backend only, static, no BLAS/curl/OpenSSL (loopback only), no web UI.
CFLAGS="${CFLAGS:-} $NOAMX" CXXFLAGS="${CXXFLAGS:-} $NOAMX" nice -n 10 cmake -S "$SRC" -B "$DEST/build" -G "${CMAKE_GENERATOR:-Unix Makefiles}" -DCMAKE_BUILD_TYPE=Release \
    $ARGS -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >>"$DEST/build.log" 2>&1 \
  || { echo "build_llama_server: cmake configure failed; see $DEST/build.log" >&2; tail -5 "$DEST/build.log" >&2; exit 4; }
nice -n 10 cmake --build "$DEST/build" --target llama-server -j "${JOBS:-$(nproc)}" >>"$DEST/build.log" 2>&1 \
  || { echo "build_llama_server: build failed; see $DEST/build.log" >&2; tail -5 "$DEST/build.log" >&2; exit 4; }
cp "$DEST/build/bin/llama-server" "$BIN"
rm -rf "$DEST/build" "$DEST/src"   # the binary is static; the tree is ~1 GB of objects
secs=$(( $(date +%s) - start ))
echo "built $(date -u +%Y-%m-%dT%H:%MZ) in ${secs}s on $(nproc) cores, $ARGS; CFLAGS=$NOAMX;" >"$STAMP"
ready || { echo "build_llama_server: built but $BIN --version fails; see $DEST/build.log" >&2; exit 5; }
echo "build_llama_server: $VERSION-$ISA ready: $BIN (built in ${secs}s)"
