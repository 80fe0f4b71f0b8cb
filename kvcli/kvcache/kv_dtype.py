"""KV cache formats: how one token's K and V are stored, and the one place their bytes are counted.

Float formats (fp32, fp16, bf16) store K/V as is. int8 and fp8 (e4m3fn) store codes plus one fp32
scale per token and KV head (symmetric absmax / qmax, qmax = KVDtype.qmax: 127 or 448, in KV_DTYPES with
the codes the kernels know each format by): a token's scale is final the moment it is written, so a
streaming write never re-quantizes its neighbours, blocks copy and swap as plain tensors, and a partly
filled block needs no special case. Per-channel key scales (KIVI) would need the scale of a whole block of tokens before any of them could be stored; a
per-tensor fp8 scale (vLLM's default) needs calibration data kvcli does not have, and one outlier
token would coarsen every other token's codes. At head_dim 64 the scales add 4 B to 64 B of codes
per head: 68 / 128 = 0.53x of fp16.

The quantization arithmetic below is THE definition: the Triton cache-write kernel
(kvcli_kernels/cache_write.py) performs the same IEEE fp32 operations in the same order
(amax / qmax with a correctly rounded division, x / scale likewise, round half to even, clamp), so
both backends produce bit-identical codes and scales (tests/kernels/test_kernel_cache_write.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVDtype:
    name: str  # fp32 | fp16 | bf16 | int8 | fp8
    storage: torch.dtype  # element type of the K/V tensors
    kernel_code: int  # the storage's dtype code in kvcli's C kernels (DT_* of cpu_attention.c, cpu_rope_kv.c)
    scale_dtype: torch.dtype | None = None  # None: stored unscaled
    qmax: float = 0.0  # quantized formats: the code a vector's absmax maps to
    quant_code: int = 0  # QUANT id of the Triton cache-write kernel: 0 float, 1 int8 codes, 2 e4m3 codes

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


# THE table of KV formats: their ranges and the codes kvcli's kernels know them by (kvcli_kernels/
# kv_formats.py derives the launchers' tables from it; kernels/ reads kvcli here, as reference.py does).
KV_DTYPES: dict[str, KVDtype] = {
    "fp32": KVDtype("fp32", torch.float32, kernel_code=0),
    "fp16": KVDtype("fp16", torch.float16, kernel_code=1),
    "bf16": KVDtype("bf16", torch.bfloat16, kernel_code=2),
    "int8": KVDtype("int8", torch.int8, kernel_code=3, scale_dtype=torch.float32, qmax=127.0, quant_code=1),
    # 448: the largest finite float8_e4m3fn
    "fp8": KVDtype("fp8", torch.float8_e4m3fn, kernel_code=4, scale_dtype=torch.float32, qmax=448.0, quant_code=2),
}
BY_STORAGE: dict[torch.dtype, KVDtype] = {d.storage: d for d in KV_DTYPES.values()}
INT8_QMAX = KV_DTYPES["int8"].qmax
FP8_QMAX = KV_DTYPES["fp8"].qmax
ALIASES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "fp8_e4m3": "fp8", "fp8-e4m3": "fp8"}
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


def resolve_kv_dtype(requested: str | None, *, device_type: str, compute_dtype: torch.dtype, dequantize: bool,
                     backend: str | None, quantized_weights: bool,
                     native_attention: bool | Callable[[], bool]) -> KVDtype:
    """THE answer to "which KV format is auto": every command and the engine ask this, with plain facts.

    requested: the --kv-dtype name; None or "auto" picks. backend: the attention backend the engine
    chose (its `.name`: torch, triton, invariant), None for a simulation (no model runs). quantized_weights:
    the linears are kvcli's own quantized forms (QuantTensor; not bitsandbytes' nf4). native_attention:
    whether kvcli's C decode-attention kernel (kernels/cpu_attention.c) runs here, or a callable asked
    only when the answer depends on it (the first ask may compile the kernel).

    auto follows the compute dtype, except
      - on CPU with quantized weights over the torch backend where the C kernel runs: fp16, as
        llama.cpp's default, since the kernel reads it in registers: half the bytes of fp32 (twice the
        context in a budget), 1.4x the decode speed at 4k tokens, +0.1 % perplexity
        (docs/benchmarks.md). The exact path (dequantize) and the batch-invariant backend keep fp32;
      - in a simulation: fp16, the 2 bytes of a GPU's default (bf16 or fp16) KV.
    """
    if requested is not None and requested != "auto":
        return kv_dtype_of(requested)
    if backend is None:
        return KV_DTYPES["fp16"]
    if (quantized_weights and device_type == "cpu" and compute_dtype == torch.float32 and not dequantize
            and backend == "torch" and (native_attention() if callable(native_attention) else native_attention)):
        return KV_DTYPES["fp16"]
    return kv_dtype_of(compute_dtype)


def quantize(x: torch.Tensor, storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (codes [..., head_dim] of `storage` (int8 or float8_e4m3fn), fp32 scales [...]);
    symmetric per vector. An all-zero vector gets scale 0 and codes 0, and dequantizes back to zeros."""
    if storage not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"no quantized KV format stores {storage}")
    qmax = BY_STORAGE[storage].qmax
    x = x.float()
    scale = x.abs().amax(-1) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (x / safe.unsqueeze(-1)).clamp_(-qmax, qmax)  # |y| <= qmax up to one rounding of the division
    if storage == torch.int8:
        return torch.round(y).to(torch.int8), scale  # round half to even
    return y.to(storage), scale  # float8_e4m3fn: round to nearest even, in range after the clamp


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize(x, torch.int8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored K or V -> `dtype`; scale has codes' shape without the last dimension (or None)."""
    if scale is None:
        return codes.to(dtype)
    if codes.dtype == torch.int8:
        # int8 * fp32 promotes inside one kernel: no separate float copy of the codes.
        return (codes * scale.unsqueeze(-1)).to(dtype)
    return (codes.float() * scale.unsqueeze(-1)).to(dtype)  # float8 does not promote
