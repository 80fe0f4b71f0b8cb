"""GGUF Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K blocks -> QuantTensor, without dequantizing.

Each decoder reads the integer codes exactly as gguf-py's `dequantize_blocks` lays them out (the same
reshapes and shifts, in torch) and re-packs them into kvcli's canonical layout (quant.py): low
nibbles, a high-bit plane for 5/6-bit codes, and the file's own scales (two-level for K-quants), so
QuantTensor.dequantize reproduces gguf-py's float32 results bit for bit and the resident bytes stay
within a few percent of the file's.

Block layouts (bytes):
  Q5_0  (22 per 32)   d fp16, qh u32 (bit i = bit 4 of element i), qs[16] (as Q4_0)
  Q5_1  (24 per 32)   d fp16, m fp16, qh u32, qs[16]
  Q4_K (144 per 256)  d fp16, dmin fp16, scales[12] (8 x 6-bit sc, 8 x 6-bit m), qs[128]
  Q5_K (176 per 256)  d, dmin, scales[12], qh[32], qs[128]
  Q6_K (210 per 256)  ql[128], qh[64], scales int8[16], d fp16
"""

from __future__ import annotations

import torch

from kvcli.model.quant import QuantTensor, pack_nibbles

QK_K = 256

# GGML type name -> (elements per block, bytes per block) for the types decoded here.
BLOCKS = {"Q5_0": (32, 22), "Q5_1": (32, 24), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] fp16 (little-endian, as stored)."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _shifts(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device)


def _pack_hi(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [N, K] -> the canonical plane of their bits above the low nibble."""
    n, k = q.shape
    h = (q >> 4).reshape(n, -1, 8 // (bits - 4))
    out = torch.zeros(h.shape[:2], dtype=torch.uint8, device=q.device)
    for i in range(h.shape[-1]):
        out |= h[..., i] << (i * (bits - 4))
    return out


def _low_bit(q: torch.Tensor, bits: int, **fields) -> QuantTensor:
    """[N, K] uint8 codes (element order) + scale fields -> QuantTensor of kind q4/q5/q6."""
    kind = {4: "q4", 5: "q5", 6: "q6"}[bits]
    hi = None if bits == 4 else _pack_hi(q, bits)
    return QuantTensor(kind, pack_nibbles(q & 0x0F), hi=hi, **fields)


def _q5_legacy(blocks: torch.Tensor, n: int, k: int, has_min: bool) -> QuantTensor:
    nb = k // 32
    off = 4 if has_min else 2
    d = _f16(blocks[..., 0:2]).reshape(n, nb).clone()
    m = _f16(blocks[..., 2:4]).reshape(n, nb).clone() if has_min else None
    qh = blocks[..., off:off + 4]  # little-endian u32: bit i of byte j is element 8 j + i
    hi = ((qh.unsqueeze(-1) >> _shifts(list(range(8)), blocks.device)) & 1).reshape(n, nb, 32)
    qs = blocks[..., off + 4:]
    lo = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # element j low nibble, j + 16 high nibble
    q = (lo | (hi << 4)).reshape(n, k)
    # Q5_0: w = d * (q - 16); Q5_1: w = d * q + m (gguf-py's order in both).
    return _low_bit(q, 5, scale=d, min=m, group_size=32, offset=0 if has_min else 16)


def from_gguf_q5_0(raw: torch.Tensor, n: int, k: int) -> QuantTensor:
    return _q5_legacy(raw.reshape(n, k // 32, 22), n, k, has_min=False)


def from_gguf_q5_1(raw: torch.Tensor, n: int, k: int) -> QuantTensor:
    return _q5_legacy(raw.reshape(n, k // 32, 24), n, k, has_min=True)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 12] packed 6-bit scales and mins -> ([..., 8], [..., 8]) uint8 (gguf-py's get_scale_min)."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, m_d = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 128] -> [..., 256]: qs[32 c + j] holds element 64 c + j (low) and 64 c + 32 + j (high)."""
    lead = qs.shape[:-1]
    q = qs.reshape(*lead, 4, 1, 32) >> _shifts([0, 4], qs.device).reshape(2, 1)
    return (q & 0x0F).reshape(*lead, QK_K)


def _k_affine(blocks: torch.Tensor, n: int, k: int, bits: int) -> QuantTensor:
    nb = k // QK_K
    d = _f16(blocks[..., 0:2]).reshape(n, nb).clone()
    dmin = _f16(blocks[..., 2:4]).reshape(n, nb).clone()
    sc, mn = _k_scale_min(blocks[..., 4:16])
    if bits == 4:
        q = _k_low_nibbles(blocks[..., 16:])
    else:
        qh = blocks[..., 16:48]  # bit i of qh[j] is bit 4 of element 32 i + j
        hi = (qh.unsqueeze(-2) >> _shifts(list(range(8)), blocks.device).reshape(8, 1)) & 1
        q = _k_low_nibbles(blocks[..., 48:]) | (hi.reshape(n, nb, QK_K) << 4)
    # w = (d * sc) * q - (dmin * m), one 32-element group per (sc, m).
    return _low_bit(q.reshape(n, k), bits, scale=d, min=dmin, group_size=32,
                    sub_scale=sc.reshape(n, nb * 8).contiguous(), sub_min=mn.reshape(n, nb * 8).contiguous())


def from_gguf_q4_k(raw: torch.Tensor, n: int, k: int) -> QuantTensor:
    return _k_affine(raw.reshape(n, k // QK_K, 144), n, k, 4)


def from_gguf_q5_k(raw: torch.Tensor, n: int, k: int) -> QuantTensor:
    return _k_affine(raw.reshape(n, k // QK_K, 176), n, k, 5)


def from_gguf_q6_k(raw: torch.Tensor, n: int, k: int) -> QuantTensor:
    nb = k // QK_K
    blocks = raw.reshape(n, nb, 210)
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    sc = blocks[..., 192:208].contiguous().view(torch.int8).reshape(n, nb * 16)
    d = _f16(blocks[..., 208:210]).reshape(n, nb).clone()
    # Element 128 h + 64 s + j: nibble s of ql[64 h + j]; element 128 h + 32 t + j: bits 2t of qh[32 h + j].
    lo = (ql.reshape(n, nb, 2, 1, 64) >> _shifts([0, 4], raw.device).reshape(2, 1)) & 0x0F
    hi = (qh.reshape(n, nb, 2, 1, 32) >> _shifts([0, 2, 4, 6], raw.device).reshape(4, 1)) & 0x03
    q = (lo.reshape(n, nb, QK_K) | (hi.reshape(n, nb, QK_K) << 4)).reshape(n, k)
    # w = (d * sc) * (q - 32), 16-element groups.
    return _low_bit(q, 6, scale=d, min=None, group_size=16, offset=32, sub_scale=sc.contiguous())
