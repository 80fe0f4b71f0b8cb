"""Decode steps through every decoder layer in one C call (kernels/cpu_decode_layers.c) instead of ten
Python-level kernel calls per layer.

At batch 1 on 2 cores a SmolLM2 layer's arithmetic is ~0.2 ms, and the Python around its kernel calls
(argument conversion, tensor allocation, dispatch checks) took ~30 % of the main thread (perf, 2026-12-01).
The C loop calls the same kernels with the same arguments in the same order, so logits are the per-op
path's bit for bit (tests/test_native_decode.py compares them). It applies only where every piece
already takes kvcli's C kernel: every layer's linears int8dot-cpu without bias but q/k/v's (Qwen2's, added after
the projection as Linear adds it) (a Linear, or a LinearGroup of up to three such parts written side by side, as a
Q4_K_M file's q/k/v), native RMSNorm (also Qwen3's
and Gemma 3's per-head q/k norms and Gemma 3's norms after attention and MLP) and SwiGLU or GeGLU, per-layer
rotary tables and windows (Gemma 3's local layers),
fp32 compute; per step: every request decodes one token or a few (a speculative verification of 1 + k rows,
each row a decode query of its own length: torch_backend._native_rows_step), fewer rows than the linears' float-GEMM
threshold, a cache the rotary/KV-store and attention kernels read (fp32 / fp16 / bf16, int8 / fp8 with their scales), the torch
backend's native attention. Anything else goes layer by layer.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvcli.native import registry
from kvcli.native.scratch import scratch

if TYPE_CHECKING:
    from kvcli.attention.base import AttentionBackend, AttentionMetadata
    from kvcli.kvcache.kv_cache import KVCache

# a projection's int8dot-cpu parts: (weight_args(...), output features, rows from which kvq_gemm_i8 takes it or 0)
Parts = tuple[tuple[tuple, int, int], ...]


@dataclass(frozen=True)
class DecodeLayer:
    """One decoder layer as the C loop reads it."""

    attn_norm: torch.Tensor  # fp32 [hidden]
    ffn_norm: torch.Tensor
    qkv: Parts
    o: Parts
    gate_up: Parts
    down: Parts
    q_norm: torch.Tensor | None = None  # fp32 [head_dim]: Qwen3's / Gemma 3's per-head q/k RMSNorm, or None
    k_norm: torch.Tensor | None = None
    attn_post_norm: torch.Tensor | None = None  # Gemma 3: on the attention / MLP output before the add
    ffn_post_norm: torch.Tensor | None = None
    cos: torch.Tensor | None = None  # this layer's rotary tables (Gemma 3's local layers), None: the model's
    sin_signed: torch.Tensor | None = None
    window: int = 0  # this layer's sliding window (0: the whole context)
    qkv_bias: torch.Tensor | None = None  # fp32 [q + k + v features]: Qwen2's q/k/v biases, or None


@dataclass(frozen=True)
class DecodeModel:
    """What LlamaModel.decode_description exports: shapes, the rotary tables and every layer."""

    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    ffn: int
    eps: float
    cos: torch.Tensor  # fp32 [positions, head_dim]
    sin_signed: torch.Tensor
    scale: float  # softmax scale
    layers: tuple[DecodeLayer, ...]
    max_rows: int | None  # steps of at least this many rows go layer by layer (None: any)
    act: str = "silu"  # the MLP's gate: silu (kvs_swiglu) or gelu_tanh (kvs_geglu)


class NativeDecode:
    def __init__(self, desc: DecodeModel, lib: ctypes.CDLL) -> None:
        self.desc = desc
        self.lib = lib
        self.max_rows = desc.max_rows or 1 << 30  # below the linears' float-GEMM threshold
        self._keep: dict = {}
        self._plans: dict[int, tuple[weakref.ref, object, ctypes.Array, list]] = {}

    @staticmethod
    def build(desc: DecodeModel) -> "NativeDecode | None":
        """None where the one-call library does not load (the weight plan decided the rest)."""
        lib = registry.library("decode_layers")
        return None if lib is None else NativeDecode(desc, lib)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: "KVCache", meta: "AttentionMetadata",
                 backend: "AttentionBackend") -> bool:
        """Runs every layer on h (fp32 [T, hidden], in place) and returns True, or returns False untouched
        where this step does not qualify (the caller runs the layers itself)."""
        t = h.shape[0]
        if t >= self.max_rows or not h.is_contiguous():
            return False
        d = self.desc
        plan = backend.native_decode_plan(meta, kv_cache.layers, d.heads, d.scale)
        if plan is None:
            return False
        step, views = plan
        entry = self._plan_for(kv_cache, views)
        if entry is None:
            return False
        from kvcli_kernels.cpu_decode_layers import decode_layers, scratch_floats

        model_args, layers = entry[1], entry[2]
        group_of = kv_cache.groups.group_of
        kinds = {(g, layer.window) for g, layer in zip(group_of, d.layers)} - {(0, meta.sliding_window)}
        if kinds:  # layers of another window or KV group than the step's (Gemma's local ones): their own step
            from dataclasses import replace

            # one layer of each kind: the plan's checks need a cache, and only its step is taken (a Gemma 3 has
            # a KV group per pair of local layers: every layer's view for each of them was ~60 look-ups a step)
            one = {}
            for g, layer, cache in zip(group_of, d.layers, kv_cache.layers):
                one.setdefault((g, layer.window), cache)
            steps, slots_of = {}, {}
            for g, w in kinds:
                gm = meta.for_group(g)
                other = backend.native_decode_plan(replace(gm, sliding_window=w), [one[g, w]], d.heads, d.scale)
                if other is None:
                    return False
                steps[g, w] = other[0]
                if g:
                    slots_of[g] = gm.slot_mapping.to(torch.int64).contiguous()
            for i, (g, layer) in enumerate(zip(group_of, d.layers)):
                step_i = steps.get((g, layer.window))
                layers[i].step = None if step_i is None else ctypes.addressof(step_i.args)
                layers[i].slots = slots_of[g].data_ptr() if g else None
            self._keep = (steps, slots_of)  # the steps' buffers and the slots live until the next call
        buf = scratch("native-decode", (scratch_floats(t, model_args),), torch.float32)
        pos = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        decode_layers(self.lib, model_args, layers, h, pos, slots, step.ref, buf)
        return True

    def _plan_for(self, kv_cache: "KVCache", views: list) -> tuple | None:
        """The C structs for this cache (built once per KVCache; None where its format is not written by
        the rotary/KV-store kernel)."""
        key = id(kv_cache)
        entry = self._plans.get(key)
        if entry is not None and entry[0]() is kv_cache and all(a is b for a, b in zip(entry[3], views)):
            return entry
        from kvcli_kernels import cpu_decode_layers as D
        from kvcli_kernels.cpu_rope_kv import DTYPE_CODES, cache_supported, scale_args

        first = kv_cache.layers[0]
        if not cache_supported(first.k, first.v, first.k_scale, first.v_scale):
            return None
        libs = self._libs()  # (the views come from the backend only for a dtype kva_decode runs: _cache_view)
        if libs is None:
            return None
        *libs, libs_gemm = libs
        d = self.desc
        k = first.k
        scale_strides = scale_args(first.k_scale, first.v_scale)[2:]  # every layer's alike (checked below)
        model_args = D.Model(
            *libs, d.heads, d.kv_heads, d.head_dim, d.hidden, d.ffn, d.eps, d.cos.data_ptr(), d.sin_signed.data_ptr(),
            d.cos.shape[0], DTYPE_CODES[k.dtype], k.shape[1], k.shape[0] * k.shape[1], k.stride(0), k.stride(1),
            k.stride(2), first.v.stride(0), first.v.stride(1), first.v.stride(2), *scale_strides, libs_gemm)
        layers = (D.Layer * len(d.layers))()
        for i, (layer, cache, view) in enumerate(zip(d.layers, kv_cache.layers, views)):
            if (cache.k.stride() != k.stride() or cache.v.stride() != first.v.stride() or cache.k.dtype != k.dtype
                    or scale_args(cache.k_scale, cache.v_scale)[2:] != scale_strides):
                return None
            layers[i] = D.Layer(layer.attn_norm.data_ptr(), layer.ffn_norm.data_ptr(),
                                *(D.linear_args(list(parts)) for parts in (layer.qkv, layer.o, layer.gate_up, layer.down)),
                                cache.k.data_ptr(), cache.v.data_ptr(), *scale_args(cache.k_scale, cache.v_scale)[:2],
                                ctypes.addressof(view.args),
                                *(_ptrs(layer.q_norm, layer.k_norm, layer.attn_post_norm, layer.ffn_post_norm,
                                        layer.cos, layer.sin_signed)), None, None, *_ptrs(layer.qkv_bias))
        # views hold the cache tensors and the kva_cache structs the layer array points into
        entry = (weakref.ref(kv_cache, lambda _, key=key: self._plans.pop(key, None)), model_args, layers, list(views))
        self._plans[key] = entry
        return entry

    def _libs(self) -> tuple[int, ...] | None:
        """Addresses of kvq_linear, kvq_rmsnorm, kvr_rope_kv, kva_decode, kvs_swiglu (or kvs_geglu), kvq_gemm_i8."""
        from kvcli_kernels.cpu_decode_layers import address

        libs = [registry.library(n) for n in ("int8dot", "rmsnorm", "rope_kv", "attention", "swiglu")]
        if any(lib is None for lib in libs):
            return None
        int8dot, norm, rope, attn, swiglu = libs
        act = swiglu.kvs_swiglu if self.desc.act == "silu" else swiglu.kvs_geglu
        return (address(int8dot.kvq_linear), address(norm.kvq_rmsnorm), address(rope.kvr_rope_kv),
                address(attn.kva_decode), address(act), address(int8dot.kvq_gemm_i8))


def _ptrs(*tensors: torch.Tensor | None) -> tuple[int | None, ...]:
    """Data pointers for the C structs, None (NULL) for what a layer does not have."""
    return tuple(None if t is None else t.data_ptr() for t in tensors)
