"""The kernels compile for real GPUs (sm_90 Hopper, one sm_80 case) without needing one.

The interpreter checks numerics but accepts code the compiler rejects and says nothing about
register spills or load vectorisation. aot_compile_check.py (run once, in a subprocess without
TRITON_INTERPRET) compiles exactly the launches the launchers would issue, specialised as
Triton's launcher would; here we assert on the results: every launch compiles, the hot sm_90
configurations do not spill, and KV / weight loads are asynchronous (cp.async) or 16-byte wide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton", reason="triton is not importable; the Triton kernels cannot be tested")
pytest.importorskip("triton.backends.nvidia", reason="this triton has no NVIDIA backend to compile for")

SCRIPT = Path(__file__).with_name("aot_compile_check.py")
sys.path.insert(0, str(SCRIPT.parent))
from aot_compile_check import ATTENTION_CASES, INT4_CASES  # noqa: E402

# Configurations that a model actually runs hot on Hopper: must not spill registers.
NO_SPILL = {"decode-llama8b-bf16", "decode-llama8b-bf16-split8", "decode-g8-bs64-fp16", "decode-mha-d64-fp16",
            "prefill-llama8b-bf16", *INT4_CASES}


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"aot_compile_check.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(results: dict[str, Any], cid: str) -> list[dict[str, Any]]:
    res = results[cid]
    if isinstance(res, dict) and "error" in res:
        pytest.fail(f"{cid} does not compile:\n{res['error']}")
    assert res, f"{cid}: no launch recorded"
    return res


@pytest.mark.parametrize("cid", list(ATTENTION_CASES))
def test_paged_attention_compiles(results: dict[str, Any], cid: str) -> None:
    launches = _check(results, cid)
    splits = ATTENTION_CASES[cid][5]
    assert [f["kernel"] for f in launches] == ["_paged_attention_kernel"] + (["_merge_kernel"] if splits > 1 else [])
    main = launches[0]
    kv_dtype = ATTENTION_CASES[cid][4]
    # 16-bit KV must take the native 16-bit tensor-core path on a GPU (fp32 upcast is interpreter-only).
    assert main["flags"]["COMPUTE_F32"] == (str(kv_dtype) == "torch.float32"), main["flags"]
    assert main["mma"] > 0, f"{cid}: the score / PV products do not use tensor cores: {main}"
    assert main["cp_async"] > 0 or main["ld_v4"] > 0, f"{cid}: KV loads neither async nor vectorised: {main}"
    if cid in NO_SPILL:
        for f in launches:
            assert f["spill"] in (0, None), f"{cid}: {f['kernel']} spills on sm_{f['cc']}: {f}"


@pytest.mark.parametrize("cid", list(INT4_CASES))
def test_int4_matmul_compiles(results: dict[str, Any], cid: str) -> None:
    launches = _check(results, cid)
    for f in launches:
        if f["kernel"] != "_splitk_reduce_kernel":
            assert f["cp_async"] > 0 or f["ld_v4"] > 0, f"{cid}: weight loads neither async nor vectorised: {f}"
        assert f["spill"] in (0, None), f"{cid}: {f['kernel']} spills on sm_90: {f}"


def test_cache_write_compiles(results: dict[str, Any]) -> None:
    (f,) = _check(results, "cache-write-bf16")
    assert f["ld_v4"] > 0 and f["spill"] in (0, None), f
