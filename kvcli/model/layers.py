"""Model building blocks: linears over INT4 / dense weights, embedding, RMSNorm, rotary embedding.

A quantized linear is built from a canonical QuantTensor and keeps only the form its matmul path needs:
  "int8dot-cpu" kvcli's own CPU kernel (model/int8dot_cpu.py, kvcli_kernels/cpu_int8dot.c): activations
                quantized to int8 per block of 32, integer dot products against the file's 4-bit codes
                (Q4_0, Q4_1, Q4_K, AWQ/GPTQ) or 5/6/8-bit codes held as int8; what mode "cpu" picks
                wherever the kernel builds and N is a multiple of 8. Not bit-exact (int8 activations).
  "int4-cpu"    torch's packed int4 CPU kernel (bf16 activations, bf16 scale/zero): 4-bit resident,
                not bit-exact (activations and scales rounded to bf16). 4-bit codes only (Q4_0,
                Q4_1, Q4_K: K-quant group scales are multiplied out to per-32 scale/zero first).
                Calls with many rows (prefill chunks) read the codes back as a transient dense
                weight and run a plain GEMM instead: bf16 where native, fp32 on AVX2 (model/int4_cpu.py).
  "triton"      kvcli_kernels.int4_matmul on the canonical layout (CUDA; plain float group scale/min:
                fp16 from GGUF Q4_0/Q4_1; float32 where multiplied out once: a min = -zero * scale from
                AWQ / GPTQ / compressed-tensors, Q4_K's two-level scales and mins per group of 32).
  "triton-int8" 5/6/8-bit codes (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) through the same Triton kernels as int8
                codes [N, K] (q - offset) with a float32 scale (and min) per group of the file
                (16 for Q6_K): exact, one byte per weight (CUDA; K-quant two-level scales multiplied out).
  "int4-torch"  4-bit codes dequantized per call in plain torch: exact, slow (fallback).
  "int4x2-cpu"  5/6/8-bit codes (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) through the same int4 kernel: each code
                split into two nibbles, q = lo + 16 * hi, both in one kernel group of twice the
                file's group (model/int4_cpu.py, Int4x2Cpu); activations rearranged per call to [x_g, 16 x_g]
                per group. 8 bits per code + bf16 scale/zero per group resident (Q8_0 1.06x the
                file, Q5_* 1.5-1.64x, Q6_K 1.52x); about twice a Q4 matmul; not bit-exact (as int4-cpu).
  "lowbit-torch" 5/6/8-bit codes dequantized per call in plain torch: resident as in the file, exact,
                slow. The fallback where int4x2-cpu does not apply (rows not a multiple of 16, a
                group size the kernel refuses, non-CPU devices).
  "half-torch"  an fp16/bf16 weight from the file kept half precision, upcast per call.
  "dense"       weights dequantized once to the compute dtype (`--dequantize`): exact, 8x the bytes.
  "nf4"         a dense checkpoint weight quantized by bitsandbytes to NF4 (blocksize 64), or a
                bitsandbytes 4-bit checkpoint's NF4/FP4 weight as saved; bitsandbytes' matmul_4bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcli.model.bnb_4bit import Bnb4bitWeight
from kvcli.model import int8dot_cpu, native
from kvcli.model.int4_cpu import KERNEL_GROUPS, Int4Cpu, Int4x2Cpu
from kvcli.model.quant import QuantTensor


CPU_KERNEL_MODES = ("int8dot-cpu", "int4-cpu", "int4x2-cpu")  # the weight lives in self.int4


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Linear:
    """y = x @ W^T (+ b). Holds exactly one resident form of W."""

    def __init__(self, weight: QuantTensor | Bnb4bitWeight | torch.Tensor, bias: torch.Tensor | None, mode: str,
                 dtype: torch.dtype) -> None:
        self.mode = mode
        self.bias = None if bias is None else bias.to(dtype)
        if isinstance(weight, Bnb4bitWeight):  # a bitsandbytes 4-bit checkpoint: its own bytes, as saved
            self.quantized = True
            if mode == "dense":
                self.weight = weight.dequantize(dtype).contiguous()
                return
            self.mode = "nf4"
            self.out_features, self.in_features = weight.shape
            self.nf4, self.nf4_state = weight.packed, weight.state
            return
        self.quantized = isinstance(weight, QuantTensor)
        if mode == "nf4" and not self.quantized:
            try:
                import bitsandbytes.functional as bnbf
            except ImportError:
                raise ValueError("--quant nf4 needs bitsandbytes (pip install bitsandbytes), or use --quant int4|none") from None
            self.out_features, self.in_features = weight.shape
            self.nf4, self.nf4_state = bnbf.quantize_4bit(weight.to(dtype), blocksize=64, quant_type="nf4")
            return
        half = (not self.quantized and weight.dtype in (torch.float16, torch.bfloat16)
                and weight.dtype != dtype and weight.dim() == 2)
        if mode == "dense" or (not self.quantized and not half):
            w = weight.dequantize(dtype) if isinstance(weight, QuantTensor) else weight.to(dtype)
            self.mode, self.weight = "dense", w.contiguous()
            return
        self.out_features, self.in_features = weight.shape
        if half:
            self.mode, self.weight = "half-torch", weight.contiguous()
            return
        self.group_size = weight.group_size
        if mode not in ("triton", "int4-torch", "int4-cpu", "cpu"):
            raise ValueError(f"unknown linear mode {mode!r}")
        if mode == "cpu":  # the best CPU path: kvcli's kernel where it builds, else torch's int4 kernel
            if int8dot_cpu.supports(weight):
                self.mode, self.int4 = "int8dot-cpu", int8dot_cpu.Int8DotCpu(weight)
                return
            mode = self.mode = "int4-cpu"
        if weight.kind != "q4":
            if mode == "int4-cpu" and self.out_features % 16 == 0 and 2 * weight.group_size in KERNEL_GROUPS:
                self.mode, self.int4 = "int4x2-cpu", Int4x2Cpu(weight)
            elif mode == "triton" and weight.group_size in (16, 32, 64, 128):
                self.mode = "triton-int8"
                self.q8 = (weight.int8_codes().contiguous(), weight.group_scales(), weight.group_mins())
            else:
                self.mode, self.q = "lowbit-torch", weight
        elif mode == "int4-cpu" and self.out_features % 16 == 0 and weight.offset == 0:
            self.int4 = Int4Cpu(weight.unpack_codes(), weight.group_scales(), weight.group_mins(), weight.group_size)
        elif mode == "triton" and weight.with_float_min().plain_groups:
            self.q = weight.with_float_min()  # zero points, Q4_K's two levels, offsets: float32, once
        else:  # CPU rows not a multiple of 16, or a layout the Triton GEMM does not read
            self.mode, self.q = "int4-torch", weight

    @property
    def nbytes(self) -> int:
        if self.mode in ("dense", "half-torch"):
            return _nbytes(self.weight, self.bias)
        if self.mode in CPU_KERNEL_MODES:
            return self.int4.nbytes + _nbytes(self.bias)
        if self.mode == "nf4":
            return _nbytes(self.nf4, self.nf4_state.absmax, self.bias)
        if self.mode == "triton-int8":
            return _nbytes(*self.q8, self.bias)
        return self.q.nbytes + _nbytes(self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "dense":
            return F.linear(x, self.weight, self.bias)
        if self.mode in CPU_KERNEL_MODES:
            y = self.int4(x)
        elif self.mode == "nf4":
            import bitsandbytes as bnb

            y = bnb.matmul_4bit(x, self.nf4.t(), quant_state=self.nf4_state).to(x.dtype)
        elif self.mode == "triton":
            from kvcli_kernels.int4_gemm import int4_matmul

            y = int4_matmul(x, self.q.codes, self.q.scale, self.q.min, group_size=self.group_size)
        elif self.mode == "triton-int8":
            from kvcli_kernels.int4_gemm import int4_matmul

            y = int4_matmul(x, *self.q8, group_size=self.group_size)
        elif self.mode == "half-torch":
            y = F.linear(x, self.weight.to(x.dtype))
        else:
            y = F.linear(x, self.q.dequantize(x.dtype))
        return y if self.bias is None else y + self.bias


class LinearGroup:
    """Linears that would be one fused matmul (q/k/v, gate/up) but whose weights cannot be concatenated
    (e.g. Q4_K_M files: q/k in Q4_K, v in Q6_K): each part keeps its own form, outputs concatenated."""

    def __init__(self, parts: list[Linear], bias: torch.Tensor | None) -> None:
        self.parts = parts
        self.bias = bias
        self.mode = "+".join(dict.fromkeys(p.mode for p in parts))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts) + _nbytes(self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias


class Embedding:
    """Token embedding; a quantized table stays quantized and looked-up rows are dequantized (exactly);
    an fp16/bf16 table stays half precision."""

    def __init__(self, weight: QuantTensor | torch.Tensor, dtype: torch.dtype) -> None:
        self.dtype = dtype
        if isinstance(weight, QuantTensor):
            self.q: QuantTensor | None = weight
            self.weight = None
        else:
            self.q = None
            half = weight.dtype in (torch.float16, torch.bfloat16)
            self.weight = weight if half else weight.to(dtype)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes if self.q is not None else _nbytes(self.weight)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return self.q.dequantize(dtype) if self.q is not None else self.weight.to(dtype)  # type: ignore[union-attr]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.q is None:
            return F.embedding(ids, self.weight).to(self.dtype)  # type: ignore[arg-type]
        q = self.q
        if q.kind == "q8" and q.sub_scale is None:  # the common Q8_0 table: no repacking per lookup
            g = q.group_size
            rows = q.codes[ids].to(torch.float32).reshape(ids.shape[0], -1, g)
            return (rows * q.scale[ids].to(torch.float32).unsqueeze(-1)).reshape(ids.shape[0], -1).to(self.dtype)
        return q.rows(ids).dequantize(self.dtype)


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> None:
        self.weight = weight.to(dtype).contiguous()
        self.eps = eps
        # kvcli's one-pass C kernel for fp32 rows on CPU (kernels/cpu_rmsnorm.c): torch's rms_norm is
        # ~20 us of small ops per decode row, 60 per SmolLM2 step. None: torch's.
        self.native = None
        if self.weight.device.type == "cpu" and dtype == torch.float32 and native.native_enabled():
            from kvcli_kernels.cpu_rmsnorm import load

            self.native = load(native.native_isa(), native.build_dir())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dtype == torch.float32 and x.is_contiguous():
            from kvcli_kernels.cpu_rmsnorm import rmsnorm

            return rmsnorm(self.native, x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class SwiGLU:
    """silu(gate) * up over the fused gate/up projection's output [T, 2F] (gate first): kvcli's one-pass C
    kernel for fp32 rows on AVX2 builds (kernels/cpu_swiglu.c: torch's chunk + silu + mul_ are ~10 us of
    per-op overhead per decode row and layer), else torch's ops."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.native = None
        if device.type == "cpu" and dtype == torch.float32 and native.native_enabled() \
                and native.native_isa() != "generic":
            from kvcli_kernels.cpu_swiglu import load

            self.native = load(native.native_isa(), native.build_dir())

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native is not None and gate_up.dtype == torch.float32 and gate_up.stride(-1) == 1 \
                and gate_up.dim() == 2:
            from kvcli_kernels.cpu_swiglu import swiglu

            out = swiglu(self.native, gate_up)
            if out is not None:
                return out
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)


class Rotary:
    """Rotate-half RoPE with a precomputed cos/sin table indexed by absolute position.

    out = x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1]. The sign is folded into the
    table (sin_signed = [-sin, sin]: (-a) * b and a * (-b) are the same float), so rotate_half becomes a
    roll by half a head, and a forward gathers the rows of its positions once (`at`) for all layers."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 device: torch.device) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        inv_freq = _apply_rope_scaling(inv_freq, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.half = head_dim // 2
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)
        self.sin_signed = torch.cat([-self.sin[:, :self.half], self.sin[:, self.half:]], dim=-1)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows for these positions, [T, 1, D]: once per forward, shared by every layer."""
        return (self.cos[positions].unsqueeze(1).to(dtype), self.sin_signed[positions].unsqueeze(1).to(dtype))

    def apply(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, heads, D] (q and k heads side by side: one call for both) -> rotated, a new tensor."""
        cos, sin = cos_sin
        rolled = torch.roll(x, self.half, dims=-1)  # [x2, x1]
        out = x * cos
        out += rolled.mul_(sin)  # the same two roundings as x * cos + rotate_half(x) * sin
        return out


def _apply_rope_scaling(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":  # Llama 3.1: smooth interpolation between low and high frequency bands
        import math

        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}")
