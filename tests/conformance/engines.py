"""The two engines of the conformance suite on one GGUF: llama.cpp through its C API (llama_worker.py, run with
the python of the llama-cpp-python venv) and kvcli's paged engine, each giving the logits of every position of
a teacher-forced token sequence."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("llama_worker.py")


def llama_python() -> Path | None:
    """The llama-cpp-python venv's python, or None when it is not built."""
    out = subprocess.run(["bash", str(REPO / "scripts" / "build_llama_cpp_python.sh"), "--where"],
                         capture_output=True, text=True, check=True).stdout.strip()
    py = Path(out)
    return py if py.is_file() and (py.parent.parent / ".kvcli-built").is_file() else None


class LlamaCppError(RuntimeError):
    pass


def run_llama_cpp(py: Path, model: Path, tokens: list[int], texts: list[str] = (), greedy: int = 0,
                  tmp: Path | None = None, parse_special: bool = True) -> tuple[np.ndarray | None, dict]:
    """llama.cpp's logits for every position of `tokens` (float32 [n, vocab]), its greedy continuation and its
    tokenization of `texts` (special-token spellings parsed unless parse_special is false). Raises LlamaCppError
    with llama.cpp's own last line when it refuses the file."""
    logits_out = (tmp or model.parent) / f"{model.stem}.llama.npy"
    job = {"model": str(model), "tokens": list(tokens), "texts": list(texts), "greedy": greedy,
           "logits_out": str(logits_out), "threads": min(2, os.cpu_count() or 1), "parse_special": parse_special}
    p = subprocess.run([str(py), str(WORKER)], input=json.dumps(job), capture_output=True, text=True, timeout=300)
    if p.returncode:
        lines = [ln for ln in (p.stderr or "").splitlines() if ln.strip()]
        raise LlamaCppError(" | ".join(lines[-3:]) or f"exit {p.returncode}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    logits = None
    if tokens:
        logits = np.load(logits_out)
        logits_out.unlink()
    return logits, out


def kvcli_logits(model: Path, tokens: list[int], *, prefill_chunk: int = 48, decode_tail: int = 16,
                 greedy: int = 0, **options) -> tuple[np.ndarray, list[int]]:
    """kvcli's logits for every position of `tokens` (float32 [n, vocab]) through its paged engine: the first
    n - decode_tail tokens prefilled in chunks of `prefill_chunk` (ending mid-block), the rest as one-token
    decode steps (the one-call C decode where it runs), then `greedy` greedy tokens through the scheduler.
    `options`: EngineOptions fields (default: fp32 KV, block size 16, the default weight path)."""
    import torch

    from kvcli.config import SamplingParams
    from kvcli.llm import LLM
    from engine_steps import teacher_forced

    opts = {"kv_dtype": "fp32", "kv_budget": "64MiB", "block_size": 16, "max_num_batched_tokens": 512} | options
    llm = LLM(str(model), **opts)
    engine = llm.engine
    with torch.no_grad():
        logits = teacher_forced(engine, list(tokens), len(tokens) - decode_tail, prefill_chunk).float()
    gen: list[int] = []
    if greedy:
        res = llm.generate([list(tokens)], SamplingParams(max_tokens=greedy, temperature=0.0, ignore_eos=True))
        gen = list(res[0].token_ids)
    return logits.numpy(), gen


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| over the largest |want|: the suite's one measure (1e-3 for F32 files)."""
    return float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())
