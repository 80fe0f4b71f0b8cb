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
    torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv",
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


SpecKey = tuple


def specialise(fn: Any, args: tuple, kwargs: dict) -> tuple[dict[str, Any], dict[str, str], dict, dict, dict]:
    """(options, signature, constexprs, attrs, values) as Triton's launcher would specialise the call."""
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    names = fn.arg_names
    values = dict(zip(names, args))
    values.update(kwargs)
    signature: dict[str, str] = {}
    constexprs: dict = {}
    attrs: dict = {}
    for i, name in enumerate(names):
        v = values[name]
        if i in fn.constexprs or isinstance(v, (str, bool)) or v is None:
            signature[name] = "constexpr"
            constexprs[(i,)] = v
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + _TORCH_TO_TRITON[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are >= 16-byte aligned
        elif isinstance(v, int):
            if v == 1:  # Triton turns an int argument equal to 1 into a constant
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
    return options, signature, constexprs, attrs, values


def spec_key(fn: Any, args: tuple, kwargs: dict, cc: int = 90) -> SpecKey:
    """Identifies one compiled variant: launches with equal keys share one compile (and cache entry)."""
    options, signature, constexprs, attrs, _ = specialise(fn, args, kwargs)
    return (fn.__name__, cc, tuple(sorted(options.items())), tuple(signature.items()),
            tuple(sorted((k, repr(v)) for k, v in constexprs.items())), tuple(sorted(attrs)))


# sm_90 (H100/H200) and sm_80 (A100): the most dynamic shared memory one block may opt into.
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
_COMPILED: dict[SpecKey, dict[str, Any]] = {}  # one compile per variant across all cases


def compile_launch(fn: Any, args: tuple, kwargs: dict, cc: int) -> dict[str, Any]:
    key = spec_key(fn, args, kwargs, cc)
    if key not in _COMPILED:
        _COMPILED[key] = _compile(fn, args, kwargs, cc)
    return _COMPILED[key]


def _compile(fn: Any, args: tuple, kwargs: dict, cc: int) -> dict[str, Any]:
    options, signature, constexprs, attrs, values = specialise(fn, args, kwargs)
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
        shared_limit=SHARED_LIMIT[cc],
        regs=None,
        spill=None,
        i2f=None,  # int-to-float conversions in the SASS (cuobjdump), None where it cannot be read
        ptxas=None,  # why there is no spill count, when there is none
        options=options,
        flags={k: v for k, v in values.items() if k in ("COMPUTE_F32", "SPLIT", "SPLIT_K", "DOT_PRECISION", "QUANT")},
        batch_is_const=values.get("batch") == 1,
    )
    tools = [p for p in (_NVBIN / "ptxas-blackwell", _NVBIN / "ptxas") if p.exists()]
    if not tools:
        facts["ptxas"] = f"missing: no ptxas in {_NVBIN}"
    for ptxas in tools:  # the one matching triton's PTX version
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "k.ptx"
            path.write_text(ptx)
            arch = f"sm_{cc}a" if cc == 90 else f"sm_{cc}"
            cubin = Path(tmp) / "k.cubin"
            r = subprocess.run([str(ptxas), "-v", f"-arch={arch}", str(path), "-o", str(cubin)],
                               capture_output=True, text=True)
            if r.returncode == 0 and (_NVBIN / "cuobjdump").exists():
                sass = subprocess.run([str(_NVBIN / "cuobjdump"), "--dump-sass", str(cubin)], capture_output=True,
                                      text=True).stdout
                facts["i2f"] = len(re.findall(r"\bI2F(?:\.|\s)", sass)) if sass else None
        out = r.stdout + r.stderr
        if r.returncode != 0:
            facts["ptxas"] = f"failed: {ptxas.name} exit {r.returncode}: {out.strip()[-500:]}"
            continue
        spill = re.search(r"(\d+) bytes spill stores", out)
        regs = re.search(r"Used (\d+) registers", out)
        if spill is None or regs is None:
            facts["ptxas"] = f"failed: no register/spill line in {ptxas.name} -v output: {out.strip()[-500:]}"
            continue
        facts.update(spill=int(spill.group(1)), regs=int(regs.group(1)), ptxas=None)
        break
    return facts


# --------------------------------------------------------------------------------------------- cases

# id -> (q_len, group, head_dim, block_size, dtype, num_splits, cc, batch). batch 1 matters: Triton
# turns the int 1 into a constant that feeds the request-finding loop (a separate compile).
ATTENTION_CASES: dict[str, tuple] = {
    "decode-llama8b-bf16": (1, 4, 128, 16, torch.bfloat16, 1, 90, 2),
    "decode-llama8b-bf16-batch1": (1, 4, 128, 16, torch.bfloat16, 1, 90, 1),
    "decode-llama8b-bf16-split8": (1, 4, 128, 16, torch.bfloat16, 8, 90, 2),
    "decode-llama8b-bf16-batch1-split33": (1, 4, 128, 16, torch.bfloat16, 33, 90, 1),
    "decode-g8-bs64-fp16": (1, 8, 128, 64, torch.float16, 1, 90, 2),
    "decode-mha-d64-fp16": (1, 1, 64, 32, torch.float16, 1, 90, 2),
    "prefill-llama8b-bf16": (300, 4, 128, 16, torch.bfloat16, 1, 90, 2),
    "prefill-llama8b-bf16-batch1": (300, 4, 128, 16, torch.bfloat16, 1, 90, 1),
    "prefill-g3-d80-fp16-split2": (300, 3, 80, 16, torch.float16, 2, 90, 2),
    "decode-fp32-kv": (1, 4, 128, 16, torch.float32, 1, 90, 2),
    "prefill-fp32-kv-tf32x3": (300, 4, 128, 16, torch.float32, 1, 90, 2),
    # gpu_check section (d)'s fp32 correctness engine: smollm2 shapes, chunks of 256, batch 1 and 4.
    "engine-smollm2-fp32-prefill-batch1": (256, 3, 64, 16, torch.float32, 1, 90, 1),
    "engine-smollm2-fp32-decode": (1, 3, 64, 16, torch.float32, 1, 90, 4),
    "decode-fp16-sm80": (1, 4, 128, 16, torch.float16, 1, 80, 2),
    # Every page size the engine accepts with head_dim 64 / 128 / 256, decode and prefill.
    **{f"{kind}-p{bs}-d{d}-bf16": (ql, 4, d, bs, torch.bfloat16, 1, 90, 2)
       for kind, ql in (("decode", 1), ("prefill", 300)) for bs in (8, 16, 32, 64, 128) for d in (64, 128, 256)},
}
# Quantized KV (int8 / e4m3 codes + fp32 scales per token and KV head): id -> ATTENTION_CASES' fields
# (dtype = q's) + the cache's storage dtype. fp8 only on sm_90 (the launchers refuse it below 8.9).
QUANT_ATTENTION_CASES: dict[str, tuple] = {
    "decode-llama8b-bf16-int8": (1, 4, 128, 16, torch.bfloat16, 1, 90, 2, torch.int8),
    "decode-llama8b-bf16-int8-split8": (1, 4, 128, 16, torch.bfloat16, 8, 90, 2, torch.int8),
    "prefill-llama8b-bf16-int8": (300, 4, 128, 16, torch.bfloat16, 1, 90, 2, torch.int8),
    "decode-llama8b-bf16-fp8": (1, 4, 128, 16, torch.bfloat16, 1, 90, 2, torch.float8_e4m3fn),
    "prefill-llama8b-bf16-fp8": (300, 4, 128, 16, torch.bfloat16, 1, 90, 2, torch.float8_e4m3fn),
    "decode-fp16-int8-sm80": (1, 4, 128, 16, torch.float16, 1, 80, 2, torch.int8),
}
# id -> (K/V dtype, cache storage dtype, cc)
QUANT_CACHE_WRITE_CASES: dict[str, tuple] = {
    "cache-write-bf16-int8": (torch.bfloat16, torch.int8, 90),
    "cache-write-bf16-fp8": (torch.bfloat16, torch.float8_e4m3fn, 90),
    "cache-write-fp16-int8-sm80": (torch.float16, torch.int8, 80),
}
# id -> (M, group size, x dtype); N = K = 4096
INT4_CASES: dict[str, tuple[int, int, torch.dtype]] = {
    **{f"int4-m{m}": (m, 32, torch.float16) for m in (1, 2, 8, 16, 64, 200)},
    "int4-m64-g128": (64, 128, torch.float16),
    "int4-m200-g128": (200, 128, torch.float16),
    "int4-m1-bf16": (1, 32, torch.bfloat16),
    "int4-m200-bf16": (200, 32, torch.bfloat16),
    "int4-m1-fp32": (1, 32, torch.float32),  # fp32 GEMV
    "int4-m200-fp32-tf32x3": (200, 32, torch.float32),  # fp32 GEMM: 3xTF32 dots
}
# The engine's "triton" INT4 linear mode (kvcli.model.layers.Linear) on a model's linear shapes:
# id -> (preset, x dtype, M). llama-3-8b in bf16 (section d's speed part), smollm2 in fp32 (its
# correctness part); M = 1 decode, 64 a decode batch, 256 / 512 prefill chunks.
LINEAR_CASES: dict[str, tuple[str, torch.dtype, int]] = {
    **{f"linear-llama8b-bf16-m{m}": ("llama-3-8b", torch.bfloat16, m) for m in (1, 64, 512)},
    **{f"linear-smollm2-fp32-m{m}": ("smollm2-135m", torch.float32, m) for m in (1, 4, 256)},
}


def attention_case(pa: ModuleType, case: tuple) -> list[dict[str, Any]]:
    q_len, group, head_dim, block_size, dtype, splits, cc, batch = case
    kv_heads = 8 if group <= 4 else 1
    q = torch.zeros(q_len * batch, kv_heads * group, head_dim, dtype=dtype)
    cache = torch.zeros(64, block_size, kv_heads, head_dim, dtype=dtype)
    cu = torch.arange(batch + 1, dtype=torch.int32) * q_len
    sl = torch.full((batch,), q_len + 100, dtype=torch.int32)
    bt = torch.zeros(batch, 32, dtype=torch.int32)
    launches = record(pa, ["_paged_attention_kernel", "_merge_kernel"], lambda: pa.paged_attention(
        q, cache, cache, cu, sl, bt, 0.1, q_len, q_len + 100, num_splits=splits))
    return [compile_launch(fn, a, k, cc) for fn, a, k in launches]


def quant_attention_case(pa: ModuleType, case: tuple) -> list[dict[str, Any]]:
    q_len, group, head_dim, block_size, dtype, splits, cc, batch, storage = case
    kv_heads = 8 if group <= 4 else 1
    q = torch.zeros(q_len * batch, kv_heads * group, head_dim, dtype=dtype)
    cache = torch.zeros(64, block_size, kv_heads, head_dim).to(storage)
    scale = torch.zeros(64, block_size, kv_heads)
    cu = torch.arange(batch + 1, dtype=torch.int32) * q_len
    sl = torch.full((batch,), q_len + 100, dtype=torch.int32)
    bt = torch.zeros(batch, 32, dtype=torch.int32)
    launches = record(pa, ["_paged_attention_kernel", "_merge_kernel"], lambda: pa.paged_attention(
        q, cache, cache, cu, sl, bt, 0.1, q_len, q_len + 100, num_splits=splits, k_scale=scale, v_scale=scale))
    return [compile_launch(fn, a, k, cc) for fn, a, k in launches]


def int4_case(ig: ModuleType, m: int, g: int, dtype: torch.dtype) -> list[dict[str, Any]]:
    n, k = 4096, 4096
    x = torch.zeros(m, k, dtype=dtype)
    codes = torch.zeros(n, k // 2, dtype=torch.uint8)
    scale = torch.zeros(n, k // g, dtype=torch.float16)
    launches = record(ig, ["_int4_gemv_kernel", "_int4_gemm_kernel", "_splitk_reduce_kernel"],
                      lambda: ig.int4_matmul(x, codes, scale, scale, g))
    return [compile_launch(fn, a, kw, 90) for fn, a, kw in launches]


def linear_case(ig: ModuleType, preset: str, dtype: torch.dtype, m: int) -> list[dict[str, Any]]:
    """Every INT4 linear of one decoder layer, built and called as the engine does (mode "triton")."""
    from kvcli.config import PRESETS
    from kvcli.model.layers import planned_linear as Linear
    from kvcli.model.quant import QuantTensor

    c = PRESETS[preset]
    h, inter = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    shapes = [(d * (c["num_attention_heads"] + 2 * c["num_key_value_heads"]), h),  # qkv (fused)
              (h, d * c["num_attention_heads"]), (2 * inter, h), (h, inter)]  # o, gate_up (fused), down
    saved = sys.modules.get("kvcli_kernels.int4_gemm")
    sys.modules["kvcli_kernels.int4_gemm"] = ig  # Linear imports the launcher from here at call time
    launches: list[tuple[Any, tuple, dict]] = []
    try:
        for n, k in shapes:
            q = QuantTensor("q4", torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 32, dtype=torch.float16),
                            torch.zeros(n, k // 32, dtype=torch.float16), 32)
            lin = Linear(q, None, "triton", dtype)
            assert lin.mode == "triton", lin.mode
            x = torch.zeros(m, k, dtype=dtype)
            launches += record(ig, ["_int4_gemv_kernel", "_int4_gemm_kernel", "_splitk_reduce_kernel"], lambda: lin(x))
    finally:
        if saved is None:
            sys.modules.pop("kvcli_kernels.int4_gemm", None)
        else:
            sys.modules["kvcli_kernels.int4_gemm"] = saved
    return [compile_launch(fn, a, kw, 90) for fn, a, kw in launches]


def cache_write_case(cw: ModuleType) -> list[dict[str, Any]]:
    key = torch.zeros(5, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    slots = torch.arange(5, dtype=torch.int64)
    launches = record(cw, ["_write_kv_cache_kernel"], lambda: cw.write_kv_cache(key, key, cache, cache, slots))
    return [compile_launch(fn, a, k, 90) for fn, a, k in launches]


def quant_cache_write_case(cw: ModuleType, dtype: torch.dtype, storage: torch.dtype, cc: int) -> list[dict[str, Any]]:
    key = torch.zeros(5, 8, 128, dtype=dtype)
    cache = torch.zeros(4, 16, 8, 128).to(storage)
    scale = torch.zeros(4, 16, 8)
    slots = torch.arange(5, dtype=torch.int64)
    launches = record(cw, ["_write_kv_cache_kernel"],
                      lambda: cw.write_kv_cache(key, key, cache, cache, slots, scale, scale))
    return [compile_launch(fn, a, k, cc) for fn, a, k in launches]


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("aot_compile_check: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    only = set(sys.argv[1:])  # optional case ids (default: all)
    pa, ig, cw = _load("paged_attention"), _load("int4_gemm"), _load("cache_write")
    jobs: dict[str, Callable[[], list[dict[str, Any]]]] = {}
    for cid, case in ATTENTION_CASES.items():
        jobs[cid] = lambda case=case: attention_case(pa, case)
    for cid, (m, g, dt) in INT4_CASES.items():
        jobs[cid] = lambda m=m, g=g, dt=dt: int4_case(ig, m, g, dt)
    for cid, (preset, dt, m) in LINEAR_CASES.items():
        jobs[cid] = lambda preset=preset, dt=dt, m=m: linear_case(ig, preset, dt, m)
    jobs["cache-write-bf16"] = lambda: cache_write_case(cw)
    for cid, case in QUANT_ATTENTION_CASES.items():
        jobs[cid] = lambda case=case: quant_attention_case(pa, case)
    for cid, (dt, st, cc) in QUANT_CACHE_WRITE_CASES.items():
        jobs[cid] = lambda dt=dt, st=st, cc=cc: quant_cache_write_case(cw, dt, st, cc)
    results: dict[str, Any] = {}
    for cid, job in jobs.items():
        if only and cid not in only:
            continue
        try:
            results[cid] = job()
        except Exception:  # noqa: BLE001 - reported per case to the test
            results[cid] = {"error": traceback.format_exc(limit=20)}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
