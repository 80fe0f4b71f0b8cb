# The two commands from the README: `make run` (continue the bundled sample with the bundled model)
# and `make test`. Both set up .venv first (seconds when nothing changed).
VENV   := .venv
PY     := $(VENV)/bin/python
SAMPLE := samples/keepers-log.txt

.PHONY: setup run test test-fast conformance-deps bench bench-deps figures gpu-check triton-matrix clean

setup:
	@bash scripts/setup.sh

run: setup
	$(VENV)/bin/kvcli continue $(SAMPLE) --max-tokens 200 --temperature 0.8 --top-p 0.95 --seed 1

# The conformance suite (tests/conformance: kvcli against llama.cpp on tiny GGUFs) needs llama-cpp-python, and
# tests/test_llama_server.py llama.cpp's llama-server, tests/test_lm_eval.py lm-evaluation-harness; each is built
# once into a cache outside the clone (~5 min for each llama.cpp build on an idle 2-core machine, a minute or two
# for lm-eval; seconds when built); a failed build only skips those tests, saying why.
test: setup conformance-deps
	$(VENV)/bin/pytest -q -p no:cacheprovider

conformance-deps:
	-bash scripts/build_llama_cpp_python.sh
	-bash scripts/build_llama_server.sh
	-bash scripts/build_lm_eval.sh

test-fast: setup
	$(VENV)/bin/pytest -q -p no:cacheprovider -m "not slow"

# kvcli, transformers and llama.cpp in one run each: batch-1 prefill/decode at 512 and 4k tokens, then the
# 64-request trace. `make bench ISA=avx2` holds torch and llama.cpp to AVX2 on an AVX-512 machine.
ISA ?= native
bench: setup bench-deps
	$(PY) -m kvcli.bench $(if $(filter avx2,$(ISA)),cpu-avx2,cpu)
	$(PY) -m kvcli.bench $(if $(filter avx2,$(ISA)),throughput-avx2,throughput)

# llama.cpp for the comparison, built once per ISA into .cache/bench (never a kvcli dependency);
# a failed build only skips llama.cpp's rows.
bench-deps:
	-bash scripts/build_llama_cpp.sh $(ISA)

# Every figure in README.md and docs/benchmarks.md, each from one entry of the benchmark package
# (`python -m kvcli.bench --list`), raw output to docs/results/<figure>.txt (about an hour, idle machine;
# FIGURES="decode load" make figures for a subset).
figures: setup
	FIGURES="$(FIGURES)" bash scripts/figures.sh

# The plan (kernel variants, time budget) first, then the run: one capped process per section.
gpu-check:
	python3 scripts/gpu_check.py --dry-run
	python3 scripts/gpu_check.py --out gpu-check.md

# Kernel tests under older Triton releases (what a GPU user's torch pins); one venv each in .cache/.
triton-matrix:
	bash scripts/triton_matrix.sh

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
