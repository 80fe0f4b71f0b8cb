"""Fused projections split into the per-projection weights kvcli's planner fuses again its own way: Phi-3
stores q, k and v as one `qkv_proj` (GGUF attn_qkv) and gate and up as one `gate_up_proj` (GGUF ffn_up of
twice the width, gate first, as ggml's swiglu and transformers' Phi3MLP read it). Splitting by rows is
lossless for every stored form (quantization groups run along the input features)."""

from __future__ import annotations

import torch

from kvcli.model.quant import QuantTensor

FUSED = {  # fused name -> the parts it holds, in row order (sizes from the config)
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def _rows(w, start: int, stop: int):
    if isinstance(w, QuantTensor):
        return w.rows(torch.arange(start, stop))
    return w[start:stop].contiguous()


def split_fused(config, weights: dict, where: str) -> None:
    """In place: every fused projection of `weights` (Hugging Face names) replaced by its parts. ValueError
    (one line, naming the tensor) when its rows do not add up to the parts the config implies."""
    q, kv, ffn = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    sizes = {"self_attn.qkv_proj.weight": (q, kv, kv), "mlp.gate_up_proj.weight": (ffn, ffn)}
    for name in [n for n in weights if n.endswith(tuple(FUSED))]:
        suffix = next(s for s in FUSED if name.endswith(s))
        prefix = name[: -len(suffix)]
        w = weights.pop(name)
        rows = w.shape[0]
        if rows != sum(sizes[suffix]):
            raise ValueError(f"{where}: {name} has {rows} rows; the config implies {' + '.join(map(str, sizes[suffix]))}")
        start = 0
        for part, n in zip(FUSED[suffix], sizes[suffix]):
            if prefix + part in weights:
                raise ValueError(f"{where}: both {name} and {prefix + part}")
            weights[prefix + part] = _rows(w, start, start + n)
            start += n
