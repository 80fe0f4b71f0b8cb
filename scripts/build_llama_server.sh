#!/usr/bin/env bash
# Build llama.cpp's llama-server once, from the llama.cpp sources vendored in the llama-cpp-python
# sdist that scripts/build_llama_cpp.sh builds the batch benchmark from (same version: 0.3.36), so
# the server and the in-process llama.cpp numbers come from one llama.cpp. Used by
# tests/test_llama_server.py and python -m kvcli.bench serve-vs-llama-server --llama-server, which skip with a message
# while the binary is missing. Niced: it takes many minutes on 2 cores. No network at build time
# beyond fetching the sdist (the web UI's prebuilt assets are not downloaded; the API needs none).
#   scripts/build_llama_server.sh        # -> $KVCLI_CACHE/llama-server/bin/llama-server
# KVCLI_CACHE: where builds go (default: <repo>/.cache/bench); LLAMA_SDIST: a local copy of
# llama_cpp_python-<version>.tar.gz (else pip downloads it); PYTHON: the interpreter that runs pip.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${KVCLI_CACHE:-$ROOT/.cache/bench}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DEST="$CACHE/llama-server"
BIN="$DEST/bin/llama-server"
if [ -x "$BIN" ]; then
    echo "build_llama_server: already built: $BIN"
    exit 0
fi
for tool in cmake c++; do
    command -v $tool >/dev/null || { echo "build_llama_server: needs $tool" >&2; exit 3; }
done
mkdir -p "$DEST/src" "$DEST/bin"
cd "$DEST/src"
SDIST=${LLAMA_SDIST:-$DEST/src/llama_cpp_python-$VERSION.tar.gz}
if [ ! -f "$SDIST" ]; then
    PY=${PYTHON:-python3}
    "$PY" -m pip download --no-deps --no-binary :all: --dest . "llama-cpp-python==$VERSION"
    SDIST=$DEST/src/llama_cpp_python-$VERSION.tar.gz
fi
SRC="$DEST/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$SRC/tools/server/server.cpp" ] || nice -n 15 tar xzf "$SDIST" "llama_cpp_python-$VERSION/vendor/llama.cpp"
# GGML_NATIVE as the batch benchmark's llama-native build; no OpenSSL (loopback only), no web UI.
nice -n 15 cmake -S "$SRC" -B "$DEST/build" -G "${CMAKE_GENERATOR:-Unix Makefiles}" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DGGML_BLAS=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >"$DEST/build.log" 2>&1 \
    || { echo "build_llama_server: cmake configure failed; see $DEST/build.log" >&2; tail -20 "$DEST/build.log" >&2; exit 4; }
nice -n 15 cmake --build "$DEST/build" --target llama-server -j "${JOBS:-$(nproc)}" >>"$DEST/build.log" 2>&1 \
    || { echo "build_llama_server: build failed; see $DEST/build.log" >&2; tail -20 "$DEST/build.log" >&2; exit 4; }
cp "$DEST/build/bin/llama-server" "$BIN"
echo "build_llama_server: built $BIN (llama.cpp from llama-cpp-python $VERSION)"
