"""Write AWQ / GPTQ / compressed-tensors INT4 tensors from a dense weight (for benchmarks and tools).

Round-to-nearest per group (no calibration: the point is the layout, not the accuracy), then packed
per each format's published layout (see hf_quant.py's docstring). The loader's tests use their own,
independent packers; this module is for scripts/bench_hf_quant.py.
"""

from __future__ import annotations

import torch

from kvcli.model.hf_quant import AWQ_ORDER


def rtn_quantize(w: torch.Tensor, group_size: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense [N, K] -> codes [N, K] in 0..15, fp16 scales [N, K/G], zeros [N, K/G] (8 when sym)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    if sym:
        s = (g.abs().amax(-1) / 7.5).clamp(min=1e-8).to(torch.float16)
        z = torch.full(s.shape, 8, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-8).to(torch.float16)
        z = torch.round(-lo / s.float()).clamp(0, 15).to(torch.int64)
    q = torch.round(g / s.float().unsqueeze(-1)) + z.unsqueeze(-1)
    return q.clamp(0, 15).to(torch.int64).reshape(n, k), s, z


def _pack(vals: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[R, C] in 0..15 -> int32 [R, C/8], packed along C; nibble i of word j holds column 8j + order[i]."""
    v = vals.to(torch.int64).reshape(vals.shape[0], -1, 8)
    word = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i, col in enumerate(order):
        word |= (v[..., col] & 0xF) << (4 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


_PLAIN = tuple(range(8))


def encode(fmt: str, prefix: str, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> dict[str, torch.Tensor]:
    """One linear's tensors: fmt "awq", "gptq" (v1: z - 1 stored), "gptq_v2" or "compressed-tensors"."""
    n, k = q.shape
    g = k // s.shape[1]
    if fmt == "awq":
        return {prefix + "qweight": _pack(q.t(), AWQ_ORDER), prefix + "qzeros": _pack(z.t(), AWQ_ORDER),
                prefix + "scales": s.t().contiguous()}
    if fmt in ("gptq", "gptq_v2"):
        stored = (z - 1) & 0xF if fmt == "gptq" else z
        return {prefix + "qweight": _pack(q, _PLAIN).t().contiguous(), prefix + "qzeros": _pack(stored.t(), _PLAIN),
                prefix + "scales": s.t().contiguous(), prefix + "g_idx": (torch.arange(k) // g).to(torch.int32)}
    out = {prefix + "weight_packed": _pack(q, _PLAIN), prefix + "weight_scale": s,
           prefix + "weight_shape": torch.tensor([n, k], dtype=torch.int32)}
    if not bool((z == 8).all()):
        out[prefix + "weight_zero_point"] = _pack(z.t(), _PLAIN).t().contiguous()
    return out


def quantization_config(fmt: str, group_size: int, sym: bool) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    if fmt in ("gptq", "gptq_v2"):
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": sym,
                "checkpoint_format": fmt}
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group", "group_size": group_size}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}}}
