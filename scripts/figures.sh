#!/usr/bin/env bash
# Re-measure every figure quoted in README.md and docs/benchmarks.md, in one run, on this machine: one entry
# of the benchmark package per figure (`python -m kvcli.bench --list` names them and the file each writes).
# Each figure's raw output goes to docs/results/<figure>.txt, headed by the date, the machine line (CPU,
# vector ISA, torch kernel ISA), the load average and the exact command, so a figure in the docs links to the
# log that printed it. Run it on an otherwise idle machine: timings shared with other work are not clean.
#   make figures                          # every figure of make figures (about an hour on a 2-core CPU)
#   FIGURES="decode load" make figures    # a subset, by name
#   bash scripts/figures.sh decode load   # the same
set -uo pipefail
cd "$(dirname "$0")/.."
export NO_COLOR=1 COLUMNS=120 PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m kvcli.bench figures ${FIGURES:-} "$@"
