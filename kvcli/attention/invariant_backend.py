"""Batch-invariant paged attention in plain torch (`--attention-backend invariant`, CPU).

Batch-invariant by construction: a query row's output depends only on its own q and the K/V it can
see, never on which other rows share the step (other requests, the rest of a prefill chunk, the
guesses of a speculative verify, a recomputation after preemption). That is what lets speculative
decoding, chunked prefill, preemption, copy-on-write and the contiguous layout give bit-identical
greedy text on the INT4 path, whose bf16 activations would turn a last-bit difference in attention
into a flipped near-tie. (SDPA's CPU kernels are not invariant: the same row gives different bits
in a 1-row decode, a 6-row chunk or a padded batch, because reductions are blocked by the call's shape.)

Every row is computed the same way, whatever the batch around it:
  scores  (q * scale) @ K^T, one GEMM per CHUNK of keys (keys padded to a multiple of CHUNK with
          the zeroed null block; a GEMM's element is a dot over head_dim whatever the GEMM's size,
          provided it has >= MIN_ROWS rows: smaller GEMMs take a kernel that rounds differently, so
          query rows are padded up to MIN_ROWS);
  softcap c * tanh(s / c) where the model soft-caps (Gemma 2), elementwise;
  mask    keys after the row's position, before its sliding window (if any) and the padding are -inf;
  softmax exp(s - max) (elementwise), denominator = per-CHUNK sums (a fixed-size reduction)
          accumulated in order by cumsum, so trailing masked chunks add exact zeros;
  output  (p @ V) one GEMM per CHUNK (a GEMM's rounding depends on its reduction length: zero-padding
          that length changed the bits), the chunks' partial outputs added one at a time in key order
          (torch.sum's order depends on the shape), divided by the denominator.
K/V are gathered head-major ([kvh, n, keys, D]) into reused buffers, so every GEMM sees the same
operand layout. Work is batched without changing any of that: decode rows of many requests share one
batched GEMM (padded to the group's longest context), prefill chunks run in tiles of rows over only
the keys they need.
Quantized caches (int8/fp8) fold their scales in: scores are scaled per key, probabilities by the
V scale per key, so dequantized K/V are never materialised (fp32 codes in reused scratch buffers).
The price is speed (more, smaller ops than the default torch backend's SDPA calls: measured in
docs/benchmarks.md), so it is an option, as vLLM's batch-invariant mode is. The default backend
gives the same attention to within float rounding. tests/test_torch_backend.py checks the
invariance bit for bit; docs/architecture.md says where it matters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcli.attention.base import AttentionMetadata
from kvcli.kvcache.kv_cache import LayerKV
from kvcli.attention.torch_backend import TorchAttentionBackend

CHUNK = 256  # keys are read padded to a multiple of this; softmax sums and p @ V run per chunk
MIN_ROWS = 4  # fewer GEMM rows than this take a kernel with different rounding
TILE_POSITIONS = 128  # prefill rows per tile (bounds the score matrix; causal: tiles read fewer keys)


def _pad(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class _DecodeGroup:
    requests: list[int]
    rows: torch.Tensor  # [n] row of each request's query in q
    blocks: torch.Tensor  # [n, keys / block_size] block ids (the null block past a request's table)
    last: torch.Tensor  # [n] last visible key position per request
    keys: int  # padded key count


class InvariantAttentionBackend(TorchAttentionBackend):
    """The torch backend's KV writes (quantize on write included); its own attention."""

    name = "invariant"

    def __init__(self) -> None:
        super().__init__()
        self._plan_meta: AttentionMetadata | None = None
        self._groups: list[_DecodeGroup] = []
        self._req_blocks: dict[int, torch.Tensor] = {}

    def native_decode_plan(self, *args: object) -> None:
        """Never: the C decode loop (model/native_decode.py) would run the default backend's attention kernel,
        not this backend's row-invariant attention."""
        return None

    # -- per-step plan (shared by every layer) -------------------------------------------------------
    def _plan(self, meta: AttentionMetadata, block_size: int, device: torch.device) -> None:
        """Block ids of each request's (padded) keys and the decode groups, worked out once per step."""
        if meta is self._plan_meta:
            return
        self._plan_meta, self._groups, self._req_blocks = meta, [], {}
        tables = meta.block_tables.long()
        width = tables.shape[1]

        def block_ids(b_rows: torch.Tensor, length: int) -> torch.Tensor:
            """The blocks holding keys [0, pad(length, CHUNK)) of each request: its table, then the null
            block (zeroed, so masked keys stay finite: NaN * 0 would be NaN in p @ V)."""
            nblk = _pad(length, CHUNK) // block_size
            ids = tables.index_select(0, b_rows)[:, :min(width, nblk)]
            if nblk > ids.shape[1]:
                ids = torch.cat([ids, ids.new_zeros(ids.shape[0], nblk - ids.shape[1])], 1)
            return ids

        starts = [0]
        for n in meta.query_lens_list:
            starts.append(starts[-1] + n)
        dec = sorted(((meta.seq_lens_list[b], b) for b, n in enumerate(meta.query_lens_list) if n == 1),
                     reverse=True)
        # Group decode rows by similar context so padding to a group's longest stays within 1.5x.
        groups: list[list[tuple[int, int]]] = []
        for length, b in dec:
            g = groups[-1] if groups else None
            if g is None or g[0][0] * (len(g) + 1) > 1.5 * (sum(x[0] for x in g) + length) + 64 * (len(g) + 1):
                groups.append([])
            groups[-1].append((length, b))
        for g in groups:
            reqs = [b for _, b in g]
            idx = torch.tensor(reqs, device=device)
            self._groups.append(_DecodeGroup(
                requests=reqs,
                rows=torch.tensor([starts[b] for b in reqs], device=device),
                blocks=block_ids(idx, g[0][0]),
                last=torch.tensor([length - 1 for length, _ in g], device=device),
                keys=_pad(g[0][0], CHUNK)))
        for b, n in enumerate(meta.query_lens_list):
            if n > 1:
                self._req_blocks[b] = block_ids(torch.tensor([b], device=device), meta.seq_lens_list[b])[0]

    def _kv(self, cache: LayerKV, blocks: torch.Tensor, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """K, V of n requests as head-major [kvh, n, keys, D] (keys = blocks [n, nblk] x block_size) in
        `dtype` (fp32 codes for quantized caches), and per-key scales [kvh, n, keys] (None when unscaled):
        a gather of whole blocks (the torch backend's _gather_codes: one index_select on the block dim of
        the head-major storage), converted into a reused buffer when `dtype` differs from the cache's.
        One memory layout whatever the batch, so the GEMMs see the same strides."""

        def read(x: torch.Tensor, name: str, out_dtype: torch.dtype) -> torch.Tensor:
            got = self._gather_codes(x, blocks, name + "-blocks")  # [kvh, n, keys(, D)]
            if got.dtype == out_dtype:
                return got
            return self._scratch_buf(name, tuple(got.shape), out_dtype, x.device).copy_(got)

        kd = dtype if cache.k_scale is None else torch.float32
        k, v = read(cache.k, "k", kd), read(cache.v, "v", kd)
        if cache.k_scale is None or cache.v_scale is None:
            return k, v, None, None
        return k, v, read(cache.k_scale, "ks", torch.float32), read(cache.v_scale, "vs", torch.float32)

    # -- attention -----------------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, cache: LayerKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self._plan(meta, cache.block_size, q.device)
        out = torch.empty_like(q)
        t, h, d = q.shape
        kvh = cache.k.shape[2]
        g = h // kvh
        for grp in self._groups:
            n = len(grp.requests)
            k, v, ks, vs = self._kv(cache, grp.blocks, q.dtype)  # [kvh, n, L, D]
            qg = q.index_select(0, grp.rows).view(n, kvh, g, d).transpose(0, 1)  # [kvh, n, g, D]
            last = grp.last.view(n, 1).expand(n, g)
            o = attend_rows(qg, last, k, v, ks, vs, scale, meta.sliding_window, meta.softcap)  # [kvh, n, g, D]
            out.index_copy_(0, grp.rows, o.transpose(0, 1).reshape(n, h, d))
        start = 0
        for b, (q_len, kv_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            if q_len > 1:
                pos0 = kv_len - q_len
                k_all, v_all, ks_all, vs_all = self._kv(cache, self._req_blocks[b][None], q.dtype)
                # Tiles of rows, each over only the keys its last row sees (a prefix of the same buffers).
                for t0 in range(0, q_len, TILE_POSITIONS):
                    t1 = min(q_len, t0 + TILE_POSITIONS)
                    keys = _pad(pos0 + t1, CHUNK)
                    k, v = k_all[:, :, :keys], v_all[:, :, :keys]
                    ks = None if ks_all is None else ks_all[:, :, :keys]
                    vs = None if vs_all is None else vs_all[:, :, :keys]
                    n = t1 - t0
                    # Rows ordered (position, q head) within each KV head: [kvh, 1, n * g, D].
                    qt = q[start + t0:start + t1].view(n, kvh, g, d).transpose(0, 1).reshape(kvh, 1, n * g, d)
                    last = torch.arange(pos0 + t0, pos0 + t1, device=q.device).repeat_interleave(g).view(1, -1)
                    o = attend_rows(qt, last, k, v, ks, vs, scale, meta.sliding_window, meta.softcap)
                    out[start + t0:start + t1] = o.view(kvh, n, g, d).transpose(0, 1).reshape(n, h, d)
            start += q_len
        return out


def attend_rows(q: torch.Tensor, last: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, scale: float,
                window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Batch-invariant attention (see the module docstring).

    q [kvh, n, M, D]: query rows of n requests grouped by the KV head they read; last [n, M]: the
    last key position each row may see (window > 0: the first is last - window + 1; keys before it
    are masked like those after, so they add exact zeros); k, v [kvh, n, L, D] with L a multiple of
    CHUNK; k_scale, v_scale [kvh, n, L] or None (unscaled); softcap > 0: scores become softcap * tanh(s /
    softcap) before the mask (elementwise: invariant). Returns [kvh, n, M, D]."""
    kvh, n, m_rows, d = q.shape
    L = k.shape[-2]
    nc = L // CHUNK
    if m_rows < MIN_ROWS:  # padded rows see key 0 only (finite, discarded)
        q = torch.cat([q, q.new_zeros(kvh, n, MIN_ROWS - m_rows, d)], -2)
        last = torch.cat([last, last.new_zeros(n, MIN_ROWS - m_rows)], -1)
    if k_scale is None:
        q = q * scale
    # Scores chunk by chunk: [kvh, n, nc, M, CHUNK], each a GEMM over head_dim (the same for any L).
    s = torch.matmul(q.unsqueeze(2), k.unflatten(2, (nc, CHUNK)).transpose(-1, -2))
    if k_scale is not None:
        s.mul_((k_scale * scale).view(kvh, n, nc, 1, CHUNK))
    if softcap:
        s.div_(softcap).tanh_().mul_(softcap)
    pos = torch.arange(L, device=q.device).view(nc, 1, CHUNK)
    lastm = last.view(n, 1, -1, 1)
    hidden = pos > lastm  # [n, nc, M, CHUNK], broadcast over kvh
    if window:
        hidden |= pos <= lastm - window
    s.masked_fill_(hidden, float("-inf"))
    p = s.sub_(s.amax(dim=(2, 4), keepdim=True)).exp_()
    den = p.sum(-1).cumsum(2)[:, :, -1].unsqueeze(-1)  # per-chunk sums in key order: [kvh, n, M, 1]
    if v_scale is not None:
        p.mul_(v_scale.view(kvh, n, nc, 1, CHUNK))
    # p @ V one CHUNK of keys at a time (a GEMM's rounding depends on its reduction length, so the
    # length is fixed), partial sums accumulated in key order.
    part = torch.matmul(p, v.unflatten(2, (nc, CHUNK)))  # [kvh, n, nc, M, D]
    o = part[:, :, 0].clone()
    for c in range(1, nc):  # in order, one add at a time (torch.sum's order depends on the shape)
        o.add_(part[:, :, c])
    return o.div_(den)[:, :, :m_rows]
