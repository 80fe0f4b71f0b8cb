"""The conformance suite's fixture: llama.cpp (llama-cpp-python, in the venv that scripts/build_llama_cpp_python.sh
builds outside the clone; `make test` builds it first). The engines themselves: engines.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines import llama_python


@pytest.fixture(scope="session")
def llama_cpp() -> Path:
    py = llama_python()
    if py is None:
        pytest.skip("llama-cpp-python is not built (bash scripts/build_llama_cpp_python.sh; make test runs it)")
    return py
