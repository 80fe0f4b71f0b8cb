"""kvcli's Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3) over a paged KV cache.

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
from kvcli.model.layers import Embedding, Linear, LinearGroup, RMSNorm, Rotary, SwiGLU
from kvcli.model.native_decode import DecodeLayer as NativeLayer
from kvcli.model.native_decode import DecodeModel, NativeDecode
from kvcli.model.quant import QuantTensor
from kvcli.model.vocab_head import VocabHead
from kvcli.model.weight_plan import LinearPlan, ProjectionPlan, WeightPlan

Weights = dict[str, "QuantTensor | torch.Tensor"]


def _fused(parts: list, dtype: torch.dtype):
    """One weight for a fused matmul: parts of one layout concatenated as they are (the plan groups only
    such neighbours), or, where a "dense" plan joined parts of several layouts, all expanded to `dtype`."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, QuantTensor) and all(isinstance(p, QuantTensor) and p.layout() == first.layout() for p in parts):
        return QuantTensor.cat(parts)
    if all(isinstance(p, torch.Tensor) and p.dtype == first.dtype for p in parts):
        return torch.cat(parts)
    return torch.cat([p.to(dtype) if isinstance(p, torch.Tensor) else p.dequantize(dtype) for p in parts])


def _build(proj: ProjectionPlan, take, bias: torch.Tensor | None, dtype: torch.dtype) -> Linear | LinearGroup:
    """The Linear (or LinearGroup of parts side by side) that `proj` plans."""
    def one(p: LinearPlan, b: torch.Tensor | None) -> Linear:
        return Linear(_fused([take(n) for n in p.names], dtype), b, p, dtype)

    if not proj.grouped:
        return one(proj.parts[0], bias)
    return LinearGroup([one(p, None) for p in proj.parts], None if bias is None else bias.to(dtype))


@dataclass
class DecoderLayer:
    attn_norm: RMSNorm
    qkv: Linear | LinearGroup
    o: Linear | LinearGroup
    ffn_norm: RMSNorm
    gate_up: Linear | LinearGroup
    down: Linear | LinearGroup
    q_norm: RMSNorm | None = None  # Qwen3, Gemma 3: per-head RMSNorm of q and k before the rotary
    k_norm: RMSNorm | None = None
    attn_post_norm: RMSNorm | None = None  # Gemma: on the attention output, before the residual add
    ffn_post_norm: RMSNorm | None = None  # Gemma: on the MLP output, before the residual add
    window: int = 0  # this layer's sliding window (0: full attention)
    rotary: "Rotary | None" = None  # this layer's rotary (set by LlamaModel: the local or the global one)


class UnreadWeights(ValueError):
    """The checkpoint holds tensors the model did not read: what it computes would not be the checkpoint's model."""


class LlamaModel:
    """Built exactly as `plan` says (kvcli/model/weight_plan.py decides how every weight runs)."""

    def __init__(self, config: ModelConfig, weights: Weights, *, plan: WeightPlan, device: torch.device,
                 positions: int | None = None) -> None:
        """`positions`: how many positions the rotary tables hold (the engine's max_model_len; default the
        model's context)."""
        self.config = config
        self.positions = positions or config.max_position_embeddings
        self.plan = plan
        self.dtype = dtype = plan.dtype
        self.device = device
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.scale = c.attention_scale

        def take(name: str) -> QuantTensor | torch.Tensor:
            t = weights.pop(name)
            return t.to(device)  # QuantTensor, Bnb4bitWeight or a plain tensor

        self.embed = Embedding(take("model.embed_tokens.weight"), dtype)
        self.layers: list[DecoderLayer] = []
        for i, projs in enumerate(plan.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = {}
            if c.attention_bias:
                bias["qkv"] = torch.cat([take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")])
            if any(proj.name == "o" and proj.bias for proj in projs):
                bias["o"] = take(a + "o_proj.bias")
            built = {proj.name: _build(proj, take, bias.get(proj.name), dtype) for proj in projs}

            def norm(name: str, on: bool = True) -> RMSNorm | None:
                return RMSNorm(take(name), c.rms_norm_eps, dtype, plan.native_norms) if on else None

            sandwich = c.sandwich_norms  # Gemma: post_attention_layernorm is after attention, not before the MLP
            self.layers.append(DecoderLayer(
                attn_norm=norm(p + "input_layernorm.weight"), qkv=built["qkv"], o=built["o"],
                ffn_norm=norm(p + ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight")),
                gate_up=built["gate_up"], down=built["down"],
                q_norm=norm(a + "q_norm.weight", c.qk_norm), k_norm=norm(a + "k_norm.weight", c.qk_norm),
                attn_post_norm=norm(p + "post_attention_layernorm.weight", sandwich),
                ffn_post_norm=norm(p + "post_feedforward_layernorm.weight", sandwich),
                window=c.layer_window(i) or 0))
        self.norm = RMSNorm(take("model.norm.weight"), c.rms_norm_eps, dtype, plan.native_norms)
        # The output projection over the whole vocabulary; with tied weights it reads the embedding table.
        head = plan.head
        w = self.embed.q if head.tied else take("lm_head.weight")
        if head.form == "int8dot-cpu":
            from kvcli.model.int8dot_cpu import Int8DotCpu

            table = Int8DotCpu(w, route=head.route)
            self.lm_head = VocabHead(head, table=table)
            if head.tied:  # one copy: rows looked up from the kernel's packed table (bit for bit)
                self.embed.share(table)
        elif head.tied:
            self.lm_head = VocabHead(head, self.embed.dense(head.dtype))
        else:
            self.lm_head = VocabHead(head, w.to(head.dtype) if isinstance(w, torch.Tensor) else w.dequantize(head.dtype))
        weights.pop("lm_head.weight", None)
        unread = sorted(n for n in weights if not n.endswith("rotary_emb.inv_freq"))  # (old checkpoints' buffers)
        if unread:
            raise UnreadWeights(f"tensor {unread[0]} ({len(unread)} not read in all) is not read by kvcli and may "
                                f"change what the model computes; refusing the checkpoint rather than computing a "
                                f"different model")
        self.rotary = Rotary(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, device,
                             rows=self.positions)
        self.local_rotary = self.rotary if c.local_rope_theta is None else Rotary(
            c.head_dim, c.max_position_embeddings, c.local_rope_theta, c.local_rope_scaling, device,
            rows=self.positions)
        for i, layer in enumerate(self.layers):
            layer.rotary = self.local_rotary if c.layer_types and c.layer_types[i] == "sliding" else self.rotary
        self.swiglu = SwiGLU(plan.native_swiglu, c.hidden_act)
        self.native_decode = NativeDecode.build(self.decode_description()) if plan.native_decode else None

    # ---------------------------------------------------------------------------------------------
    @property
    def row_invariant(self) -> bool:
        return self.plan.row_invariant

    @property
    def linear_mode(self) -> str:
        """What the layers run: "dense" or "nf4" as the tier, else the forms, e.g. "int4-cpu+int4x2-cpu"."""
        return self.plan.tier if self.plan.tier in ("dense", "nf4") else self.plan.forms()

    @property
    def projection_paths(self) -> dict[str, dict[str, int]]:
        """Projection name -> {form: layers}, e.g. down_proj {"int4x2-cpu": 30}: what inspect shows."""
        return self.plan.by_projection()

    def linears(self) -> Iterator[Linear]:
        """Every layer Linear, the parts of a LinearGroup one by one."""
        for l in self.layers:
            for lin in (l.qkv, l.o, l.gate_up, l.down):
                yield from (lin.parts if isinstance(lin, LinearGroup) else [lin])

    def decode_description(self) -> DecodeModel:
        """The plain per-layer description the one-call C decode builds from (model/native_decode.py): norm
        weights, each projection's int8dot-cpu parts (kernel arguments and output features, in output
        order), the rotary tables. Only for a model whose plan has native_decode."""
        c = self.config

        def parts(lin: Linear | LinearGroup) -> tuple[tuple[tuple, int], ...]:
            return tuple((p.kernel.args, p.out_features, p.kernel.int8_min_rows or 0)
                         for p in (lin.parts if isinstance(lin, LinearGroup) else [lin]))

        def weight(norm: RMSNorm | None) -> torch.Tensor | None:
            return None if norm is None else norm.weight

        layers = tuple(NativeLayer(l.attn_norm.weight, l.ffn_norm.weight, parts(l.qkv), parts(l.o), parts(l.gate_up),
                                   parts(l.down), weight(l.q_norm), weight(l.k_norm), weight(l.attn_post_norm),
                                   weight(l.ffn_post_norm), None if l.rotary is self.rotary else l.rotary.cos,
                                   None if l.rotary is self.rotary else l.rotary.sin_signed, l.window, l.qkv.bias)
                       for l in self.layers)
        return DecodeModel(heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim, hidden=c.hidden_size,
                           ffn=c.intermediate_size, eps=self.layers[0].attn_norm.eps, cos=self.rotary.cos,
                           sin_signed=self.rotary.sin_signed, scale=self.scale, layers=layers,
                           max_rows=self.plan.native_decode_max_rows, act=c.hidden_act)

    def weight_bytes(self) -> dict[str, int]:
        layers = sum(l.qkv.nbytes + l.o.nbytes + l.gate_up.nbytes + l.down.nbytes
                     + 2 * l.attn_norm.weight.numel() * l.attn_norm.weight.element_size() for l in self.layers)
        return {
            "layers": layers,
            "embedding": self.embed.nbytes,
            "lm_head": self.lm_head.nbytes,
        }

    def table_bytes(self) -> int:
        """What the model holds besides its weights: the rotary tables (cos and signed sin for every position
        of the context, one pair per distinct rotary: Gemma 3's local layers have their own)."""
        return sum({id(l.rotary): l.rotary.nbytes for l in self.layers}.values())

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
        window, softcap = c.sliding_window or 0, c.attn_logit_softcap or 0.0
        if meta.sliding_window != window or meta.softcap != softcap:  # the model's, whoever built the metadata
            meta = replace(meta, sliding_window=window, softcap=softcap,
                           groups=tuple(replace(g, softcap=softcap) for g in meta.groups))
        h = self.embed(input_ids)
        if c.embed_scale != 1.0:  # Gemma: sqrt(hidden) (rounded by the reader as its reference rounds it)
            h.mul_(c.embed_scale)
        # A decode step through every layer in one C call where everything runs on kvcli's C kernels.
        cut = None
        if self.native_decode is None or not self.native_decode(h, positions, kv_cache, meta, backend):
            cut = self._last_layer_rows(meta, logits_indices, backend, h.device)
            h = self._layers(h, positions, kv_cache, meta, backend, cut)
        if cut is None and logits_indices is not None:  # a cut already kept only these rows
            h = h[logits_indices]
        h = self.norm(h)
        logits = self.lm_head(h)
        if c.final_logit_softcap is not None:
            cap = c.final_logit_softcap
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits

    def _last_layer_rows(self, meta: AttentionMetadata, wanted: torch.Tensor | None, backend: AttentionBackend,
                         device: torch.device) -> tuple[torch.Tensor, AttentionMetadata | None] | None:
        """Rows only the last layer may skip: after it stores its K/V, its attention, output projection and
        MLP matter only for the rows whose logits are wanted (llama.cpp does the same). For a step whose
        wanted rows are each the last row of its request (sampling after a prefill chunk) or none (a
        prefill-only step), with at least one multi-row request: (those rows, a metadata of one query row
        per such request, None when there are none). None: compute every row (decode-only steps, a
        speculative verify's several rows per request, the row-invariant model, non-CPU backends)."""
        if wanted is None or self.row_invariant or device.type != "cpu" or backend.name != "torch" \
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

        def rows_of(m: AttentionMetadata) -> AttentionMetadata:
            return AttentionMetadata(
                slot_mapping=m.slot_mapping[wanted], cu_seqlens_q=torch.arange(len(sel) + 1, dtype=torch.int32),
                seq_lens=m.seq_lens[sel_t], block_tables=m.block_tables[sel_t], max_seqlen_q=1,
                max_seq_len=max(lens), seq_lens_list=lens, query_lens_list=(1,) * len(sel),
                sliding_window=m.sliding_window, softcap=m.softcap)

        return wanted, replace(rows_of(meta), groups=tuple(rows_of(g) for g in meta.groups))

    def _qk_norm(self, qkv: torch.Tensor, layer: DecoderLayer) -> None:
        """Qwen3's RMSNorm over every q head and every k head of the fused qkv output, in place (so the
        rotary + KV-store kernel reads the normed heads)."""
        c, d = self.config, self.config.head_dim
        q = qkv[:, :self.q_size].reshape(-1, d)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].reshape(-1, d)
        qkv[:, :self.q_size] = layer.q_norm(q).view(-1, self.q_size)
        qkv[:, self.q_size:self.q_size + self.kv_size] = layer.k_norm(k).view(-1, self.kv_size)

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                backend: AttentionBackend, cut: tuple[torch.Tensor, AttentionMetadata | None] | None) -> torch.Tensor:
        """Every decoder layer on h [T, hidden], in place, one kernel call at a time; returns h, or with a
        `cut` (_last_layer_rows) only its rows, the last layer computed for them alone."""
        c = self.config
        t = h.shape[0]
        last = len(self.layers) - 1  # (by index: layers of different KV groups share a cache slot)
        # Rotary + KV store as one C call per layer where the backend offers it (fp32 compute on the CPU); one
        # writer and one table gather per rotary (Gemma 3's local and global layers rotate differently).
        # (KV groups, kvcache/kv_groups.py: each group's layers write through its own slots, so one writer per
        # rotary and group.)
        group_of = kv_cache.groups.group_of
        rope_kv: dict[tuple[int, int], object] = {}
        cos_sin: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, (rot, g) in {(id(l.rotary), g): (l.rotary, g) for l, g in zip(self.layers, group_of)}.items():
            writer = None if h.dtype != torch.float32 else backend.rope_kv_writer(
                rot.cos, rot.sin_signed, positions, meta.for_group(g), kv_cache.layers[0], c.num_heads,
                c.num_kv_heads)
            if writer is not None:
                rope_kv[key] = writer
            elif id(rot) not in cos_sin:
                cos_sin[id(rot)] = rot.at(positions, h.dtype)
        # This step's metadata per (KV group, window): layers of several kinds.
        windows: dict[tuple[int, int], AttentionMetadata] = {}

        def with_window(m: AttentionMetadata, g: int, w: int) -> AttentionMetadata:
            m = m.for_group(g)
            if m.sliding_window == w:
                return m
            if (g, w) not in windows:
                windows[g, w] = replace(m, sliding_window=w)
            return windows[g, w]

        qk_size = self.q_size + self.kv_size
        for i, (layer, cache, g) in enumerate(zip(self.layers, kv_cache.layers, group_of)):
            lmeta = with_window(meta, g, layer.window)
            x = layer.attn_norm(h)
            qkv = layer.qkv(x)
            if layer.q_norm is not None:
                self._qk_norm(qkv, layer)
            writer = rope_kv.get((id(layer.rotary), g))
            if writer is not None:
                q = writer(qkv, cache)
            else:
                # q and k heads are adjacent in the fused output: rotated in one go.
                qk = layer.rotary.apply(qkv[:, :qk_size].view(t, c.num_heads + c.num_kv_heads, c.head_dim),
                                        cos_sin[id(layer.rotary)])
                q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
                v = qkv[:, qk_size:].view(t, c.num_kv_heads, c.head_dim)
                backend.write_kv(k, v, cache, lmeta)
            if cut is not None and i == last:  # K/V of every row are stored; the rest only for these
                rows, meta = cut
                h = h[rows]
                if meta is None:
                    return h
                windows.clear()
                lmeta = with_window(meta, g, layer.window)
                q, t = q[rows], h.shape[0]
            attn = backend.forward(q, cache, lmeta, self.scale)
            # In place: h is this forward's own tensor (the embedding rows, then its own sums).
            out = layer.o(attn.reshape(t, self.q_size))
            h.add_(out if layer.attn_post_norm is None else layer.attn_post_norm(out))
            x = layer.ffn_norm(h)
            out = layer.down(self.swiglu(layer.gate_up(x)))
            h.add_(out if layer.ffn_post_norm is None else layer.ffn_post_norm(out))
        return h

