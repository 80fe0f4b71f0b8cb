"""Launcher of cpu_attention.c: paged decode attention (one query row per request) on the CPU.

Built at first use by cpu_build.py; `load(isa, cache_dir)` returns None, with the reason in
`load_error(isa)`, where there is no compiler or the build fails: callers keep torch's path.
The kernel reads K/V through the block table in the cache's own dtype (fp32, fp16, bf16, int8 and fp8
with per-token scales); `supported()` says whether a call fits it.
"""

from __future__ import annotations

import ctypes

import torch

from kvcli_kernels.cpu_build import build, build_error

_SOURCE = "cpu_attention.c"
MAX_HEAD_DIM = 256  # cpu_attention.c MAX_D
MAX_GROUP = 16  # cpu_attention.c MAX_G
FP8_UNIT = 256.0  # the kernel reads fp8 codes as fp16 holding code / 256 (as torch_backend.py does)
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3, torch.float8_e4m3fn: 4}

_i64, _f32, _i32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p


class _Args(ctypes.Structure):
    """cpu_attention.c's kva_args, field for field."""

    _fields_ = [("q", _ptr), ("out", _ptr), ("q_row", _i64), ("out_row", _i64),
                ("k", _ptr), ("v", _ptr),
                ("k_sh", _i64), ("k_sb", _i64), ("k_st", _i64), ("v_sh", _i64), ("v_sb", _i64), ("v_st", _i64),
                ("ks", _ptr), ("vs", _ptr),
                ("ks_sh", _i64), ("ks_sb", _i64), ("ks_st", _i64), ("vs_sh", _i64), ("vs_sb", _i64), ("vs_st", _i64),
                ("tables", _ptr), ("t_row", _i64), ("lens", _ptr), ("reqs", _ptr), ("rows", _ptr),
                ("n", _i64), ("heads", _i64), ("kv_heads", _i64), ("d", _i64), ("block_size", _i64), ("window", _i64),
                ("scale", _f32), ("v_unit", _f32),
                ("dtype", _i32), ("tables64", _i32), ("lens64", _i32), ("nthreads", _i32)]


def load(isa: str, cache_dir: str) -> ctypes.CDLL | None:
    """The built library with its function signature declared, or None (see load_error)."""
    lib = build(_SOURCE, isa, cache_dir)
    if lib is not None and not hasattr(lib, "_kva_declared"):
        lib.kva_decode.argtypes = [ctypes.POINTER(_Args)]
        lib.kva_decode.restype = ctypes.c_int
        lib._kva_declared = True
    return lib


def load_error(isa: str) -> str | None:
    return build_error(_SOURCE, isa)


def supported(q: torch.Tensor, k_heads: torch.Tensor) -> bool:
    """Whether the kernel takes fp32 queries q [tokens, heads, D] over storage k_heads [kvh, blocks, bs, D]
    (LayerKV.heads form: fp8 as uint8 bytes is not enough to tell, so pass the cache's dtype view)."""
    kvh, d = k_heads.shape[0], k_heads.shape[-1]
    return (q.device.type == "cpu" and k_heads.device.type == "cpu" and q.dtype == torch.float32
            and k_heads.dtype in DTYPE_CODES and d == q.shape[-1] and d % 8 == 0 and d <= MAX_HEAD_DIM
            and q.shape[1] % kvh == 0 and q.shape[1] // kvh <= MAX_GROUP
            and q.stride(-1) == 1 and q.stride(1) == d and k_heads.stride(-1) == 1)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_heads: torch.Tensor, v_heads: torch.Tensor,
                     block_tables: torch.Tensor, lens: torch.Tensor, scale: float, window: int = 0,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, reqs: torch.Tensor | None = None,
                     rows: torch.Tensor | None = None, nthreads: int | None = None) -> torch.Tensor:
    """Attention of the decode rows of q (fp32 [tokens, heads, D]) over paged K/V.

    k_heads, v_heads: head-major storage [kv_heads, blocks, block_size, D] in the cache's dtype (fp8 as
    float8_e4m3fn, not its uint8 bytes); k_scale, v_scale: per-token fp32 scales [kv_heads, blocks,
    block_size] for int8 / fp8. block_tables int32/int64 [batch, max_blocks], lens int32/int64 [batch]:
    each request's context length, its query being the last position. reqs, rows (int64 [n], optional):
    the n decode requests' indices into block_tables / lens and their rows of q / out (default: request
    i is row i, n = len(lens)). window > 0: the query sees only the last `window` keys. Writes the rows
    of `out` (a new tensor like q when None) and returns it."""
    if out is None:
        out = torch.empty_like(q)
    d = q.shape[-1]
    assert supported(q, k_heads) and out.stride(-1) == 1 and out.stride(1) == d and out.dtype == torch.float32
    assert block_tables.dtype in (torch.int32, torch.int64) and lens.dtype in (torch.int32, torch.int64)
    assert block_tables.stride(-1) == 1 and lens.is_contiguous()
    for t in (reqs, rows):
        assert t is None or (t.dtype == torch.int64 and t.is_contiguous())
    n = lens.shape[0] if reqs is None else reqs.shape[0]
    quantized = k_scale is not None and v_scale is not None
    unit = FP8_UNIT if k_heads.dtype == torch.float8_e4m3fn else 1.0
    ks_st = _strides(k_scale) if quantized else (0, 0, 0)
    vs_st = _strides(v_scale) if quantized else (0, 0, 0)
    args = _Args(q.data_ptr(), out.data_ptr(), q.stride(0), out.stride(0),
                 k_heads.data_ptr(), v_heads.data_ptr(), *_strides(k_heads), *_strides(v_heads),
                 k_scale.data_ptr() if quantized else None, v_scale.data_ptr() if quantized else None,
                 *ks_st, *vs_st,
                 block_tables.data_ptr(), block_tables.stride(0), lens.data_ptr(),
                 None if reqs is None else reqs.data_ptr(), None if rows is None else rows.data_ptr(),
                 n, q.shape[1], k_heads.shape[0], d, k_heads.shape[2], window,
                 scale * unit if quantized else scale, unit,
                 DTYPE_CODES[k_heads.dtype], int(block_tables.dtype == torch.int64), int(lens.dtype == torch.int64),
                 torch.get_num_threads() if nthreads is None else nthreads)
    rc = lib.kva_decode(ctypes.byref(args))
    if rc == -1:
        raise MemoryError("cpu_attention: no memory for the work plan")
    if rc != 0:
        raise ValueError(f"cpu_attention: unsupported shape (q {tuple(q.shape)}, kv heads {k_heads.shape[0]})")
    return out
