"""KV cache formats: how one token's K and V are stored, and the one place their bytes are counted.

Float formats (fp32, fp16, bf16) store K/V as is. int8 stores codes plus one fp32 scale per token
and KV head (symmetric absmax / 127): a token's scale is final the moment it is written, so a
streaming write never re-quantizes its neighbours, blocks copy and swap as plain tensors, and a
partly filled block needs no special case. Per-channel key scales (KIVI) would need the scale of a
whole block of tokens before any of them could be stored. At head_dim 64 the scales add 4 B to 64 B
of codes per head: 68 / 128 = 0.53x of fp16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVDtype:
    name: str  # fp32 | fp16 | bf16 | int8
    storage: torch.dtype  # element type of the K/V tensors
    scale_dtype: torch.dtype | None = None  # None: stored unscaled

    @property
    def quantized(self) -> bool:
        return self.scale_dtype is not None

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """K and V of every layer for one token, scales included."""
        per_head = head_dim * _size(self.storage) + (_size(self.scale_dtype) if self.scale_dtype else 0)
        return 2 * num_layers * num_kv_heads * per_head

    def __str__(self) -> str:
        return self.name


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


INT8_QMAX = 127.0

KV_DTYPES: dict[str, KVDtype] = {
    "fp32": KVDtype("fp32", torch.float32),
    "fp16": KVDtype("fp16", torch.float16),
    "bf16": KVDtype("bf16", torch.bfloat16),
    "int8": KVDtype("int8", torch.int8, torch.float32),
}
ALIASES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
KV_DTYPE_CHOICES = ("auto", "fp32", "fp16", "bf16", "int8", "fp8")


def kv_dtype_of(spec: "str | torch.dtype | KVDtype") -> KVDtype:
    """A KVDtype from its name, a torch float dtype (unquantized storage) or a KVDtype."""
    if isinstance(spec, KVDtype):
        return spec
    if isinstance(spec, torch.dtype):
        for d in KV_DTYPES.values():
            if d.storage == spec and not d.quantized:
                return d
        raise ValueError(f"no KV format stores {spec}")
    return KV_DTYPES[ALIASES.get(spec, spec)]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 codes [..., head_dim], fp32 scales [...]); symmetric per vector.
    An all-zero vector gets scale 0 and codes 0, and dequantizes back to zeros."""
    x = x.float()
    scale = x.abs().amax(-1) / INT8_QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x / safe.unsqueeze(-1)).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored K or V -> `dtype`; scale has codes' shape without the last dimension (or None)."""
    if scale is None:
        return codes.to(dtype)
    # int8 * fp32 promotes inside one kernel: no separate float copy of the codes.
    return (codes * scale.unsqueeze(-1)).to(dtype)
