"""Launcher of cpu_decode_layers.c: every decoder layer of a decode step in one call, through the kernels of
cpu_int8dot.c, cpu_rmsnorm.c, cpu_rope_kv.c, cpu_attention.c and cpu_swiglu.c (function pointers from their
loaded libraries). Built at first use by cpu_build.py; `load` returns None where it cannot be built."""

from __future__ import annotations

import ctypes

import torch

from kvcli_kernels.cpu_build import build, check_structs

_SOURCE = "cpu_decode_layers.c"
_ptr, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
STEPS = {1: "a linear (no memory for its activations, or a weight form without a kernel loop)", 2: "rotary / KV store (a position or slot out of range)",
         3: "attention (no memory, or a shape it does not read)"}


class Part(ctypes.Structure):
    """cpu_decode_layers.c's kvd_part: kvcli_kernels.cpu_int8dot.weight_args and N."""

    _fields_ = [("codes", _ptr), ("bits", _i64), ("offset", _i64), ("scale_kind", _i64), ("scale", _ptr), ("scale_sup", _ptr),
                ("scale_per", _i64), ("min_kind", _i64), ("mins", _ptr), ("min_sup", _ptr), ("min_per", _i64),
                ("group_size", _i64), ("one_level", _i64), ("n", _i64), ("int8_min_rows", _i64)]


MAX_PARTS = 3  # KVD_PARTS


class Linear(ctypes.Structure):
    """cpu_decode_layers.c's kvd_linear: one projection as up to MAX_PARTS weights side by side."""

    _fields_ = [("nparts", _i64), ("n", _i64), ("part", Part * MAX_PARTS)]


class Layer(ctypes.Structure):
    _fields_ = [("attn_norm", _ptr), ("ffn_norm", _ptr), ("qkv", Linear), ("o", Linear), ("gate_up", Linear),
                ("down", Linear), ("k", _ptr), ("v", _ptr), ("ks", _ptr), ("vs", _ptr), ("cache", _ptr),
                ("q_norm", _ptr), ("k_norm", _ptr), ("attn_post_norm", _ptr), ("ffn_post_norm", _ptr), ("cos", _ptr), ("sin_signed", _ptr), ("step", _ptr),
                ("slots", _ptr), ("qkv_bias", _ptr)]


class Model(ctypes.Structure):
    _fields_ = [("linear", _ptr), ("rmsnorm", _ptr), ("rope_kv", _ptr), ("attention", _ptr), ("swiglu", _ptr),
                ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("hidden", _i64), ("ffn", _i64),
                ("eps", _f32), ("cos", _ptr), ("sin_signed", _ptr), ("table_rows", _i64),
                ("kv_dtype", _i64), ("block_size", _i64), ("num_slots", _i64), ("k_sb", _i64), ("k_st", _i64),
                ("k_sh", _i64), ("v_sb", _i64), ("v_st", _i64), ("v_sh", _i64), ("s_sb", _i64), ("s_st", _i64),
                ("s_sh", _i64), ("gemm_i8", _ptr)]


def load(isa: str, cache_dir: str) -> ctypes.CDLL | None:
    lib = build(_SOURCE, isa, cache_dir)
    if lib is not None and not hasattr(lib, "_kvd_declared"):
        if check_structs(lib, _SOURCE, isa, "kvd_struct_size", [Part, Linear, Layer, Model]) is None:
            return None
        lib.kvd_decode_layers.argtypes = [_ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _int]
        lib.kvd_decode_layers.restype = _int
        lib._kvd_declared = True
    return lib


def address(fn: ctypes._CFuncPtr) -> int:  # type: ignore[name-defined]
    """A loaded C function's address, for the Model struct."""
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def linear_args(parts: list[tuple[tuple, int, int]]) -> Linear:
    """From each part's kvcli_kernels.cpu_int8dot.weight_args(...), output features and the rows from which its
    route takes kvq_gemm_i8 (0: never), in output order."""
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"a linear of {len(parts)} parts (1 to {MAX_PARTS})")
    held = (Part * MAX_PARTS)(*(Part(*weight, n, int8_rows) for weight, n, int8_rows in parts))
    return Linear(len(parts), sum(n for _, n, _ in parts), held)


def scratch_floats(rows: int, model: Model) -> int:
    q = model.heads * model.head_dim
    return rows * (2 * model.hidden + (model.heads + 2 * model.kv_heads) * model.head_dim + 2 * q + 3 * model.ffn)


def decode_layers(lib: ctypes.CDLL, model: Model, layers: ctypes.Array, h: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, step_ref: object, scratch: torch.Tensor) -> None:
    """h fp32 [T, hidden] contiguous, updated in place through every layer; positions / slots int64 [T]
    contiguous; step_ref: the attention's per-step arguments (DecodeStep.ref); scratch fp32 of at least
    scratch_floats(T, model). RuntimeError naming the layer and step that failed."""
    rc = lib.kvd_decode_layers(ctypes.addressof(model), ctypes.addressof(layers), len(layers), h.data_ptr(),
                               h.shape[0], positions.data_ptr(), slots.data_ptr(), step_ref, scratch.data_ptr(),
                               torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"decode layers: layer {rc // 16 - 1}: {STEPS.get(rc % 16, f'error {rc % 16}')}")
