"""Launcher of cpu_int8dot.c: y = x W^T with int8 activations against 4/5/6-bit weight codes (the file's
bits, interleaved by 8 rows) or 8-bit ones, or (many rows, AVX2) an fp32 GEMM over weight panels
dequantized on the fly.

Built at first use by cpu_build.py; `load(isa, cache_dir)` returns None, with the reason in
`load_error(isa)`, where there is no compiler or the build fails: callers fall back to torch's kernels.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvcli_kernels.cpu_build import build, build_error

_SOURCE = "cpu_int8dot.c"


# kvq_groups kinds (cpu_int8dot.c)
NONE, F16, F32, SUB, NEG_SUB, ZERO, SUB_I8 = range(7)


@dataclass
class Groups:
    """Per-group scales or mins as the kernel reads them, in the x8 order [N / 8, groups, 8] (groups_x8):
    F16 / F32 values; SUB / NEG_SUB uint8 multipliers `v` of an fp16 value per `per_super` groups (`sup`,
    [N / 8, groups / per_super, 8]), the K-quants' two levels, NEG_SUB negated; SUB_I8 int8 multipliers
    (Q6_K); ZERO uint8 zero points, min = -(zero * scale)."""
    kind: int
    v: torch.Tensor | None = None
    sup: torch.Tensor | None = None
    per_super: int = 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.v, self.sup) if t is not None)

    def args(self) -> tuple:
        return (self.kind, _ptr(self.v), _ptr(self.sup), self.per_super)


def load(isa: str, cache_dir: str) -> ctypes.CDLL | None:
    """The built library with its function signatures declared, or None (see cpu_build.build_error)."""
    lib = build(_SOURCE, isa, cache_dir)
    if lib is not None and not hasattr(lib, "_kvq_declared"):
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        groups = [i32, ptr, ptr, i64]
        gemm = [ptr, i64, i64, ptr, i32, i32, *groups, *groups, i64, i64, ptr, i64, i32]
        lib.kvq_linear.argtypes = [*gemm[:15], i32, *gemm[15:]]  # + one_level after the group size
        lib.kvq_linear.restype = i32
        lib.kvq_dequant.argtypes = [ptr, i32, i32, *groups, *groups, i64, i64, i64, i64, ptr, ptr, i32]
        lib.kvq_dequant.restype = None
        lib.kvq_pack.argtypes = [ptr, i64, i64, i32, ptr, i32]
        lib.kvq_pack.restype = None
        lib.kvq_gemm_f32.argtypes = gemm
        lib.kvq_gemm_f32.restype = i32
        lib.kvq_gemm_bf16.argtypes = gemm
        lib.kvq_gemm_bf16.restype = i32
        lib.kvq_gemm_i8.argtypes = gemm
        lib.kvq_gemm_i8.restype = i32
        lib.kvq_amx_enable.argtypes = [i32, i64, i32]
        lib.kvq_amx_enable.restype = i32
        lib._kvq_declared = True
    return lib


def load_error(isa: str) -> str | None:
    return build_error(_SOURCE, isa)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def weight_args(codes: torch.Tensor, bits: int, scale: Groups, mins: Groups, group_size: int,
                offset: int = 0, one_level: bool = False) -> tuple:
    """The weight's arguments of kvq_linear, built once per weight (pointers into tensors the caller keeps
    alive): per-call argument building was ~0.4 ms of a 13 ms decode step. offset: of unsigned codes (bits 4-6),
    w = d (q - offset) + m. one_level: kvq_linear rounds the activations as kvq_gemm_i8 does (one int8 level, two
    in outlier blocks; 4-bit codes with one scale per 32), so that a row's result is the same in both kernels;
    else two levels everywhere. The other entry points take the same tuple less one_level (form_args)."""
    return (codes.data_ptr(), bits, offset, *scale.args(), *mins.args(), group_size, int(one_level))


def form_args(weight: tuple) -> tuple:
    """The weight's form (weight_args less the rounding choice): kvq_dequant's and the GEMMs' arguments."""
    return weight[:-1]


def int8dot_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: tuple, out_features: int) -> torch.Tensor:
    """x fp32 [M, K] contiguous, `weight` from weight_args -> fp32 [M, N]."""
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32)
    rc = lib.kvq_linear(x.data_ptr(), m, k, *weight, out_features, y.data_ptr(), out_features, torch.get_num_threads())
    if rc == -3:
        bits, group_size, one_level = weight[1], weight[-2], weight[-1]
        rounding = " at one activation level" if one_level else ""
        raise ValueError(f"int8dot: no kernel loop for {bits}-bit codes in groups of {group_size} of this scale "
                         f"form{rounding}")
    if rc != 0:
        raise MemoryError(f"int8dot: no memory to quantize {m} x {k} activations")
    return y


def int8dot_gemm_f32(lib: ctypes.CDLL, x: torch.Tensor, weight: tuple, out_features: int) -> torch.Tensor | None:
    """x fp32 [M, K] contiguous -> fp32 [M, N] by the fp32 GEMM over weight panels dequantized on the fly
    (exact weights, fp32 products); None where the build has no such kernel (no AVX2 + FMA)."""
    return _panel_gemm(lib.kvq_gemm_f32, x, weight, out_features)


def int8dot_gemm_bf16(lib: ctypes.CDLL, x: torch.Tensor, weight: tuple, out_features: int) -> torch.Tensor | None:
    """x fp32 [M, K] contiguous -> fp32 [M, N] by the bf16 GEMM on AMX tiles over weight panels dequantized on
    the fly (the read-back's bf16 weights and activations, fp32 sums); None where there are no AMX-BF16 tiles
    (the CPU, Linux or the build)."""
    return _panel_gemm(lib.kvq_gemm_bf16, x, weight, out_features)


def int8dot_gemm_i8(lib: ctypes.CDLL, x: torch.Tensor, weight: tuple, out_features: int) -> torch.Tensor | None:
    """x fp32 [M, K] contiguous -> fp32 [M, N] by the integer GEMM with one int8 level of activations per block of
    32 (a second in blocks past IG_OUTLIER x the row's RMS; cpu_int8dot.c); None where the build has no such
    kernel (no AVX2) or the codes are not 4-bit."""
    return _panel_gemm(lib.kvq_gemm_i8, x, weight, out_features)


def _panel_gemm(fn, x: torch.Tensor, weight: tuple, out_features: int) -> torch.Tensor | None:
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32)
    codes, bits, offset, *groups, group_size = form_args(weight)
    rc = fn(x.data_ptr(), m, k, codes, bits, offset, *groups, group_size, out_features, y.data_ptr(), out_features,
            torch.get_num_threads())
    if rc == -2:
        return None
    if rc == -3:
        raise ValueError(f"int8dot: no GEMM loop for {bits}-bit codes in groups of {group_size}")
    if rc != 0:
        raise MemoryError("int8dot: no memory for the GEMM's weight panels")
    return y


def int8dot_dequant(lib: ctypes.CDLL, weight: tuple, out: torch.Tensor, first_row: int = 0) -> torch.Tensor:
    """Rows first_row .. first_row + len(out) of the weight, as out's dtype (fp32 or bf16), into `out`."""
    n, k = out.shape
    f32 = out.dtype == torch.float32
    lib.kvq_dequant(*form_args(weight), k, first_row, n, out.data_ptr() if f32 else None, None if f32 else out.data_ptr(),
                    torch.get_num_threads())
    return out


# Bytes per block of 8 rows x 32 k in the kernel's layout, by code bits (block_bytes() in cpu_int8dot.c).
BLOCK_BYTES = {4: 128, 5: 160, 6: 192, 8: 256}


def pack_x8_native(lib: ctypes.CDLL, q: torch.Tensor, bits: int) -> torch.Tensor:
    """pack_x8 by the library (kvq_pack): the same bytes, without the tensor passes."""
    if bits not in BLOCK_BYTES:
        raise ValueError(f"int8dot holds codes of {sorted(BLOCK_BYTES)} bits, not {bits}")
    n, k = q.shape
    q = q.contiguous()
    out = torch.empty(n // 8, k // 32 * BLOCK_BYTES[bits], dtype=torch.uint8)
    lib.kvq_pack(q.data_ptr(), n, k, bits, out.data_ptr(), torch.get_num_threads())
    return out.view(torch.int8) if bits == 8 else out


def pack_x8(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [N, K] (uint8 below 2^bits for bits 4-6, int8 for bits 8), N a multiple of 8 -> the kernel's
    interleaved layout (see cpu_int8dot.c): 8 rows side by side, 4 consecutive k per lane and step; for
    bits 5 and 6 the nibbles of bits 4, then the high bits (32 or 64 bytes per block)."""
    n, k = q.shape
    steps = q.reshape(n // 8, 8, k // 32, 8, 4).permute(0, 2, 3, 1, 4)  # [N/8, blocks, step, lane, 4]
    if bits == 8:
        return steps.contiguous().view(torch.int8).reshape(n // 8, -1)
    if bits == 4:
        return (steps[:, :, :4] | (steps[:, :, 4:] << 4)).contiguous().reshape(n // 8, -1)
    nib = (steps[:, :, :4] & 0x0F) | (steps[:, :, 4:] << 4)  # uint8: the high bits shift out
    high = (steps >> 4).reshape(n // 8, k // 32, 8, 32)  # [N/8, blocks, step, byte p = 4 lane + t]
    if bits == 5:  # bit s of byte p: bit 4 of step s's code there
        planes = [sum(high[:, :, s] << s for s in range(8)).to(torch.uint8)]
    else:  # bits 2 (s % 4) .. + 1 of byte 32 (s / 4) + p: its bits 4 and 5
        planes = [sum(high[:, :, 4 * h + u] << (2 * u) for u in range(4)).to(torch.uint8) for h in range(2)]
    return torch.cat([nib.reshape(n // 8, k // 32, 128), *planes], dim=-1).reshape(n // 8, -1)


def groups_x8(t: torch.Tensor) -> torch.Tensor:
    """Per-group scale or min [N, K / G] -> [N / 8, K / G, 8]."""
    n, g = t.shape
    return t.reshape(n // 8, 8, g).transpose(1, 2).contiguous()
