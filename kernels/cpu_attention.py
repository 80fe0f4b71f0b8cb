"""Launcher of cpu_attention.c: paged decode attention (one query row per request) on the CPU.

Built at first use by cpu_build.py; `load(isa, cache_dir)` returns None, with the reason in
`load_error(isa)`, where there is no compiler or the build fails: callers keep torch's path.
The kernel reads K/V through the block table in the cache's own dtype (fp32, fp16, bf16, int8 and fp8
with per-token scales). The loaded library holds fp16's loop (the CPU default); `run` (and
`with_dtype`, for callers that reach kva_decode from C) builds another dtype's on its first cache, as a
library of its own whose loop the first one calls: each dtype's loop is about a second of a machine's
first compile, which a first load waits for. A call has a per-step half (DecodeStep: requests, tables, lengths) and a
per-layer half (CacheView: the pool's tensors), each built once, so the per-layer `run` costs one
ctypes call; `decode_attention` does all three for one-off calls (tests, benchmarks).
"""

from __future__ import annotations

import ctypes

import torch

from kvcli_kernels import kv_formats
from kvcli_kernels.cpu_build import build, build_error, check_structs

_SOURCE = "cpu_attention.c"
MAX_HEAD_DIM = 256  # cpu_attention.c MAX_D
MAX_GROUP = 16  # cpu_attention.c MAX_G
MAX_UNIT_HEADS = 64  # cpu_attention.c MAX_QG: a query group's rows x the GQA group
FP8_UNIT = 256.0  # the kernel reads fp8 codes as fp16 holding code / 256 (as torch_backend.py does)
DTYPE_CODES = kv_formats.DTYPE_CODES  # cache storage dtype -> DT_* of cpu_attention.c (kv_formats.py)

_i64, _f32, _i32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p


class _Step(ctypes.Structure):
    """cpu_attention.c's kva_step, field for field."""

    _fields_ = [("tables", _ptr), ("t_row", _i64), ("lens", _ptr), ("reqs", _ptr), ("rows", _ptr), ("group", _ptr),
                ("n", _i64), ("heads", _i64), ("window", _i64), ("scale", _f32), ("softcap", _f32),
                ("tables64", _i32), ("lens64", _i32)]


class _Cache(ctypes.Structure):
    """cpu_attention.c's kva_cache, field for field."""

    _fields_ = [("k", _ptr), ("v", _ptr),
                ("k_sh", _i64), ("k_sb", _i64), ("k_st", _i64), ("v_sh", _i64), ("v_sb", _i64), ("v_st", _i64),
                ("ks", _ptr), ("vs", _ptr),
                ("ks_sh", _i64), ("ks_sb", _i64), ("ks_st", _i64), ("vs_sh", _i64), ("vs_sb", _i64), ("vs_st", _i64),
                ("kv_heads", _i64), ("d", _i64), ("block_size", _i64), ("unit", _f32), ("dtype", _i32)]


def load(isa: str, cache_dir: str) -> ctypes.CDLL | None:
    """The built library with its function signature declared, or None (see load_error)."""
    lib = build(_SOURCE, isa, cache_dir)
    if lib is not None and not hasattr(lib, "_kva_declared"):
        if check_structs(lib, _SOURCE, isa, "kva_struct_size", [_Step, _Cache]) is None:
            return None
        lib.kva_decode.argtypes = [ctypes.POINTER(_Step), ctypes.POINTER(_Cache), _ptr, _i64, _ptr, _i64, _i32]
        lib.kva_decode.restype = ctypes.c_int
        _declare_dtypes(lib)
        lib._kva_build = (isa, cache_dir)
        lib._kva_dtypes = {code for code in DTYPE_CODES.values() if lib.kva_dtypes() >> code & 1}
        lib._kva_loops = []  # the libraries holding the dtypes' loops added since (kept loaded)
        lib._kva_declared = True
    return lib


def _declare_dtypes(lib: ctypes.CDLL) -> None:
    lib.kva_span.argtypes, lib.kva_span.restype = [_i32], _ptr
    lib.kva_add_dtype.argtypes, lib.kva_add_dtype.restype = [_i32, _ptr], _i32
    lib.kva_dtypes.argtypes, lib.kva_dtypes.restype = [], _i32


def loop_defines(code: int) -> tuple[str, ...]:
    """The -D flags of the build holding dtype `code`'s loop alone."""
    return (f"-DKVA_DTYPES={1 << code}",)


def with_dtype(lib: ctypes.CDLL, code: int) -> bool:
    """Whether `lib` (from load) runs caches of dtype `code` (DT_*), building that dtype's loop on first need
    (its own library, -DKVA_DTYPES, linked into lib through kva_add_dtype). False where that build fails."""
    if code in lib._kva_dtypes:
        return True
    isa, cache_dir = lib._kva_build
    loop = build(_SOURCE, isa, cache_dir, loop_defines(code))
    if loop is None:
        return False
    _declare_dtypes(loop)
    if lib.kva_add_dtype(code, loop.kva_span(code)) != 0:
        return False
    lib._kva_loops.append(loop)
    lib._kva_dtypes.add(code)
    return True


def load_error(isa: str) -> str | None:
    return build_error(_SOURCE, isa)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


class DecodeStep:
    """The per-step half of a call: which requests decode, their block tables and context lengths (the
    query is each one's last position), the q heads, softmax scale and sliding window. Built once per
    step and run against every layer's CacheView; holds the tensors it points to.

    block_tables int32/int64 [batch, max_blocks], lens int32/int64 [batch]; reqs, rows (int64 [n],
    optional): the n decode requests' indices into block_tables / lens and their rows of q / out
    (default: request i is row i, n = len(lens)). window > 0: a query sees only the last `window` keys.
    softcap > 0: scores s become softcap * tanh(s / softcap) (Gemma 2's attention logit soft-capping).
    group (int64 [n], optional; no window): group[r] = k > 1 makes queries r .. r + k - 1 one work item,
    consecutive positions of one request (equal table rows, lengths L - k + 1 .. L) reading its K/V once for
    all k rows; 0 marks the queries a group covers; k x heads / kv_heads <= MAX_UNIT_HEADS."""

    def __init__(self, block_tables: torch.Tensor, lens: torch.Tensor, heads: int, scale: float, window: int = 0,
                 reqs: torch.Tensor | None = None, rows: torch.Tensor | None = None, softcap: float = 0.0,
                 group: torch.Tensor | None = None) -> None:
        assert block_tables.dtype in (torch.int32, torch.int64) and lens.dtype in (torch.int32, torch.int64)
        assert block_tables.device.type == "cpu" and block_tables.stride(-1) == 1 and lens.is_contiguous()
        for t in (reqs, rows, group):
            assert t is None or (t.dtype == torch.int64 and t.is_contiguous())
        assert group is None or window == 0
        self.heads = heads
        self._keep = (block_tables, lens, reqs, rows, group)
        self.args = _Step(block_tables.data_ptr(), block_tables.stride(0), lens.data_ptr(),
                          None if reqs is None else reqs.data_ptr(), None if rows is None else rows.data_ptr(),
                          None if group is None else group.data_ptr(),
                          lens.shape[0] if reqs is None else reqs.shape[0], heads, window, scale, softcap,
                          int(block_tables.dtype == torch.int64), int(lens.dtype == torch.int64))
        self.ref = ctypes.byref(self.args)


class CacheView:
    """The per-layer half: K/V storage [kv_heads, blocks, block_size, D] in the cache's dtype (head-major
    or not: strides are passed; fp8 as float8_e4m3fn, not LayerKV.heads' uint8 bytes) and, for int8 /
    fp8, the per-token fp32 scales [kv_heads, blocks, block_size]. Holds the tensors it points to."""

    def __init__(self, k_heads: torch.Tensor, v_heads: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        assert cache_supported(k_heads, v_heads, k_scale, v_scale)
        self.k_heads = k_heads
        self.code = DTYPE_CODES[k_heads.dtype]
        self._keep = (k_heads, v_heads, k_scale, v_scale)
        quantized = k_scale is not None and v_scale is not None
        self.args = _Cache(k_heads.data_ptr(), v_heads.data_ptr(), *_strides(k_heads), *_strides(v_heads),
                           k_scale.data_ptr() if quantized else None, v_scale.data_ptr() if quantized else None,
                           *(_strides(k_scale) if quantized else (0, 0, 0)),
                           *(_strides(v_scale) if quantized else (0, 0, 0)),
                           k_heads.shape[0], k_heads.shape[3], k_heads.shape[2],
                           FP8_UNIT if k_heads.dtype == torch.float8_e4m3fn else 1.0, self.code)
        self.ref = ctypes.byref(self.args)


def cache_supported(k_heads: torch.Tensor, v_heads: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> bool:
    """Whether the kernel reads this cache: a dtype it converts, head_dim a multiple of 8 within its
    buffers, unit-stride rows, scales exactly for int8 / fp8."""
    d = k_heads.shape[-1]
    quantized = k_heads.dtype in kv_formats.QUANTIZED
    return (k_heads.device.type == "cpu" and k_heads.dim() == 4 and k_heads.dtype in DTYPE_CODES
            and v_heads.dtype == k_heads.dtype and v_heads.shape == k_heads.shape
            and d % 8 == 0 and d <= MAX_HEAD_DIM and k_heads.stride(-1) == 1 and v_heads.stride(-1) == 1
            and ((k_scale is not None and v_scale is not None) == quantized)
            and all(s.dtype == torch.float32 and s.dim() == 3 for s in (k_scale, v_scale) if s is not None))


def query_supported(q: torch.Tensor, step: DecodeStep, cache: CacheView) -> bool:
    """Whether q (and an out like it) fits: fp32 [tokens, heads, D] on the CPU, each row's heads
    contiguous, a GQA group within the kernel's buffers."""
    kvh, d = cache.k_heads.shape[0], cache.k_heads.shape[3]
    return (q.dtype == torch.float32 and q.device.type == "cpu" and q.dim() == 3 and q.shape[1] == step.heads
            and q.shape[2] == d and q.stride(2) == 1 and q.stride(1) == d and step.heads % kvh == 0
            and step.heads // kvh <= MAX_GROUP)


def run(lib: ctypes.CDLL, step: DecodeStep, cache: CacheView, q: torch.Tensor, out: torch.Tensor,
        nthreads: int | None = None) -> torch.Tensor:
    """Writes the step's decode rows of `out` (fp32, laid out like q) from q, on torch's thread count
    unless given; the caller has checked query_supported (this is the per-layer call: no checks beyond
    the kernel's own)."""
    if not with_dtype(lib, cache.code):
        raise RuntimeError(f"cpu_attention: the loop for KV dtype {cache.k_heads.dtype} did not build: "
                           f"{build_error(_SOURCE, lib._kva_build[0])}")
    rc = lib.kva_decode(step.ref, cache.ref, q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0),
                        torch.get_num_threads() if nthreads is None else nthreads)
    if rc == -1:
        raise MemoryError("cpu_attention: no memory for the work plan")
    if rc != 0:
        raise ValueError(f"cpu_attention: unsupported shape (q {tuple(q.shape)}, cache {tuple(cache.k_heads.shape)})")
    return out


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_heads: torch.Tensor, v_heads: torch.Tensor,
                     block_tables: torch.Tensor, lens: torch.Tensor, scale: float, window: int = 0,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, reqs: torch.Tensor | None = None,
                     rows: torch.Tensor | None = None, nthreads: int | None = None,
                     softcap: float = 0.0, group: torch.Tensor | None = None) -> torch.Tensor:
    """One call (DecodeStep, CacheView and run together): attention of the decode rows of q (fp32
    [tokens, heads, D]) over paged K/V, written into `out` (a new tensor like q when None)."""
    step = DecodeStep(block_tables, lens, q.shape[1], scale, window, reqs, rows, softcap, group)
    cache = CacheView(k_heads, v_heads, k_scale, v_scale)
    out = torch.empty_like(q) if out is None else out
    assert query_supported(q, step, cache) and out.dtype == torch.float32 and out.shape == q.shape
    assert out.stride(2) == 1 and out.stride(1) == q.shape[2]
    return run(lib, step, cache, q, out, nthreads)
