"""Decode steps through every decoder layer in one C call (kernels/cpu_decode_layers.c) instead of ten
Python-level kernel calls per layer.

At batch 1 on 2 cores a SmolLM2 layer's arithmetic is ~0.2 ms, and the Python around its kernel calls
(argument conversion, tensor allocation, dispatch checks) took ~30 % of the main thread (perf, 2026-12-01).
The C loop calls the same kernels with the same arguments in the same order, so logits are the per-op
path's bit for bit (tests/test_native_decode.py compares them). It applies only where every piece
already takes kvcli's C kernel: every layer's linears int8dot-cpu without bias (a Linear, or a LinearGroup
of up to three such parts written side by side, as a Q4_K_M file's q/k/v), native RMSNorm and SwiGLU,
fp32 compute; per step: every request decodes one token, fewer rows than the linears' float-GEMM
threshold, a cache the rotary/KV-store and attention kernels read (fp32 / fp16 / bf16), the torch
backend's native attention. Anything else goes layer by layer.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING

import torch

from kvcli.model import native

if TYPE_CHECKING:
    from kvcli.attention.base import AttentionMetadata
    from kvcli.kvcache.kv_cache import KVCache
    from kvcli.model.llama import LlamaModel


class NativeDecode:
    def __init__(self, model: "LlamaModel", lib: ctypes.CDLL, max_rows: int) -> None:
        self.model = model
        self.lib = lib
        self.max_rows = max_rows  # below the linears' float-GEMM threshold: kvq_linear at every row count
        self._plans: dict[int, tuple[weakref.ref, object, ctypes.Array, list]] = {}
        self._scratch = torch.empty(0)

    @staticmethod
    def build(model: "LlamaModel") -> "NativeDecode | None":
        """None unless every layer runs on kvcli's C kernels (see the module docstring)."""
        if not native.native_enabled() or native.native_isa() == "generic" or model.dtype != torch.float32 \
                or model.device.type != "cpu" or model.swiglu.native is None:
            return None
        rows = []
        for layer in model.layers:
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                parts = _parts(lin)
                if parts is None:
                    return None
                rows += [p.int4.dense_min_rows for p in parts]
            if layer.attn_norm.native is None or layer.ffn_norm.native is None:
                return None
        from kvcli_kernels.cpu_decode_layers import load

        lib = load(native.native_isa(), native.build_dir())
        if lib is None:
            return None
        return NativeDecode(model, lib, min((r for r in rows if r is not None), default=1 << 30))

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: "KVCache", meta: "AttentionMetadata",
                 backend: object) -> bool:
        """Runs every layer on h (fp32 [T, hidden], in place) and returns True, or returns False untouched
        where this step does not qualify (the caller runs the layers itself)."""
        t = h.shape[0]
        if t >= self.max_rows or not h.is_contiguous():
            return False
        plan_fn = getattr(backend, "native_decode_plan", None)
        writer = getattr(backend, "rope_kv_writer", None)
        if plan_fn is None or writer is None:
            return False
        m, c = self.model, self.model.config
        plan = plan_fn(meta, kv_cache.layers, c.num_heads, m.scale)
        if plan is None:
            return False
        step, views = plan
        entry = self._plan_for(kv_cache, views)
        if entry is None:
            return False
        from kvcli_kernels.cpu_decode_layers import decode_layers, scratch_floats

        model_args, layers = entry[1], entry[2]
        need = scratch_floats(t, model_args)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        pos = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        decode_layers(self.lib, model_args, layers, h, pos, slots, step.ref, self._scratch)
        return True

    def _plan_for(self, kv_cache: "KVCache", views: list) -> tuple | None:
        """The C structs for this cache (built once per KVCache; None where its format is not written by
        the rotary/KV-store kernel)."""
        key = id(kv_cache)
        entry = self._plans.get(key)
        if entry is not None and entry[0]() is kv_cache and all(a is b for a, b in zip(entry[3], views)):
            return entry
        from kvcli_kernels import cpu_decode_layers as D
        from kvcli_kernels.cpu_rope_kv import DTYPE_CODES, cache_supported

        first = kv_cache.layers[0]
        if first.k_scale is not None or not cache_supported(first.k, first.v):
            return None
        libs = self._libs()
        if libs is None:
            return None
        m, c = self.model, self.model.config
        k = first.k
        model_args = D.Model(
            *libs, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size,
            m.layers[0].attn_norm.eps, m.rotary.cos.data_ptr(), m.rotary.sin_signed.data_ptr(), m.rotary.cos.shape[0],
            DTYPE_CODES[k.dtype], k.shape[1], k.shape[0] * k.shape[1], k.stride(0), k.stride(1), k.stride(2),
            first.v.stride(0), first.v.stride(1), first.v.stride(2))
        layers = (D.Layer * len(m.layers))()
        for i, (layer, cache, view) in enumerate(zip(m.layers, kv_cache.layers, views)):
            if cache.k.stride() != k.stride() or cache.v.stride() != first.v.stride() or cache.k.dtype != k.dtype:
                return None
            layers[i] = D.Layer(layer.attn_norm.weight.data_ptr(), layer.ffn_norm.weight.data_ptr(),
                                *(D.linear_args([(p.int4.args, p.out_features) for p in _parts(lin) or ()])
                                  for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)),
                                cache.k.data_ptr(), cache.v.data_ptr(), ctypes.addressof(view.args))
        # views hold the cache tensors and the kva_cache structs the layer array points into
        entry = (weakref.ref(kv_cache, lambda _, key=key: self._plans.pop(key, None)), model_args, layers, list(views))
        self._plans[key] = entry
        return entry

    def _libs(self) -> tuple[int, ...] | None:
        """Addresses of kvq_linear, kvq_rmsnorm, kvr_rope_kv, kva_decode, kvs_swiglu."""
        from kvcli.attention.torch_backend import native_attention, native_rope_kv
        from kvcli.model.int8dot_cpu import native_library
        from kvcli_kernels.cpu_decode_layers import address

        int8dot, rope, attn = native_library(), native_rope_kv(), native_attention()
        norm, swiglu = self.model.layers[0].attn_norm.native, self.model.swiglu.native
        if None in (int8dot, rope, attn, norm, swiglu):
            return None
        return (address(int8dot.kvq_linear), address(norm.kvq_rmsnorm), address(rope.kvr_rope_kv),
                address(attn.kva_decode), address(swiglu.kvs_swiglu))


def _parts(lin: object) -> list | None:
    """The int8dot-cpu weights a layer linear is made of, in output order (a LinearGroup's parts: a Q4_K_M
    file's q/k in Q4_K and v in Q6_K), or None where the C loop cannot run it (another mode, a bias, more
    parts than it holds)."""
    from kvcli.model.layers import Linear, LinearGroup
    from kvcli_kernels.cpu_decode_layers import MAX_PARTS

    if isinstance(lin, LinearGroup):
        parts = lin.parts if lin.bias is None and len(lin.parts) <= MAX_PARTS else None
    else:
        parts = [lin]
    if parts is None or not all(isinstance(p, Linear) and p.mode == "int8dot-cpu" and p.bias is None for p in parts):
        return None
    return list(parts)
