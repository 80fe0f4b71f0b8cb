#!/usr/bin/env bash
# Run the Triton kernel tests (interpreter numerics + sm_90 ahead-of-time compiles) under several
# Triton releases. A GPU user runs whatever Triton their CUDA torch pins (torch 2.6 -> 3.2,
# 2.8 -> 3.4, 2.11 -> 3.6 as on the H200 image), while CI only sees the newest release.
#
#   bash scripts/triton_matrix.sh                 # 3.2.0 3.4.0 3.6.0
#   bash scripts/triton_matrix.sh 3.5.0 3.6.0     # chosen versions
#   MATRIX_TESTS="tests/kernels/test_kernel_sm90_compile.py" bash scripts/triton_matrix.sh   # a subset
#
# One venv per version under .cache/triton-matrix: CPU torch 2.13.0, kvcli without its declared
# dependencies, and what tests/kernels needs of them (transformers, rich, nvidia-ml-py: about what
# the H200 image has; no gguf, no bitsandbytes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.2.0 3.4.0 3.6.0)
tests=${MATRIX_TESTS:-tests/kernels}
root=.cache/triton-matrix
mkdir -p "$root"
declare -A result
for v in "${versions[@]}"; do
  venv="$root/triton-$v"
  want="torch==2.13.0 numpy<2.3 pytest hypothesis rich transformers accelerate nvidia-ml-py triton==$v"
  if [ "$(cat "$venv/.requirements" 2>/dev/null)" != "$want" ]; then
    echo "triton-matrix: creating $venv"
    rm -rf "$venv"
    # numpy < 2.3: the interpreter of Triton <= 3.6 turns 1-element arrays into Python ints, which
    # newer numpy refuses ("only 0-dimensional arrays can be converted to Python scalars").
    if ! { "$PY" -m venv "$venv" &&
           "$venv/bin/python" -m pip -q install $want &&
           "$venv/bin/python" -m pip -q install --no-deps -e . &&
           echo "$want" > "$venv/.requirements"; }; then
      echo "triton-matrix: could not install triton $v (see above)"
      rm -rf "$venv"  # retried on the next run
      result[$v]="FAIL (install)"
      continue
    fi
  fi
  echo "triton-matrix: triton $v"
  if "$venv/bin/pytest" -q -p no:cacheprovider $tests -W ignore::DeprecationWarning 2>&1 | tail -n 3; then
    # (pipefail: pytest's status counts, not tail's)
    result[$v]=pass
  else
    result[$v]=FAIL
  fi
done
echo
echo "triton-matrix summary ($(date -u '+%Y-%m-%d %H:%M UTC'), $(uname -m), $(nproc) cores, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), tests: $tests):"
status=0
for v in "${versions[@]}"; do
  echo "  triton $v: ${result[$v]:-FAIL}"
  [ "${result[$v]:-FAIL}" = pass ] || status=1
done
exit $status
