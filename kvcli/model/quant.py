"""Quantized weight tensors in kvcli's canonical (lossless) layouts.

Group-wise affine INT4 (GGUF Q4_0 / Q4_1):
    codes uint8 [N, K // 2]   element k = 2j in the low nibble of codes[n, j], k = 2j + 1 in the high
    scale fp16 [N, K // G]    min fp16 [N, K // G]
    w[n, k] = scale[n, k // G] * q[n, k] + min[n, k // G]     (Q4_0: min = -8 * scale)
Symmetric INT8 (GGUF Q8_0):
    codes int8 [N, K]         scale fp16 [N, K // G]            w = scale * q

Dequantization follows gguf-py's order of float32 operations, so kvcli's dense weights are
bit-identical to the ones transformers builds from the same file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantTensor:
    kind: str  # "q4" (affine int4) or "q8" (symmetric int8)
    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    group_size: int = 32

    @property
    def shape(self) -> tuple[int, int]:
        n = self.codes.shape[0]
        k = self.codes.shape[1] * (2 if self.kind == "q4" else 1)
        return (n, k)

    @property
    def nbytes(self) -> int:
        tensors = [self.codes, self.scale] + ([self.min] if self.min is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def unpack_codes(self) -> torch.Tensor:
        """Integer codes as uint8 [N, K] (0..15 for q4, raw int8 for q8)."""
        if self.kind == "q8":
            return self.codes
        lo = self.codes & 0x0F
        hi = self.codes >> 4
        return torch.stack([lo, hi], dim=-1).reshape(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        g = self.group_size
        q = self.unpack_codes().reshape(n, k // g, g).to(torch.float32)
        d = self.scale.to(torch.float32).unsqueeze(-1)
        w = q * d
        if self.min is not None:
            w = w + self.min.to(torch.float32).unsqueeze(-1)
        return w.reshape(n, k).to(dtype)

    def rows(self, index: torch.Tensor) -> "QuantTensor":
        """A row subset (used to un-permute q/k heads and to split fused tensors)."""
        return QuantTensor(
            self.kind,
            self.codes[index].contiguous(),
            self.scale[index].contiguous(),
            None if self.min is None else self.min[index].contiguous(),
            self.group_size,
        )

    def to(self, device: torch.device | str) -> "QuantTensor":
        return QuantTensor(
            self.kind,
            self.codes.to(device),
            self.scale.to(device),
            None if self.min is None else self.min.to(device),
            self.group_size,
        )

    @staticmethod
    def cat(parts: list["QuantTensor"]) -> "QuantTensor":
        """Concatenate along N (fused qkv, gate/up); all parts share K, kind and group size."""
        first = parts[0]
        if any(p.kind != first.kind or p.group_size != first.group_size for p in parts):
            raise ValueError("cannot fuse quantized tensors of different kinds")
        mins = [p.min for p in parts]
        return QuantTensor(
            first.kind,
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            None if first.min is None else torch.cat(mins),  # type: ignore[arg-type]
            first.group_size,
        )


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in 0..15 -> canonical packed [N, K // 2]."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def quantize_q4(w: torch.Tensor, group_size: int = 32) -> QuantTensor:
    """Asymmetric group-wise INT4 (Q4_1 style) of a dense [N, K] weight; lossy by nature."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo = g.amin(-1)
    hi = g.amax(-1)
    d = ((hi - lo) / 15).to(torch.float16)
    m = lo.to(torch.float16)
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d.float())
    q = torch.round((g - m.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(0, 15)
    return QuantTensor("q4", pack_nibbles(q.reshape(n, k)), d, m, group_size)


def random_q4(n: int, k: int, std: float, generator: torch.Generator, group_size: int = 32) -> QuantTensor:
    """Random INT4 weights with roughly `std` spread, for dummy models (no weights to download)."""
    raw = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
    # Uniform codes in 0..15 have std ~4.6, centred on 7.5.
    scale = torch.full((n, k // group_size), std / 4.6, dtype=torch.float16)
    mn = (-7.5 * scale.float()).to(torch.float16)
    return QuantTensor("q4", raw, scale, mn, group_size)


# --- GGUF block decoding -------------------------------------------------------------------------
# Q4_0 block (18 B): d fp16, qs[16]; Q4_1 block (20 B): d fp16, m fp16, qs[16]. In both, qs[j] holds
# element j in its low nibble and element j + 16 in its high nibble. Q8_0 block (34 B): d, qs int8[32].


def _gguf_q4_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[N, nb, 16] GGUF nibble bytes -> canonical packed [N, nb * 16]."""
    n, nb, _ = qs.shape
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [N, nb, 32] in element order
    return pack_nibbles(q.reshape(n, nb * 32))


def from_gguf_q4_1(raw: torch.Tensor, n: int, k: int) -> QuantTensor:
    blocks = raw.reshape(n, k // 32, 20)
    d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(n, k // 32)
    m = blocks[..., 2:4].contiguous().view(torch.float16).reshape(n, k // 32)
    return QuantTensor("q4", _gguf_q4_nibbles(blocks[..., 4:]), d.clone(), m.clone(), 32)


def from_gguf_q4_0(raw: torch.Tensor, n: int, k: int) -> QuantTensor:
    blocks = raw.reshape(n, k // 32, 18)
    d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(n, k // 32).clone()
    # w = d * (q - 8) == d * q + (-8 d), exactly in float32 (fp16 d times a 4-bit int is exact).
    m = (-8.0 * d.float()).to(torch.float16)
    return QuantTensor("q4", _gguf_q4_nibbles(blocks[..., 2:]), d, m, 32)


def from_gguf_q8_0(raw: torch.Tensor, n: int, k: int) -> QuantTensor:
    blocks = raw.reshape(n, k // 32, 34)
    d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(n, k // 32).clone()
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
    return QuantTensor("q8", q, d, None, 32)
