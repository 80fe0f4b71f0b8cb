"""kvcli's Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

The model sees a flat batch: every scheduled token of every request packed into one [T] tensor, with
absolute positions and an AttentionMetadata that tells attention where each request's KV lives.
Weights use Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...); q/k/v and gate/up are
fused into one matmul each.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from kvcli.attention.base import AttentionBackend, AttentionMetadata
from kvcli.config import ModelConfig
from kvcli.kvcache.kv_cache import KVCache
from kvcli.model import int8dot_cpu
from kvcli.model.native_decode import NativeDecode
from kvcli.model.layers import Embedding, Linear, LinearGroup, RMSNorm, Rotary, SwiGLU
from kvcli.model.quant import QuantTensor
from kvcli.model.vocab_head import VocabHead

Weights = dict[str, "QuantTensor | torch.Tensor"]


def _fuse(parts: list[QuantTensor | torch.Tensor]) -> QuantTensor | torch.Tensor | list[QuantTensor | torch.Tensor]:
    """One weight for a fused matmul when the parts share a layout; else the parts, kept as they are
    (a LinearGroup), so a mixed Q4_K/Q6_K q/k/v never falls back to a dense copy. Neighbours that
    share a layout are still fused (Q4_K_M: q+k, then v), one kernel call fewer per layer."""
    fused = [r[0] if len(r) == 1 else (QuantTensor.cat(r) if isinstance(r[0], QuantTensor) else torch.cat(r))
             for r in _runs(parts)]
    return fused[0] if len(fused) == 1 else fused


def _runs(parts: list) -> list[list]:
    """Neighbouring parts that can be concatenated (quantized of one layout, or tensors of one dtype)."""
    def key(p) -> object:
        if isinstance(p, QuantTensor):
            return ("quant", p.layout())
        if isinstance(p, torch.Tensor):
            return ("tensor", p.dtype)
        return object()  # e.g. a bitsandbytes weight: never concatenated

    runs: list[list] = []
    last = None
    for p in parts:
        k = key(p)
        if runs and k == last:
            runs[-1].append(p)
        else:
            runs.append([p])
        last = k
    return runs


def _linear(w: QuantTensor | torch.Tensor | list, bias: torch.Tensor | None, mode: str,
            dtype: torch.dtype) -> Linear | LinearGroup:
    if isinstance(w, list) and mode == "dense":  # one dense matmul after all
        w = torch.cat([p.to(dtype) if isinstance(p, torch.Tensor) else p.dequantize(dtype) for p in w])
    if isinstance(w, list):
        return LinearGroup([Linear(p, None, mode, dtype) for p in w], None if bias is None else bias.to(dtype))
    return Linear(w, bias, mode, dtype)


@dataclass
class DecoderLayer:
    attn_norm: RMSNorm
    qkv: Linear | LinearGroup
    o: Linear
    ffn_norm: RMSNorm
    gate_up: Linear | LinearGroup
    down: Linear


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: Weights, *, linear_mode: str, dtype: torch.dtype,
                 device: torch.device, lm_head_dtype: torch.dtype | None = None) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.head_dim ** -0.5

        def take(name: str) -> QuantTensor | torch.Tensor:
            t = weights.pop(name)
            return t.to(device)  # QuantTensor, Bnb4bitWeight or a plain tensor

        self.embed = Embedding(take("model.embed_tokens.weight"), dtype)
        self.layers: list[DecoderLayer] = []
        # projection name -> {matmul path: layers}, e.g. down_proj {"int4x2-cpu": 30}: what inspect shows.
        self.projection_paths: dict[str, dict[str, int]] = {}
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv_parts = [take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")]
            qkv = _fuse(qkv_parts)
            bias = None
            if c.attention_bias:
                bias = torch.cat([take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")])
            gate_up_parts = [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
            gate_up = _fuse(gate_up_parts)
            self.layers.append(DecoderLayer(
                attn_norm=RMSNorm(take(p + "input_layernorm.weight"), c.rms_norm_eps, dtype),
                qkv=_linear(qkv, bias, linear_mode, dtype),
                o=Linear(take(a + "o_proj.weight"), None, linear_mode, dtype),
                ffn_norm=RMSNorm(take(p + "post_attention_layernorm.weight"), c.rms_norm_eps, dtype),
                gate_up=_linear(gate_up, None, linear_mode, dtype),
                down=Linear(take(p + "mlp.down_proj.weight"), None, linear_mode, dtype),
            ))
            layer = self.layers[-1]
            self._count_paths(("q_proj", "k_proj", "v_proj"), qkv_parts, layer.qkv)
            self._count_paths(("o_proj",), [], layer.o)
            self._count_paths(("gate_proj", "up_proj"), gate_up_parts, layer.gate_up)
            self._count_paths(("down_proj",), [], layer.down)
        self.norm = RMSNorm(take("model.norm.weight"), c.rms_norm_eps, dtype)
        # The output projection over the whole vocabulary. With tied weights it reads the embedding table:
        # on the "cpu" path a quantized table (Q8_0 in most GGUF files) is multiplied as it is by kvcli's
        # int8 kernel; otherwise it is expanded once into lm_head_dtype.
        head_dtype = lm_head_dtype or dtype
        tied = c.tie_word_embeddings or "lm_head.weight" not in weights
        w = self.embed.q if tied else take("lm_head.weight")
        if linear_mode == "cpu" and isinstance(w, QuantTensor) and int8dot_cpu.supports(w):
            self.lm_head = VocabHead.int8dot(int8dot_cpu.Int8DotCpu(w))
        else:
            if tied:
                head = self.embed.dense(head_dtype)
            else:
                head = w.to(head_dtype) if isinstance(w, torch.Tensor) else w.dequantize(head_dtype)
            self.lm_head = VocabHead(head, head_dtype)
        weights.pop("lm_head.weight", None)
        self.rotary = Rotary(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, device)
        self.swiglu = SwiGLU(device, dtype)
        self.native_decode = NativeDecode.build(self)
        self.row_invariant = False

    # ---------------------------------------------------------------------------------------------
    def _count_paths(self, names: tuple[str, ...], parts: list, lin: Linear | LinearGroup) -> None:
        """projection_paths[name][mode] += 1 for each projection of one fused linear: a LinearGroup's
        parts are _fuse's runs of neighbours, in order; a single Linear covers them all."""
        if isinstance(lin, LinearGroup):
            modes = [part.mode for part, run in zip(lin.parts, _runs(parts)) for _ in run]
        else:
            modes = [lin.mode] * len(names)
        for name, mode in zip(names, modes):
            counts = self.projection_paths.setdefault(name, {})
            counts[mode] = counts.get(mode, 0) + 1

    def make_row_invariant(self) -> None:
        """Make each row's logits independent of how many rows share a call (what the invariant attention
        backend needs for speculation's token identity): turn off the matmul paths picked by row count,
        the quantized linears' float GEMM from dense_min_rows rows (a read-back, or the fused fp32 GEMM
        on AVX2 builds) and the vocabulary projection's fp32 slices or fused GEMM."""
        for lin in self._linears():
            if lin.mode in ("int4-cpu", "int8dot-cpu"):
                lin.int4.dense_min_rows = None
        self.lm_head.make_row_invariant()
        self.row_invariant = True  # and every row through every layer (no last-layer cut)

    def _linears(self) -> Iterator[Linear]:
        """Every layer Linear, the parts of a LinearGroup one by one."""
        for l in self.layers:
            for lin in (l.qkv, l.o, l.gate_up, l.down):
                yield from (lin.parts if isinstance(lin, LinearGroup) else [lin])

    def linear_modes(self) -> str:
        """The matmul paths the layer linears took, e.g. "int4-cpu" or "int4-cpu+int4x2-cpu"."""
        return "+".join(dict.fromkeys(lin.mode for lin in self._linears()))

    def weight_bytes(self) -> dict[str, int]:
        layers = sum(l.qkv.nbytes + l.o.nbytes + l.gate_up.nbytes + l.down.nbytes
                     + 2 * l.attn_norm.weight.numel() * l.attn_norm.weight.element_size() for l in self.layers)
        return {
            "layers": layers,
            "embedding": self.embed.nbytes,
            "lm_head": self.lm_head.nbytes,
        }

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor | None = None,  # rows whose next-token logits are wanted
    ) -> torch.Tensor:
        c = self.config
        window = c.sliding_window or 0
        if meta.sliding_window != window:  # the model's window, whoever built the step's metadata
            meta = replace(meta, sliding_window=window)
        h = self.embed(input_ids)
        # A decode step through every layer in one C call where everything runs on kvcli's C kernels.
        cut = None
        if self.native_decode is None or not self.native_decode(h, positions, kv_cache, meta, backend):
            cut = self._last_layer_rows(meta, logits_indices, backend, h.device)
            h = self._layers(h, positions, kv_cache, meta, backend, cut)
        if cut is None and logits_indices is not None:  # a cut already kept only these rows
            h = h[logits_indices]
        h = self.norm(h)
        return self.lm_head(h)

    def _last_layer_rows(self, meta: AttentionMetadata, wanted: torch.Tensor | None, backend: AttentionBackend,
                         device: torch.device) -> tuple[torch.Tensor, AttentionMetadata | None] | None:
        """Rows only the last layer may skip: after it stores its K/V, its attention, output projection and
        MLP matter only for the rows whose logits are wanted (llama.cpp does the same). For a step whose
        wanted rows are each the last row of its request (sampling after a prefill chunk) or none (a
        prefill-only step), with at least one multi-row request: (those rows, a metadata of one query row
        per such request, None when there are none). None: compute every row (decode-only steps, a
        speculative verify's several rows per request, the row-invariant model, non-CPU backends)."""
        if wanted is None or self.row_invariant or device.type != "cpu" or getattr(backend, "name", "") != "torch" \
                or all(n == 1 for n in meta.query_lens_list):
            return None
        rows = wanted.tolist()
        ends, last = {}, -1
        for b, n in enumerate(meta.query_lens_list):
            last += n
            ends[last] = b
        if any(r not in ends for r in rows) or rows != sorted(set(rows)):
            return None
        if not rows:
            return wanted, None
        sel = [ends[r] for r in rows]
        sel_t = torch.tensor(sel, dtype=torch.int64, device=device)
        lens = tuple(meta.seq_lens_list[b] for b in sel)
        return wanted, AttentionMetadata(
            slot_mapping=meta.slot_mapping[wanted], cu_seqlens_q=torch.arange(len(sel) + 1, dtype=torch.int32),
            seq_lens=meta.seq_lens[sel_t], block_tables=meta.block_tables[sel_t], max_seqlen_q=1,
            max_seq_len=max(lens), seq_lens_list=lens, query_lens_list=(1,) * len(sel),
            sliding_window=meta.sliding_window)

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                backend: AttentionBackend, cut: tuple[torch.Tensor, AttentionMetadata | None] | None) -> torch.Tensor:
        """Every decoder layer on h [T, hidden], in place, one kernel call at a time; returns h, or with a
        `cut` (_last_layer_rows) only its rows, the last layer computed for them alone."""
        c = self.config
        t = h.shape[0]
        last = kv_cache.layers[-1]
        # Rotary + KV store as one C call per layer where the backend offers it (fp32 compute on the CPU).
        writer = getattr(backend, "rope_kv_writer", None)
        rope_kv = None if writer is None or h.dtype != torch.float32 else writer(
            self.rotary.cos, self.rotary.sin_signed, positions, meta, kv_cache.layers[0], c.num_heads, c.num_kv_heads)
        cos_sin = self.rotary.at(positions, h.dtype) if rope_kv is None else None
        qk_size = self.q_size + self.kv_size
        for layer, cache in zip(self.layers, kv_cache.layers):
            x = layer.attn_norm(h)
            qkv = layer.qkv(x)
            if rope_kv is not None:
                q = rope_kv(qkv, cache)
            else:
                # q and k heads are adjacent in the fused output: rotated in one go.
                qk = self.rotary.apply(qkv[:, :qk_size].view(t, c.num_heads + c.num_kv_heads, c.head_dim), cos_sin)
                q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
                v = qkv[:, qk_size:].view(t, c.num_kv_heads, c.head_dim)
                backend.write_kv(k, v, cache, meta)
            if cut is not None and cache is last:  # K/V of every row are stored; the rest only for these
                rows, meta = cut
                h = h[rows]
                if meta is None:
                    return h
                q, t = q[rows], h.shape[0]
            attn = backend.forward(q, cache, meta, self.scale)
            # In place: h is this forward's own tensor (the embedding rows, then its own sums).
            h.add_(layer.o(attn.reshape(t, self.q_size)))
            x = layer.ffn_norm(h)
            h.add_(layer.down(self.swiglu(layer.gate_up(x))))
        return h

