"""Paged attention in plain torch: the CPU path, and the behaviour the Triton backend must reproduce.

The pool is stored head-major (kvcache/kv_cache.py), so per request, K/V are read through the block
table as [kv_heads, L, head_dim] with unit-stride rows: a view of the storage when the table is a run
of consecutive blocks (the common case when a pool is fresh), otherwise one index_select on the
storage's block dim. When many requests decode in one step, their rows go through a few padded, masked
calls (one per group of similar context lengths) instead of one call each: per-call overhead
dominates at small contexts. Two shapes of work:
  decode (1 query token): the q heads that share a KV head are stacked as that head's query rows
      (grouped-query trick: no mask, no repeated K/V), and attention is two GEMMs per KV head,
      scores = q @ K^T and out = softmax(scores) @ V, read at near memory bandwidth over the views;
  prefill chunk (q_len tokens on top of a cached prefix): attention to the prefix (all visible, no
      mask, grouped like decode) and to the chunk itself (causal) are computed separately by the
      CPU flash kernel and merged with their log-sum-exps, which avoids a masked math-path SDPA.
Decode over an int8, fp8, fp16 or bf16 cache (fp32 queries) converts the request's K/V to fp32 in one
pass each into scratch buffers kept between layers and steps, then computes scores = (q @ K^T) *
k_scale per token and out = (softmax * v_scale) @ V with the scales folded in (no dequantized K/V
materialised; 16-bit caches have no scales). Batched decode rows gather their blocks with index_select
into reused buffers instead of advanced indexing. Prefill chunks over converted caches dequantize the
request's K/V into the same reused buffers (values identical to dequantize()), not into fresh tensors
per layer. Measured figures: docs/benchmarks.md ("KV cache formats", "kvcli vs transformers vs llama.cpp").
Sliding window (meta.sliding_window = w > 0): a request's keys are read from the first one its first
query row sees; the batched decode groups mask keys before p - w + 1; a chunk longer than the window
takes the masked SDPA path. Soft-capping (meta.softcap = c > 0, Gemma 2): every path computes the scores
itself (c * tanh(s / c) before the mask), the C decode kernel too; chunks skip SDPA and the C prefill kernel.
Native decode: where kvcli's C kernel builds (kvcli_kernels/cpu_attention.c; KVCLI_NATIVE=0 turns it
off), every decode row of the step goes through one call per layer instead of all of the above: it reads
each request's K/V through its block table in the cache's own dtype (fp32, fp16, bf16, int8 / fp8 with
their scales), once, with an online softmax, parallel over requests, KV heads and spans of long contexts.
The GEMMs and scratch conversions remain for prefill chunks, non-fp32 queries and unsupported shapes.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvcli.attention.base import AttentionMetadata
from kvcli.kvcache.kv_cache import LayerKV
from kvcli.kvcache.kv_dtype import dequantize, quantize
from kvcli.native import registry
from kvcli.native.scratch import scratch

if TYPE_CHECKING:
    from kvcli_kernels.cpu_attention import CacheView, DecodeStep

FP8_UNIT = 256.0  # _heads_f32 gives fp8 codes divided by this (2 ** (15 - 7), the exponent biases)
_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def native_attention() -> ctypes.CDLL | None:
    """The decode-attention kernel (built at first use), or None: see kvcli.native.registry.unavailable."""
    return registry.library("attention")


def native_prefill_attention() -> ctypes.CDLL | None:
    """The prefill-chunk attention kernel (kernels/cpu_prefill_attention.c; AVX2 + FMA builds), or None
    (KVCLI_NATIVE=0, no compiler, a plain C build: torch's flash attention instead)."""
    return registry.library("prefill_attention")


def native_rope_kv() -> ctypes.CDLL | None:
    """The rotary + KV-store kernel (kernels/cpu_rope_kv.c), or None (KVCLI_NATIVE=0, no compiler)."""
    return registry.library("rope_kv")


class TorchAttentionBackend:
    name = "torch"

    BATCH_DECODE_MIN = 4  # decode rows from this many requests on go through one batched call
    # Steps whose requests bring at most this many query rows each (speculative verification, 1 + k; short
    # prompts) may run whole in the one-call C decode, every row a decode query of its own length
    ROWS_STEP_MAX = 16
    SCRATCH_KEEP_BYTES = 64 << 20  # scratch buffers up to this size are kept between calls

    def __init__(self, native: bool = True) -> None:
        self.native = native  # decode rows through native_attention() where it loads (False: torch only)
        self._lib: ctypes.CDLL | None | bool = False  # native_attention(), looked up once (False: not yet)
        self._prefill_lib: ctypes.CDLL | None | bool = False  # native_prefill_attention(), likewise
        self._rope_kv_lib: ctypes.CDLL | None | bool = False  # native_rope_kv(), likewise
        self._native_meta: AttentionMetadata | None = None
        self._native_scale = 0.0
        self._native_heads = 0
        self._native_ids: set[int] = set()
        self._native_step: DecodeStep | None = None
        self._native_recent: list[tuple] = []  # the last few steps' arguments (see _native_decode_step)
        self._rows_recent: list[tuple] = []  # likewise for steps of several rows per request (_native_rows_step)
        self._native_views: dict[int, tuple[weakref.ref[LayerKV], tuple[torch.Tensor, ...], CacheView | None]] = {}
        self._meta: AttentionMetadata | None = None
        self._reads: dict[int, slice | torch.Tensor] = {}
        self._batch_meta: AttentionMetadata | None = None
        self._batches: list[tuple] = []

    def _scratch_buf(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A scratch tensor of `shape` from the shared pool (kvcli/native/scratch.py), reused by every layer
        and step (contents valid until the next call with the same name); kept when at most
        SCRATCH_KEEP_BYTES."""
        return scratch("attention:" + name, shape, dtype, device, keep_bytes=self.SCRATCH_KEEP_BYTES)

    def _heads_f32(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x [..., kvh, L, D] (any storage dtype, head-major) as fp32, contiguous, in a scratch buffer:
        one converting pass, so the two matmuls read unit-stride rows."""
        if x.dtype == torch.float8_e4m3fn:
            x = self._fp8_as_fp16_bits(x, name)
        return self._scratch_buf(name, tuple(x.shape), torch.float32, x.device).copy_(x)

    def _fp8_as_fp16_bits(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """e4m3fn codes -> fp16 holding code / 256, exactly: the sign bit moves from bit 7 to bit 15 and
        exponent+mantissa from bits 0-6 to 7-13, i.e. the same bits read with fp16's exponent bias (15)
        instead of e4m3's (7); subnormals map to subnormals. Codes never hold NaN (clamped on write).
        Callers fold FP8_UNIT (256) into the scales. ~7x faster here than torch's fp8 -> fp32 copy."""
        a = self._scratch_buf(name + "16a", tuple(x.shape), torch.int16, x.device).copy_(x.view(torch.uint8))
        b = self._scratch_buf(name + "16b", tuple(x.shape), torch.int16, x.device)
        torch.bitwise_and(a, 0x80, out=b).bitwise_left_shift_(8)
        a.bitwise_and_(0x7F).bitwise_left_shift_(7).bitwise_or_(b)
        return a.view(torch.float16)

    def _gather_codes(self, cache: torch.Tensor, tables: torch.Tensor, name: str) -> torch.Tensor:
        """Blocks `tables` [n, nblk] of a cache tensor indexed [blocks, bs, kvh(, D)] -> head-major
        [kvh, n, nblk * bs(, D)] in the cache's dtype: one index_select on the block dim of the
        head-major storage into a reused buffer (not advanced indexing, which allocates and walks a
        generic index kernel). float8 moves as its bytes."""
        heads = LayerKV.heads(cache)  # [kvh, blocks, bs(, D)]
        n, nblk = tables.shape
        kvh, bs, rest = heads.shape[0], heads.shape[2], tuple(heads.shape[3:])
        out = self._scratch_buf(name, (kvh, n * nblk, bs, *rest), heads.dtype, cache.device)
        torch.index_select(heads, 1, tables.reshape(-1), out=out)
        return out.view(cache.dtype).view(kvh, n, nblk * bs, *rest)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKV, meta: AttentionMetadata) -> None:
        slots = meta.slot_mapping
        kc = cache.k.flatten(0, 1)  # [slots, kvh, D]: a view for the head-major and token-major layouts
        vc = cache.v.flatten(0, 1)
        if bool((slots < 0).any()):
            keep = slots >= 0
            slots, key, value = slots[keep], key[keep], value[keep]
        if cache.k_scale is None or cache.v_scale is None:
            kc.index_copy_(0, slots, key.to(kc.dtype))
            vc.index_copy_(0, slots, value.to(vc.dtype))
            return
        # int8 / fp8: quantize on write, one scale per token and KV head stored beside the codes.
        for codes_cache, scale_cache, x in ((kc, cache.k_scale, key), (vc, cache.v_scale, value)):
            codes, scale = quantize(x, codes_cache.dtype)
            # index_copy_ has no float8 CPU kernel: move fp8 codes as their bytes.
            raw = torch.uint8 if codes.dtype == torch.float8_e4m3fn else codes.dtype
            codes_cache.view(raw).index_copy_(0, slots, codes.view(raw))
            scale_cache.flatten(0, 1).index_copy_(0, slots, scale.to(scale_cache.dtype))

    def rope_kv_writer(self, cos: torch.Tensor, sin_signed: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata, first: LayerKV, heads: int,
                       kv_heads: int) -> Callable[[torch.Tensor, LayerKV], torch.Tensor] | None:
        """For one forward: the rotary embedding of q and k and write_kv's store of k and v as one C call
        per layer (kvcli_kernels/cpu_rope_kv.c: the same values, bit for bit, without a dozen small torch
        ops per layer, ~1.5 ms of a ~10 ms SmolLM2 decode step on 2 cores). The callable takes a layer's
        fused q/k/v output (fp32 [T, (heads + 2 kv_heads) * D], rows contiguous) and its cache and returns
        q rotated, [T, heads, D]. cos / sin_signed: the rotary tables [positions, D] with the sign of
        rotate-half folded in (layers.Rotary). None where it does not apply (native kernels off or not
        built, a non-CPU cache, tables not fp32; `first`, any layer's cache, stands for all):
        the caller rotates and calls write_kv."""
        if not self.native or cos.dtype != torch.float32 or cos.device.type != "cpu":
            return None
        from kvcli_kernels.cpu_rope_kv import cache_supported, rope_kv

        if not cache_supported(first.k, first.v, first.k_scale, first.v_scale):
            return None
        if self._rope_kv_lib is False:
            self._rope_kv_lib = native_rope_kv()
        lib = self._rope_kv_lib
        if lib is None:
            return None
        pos = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()

        def write(qkv: torch.Tensor, cache: LayerKV) -> torch.Tensor:
            qkv = qkv if qkv.dtype == torch.float32 and qkv.stride(-1) == 1 else qkv.float().contiguous()
            return rope_kv(lib, qkv, heads, kv_heads, cos, sin_signed, pos, slots, cache.k, cache.v, cache.k_scale,
                           cache.v_scale)

        return write

    def _blocks(self, meta: AttentionMetadata, b: int, block_size: int) -> slice | torch.Tensor:
        """Request b's used blocks: a slice when they are consecutive ids (read as a view), else
        an index tensor (one gather). Worked out once per step, reused by every layer."""
        if meta is not self._meta:
            self._meta, self._reads = meta, {}
        if b not in self._reads:
            n = -(-meta.seq_lens_list[b] // block_size)
            ids = meta.block_tables[b, :n]
            first = int(ids[0])
            if int(ids[-1]) - first == n - 1 and bool((ids.diff() == 1).all()):
                self._reads[b] = slice(first, first + n)
            else:
                self._reads[b] = ids.long()
        return self._reads[b]

    @staticmethod
    def _take(cache: torch.Tensor, blocks: slice | torch.Tensor, lo: int, kv_len: int) -> torch.Tensor:
        """A request's positions [lo, kv_len) of a cache tensor indexed [blocks, bs, kvh(, D)], head-major
        [kvh, kv_len - lo(, D)]: a view for a run of consecutive blocks (each head's rows side by side in
        the head-major storage), else one index_select of the blocks."""
        heads = LayerKV.heads(cache)
        x = heads[:, blocks] if isinstance(blocks, slice) else heads.index_select(1, blocks)
        return x.flatten(1, 2)[:, lo:kv_len].view(cache.dtype)

    @classmethod
    def _read(cls, cache: torch.Tensor, scale: torch.Tensor | None, blocks: slice | torch.Tensor, kv_len: int,
              dtype: torch.dtype, lo: int = 0) -> torch.Tensor:
        """Request's K or V at positions [lo, kv_len) as `dtype` [kv_heads, kv_len - lo, D], dequantized
        when the cache is scaled."""
        x = cls._take(cache, blocks, lo, kv_len)
        s = None if scale is None else cls._take(scale, blocks, lo, kv_len)
        return dequantize(x, s, dtype)

    def _read_f32(self, cache: torch.Tensor, scale: torch.Tensor | None, blocks: slice | torch.Tensor, kv_len: int,
                  name: str, lo: int = 0) -> torch.Tensor:
        """Request's K or V at positions [lo, kv_len) as fp32 [kv_heads, kv_len - lo, D] (for prefill
        chunks), dequantized in place in a reused head-major scratch buffer: the same values as _read
        (codes * scale, one fp32 rounding;
        for fp8 (code / 256) * (scale * 256) is that same product), without a fresh tensor per layer."""
        x = self._heads_f32(self._take(cache, blocks, lo, kv_len), name)
        if scale is not None:
            s = self._take(scale, blocks, lo, kv_len).unsqueeze(-1)  # [kvh, L, 1]
            x.mul_(s * FP8_UNIT if cache.dtype == torch.float8_e4m3fn else s)
        return x

    def _decode_converted(self, q: torch.Tensor, cache: LayerKV, blocks: slice | torch.Tensor, kv_len: int,
                          scale: float, lo: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """One decode row q [H, D] over keys [lo, kv_len) of a 16-bit, int8 or fp8 cache: the request's K/V converted to
        fp32 head-major scratch buffers in one pass each, then two matmuls (scales folded in)."""
        kvh, d = cache.k.shape[2], cache.k.shape[3]
        k = self._heads_f32(self._take(cache.k, blocks, lo, kv_len), "k")  # [kvh, L, D]
        v = self._heads_f32(self._take(cache.v, blocks, lo, kv_len), "v")
        ks = vs = None
        if cache.k_scale is not None and cache.v_scale is not None:
            ks = self._take(cache.k_scale, blocks, lo, kv_len)  # [kvh, L]
            vs = self._take(cache.v_scale, blocks, lo, kv_len)
        unit = FP8_UNIT if cache.k.dtype == torch.float8_e4m3fn else 1.0
        return _attend_scaled(q.view(kvh, -1, d), k, v, ks, vs, scale, unit=unit, softcap=softcap).reshape(q.shape)

    def _decode_batches(self, meta: AttentionMetadata, block_size: int, device: torch.device) -> list[tuple]:
        """Per step: the decode requests grouped by similar context length (so padding to a group's
        longest context stays within 1.5x of the real work), each group as (request ids, query
        rows, padded block tables, key mask). Singletons stay on the per-request path."""
        if meta is not self._batch_meta:
            self._batch_meta, self._batches = meta, []
            dec = sorted(((meta.seq_lens_list[b], b) for b, n in enumerate(meta.query_lens_list) if n == 1),
                         reverse=True)
            if len(dec) >= self.BATCH_DECODE_MIN:
                starts = [0]
                for n in meta.query_lens_list:
                    starts.append(starts[-1] + n)
                groups: list[list[tuple[int, int]]] = [[]]
                for length, b in dec:
                    g = groups[-1]
                    if g and g[0][0] * (len(g) + 1) > 1.5 * (sum(x[0] for x in g) + length) + 64 * (len(g) + 1):
                        groups.append([])
                    groups[-1].append((length, b))
                for g in groups:
                    if len(g) < 2:
                        continue
                    lens = [x[0] for x in g]
                    ids = [x[1] for x in g]
                    nblk = -(-lens[0] // block_size)
                    idx = torch.tensor(ids, device=device)
                    tables = meta.block_tables.index_select(0, idx)[:, :nblk].long()
                    pos = torch.arange(nblk * block_size, device=device)
                    ends = torch.tensor(lens, device=device)[:, None]
                    mask = pos < ends
                    if meta.sliding_window:
                        mask &= pos >= ends - meta.sliding_window
                    rows = torch.tensor([starts[b] for b in ids], device=device)
                    self._batches.append((set(ids), rows, tables, mask[None, :, None, :]))  # [1, n, 1, L]
        return self._batches

    def _decode_native(self, q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata, scale: float,
                       out: torch.Tensor) -> set[int]:
        """Every decode row of the step (requests with one query token) in one kernel call, written into
        `out`; returns the requests done (none where the kernel is off or does not fit: torch's path)."""
        if not self.native or q.device.type != "cpu":
            return set()
        step = self._native_decode_step(meta, q.shape[1], scale)
        if step is None:
            return set()
        from kvcli_kernels.cpu_attention import query_supported, run

        lib = self._lib
        view = self._cache_view(cache)
        if view is None or not query_supported(q, step, view):
            return set()
        run(lib, step, view, q, out)
        return self._native_ids

    def _native_decode_step(self, meta: AttentionMetadata, heads: int, scale: float) -> DecodeStep | None:
        """The decode kernel's per-step arguments for the step's decode rows (requests with one query
        token), built once per step; None where there are none or the kernel does not load."""
        if self._lib is False:
            self._lib = native_attention()
        if self._lib is None:
            return None
        if meta is not self._native_meta or scale != self._native_scale or heads != self._native_heads:
            # A few recent steps' arguments, found by their metadata's identity: Gemma 3's sliding and global
            # layers alternate between two metadata of one step, which are not rebuilt at every switch.
            for entry in self._native_recent:
                if entry[0] is meta and entry[1] == scale and entry[2] == heads:
                    (self._native_meta, self._native_scale, self._native_heads, self._native_ids,
                     self._native_step) = entry
                    return self._native_step
            from kvcli_kernels.cpu_attention import DecodeStep

            starts = [0]
            for n in meta.query_lens_list:
                starts.append(starts[-1] + n)
            ids = [b for b, n in enumerate(meta.query_lens_list) if n == 1]
            self._native_meta, self._native_scale, self._native_heads = meta, scale, heads
            self._native_ids = set(ids)
            self._native_step = None
            if ids and meta.block_tables.device.type == "cpu" and meta.block_tables.stride(-1) == 1:
                self._native_step = DecodeStep(meta.block_tables, meta.seq_lens.contiguous(), heads, scale,
                                               meta.sliding_window, torch.tensor(ids, dtype=torch.int64),
                                               torch.tensor([starts[b] for b in ids], dtype=torch.int64),
                                               meta.softcap)
            self._native_recent = [*self._native_recent[-3:], (meta, scale, heads, self._native_ids, self._native_step)]
        return self._native_step

    def _native_rows_step(self, meta: AttentionMetadata, heads: int, scale: float, group: int) -> DecodeStep | None:
        """The decode kernel's arguments for a step whose requests bring several query rows each: row j of a
        request of n rows and L keys (its own K/V among them, written before attention) is a decode query
        over the first L - (n - 1 - j) keys, through the request's own block table: the causal mask of a
        chunk, row by row, and each row computed as a plain decode step would compute it (bit for bit where
        the kernel does not split a row's keys into spans for threads, under 256 keys: past that the spans
        follow the step's total work, so the merge order may differ from a 1-row step's). Without a sliding
        window a request's rows form one query group (at most MAX_UNIT_HEADS // group rows each): the kernel
        reads its K/V once for all of them instead of once per row. Cached per step like
        _native_decode_step; None where the kernel does not load."""
        if self._lib is False:
            self._lib = native_attention()
        if self._lib is None or meta.block_tables.device.type != "cpu":
            return None
        for entry in self._rows_recent:
            if entry[0] is meta and entry[1] == scale and entry[2] == heads:
                return entry[3]
        from kvcli_kernels.cpu_attention import MAX_UNIT_HEADS, DecodeStep

        req = torch.repeat_interleave(torch.arange(len(meta.query_lens_list)),
                                      torch.tensor(meta.query_lens_list))
        lens = torch.cat([torch.arange(length - n + 1, length + 1, dtype=torch.int64)
                          for n, length in zip(meta.query_lens_list, meta.seq_lens_list)])
        tables = meta.block_tables.index_select(0, req).contiguous()
        units = None
        if not meta.sliding_window:  # consecutive rows of a request: one work item per at most `most` rows
            most, sizes = max(1, MAX_UNIT_HEADS // group), []
            for n in meta.query_lens_list:
                for start in range(0, n, most):
                    k = min(most, n - start)
                    sizes += [k] + [0] * (k - 1)
            units = torch.tensor(sizes, dtype=torch.int64)
        step = DecodeStep(tables, lens, heads, scale, meta.sliding_window, softcap=meta.softcap, group=units)
        self._rows_recent = [*self._rows_recent[-3:], (meta, scale, heads, step)]
        return step

    def decode_graph_key(self, *args: object) -> None:
        """No CUDA graphs: a step loops over its requests on the host (the per-request lengths are read there)."""
        return None

    def native_decode_plan(self, meta: AttentionMetadata, caches: list[LayerKV], heads: int,
                           scale: float) -> tuple[DecodeStep, list[CacheView]] | None:
        """For a caller that runs whole decoder layers in C (kernels/cpu_decode_layers.c): the decode
        kernel's step arguments and every layer's cache view, when every request of the step decodes one
        token, or a few rows each (_native_rows_step: a speculative verification), and the kernel reads
        these caches (else None: the caller goes layer by layer through forward)."""
        lens = meta.query_lens_list
        if not self.native or not lens or any(n < 1 or n > self.ROWS_STEP_MAX for n in lens):
            return None
        if any(n != 1 for n in lens):
            step = self._native_rows_step(meta, heads, scale, heads // caches[0].k.shape[2])
        else:
            step = self._native_decode_step(meta, heads, scale)
        if step is None:
            return None
        views = [self._cache_view(c) for c in caches]
        return None if any(v is None for v in views) else (step, views)  # type: ignore[return-value]

    def _cache_view(self, cache: LayerKV) -> CacheView | None:
        """The kernel's view of a layer's pool (None: a format or shape it does not read, or a dtype whose loop
        does not build), built once per LayerKV rather than per step (~10 us of Python each); dropped when the
        LayerKV is, rebuilt if its tensors are replaced."""
        from kvcli_kernels.cpu_attention import CacheView, cache_supported, with_dtype

        key, tensors = id(cache), cache.tensors()
        entry = self._native_views.get(key)
        if (entry is not None and entry[0]() is cache and len(entry[1]) == len(tensors)
                and all(a is b for a, b in zip(entry[1], tensors))):
            return entry[2]
        # head-major storage [kvh, blocks, bs, ...] in the cache's own dtype (float8 kept as such)
        k, v = cache.k.movedim(2, 0), cache.v.movedim(2, 0)
        ks = None if cache.k_scale is None else cache.k_scale.movedim(2, 0)
        vs = None if cache.v_scale is None else cache.v_scale.movedim(2, 0)
        view = CacheView(k, v, ks, vs) if cache_supported(k, v, ks, vs) else None
        if view is not None and not (self._lib and with_dtype(self._lib, view.code)):
            view = None  # this dtype's loop did not build (its first need builds it): torch's path
        views = self._native_views
        views[key] = (weakref.ref(cache, lambda _, key=key: views.pop(key, None)), tensors, view)
        return view

    def _prefill_native(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        out: torch.Tensor) -> bool:
        """A chunk's causal attention (no window cut) by kvcli's C kernel where it runs (about 2x torch's
        flash attention for a chunk against itself, 1.04-1.4x after a prefix: scripts/bench_prefill_attention.py).
        False: not here (torch computes it)."""
        if not self.native or q.device.type != "cpu" or q.shape[0] < 2:
            return False
        if self._prefill_lib is False:
            self._prefill_lib = native_prefill_attention()
        lib = self._prefill_lib
        if lib is None:
            return False
        from kvcli_kernels.cpu_prefill_attention import prefill_attention, supported

        return supported(q, k, v) and out.stride(2) == 1 and out.stride(1) == q.shape[2] and \
            prefill_attention(lib, q, k, v, scale, out)

    def forward(self, q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = cache.k, cache.v
        bs = cache.block_size
        cap = meta.softcap
        out = torch.empty_like(q)
        batched = set(self._decode_native(q, cache, meta, scale, out))
        groups = [] if batched else self._decode_batches(meta, k_cache.shape[1], q.device)
        for ids, rows, tables, mask in groups:
            batched |= ids
            n, h, d = rows.shape[0], q.shape[1], q.shape[2]
            kvh = k_cache.shape[2]
            # Padded slots are masked; their contents are finite because the runner zeroes every
            # block on first use (masking alone would not hide NaN: NaN * 0 is NaN).
            # Head-major throughout ([kvh, n, ...]): the gathered K/V come out of the storage that way.
            qg = q.index_select(0, rows).reshape(n, kvh, h // kvh, d).transpose(0, 1)  # [kvh, n, g, D]
            kg = self._gather_codes(k_cache, tables, "gk")  # [kvh, n, L, D]
            vg = self._gather_codes(v_cache, tables, "gv")
            if k_cache.dtype == q.dtype:
                o = _attend_scaled(qg, kg, vg, None, None, scale, mask, softcap=cap)
            elif q.dtype == torch.float32:
                k, v = self._heads_f32(kg, "k"), self._heads_f32(vg, "v")
                ks = vs = None
                if cache.k_scale is not None and cache.v_scale is not None:
                    ks = self._gather_codes(cache.k_scale, tables, "gks")  # [kvh, n, L]
                    vs = self._gather_codes(cache.v_scale, tables, "gvs")
                unit = FP8_UNIT if k_cache.dtype == torch.float8_e4m3fn else 1.0
                o = _attend_scaled(qg, k, v, ks, vs, scale, mask, unit=unit, softcap=cap)
            else:
                k = dequantize(kg, None if cache.k_scale is None else self._gather_codes(cache.k_scale, tables, "gks"),
                               q.dtype)
                v = dequantize(vg, None if cache.v_scale is None else self._gather_codes(cache.v_scale, tables, "gvs"),
                               q.dtype)
                o = (_attend_scaled(qg, k, v, None, None, scale, mask, softcap=cap) if cap else
                     F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale))
            out.index_copy_(0, rows, o.transpose(0, 1).reshape(n, h, d))
        start = 0
        for b, (q_len, kv_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            if b in batched:
                start += q_len
                continue
            blocks = self._blocks(meta, b, bs)
            w = meta.sliding_window
            lo = max(0, kv_len - q_len - w + 1) if w else 0  # the first key the first row sees
            if q_len == 1 and k_cache.dtype != q.dtype and q.dtype == torch.float32:
                out[start] = self._decode_converted(q[start], cache, blocks, kv_len, scale, lo, cap)
                start += 1
                continue
            if k_cache.dtype != q.dtype and q.dtype == torch.float32:  # prefill chunk over a converted cache
                k = self._read_f32(k_cache, cache.k_scale, blocks, kv_len, "k", lo)
                v = self._read_f32(v_cache, cache.v_scale, blocks, kv_len, "v", lo)
            else:
                k = self._read(k_cache, cache.k_scale, blocks, kv_len, q.dtype, lo)
                v = self._read(v_cache, cache.v_scale, blocks, kv_len, q.dtype, lo)
            # kvcli's kernel has no window and no soft-cap: it takes chunks whose every row sees all keys before it.
            if not 0 < w < kv_len and not cap and self._prefill_native(q[start:start + q_len], k, v, scale, out[start:start + q_len]):
                start += q_len
                continue
            qb = q[start:start + q_len].transpose(0, 1)  # [H, q_len, D]
            out[start:start + q_len] = attend(qb, k, v, scale, w, cap).transpose(0, 1)
            start += q_len
        return out


def _attend_scaled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None,
                   v_scale: torch.Tensor | None, scale: float, mask: torch.Tensor | None = None,
                   unit: float = 1.0, softcap: float = 0.0) -> torch.Tensor:
    """Attention of q [..., kvh, g, D] over K/V given as fp32 [..., kvh, L, D] (codes of a quantized
    cache, or the values of a 16-bit one) and, when quantized, their per-token scales [..., kvh, L]:
    k_scale multiplies the score columns, v_scale the probabilities, so dequantized K/V are never
    materialised. mask [..., 1, 1, L] (True = visible) or None. unit: a power of two the codes were
    divided by (FP8_UNIT for fp8), multiplied back into the scales (exact). softcap > 0: scores become
    softcap * tanh(s / softcap) before the mask (Gemma 2)."""
    s = torch.matmul(q, k.transpose(-1, -2))  # [..., kvh, g, L]
    s.mul_(scale if k_scale is None else (k_scale * (scale * unit)).unsqueeze(-2))
    if softcap:
        s.div_(softcap).tanh_().mul_(softcap)
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    p = torch.softmax(s, -1)
    if v_scale is not None:
        p.mul_((v_scale * unit if unit != 1.0 else v_scale).unsqueeze(-2))
    return torch.matmul(p, v)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
           softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of q [H, q_len, D] whose rows are the last q_len positions of k/v [kvh, L, D];
    window > 0: the row at position p sees keys [p - window + 1, p] only (a decode row must be given
    only the keys it sees); softcap > 0: soft-capped scores (materialised: SDPA has no soft-cap)."""
    h, q_len, d = q.shape
    kvh, kv_len, _ = k.shape
    g = h // kvh
    if q_len == 1:  # two GEMMs over the head-major K/V (fewer ops than SDPA's math path for one row)
        return _attend_scaled(q.reshape(kvh, g, d), k, v, None, None, scale, softcap=softcap).reshape(h, 1, d)
    prefix = kv_len - q_len
    windowed = 0 < window < kv_len  # some row has keys outside its window
    if softcap:  # grouped rows [kvh, g, q_len, D] against [kvh, 1, L, D]; the mask [q_len, L] broadcasts
        qpos = torch.arange(prefix, kv_len, device=q.device).unsqueeze(1)
        kpos = torch.arange(kv_len, device=q.device).unsqueeze(0)
        mask = (kpos <= qpos) & (kpos > qpos - window) if windowed else kpos <= qpos
        return _attend_scaled(q.reshape(kvh, g, q_len, d), k.unsqueeze(1), v.unsqueeze(1), None, None, scale,
                              mask, softcap=softcap).reshape(h, q_len, d)
    if windowed or _flash_cpu is None or q.device.type != "cpu":
        qpos = torch.arange(prefix, kv_len, device=q.device).unsqueeze(1)
        kpos = torch.arange(kv_len, device=q.device).unsqueeze(0)
        mask = (kpos <= qpos) & (kpos > qpos - window) if windowed else kpos <= qpos
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    # The chunk against itself: causal, K/V repeated per q head (only q_len rows, cheap).
    kc = k[:, prefix:].repeat_interleave(g, 0).unsqueeze(0)
    vc = v[:, prefix:].repeat_interleave(g, 0).unsqueeze(0)
    o_self, lse_self = _flash_cpu(q.unsqueeze(0), kc, vc, is_causal=True, scale=scale)
    if prefix == 0:
        return o_self[0]
    # Every row sees the whole prefix: grouped rows, no mask, no repeat.
    qg = q.contiguous().view(1, kvh, g * q_len, d)
    o_pre, lse_pre = _flash_cpu(qg, k[:, :prefix].unsqueeze(0), v[:, :prefix].unsqueeze(0), scale=scale)
    o_pre = o_pre.reshape(1, h, q_len, d)
    lse_pre = lse_pre.reshape(1, h, q_len)
    m = torch.maximum(lse_pre, lse_self)
    w_pre = (lse_pre - m).exp().unsqueeze(-1)
    w_self = (lse_self - m).exp().unsqueeze(-1)
    return ((o_pre * w_pre + o_self * w_self) / (w_pre + w_self))[0]
