"""Ahead-of-time compile of the kernels for CUDA targets, with no GPU present.

Run as a script (by test_kernel_sm90_compile.py) in a process *without* TRITON_INTERPRET: under
the interpreter even triton's own library functions (tl.cdiv, reductions) are interpreted objects
and cannot be compiled. Prints one JSON object: case id -> list of per-launch facts or an error.

Each launcher runs on CPU tensors with its kernels swapped for a recorder; every recorded launch
is specialised the way Triton's launcher would (ints equal to 1 become constexpr, 16-divisible
ints and 16-byte aligned pointers get divisibility hints) and compiled with triton.compile for a
CUDA target, then the PTX is re-assembled by the bundled ptxas with -v for spill counts.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
_NVBIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_TORCH_TO_TRITON = {
    torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
    torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
}
H200_SMS = 132


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_aot_{name}", KERNELS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    mod._num_sms = lambda device: H200_SMS  # plan split-K as on an H200
    return mod


class _Recorder:
    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((args, kwargs))

        return launch


def record(mod: ModuleType, kernel_names: list[str], call: Callable[[], Any]) -> list[tuple[Any, tuple, dict]]:
    recorders = {n: _Recorder(getattr(mod, n)) for n in kernel_names}
    saved = {n: getattr(mod, n) for n in kernel_names}
    try:
        for n, r in recorders.items():
            setattr(mod, n, r)
        call()
    finally:
        for n, f in saved.items():
            setattr(mod, n, f)
    return [(r.fn, a, k) for r in recorders.values() for a, k in r.launches]


# triton < 3.4 (3.2 ships with torch 2.6) names constants by parameter name, leaves them out of the
# signature, and takes its specialisation hints as the backend's AttrsDescriptor.
_LEGACY_AST_SOURCE = "constexprs" not in inspect.signature(ASTSource.__init__).parameters


def _legacy_source(fn: Any, values: dict[str, Any], signature: dict[str, str], constexprs: dict) -> Any:
    from triton.compiler import make_backend

    names = fn.arg_names
    const_names = {names[i]: v for (i,), v in constexprs.items()}
    attrs = make_backend(GPUTarget("cuda", 90, 32)).get_attrs_descriptor(fn.params, tuple(values[n] for n in names))
    sig = {n: t for n, t in signature.items() if t != "constexpr"}
    return ASTSource(fn, sig, const_names, attrs)


def compile_launch(fn: Any, args: tuple, kwargs: dict, cc: int) -> dict[str, Any]:
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    names = fn.arg_names
    values = dict(zip(names, args))
    values.update(kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        v = values[name]
        if i in fn.constexprs or isinstance(v, (str, bool)) or v is None:
            signature[name] = "constexpr"
            constexprs[(i,)] = v
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + _TORCH_TO_TRITON[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are >= 16-byte aligned
        elif isinstance(v, int):
            if v == 1:
                signature[name] = "constexpr"
                constexprs[(i,)] = 1
            else:
                signature[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: {type(v)}")
    if _LEGACY_AST_SOURCE:
        src = _legacy_source(fn, values, signature, constexprs)
    else:
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
    ptx = compiled.asm["ptx"]
    facts: dict[str, Any] = dict(
        kernel=fn.__name__,
        cc=cc,
        cp_async=len(re.findall(r"cp\.async\.c[ag]", ptx)),
        ld_v4=ptx.count("ld.global.v4"),
        mma=ptx.count("mma.sync") + ptx.count("wgmma.mma_async"),
        shared=compiled.metadata.shared,
        regs=None,
        spill=None,
        options=options,
        flags={k: v for k, v in kwargs.items() if k in ("COMPUTE_F32", "SPLIT", "SPLIT_K", "DOT_PRECISION")},
    )
    for ptxas in (_NVBIN / "ptxas-blackwell", _NVBIN / "ptxas"):  # the one matching triton's PTX version
        if not ptxas.exists():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "k.ptx"
            path.write_text(ptx)
            arch = f"sm_{cc}a" if cc == 90 else f"sm_{cc}"
            r = subprocess.run([str(ptxas), "-v", f"-arch={arch}", str(path), "-o", os.devnull],
                               capture_output=True, text=True)
        if r.returncode == 0:
            out = r.stdout + r.stderr
            spill = re.search(r"(\d+) bytes spill stores", out)
            regs = re.search(r"Used (\d+) registers", out)
            facts["spill"] = int(spill.group(1)) if spill else None
            facts["regs"] = int(regs.group(1)) if regs else None
            break
    return facts


# --------------------------------------------------------------------------------------------- cases

# id -> (q_len, group, head_dim, block_size, dtype, num_splits, cc)
ATTENTION_CASES: dict[str, tuple] = {
    "decode-llama8b-bf16": (1, 4, 128, 16, torch.bfloat16, 1, 90),
    "decode-llama8b-bf16-split8": (1, 4, 128, 16, torch.bfloat16, 8, 90),
    "decode-g8-bs64-fp16": (1, 8, 128, 64, torch.float16, 1, 90),
    "decode-mha-d64-fp16": (1, 1, 64, 32, torch.float16, 1, 90),
    "prefill-llama8b-bf16": (300, 4, 128, 16, torch.bfloat16, 1, 90),
    "prefill-g3-d80-fp16-split2": (300, 3, 80, 16, torch.float16, 2, 90),
    "decode-fp32-kv": (1, 4, 128, 16, torch.float32, 1, 90),
    "decode-fp16-sm80": (1, 4, 128, 16, torch.float16, 1, 80),
}
# id -> (M, group size); N = K = 4096
INT4_CASES: dict[str, tuple[int, int]] = {
    **{f"int4-m{m}": (m, 32) for m in (1, 2, 8, 16, 64, 200)},
    "int4-m64-g128": (64, 128),
    "int4-m200-g128": (200, 128),
}


def attention_case(pa: ModuleType, case: tuple) -> list[dict[str, Any]]:
    q_len, group, head_dim, block_size, dtype, splits, cc = case
    kv_heads = 8 if group <= 4 else 1
    q = torch.zeros(q_len * 2, kv_heads * group, head_dim, dtype=dtype)
    cache = torch.zeros(64, block_size, kv_heads, head_dim, dtype=dtype)
    cu = torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32)
    sl = torch.tensor([q_len + 100, q_len + 5], dtype=torch.int32)
    bt = torch.zeros(2, 32, dtype=torch.int32)
    launches = record(pa, ["_paged_attention_kernel", "_merge_kernel"], lambda: pa.paged_attention(
        q, cache, cache, cu, sl, bt, 0.1, q_len, q_len + 100, num_splits=splits))
    return [compile_launch(fn, a, k, cc) for fn, a, k in launches]


def int4_case(ig: ModuleType, m: int, g: int) -> list[dict[str, Any]]:
    n, k = 4096, 4096
    x = torch.zeros(m, k, dtype=torch.float16)
    codes = torch.zeros(n, k // 2, dtype=torch.uint8)
    scale = torch.zeros(n, k // g, dtype=torch.float16)
    launches = record(ig, ["_int4_gemv_kernel", "_int4_gemm_kernel", "_splitk_reduce_kernel"],
                      lambda: ig.int4_matmul(x, codes, scale, scale, g))
    return [compile_launch(fn, a, kw, 90) for fn, a, kw in launches]


def cache_write_case(cw: ModuleType) -> list[dict[str, Any]]:
    key = torch.zeros(5, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    slots = torch.arange(5, dtype=torch.int64)
    launches = record(cw, ["_write_kv_cache_kernel"], lambda: cw.write_kv_cache(key, key, cache, cache, slots))
    return [compile_launch(fn, a, k, 90) for fn, a, k in launches]


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("aot_compile_check: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    pa, ig, cw = _load("paged_attention"), _load("int4_gemm"), _load("cache_write")
    jobs: dict[str, Callable[[], list[dict[str, Any]]]] = {}
    for cid, case in ATTENTION_CASES.items():
        jobs[cid] = lambda case=case: attention_case(pa, case)
    for cid, (m, g) in INT4_CASES.items():
        jobs[cid] = lambda m=m, g=g: int4_case(ig, m, g)
    jobs["cache-write-bf16"] = lambda: cache_write_case(cw)
    results: dict[str, Any] = {}
    for cid, job in jobs.items():
        try:
            results[cid] = job()
        except Exception:  # noqa: BLE001 - reported per case to the test
            results[cid] = {"error": traceback.format_exc(limit=20)}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
