#!/usr/bin/env bash
# Re-measure every figure quoted in README.md and docs/benchmarks.md, in one run, on this machine.
# Each figure's raw output goes to docs/results/<name>.txt, headed by the date, the machine line
# (CPU, vector ISA, torch kernel ISA) and the exact command, so a figure in the docs links to the log
# that printed it. Run it on an otherwise idle machine: timings shared with other work are not clean.
#   make figures                 # everything (about an hour on a 2-core CPU)
#   FIGURES="decode load" make figures   # a subset, by name
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
KVCLI=.venv/bin/kvcli
OUT=docs/results
mkdir -p "$OUT"
ALL="decode load continue throughput throughput-avx2 profile simulate live dashboard kv-dtype kv-decode kv-int4 cpu cpu-avx2 invariant spec"
WANT=" ${FIGURES:-$ALL} "

header() {  # name, command...
  local name=$1; shift
  local envs=() a
  if [ "${1:-}" = env ]; then  # `env K=V ... cmd`: the machine line under the command's settings
    for a in "${@:2}"; do case "$a" in *=*) envs+=("$a") ;; *) break ;; esac; done
  fi
  {
    echo "# $name — $(date -u '+%Y-%m-%d %H:%M UTC')"
    env "${envs[@]}" "$PY" -c 'from kvcli.bench.machine import machine_line; print(machine_line())'
    echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "command: $*"
    echo
  } > "$OUT/$name.txt"
}

run() {  # name, command...: header, then the command's stdout and stderr
  local name=$1; shift
  case "$WANT" in *" $name "*) ;; *) return 0 ;; esac
  echo "figures: $name" >&2
  header "$name" "$@"
  "$@" >> "$OUT/$name.txt" 2>&1 || echo "(exit status $?)" >> "$OUT/$name.txt"
}

export NO_COLOR=1 COLUMNS=120
run decode "$PY" scripts/bench_decode.py
run load "$PY" scripts/bench_load.py
run continue "$KVCLI" continue samples/keepers-log.txt -n 40 --no-live
run throughput "$PY" scripts/bench_throughput.py --workload alpaca --num-requests 64
run throughput-avx2 env ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 "$PY" scripts/bench_throughput.py \
  --workload alpaca --num-requests 64  # the same trace with torch, kvcli's C kernels and llama.cpp held to AVX2
run cpu "$PY" scripts/bench_cpu.py --repeats 2  # kvcli vs transformers vs llama.cpp, 512 and 4k, batch 1
run cpu-avx2 "$PY" scripts/bench_cpu.py --repeats 2 --isa avx2  # the same with torch and llama.cpp held to AVX2
run kv-dtype "$PY" scripts/bench_kv_dtype.py  # every --kv-dtype: perplexity, bytes, decode at 4k
run kv-decode "$PY" scripts/bench_kv_decode.py  # decode at 4k per --kv-dtype, interleaved rounds
run kv-int4 "$PY" scripts/probe_kv_int4.py  # what an int4 cache would cost in perplexity at 4k (not shipped)
run invariant "$PY" scripts/bench_invariant.py  # what --attention-backend invariant costs
run spec "$PY" scripts/bench_spec.py --repeats 2 --attention-backend invariant  # ~17 min: speculation
run profile "$KVCLI" profile --workload sharegpt --num-requests 64 --max-model-len 2048 --block-size 16 \
  --kv-budget 512MiB --compare contiguous --no-live --plot docs/profile-sharegpt-cpu.png
run simulate "$KVCLI" profile --model dummy:llama-2-13b --kv-budget 12GiB --workload sharegpt \
  --num-requests 1000 --simulate --compare contiguous --no-live
run live "$PY" scripts/bench_live_overhead.py

# The live view on a real terminal: tmux, 120 columns, captured while decode runs.
case "$WANT" in *" dashboard "*)
  if command -v tmux >/dev/null 2>&1; then
    echo "figures: dashboard" >&2
    header dashboard "tmux (120x50): $KVCLI continue samples/keepers-log.txt -n 300, captured 5 s into decode"
    tmux kill-session -t kvcli-figures 2>/dev/null
    tmux new-session -d -s kvcli-figures -x 120 -y 50 \
      "env -u NO_COLOR $KVCLI continue samples/keepers-log.txt -n 300 > /dev/null; sleep 30"
    for _ in $(seq 120); do  # wait (up to 4 min) until the prefill bar is gone and the dashboard is up
      sleep 2
      pane=$(tmux capture-pane -p -t kvcli-figures 2>/dev/null)
      case "$pane" in *"KV fragmentation"*) case "$pane" in *"prefill "*) ;; *) break ;; esac ;; esac
    done
    sleep 5
    tmux capture-pane -p -t kvcli-figures >> "$OUT/dashboard.txt"
    tmux kill-session -t kvcli-figures 2>/dev/null
  else
    echo "figures: dashboard skipped (no tmux)" >&2
  fi
;; esac
echo "figures: done; raw outputs in $OUT/" >&2
