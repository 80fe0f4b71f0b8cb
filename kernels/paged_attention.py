"""Causal attention over a paged KV cache for mixed prefill/decode batches.

Inputs (see kvcli/attention/base.py for the cache layout):
  q            : [num_tokens, num_q_heads, head_dim]; request b owns rows [cu_seqlens_q[b], cu_seqlens_q[b+1])
  k/v_cache    : [num_blocks, block_size, num_kv_heads, head_dim]
  seq_lens     : [batch] KV length of request b *including* this step's tokens (already in the cache)
  block_tables : [batch, max_blocks] physical block ids
  k/v_scale    : int8 / float8_e4m3fn caches only: [num_blocks, block_size, num_kv_heads] fp32, one
                 scale per token and KV head (kvcli.kvcache.kv_dtype)
Query row i of request b sits at absolute position seq_lens[b] - q_len + i and sees keys 0..that position;
with a sliding window w (window > 0) only keys [position - w + 1, position].

Main kernel, grid (num_q_blocks, num_kv_heads, num_splits):
  * A program owns BLOCK_Q consecutive query tokens of one request times all GROUP = q_heads/kv_heads
    query heads that share one KV head, i.e. a BLOCK_M = BLOCK_Q * GROUP (padded) row tile. Each
    K/V tile is therefore read once for the whole GQA group and used by one tl.dot (M >= 16).
  * q-blocks of all requests are numbered globally without a host-side table: request b owns
    q-blocks [cu[b] // BLOCK_Q + b, ...), which needs at most num_tokens // BLOCK_Q + batch
    programs; a program finds its request by binary search over cu_seqlens_q and surplus
    programs exit at once. Decode (1 row) and prefill chunks (many rows) share one launch.
  * KV is walked in tiles of BLOCK_N tokens (a multiple of the page size), gathering physical block
    ids from the block table; online softmax in the exp2 domain, fp32 statistics and accumulator.
    With a sliding window the walk starts at the tile holding the first key the program's first row
    sees (earlier tiles are skipped, not read), and keys before each row's window are masked.
  * All pool offsets are int64 (block id * block stride exceeds 2^31 on large pools).
Quantized KV (int8 or e4m3 codes + per-token scales) is dequantized in registers, never in memory:
the codes of a K tile are converted to the compute dtype (exact: |code| <= 127 fits fp16/bf16, e4m3
embeds in both) and the key scales are folded into the score columns after the dot (s = (q @ codes)
* k_scale); a V tile is multiplied by its scales before the P @ V dot (folding them into P instead
would push P * scale into fp16's subnormal range for small scales).
Split-K ("flash decoding"): when too few (request, kv-head) programs exist to fill the GPU, the
KV range of every program is cut into num_splits segments (grid axis 2); each writes unnormalised
(max, sum, acc) partials in fp32 and _merge_kernel combines them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvcli_kernels.cache_write import check_cache_format

__all__ = ["paged_attention", "auto_num_splits", "decode_num_splits", "choose_num_splits", "attention_launch_config"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
MAX_SPLITS = 64
# A split below this many KV tokens costs more in partial traffic + merge than it gains.
MIN_TOKENS_PER_SPLIT = 256


@triton.jit
def _find_request(cu_seqlens_q_ptr, q_block_id, batch, BLOCK_Q: tl.constexpr):
    """Largest b with cu[b] // BLOCK_Q + b <= q_block_id (those starts strictly increase in b)."""
    lo = 0
    hi = batch
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if start <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    k_scale_ptr,  # QUANT only: [num_blocks, block_size, kv_heads] fp32
    v_scale_ptr,
    out_ptr,  # [T, Hq, D] final output (SPLIT=False)
    part_acc_ptr,  # [T, Hq, S, D] fp32 (SPLIT=True)
    part_ml_ptr,  # [T, Hq, S, 2] fp32 running max (log2 domain) and sum (SPLIT=True)
    qk_scale,  # softmax scale * log2(e)
    batch,
    num_splits,
    window,  # sliding window (keys [pos - window + 1, pos]); the launcher passes 2**30 for none
    softcap,  # SOFTCAP only: the cap times log2(e) (scores in the log2 domain stay c * tanh(s / c))
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ksb,
    stride_kst,
    stride_ksh,
    stride_vsb,
    stride_vst,
    stride_vsh,
    stride_btb,
    stride_btn,
    stride_ot,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    BLOCK_SIZE: tl.constexpr,  # page size
    BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q tokens x GROUP heads, padded to pow2 >= 16
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,  # KV tokens per iteration
    SPLIT: tl.constexpr,
    COMPUTE_F32: tl.constexpr,  # upcast tiles and run the dots in fp32 (fp32 KV, or bf16 in the interpreter)
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,  # int8 / e4m3 codes + fp32 scales; dots run in q's dtype (or fp32)
    SOFTCAP: tl.constexpr,  # Gemma 2's attention logit soft-capping: s = c * tanh(s / c) before the mask
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split_id = tl.program_id(2)

    b = _find_request(cu_seqlens_q_ptr, q_block_id, batch, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    q_block_local = q_block_id - (q_start // BLOCK_Q + b)
    if q_block_local * BLOCK_Q >= q_len:  # surplus program of the global numbering
        return
    seq_len = tl.load(seq_lens_ptr + b)
    context_len = seq_len - q_len  # tokens cached before this step

    # Row r of the tile = query token r // GROUP, query head kv_head * GROUP + r % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    tok_in_block = offs_m // GROUP
    q_tok = q_block_local * BLOCK_Q + tok_in_block
    row_valid = (tok_in_block < BLOCK_Q) & (q_tok < q_len)
    q_head = kv_head * GROUP + offs_m % GROUP
    q_pos = context_len + q_tok  # absolute position: sees keys 0..q_pos

    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    d64 = offs_d.to(tl.int64)

    q_row = (q_start + q_tok).to(tl.int64) * stride_qt + q_head.to(tl.int64) * stride_qh
    q = tl.load(
        q_ptr + q_row[:, None] + d64[None, :] * stride_qd,
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if COMPUTE_F32:
        q = q.to(tl.float32)
    elif not QUANT:
        q = q.to(k_cache_ptr.dtype.element_ty)

    # Keys this program needs: from the first key its first row sees to the last position among its rows.
    kv_end = tl.minimum(seq_len, context_len + (q_block_local + 1) * BLOCK_Q)
    kv_start = tl.maximum(context_len + q_block_local * BLOCK_Q - window + 1, 0)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    first_tile = kv_start // BLOCK_N
    if SPLIT:
        tiles_per_split = tl.cdiv(num_tiles - first_tile, num_splits)
        tile_lo = first_tile + split_id * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    else:
        tile_lo = first_tile
        tile_hi = num_tiles

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_btb
    k_head = kv_head.to(tl.int64) * stride_kh
    v_head = kv_head.to(tl.int64) * stride_vh
    ks_head = kv_head.to(tl.int64) * stride_ksh
    vs_head = kv_head.to(tl.int64) * stride_vsh
    offs_n_base = tl.arange(0, BLOCK_N)
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * BLOCK_N + offs_n_base
        n_valid = offs_n < kv_end
        # Page id per token: repeated ids (tokens of one page) hit in L1.
        phys = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_btn, mask=n_valid, other=0).to(tl.int64)
        slot_in_page = (offs_n % BLOCK_SIZE).to(tl.int64)
        k_off = phys * stride_kb + slot_in_page * stride_kt + k_head
        v_off = phys * stride_vb + slot_in_page * stride_vt + v_head

        # K is loaded transposed ([D, N]) so the score tile is a plain q @ k.
        k = tl.load(
            k_cache_ptr + k_off[None, :] + d64[:, None] * stride_kd,
            mask=n_valid[None, :] & d_valid[:, None],
            other=0.0,
        )
        if COMPUTE_F32 or QUANT:
            k = k.to(q.dtype)
        if QUANT:
            # Masked tokens get scale 0 (never a poisoned scale) and are then set to -inf below.
            k_s = tl.load(k_scale_ptr + phys * stride_ksb + slot_in_page * stride_kst + ks_head, mask=n_valid, other=0.0)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * (k_s * qk_scale)[None, :]
        else:
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:  # tanh(x) = 2 sigmoid(2x) - 1 (no tanh in every Triton backend)
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - window) & n_valid[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; subtract 0 instead to avoid inf - inf.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

        v = tl.load(
            v_cache_ptr + v_off[:, None] + d64[None, :] * stride_vd,
            mask=n_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        if QUANT:
            v_s = tl.load(v_scale_ptr + phys * stride_vsb + slot_in_page * stride_vst + vs_head, mask=n_valid, other=0.0)
            v = (v.to(tl.float32) * v_s[:, None]).to(q.dtype)
        elif COMPUTE_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)

    store_mask = row_valid[:, None] & d_valid[None, :]
    if SPLIT:
        # Unnormalised partials; empty segments write (-inf, 0, 0) which the merge weights to 0.
        row = ((q_start + q_tok).to(tl.int64) * (GROUP * tl.num_programs(1)) + q_head) * num_splits + split_id
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d64[None, :], acc, mask=store_mask)
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_valid)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # only padding rows can have l == 0
        out = acc / l_safe[:, None]
        o_row = (q_start + q_tok).to(tl.int64) * stride_ot + q_head.to(tl.int64) * stride_oh
        tl.store(
            out_ptr + o_row[:, None] + d64[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )


@triton.jit
def _merge_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    num_q_heads,
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """out[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the num_splits partials."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_valid = offs_s < num_splits
    row = (t * num_q_heads + h) * num_splits + offs_s
    m = tl.load(part_ml_ptr + row * 2, mask=s_valid, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=s_valid, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # empty segments (m = -inf) get weight 0
    denom = tl.sum(w * l, 0)
    acc = tl.load(
        part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_valid[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


# Kernels built for the Triton interpreter (TRITON_INTERPRET=1 at import time) cannot run bf16 dots.
_INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


def attention_launch_config(
    group: int, head_dim: int, block_size: int, max_seqlen_q: int, kv_dtype: torch.dtype, quant: bool = False
) -> dict[str, int]:
    """Tile sizes: BLOCK_M rows (= BLOCK_Q tokens x GROUP heads), BLOCK_N KV tokens per iteration.

    Decode-only batches use the smallest tensor-core tile (16 rows); batches with prefill rows use
    64 rows so each K/V tile is reused by more query tokens. BLOCK_N does not depend on the page size.
    """
    min_rows = 16 if max_seqlen_q <= 1 else 64
    block_m = max(min_rows, triton.next_power_of_2(group))
    block_q = max(1, block_m // group)
    block_d = triton.next_power_of_2(max(head_dim, 16))
    # 64 tokens of K and V per iteration (16 KiB each at D=128 fp16); fewer when fp32 or D=256.
    # The tile is independent of the page size: a page larger than the tile is walked in several
    # tiles (page 128 x D 256 in one tile needs ~288 KB of shared memory, over sm_90's 227 KB, and
    # page 128 x D 128 spills registers), a smaller one is gathered several pages per tile.
    block_n = 64 if block_d * (4 if kv_dtype == torch.float32 else 2) <= 256 else 32
    if quant and max_seqlen_q <= 1:
        # Quantized decode converts each V tile through fp32 (codes x scale): at 64 keys that tile alone is 64
        # registers a thread, and Triton 3.6 compiled the split kernel at 255 registers with a spill (the
        # 16-bit cache: 126), a quarter of the occupancy; the H200 measured it at 0.53-0.96x fp16's speed.
        block_n = 32
    wide = block_d >= 256 or kv_dtype == torch.float32  # more live registers per row
    num_warps = 8 if block_m >= 128 or (block_m >= 64 and wide) else 4
    num_stages = 3 if block_d <= 128 and kv_dtype != torch.float32 else 2
    return dict(BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_D=block_d, BLOCK_N=block_n,
                num_warps=num_warps, num_stages=num_stages)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:  # cached: launchers run per layer per step
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 1  # interpreter: nothing to fill


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int, block_n: int) -> int:
    """Split-K only when the (q-block, kv-head) programs are fewer than the SMs.

    Aim for ~2 programs per SM in total, but keep every split >= MIN_TOKENS_PER_SPLIT keys (and
    >= one tile) so the partial write + merge stays small next to the KV read.
    """
    if num_programs >= num_sms or max_seq_len <= 0:
        return 1
    want = triton.cdiv(2 * num_sms, max(num_programs, 1))
    useful = max_seq_len // max(MIN_TOKENS_PER_SPLIT, block_n)
    return max(1, min(want, useful, MAX_SPLITS))


def _tile_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype:
    """The dtype K/V tiles are computed in: the cache's, or q's for quantized caches (codes are converted)."""
    return k_cache.dtype if k_cache.dtype in _FLOAT_DTYPES else q.dtype


def auto_num_splits(q: torch.Tensor, k_cache: torch.Tensor, batch: int, max_seqlen_q: int, max_seq_len: int) -> int:
    """The split count paged_attention(num_splits=None) uses for these inputs."""
    num_tokens, num_q_heads, _ = q.shape
    return _auto_splits(num_tokens, num_q_heads, _tile_dtype(q, k_cache), k_cache, batch, max_seqlen_q, max_seq_len)


def decode_num_splits(batch: int, num_q_heads: int, q_dtype: torch.dtype, k_cache: torch.Tensor,
                      max_seq_len: int) -> int:
    """The split count of a decode step (one query row per request) over at most max_seq_len keys, without
    its tensors: what a CUDA graph of that step is captured with (kvcli/runner/cuda_graphs.py)."""
    tile = k_cache.dtype if k_cache.dtype in _FLOAT_DTYPES else q_dtype
    return _auto_splits(batch, num_q_heads, tile, k_cache, batch, 1, max_seq_len)


def _auto_splits(num_tokens: int, num_q_heads: int, tile_dtype: torch.dtype, k_cache: torch.Tensor, batch: int,
                 max_seqlen_q: int, max_seq_len: int) -> int:
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    cfg = attention_launch_config(num_q_heads // num_kv_heads, head_dim, block_size, max_seqlen_q, tile_dtype,
                                  k_cache.dtype not in _FLOAT_DTYPES)
    # Programs that do work (the global q-block numbering also launches some that exit at once).
    q_blocks = min(num_tokens // cfg["BLOCK_Q"] + batch, batch * triton.cdiv(max(max_seqlen_q, 1), cfg["BLOCK_Q"]))
    return choose_num_splits(q_blocks * num_kv_heads, max_seq_len, _num_sms(k_cache.device), cfg["BLOCK_N"])




def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, q_heads, head_dim]; got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache/v_cache must both be [num_blocks, block_size, kv_heads, head_dim]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be float16/bfloat16/float32; got {q.dtype}")
    check_cache_format(k_cache, v_cache, k_scale, v_scale)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, cache has {k_cache.shape[3]}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"q_heads ({num_q_heads}) must be a multiple of kv_heads ({num_kv_heads})")
    if num_q_heads // num_kv_heads > 128:
        raise ValueError(f"at most 128 query heads per KV head are supported; got {num_q_heads // num_kv_heads}")
    if head_dim > 256:
        raise ValueError(f"head_dim <= 256 supported; got {head_dim}")
    if cu_seqlens_q.dim() != 1 or seq_lens.dim() != 1 or cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens_q must be [batch + 1] and seq_lens [batch]; got {tuple(cu_seqlens_q.shape)} "
            f"and {tuple(seq_lens.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables must be [batch={seq_lens.shape[0]}, max_blocks]; got {tuple(block_tables.shape)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32; got {t.dtype}")
    tensors = [q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables]
    tensors += [t for t in (k_scale, v_scale) if t is not None]
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}; got {tuple(out.shape)} {out.dtype}")
        tensors.append(out)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(str(d) for d in devices)}")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    max_seq_len: int,
    num_splits: int | None = None,
    *,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal paged attention for a packed batch of decode and prefill rows.

    Returns out [num_tokens, q_heads, head_dim] in q's dtype (written into `out` if given).
    max_seqlen_q / max_seq_len are host-side upper bounds (no device sync is done): max_seqlen_q
    picks the tile shape, max_seq_len the split count. num_splits: None = automatic (split-K only
    when batch x kv_heads cannot fill the GPU), 1 = never split, n > 1 = exactly n KV segments.
    int8 / float8_e4m3fn caches need k_scale, v_scale [num_blocks, block_size, kv_heads] fp32.
    window > 0: sliding-window attention, the row at position p sees keys [p - window + 1, p] only.
    softcap > 0: scores are soft-capped, s = softcap * tanh(s / softcap), before the mask (Gemma 2).
    """
    _check(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or batch == 0:
        return out
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None; got {num_splits}")
    if window < 0:
        raise ValueError(f"window must be >= 0 (0 = none); got {window}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 = none); got {softcap}")

    group = num_q_heads // num_kv_heads
    tile_dtype = _tile_dtype(q, k_cache)
    cfg = attention_launch_config(group, head_dim, block_size, max_seqlen_q, tile_dtype, k_scale is not None)
    num_q_blocks = num_tokens // cfg["BLOCK_Q"] + batch
    if num_splits is None:  # a window bounds the keys a program reads, whatever the context
        keys = min(max_seq_len, window + max_seqlen_q - 1) if window else max_seq_len
        num_splits = auto_num_splits(q, k_cache, batch, max_seqlen_q, keys)
    split = num_splits > 1

    compute_f32 = tile_dtype == torch.float32 or (tile_dtype == torch.bfloat16 and _INTERPRETED)
    quant = k_scale is not None and v_scale is not None
    common = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=cfg["BLOCK_D"],
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_Q=cfg["BLOCK_Q"],
        BLOCK_N=cfg["BLOCK_N"],
        COMPUTE_F32=compute_f32,
        # fp32 KV: 3xTF32 keeps ~fp32 accuracy on tensor cores (IEEE FMA dots spill badly on sm_90).
        DOT_PRECISION="tf32x3" if compute_f32 else "tf32",  # ignored for 16-bit operands
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        QUANT=quant,
    )
    if split:
        part_acc = torch.empty((num_tokens, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_tokens, num_q_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused placeholders
    grid = (num_q_blocks, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        k_scale if quant else q,  # unused placeholders for float caches
        v_scale if quant else q,
        out,
        part_acc,
        part_ml,
        float(scale) * _LOG2E,
        batch,
        num_splits,
        window if window else 1 << 30,  # "none": farther back than any position
        float(softcap) * _LOG2E if softcap else 1.0,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *(k_scale.stride() if quant else (0, 0, 0)),
        *(v_scale.stride() if quant else (0, 0, 0)),
        *block_tables.stride(),
        *out.stride(),
        SPLIT=split,
        SOFTCAP=bool(softcap),
        **common,
    )
    if split:
        _merge_kernel[(num_tokens, num_q_heads)](
            part_acc,
            part_ml,
            out,
            num_q_heads,
            num_splits,
            *out.stride(),
            HEAD_DIM=head_dim,
            BLOCK_D=cfg["BLOCK_D"],
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4 if num_splits * cfg["BLOCK_D"] >= 2048 else 2,
        )
    return out
