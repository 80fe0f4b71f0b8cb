#!/usr/bin/env bash
# lm-evaluation-harness in its own venv OUTSIDE the clone, for python -m kvcli.bench lm-eval and
# tests/test_lm_eval.py (lm-eval's local-completions on kvcli serve against its hf backend). Never a kvcli
# dependency. Its torch and transformers are kvcli's: the check appends kvcli's site-packages to this venv's
# path at run time (nothing here pins the clone's location).
#   scripts/build_lm_eval.sh          # build if missing; seconds when built
#   scripts/build_lm_eval.sh --where  # print the venv's python path (built or not), build nothing
# Where: ${KVCLI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcli}/lm-eval/<version>/
# Env: LM_EVAL_VERSION (0.4.13), PYTHON (interpreter for the venv).
set -euo pipefail
VERSION=${LM_EVAL_VERSION:-0.4.13}
CACHE=${KVCLI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcli}
DEST="$CACHE/lm-eval/$VERSION"
PYBIN="$DEST/bin/python"
STAMP="$DEST/.kvcli-built"
if [ "${1:-}" = "--where" ]; then echo "$PYBIN"; exit 0; fi
ready() { [ -f "$STAMP" ] && [ -x "$PYBIN" ]; }
if ready; then echo "build_lm_eval: lm-eval $VERSION ready: $PYBIN ($(cat "$STAMP"))"; exit 0; fi
mkdir -p "$CACHE/lm-eval"
exec 9>"$CACHE/lm-eval/.lock-$VERSION"
if command -v flock >/dev/null; then flock 9; fi
if ready; then echo "build_lm_eval: lm-eval $VERSION ready: $PYBIN ($(cat "$STAMP"))"; exit 0; fi
rm -rf "$DEST"; "${PYTHON:-python3}" -m venv "$DEST"
echo "build_lm_eval: installing lm-eval[api]==$VERSION into $DEST (a minute or two; log in $DEST/build.log)"
start=$(date +%s)
if ! "$PYBIN" -m pip install -q "lm-eval[api]==$VERSION" >"$DEST/build.log" 2>&1; then
  echo "build_lm_eval: install failed; see $DEST/build.log (tail below)" >&2; tail -5 "$DEST/build.log" >&2; exit 4
fi
secs=$(( $(date +%s) - start ))
echo "installed $(date -u +%Y-%m-%dT%H:%MZ) in ${secs}s" >"$STAMP"
echo "build_lm_eval: lm-eval $VERSION ready: $PYBIN (installed in ${secs}s)"
