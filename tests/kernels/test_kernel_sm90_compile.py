"""The kernels compile for real GPUs (sm_90 Hopper, one sm_80 case) without needing one.

The interpreter checks numerics but accepts code the compiler rejects and says nothing about
register spills or load vectorisation. aot_compile_check.py (run once, in a subprocess without
TRITON_INTERPRET) compiles exactly the launches the launchers would issue, specialised as
Triton's launcher would; here we assert on the results: every launch compiles and fits in the
target's shared memory, the hot sm_90 configurations do not spill (a missing ptxas skips them with
the reason, a failing one fails them: no count is never read as "no spills"), and KV / weight
loads are asynchronous (cp.async) or 16-byte wide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable; the Triton kernels cannot be tested")
pytest.importorskip("triton.backends.nvidia", reason="this triton has no NVIDIA backend to compile for")

SCRIPT = Path(__file__).with_name("aot_compile_check.py")
sys.path.insert(0, str(SCRIPT.parent))
from aot_compile_check import (  # noqa: E402
    ATTENTION_CASES,
    INT4_CASES,
    LINEAR_CASES,
    QUANT_ATTENTION_CASES,
    QUANT_CACHE_WRITE_CASES,
)

# Configurations a model runs hot on a GPU (16-bit KV / activations on sm_90): must not spill
# registers. The fp32 ones (gpu_check's correctness engine, 3xTF32) must compile and fit in shared
# memory; their spill counts are reported, not limited.
NO_SPILL = {cid for cid, c in ATTENTION_CASES.items() if c[4] != torch.float32 and c[6] == 90}
NO_SPILL |= {cid for cid, c in INT4_CASES.items() if c[2] != torch.float32}
NO_SPILL |= {cid for cid, c in LINEAR_CASES.items() if c[1] != torch.float32}
NO_SPILL |= {cid for cid, c in QUANT_ATTENTION_CASES.items() if c[6] == 90} | set(QUANT_CACHE_WRITE_CASES)


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    """Every case compiled, in two processes at once (each compile is one core's work; the script takes the case
    ids it runs): the cases split alternately, the two JSON reports merged."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    ids = [*ATTENTION_CASES, *INT4_CASES, *LINEAR_CASES, "cache-write-bf16", *QUANT_ATTENTION_CASES,
           *QUANT_CACHE_WRITE_CASES]
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), *ids[i::2]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for i in range(2)]
    merged: dict[str, Any] = {}
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            pytest.fail(f"aot_compile_check.py failed ({proc.returncode}):\n{err[-4000:]}")
        merged.update(json.loads(out.strip().splitlines()[-1]))
    assert set(merged) == set(ids), sorted(set(ids) ^ set(merged))
    return merged


def _check(results: dict[str, Any], cid: str) -> list[dict[str, Any]]:
    """Every launch compiled and fits in shared memory; hot cases have a spill count of 0."""
    res = results[cid]
    if isinstance(res, dict) and "error" in res:
        pytest.fail(f"{cid} does not compile:\n{res['error']}")
    assert res, f"{cid}: no launch recorded"
    for f in res:
        assert f["shared"] <= f["shared_limit"], (
            f"{cid}: {f['kernel']} needs {f['shared']} B of shared memory, over sm_{f['cc']}'s {f['shared_limit']} B")
    if cid in NO_SPILL:
        for f in res:
            if f["spill"] is None:  # no count is not "no spills"
                why = f"{cid}: no register/spill count for {f['kernel']}: ptxas {f['ptxas']}"
                if str(f["ptxas"]).startswith("missing"):
                    pytest.skip(why)
                pytest.fail(why)
            assert f["spill"] == 0, f"{cid}: {f['kernel']} spills {f['spill']} B on sm_{f['cc']}: {f}"
    return res


@pytest.mark.parametrize("cid", list(ATTENTION_CASES))
def test_paged_attention_compiles(results: dict[str, Any], cid: str) -> None:
    launches = _check(results, cid)
    splits, batch = ATTENTION_CASES[cid][5], ATTENTION_CASES[cid][7]
    assert [f["kernel"] for f in launches] == ["_paged_attention_kernel"] + (["_merge_kernel"] if splits > 1 else [])
    main = launches[0]
    assert main["batch_is_const"] == (batch == 1), main  # the batch-1 variant really was the one compiled
    kv_dtype = ATTENTION_CASES[cid][4]
    # 16-bit KV must take the native 16-bit tensor-core path on a GPU (fp32 upcast is interpreter-only).
    assert main["flags"]["COMPUTE_F32"] == (kv_dtype == torch.float32), main["flags"]
    if kv_dtype == torch.float32:
        assert main["flags"]["DOT_PRECISION"] == "tf32x3", main["flags"]
    assert main["mma"] > 0, f"{cid}: the score / PV products do not use tensor cores: {main}"
    assert main["cp_async"] > 0 or main["ld_v4"] > 0, f"{cid}: KV loads neither async nor vectorised: {main}"


@pytest.mark.parametrize("cid", list(INT4_CASES))
def test_int4_matmul_compiles(results: dict[str, Any], cid: str) -> None:
    launches = _check(results, cid)
    m, _, dtype = INT4_CASES[cid]
    for f in launches:
        if f["kernel"] != "_splitk_reduce_kernel":
            assert f["cp_async"] > 0 or f["ld_v4"] > 0, f"{cid}: weight loads neither async nor vectorised: {f}"
        if f["kernel"] == "_int4_gemm_kernel":
            assert m > 8 and f["flags"]["COMPUTE_F32"] == (dtype == torch.float32), f
        if f["kernel"] in ("_int4_gemv_kernel", "_int4_gemm_kernel") and f["i2f"] is not None:
            # Codes become floats by the 2**23 mantissa trick (int4_gemm._codes_f32), not I2F, which runs at a
            # quarter of the FMA rate or less: the first H200 run's GEMV had one I2F per weight, its bottleneck.
            assert f["i2f"] <= 4, f"{cid}: {f['i2f']} int-to-float conversions in {f['kernel']}"


@pytest.mark.parametrize("cid", list(LINEAR_CASES))
def test_engine_triton_linear_compiles(results: dict[str, Any], cid: str) -> None:
    """The engine's "triton" INT4 linear mode: qkv, o, gate_up and down of one layer."""
    launches = _check(results, cid)
    m = LINEAR_CASES[cid][2]
    main = [f for f in launches if f["kernel"] != "_splitk_reduce_kernel"]
    assert len(main) == 4, launches  # one matmul per linear
    assert {f["kernel"] for f in main} == {"_int4_gemv_kernel" if m <= 8 else "_int4_gemm_kernel"}


def test_cache_write_compiles(results: dict[str, Any]) -> None:
    (f,) = _check(results, "cache-write-bf16")
    assert f["ld_v4"] > 0 and f["spill"] == 0, f


@pytest.mark.parametrize("cid", list(QUANT_ATTENTION_CASES))
def test_quantized_paged_attention_compiles(results: dict[str, Any], cid: str) -> None:
    """int8 / e4m3 KV: codes converted to q's 16-bit dtype in registers, so the dots stay on tensor
    cores; no fp32 upcast on a GPU; no spills on sm_90 (checked in _check)."""
    launches = _check(results, cid)
    main = launches[0]
    assert main["kernel"] == "_paged_attention_kernel" and main["flags"]["QUANT"] is True, main
    assert main["flags"]["COMPUTE_F32"] is False, main["flags"]
    assert main["mma"] > 0, f"{cid}: the score / PV products do not use tensor cores: {main}"
    assert main["cp_async"] > 0 or main["ld_v4"] > 0, f"{cid}: KV loads neither async nor vectorised: {main}"


@pytest.mark.parametrize("cid", list(QUANT_CACHE_WRITE_CASES))
def test_quantized_cache_write_compiles(results: dict[str, Any], cid: str) -> None:
    (launch,) = _check(results, cid)
    assert launch["kernel"] == "_write_kv_cache_kernel" and launch["flags"]["QUANT"] in (1, 2), launch
