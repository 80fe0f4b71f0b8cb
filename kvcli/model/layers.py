"""Model building blocks: linears over INT4 / dense weights, embedding, RMSNorm, SwiGLU, rotary embedding.

A Linear builds the one form its plan names (kvcli/model/weight_plan.py decides the form and the row-count
route of every weight; FORMS there lists them) and keeps only what that form's matmul needs:
  "int8dot-cpu"   Int8DotCpu (model/int8dot_cpu.py): the file's codes, int8 activations
  "int4-cpu"      Int4Cpu (model/int4_cpu.py): torch's packed int4 form, bf16 scale/zero
  "int4x2-cpu"    Int4x2Cpu: 5/6/8-bit codes as two nibbles each in the same form
  "triton"        the canonical 4-bit layout with float mins, for kvcli_kernels.int4_matmul (CUDA)
  "triton-int8"   5/6/8-bit codes as int8 [N, K] (q - offset) with float32 group scale (and min)
  "dequant-torch" the QuantTensor as loaded, dequantized per call (exact, slow)
  "half-torch"    an fp16/bf16 weight from the file, upcast per call
  "dense"         the weight in the compute dtype
  "nf4"           bitsandbytes NF4 (a dense weight quantized at load, or a 4-bit checkpoint's as saved)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvcli.model.bnb_4bit import Bnb4bitWeight
from kvcli.model import rope
from kvcli.model.int4_cpu import Int4Cpu, Int4x2Cpu
from kvcli.model.quant import QuantTensor
from kvcli.native import registry

if TYPE_CHECKING:
    from kvcli.model.weight_plan import LinearPlan
    from kvcli.native.capabilities import CpuCapabilities


CPU_KERNEL_FORMS = ("int8dot-cpu", "int4-cpu", "int4x2-cpu")  # the weight lives in self.kernel


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Linear:
    """y = x @ W^T (+ b). Holds exactly one resident form of W: the one `plan` names."""

    def __init__(self, weight: QuantTensor | Bnb4bitWeight | torch.Tensor, bias: torch.Tensor | None,
                 plan: "LinearPlan", dtype: torch.dtype) -> None:
        self.plan = plan
        self.mode = form = plan.form
        self.bias = None if bias is None else bias.to(dtype)
        self.quantized = isinstance(weight, (QuantTensor, Bnb4bitWeight))
        if form != "dense":
            self.out_features, self.in_features = weight.shape
        if form == "dense":
            w = weight.dequantize(dtype) if isinstance(weight, (QuantTensor, Bnb4bitWeight)) else weight.to(dtype)
            self.weight = w.contiguous()
        elif form == "nf4":
            if isinstance(weight, Bnb4bitWeight):
                self.nf4, self.nf4_state = weight.packed, weight.state
            else:
                try:
                    import bitsandbytes.functional as bnbf
                except ImportError:
                    raise ValueError("--quant nf4 needs bitsandbytes (pip install bitsandbytes), "
                                     "or use --quant int4|none") from None
                self.nf4, self.nf4_state = bnbf.quantize_4bit(weight.to(dtype), blocksize=64, quant_type="nf4")
        elif form == "half-torch":
            self.weight = weight.contiguous()
        elif form == "int8dot-cpu":
            from kvcli.model.int8dot_cpu import Int8DotCpu

            self.kernel = Int8DotCpu(weight, route=plan.route)
        elif form == "int4-cpu":
            self.kernel = Int4Cpu(weight.unpack_codes(), weight.group_scales(), weight.group_mins(), weight.group_size,
                                  route=plan.route)
        elif form == "int4x2-cpu":
            self.kernel = Int4x2Cpu(weight)
        elif form == "triton":
            self.q = weight.with_float_min()  # zero points, Q4_K's two levels, offsets: float32, once
        elif form == "triton-int8":
            self.q8 = (weight.int8_codes().contiguous(), weight.group_scales(), weight.group_mins())
        elif form == "dequant-torch":
            self.q = weight
        else:
            raise ValueError(f"unknown linear form {form!r}")
        if isinstance(weight, QuantTensor):
            self.group_size = weight.group_size

    @property
    def nbytes(self) -> int:
        if self.mode in ("dense", "half-torch"):
            return _nbytes(self.weight, self.bias)
        if self.mode in CPU_KERNEL_FORMS:
            return self.kernel.nbytes + _nbytes(self.bias)
        if self.mode == "nf4":
            return _nbytes(self.nf4, self.nf4_state.absmax, self.bias)
        if self.mode == "triton-int8":
            return _nbytes(*self.q8, self.bias)
        return self.q.nbytes + _nbytes(self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "dense":
            return F.linear(x, self.weight, self.bias)
        if self.mode in CPU_KERNEL_FORMS:
            y = self.kernel(x)
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


def planned_linear(weight: QuantTensor | Bnb4bitWeight | torch.Tensor, bias: torch.Tensor | None, tier: str,
                   dtype: torch.dtype, caps: "CpuCapabilities | None" = None, row_invariant: bool = False) -> Linear:
    """One Linear planned for this machine under `tier` (tests, benchmarks and one-off tools; a model plans
    all its weights at once, kvcli/model/weight_plan.py)."""
    from kvcli.model.weight_plan import Native, plan_linear
    from kvcli.native.capabilities import capabilities

    device = (weight.codes if isinstance(weight, QuantTensor) else weight).device \
        if isinstance(weight, (QuantTensor, torch.Tensor)) else torch.device("cpu")
    plan = plan_linear(weight, tier, dtype, caps or capabilities(), Native.here(device, torch.float32),
                       row_invariant=row_invariant, bias=bias is not None)
    return Linear(weight, bias, plan, dtype)


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
        self.packed = None  # the vocabulary projection's kernel copy of this (tied, quantized) table, when shared
        if isinstance(weight, QuantTensor):
            self.q: QuantTensor | None = weight
            self.weight = None
        else:
            self.q = None
            half = weight.dtype in (torch.float16, torch.bfloat16)
            self.weight = weight if half else weight.to(dtype)

    def share(self, packed) -> bool:
        """Look rows up from `packed` (the vocabulary projection's Int8DotCpu of this same tied table) and drop
        this copy: one copy of the weight held. The kernel's read-back of a row is the table's exact
        dequantization bit for bit, for every form it holds (Q8_0, Q6_K, Q4_K, ...: test_int8dot_cpu's
        test_read_back_equals_dequantize). False (nothing changed) for a float table or another shape."""
        q = self.q
        if q is None or tuple(q.shape) != (packed.out_features, packed.in_features):
            return False
        self.packed, self.q = packed, None
        return True

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return 0  # held once, by the vocabulary projection
        return self.q.nbytes if self.q is not None else _nbytes(self.weight)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.dense(torch.float32).clone().to(dtype)
        return self.q.dequantize(dtype) if self.q is not None else self.weight.to(dtype)  # type: ignore[union-attr]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            from kvcli_kernels.cpu_int8dot import int8dot_dequant

            p = self.packed
            out = torch.empty(ids.shape[0], p.in_features, dtype=torch.float32)
            for i, row in enumerate(ids.tolist()):
                int8dot_dequant(p.lib, p.args, out[i:i + 1], row)
            return out if self.dtype == torch.float32 else out.to(self.dtype)
        if self.q is None:
            return F.embedding(ids, self.weight).to(self.dtype)  # type: ignore[arg-type]
        q = self.q
        if q.kind == "q8" and q.sub_scale is None:  # the common Q8_0 table: no repacking per lookup
            g = q.group_size
            rows = q.codes[ids].to(torch.float32).reshape(ids.shape[0], -1, g)
            return (rows * q.scale[ids].to(torch.float32).unsqueeze(-1)).reshape(ids.shape[0], -1).to(self.dtype)
        return q.rows(ids).dequantize(self.dtype)


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype, native: bool = False) -> None:
        """native: kvcli's one-pass C kernel for fp32 rows on CPU (kernels/cpu_rmsnorm.c; the weight plan
        says whether it loaded): torch's rms_norm is ~20 us of small ops per decode row, 60 per SmolLM2
        step."""
        self.weight = weight.to(dtype).contiguous()
        self.eps = eps
        self.native = registry.library("rmsnorm") if native and self.weight.device.type == "cpu" else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dtype == torch.float32 and x.is_contiguous():
            from kvcli_kernels.cpu_rmsnorm import rmsnorm

            return rmsnorm(self.native, x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class SwiGLU:
    """act(gate) * up over the fused gate/up projection's output [T, 2F] (gate first), act silu (SwiGLU) or
    gelu_tanh (GeGLU: Gemma; transformers' gelu_pytorch_tanh, ggml's gelu): kvcli's one-pass C kernel for
    fp32 rows on AVX2 builds (kernels/cpu_swiglu.c: torch's chunk + act + mul_ are ~10 us of per-op overhead
    per decode row and layer), else torch's ops."""

    def __init__(self, native: bool = False, act: str = "silu") -> None:
        """native: the weight plan found the C kernel (fp32 compute on the CPU, a SIMD build)."""
        self.native = registry.library("swiglu") if native else None
        self.act = act

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native is not None and gate_up.dtype == torch.float32 and gate_up.stride(-1) == 1 \
                and gate_up.dim() == 2:
            from kvcli_kernels.cpu_swiglu import swiglu

            out = swiglu(self.native, gate_up, self.act)
            if out is not None:
                return out
        gate, up = gate_up.chunk(2, dim=-1)
        if self.act == "silu":
            return F.silu(gate).mul_(up)
        return F.gelu(gate, approximate="tanh").mul_(up)


def rotary_table_bytes(config, positions: int | None = None) -> int:
    """The bytes LlamaModel's rotary tables take for `config`, before anything loads (plan, inspect): cos and
    signed sin in fp32 for every position a request can reach (`positions`: the engine's --max-model-len, by
    default the model's context), one pair per rotary (Gemma 3's local layers have their own)."""
    pairs = 1 if config.local_rope_theta is None else 2
    return pairs * 2 * (positions or config.max_position_embeddings) * config.head_dim * 4


class Rotary:
    """Rotate-half RoPE with a precomputed cos/sin table indexed by absolute position.

    out = x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1]. The sign is folded into the
    table (sin_signed = [-sin, sin]: (-a) * b and a * (-b) are the same float), so rotate_half becomes a
    roll by half a head, and a forward gathers the rows of its positions once (`at`) for all layers.
    Frequencies and the attention factor (folded into both tables, as llama.cpp's mscale) come from
    kvcli.model.rope: every backend reads these tables, so every rotary scaling reaches all of them."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 device: torch.device, rows: int | None = None) -> None:
        # The frequencies follow the model's context (max_positions: a long-context scaling picks its factors by
        # it); the tables hold the `rows` positions a request can reach (the engine's max_model_len), not more.
        inv_freq, self.attention_factor = rope.frequencies(head_dim, theta, scaling, max_positions)
        t = torch.arange(rows or max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.half = head_dim // 2
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        # Two tables, not three: sin's halves are equal (emb repeats freqs), so sin_signed holds it.
        self.cos = cos.to(device)
        self.sin_signed = torch.cat([-sin[:, :self.half], sin[:, self.half:]], dim=-1).to(device)

    @property
    def nbytes(self) -> int:
        """The tables' bytes (held for every position a request can reach)."""
        return self.cos.nbytes + self.sin_signed.nbytes

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

    def shift_keys(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys already rotated at positions p, [N, kv_heads, D] (rotate-half layout), rotated to p - delta:
        R(p - delta) = R(-delta) R(p), the pure rotation. Its angles are the tables' row delta (the rotation by
        +delta, computed as every position's was), divided by the attention factor the tables fold in (the
        stored keys carry it once already); turning by -delta flips the sign of the sines. fp32 math, k's
        dtype back; llama.cpp's context shift (K-shift)."""
        cos = self.cos[delta].to(k.device, torch.float32) / self.attention_factor  # cos(-delta f) = cos(delta f)
        sin_signed = -self.sin_signed[delta].to(k.device, torch.float32) / self.attention_factor
        return self.apply(k.to(torch.float32), (cos, sin_signed)).to(k.dtype)
