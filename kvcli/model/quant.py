"""Quantized weight tensors in kvcli's canonical (lossless) layouts.

Group-wise affine low-bit codes (GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K):
    codes uint8 [N, K // 2]   the low 4 bits: element k = 2j in the low nibble of codes[n, j],
                              k = 2j + 1 in the high nibble
    hi    uint8 [N, K // 8]   "q5": bit 4 of element k in bit (k % 8) of hi[n, k // 8]
          uint8 [N, K // 4]   "q6": bits 4-5 of element k in bits 2 (k % 4).. of hi[n, k // 4]
    w[n, k] = scale[n, g] * (q[n, k] - offset) + min[n, g]      g = k // G   (min optional)
          or  scale[n, g] * (q[n, k] - zero[n, g])                 (AWQ / GPTQ / compressed-tensors:
                              a uint8 zero point per group; min = -(zero * scale) is exact in float32)
Symmetric INT8 (GGUF Q8_0):
    codes int8 [N, K]         w = scale * q
Scales are fp16 (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 store them so) or two-level like the K-quants: an fp16
`scale` (and `min`) per super-block of S elements times a 6/8-bit integer `sub_scale` (`sub_min`)
per group, multiplied out in float32 per call (d * sc is exact in float32: 11 x 8 bits), with
min = -(dmin * m). Keeping the file's two levels keeps the resident bytes those of the file.

Dequantization follows gguf-py's order of float32 operations, so kvcli's dense weights are
bit-identical to the ones transformers builds from the same file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BITS = {"q4": 4, "q5": 5, "q6": 6, "q8": 8}


@dataclass
class QuantTensor:
    kind: str  # "q4" / "q5" / "q6" (affine low-bit, nibbles + high-bit plane) or "q8" (int8)
    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    group_size: int = 32
    hi: torch.Tensor | None = None  # "q5" / "q6": the bits above the low nibble
    offset: int = 0  # subtracted from the unsigned code (Q5_0: 16, Q6_K: 32) before scaling
    sub_scale: torch.Tensor | None = None  # per-group integer multiplier of a per-super-block `scale`
    sub_min: torch.Tensor | None = None  # per-group integer multiplier of a per-super-block dmin (`min`)
    zero: torch.Tensor | None = None  # uint8 [N, K // G] code-space zero point (instead of `min`)

    @property
    def bits(self) -> int:
        return _BITS[self.kind]

    @property
    def shape(self) -> tuple[int, int]:
        n = self.codes.shape[0]
        k = self.codes.shape[1] * (1 if self.kind == "q8" else 2)
        return (n, k)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.min, self.hi, self.sub_scale, self.sub_min, self.zero)
                if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    @property
    def plain_groups(self) -> bool:
        """One float scale/min per group, no offset or zero point: the layout the Triton INT4 GEMM reads
        (fp16 from GGUF; float32 mins from with_float_min)."""
        floats = (torch.float16, torch.bfloat16, torch.float32)
        return (self.kind == "q4" and self.sub_scale is None and self.offset == 0 and self.zero is None
                and self.scale.dtype in floats and (self.min is None or self.min.dtype in floats))

    def with_float_min(self) -> "QuantTensor":
        """4-bit codes with one plain float scale and min per group, for kernels that read scale/min: zero
        points (AWQ / GPTQ), K-quants' two-level scales and mins (Q4_K) and a code offset multiplied
        out once into float32 (exact: an fp16 x 8-bit product, or a scale times a small integer)."""
        if self.kind != "q4" or (self.zero is None and self.sub_scale is None and self.sub_min is None
                                 and self.offset == 0):
            return self
        scale = self.group_scales()
        mins = self.group_mins()
        if self.offset:  # s (q - o) + m == s q + (m - s o)
            mins = (torch.zeros_like(scale) if mins is None else mins) - scale * self.offset
        return QuantTensor(self.kind, self.codes, scale, mins, self.group_size)

    def int8_codes(self) -> torch.Tensor:
        """5/6/8-bit codes minus their offset as int8 [N, K] (Q6_K: -32..31; Q8_0's as stored): the form the
        CPU int8dot kernel and the Triton GEMM read for these kinds."""
        q = self.unpack_codes()
        return q.view(torch.int8) if self.kind == "q8" else (q.to(torch.int16) - self.offset).to(torch.int8)

    def unpack_codes(self) -> torch.Tensor:
        """Integer codes as uint8 [N, K] (0 .. 2^bits - 1 before the offset; raw int8 for q8)."""
        if self.kind == "q8":
            return self.codes
        lo = torch.stack([self.codes & 0x0F, self.codes >> 4], dim=-1).reshape(self.shape)
        if self.kind == "q4":
            return lo
        n, k = self.shape
        assert self.hi is not None
        if self.kind == "q5":
            shifts = torch.arange(8, dtype=torch.uint8, device=self.hi.device)
            hi = ((self.hi.unsqueeze(-1) >> shifts) & 1).reshape(n, k)
        else:
            shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=self.hi.device)
            hi = ((self.hi.unsqueeze(-1) >> shifts) & 3).reshape(n, k)
        return lo | (hi << 4)

    def float_codes(self) -> torch.Tensor:
        """float32 [N, K] of q - offset, through byte lookup tables: one gather per packed plane
        instead of a chain of uint8 shifts (4x faster per call on CPU). Small integers: exact."""
        n, k = self.shape
        if self.kind == "q8":
            q = self.codes.to(torch.float32)
            return q - float(self.offset) if self.offset else q
        lo_table, hi_table = _code_tables(self.kind, self.offset, self.codes.device)
        q = torch.nn.functional.embedding(self.codes.to(torch.int32), lo_table).view(n, k)
        if hi_table is not None:
            assert self.hi is not None
            q = q + torch.nn.functional.embedding(self.hi.to(torch.int32), hi_table).view(n, k)
        return q

    def group_scales(self) -> torch.Tensor:
        """float32 [N, K // G]: the scale of each group (two-level scales multiplied out exactly)."""
        s = self.scale.to(torch.float32)
        if self.sub_scale is None:
            return s
        per = self.sub_scale.shape[1] // self.scale.shape[1]
        return s.repeat_interleave(per, dim=1) * self.sub_scale.to(torch.float32)

    def group_mins(self) -> torch.Tensor | None:
        """float32 [N, K // G] added after scaling, or None. K-quants: -(dmin * m), as gguf-py's `- dm`."""
        if self.zero is not None:
            return -(self.zero.to(torch.float32) * self.group_scales())
        if self.min is None:
            return None
        m = self.min.to(torch.float32)
        if self.sub_min is None:
            return m
        per = self.sub_min.shape[1] // self.min.shape[1]
        return -(m.repeat_interleave(per, dim=1) * self.sub_min.to(torch.float32))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        g = self.group_size
        q = self.float_codes().view(n, k // g, g)
        w = q * self.group_scales().unsqueeze(-1)
        mins = self.group_mins()
        if mins is not None:
            w = w + mins.unsqueeze(-1)
        return w.reshape(n, k).to(dtype)

    def _map(self, fn) -> "QuantTensor":
        def opt(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return QuantTensor(self.kind, fn(self.codes), fn(self.scale), opt(self.min), self.group_size,
                           opt(self.hi), self.offset, opt(self.sub_scale), opt(self.sub_min), opt(self.zero))

    def rows(self, index: torch.Tensor) -> "QuantTensor":
        """A row subset (used to un-permute q/k heads and to split fused tensors)."""
        return self._map(lambda t: t[index].contiguous())

    def to(self, device: torch.device | str) -> "QuantTensor":
        return self._map(lambda t: t.to(device))

    def layout(self) -> tuple:
        """What must agree for two tensors to be concatenated along N."""
        def dt(t: torch.Tensor | None) -> torch.dtype | None:
            return None if t is None else t.dtype

        return (self.kind, self.group_size, self.offset, self.codes.shape[1], dt(self.scale), dt(self.min),
                dt(self.sub_scale), dt(self.sub_min), None if self.sub_scale is None else self.scale.shape[1],
                dt(self.zero))

    @staticmethod
    def cat(parts: list["QuantTensor"]) -> "QuantTensor":
        """Concatenate along N (fused qkv, gate/up); all parts share K and the layout."""
        first = parts[0]
        if any(p.layout() != first.layout() for p in parts):
            raise ValueError("cannot fuse quantized tensors of different kinds")

        def cat_opt(name: str) -> torch.Tensor | None:
            ts = [getattr(p, name) for p in parts]
            return None if ts[0] is None else torch.cat(ts)

        return QuantTensor(first.kind, torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                           cat_opt("min"), first.group_size, cat_opt("hi"), first.offset,
                           cat_opt("sub_scale"), cat_opt("sub_min"), cat_opt("zero"))


_TABLES: dict[tuple[str, int, str], tuple[torch.Tensor, torch.Tensor | None]] = {}


def _code_tables(kind: str, offset: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Byte -> its codes' float values: [256, 2] for a nibble byte (low nibble first, minus the offset
    when there is no high plane), [256, 8 / (bits - 4)] for a high-plane byte (16 x high bits - offset)."""
    key = (kind, offset, str(device))
    if key not in _TABLES:
        b = torch.arange(256)
        lo = torch.stack([b & 0x0F, b >> 4], dim=-1).float()
        hi = None
        if kind == "q4":
            lo = lo - offset
        else:
            width = _BITS[kind] - 4
            mask = (1 << width) - 1
            hi = torch.stack([(b >> s) & mask for s in range(0, 8, width)], dim=-1).float() * 16 - offset
        _TABLES[key] = (lo.to(device), None if hi is None else hi.to(device))
    return _TABLES[key]


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in 0..15 -> canonical packed [N, K // 2]."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


Q4_GROUP = 32  # quantize_q4's default group: kvcli's int4 of a dense folder (one scale and min per 32 weights)


def quantize_q4(w: torch.Tensor, group_size: int = Q4_GROUP) -> QuantTensor:
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


def quantize_q8(w: torch.Tensor, group_size: int = 32) -> QuantTensor:
    """Symmetric group-wise INT8 (Q8_0 style: d = max |w| / 127 per group in fp16, codes round(w / d)) of a
    dense [N, K] weight: the vocabulary table of a folder quantized with --quant int4, as llama.cpp's Q4 files
    keep theirs in 8 bits."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    d = (g.abs().amax(-1) / 127).to(torch.float16)
    inv = torch.where(d == 0, torch.zeros_like(d, dtype=torch.float32), 1.0 / d.float())
    q = torch.round(g * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return QuantTensor("q8", q.reshape(n, k).contiguous(), d, None, group_size)


def random_q4(n: int, k: int, std: float, generator: torch.Generator, group_size: int = 32) -> QuantTensor:
    """Random INT4 weights with roughly `std` spread, for dummy models (no weights to download), on the
    generator's device."""
    dev = generator.device
    raw = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator, device=dev)
    # Uniform codes in 0..15 have std ~4.6, centred on 7.5.
    scale = torch.full((n, k // group_size), std / 4.6, dtype=torch.float16, device=dev)
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
