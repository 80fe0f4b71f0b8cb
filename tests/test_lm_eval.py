"""lm-evaluation-harness against `kvcli serve` (issue #31, item 5): lm-eval's local-completions client (token
ids, echo with logprobs) on kvcli serve and lm-eval's own hf backend agree on every item's log-likelihood
within 1e-3, on the bundled model's float32 folder (kvcli/bench/lm_eval_check.py; the figure with 24 items is
docs/results/lm-eval.txt). lm-eval runs from its own venv outside the clone (scripts/build_lm_eval.sh, which
`make test` runs first); without it this skips, naming the path."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcli.bench.lm_eval_check import lm_eval_python

PY = lm_eval_python()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not PY.is_file(), reason=f"lm-eval is not installed at {PY}; "
                                                                             "run scripts/build_lm_eval.sh")]


def test_lm_eval_loglikelihoods_on_kvcli_serve_equal_its_hf_backend():
    r = subprocess.run([sys.executable, "-m", "kvcli.bench", "lm-eval", "--items", "6"], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "-> met" in r.stdout and "over 24 (item, choice) pairs" in r.stdout, r.stdout
