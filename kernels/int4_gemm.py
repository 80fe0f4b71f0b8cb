"""out = x @ W^T with W stored as group-wise affine INT4 (GGUF Q4_1 layout), dequantized in registers;
or with 8-bit integer codes (the 5/6/8-bit GGUF types: Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, codes minus their
offset held as int8).

  x      : [M, K] fp16 / bf16 / fp32
  codes  : uint8 [N, K // 2]; k = 2j is the LOW nibble of codes[n, j], k = 2j + 1 the HIGH nibble
           or int8 [N, K] (8-bit codes, one byte per weight)
  scale  : [N, K // G],  min : [N, K // G] or None (no min: Q8_0, Q6_K, Q5_0); fp16 / bf16 / fp32
  W[n, k] = scale[n, k // G] * q[n, k] + min[n, k // G]   (Q4_0 is min = -8 * scale),
           G in {32, 64, 128}, and 16 for 8-bit codes (Q6_K)
  out    : [M, N] in x's dtype, fp32 accumulation

Kernels, each with optional split-K over an fp32 workspace (deterministic, no atomics):
  * GEMV (M <= 8, decode): pure weight streaming, no tensor cores. A program owns BLOCK_N output
    columns for all M rows; each [BLOCK_N, BLOCK_K] tile of codes is loaded as K-contiguous 16-byte
    vectors and reduced against every x row per quantization group on the raw codes, the group's
    scale and min applied to the group sums: scale * (q_g . x_g) + min * sum(x_g) (three CUDA-core
    operations per weight and row instead of five).
  * GEMM (M > 8): tiled tl.dot with grouped tile ordering for L2 reuse. Each [BLOCK_N, BLOCK_K] weight
    tile is dequantized in registers (fp32 FMA, rounded to the dot's 16-bit type) and fed to one
    tl.dot that accumulates in place, so the tensor cores run whole BLOCK_K steps and the pipeline
    stays full (the first GPU run measured the per-group form below at 17 % of copy bandwidth for
    M = 16: a K = 32 dot per group and an fp32 rescale of the whole tile after each).
  * GEMM "codes" form (kept for comparison, gemm="codes"): per quantization group
    scale * (x_g @ q_g) + min * rowsum(x_g) (llama.cpp's Q4_1 dot) on the raw 0..15 codes, exact in
    16-bit, nothing dequantized per weight.
Split-K is picked when the output tiles alone cannot fill the SMs (small M and N); the partial
sums are reduced and cast by _splitk_reduce_kernel.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["int4_matmul", "int4_launch_config", "GEMM_FORMS"]

GEMV_MAX_M = 8
_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAGIC = tl.constexpr(0x4B000000)  # the bits of 2.0**23: an integer 0 <= v < 2**23 OR-ed into its mantissa reads as 2**23 + v


@triton.jit
def _codes_f32(c, CODE_BITS: tl.constexpr):
    """Codes as exact fp32 values without int-to-float conversions: uint8 nibble pairs [R, C] -> [R, 2C] in k
    order (low nibble first), or int8 codes [R, C] -> [R, C]. Each code is placed in the mantissa of 2**23
    (an integer OR or add, full rate) and 2**23 subtracted (exact); the I2F conversion this replaces runs
    at a quarter or less of the FMA rate on sm_90 and was the GEMV's bottleneck (64 I2F per 64 FFMA)."""
    if CODE_BITS == 8:
        v = c.to(tl.int32) + (_MAGIC + 128)  # -128..127 -> 2**23 + 0..255
        return v.to(tl.float32, bitcast=True) - 8388736.0
    lo = (c & 0xF).to(tl.int32) | _MAGIC
    hi = (c >> 4).to(tl.int32) | _MAGIC
    return tl.interleave(lo, hi).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid in grouped order: GROUP_M row tiles sweep the same weight
    columns back to back, so a weight tile is read once from HBM and then from L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_m = (pid // num_pid_in_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % num_pid_in_group) % group_rows, (pid % num_pid_in_group) // group_rows


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    min_ptr,
    out_ptr,  # [M, N] (SPLIT_K == False) or fp32 workspace [S, M, N]
    M,
    N,
    K,
    k_per_split,  # multiple of BLOCK_K
    stride_xm,
    stride_xk,
    stride_cn,
    stride_cj,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_om,
    stride_on,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # M padded to a power of two (<= 8): rows are unrolled
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    CODE_BITS: tl.constexpr = 4,  # 4: packed nibbles; 8: int8 codes, stride_cj per k
    HAS_MIN: tl.constexpr = True,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    n64 = offs_n.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    k_lo = pid_k * k_per_split
    # Both bounds are multiples of GROUP_SIZE (>= 32): telling the compiler keeps the K masks
    # constant over 16-byte vectors, so the loads vectorise instead of going byte by byte.
    k_hi = tl.multiple_of(tl.minimum(k_lo + k_per_split, K), GROUP_SIZE)
    j_hi = tl.multiple_of(k_hi // 2, GROUP_SIZE // 2)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(0, tl.cdiv(k_hi - k_lo, BLOCK_K)):
        k0 = tl.multiple_of(k_lo + kt * BLOCK_K, BLOCK_K)
        offs_j = tl.max_contiguous(tl.multiple_of(k0 // 2 + tl.arange(0, BLOCK_K // 2), BLOCK_K // 2), BLOCK_K // 2)
        offs_g = k0 // GROUP_SIZE + tl.arange(0, BLOCK_K // GROUP_SIZE)
        offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        k_valid = offs_k < k_hi
        if CODE_BITS == 8:
            q = _codes_f32(tl.load(
                codes_ptr + n64[:, None] * stride_cn + offs_k[None, :] * stride_cj,
                mask=n_valid[:, None] & k_valid[None, :],
                other=0,
            ), 8)  # [BLOCK_N, BLOCK_K]
        else:
            c = tl.load(
                codes_ptr + n64[:, None] * stride_cn + offs_j[None, :] * stride_cj,
                mask=n_valid[:, None] & (offs_j[None, :] < j_hi),
                other=0,
            )
            q = _codes_f32(c, 4)  # [BLOCK_N, BLOCK_K] in k order
        g_mask = n_valid[:, None] & (offs_g[None, :] < tl.cdiv(k_hi, GROUP_SIZE))
        s = tl.load(scale_ptr + n64[:, None] * stride_sn + offs_g[None, :] * stride_sg, mask=g_mask,
                    other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K // GROUP_SIZE]
        if HAS_MIN:
            z = tl.load(min_ptr + n64[:, None] * stride_zn + offs_g[None, :] * stride_zg, mask=g_mask,
                        other=0.0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            x_mask = k_valid & (tl.full([BLOCK_K], m, tl.int32) < M)  # rows past M read as 0 (vector form for the interpreter)
            xm = tl.load(x_ptr + m * stride_xm + offs_k * stride_xk, mask=x_mask, other=0.0).to(tl.float32)
            # Per group: q_g . x_g on the raw codes, then the group's affine part on the sums.
            dots = tl.sum(tl.reshape(q * xm[None, :], [BLOCK_N, BLOCK_K // GROUP_SIZE, GROUP_SIZE]), 2)
            gsum = dots * s
            if HAS_MIN:
                xs = tl.sum(tl.reshape(xm, [BLOCK_K // GROUP_SIZE, GROUP_SIZE]), 1)  # sum(x_g)
                gsum += z * xs[None, :]
            part = tl.sum(gsum, 1)  # [BLOCK_N]
            acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)

    mask = (offs_m[:, None] < M) & n_valid[None, :]
    if SPLIT_K:
        ws = out_ptr + (pid_k.to(tl.int64) * M + offs_m[:, None]) * N + n64[None, :]
        tl.store(ws, acc, mask=mask)
    else:
        o = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + n64[None, :] * stride_on
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    min_ptr,
    out_ptr,  # [M, N] (SPLIT_K == False) or fp32 workspace [S, M, N]
    M,
    N,
    K,
    k_per_split,  # multiple of BLOCK_K
    stride_xm,
    stride_xk,
    stride_cn,
    stride_cj,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_om,
    stride_on,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of GROUP_SIZE
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    COMPUTE_F32: tl.constexpr,  # fp32 x (or bf16 under the interpreter): fp32 operands, 3xTF32 dot
    CODE_BITS: tl.constexpr = 4,  # 4: packed nibbles; 8: int8 codes
    HAS_MIN: tl.constexpr = True,
):
    """acc += x_tile @ dequant(W_tile)^T over BLOCK_K steps: the [BLOCK_N, BLOCK_K] tile of codes is loaded
    K-contiguous (16-byte vectors along each weight row), dequantized in fp32 (scale * q + min), rounded to
    x's 16-bit type and consumed by one tl.dot that accumulates into acc."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < M
    n_valid = offs_n < N
    m64 = offs_m.to(tl.int64)
    n64 = offs_n.to(tl.int64)
    k_lo = pid_k * k_per_split
    # Both bounds are multiples of GROUP_SIZE: the K masks are constant over each group's vectors.
    k_hi = tl.multiple_of(tl.minimum(k_lo + k_per_split, K), GROUP_SIZE)
    j_hi = tl.multiple_of(k_hi // 2, GROUP_SIZE // 2)
    dot_ty = tl.float32 if COMPUTE_F32 else x_ptr.dtype.element_ty

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(0, tl.cdiv(k_hi - k_lo, BLOCK_K)):
        k0 = tl.multiple_of(k_lo + kt * BLOCK_K, BLOCK_K)
        offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        k_valid = offs_k < k_hi
        x = tl.load(x_ptr + m64[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        if CODE_BITS == 8:
            q = _codes_f32(tl.load(codes_ptr + n64[:, None] * stride_cn + offs_k[None, :] * stride_cj,
                                   mask=n_valid[:, None] & k_valid[None, :], other=0), 8)  # [BLOCK_N, BLOCK_K]
        else:
            offs_j = tl.max_contiguous(tl.multiple_of(k0 // 2 + tl.arange(0, BLOCK_K // 2), BLOCK_K // 2),
                                       BLOCK_K // 2)
            c = tl.load(codes_ptr + n64[:, None] * stride_cn + offs_j[None, :] * stride_cj,
                        mask=n_valid[:, None] & (offs_j[None, :] < j_hi), other=0)
            q = _codes_f32(c, 4)  # [BLOCK_N, BLOCK_K] in k order
        offs_g = k0 // GROUP_SIZE + tl.arange(0, BLOCK_K // GROUP_SIZE)
        g_mask = n_valid[:, None] & (offs_g[None, :] < tl.cdiv(k_hi, GROUP_SIZE))
        s = tl.load(scale_ptr + n64[:, None] * stride_sn + offs_g[None, :] * stride_sg, mask=g_mask, other=0.0)
        w = tl.reshape(q, [BLOCK_N, BLOCK_K // GROUP_SIZE, GROUP_SIZE]) * s.to(tl.float32)[:, :, None]
        if HAS_MIN:
            z = tl.load(min_ptr + n64[:, None] * stride_zn + offs_g[None, :] * stride_zg, mask=g_mask, other=0.0)
            w = w + z.to(tl.float32)[:, :, None]
        w = tl.reshape(w, [BLOCK_N, BLOCK_K]).to(dot_ty)
        acc = tl.dot(x.to(dot_ty), tl.trans(w), acc, input_precision="tf32x3" if COMPUTE_F32 else "tf32")

    mask = m_valid[:, None] & n_valid[None, :]
    if SPLIT_K:
        ws = out_ptr + (pid_k.to(tl.int64) * M + m64[:, None]) * N + n64[None, :]
        tl.store(ws, acc, mask=mask)
    else:
        o = out_ptr + m64[:, None] * stride_om + n64[None, :] * stride_on
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_gemm_codes_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    min_ptr,
    out_ptr,  # [M, N] (SPLIT_K == False) or fp32 workspace [S, M, N]
    M,
    N,
    K,
    k_per_split,  # multiple of BLOCK_K
    stride_xm,
    stride_xk,
    stride_cn,
    stride_cj,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_om,
    stride_on,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of GROUP_SIZE; each group is one tl.dot
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    COMPUTE_F32: tl.constexpr,  # fp32 x (or bf16 under the interpreter): fp32 operands, 3xTF32 dot
    CODE_BITS: tl.constexpr = 4,  # 4: packed nibbles; 8: int8 codes (exact in fp16 / bf16 too)
    HAS_MIN: tl.constexpr = True,
):
    """Per quantization group: acc += scale * (x_g @ q_g) + min * rowsum(x_g)   (as llama.cpp's Q4_1 dot).

    The raw codes 0..15 are exact in fp16/bf16, so the tensor-core dot runs on the codes themselves
    and the affine part is applied to the [BLOCK_M, BLOCK_N] partial in fp32: no per-weight
    dequantization and no rounding of dequantized weights to 16 bits.
    """
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < M
    n_valid = offs_n < N
    m64 = offs_m.to(tl.int64)
    n64 = offs_n.to(tl.int64)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    dot_ty = tl.float32 if COMPUTE_F32 else x_ptr.dtype.element_ty

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(0, tl.cdiv(k_hi - k_lo, BLOCK_K)):
        k0 = tl.multiple_of(k_lo + kt * BLOCK_K, BLOCK_K)
        for gi in tl.static_range(BLOCK_K // GROUP_SIZE):
            kg = k0 + gi * GROUP_SIZE  # K is a multiple of GROUP_SIZE: a group is all valid or all masked
            offs_k = tl.max_contiguous(tl.multiple_of(kg + tl.arange(0, GROUP_SIZE), GROUP_SIZE), GROUP_SIZE)
            offs_j = tl.max_contiguous(
                tl.multiple_of(kg // 2 + tl.arange(0, GROUP_SIZE // 2), GROUP_SIZE // 2), GROUP_SIZE // 2
            )
            # Group-granular K masks (splats): constant along K, so the loads stay vectorised.
            k_ok = tl.full([GROUP_SIZE], kg, tl.int32) < k_hi
            j_ok = tl.full([GROUP_SIZE // 2], kg, tl.int32) < k_hi
            x = tl.load(
                x_ptr + m64[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                mask=m_valid[:, None] & k_ok[None, :],
                other=0.0,
            )
            if CODE_BITS == 8:
                q = tl.load(  # [GROUP_SIZE, BLOCK_N], bytes contiguous along dim 0
                    codes_ptr + n64[None, :] * stride_cn + offs_k[:, None] * stride_cj,
                    mask=n_valid[None, :] & k_ok[:, None],
                    other=0,
                )
            else:
                c = tl.load(  # [GROUP_SIZE // 2, BLOCK_N], bytes contiguous along dim 0
                    codes_ptr + n64[None, :] * stride_cn + offs_j[:, None] * stride_cj,
                    mask=n_valid[None, :] & j_ok[:, None],
                    other=0,
                )
                # (j, nibble, n) -> row k = 2j + nibble
                q = tl.reshape(tl.permute(tl.join(c & 0xF, c >> 4), (0, 2, 1)), [GROUP_SIZE, BLOCK_N])
            g_mask = n_valid & (tl.full([BLOCK_N], kg, tl.int32) < k_hi)  # (vector form: the interpreter rejects scalar masks)
            g = kg // GROUP_SIZE
            s = tl.load(scale_ptr + n64 * stride_sn + g * stride_sg, mask=g_mask, other=0.0).to(tl.float32)
            xq = tl.dot(x.to(dot_ty), q.to(dot_ty), input_precision="tf32x3" if COMPUTE_F32 else "tf32")
            acc += xq * s[None, :]
            if HAS_MIN:
                z = tl.load(min_ptr + n64 * stride_zn + g * stride_zg, mask=g_mask, other=0.0).to(tl.float32)
                acc += tl.sum(x.to(tl.float32), 1)[:, None] * z[None, :]

    mask = m_valid[:, None] & n_valid[None, :]
    if SPLIT_K:
        ws = out_ptr + (pid_k.to(tl.int64) * M + m64[:, None]) * N + n64[None, :]
        tl.store(ws, acc, mask=mask)
    else:
        o = out_ptr + m64[:, None] * stride_om + n64[None, :] * stride_on
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, out_ptr, M, N, MN, num_splits, stride_om, stride_on, BLOCK: tl.constexpr):
    """out = sum over the split axis of ws [S, M, N] (MN = M * N, passed as i64 when large)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    ptrs = ws_ptr + offs
    for _ in range(num_splits):  # fixed order: bitwise reproducible
        acc += tl.load(ptrs, mask=valid, other=0.0)
        ptrs += MN
    m = offs // N
    n = offs % N
    tl.store(out_ptr + m * stride_om + n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=valid)


# Kernels built for the Triton interpreter (TRITON_INTERPRET=1 at import time) cannot run bf16 dots.
_INTERPRETED = not isinstance(_int4_gemm_kernel, triton.runtime.JITFunction)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:  # cached: launchers run per layer per step
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 1


GEMM_FORMS = ("dequant", "codes")  # the M > 8 kernels (module doc); "dequant" is the default


def int4_launch_config(M: int, N: int, K: int, group_size: int, num_sms: int,
                       gemm: str = "dequant") -> dict[str, int | bool]:
    """Tile shape and split-K count (and, for M > 8, which GEMM kernel: GEMM_FORMS).

    Chosen from sm_90 compiles (no spills, vectorised/async loads); the GEMV and the "codes" GEMM were
    timed on an H200 (docs/kernels.md), the "dequant" GEMM's tiles not yet.
    """
    if M <= GEMV_MAX_M:
        block_m = triton.next_power_of_2(M)
        # 512 K per iteration = 256 code bytes per row: one or two 16-byte loads per thread.
        block_k = max(512, group_size)
        block_n, warps = (16, 4) if block_m <= 2 else (16, 8)
        cfg: dict[str, int | bool] = dict(gemv=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                          num_warps=warps, num_stages=2)
        tiles = triton.cdiv(N, block_n)
        target = 4 * num_sms  # pure streaming: several CTAs per SM keep enough bytes in flight
        min_iters = 2
    elif gemm == "dequant":
        # Weight streaming up to M = 64 (one row tile covers M): 64 x 64 weight tiles keep the dequantized
        # fp32 tile at 32 registers a thread over 4 warps; prefill-sized M gets 128 x 128 output tiles.
        if M <= 64:
            block_m, block_n, block_k, warps, stages = max(16, triton.next_power_of_2(M)), 64, 64, 4, 4
        else:
            block_m, block_n, block_k, warps, stages = 128, 128, 64, 8, 3
        block_k = max(block_k, group_size)
        cfg = dict(gemv=False, gemm=gemm, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                   num_warps=warps, num_stages=stages)
        tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
        target = 2 * num_sms
        min_iters = 4
    elif gemm == "codes":
        if M <= 16:
            block_m, block_n, block_k, warps = 16, 64, 128, 4
        elif M <= 32:
            block_m, block_n, block_k, warps = 32, 64, 128, 4
        elif M <= 64:  # 8 warps: with 4, triton 3.6 needs 255 registers and spills
            block_m, block_n, block_k, warps = 64, 64, 64, 8
        else:  # one group per iteration: 64 spills on triton 3.6 (as on the H200 image)
            block_m, block_n, block_k, warps = 128, 64, 32, 8
        block_k = max(block_k, group_size)
        cfg = dict(gemv=False, gemm=gemm, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                   num_warps=warps, num_stages=3)
        tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
        target = 2 * num_sms
        min_iters = 4
    else:
        raise ValueError(f"gemm must be one of {', '.join(GEMM_FORMS)}; got {gemm!r}")
    k_iters = triton.cdiv(K, int(cfg["BLOCK_K"]))
    # Split K only when the output tiles alone leave SMs idle; keep a few K-iterations per split.
    split = 1 if tiles >= target else max(1, min(triton.cdiv(target, tiles), k_iters // min_iters, 32))
    cfg["split_k"] = split
    return cfg


def _split_plan(K: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(number of K slices, K per slice); slices are whole BLOCK_K tiles and never empty."""
    k_iters = triton.cdiv(K, block_k)
    split = max(1, min(split_k, k_iters))
    k_per_split = triton.cdiv(k_iters, split) * block_k
    return triton.cdiv(K, k_per_split), k_per_split


def int4_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    min: torch.Tensor | None,
    group_size: int = 32,
    *,
    out: torch.Tensor | None = None,
    split_k: int | None = None,
    gemm: str = "dequant",
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, W dequantized on the fly from INT4 codes, or from int8
    codes when `codes` is int8 [N, K] (see module doc). min None: no min term.

    split_k: None = automatic, 1 = off, n = exactly n K-slices (rounded to whole BLOCK_K tiles).
    out: optional preallocated [M, N] output (x's dtype).
    gemm: the M > 8 kernel (GEMM_FORMS); config: tile fields (BLOCK_N, BLOCK_K, num_warps, num_stages)
    that replace the launch config's, for benchmark sweeps (BLOCK_K a multiple of the group size).
    """
    mins = min  # the parameter name follows the brief/GGUF; builtin min() is not used below
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K]; got shape {tuple(x.shape)}")
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"x must be float16/bfloat16/float32; got {x.dtype}")
    bits = 8 if codes.dtype == torch.int8 else 4
    if group_size not in ((16, 32, 64, 128) if bits == 8 else (32, 64, 128)):
        raise ValueError(f"group_size must be 32, 64 or 128 (or 16 for int8 codes); got {group_size}")
    M, K = x.shape
    if K % group_size:
        raise ValueError(f"K={K} must be a multiple of group_size={group_size}")
    if codes.dim() != 2 or (bits == 4 and (codes.dtype != torch.uint8 or codes.shape[1] * 2 != K)) \
            or (bits == 8 and codes.shape[1] != K):
        raise ValueError(f"codes must be uint8 [N, K//2={K // 2}] or int8 [N, K={K}]; got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    N = codes.shape[0]
    for name, t in (("scale", scale), ("min", mins)):
        if t is None and name == "min":
            continue
        if t is None or t.shape != (N, K // group_size):
            raise ValueError(f"{name} must be [N={N}, K//G={K // group_size}]; got "
                             f"{None if t is None else tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{name} must be a float tensor (fp16 in GGUF); got {t.dtype}")
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != x.dtype:
        raise ValueError(f"out must be [{M}, {N}] {x.dtype}; got {tuple(out.shape)} {out.dtype}")
    devices = {t.device for t in (x, codes, scale, mins, out) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(str(d) for d in devices)}")
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()

    cfg = int4_launch_config(M, N, K, group_size, _num_sms(x.device), gemm)
    if config:
        bad = set(config) - {"BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}
        if bad or config.get("BLOCK_K", group_size) % group_size:
            raise ValueError(f"config takes BLOCK_N, BLOCK_K (a multiple of {group_size}), num_warps, num_stages; "
                             f"got {config}")
        cfg.update(config)
    if split_k is not None:
        if split_k < 1:
            raise ValueError(f"split_k must be >= 1 or None; got {split_k}")
        cfg["split_k"] = split_k
    block_k = int(cfg["BLOCK_K"])
    split, k_per_split = _split_plan(K, block_k, int(cfg["split_k"]))
    use_ws = split > 1
    target = torch.empty((split, M, N), dtype=torch.float32, device=x.device) if use_ws else out
    has_min = mins is not None
    mins = mins if has_min else scale  # not read without HAS_MIN
    args = (
        x, codes, scale, mins, target, M, N, K, k_per_split,
        *x.stride(), *codes.stride(), *scale.stride(), *mins.stride(), *out.stride(),
    )
    if cfg["gemv"]:
        grid = (triton.cdiv(N, int(cfg["BLOCK_N"])), split)
        _int4_gemv_kernel[grid](
            *args,
            GROUP_SIZE=group_size, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
            SPLIT_K=use_ws, CODE_BITS=bits, HAS_MIN=has_min, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    else:
        grid = (triton.cdiv(M, int(cfg["BLOCK_M"])) * triton.cdiv(N, int(cfg["BLOCK_N"])), split)
        kernel = _int4_gemm_kernel if cfg["gemm"] == "dequant" else _int4_gemm_codes_kernel
        kernel[grid](
            *args,
            GROUP_SIZE=group_size, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
            GROUP_M=cfg["GROUP_M"], SPLIT_K=use_ws,
            COMPUTE_F32=x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and _INTERPRETED),
            CODE_BITS=bits, HAS_MIN=has_min, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    if use_ws:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](
            target, out, M, N, M * N, split, *out.stride(), BLOCK=block, num_warps=4
        )
    return out
